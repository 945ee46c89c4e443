// Prompt caches on disk (docs/design.md G): save_prompt_cache / load_prompt_cache beyond the
// contract suite's per-policy round trip (test_contract.cpp):
//  * a whole model (the builder's: squeeze layers sharing one coordinator, standard caches for
//    layers without attention) saved at any step, mid-calibration and deferring included, and
//    loaded continues bitwise as the model never saved; reset() after a load starts afresh;
//  * every storage width, every config field, any metadata bytes round-trip; saving leaves the
//    cache and a view of it untouched;
//  * files: atomic replacement, names in messages, trailing data, failing streams;
//  * every truncation and every corrupted byte of a file is refused; newer versions and other
//    storage types are named; crafted files (fields changed and the checksums sealed again by an
//    independent reader of the documented format, support/prompt_cache_format.hpp) are refused
//    with the problem named; huge counts allocate nothing the file does not hold;
//  * the CRC-32C kernel alone (its check value; both paths, every length and alignment).

#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/prompt_cache_format.hpp"
#include "support/simd_levels.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

// The heap a load holds at its peak, and its largest single allocation
// (HugeCountsAllocateNothingTheFileDoesNotHold, ...): every operator new and delete of this test
// program goes through here while g_track is set (one thread).
namespace {
std::atomic<bool> g_track{false};
std::size_t g_largest = 0;
long long g_live = 0, g_peak = 0;
void* counted_new(std::size_t n) {
  void* p = std::malloc(n ? n : 1);
  if (p == nullptr) throw std::bad_alloc();
  if (g_track.load(std::memory_order_relaxed)) {
    g_largest = std::max(g_largest, n);
    g_live += static_cast<long long>(malloc_usable_size(p));
    g_peak = std::max(g_peak, g_live);
  }
  return p;
}
void counted_delete(void* p) noexcept {
  if (p != nullptr && g_track.load(std::memory_order_relaxed)) {
    g_live -= static_cast<long long>(malloc_usable_size(p));
  }
  std::free(p);
}
/// Runs f with the counters on; returns the peak heap (bytes above what was live before).
template <class F>
long long peak_heap_of(F f) {
  g_largest = 0;
  g_live = g_peak = 0;
  g_track = true;
  try {
    f();
  } catch (...) {
    g_track = false;
    throw;
  }
  g_track = false;
  return g_peak;
}
}  // namespace
void* operator new(std::size_t n) { return counted_new(n); }
void* operator new[](std::size_t n) { return counted_new(n); }
void operator delete(void* p) noexcept { counted_delete(p); }
void operator delete[](void* p) noexcept { counted_delete(p); }
void operator delete(void* p, std::size_t) noexcept { counted_delete(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_delete(p); }

namespace {

namespace vc = veloxquant::cache;
namespace fmt = veloxquant::test::format;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

template <class T>
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

vc::KVCacheConfig standard_config() {
  vc::KVCacheConfig c;
  c.method = "standard";
  return c;
}

template <class T>
std::string save_to_string(const Caches<T>& caches,
                           const std::map<std::string, std::string>& meta = {}) {
  std::ostringstream out;
  vc::save_prompt_cache(out, caches, meta);
  return out.str();
}
template <class T>
vc::PromptCache<T> load_from_string(const std::string& bytes) {
  std::istringstream in(bytes);
  return vc::load_prompt_cache<T>(in);
}
/// The message of the std::runtime_error loading `bytes` raises ("" and a failure if none).
template <class T>
std::string load_error(const std::string& bytes) {
  try {
    (void)load_from_string<T>(bytes);
  } catch (const std::runtime_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than std::runtime_error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "the file was accepted";
  return "";
}

// ---------------------------------------------------------------------------------------------
// A model: the builder's caches, driven like an engine (each layer one call per step)
// ---------------------------------------------------------------------------------------------

/// Head dims of the test model: three attention layers around one without attention.
const std::vector<std::optional<int>>& model_dims() {
  static const std::vector<std::optional<int>> dims = {16, std::nullopt, 16, 16};
  return dims;
}

vc::KVCacheConfig model_config(bool defer) {
  vc::KVCacheConfig c;
  c.set_budget(10);
  c.squeeze_n_sink = 2;
  c.squeeze_calibration_tokens = 12;
  c.squeeze_defer = defer;
  return c;
}

/// One engine step's calls: per layer, S tokens (keys [2, 2, S, 16], values [2, 2, S, 8]) with
/// queries (G = 2) on even steps, through a rotating API.
struct Step {
  std::vector<Call> calls;
  int api = 0;
};
Step random_step(std::mt19937& rng, Index S, int api) {
  Step st;
  st.api = api;
  for (std::size_t l = 0; l < model_dims().size(); ++l) {
    st.calls.push_back(random_call(rng, {2, 2, S, 16}, {2, 2, S, 8}));
  }
  return st;
}

/// The step on every layer of `caches`; returns what each call gave back.
template <class T>
std::vector<std::vector<unsigned char>> run_step(Caches<T>& caches, const Step& st) {
  std::vector<std::vector<unsigned char>> out;
  for (std::size_t l = 0; l < caches.size(); ++l) {
    const Call& c = st.calls[l];
    vc::KVCache<T>& cache = *caches[l];
    const vc::Tensor4<float> q = converted<float>(c.queries);
    switch (st.api % 4) {
      case 0:
        out.push_back(bytes_of(cache.attend(q, c.keys, c.values)));
        break;
      case 1: {
        const vc::KVPair<T> r = cache.update_and_fetch(c.keys, c.values);
        out.push_back(bytes_of(r.first));
        break;
      }
      case 2: {
        const vc::KVPair<T> r = cache.update_and_fetch(c.keys, c.values, q);
        out.push_back(bytes_of(r.second));
        break;
      }
      default: {
        vc::KVPair<T> r;
        cache.update_and_fetch_into(c.keys, c.values, r);
        out.push_back(bytes_of(r.first));
        break;
      }
    }
  }
  return out;
}

template <class T>
class PromptCacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(PromptCacheTest, StorageTypes);

/// The builder's model saved after any step (before its first call, mid-calibration with the
/// concentration sums in flight, at the step that completes the coordinator's reports, in the
/// decode) and loaded continues bitwise as the model never saved; the loaded set is one
/// coordinator shared by the squeeze layers and a standard cache for the layer without attention.
TYPED_TEST(PromptCacheTest, AModelSavedAtAnyStepContinuesBitIdentically) {
  using T = TypeParam;
  // Steps: a 5-token prompt chunk, then one token per step (calibration needs 12 tokens).
  std::vector<Index> sizes = {5, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  for (const bool defer : {false, true}) {
    for (const std::size_t at : {std::size_t{0}, std::size_t{1}, std::size_t{4}, std::size_t{7},
                                 std::size_t{8}, std::size_t{9}, std::size_t{15}, sizes.size()}) {
      const std::string ctx = std::string(defer ? "deferring" : "squeeze") +
                              ", saved before step " + std::to_string(at);
      Caches<T> twin = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config(defer));
      Caches<T> model = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config(defer));
      std::mt19937 rng(41u);
      for (std::size_t i = 0; i <= sizes.size(); ++i) {
        if (i == at) {
          const std::string bytes = save_to_string(model, {{"step", std::to_string(i)}});
          vc::PromptCache<T> loaded = load_from_string<T>(bytes);
          ASSERT_EQ(loaded.caches.size(), model.size()) << ctx;
          EXPECT_EQ(loaded.metadata,
                    (std::map<std::string, std::string>{{"step", std::to_string(i)}}));
          EXPECT_EQ(save_to_string(loaded.caches, loaded.metadata), bytes) << ctx;
          // The structure: a standard cache (exactly KVCache<T>) for layer 1, squeeze layers 0,
          // 2 and 3 on one new coordinator of 3 layers.
          EXPECT_TRUE(typeid(*loaded.caches[1]) == typeid(vc::KVCache<T>)) << ctx;
          EXPECT_EQ(loaded.caches[1]->config().method, "standard");
          std::shared_ptr<vc::SqueezeCoordinator> shared;
          for (const int l : {0, 2, 3}) {
            const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(
                loaded.caches[static_cast<std::size_t>(l)].get());
            ASSERT_NE(sq, nullptr) << ctx;
            EXPECT_EQ(sq->layer_id(), std::optional<int>(l));
            if (!shared) shared = sq->coordinator();
            EXPECT_EQ(sq->coordinator(), shared) << ctx << ": layer " << l;
          }
          ASSERT_NE(shared, nullptr);
          EXPECT_EQ(shared->n_layers(), 3);
          EXPECT_NE(shared,
                    dynamic_cast<const vc::SqueezeAttentionCache<T>&>(*model[0]).coordinator());
          model = std::move(loaded.caches);
          EXPECT_TRUE(model_state(model) == model_state(twin)) << ctx << ": state after loading";
        }
        if (i == sizes.size()) break;
        const Step st = random_step(rng, sizes[i], static_cast<int>(i));
        EXPECT_EQ(run_step(model, st), run_step(twin, st)) << ctx << ", step " << i;
        EXPECT_TRUE(model_state(model) == model_state(twin)) << ctx << ", step " << i;
      }
      // The coordinator published (every layer calibrated) and every layer adopted, in both.
      const auto& sq = dynamic_cast<const vc::SqueezeAttentionCache<T>&>(*model[0]);
      EXPECT_TRUE(sq.coordinator()->is_finalized()) << ctx;
      EXPECT_TRUE(sq.budget_adopted()) << ctx;
    }
  }
}

/// KVCacheBuilder::reset on a loaded model starts a fresh sequence: the same calls then give what
/// a new model gives (the coordinator is one generation ahead, nothing else differs).
TYPED_TEST(PromptCacheTest, ResetAfterALoadStartsAFreshSequence) {
  using T = TypeParam;
  Caches<T> model = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config(false));
  std::mt19937 rng(5u);
  for (const Index S : {Index{14}, Index{1}, Index{1}})
    (void)run_step(model, random_step(rng, S, 1));
  vc::PromptCache<T> loaded = load_from_string<T>(save_to_string(model));
  vc::KVCacheBuilder::reset(loaded.caches);
  Caches<T> fresh = vc::KVCacheBuilder::for_model<T>(model_dims(), model_config(false));
  const std::uint64_t generation_before =
      dynamic_cast<const vc::SqueezeAttentionCache<T>&>(*model[0]).coordinator()->generation();
  for (const Index S : {Index{13}, Index{1}, Index{2}, Index{1}}) {
    const Step st = random_step(rng, S, 0);
    EXPECT_EQ(run_step(loaded.caches, st), run_step(fresh, st));
    std::vector<Snapshot> a = model_state(loaded.caches);
    const std::vector<Snapshot> b = model_state(fresh);
    for (std::size_t l = 0; l < a.size(); ++l) {
      if (a[l].generation != 0) {
        EXPECT_EQ(a[l].generation, generation_before + 1);
        a[l].generation = b[l].generation;
      }
    }
    EXPECT_TRUE(a == b) << "S = " << S;
  }
}

/// SqueezeCoordinator is public: a coordinator with fewer sinks than its layers may publish a
/// budget below a layer's sinks, which then holds its sinks (max(budget, sinks) rows). Such a set
/// saves, loads and goes on bitwise.
TYPED_TEST(PromptCacheTest, ABudgetBelowTheLayersSinksRoundTrips) {
  using T = TypeParam;
  vc::KVCacheConfig c;
  c.squeeze_budget = 16;
  c.squeeze_n_sink = 4;
  c.squeeze_calibration_tokens = 4;
  const auto make = [&] {
    auto co = std::make_shared<vc::SqueezeCoordinator>(2, 6, 0, 1.0);
    Caches<T> set;
    set.push_back(std::make_unique<vc::SqueezeAttentionCache<T>>(c, 0, co));
    set.push_back(std::make_unique<vc::SqueezeAttentionCache<T>>(c, 1, co));
    return set;
  };
  Caches<T> twin = make(), model = make();
  std::mt19937 rng(2u);
  const auto step = [&](Index S) {
    Call c0 = random_call(rng, {1, 2, S, 8}, {1, 2, S, 8});
    for (Index i = 0; i < c0.keys.size(); ++i) c0.keys.data()[i] = 1.0 + static_cast<double>(i % 8);
    const Call c1 = random_call(rng, {1, 2, S, 8}, {1, 2, S, 8});
    for (Caches<T>* set : {&twin, &model}) {
      (void)(*set)[0]->update_and_fetch(c0.keys, c0.values);  // parallel keys: concentration 1
      (void)(*set)[1]->update_and_fetch(c1.keys, c1.values);
    }
  };
  step(10);
  step(1);
  ASSERT_EQ(model[0]->layer_budget(), 1);
  ASSERT_EQ(model[0]->tokens_kept(), 4);  // its four sinks
  vc::PromptCache<T> loaded = load_from_string<T>(save_to_string(model));
  model = std::move(loaded.caches);
  for (int i = 0; i < 4; ++i) {
    const Call c0 = random_call(rng, {1, 2, 1, 8}, {1, 2, 1, 8});
    for (std::size_t l = 0; l < 2; ++l) {
      EXPECT_EQ(bytes_of(model[l]->update_and_fetch(c0.keys, c0.values).first),
                bytes_of(twin[l]->update_and_fetch(c0.keys, c0.values).first));
    }
    EXPECT_TRUE(model_state(model) == model_state(twin)) << "step " << i;
  }
}

/// A standard cache trimmed to no rows keeps its dims: saved without head sections, loaded with
/// no head objects (docs/design.md G), it answers as its twin (accessors, out-of-range heads, an
/// empty call, a call of another shape refused) and goes on as it.
TYPED_TEST(PromptCacheTest, ATrimmedEmptyStandardCacheRoundTrips) {
  using T = TypeParam;
  std::mt19937 rng(6u);
  vc::KVCacheConfig standard = small_config();
  standard.method = "standard";
  Caches<T> twin, model;
  for (Caches<T>* set : {&twin, &model}) set->push_back(vc::KVCacheFactory::create<T>(standard));
  const Call first = random_call(rng, {2, 3, 5, 4}, {2, 3, 5, 6});
  for (Caches<T>* set : {&twin, &model}) {
    (void)set->front()->update_and_fetch(first.keys, first.values);
    ASSERT_EQ(set->front()->trim(5), 5);
  }
  vc::PromptCache<T> loaded = load_from_string<T>(save_to_string(model));
  model = std::move(loaded.caches);
  vc::KVCache<T>& a = *model.front();
  vc::KVCache<T>& b = *twin.front();
  EXPECT_EQ(a.batch(), 2);
  EXPECT_EQ(a.heads(), 3);
  EXPECT_EQ(a.key_dim(), 4);
  EXPECT_EQ(a.value_dim(), 6);
  EXPECT_EQ(a.tokens_seen(), b.tokens_seen());
  EXPECT_TRUE(a.positions(1, 2).empty());
  EXPECT_THROW((void)a.positions(2, 0), std::out_of_range);
  EXPECT_THROW((void)b.positions(2, 0), std::out_of_range);
  EXPECT_THROW((void)a.scores(0, 3), std::out_of_range);
  EXPECT_EQ(bytes_of(a.state().first), bytes_of(b.state().first));
  const vc::Tensor4<T> k0(2, 3, 0, 4), v0(2, 3, 0, 6);
  EXPECT_TRUE(from_view(a.update_and_view(k0, v0)) == from_view(b.update_and_view(k0, v0)));
  const Call other = random_call(rng, {2, 2, 1, 4}, {2, 2, 1, 6});
  EXPECT_THROW((void)a.update_and_fetch(other.keys, other.values), std::invalid_argument);
  for (const Index S : {Index{4}, Index{1}}) {
    const Call c = random_call(rng, {2, 3, S, 4}, {2, 3, S, 6});
    vc::KVPair<T> ra, rb;
    EXPECT_TRUE(invoke(a, Api::kFetchQ, c, ra) == invoke(b, Api::kFetchQ, c, rb));
    EXPECT_TRUE(model_state(model) == model_state(twin));
  }
}

/// Every storage width (keys and values apart) and every policy: saved after a prefill and a few
/// decode steps (holes left by evictions included), loaded, continued bitwise.
TYPED_TEST(PromptCacheTest, EveryWidthAndPolicyContinuesBitIdentically) {
  using T = TypeParam;
  for (const auto& [kb, vb] :
       {std::pair{8, 8}, std::pair{4, 4}, std::pair{16, 4}, std::pair{4, 16}}) {
    vc::KVCacheConfig storage = small_config();
    storage.key_bits = kb;
    storage.value_bits = vb;
    for (const Kind kind : kKinds) {
      const std::string ctx =
          std::string(kind_name(kind)) + " " + std::to_string(kb) + "/" + std::to_string(vb);
      Subject<T> twin = make_subject<T>(kind, storage), subject = make_subject<T>(kind, storage);
      std::mt19937 rng(77u);
      const Shape k{2, 2, 0, 16}, v{2, 2, 0, 24};
      for (int i = 0; i < 12; ++i) {
        if (i == 6) {
          Caches<T> set;
          set.push_back(std::move(subject.cache));
          const std::string bytes = save_to_string(set);
          vc::PromptCache<T> loaded = load_from_string<T>(bytes);
          EXPECT_EQ(save_to_string(loaded.caches), bytes) << ctx;
          subject.cache = std::move(loaded.caches.front());
          if (auto* sq = dynamic_cast<vc::SqueezeAttentionCache<T>*>(subject.cache.get())) {
            subject.coordinator = sq->coordinator();
          }
        }
        const Call call = random_call(rng, with_s(k, i == 0 ? 9 : 1), with_s(v, i == 0 ? 9 : 1));
        const Api api = i % 2 ? Api::kFetchQ : Api::kView;
        vc::KVPair<T> a, b;
        EXPECT_TRUE(invoke(*subject.cache, api, call, a) == invoke(*twin.cache, api, call, b))
            << ctx << ", call " << i;
        EXPECT_TRUE(logical_state(subject) == logical_state(twin)) << ctx << ", call " << i;
      }
    }
  }
}

/// Saving reads the cache and nothing else: a view taken before (whose window still has the
/// holes of the call's evictions) shows the same rows after, and the cache goes on as its twin.
TYPED_TEST(PromptCacheTest, SavingLeavesTheCacheAndItsViewUntouched) {
  using T = TypeParam;
  for (const Kind kind : {Kind(Method::h2o), Kind::kSqueezeCoordinated, Kind(Method::tova),
                          Kind(Method::streaming_llm)}) {
    Subject<T> twin = make_subject<T>(kind), subject = make_subject<T>(kind);
    std::mt19937 rng(3u);
    vc::KVPair<T> into;
    for (const Index S : {Index{9}, Index{1}, Index{1}}) {
      const Call c = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
      (void)invoke(*twin.cache, Api::kFetch, c, into);
      (void)invoke(*subject.cache, Api::kFetch, c, into);
    }
    const Call c = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
    (void)invoke(*twin.cache, Api::kView, c, into);
    const vc::KVView<T> view =
        subject.cache->update_and_view(converted<T>(c.keys), converted<T>(c.values));
    const Returned before = from_view(view);
    Caches<T> set;
    set.push_back(std::move(subject.cache));
    const std::string bytes = save_to_string(set);
    subject.cache = std::move(set.front());
    EXPECT_TRUE(from_view(view) == before) << kind_name(kind);
    EXPECT_FALSE(bytes.empty());
    const Call next = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
    vc::KVPair<T> a, b;
    EXPECT_TRUE(invoke(*subject.cache, Api::kFetch, next, a) ==
                invoke(*twin.cache, Api::kFetch, next, b));
    EXPECT_TRUE(logical_state(subject) == logical_state(twin)) << kind_name(kind);
  }
}

// ---------------------------------------------------------------------------------------------
// Configs, metadata, files, streams
// ---------------------------------------------------------------------------------------------

/// Every field of KVCacheConfig survives the round trip (each set away from its default).
TEST(PromptCacheConfig, EveryFieldRoundTrips) {
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.squeeze_budget = 77;
  c.squeeze_n_sink = 3;
  c.squeeze_strength = 0.25;
  c.squeeze_resolved_budget = 55;
  c.squeeze_recent_ratio = 0.125;
  c.squeeze_decay = 0.9;
  c.squeeze_defer = true;
  c.squeeze_calibration_tokens = 9;
  c.h2o_budget = 33;
  c.h2o_n_sink = 2;
  c.h2o_grace = 5;
  c.h2o_decay = 0.75;
  c.pyramid_budget = 44;
  c.pyramid_n_sink = 6;
  c.pyramid_beta = 3.5;
  c.pyramid_resolved_budget = 41;
  c.pyramid_recent_ratio = 0.375;
  c.pyramid_decay = 0.625;
  c.tova_budget = 21;
  c.tova_n_sink = 7;
  c.stream_n_sink = 8;
  c.stream_window_size = 99;
  c.snap_budget = 88;
  c.snap_obs_window = 11;
  c.snap_n_sink = 1;
  c.key_bits = 8;
  c.value_bits = 4;
  c.quant_group = 16;
  Caches<float> set;
  set.push_back(vc::KVCacheFactory::create<float>(c));
  const vc::PromptCache<float> loaded = load_from_string<float>(save_to_string(set));
  const vc::KVCacheConfig& l = loaded.caches.front()->config();
  EXPECT_EQ(l.method, "h2o");
  EXPECT_EQ(l.squeeze_budget, 77);
  EXPECT_EQ(l.squeeze_n_sink, 3);
  EXPECT_EQ(l.squeeze_strength, 0.25);
  EXPECT_EQ(l.squeeze_resolved_budget, std::optional<int>(55));
  EXPECT_EQ(l.squeeze_recent_ratio, 0.125);
  EXPECT_EQ(l.squeeze_decay, 0.9);
  EXPECT_TRUE(l.squeeze_defer);
  EXPECT_EQ(l.squeeze_calibration_tokens, 9);
  EXPECT_EQ(l.h2o_budget, 33);
  EXPECT_EQ(l.h2o_n_sink, 2);
  EXPECT_EQ(l.h2o_grace, 5);
  EXPECT_EQ(l.h2o_decay, 0.75);
  EXPECT_EQ(l.pyramid_budget, 44);
  EXPECT_EQ(l.pyramid_n_sink, 6);
  EXPECT_EQ(l.pyramid_beta, 3.5);
  EXPECT_EQ(l.pyramid_resolved_budget, std::optional<int>(41));
  EXPECT_EQ(l.pyramid_recent_ratio, 0.375);
  EXPECT_EQ(l.pyramid_decay, 0.625);
  EXPECT_EQ(l.tova_budget, 21);
  EXPECT_EQ(l.tova_n_sink, 7);
  EXPECT_EQ(l.stream_n_sink, 8);
  EXPECT_EQ(l.stream_window_size, 99);
  EXPECT_EQ(l.snap_budget, 88);
  EXPECT_EQ(l.snap_obs_window, 11);
  EXPECT_EQ(l.snap_n_sink, 1);
  EXPECT_EQ(l.key_bits, 8);
  EXPECT_EQ(l.value_bits, 4);
  EXPECT_EQ(l.quant_group, 16);
}

/// Metadata is any bytes (NUL, high bytes, empty keys and values), many entries, in key order;
/// a set of no caches is a valid file too.
TEST(PromptCacheMetadata, AnyBytesRoundTrip) {
  std::map<std::string, std::string> meta = {
      {"", "empty key"},
      {"model", "stories260K"},
      {std::string("a\0b", 3), std::string("\xff\x00\x01", 3)},
      {"empty value", ""},
      {"\xc3\xa9t\xc3\xa9", "\xe2\x80\x9cquoted\xe2\x80\x9d"}};
  for (int i = 0; i < 300; ++i)
    meta["k" + std::to_string(i)] = std::string(static_cast<std::size_t>(i), 'x');
  const Caches<Eigen::half> none;
  const std::string bytes = save_to_string(none, meta);
  const vc::PromptCache<Eigen::half> loaded = load_from_string<Eigen::half>(bytes);
  EXPECT_EQ(loaded.metadata, meta);
  EXPECT_TRUE(loaded.caches.empty());
}

/// The path forms: a round trip; a file saved over is replaced only once the new one is whole (a
/// save that fails leaves the old file and no temporary behind); errors name the path; a file
/// must end with its prompt cache.
TEST(PromptCacheFile, SavedOverAtomicallyAndNamedInErrors) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("vq_prompt_cache_" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const std::string path = (dir / "chat.vqkv").string();
  std::mt19937 rng(9u);
  Subject<Eigen::half> s = make_subject<Eigen::half>(Method::h2o);
  vc::KVPair<Eigen::half> into;
  (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, 9), with_s(kValues, 9)), into);
  Caches<Eigen::half> set;
  set.push_back(std::move(s.cache));
  vc::save_prompt_cache(path, set, {{"turn", "1"}});
  const std::string first = save_to_string(set, {{"turn", "1"}});
  const auto read_file = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(read_file(path), first);
  const vc::PromptCache<Eigen::half> loaded = vc::load_prompt_cache<Eigen::half>(path);
  EXPECT_EQ(save_to_string(loaded.caches, loaded.metadata), first);

  // A failing save (a null cache) leaves the file as it was and nothing beside it.
  Caches<Eigen::half> bad;
  bad.push_back(nullptr);
  EXPECT_THROW(vc::save_prompt_cache(path, bad), std::invalid_argument);
  EXPECT_EQ(read_file(path), first);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);

  // Errors name the path.
  const std::string missing = (dir / "missing.vqkv").string();
  try {
    (void)vc::load_prompt_cache<Eigen::half>(missing);
    ADD_FAILURE() << "a missing file loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const std::string nowhere = (dir / "no_such_dir" / "x.vqkv").string();
  try {
    vc::save_prompt_cache(nowhere, set);
    ADD_FAILURE() << "saved into a missing directory";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no_such_dir"), std::string::npos) << e.what();
  }
  // Two files joined: the path form refuses the second one's bytes after the first.
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out << "x";
  }
  try {
    (void)vc::load_prompt_cache<Eigen::half>(path);
    ADD_FAILURE() << "trailing data accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("data follows"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // The stream form reads one prompt cache and leaves the stream after it.
  std::stringstream two(first + first);
  (void)vc::load_prompt_cache<Eigen::half>(two);
  const vc::PromptCache<Eigen::half> second = vc::load_prompt_cache<Eigen::half>(two);
  EXPECT_EQ(second.metadata.at("turn"), "1");
  EXPECT_EQ(two.peek(), std::char_traits<char>::eof());
  fs::remove_all(dir);
}

