// One memory cap over many sequences (SPEC 19, docs/design.md 10.5), through the public API:
// sequences arriving over time under one MemoryPool with every evicting method, quantized rows and
// adaptive heads; the cap after every call, the floors, fair shares; attaching (for_model, fork,
// load_prompt_cache) and leaving (release, destruction); refusals that change nothing; rollback
// and prompt caches in a pool. Threads sharing a pool: test_concurrency.cpp (under TSan in CI).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>
#include <veloxquant/cache/memory_pool.hpp>

#include "support/methods.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

using T = Eigen::half;
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

constexpr Index kB = 1, kH = 2, kD = 16;
constexpr int kLayers = 2;

/// One call with `S` tokens on every layer of `set` (random keys, values and queries).
void step(Caches& set, std::mt19937& rng, Index S) {
  for (auto& c : set) {
    const vc::Tensor4<T> k = random_tensor<T>(rng, kB, kH, S, kD);
    const vc::Tensor4<T> v = random_tensor<T>(rng, kB, kH, S, kD);
    const vc::Tensor4<float> q = random_queries(rng, kB, 2 * kH, S, kD);
    (void)c->attend(q, k, v);
  }
}

std::size_t kept(const std::vector<Caches>& sets) {
  std::size_t n = 0;
  for (const Caches& s : sets) {
    for (const auto& c : s) n += c->kept_bytes();
  }
  return n;
}

/// Bytes one row of one head takes (half keys and values).
constexpr std::size_t kRowBytes = 2 * kD * sizeof(T);

/// Bytes `rows` rows per head take over one set's layers and heads.
constexpr std::size_t layer_rows(std::size_t rows) { return kLayers * kB * kH * rows * kRowBytes; }

/// A configuration of `method` at budget `budget`.
vc::KVCacheConfig config_of(const std::string& method, int budget) {
  vc::KVCacheConfig c;
  c.method = method;
  c.set_budget(budget);
  return c;
}

/// The configurations the sweep runs: every evicting method at budget 48, then 8-bit token rows,
/// 4-bit channel keys and adaptive heads.
std::vector<std::pair<std::string, vc::KVCacheConfig>> configs() {
  std::vector<std::pair<std::string, vc::KVCacheConfig>> out;
  for (const Method m : kMethods) {
    if (m == Method::standard) continue;
    vc::KVCacheConfig c = config_of(method_name(m), 48);
    c.snap_obs_window = 4;
    out.emplace_back(c.method, c);
  }
  vc::KVCacheConfig q8 = config_of("h2o", 48);
  q8.key_bits = q8.value_bits = 8;
  q8.quant_group = 16;
  out.emplace_back("h2o+int8", q8);
  vc::KVCacheConfig ch = q8;
  ch.method = "squeeze";
  ch.key_bits = 4;
  ch.value_bits = 16;
  ch.key_axis = "channel";
  ch.quant_block = 8;
  ch.pool_floor_rows = 8;  // channel blocks claim a pending block and a table per row at most
  out.emplace_back("squeeze+k4channel", ch);
  vc::KVCacheConfig ad = config_of("h2o", 48);
  ad.head_budgets = "adaptive";
  ad.head_budget_floor = 0.25;
  out.emplace_back("h2o+adaptive", ad);
  return out;
}

