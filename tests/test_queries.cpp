// Real-query scoring ("observed attention", docs/design.md 4.6) on the fast caches: the overloads
// update_and_fetch / update_and_view / update_and_fetch_into(keys, values, queries) of every cache.
//
//  * hand-computed examples (the issue's example, eviction once per call, TOVA and SnapKV examples);
//  * large and odd G (blocks of 64 / G tokens down to one) with budgets of 1-3 rows on H2O, TOVA
//    and SnapKV against their query oracles, through the driver of support/oracle_driver.hpp;
//  * calls with and without queries mixed on one cache (proxy oracle + query oracle combined);
//  * value_norm_power by hand; exact ties (one-hot attention or identical logits) evict the
//    earliest position.
// Each policy's random query sequences against its oracle are in its own file (test_h2o_core.cpp,
// test_tova_cache.cpp, test_snapkv_cache.cpp); the contract for calls with queries (bad queries
// and the strong guarantee, empty calls, key and value errors first, StreamingLLM and the standard
// cache ignoring queries, query element types) is in test_contract.cpp, parallel == serial in
// test_parallel.cpp, over the shared harness of support/subjects.hpp.
//
// Keys and values are fed to the oracles exactly as the cache stores them (converted to T and read
// back as double); queries are generated in float32 (what the cache scores with) and read back as
// double.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "reference/policy_oracles.hpp"
#include "support/oracle_driver.hpp"
#include "support/storage_types.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

using Positions = std::vector<std::int64_t>;
using QTensor = vc::Tensor4<float>;

// =============================================================================================
// 1. Hand-computed examples on the real caches
// =============================================================================================

// The scale of tests/test_query_oracle.cpp: keys and queries kC * e give logits ln(2) * dot(e, e'),
// so every softmax is a ratio of small integers.
const double kC = std::sqrt(std::sqrt(2.0) * std::log(2.0));

/// A [1, 1, S, 2] key tensor or a [1, G, S, 2] query tensor from kC-unit vectors.
/// e: [head][token] -> (x, y)
QTensor c2_tensor(const std::vector<std::vector<std::pair<double, double>>>& e) {
  const auto heads = static_cast<Index>(e.size());
  const auto S = static_cast<Index>(e.front().size());
  QTensor t(1, heads, S, 2);
  for (Index h = 0; h < heads; ++h) {
    for (Index s = 0; s < S; ++s) {
      const auto& xy = e[static_cast<std::size_t>(h)][static_cast<std::size_t>(s)];
      t(0, h, s, 0) = static_cast<float>(kC * xy.first);
      t(0, h, s, 1) = static_cast<float>(kC * xy.second);
    }
  }
  return t;
}

/// [1, 1, S, 1] values 100, 101, ...
QTensor value_tensor(Index S) {
  QTensor t(1, 1, S, 1);
  for (Index s = 0; s < S; ++s) t(0, 0, s, 0) = 100.0f + static_cast<float>(s);
  return t;
}

// The issue's example: B = H = 1, G = 2, D = 2, decay 0.5, no eviction.
//   keys: k0 = (0,0), k1 = (1,0), k2 = (0,1); queries: token 0 and 1: (1,0), (0,1); token 2: (1,1), (0,2)
//   token 0 -> s = [1]; token 1 -> a = [5/12, 7/12], s = [11/12, 7/12, 0];
//   token 2 -> a = [11/60, 17/60, 32/60], s = [77/120, 69/120, 64/120]  (derivation in test_query_oracle.cpp)
const QTensor kIssueKeys = c2_tensor({{{0, 0}, {1, 0}, {0, 1}}});
const QTensor kIssueQueries = c2_tensor({{{1, 0}, {1, 0}, {1, 1}}, {{0, 1}, {0, 1}, {0, 2}}});
const std::vector<double> kIssueScores = {77.0 / 120.0, 69.0 / 120.0, 64.0 / 120.0};
constexpr double kHandTol = 2e-6;  // float32 scoring of exact rationals

void expect_scores_near(const std::vector<float>& got, const std::vector<double>& want,
                        const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(static_cast<double>(got[i]), want[i], kHandTol) << where << " row " << i;
  }
}

std::vector<std::unique_ptr<vc::KVCache<float>>> issue_example_caches() {
  std::vector<std::unique_ptr<vc::KVCache<float>>> out;
  out.push_back(std::make_unique<vc::H2OCache<float>>(h2o_config(64, 0, 0, 0.5)));
  out.push_back(std::make_unique<vc::SqueezeAttentionCache<float>>(squeeze_config(64, 0, 0.5, 0.5)));
  out.push_back(std::make_unique<vc::PyramidKVCache<float>>(pyramid_config(64, 0, 0.5, 0.5)));
  return out;
}

