// Serving many sequences with a model's set of caches (docs/design.md 10, SPEC 13), where the
// set matters: fork and checkpoint / rollback of a model's layers sharing a coordinator, sets
// loaded from a prompt cache, the errors, and the memory a copy holds at a real head size. (That
// one cache of every policy, storage type and width continues bit-identically after a fork or a
// rollback: the contract suite, test_contract.cpp.)

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

template <class T>
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

/// A model of four layers, the third without attention (a standard cache), SqueezeAttention
/// deferring to its coordinator, calibrating on 12 tokens.
vc::KVCacheConfig model_config() {
  vc::KVCacheConfig c = small_config();
  c.method = "squeeze";
  c.squeeze_budget = 10;
  c.squeeze_calibration_tokens = 12;
  c.squeeze_defer = true;
  return c;
}
const std::vector<std::optional<int>>& model_dims() {
  static const std::vector<std::optional<int>> dims = {16, 16, std::nullopt, 16};
  return dims;
}

/// The same attend call on every layer of `set` (a decode step or a prompt chunk of S tokens);
/// returns the outputs' bytes, layer after layer.
template <class T>
std::vector<unsigned char> step(Caches<T>& set, unsigned seed, Index S) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> out;
  for (auto& c : set) {
    const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 2, S, 16);
    const vc::Tensor4<T> v = random_tensor<T>(rng, 1, 2, S, 16);
    const vc::Tensor4<float> q = random_queries(rng, 1, 4, S, 16);
    const std::vector<unsigned char> b = bytes_of(c->attend(q, k, v));
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

/// A fork of a model's set made mid-calibration (some layers reported, none adopted) and one
/// made after adoption: the copy's squeeze layers share one coordinator, a new one; the
/// standard layer stays standard; the source, its fork and a set that never forked then give
/// bitwise the same outputs and states through prompt chunks and decode steps, the copy's calls
/// never changing the source (its state is compared before and after them).
TEST(ForkTest, AModelsSetForksWithOneNewCoordinatorAndContinuesLikeASetThatNeverForked) {
  using T = Eigen::half;
  for (const int forked_after : {1, 3}) {
    const std::string ctx = "forked after " + std::to_string(forked_after) + " steps";
    Caches<T> source = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
    Caches<T> twin = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
    // 8 tokens (no layer calibrated), 1 token for layer 0 only... then 6 and decode steps.
    const std::vector<Index> sizes = {8, 6, 1, 1, 5, 1, 1};
    std::size_t i = 0;
    for (; i < static_cast<std::size_t>(forked_after); ++i) {
      ASSERT_EQ(step(source, 10u + static_cast<unsigned>(i), sizes[i]),
                step(twin, 10u + static_cast<unsigned>(i), sizes[i]));
    }
    Caches<T> copy = vc::KVCacheBuilder::fork(source);
    ASSERT_EQ(copy.size(), source.size());
    std::shared_ptr<vc::SqueezeCoordinator> shared;
    for (std::size_t l = 0; l < copy.size(); ++l) {
      const vc::KVCache<T>& made = *copy[l];
      const vc::KVCache<T>& from = *source[l];
      EXPECT_EQ(typeid(made), typeid(from)) << ctx << ", layer " << l;
      const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(copy[l].get());
      if (!sq) continue;
      const auto* src = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(source[l].get());
      ASSERT_TRUE(sq->coordinator());
      EXPECT_NE(sq->coordinator(), src->coordinator()) << ctx;
      if (!shared) shared = sq->coordinator();
      EXPECT_EQ(sq->coordinator(), shared) << ctx << ": the copy's layers share one coordinator";
      EXPECT_EQ(sq->layer_id(), src->layer_id());
    }
    EXPECT_TRUE(model_state(copy) == model_state(source)) << ctx;
    for (; i < sizes.size(); ++i) {
      const auto seed = 10u + static_cast<unsigned>(i);
      const std::vector<unsigned char> want = step(twin, seed, sizes[i]);
      const std::vector<Snapshot> before = model_state(source);
      EXPECT_EQ(step(copy, seed, sizes[i]), want) << ctx << ", step " << i << ": the copy";
      EXPECT_TRUE(model_state(source) == before)
          << ctx << ", step " << i << ": the copy's call changed the source";
      EXPECT_EQ(step(source, seed, sizes[i]), want) << ctx << ", step " << i << ": the source";
      EXPECT_TRUE(model_state(copy) == model_state(twin)) << ctx << ", step " << i;
      EXPECT_TRUE(model_state(source) == model_state(twin)) << ctx << ", step " << i;
    }
    // Not vacuous: the layers adopted budgets of their own and evicted.
    const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(copy[0].get());
    EXPECT_TRUE(sq->budget_adopted()) << ctx;
    EXPECT_LT(copy[0]->tokens_kept(), copy[0]->offset()) << ctx;
  }
}