/// A streambuf that takes `room` bytes and then fails.
class FullDisk : public std::streambuf {
 public:
  explicit FullDisk(std::size_t room) : room_(room) {}

 protected:
  int_type overflow(int_type c) override {
    if (room_ == 0) return traits_type::eof();
    --room_;
    return traits_type::not_eof(c);
  }
  std::streamsize xsputn(const char*, std::streamsize n) override {
    const auto k = std::min<std::streamsize>(n, static_cast<std::streamsize>(room_));
    room_ -= static_cast<std::size_t>(k);
    return k;
  }

 private:
  std::size_t room_;
};

/// A stream that fails raises std::runtime_error; a null cache or a class derived from the
/// library's is refused before a byte is written.
TEST(PromptCacheSave, FailingStreamsAndUnknownCachesAreRefused) {
  Caches<float> set;
  set.push_back(vc::KVCacheFactory::create<float>(small_config()));
  std::mt19937 rng(2u);
  (void)set.front()->update_and_fetch(random_doubles(rng, with_s(kKeys, 4)),
                                      random_doubles(rng, with_s(kValues, 4)));
  for (const std::size_t room :
       {std::size_t{0}, std::size_t{10}, std::size_t{100}, std::size_t{1000}}) {
    FullDisk disk(room);
    std::ostream out(&disk);
    try {
      vc::save_prompt_cache(out, set);
      ADD_FAILURE() << "a full disk took the file (room " << room << ")";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("writing failed"), std::string::npos) << e.what();
    }
  }
  {
    // The widest row a call may bring (D = 65536 keys and values in float, docs/robustness.md,
    // "Magnitudes": 512 KiB) is within what the loader allocates at once (1 MiB), so a row too
    // wide to load cannot be made; such a set saves and loads, the rows intact.
    Caches<float> wide;
    wide.push_back(vc::KVCacheFactory::create<float>(small_config()));
    vc::Tensor4<float> k(1, 1, 1, 65536);
    k.setConstant(0.25f);
    (void)wide.front()->update_and_fetch(k, k);
    std::stringstream io;
    vc::save_prompt_cache(io, wide);
    const vc::PromptCache<float> back = vc::load_prompt_cache<float>(io);
    ASSERT_EQ(back.caches.size(), 1u);
    const vc::KVPair<float> state = back.caches.front()->state();
    ASSERT_EQ(state.first.dimension(3), 65536);
    EXPECT_EQ(state.second(0, 0, 0, 65535), 0.25f);
  }
  struct Derived : vc::H2OCache<float> {
    using vc::H2OCache<float>::H2OCache;
  };
  for (int which = 0; which < 2; ++which) {
    Caches<float> bad;
    bad.push_back(vc::KVCacheFactory::create<float>(small_config()));
    bad.push_back(which == 0 ? nullptr : std::make_unique<Derived>(small_config()));
    std::ostringstream out;
    try {
      vc::save_prompt_cache(out, bad);
      ADD_FAILURE() << "saved";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cache 1"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(out.str().empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Files the loader refuses
// ---------------------------------------------------------------------------------------------

/// A small file with every kind of section: metadata, a coordinator with reports, squeeze layers
/// (one mid-calibration with sums), a standard layer, quantized rows, a compressed SnapKV cache.
template <class T>
Caches<T> rich_set() {
  vc::KVCacheConfig c = small_config();
  c.squeeze_calibration_tokens = 6;
  // Newer than every older version the version tests write: at its default, so that their
  // files, loaded with it at its default, save back to the same bytes.
  c.kvzip_n_sink = vc::KVCacheConfig{}.kvzip_n_sink;
  Caches<T> set =
      vc::KVCacheBuilder::for_model<T>(std::vector<std::optional<int>>{8, std::nullopt, 8}, c);
  vc::KVCacheConfig q = small_config();
  q.method = "snapkv";
  q.kvzip_n_sink = c.kvzip_n_sink;
  q.key_bits = 8;
  q.value_bits = 4;
  set.push_back(vc::KVCacheFactory::create<T>(q));
  std::mt19937 rng(12u);
  const auto call = [&](vc::KVCache<T>& cache, Index S) {
    (void)cache.update_and_fetch(random_doubles(rng, 1, 2, S, 8), random_doubles(rng, 1, 2, S, 8));
  };
  call(*set[0], 7);
  call(*set[0], 1);
  call(*set[1], 3);
  call(*set[2], 4);  // still calibrating: sums in the file
  call(*set[3], 9);
  return set;
}

TEST(PromptCacheLoad, EveryTruncationIsRefused) {
  const std::string bytes = save_to_string(rich_set<Eigen::half>(), {{"k", "v"}});
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    const std::string msg = load_error<Eigen::half>(bytes.substr(0, n));
    ASSERT_NE(msg.find("ends early"), std::string::npos) << "prefix of " << n << " bytes: " << msg;
  }
  EXPECT_NO_THROW((void)load_from_string<Eigen::half>(bytes));
}

TEST(PromptCacheLoad, EveryCorruptedByteIsRefused) {
  const std::string bytes = save_to_string(rich_set<float>(), {{"k", "v"}});
  const fmt::FileMap map = fmt::walk<float>(bytes);
  int checksums = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (const int flip : {0x01, 0x80}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ flip);
      const std::string msg = load_error<float>(bad);
      ASSERT_FALSE(msg.empty()) << "byte " << i;
      checksums += msg.find("checksum mismatch") != std::string::npos;
    }
  }
  // Most flips land in data behind a checksum; the rest hit the magic, the version, or a length
  // that runs past the end.
  EXPECT_GT(checksums, static_cast<int>(bytes.size()));
  // A flip in a head's keys names the head.
  std::string bad = bytes;
  bad[map.at("cache3.head1.keys").offset] =
      static_cast<char>(bad[map.at("cache3.head1.keys").offset] ^ 0x10);
  const std::string msg = load_error<float>(bad);
  EXPECT_NE(msg.find("cache 3 (snapkv), head (0, 1): checksum mismatch"), std::string::npos) << msg;
}

