// The SIMD kernels alone, on purpose (docs/design.md 7.2): every path this CPU runs against a
// double-precision reference, exact ties wherever equal inputs sit, tails of every length, the
// softmax underflow rule, and the scalar path bitwise equal to the AVX2 path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/simd_levels.hpp"
#include "support/storage_types.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace vd = veloxquant::cache::detail;
using Index = Eigen::Index;

using veloxquant::test::for_each_level;
using veloxquant::test::kAllLevels;
using veloxquant::test::same_bits_as_scalar;

template <class T>
std::vector<T> random_rows(std::mt19937& rng, Index n, Index d, float sigma = 1.0f) {
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<T> out(static_cast<std::size_t>(n * d));
  for (auto& x : out) x = static_cast<T>(g(rng));
  return out;
}

/// Query rows padded with zeros to padded_dim(d): [m, padded_dim(d)].
std::vector<float> padded_queries(std::mt19937& rng, Index m, Index d) {
  std::normal_distribution<float> g;
  const Index dp = vd::padded_dim(d);
  std::vector<float> q(static_cast<std::size_t>(m * dp), 0.0f);
  for (Index i = 0; i < m; ++i)
    for (Index k = 0; k < d; ++k) q[static_cast<std::size_t>(i * dp + k)] = g(rng);
  return q;
}

/// logits at the active level: [m, ld] with ld = n + 5 (columns past n must stay untouched).
template <class T>
std::vector<float> run_logits(const std::vector<float>& q, Index m, const std::vector<T>& keys,
                              const std::int32_t* idx, Index n, Index d, float scale) {
  const Index ld = n + 5, dp = vd::padded_dim(d);
  std::vector<float> out(static_cast<std::size_t>(m * ld), -7.0f);
  std::vector<float> kbuf(static_cast<std::size_t>(4 * dp));
  vd::logits(q.data(), m, dp, keys.data(), d, idx, n, d, scale, out.data(), ld, kbuf.data());
  return out;
}

template <class T>
class SimdKernelsTest : public ::testing::Test {};
using veloxquant::test::StorageTypes;
TYPED_TEST_SUITE(SimdKernelsTest, StorageTypes);

/// Scaled dot products against a double reference for head dims with every tail length, query
/// row counts odd and even, key counts not a multiple of the 4-key tile, and an index map.
TYPED_TEST(SimdKernelsTest, LogitsMatchADoubleReference) {
  using T = TypeParam;
  std::mt19937 rng(11);
  for (const Index d : {Index{1}, Index{3}, Index{8}, Index{13}, Index{16}, Index{20}, Index{64},
                        Index{128}}) {
    for (const Index m : {Index{1}, Index{2}, Index{3}, Index{8}}) {
      const Index n = 1 + static_cast<Index>(rng() % 23);
      const std::vector<T> keys = random_rows<T>(rng, n + 3, d);
      const std::vector<float> q = padded_queries(rng, m, d);
      std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
      for (Index j = 0; j < n; ++j) idx[static_cast<std::size_t>(j)] = static_cast<std::int32_t>((j * 7 + 2) % (n + 3));
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      for_each_level([&](vc::SimdLevel) {
        for (const bool mapped : {false, true}) {
          const std::vector<float> out =
              run_logits(q, m, keys, mapped ? idx.data() : nullptr, n, d, scale);
          const Index ld = n + 5, dp = vd::padded_dim(d);
          for (Index i = 0; i < m; ++i) {
            for (Index j = 0; j < ld; ++j) {
              const float got = out[static_cast<std::size_t>(i * ld + j)];
              if (j >= n) {
                ASSERT_EQ(got, -7.0f) << "wrote past n at column " << j;
                continue;
              }
              const Index row = mapped ? idx[static_cast<std::size_t>(j)] : j;
              double want = 0.0, mag = 0.0;
              for (Index k = 0; k < d; ++k) {
                const double a = q[static_cast<std::size_t>(i * dp + k)];
                const double b = static_cast<double>(static_cast<float>(keys[static_cast<std::size_t>(row * d + k)]));
                want += a * b;
                mag += std::fabs(a * b);
              }
              want *= scale;
              ASSERT_NEAR(got, want, 1e-6 * (1.0 + mag)) << "d=" << d << " m=" << m << " n=" << n
                                                         << " i=" << i << " j=" << j;
            }
          }
        }
      });
    }
  }
}

