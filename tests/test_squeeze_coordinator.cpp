// Tests of SqueezeCoordinator: the coordinator protocol of docs/design.md 5.4 (steps 1, 2 and 6), the
// generation mechanism, bad reports (docs/design.md 8) and thread safety (docs/design.md 2.4). Expected budgets come
// from the independent oracle (tests/reference/oracle.hpp) or from the worked vectors of docs/design.md 5.3.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;

/// Every published budget of `coord` for the ids in `ids` (empty optionals included).
std::map<int, std::optional<int>> budget_map(const vc::SqueezeCoordinator& coord,
                                             const std::vector<int>& ids) {
  std::map<int, std::optional<int>> out;
  for (int id : ids) out[id] = coord.resolved_budget(id);
  return out;
}

/// Expects `fn` to throw std::invalid_argument whose message contains every one of `parts`.
template <class Fn>
void expect_invalid_argument(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message '" << msg << "' lacks '" << p << "'";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Construction and accessors (docs/design.md 2.4)
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, AccessorsReturnConstructorArguments) {
  const vc::SqueezeCoordinator coord(5, 96, 3, 0.25);
  EXPECT_EQ(coord.n_layers(), 5);
  EXPECT_EQ(coord.avg_budget(), 96);
  EXPECT_EQ(coord.n_sink(), 3);
  EXPECT_DOUBLE_EQ(coord.strength(), 0.25);
  EXPECT_EQ(coord.generation(), 0u);
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_TRUE(coord.reports().empty());
}

TEST(SqueezeCoordinatorTest, ConstructorRejectsBadArguments) {
  expect_invalid_argument([] { vc::SqueezeCoordinator c(0, 100, 4, 1.0); }, {"n_layers", "0"});
  expect_invalid_argument([] { vc::SqueezeCoordinator c(-3, 100, 4, 1.0); }, {"n_layers", "-3"});
  expect_invalid_argument([] { vc::SqueezeCoordinator c(2, 4, 4, 1.0); }, {"avg_budget", "4"});
  expect_invalid_argument([] { vc::SqueezeCoordinator c(2, 100, 4, 1.5); }, {"strength", "1.5"});
  expect_invalid_argument([] { vc::SqueezeCoordinator c(2, 100, 4, -0.1); }, {"strength"});
  expect_invalid_argument(
      [] { vc::SqueezeCoordinator c(2, 100, 4, std::numeric_limits<double>::quiet_NaN()); },
      {"strength"});
  // The boundary values are accepted.
  EXPECT_NO_THROW(vc::SqueezeCoordinator(1, 5, 4, 0.0));
  EXPECT_NO_THROW(vc::SqueezeCoordinator(1, 5, 4, 1.0));
}

// ---------------------------------------------------------------------------------------------
// Step 2: finalisation after n_layers distinct layers, budgets in ascending id order
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, NotFinalizedUntilAllLayersReport) {
  vc::SqueezeCoordinator coord(3, 100, 4, 1.0);
  coord.report_concentration(0, 0.1);
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_FALSE(coord.resolved_budget(0).has_value());
  coord.report_concentration(1, 0.5);
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_FALSE(coord.resolved_budget(0).has_value());
  EXPECT_FALSE(coord.resolved_budget(1).has_value());
  coord.report_concentration(2, 0.9);
  ASSERT_TRUE(coord.is_finalized());
  // docs/design.md 5.3 worked vector ({0.1, 0.5, 0.9}, 100, 4, 1) -> {180, 100, 20}.
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(180));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(2), std::optional<int>(20));
  const std::map<int, double> expected_reports{{0, 0.1}, {1, 0.5}, {2, 0.9}};
  EXPECT_EQ(coord.reports(), expected_reports);
}

