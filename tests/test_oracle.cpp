// Self-tests of the naive reference oracle (tests/reference/oracle.hpp) against hand-computed facts
// and the worked vectors of docs/design.md, so that the oracle can be trusted when the fast library is
// compared against it.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "reference/oracle.hpp"

namespace {

namespace ref = veloxquant::reference;
using Positions = std::vector<std::int64_t>;

/// Grace rule of SqueezeAttention/PyramidKV for a given recent ratio and n_sink.
std::function<int(int)> ratio_grace(double ratio, int n_sink) {
    return [ratio, n_sink](int budget) { return ref::protected_recent_ratio(ratio, budget, n_sink); };
}

/// A one-element vector (D = 1 key or value).
std::vector<double> v1(double x) { return std::vector<double>{x}; }

/// n random keys of dimension d, N(0, scale^2) entries.
std::vector<std::vector<double>> random_rows(std::mt19937& rng, int n, int d, double scale) {
    std::normal_distribution<double> dist(0.0, scale);
    std::vector<std::vector<double>> rows(static_cast<std::size_t>(n), std::vector<double>(static_cast<std::size_t>(d)));
    for (auto& r : rows)
        for (auto& x : r) x = dist(rng);
    return rows;
}

// ---------------------------------------------------------------------------------------------
// round_half_even
// ---------------------------------------------------------------------------------------------

TEST(OracleRounding, HalfToEven) {
    EXPECT_EQ(ref::round_half_even(0.5), 0);
    EXPECT_EQ(ref::round_half_even(1.5), 2);
    EXPECT_EQ(ref::round_half_even(2.5), 2);
    EXPECT_EQ(ref::round_half_even(3.5), 4);
    EXPECT_EQ(ref::round_half_even(-0.5), 0);
    EXPECT_EQ(ref::round_half_even(-1.5), -2);
    EXPECT_EQ(ref::round_half_even(-2.5), -2);
    EXPECT_EQ(ref::round_half_even(2.4999), 2);
    EXPECT_EQ(ref::round_half_even(2.5001), 3);
    EXPECT_EQ(ref::round_half_even(-2.6), -3);
    EXPECT_EQ(ref::round_half_even(7.0), 7);
    EXPECT_EQ(ref::round_half_even(0.0), 0);
}

// ---------------------------------------------------------------------------------------------
// squeeze_budgets, docs/design.md 5.3 worked vectors
// ---------------------------------------------------------------------------------------------

TEST(OracleSqueezeBudgets, WorkedVectors) {
    EXPECT_EQ(ref::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4, 1.0), (std::vector<int>{180, 100, 20}));
    EXPECT_EQ(ref::squeeze_budgets({0.1, 0.3, 0.5, 0.7, 0.9}, 200, 4, 1.0),
              (std::vector<int>{360, 280, 200, 120, 40}));
    EXPECT_EQ(ref::squeeze_budgets({0.1, 0.9}, 100, 4, 0.5), (std::vector<int>{140, 60}));
    EXPECT_EQ(ref::squeeze_budgets({-0.5, 0.9}, 100, 4, 1.0), (std::vector<int>{182, 18}));
    EXPECT_EQ(ref::squeeze_budgets({0.0, 1.0, 1.0, 1.0}, 50, 8, 1.0), (std::vector<int>{200, 9, 9, 9}));
    EXPECT_EQ(ref::squeeze_budgets({1.0, 1.0, 1.0}, 64, 4, 1.0), (std::vector<int>{64, 64, 64}));
    EXPECT_EQ(ref::squeeze_budgets({0.05, 0.25, 0.5, 0.75, 0.95}, 300, 4, 1.0),
              (std::vector<int>{570, 450, 300, 150, 30}));
    EXPECT_EQ(ref::squeeze_budgets({0.25, 0.75}, 5, 0, 1.0), (std::vector<int>{8, 2}));  // 7.5 -> 8, 2.5 -> 2
    EXPECT_EQ(ref::squeeze_budgets({0.5}, 100, 4, 1.0), (std::vector<int>{100}));
    EXPECT_EQ(ref::squeeze_budgets({0.9}, 2, 8, 1.0), (std::vector<int>{9}));
}

TEST(OracleSqueezeBudgets, DefaultStrengthIsOne) {
    EXPECT_EQ(ref::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4), (std::vector<int>{180, 100, 20}));
}

