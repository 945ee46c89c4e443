// Quantized storage (docs/design.md 2.9, 7.4). The row format and the quantized kernels alone, on
// purpose (quant.hpp, simd/kernels.inl): every element within half a step of its group after a
// round trip; every quantized kernel on every path gives bitwise what its float32 counterpart
// gives on the dequantized rows. Then through the public API: a quantized cache of every policy
// scores, evicts and attends bitwise as a float32 cache fed the dequantized rows; bad widths,
// groups and elements are rejected and change nothing; kept_bytes() counts what is held; the
// view of a quantized cache shows the dequantized rows. (The contract suite runs over quantized
// rows too: test_contract_q84.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/simd_levels.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace vd = veloxquant::cache::detail;
using Index = Eigen::Index;
using veloxquant::test::for_each_level;
using veloxquant::test::Kind;
using veloxquant::test::kind_name;
using veloxquant::test::kKinds;
using veloxquant::test::Method;

struct Format {
  int bits;
  Index dim, group;
};
/// Formats that take the in-register path on some level and the lane-by-lane path on others:
/// groups of 8, 16, 32 and 64, an odd group (4 bits: a half-empty last byte), a group of the
/// whole row.
const std::vector<Format>& formats() {
  static const std::vector<Format> f = {{8, 64, 32}, {4, 64, 32}, {8, 64, 16}, {4, 64, 16},
                                        {8, 64, 8},  {4, 64, 8},  {8, 128, 64}, {4, 128, 64},
                                        {8, 8, 8},   {4, 8, 8},   {4, 27, 9},  {8, 27, 9},
                                        {4, 48, 48}, {8, 40, 20}};
  return f;
}
vd::RowFormat row_format(const Format& f) { return vd::RowFormat{f.bits, f.dim, f.group}; }
std::string name(const Format& f) {
  return std::to_string(f.bits) + " bits, D " + std::to_string(f.dim) + ", group " +
         std::to_string(f.group);
}

/// n rows quantized: [n, row_bytes].
std::vector<std::uint8_t> quantize(const std::vector<float>& x, const vd::RowFormat& f, Index n) {
  std::vector<std::uint8_t> q(static_cast<std::size_t>(n * f.row_bytes()));
  for (Index j = 0; j < n; ++j) {
    vd::quantize_row(x.data() + j * f.dim, f, q.data() + j * f.row_bytes());
  }
  return q;
}
/// Their dequantization at the active level, as float32 rows [n, D].
std::vector<float> dequantize(const std::vector<std::uint8_t>& q, const vd::RowFormat& f, Index n) {
  const vd::QuantRows rows{q.data(), f.row_bytes(), f};
  std::vector<float> out(static_cast<std::size_t>(n * f.dim));
  std::vector<float> buf(static_cast<std::size_t>(vd::padded_dim(f.dim)));
  for (Index j = 0; j < n; ++j) {
    vd::dequantize_row(rows, j, buf.data());
    std::copy(buf.begin(), buf.begin() + f.dim, out.begin() + j * f.dim);
    for (Index k = f.dim; k < vd::padded_dim(f.dim); ++k) {
      EXPECT_EQ(buf[static_cast<std::size_t>(k)], 0.0f) << "padding";
    }
  }
  return out;
}

std::vector<float> normal_rows(std::mt19937& rng, Index n, Index d, float sigma = 1.0f,
                               float mean = 0.0f) {
  std::normal_distribution<float> g(mean, sigma);
  std::vector<float> x(static_cast<std::size_t>(n * d));
  for (auto& v : x) v = g(rng);
  return x;
}

// ---------------------------------------------------------------------------------------------
// The row format
// ---------------------------------------------------------------------------------------------

/// Every element, after quantize_row and dequantize_row, is within half a step (the group's
/// stored scale / 2) of the original, plus float32 rounding of the dequantizing multiply-add; on
/// every path; for rows of every kind: normal, wide, shifted (a large mean), constant, tiny
/// ranges, subnormal, and the extremes +-65504. Codes span [0, levels] where halves resolve the
/// group's spread.
TEST(QuantRowFormat, RoundTripIsWithinHalfAStepOfTheGroup) {
  std::mt19937 rng(1);
  for (const Format& fm : formats()) {
    SCOPED_TRACE(name(fm));
    const vd::RowFormat f = row_format(fm);
    std::vector<std::vector<float>> cases = {
        normal_rows(rng, 6, f.dim), normal_rows(rng, 6, f.dim, 300.0f),
        normal_rows(rng, 6, f.dim, 0.01f, 1000.0f), std::vector<float>(6 * f.dim, 0.3f),
        normal_rows(rng, 6, f.dim, 1e-6f), normal_rows(rng, 6, f.dim, 1e-9f)};
    std::vector<float> extremes = normal_rows(rng, 6, f.dim, 20000.0f);
    for (Index i = 0; i < 6 * f.dim; i += 5) extremes[static_cast<std::size_t>(i)] = i % 2 ? 65504.0f : -65504.0f;
    for (auto& x : extremes) x = std::clamp(x, -65504.0f, 65504.0f);
    cases.push_back(extremes);
    for (std::size_t c = 0; c < cases.size(); ++c) {
      const std::vector<float>& x = cases[c];
      const std::vector<std::uint8_t> q = quantize(x, f, 6);
      int lowest = f.levels(), highest = 0;
      for (Index j = 0; j < 6; ++j) {
        for (Index k = 0; k < f.dim; ++k) {
          const int code = vd::element_code(q.data() + j * f.row_bytes(), f, k);
          lowest = std::min(lowest, code);
          highest = std::max(highest, code);
        }
      }
      // Where half scales resolve the spread (not: the constant rows, a spread of 0.05 around
      // 1000 where halves step by 0.5, spreads below the smallest half), the codes span it all.
      if (c == 0 || c == 1 || c == 6) {
        EXPECT_EQ(lowest, 0) << "case " << c;
        EXPECT_EQ(highest, f.levels()) << "case " << c;
      }
      for_each_level([&](vc::SimdLevel) {
        const std::vector<float> y = dequantize(q, f, 6);
        for (Index j = 0; j < 6; ++j) {
          for (Index k = 0; k < f.dim; ++k) {
            float scale = 0.0f, offset = 0.0f;
            vd::group_scale_offset(q.data() + j * f.row_bytes(), f, k / f.group, scale, offset);
            const auto at = static_cast<std::size_t>(j * f.dim + k);
            const double err = std::abs(static_cast<double>(y[at]) - x[at]);
            const double ulp = std::abs(static_cast<double>(x[at])) * 0x1p-23 * 2;
            ASSERT_LE(err, 0.5 * scale + ulp)
                << "case " << c << ", row " << j << ", element " << k << ": " << x[at] << " -> "
                << y[at] << ", scale " << scale;
          }
        }
      });
    }
  }
}

/// A constant group whose value is a half round-trips exactly (scale 0), and so does a group of
/// exactly representable steps; the stored offset never lies above the group's minimum.
TEST(QuantRowFormat, ExactValuesStayExact) {
  for (const int bits : {8, 4}) {
    const vd::RowFormat f{bits, 16, 8};
    std::vector<float> x(16);
    for (Index k = 0; k < 8; ++k) x[static_cast<std::size_t>(k)] = -2.5f;
    for (Index k = 8; k < 16; ++k) x[static_cast<std::size_t>(k)] = 0.25f * static_cast<float>(k - 8);
    const std::vector<std::uint8_t> q = quantize(x, f, 1);
    float s0, o0, s1, o1;
    vd::group_scale_offset(q.data(), f, 0, s0, o0);
    vd::group_scale_offset(q.data(), f, 1, s1, o1);
    EXPECT_EQ(s0, 0.0f);
    EXPECT_EQ(o0, -2.5f);
    EXPECT_EQ(o1, 0.0f);
    for_each_level([&](vc::SimdLevel) {
      const std::vector<float> y = dequantize(q, f, 1);
      for (Index k = 0; k < 8; ++k) EXPECT_EQ(y[static_cast<std::size_t>(k)], -2.5f);
      if (bits == 8) {
        // 1.75 / 255 is not a half: the codes are rounded, yet within half a step.
        for (Index k = 8; k < 16; ++k) {
          EXPECT_NEAR(y[static_cast<std::size_t>(k)], x[static_cast<std::size_t>(k)], 0.5 * s1 + 1e-6);
        }
      }
    });
  }
  // The offset is the largest half <= min, also when min is not a half.
  const vd::RowFormat f{8, 8, 8};
  std::vector<float> x = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, -0.1f};
  const std::vector<std::uint8_t> q = quantize(x, f, 1);
  float s, o;
  vd::group_scale_offset(q.data(), f, 0, s, o);
  EXPECT_LE(o, -0.1f);
  EXPECT_GE(o + 255.0f * s, 0.7f);
}

