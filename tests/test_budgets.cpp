// Tests of the per-layer budget schedules and the concentration kernel:
//   squeeze_budgets (docs/design.md 5.3), pyramid_budgets (docs/design.md 6), concentration_score (docs/design.md 5.1).
// Every worked vector of docs/design.md is checked exactly; the fast functions are cross-checked against
// the independent double-precision oracle in tests/reference/oracle.hpp on many random inputs.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <gtest/gtest.h>

#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;

using IntVec = std::vector<int>;
using DblVec = std::vector<double>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// Expects `f` to throw std::invalid_argument whose message contains `needle`.
template <class F>
void ExpectInvalidArgumentMentioning(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument mentioning '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  } catch (...) {
    ADD_FAILURE() << "expected std::invalid_argument, got another exception";
  }
}

/// Rows of an Eigen matrix as std::vector<std::vector<double>> (for the oracle).
template <class Derived>
std::vector<DblVec> ToRows(const Eigen::MatrixBase<Derived>& m) {
  std::vector<DblVec> rows(static_cast<std::size_t>(m.rows()),
                           DblVec(static_cast<std::size_t>(m.cols())));
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
      rows[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] =
          static_cast<double>(m(i, j));
    }
  }
  return rows;
}

/// A random n x D double matrix with N(0, 1) entries.
Eigen::MatrixXd RandomMatrix(std::mt19937& rng, Eigen::Index n, Eigen::Index d) {
  std::normal_distribution<double> dist(0.0, 1.0);
  Eigen::MatrixXd m(n, d);
  for (Eigen::Index i = 0; i < n; ++i) {
    for (Eigen::Index j = 0; j < d; ++j) m(i, j) = dist(rng);
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// squeeze_budgets (docs/design.md 5.3)
// ---------------------------------------------------------------------------------------------

TEST(SqueezeBudgetsTest, WorkedVectorsOfSpecHoldExactly) {
  EXPECT_EQ(vc::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4, 1.0), (IntVec{180, 100, 20}));
  EXPECT_EQ(vc::squeeze_budgets({0.1, 0.3, 0.5, 0.7, 0.9}, 200, 4, 1.0),
            (IntVec{360, 280, 200, 120, 40}));
  EXPECT_EQ(vc::squeeze_budgets({0.1, 0.9}, 100, 4, 0.5), (IntVec{140, 60}));
  EXPECT_EQ(vc::squeeze_budgets({-0.5, 0.9}, 100, 4, 1.0), (IntVec{182, 18}));
  EXPECT_EQ(vc::squeeze_budgets({0.0, 1.0, 1.0, 1.0}, 50, 8, 1.0), (IntVec{200, 9, 9, 9}));
  EXPECT_EQ(vc::squeeze_budgets({1.0, 1.0, 1.0}, 64, 4, 1.0), (IntVec{64, 64, 64}));
  EXPECT_EQ(vc::squeeze_budgets({0.05, 0.25, 0.5, 0.75, 0.95}, 300, 4, 1.0),
            (IntVec{570, 450, 300, 150, 30}));
  EXPECT_EQ(vc::squeeze_budgets({0.5}, 100, 4, 1.0), (IntVec{100}));
  EXPECT_EQ(vc::squeeze_budgets({0.9}, 2, 8, 1.0), (IntVec{9}));
}

TEST(SqueezeBudgetsTest, RoundsHalfToEven) {
  // 5 * 1.5 = 7.5 -> 8 and 5 * 0.5 = 2.5 -> 2 (docs/design.md 5.3 worked vector).
  EXPECT_EQ(vc::squeeze_budgets({0.25, 0.75}, 5, 0, 1.0), (IntVec{8, 2}));
  // 3 * 1.5 = 4.5 -> 4 and 3 * 0.5 = 1.5 -> 2.
  EXPECT_EQ(vc::squeeze_budgets({0.25, 0.75}, 3, 0, 1.0), (IntVec{4, 2}));
}

TEST(SqueezeBudgetsTest, DefaultStrengthIsOne) {
  EXPECT_EQ(vc::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4), (IntVec{180, 100, 20}));
}