TEST(OracleSqueezeBudgets, StrengthZeroIsUniform) {
    EXPECT_EQ(ref::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4, 0.0), (std::vector<int>{100, 100, 100}));
    EXPECT_EQ(ref::squeeze_budgets({0.0, 1.0, -3.0, 0.77, 0.2}, 37, 2, 0.0),
              (std::vector<int>{37, 37, 37, 37, 37}));
    EXPECT_EQ(ref::squeeze_budgets({0.05, 0.95}, 512, 4, 0.0), (std::vector<int>{512, 512}));
}

TEST(OracleSqueezeBudgets, EmptyInputGivesEmptyOutput) {
    EXPECT_TRUE(ref::squeeze_budgets({}, 100, 4, 1.0).empty());
    EXPECT_TRUE(ref::squeeze_budgets({}, 100, 4, 0.3).empty());
}

TEST(OracleSqueezeBudgets, BadStrengthThrows) {
    EXPECT_THROW(ref::squeeze_budgets({0.1, 0.9}, 100, 4, -0.01), std::invalid_argument);
    EXPECT_THROW(ref::squeeze_budgets({0.1, 0.9}, 100, 4, 1.01), std::invalid_argument);
    EXPECT_THROW(ref::squeeze_budgets({0.1, 0.9}, 100, 4, std::numeric_limits<double>::quiet_NaN()),
                 std::invalid_argument);
    EXPECT_NO_THROW(ref::squeeze_budgets({0.1, 0.9}, 100, 4, 0.0));
    EXPECT_NO_THROW(ref::squeeze_budgets({0.1, 0.9}, 100, 4, 1.0));
}

// ---------------------------------------------------------------------------------------------
// pyramid_budgets, docs/design.md 6 worked vectors
// ---------------------------------------------------------------------------------------------

TEST(OraclePyramidBudgets, WorkedVectors) {
    // beta 2: v = {195, 131.67, 68.33, 5}, sum already 400 -> no water-filling.
    EXPECT_EQ(ref::pyramid_budgets(4, 100, 4, 2.0), (std::vector<int>{195, 132, 68, 5}));
    // beta 3: v = {290, 163.33, 36.67, -90}; clamp -90 -> 5, excess 95 over slack 475 -> {233, 131.67, 30.33, 5}.
    EXPECT_EQ(ref::pyramid_budgets(4, 100, 4, 3.0), (std::vector<int>{233, 132, 30, 5}));
    EXPECT_EQ(ref::pyramid_budgets(5, 512, 4, 1.0), (std::vector<int>{512, 512, 512, 512, 512}));
}

TEST(OraclePyramidBudgets, DefaultBetaIsTwo) {
    EXPECT_EQ(ref::pyramid_budgets(4, 100, 4), (std::vector<int>{195, 132, 68, 5}));
}

TEST(OraclePyramidBudgets, EdgeCounts) {
    EXPECT_TRUE(ref::pyramid_budgets(0, 100, 4, 2.0).empty());
    EXPECT_TRUE(ref::pyramid_budgets(-3, 100, 4, 2.0).empty());
    EXPECT_EQ(ref::pyramid_budgets(1, 100, 4, 2.0), (std::vector<int>{100}));
    EXPECT_EQ(ref::pyramid_budgets(1, 3, 4, 2.0), (std::vector<int>{5}));  // max(avg, n_sink + 1)
}

TEST(OraclePyramidBudgets, BetaBelowOneThrows) {
    EXPECT_THROW(ref::pyramid_budgets(4, 100, 4, 0.5), std::invalid_argument);
    EXPECT_THROW(ref::pyramid_budgets(4, 100, 4, 0.999), std::invalid_argument);
    EXPECT_THROW(ref::pyramid_budgets(4, 100, 4, std::numeric_limits<double>::quiet_NaN()),
                 std::invalid_argument);
}

TEST(OraclePyramidBudgets, ExtremeBetaStaysAtOrAboveFloorAndNearAverage) {
    const std::vector<int> b = ref::pyramid_budgets(6, 64, 4, 10.0);
    ASSERT_EQ(b.size(), 6u);
    long long sum = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
        EXPECT_GE(b[i], 5) << i;
        if (i > 0) {
            EXPECT_LE(b[i], b[i - 1]) << i;  // non-increasing with depth
        }
        sum += b[i];
    }
    EXPECT_NEAR(static_cast<double>(sum), 6.0 * 64.0, 6.0);  // water-filling keeps the mean (up to rounding)
}