TEST(QueryHandExampleTest, IssueExampleInOneCall) {
  for (auto& cache : issue_example_caches()) {
    const vc::KVPair<float> got =
        cache->update_and_fetch(kIssueKeys, value_tensor(3), kIssueQueries);
    EXPECT_TRUE(bitwise_equal(got.first, kIssueKeys));  // returns the call's rows (nothing before)
    EXPECT_TRUE(bitwise_equal(got.second, value_tensor(3)));
    EXPECT_EQ(policy_positions(*cache, 0, 0), (Positions{0, 1, 2}));
    expect_scores_near(policy_scores(*cache, 0, 0), kIssueScores, "one call");
    EXPECT_EQ(cache->offset(), 3);
  }
}

TEST(QueryHandExampleTest, IssueExampleAsThreeOneTokenCalls) {
  for (auto& cache : issue_example_caches()) {
    const std::vector<std::vector<double>> after = {
        {1.0}, {11.0 / 12.0, 7.0 / 12.0}, kIssueScores};
    for (Index s = 0; s < 3; ++s) {
      const vc::KVPair<float> got = cache->update_and_fetch(
          slice_s(kIssueKeys, s, 1), slice_s(value_tensor(3), s, 1), slice_s(kIssueQueries, s, 1));
      // Returned: the rows retained before (positions 0 .. s - 1) then this token.
      EXPECT_TRUE(bitwise_equal(got.first, slice_s(kIssueKeys, 0, s + 1))) << "token " << s;
      expect_scores_near(policy_scores(*cache, 0, 0), after[static_cast<std::size_t>(s)],
                         "after token " + std::to_string(s));
    }
    EXPECT_EQ(policy_positions(*cache, 0, 0), (Positions{0, 1, 2}));
  }
}

TEST(QueryHandExampleTest, IssueExampleThroughViewAndFetchInto) {
  vc::H2OCache<float> viewed(h2o_config(64, 0, 0, 0.5));
  const vc::KVView<float> view = viewed.update_and_view(kIssueKeys, value_tensor(3), kIssueQueries);
  ASSERT_EQ(view.rows(), 3);
  EXPECT_EQ(view.new_rows(), 3);
  for (Index r = 0; r < 3; ++r) {
    EXPECT_EQ(view.positions(0, 0)(r), r);
    EXPECT_EQ(view.keys(0, 0)(r, 0), kIssueKeys(0, 0, r, 0));
    EXPECT_EQ(view.values(0, 0)(r, 0), 100.0f + static_cast<float>(r));
  }
  expect_scores_near(viewed.scores(0, 0), kIssueScores, "view");

  vc::H2OCache<float> into(h2o_config(64, 0, 0, 0.5));
  vc::KVPair<float> out;
  into.update_and_fetch_into(kIssueKeys, value_tensor(3), kIssueQueries, out);
  EXPECT_TRUE(bitwise_equal(out.first, kIssueKeys));
  expect_scores_near(into.scores(0, 0), kIssueScores, "fetch_into");
}

// Eviction once per call (test_query_oracle.cpp, EvictsOncePerCallAfterScoring): G = 1, D = 2,
// decay 1, n_sink 1, g = 1, budget 3.
//   one 5-token call: s = [265, 210, 151, 23, 11] / 132 -> evict 3 then 2 -> {0, 1, 4}
//   five 1-token calls: after t3 evict 1 -> {0, 2, 3}; after t4 evict 3 -> {0, 2, 4}
const QTensor kEvictKeys = c2_tensor({{{0, 0}, {1, 0}, {0, 1}, {0, 0}, {0, 0}}});
const QTensor kEvictQueries = c2_tensor({{{0, 0}, {0, 0}, {0, 0}, {0, 3}, {3, 0}}});

TEST(QueryHandExampleTest, EvictsOncePerCallAfterScoringAllTokens) {
  vc::H2OCache<float> cache(h2o_config(3, 1, 1, 1.0));
  const vc::KVPair<float> got = cache.update_and_fetch(kEvictKeys, value_tensor(5), kEvictQueries);
  EXPECT_EQ(got.first.dimension(2), 5);  // a prefill attends over all of its rows
  EXPECT_EQ(cache.positions(0, 0), (Positions{0, 1, 4}));
  expect_scores_near(cache.scores(0, 0), {265.0 / 132.0, 210.0 / 132.0, 11.0 / 132.0}, "one call");
  const vc::KVPair<float> st = cache.state();
  EXPECT_EQ(st.second(0, 0, 1, 0), 101.0f);  // values travel with their keys
  EXPECT_EQ(st.second(0, 0, 2, 0), 104.0f);
}

