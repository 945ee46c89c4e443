// KVCache<T>, the standard append-only cache and common base (docs/design.md 2.2), and the zero-copy
// KVView<T> of update_and_view (docs/design.md 2.3) on the standard cache and on an eviction cache.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using veloxquant::test::Index;
using veloxquant::test::random_tensor;

using veloxquant::test::StorageTypes;

template <class T>
float f(T x) {
  return static_cast<float>(x);
}

/// One head's rows: key and value rows, converted to float (exact for every storage type).
struct Row {
  std::vector<float> key;
  std::vector<float> value;
  bool operator==(const Row& o) const { return key == o.key && value == o.value; }
};
using HeadRows = std::vector<Row>;  // ascending position

/// Row s of head (b, h) of (keys, values).
template <class T>
Row row_at(const vc::Tensor4<T>& keys, const vc::Tensor4<T>& values, Index b, Index h, Index s) {
  Row r;
  for (Index d = 0; d < keys.dimension(3); ++d) r.key.push_back(f(keys(b, h, s, d)));
  for (Index d = 0; d < values.dimension(3); ++d) r.value.push_back(f(values(b, h, s, d)));
  return r;
}

/// All rows of head (b, h) of a [B, H, n, D] pair.
template <class T>
HeadRows head_rows(const vc::KVPair<T>& kv, Index b, Index h) {
  HeadRows out;
  for (Index s = 0; s < kv.first.dimension(2); ++s)
    out.push_back(row_at(kv.first, kv.second, b, h, s));
  return out;
}

/// Rows of head (b, h) of a view, in view order, with their positions.
template <class T>
std::vector<std::pair<std::int64_t, Row>> view_rows(const vc::KVView<T>& view, Index b, Index h) {
  std::vector<std::pair<std::int64_t, Row>> out;
  const auto k = view.keys(b, h);
  const auto v = view.values(b, h);
  const auto p = view.positions(b, h);
  EXPECT_EQ(k.rows(), view.rows());
  EXPECT_EQ(k.cols(), view.key_dim());
  EXPECT_EQ(v.rows(), view.rows());
  EXPECT_EQ(v.cols(), view.value_dim());
  EXPECT_EQ(p.size(), view.rows());
  for (Index r = 0; r < view.rows(); ++r) {
    Row row;
    for (Index d = 0; d < k.cols(); ++d) row.key.push_back(f(k(r, d)));
    for (Index d = 0; d < v.cols(); ++d) row.value.push_back(f(v(r, d)));
    out.emplace_back(p(r), std::move(row));
  }
  return out;
}

vc::KVCacheConfig h2o_config(int budget, int n_sink, int grace) {
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  c.h2o_n_sink = n_sink;
  c.h2o_grace = grace;
  return c;
}

template <class T>
class KVCacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(KVCacheTest, StorageTypes);

// ---------------------------------------------------------------------------------------------
// The standard cache
// ---------------------------------------------------------------------------------------------