// ---------------------------------------------------------------------------------------------
// concentration_score_gram, docs/design.md 5.1
// ---------------------------------------------------------------------------------------------

TEST(OracleConcentration, ParallelRowsGiveOne) {
    const std::vector<std::vector<double>> rows = {{1.0, 2.0, -0.5}, {2.0, 4.0, -1.0}, {0.1, 0.2, -0.05}, {30, 60, -15}};
    EXPECT_NEAR(ref::concentration_score_gram(rows), 1.0, 1e-6);
}

TEST(OracleConcentration, AntiParallelPairGivesMinusOne) {
    const std::vector<std::vector<double>> rows = {{3.0, -4.0}, {-6.0, 8.0}};
    EXPECT_NEAR(ref::concentration_score_gram(rows), -1.0, 1e-6);
}

TEST(OracleConcentration, OrthogonalRowsGiveZero) {
    const std::vector<std::vector<double>> rows = {{2.0, 0.0, 0.0}, {0.0, -5.0, 0.0}, {0.0, 0.0, 0.25}};
    EXPECT_NEAR(ref::concentration_score_gram(rows), 0.0, 1e-12);
}

TEST(OracleConcentration, FewerThanTwoRowsGiveZero) {
    EXPECT_EQ(ref::concentration_score_gram({}), 0.0);
    EXPECT_EQ(ref::concentration_score_gram({{1.0, 2.0, 3.0}}), 0.0);
}

TEST(OracleConcentration, HandComputedValue) {
    // u = (1,0), (0,1), (1,1)/sqrt2. Off-diagonal pairs: 0, 1/sqrt2, 1/sqrt2, each counted twice
    // -> sum = 2*sqrt2; divided by n(n-1) = 6 -> sqrt2/3.
    const std::vector<std::vector<double>> rows = {{1.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}};
    EXPECT_NEAR(ref::concentration_score_gram(rows), std::sqrt(2.0) / 3.0, 1e-7);
}

TEST(OracleConcentration, ScaleInvariant) {
    std::mt19937 rng(1234);
    const auto rows = random_rows(rng, 7, 5, 1.0);
    const double c = ref::concentration_score_gram(rows);
    for (double s : {0.5, 3.0, 1000.0}) {
        auto scaled = rows;
        for (auto& r : scaled)
            for (auto& x : r) x *= s;
        EXPECT_NEAR(ref::concentration_score_gram(scaled), c, 1e-7) << "scale " << s;
    }
    // Scaling single rows (not all rows together) leaves every cosine unchanged as well.
    auto mixed = rows;
    for (std::size_t i = 0; i < mixed.size(); ++i)
        for (auto& x : mixed[i]) x *= static_cast<double>(i + 1) * 2.5;
    EXPECT_NEAR(ref::concentration_score_gram(mixed), c, 1e-7);
    EXPECT_GE(c, -1.0);
    EXPECT_LE(c, 1.0);
}

TEST(OracleConcentration, MatchesOnDFormula) {
    // Independent O(nD) form of docs/design.md 5.1: (|sum u|^2 - sum |u|^2) / (n (n-1)).
    std::mt19937 rng(99);
    for (int n : {2, 3, 10, 33}) {
        const auto rows = random_rows(rng, n, 6, 2.0);
        std::vector<double> total(6, 0.0);
        double diag = 0.0;
        for (const auto& r : rows) {
            double sq = 0.0;
            for (double x : r) sq += x * x;
            const double denom = std::sqrt(sq) + 1e-8;
            for (std::size_t k = 0; k < 6; ++k) {
                total[k] += r[k] / denom;
                diag += (r[k] / denom) * (r[k] / denom);
            }
        }
        double all = 0.0;
        for (double t : total) all += t * t;
        const double expected = (all - diag) / (static_cast<double>(n) * (n - 1));
        EXPECT_NEAR(ref::concentration_score_gram(rows), expected, 1e-12) << "n " << n;
    }
}

// ---------------------------------------------------------------------------------------------
// protected recent window, docs/design.md 4.2 step 3
// ---------------------------------------------------------------------------------------------