/// A set loaded from a prompt cache forks and rolls back: after a checkpoint, a draft and a
/// rollback, it and its fork continue as the set it was saved from does.
TEST(ForkTest, ALoadedPromptCacheForksAndRollsBack) {
  using T = float;
  Caches<T> source = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  (void)step(source, 1u, 14);
  std::stringstream file;
  vc::save_prompt_cache(file, source);
  vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
  vc::KVCacheBuilder::checkpoint(loaded.caches);
  (void)step(loaded.caches, 99u, 4);
  vc::KVCacheBuilder::rollback(loaded.caches);
  EXPECT_TRUE(model_state(loaded.caches) == model_state(source));
  Caches<T> copy = vc::KVCacheBuilder::fork(loaded.caches);
  for (unsigned s = 2; s < 6; ++s) {
    const std::vector<unsigned char> want = step(source, s, 1);
    EXPECT_EQ(step(loaded.caches, s, 1), want) << "step " << s;
    EXPECT_EQ(step(copy, s, 1), want) << "step " << s;
  }
  EXPECT_TRUE(model_state(copy) == model_state(source));
}

/// At a real head size (D = 128, half, 8 heads of 300 rows), the copy holds its rows and little
/// more: at most 1.1x its kept bytes plus 4 KiB per cache (SPEC 13.1), though its source holds
/// room for growth.
TEST(ForkTest, ACopyHoldsItsKeptBytesAndLittleMore) {
  using T = Eigen::half;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 300;
  Caches<T> source = vc::KVCacheBuilder::for_model<T>(2, c);
  std::mt19937 rng(4u);
  for (const Index S : {Index{700}, Index{1}, Index{1}, Index{3}}) {
    for (auto& layer : source) {
      (void)layer->update_and_view(random_tensor<T>(rng, 1, 8, S, 128),
                                   random_tensor<T>(rng, 1, 8, S, 128));
    }
  }
  const Caches<T> copy = vc::KVCacheBuilder::fork(source);
  for (std::size_t l = 0; l < copy.size(); ++l) {
    const std::size_t kept = copy[l]->kept_bytes();
    EXPECT_EQ(kept, source[l]->kept_bytes());
    EXPECT_EQ(kept, std::size_t{8} * 300 * 2 * 128 * sizeof(T));
    EXPECT_LE(copy[l]->heap_bytes(), kept + kept / 10 + 4096) << "layer " << l;
    EXPECT_LT(copy[l]->heap_bytes(), source[l]->heap_bytes()) << "layer " << l;
  }
}

/// A fork of quantized rows holds exactly its rows; a trim then frees slots, and the next call
/// refills one without growing: it needs the row it quantizes through, which the fork must have
/// allocated (it did not: a null write, found by the fuzz target `pool`, whose pool cuts free
/// slots the same way). The copy then goes on as its source does.
TEST(ForkTest, AQuantizedCopyRefillsASlotFreedBeforeItGrows) {
  using T = Eigen::half;
  vc::KVCacheConfig c;
  c.method = "standard";
  c.key_bits = c.value_bits = 8;
  c.quant_group = 8;
  Caches<T> source = vc::KVCacheBuilder::for_model<T>(1, c);
  std::mt19937 rng(6u);
  (void)source[0]->update_and_view(random_tensor<T>(rng, 1, 3, 11, 8),
                                   random_tensor<T>(rng, 1, 3, 11, 8));
  Caches<T> copy = vc::KVCacheBuilder::fork(source);
  const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 3, 1, 8);
  const vc::Tensor4<T> v = random_tensor<T>(rng, 1, 3, 1, 8);
  for (Caches<T>* set : {&source, &copy}) {
    EXPECT_EQ((*set)[0]->trim(3), 3);
    (void)(*set)[0]->update_and_view(k, v);
  }
  EXPECT_EQ(bytes_of(copy[0]->state().first), bytes_of(source[0]->state().first));
  EXPECT_EQ(bytes_of(copy[0]->state().second), bytes_of(source[0]->state().second));
  EXPECT_EQ(copy[0]->positions(0, 2), source[0]->positions(0, 2));
}