TYPED_TEST(KVCacheTest, AppendsEverythingAndReturnsAllRowsInOrder) {
  using T = TypeParam;
  const Index B = 2, H = 3, Dk = 4, Dv = 6;  // Dk != Dv
  std::mt19937 rng(11);
  vc::KVCache<T> cache;
  EXPECT_TRUE(cache.is_trimmable());
  EXPECT_EQ(cache.offset(), 0);
  std::vector<HeadRows> all(static_cast<std::size_t>(B * H));
  std::int64_t offset = 0;
  for (const Index S : {Index{5}, Index{1}, Index{3}, Index{1}, Index{1}, Index{8}}) {
    const auto k = random_tensor<T>(rng, B, H, S, Dk);
    const auto v = random_tensor<T>(rng, B, H, S, Dv);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index s = 0; s < S; ++s)
          all[static_cast<std::size_t>(b * H + h)].push_back(row_at(k, v, b, h, s));
    const vc::KVPair<T> out = cache.update_and_fetch(k, v);
    offset += S;
    ASSERT_EQ(out.first.dimension(0), B);
    ASSERT_EQ(out.first.dimension(1), H);
    ASSERT_EQ(out.first.dimension(2), offset);
    ASSERT_EQ(out.first.dimension(3), Dk);
    ASSERT_EQ(out.second.dimension(2), offset);
    ASSERT_EQ(out.second.dimension(3), Dv);
    EXPECT_EQ(cache.offset(), offset);
    const vc::KVPair<T> st = cache.state();
    ASSERT_EQ(st.first.dimension(2), offset);
    ASSERT_EQ(st.second.dimension(3), Dv);
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        EXPECT_EQ(head_rows(out, b, h), all[static_cast<std::size_t>(b * H + h)]);
        EXPECT_EQ(head_rows(st, b, h), all[static_cast<std::size_t>(b * H + h)]);
      }
    }
  }
  EXPECT_EQ(cache.batch(), B);
  EXPECT_EQ(cache.heads(), H);
  EXPECT_EQ(cache.key_dim(), Dk);
  EXPECT_EQ(cache.value_dim(), Dv);
}

TYPED_TEST(KVCacheTest, TrimDropsTheNewestTokensAndPositionsAreReused) {
  using T = TypeParam;
  const Index B = 2, H = 2, D = 4;
  std::mt19937 rng(12);
  vc::KVCache<T> cache;
  const auto k1 = random_tensor<T>(rng, B, H, 10, D);
  const auto v1 = random_tensor<T>(rng, B, H, 10, D);
  cache.update_and_fetch(k1, v1);
  const vc::KVPair<T> full = cache.state();

  EXPECT_EQ(cache.trim(0), 0);
  EXPECT_EQ(cache.offset(), 10);
  EXPECT_EQ(cache.trim(3), 3);
  EXPECT_EQ(cache.offset(), 7);
  const vc::KVPair<T> st = cache.state();
  ASSERT_EQ(st.first.dimension(2), 7);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      HeadRows want = head_rows(full, b, h);
      want.resize(7);
      EXPECT_EQ(head_rows(st, b, h), want);
    }
  EXPECT_EQ(cache.tokens_kept(), 7);
  EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * 7 * 2 * D) * sizeof(T));
  EXPECT_EQ(cache.full_seq_bytes(), cache.kept_bytes());

  // The next call continues at the new offset: positions 7 and 8 are reused.
  const auto k2 = random_tensor<T>(rng, B, H, 2, D);
  const auto v2 = random_tensor<T>(rng, B, H, 2, D);
  const vc::KVView<T> view = cache.update_and_view(k2, v2);
  ASSERT_EQ(view.rows(), 9);
  ASSERT_EQ(view.new_rows(), 2);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const auto rows = view_rows(view, b, h);
      EXPECT_EQ(rows[7].first, 7);
      EXPECT_EQ(rows[8].first, 8);
      EXPECT_EQ(rows[7].second, row_at(k2, v2, b, h, 0));
      EXPECT_EQ(rows[8].second, row_at(k2, v2, b, h, 1));
    }
  EXPECT_EQ(cache.offset(), 9);

  // n > offset clamps to offset and returns what was dropped.
  EXPECT_EQ(cache.trim(100), 9);
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.state().first.dimension(2), 0);
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.trim(5), 0);
  const vc::KVView<T> again = cache.update_and_view(k2, v2);
  ASSERT_EQ(again.rows(), 2);
  EXPECT_EQ(again.positions(1, 1)(0), 0);
  EXPECT_EQ(again.positions(1, 1)(1), 1);
}