/// Identical key rows give bit-identical logits wherever they sit among the columns (inside a
/// 4-key tile, in the last partial tile, through the index map), and the same query row in any
/// row of the product gives the same logits: the exact-tie rules rest on this.
TYPED_TEST(SimdKernelsTest, EqualRowsGiveBitEqualLogits) {
  using T = TypeParam;
  std::mt19937 rng(12);
  for (const Index d : {Index{5}, Index{16}, Index{37}, Index{128}}) {
    const Index n = 23;
    std::vector<T> keys = random_rows<T>(rng, n, d);
    for (const Index j : {Index{4}, Index{9}, Index{21}, Index{22}}) {
      std::copy_n(keys.begin(), d, keys.begin() + j * d);  // rows 0, 4, 9, 21, 22 equal
    }
    std::vector<float> q = padded_queries(rng, 5, d);
    const Index dp = vd::padded_dim(d);
    std::copy_n(q.begin(), dp, q.begin() + 3 * dp);  // query rows 0 and 3 equal
    for_each_level([&](vc::SimdLevel) {
      const std::vector<float> out = run_logits(q, 5, keys, nullptr, n, d, 0.3f);
      const Index ld = n + 5;
      for (const Index r : {Index{0}, Index{3}}) {
        for (const Index j : {Index{4}, Index{9}, Index{21}, Index{22}}) {
          ASSERT_EQ(out[static_cast<std::size_t>(r * ld)], out[static_cast<std::size_t>(r * ld + j)])
              << "d=" << d << " column " << j;
        }
      }
      for (Index j = 0; j < n; ++j) {
        ASSERT_EQ(out[static_cast<std::size_t>(j)], out[static_cast<std::size_t>(3 * ld + j)]);
      }
    });
  }
}

/// softmax_mean against a double reference: every length, several rows (their mean), -inf
/// columns get exactly 0, equal logits get bit-equal weights, the rows become their exp values.
TEST(SimdSoftmaxTest, MeanOfSoftmaxMatchesADoubleReference) {
  std::mt19937 rng(13);
  std::normal_distribution<float> g(0.0f, 3.0f);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (const Index n : {Index{1}, Index{2}, Index{7}, Index{8}, Index{15}, Index{16}, Index{17},
                        Index{33}, Index{513}}) {
    for (const Index rows : {Index{1}, Index{2}, Index{5}}) {
      const Index ld = (n + 15) / 16 * 16 + 16;
      std::vector<float> x(static_cast<std::size_t>(rows * ld), 99.0f);
      for (Index r = 0; r < rows; ++r)
        for (Index j = 0; j < n; ++j) x[static_cast<std::size_t>(r * ld + j)] = g(rng);
      // A masked column and a pair of equal logits in every row.
      for (Index r = 0; r < rows; ++r) {
        if (n > 2) x[static_cast<std::size_t>(r * ld + 1)] = neg_inf;
        if (n > 3) x[static_cast<std::size_t>(r * ld + n - 1)] = x[static_cast<std::size_t>(r * ld + 2)];
      }
      std::vector<double> want(static_cast<std::size_t>(n), 0.0);
      for (Index r = 0; r < rows; ++r) {
        double m = -1e300, sum = 0.0;
        for (Index j = 0; j < n; ++j) m = std::max(m, static_cast<double>(x[static_cast<std::size_t>(r * ld + j)]));
        for (Index j = 0; j < n; ++j) sum += std::exp(x[static_cast<std::size_t>(r * ld + j)] - m);
        for (Index j = 0; j < n; ++j)
          want[static_cast<std::size_t>(j)] += std::exp(x[static_cast<std::size_t>(r * ld + j)] - m) / sum / static_cast<double>(rows);
      }
      for_each_level([&](vc::SimdLevel) {
        std::vector<float> xs = x;
        std::vector<float> w(static_cast<std::size_t>(n) + 3, -5.0f);
        vd::softmax_mean(xs.data(), rows, ld, n, w.data());
        double total = 0.0;
        for (Index j = 0; j < n; ++j) {
          ASSERT_NEAR(w[static_cast<std::size_t>(j)], want[static_cast<std::size_t>(j)], 2e-7)
              << "n=" << n << " rows=" << rows << " j=" << j;
          total += w[static_cast<std::size_t>(j)];
        }
        EXPECT_NEAR(total, 1.0, 1e-5);
        for (Index j = n; j < n + 3; ++j) ASSERT_EQ(w[static_cast<std::size_t>(j)], -5.0f) << "wrote past n";
        if (n > 2) {
          EXPECT_EQ(w[1], 0.0f) << "a -inf logit must get weight exactly 0";
        }
        if (n > 3) {
          EXPECT_EQ(w[2], w[static_cast<std::size_t>(n - 1)]) << "equal logits, unequal weights";
        }
        for (Index r = 0; r < rows; ++r) {
          for (Index j = n; j < ld; ++j) {
            ASSERT_EQ(xs[static_cast<std::size_t>(r * ld + j)], 99.0f);
          }
        }
      });
    }
  }
}