TEST(QueryHandExampleTest, OneTokenCallsEvictAfterEachToken) {
  vc::H2OCache<float> cache(h2o_config(3, 1, 1, 1.0));
  const std::vector<Positions> after = {{0}, {0, 1}, {0, 1, 2}, {0, 2, 3}, {0, 2, 4}};
  for (Index s = 0; s < 5; ++s) {
    const vc::KVPair<float> got = cache.update_and_fetch(
        slice_s(kEvictKeys, s, 1), slice_s(value_tensor(5), s, 1), slice_s(kEvictQueries, s, 1));
    EXPECT_EQ(got.first.dimension(2), std::min<Index>(s, 3) + 1);
    EXPECT_EQ(cache.positions(0, 0), after[static_cast<std::size_t>(s)]) << "after token " << s;
  }
  expect_scores_near(cache.scores(0, 0),
                     {11.0 / 6.0 + 1.0 / 11.0 + 0.25, 1.0 / 3.0 + 8.0 / 11.0 + 0.25, 0.25},
                     "five calls");
}

// TOVA (test_query_oracle.cpp, TOVAHeadOracleQueriesTest.HandExample): n_sink 1, budget 2, G = 2.
//   t2: a = [7, 10, 7] / 24 -> evicts the token itself (the key-as-query proxy evicts row 1);
//   t3: a = [1/4, 1/4, 1/2], row 0 is a sink -> evict 1; t4: uniform 1/3 -> tie 3 vs 4 -> evict 3.
const QTensor kTovaKeys = c2_tensor({{{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 0}}});
const QTensor kTovaQueries =
    c2_tensor({{{5, 5}, {5, 5}, {1, 0}, {0, 1}, {0, 0}}, {{-5, 5}, {-5, 5}, {0, 0}, {0, 1}, {0, 0}}});

TEST(QueryHandExampleTest, TovaOneTokenCallsAndOneCall) {
  const std::vector<Positions> after = {{0}, {0, 1}, {0, 1}, {0, 3}, {0, 4}};
  vc::TOVACache<float> stepped(tova_config(2, 1));
  for (Index s = 0; s < 5; ++s) {
    (void)stepped.update_and_fetch(slice_s(kTovaKeys, s, 1), slice_s(value_tensor(5), s, 1),
                                   slice_s(kTovaQueries, s, 1));
    EXPECT_EQ(stepped.positions(0, 0), after[static_cast<std::size_t>(s)]) << "after token " << s;
    if (s == 2) expect_scores_near(stepped.scores(0, 0), {7.0 / 24.0, 10.0 / 24.0}, "t2");
  }
  expect_scores_near(stepped.scores(0, 0), {1.0 / 3.0, 1.0 / 3.0}, "t4");

  // The same five tokens in one call: TOVA still decides token by token.
  vc::TOVACache<float> one_call(tova_config(2, 1));
  (void)one_call.update_and_fetch(kTovaKeys, value_tensor(5), kTovaQueries);
  EXPECT_EQ(one_call.positions(0, 0), (Positions{0, 4}));
  EXPECT_EQ(one_call.state().second(0, 0, 1, 0), 104.0f);

  // Contrast: without queries (key-as-query) t2 evicts row 1.
  vc::TOVACache<float> proxy(tova_config(2, 1));
  (void)proxy.update_and_fetch(slice_s(kTovaKeys, 0, 3), slice_s(value_tensor(5), 0, 3));
  EXPECT_EQ(proxy.positions(0, 0), (Positions{0, 2}));
}

// SnapKV (test_query_oracle.cpp, SnapKVHeadOracleQueriesTest.HandExample): n_sink 1, budget 3,
// obs_window 2, G = 2: scores [222, 277, 382, 437, 222] / 1540 -> keep {0, 2, 3}.
const QTensor kSnapKeys = c2_tensor({{{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 0}}});
const QTensor kSnapQueries =
    c2_tensor({{{3, 0}, {3, 0}, {3, 0}, {1, 0}, {0, 1}}, {{3, 0}, {3, 0}, {0, -3}, {0, 0}, {0, 2}}});

TEST(QueryHandExampleTest, SnapKVObservationWindowUsesTheQueries) {
  vc::SnapKVCache<float> cache(snap_config(3, 1, 2));
  (void)cache.update_and_fetch(kSnapKeys, value_tensor(5), kSnapQueries);
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(cache.positions(0, 0), (Positions{0, 2, 3}));
  expect_scores_near(cache.scores(0, 0), {222.0 / 1540.0, 382.0 / 1540.0, 437.0 / 1540.0}, "snap");

  // obs_window 1, budget 2: rows 2 and 3 tie exactly under token 4's queries; the earlier stays.
  vc::SnapKVCache<float> tie(snap_config(2, 1, 1));
  (void)tie.update_and_fetch(kSnapKeys, value_tensor(5), kSnapQueries);
  EXPECT_EQ(tie.positions(0, 0), (Positions{0, 2}));

  // Contrast: the key-as-query proxy keeps {0, 1, 3}.
  vc::SnapKVCache<float> proxy(snap_config(3, 1, 2));
  (void)proxy.update_and_fetch(kSnapKeys, value_tensor(5));
  EXPECT_EQ(proxy.positions(0, 0), (Positions{0, 1, 3}));
}