TEST(SqueezeCoordinatorTest, BudgetsIndependentOfReportOrder) {
  const std::vector<double> c = {0.05, 0.25, 0.5, 0.75, 0.95};
  const std::vector<int> ids = {0, 1, 2, 3, 4};
  // docs/design.md 5.3 worked vector.
  const std::map<int, std::optional<int>> expected{{0, 570}, {1, 450}, {2, 300}, {3, 150}, {4, 30}};
  std::vector<int> order = ids;
  int permutations = 0;
  do {
    vc::SqueezeCoordinator coord(5, 300, 4, 1.0);
    for (int id : order) coord.report_concentration(id, c[static_cast<std::size_t>(id)]);
    ASSERT_TRUE(coord.is_finalized());
    EXPECT_EQ(budget_map(coord, ids), expected) << "permutation " << permutations;
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 120);
}

TEST(SqueezeCoordinatorTest, ReportOrder201MatchesOrder012) {
  vc::SqueezeCoordinator a(3, 64, 4, 1.0);
  vc::SqueezeCoordinator b(3, 64, 4, 1.0);
  const std::vector<double> c = {0.3, 0.6, 0.1};
  for (int id : {0, 1, 2}) a.report_concentration(id, c[static_cast<std::size_t>(id)]);
  for (int id : {2, 0, 1}) b.report_concentration(id, c[static_cast<std::size_t>(id)]);
  const std::vector<int> expected = ref::squeeze_budgets(c, 64, 4, 1.0);
  for (int id : {0, 1, 2}) {
    EXPECT_EQ(a.resolved_budget(id), std::optional<int>(expected[static_cast<std::size_t>(id)]));
    EXPECT_EQ(b.resolved_budget(id), a.resolved_budget(id));
  }
  // The budgets differ per layer, so a permutation of the assignment would be caught.
  EXPECT_NE(expected[0], expected[1]);
  EXPECT_NE(expected[1], expected[2]);
}

TEST(SqueezeCoordinatorTest, NonContiguousIdsMapInAscendingOrder) {
  vc::SqueezeCoordinator coord(3, 100, 4, 1.0);
  // Reported out of order: id 4 first, then 0, then 2.
  coord.report_concentration(4, 0.9);
  coord.report_concentration(0, 0.1);
  EXPECT_FALSE(coord.is_finalized());
  coord.report_concentration(2, 0.5);
  ASSERT_TRUE(coord.is_finalized());
  // Ascending ids 0, 2, 4 carry concentrations 0.1, 0.5, 0.9 -> {180, 100, 20}.
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(180));
  EXPECT_EQ(coord.resolved_budget(2), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(4), std::optional<int>(20));
  for (int id : {1, 3, 5, 100}) EXPECT_FALSE(coord.resolved_budget(id).has_value()) << id;
}

TEST(SqueezeCoordinatorTest, LargeIdsCountAsDistinctLayers) {
  vc::SqueezeCoordinator coord(2, 100, 4, 0.5);
  coord.report_concentration(1000, 0.9);
  EXPECT_FALSE(coord.is_finalized());
  coord.report_concentration(7, 0.1);
  ASSERT_TRUE(coord.is_finalized());
  // ({0.1, 0.9}, 100, 4, 0.5) -> {140, 60}; id 7 < id 1000.
  EXPECT_EQ(coord.resolved_budget(7), std::optional<int>(140));
  EXPECT_EQ(coord.resolved_budget(1000), std::optional<int>(60));
}

TEST(SqueezeCoordinatorTest, SingleLayerGetsAverageBudget) {
  vc::SqueezeCoordinator coord(1, 100, 4, 1.0);
  coord.report_concentration(3, 0.5);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(3), std::optional<int>(100));
  EXPECT_FALSE(coord.resolved_budget(0).has_value());
}

TEST(SqueezeCoordinatorTest, StrengthZeroGivesEveryLayerTheAverage) {
  vc::SqueezeCoordinator coord(4, 77, 4, 0.0);
  const std::vector<double> c = {0.0, 0.99, 0.3, -0.4};
  for (int id = 0; id < 4; ++id) coord.report_concentration(id, c[static_cast<std::size_t>(id)]);
  ASSERT_TRUE(coord.is_finalized());
  for (int id = 0; id < 4; ++id) EXPECT_EQ(coord.resolved_budget(id), std::optional<int>(77));
}