TEST(PromptCacheLoad, NewerVersionsAndOtherStorageTypesAreNamed) {
  const std::string half = save_to_string(rich_set<Eigen::half>());
  std::string newer = half;
  const fmt::FileMap map = fmt::walk<Eigen::half>(half);
  const std::uint32_t next = vc::detail::kPromptCacheVersion + 1;
  fmt::patch(newer, map.at("header.version"), next);
  fmt::reseal(newer, map);
  EXPECT_NE(
      load_error<Eigen::half>(newer).find("format version " + std::to_string(next) + " is newer"),
      std::string::npos);
  const std::string as_float = load_error<float>(half);
  EXPECT_NE(as_float.find("holds Eigen::half rows"), std::string::npos) << as_float;
  EXPECT_NE(as_float.find("load_prompt_cache<Eigen::half>"), std::string::npos) << as_float;
  EXPECT_NE(load_error<Eigen::bfloat16>(half).find("holds Eigen::half rows"), std::string::npos);
  std::string other = half;
  fmt::patch(other, map.at("header.magic"), std::uint64_t{0x4b4e554a4b4e554aull});
  EXPECT_NE(load_error<Eigen::half>(other).find("not a veloxquant prompt cache"),
            std::string::npos);
}

template <class T>
std::string as_version(const std::string& bytes, std::uint32_t version) {
  return fmt::as_version<T>(bytes, version, vc::detail::config_field_since);
}