TEST(SqueezeBudgetsTest, StrengthZeroGivesAverageEverywhere) {
  EXPECT_EQ(vc::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4, 0.0), (IntVec{100, 100, 100}));
  EXPECT_EQ(vc::squeeze_budgets({0.0, 1.0, 1.0, 1.0}, 50, 8, 0.0), (IntVec{50, 50, 50, 50}));
  EXPECT_EQ(vc::squeeze_budgets({-3.0, 7.0}, 17, 0, 0.0), (IntVec{17, 17}));
  EXPECT_EQ(vc::squeeze_budgets({0.3}, 77, 4, 0.0), (IntVec{77}));
  EXPECT_EQ(vc::squeeze_budgets({1.0, 1.0, 1.0, 1.0, 1.0, 1.0}, 9, 8, 0.0), IntVec(6, 9));

  std::mt19937 rng(501);
  std::uniform_real_distribution<double> c_dist(-0.5, 1.5);
  std::uniform_int_distribution<int> n_dist(1, 40);
  std::uniform_int_distribution<int> avg_dist(1, 4000);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = n_dist(rng);
    DblVec c(static_cast<std::size_t>(n));
    for (double& x : c) x = c_dist(rng);
    const int avg = avg_dist(rng);
    const int n_sink = std::uniform_int_distribution<int>(0, avg - 1)(rng);
    EXPECT_EQ(vc::squeeze_budgets(c, avg, n_sink, 0.0), IntVec(static_cast<std::size_t>(n), avg))
        << "trial " << trial;
  }
}

TEST(SqueezeBudgetsTest, EmptyInputGivesEmptyOutput) {
  EXPECT_TRUE(vc::squeeze_budgets({}, 100, 4, 1.0).empty());
  EXPECT_TRUE(vc::squeeze_budgets({}, 100, 4, 0.0).empty());
  EXPECT_TRUE(vc::squeeze_budgets({}, 1, 0).empty());
}

TEST(SqueezeBudgetsTest, StrengthOutsideUnitIntervalOrNaNThrowsNamingStrength) {
  for (const double s : {kNaN, -0.1, 1.1, -1e-12, 1.0 + 1e-12,
                         std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(s);
    ExpectInvalidArgumentMentioning([&] { vc::squeeze_budgets({0.1, 0.5, 0.9}, 100, 4, s); },
                                    "strength");
    ExpectInvalidArgumentMentioning([&] { vc::squeeze_budgets({0.5}, 100, 4, s); }, "strength");
  }
  // The boundaries are valid.
  EXPECT_NO_THROW(vc::squeeze_budgets({0.1, 0.9}, 100, 4, 0.0));
  EXPECT_NO_THROW(vc::squeeze_budgets({0.1, 0.9}, 100, 4, 1.0));
}

TEST(SqueezeBudgetsTest, SingleLayerGetsMaxOfAverageAndFloor) {
  EXPECT_EQ(vc::squeeze_budgets({0.0}, 100, 4, 1.0), (IntVec{100}));
  EXPECT_EQ(vc::squeeze_budgets({1.0}, 100, 4, 0.3), (IntVec{100}));
  EXPECT_EQ(vc::squeeze_budgets({0.2}, 5, 4, 1.0), (IntVec{5}));
  EXPECT_EQ(vc::squeeze_budgets({0.2}, 4, 4, 1.0), (IntVec{5}));
  EXPECT_EQ(vc::squeeze_budgets({0.2}, 0, 0, 1.0), (IntVec{1}));
}

TEST(SqueezeBudgetsTest, AllFullyConcentratedGivesUniformWeights) {
  // sum(raw) == 0 -> every weight is 1 (also after clamping values above 1).
  EXPECT_EQ(vc::squeeze_budgets({1.0, 2.0, 5.0}, 64, 4, 1.0), (IntVec{64, 64, 64}));
  EXPECT_EQ(vc::squeeze_budgets({1.0, 1.0}, 64, 4, 0.5), (IntVec{64, 64}));
}

TEST(SqueezeBudgetsTest, MatchesOracleOnRandomInputs) {
  std::mt19937 rng(20240531);
  std::uniform_int_distribution<int> n_dist(0, 48);
  std::uniform_real_distribution<double> c_dist(-0.6, 1.6);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<int> avg_dist(1, 6000);
  std::uniform_int_distribution<int> sink_dist(0, 128);
  int compared = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const auto n = static_cast<std::size_t>(n_dist(rng));
    DblVec c(n);
    const int mode = static_cast<int>(rng() % 4U);
    for (double& x : c) {
      if (mode == 0) {
        x = c_dist(rng);
      } else if (mode == 1) {  // quantised values: many ties, exact 0 and 1
        x = static_cast<double>(rng() % 9U) / 8.0 - 0.125;
      } else if (mode == 2) {
        x = u01(rng);
      } else {
        x = (rng() % 5U == 0U) ? 1.0 : u01(rng);
      }
    }
    const int avg = (rng() % 8U == 0U) ? static_cast<int>(rng() % 12U) : avg_dist(rng);
    const int n_sink = sink_dist(rng) % (rng() % 2U == 0U ? 9 : 129);
    double strength = u01(rng);
    if (trial % 7 == 0) strength = 0.0;
    if (trial % 7 == 1) strength = 1.0;
    if (trial % 7 == 2) strength = 0.5;
    const IntVec got = vc::squeeze_budgets(c, avg, n_sink, strength);
    const IntVec want = ref::squeeze_budgets(c, avg, n_sink, strength);
    ASSERT_EQ(got, want) << "trial " << trial << " n=" << n << " avg=" << avg
                         << " n_sink=" << n_sink << " strength=" << strength;
    ++compared;
  }
  EXPECT_EQ(compared, 20000);
}