/// Weights below exp(-87) are exactly 0 (docs/design.md 4.2): a row far below the maximum gets 0,
/// not a tiny age-dependent value; a row whose logits are all -inf contributes nothing.
TEST(SimdSoftmaxTest, UnderflowIsExactlyZeroAndEmptyRowsContributeNothing) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for_each_level([&](vc::SimdLevel) {
    std::vector<float> x = {0.0f, -86.0f, -87.5f, -200.0f, neg_inf, 0.0f, 0.0f, 0.0f,
                            0.0f, 0.0f,   0.0f,   0.0f,    0.0f,    0.0f, 0.0f, 0.0f};
    std::vector<float> w(5);
    vd::softmax_mean(x.data(), 1, 16, 5, w.data());
    EXPECT_GT(w[1], 0.0f);
    EXPECT_EQ(w[2], 0.0f);
    EXPECT_EQ(w[3], 0.0f);
    EXPECT_EQ(w[4], 0.0f);
    EXPECT_NEAR(w[0], 1.0f, 1e-6f);
    // Row 1 all -inf: the mean over two rows is half of row 0's softmax.
    std::vector<float> y(32, neg_inf);
    y[0] = 1.0f;
    y[1] = 1.0f;
    std::vector<float> w2(2);
    vd::softmax_mean(y.data(), 2, 16, 2, w2.data());
    EXPECT_FLOAT_EQ(w2[0], 0.25f);
    EXPECT_FLOAT_EQ(w2[1], 0.25f);
  });
}

/// decay_accumulate: s * decay + w elementwise for every length (one rounding on FMA paths, two
/// on SSE2), nothing written past n.
TEST(SimdDecayTest, DecayAccumulateMatchesTheFormula) {
  std::mt19937 rng(14);
  std::normal_distribution<float> g;
  for (const Index n : {Index{1}, Index{5}, Index{16}, Index{19}, Index{100}}) {
    std::vector<float> s0(static_cast<std::size_t>(n) + 2), w(static_cast<std::size_t>(n));
    for (auto& v : s0) v = g(rng);
    for (auto& v : w) v = g(rng);
    for_each_level([&](vc::SimdLevel l) {
      std::vector<float> s = s0;
      vd::decay_accumulate(s.data(), w.data(), n, 0.98f);
      for (Index i = 0; i < n; ++i) {
        const auto k = static_cast<std::size_t>(i);
        const float fused = std::fma(s0[k], 0.98f, w[k]);
        const float p = s0[k] * 0.98f;
        const float twice = p + w[k];
        ASSERT_EQ(s[k], l == vc::SimdLevel::sse2 ? twice : fused) << "n=" << n << " i=" << i;
      }
      EXPECT_EQ(s[static_cast<std::size_t>(n)], s0[static_cast<std::size_t>(n)]);
    });
  }
}