TEST(SqueezeCoordinatorTest, FloorAndClampFollowSqueezeBudgets) {
  // ({0, 1, 1, 1}, 50, 8, 1) -> {200, 9, 9, 9}; ({-0.5, 0.9}, 100, 4, 1) -> {182, 18}.
  vc::SqueezeCoordinator a(4, 50, 8, 1.0);
  for (int id : {3, 1, 0, 2}) a.report_concentration(id, id == 0 ? 0.0 : 1.0);
  EXPECT_EQ(budget_map(a, {0, 1, 2, 3}),
            (std::map<int, std::optional<int>>{{0, 200}, {1, 9}, {2, 9}, {3, 9}}));
  vc::SqueezeCoordinator b(2, 100, 4, 1.0);
  b.report_concentration(1, 0.9);
  b.report_concentration(0, -0.5);
  EXPECT_EQ(budget_map(b, {0, 1}), (std::map<int, std::optional<int>>{{0, 182}, {1, 18}}));
}

// ---------------------------------------------------------------------------------------------
// Step 1: first report per layer wins; reports after finalisation are ignored
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, FirstReportPerLayerWins) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  coord.report_concentration(0, 0.1);
  coord.report_concentration(0, 0.9);  // ignored: layer 0 already reported
  coord.report_concentration(0, 0.5);  // ignored
  // A repeated id is not a distinct layer: still waiting for a second layer.
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_EQ(coord.reports(), (std::map<int, double>{{0, 0.1}}));
  coord.report_concentration(1, 0.5);
  ASSERT_TRUE(coord.is_finalized());
  const std::vector<int> expected = ref::squeeze_budgets({0.1, 0.5}, 100, 4, 1.0);
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(expected[0]));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(expected[1]));
  // Had the second report of layer 0 won, the budgets would be different.
  EXPECT_NE(ref::squeeze_budgets({0.9, 0.5}, 100, 4, 1.0), expected);
  EXPECT_EQ(expected, (std::vector<int>{129, 71}));
}

TEST(SqueezeCoordinatorTest, ReportsAfterFinalisationAreIgnored) {
  vc::SqueezeCoordinator coord(3, 100, 4, 1.0);
  coord.report_concentration(0, 0.1);
  coord.report_concentration(1, 0.5);
  coord.report_concentration(2, 0.9);
  ASSERT_TRUE(coord.is_finalized());
  const auto before = budget_map(coord, {0, 1, 2, 3, 7});
  const auto reports_before = coord.reports();
  coord.report_concentration(0, 0.95);  // a known layer again
  coord.report_concentration(3, 0.0);   // an unknown layer
  coord.report_concentration(7, 0.2);   // another unknown layer
  EXPECT_TRUE(coord.is_finalized());
  EXPECT_EQ(budget_map(coord, {0, 1, 2, 3, 7}), before);
  EXPECT_EQ(coord.reports(), reports_before);
  EXPECT_FALSE(coord.resolved_budget(3).has_value());
  EXPECT_FALSE(coord.resolved_budget(7).has_value());
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(180));
}

TEST(SqueezeCoordinatorTest, ResolvedBudgetEmptyBeforeFinalisationAndForUnknownIds) {
  vc::SqueezeCoordinator coord(2, 40, 2, 1.0);
  for (int id : {-1, 0, 1, 2}) EXPECT_FALSE(coord.resolved_budget(id).has_value()) << id;
  coord.report_concentration(1, 0.2);
  // Layer 1 has reported, but nothing is published before finalisation.
  EXPECT_FALSE(coord.resolved_budget(1).has_value());
  EXPECT_FALSE(coord.resolved_budget(1, coord.generation()).has_value());
  coord.report_concentration(0, 0.6);
  ASSERT_TRUE(coord.is_finalized());
  const std::vector<int> expected = ref::squeeze_budgets({0.6, 0.2}, 40, 2, 1.0);
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(expected[0]));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(expected[1]));
  for (int id : {-1, 2, 3}) EXPECT_FALSE(coord.resolved_budget(id).has_value()) << id;
}