// =============================================================================================
// 2. Every scored policy against its query oracle where the blocks get odd: large G, tiny budgets
// =============================================================================================

// Odd and large G (64 / G tokens per block: 21, 4, and 1 token when G > 64) and tiny budgets
// (1-3 rows, n_sink 0 or budget - 1, so g clamps to 0) on H2O, TOVA and SnapKV.
template <class T>
class QueryOracleTest : public ::testing::Test {};
TYPED_TEST_SUITE(QueryOracleTest, StorageTypes);

TYPED_TEST(QueryOracleTest, LargeGroupsAndTinyBudgetsMatchOracles) {
  using T = TypeParam;
  for (const Index G : {Index{3}, Index{16}, Index{96}}) {
    for (const int budget : {1, 2, 3}) {
      for (const int n_sink : {0, budget - 1}) {
        const std::string what = "G=" + std::to_string(G) + " budget=" + std::to_string(budget) +
                                 " n_sink=" + std::to_string(n_sink);
        const RunDims dm{1, 2, 5, 2};
        std::mt19937 rng(static_cast<unsigned>(G * 100 + budget * 10 + n_sink));
        std::vector<DriverCall> plan = {DriverCall{70, Api::kFetchQ, G, false}};
        for (int i = 0; i < 6; ++i) {
          plan.push_back(DriverCall{i == 3 ? 9 : 1, kAllQueryApis[i % 4], G, i == 4});
        }
        RunChecks<T> checks;
        const int grace_rows = 1;
        const auto grace = [n_sink](int b) { return ref::protected_recent_fixed(grace_rows, b, n_sink); };
        Subject<T> h2o{nullptr, std::make_unique<vc::H2OCache<T>>(h2o_config(budget, n_sink, grace_rows, 0.9))};
        CoreHeads core(2, n_sink, 0.9, grace, budget);
        checks.what = "h2o " + what;
        ASSERT_EQ(run_against_oracle(h2o, core, dm, plan, rng, checks).failure, "");
        EXPECT_EQ(h2o.cache->tokens_kept(), budget);

        Subject<T> tova{nullptr, std::make_unique<vc::TOVACache<T>>(tova_config(budget, n_sink))};
        TovaHeads tova_oracle(2, n_sink, budget);
        checks.what = "tova " + what;
        ASSERT_EQ(run_against_oracle(tova, tova_oracle, dm, plan, rng, checks).failure, "");

        Subject<T> snap{nullptr, std::make_unique<vc::SnapKVCache<T>>(snap_config(budget, n_sink, 5))};
        SnapHeads snap_oracle(2, n_sink, budget, 5);
        checks.what = "snapkv " + what;
        ASSERT_EQ(run_against_oracle(snap, snap_oracle, dm, plan, rng, checks).failure, "");
      }
    }
  }
}

// value_norm_power (docs/design.md 4.8) by hand: H2O, budget 2, no sinks, no protected rows,
// decay 1, three tokens of one key attending with that key as their query. The masses are
// 1 + 1/2 + 1/3, 1/2 + 1/3 and 1/3 (the later tokens see more rows), the values 1, 0.1 and 10.
// By score the third row goes; by score * |v|^2 (1.83, 0.0083, 33.3) the second, and at power 0.5
// (1.83, 0.26, 1.05) the second too; the same through update_and_fetch with queries in every
// storage type.
TEST(QueryValueNormTest, SmallValuesGoFirstAmongSimilarAttention) {
  const auto kept_values = [](double power) {
    vc::KVCacheConfig c = h2o_config(2, 0, 0, 1.0);
    c.value_norm_power = power;
    vc::H2OCache<float> cache(c);
    vc::Tensor4<float> k(1, 1, 3, 2), v(1, 1, 3, 1);
    for (Index s = 0; s < 3; ++s) {
      k(0, 0, s, 0) = 1.0f;
      k(0, 0, s, 1) = 0.0f;
    }
    v(0, 0, 0, 0) = 1.0f;
    v(0, 0, 1, 0) = 0.1f;
    v(0, 0, 2, 0) = 10.0f;
    const vc::Tensor4<float> q = k;
    (void)cache.update_and_fetch(k, v, q);
    const vc::KVPair<float> st = cache.state();
    std::vector<float> out;
    for (Index r = 0; r < st.second.dimension(2); ++r) out.push_back(st.second(0, 0, r, 0));
    return out;
  };
  EXPECT_EQ(kept_values(0.0), (std::vector<float>{1.0f, 0.1f}));
  EXPECT_EQ(kept_values(2.0), (std::vector<float>{1.0f, 10.0f}));
  EXPECT_EQ(kept_values(0.5), (std::vector<float>{1.0f, 10.0f}));
  // Without queries the field changes nothing (the key-as-query proxy evicts token by token).
  for (const double power : {0.0, 2.0}) {
    vc::KVCacheConfig c = h2o_config(2, 0, 0, 1.0);
    c.value_norm_power = power;
    vc::H2OCache<float> with(c), without(h2o_config(2, 0, 0, 1.0));
    std::mt19937 rng(5u);
    const vc::Tensor4<float> k = random_tensor<float>(rng, 1, 2, 7, 4);
    const vc::Tensor4<float> v = random_tensor<float>(rng, 1, 2, 7, 3);
    (void)with.update_and_fetch(k, v);
    (void)without.update_and_fetch(k, v);
    EXPECT_TRUE(shape_of(with.state().second) == shape_of(without.state().second));
    for (Index h = 0; h < 2; ++h) EXPECT_EQ(policy_positions(with, 0, h), policy_positions(without, 0, h));
  }
}