TEST(OracleProtectedRecent, RatioRule) {
    EXPECT_EQ(ref::protected_recent_ratio(0.5, 512, 4), 254);  // floor(0.5 * 508)
    EXPECT_EQ(ref::protected_recent_ratio(0.5, 3, 1), 1);      // floor(0.5 * 2)
    EXPECT_EQ(ref::protected_recent_ratio(0.3, 14, 4), 3);     // floor(3.0)
    EXPECT_EQ(ref::protected_recent_ratio(0.5, 9, 2), 3);      // floor(3.5)
    EXPECT_EQ(ref::protected_recent_ratio(0.25, 14, 4), 2);    // floor(2.5)
    EXPECT_EQ(ref::protected_recent_ratio(0.9, 14, 4), 9);     // floor(9.0) = 9 = budget - n_sink - 1
    EXPECT_EQ(ref::protected_recent_ratio(0.0, 100, 4), 0);
    EXPECT_EQ(ref::protected_recent_ratio(1.0, 10, 4), 5);  // 6 clamped to budget - n_sink - 1
    EXPECT_EQ(ref::protected_recent_ratio(0.5, 5, 4), 0);   // floor(0.5) = 0
    EXPECT_EQ(ref::protected_recent_ratio(1.0, 5, 4), 0);   // 1 clamped to 0
}

TEST(OracleProtectedRecent, FixedRule) {
    EXPECT_EQ(ref::protected_recent_fixed(16, 512, 4), 16);
    EXPECT_EQ(ref::protected_recent_fixed(16, 10, 4), 5);
    EXPECT_EQ(ref::protected_recent_fixed(0, 10, 4), 0);
    EXPECT_EQ(ref::protected_recent_fixed(-3, 10, 4), 0);
    EXPECT_EQ(ref::protected_recent_fixed(16, 21, 4), 16);
    EXPECT_EQ(ref::protected_recent_fixed(16, 20, 4), 15);
}

// ---------------------------------------------------------------------------------------------
// H2OHeadOracle: hand-computed example (docs/design.md 4.2)
// ---------------------------------------------------------------------------------------------

TEST(OracleH2O, HandComputedScoresAndEvictions) {
    // n_sink = 1, decay = 0.5, budget = 3, recent ratio 0.5 -> g = floor(0.5 * (3 - 1)) = 1. D = 1,
    // so logit_r = K_r * q (sqrt(1) = 1).
    ref::H2OHeadOracle head(1, 0.5, ratio_grace(0.5, 1));
    head.set_budget(3);
    ASSERT_TRUE(head.budget().has_value());
    EXPECT_EQ(*head.budget(), 3);

    // t0, key 0: empty head -> score 1.
    head.absorb(v1(0.0), v1(10.0));
    EXPECT_EQ(head.positions(), (Positions{0}));
    EXPECT_NEAR(head.scores()[0], 1.0, 1e-12);

    // t1, key 1: attention over {t0} is [1]. s0 = 1*0.5 + 1 = 1.5; s1 = 0.
    head.absorb(v1(1.0), v1(11.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1}));
    EXPECT_NEAR(head.scores()[0], 1.5, 1e-12);
    EXPECT_NEAR(head.scores()[1], 0.0, 1e-12);

    // t2, key ln3: logits {0*ln3, 1*ln3} -> exp {1, 3} -> a = {1/4, 3/4}.
    // s0 = 1.5*0.5 + 1/4 = 1; s1 = 0*0.5 + 3/4 = 3/4; s2 = 0. Three rows = budget: no eviction.
    head.absorb(v1(std::log(3.0)), v1(12.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    EXPECT_NEAR(head.scores()[0], 1.0, 1e-12);
    EXPECT_NEAR(head.scores()[1], 0.75, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);

    // t3, key 0: all logits 0 -> a = {1/3, 1/3, 1/3}.
    // s0 = 0.5 + 1/3 = 5/6; s1 = 0.375 + 1/3 = 17/24; s2 = 1/3; s3 = 0. Four rows > 3:
    // t0 is a sink, t3 is the protected newest (g = 1); candidates t1 (17/24), t2 (1/3) -> evict t2.
    head.absorb(v1(0.0), v1(13.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1, 3}));
    EXPECT_NEAR(head.scores()[0], 5.0 / 6.0, 1e-12);
    EXPECT_NEAR(head.scores()[1], 17.0 / 24.0, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);

    // t4, key ln2: rows t0 (key 0), t1 (key 1), t3 (key 0): logits {0, ln2, 0} -> exp {1, 2, 1}
    // -> a = {1/4, 1/2, 1/4}. s0 = 5/12 + 1/4 = 2/3; s1 = 17/48 + 1/2 = 41/48; s3 = 0 + 1/4 = 1/4;
    // s4 = 0. Candidates t1 (41/48), t3 (1/4) -> evict t3 (the new t4 is protected).
    head.absorb(v1(std::log(2.0)), v1(14.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1, 4}));
    EXPECT_NEAR(head.scores()[0], 2.0 / 3.0, 1e-12);
    EXPECT_NEAR(head.scores()[1], 41.0 / 48.0, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);
    EXPECT_EQ(head.next_position(), 5);

    // Keys and values travel with their rows.
    ASSERT_EQ(head.rows().size(), 3u);
    EXPECT_EQ(head.rows()[1].key, v1(1.0));
    EXPECT_EQ(head.rows()[1].value, v1(11.0));
    EXPECT_EQ(head.rows()[2].value, v1(14.0));
    EXPECT_EQ(head.rows()[2].position, 4);
}