/// Sequences arrive one every 12 steps (a 24-token prompt, then one token per step) under a cap
/// of three sequences' worth of 40 rows per head: after every call the pool holds at most its cap
/// and exactly what its caches keep; every head keeps its floor (or what it holds); no sequence
/// is dropped, and the older ones give rows up to the newer. Under both rules.
TEST(MemoryPoolTest, EverySequenceStaysUnderTheCapWithEveryEvictingMethod) {
  for (const auto rule : {vc::MemoryPool::Rule::fair_share, vc::MemoryPool::Rule::scores}) {
    for (const auto& [name, config] : configs()) {
      SCOPED_TRACE(name + (rule == vc::MemoryPool::Rule::scores ? ", scores" : ", fair shares"));
      const std::size_t cap = 3 * layer_rows(40);
      vc::MemoryPool pool(cap, rule);
      std::vector<Caches> sets;
      std::mt19937 rng(7);
      std::size_t first_before_fifth = 0;
      for (int t = 0; t < 60; ++t) {
        if (t % 12 == 0) {
          sets.push_back(vc::KVCacheBuilder::for_model<T>(kLayers, config, pool));
          step(sets.back(), rng, 24);
          ASSERT_LE(pool.used_bytes(), cap);
        }
        const std::size_t waiting = sets.size() - (t % 12 == 0 ? 1 : 0);  // not the newcomer
        for (std::size_t s = 0; s < waiting; ++s) {
          step(sets[s], rng, 1);
          ASSERT_LE(pool.used_bytes(), cap) << "step " << t << ", sequence " << s;
          ASSERT_EQ(pool.used_bytes(), kept(sets));
        }
        if (t == 47) {
          for (const auto& c : sets[0]) first_before_fifth += c->kept_bytes();
        }
      }
      EXPECT_EQ(pool.sequences(), 5U);
      // Every head keeps its floor, or what its own policy's budget keeps when that is less (a
      // PyramidKV layer's).
      const Index floor = config.pool_floor_rows + 4;  // every method's sinks default to 4
      for (const Caches& s : sets) {
        for (const auto& c : s) {
          const Index least =
              c->layer_budget() > 0 ? std::min<Index>(floor, c->layer_budget()) : floor;
          for (Index h = 0; h < kH; ++h) EXPECT_GE(c->head_rows(0, h), least);
        }
      }
      // The fifth sequence took rows from the first.
      std::size_t first_now = 0;
      for (const auto& c : sets[0]) first_now += c->kept_bytes();
      EXPECT_LT(first_now, first_before_fifth);
    }
  }
}

/// The scores rule under prompts that outgrow the cap at once: its ranks may run out (the heads'
/// newest rows are protected; a channel block's table outlives its rows) before the pool is back
/// under its cap, or take more rounds than it runs, and then fair shares take the rest. (Found by
/// the fuzz target `pool`.)
TEST(MemoryPoolTest, TheScoresRuleKeepsTheCapWhenItsRanksRunOut) {
  for (const char* kind : {"h2o+k4channel", "squeeze+adaptive"}) {
    for (int budget = 8; budget <= 32; budget += 8) {
      SCOPED_TRACE(std::string(kind) + ", budget " + std::to_string(budget));
      vc::KVCacheConfig config = config_of(kind[0] == 'h' ? "h2o" : "squeeze", budget);
      config.pool_floor_rows = 2;
      if (kind[0] == 'h') {
        config.key_bits = 4;
        config.key_axis = "channel";
        config.quant_block = 8;
      } else {
        config.head_budgets = "adaptive";
        config.head_budget_floor = 0.25;
      }
      const std::size_t cap = layer_rows(16);
      vc::MemoryPool pool(cap, vc::MemoryPool::Rule::scores);
      std::mt19937 rng(29);
      Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
      for (const Index S : {11, 10, 12, 9, 1, 1}) {
        step(a, rng, S);
        ASSERT_LE(pool.used_bytes(), cap) << "after " << S << " tokens";
      }
    }
  }
  // Newest rows protected almost up to the head's size (grace 190): each round of the scores
  // rule finds one candidate a head, so its 64 rounds cannot take the 130 rows that must go, and
  // fair shares take them.
  vc::KVCacheConfig config = config_of("h2o", 200);
  config.h2o_grace = 190;
  config.pool_floor_rows = 0;
  const std::size_t cap = layer_rows(20);
  vc::MemoryPool pool(cap, vc::MemoryPool::Rule::scores);
  std::mt19937 rng(31);
  Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(a, rng, 150);
  EXPECT_LE(pool.used_bytes(), cap);
  for (const auto& c : a) EXPECT_GE(c->tokens_kept(), 4);  // the sinks: the floor
}