// =============================================================================================
// 6. Calls with and without queries on one cache
// =============================================================================================

/// docs/design.md 4.6 step 3 on explicit (position, score) rows: evict the lowest-score row that is neither
/// a sink nor among the newest g, ties to the earliest, until at most `budget` rows remain.
void evict_to_budget(std::vector<std::pair<std::int64_t, double>>& rows, int budget, int n_sink, int g) {
  while (rows.size() > static_cast<std::size_t>(budget)) {
    std::optional<std::size_t> victim;
    for (std::size_t r = 0; r + static_cast<std::size_t>(g) < rows.size(); ++r) {
      if (rows[r].first < n_sink) continue;
      if (!victim || rows[r].second < rows[*victim].second) victim = r;
    }
    ASSERT_TRUE(victim.has_value());
    rows.erase(rows.begin() + static_cast<std::ptrdiff_t>(*victim));
  }
}

template <class T>
class QueryMixedTest : public ::testing::Test {};
TYPED_TEST_SUITE(QueryMixedTest, StorageTypes);

// Call A without queries (S_A <= budget: nothing evicted; proxy oracle), then call B with queries.
// Without eviction before B's end, every token of B attends over all rows retained before B, so a
// row's score after B is decay^S_B * (its score after A) + (B's own contribution), and B's
// contribution depends only on the keys. The query oracle fed A (with any queries) then B gives
// that contribution as Q_after - decay^S_B * Q_A. Then the once-per-call eviction is applied by hand.
TYPED_TEST(QueryMixedTest, ProxyCallThenQueryCallCombinesBothScorings) {
  using T = TypeParam;
  const int budget = 12, n_sink = 2, grace_rows = 3;
  const double decay = 0.9;
  const Index B = 1, H = 2, G = 2, D = 8, Dv = 2, SA = 10, SB = 7;
  vc::H2OCache<T> cache(h2o_config(budget, n_sink, grace_rows, decay));
  const auto grace = [](int b) { return ref::protected_recent_fixed(grace_rows, b, n_sink); };
  std::mt19937 rng(2024);
  const vc::Tensor4<T> ka = random_tensor<T>(rng, B, H, SA, D), va = random_tensor<T>(rng, B, H, SA, Dv);
  const vc::Tensor4<T> kb = random_tensor<T>(rng, B, H, SB, D), vb = random_tensor<T>(rng, B, H, SB, Dv);
  const QTensor qa = random_queries(rng, B, G * H, SA, D);  // only for the query oracle
  const QTensor qb = random_queries(rng, B, G * H, SB, D);

  (void)cache.update_and_fetch(ka, va);
  const vc::KVPair<T> got = cache.update_and_fetch(kb, vb, qb);
  EXPECT_EQ(got.first.dimension(2), SA + SB);

  for (Index h = 0; h < H; ++h) {
    ref::H2OHeadOracle proxy(n_sink, decay, grace);
    proxy.set_budget(budget);
    ref::H2OHeadOracle query(n_sink, decay, grace);  // no budget: nothing evicted
    const Rows keys_a = rows_of(ka, 0, h), vals_a = rows_of(va, 0, h);
    for (std::size_t s = 0; s < keys_a.size(); ++s) proxy.absorb(keys_a[s], vals_a[s]);
    ASSERT_EQ(proxy.positions().size(), static_cast<std::size_t>(SA));
    query.absorb_call(keys_a, vals_a, queries_of(qa, 0, h, G));
    const std::vector<double> p_a = proxy.scores(), q_a = query.scores();
    query.absorb_call(rows_of(kb, 0, h), rows_of(vb, 0, h), queries_of(qb, 0, h, G));
    const std::vector<double> q_after = query.scores();
    const double fade = std::pow(decay, static_cast<double>(SB));
    std::vector<std::pair<std::int64_t, double>> want;
    for (std::size_t r = 0; r < q_after.size(); ++r) {
      const double s = r < p_a.size() ? q_after[r] + fade * (p_a[r] - q_a[r]) : q_after[r];
      want.emplace_back(static_cast<std::int64_t>(r), s);
    }
    evict_to_budget(want, budget, n_sink, ref::protected_recent_fixed(grace_rows, budget, n_sink));
    Positions want_pos;
    for (const auto& w : want) want_pos.push_back(w.first);
    ASSERT_EQ(cache.positions(0, h), want_pos) << "head " << h;
    const std::vector<float> sc = cache.scores(0, h);
    for (std::size_t r = 0; r < want.size(); ++r) {
      EXPECT_TRUE(scores_close(static_cast<double>(sc[r]), want[r].second))
          << "head " << h << " position " << want[r].first << ": " << sc[r] << " vs " << want[r].second;
    }
    // And the proxy call alone had matched the proxy oracle: its rows' scores differ from the
    // query oracle's after A, so the check above really mixes two scorings.
    EXPECT_GT(std::fabs(p_a[0] - q_a[0]), 1e-3);
  }
}