// ---------------------------------------------------------------------------------------------
// The quantized kernels against their float32 counterparts
// ---------------------------------------------------------------------------------------------

/// Quantized rows as a float32 cache holds them: each row padded to whole floats.
struct HeldRows {
  std::vector<float> data;
  Index stride = 0;  // floats per row
  vd::RowFormat fmt;
  vd::StoredRows<float> rows() const { return vd::StoredRows<float>{data.data(), stride, fmt}; }
};
HeldRows hold(const std::vector<std::uint8_t>& q, const vd::RowFormat& f, Index n) {
  HeldRows h;
  h.fmt = f;
  h.stride = (f.row_bytes() + 3) / 4;
  h.data.assign(static_cast<std::size_t>(n * h.stride), 0.0f);
  for (Index j = 0; j < n; ++j) {
    std::memcpy(h.data.data() + j * h.stride, q.data() + j * f.row_bytes(),
                static_cast<std::size_t>(f.row_bytes()));
  }
  return h;
}

/// logits over quantized keys (m = 1 .. 8 query rows, with and without an index), the packed
/// prefill keys and the attention output over quantized values equal, bitwise, on every path,
/// what the float32 kernels give on the dequantized rows.
TEST(QuantKernels, EveryKernelEqualsItsFloatCounterpartOnTheDequantizedRows) {
  std::mt19937 rng(2);
  const Index n = 37;
  for (const Format& fm : formats()) {
    SCOPED_TRACE(name(fm));
    const vd::RowFormat f = row_format(fm);
    const Index d = f.dim, dp = vd::padded_dim(d);
    const std::vector<std::uint8_t> q = quantize(normal_rows(rng, n, d), f, n);
    const HeldRows held = hold(q, f, n);
    std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) idx[static_cast<std::size_t>(j)] = static_cast<std::int32_t>((j * 7) % n);
    for_each_level([&](vc::SimdLevel) {
      const std::vector<float> deq = dequantize(q, f, n);
      const vd::StoredRows<float> plain{deq.data(), d, vd::RowFormat{16, d, 0}};
      std::vector<float> kbuf(static_cast<std::size_t>(4 * dp));
      for (const Index m : {1, 2, 3, 4, 5, 8}) {
        SCOPED_TRACE("m = " + std::to_string(m));
        std::vector<float> qs(static_cast<std::size_t>(m * dp), 0.0f);
        const std::vector<float> g = normal_rows(rng, m, d);
        for (Index i = 0; i < m; ++i)
          for (Index k = 0; k < d; ++k) qs[static_cast<std::size_t>(i * dp + k)] = g[static_cast<std::size_t>(i * d + k)];
        const Index ld = n + 3;
        for (const bool with_idx : {false, true}) {
          const std::int32_t* ix = with_idx ? idx.data() : nullptr;
          std::vector<float> a(static_cast<std::size_t>(m * ld), -1.0f), b = a;
          vd::logits(qs.data(), m, dp, plain, ix, n, d, 0.25f, a.data(), ld, kbuf.data());
          vd::logits(qs.data(), m, dp, held.rows(), ix, n, d, 0.25f, b.data(), ld, kbuf.data());
          ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
              << (with_idx ? "logits with an index" : "logits");
        }
        // The attention output of exp rows e [m, n] with normalisers inv [m].
        std::vector<float> e = normal_rows(rng, m, n), inv(static_cast<std::size_t>(m), 0.5f);
        for (auto& v : e) v = std::abs(v);
        std::vector<float> oa(static_cast<std::size_t>(m * (d + 1)), -3.0f), ob = oa;
        vd::weighted_rows(e.data(), n, inv.data(), m, plain, d, n, oa.data(), d + 1);
        vd::weighted_rows(e.data(), n, inv.data(), m, held.rows(), d, n, ob.data(), d + 1);
        ASSERT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)), 0) << "weighted";
      }
      std::vector<float> pa(static_cast<std::size_t>(vd::packed_size(n, d)), 0.0f), pb = pa;
      std::vector<float> buf(static_cast<std::size_t>(dp));
      vd::pack_keys(plain, 0, n, d, pa.data(), buf.data());
      vd::pack_keys(held.rows(), 0, n, d, pb.data(), buf.data());
      ASSERT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0) << "packed";
      // And the key-as-query row.
      std::vector<float> ra(static_cast<std::size_t>(dp), 1.0f), rb = ra;
      vd::load_stored_row(plain, 5, d, ra.data());
      vd::load_stored_row(held.rows(), 5, d, rb.data());
      ASSERT_EQ(std::memcmp(ra.data(), rb.data(), ra.size() * sizeof(float)), 0) << "query row";
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Through the public API
// ---------------------------------------------------------------------------------------------

vc::Tensor4<double> random_input(std::mt19937& rng, Index B, Index H, Index S, Index D) {
  return veloxquant::test::random_doubles(rng, B, H, S, D);
}

/// Every policy, every width pair (8/8, 4/4, 8/4, 16/4, 4/16), group 8 and 16: a quantized float32
/// cache and a float32 cache fed the dequantized rows hold the same positions and scores and
/// write the same attention output, bitwise, over a prefill longer than the budget and decode
/// steps, with queries (attend) and with the key-as-query proxy (fetch).
TEST(QuantizedCache, EveryPolicyScoresAndAttendsAsOnTheDequantizedRows) {
  const std::pair<int, int> widths[] = {{8, 8}, {4, 4}, {8, 4}, {16, 4}, {4, 16}};
  const Index B = 1, H = 2, G = 2, Dk = 32, Dv = 16;
  for (const auto& [kb, vb] : widths) {
    for (const int group : {8, 16}) {
      for (const Kind kind : kKinds) {
        for (const bool queries : {true, false}) {
          const std::string ctx = std::string(kind_name(kind)) + ", " + std::to_string(kb) + "/" +
                                  std::to_string(vb) + " bits, group " + std::to_string(group) +
                                  (queries ? ", attend" : ", proxy");
          SCOPED_TRACE(ctx);
          vc::KVCacheConfig c = veloxquant::test::small_config();
          c.key_bits = kb;
          c.value_bits = vb;
          c.quant_group = group;
          vc::KVCacheConfig plain = c;
          plain.key_bits = plain.value_bits = 16;
          auto q = veloxquant::test::make_subject<float>(kind, c);
          auto p = veloxquant::test::make_subject<float>(kind, plain);
          std::mt19937 rng(7u + kind_index(kind));
          for (const Index S : {Index{11}, Index{1}, Index{1}, Index{3}, Index{1}, Index{1}}) {
            const vc::Tensor4<double> k = random_input(rng, B, H, S, Dk);
            const vc::Tensor4<double> v = random_input(rng, B, H, S, Dv);
            const vc::KVPair<float> kv = veloxquant::test::stored_call<float>(k, v, c);
            // Not vacuous: the quantized rows are not the inputs.
            const vc::Tensor4<float> kf0 = k.cast<float>(), vf0 = v.cast<float>();
            if (kb < 16) {
              ASSERT_FALSE(veloxquant::test::bitwise_equal(kv.first, kf0));
            }
            if (vb < 16) {
              ASSERT_FALSE(veloxquant::test::bitwise_equal(kv.second, vf0));
            }
            if (queries) {
              const vc::Tensor4<float> qs =
                  veloxquant::test::random_queries(rng, B, G * H, S, Dk);
              const vc::Tensor4<float> kf = k.cast<float>(), vf = v.cast<float>();
              const vc::Tensor4<float> a = q.cache->attend(qs, kf, vf);
              const vc::Tensor4<float> b = p.cache->attend(qs, kv.first, kv.second);
              ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0);
            } else {
              const vc::KVPair<float> a = q.cache->update_and_fetch(k, v);
              const vc::KVPair<float> b = p.cache->update_and_fetch(kv.first, kv.second);
              ASSERT_TRUE(veloxquant::test::bitwise_equal(a.first, b.first));
              ASSERT_TRUE(veloxquant::test::bitwise_equal(a.second, b.second));
            }
            for (Index h = 0; h < H; ++h) {
              ASSERT_EQ(q.cache->positions(0, h), p.cache->positions(0, h));
              const std::vector<float> sq = q.cache->scores(0, h), sp = p.cache->scores(0, h);
              ASSERT_EQ(sq.size(), sp.size());
              ASSERT_EQ(std::memcmp(sq.data(), sp.data(), sizeof(float) * sq.size()), 0);
            }
            ASSERT_EQ(q.cache->layer_budget(), p.cache->layer_budget());
          }
          ASSERT_TRUE(veloxquant::test::bitwise_equal(q.cache->state().first,
                                                      p.cache->state().first));
        }
      }
    }
  }
}

