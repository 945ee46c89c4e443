// Concurrency (docs/design.md 2.4: "all methods are thread-safe: layers may run on different
// threads"; docs/design.md 7: results identical to a serial run). Built and run under
// ThreadSanitizer by scripts/sanitize.sh.
//
//  * The layers of one model (KVCacheBuilder::for_model, squeeze with the shared coordinator, with
//    and without squeeze_defer), each driven from its own std::thread through prefill and decode
//    while the coordinator finalises, give bitwise the results of a serial run with the same
//    adoption schedule, and every layer ends on the budget a serial run gives it.
//  * Independent caches of every policy updated from several threads at once equal serial twins.
//  * One coordinator read from many threads while layers report stays consistent.
//
// Every cache here runs with set_parallel_heads(false) unless a test says otherwise: the point is
// std::thread concurrency between caches. The lanes test also runs some caches with their heads
// spread over a parallel-for of 3 std::threads of their own, inside the threads.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <veloxquant/cache.hpp>
#include <veloxquant/cache/memory_pool.hpp>

#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using Index = Eigen::Index;
using Blob = std::vector<unsigned char>;
using veloxquant::test::Kind;
using veloxquant::test::StorageTypes;
using veloxquant::test::Wiring;

// ---------------------------------------------------------------------------------------------
// Recording what a call returns
// ---------------------------------------------------------------------------------------------

template <class X>
void put(Blob& out, const X* p, std::size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  out.insert(out.end(), b, b + n * sizeof(X));
}
template <class X>
void put_value(Blob& out, const X& x) {
  put(out, &x, 1);
}

/// The shape and bytes of a tensor. t: [B, H, n, D]
template <class T>
void put_tensor(Blob& out, const vc::Tensor4<T>& t) {
  for (int i = 0; i < 4; ++i) put_value(out, t.dimension(i));
  put(out, t.data(), static_cast<std::size_t>(t.size()));
}

/// Everything a view shows, in its own row order.
template <class T>
void put_view(Blob& out, const vc::KVView<T>& v) {
  put_value(out, v.rows());
  put_value(out, v.new_rows());
  for (Index b = 0; b < v.batch(); ++b) {
    for (Index h = 0; h < v.heads(); ++h) {
      const auto k = v.keys(b, h);
      const auto val = v.values(b, h);
      const auto pos = v.positions(b, h);
      for (Index r = 0; r < v.rows(); ++r) {
        put(out, k.row(r).data(), static_cast<std::size_t>(v.key_dim()));
        put(out, val.row(r).data(), static_cast<std::size_t>(v.value_dim()));
        put_value(out, pos(r));
      }
    }
  }
}

/// What a cache reports about itself after a call: accounting, budget and adoption, and for the
/// scored policies every head's scores and positions.
template <class T>
void put_cache_state(Blob& out, const vc::KVCache<T>& c) {
  put_value(out, c.offset());
  put_value(out, c.kept_bytes());
  put_value(out, c.full_seq_bytes());
  put_value(out, c.tokens_seen());
  put_value(out, c.tokens_kept());
  veloxquant::test::visit_scored(c, [&](const auto& scored) {
    for (Index b = 0; b < c.batch(); ++b) {
      for (Index h = 0; h < c.heads(); ++h) {
        const std::vector<float> s = scored.scores(b, h);
        const std::vector<std::int64_t> p = scored.positions(b, h);
        put(out, s.data(), s.size());
        put(out, p.data(), p.size());
      }
    }
  });
  veloxquant::test::visit_core(c, [&](const auto& core) {
    put_value(out, core.budget().value_or(-1));
    put_value(out, core.protected_recent());
  });
  if (const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&c)) {
    put_value(out, sq->layer_budget());
    put_value(out, sq->budget_adopted());
    put_value(out, sq->concentration());
  }
}

// ---------------------------------------------------------------------------------------------
// One call of a plan, through one of the APIs
// ---------------------------------------------------------------------------------------------

enum class Api { kFetch, kView, kFetchInto };

struct CallSpec {
  Index S;
  Api api;
  bool queries;  // pass real queries (G = 2) with the call
};

/// The inputs of one call. keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, 2H, S, Dk]
template <class T>
struct CallInput {
  CallSpec spec;
  vc::Tensor4<T> keys, values;
  vc::Tensor4<float> queries;
};