/// A version-1 file (written before proxy_scoring existed) loads with the key-as-query proxy, the
/// behaviour that wrote it (docs/design.md G, 4.7), and is the very set: saved again, it is the
/// current file byte for byte. A version-1 file may not hold the newer field.
TEST(PromptCacheLoad, Version1FilesLoadWithTheKeyAsQueryProxy) {
  ASSERT_EQ(vc::detail::kPromptCacheVersion, 7U);
  const std::string v4 = save_to_string(rich_set<Eigen::half>(), {{"k", "v"}});
  const std::string v1 = as_version<Eigen::half>(v4, 1);
  ASSERT_LT(v1.size(), v4.size());
  vc::PromptCache<Eigen::half> loaded = load_from_string<Eigen::half>(v1);
  ASSERT_EQ(loaded.caches.size(), 4U);
  for (const auto& c : loaded.caches) {
    EXPECT_EQ(c->config().proxy_scoring, "key_as_query");
    EXPECT_EQ(c->config().value_norm_power, 0.0);
  }
  EXPECT_EQ(save_to_string(loaded.caches, loaded.metadata), v4);

  std::string mixed = as_version<Eigen::half>(v4, 2);  // a version-1 header over version-2 configs
  const fmt::FileMap map = fmt::walk<Eigen::half>(mixed);
  fmt::patch(mixed, map.at("header.version"), std::uint32_t{1});
  fmt::reseal(mixed, map);
  const std::string msg = load_error<Eigen::half>(mixed);
  EXPECT_NE(msg.find("config field 'proxy_scoring' is not in format version 1"), std::string::npos)
      << msg;
}

