// Engine integration through the public API (docs/design.md 2.3, 2.8):
//  * attend(queries, keys, values, out) on every policy leaves bit for bit the state of
//    update_and_view(keys, values, queries) on a twin, and writes the attention output over the
//    rows that call returned (lower-right causal mask), checked against a double-precision
//    attention over the twin's view; by hand on a three-token case;
//  * TensorRef and TensorMap inputs, token-major inputs and outputs: the same state and output as
//    head-major Tensor4s, with no copy of the input (the cache reads the caller's buffer);
//  * every bad call to attend (null out, bad shapes, non-finite keys or queries, bad references)
//    throws std::invalid_argument naming the problem, writes nothing to out, changes nothing.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

template <class T>
class AttendTest : public ::testing::Test {};
TYPED_TEST_SUITE(AttendTest, StorageTypes);

/// The attention the engine computes over what update_and_view returned, in double: token s of
/// the call, query head j (KV head j / G) over the view's first rows() - S + s + 1 rows (retained
/// rows, then the call's). q: [B, Hq, S, Dk] as float32 (what the cache reads); returns
/// [B, Hq, S, Dv].
template <class T>
vc::Tensor4<double> reference_attention(const vc::KVView<T>& view, const vc::Tensor4<float>& q) {
  const Index B = q.dimension(0), Hq = q.dimension(1), S = q.dimension(2), Dk = q.dimension(3);
  const Index H = view.heads(), G = Hq / H, Dv = view.value_dim();
  vc::Tensor4<double> out(B, Hq, S, Dv);
  out.setZero();
  if (view.rows() == 0) return out;
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dk));
  for (Index b = 0; b < B; ++b) {
    for (Index j = 0; j < Hq; ++j) {
      const auto keys = view.keys(b, j / G);
      const auto values = view.values(b, j / G);
      for (Index s = 0; s < S; ++s) {
        const Index n = view.rows() - S + s + 1;
        std::vector<double> logit(static_cast<std::size_t>(n));
        double top = -std::numeric_limits<double>::infinity();
        for (Index c = 0; c < n; ++c) {
          double dot = 0.0;
          for (Index d = 0; d < Dk; ++d) {
            dot += static_cast<double>(q(b, j, s, d)) *
                   static_cast<double>(static_cast<float>(keys(c, d)));
          }
          logit[static_cast<std::size_t>(c)] = dot * scale;
          top = std::max(top, dot * scale);
        }
        double sum = 0.0;
        for (double& l : logit) sum += (l = std::exp(l - top));
        for (Index c = 0; c < n; ++c) {
          const double w = logit[static_cast<std::size_t>(c)] / sum;
          for (Index d = 0; d < Dv; ++d) {
            out(b, j, s, d) += w * static_cast<double>(static_cast<float>(values(c, d)));
          }
        }
      }
    }
  }
  return out;
}

/// "" when got (float32) matches want within float32 accumulation error, else the first miss.
inline std::string compare_output(const vc::Tensor4<float>& got, const vc::Tensor4<double>& want) {
  if (got.dimensions() != want.dimensions()) return "output shape differs";
  for (Index i = 0; i < got.size(); ++i) {
    const double g = got.data()[i], w = want.data()[i];
    if (!(std::abs(g - w) <= 2e-5 * (1.0 + std::abs(w)))) {
      return "output element " + std::to_string(i) + ": got " + std::to_string(g) + ", want " +
             std::to_string(w);
    }
  }
  return "";
}

/// Row-major [B, H, S, D] -> [B, S, H, D].
template <class U>
std::vector<U> token_major(const vc::Tensor4<U>& t) {
  const Index B = t.dimension(0), H = t.dimension(1), S = t.dimension(2), D = t.dimension(3);
  std::vector<U> out(static_cast<std::size_t>(t.size()));
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index s = 0; s < S; ++s)
        for (Index d = 0; d < D; ++d)
          out[static_cast<std::size_t>(((b * S + s) * H + h) * D + d)] = t(b, h, s, d);
  return out;
}

/// The call sizes every sweep runs: a prefill past the budget, decode, a multi-token call, an
/// empty call, a long call across kernel blocks.
const std::vector<Index> kSizes{9, 1, 1, 3, 0, 1, 70, 1, 2, 1};