// ---------------------------------------------------------------------------------------------
// Bad reports (docs/design.md 8): throw, record nothing
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, NegativeLayerIdThrowsAndRecordsNothing) {
  vc::SqueezeCoordinator coord(1, 100, 4, 1.0);
  expect_invalid_argument([&] { coord.report_concentration(-1, 0.5); }, {"layer_id", "-1"});
  expect_invalid_argument([&] { (void)coord.report(-7, 0.5); }, {"layer_id", "-7"});
  // With n_layers = 1 a recorded report would have finalised the coordinator.
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_TRUE(coord.reports().empty());
  EXPECT_EQ(coord.generation(), 0u);
  coord.report_concentration(0, 0.5);
  EXPECT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(100));
}

TEST(SqueezeCoordinatorTest, NonFiniteConcentrationThrowsAndRecordsNothing) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {nan, inf, -inf}) {
    expect_invalid_argument([&] { coord.report_concentration(0, bad); }, {"concentration"});
    expect_invalid_argument([&] { (void)coord.report(1, bad); }, {"concentration"});
  }
  EXPECT_TRUE(coord.reports().empty());
  EXPECT_FALSE(coord.is_finalized());
  // The layers can still report afterwards: the bad reports did not take their slot.
  coord.report_concentration(0, 0.1);
  coord.report_concentration(1, 0.9);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.reports(), (std::map<int, double>{{0, 0.1}, {1, 0.9}}));
  const std::vector<int> expected = ref::squeeze_budgets({0.1, 0.9}, 100, 4, 1.0);
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(expected[0]));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(expected[1]));
}

TEST(SqueezeCoordinatorTest, BadReportAfterOneGoodReportKeepsState) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  coord.report_concentration(0, 0.3);
  EXPECT_THROW(coord.report_concentration(1, std::numeric_limits<double>::quiet_NaN()),
               std::invalid_argument);
  EXPECT_THROW(coord.report_concentration(-2, 0.3), std::invalid_argument);
  EXPECT_EQ(coord.reports(), (std::map<int, double>{{0, 0.3}}));
  EXPECT_FALSE(coord.is_finalized());
}

// ---------------------------------------------------------------------------------------------
// Step 6: reset and generations
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, ResetClearsAndStartsFreshRound) {
  vc::SqueezeCoordinator coord(3, 100, 4, 1.0);
  coord.report_concentration(0, 0.1);
  coord.report_concentration(1, 0.5);
  coord.report_concentration(2, 0.9);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.generation(), 0u);

  coord.reset();
  EXPECT_EQ(coord.generation(), 1u);
  EXPECT_FALSE(coord.is_finalized());
  EXPECT_TRUE(coord.reports().empty());
  for (int id : {0, 1, 2}) EXPECT_FALSE(coord.resolved_budget(id).has_value()) << id;

  // A fresh round with reversed concentrations; layer 0 may report again.
  coord.report_concentration(0, 0.9);
  coord.report_concentration(1, 0.5);
  EXPECT_FALSE(coord.is_finalized());
  coord.report_concentration(2, 0.1);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(20));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(2), std::optional<int>(180));

  coord.reset();
  coord.reset();
  EXPECT_EQ(coord.generation(), 3u);
  EXPECT_FALSE(coord.is_finalized());
}

TEST(SqueezeCoordinatorTest, ResetBeforeFinalisationDropsPartialReports) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  coord.report_concentration(0, 0.9);
  coord.reset();
  // Without the reset this report would complete the set with layer 0 at 0.9.
  coord.report_concentration(1, 0.1);
  EXPECT_FALSE(coord.is_finalized());
  coord.report_concentration(0, 0.1);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(100));
}