/// A version-2 file (written before value_norm_power existed) ranks by score alone, the behaviour
/// that wrote it (docs/design.md G, 4.8), and saved again is the current file byte for byte; a
/// version-2 file may not hold the newer field. value_norm_power itself round-trips.
TEST(PromptCacheLoad, Version2FilesLoadRankingByScoreAlone) {
  const std::string v4 = save_to_string(rich_set<Eigen::half>(), {{"k", "v"}});
  const std::string v2 = as_version<Eigen::half>(v4, 2);
  ASSERT_LT(v2.size(), v4.size());
  vc::PromptCache<Eigen::half> loaded = load_from_string<Eigen::half>(v2);
  ASSERT_EQ(loaded.caches.size(), 4U);
  for (const auto& c : loaded.caches) EXPECT_EQ(c->config().value_norm_power, 0.0);
  EXPECT_EQ(save_to_string(loaded.caches, loaded.metadata), v4);

  std::string mixed = as_version<Eigen::half>(v4, 3);  // a version-2 header over version-3 configs
  const fmt::FileMap map = fmt::walk<Eigen::half>(mixed);
  fmt::patch(mixed, map.at("header.version"), std::uint32_t{2});
  fmt::reseal(mixed, map);
  const std::string msg = load_error<Eigen::half>(mixed);
  EXPECT_NE(msg.find("config field 'value_norm_power' is not in format version 2"),
            std::string::npos)
      << msg;

  vc::KVCacheConfig c = small_config();
  c.value_norm_power = 1.5;
  Caches<float> a = vc::KVCacheBuilder::for_model<float>(2, c);
  const vc::PromptCache<float> back = load_from_string<float>(save_to_string(a, {}));
  for (const auto& cache : back.caches) EXPECT_EQ(cache->config().value_norm_power, 1.5);
}

/// A version-3 file (written before head_budgets existed) loads with uniform heads, the
/// behaviour that wrote it (docs/design.md G, 4.9), and saved again is the current file byte for
/// byte; a version-3 file may not hold the newer fields. Both fields round-trip, and an adaptive
/// set's ragged heads (each head section with its own row count) load as they were saved.
TEST(PromptCacheLoad, Version3FilesLoadWithUniformHeads) {
  const std::string v4 = save_to_string(rich_set<Eigen::half>(), {{"k", "v"}});
  const std::string v3 = as_version<Eigen::half>(v4, 3);
  ASSERT_LT(v3.size(), v4.size());
  vc::PromptCache<Eigen::half> loaded = load_from_string<Eigen::half>(v3);
  ASSERT_EQ(loaded.caches.size(), 4U);
  for (const auto& c : loaded.caches) {
    EXPECT_EQ(c->config().head_budgets, "uniform");
    EXPECT_EQ(c->config().head_budget_floor, 0.2);
  }
  EXPECT_EQ(save_to_string(loaded.caches, loaded.metadata), v4);

  std::string mixed = v4;  // a version-3 header over version-4 configs
  const fmt::FileMap map = fmt::walk<Eigen::half>(mixed);
  fmt::patch(mixed, map.at("header.version"), std::uint32_t{3});
  fmt::reseal(mixed, map);
  const std::string msg = load_error<Eigen::half>(mixed);
  EXPECT_NE(msg.find("config field 'head_budgets' is not in format version 3"), std::string::npos)
      << msg;
}

/// Value-weighted eviction (docs/design.md 4.8) after a load: each row's |v|^p is recomputed from
/// its stored value when the head is restored, so a loaded set of caches, driven with queries,
/// evicts exactly as the set that never left memory (float rows and 8-bit values, squeeze and
/// H2O); with the weights of restored rows missing, the next re-budget would rank them by 0.
TEST(PromptCacheLoad, ValueWeightedCachesContinueBitIdenticallyAfterALoad) {
  for (const int value_bits : {16, 8}) {
    for (const char* method : {"squeeze", "h2o"}) {
      SCOPED_TRACE(std::string(method) + ", value bits " + std::to_string(value_bits));
      vc::KVCacheConfig c = small_config();
      c.method = method;
      c.value_norm_power = 2.0;
      c.value_bits = value_bits;
      c.quant_group = 8;
      c.squeeze_calibration_tokens = 4;
      Caches<float> a = vc::KVCacheBuilder::for_model<float>(2, c);
      Caches<float> b = vc::KVCacheBuilder::for_model<float>(2, c);
      std::mt19937 rng(9u);
      const auto both = [&](Caches<float>& x, Caches<float>& y, Index S) {
        for (std::size_t l = 0; l < x.size(); ++l) {
          const auto k = random_doubles(rng, 1, 2, S, 8), v = random_doubles(rng, 1, 2, S, 8);
          const auto q = random_doubles(rng, 1, 4, S, 8);  // G = 2
          (void)x[l]->update_and_fetch(k, v, q);
          (void)y[l]->update_and_fetch(k, v, q);
        }
      };
      both(a, b, 20);
      for (int step = 0; step < 5; ++step) both(a, b, 1);
      vc::PromptCache<float> loaded = load_from_string<float>(save_to_string(a));
      EXPECT_EQ(loaded.caches[0]->config().value_norm_power, 2.0);
      for (int step = 0; step < 12; ++step) both(loaded.caches, b, step % 5 == 0 ? 3 : 1);
      EXPECT_EQ(save_to_string(loaded.caches), save_to_string(b));
      EXPECT_LT(b[0]->tokens_kept(), b[0]->offset());  // it evicted
    }
  }
}

/// The query-free scorers round-trip with their scores (K-norm's are negative) and go on bitwise;
/// a scorer name the library does not know is refused with the name.
TEST(PromptCacheLoad, QueryFreeScorersRoundTripAndUnknownOnesAreRefused) {
  for (const char* scorer : {"keydiff", "knorm"}) {
    SCOPED_TRACE(scorer);
    vc::KVCacheConfig c = small_config();
    c.proxy_scoring = scorer;
    c.squeeze_calibration_tokens = 4;
    Caches<float> a = vc::KVCacheBuilder::for_model<float>(2, c);
    Caches<float> b = vc::KVCacheBuilder::for_model<float>(2, c);
    std::mt19937 rng(5u);
    const auto both = [&](Caches<float>& x, Caches<float>& y, Index S) {
      for (std::size_t l = 0; l < x.size(); ++l) {
        const auto k = random_doubles(rng, 1, 2, S, 8), v = random_doubles(rng, 1, 2, S, 8);
        (void)x[l]->update_and_fetch(k, v);
        (void)y[l]->update_and_fetch(k, v);
      }
    };
    both(a, b, 12);
    both(a, b, 1);
    const std::string bytes = save_to_string(a);
    vc::PromptCache<float> loaded = load_from_string<float>(bytes);
    EXPECT_EQ(loaded.caches[0]->config().proxy_scoring, scorer);
    for (int step = 0; step < 12; ++step) both(loaded.caches, b, step % 5 == 0 ? 3 : 1);
    EXPECT_EQ(save_to_string(loaded.caches), save_to_string(b));
    // K-norm's scores are -|k| (negative, which version 1 refused); KeyDiff's 1 / (|k| + 1e-8).
    const bool knorm = std::string(scorer) == "knorm";
    visit_core(*b[0], [&](const auto& core) {
      for (const float x : core.scores(0, 0)) EXPECT_EQ(x < 0.0f, knorm) << x;
    });

    // "keydiff" -> "keydifX", "knorm" -> "knorX": same length, checksums sealed again.
    std::string bad = bytes;
    const fmt::FileMap map = fmt::walk<float>(bad);
    const fmt::Field f = map.at("cache0.config.proxy_scoring");
    bad[f.offset + f.size - 1] = 'X';
    fmt::reseal(bad, map);
    const std::string msg = load_error<float>(bad);
    EXPECT_NE(msg.find("proxy_scoring"), std::string::npos) << msg;

    // KeyDiff does not trust the scores of a file: it recomputes each row's weight from its key
    // before its first ranking, so a crafted score (1e30, which the loader accepts) changes
    // nothing once the next call has evicted (and reaches no overflow on the way).
    if (knorm) continue;
    std::string odd = bytes;
    const fmt::Field scores = map.at("cache0.head0.scores");
    fmt::patch(odd, fmt::Field{scores.offset, 4}, 1e30f);
    fmt::reseal(odd, map);
    vc::PromptCache<float> same = load_from_string<float>(bytes);
    vc::PromptCache<float> crafted = load_from_string<float>(odd);
    for (int step = 0; step < 6; ++step) both(same.caches, crafted.caches, 1);
    EXPECT_EQ(save_to_string(crafted.caches), save_to_string(same.caches));
  }
}