/// Row conversion to the storage type equals Eigen's own conversion (round to nearest even),
/// finite and non-finite values, at every level and every length.
TYPED_TEST(SimdKernelsTest, StoreRowEqualsEigenConversion) {
  using T = TypeParam;
  std::mt19937 rng(15);
  std::normal_distribution<float> g(0.0f, 100.0f);
  for (const Index n : {Index{1}, Index{7}, Index{16}, Index{35}}) {
    std::vector<float> src(static_cast<std::size_t>(n));
    for (auto& v : src) v = g(rng);
    src[0] = 65520.0f;  // rounds to half infinity
    if (n > 3) src[3] = std::numeric_limits<float>::infinity();
    if (n > 5) src[5] = 1e-7f;  // a half subnormal
    std::vector<double> dsrc(src.begin(), src.end());
    for_each_level([&](vc::SimdLevel) {
      std::vector<T> dst(static_cast<std::size_t>(n));
      vd::store_row(src.data(), dst.data(), n);
      for (Index i = 0; i < n; ++i) {
        const T want = static_cast<T>(src[static_cast<std::size_t>(i)]);
        ASSERT_EQ(std::memcmp(&want, &dst[static_cast<std::size_t>(i)], sizeof(T)), 0) << "i=" << i;
      }
      vd::store_row(dsrc.data(), dst.data(), n);
      for (Index i = 0; i < n; ++i) {
        const T want = static_cast<T>(dsrc[static_cast<std::size_t>(i)]);
        ASSERT_EQ(std::memcmp(&want, &dst[static_cast<std::size_t>(i)], sizeof(T)), 0) << "i=" << i;
      }
      // And back to float32 exactly, for every storage type through every path.
      std::vector<float> back(static_cast<std::size_t>(n));
      vd::store_row(dst.data(), back.data(), n);
      for (Index i = 0; i < n; ++i) {
        const float want = static_cast<float>(dst[static_cast<std::size_t>(i)]);
        ASSERT_EQ(std::memcmp(&want, &back[static_cast<std::size_t>(i)], sizeof(float)), 0);
      }
    });
  }
}

/// The scalar path performs exactly the AVX2 and NEON paths' operations: logits, softmax and decay
/// are bitwise equal (run where either is available).
TEST(SimdPathsTest, ScalarIsBitIdenticalToAvx2AndNeon) {
  std::vector<vc::SimdLevel> levels;
  for (const vc::SimdLevel l : kAllLevels) {
    if (same_bits_as_scalar(l) && vc::simd_level_supported(l)) levels.push_back(l);
  }
  if (levels.size() < 2) GTEST_SKIP() << "this CPU has neither AVX2 nor NEON";
  const vc::SimdLevel saved = vc::simd_level();
  std::mt19937 rng(16);
  const Index d = 72, n = 45, m = 6;
  const std::vector<Eigen::half> keys = random_rows<Eigen::half>(rng, n, d);
  const std::vector<float> q = padded_queries(rng, m, d);
  std::vector<std::vector<float>> outs, ws;
  for (const vc::SimdLevel l : levels) {
    vc::set_simd_level(l);
    std::vector<float> lg = run_logits(q, m, keys, nullptr, n, d, 0.11f);
    std::vector<float> w(static_cast<std::size_t>(n));
    vd::softmax_mean(lg.data(), m, n + 5, n, w.data());
    vd::decay_accumulate(w.data(), lg.data(), n, 0.9f);
    outs.push_back(lg);
    ws.push_back(w);
  }
  vc::set_simd_level(saved);
  for (std::size_t i = 1; i < levels.size(); ++i) {
    SCOPED_TRACE(vc::simd_level_name(levels[i]));
    EXPECT_EQ(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(ws[0].data(), ws[i].data(), ws[0].size() * sizeof(float)), 0);
  }
}

