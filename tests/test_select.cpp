// The selection kernel alone, on purpose (docs/design.md 4.2, 4.5, 6): which row goes first, with
// both tie rules, protection by position, dead rows, NaN scores, and the k-worst ordering against
// a full sort.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>
#include <veloxquant/cache.hpp>

namespace {

namespace vd = veloxquant::cache::detail;
using Index = Eigen::Index;

TEST(SelectTest, WorstOfTakesTheLowestScoreAndBreaksTiesByPosition) {
  //                   0     1     2     3     4     5
  std::vector<float> score = {0.5f, 0.2f, 0.9f, 0.2f, 0.1f, 0.1f};
  std::vector<std::int64_t> pos = {10, 3, 7, 1, 8, 4};
  std::vector<std::uint8_t> alive = {1, 1, 1, 1, 1, 1};
  const auto all = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 0, all, vd::Tie::evict_earliest), 5);
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 0, all, vd::Tie::evict_latest), 4);
  // Protection by position: [lo, hi) = [5, 9) leaves rows 2 (pos 7) and 4 (pos 8).
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 5, 9, vd::Tie::evict_earliest), 4);
  // Dead rows never qualify.
  alive[4] = 0;
  alive[5] = 0;
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 0, all, vd::Tie::evict_earliest), 3);
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 0, all, vd::Tie::evict_latest), 1);
  // Nothing qualifies: -1.
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 6, 11, all, vd::Tie::evict_earliest), -1);
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 0, 0, all, vd::Tie::evict_earliest), -1);
}

TEST(SelectTest, NanScoresRankFirstSoTheOrderStaysStrict) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> score = {0.0f, nan, -1.0f, nan};
  std::vector<std::int64_t> pos = {0, 1, 2, 3};
  std::vector<std::uint8_t> alive = {1, 1, 1, 1};
  const auto all = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 4, 0, all, vd::Tie::evict_earliest), 1);
  EXPECT_EQ(vd::worst_of(score.data(), pos.data(), alive.data(), 4, 0, all, vd::Tie::evict_latest), 3);
  EXPECT_TRUE(vd::evicts_before(nan, 5, -1e30f, 0, vd::Tie::evict_earliest));
  EXPECT_FALSE(vd::evicts_before(-1e30f, 0, nan, 5, vd::Tie::evict_earliest));
}

/// order_worst_first puts exactly the k first rows of the full (score, position) order first,
/// for both tie rules, with many ties and a few NaNs (nth_element with a strict weak order).
TEST(SelectTest, OrderWorstFirstAgreesWithAFullSort) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const Index n = 1 + static_cast<Index>(rng() % 60);
    std::vector<float> score(static_cast<std::size_t>(n));
    std::vector<std::int64_t> pos(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      score[k] = static_cast<float>(rng() % 5) * 0.25f;  // many exact ties
      if (rng() % 17 == 0) score[k] = std::numeric_limits<float>::quiet_NaN();
      pos[k] = static_cast<std::int64_t>(i * 3 + static_cast<Index>(rng() % 3));
    }
    for (const vd::Tie tie : {vd::Tie::evict_earliest, vd::Tie::evict_latest}) {
      const Index k = static_cast<Index>(rng() % static_cast<unsigned>(n + 1));
      std::vector<std::int32_t> cand(static_cast<std::size_t>(n));
      std::iota(cand.begin(), cand.end(), 0);
      std::shuffle(cand.begin(), cand.end(), rng);
      vd::order_worst_first(cand.data(), n, k, score.data(), pos.data(), tie);
      std::vector<std::int32_t> sorted(static_cast<std::size_t>(n));
      std::iota(sorted.begin(), sorted.end(), 0);
      std::sort(sorted.begin(), sorted.end(), [&](std::int32_t a, std::int32_t b) {
        return vd::evicts_before(score[static_cast<std::size_t>(a)], pos[static_cast<std::size_t>(a)],
                                 score[static_cast<std::size_t>(b)], pos[static_cast<std::size_t>(b)], tie);
      });
      if (k >= n) continue;  // nothing to order: every candidate goes
      std::vector<std::int32_t> got(cand.begin(), cand.begin() + k), want(sorted.begin(), sorted.begin() + k);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      ASSERT_EQ(got, want) << "trial " << trial << " n=" << n << " k=" << k;
    }
  }
}

/// worst_in_order (the one-token calls' eviction: a gather and the SIMD argmin, with a scalar
/// pass when a NaN is among the scores) picks the row worst_of picks over the same rows, for both
/// tie rules, with many ties, NaNs and sub-ranges of every length.
TEST(SelectTest, WorstInOrderAgreesWithWorstOf) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 400; ++trial) {
    const Index n = 1 + static_cast<Index>(rng() % 80);
    std::vector<float> score(static_cast<std::size_t>(n));
    std::vector<std::int64_t> pos(static_cast<std::size_t>(n));
    std::vector<std::uint8_t> alive(static_cast<std::size_t>(n), 1);
    for (std::size_t i = 0; i < score.size(); ++i) {
      score[i] = static_cast<float>(rng() % 4) * 0.5f;
      if (trial % 2 == 0 && rng() % 9 == 0) score[i] = std::numeric_limits<float>::quiet_NaN();
    }
    // Rows stored in any order; `order` lists them by ascending position.
    std::vector<std::int32_t> order(score.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t r = 0; r < order.size(); ++r) {
      pos[static_cast<std::size_t>(order[r])] = static_cast<std::int64_t>(2 * r);
    }
    const Index lo = static_cast<Index>(rng() % static_cast<unsigned>(n));
    const Index hi = lo + static_cast<Index>(rng() % static_cast<unsigned>(n - lo + 1));
    std::vector<float> buf(score.size());
    for (const vd::Tie tie : {vd::Tie::evict_earliest, vd::Tie::evict_latest}) {
      const Index got = vd::worst_in_order(order.data(), lo, hi, score.data(), tie, buf.data());
      const Index want =
          vd::worst_of(score.data(), pos.data(), alive.data(), n, 2 * lo, 2 * hi, tie);
      ASSERT_EQ(got < 0 ? -1 : order[static_cast<std::size_t>(got)], want)
          << "trial " << trial << " n=" << n << " [" << lo << ", " << hi << ")";
    }
  }
}

}  // namespace