/// Once quantized, the storage type does not change what is scored or attended: half, bfloat16
/// and float32 caches at the same widths, fed inputs that every type holds exactly (halves whose
/// last bits are clear, so bfloat16 holds them too), keep the same positions and scores and write
/// the same output, bitwise; the half and bfloat16 caches return the float32 one's rows rounded.
TEST(QuantizedCache, TheStorageTypeOnlyRoundsWhatIsReturned) {
  vc::KVCacheConfig c = veloxquant::test::small_config();
  c.key_bits = 8;
  c.value_bits = 4;
  c.quant_group = 16;
  for (const Method kind : {Method::squeeze, Method::tova, Method::snapkv}) {
    SCOPED_TRACE(kind_name(kind));
    auto h = veloxquant::test::make_subject<Eigen::half>(kind, c);
    auto bf = veloxquant::test::make_subject<Eigen::bfloat16>(kind, c);
    auto f = veloxquant::test::make_subject<float>(kind, c);
    std::mt19937 rng(3);
    // Values with 8 significant bits (exact in half, bfloat16 and float).
    const auto exact = [&](Index S, Index D) {
      vc::Tensor4<float> t = random_input(rng, 1, 2, S, D).cast<float>();
      for (Index i = 0; i < t.size(); ++i) t.data()[i] = std::ldexp(std::round(std::ldexp(t.data()[i], 6)), -6);
      return t;
    };
    for (const Index S : {Index{9}, Index{1}, Index{2}, Index{1}}) {
      const vc::Tensor4<float> k = exact(S, 32), v = exact(S, 16);
      const vc::Tensor4<float> qs = veloxquant::test::random_queries(rng, 1, 4, S, 32);
      const vc::Tensor4<float> a = h.cache->attend(qs, k, v);
      const vc::Tensor4<float> ab = bf.cache->attend(qs, k, v);
      const vc::Tensor4<float> b = f.cache->attend(qs, k, v);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0);
      ASSERT_EQ(std::memcmp(ab.data(), b.data(), sizeof(float) * a.size()), 0);
      for (Index hd = 0; hd < 2; ++hd) {
        ASSERT_EQ(h.cache->positions(0, hd), f.cache->positions(0, hd));
        ASSERT_EQ(h.cache->scores(0, hd), f.cache->scores(0, hd));
        ASSERT_EQ(bf.cache->positions(0, hd), f.cache->positions(0, hd));
        ASSERT_EQ(bf.cache->scores(0, hd), f.cache->scores(0, hd));
      }
    }
    const vc::KVPair<float> sf = f.cache->state();
    const vc::Tensor4<Eigen::half> rounded = sf.first.cast<Eigen::half>();
    EXPECT_TRUE(veloxquant::test::bitwise_equal(h.cache->state().first, rounded));
    const vc::Tensor4<Eigen::bfloat16> rounded_bf = sf.second.cast<Eigen::bfloat16>();
    EXPECT_TRUE(veloxquant::test::bitwise_equal(bf.cache->state().second, rounded_bf));
  }
}

/// kept_bytes() counts codes, scales and offsets (rounded up to whole elements of T);
/// full_seq_bytes() stays the unquantized size; compression_ratio() compares the two.
TEST(QuantizedCache, KeptBytesCountWhatIsHeld) {
  struct Case {
    int kb, vb, group;
    Index dk, dv;
    std::size_t row_bytes_half;  // key + value bytes of one retained row, T = half
  };
  // 8 bits, D 64, group 32: 64 codes + 2 x 4 = 72 bytes; 4 bits: 32 + 8 = 40.
  const Case cases[] = {{8, 8, 32, 64, 64, 144}, {4, 4, 32, 64, 64, 80}, {8, 4, 32, 64, 64, 112},
                        {16, 4, 32, 64, 64, 168}, {4, 8, 8, 8, 8, 8 + 12},
                        // 4 bits, D 27, group 9: 3 x 5 code bytes + 3 x 4 = 27 -> 28 (whole halves)
                        {4, 16, 9, 27, 27, 28 + 54}};
  for (const Case& cs : cases) {
    vc::KVCacheConfig c;
    c.method = "standard";
    c.key_bits = cs.kb;
    c.value_bits = cs.vb;
    c.quant_group = cs.group;
    vc::KVCache<Eigen::half> cache(c);
    std::mt19937 rng(4);
    (void)cache.update_and_view(random_input(rng, 2, 3, 5, cs.dk), random_input(rng, 2, 3, 5, cs.dv));
    EXPECT_EQ(cache.kept_bytes(), 2u * 3u * 5u * cs.row_bytes_half) << cs.kb << "/" << cs.vb;
    const std::size_t full = 2u * 3u * 5u * static_cast<std::size_t>(cs.dk + cs.dv) * 2u;
    EXPECT_EQ(cache.full_seq_bytes(), full);
    EXPECT_DOUBLE_EQ(cache.compression_ratio(),
                     static_cast<double>(full) / static_cast<double>(cache.kept_bytes()));
  }
}

/// Widths other than 16, 8, 4, 2 and groups below 8 are rejected at construction (validate, every
/// cache, the factory, the builder); the builder also rejects a group that does not divide a
/// layer's head dim; a cache that learns D from its first call rejects that call and is left
/// unchanged.
TEST(QuantizedCache, BadWidthsAndGroupsAreRejectedAtConstruction) {
  for (const int bits : {0, 1, 3, 5, 6, 7, 9, 12, 15, 17, 32, -8}) {
    for (const bool keys : {true, false}) {
      vc::KVCacheConfig c;
      (keys ? c.key_bits : c.value_bits) = bits;
      const std::string field = keys ? "key_bits" : "value_bits";
      const std::string m = veloxquant::test::invalid_argument_message([&] { c.validate(); });
      EXPECT_NE(m.find(field), std::string::npos) << m;
      EXPECT_NE(m.find(std::to_string(bits)), std::string::npos) << m;
      EXPECT_THROW((void)vc::KVCacheFactory::create<float>(c), std::invalid_argument);
      EXPECT_THROW((void)vc::SqueezeAttentionCache<float>(c), std::invalid_argument);
      EXPECT_THROW((void)vc::KVCacheBuilder::for_model<float>(3, c), std::invalid_argument);
    }
  }
  for (const int group : {7, 4, 1, 0, -32}) {
    vc::KVCacheConfig c;
    c.quant_group = group;
    const std::string m = veloxquant::test::invalid_argument_message([&] { c.validate(); });
    EXPECT_NE(m.find("quant_group"), std::string::npos) << m;
    for (const Method method : veloxquant::test::kMethods) {
      c.method = veloxquant::test::method_name(method);
      EXPECT_THROW((void)vc::KVCacheFactory::create<Eigen::half>(c), std::invalid_argument)
          << c.method;
    }
  }
  vc::KVCacheConfig c;
  c.key_bits = 8;
  c.quant_group = 32;
  const std::string m = veloxquant::test::invalid_argument_message(
      [&] { (void)vc::KVCacheBuilder::for_model<float>({64, std::nullopt, 48}, c); });
  EXPECT_NE(m.find("quant_group (32)"), std::string::npos) << m;
  EXPECT_NE(m.find("layer 2 (48)"), std::string::npos) << m;
  EXPECT_NO_THROW((void)vc::KVCacheBuilder::for_model<float>({64, std::nullopt, 96}, c));
  c.key_bits = 16;  // unquantized: the group is not used
  EXPECT_NO_THROW((void)vc::KVCacheBuilder::for_model<float>({64, 48}, c));
  // Learnt at the first call: rejected, nothing changes, a good call then goes through.
  c.value_bits = 4;
  vc::SqueezeAttentionCache<float> cache(c);
  std::mt19937 rng(5);
  const std::string first = veloxquant::test::invalid_argument_message([&] {
    (void)cache.update_and_fetch(random_input(rng, 1, 2, 3, 64), random_input(rng, 1, 2, 3, 40));
  });
  EXPECT_NE(first.find("quant_group (32) must divide the values' head dim D (40)"),
            std::string::npos)
      << first;
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.key_dim(), 0);
  EXPECT_NO_THROW((void)cache.update_and_fetch(random_input(rng, 1, 2, 3, 40),
                                               random_input(rng, 1, 2, 3, 64)));
  EXPECT_EQ(cache.offset(), 3);
}