/// Fair shares: sequences of one model and method, stepped in turn, end every round with their
/// heads within one row of each other (the water-fill's one limit), whatever their ages.
TEST(MemoryPoolTest, FairSharesGiveEveryHeadTheSameRows) {
  vc::KVCacheConfig config = config_of("h2o", 200);
  const std::size_t cap = 4 * layer_rows(50);
  vc::MemoryPool pool(cap);
  std::vector<Caches> sets;
  std::mt19937 rng(3);
  for (int s = 0; s < 4; ++s) {
    sets.push_back(vc::KVCacheBuilder::for_model<T>(kLayers, config, pool));
    step(sets.back(), rng, 30 + 40 * s);
  }
  for (int t = 0; t < 30; ++t) {
    for (Caches& s : sets) step(s, rng, 1);
  }
  std::int64_t lo = 1 << 30, hi = 0;
  for (const Caches& s : sets) {
    for (const auto& c : s) {
      for (Index h = 0; h < kH; ++h) {
        lo = std::min(lo, c->head_rows(0, h));
        hi = std::max(hi, c->head_rows(0, h));
      }
    }
  }
  EXPECT_LE(hi - lo, 1);
  EXPECT_GE(lo, 48);  // 50 rows a head fit; the one being stepped holds one more until it ends
  EXPECT_LE(pool.used_bytes(), cap);
}