/// Runs one call on `cache` and appends what it returned and the cache's state to `out`.
/// `into` is the caller-owned output reused by update_and_fetch_into.
template <class T>
void run_call(vc::KVCache<T>& cache, const CallInput<T>& in, vc::KVPair<T>& into, Blob& out) {
  switch (in.spec.api) {
    case Api::kFetch: {
      const vc::KVPair<T> r = in.spec.queries
                                  ? cache.update_and_fetch(in.keys, in.values, in.queries)
                                  : cache.update_and_fetch(in.keys, in.values);
      put_tensor(out, r.first);
      put_tensor(out, r.second);
      break;
    }
    case Api::kView: {
      const vc::KVView<T> v = in.spec.queries
                                  ? cache.update_and_view(in.keys, in.values, in.queries)
                                  : cache.update_and_view(in.keys, in.values);
      put_view(out, v);
      break;
    }
    case Api::kFetchInto: {
      if (in.spec.queries) {
        cache.update_and_fetch_into(in.keys, in.values, in.queries, into);
      } else {
        cache.update_and_fetch_into(in.keys, in.values, into);
      }
      put_tensor(out, into.first);
      put_tensor(out, into.second);
      break;
    }
  }
  put_cache_state(out, cache);
}

/// Keys alpha * e_0 + N(0, 1) (larger alpha: more concentrated), values N(0, 1), queries N(0, 1)
/// for every call of `plan`.
template <class T>
std::vector<CallInput<T>> make_inputs(const std::vector<CallSpec>& plan, Index B, Index H, Index Dk,
                                      Index Dv, double alpha, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<CallInput<T>> out;
  for (const CallSpec& spec : plan) {
    CallInput<T> in{spec, vc::Tensor4<T>(B, H, spec.S, Dk), vc::Tensor4<T>(B, H, spec.S, Dv),
                    vc::Tensor4<float>(B, 2 * H, spec.S, Dk)};
    for (Index i = 0; i < in.keys.size(); ++i) {
      const double shift = (i % Dk == 0) ? alpha : 0.0;
      in.keys.data()[i] = static_cast<T>(shift + normal(rng));
    }
    for (Index i = 0; i < in.values.size(); ++i) in.values.data()[i] = static_cast<T>(normal(rng));
    for (Index i = 0; i < in.queries.size(); ++i) {
      in.queries.data()[i] = static_cast<float>(normal(rng));
    }
    out.push_back(std::move(in));
  }
  return out;
}

/// Index of the first call whose records differ, or -1.
long first_difference(const std::vector<Blob>& a, const std::vector<Blob>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<long>(n);
}

/// Spins until `count` reaches `target` (a start line / barrier for a few threads).
void arrive_and_wait(std::atomic<int>& count, int target) {
  count.fetch_add(1);
  while (count.load() < target) std::this_thread::yield();
}

// ---------------------------------------------------------------------------------------------
// (a) The layers of one model on their own threads
// ---------------------------------------------------------------------------------------------

constexpr int kAvgBudget = 20;
constexpr int kSinks = 2;

/// Prefill over the budget, then decode steps and short multi-token calls through every API,
/// with and without queries. The last call runs after every thread has joined (see below).
std::vector<CallSpec> layer_plan() {
  std::vector<CallSpec> plan = {{36, Api::kFetch, false},    {1, Api::kView, false},
                                {1, Api::kFetchInto, false}, {3, Api::kFetch, true},
                                {1, Api::kView, true},       {2, Api::kFetchInto, false}};
  for (int i = 0; i < 10; ++i) {
    plan.push_back({1, static_cast<Api>(i % 3), i % 4 == 1});
  }
  plan.push_back({1, Api::kFetch, false});  // after the join
  return plan;
}

/// Head dims of the model: six layers, layer 2 without attention (a standard cache), the others
/// with different head dims; the squeeze layer ids are the raw indices 0, 1, 3, 4, 5.
const std::vector<std::optional<int>> kHeadDims = {8, 4, std::nullopt, 8, 16, 6};
constexpr Index kB = 2, kH = 2;

vc::KVCacheConfig model_config(bool defer) {
  vc::KVCacheConfig c;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  c.method = "squeeze";
  c.squeeze_budget = kAvgBudget;
  c.squeeze_n_sink = kSinks;
  c.squeeze_strength = 1.0;
  c.squeeze_defer = defer;
  return c;
}

template <class T>
std::vector<std::unique_ptr<vc::KVCache<T>>> build_model(bool defer) {
  auto caches = vc::KVCacheBuilder::for_model<T>(kHeadDims, model_config(defer));
  for (auto& c : caches) c->set_parallel_heads(false);  // one thread per layer, heads serial
  return caches;
}

template <class T>
vc::SqueezeAttentionCache<T>* as_squeeze(const std::unique_ptr<vc::KVCache<T>>& c) {
  return dynamic_cast<vc::SqueezeAttentionCache<T>*>(c.get());
}

/// Inputs of every layer for one round: deeper layers get more concentrated keys, so the
/// coordinator gives the layers different budgets.
template <class T>
std::vector<std::vector<CallInput<T>>> model_inputs(unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<CallInput<T>>> out;
  for (std::size_t l = 0; l < kHeadDims.size(); ++l) {
    const Index d = kHeadDims[l].value_or(8);
    out.push_back(
        make_inputs<T>(layer_plan(), kB, kH, d, d + 1, 0.6 * static_cast<double>(l), rng));
  }
  return out;
}