TEST(OracleH2O, TwoDimensionalProxyUsesSqrtD) {
    // D = 2: logit = dot / sqrt(2). Rows t0 = (0, 0), t1 = (sqrt2 * ln3, 0); query t2 = (1, 0):
    // logits {0, ln3} -> a = {1/4, 3/4}. No budget: nothing evicted. Decay 1.
    ref::H2OHeadOracle head(0, 1.0, ratio_grace(0.5, 0));
    const double s2 = std::sqrt(2.0);
    head.absorb({0.0, 0.0}, {0.0});
    head.absorb({s2 * std::log(3.0), 0.0}, {0.0});  // a over {t0} = [1]: s0 = 2
    head.absorb({1.0, 0.0}, {0.0});
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    EXPECT_NEAR(head.scores()[0], 2.25, 1e-12);
    EXPECT_NEAR(head.scores()[1], 0.75, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);
}

TEST(OracleH2O, EvictionTieGoesToEarliestPosition) {
    // D = 1, n_sink = 1, decay 1, budget 3, g = floor(0.5 * 2) = 1.
    // t0 key 1000 (sink) takes all attention mass: for the other keys (1) the logit gap is
    // 1000 - 1 = 999, and exp(-999) underflows to exactly 0 in double. So t1, t2 and t3 keep score
    // exactly 0 and t0 collects 1 per token.
    ref::H2OHeadOracle head(1, 1.0, ratio_grace(0.5, 1));
    head.set_budget(3);
    head.absorb(v1(1000.0), v1(0.0));
    head.absorb(v1(1.0), v1(1.0));
    head.absorb(v1(1.0), v1(2.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    EXPECT_EQ(head.scores(), (std::vector<double>{3.0, 0.0, 0.0}));
    // t3: four rows; t0 sink, t3 protected; candidates t1 and t2 tie at exactly 0 -> evict t1.
    head.absorb(v1(1.0), v1(3.0));
    EXPECT_EQ(head.positions(), (Positions{0, 2, 3}));
    EXPECT_EQ(head.scores(), (std::vector<double>{4.0, 0.0, 0.0}));
    // t4: candidates t2, t3 tie at 0 -> evict t2.
    head.absorb(v1(1.0), v1(4.0));
    EXPECT_EQ(head.positions(), (Positions{0, 3, 4}));
    EXPECT_EQ(head.scores(), (std::vector<double>{5.0, 0.0, 0.0}));
}

TEST(OracleH2O, NoEvictionWhileBudgetUnknown) {
    ref::H2OHeadOracle head(2, 0.98, ratio_grace(0.5, 2));
    EXPECT_FALSE(head.budget().has_value());
    std::mt19937 rng(7);
    const auto keys = random_rows(rng, 40, 4, 1.0);
    for (const auto& k : keys) head.absorb(k, k);
    EXPECT_EQ(head.rows().size(), 40u);
    EXPECT_EQ(head.next_position(), 40);
    EXPECT_EQ(head.positions().front(), 0);
    EXPECT_EQ(head.positions().back(), 39);
}

TEST(OracleH2O, RebudgetKeepsSinksRecentAndHighestScores) {
    // Same tokens as the hand-computed example, but no budget: after t3 the head holds
    // scores {5/6, 17/24, 1/3, 0} for positions {0, 1, 2, 3}.
    ref::H2OHeadOracle head(1, 0.5, ratio_grace(0.5, 1));
    head.absorb(v1(0.0), v1(0.0));
    head.absorb(v1(1.0), v1(1.0));
    head.absorb(v1(std::log(3.0)), v1(2.0));
    head.absorb(v1(0.0), v1(3.0));
    ASSERT_EQ(head.positions(), (Positions{0, 1, 2, 3}));
    EXPECT_NEAR(head.scores()[2], 1.0 / 3.0, 1e-12);

    // Budget 3 -> g = 1: keep sink t0, newest t3, and the best of t1 (17/24) / t2 (1/3) -> t1.
    head.set_budget(3);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 3}));
    EXPECT_NEAR(head.scores()[0], 5.0 / 6.0, 1e-12);  // scores are not reset
    EXPECT_NEAR(head.scores()[1], 17.0 / 24.0, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);

    // A larger budget is just stamped.
    head.set_budget(10);
    EXPECT_EQ(*head.budget(), 10);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 3}));

    // Budget 2 -> g clamped to 2 - 1 - 1 = 0: keep the sink and the higher of t1 (17/24) / t3 (0).
    head.set_budget(2);
    EXPECT_EQ(head.positions(), (Positions{0, 1}));
    EXPECT_NEAR(head.scores()[1], 17.0 / 24.0, 1e-12);
}