/// Floors that do not fit: a set whose first call would claim more than the cap leaves beside
/// the others' floors throws std::length_error, and neither it nor the pool changes; a fork and
/// a load that do not fit attach nothing; for_model alone throws when not even its lower bound
/// fits.
TEST(MemoryPoolTest, FloorsThatDoNotFitThrowLengthErrorAndChangeNothing) {
  vc::KVCacheConfig config = config_of("tova", 64);
  const std::size_t floor = layer_rows(20);  // (16 + 4 sinks) rows a head
  vc::MemoryPool pool(floor + floor / 2);
  std::mt19937 rng(5);
  Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(a, rng, 40);
  EXPECT_EQ(pool.floor_bytes(), floor);
  const std::size_t used = pool.used_bytes();
  Caches b = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  EXPECT_EQ(pool.sequences(), 2U);
  // Until its first call b claims a lower bound only (one head of dim 1 per layer).
  const std::size_t claimed = pool.floor_bytes();
  EXPECT_EQ(claimed, floor + kLayers * 20 * 2 * sizeof(T));
  const vc::Tensor4<T> k = random_tensor<T>(rng, kB, kH, 8, kD);
  try {
    (void)b[0]->update_and_fetch(k, k);
    FAIL() << "no std::length_error";
  } catch (const std::length_error& e) {
    EXPECT_NE(std::string(e.what()).find("above its cap"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b[0]->offset(), 0);
  EXPECT_EQ(b[0]->kept_bytes(), 0U);
  EXPECT_EQ(pool.used_bytes(), used);
  EXPECT_EQ(pool.floor_bytes(), claimed);
  // A fork of `a` would claim a's floors again.
  EXPECT_THROW((void)vc::KVCacheBuilder::fork(a, pool), std::length_error);
  EXPECT_THROW((void)vc::KVCacheBuilder::fork(a), std::length_error);  // (joins a's pool)
  std::stringstream file;
  vc::save_prompt_cache(file, a);
  EXPECT_THROW((void)vc::load_prompt_cache<T>(file, pool), std::length_error);
  EXPECT_EQ(pool.used_bytes(), used);
  EXPECT_EQ(pool.floor_bytes(), claimed);
  EXPECT_EQ(pool.sequences(), 2U);
  // b leaves with its claim; once a leaves too, a fork of it fits.
  b.clear();
  EXPECT_EQ(pool.floor_bytes(), floor);
  pool.release(a);
  EXPECT_EQ(pool.floor_bytes(), 0U);
  Caches c = vc::KVCacheBuilder::fork(a, pool);
  EXPECT_EQ(pool.floor_bytes(), floor);
  EXPECT_LE(pool.used_bytes(), pool.max_bytes());
  vc::MemoryPool tiny(10);
  EXPECT_THROW((void)vc::KVCacheBuilder::for_model<T>(kLayers, config, tiny), std::length_error);
  EXPECT_EQ(tiny.sequences(), 0U);
}

/// A first call refused for its input names the input, not the pool, and claims nothing.
TEST(MemoryPoolTest, ARefusedFirstCallClaimsNoFloor) {
  vc::KVCacheConfig config;
  config.method = "h2o";
  vc::MemoryPool pool(1 << 20);
  Caches a = vc::KVCacheBuilder::for_model<T>(1, config, pool);
  const std::size_t provisional = pool.floor_bytes();
  vc::Tensor4<T> k(1, 2, 3, 16), v(1, 2, 4, 16);  // S differs
  k.setZero();
  v.setZero();
  EXPECT_THROW((void)a[0]->update_and_fetch(k, v), std::invalid_argument);
  EXPECT_EQ(pool.floor_bytes(), provisional);
  EXPECT_EQ(a[0]->offset(), 0);
}

/// Standard caches never evict: the standard method cannot join; a model's non-attention layers
/// (standard caches in an evicting set) stay outside while its other layers join.
TEST(MemoryPoolTest, StandardCachesCannotJoin) {
  vc::MemoryPool pool(1 << 20);
  vc::KVCacheConfig standard;
  standard.method = "standard";
  try {
    (void)vc::KVCacheBuilder::for_model<T>(2, standard, pool);
    FAIL() << "no std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'standard'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.sequences(), 0U);
  vc::KVCacheConfig h2o;
  h2o.method = "h2o";
  Caches set = vc::KVCacheBuilder::for_model<T>(
      std::vector<std::optional<int>>{16, std::nullopt, 16}, h2o, pool);
  EXPECT_TRUE(set[0]->in_pool());
  EXPECT_FALSE(set[1]->in_pool());
  EXPECT_TRUE(set[2]->in_pool());
  EXPECT_EQ(pool.sequences(), 1U);
  EXPECT_THROW(pool.attach(set, "test"), std::invalid_argument);  // attached already
}

/// release() and destruction return a set's bytes and floors; a released set works on,
/// unlimited; a pool destroyed before its caches leaves them working.
TEST(MemoryPoolTest, ReleaseAndDestructionReturnTheBytes) {
  vc::KVCacheConfig config = config_of("h2o", 64);
  std::mt19937 rng(9);
  auto pool = std::make_unique<vc::MemoryPool>(2 * layer_rows(30));
  Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, *pool);
  Caches b = vc::KVCacheBuilder::for_model<T>(kLayers, config, *pool);
  step(a, rng, 40);
  step(b, rng, 40);
  const std::size_t both = pool->used_bytes();
  EXPECT_EQ(both,
            a[0]->kept_bytes() + a[1]->kept_bytes() + b[0]->kept_bytes() + b[1]->kept_bytes());
  pool->release(a);
  EXPECT_FALSE(a[0]->in_pool());
  EXPECT_EQ(pool->sequences(), 1U);
  EXPECT_EQ(pool->used_bytes(), b[0]->kept_bytes() + b[1]->kept_bytes());
  step(a, rng, 40);  // unlimited now: the policy's budget alone
  EXPECT_EQ(a[0]->max_head_rows(), 64);
  b.clear();
  EXPECT_EQ(pool->used_bytes(), 0U);
  EXPECT_EQ(pool->floor_bytes(), 0U);
  EXPECT_EQ(pool->sequences(), 0U);
  Caches c = vc::KVCacheBuilder::for_model<T>(kLayers, config, *pool);
  step(c, rng, 10);
  pool.reset();
  step(c, rng, 10);  // the pool's state outlives its handle while caches hold it
  EXPECT_TRUE(c[0]->in_pool());
}

/// A fork's children share their source's pool, and the cap holds as they diverge.
TEST(MemoryPoolTest, ForkChildrenShareThePool) {
  vc::KVCacheConfig config = config_of("squeeze", 64);
  const std::size_t cap = 2 * layer_rows(50);
  vc::MemoryPool pool(cap);
  std::mt19937 rng(11);
  Caches root = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(root, rng, 80);
  std::vector<Caches> children;
  for (int i = 0; i < 3; ++i) children.push_back(vc::KVCacheBuilder::fork(root));
  EXPECT_EQ(pool.sequences(), 4U);
  EXPECT_LE(pool.used_bytes(), cap);
  for (int t = 0; t < 20; ++t) {
    for (Caches& c : children) {
      step(c, rng, 1);
      ASSERT_LE(pool.used_bytes(), cap);
    }
  }
  for (const Caches& c : children) EXPECT_TRUE(c[0]->in_pool());
}

/// Rollback in a pool: a checkpointed set the pool takes rows from still returns to its
/// checkpoint when there is room, and the cap holds after a rollback when there is not.
TEST(MemoryPoolTest, RollbackReturnsToTheCheckpointAndKeepsTheCap) {
  vc::KVCacheConfig config = config_of("h2o", 64);
  const std::size_t cap = 2 * layer_rows(40);
  vc::MemoryPool pool(cap);
  std::mt19937 rng(13);
  Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(a, rng, 60);
  vc::KVCacheBuilder::checkpoint(a);
  std::vector<std::vector<std::int64_t>> marked;
  for (const auto& c : a) marked.push_back(c->positions(0, 1));
  step(a, rng, 3);
  Caches b = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(b, rng, 60);  // takes rows from a
  EXPECT_LT(a[0]->max_head_rows(), static_cast<std::int64_t>(marked[0].size()));
  vc::KVCacheBuilder::rollback(a);
  EXPECT_LE(pool.used_bytes(), cap);
  vc::KVCacheBuilder::checkpoint(a);
  pool.release(b);
  b.clear();
  vc::KVCacheBuilder::rollback(a);
  for (std::size_t l = 0; l < a.size(); ++l) {
    EXPECT_LE(a[l]->positions(0, 1).size(), marked[l].size());
  }
  // With the room back, a checkpoint taken before the pool bound comes back whole.
  Caches c = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(c, rng, 20);
  vc::KVCacheBuilder::checkpoint(c);
  const std::vector<std::int64_t> before = c[0]->positions(0, 0);
  step(c, rng, 2);
  vc::KVCacheBuilder::rollback(c);
  EXPECT_EQ(c[0]->positions(0, 0), before);
  EXPECT_LE(pool.used_bytes(), cap);
}

/// A prompt cache loads into a pool: its floors are claimed at once (its shape is known) and its
/// rows counted; under a binding cap the loaded set gives rows up as any other.
TEST(MemoryPoolTest, PromptCachesLoadIntoThePool) {
  vc::KVCacheConfig config = config_of("snapkv", 48);
  config.snap_obs_window = 4;
  std::mt19937 rng(17);
  Caches src = vc::KVCacheBuilder::for_model<T>(kLayers, config);
  step(src, rng, 80);
  std::stringstream file;
  vc::save_prompt_cache(file, src);
  const std::size_t cap = layer_rows(70);
  vc::MemoryPool pool(cap);
  Caches other = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(other, rng, 40);
  vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file, pool);
  EXPECT_EQ(pool.sequences(), 2U);
  EXPECT_EQ(pool.floor_bytes(), 2 * layer_rows(20));
  EXPECT_LE(pool.used_bytes(), cap);
  EXPECT_EQ(pool.used_bytes(), other[0]->kept_bytes() + other[1]->kept_bytes() +
                                   loaded.caches[0]->kept_bytes() + loaded.caches[1]->kept_bytes());
  EXPECT_LT(loaded.caches[0]->max_head_rows(), src[0]->max_head_rows());
}

/// What a pool cut still saves and loads: a SnapKV set never compressed by its own budget, a
/// KVzip set never observed (both marked compressed by the cut), and a KeyDiff set, which a tight
/// pool cuts at once when it loads (ranked by its scores: a loaded head has no key sum yet).
TEST(MemoryPoolTest, SetsThePoolCutSaveAndLoad) {
  for (const char* method : {"snapkv", "kvzip", "h2o"}) {
    SCOPED_TRACE(method);
    vc::KVCacheConfig config = config_of(method, 500);
    config.proxy_scoring = "keydiff";
    const std::size_t cap = 2 * layer_rows(30);
    vc::MemoryPool pool(cap);
    std::mt19937 rng(23);
    Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
    Caches b = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
    for (Caches* s : {&a, &b}) {
      for (auto& c : *s) {  // no queries: KeyDiff ranks h2o's rows
        const vc::Tensor4<T> k = random_tensor<T>(rng, kB, kH, 50, kD);
        (void)c->update_and_view(k, k);
      }
    }
    ASSERT_LE(pool.used_bytes(), cap);
    ASSERT_LT(a[0]->max_head_rows(), 50);
    std::stringstream file;
    vc::save_prompt_cache(file, a);
    const std::string bytes = file.str();
    std::istringstream in(bytes);
    const vc::PromptCache<T> plain = vc::load_prompt_cache<T>(in);
    EXPECT_EQ(plain.caches[0]->max_head_rows(), a[0]->max_head_rows());
    vc::MemoryPool tight(layer_rows(24));
    std::istringstream again(bytes);
    vc::PromptCache<T> cut = vc::load_prompt_cache<T>(again, tight);
    EXPECT_LE(tight.used_bytes(), tight.max_bytes());
    EXPECT_LT(cut.caches[0]->max_head_rows(), a[0]->max_head_rows());
    step(cut.caches, rng, 1);
    EXPECT_LE(tight.used_bytes(), tight.max_bytes());
  }
}

/// The pool_floor_rows field: validated, saved with the config (prompt-cache format 7), and
/// what heads keep at least.
TEST(MemoryPoolTest, PoolFloorRowsIsWhatHeadsKeep) {
  vc::KVCacheConfig bad;
  bad.method = "h2o";
  bad.pool_floor_rows = -1;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  vc::KVCacheConfig config = config_of("streaming_llm", 64);
  config.pool_floor_rows = 30;
  const std::size_t cap = 2 * layer_rows(40);
  vc::MemoryPool pool(cap);
  std::mt19937 rng(19);
  Caches a = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  Caches b = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  step(a, rng, 60);
  step(b, rng, 60);
  for (const Caches* s : {&a, &b}) {
    for (const auto& c : *s) EXPECT_EQ(c->tokens_kept(), 40);  // the fair share
  }
  // A set of a lower floor (4 rows) grows: the common limit falls to 12 rows, below the others'
  // floors of 34, which they keep; the newcomer gets what is left.
  vc::KVCacheConfig low = config;
  low.pool_floor_rows = 0;
  Caches c = vc::KVCacheBuilder::for_model<T>(kLayers, low, pool);
  step(c, rng, 40);
  EXPECT_LE(pool.used_bytes(), cap);
  for (const Caches* s : {&a, &b}) {
    for (const auto& layer : *s) EXPECT_EQ(layer->tokens_kept(), 34);
  }
  for (const auto& layer : c) EXPECT_EQ(layer->tokens_kept(), 12);
  std::stringstream file;
  vc::save_prompt_cache(file, a);
  vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
  EXPECT_EQ(loaded.caches[0]->config().pool_floor_rows, 30);
}

}  // namespace