/// Speculative decoding on a model's set: a checkpoint mid-calibration, a draft of 6 tokens that
/// completes it (the coordinator finalizes, the layers adopt and evict), a rollback, and the 2
/// accepted tokens in one call: bitwise what a set that only made that call gives, coordinator
/// included; then the same again in the decode phase with k = 1..4, each time a new checkpoint.
TEST(RollbackTest, SpeculativeStepsOnAModelsSetEqualASetThatOnlyTookTheAcceptedTokens) {
  using T = Eigen::half;
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  Caches<T> twin = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  ASSERT_EQ(step(set, 1u, 8), step(twin, 1u, 8));
  unsigned seed = 100;
  for (const Index k : {6, 1, 2, 3, 4}) {
    const std::string ctx = "a draft of " + std::to_string(k);
    vc::KVCacheBuilder::checkpoint(set);
    const std::vector<Snapshot> at = model_state(set);
    (void)step(set, seed++, k);  // the draft, verified in one call
    EXPECT_FALSE(model_state(set) == at) << ctx << ": the draft changed nothing";
    vc::KVCacheBuilder::rollback(set);
    EXPECT_TRUE(model_state(set) == at) << ctx << ": not the checkpoint's state";
    const Index accepted = k > 1 ? 2 : 1;
    EXPECT_EQ(step(set, seed, accepted), step(twin, seed, accepted)) << ctx;
    EXPECT_TRUE(model_state(set) == model_state(twin)) << ctx;
    ++seed;
  }
  const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(set[0].get());
  EXPECT_TRUE(sq->budget_adopted());
  EXPECT_LT(set[0]->tokens_kept(), set[0]->offset());
}