/// A group's offset and scale are halves: quantized rows reject elements that are not finite or
/// beyond +-65504 once converted to T, keys and values alike (unquantized values are not
/// inspected, docs/design.md 8), naming the element; nothing changes; the largest accepted
/// element round-trips within half a step.
TEST(QuantizedCache, QuantizedRowsRejectWhatAGroupCannotHold) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const bool keys : {true, false}) {
    vc::KVCacheConfig c;
    c.set_budget(8);
    c.squeeze_n_sink = 1;
    (keys ? c.key_bits : c.value_bits) = 8;
    c.quant_group = 8;
    vc::SqueezeAttentionCache<float> cache(c), twin(c);
    std::mt19937 rng(6);
    const vc::Tensor4<double> k0 = random_input(rng, 1, 2, 10, 16), v0 = random_input(rng, 1, 2, 10, 16);
    (void)cache.update_and_fetch(k0, v0);
    (void)twin.update_and_fetch(k0, v0);
    for (const double bad : {nan, inf, -inf, 65520.0, -1e6, 3e38}) {
      vc::Tensor4<double> k = random_input(rng, 1, 2, 2, 16), v = random_input(rng, 1, 2, 2, 16);
      (keys ? k : v)(0, 1, 1, 5) = bad;
      const std::string m = veloxquant::test::invalid_argument_message([&] {
        (void)cache.update_and_view(k, v);
      });
      SCOPED_TRACE(std::string(keys ? "key " : "value ") + std::to_string(bad) + ": " + m);
      EXPECT_EQ(veloxquant::test::named_index(m), (veloxquant::test::Shape{0, 1, 1, 5}));
      if (!keys || std::isfinite(static_cast<float>(bad))) {
        EXPECT_NE(m.find("65504"), std::string::npos);
      }
      EXPECT_EQ(cache.offset(), 10);
      EXPECT_TRUE(cache.positions(0, 1) == twin.positions(0, 1));
      EXPECT_TRUE(cache.scores(0, 1) == twin.scores(0, 1));
    }
    vc::Tensor4<double> k = random_input(rng, 1, 2, 1, 16), v = random_input(rng, 1, 2, 1, 16);
    (keys ? k : v)(0, 0, 0, 3) = 65504.0;
    (keys ? k : v)(0, 0, 0, 2) = -65504.0;
    const vc::KVPair<float> a = cache.update_and_fetch(k, v);
    const vc::KVPair<float> b = twin.update_and_fetch(k, v);
    EXPECT_TRUE(veloxquant::test::bitwise_equal(a.first, b.first));
    const float got = (keys ? a.first : a.second)(0, 0, a.first.dimension(2) - 1, 3);
    EXPECT_NEAR(got, 65504.0f, 0.5f * 131008.0f / 255.0f + 1.0f);
  }
}

/// A decoded element may lie half a step beyond its group's extremes; a half cache returns it
/// clamped to +-65504, never infinite, and still within half a step (8 and 4 bits, fetch, state,
/// view).
TEST(QuantizedCache, HalfRowsAtTheEdgeOfTheRangeStayFinite) {
  for (const int bits : {8, 4}) {
    vc::KVCacheConfig c;
    c.method = "standard";
    c.key_bits = c.value_bits = bits;
    c.quant_group = 8;
    vc::KVCache<Eigen::half> cache(c);
    vc::Tensor4<Eigen::half> k(1, 1, 2, 8), v(1, 1, 2, 8);
    for (Index d = 0; d < 8; ++d) {
      // Row 0 from 0 to 65504; row 1 from -65504 to 0: the step is 257 (8 bits) or 4367 (4).
      k(0, 0, 0, d) = v(0, 0, 0, d) = Eigen::half(d == 7 ? 65504.0f : 1000.0f * static_cast<float>(d));
      k(0, 0, 1, d) = v(0, 0, 1, d) = Eigen::half(d == 0 ? -65504.0f : -1000.0f * static_cast<float>(d));
    }
    const vc::KVPair<Eigen::half> a = cache.update_and_fetch(k, v);
    const vc::KVView<Eigen::half> w = cache.update_and_view(vc::Tensor4<Eigen::half>(1, 1, 0, 8),
                                                            vc::Tensor4<Eigen::half>(1, 1, 0, 8));
    const double half_step = 0.5 * 65504.0 / ((1 << bits) - 1) * (1.0 + 1e-3);
    for (Index r = 0; r < 2; ++r) {
      for (Index d = 0; d < 8; ++d) {
        SCOPED_TRACE(std::to_string(bits) + " bits, row " + std::to_string(r) + ", element " +
                     std::to_string(d));
        const float x = static_cast<float>(k(0, 0, r, d));
        for (const float y : {static_cast<float>(a.first(0, 0, r, d)),
                              static_cast<float>(a.second(0, 0, r, d)),
                              static_cast<float>(w.keys(0, 0)(r, d))}) {
          ASSERT_TRUE(std::isfinite(y));
          EXPECT_LE(std::abs(y - x), half_step);
        }
      }
    }
  }
}