TYPED_TEST(AttendTest, SameStateAsUpdateAndViewAndTheAttentionOverItsRows) {
  using T = TypeParam;
  for (const Kind kind : kKinds) {
    for (const Index G : {Index{1}, Index{2}, Index{3}}) {
      const std::string ctx = std::string(kind_name(kind)) + ", G = " + std::to_string(G);
      Subject<T> subject = make_subject<T>(kind);
      Subject<T> twin = make_subject<T>(kind);
      std::mt19937 rng(40u + kind_index(kind) * 7u + static_cast<unsigned>(G));
      const Index B = 2, H = 2, Dk = 8, Dv = 5;
      for (const Index S : kSizes) {
        const auto k = random_tensor<T>(rng, B, H, S, Dk);
        const auto v = random_tensor<T>(rng, B, H, S, Dv);
        const auto q = random_queries(rng, B, G * H, S, Dk, 2.0);
        const vc::Tensor4<float> out = subject.cache->attend(q, k, v);
        const vc::KVView<T> view = twin.cache->update_and_view(k, v, q);
        ASSERT_TRUE(logical_state(subject) == logical_state(twin))
            << ctx << ", S = " << S << ": state differs";
        EXPECT_EQ(compare_output(out, reference_attention(view, q)), "") << ctx << ", S = " << S;
      }
    }
  }
}

/// B = H = 1, G = 1, Dk = Dv = 2, by hand. Token 0 attends to itself alone: its value. Token 1's
/// query (sqrt(2) ln 3, 0) gives logits ln 3 and 0 against keys (1, 0) and (0, 1): weights 3/4 and
/// 1/4 of values (1, 2) and (3, 4) = (1.5, 2.5). A later call's token sees both earlier rows.
TYPED_TEST(AttendTest, ThreeTokensByHand) {
  using T = TypeParam;
  vc::KVCache<T> cache;
  vc::Tensor4<float> k(1, 1, 2, 2), v(1, 1, 2, 2), q(1, 1, 2, 2);
  k.setValues({{{{1, 0}, {0, 1}}}});
  v.setValues({{{{1, 2}, {3, 4}}}});
  const float a = std::sqrt(2.0f) * std::log(3.0f);
  q.setValues({{{{5, -7}, {a, 0}}}});
  const vc::Tensor4<float> out = cache.attend(q, k, v);
  EXPECT_NEAR(out(0, 0, 0, 0), 1.0, 1e-6);
  EXPECT_NEAR(out(0, 0, 0, 1), 2.0, 1e-6);
  EXPECT_NEAR(out(0, 0, 1, 0), 1.5, 2e-3);  // the keys are stored as T (exact here; q is not)
  EXPECT_NEAR(out(0, 0, 1, 1), 2.5, 2e-3);
  // Decode: key (1, 1), value (0, 0); query 0 gives equal weights to all three rows.
  vc::Tensor4<float> k2(1, 1, 1, 2), v2(1, 1, 1, 2), q2(1, 1, 1, 2);
  k2.setValues({{{{1, 1}}}});
  v2.setValues({{{{0, 0}}}});
  q2.setZero();
  const vc::Tensor4<float> out2 = cache.attend(q2, k2, v2);
  EXPECT_NEAR(out2(0, 0, 0, 0), 4.0 / 3.0, 1e-6);
  EXPECT_NEAR(out2(0, 0, 0, 1), 2.0, 1e-6);
  EXPECT_EQ(cache.offset(), 3);
}