/// The public level switch: every supported level can be chosen and reports its name; the
/// scalar path is always available; the best level is supported.
TEST(SimdPathsTest, LevelsCanBeChosenAndReported) {
  const vc::SimdLevel saved = vc::simd_level();
  EXPECT_TRUE(vc::simd_level_supported(vc::SimdLevel::scalar));
  EXPECT_TRUE(vc::simd_level_supported(vc::best_simd_level()));
  for_each_level([](vc::SimdLevel l) { EXPECT_EQ(vc::simd_level(), l); });
  EXPECT_STREQ(vc::simd_level_name(vc::SimdLevel::avx512), "avx512");
  EXPECT_STREQ(vc::simd_level_name(vc::SimdLevel::sse2), "sse2");
  EXPECT_STREQ(vc::simd_level_name(vc::SimdLevel::neon), "neon");
#if defined(__aarch64__)
  EXPECT_TRUE(vc::simd_level_supported(vc::SimdLevel::neon));
  EXPECT_EQ(vc::best_simd_level(), vc::SimdLevel::neon);
#else
  EXPECT_FALSE(vc::simd_level_supported(vc::SimdLevel::neon));
  EXPECT_THROW(vc::set_simd_level(vc::SimdLevel::neon), std::invalid_argument);
#endif
  EXPECT_THROW(vc::set_simd_level(static_cast<vc::SimdLevel>(7)), std::invalid_argument);
  EXPECT_EQ(vc::simd_level(), saved) << "a rejected level must change nothing";
}

}  // namespace

// ---- The query-free scorers' kernels (docs/design.md 4.7, detail/proxy_scores.hpp) ----

/// KeyDiff's fixed-point running sum is exact: rows added and removed in any order leave the same
/// integers as a sum built from the rows that remain, on every path.
TYPED_TEST(SimdKernelsTest, KeyDiffRunningSumIsExactWhateverTheOrder) {
  using T = TypeParam;
  std::mt19937 rng(91);
  for (const Index d : {Index{3}, Index{16}, Index{37}}) {
    const Index n = 40;
    const std::vector<T> keys = random_rows<T>(rng, n, d, 3.0f);
    const vd::StoredRows<T> rows{keys.data(), d, vd::RowFormat{16, d, 0}};
    std::vector<float> w(static_cast<std::size_t>(n)),
        buf(static_cast<std::size_t>(5 * vd::padded_dim(d)));
    for (Index j = 0; j < n; ++j) {
      w[static_cast<std::size_t>(j)] =
          1.0f /
          (vd::key_norm(rows, j, d, buf.data(), buf.data() + vd::padded_dim(d)) + vd::kUnitEps);
    }
    // Rows 0..n-1 in, then every third out, against the rows that stay summed in reverse order.
    std::vector<std::int64_t> kept(static_cast<std::size_t>(d), 0), built(kept);
    const auto update = [&](std::vector<std::int64_t>& sum, Index j, int sign) {
      vd::load_stored_row(rows, j, d, buf.data());
      vd::key_sum_update(sum.data(), buf.data(), d, w[j], sign);
    };
    for (Index j = 0; j < n; ++j) update(kept, j, 1);
    for (Index j = 0; j < n; j += 3) update(kept, j, -1);
    for (Index j = n - 1; j >= 0; --j) {
      if (j % 3 != 0) update(built, j, 1);
    }
    EXPECT_EQ(kept, built) << "d=" << d;
    // Each component is the sum of the unit vectors' components, to 2^-32 per row.
    for (Index i = 0; i < d; ++i) {
      double want = 0.0, norm_sq = 0.0;
      for (Index j = 0; j < n; ++j) {
        if (j % 3 == 0) continue;
        norm_sq = 0.0;
        for (Index k = 0; k < d; ++k) {
          const double x = static_cast<double>(keys[static_cast<std::size_t>(j * d + k)]);
          norm_sq += x * x;
        }
        want += static_cast<double>(keys[static_cast<std::size_t>(j * d + i)]) / std::sqrt(norm_sq);
      }
      EXPECT_NEAR(static_cast<double>(kept[static_cast<std::size_t>(i)]) / vd::kKeySumScale, want,
                  1e-5 * static_cast<double>(n))
          << "d=" << d << " i=" << i;
    }
  }
}