TEST(SqueezeBudgetsTest, MeanStaysWithinRoundingOfAverageWhenNoFloorClamps) {
  std::mt19937 rng(77);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  int checked = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    const auto n = static_cast<std::size_t>(2 + rng() % 30U);
    DblVec c(n);
    for (double& x : c) x = u01(rng) * 0.9;  // raw >= 0.1, so weights stay moderate
    const int avg = 50 + static_cast<int>(rng() % 3000U);
    const int n_sink = static_cast<int>(rng() % 8U);
    const double strength = u01(rng);
    const IntVec b = vc::squeeze_budgets(c, avg, n_sink, strength);
    ASSERT_EQ(b.size(), n);
    // An output equal to the floor may have been clamped; only judge vectors with none.
    if (std::any_of(b.begin(), b.end(), [&](int x) { return x <= n_sink + 1; })) continue;
    long long sum = 0;
    for (int x : b) sum += x;
    const double target = static_cast<double>(avg) * static_cast<double>(n);
    EXPECT_LE(std::abs(static_cast<double>(sum) - target), 0.5 * static_cast<double>(n) + 1e-9)
        << "trial " << trial;
    ++checked;
  }
  EXPECT_GT(checked, 4000);
}

TEST(SqueezeBudgetsTest, LowerConcentrationNeverGetsSmallerBudget) {
  std::mt19937 rng(4242);
  std::uniform_real_distribution<double> c_dist(-0.4, 1.4);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int trial = 0; trial < 3000; ++trial) {
    const auto n = static_cast<std::size_t>(2 + rng() % 20U);
    DblVec c(n);
    for (double& x : c) x = c_dist(rng);
    const int avg = 1 + static_cast<int>(rng() % 2000U);
    const int n_sink = static_cast<int>(rng() % 16U);
    const double strength = u01(rng);
    const IntVec b = vc::squeeze_budgets(c, avg, n_sink, strength);
    ASSERT_EQ(b.size(), n);
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_GE(b[i], n_sink + 1);
      for (std::size_t j = 0; j < n; ++j) {
        if (std::clamp(c[i], 0.0, 1.0) < std::clamp(c[j], 0.0, 1.0)) {
          EXPECT_GE(b[i], b[j]) << "trial " << trial << " c_i=" << c[i] << " c_j=" << c[j];
        }
      }
    }
  }
}