/// One crafted change: a field set to a value, the checksums sealed again.
struct Craft {
  std::string field;
  std::int64_t value;
  std::string message;  // a part of what the loader must say
};

template <class U>
std::string crafted(const std::string& bytes, const fmt::FileMap& map, const std::string& field,
                    U value) {
  std::string out = bytes;
  fmt::patch(out, map.at(field), value);
  fmt::reseal(out, map);
  return out;
}

/// Sets the integer field `f` of `bytes` (1, 4 or 8 bytes; the 3 reserved header bytes: the
/// first) to `value`, without sealing.
void patch_int(std::string& bytes, fmt::Field f, std::int64_t value) {
  if (f.size == 3) f.size = 1;
  switch (f.size) {
    case 1:
      fmt::patch(bytes, f, static_cast<std::uint8_t>(value));
      break;
    case 4:
      fmt::patch(bytes, f, static_cast<std::int32_t>(value));
      break;
    case 8:
      fmt::patch(bytes, f, value);
      break;
    default:
      throw std::runtime_error("patch_int: a field of " + std::to_string(f.size) + " bytes");
  }
}

/// Files whose checksums are right but whose content no cache can hold: each is refused, naming
/// the problem. (The independent format reader of support/prompt_cache_format.hpp places the
/// changes and seals the checksums again.)
TEST(PromptCacheLoad, CraftedFilesAreRefusedNamingTheProblem) {
  using T = Eigen::half;
  const std::string bytes = save_to_string(rich_set<T>(), {{"a", "1"}, {"b", "2"}});
  const fmt::FileMap map = fmt::walk<T>(bytes);
  EXPECT_NO_THROW((void)load_from_string<T>(bytes));
  const std::vector<Craft> crafts = {
      {"header.reserved", 1, "reserved header bytes"},
      {"header.storage", 9, "unknown storage type code 9"},
      {"meta1.key", 'a', "out of order or repeated"},
      {"coord0.n_layers", 0, "n_layers (0) must be >= 1"},
      {"coord0.avg_budget", 1, "avg_budget (1) must be >= n_sink + 1"},
      {"coord0.report0.layer", -1, "negative, out of order or repeated"},
      {"cache0.config.squeeze_budget", 0,
       "its configuration is invalid: KVCacheConfig: squeeze_budget (0)"},
      {"cache0.config.key_bits", 5, "key_bits (5) must be 16, 8, 4 or 2"},
      {"cache0.config.squeeze_defer", 2, "config field 'squeeze_defer' is 2"},
      {"cache0.config.method.type", 1, "config field 'method' has type code 1"},
      {"cache0.config_fields", 28, "holds 28 fields"},
      {"cache0.flags", 16, "unknown state flags"},
      {"cache0.budget", 1000, "budget 1000 before adoption"},
      {"cache0.rows", 9, "9 rows per head at offset 8"},
      {"cache0.offset", 9, "tokens_seen 16 does not fit 2 heads at offset 9"},
      {"cache0.batch", 0, "not in [1, 2^31 - 1]"},
      {"cache0.coordinator", 5, "coordinator index 5 is not in the table"},
      {"cache0.squeeze_flags", 2 | 4 | 8 | 32, "unknown squeeze flags"},
      {"cache0.report_generation", 3, "reported in generation 3"},
      {"cache2.squeeze_flags", 1,
       "the concentration sums are there exactly while a layer calibrates"},
      {"cache2.tokens_seen", 10, "tokens_seen 10 does not fit"},
      {"cache3.flags", 1 | 2, "a SnapKV cache that has not compressed holds every row"},
      {"cache3.budget", 5, "its budget is not the one its configuration gives"},
      // The descriptor every cache has.
      {"cache0.offset", (std::int64_t{1} << 62) + 1, "is beyond 2^62"},
      {"cache3.config.quant_group", 16, "quant_group 16 does not divide the key dim 8"},
      {"cache0.rows", 0, "no rows after a call"},
      {"cache0.flags", 1 | 2 | 4,
       "compressed, but not a SnapKV or KVzip cache that has seen a call"},
      {"cache0.flags", 1 | 2 | 8, "observed, but not a KVzip cache that holds rows"},
      {"cache0.budget", 0, "budget 0 is below 1"},
      {"cache0.budget", 5, "8 rows per head over its budget of 5"},
      {"cache1.flags", 0, "a cache that has seen no call holds dims"},
      // A squeeze layer's own part: cache 0 is calibrated and has reported (flags 1 | 2 | 4),
      // cache 2 (layer 2) still calibrates (flags 1 | 16).
      {"cache2.squeeze_flags", 16, "no layer id but a layer id value"},
      {"cache0.layer_id", -1, "layer_id (-1) must be >= 0"},
      {"cache0.squeeze_flags", 1 | 4, "calibrated is false at offset 8"},
      {"cache0.squeeze_flags", 1 | 2, "reported must be: calibrated, with a coordinator"},
      {"cache0.squeeze_flags", 2 | 8, "adopted a budget without reporting"},
      {"cache2.report_generation", 1, "a report generation without a report"},
  };
  for (const Craft& c : crafts) {
    std::string bad = bytes;
    patch_int(bad, map.at(c.field), c.value);
    fmt::reseal(bad, map);
    const std::string msg = load_error<T>(bad);
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.field << " = " << c.value << ": " << msg;
  }
}

/// Squeeze layers that have adopted their coordinator's budgets, and a third one (of its own, no
/// coordinator) that has seen no call: states no run reaches, each made by changing several
/// fields at once, are refused naming the problem.
TEST(PromptCacheLoad, CraftedSqueezeLayersAreRefusedNamingTheProblem) {
  using T = float;
  vc::KVCacheConfig c = small_config();
  c.squeeze_calibration_tokens = 6;
  Caches<T> set = vc::KVCacheBuilder::for_model<T>(std::vector<std::optional<int>>{8, 8}, c);
  set.push_back(vc::KVCacheFactory::create<T>(c));
  std::mt19937 rng(5u);
  for (const Index S : {7, 1}) {  // both report, then both adopt
    for (std::size_t i = 0; i < 2; ++i) {
      (void)set[i]->update_and_fetch(random_doubles(rng, 1, 2, S, 8),
                                     random_doubles(rng, 1, 2, S, 8));
    }
  }
  ASSERT_TRUE(set[0]->layer_budget() > 0 && set[1]->layer_budget() > 0);
  const std::string bytes = save_to_string(set);
  const fmt::FileMap map = fmt::walk<T>(bytes);
  EXPECT_NO_THROW((void)load_from_string<T>(bytes));
  // A layer that never reported: its layer id and calibration stay, the rest is what a layer
  // without a coordinator holds (the fallback budget, 8).
  const auto uncoordinated = [](const std::string& cache) -> std::vector<Craft> {
    return {{cache + ".coordinator", -1, ""},
            {cache + ".squeeze_flags", 1 | 2, ""},
            {cache + ".report_generation", 0, ""},
            {cache + ".budget", 8, ""}};
  };
  std::vector<Craft> unused = uncoordinated("cache0");
  for (const Craft& x : uncoordinated("cache1")) unused.push_back(x);
  const std::vector<std::pair<std::vector<Craft>, std::string>> crafts = {
      {{{"cache0.budget", 100, ""}}, "adopted budget 100 is not the one its coordinator published"},
      {{{"cache2.squeeze_flags", 2, ""}}, "a cache that has seen no call is calibrated"},
      {{{"cache0.flags", 1, ""}, {"cache0.budget", 0, ""}},
       "no budget, but not a deferring layer waiting for its coordinator"},
      {unused, "coordinator 0: no cache of the file uses it"},
      {{{"coord0.n_layers", 1, ""}}, "2 reports for 1 layers"},
  };
  for (const auto& [changes, message] : crafts) {
    std::string bad = bytes;
    for (const Craft& x : changes) patch_int(bad, map.at(x.field), x.value);
    fmt::reseal(bad, map);
    const std::string msg = load_error<T>(bad);
    EXPECT_NE(msg.find(message), std::string::npos) << changes.front().field << ": " << msg;
  }
}