TEST(OracleH2O, RebudgetProtectsNewestEvenWithLowestScore) {
    // Budget 2 with n_sink 0 and ratio 0.5: g = floor(0.5 * 2) = 1 (clamp max is 1).
    // Scores {5/6, 17/24, 1/3, 0}: keep newest t3 (score 0) and the highest other, t0.
    ref::H2OHeadOracle head(0, 0.5, ratio_grace(0.5, 0));
    head.absorb(v1(0.0), v1(0.0));
    head.absorb(v1(1.0), v1(1.0));
    head.absorb(v1(std::log(3.0)), v1(2.0));
    head.absorb(v1(0.0), v1(3.0));
    head.set_budget(2);
    EXPECT_EQ(head.positions(), (Positions{0, 3}));
    EXPECT_NEAR(head.scores()[0], 5.0 / 6.0, 1e-12);
    EXPECT_NEAR(head.scores()[1], 0.0, 1e-12);
}

TEST(OracleH2O, RebudgetTieLaterPositionSurvives) {
    // t0 key 1000 (sink, n_sink 1) takes all mass; t1..t4 (key 1) keep exactly 0. Decay 1.
    ref::H2OHeadOracle head(1, 1.0, ratio_grace(0.5, 1));
    head.absorb(v1(1000.0), v1(0.0));
    for (int i = 1; i <= 4; ++i) head.absorb(v1(1.0), v1(static_cast<double>(i)));
    ASSERT_EQ(head.positions(), (Positions{0, 1, 2, 3, 4}));
    EXPECT_EQ(head.scores(), (std::vector<double>{5.0, 0.0, 0.0, 0.0, 0.0}));
    // Budget 3 -> g = 1: sink t0, newest t4, one slot among t1, t2, t3 (all 0) -> the latest, t3.
    head.set_budget(3);
    EXPECT_EQ(head.positions(), (Positions{0, 3, 4}));
    EXPECT_EQ(head.scores(), (std::vector<double>{5.0, 0.0, 0.0}));
    EXPECT_EQ(head.rows()[1].value, v1(3.0));
}

TEST(OracleH2O, ProtectedWindowKeepsNewestRows) {
    // n_sink 2, budget 8, ratio 0.5 -> g = floor(0.5 * 6) = 3, decay 0.98.
    ref::H2OHeadOracle head(2, 0.98, ratio_grace(0.5, 2));
    head.set_budget(8);
    std::mt19937 rng(2024);
    const auto keys = random_rows(rng, 100, 4, 1.0);
    for (int t = 0; t < 100; ++t) {
        head.absorb(keys[static_cast<std::size_t>(t)], keys[static_cast<std::size_t>(t)]);
        const Positions p = head.positions();
        ASSERT_EQ(p.size(), static_cast<std::size_t>(std::min(t + 1, 8))) << t;
        if (t >= 2) {
            EXPECT_EQ(p[0], 0) << t;
            EXPECT_EQ(p[1], 1) << t;
        }
        if (t >= 7) {
            EXPECT_EQ(p[5], t - 2) << t;
            EXPECT_EQ(p[6], t - 1) << t;
            EXPECT_EQ(p[7], t) << t;
        }
        for (std::size_t i = 1; i < p.size(); ++i) EXPECT_LT(p[i - 1], p[i]) << t;
    }
}