TEST(SqueezeCoordinatorTest, ReportReturnsCurrentGeneration) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  EXPECT_EQ(coord.report(0, 0.2), 0u);
  EXPECT_EQ(coord.report(1, 0.4), 0u);
  coord.reset();
  coord.reset();
  EXPECT_EQ(coord.report(1, 0.4), 2u);
  // Even an ignored (duplicate) report returns the current generation.
  EXPECT_EQ(coord.report(1, 0.8), 2u);
}

TEST(SqueezeCoordinatorTest, ResolvedBudgetForStaleGenerationIsEmpty) {
  vc::SqueezeCoordinator coord(2, 100, 4, 1.0);
  const std::uint64_t g0 = coord.report(0, 0.1);
  EXPECT_FALSE(coord.resolved_budget(0, g0).has_value());  // not finalised yet
  (void)coord.report(1, 0.9);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(0, g0), std::optional<int>(180));
  EXPECT_EQ(coord.resolved_budget(1, g0), std::optional<int>(20));
  EXPECT_FALSE(coord.resolved_budget(0, g0 + 1).has_value());  // a generation not yet reached

  coord.reset();
  const std::uint64_t g1 = coord.report(0, 0.9);
  EXPECT_EQ(g1, g0 + 1);
  (void)coord.report(1, 0.1);
  ASSERT_TRUE(coord.is_finalized());
  // The old generation's budgets are gone even though the layer ids are published again.
  EXPECT_FALSE(coord.resolved_budget(0, g0).has_value());
  EXPECT_FALSE(coord.resolved_budget(1, g0).has_value());
  EXPECT_EQ(coord.resolved_budget(0, g1), std::optional<int>(20));
  EXPECT_EQ(coord.resolved_budget(1, g1), std::optional<int>(180));
  EXPECT_FALSE(coord.resolved_budget(2, g1).has_value());
}

// ---------------------------------------------------------------------------------------------
// Thread safety (docs/design.md 2.4): concurrent reports finalise exactly like the serial computation
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorTest, ConcurrentReportsMatchSerialComputation) {
  constexpr int kLayers = 16;
  constexpr int kRounds = 50;
  constexpr int kAvg = 128;
  constexpr int kSink = 4;
  vc::SqueezeCoordinator coord(kLayers, kAvg, kSink, 1.0);
  std::mt19937 rng(20240611u);
  std::uniform_real_distribution<double> unit(-0.2, 1.0);

  for (int round = 0; round < kRounds; ++round) {
    std::vector<double> c(kLayers);
    for (double& x : c) x = unit(rng);
    const std::vector<int> serial = ref::squeeze_budgets(c, kAvg, kSink, 1.0);
    const std::uint64_t gen = coord.generation();
    ASSERT_EQ(gen, static_cast<std::uint64_t>(round));

    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::atomic<int> wrong_generation{0};
    std::atomic<int> wrong_early_budget{0};
    std::vector<std::thread> threads;
    threads.reserve(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      threads.emplace_back([&, l] {
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        const double mine = c[static_cast<std::size_t>(l)];
        if (coord.report(l, mine) != gen) wrong_generation.fetch_add(1);
        // A second, different report of the same layer must be ignored.
        coord.report_concentration(l, 1.0 - mine);
        // Any budget observed mid-round must already be the final one.
        for (int other = 0; other < kLayers; ++other) {
          const std::optional<int> b = coord.resolved_budget(other, gen);
          if (b && *b != serial[static_cast<std::size_t>(other)]) wrong_early_budget.fetch_add(1);
        }
      });
    }
    while (ready.load() < kLayers) std::this_thread::yield();
    go.store(true);
    for (auto& t : threads) t.join();

    ASSERT_TRUE(coord.is_finalized()) << "round " << round;
    EXPECT_EQ(wrong_generation.load(), 0) << "round " << round;
    EXPECT_EQ(wrong_early_budget.load(), 0) << "round " << round;
    const std::map<int, double> reports = coord.reports();
    ASSERT_EQ(reports.size(), static_cast<std::size_t>(kLayers));
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(reports.at(l), c[static_cast<std::size_t>(l)]) << "round " << round;
      EXPECT_EQ(coord.resolved_budget(l), std::optional<int>(serial[static_cast<std::size_t>(l)]))
          << "round " << round << " layer " << l;
    }
    coord.reset();
  }
  EXPECT_EQ(coord.generation(), static_cast<std::uint64_t>(kRounds));
}