enum class Schedule {
  kFree,                 // every thread runs its calls as fast as it can, yielding now and then
  kBarrierAfterPrefill,  // every layer prefills, then all decode (the usual engine order)
};

/// One round of the model driven by one thread per layer. Returns each layer's records; sets
/// `adopted_at[l]` to the index of the call in which squeeze layer l adopted its budget (-1: not
/// during the threaded calls). The plan's last call runs from this thread after the join.
template <class T>
std::vector<std::vector<Blob>> threaded_round(std::vector<std::unique_ptr<vc::KVCache<T>>>& caches,
                                              const std::vector<std::vector<CallInput<T>>>& inputs,
                                              Schedule schedule, unsigned seed,
                                              std::vector<int>& adopted_at) {
  const std::size_t L = caches.size();
  std::vector<std::vector<Blob>> records(L);
  adopted_at.assign(L, -1);
  std::atomic<int> start{0};
  std::atomic<int> prefilled{0};
  const int n_threads = static_cast<int>(L);
  std::vector<std::thread> threads;
  for (std::size_t l = 0; l < L; ++l) {
    threads.emplace_back([&, l] {
      std::mt19937 jitter(seed + static_cast<unsigned>(l));
      vc::KVCache<T>& cache = *caches[l];
      auto* sq = as_squeeze(caches[l]);
      vc::KVPair<T> into;
      arrive_and_wait(start, n_threads);
      const std::size_t threaded_calls = inputs[l].size() - 1;
      for (std::size_t i = 0; i < threaded_calls; ++i) {
        if (schedule == Schedule::kBarrierAfterPrefill && i == 1) {
          arrive_and_wait(prefilled, n_threads);
        }
        records[l].emplace_back();
        run_call(cache, inputs[l][i], into, records[l].back());
        if (sq != nullptr && adopted_at[l] < 0 && sq->budget_adopted()) {
          adopted_at[l] = static_cast<int>(i);
        }
        if (schedule == Schedule::kFree && jitter() % 3 == 0) std::this_thread::yield();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t l = 0; l < L; ++l) {
    vc::KVPair<T> into;
    records[l].emplace_back();
    run_call(*caches[l], inputs[l].back(), into, records[l].back());
  }
  return records;
}

/// The same round run serially, reproducing the adoption schedule of a threaded round: every
/// layer first makes the calls it made before it saw the budgets; then the layers that adopted in
/// their very first call (they saw the coordinator finalise) are reported directly, which
/// finalises it; then every layer makes its remaining calls. Each layer's calls are in order.
template <class T>
std::vector<std::vector<Blob>> serial_round(std::vector<std::unique_ptr<vc::KVCache<T>>>& caches,
                                            const std::vector<std::vector<CallInput<T>>>& inputs,
                                            const std::vector<int>& adopted_at,
                                            const std::map<int, double>& concentrations) {
  const std::size_t L = caches.size();
  std::vector<std::vector<Blob>> records(L);
  std::vector<vc::KVPair<T>> into(L);
  std::vector<std::size_t> done(L, 0);
  std::shared_ptr<vc::SqueezeCoordinator> coord;
  for (const auto& c : caches) {
    if (auto* sq = as_squeeze(c)) coord = sq->coordinator();
  }
  const auto call = [&](std::size_t l) {
    records[l].emplace_back();
    run_call(*caches[l], inputs[l][done[l]], into[l], records[l].back());
    ++done[l];
  };
  const std::size_t threaded_calls = inputs.front().size() - 1;
  for (std::size_t l = 0; l < L; ++l) {
    const bool squeeze = as_squeeze(caches[l]) != nullptr;
    const std::size_t before =
        !squeeze || adopted_at[l] < 0 ? threaded_calls : static_cast<std::size_t>(adopted_at[l]);
    while (done[l] < before) call(l);
  }
  EXPECT_FALSE(coord->is_finalized()) << "finalised before the first-call adopters reported";
  for (std::size_t l = 0; l < L; ++l) {
    if (adopted_at[l] == 0)
      coord->report_concentration(static_cast<int>(l), concentrations.at(static_cast<int>(l)));
  }
  EXPECT_TRUE(coord->is_finalized());
  for (std::size_t l = 0; l < L; ++l) {
    while (done[l] < threaded_calls) call(l);
  }
  for (std::size_t l = 0; l < L; ++l) call(l);  // the call made after the join
  return records;
}

/// The engine's own serial order: each call index through every layer in layer order.
template <class T>
std::map<int, int> engine_order_budgets(const std::vector<std::vector<CallInput<T>>>& inputs,
                                        bool defer) {
  auto caches = build_model<T>(defer);
  std::vector<vc::KVPair<T>> into(caches.size());
  for (std::size_t i = 0; i < inputs.front().size(); ++i) {
    for (std::size_t l = 0; l < caches.size(); ++l) {
      Blob ignored;
      run_call(*caches[l], inputs[l][i], into[l], ignored);
    }
  }
  std::map<int, int> budgets;
  for (std::size_t l = 0; l < caches.size(); ++l) {
    if (auto* sq = as_squeeze(caches[l])) {
      EXPECT_TRUE(sq->budget_adopted()) << "serial layer " << l;
      budgets[static_cast<int>(l)] = sq->layer_budget();
    }
  }
  return budgets;
}

template <class T>
void run_model_rounds(bool defer, Schedule schedule, unsigned seed) {
  auto threaded = build_model<T>(defer);
  auto serial = build_model<T>(defer);
  std::shared_ptr<vc::SqueezeCoordinator> coord = as_squeeze(threaded.front())->coordinator();
  ASSERT_NE(coord, nullptr);
  ASSERT_EQ(coord->n_layers(), 5);
  constexpr int kRounds = 6;
  std::map<int, int> first_round_budgets;
  for (int round = 0; round < kRounds; ++round) {
    const std::string ctx = "defer=" + std::to_string(defer) +
                            " schedule=" + std::to_string(static_cast<int>(schedule)) + " round " +
                            std::to_string(round);
    // Rounds 0-2 replay the same data (the coordinator and caches are reset between rounds), the
    // others bring new data.
    const unsigned data_seed = seed + static_cast<unsigned>(round < 3 ? 0 : round);
    const auto inputs = model_inputs<T>(data_seed);
    ASSERT_EQ(coord->generation(), static_cast<std::uint64_t>(round)) << ctx;

    std::vector<int> adopted_at;
    const auto got = threaded_round(threaded, inputs, schedule,
                                    seed * 31u + static_cast<unsigned>(round), adopted_at);

    // Every attention layer reported once, finalised the coordinator and adopted its budget.
    ASSERT_TRUE(coord->is_finalized()) << ctx;
    const std::map<int, double> reports = coord->reports();
    ASSERT_EQ(reports.size(), 5u) << ctx;
    std::vector<double> cs;
    for (const auto& [id, c] : reports) cs.push_back(c);
    const std::vector<int> expected = vc::squeeze_budgets(cs, kAvgBudget, kSinks, 1.0);
    std::map<int, int> budgets;
    int first_call_adopters = 0;
    std::size_t k = 0;
    for (const auto& [id, c] : reports) {
      auto* sq = as_squeeze(threaded[static_cast<std::size_t>(id)]);
      ASSERT_NE(sq, nullptr) << ctx << " layer " << id;
      EXPECT_EQ(sq->concentration(), c) << ctx << " layer " << id;
      EXPECT_TRUE(sq->budget_adopted()) << ctx << " layer " << id;
      EXPECT_EQ(sq->layer_budget(), expected[k]) << ctx << " layer " << id;
      EXPECT_EQ(coord->resolved_budget(id), std::optional<int>(expected[k])) << ctx;
      budgets[id] = sq->layer_budget();
      if (adopted_at[static_cast<std::size_t>(id)] == 0) ++first_call_adopters;
      ++k;
    }
    // docs/design.md 5.4.3: the call that completes the set adopts before absorbing.
    EXPECT_GE(first_call_adopters, 1) << ctx;
    EXPECT_EQ(as_squeeze(threaded[2]), nullptr);
    EXPECT_EQ(engine_order_budgets<T>(inputs, defer), budgets) << ctx;
    if (round == 0) first_round_budgets = budgets;
    if (round < 3) {
      EXPECT_EQ(budgets, first_round_budgets) << ctx;
    }

    // Bitwise the same as the serial run with the same adoption schedule.
    const auto want = serial_round(serial, inputs, adopted_at, reports);
    for (std::size_t l = 0; l < threaded.size(); ++l) {
      const long diff = first_difference(got[l], want[l]);
      EXPECT_EQ(diff, -1) << ctx << ": layer " << l << " (adopted at call " << adopted_at[l]
                          << ") differs from the serial run at call " << diff;
    }
    vc::KVCacheBuilder::reset(threaded);
    vc::KVCacheBuilder::reset(serial);
  }
}

template <class T>
class ConcurrencyModelTest : public ::testing::Test {};
TYPED_TEST_SUITE(ConcurrencyModelTest, StorageTypes);

TYPED_TEST(ConcurrencyModelTest, LayersOnThreadsEqualSerialRunWhileCoordinatorFinalises) {
  run_model_rounds<TypeParam>(false, Schedule::kFree, 11u);
  run_model_rounds<TypeParam>(false, Schedule::kBarrierAfterPrefill, 12u);
}

TYPED_TEST(ConcurrencyModelTest, DeferringLayersOnThreadsEqualSerialRunWhileCoordinatorFinalises) {
  run_model_rounds<TypeParam>(true, Schedule::kFree, 21u);
  run_model_rounds<TypeParam>(true, Schedule::kBarrierAfterPrefill, 22u);
}

/// With the engine's order (every layer prefills before any decodes), exactly the layers that saw
/// the coordinator finalise in their prefill adopt there; the others adopt at their first decode
/// step, and a deferring layer evicts nothing before it adopts.
TYPED_TEST(ConcurrencyModelTest, AfterAPrefillBarrierEveryLayerAdoptsByItsSecondCall) {
  using T = TypeParam;
  for (const bool defer : {false, true}) {
    auto caches = build_model<T>(defer);
    const auto inputs = model_inputs<T>(99u);
    std::vector<int> adopted_at;
    (void)threaded_round(caches, inputs, Schedule::kBarrierAfterPrefill, 5u, adopted_at);
    for (std::size_t l = 0; l < caches.size(); ++l) {
      if (as_squeeze(caches[l]) == nullptr) continue;
      EXPECT_TRUE(adopted_at[l] == 0 || adopted_at[l] == 1)
          << "defer=" << defer << " layer " << l << " adopted at call " << adopted_at[l];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// (b) Independent caches of every method on several threads
// ---------------------------------------------------------------------------------------------

/// Caches of budget 12 and 2 sinks (StreamingLLM: a window of 10 beside them) of every subject of
/// kKinds but the query-free scorers' (support/methods.hpp); a wired squeeze layer gets its own
/// coordinator (coordinated: 1 layer, average 9; deferring: 2 layers, average 12, waiting for a
/// layer that never reports).
template <class T>
std::unique_ptr<vc::KVCache<T>> make_lane_cache(Kind kind,
                                                std::shared_ptr<vc::SqueezeCoordinator>& coord) {
  vc::KVCacheConfig c;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  veloxquant::test::set_n_sinks(c, 2);
  c.set_budget(12);
  c.h2o_grace = 3;
  c.snap_obs_window = 4;
  if (kind.wiring == Wiring::coordinated) {
    coord = std::make_shared<vc::SqueezeCoordinator>(1, 9, 2, 1.0);
  } else if (kind.wiring == Wiring::deferring) {
    coord = std::make_shared<vc::SqueezeCoordinator>(2, 12, 2, 1.0);
  }
  return veloxquant::test::make_kind<T>(kind, c, coord);
}

/// One cache with its inputs and what its calls returned.
struct Lane {
  virtual ~Lane() = default;
  virtual void step(std::size_t i) = 0;
  virtual std::size_t steps() const = 0;
  std::vector<Blob> records;
  std::string name;
};

template <class T>
struct TypedLane : Lane {
  TypedLane(Kind kind, unsigned seed, const std::vector<CallSpec>& plan, Index Dk, bool parallel) {
    cache = make_lane_cache<T>(kind, coord);
    if (parallel) {
      veloxquant::test::enable_parallel_heads(*cache, 3);
    } else {
      cache->set_parallel_heads(false);
    }
    std::mt19937 rng(seed);
    inputs = make_inputs<T>(plan, kB, kH, Dk, Dk - 1, 0.5, rng);
  }
  void step(std::size_t i) override {
    records.emplace_back();
    run_call(*cache, inputs[i], into, records.back());
  }
  std::size_t steps() const override { return inputs.size(); }

  std::shared_ptr<vc::SqueezeCoordinator> coord;
  std::unique_ptr<vc::KVCache<T>> cache;
  std::vector<CallInput<T>> inputs;
  vc::KVPair<T> into;
};

std::vector<CallSpec> lane_plan(Index prefill) {
  std::vector<CallSpec> plan = {{prefill, Api::kFetch, false}, {1, Api::kView, false},
                                {5, Api::kFetchInto, true},    {1, Api::kFetch, true},
                                {0, Api::kFetch, false},       {2, Api::kView, true}};
  for (int i = 0; i < 12; ++i) plan.push_back({1, static_cast<Api>((i + 1) % 3), i % 3 == 0});
  return plan;
}

/// Every policy in every storage type, twice: one set stepped from `n_threads` threads (each
/// thread steps its lanes in turn, so the calls of different caches interleave), one serially.
std::vector<std::unique_ptr<Lane>> make_lanes(unsigned seed, Index prefill, Index Dk,
                                              bool parallel) {
  std::vector<std::unique_ptr<Lane>> lanes;
  const std::vector<CallSpec> plan = lane_plan(prefill);
  unsigned i = 0;
  for (const Kind kind : veloxquant::test::kKinds) {
    if (kind.proxy != 0) continue;  // the query-free scorers' subjects
    const auto add = [&](std::unique_ptr<Lane> lane, const char* type) {
      lane->name = std::string(type) + " " + veloxquant::test::kind_name(kind);
      lanes.push_back(std::move(lane));
    };
    add(std::make_unique<TypedLane<Eigen::half>>(kind, seed + i++, plan, Dk, parallel), "half");
    add(std::make_unique<TypedLane<Eigen::bfloat16>>(kind, seed + i++, plan, Dk, parallel), "bf16");
    add(std::make_unique<TypedLane<float>>(kind, seed + i++, plan, Dk, parallel), "float");
  }
  return lanes;
}

void run_lanes_threaded(std::vector<std::unique_ptr<Lane>>& lanes, int n_threads) {
  std::atomic<int> start{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      arrive_and_wait(start, n_threads);
      const std::size_t steps = lanes.front()->steps();
      for (std::size_t i = 0; i < steps; ++i) {
        for (std::size_t l = static_cast<std::size_t>(t); l < lanes.size();
             l += static_cast<std::size_t>(n_threads)) {
          lanes[l]->step(i);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
}

void compare_lanes(unsigned seed, Index prefill, Index Dk, bool parallel, int n_threads) {
  auto threaded = make_lanes(seed, prefill, Dk, parallel);
  auto serial = make_lanes(seed, prefill, Dk, parallel);
  run_lanes_threaded(threaded, n_threads);
  for (auto& lane : serial) {
    for (std::size_t i = 0; i < lane->steps(); ++i) lane->step(i);
  }
  ASSERT_EQ(threaded.size(), serial.size());
  for (std::size_t l = 0; l < threaded.size(); ++l) {
    ASSERT_EQ(threaded[l]->records.size(), threaded[l]->steps()) << threaded[l]->name;
    const long diff = first_difference(threaded[l]->records, serial[l]->records);
    EXPECT_EQ(diff, -1) << threaded[l]->name << ": differs from its serial twin at call " << diff;
  }
}

TEST(ConcurrencyCachesTest, EveryPolicyOnSeveralThreadsEqualsSerialTwins) {
  for (const int n_threads : {2, 4, 7}) {
    SCOPED_TRACE("threads " + std::to_string(n_threads));
    compare_lanes(1000u + static_cast<unsigned>(n_threads), 20, 6, false, n_threads);
  }
}

/// The same with each cache's heads spread over threads of its own parallel-for inside the
/// std::threads (prefill big enough to take the parallel path; docs/design.md 7.3).
TEST(ConcurrencyCachesTest, ParallelHeadsInsideThreadsEqualSerialTwins) {
  compare_lanes(2000u, 96, 24, true, 3);
}

/// A parallel-for that breaks its contract with threads (docs/robustness.md, "The engine's thread
/// pool"): each task run on two threads at once, or the tasks run on a thread that outlives the
/// pool's return (started before or after the call ends). Under ThreadSanitizer: no race on the
/// cache, the call throws std::logic_error, the cache is reset and then matches a fresh twin.
TEST(ConcurrencyPoolTest, APoolThatRacesItsOwnTasksIsCaughtWithoutARace) {
  vc::KVCacheConfig config;
  config.method = "h2o";
  config.h2o_budget = 40;
  std::mt19937 rng(31);
  const auto k = veloxquant::test::random_float_tensor(1, 8, 120, 32, rng);
  const auto v = veloxquant::test::random_float_tensor(1, 8, 120, 32, rng);
  for (const int fault : {0, 1, 2}) {
    SCOPED_TRACE("fault " + std::to_string(fault));
    std::vector<std::thread> spawned;
    std::atomic<bool> call_over{false};
    const auto pool = [&spawned, &call_over, fault](int tasks,
                                                    const std::function<void(int)>& task) {
      if (fault == 0) {  // every task on two threads at once
        std::vector<std::thread> twice;
        for (int t = 0; t < tasks; ++t) {
          twice.emplace_back(task, t);
          twice.emplace_back(task, t);
        }
        for (auto& th : twice) th.join();
        return;
      }
      // Returns while a thread of its own runs (a copy of) the task function: task 0 at once and
      // the others once the call is over (1), or all of them once the call is over (2).
      spawned.emplace_back([tasks, fault, copy = task, &call_over] {
        if (fault == 1) copy(0);
        while (!call_over.load()) std::this_thread::yield();
        for (int t = fault == 1 ? 1 : 0; t < tasks; ++t) copy(t);
      });
    };
    vc::H2OCache<float> cache(config);
    cache.set_parallel_for(pool, 4);
    cache.set_parallel_heads(true);
    EXPECT_THROW((void)cache.update_and_view(k, v), std::logic_error);
    call_over.store(true);
    for (auto& th : spawned) th.join();
    EXPECT_EQ(cache.offset(), 0);
    EXPECT_EQ(cache.kept_bytes(), 0u);
    vc::H2OCache<float> fresh(config);
    cache.set_parallel_heads(false);
    EXPECT_TRUE(veloxquant::test::bitwise_equal(cache.update_and_fetch(k, v).first,
                                                fresh.update_and_fetch(k, v).first));
  }
}

// The memory pool's tests: sets of two layers of two heads of dim 16, half rows, H2O.
namespace pooled {
using T = Eigen::half;
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;
constexpr int kLayers = 2, kHeads = 2, kD = 16;
constexpr std::size_t kRow = 2 * kD * sizeof(T);  // one row of one head
vc::KVCacheConfig h2o(int budget) {
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  return c;
}
/// One call of S random tokens on every layer of `set`.
void call(Caches& set, std::mt19937& rng, Index S) {
  for (auto& c : set) {
    const auto k = veloxquant::test::random_tensor<T>(rng, 1, kHeads, S, kD);
    const auto v = veloxquant::test::random_tensor<T>(rng, 1, kHeads, S, kD);
    (void)c->update_and_view(k, v);
  }
}
}  // namespace pooled

/// Sequences on threads of their own under one memory pool (SPEC 19, docs/design.md 10.5): each
/// thread builds its set in the pool, prefills, decodes (with a checkpoint and a rollback), forks
/// and drops the fork, while the others' calls end and the pool takes their rows. Under
/// ThreadSanitizer: no race; afterwards the pool holds at most its cap and exactly what the caches
/// keep, and every head its floor.
TEST(ConcurrencyMemoryPoolTest, SetsOnThreadsShareOnePool) {
  using namespace pooled;  // NOLINT(google-build-using-namespace)
  const vc::KVCacheConfig config = h2o(64);
  constexpr int kThreads = 4;
  vc::MemoryPool pool(kThreads * kLayers * kHeads * 36 * kRow);
  std::vector<Caches> sets(kThreads);
  std::atomic<int> failures{0};
  const auto lane = [&](int id) {
    try {
      std::mt19937 rng(500u + static_cast<unsigned>(id));
      Caches set = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
      call(set, rng, 30 + 10 * id);
      for (int t = 0; t < 40; ++t) {
        if (t == 20) vc::KVCacheBuilder::checkpoint(set);
        call(set, rng, 1);
        if (t == 22) vc::KVCacheBuilder::rollback(set);
        if (t == 30) {
          // A fork joins the pool and leaves it when dropped. (Its accessors are not read: another
          // thread's call may trim it meanwhile, docs/design.md D.)
          const Caches fork = vc::KVCacheBuilder::fork(set);
        }
      }
      sets[static_cast<std::size_t>(id)] = std::move(set);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "lane " << id << ": " << e.what();
      ++failures;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(lane, i);
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  std::size_t kept = 0;
  for (const Caches& s : sets) {
    for (const auto& c : s) {
      kept += c->kept_bytes();
      for (Index h = 0; h < kHeads; ++h) EXPECT_GE(c->head_rows(0, h), 20);
    }
  }
  EXPECT_EQ(pool.sequences(), static_cast<std::size_t>(kThreads));
  EXPECT_EQ(pool.used_bytes(), kept);
  EXPECT_LE(pool.used_bytes(), pool.max_bytes());
}

/// MemoryPool::hold: a reader holding the pool sees its idle set stand still while another
/// thread's calls would trim it (they wait), and may call its own set meanwhile. Outside the
/// holds the other thread's calls do take the set's rows (checked at the end).
TEST(ConcurrencyMemoryPoolTest, AHoldKeepsIdleCachesStillWhileAnotherThreadCalls) {
  using namespace pooled;  // NOLINT(google-build-using-namespace)
  const vc::KVCacheConfig config = h2o(200);
  const std::size_t cap = kLayers * kHeads * 120 * kRow;
  vc::MemoryPool pool(cap);
  std::mt19937 rng(77u);
  Caches mine = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
  call(mine, rng, 100);
  const auto rows_of = [&] {
    std::vector<std::vector<std::int64_t>> out;
    for (const auto& c : mine) {
      for (Index h = 0; h < kHeads; ++h) out.push_back(c->positions(0, h));
    }
    return out;
  };
  const std::int64_t before = mine[0]->head_rows(0, 0);
  std::atomic<bool> done{false};
  std::thread other([&] {
    std::mt19937 r(78u);
    Caches set = vc::KVCacheBuilder::for_model<T>(kLayers, config, pool);
    for (int t = 0; t < 150; ++t) call(set, r, 1);
    done = true;
  });
  int holds = 0;
  while (!done) {
    {
      const vc::MemoryPool::Hold hold = pool.hold();
      const auto first = rows_of();
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      EXPECT_EQ(rows_of(), first) << "the set changed during hold " << holds;
      ++holds;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  other.join();
  EXPECT_GT(holds, 0);
  EXPECT_LT(mine[0]->head_rows(0, 0), before) << "the other thread's calls never took a row";
  {
    const vc::MemoryPool::Hold hold = pool.hold();
    call(mine, rng, 1);  // the holding thread's own calls go on
    EXPECT_LE(pool.used_bytes(), cap);
  }
}

// ---------------------------------------------------------------------------------------------
// (c) One coordinator read from many threads while layers report
// ---------------------------------------------------------------------------------------------

TEST(ConcurrencyCoordinatorTest, ReadersSeeAConsistentCoordinatorWhileLayersReport) {
  constexpr int kLayers = 12;
  constexpr int kReaders = 4;
  constexpr int kAvg = 64;
  constexpr int kSink = 3;
  std::mt19937 rng(4242u);
  std::uniform_real_distribution<double> unit(-0.3, 1.0);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const double strength = round % 2 == 0 ? 1.0 : 0.5;
    vc::SqueezeCoordinator coord(kLayers, kAvg, kSink, strength);
    std::vector<double> c(kLayers);
    for (double& x : c) x = unit(rng);
    const std::vector<int> expected = vc::squeeze_budgets(c, kAvg, kSink, strength);

    std::atomic<int> start{0};
    std::atomic<int> reporters_done{0};
    std::atomic<int> violations{0};
    std::atomic<long> reads{0};
    std::vector<std::string> first_violation(kReaders);
    std::vector<std::thread> threads;
    for (int r = 0; r < kReaders; ++r) {
      threads.emplace_back([&, r] {
        arrive_and_wait(start, kLayers + kReaders);
        bool seen_final = false;
        std::size_t seen_reports = 0;
        long n = 0;
        const auto bad = [&](const std::string& what) {
          violations.fetch_add(1);
          std::string& first = first_violation[static_cast<std::size_t>(r)];
          if (first.empty()) first = what;
        };
        // Keep reading until the reporters are done, then once more.
        for (bool last = false; !last;) {
          last = reporters_done.load() == kLayers;
          const bool final_before = coord.is_finalized();
          if (seen_final && !final_before) bad("is_finalized went back to false");
          seen_final = seen_final || final_before;
          const std::map<int, double> reports = coord.reports();
          if (reports.size() < seen_reports) bad("reports() shrank");
          seen_reports = reports.size();
          for (const auto& [id, value] : reports) {
            if (id < 0 || id >= kLayers || value != c[static_cast<std::size_t>(id)]) {
              bad("reports() holds a report that is not the layer's first");
            }
          }
          if (final_before && reports.size() != static_cast<std::size_t>(kLayers)) {
            bad("finalised with missing reports");
          }
          for (int id = -1; id <= kLayers; ++id) {
            const std::optional<int> b =
                (id + r) % 2 == 0 ? coord.resolved_budget(id) : coord.resolved_budget(id, 0);
            if (id < 0 || id >= kLayers) {
              if (b) bad("a budget for an unknown layer");
            } else if (b) {
              if (*b != expected[static_cast<std::size_t>(id)]) bad("a wrong budget");
            } else if (final_before) {
              bad("no budget after finalisation");
            }
          }
          if (coord.generation() != 0u) bad("generation changed without reset");
          if (coord.n_layers() != kLayers || coord.avg_budget() != kAvg ||
              coord.n_sink() != kSink || coord.strength() != strength) {
            bad("constant accessors changed");
          }
          ++n;
        }
        reads.fetch_add(n);
      });
    }
    for (int l = 0; l < kLayers; ++l) {
      threads.emplace_back([&, l] {
        arrive_and_wait(start, kLayers + kReaders);
        const double mine = c[static_cast<std::size_t>(l)];
        EXPECT_EQ(coord.report(l, mine), 0u);
        coord.report_concentration(l, 1.0 - mine);  // ignored: the first report wins
        EXPECT_THROW(coord.report_concentration(-1 - l, mine), std::invalid_argument);
        // Once finalised, a report from an id the coordinator does not know is ignored (README,
        // design decision (h)). Before that it would count as a layer, so wait for it.
        while (!coord.is_finalized()) std::this_thread::yield();
        coord.report_concentration(l + kLayers, 0.5);
        reporters_done.fetch_add(1);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kReaders; ++r) {
      EXPECT_TRUE(first_violation[static_cast<std::size_t>(r)].empty())
          << "reader " << r << ": " << first_violation[static_cast<std::size_t>(r)];
    }
    EXPECT_EQ(violations.load(), 0);
    EXPECT_GE(reads.load(), kReaders);
    ASSERT_TRUE(coord.is_finalized());
    const std::map<int, double> reports = coord.reports();
    ASSERT_EQ(reports.size(), static_cast<std::size_t>(kLayers));
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(reports.at(l), c[static_cast<std::size_t>(l)]);
      EXPECT_EQ(coord.resolved_budget(l),
                std::optional<int>(expected[static_cast<std::size_t>(l)]));
      EXPECT_FALSE(coord.resolved_budget(l + kLayers).has_value());
    }
  }
}

}  // namespace