/// Rollback refuses, naming what is missing and changing nothing, without a checkpoint, twice,
/// after a reset (the builder's or one cache's), on a fork (a fork has no checkpoint); a new
/// checkpoint replaces the live one.
TEST(RollbackTest, WithoutALiveCheckpointOfTheSetItIsRefusedAndChangesNothing) {
  using T = float;
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  (void)step(set, 1u, 13);
  const auto refused = [&](Caches<T>& s, const std::string& what) {
    const std::vector<Snapshot> before = model_state(s);
    try {
      vc::KVCacheBuilder::rollback(s);
      ADD_FAILURE() << what << ": not refused";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("holds no live checkpoint"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(model_state(s) == before) << what;
  };
  refused(set, "none taken");
  vc::KVCacheBuilder::checkpoint(set);
  Caches<T> copy = vc::KVCacheBuilder::fork(set);
  refused(copy, "a fork");
  (void)step(set, 2u, 1);
  vc::KVCacheBuilder::checkpoint(set);  // replaces the first
  const std::vector<Snapshot> second = model_state(set);
  (void)step(set, 3u, 1);
  vc::KVCacheBuilder::rollback(set);
  EXPECT_TRUE(model_state(set) == second);
  refused(set, "consumed");
  vc::KVCacheBuilder::checkpoint(set);
  set[1]->reset();
  refused(set, "one cache reset");
  vc::KVCacheBuilder::checkpoint(set);
  vc::KVCacheBuilder::reset(set);
  refused(set, "the builder's reset");
  Caches<T> with_null = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  with_null.push_back(nullptr);
  EXPECT_THROW(vc::KVCacheBuilder::checkpoint(with_null), std::invalid_argument);
  EXPECT_THROW(vc::KVCacheBuilder::rollback(with_null), std::invalid_argument);
}

/// A checkpoint costs what the calls after it overwrite, not what they bring: after a 1500-token
/// chunk under a checkpoint, an H2O layer of budget 64 holds at most the checkpoint's rows (its 64
/// live rows and their bookkeeping) more heap than a twin that made the same chunk without one.
TEST(RollbackTest, ALongChunkUnderACheckpointJournalsAtMostTheRowsItHeld) {
  using T = float;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 64;
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(1, c);
  Caches<T> twin = vc::KVCacheBuilder::for_model<T>(1, c);
  const Index D = 16, H = 2;
  std::mt19937 rng(8u);
  const auto feed = [&](Caches<T>& s, unsigned seed, Index S) {
    std::mt19937 r(seed);
    (void)s.front()->update_and_view(random_tensor<T>(r, 1, H, S, D),
                                     random_tensor<T>(r, 1, H, S, D));
  };
  for (unsigned i = 0; i < 3; ++i) {
    feed(set, i, 100);
    feed(twin, i, 100);
  }
  vc::KVCacheBuilder::checkpoint(set);
  feed(set, 50u, 1500);
  feed(twin, 50u, 1500);
  const std::size_t row = 2 * static_cast<std::size_t>(D) * sizeof(T);  // K and V of one row
  const std::size_t held = 64 * static_cast<std::size_t>(H);            // rows at the checkpoint
  EXPECT_LE(set.front()->heap_bytes(), twin.front()->heap_bytes() + held * (row + 64) + 4096);
  vc::KVCacheBuilder::rollback(set);
}

/// While a checkpoint is live, a head whose rows fell far below the checkpoint's (a standard
/// cache trimmed from 300 rows to 20) keeps its buffers from call to call instead of reallocating
/// at every one: the view's rows stay where they were.
TEST(RollbackTest, AHeadHeldAboveItsRowsByACheckpointDoesNotReallocateAtEveryCall) {
  using T = float;
  vc::KVCacheConfig c;
  c.method = "standard";
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(1, c);
  std::mt19937 rng(9u);
  const auto call = [&](Index S) {
    return set.front()->update_and_view(random_tensor<T>(rng, 1, 1, S, 8),
                                        random_tensor<T>(rng, 1, 1, S, 8));
  };
  (void)call(300);
  vc::KVCacheBuilder::checkpoint(set);
  EXPECT_EQ(set.front()->trim(280), 280);
  (void)call(1);
  const T* keys = call(1).keys(0, 0).data();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(call(1).keys(0, 0).data(), keys) << "call " << i << " reallocated";
  }
  vc::KVCacheBuilder::rollback(set);
  EXPECT_EQ(set.front()->offset(), 300);
}

/// An engine's own subclass of a cache (the library cannot build one of its class).
class EngineCache : public vc::KVCache<float> {
 public:
  using KVCache::KVCache;
};

/// A fork of no caches is no caches; a null entry or a cache of a class the library does not
/// build is refused naming it, and the source is unchanged.
TEST(ForkTest, BadSetsAreRefusedNamingTheCache) {
  using T = float;
  EXPECT_TRUE(vc::KVCacheBuilder::fork(Caches<T>{}).empty());
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  (void)step(set, 3u, 9);
  const std::vector<Snapshot> before = model_state(set);
  set.push_back(nullptr);
  std::string msg = invalid_argument_message([&] { (void)vc::KVCacheBuilder::fork(set); });
  EXPECT_NE(msg.find("KVCacheBuilder::fork: cache 4 is null"), std::string::npos) << msg;
  set.back() = std::make_unique<EngineCache>();
  msg = invalid_argument_message([&] { (void)vc::KVCacheBuilder::fork(set); });
  EXPECT_NE(msg.find("cache 4 is of a class the library does not build"), std::string::npos) << msg;
  set.pop_back();
  EXPECT_TRUE(model_state(set) == before);
}

/// The set's operations each cache exposes for the builder are safe one cache at a time: a
/// rollback without a checkpoint changes nothing (after one was consumed, too), and fork_from
/// refuses a source of another method, naming both, changing neither.
TEST(ForkTest, OneCachesSetOperationsAreSafeAlone) {
  using T = float;
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config());
  (void)step(set, 5u, 9);
  const std::vector<Snapshot> before = model_state(set);
  for (auto& c : set) c->roll_back();
  EXPECT_TRUE(model_state(set) == before);
  vc::KVCacheBuilder::checkpoint(set);
  (void)step(set, 6u, 3);
  vc::KVCacheBuilder::rollback(set);
  for (auto& c : set) c->roll_back();  // the checkpoint was consumed
  EXPECT_TRUE(model_state(set) == before);

  vc::KVCacheConfig h2o = small_config();
  h2o.method = "h2o";
  Caches<T> other;
  other.push_back(vc::KVCacheFactory::create<T>(h2o));
  const std::vector<Snapshot> fresh = model_state(other);
  vc::detail::StateLinks links;
  const std::string msg =
      invalid_argument_message([&] { other.front()->fork_from(*set.front(), links); });
  EXPECT_NE(msg.find("fork_from: the source's method 'squeeze' is not this cache's 'h2o'"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(model_state(other) == fresh);
  EXPECT_TRUE(model_state(set) == before);
}

}  // namespace