// The other order, no eviction (budget large): call A with queries, call B without (key-as-query).
// Each proxy token of B decays every row retained before it, so rows of A decay S_B times and get
// the proxy's contribution P_after - decay^S_B * P_A; B's rows get exactly the proxy's scores.
TYPED_TEST(QueryMixedTest, QueryCallThenProxyCallCombinesBothScorings) {
  using T = TypeParam;
  const int n_sink = 1;
  const double decay = 0.95;
  const Index B = 2, H = 1, G = 4, D = 6, Dv = 1, SA = 9, SB = 6;
  vc::SqueezeAttentionCache<T> cache(squeeze_config(100, n_sink, 0.5, decay));
  const auto grace = [](int b) { return ref::protected_recent_ratio(0.5, b, 1); };
  std::mt19937 rng(4048);
  const vc::Tensor4<T> ka = random_tensor<T>(rng, B, H, SA, D), va = random_tensor<T>(rng, B, H, SA, Dv);
  const vc::Tensor4<T> kb = random_tensor<T>(rng, B, H, SB, D), vb = random_tensor<T>(rng, B, H, SB, Dv);
  const QTensor qa = random_queries(rng, B, G * H, SA, D);
  (void)cache.update_and_view(ka, va, qa);
  vc::KVPair<T> out;
  cache.update_and_fetch_into(kb, vb, out);
  EXPECT_EQ(out.first.dimension(2), SA + SB);

  for (Index b = 0; b < B; ++b) {
    ref::H2OHeadOracle query(n_sink, decay, grace);
    ref::H2OHeadOracle proxy(n_sink, decay, grace);
    query.absorb_call(rows_of(ka, b, 0), rows_of(va, b, 0), queries_of(qa, b, 0, G));
    const Rows keys_a = rows_of(ka, b, 0), vals_a = rows_of(va, b, 0);
    for (std::size_t s = 0; s < keys_a.size(); ++s) proxy.absorb(keys_a[s], vals_a[s]);
    const std::vector<double> q_a = query.scores(), p_a = proxy.scores();
    const Rows keys_b = rows_of(kb, b, 0), vals_b = rows_of(vb, b, 0);
    for (std::size_t s = 0; s < keys_b.size(); ++s) proxy.absorb(keys_b[s], vals_b[s]);
    const std::vector<double> p_after = proxy.scores();
    const double fade = std::pow(decay, static_cast<double>(SB));
    ASSERT_EQ(cache.positions(b, 0).size(), static_cast<std::size_t>(SA + SB));
    const std::vector<float> sc = cache.scores(b, 0);
    for (std::size_t r = 0; r < p_after.size(); ++r) {
      const double want = r < q_a.size() ? p_after[r] + fade * (q_a[r] - p_a[r]) : p_after[r];
      EXPECT_TRUE(scores_close(static_cast<double>(sc[r]), want))
          << "batch " << b << " row " << r << ": " << sc[r] << " vs " << want;
    }
    EXPECT_EQ(sc.back(), 0.0f);  // the last proxy token joins with score 0
  }
}