TYPED_TEST(KVCacheTest, TrimOfNegativeCountThrowsAndChangesNothing) {
  using T = TypeParam;
  std::mt19937 rng(13);
  vc::KVCache<T> cache;
  cache.update_and_fetch(random_tensor<T>(rng, 1, 2, 4, 3), random_tensor<T>(rng, 1, 2, 4, 3));
  const vc::KVPair<T> before = cache.state();
  EXPECT_THROW(cache.trim(-1), std::invalid_argument);
  EXPECT_EQ(cache.offset(), 4);
  EXPECT_EQ(head_rows(cache.state(), 0, 1), head_rows(before, 0, 1));
}

TYPED_TEST(KVCacheTest, ResetForgetsEverythingAndAllowsNewShapes) {
  using T = TypeParam;
  std::mt19937 rng(15);
  vc::KVCache<T> cache;
  cache.update_and_fetch(random_tensor<T>(rng, 2, 2, 5, 4), random_tensor<T>(rng, 2, 2, 5, 4));
  cache.reset();
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.full_seq_bytes(), 0u);
  EXPECT_EQ(cache.compression_ratio(), 1.0);
  EXPECT_EQ(cache.tokens_seen(), 0);
  EXPECT_EQ(cache.tokens_kept(), 0);
  EXPECT_EQ(cache.state().first.size(), 0);

  // B, H and D may all change after a reset; positions restart at 0.
  const auto k = random_tensor<T>(rng, 3, 1, 2, 8);
  const auto v = random_tensor<T>(rng, 3, 1, 2, 5);
  const vc::KVView<T> view = cache.update_and_view(k, v);
  EXPECT_EQ(view.batch(), 3);
  EXPECT_EQ(view.heads(), 1);
  EXPECT_EQ(view.key_dim(), 8);
  EXPECT_EQ(view.value_dim(), 5);
  ASSERT_EQ(view.rows(), 2);
  EXPECT_EQ(view.positions(2, 0)(0), 0);
  EXPECT_EQ(view.positions(2, 0)(1), 1);
  EXPECT_EQ(cache.offset(), 2);
  const vc::KVPair<T> st = cache.state();
  EXPECT_EQ(st.first.dimension(0), 3);
  EXPECT_EQ(st.first.dimension(3), 8);
  EXPECT_EQ(st.second.dimension(3), 5);
  EXPECT_EQ(head_rows(st, 2, 0)[1], row_at(k, v, 2, 0, 1));
}

TYPED_TEST(KVCacheTest, AccountingOfTheStandardCache) {
  using T = TypeParam;
  const Index B = 2, H = 3, Dk = 4, Dv = 2;
  std::mt19937 rng(16);
  vc::KVCache<T> cache;
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.full_seq_bytes(), 0u);
  EXPECT_EQ(cache.compression_ratio(), 1.0);
  EXPECT_EQ(cache.tokens_seen(), 0);
  EXPECT_EQ(cache.tokens_kept(), 0);
  std::int64_t rows = 0;
  for (const Index S : {Index{7}, Index{1}, Index{1}, Index{4}}) {
    cache.update_and_fetch(random_tensor<T>(rng, B, H, S, Dk), random_tensor<T>(rng, B, H, S, Dv));
    rows += S;
    const std::size_t want = static_cast<std::size_t>(B * H * rows * (Dk + Dv)) * sizeof(T);
    EXPECT_EQ(cache.kept_bytes(), want);
    EXPECT_EQ(cache.full_seq_bytes(), want);
    EXPECT_EQ(cache.compression_ratio(), 1.0);
    EXPECT_EQ(cache.tokens_seen(), B * H * rows);
    EXPECT_EQ(cache.tokens_kept(), rows);
  }
}