/// The value-weighted ranking (docs/design.md 4.8): a row's weight |v|^p against a double
/// reference (exactly |v|^2 at p = 2, saturated at the largest float), and the rank score * weight
/// over the listed slots only (the others untouched), clamped to the float range (never NaN: a
/// zero score times the largest weight is 0) with a negative score kept negative.
TYPED_TEST(SimdKernelsTest, ValueWeightsAndRankMatchADoubleReference) {
  using T = TypeParam;
  std::mt19937 rng(93);
  for (const Index d : {Index{1}, Index{7}, Index{64}}) {
    const Index n = 9, dp = vd::padded_dim(d);
    const std::vector<T> values = random_rows<T>(rng, n, d, 2.0f);
    const vd::StoredRows<T> rows{values.data(), d, vd::RowFormat{16, d, 0}};
    std::vector<float> score(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) score[j] = 0.25f * static_cast<float>(j) - 0.5f;  // one < 0
    const std::vector<std::int32_t> cand = {8, 1, 4, 0, 2};
    for (const double p : {0.5, 1.5, 2.0, 4.0}) {
      std::vector<float> weight(static_cast<std::size_t>(n)), row(static_cast<std::size_t>(dp));
      std::vector<double> want_w(static_cast<std::size_t>(n));
      for (Index j = 0; j < n; ++j) {
        weight[j] = vd::value_norm_weight(rows, j, d, p, row.data());
        double ss = 0.0;
        for (Index k = 0; k < d; ++k) {
          const double x = static_cast<double>(values[static_cast<std::size_t>(j * d + k)]);
          ss += x * x;
        }
        want_w[j] = std::pow(ss, p / 2.0);
        EXPECT_NEAR(weight[j], want_w[j], 1e-6 * want_w[j]) << "p=" << p << " d=" << d;
        if (p == 2.0) {
          EXPECT_EQ(weight[j], static_cast<float>(ss)) << "d=" << d;
        }
      }
      std::vector<float> rank(static_cast<std::size_t>(n), -7.0f);
      vd::value_weighted_rank(score.data(), weight.data(), cand.data(),
                              static_cast<Index>(cand.size()), rank.data());
      for (Index j = 0; j < n; ++j) {
        const bool listed = std::find(cand.begin(), cand.end(), j) != cand.end();
        if (!listed) {
          EXPECT_EQ(rank[j], -7.0f) << "slot " << j << " is not a candidate";
          continue;
        }
        const double want = static_cast<double>(score[j]) * want_w[j];
        EXPECT_NEAR(rank[j], want, 2e-6 * std::abs(want) + 1e-30) << "p=" << p << " d=" << d;
        EXPECT_EQ(rank[j], static_cast<float>(static_cast<double>(score[j]) * weight[j]));
      }
    }
  }
  // Saturation: a float row near 1e30 at p = 4 weighs beyond the float range.
  const std::vector<float> huge = {1e30f, 1e30f, 0.0f, 0.0f};  // two rows of D = 2
  const vd::StoredRows<float> rows{huge.data(), 2, vd::RowFormat{16, 2, 0}};
  std::vector<float> row(static_cast<std::size_t>(vd::padded_dim(2)));
  const std::vector<float> weight = {vd::value_norm_weight(rows, 0, 2, 4.0, row.data()),
                                     vd::value_norm_weight(rows, 1, 2, 4.0, row.data())};
  EXPECT_EQ(weight[0], std::numeric_limits<float>::max());
  EXPECT_EQ(weight[1], 0.0f);
  const std::vector<std::int32_t> both = {0, 1};
  std::vector<float> rank(2);
  for (const float s0 : {3.0f, -0.5f}) {
    const std::vector<float> score = {s0, 2.0f};
    vd::value_weighted_rank(score.data(), weight.data(), both.data(), 2, rank.data());
    EXPECT_EQ(rank[0], s0 > 0 ? std::numeric_limits<float>::max()
                              : -0.5f * std::numeric_limits<float>::max());
    EXPECT_EQ(rank[1], 0.0f);
  }
  const std::vector<float> big_score = {-1e30f, 0.0f};
  vd::value_weighted_rank(big_score.data(), weight.data(), both.data(), 2, rank.data());
  EXPECT_EQ(rank[0], std::numeric_limits<float>::lowest());
}