// Queries equal to the keys (G = 1) are not the key-as-query proxy: the token also attends to
// itself (docs/design.md 4.6 vs 4.2), so its own row gets mass at once. Each cache matches its own oracle.
TYPED_TEST(QueryMixedTest, QueriesEqualToKeysAreNotTheProxy) {
  using T = TypeParam;
  const auto grace = [](int b) { return ref::protected_recent_fixed(2, b, 1); };
  vc::H2OCache<T> with(h2o_config(6, 1, 2, 0.9));
  vc::H2OCache<T> without(h2o_config(6, 1, 2, 0.9));
  ref::H2OHeadOracle query_oracle(1, 0.9, grace);
  ref::H2OHeadOracle proxy_oracle(1, 0.9, grace);
  query_oracle.set_budget(6);
  proxy_oracle.set_budget(6);
  std::mt19937 rng(77);
  for (int i = 0; i < 12; ++i) {
    const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 1, 1, 5);
    const vc::Tensor4<T> v = random_tensor<T>(rng, 1, 1, 1, 2);
    const QTensor q = k.template cast<float>();  // the key itself, exactly
    (void)with.update_and_fetch(k, v, q);
    (void)without.update_and_fetch(k, v);
    query_oracle.absorb_call(rows_of(k, 0, 0), rows_of(v, 0, 0), queries_of(q, 0, 0, 1));
    proxy_oracle.absorb(row_of(k, 0, 0, 0), row_of(v, 0, 0, 0));
    ASSERT_EQ(with.positions(0, 0), query_oracle.positions()) << "token " << i;
    ASSERT_EQ(without.positions(0, 0), proxy_oracle.positions()) << "token " << i;
    const std::vector<float> sw = with.scores(0, 0), so = without.scores(0, 0);
    const std::vector<double> qw = query_oracle.scores(), po = proxy_oracle.scores();
    for (std::size_t r = 0; r < sw.size(); ++r) EXPECT_TRUE(scores_close(sw[r], qw[r])) << i << "," << r;
    for (std::size_t r = 0; r < so.size(); ++r) EXPECT_TRUE(scores_close(so[r], po[r])) << i << "," << r;
    if (i > 0) {
      EXPECT_EQ(so.back(), 0.0f) << "token " << i;  // proxy: the new row joins with score 0
      EXPECT_GT(sw.back(), 1e-3f) << "token " << i;  // queries: it attended to itself
    }
  }
}

// =============================================================================================
// 9. Exact ties
// =============================================================================================

// One-hot attention: key r = M e_r (D = 8, M = 100); a query M e_j has logit M^2 / sqrt(8) ~ 3536
// on row j and 0 elsewhere, so exp underflows to exactly 0 and the weight is exactly 1 on row j.
// Token r's G = 2 query heads are (M e_r, M e_r), except token 5: (M e_5, M e_2), which gives
// exactly 0.5 to row 5 and 0.5 to row 2. With decay 1, budget 4, n_sink 1, g = 1:
//   prefill (one call of 8): scores [1, 1, 1.5, 1, 1, 0.5, 1, 1]; evict 4 of {1..6}: 5 (0.5),
//     then the tie at 1.0 among {1, 3, 4, 6}: earliest first -> 1, 3, 4  =>  {0, 2, 6, 7};
//   decode (8 calls of one token): t4: all 1, evict 1 -> {0,2,3,4}; t5: {0:1, 2:1.5, 3:1, 4:1,
//     5:0.5}, 5 protected -> tie 3 vs 4, evict 3 -> {0,2,4,5}; t6: candidates {2,4,5} =
//     {1.5, 1, 0.5} -> evict 5 -> {0,2,4,6}; t7: candidates {2,4,6} = {1.5, 1, 1} -> tie, evict 4
//     -> {0,2,6,7}.
// (Evicting the latest of equal scores would give {0, 1, 2, 7} / other sets.)
constexpr double kM = 100.0;

template <class T>
vc::Tensor4<T> onehot_keys(Index S) {
  vc::Tensor4<T> k(1, 1, S, 8);
  k.setConstant(T(0.0f));
  for (Index s = 0; s < S; ++s) k(0, 0, s, s) = T(static_cast<float>(kM));
  return k;
}

QTensor onehot_queries(Index S) {
  QTensor q(1, 2, S, 8);
  q.setZero();
  for (Index s = 0; s < S; ++s) {
    q(0, 0, s, s) = static_cast<float>(kM);
    q(0, 1, s, s == 5 ? 2 : s) = static_cast<float>(kM);
  }
  return q;
}

template <class T>
std::vector<Subject<T>> tie_caches() {
  std::vector<Subject<T>> out;
  out.push_back(Subject<T>{nullptr, std::make_unique<vc::H2OCache<T>>(h2o_config(4, 1, 1, 1.0))});
  // ratio 0.34: g = floor(0.34 * (4 - 1)) = 1
  out.push_back(Subject<T>{nullptr, std::make_unique<vc::SqueezeAttentionCache<T>>(squeeze_config(4, 1, 0.34, 1.0))});
  out.push_back(Subject<T>{nullptr, std::make_unique<vc::PyramidKVCache<T>>(pyramid_config(4, 1, 0.34, 1.0))});
  return out;
}

template <class T>
class QueryTieTest : public ::testing::Test {};
TYPED_TEST_SUITE(QueryTieTest, StorageTypes);