TEST(SqueezeBudgetsTest, CoordinatorPublishesSqueezeBudgetsInLayerOrder) {
  // The coordinator's published budgets are exactly squeeze_budgets over ascending layer ids.
  vc::SqueezeCoordinator coord(3, 100, 4, 1.0);
  coord.report_concentration(2, 0.9);
  coord.report_concentration(0, 0.1);
  EXPECT_FALSE(coord.is_finalized());
  coord.report_concentration(1, 0.5);
  ASSERT_TRUE(coord.is_finalized());
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(180));
  EXPECT_EQ(coord.resolved_budget(1), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(2), std::optional<int>(20));
}

// ---------------------------------------------------------------------------------------------
// pyramid_budgets (docs/design.md 6)
// ---------------------------------------------------------------------------------------------

TEST(PyramidBudgetsTest, WorkedVectorsOfSpecHoldExactly) {
  EXPECT_EQ(vc::pyramid_budgets(4, 100, 4, 2.0), (IntVec{195, 132, 68, 5}));
  EXPECT_EQ(vc::pyramid_budgets(4, 100, 4, 3.0), (IntVec{233, 132, 30, 5}));
  EXPECT_EQ(vc::pyramid_budgets(5, 512, 4, 1.0), IntVec(5, 512));
}

TEST(PyramidBudgetsTest, DefaultBetaIsTwo) {
  EXPECT_EQ(vc::pyramid_budgets(4, 100, 4), (IntVec{195, 132, 68, 5}));
}

TEST(PyramidBudgetsTest, NonPositiveLayerCountGivesEmpty) {
  EXPECT_TRUE(vc::pyramid_budgets(0, 100, 4, 2.0).empty());
  EXPECT_TRUE(vc::pyramid_budgets(-3, 100, 4, 2.0).empty());
  EXPECT_TRUE(vc::pyramid_budgets(0, 1, 0).empty());
}

TEST(PyramidBudgetsTest, SingleLayerGetsMaxOfAverageAndFloor) {
  EXPECT_EQ(vc::pyramid_budgets(1, 100, 4, 2.0), (IntVec{100}));
  EXPECT_EQ(vc::pyramid_budgets(1, 100, 4, 5.0), (IntVec{100}));
  EXPECT_EQ(vc::pyramid_budgets(1, 3, 8, 2.0), (IntVec{9}));
  EXPECT_EQ(vc::pyramid_budgets(1, 5, 4, 1.0), (IntVec{5}));
}

TEST(PyramidBudgetsTest, BetaBelowOneOrNaNThrowsNamingBeta) {
  for (const double beta : {0.5, 0.999999, 0.0, -2.0, kNaN}) {
    SCOPED_TRACE(beta);
    ExpectInvalidArgumentMentioning([&] { vc::pyramid_budgets(4, 100, 4, beta); }, "beta");
    ExpectInvalidArgumentMentioning([&] { vc::pyramid_budgets(2, 512, 4, beta); }, "beta");
  }
  EXPECT_NO_THROW(vc::pyramid_budgets(4, 100, 4, 1.0));
}

TEST(PyramidBudgetsTest, MatchesOracleOnRandomInputs) {
  std::mt19937 rng(9001);
  std::uniform_real_distribution<double> beta_dist(1.0, 6.0);
  int compared = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = static_cast<int>(rng() % 70U);  // 0..69; 0 and 1 are the special cases
    const int avg = (rng() % 6U == 0U) ? static_cast<int>(rng() % 16U)
                                       : 1 + static_cast<int>(rng() % 8000U);
    const int n_sink = (rng() % 2U == 0U) ? static_cast<int>(rng() % 9U)
                                          : static_cast<int>(rng() % 300U);
    double beta = beta_dist(rng);
    if (trial % 5 == 0) beta = 1.0;
    if (trial % 5 == 1) beta = 2.0;
    if (trial % 5 == 2) beta = 1.0 + static_cast<double>(rng() % 16U) / 4.0;
    const IntVec got = vc::pyramid_budgets(n, avg, n_sink, beta);
    const IntVec want = ref::pyramid_budgets(n, avg, n_sink, beta);
    ASSERT_EQ(got, want) << "trial " << trial << " n=" << n << " avg=" << avg
                         << " n_sink=" << n_sink << " beta=" << beta;
    ++compared;
  }
  EXPECT_EQ(compared, 20000);
}