/// KeyDiff's ranking: -cos(k, mean unit key) against a double reference on every path, the same
/// over the storage as it lies and over a list of live slots, and K-norm's |k|.
TYPED_TEST(SimdKernelsTest, KeyDiffRankMatchesADoubleReferenceOnEveryPath) {
  using T = TypeParam;
  std::mt19937 rng(92);
  for (const Index d : {Index{5}, Index{32}, Index{64}}) {
    const Index n = 23, dp = vd::padded_dim(d);
    const std::vector<T> keys = random_rows<T>(rng, n, d, 2.0f);
    const vd::StoredRows<T> rows{keys.data(), d, vd::RowFormat{16, d, 0}};
    // Double reference over every row.
    std::vector<std::vector<double>> u(static_cast<std::size_t>(n), std::vector<double>(d));
    std::vector<double> norm(static_cast<std::size_t>(n)), mean(static_cast<std::size_t>(d), 0.0);
    for (Index j = 0; j < n; ++j) {
      double s = 0.0;
      for (Index k = 0; k < d; ++k) {
        const double x = static_cast<double>(keys[static_cast<std::size_t>(j * d + k)]);
        s += x * x;
      }
      norm[j] = std::sqrt(s);
      for (Index k = 0; k < d; ++k) {
        u[j][k] = static_cast<double>(keys[static_cast<std::size_t>(j * d + k)]) / (norm[j] + 1e-8);
        mean[k] += u[j][k] / static_cast<double>(n);
      }
    }
    double mnorm = 0.0;
    for (double x : mean) mnorm += x * x;
    mnorm = std::sqrt(mnorm);
    for_each_level([&](vc::SimdLevel level) {
      std::vector<float> w(static_cast<std::size_t>(n)), buf(static_cast<std::size_t>(6 * dp));
      std::vector<std::int64_t> sum(static_cast<std::size_t>(d), 0);
      std::vector<std::int32_t> slot(static_cast<std::size_t>(n));
      for (Index j = 0; j < n; ++j) {
        const float nj = vd::key_norm(rows, j, d, buf.data(), buf.data() + dp);
        EXPECT_NEAR(nj, norm[j], 1e-5 * norm[j]) << vc::simd_level_name(level);
        w[j] = 1.0f / (nj + vd::kUnitEps);
        vd::key_sum_update(sum.data(), buf.data(), d, w[j], 1);  // the row key_norm loaded
        slot[j] = static_cast<std::int32_t>(j);
      }
      std::vector<float> whole(static_cast<std::size_t>(n)), listed(whole), dots(whole);
      vd::keydiff_rank(rows, d, sum.data(), w.data(), n, n, slot.data(), n, true, whole.data(),
                       dots.data(), buf.data(), buf.data() + dp);
      vd::keydiff_rank(rows, d, sum.data(), w.data(), n, n, slot.data(), n, false, listed.data(),
                       dots.data(), buf.data(), buf.data() + dp);
      for (Index j = 0; j < n; ++j) {
        double dot = 0.0;
        for (Index k = 0; k < d; ++k) dot += u[j][k] * mean[k];
        EXPECT_NEAR(whole[j], -dot / mnorm, 2e-6) << vc::simd_level_name(level) << " d=" << d;
        EXPECT_EQ(whole[j], listed[j]) << vc::simd_level_name(level) << " d=" << d;
      }
    });
  }
}