/// Crafted head contents: positions, sinks, scores, keys, quantized scales, concentration sums.
TEST(PromptCacheLoad, CraftedHeadsAreRefusedNamingTheProblem) {
  using T = float;
  const std::string bytes = save_to_string(rich_set<T>());
  const fmt::FileMap map = fmt::walk<T>(bytes);
  const auto at = [&](const std::string& field, std::size_t i, std::size_t size) {
    const fmt::Field& f = map.at(field);
    return fmt::Field{f.offset + i * size, size};
  };
  const auto expect_refused = [&](std::string bad, const std::string& what) {
    fmt::reseal(bad, map);
    const std::string msg = load_error<T>(bad);
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  std::string bad = bytes;
  // Cache 0 (squeeze, 6 rows of positions {0, ...}): a repeated position, one past the offset,
  // the sink missing.
  fmt::patch(bad, at("cache0.head0.positions", 2, 8), std::int64_t{1});
  fmt::patch(bad, at("cache0.head0.positions", 1, 8), std::int64_t{1});
  expect_refused(bad, "cache 0 (squeeze), head (0, 0): two rows share a position");
  bad = bytes;
  fmt::patch(bad, at("cache0.head1.positions", 5, 8), std::int64_t{8});
  expect_refused(bad, "are not in [0, offset 8)");
  bad = bytes;
  fmt::patch(bad, at("cache0.head1.positions", 0, 8), std::int64_t{6});
  fmt::patch(bad, at("cache0.head1.positions", 1, 8), std::int64_t{7});
  expect_refused(bad, "share a position");
  bad = bytes;
  {
    // Cache 3 (SnapKV: 6 of the prompt's 9 rows, one sink): position 0 replaced by one it
    // evicted.
    std::vector<std::int64_t> p(6);
    std::memcpy(p.data(), bytes.data() + map.at("cache3.head0.positions").offset, 48);
    std::int64_t missing = 1;
    while (std::find(p.begin(), p.end(), missing) != p.end()) ++missing;
    ASSERT_LT(missing, 9);
    const auto zero = static_cast<std::size_t>(std::find(p.begin(), p.end(), 0) - p.begin());
    ASSERT_LT(zero, p.size());
    fmt::patch(bad, at("cache3.head0.positions", zero, 8), missing);
    expect_refused(
        bad, "cache 3 (snapkv), head (0, 0): a sink (one of the first 1 positions) is missing");
  }
  bad = bytes;
  fmt::patch(bad, at("cache0.head0.scores", 3, 4), -1.0f);
  expect_refused(bad, "a score (-1.000000) is negative or not finite");
  bad = bytes;
  fmt::patch(bad, at("cache0.head0.scores", 3, 4), std::numeric_limits<float>::infinity());
  expect_refused(bad, "negative or not finite");
  bad = bytes;
  fmt::patch(bad, at("cache0.head0.scores", 3, 4), std::numeric_limits<float>::quiet_NaN());
  expect_refused(bad, "negative or not finite");
  bad = bytes;
  fmt::patch(bad, at("cache0.head1.keys", 5, 4), std::numeric_limits<float>::quiet_NaN());
  expect_refused(bad, "a key is not finite");
  bad = bytes;
  fmt::patch(bad, at("cache0.head1.keys", 5, 4), 0x1p49f);  // finite, beyond what a call may bring
  expect_refused(bad, "a key is not finite or beyond +-2^48");
  bad = bytes;
  // Cache 3 (SnapKV, 8-bit keys in one group of 8: 8 code bytes, then the half scale and offset).
  fmt::patch(bad, fmt::Field{map.at("cache3.head0.keys").offset + 8, 2}, std::uint16_t{0x7C00});
  expect_refused(bad, "a quantized key row's scale or offset is not finite");
  bad = bytes;
  fmt::patch(bad, map.at("cache2.head0.sum_rows"), std::int64_t{3});
  expect_refused(bad, "the concentration sums count 3 rows");
  bad = bytes;
  fmt::patch(bad, map.at("cache2.head0.diagonal"), std::numeric_limits<double>::infinity());
  expect_refused(bad, "the concentration sums are not finite");
  bad = bytes;
  fmt::patch(bad, map.at("cache2.head0.diagonal"), 4.5);  // 4 unit vectors add up to at most 4
  expect_refused(bad, "the concentration sums exceed what 4 rows can add up to");
  bad = bytes;
  fmt::patch(bad, map.at("coord0.report0.concentration"), std::numeric_limits<double>::quiet_NaN());
  expect_refused(bad, "the report of layer 0 is not finite");
}

// ---------------------------------------------------------------------------------------------
// The state seam itself: KVCache::write_state / read_state (docs/design.md G), which fork and
// checkpoint build on
// ---------------------------------------------------------------------------------------------

/// Reads cache `i` of the file `bytes` (its state: from its state flags on) into `target`.
template <class T>
void read_state_of(const std::string& bytes, const fmt::FileMap& map, std::size_t i,
                   vc::KVCache<T>& target) {
  const std::string prefix = "cache" + std::to_string(i);
  std::istringstream in(bytes.substr(map.at(prefix + ".flags").offset));
  // The descriptor's checksum covers its config too, which the container reads: not verified.
  vc::detail::ByteReader reader(in, false);
  vc::detail::StateLinks links;
  vc::detail::StateReader state(reader, links, prefix);
  target.read_state(state);
}

/// A saved state read into a cache of the same config that has a history of its own: the cache
/// then stands where the saved one stood (the same snapshot, the same results for the same
/// calls). A state it refuses throws std::invalid_argument naming the rule and leaves the cache
/// as it was, whether the fault is in the descriptor or in a head read after others.
TEST(PromptCacheState, ReadIntoAUsedCacheRestoresItOrLeavesItUntouched) {
  using T = float;
  const Caches<T> saved = rich_set<T>();  // cache 1: standard; cache 3: SnapKV, 8/4-bit rows
  const std::string bytes = save_to_string(saved);
  const fmt::FileMap map = fmt::walk<T>(bytes);
  std::mt19937 rng(31u);
  for (const std::size_t i : {std::size_t{1}, std::size_t{3}}) {
    SCOPED_TRACE("cache " + std::to_string(i));
    const auto used = [&] {
      std::unique_ptr<vc::KVCache<T>> c = vc::KVCacheFactory::create<T>(saved[i]->config());
      for (const Index S : {Index{5}, Index{1}, Index{12}}) {
        (void)c->update_and_fetch(random_doubles(rng, 1, 2, S, 8), random_doubles(rng, 1, 2, S, 8));
      }
      return c;
    };
    // Refused: rows beyond the offset (descriptor), a key that is not finite (head (0, 1)).
    const std::string prefix = "cache" + std::to_string(i);
    std::string bad_rows = bytes;
    fmt::patch(bad_rows, map.at(prefix + ".rows"), std::int64_t{99});
    std::string bad_key = bytes;
    const std::size_t key = map.at(prefix + ".head1.keys").offset;
    if (i == 1) {
      fmt::patch(bad_key, fmt::Field{key, 4}, std::numeric_limits<float>::quiet_NaN());
    } else {  // 8 code bytes, then the half scale
      fmt::patch(bad_key, fmt::Field{key + 8, 2}, std::uint16_t{0x7C00});
    }
    for (const auto& [bad, what] :
         {std::pair<std::string, std::string>{bad_rows, "99 rows per head"},
          {bad_key, i == 1 ? "a key is not finite" : "scale or offset"}}) {
      std::unique_ptr<vc::KVCache<T>> c = used();
      const Snapshot before = snapshot(*c, nullptr);
      try {
        read_state_of(bad, map, i, *c);
        ADD_FAILURE() << "accepted: " << what;
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
      EXPECT_TRUE(snapshot(*c, nullptr) == before) << what;
    }
    // Restored: the used cache and a loaded one go on as the saved cache does.
    std::unique_ptr<vc::KVCache<T>> c = used();
    read_state_of(bytes, map, i, *c);
    Snapshot got = snapshot(*c, nullptr), want = snapshot(*saved[i], nullptr);
    got.heap = want.heap = 0;
    EXPECT_TRUE(got == want);
    vc::PromptCache<T> loaded = load_from_string<T>(bytes);
    for (const Index S : {Index{1}, Index{4}, Index{0}, Index{1}}) {
      const vc::Tensor4<double> k = random_doubles(rng, 1, 2, S, 8);
      const vc::Tensor4<double> v = random_doubles(rng, 1, 2, S, 8);
      const std::vector<unsigned char> from_saved =
          bytes_of(saved[i]->update_and_fetch(k, v).first);
      EXPECT_EQ(bytes_of(c->update_and_fetch(k, v).first), from_saved) << "S = " << S;
      EXPECT_EQ(bytes_of(loaded.caches[i]->update_and_fetch(k, v).first), from_saved);
    }
  }
}

/// Counts of 2^62 and more in a crafted (resealed) file: the loader reads until the file runs
/// out and never allocates more than its grant (1 MiB) plus the bytes it has read.
TEST(PromptCacheLoad, HugeCountsAllocateNothingTheFileDoesNotHold) {
  using T = Eigen::half;
  Caches<T> set;
  set.push_back(vc::KVCacheFactory::create<T>(standard_config()));  // a standard cache
  std::mt19937 rng(1u);
  (void)set.front()->update_and_fetch(random_doubles(rng, 1, 2, 3, 8),
                                      random_doubles(rng, 1, 2, 3, 8));
  const std::string bytes = save_to_string(set, {{"m", "v"}});
  const fmt::FileMap map = fmt::walk<T>(bytes);
  const std::int64_t huge = std::int64_t{1} << 62;
  std::vector<std::string> files;
  files.push_back(crafted(bytes, map, "header.metadata", std::uint32_t{0xFFFFFFFFu}));
  files.push_back(crafted(bytes, map, "header.caches", std::uint32_t{0xFFFFFFFFu}));
  files.push_back(crafted(bytes, map, "header.coordinators", std::uint32_t{0xFFFFFFFFu}));
  files.push_back(crafted(bytes, map, "meta0.key_length", std::uint32_t{0xFFFFFFF0u}));
  files.push_back(crafted(bytes, map, "cache0.config.method.length", std::uint32_t{0x7FFFFFF0u}));
  files.push_back(crafted(bytes, map, "cache0.config_fields", std::uint32_t{0xFFFFFFFFu}));
  {
    // A standard cache claiming 2^30 rows per head over 2^10 x 2^10 heads (consistent counts).
    std::string f = bytes;
    fmt::patch(f, map.at("cache0.rows"), std::int64_t{1} << 30);
    fmt::patch(f, map.at("cache0.offset"), std::int64_t{1} << 30);
    fmt::patch(f, map.at("cache0.batch"), std::int64_t{1} << 10);
    fmt::patch(f, map.at("cache0.heads"), std::int64_t{1} << 10);
    fmt::patch(f, map.at("cache0.tokens_seen"), std::int64_t{1} << 50);
    fmt::reseal(f, map);
    files.push_back(f);
  }
  {
    std::string f = bytes;
    fmt::patch(f, map.at("cache0.rows"), huge);
    fmt::patch(f, map.at("cache0.offset"), huge);
    fmt::patch(f, map.at("cache0.tokens_seen"), huge);  // B = 1, H = 2: 2^63 overflows, refused
    fmt::reseal(f, map);
    files.push_back(f);
  }
  {
    std::string f = bytes;
    fmt::patch(f, map.at("cache0.key_dim"), std::int64_t{0x7FFFFFFF});
    fmt::reseal(f, map);
    files.push_back(f);
  }
  {
    // An H2O head weighing its values (value_norm_power) claiming 2^31 - 1 value dims: its
    // weight buffers come after its rows, so nothing is allocated for them.
    vc::KVCacheConfig c = small_config();
    c.method = "h2o";
    c.value_norm_power = 2.0;
    Caches<T> h2o;
    h2o.push_back(vc::KVCacheFactory::create<T>(c));
    (void)h2o.front()->update_and_fetch(random_doubles(rng, 1, 2, 3, 8),
                                        random_doubles(rng, 1, 2, 3, 8),
                                        random_doubles(rng, 1, 2, 3, 8));
    const std::string hb = save_to_string(h2o);
    const fmt::FileMap hm = fmt::walk<T>(hb);
    std::string f = hb;
    fmt::patch(f, hm.at("cache0.value_dim"), std::int64_t{0x7FFFFFFF});
    fmt::reseal(f, hm);
    files.push_back(f);
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::string msg;
    const long long peak = peak_heap_of([&] {
      try {
        (void)load_from_string<T>(files[i]);
      } catch (const std::runtime_error& e) {
        msg = e.what();
      }
    });
    EXPECT_FALSE(msg.empty()) << "file " << i << " loaded";
    EXPECT_LE(g_largest, (std::size_t{1} << 20) + 4 * files[i].size() + 65536)
        << "file " << i << ": " << msg;
    EXPECT_LE(peak, 4 << 20) << "file " << i << ": " << msg;
  }
}

/// Heads that cost the file almost nothing: a standard cache trimmed to no rows is saved with no
/// head sections and loaded with no head objects, so B = 2^22 costs nothing; many tiny heads are
/// charged against the file's bytes (docs/design.md G, "Memory"), so a crafted file repeating a
/// 16-byte head section is refused before its heads outgrow it, and the writer refuses the sets
/// the loader would refuse.
TEST(PromptCacheLoad, EmptyAndTinyHeadsCostNoMoreThanTheFileHolds) {
  using T = Eigen::half;
  std::mt19937 rng(4u);
  {
    Caches<T> set;
    set.push_back(vc::KVCacheFactory::create<T>(standard_config()));
    (void)set.front()->update_and_fetch(random_doubles(rng, 1, 2, 3, 8),
                                        random_doubles(rng, 1, 2, 3, 8));
    ASSERT_EQ(set.front()->trim(3), 3);
    const std::string bytes = save_to_string(set);
    const fmt::FileMap map = fmt::walk<T>(bytes);
    EXPECT_FALSE(map.has("cache0.head0.positions"));
    std::string big = bytes;
    fmt::patch(big, map.at("cache0.batch"), std::int64_t{1} << 22);
    fmt::patch(big, map.at("cache0.tokens_seen"), std::int64_t{3} << 23);
    fmt::reseal(big, map);
    vc::PromptCache<T> loaded;
    const long long peak = peak_heap_of([&] { loaded = load_from_string<T>(big); });
    EXPECT_LE(peak, 1 << 16);
    EXPECT_EQ(loaded.caches.front()->batch(), Eigen::Index{1} << 22);
    EXPECT_EQ(loaded.caches.front()->tokens_kept(), 0);
  }
  {
    // 1000 heads of one 1-element row each: 16 bytes a head in the file (the writer accepts it,
    // the grant covering the heads' bookkeeping).
    Caches<T> set;
    set.push_back(vc::KVCacheFactory::create<T>(standard_config()));
    vc::Tensor4<T> one(1000, 1, 1, 1);
    one.setConstant(T(0.5f));
    (void)set.front()->update_and_fetch(one, one);
    const std::string bytes = save_to_string(set);
    const fmt::FileMap map = fmt::walk<T>(bytes);
    // Repeat head 0's section (every head holds the same row) for 20,000 heads.
    const fmt::Field h0 = map.sections[map.sections.size() - 1000];
    const std::string head = bytes.substr(h0.offset, h0.size + 4);
    std::string crafted = bytes.substr(0, h0.offset);
    fmt::patch(crafted, map.at("cache0.batch"), std::int64_t{20000});
    fmt::patch(crafted, map.at("cache0.tokens_seen"), std::int64_t{20000});
    fmt::reseal(crafted,
                fmt::FileMap{map.fields, {map.sections.begin(), map.sections.end() - 1000}});
    for (int i = 0; i < 20000; ++i) crafted += head;
    std::string msg;
    const long long peak = peak_heap_of([&] {
      try {
        (void)load_from_string<T>(crafted);
      } catch (const std::runtime_error& e) {
        msg = e.what();
      }
    });
    EXPECT_NE(msg.find("the heads would hold more memory than the file's data allows"),
              std::string::npos)
        << msg;
    EXPECT_LE(peak, static_cast<long long>(4 * crafted.size()) + (4 << 20));
    // The writer refuses what the loader would: 20,000 such heads.
    Caches<T> many;
    many.push_back(vc::KVCacheFactory::create<T>(standard_config()));
    vc::Tensor4<T> wide(20000, 1, 1, 1);
    wide.setConstant(T(0.5f));
    (void)many.front()->update_and_fetch(wide, wide);
    std::ostringstream out;
    try {
      vc::save_prompt_cache(out, many);
      ADD_FAILURE() << "saved a set the loader refuses";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cannot be saved: cache 0's heads"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(out.str().empty());
  }
}

// ---------------------------------------------------------------------------------------------
// The CRC-32C kernel alone (on purpose)
// ---------------------------------------------------------------------------------------------

TEST(Crc32cKernel, CheckValueAndEveryPathEveryLengthAndAlignment) {
  EXPECT_EQ(vc::detail::crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(vc::detail::crc32c(0, "", 0), 0u);
  std::mt19937 rng(8u);
  std::vector<unsigned char> data(3 * 4096 * 3 + 64);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  const std::size_t lengths[] = {0,
                                 1,
                                 7,
                                 8,
                                 9,
                                 63,
                                 4095,
                                 4096,
                                 4097,
                                 3 * 4096 - 1,
                                 3 * 4096,
                                 3 * 4096 + 1,
                                 3 * 4096 + 8,
                                 6 * 4096 + 5,
                                 9 * 4096 + 17};
  for_each_level([&](vc::SimdLevel level) {
    for (const std::size_t n : lengths) {
      for (std::size_t off = 0; off < 8; ++off) {
        const std::uint32_t want = fmt::crc32c_bitwise(data.data() + off, n);
        ASSERT_EQ(vc::detail::crc32c(0, data.data() + off, n), want)
            << vc::simd_level_name(level) << " n=" << n << " off=" << off;
        const std::size_t cut = n / 3;
        ASSERT_EQ(vc::detail::crc32c(vc::detail::crc32c(0, data.data() + off, cut),
                                     data.data() + off + cut, n - cut),
                  want);
      }
    }
  });
}

}  // namespace