TEST(OracleH2O, FixedGraceAsH2OUses) {
    // H2O style: grace 16 clamped by a budget of 10 with 4 sinks -> g = 5.
    ref::H2OHeadOracle head(4, 0.98, [](int budget) { return ref::protected_recent_fixed(16, budget, 4); });
    head.set_budget(10);
    std::mt19937 rng(11);
    const auto keys = random_rows(rng, 50, 3, 1.0);
    for (int t = 0; t < 50; ++t) head.absorb(keys[static_cast<std::size_t>(t)], keys[static_cast<std::size_t>(t)]);
    const Positions p = head.positions();
    ASSERT_EQ(p.size(), 10u);
    EXPECT_EQ((Positions{p[0], p[1], p[2], p[3]}), (Positions{0, 1, 2, 3}));
    EXPECT_EQ((Positions{p[5], p[6], p[7], p[8], p[9]}), (Positions{45, 46, 47, 48, 49}));
    EXPECT_GE(p[4], 4);
    EXPECT_LT(p[4], 45);
}

TEST(OracleH2O, ResetStartsANewSequence) {
    ref::H2OHeadOracle head(1, 0.5, ratio_grace(0.5, 1));
    head.set_budget(3);
    for (int i = 0; i < 6; ++i) head.absorb(v1(static_cast<double>(i)), v1(0.0));
    EXPECT_EQ(head.next_position(), 6);
    head.reset();
    EXPECT_TRUE(head.rows().empty());
    EXPECT_EQ(head.next_position(), 0);
    EXPECT_EQ(*head.budget(), 3);
    head.absorb(v1(5.0), v1(1.0));
    EXPECT_EQ(head.positions(), (Positions{0}));
    EXPECT_EQ(head.scores(), (std::vector<double>{1.0}));
}

TEST(OracleH2O, BadArgumentsThrow) {
    EXPECT_THROW(ref::H2OHeadOracle(1, 0.0, ratio_grace(0.5, 1)), std::invalid_argument);
    EXPECT_THROW(ref::H2OHeadOracle(1, 1.5, ratio_grace(0.5, 1)), std::invalid_argument);
    EXPECT_THROW(ref::H2OHeadOracle(-1, 0.9, ratio_grace(0.5, 1)), std::invalid_argument);
    ref::H2OHeadOracle head(1, 0.9, ratio_grace(0.5, 1));
    EXPECT_THROW(head.set_budget(0), std::invalid_argument);
    head.absorb({1.0, 2.0}, {3.0});
    EXPECT_THROW(head.absorb({1.0}, {3.0}), std::invalid_argument);
    EXPECT_THROW(head.absorb({1.0, std::numeric_limits<double>::infinity()}, {3.0}), std::invalid_argument);
    EXPECT_EQ(head.rows().size(), 1u);  // failed calls changed nothing
}

// ---------------------------------------------------------------------------------------------
// ReferenceAlgorithmHeadOracle (docs/design.md 4.3, 9.1)
// ---------------------------------------------------------------------------------------------

TEST(OracleReferenceAlgorithm, FreezesOnFirstBudgetTokens) {
    // n_sink 1, budget 4, D 2. Once full, the newcomer (score 0) is evicted every step, because
    // every retained row has positive mass. Total mass: 1 for the first token plus 1 per later
    // token, and the evicted newcomer carries none, so the scores sum to the token count.
    ref::ReferenceAlgorithmHeadOracle head(1, 4);
    std::mt19937 rng(5);
    const auto keys = random_rows(rng, 20, 2, 1.0);
    for (int t = 0; t < 20; ++t) {
        head.absorb(keys[static_cast<std::size_t>(t)], keys[static_cast<std::size_t>(t)]);
        if (t < 4) {
            Positions expected;
            for (int i = 0; i <= t; ++i) expected.push_back(i);
            EXPECT_EQ(head.positions(), expected) << t;
        } else {
            EXPECT_EQ(head.positions(), (Positions{0, 1, 2, 3})) << t;
            for (double s : head.scores()) EXPECT_GT(s, 0.0) << t;
        }
        double sum = 0.0;
        for (double s : head.scores()) sum += s;
        EXPECT_NEAR(sum, static_cast<double>(t + 1), 1e-12) << t;
    }
}