TEST(SqueezeCoordinatorTest, ConcurrentCachesAdoptSerialBudgets) {
  // 8 squeeze layers, each driven from its own thread (prefill, then one decode step after all
  // prefills): every layer ends up with exactly the serially computed budget.
  using T = float;
  constexpr int kLayers = 8;
  constexpr Eigen::Index B = 1, H = 2, S = 48, D = 8;
  vc::KVCacheConfig config;
  config.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  config.squeeze_budget = 16;
  config.squeeze_n_sink = 2;
  auto coord = std::make_shared<vc::SqueezeCoordinator>(kLayers, 16, 2, 1.0);
  std::vector<std::unique_ptr<vc::SqueezeAttentionCache<T>>> caches;
  std::vector<vc::Tensor4<T>> prefill;
  std::mt19937 rng(77u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    caches.push_back(std::make_unique<vc::SqueezeAttentionCache<T>>(config, l, coord));
    // Layer l: keys = alpha_l * e_0 + noise (more clustered with depth).
    vc::Tensor4<T> k(B, H, S, D);
    const float alpha = 0.5f * static_cast<float>(l);
    for (Eigen::Index b = 0; b < B; ++b)
      for (Eigen::Index h = 0; h < H; ++h)
        for (Eigen::Index s = 0; s < S; ++s)
          for (Eigen::Index d = 0; d < D; ++d) k(b, h, s, d) = (d == 0 ? alpha : 0.0f) + normal(rng);
    prefill.push_back(k);
  }
  std::vector<std::thread> threads;
  for (int l = 0; l < kLayers; ++l) {
    threads.emplace_back([&, l] {
      const auto& k = prefill[static_cast<std::size_t>(l)];
      (void)caches[static_cast<std::size_t>(l)]->update_and_fetch(k, k);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(coord->is_finalized());
  std::vector<double> c;
  for (const auto& cache : caches) c.push_back(cache->concentration());
  const std::vector<int> serial = ref::squeeze_budgets(c, 16, 2, 1.0);
  threads.clear();
  vc::Tensor4<T> step(B, H, 1, D);
  step.setConstant(0.25f);
  for (int l = 0; l < kLayers; ++l) {
    threads.emplace_back([&, l] { (void)caches[static_cast<std::size_t>(l)]->update_and_fetch(step, step); });
  }
  for (auto& t : threads) t.join();
  for (int l = 0; l < kLayers; ++l) {
    const auto& cache = *caches[static_cast<std::size_t>(l)];
    EXPECT_TRUE(cache.budget_adopted()) << l;
    EXPECT_EQ(cache.layer_budget(), serial[static_cast<std::size_t>(l)]) << l;
    // A layer adopts in its prefill (if it completed the set) or at the start of the decode step;
    // before that it evicted against squeeze_budget (16).
    const std::int64_t budget = serial[static_cast<std::size_t>(l)];
    if (budget <= 16) {
      EXPECT_EQ(cache.tokens_kept(), budget) << l;
    } else {
      const std::int64_t kept = cache.tokens_kept();
      EXPECT_TRUE(kept == 17 || kept == std::min<std::int64_t>(budget, S + 1)) << l << ": " << kept;
    }
    EXPECT_EQ(coord->reports().at(l), cache.concentration()) << l;
  }
  EXPECT_NE(serial.front(), serial.back());
}

}  // namespace