TEST(PyramidBudgetsTest, BudgetsRespectFloorAndTaperWithDepth) {
  std::mt19937 rng(31337);
  std::uniform_real_distribution<double> beta_dist(1.0, 4.0);
  for (int trial = 0; trial < 3000; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 40U);
    const int n_sink = static_cast<int>(rng() % 16U);
    const int avg = n_sink + 1 + static_cast<int>(rng() % 3000U);
    const double beta = beta_dist(rng);
    const IntVec b = vc::pyramid_budgets(n, avg, n_sink, beta);
    ASSERT_EQ(b.size(), static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < b.size(); ++i) {
      EXPECT_GE(b[i], n_sink + 1) << "trial " << trial;
      if (i > 0) {
        EXPECT_LE(b[i], b[i - 1]) << "trial " << trial << " layer " << i;
      }
    }
    // Water-filling keeps the mean at avg up to rounding (each layer rounds by at most 0.5).
    long long sum = 0;
    for (int x : b) sum += x;
    EXPECT_LE(std::abs(static_cast<double>(sum) - static_cast<double>(avg) * n), 0.5 * n + 1e-6)
        << "trial " << trial << " n=" << n << " avg=" << avg << " n_sink=" << n_sink
        << " beta=" << beta;
  }
}

// ---------------------------------------------------------------------------------------------
// concentration_score (docs/design.md 5.1)
// ---------------------------------------------------------------------------------------------

TEST(ConcentrationScoreTest, ParallelRowsScoreOne) {
  std::mt19937 rng(1);
  const Eigen::MatrixXd base = RandomMatrix(rng, 1, 24);
  Eigen::MatrixXd m(9, 24);
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    m.row(i) = base.row(0) * (0.5 + 3.0 * static_cast<double>(i));
  }
  EXPECT_NEAR(vc::concentration_score(m), 1.0, 1e-6);
  // Identical rows too.
  const Eigen::MatrixXd same = Eigen::MatrixXd::Constant(5, 3, 2.0);
  EXPECT_NEAR(vc::concentration_score(same), 1.0, 1e-6);
}

TEST(ConcentrationScoreTest, OrthogonalRowsScoreZero) {
  Eigen::MatrixXd m = Eigen::MatrixXd::Zero(6, 10);
  for (Eigen::Index i = 0; i < 6; ++i) m(i, i + 2) = 1.0 + static_cast<double>(i);
  EXPECT_NEAR(vc::concentration_score(m), 0.0, 1e-12);
  // A rotated orthogonal basis (Hadamard rows of dimension 4).
  Eigen::MatrixXd h(4, 4);
  h << 1, 1, 1, 1, 1, -1, 1, -1, 1, 1, -1, -1, 1, -1, -1, 1;
  EXPECT_NEAR(vc::concentration_score(h), 0.0, 1e-12);
}