/// TensorRef (head- and token-major), TensorMap (const and mutable) inputs and token-major output
/// give bitwise the state and output of head-major Tensor4s, on every policy and every update API.
TYPED_TEST(AttendTest, EveryInputFormGivesTheSameStateAndOutput) {
  using T = TypeParam;
  using Map = Eigen::TensorMap<vc::Tensor4<float>>;
  using ConstMap = Eigen::TensorMap<const vc::Tensor4<float>>;
  for (const Kind kind : kKinds) {
    const std::string ctx = kind_name(kind);
    Subject<T> ref = make_subject<T>(kind);
    Subject<T> tok = make_subject<T>(kind);  // token-major TensorRefs, token-major output
    Subject<T> map = make_subject<T>(kind);  // TensorMaps
    Subject<T> fetch =
        make_subject<T>(kind);  // update_and_fetch(_into) through TensorRef/TensorMap
    Subject<T> fetch_ref = make_subject<T>(kind);
    std::mt19937 rng(70u + kind_index(kind));
    const Index B = 2, H = 2, G = 2, Dk = 8, Dv = 5, Hq = G * H;
    vc::KVPair<T> into;
    for (const Index S : kSizes) {
      const vc::Tensor4<float> k = random_tensor<float>(rng, B, H, S, Dk);
      const vc::Tensor4<float> v = random_tensor<float>(rng, B, H, S, Dv);
      vc::Tensor4<float> q = random_queries(rng, B, Hq, S, Dk);
      const vc::Tensor4<float> want = ref.cache->attend(q, k, v);

      const std::vector<float> kt = token_major(k), vt = token_major(v), qt = token_major(q);
      // One spare element: an empty call's buffer is not null (a null out is an error).
      std::vector<float> got_t(static_cast<std::size_t>(want.size()) + 1, -1.0f);
      tok.cache->attend(vc::TensorRef<float>(qt.data(), B, Hq, S, Dk, vc::Layout::token_major),
                        vc::TensorRef<float>(kt.data(), B, H, S, Dk, vc::Layout::token_major),
                        vc::TensorRef<float>(vt.data(), B, H, S, Dv, vc::Layout::token_major),
                        got_t.data(), vc::Layout::token_major);
      EXPECT_EQ(got_t.back(), -1.0f);
      got_t.pop_back();
      EXPECT_TRUE(token_major(want) == got_t) << ctx << ", S = " << S << ": token-major output";
      EXPECT_TRUE(logical_state(tok) == logical_state(ref))
          << ctx << ", S = " << S << ": token-major state";

      vc::Tensor4<float> got_m(B, Hq, S, Dv);
      float spare = 0.0f;
      map.cache->attend(Map(q.data(), B, Hq, S, Dk), ConstMap(k.data(), B, H, S, Dk),
                        ConstMap(v.data(), B, H, S, Dv), S ? got_m.data() : &spare);
      EXPECT_TRUE(bitwise_equal(got_m, want)) << ctx << ", S = " << S << ": TensorMap output";
      EXPECT_TRUE(logical_state(map) == logical_state(ref))
          << ctx << ", S = " << S << ": TensorMap state";

      // The update APIs: Tensor4 on one cache, token-major TensorRef / TensorMap on the other.
      const vc::KVPair<T> a = fetch.cache->update_and_fetch(k, v, q);
      vc::TensorRef<float> kr(kt.data(), B, H, S, Dk, vc::Layout::token_major);
      vc::TensorRef<float> vr(vt.data(), B, H, S, Dv, vc::Layout::token_major);
      if (S % 2 == 0) {
        fetch_ref.cache->update_and_fetch_into(kr, vr, ConstMap(q.data(), B, Hq, S, Dk), into);
      } else {
        fetch_ref.cache->update_and_fetch_into(
            Map(const_cast<float*>(k.data()), B, H, S, Dk), ConstMap(v.data(), B, H, S, Dv),
            vc::TensorRef<float>(qt.data(), B, Hq, S, Dk, vc::Layout::token_major), into);
      }
      EXPECT_TRUE(bitwise_equal(a.first, into.first) && bitwise_equal(a.second, into.second))
          << ctx << ", S = " << S << ": fetch through references";
      EXPECT_TRUE(logical_state(fetch) == logical_state(fetch_ref)) << ctx << ", S = " << S;
    }
    // Without queries, and update_and_view.
    const vc::Tensor4<float> k = random_tensor<float>(rng, B, H, 3, Dk);
    const vc::Tensor4<float> v = random_tensor<float>(rng, B, H, 3, Dv);
    const std::vector<float> kt = token_major(k), vt = token_major(v);
    (void)fetch.cache->update_and_view(k, v);
    (void)fetch_ref.cache->update_and_view(
        vc::TensorRef<float>(kt.data(), B, H, 3, Dk, vc::Layout::token_major),
        vc::TensorRef<float>(vt.data(), B, H, 3, Dv, vc::Layout::token_major));
    EXPECT_TRUE(logical_state(fetch) == logical_state(fetch_ref))
        << ctx << ": view without queries";
    (void)fetch.cache->update_and_fetch(k, v);
    (void)fetch_ref.cache->update_and_fetch(ConstMap(k.data(), B, H, 3, Dk),
                                            ConstMap(v.data(), B, H, 3, Dv));
    EXPECT_TRUE(logical_state(fetch) == logical_state(fetch_ref))
        << ctx << ": fetch without queries";
  }
}