TEST(OracleReferenceAlgorithm, HandComputedScores) {
    // D = 1, n_sink 1, budget 3, no decay.
    // t0 key 0 -> {1}. t1 key 1 -> a {1}: {2, 0}. t2 key ln3 -> a {1/4, 3/4}: {2.25, 0.75, 0}.
    // t3 key 0 -> a {1/3,1/3,1/3}: {31/12, 13/12, 1/3, 0}; over budget, no recent window:
    // lowest non-sink is the newcomer t3 (0) -> evicted.
    ref::ReferenceAlgorithmHeadOracle head(1, 3);
    head.absorb(v1(0.0), v1(0.0));
    head.absorb(v1(1.0), v1(0.0));
    head.absorb(v1(std::log(3.0)), v1(0.0));
    EXPECT_NEAR(head.scores()[0], 2.25, 1e-12);
    EXPECT_NEAR(head.scores()[1], 0.75, 1e-12);
    EXPECT_NEAR(head.scores()[2], 0.0, 1e-12);
    head.absorb(v1(0.0), v1(0.0));
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    EXPECT_NEAR(head.scores()[0], 31.0 / 12.0, 1e-12);
    EXPECT_NEAR(head.scores()[1], 13.0 / 12.0, 1e-12);
    EXPECT_NEAR(head.scores()[2], 1.0 / 3.0, 1e-12);
}

TEST(OracleReferenceAlgorithm, TieEvictsEarliestIncludingOlderThanNewcomer) {
    // t0 key 1000 (sink) takes all mass; t1, t2, t3 (key 1) stay at exactly 0. Budget 3: at t3 the
    // candidates t1, t2, t3 tie at 0 -> the earliest, t1, goes (not the newcomer).
    ref::ReferenceAlgorithmHeadOracle head(1, 3);
    head.absorb(v1(1000.0), v1(0.0));
    head.absorb(v1(1.0), v1(1.0));
    head.absorb(v1(1.0), v1(2.0));
    head.absorb(v1(1.0), v1(3.0));
    EXPECT_EQ(head.positions(), (Positions{0, 2, 3}));
    EXPECT_EQ(head.scores(), (std::vector<double>{4.0, 0.0, 0.0}));
    EXPECT_EQ(head.rows()[2].value, v1(3.0));
}

TEST(OracleReferenceAlgorithm, BadArgumentsThrow) {
    EXPECT_THROW(ref::ReferenceAlgorithmHeadOracle(-1, 4), std::invalid_argument);
    EXPECT_THROW(ref::ReferenceAlgorithmHeadOracle(1, 0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Cross-check of the two independent oracles
// ---------------------------------------------------------------------------------------------

TEST(OracleCrossCheck, RatioZeroDecayOneMatchesReferenceAlgorithm) {
    struct Config {
        int n_sink, budget, d;
    };
    const Config configs[] = {{4, 16, 8}, {0, 5, 3}, {2, 32, 4}, {1, 2, 2}};
    // Scale 1: ordinary keys (the reference freezes, the newcomer is evicted every step).
    // Scale 40: logits of thousands, so many rows get exactly 0 mass and older rows tie with the
    // newcomer; those evictions exercise the lowest-score / earliest-tie rule for real.
    int non_newest_evictions = 0;
    for (double scale : {1.0, 40.0}) {
        for (unsigned seed : {1u, 2u, 3u, 4u, 5u}) {
            for (const Config& cfg : configs) {
                std::mt19937 rng(seed * 1000u + static_cast<unsigned>(cfg.budget));
                const auto keys = random_rows(rng, 200, cfg.d, scale);
                ref::ReferenceAlgorithmHeadOracle reference_head(cfg.n_sink, cfg.budget);
                ref::H2OHeadOracle core_head(cfg.n_sink, 1.0, ratio_grace(0.0, cfg.n_sink));
                core_head.set_budget(cfg.budget);
                for (int t = 0; t < 200; ++t) {
                    const auto& k = keys[static_cast<std::size_t>(t)];
                    reference_head.absorb(k, k);
                    core_head.absorb(k, k);
                    const Positions rp = reference_head.positions();
                    ASSERT_EQ(core_head.positions(), rp)
                        << "scale " << scale << " seed " << seed << " budget " << cfg.budget << " t " << t;
                    const auto rs = reference_head.scores();
                    const auto cs = core_head.scores();
                    for (std::size_t i = 0; i < rs.size(); ++i) EXPECT_NEAR(cs[i], rs[i], 1e-12);
                    ASSERT_LE(rp.size(), static_cast<std::size_t>(cfg.budget));
                    if (t >= cfg.budget && rp.back() == t) ++non_newest_evictions;
                }
            }
        }
    }
    // The large-scale runs must have produced evictions other than the newcomer, or this test
    // would only compare two frozen caches.
    EXPECT_GT(non_newest_evictions, 50);
}

}  // namespace