TYPED_TEST(KVCacheTest, AccountingOfAnEvictionCache) {
  using T = TypeParam;
  const Index B = 2, H = 2, Dk = 8, Dv = 4;
  std::mt19937 rng(17);
  vc::H2OCache<T> cache(h2o_config(4, 1, 1));
  EXPECT_EQ(cache.compression_ratio(), 1.0);
  cache.update_and_fetch(random_tensor<T>(rng, B, H, 10, Dk), random_tensor<T>(rng, B, H, 10, Dv));
  const std::size_t row = static_cast<std::size_t>(Dk + Dv) * sizeof(T);
  EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * 4) * row);
  EXPECT_EQ(cache.full_seq_bytes(), static_cast<std::size_t>(B * H * 10) * row);
  EXPECT_DOUBLE_EQ(cache.compression_ratio(), 2.5);
  EXPECT_EQ(cache.tokens_seen(), 40);
  EXPECT_EQ(cache.tokens_kept(), 4);
  for (int i = 0; i < 6; ++i) {
    cache.update_and_fetch(random_tensor<T>(rng, B, H, 1, Dk), random_tensor<T>(rng, B, H, 1, Dv));
  }
  EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * 4) * row);
  EXPECT_EQ(cache.full_seq_bytes(), static_cast<std::size_t>(B * H * 16) * row);
  EXPECT_DOUBLE_EQ(cache.compression_ratio(), 4.0);
  EXPECT_EQ(cache.tokens_seen(), 64);
  EXPECT_EQ(cache.tokens_kept(), 4);
  EXPECT_EQ(cache.offset(), 16);
}

TYPED_TEST(KVCacheTest, DoubleAndFloatInputsAreRoundedToTheStorageType) {
  using T = TypeParam;
  const Index B = 1, H = 2, S = 3, Dk = 5, Dv = 3;
  std::mt19937 rng(18);
  std::uniform_real_distribution<double> dist(-3.0, 3.0);
  vc::Tensor4<double> kd(B, H, S, Dk), vd(B, H, S, Dv);
  for (Index i = 0; i < kd.size(); ++i) kd.data()[i] = dist(rng);
  for (Index i = 0; i < vd.size(); ++i) vd.data()[i] = dist(rng);
  kd(0, 1, 2, 4) = 0.1;  // not representable in any storage type
  vc::KVCache<T> cache;
  const vc::KVPair<T> out = cache.update_and_fetch(kd, vd);
  ASSERT_EQ(out.first.dimension(2), S);
  for (Index h = 0; h < H; ++h)
    for (Index s = 0; s < S; ++s) {
      for (Index d = 0; d < Dk; ++d) {
        const T want = static_cast<T>(kd(0, h, s, d));
        EXPECT_EQ(std::memcmp(&out.first(0, h, s, d), &want, sizeof(T)), 0)
            << h << " " << s << " " << d;
      }
      for (Index d = 0; d < Dv; ++d) {
        const T want = static_cast<T>(vd(0, h, s, d));
        EXPECT_EQ(std::memcmp(&out.second(0, h, s, d), &want, sizeof(T)), 0)
            << h << " " << s << " " << d;
      }
    }
  if constexpr (!std::is_same_v<T, float>) {
    EXPECT_NE(static_cast<double>(f(out.first(0, 1, 2, 4))), 0.1);  // really rounded
  }

  // float input through update_and_view.
  vc::Tensor4<float> kf(B, H, 1, Dk), vf(B, H, 1, Dv);
  for (Index i = 0; i < kf.size(); ++i) kf.data()[i] = static_cast<float>(dist(rng));
  for (Index i = 0; i < vf.size(); ++i) vf.data()[i] = static_cast<float>(dist(rng));
  const vc::KVView<T> view = cache.update_and_view(kf, vf);
  ASSERT_EQ(view.rows(), S + 1);
  for (Index h = 0; h < H; ++h) {
    for (Index d = 0; d < Dk; ++d)
      EXPECT_EQ(f(view.keys(0, h)(S, d)), f(static_cast<T>(kf(0, h, 0, d))));
    for (Index d = 0; d < Dv; ++d)
      EXPECT_EQ(f(view.values(0, h)(S, d)), f(static_cast<T>(vf(0, h, 0, d))));
    EXPECT_EQ(view.positions(0, h)(S), S);
  }
}