TEST(ConcentrationScoreTest, AntiparallelPairs) {
  Eigen::MatrixXd two(2, 3);
  two << 1.0, -2.0, 0.5, -1.0, 2.0, -0.5;
  EXPECT_NEAR(vc::concentration_score(two), -1.0, 1e-6);
  // {v, -v, v, -v}: off-diagonal sum = |0|^2 - 4 = -4 over 12 pairs.
  Eigen::MatrixXd four(4, 3);
  four << 1.0, 2.0, 3.0, -2.0, -4.0, -6.0, 0.5, 1.0, 1.5, -1.0, -2.0, -3.0;
  EXPECT_NEAR(vc::concentration_score(four), -1.0 / 3.0, 1e-6);
  // Two antiparallel pairs orthogonal to each other: each pair gives -1 twice (ordered pairs), the
  // cross pairs give 0, so the mean over the 12 ordered pairs is -4/12.
  Eigen::MatrixXd mixed(4, 2);
  mixed << 1.0, 0.0, -3.0, 0.0, 0.0, 2.0, 0.0, -5.0;
  EXPECT_NEAR(vc::concentration_score(mixed), -1.0 / 3.0, 1e-6);
  // One antiparallel pair plus a third row parallel to the first: (1 - 1 - 1) * 2 / 6 = -1/3.
  Eigen::MatrixXd three(3, 2);
  three << 2.0, 1.0, -4.0, -2.0, 1.0, 0.5;
  EXPECT_NEAR(vc::concentration_score(three), -1.0 / 3.0, 1e-6);
}

TEST(ConcentrationScoreTest, RowScalingChangesNothing) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<double> scale(0.25, 1000.0);
  for (int trial = 0; trial < 20; ++trial) {
    const Eigen::MatrixXd m = RandomMatrix(rng, 3 + trial, 16);
    Eigen::MatrixXd scaled = m;
    for (Eigen::Index i = 0; i < scaled.rows(); ++i) scaled.row(i) *= scale(rng);
    EXPECT_NEAR(vc::concentration_score(scaled), vc::concentration_score(m), 1e-7)
        << "trial " << trial;
  }
}

TEST(ConcentrationScoreTest, FewerThanTwoRowsScoreZero) {
  const Eigen::MatrixXd empty(0, 8);
  EXPECT_EQ(vc::concentration_score(empty), 0.0);
  Eigen::MatrixXd one(1, 8);
  one.setConstant(3.0);
  EXPECT_EQ(vc::concentration_score(one), 0.0);
  const Eigen::MatrixXf one_f = Eigen::MatrixXf::Constant(1, 300, 1.0f);
  EXPECT_EQ(vc::concentration_score(one_f), 0.0);
}

TEST(ConcentrationScoreTest, MatchesGramOracleOnRandomMatrices) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 150; ++trial) {
    const auto n = static_cast<Eigen::Index>(2 + rng() % 60U);
    const auto d = static_cast<Eigen::Index>(1 + rng() % 300U);
    Eigen::MatrixXd m = RandomMatrix(rng, n, d);
    if (trial % 3 == 0) {
      // A shared direction: strongly concentrated rows (large Gram sum, cancellation-prone).
      const Eigen::MatrixXd dir = RandomMatrix(rng, 1, d);
      for (Eigen::Index i = 0; i < n; ++i) m.row(i) = 0.05 * m.row(i) + 4.0 * dir.row(0);
    }
    if (trial % 5 == 0) m.row(0).setZero();  // a zero row contributes u = 0
    const double want = ref::concentration_score_gram(ToRows(m));
    EXPECT_NEAR(vc::concentration_score(m), want, 1e-9)
        << "trial " << trial << " n=" << n << " d=" << d;
  }
}

TEST(ConcentrationScoreTest, HeapPathForLargeHeadDims) {
  std::mt19937 rng(4);
  for (const Eigen::Index d : {Eigen::Index{256}, Eigen::Index{257}, Eigen::Index{300},
                               Eigen::Index{1024}}) {
    SCOPED_TRACE(d);
    const Eigen::MatrixXd m = RandomMatrix(rng, 12, d);
    EXPECT_NEAR(vc::concentration_score(m), ref::concentration_score_gram(ToRows(m)), 1e-9);
    // Parallel rows at a large D: a stale or mis-sized accumulator would not give 1.
    Eigen::MatrixXd par(7, d);
    for (Eigen::Index i = 0; i < 7; ++i) par.row(i) = m.row(0) * (1.0 + static_cast<double>(i));
    EXPECT_NEAR(vc::concentration_score(par), 1.0, 1e-6);
  }
  // Large then small then large again: each call starts from a zero accumulator.
  const Eigen::MatrixXd big = RandomMatrix(rng, 5, 700);
  const Eigen::MatrixXd small = RandomMatrix(rng, 5, 3);
  const double big1 = vc::concentration_score(big);
  (void)vc::concentration_score(small);
  EXPECT_EQ(vc::concentration_score(big), big1);
}