TYPED_TEST(QueryTieTest, H2OCorePrefillEvictsTheEarliestOfEqualScores) {
  using T = TypeParam;
  for (Subject<T>& s : tie_caches<T>()) {
    vc::Tensor4<T> values(1, 1, 8, 1);
    for (Index i = 0; i < 8; ++i) values(0, 0, i, 0) = T(static_cast<float>(i));
    (void)s.cache->update_and_fetch(onehot_keys<T>(8), values, onehot_queries(8));
    EXPECT_EQ(policy_positions(*s.cache, 0, 0), (Positions{0, 2, 6, 7}));
    EXPECT_EQ(policy_scores(*s.cache, 0, 0), (std::vector<float>{1.0f, 1.5f, 1.0f, 1.0f}));
    EXPECT_EQ(static_cast<float>(s.cache->state().second(0, 0, 1, 0)), 2.0f);
  }
}

TYPED_TEST(QueryTieTest, H2OCoreDecodeEvictsTheEarliestOfEqualScores) {
  using T = TypeParam;
  const std::vector<Positions> after = {{0},          {0, 1},       {0, 1, 2},    {0, 1, 2, 3},
                                        {0, 2, 3, 4}, {0, 2, 4, 5}, {0, 2, 4, 6}, {0, 2, 6, 7}};
  const std::vector<std::vector<float>> scores_after = {
      {1}, {1, 1}, {1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1.5f, 1, 0.5f}, {1, 1.5f, 1, 1},
      {1, 1.5f, 1, 1}};
  const vc::Tensor4<T> keys = onehot_keys<T>(8);
  const QTensor queries = onehot_queries(8);
  vc::Tensor4<T> values(1, 1, 8, 1);
  values.setConstant(T(1.0f));
  for (Subject<T>& s : tie_caches<T>()) {
    for (Index i = 0; i < 8; ++i) {
      (void)s.cache->update_and_fetch(slice_s(keys, i, 1), slice_s(values, i, 1), slice_s(queries, i, 1));
      EXPECT_EQ(policy_positions(*s.cache, 0, 0), after[static_cast<std::size_t>(i)]) << "after token " << i;
      EXPECT_EQ(policy_scores(*s.cache, 0, 0), scores_after[static_cast<std::size_t>(i)]) << "after token " << i;
    }
  }
}

// TOVA with all-zero queries: every logit is 0, the weights are exactly uniform, and the earliest
// non-sink row goes (budget 3, n_sink 1): t3 evicts 1, t4 evicts 2 -> {0, 3, 4}; one call or five.
// SnapKV with one-hot keys, obs_window 2: token 4 looks at row 3, token 5 at row 5 -> rows 3 and 5
// score exactly 0.5, the rest 0; budget 2 keeps the sink and the earlier of the tied pair.
TYPED_TEST(QueryTieTest, TovaAndSnapKVTiesGoToTheEarliest) {
  using T = TypeParam;
  const vc::Tensor4<T> keys = onehot_keys<T>(6);
  vc::Tensor4<T> values(1, 1, 6, 1);
  values.setConstant(T(1.0f));
  QTensor zero(1, 1, 6, 8);
  zero.setZero();
  vc::TOVACache<T> one_call(tova_config(3, 1));
  (void)one_call.update_and_fetch(slice_s(keys, 0, 5), slice_s(values, 0, 5), slice_s(zero, 0, 5));
  EXPECT_EQ(one_call.positions(0, 0), (Positions{0, 3, 4}));
  vc::TOVACache<T> stepped(tova_config(3, 1));
  for (Index i = 0; i < 5; ++i) {
    (void)stepped.update_and_fetch(slice_s(keys, i, 1), slice_s(values, i, 1), slice_s(zero, i, 1));
  }
  EXPECT_EQ(stepped.positions(0, 0), (Positions{0, 3, 4}));
  EXPECT_EQ(stepped.scores(0, 0), (std::vector<float>{0.25f, 0.25f, 0.25f}));

  QTensor looks(1, 1, 6, 8);
  looks.setZero();
  looks(0, 0, 4, 3) = static_cast<float>(kM);
  looks(0, 0, 5, 5) = static_cast<float>(kM);
  vc::SnapKVCache<T> snap2(snap_config(2, 1, 2));
  (void)snap2.update_and_fetch(keys, values, looks);
  EXPECT_EQ(snap2.positions(0, 0), (Positions{0, 3}));
  EXPECT_EQ(snap2.scores(0, 0), (std::vector<float>{0.0f, 0.5f}));
  vc::SnapKVCache<T> snap3(snap_config(3, 1, 2));
  (void)snap3.update_and_fetch(keys, values, looks);
  EXPECT_EQ(snap3.positions(0, 0), (Positions{0, 3, 5}));
  // All-zero queries: uniform scores, a full tie: the earliest rows are kept.
  vc::SnapKVCache<T> flat(snap_config(3, 1, 2));
  (void)flat.update_and_fetch(keys, values, zero);
  EXPECT_EQ(flat.positions(0, 0), (Positions{0, 1, 2}));
}

}  // namespace