// ---------------------------------------------------------------------------------------------
// update_and_view
// ---------------------------------------------------------------------------------------------

TYPED_TEST(KVCacheTest, ViewMatchesFetchOnTheStandardCache) {
  using T = TypeParam;
  const Index B = 2, H = 2, Dk = 3, Dv = 5;
  std::mt19937 rng(19);
  vc::KVCache<T> viewed, fetched;
  std::int64_t offset = 0;
  for (const Index S : {Index{4}, Index{1}, Index{2}, Index{1}}) {
    const auto k = random_tensor<T>(rng, B, H, S, Dk);
    const auto v = random_tensor<T>(rng, B, H, S, Dv);
    const vc::KVPair<T> out = fetched.update_and_fetch(k, v);
    const vc::KVView<T> view = viewed.update_and_view(k, v);
    offset += S;
    ASSERT_EQ(view.rows(), offset);
    ASSERT_EQ(view.new_rows(), S);
    EXPECT_EQ(view.batch(), B);
    EXPECT_EQ(view.heads(), H);
    EXPECT_EQ(view.key_dim(), Dk);
    EXPECT_EQ(view.value_dim(), Dv);
    const vc::KVPair<T> st = viewed.state();
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const auto rows = view_rows(view, b, h);
        const HeadRows want = head_rows(out, b, h);
        const HeadRows state_rows = head_rows(st, b, h);
        std::vector<bool> seen(static_cast<std::size_t>(offset), false);
        for (const auto& [pos, row] : rows) {
          ASSERT_GE(pos, 0);
          ASSERT_LT(pos, offset);
          EXPECT_FALSE(seen[static_cast<std::size_t>(pos)]);
          seen[static_cast<std::size_t>(pos)] = true;
          EXPECT_EQ(row, want[static_cast<std::size_t>(pos)]);
          EXPECT_EQ(row, state_rows[static_cast<std::size_t>(pos)]);
        }
        for (Index s = 0; s < S; ++s) {
          const auto& last = rows[static_cast<std::size_t>(offset - S + s)];
          EXPECT_EQ(last.first, offset - S + s);
          EXPECT_EQ(last.second, row_at(k, v, b, h, s));
        }
      }
    }
    EXPECT_THROW(view.keys(B, 0), std::out_of_range);
    EXPECT_THROW(view.positions(0, H), std::out_of_range);
  }
}

TYPED_TEST(KVCacheTest, EmptyCallChangesNothingAndReturnsTheRetainedSet) {
  using T = TypeParam;
  const Index B = 2, H = 3, Dk = 4, Dv = 6;
  std::mt19937 rng(20);
  vc::KVCache<T> cache;
  const vc::Tensor4<T> k0(B, H, 0, Dk), v0(B, H, 0, Dv);

  // Before any call: an empty window shaped like the input, [B, H, 0, D].
  const vc::KVPair<T> e = cache.update_and_fetch(k0, v0);
  EXPECT_EQ(e.first.dimension(0), B);
  EXPECT_EQ(e.first.dimension(1), H);
  EXPECT_EQ(e.first.dimension(2), 0);
  EXPECT_EQ(e.first.dimension(3), Dk);
  EXPECT_EQ(e.second.dimension(3), Dv);
  const vc::KVView<T> ev = cache.update_and_view(k0, v0);
  EXPECT_EQ(ev.rows(), 0);
  EXPECT_EQ(ev.new_rows(), 0);
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.tokens_seen(), 0);

  const auto k = random_tensor<T>(rng, B, H, 5, Dk);
  const auto v = random_tensor<T>(rng, B, H, 5, Dv);
  cache.update_and_fetch(k, v);
  const vc::KVPair<T> st = cache.state();
  const vc::KVPair<T> out = cache.update_and_fetch(k0, v0);
  ASSERT_EQ(out.first.dimension(2), 5);
  EXPECT_EQ(cache.offset(), 5);
  EXPECT_EQ(cache.tokens_seen(), B * H * 5);
  const vc::KVView<T> view = cache.update_and_view(k0, v0);
  EXPECT_EQ(view.rows(), 5);
  EXPECT_EQ(view.new_rows(), 0);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      EXPECT_EQ(head_rows(out, b, h), head_rows(st, b, h));
      for (const auto& [pos, row] : view_rows(view, b, h)) {
        EXPECT_EQ(row, head_rows(st, b, h)[static_cast<std::size_t>(pos)]);
      }
    }
  EXPECT_EQ(head_rows(cache.state(), 1, 2), head_rows(st, 1, 2));
}