/// The references are read where they are: a view into an engine's larger token-major buffer of
/// half rows, with the keys' storage type differing from the input's.
TYPED_TEST(AttendTest, ReferencesReadTheCallersBufferInPlace) {
  using T = TypeParam;
  const Index B = 1, H = 2, G = 2, S = 4, D = 8;
  std::mt19937 rng(9u);
  const auto k = random_tensor<Eigen::half>(rng, B, H, S, D);
  const auto v = random_tensor<Eigen::half>(rng, B, H, S, D);
  const auto q = random_tensor<Eigen::half>(rng, B, G * H, S, D);
  std::vector<Eigen::half> kt = token_major(k), vt = token_major(v), qt = token_major(q);
  vc::KVCache<T> a, b;
  const vc::Tensor4<float> want = a.attend(q, k, v);
  std::vector<float> got(static_cast<std::size_t>(want.size()));
  b.attend(vc::TensorRef<Eigen::half>(qt.data(), B, G * H, S, D, vc::Layout::token_major),
           vc::TensorRef<Eigen::half>(kt.data(), B, H, S, D, vc::Layout::token_major),
           vc::TensorRef<Eigen::half>(vt.data(), B, H, S, D, vc::Layout::token_major), got.data(),
           vc::Layout::token_major);
  EXPECT_TRUE(token_major(want) == got);
  // The stored rows are the caller's rows (converted to T), in place of any copy.
  const vc::KVPair<T> st = b.state();
  for (Index h = 0; h < H; ++h)
    for (Index s = 0; s < S; ++s)
      for (Index d = 0; d < D; ++d)
        EXPECT_EQ(static_cast<float>(st.first(0, h, s, d)),
                  static_cast<float>(static_cast<T>(
                      static_cast<float>(kt[static_cast<std::size_t>((s * H + h) * D + d)]))));
}