/// The view of a quantized cache (docs/design.md 2.3) shows the dequantized rows: by position,
/// the same rows a fetch returns, the call's rows last in arrival order; an empty call views the
/// retained set.
TEST(QuantizedCache, TheViewShowsTheDequantizedWindow) {
  vc::KVCacheConfig c = veloxquant::test::small_config();
  c.key_bits = 4;
  c.value_bits = 8;
  c.quant_group = 8;
  for (const Kind kind : kKinds) {
    SCOPED_TRACE(kind_name(kind));
    auto viewed = veloxquant::test::make_subject<Eigen::half>(kind, c);
    auto fetched = veloxquant::test::make_subject<Eigen::half>(kind, c);
    std::mt19937 rng(8);
    for (const Index S : {Index{9}, Index{1}, Index{0}, Index{2}}) {
      const vc::Tensor4<double> k = random_input(rng, 2, 2, S, 16), v = random_input(rng, 2, 2, S, 24);
      const vc::KVPair<Eigen::half> f = fetched.cache->update_and_fetch(k, v);
      const vc::KVView<Eigen::half> w = viewed.cache->update_and_view(k, v);
      ASSERT_EQ(w.rows(), f.first.dimension(2));
      ASSERT_EQ(w.new_rows(), S);
      for (Index b = 0; b < 2; ++b) {
        for (Index h = 0; h < 2; ++h) {
          // The fetch is [retained before, ascending ; the call's rows]: rows matched by position.
          for (Index r = 0; r < w.rows(); ++r) {
            const std::int64_t p = w.positions(b, h)(r);
            Index fr = -1;
            if (r >= w.rows() - S) {
              fr = f.first.dimension(2) - S + (r - (w.rows() - S));
            } else {
              // Rows before the call: f's first w.rows() - S rows in ascending position.
              std::vector<std::int64_t> asc;
              for (Index j = 0; j < w.rows() - S; ++j) asc.push_back(w.positions(b, h)(j));
              std::sort(asc.begin(), asc.end());
              fr = std::lower_bound(asc.begin(), asc.end(), p) - asc.begin();
            }
            for (Index d = 0; d < 16; ++d) {
              ASSERT_EQ(static_cast<float>(w.keys(b, h)(r, d)), static_cast<float>(f.first(b, h, fr, d)));
            }
            for (Index d = 0; d < 24; ++d) {
              ASSERT_EQ(static_cast<float>(w.values(b, h)(r, d)),
                        static_cast<float>(f.second(b, h, fr, d)));
            }
          }
        }
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Channel-axis rows (docs/design.md 7.5)
// ---------------------------------------------------------------------------------------------

/// Channel-axis rows as a head holds them, built here from the format's pieces: positions
/// [0, 40) but five evicted before their block sealed, in blocks of 8 (quantize_block over the
/// block's remaining rows), the rows from position 32 on pending at T (float), every row in a
/// scrambled slot.
struct ChannelHeld {
  vd::RowFormat f;
  Index stride = 0;                   // floats per slot
  std::vector<float> x;               // [slots, d]: the original rows, by slot
  std::vector<std::int64_t> pos;      // [slots]
  std::vector<float> codes;           // [slots, stride]: each slot's codes (bytes)
  std::vector<std::int64_t> starts;   // first position of each sealed block
  std::vector<std::uint16_t> tables;  // [blocks, 2 d]
  std::vector<float> pending;         // [8, d], by lane
  std::int64_t pending_start = 32;

  Index slots() const { return static_cast<Index>(pos.size()); }
  vd::StoredRows<float> rows() const {
    vd::StoredRows<float> r{codes.data(), stride, f};
    r.pos = pos.data();
    r.starts = starts.data();
    r.blocks = static_cast<Index>(starts.size());
    r.tables = tables.data();
    r.pending_start = pending_start;
    r.pending = pending.data();
    r.pending_lanes = 8;
    return r;
  }
  const std::uint8_t* code_row(Index s) const {
    return reinterpret_cast<const std::uint8_t*>(codes.data() + s * stride);
  }
  /// Slot s's block (-1: pending).
  Index block_of(Index s) const {
    const std::int64_t p = pos[static_cast<std::size_t>(s)];
    return p >= pending_start ? -1 : static_cast<Index>(p / 8);
  }
};

ChannelHeld channel_held(std::mt19937& rng, int bits, Index d, float sigma) {
  ChannelHeld h;
  h.f = vd::RowFormat{bits, d, 0, true, 8};
  h.stride = (h.f.code_bytes() + 3) / 4;
  const std::vector<std::int64_t> evicted = {3, 9, 10, 17, 30};
  std::vector<std::int64_t> order;
  for (std::int64_t p = 0; p < 37; ++p) {
    if (std::find(evicted.begin(), evicted.end(), p) == evicted.end()) order.push_back(p);
  }
  std::shuffle(order.begin(), order.end(), rng);
  const Index n = static_cast<Index>(order.size());
  h.pos = order;
  // Channel 1 carries an outlier scale, as keys do.
  h.x = normal_rows(rng, n, d, sigma);
  for (Index s = 0; s < n; ++s) h.x[static_cast<std::size_t>(s * d + 1 % d)] *= 40.0f;
  h.codes.assign(static_cast<std::size_t>(n * h.stride), 0.0f);
  h.pending.assign(static_cast<std::size_t>(8 * d), 0.0f);
  for (Index b = 0; b < 4; ++b) {
    std::vector<const float*> rows;
    std::vector<std::uint8_t*> out;
    for (Index s = 0; s < n; ++s) {
      if (h.block_of(s) != b) continue;
      rows.push_back(h.x.data() + s * d);
      out.push_back(reinterpret_cast<std::uint8_t*>(h.codes.data() + s * h.stride));
    }
    h.starts.push_back(8 * b);
    h.tables.resize(h.tables.size() + static_cast<std::size_t>(2 * d));
    vd::quantize_block(rows.data(), static_cast<Index>(rows.size()), h.f, out.data(),
                       h.tables.data() + h.tables.size() - static_cast<std::size_t>(2 * d));
  }
  for (Index s = 0; s < n; ++s) {
    if (h.block_of(s) >= 0) continue;
    std::copy_n(h.x.begin() + s * d, d, h.pending.begin() + (h.pos[static_cast<std::size_t>(s)] - 32) * d);
  }
  return h;
}

/// Every element of a sealed block's row, read back through the kernels on every path, is within
/// half a step (its channel's stored scale / 2) of the original; a pending row reads back exactly;
/// on the paths with a fused multiply-add (all but SSE2) the element is exactly fma(code, scale,
/// offset) of the stored code, scale and offset, so NEON and AVX2 give the scalar path's bits.
/// 8, 4 and 2 bits; D 64 (whole vectors), 27 and 8 (lane by lane).
TEST(ChannelRowFormat, RoundTripIsWithinHalfAStepOfTheChannel) {
  std::mt19937 rng(11);
  for (const int bits : {8, 4, 2}) {
    for (const Index d : {Index{64}, Index{27}, Index{8}}) {
      for (const float sigma : {1.0f, 1e-3f, 300.0f}) {
        SCOPED_TRACE(std::to_string(bits) + " bits, D " + std::to_string(d) + ", sigma " +
                     std::to_string(sigma));
        const ChannelHeld h = channel_held(rng, bits, d, sigma);
        const vd::StoredRows<float> r = h.rows();
        std::vector<float> y(static_cast<std::size_t>(vd::padded_dim(d)));
        for_each_level([&](vc::SimdLevel level) {
          for (Index s = 0; s < h.slots(); ++s) {
            vd::load_stored_row(r, s, d, y.data());
            const Index b = h.block_of(s);
            for (Index c = 0; c < d; ++c) {
              const float x = h.x[static_cast<std::size_t>(s * d + c)];
              const float got = y[static_cast<std::size_t>(c)];
              if (b < 0) {
                ASSERT_EQ(got, x) << "pending slot " << s;
                continue;
              }
              const std::uint16_t* t = h.tables.data() + b * 2 * d;
              const float scale = vd::half_bits_to_float(t[c]);
              const float offset = vd::half_bits_to_float(t[d + c]);
              const int code = vd::span_code(h.code_row(s), c, d, bits);
              ASSERT_LE(code, (1 << bits) - 1);
              const double ulp = std::abs(static_cast<double>(x)) * 0x1p-22;
              ASSERT_LE(std::abs(static_cast<double>(got) - x), 0.5 * scale + ulp)
                  << "slot " << s << ", channel " << c << ": " << x << " -> " << got;
              if (level != vc::SimdLevel::sse2) {
                ASSERT_EQ(got, std::fma(static_cast<float>(code), scale, offset));
              }
            }
            for (Index c = d; c < vd::padded_dim(d); ++c) ASSERT_EQ(y[static_cast<std::size_t>(c)], 0.0f);
          }
        });
      }
    }
  }
}

/// Over channel-axis rows the logits (m = 1, 2, 4, 5; with and without an index) and the
/// attention output fold each block's scales into the query rows (docs/design.md 7.5): they equal
/// the float32 kernels over the rows as read back (dequantized) up to rounding, and the paths with
/// a fused multiply-add and the scalar path's reduction tree (AVX2, NEON) give the scalar path's
/// bits. The packed prefill keys are the dequantized rows exactly. Finding the rows' blocks by the
/// head's order (one walk) gives the bits a search per row gives.
TEST(ChannelKernels, FoldedKernelsMatchTheDequantizedRowsAndTheScalarPath) {
  std::mt19937 rng(12);
  for (const int bits : {8, 4, 2}) {
    for (const Index d : {Index{64}, Index{27}, Index{8}}) {
      SCOPED_TRACE(std::to_string(bits) + " bits, D " + std::to_string(d));
      const ChannelHeld h = channel_held(rng, bits, d, 1.0f);
      const vd::StoredRows<float> held = h.rows();
      const Index n = h.slots(), dp = vd::padded_dim(d);
      // The same rows with the head's order given, as a head gives it: the folded kernels then
      // find each slot's block by one walk over the slots in ascending position, not by a search
      // per row. One slot is left out of the order, as a dead one would be (it searches).
      std::vector<std::int32_t> order(static_cast<std::size_t>(n));
      for (Index s = 0; s < n; ++s) order[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
      std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
        return h.pos[static_cast<std::size_t>(a)] < h.pos[static_cast<std::size_t>(b)];
      });
      order.erase(order.begin() + 5);
      vd::StoredRows<float> walked = held;
      walked.order = order.data();
      walked.live = n - 1;
      walked.slots = n;
      std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
      for (Index j = 0; j < n; ++j) idx[static_cast<std::size_t>(j)] = static_cast<std::int32_t>((j * 7) % n);
      std::vector<float> qs(static_cast<std::size_t>(5 * dp), 0.0f);
      const std::vector<float> g = normal_rows(rng, 5, d);
      for (Index i = 0; i < 5; ++i)
        for (Index k = 0; k < d; ++k) qs[static_cast<std::size_t>(i * dp + k)] = g[static_cast<std::size_t>(i * d + k)];
      std::vector<float> e = normal_rows(rng, 5, n), inv(5, 0.5f);
      for (auto& v : e) v = std::abs(v);
      const Index ld = n + 3;
      // What each level gives, by m and index use: logits, then the output rows.
      std::vector<std::vector<float>> scalar_results;
      for_each_level([&](vc::SimdLevel level) {
        std::vector<float> deq(static_cast<std::size_t>(n * d)), row(static_cast<std::size_t>(dp));
        double biggest = 0;
        for (Index s = 0; s < n; ++s) {
          vd::load_stored_row(held, s, d, row.data());
          std::copy_n(row.begin(), d, deq.begin() + s * d);
          for (Index k = 0; k < d; ++k) biggest = std::max(biggest, std::abs(static_cast<double>(row[static_cast<std::size_t>(k)])));
        }
        const vd::StoredRows<float> plain{deq.data(), d, vd::RowFormat{16, d, 0}};
        std::vector<float> kbuf(static_cast<std::size_t>(4 * dp));
        std::vector<std::vector<float>> results;
        for (const Index m : {1, 2, 4, 5}) {
          SCOPED_TRACE("m = " + std::to_string(m));
          for (const bool with_idx : {false, true}) {
            const std::int32_t* ix = with_idx ? idx.data() : nullptr;
            std::vector<float> a(static_cast<std::size_t>(m * ld), -1.0f), b = a;
            vd::logits(qs.data(), m, dp, plain, ix, n, d, 0.25f, a.data(), ld, kbuf.data());
            vd::logits(qs.data(), m, dp, held, ix, n, d, 0.25f, b.data(), ld, kbuf.data());
            std::vector<float> w = a;
            vd::logits(qs.data(), m, dp, walked, ix, n, d, 0.25f, w.data(), ld, kbuf.data());
            ASSERT_EQ(std::memcmp(w.data(), b.data(), b.size() * sizeof(float)), 0) << "walked";
            for (std::size_t i = 0; i < a.size(); ++i) {
              // Each logit sums d products of |q| <= 5 and |k| <= biggest: rounding of a few
              // float32 ulps of that sum's magnitude.
              ASSERT_NEAR(a[i], b[i], 0.25 * static_cast<double>(d) * 5.0 * biggest * 0x1p-20) << "logit " << i;
            }
            results.push_back(b);
          }
          std::vector<float> oa(static_cast<std::size_t>(m * (d + 1)), -3.0f), ob = oa;
          vd::weighted_rows(e.data(), n, inv.data(), m, plain, d, n, oa.data(), d + 1);
          vd::weighted_rows(e.data(), n, inv.data(), m, held, d, n, ob.data(), d + 1);
          std::vector<float> ow = oa;
          vd::weighted_rows(e.data(), n, inv.data(), m, walked, d, n, ow.data(), d + 1);
          ASSERT_EQ(std::memcmp(ow.data(), ob.data(), ob.size() * sizeof(float)), 0) << "walked";
          double esum = 0;
          for (Index j = 0; j < n; ++j) esum += e[static_cast<std::size_t>(j)];
          for (std::size_t i = 0; i < oa.size(); ++i) {
            ASSERT_NEAR(oa[i], ob[i], 4 * 0.5 * esum * biggest * 0x1p-20) << "output " << i;
          }
          results.push_back(ob);
        }
        if (level == vc::SimdLevel::scalar) scalar_results = results;
        if (level == vc::SimdLevel::avx2 || level == vc::SimdLevel::neon) {
          ASSERT_EQ(results.size(), scalar_results.size());
          for (std::size_t r = 0; r < results.size(); ++r) {
            ASSERT_EQ(std::memcmp(results[r].data(), scalar_results[r].data(),
                                  results[r].size() * sizeof(float)), 0)
                << "result " << r << " differs from the scalar path's";
          }
        }
        std::vector<float> pa(static_cast<std::size_t>(vd::packed_size(n, d)), 0.0f), pb = pa;
        std::vector<float> buf(static_cast<std::size_t>(dp));
        vd::pack_keys(plain, 0, n, d, pa.data(), buf.data());
        vd::pack_keys(held, 0, n, d, pb.data(), buf.data());
        ASSERT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0) << "packed";
      });
    }
  }
}

/// The input rows of every call, by position, of head h (float: stored exactly until quantized).
struct ChannelInputs {
  Index d;
  std::vector<std::vector<float>> rows;  // [heads][positions * d]
  void add(const vc::Tensor4<double>& t) {
    rows.resize(static_cast<std::size_t>(t.dimension(1)));
    for (Index h = 0; h < t.dimension(1); ++h)
      for (Index s = 0; s < t.dimension(2); ++s)
        for (Index k = 0; k < d; ++k) rows[static_cast<std::size_t>(h)].push_back(static_cast<float>(t(0, h, s, k)));
  }
  float at(Index h, std::int64_t p, Index k) const {
    return rows[static_cast<std::size_t>(h)][static_cast<std::size_t>(p * d + k)];
  }
};

/// Every retained row of head h of `cache` (rows of T = float) is its input exactly while its
/// block is pending, and within half a step of its block's grid once sealed: the step bound taken
/// over the block's whole position range of inputs (the rows the block was quantized from are a
/// subset of it), with room for the half rounding of scale and offset.
void expect_rows_within_their_blocks(const vc::KVCache<float>& cache, const vc::Tensor4<float>& got,
                                     const ChannelInputs& in, int bits, Index block, Index h) {
  const std::vector<std::int64_t> pos = cache.positions(0, h);
  const std::int64_t pending = cache.offset() / block * block;
  const double levels = (1 << bits) - 1;
  for (std::size_t i = 0; i < pos.size(); ++i) {
    for (Index k = 0; k < in.d; ++k) {
      const float x = in.at(h, pos[i], k);
      const float y = got(0, h, static_cast<Index>(i), k);
      if (pos[i] >= pending) {
        ASSERT_EQ(y, x) << "pending position " << pos[i];
        continue;
      }
      const std::int64_t b0 = pos[i] / block * block;
      float lo = x, hi = x;
      for (std::int64_t p = b0; p < b0 + block; ++p) {
        lo = std::min(lo, in.at(h, p, k));
        hi = std::max(hi, in.at(h, p, k));
      }
      const double bound = 0.5 * ((hi - lo) + std::abs(lo) * 0x1p-9 + 1e-6) / levels * (1 + 0x1p-9) +
                           std::abs(x) * 0x1p-20;
      ASSERT_LE(std::abs(static_cast<double>(y) - x), bound)
          << "position " << pos[i] << ", element " << k << ": " << x << " -> " << y;
    }
  }
}

/// Every policy over channel-axis keys and values (4/4, 8/2, 2/16, 16/4 bits), blocks of 8, with
/// queries (attend) and with the key-as-query proxy (fetch), over a prefill and decode steps that
/// cross block boundaries and evict rows from sealed and pending blocks: every retained row
/// stays within half a step of its block's grid, a pending one exact; and kept_bytes() is the
/// live rows' codes, the sealed blocks' tables and the pending block.
TEST(ChannelCache, EveryPolicyKeepsEachRowWithinHalfAStepOfItsBlock) {
  const std::pair<int, int> widths[] = {{4, 4}, {8, 2}, {2, 16}, {16, 4}};
  const Index B = 1, H = 2, G = 2, Dk = 9, Dv = 16, block = 8;
  for (const auto& [kb, vb] : widths) {
    for (const Kind kind : kKinds) {
      for (const bool queries : {true, false}) {
        SCOPED_TRACE(std::string(kind_name(kind)) + ", " + std::to_string(kb) + "/" +
                     std::to_string(vb) + (queries ? ", attend" : ", proxy"));
        vc::KVCacheConfig c = veloxquant::test::small_config();
        c.key_bits = kb;
        c.value_bits = vb;
        c.key_axis = c.value_axis = "channel";
        c.quant_block = static_cast<int>(block);
        auto q = veloxquant::test::make_subject<float>(kind, c);
        std::mt19937 rng(31u + kind_index(kind));
        ChannelInputs ki{Dk, {}}, vi{Dv, {}};
        for (const Index S : {Index{11}, Index{1}, Index{1}, Index{3}, Index{7}, Index{1},
                              Index{1}, Index{1}, Index{9}, Index{1}}) {
          vc::Tensor4<double> k = random_input(rng, B, H, S, Dk);
          for (Index h = 0; h < H; ++h)
            for (Index s = 0; s < S; ++s) k(0, h, s, 2) *= 30.0;  // an outlier channel
          const vc::Tensor4<double> v = random_input(rng, B, H, S, Dv);
          ki.add(k);
          vi.add(v);
          const vc::Tensor4<float> kf = k.cast<float>(), vf = v.cast<float>();
          if (queries) {
            (void)q.cache->attend(veloxquant::test::random_queries(rng, B, G * H, S, Dk), kf, vf);
          } else {
            (void)q.cache->update_and_fetch(kf, vf);
          }
          const vc::KVPair<float> st = q.cache->state();
          for (Index h = 0; h < H; ++h) {
            if (kb < 16) expect_rows_within_their_blocks(*q.cache, st.first, ki, kb, block, h);
            if (vb < 16) expect_rows_within_their_blocks(*q.cache, st.second, vi, vb, block, h);
          }
        }
        // One empty call compacts: the blocks without a live row are gone.
        (void)q.cache->update_and_fetch(vc::Tensor4<float>(B, H, 0, Dk), vc::Tensor4<float>(B, H, 0, Dv));
        std::size_t expected = 0;
        const std::int64_t pending = q.cache->offset() / block * block;
        const auto row = [](int bits, Index d) -> std::size_t {
          if (bits == 16) return static_cast<std::size_t>(d) * 4;
          return static_cast<std::size_t>((vd::RowFormat::span_bytes(d, bits) + 3) / 4 * 4);
        };
        for (Index h = 0; h < H; ++h) {
          const std::vector<std::int64_t> pos = q.cache->positions(0, h);
          std::vector<std::int64_t> blocks;
          for (const std::int64_t p : pos) {
            if (p < pending) blocks.push_back(p / block);
          }
          blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
          expected += pos.size() * (row(kb, Dk) + row(vb, Dv));
          for (const auto& [bits, d] : {std::pair<int, Index>{kb, Dk}, {vb, Dv}}) {
            if (bits < 16) expected += blocks.size() * 4 * d + block * d * 4;
          }
        }
        EXPECT_EQ(q.cache->kept_bytes(), expected);
      }
    }
  }
}

/// Adaptive head budgets (SPEC 14) over channel-axis rows (4/4 bits, blocks of 8): the heads come
/// to hold different numbers of rows, attend serves them with the output a twin cache gives, and
/// after an empty call kept_bytes() is each head's codes and the tables of the blocks its rows
/// lie in, plus the pending blocks.
TEST(ChannelCache, AdaptiveHeadsKeepTheirOwnBlocks) {
  const Index H = 4, G = 2, D = 16, block = 8;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.set_budget(10);
  c.h2o_n_sink = 1;
  c.h2o_grace = 1;
  c.head_budgets = "adaptive";
  c.head_budget_floor = 0.25;
  c.key_bits = c.value_bits = 4;
  c.key_axis = c.value_axis = "channel";
  c.quant_block = static_cast<int>(block);
  auto a = vc::KVCacheFactory::create<float>(c), b = vc::KVCacheFactory::create<float>(c);
  std::mt19937 rng(61);
  std::set<Index> spreads;
  for (const Index S : {Index{13}, Index{1}, Index{1}, Index{1}, Index{6}, Index{1}, Index{1},
                        Index{1}, Index{1}, Index{1}, Index{1}, Index{1}}) {
    const vc::Tensor4<float> q = veloxquant::test::random_queries(rng, 1, G * H, S, D);
    const vc::Tensor4<double> k = random_input(rng, 1, H, S, D), v = random_input(rng, 1, H, S, D);
    const vc::Tensor4<float> kf = k.cast<float>(), vf = v.cast<float>();
    const vc::Tensor4<float> oa = a->attend(q, kf, vf), ob = b->attend(q, kf, vf);
    ASSERT_EQ(std::memcmp(oa.data(), ob.data(), sizeof(float) * oa.size()), 0);
    Index lo = a->offset(), hi = 0;
    for (Index h = 0; h < H; ++h) {
      const auto n = static_cast<Index>(a->positions(0, h).size());
      lo = std::min(lo, n);
      hi = std::max(hi, n);
    }
    spreads.insert(hi - lo);
  }
  EXPECT_GT(*spreads.rbegin(), 0) << "the heads never came to differ";
  (void)a->attend(vc::Tensor4<float>(1, G * H, 0, D), vc::Tensor4<float>(1, H, 0, D),
                  vc::Tensor4<float>(1, H, 0, D));
  const std::int64_t pending = a->offset() / block * block;
  std::size_t expected = 0;
  for (Index h = 0; h < H; ++h) {
    const std::vector<std::int64_t> pos = a->positions(0, h);
    std::set<std::int64_t> blocks;
    for (const std::int64_t p : pos) {
      if (p < pending) blocks.insert(p / block);
    }
    expected += pos.size() * 2 * 8 + 2 * (blocks.size() * 4 * D + block * D * 4);
  }
  EXPECT_EQ(a->kept_bytes(), expected);
}

/// Channel-axis rows carry their blocks through the set's operations: a fork continues exactly as
/// its source; a rollback to a checkpoint taken mid-block, after calls that sealed blocks and
/// evicted rows, restores positions, rows, scores and kept_bytes(), and the caches then continue
/// exactly as a twin that never left; a trim that cuts into a sealed block keeps the rows before
/// it unchanged and stores later rows within their new blocks. Half rows, 4/4 bits, blocks of 8.
TEST(ChannelCache, ForkRollbackAndTrimCarryTheBlocks) {
  using T = Eigen::half;
  const Index H = 2, G = 2, D = 16;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.set_budget(12);
  c.key_bits = c.value_bits = 4;
  c.key_axis = c.value_axis = "channel";
  c.quant_block = 8;
  std::mt19937 rng(41);
  const auto rows = [&](Index S) {
    const vc::Tensor4<double> x = random_input(rng, 1, H, S, D);
    return vc::Tensor4<T>(x.cast<T>());
  };
  const auto run = [&](std::vector<std::unique_ptr<vc::KVCache<T>>>& set, const vc::Tensor4<float>& q,
                       const vc::Tensor4<T>& k, const vc::Tensor4<T>& v) {
    return set[0]->attend(q, k, v);
  };
  const auto same = [](const vc::KVCache<T>& a, const vc::KVCache<T>& b) {
    ASSERT_EQ(a.kept_bytes(), b.kept_bytes());
    ASSERT_TRUE(veloxquant::test::bitwise_equal(a.state().first, b.state().first));
    ASSERT_TRUE(veloxquant::test::bitwise_equal(a.state().second, b.state().second));
    for (Index h = 0; h < H; ++h) {
      ASSERT_EQ(a.positions(0, h), b.positions(0, h));
      ASSERT_EQ(a.scores(0, h), b.scores(0, h));
    }
  };
  std::vector<std::unique_ptr<vc::KVCache<T>>> a, twin;
  a.push_back(vc::KVCacheFactory::create<T>(c));
  twin.push_back(vc::KVCacheFactory::create<T>(c));
  std::vector<std::tuple<vc::Tensor4<float>, vc::Tensor4<T>, vc::Tensor4<T>>> calls;
  for (const Index S : {Index{13}, Index{1}, Index{1}, Index{5}, Index{1}, Index{1}, Index{1},
                        Index{1}, Index{1}, Index{1}}) {
    calls.emplace_back(veloxquant::test::random_queries(rng, 1, G * H, S, D), rows(S), rows(S));
  }
  for (std::size_t i = 0; i < 4; ++i) {
    const auto& [q, k, v] = calls[i];
    (void)run(a, q, k, v);
    (void)run(twin, q, k, v);
  }
  ASSERT_NE(a[0]->offset() % 8, 0) << "the checkpoint falls inside a block";
  vc::KVCacheBuilder::checkpoint(a);
  for (int i = 0; i < 9; ++i) {  // an excursion that seals a block and evicts
    const Index S = i == 0 ? 6 : 1;
    (void)run(a, veloxquant::test::random_queries(rng, 1, G * H, S, D), rows(S), rows(S));
  }
  vc::KVCacheBuilder::rollback(a);
  same(*a[0], *twin[0]);
  std::vector<std::unique_ptr<vc::KVCache<T>>> f = vc::KVCacheBuilder::fork(a);
  for (std::size_t i = 4; i < calls.size(); ++i) {
    const auto& [q, k, v] = calls[i];
    const vc::Tensor4<float> oa = run(a, q, k, v), ot = run(twin, q, k, v), of = run(f, q, k, v);
    ASSERT_EQ(std::memcmp(oa.data(), ot.data(), sizeof(float) * oa.size()), 0) << "call " << i;
    ASSERT_EQ(std::memcmp(oa.data(), of.data(), sizeof(float) * oa.size()), 0) << "call " << i;
  }
  same(*a[0], *twin[0]);
  same(*a[0], *f[0]);

  // Trim (the standard cache): 21 rows, then 7 dropped, which cuts into the block [8, 16).
  vc::KVCacheConfig s = c;
  s.method = "standard";
  auto st = vc::KVCacheFactory::create<float>(s);
  ChannelInputs ki{D, {}}, vi{D, {}};
  const vc::Tensor4<double> k0 = random_input(rng, 1, H, 21, D), v0 = random_input(rng, 1, H, 21, D);
  ki.add(k0);
  vi.add(v0);
  (void)st->update_and_fetch(k0.cast<float>(), v0.cast<float>());
  const vc::KVPair<float> before = st->state();
  ASSERT_EQ(st->trim(7), 7);
  const vc::KVPair<float> after = st->state();
  ASSERT_EQ(after.first.dimension(2), 14);
  for (Index h = 0; h < H; ++h)
    for (Index p = 0; p < 14; ++p)
      for (Index k = 0; k < D; ++k) {
        ASSERT_EQ(after.first(0, h, p, k), before.first(0, h, p, k));
        ASSERT_EQ(after.second(0, h, p, k), before.second(0, h, p, k));
      }
  // The inputs of positions 14.. are the new rows now.
  for (auto* in : {&ki, &vi})
    for (auto& r : in->rows) r.resize(static_cast<std::size_t>(14 * D));
  for (int i = 0; i < 3; ++i) {
    const vc::Tensor4<double> k = random_input(rng, 1, H, 5, D), v = random_input(rng, 1, H, 5, D);
    ki.add(k);
    vi.add(v);
    (void)st->update_and_fetch(k.cast<float>(), v.cast<float>());
    const vc::KVPair<float> now = st->state();
    for (Index h = 0; h < H; ++h) {
      // Rows before the trim are as they were; the blocks after it start where it left off
      // (position 14), so the bound over aligned blocks of 8 does not apply to them: each is
      // checked against the range of its own block, [14 + 8 j, 22 + 8 j).
      for (Index p = 0; p < 14; ++p)
        for (Index e = 0; e < D; ++e) ASSERT_EQ(now.first(0, h, p, e), before.first(0, h, p, e));
      for (Index p = 14; p < st->offset(); ++p) {
        const std::int64_t b0 = 14 + (p - 14) / 8 * 8;
        const bool pending = b0 + 8 > st->offset();
        for (Index e = 0; e < D; ++e) {
          const float x = ki.at(h, p, e), y = now.first(0, h, p, e);
          if (pending) {
            ASSERT_EQ(y, x) << "pending position " << p;
            continue;
          }
          float lo = x, hi = x;
          for (std::int64_t q = b0; q < b0 + 8; ++q) {
            lo = std::min(lo, ki.at(h, q, e));
            hi = std::max(hi, ki.at(h, q, e));
          }
          ASSERT_LE(std::abs(y - x), 0.5 * ((hi - lo) + std::abs(lo) * 0x1p-9 + 1e-6) / 15 * (1 + 0x1p-9) + std::abs(x) * 0x1p-20)
              << "position " << p;
        }
      }
    }
  }
}

/// key_axis and value_axis take "token" or "channel", quant_block 8..1024, the widths 16, 8, 4
/// and 2; a bad one is named. A head dim that quant_group does not divide is fine along channels.
TEST(ChannelCache, ConfigIsValidated) {
  vc::KVCacheConfig c;
  c.key_bits = 2;
  c.key_axis = "channel";
  EXPECT_NO_THROW(c.validate());
  const auto fails = [](const vc::KVCacheConfig& b, const std::string& field) {
    try {
      b.validate();
      ADD_FAILURE() << field << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  vc::KVCacheConfig b = c;
  b.value_axis = "channels";
  fails(b, "value_axis");
  b = c;
  b.quant_block = 7;
  fails(b, "quant_block");
  b.quant_block = 1025;
  fails(b, "quant_block");
  b = c;
  b.key_bits = 3;
  fails(b, "key_bits");
  c.quant_group = 32;
  EXPECT_NO_THROW((void)vc::KVCacheBuilder::for_model<float>(std::vector<std::optional<int>>{9}, c));
}

/// A set over channel-axis rows (keys 4 bits, values 2, blocks of 8; H2O and the standard cache)
/// saved mid-block after evictions loads to the same rows, positions, scores and kept_bytes(), and
/// the loaded set continues exactly as the saved one.
TEST(ChannelCache, PromptCachesCarryTheBlocks) {
  using T = Eigen::half;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.set_budget(12);
  c.key_bits = 4;
  c.value_bits = 2;
  c.key_axis = c.value_axis = "channel";
  c.quant_block = 8;
  for (const std::string method : {"h2o", "standard"}) {
    SCOPED_TRACE(method);
    c.method = method;
    auto set = vc::KVCacheBuilder::for_model<T>(std::vector<std::optional<int>>{16, 16}, c);
    std::mt19937 rng(51);
    const auto call = [&](std::vector<std::unique_ptr<vc::KVCache<T>>>& s, std::mt19937& g, Index S) {
      std::vector<vc::Tensor4<float>> out;
      for (auto& l : s) {
        const vc::Tensor4<double> k = random_input(g, 1, 2, S, 16), v = random_input(g, 1, 2, S, 16);
        const vc::Tensor4<float> kf = k.cast<float>(), vf = v.cast<float>();
        out.push_back(l->attend(veloxquant::test::random_queries(g, 1, 4, S, 16), kf, vf));
      }
      return out;
    };
    for (const Index S : {Index{13}, Index{1}, Index{1}, Index{5}, Index{1}}) (void)call(set, rng, S);
    ASSERT_NE(set[0]->offset() % 8, 0);
    std::stringstream file;
    vc::save_prompt_cache(file, set);
    vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
    ASSERT_EQ(loaded.caches.size(), set.size());
    for (std::size_t l = 0; l < set.size(); ++l) {
      EXPECT_EQ(loaded.caches[l]->kept_bytes(), set[l]->kept_bytes());
      EXPECT_TRUE(veloxquant::test::bitwise_equal(loaded.caches[l]->state().first, set[l]->state().first));
      EXPECT_TRUE(veloxquant::test::bitwise_equal(loaded.caches[l]->state().second, set[l]->state().second));
      for (Index h = 0; h < 2; ++h) {
        EXPECT_EQ(loaded.caches[l]->positions(0, h), set[l]->positions(0, h));
        EXPECT_EQ(loaded.caches[l]->scores(0, h), set[l]->scores(0, h));
      }
    }
    for (const Index S : {Index{1}, Index{1}, Index{6}, Index{1}, Index{1}, Index{1}, Index{9}}) {
      std::mt19937 g1 = rng, g2 = rng;
      const auto a = call(set, g1, S), b = call(loaded.caches, g2, S);
      rng = g1;
      for (std::size_t l = 0; l < a.size(); ++l) {
        ASSERT_EQ(std::memcmp(a[l].data(), b[l].data(), sizeof(float) * a[l].size()), 0) << "layer " << l;
      }
    }
  }
}