template <class T>
class ConcentrationScoreTypedTest : public ::testing::Test {};
using ScalarTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(ConcentrationScoreTypedTest, ScalarTypes);

TYPED_TEST(ConcentrationScoreTypedTest, MatchesGramOracleOnStoredValues) {
  using T = TypeParam;
  std::mt19937 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const auto n = static_cast<Eigen::Index>(2 + rng() % 40U);
    const auto d = static_cast<Eigen::Index>(1 + rng() % 320U);
    const Eigen::MatrixXd src = RandomMatrix(rng, n, d);
    const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> m = src.cast<T>();
    // The oracle sees exactly the stored (rounded) values, converted to double.
    const double want = ref::concentration_score_gram(ToRows(m));
    EXPECT_NEAR(vc::concentration_score(m), want, 1e-9) << "trial " << trial;
  }
}

TYPED_TEST(ConcentrationScoreTypedTest, ParallelAndOrthogonalRows) {
  using T = TypeParam;
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> par(4, 3);
  for (Eigen::Index i = 0; i < 4; ++i) {
    const double s = 1.0 + static_cast<double>(i);
    par(i, 0) = static_cast<T>(s * 1.0);
    par(i, 1) = static_cast<T>(s * -2.0);
    par(i, 2) = static_cast<T>(s * 0.5);
  }
  EXPECT_NEAR(vc::concentration_score(par), 1.0, 1e-6);
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> orth =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>::Zero(3, 5);
  orth(0, 0) = static_cast<T>(2.0);
  orth(1, 3) = static_cast<T>(-1.0);
  orth(2, 4) = static_cast<T>(0.25);
  EXPECT_NEAR(vc::concentration_score(orth), 0.0, 1e-12);
}

TEST(ConcentrationScoreTest, WorksOnMapAndBlockExpressions) {
  std::mt19937 rng(6);
  // A row-major float buffer [n, D] seen through a Map, as the cache sees a head's keys.
  const Eigen::Index n = 17, d = 40;
  std::vector<float> buf(static_cast<std::size_t>(n * d));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& x : buf) x = dist(rng);
  using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const RowMajorF> map(buf.data(), n, d);
  std::vector<DblVec> rows(static_cast<std::size_t>(n), DblVec(static_cast<std::size_t>(d)));
  for (Eigen::Index i = 0; i < n; ++i) {
    for (Eigen::Index j = 0; j < d; ++j) {
      rows[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] =
          static_cast<double>(buf[static_cast<std::size_t>(i * d + j)]);
    }
  }
  EXPECT_NEAR(vc::concentration_score(map), ref::concentration_score_gram(rows), 1e-9);

  // A block in the middle of a larger matrix (rows 3..12, columns 5..34).
  const Eigen::MatrixXd big = RandomMatrix(rng, 20, 50);
  const auto block = big.block(3, 5, 10, 30);
  EXPECT_NEAR(vc::concentration_score(block), ref::concentration_score_gram(ToRows(block)), 1e-9);
  // The block is not the whole matrix: its score differs from the full matrix's.
  EXPECT_NE(vc::concentration_score(block), vc::concentration_score(big));

  // A Map of a half buffer with an outer stride (every other row of a [2n, D] buffer).
  std::vector<Eigen::half> hbuf(static_cast<std::size_t>(2 * n * d));
  for (Eigen::half& x : hbuf) x = static_cast<Eigen::half>(dist(rng));
  using RowMajorH = Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const RowMajorH, 0, Eigen::OuterStride<>> strided(hbuf.data(), n, d,
                                                                     Eigen::OuterStride<>(2 * d));
  EXPECT_NEAR(vc::concentration_score(strided), ref::concentration_score_gram(ToRows(strided)),
              1e-9);
}

}  // namespace