/// Every bad call to attend: invalid_argument naming the problem, `out` untouched, state unchanged,
/// and the next valid call as on a twin that never saw it.
TYPED_TEST(AttendTest, BadCallsThrowWriteNothingAndChangeNothing) {
  using T = TypeParam;
  constexpr float kSentinel = 12345.0f;
  for (const Kind kind : kKinds) {
    Subject<T> subject = make_subject<T>(kind);
    Subject<T> twin = make_subject<T>(kind);
    std::mt19937 rng(11u + kind_index(kind));
    establish(subject, twin, rng, kind_name(kind));
    const Index B = kKeys[0], H = kKeys[1], S = 3, Dk = kKeys[3], Dv = kValues[3], Hq = 2 * H;
    const vc::Tensor4<float> k = random_tensor<float>(rng, B, H, S, Dk);
    const vc::Tensor4<float> v = random_tensor<float>(rng, B, H, S, Dv);
    const vc::Tensor4<float> q = random_queries(rng, B, Hq, S, Dk);
    std::vector<float> out(static_cast<std::size_t>(B * Hq * S * Dv * 2), kSentinel);
    const auto check = [&](const std::string& name, const std::string& part, const auto& call) {
      const Snapshot before = snapshot(subject);
      const std::string what = invalid_argument_message(call);
      EXPECT_TRUE(contains(what, part)) << kind_name(kind) << ", " << name << ": " << what;
      EXPECT_TRUE(snapshot(subject) == before)
          << kind_name(kind) << ", " << name << " changed the cache";
      for (const float x : out) {
        if (x != kSentinel) {
          ADD_FAILURE() << kind_name(kind) << ", " << name << " wrote to out";
          break;
        }
      }
    };
    check("null out", "out", [&] { subject.cache->attend(q, k, v, nullptr); });
    {
      vc::Tensor4<float> bad = k;
      bad(1, 1, 2, 3) = std::numeric_limits<float>::quiet_NaN();
      check("NaN key", "non-finite key", [&] { subject.cache->attend(q, bad, v, out.data()); });
    }
    check("keys with another S", "share B, H and S", [&] {
      subject.cache->attend(q, random_tensor<float>(rng, B, H, S + 1, Dk), v, out.data());
    });
    check("keys with another D", "differ from the first call", [&] {
      subject.cache->attend(random_queries(rng, B, Hq, S, Dk + 1),
                            random_tensor<float>(rng, B, H, S, Dk + 1), v, out.data());
    });
    for (const BadQueries& bq : bad_query_variants(q, H, rng)) {
      const auto call = [&] {
        switch (bq.type) {
          case BadQueries::Type::kFloat:
            return subject.cache->attend(bq.f, k, v, out.data());
          case BadQueries::Type::kDouble:
            return subject.cache->attend(bq.d, k, v, out.data());
          case BadQueries::Type::kHalf:
            return subject.cache->attend(bq.h, k, v, out.data());
        }
      };
      check(bq.name, "quer", call);
    }
    // References that cannot be read: a negative dimension, null data with a non-zero size.
    const vc::TensorRef<float> kref(k.data(), B, H, S, Dk);
    const vc::TensorRef<float> vref(v.data(), B, H, S, Dv);
    const vc::TensorRef<float> qref(q.data(), B, Hq, S, Dk);
    check("negative S in the keys", "keys has a negative dimension", [&] {
      subject.cache->attend(qref, vc::TensorRef<float>(k.data(), B, H, -1, Dk), vref, out.data());
    });
    check("null values", "values has null data", [&] {
      subject.cache->attend(qref, kref, vc::TensorRef<float>(nullptr, B, H, S, Dv), out.data());
    });
    check("null queries", "queries has null data", [&] {
      subject.cache->attend(vc::TensorRef<float>(nullptr, B, Hq, S, Dk), kref, vref, out.data());
    });
    check("keys with too many elements", "too many elements", [&] {
      const Index huge = Index{1} << 40;
      subject.cache->attend(qref, vc::TensorRef<float>(k.data(), huge, huge, S, Dk), vref,
                            out.data());
    });
    // The same reference errors through the update APIs.
    check("negative D through update_and_fetch", "update_and_fetch: keys has a negative dimension",
          [&] {
            (void)subject.cache->update_and_fetch(vc::TensorRef<float>(k.data(), B, H, S, -2),
                                                  vref);
          });
    check("null keys through update_and_view", "update_and_view: keys has null data", [&] {
      (void)subject.cache->update_and_view(vc::TensorRef<float>(nullptr, B, H, S, Dk), vref, qref);
    });
    // Still in step with the twin.
    valid_call_on_both(subject, twin, rng, 1, Api::kViewQ, kind_name(kind));
  }
}

/// An empty call writes nothing and changes nothing but what update_and_view would; null data is
/// fine when the size is zero.
TYPED_TEST(AttendTest, EmptyCallsAreLikeUpdateAndView) {
  using T = TypeParam;
  for (const Kind kind : kKinds) {
    Subject<T> subject = make_subject<T>(kind);
    Subject<T> twin = make_subject<T>(kind);
    std::mt19937 rng(5u + kind_index(kind));
    establish(subject, twin, rng, kind_name(kind));
    float out = 7.0f;
    subject.cache->attend(vc::TensorRef<float>(nullptr, 2, 4, 0, 4),
                          vc::TensorRef<float>(nullptr, 2, 2, 0, 4),
                          vc::TensorRef<float>(nullptr, 2, 2, 0, 3), &out);
    (void)twin.cache->update_and_view(random_tensor<float>(rng, 2, 2, 0, 4),
                                      random_tensor<float>(rng, 2, 2, 0, 3),
                                      random_queries(rng, 2, 4, 0, 4));
    EXPECT_EQ(out, 7.0f);
    EXPECT_TRUE(logical_state(subject) == logical_state(twin)) << kind_name(kind);
  }
}

}  // namespace