TYPED_TEST(KVCacheTest, EmptyCallOnAnEvictionCacheReturnsTheRetainedSetNotTheLastWindow) {
  using T = TypeParam;
  const Index B = 1, H = 2, D = 4;
  std::mt19937 rng(21);
  vc::H2OCache<T> cache(h2o_config(4, 1, 1));
  const auto k = random_tensor<T>(rng, B, H, 9, D);
  const auto v = random_tensor<T>(rng, B, H, 9, D);
  ASSERT_EQ(cache.update_and_fetch(k, v).first.dimension(2), 9);  // the whole prefill
  const vc::KVPair<T> st = cache.state();
  ASSERT_EQ(st.first.dimension(2), 4);
  const auto positions = cache.positions(0, 1);
  const vc::Tensor4<T> k0(B, H, 0, D), v0(B, H, 0, D);
  const vc::KVPair<T> out = cache.update_and_fetch(k0, v0);
  ASSERT_EQ(out.first.dimension(2), 4);
  for (Index h = 0; h < H; ++h) EXPECT_EQ(head_rows(out, 0, h), head_rows(st, 0, h));
  const vc::KVView<T> view = cache.update_and_view(k0, v0);
  ASSERT_EQ(view.rows(), 4);
  EXPECT_EQ(view.new_rows(), 0);
  std::vector<std::int64_t> vp;
  for (const auto& [pos, row] : view_rows(view, 0, 1)) {
    vp.push_back(pos);
    const auto it = std::find(positions.begin(), positions.end(), pos);
    ASSERT_NE(it, positions.end());
    EXPECT_EQ(row, head_rows(st, 0, 1)[static_cast<std::size_t>(it - positions.begin())]);
  }
  std::sort(vp.begin(), vp.end());
  EXPECT_EQ(vp, positions);
  EXPECT_EQ(cache.positions(0, 1), positions);
  EXPECT_EQ(cache.offset(), 9);
  EXPECT_EQ(cache.tokens_seen(), 18);
}

TYPED_TEST(KVCacheTest, ViewOnAnEvictionCacheHoldsRetainedRowsThenTheCallsRows) {
  using T = TypeParam;
  const Index B = 2, H = 2, Dk = 4, Dv = 3;
  std::mt19937 rng(22);
  // Twin caches fed the same calls: one through views, one through fetch.
  vc::H2OCache<T> viewed(h2o_config(4, 1, 1)), fetched(h2o_config(4, 1, 1));
  std::int64_t offset = 0;
  int calls = 0;
  for (const Index S : {Index{7}, Index{1}, Index{1}, Index{3}, Index{1}, Index{1}, Index{1},
                        Index{2}, Index{1}, Index{1}, Index{1}, Index{1}}) {
    std::vector<std::vector<std::int64_t>> before;
    std::vector<HeadRows> before_rows;
    const vc::KVPair<T> st_before = viewed.state();
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        // (No heads exist before the first call.)
        before.push_back(offset ? viewed.positions(b, h) : std::vector<std::int64_t>{});
        before_rows.push_back(offset ? head_rows(st_before, b, h) : HeadRows{});
      }
    const auto k = random_tensor<T>(rng, B, H, S, Dk);
    const auto v = random_tensor<T>(rng, B, H, S, Dv);
    const vc::KVPair<T> out = fetched.update_and_fetch(k, v);
    const vc::KVView<T> view = viewed.update_and_view(k, v);
    const Index n_before = static_cast<Index>(before.front().size());
    ASSERT_EQ(view.rows(), n_before + S);
    ASSERT_EQ(view.new_rows(), S);
    ASSERT_EQ(out.first.dimension(2), n_before + S);
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const std::size_t hi = static_cast<std::size_t>(b * H + h);
        const auto rows = view_rows(view, b, h);
        // The first n_before rows: a permutation of the retained set, with the right contents.
        std::vector<std::int64_t> old;
        for (Index r = 0; r < n_before; ++r) {
          const auto& [pos, row] = rows[static_cast<std::size_t>(r)];
          old.push_back(pos);
          const auto it = std::find(before[hi].begin(), before[hi].end(), pos);
          ASSERT_NE(it, before[hi].end()) << "position " << pos << " was not retained";
          EXPECT_EQ(row, before_rows[hi][static_cast<std::size_t>(it - before[hi].begin())]);
        }
        std::sort(old.begin(), old.end());
        EXPECT_EQ(old, before[hi]);
        // The last S rows: the call's rows in arrival order.
        for (Index s = 0; s < S; ++s) {
          const auto& [pos, row] = rows[static_cast<std::size_t>(n_before + s)];
          EXPECT_EQ(pos, offset + s);
          EXPECT_EQ(row, row_at(k, v, b, h, s));
        }
        // The fetch twin returns the same rows in ascending position.
        const HeadRows want = head_rows(out, b, h);
        std::vector<std::pair<std::int64_t, Row>> sorted = rows;
        std::sort(sorted.begin(), sorted.end(),
                  [](const auto& x, const auto& y) { return x.first < y.first; });
        for (std::size_t r = 0; r < sorted.size(); ++r) EXPECT_EQ(sorted[r].second, want[r]);
        EXPECT_EQ(viewed.positions(b, h), fetched.positions(b, h));
      }
    }
    offset += S;
    ++calls;
    EXPECT_EQ(viewed.tokens_kept(), 4);
  }
  EXPECT_EQ(calls, 12);
  EXPECT_EQ(viewed.offset(), offset);
}

TYPED_TEST(KVCacheTest, HeapBytesStayBoundedOverALongDecode) {
  using T = TypeParam;
  const Index B = 2, H = 2, Dk = 32, Dv = 32;
  std::mt19937 rng(23);
  vc::H2OCache<T> cache(h2o_config(64, 4, 16));
  std::size_t at_500 = 0;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  vc::Tensor4<T> kk(B, H, 1, Dk), vv(B, H, 1, Dv);
  for (int step = 1; step <= 2000; ++step) {
    for (Index i = 0; i < kk.size(); ++i) kk.data()[i] = static_cast<T>(dist(rng));
    for (Index i = 0; i < vv.size(); ++i) vv.data()[i] = static_cast<T>(dist(rng));
    cache.update_and_view(kk, vv);
    if (step >= 100) {
      const std::size_t call_rows = static_cast<std::size_t>(B * H * (Dk + Dv)) * sizeof(T);
      const std::size_t bound =
          static_cast<std::size_t>(1.5 * static_cast<double>(cache.kept_bytes() + call_rows) +
                                   16384.0 * static_cast<double>(B * H));
      ASSERT_LT(cache.heap_bytes(), bound) << "step " << step;
    }
    if (step == 500) at_500 = cache.heap_bytes();
  }
  EXPECT_EQ(cache.tokens_kept(), 64);
  EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * 64 * (Dk + Dv)) * sizeof(T));
  EXPECT_EQ(cache.heap_bytes(), at_500);
  EXPECT_EQ(cache.offset(), 2000);
}

}  // namespace
