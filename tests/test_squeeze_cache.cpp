// Tests of SqueezeAttentionCache<T> and the squeeze/pyramidkv paths of KVCacheBuilder: budget
// adoption (docs/design.md 5.4 steps 3-4), deferral and its fallback, the layer concentration (5.2), reset
// and generations (5.4 step 6), the protected recent window (4.2-4.3), the return/retain rule
// (4.4), re-budget on adoption (4.5) and the builder end to end (2.7). Retained sets and scores
// are compared with the independent double-precision oracle in tests/reference/oracle.hpp, fed
// with the same keys converted to the storage type T.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "support/storage_types.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using Index = Eigen::Index;
using D4 = vc::Tensor4<double>;
using Positions = std::vector<std::int64_t>;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// x converted to T and back to double (what the cache stores, seen exactly). x: [B, H, S, D]
template <class T>
D4 through(const D4& x) {
  D4 out(x.dimensions());
  for (Index i = 0; i < x.size(); ++i) {
    out.data()[i] = static_cast<double>(static_cast<float>(static_cast<T>(x.data()[i])));
  }
  return out;
}

/// One row (b, h, s) of a [B, H, S, D] tensor as a vector.
std::vector<double> row_of(const D4& x, Index b, Index h, Index s) {
  std::vector<double> r(static_cast<std::size_t>(x.dimension(3)));
  for (Index d = 0; d < x.dimension(3); ++d) r[static_cast<std::size_t>(d)] = x(b, h, s, d);
  return r;
}

/// Keys and values for B*H heads. Head i's keys are alpha_i * dir_i + N(0, 1) noise, dir_i a
/// random unit vector fixed for the stream (larger alpha: more clustered keys, higher
/// concentration); values are N(0, 1).
class Stream {
 public:
  Stream(std::uint32_t seed, Index B, Index H, Index D, Index Dv, std::vector<double> alpha)
      : rng_(seed), B_(B), H_(H), D_(D), Dv_(Dv), alpha_(std::move(alpha)) {
    if (alpha_.size() == 1) alpha_.assign(static_cast<std::size_t>(B * H), alpha_[0]);
    for (Index i = 0; i < B * H; ++i) {
      std::vector<double> dir(static_cast<std::size_t>(D));
      double n2 = 0.0;
      for (double& x : dir) {
        x = normal_(rng_);
        n2 += x * x;
      }
      for (double& x : dir) x /= std::sqrt(n2);
      dirs_.push_back(dir);
    }
  }

  /// The next S tokens: keys [B, H, S, D], values [B, H, S, Dv].
  std::pair<D4, D4> next(Index S) {
    D4 k(B_, H_, S, D_);
    D4 v(B_, H_, S, Dv_);
    for (Index b = 0; b < B_; ++b) {
      for (Index h = 0; h < H_; ++h) {
        const auto i = static_cast<std::size_t>(b * H_ + h);
        for (Index s = 0; s < S; ++s) {
          for (Index d = 0; d < D_; ++d) {
            k(b, h, s, d) = alpha_[i] * dirs_[i][static_cast<std::size_t>(d)] + normal_(rng_);
          }
          for (Index d = 0; d < Dv_; ++d) v(b, h, s, d) = normal_(rng_);
        }
      }
    }
    return {k, v};
  }

 private:
  std::mt19937 rng_;
  std::normal_distribution<double> normal_{0.0, 1.0};
  Index B_, H_, D_, Dv_;
  std::vector<double> alpha_;
  std::vector<std::vector<double>> dirs_;
};

/// Mean over all B*H heads of the Gram-matrix concentration of the keys as stored in T.
/// keys: [B, H, S, D]
template <class T>
double expected_concentration(const D4& keys) {
  const D4 kt = through<T>(keys);
  double sum = 0.0;
  for (Index b = 0; b < kt.dimension(0); ++b) {
    for (Index h = 0; h < kt.dimension(1); ++h) {
      std::vector<std::vector<double>> rows;
      for (Index s = 0; s < kt.dimension(2); ++s) rows.push_back(row_of(kt, b, h, s));
      sum += ref::concentration_score_gram(rows);
    }
  }
  return sum / static_cast<double>(kt.dimension(0) * kt.dimension(1));
}

/// Gram-matrix concentration of head (b, h) alone, as stored in T. keys: [B, H, S, D]
template <class T>
double head_concentration(const D4& keys, Index b, Index h) {
  const D4 kt = through<T>(keys);
  std::vector<std::vector<double>> rows;
  for (Index s = 0; s < kt.dimension(2); ++s) rows.push_back(row_of(kt, b, h, s));
  return ref::concentration_score_gram(rows);
}

/// One oracle head per (b, h) of a layer, SqueezeAttention grace rule.
class OracleLayer {
 public:
  OracleLayer(Index B, Index H, int n_sink, double decay = 0.98, double ratio = 0.5) : H_(H) {
    for (Index i = 0; i < B * H; ++i) {
      heads_.emplace_back(n_sink, decay, [ratio, n_sink](int budget) {
        return ref::protected_recent_ratio(ratio, budget, n_sink);
      });
    }
  }
  void set_budget(int budget) {
    for (auto& h : heads_) h.set_budget(budget);
  }
  /// keys: [B, H, S, D], values: [B, H, S, Dv], both already rounded through T.
  void absorb(const D4& keys, const D4& values) {
    for (Index b = 0; b < keys.dimension(0); ++b) {
      for (Index h = 0; h < keys.dimension(1); ++h) {
        for (Index s = 0; s < keys.dimension(2); ++s) {
          head(b, h).absorb(row_of(keys, b, h, s), row_of(values, b, h, s));
        }
      }
    }
  }
  ref::H2OHeadOracle& head(Index b, Index h) { return heads_[static_cast<std::size_t>(b * H_ + h)]; }
  const ref::H2OHeadOracle& head(Index b, Index h) const {
    return heads_[static_cast<std::size_t>(b * H_ + h)];
  }
  /// The window a call with `keys` would return now: retained rows then the new ones.
  /// keys: [B, H, S, D]; returns [B, H, n + S, D].
  D4 window(const D4& keys) const {
    const Index B = keys.dimension(0), H = keys.dimension(1), S = keys.dimension(2);
    const Index D = keys.dimension(3);
    const auto n = static_cast<Index>(head(0, 0).rows().size());
    D4 out(B, H, n + S, D);
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const auto& rows = head(b, h).rows();
        EXPECT_EQ(static_cast<Index>(rows.size()), n);
        for (Index r = 0; r < n; ++r) {
          for (Index d = 0; d < D; ++d) {
            out(b, h, r, d) = rows[static_cast<std::size_t>(r)].key[static_cast<std::size_t>(d)];
          }
        }
        for (Index s = 0; s < S; ++s) {
          for (Index d = 0; d < D; ++d) out(b, h, n + s, d) = keys(b, h, s, d);
        }
      }
    }
    return out;
  }

 private:
  Index H_;
  std::vector<ref::H2OHeadOracle> heads_;
};

/// Expects retained positions equal and scores within 1e-4 (relative, absolute below 1).
template <class Cache>
void expect_matches_oracle(const Cache& cache, const OracleLayer& oracle, const std::string& where) {
  for (Index b = 0; b < cache.batch(); ++b) {
    for (Index h = 0; h < cache.heads(); ++h) {
      const auto& o = oracle.head(b, h);
      EXPECT_EQ(cache.positions(b, h), o.positions()) << where << " head (" << b << "," << h << ")";
      const std::vector<float> s = cache.scores(b, h);
      const std::vector<double> os = o.scores();
      ASSERT_EQ(s.size(), os.size()) << where;
      for (std::size_t i = 0; i < s.size(); ++i) {
        EXPECT_NEAR(static_cast<double>(s[i]), os[i], 1e-4 * std::max(1.0, std::abs(os[i])))
            << where << " head (" << b << "," << h << ") row " << i;
      }
    }
  }
}

/// Expects a returned tensor (storage T) to equal `expected` (double) exactly, shape included.
template <class T>
void expect_tensor_eq(const vc::Tensor4<T>& got, const D4& expected, const std::string& where) {
  ASSERT_EQ(got.dimensions(), expected.dimensions()) << where;
  Index bad = 0;
  for (Index i = 0; i < got.size(); ++i) {
    if (static_cast<double>(static_cast<float>(got.data()[i])) != expected.data()[i]) ++bad;
  }
  EXPECT_EQ(bad, 0) << where << ": elements differ";
}

/// Every head of `cache` holds `n` rows.
template <class Cache>
void expect_rows_per_head(const Cache& cache, std::size_t n, const std::string& where) {
  for (Index b = 0; b < cache.batch(); ++b) {
    for (Index h = 0; h < cache.heads(); ++h) {
      EXPECT_EQ(cache.positions(b, h).size(), n) << where << " head (" << b << "," << h << ")";
    }
  }
}

int grace(int budget, int n_sink, double ratio = 0.5) {
  return ref::protected_recent_ratio(ratio, budget, n_sink);
}

vc::KVCacheConfig squeeze_config(int budget, int n_sink, bool defer = false) {
  vc::KVCacheConfig c;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  c.method = "squeeze";
  c.squeeze_budget = budget;
  c.squeeze_n_sink = n_sink;
  c.squeeze_defer = defer;
  return c;
}

template <class T>
class SqueezeAttentionCacheTest : public ::testing::Test {};
template <class T>
class KVCacheBuilderSqueezeTest : public ::testing::Test {};

using veloxquant::test::StorageTypes;

struct StorageTypeNames {
  template <class T>
  static std::string GetName(int) {
    if (std::is_same_v<T, Eigen::half>) return "half";
    if (std::is_same_v<T, Eigen::bfloat16>) return "bfloat16";
    return "float";
  }
};

TYPED_TEST_SUITE(SqueezeAttentionCacheTest, StorageTypes, StorageTypeNames);
TYPED_TEST_SUITE(KVCacheBuilderSqueezeTest, StorageTypes, StorageTypeNames);

// ---------------------------------------------------------------------------------------------
// docs/design.md 5.4 steps 3-4: adoption in the completing call vs at the next call
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, AdoptsInCompletingCallAndOthersAtTheirNextCall) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 16, Dv = 8, S = 40;
  constexpr int kAvg = 24, kSink = 2;
  const vc::KVCacheConfig config = squeeze_config(kAvg, kSink);
  auto coord = std::make_shared<vc::SqueezeCoordinator>(3, kAvg, kSink, 1.0);
  const std::vector<double> alphas = {0.0, 4.0, 8.0};  // broad, medium, clustered
  std::vector<std::unique_ptr<vc::SqueezeAttentionCache<T>>> caches;
  std::vector<Stream> streams;
  std::vector<OracleLayer> oracles;
  for (int l = 0; l < 3; ++l) {
    caches.push_back(std::make_unique<vc::SqueezeAttentionCache<T>>(config, l, coord));
    streams.emplace_back(100u + static_cast<std::uint32_t>(l), B, H, D, Dv,
                         std::vector<double>{alphas[static_cast<std::size_t>(l)]});
    oracles.emplace_back(B, H, kSink);
  }

  // Layers 0 and 1: first calls do not finalise; they evict against squeeze_budget meanwhile.
  std::vector<D4> prefill_keys;
  for (int l = 0; l < 2; ++l) {
    auto& cache = *caches[static_cast<std::size_t>(l)];
    auto& oracle = oracles[static_cast<std::size_t>(l)];
    const auto [k, v] = streams[static_cast<std::size_t>(l)].next(S);
    prefill_keys.push_back(k);
    const auto out = cache.update_and_fetch(k, v);
    EXPECT_FALSE(coord->is_finalized()) << l;
    EXPECT_FALSE(cache.budget_adopted()) << l;
    EXPECT_EQ(cache.layer_budget(), kAvg) << l;
    EXPECT_EQ(cache.budget(), std::optional<int>(kAvg)) << l;
    EXPECT_EQ(cache.protected_recent(), grace(kAvg, kSink)) << l;
    expect_tensor_eq<T>(out.first, through<T>(k), "prefill keys returned");
    expect_rows_per_head(cache, kAvg, "layer " + std::to_string(l) + " after prefill");
    oracle.set_budget(kAvg);
    oracle.absorb(through<T>(k), through<T>(v));
    expect_matches_oracle(cache, oracle, "layer " + std::to_string(l) + " prefill");
  }

  // Layer 2's first call completes the set and adopts before its tokens are absorbed.
  auto& last = *caches[2];
  const auto [k2, v2] = streams[2].next(S);
  prefill_keys.push_back(k2);
  const auto out2 = last.update_and_fetch(k2, v2);
  ASSERT_TRUE(coord->is_finalized());
  std::vector<double> c;
  for (int l = 0; l < 3; ++l) {
    c.push_back(caches[static_cast<std::size_t>(l)]->concentration());
    EXPECT_NEAR(c.back(), expected_concentration<T>(prefill_keys[static_cast<std::size_t>(l)]), 1e-9);
    EXPECT_EQ(coord->reports().at(l), c.back());
  }
  const std::vector<int> budgets = ref::squeeze_budgets(c, kAvg, kSink, 1.0);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(coord->resolved_budget(l), std::optional<int>(budgets[static_cast<std::size_t>(l)]));
  }
  // Preconditions of this scenario: layer 0 grows, layers 1 and 2 shrink.
  ASSERT_GT(budgets[0], kAvg);
  ASSERT_LT(budgets[1], kAvg);
  ASSERT_LT(budgets[2], budgets[1]);
  EXPECT_TRUE(last.budget_adopted());
  EXPECT_EQ(last.layer_budget(), budgets[2]);
  EXPECT_EQ(last.protected_recent(), grace(budgets[2], kSink));
  expect_tensor_eq<T>(out2.first, through<T>(k2), "completing prefill keys returned");
  expect_rows_per_head(last, static_cast<std::size_t>(budgets[2]), "layer 2 after prefill");
  // Adopted before absorbing: the oracle with the resolved budget from the start...
  oracles[2].set_budget(budgets[2]);
  oracles[2].absorb(through<T>(k2), through<T>(v2));
  expect_matches_oracle(last, oracles[2], "layer 2 prefill");
  // ...which differs from evicting against the average first and trimming afterwards.
  OracleLayer late(B, H, kSink);
  late.set_budget(kAvg);
  late.absorb(through<T>(k2), through<T>(v2));
  late.set_budget(budgets[2]);
  EXPECT_NE(late.head(0, 0).positions(), oracles[2].head(0, 0).positions());

  // Layers 0 and 1 have not adopted yet: that happens at the start of their next call.
  for (int l = 0; l < 2; ++l) {
    EXPECT_FALSE(caches[static_cast<std::size_t>(l)]->budget_adopted()) << l;
    EXPECT_EQ(caches[static_cast<std::size_t>(l)]->layer_budget(), kAvg) << l;
  }
  for (int l = 0; l < 3; ++l) {
    auto& cache = *caches[static_cast<std::size_t>(l)];
    auto& oracle = oracles[static_cast<std::size_t>(l)];
    const int b = budgets[static_cast<std::size_t>(l)];
    const auto [k, v] = streams[static_cast<std::size_t>(l)].next(1);
    // The call returns the rows retained before it (before the adoption's re-budget) and itself.
    const D4 expected_window = oracle.window(through<T>(k));
    const Index expected_rows = static_cast<Index>(oracle.head(0, 0).positions().size()) + 1;
    oracle.set_budget(b);  // adoption (a trim for layer 1, a stamp for layer 0)
    const auto out = cache.update_and_fetch(k, v);
    EXPECT_TRUE(cache.budget_adopted()) << l;
    EXPECT_EQ(cache.layer_budget(), b) << l;
    EXPECT_EQ(cache.protected_recent(), grace(b, kSink)) << l;
    EXPECT_EQ(out.first.dimension(2), expected_rows) << l;
    expect_tensor_eq<T>(out.first, expected_window, "decode window of layer " + std::to_string(l));
    oracle.absorb(through<T>(k), through<T>(v));
    expect_matches_oracle(cache, oracle, "layer " + std::to_string(l) + " first decode");
    EXPECT_LE(cache.tokens_kept(), b) << l;
  }
  EXPECT_EQ(caches[0]->tokens_kept(), kAvg + 1);  // a larger budget is only stamped
  EXPECT_EQ(caches[1]->tokens_kept(), budgets[1]);
  // g follows each layer's own budget.
  EXPECT_NE(caches[0]->protected_recent(), caches[2]->protected_recent());

  // A few more decode steps keep every layer on its oracle.
  for (int step = 0; step < 12; ++step) {
    for (int l = 0; l < 3; ++l) {
      const auto [k, v] = streams[static_cast<std::size_t>(l)].next(1);
      (void)caches[static_cast<std::size_t>(l)]->update_and_fetch(k, v);
      oracles[static_cast<std::size_t>(l)].absorb(through<T>(k), through<T>(v));
    }
  }
  for (int l = 0; l < 3; ++l) {
    expect_matches_oracle(*caches[static_cast<std::size_t>(l)], oracles[static_cast<std::size_t>(l)],
                          "layer " + std::to_string(l) + " after 13 decode steps");
    EXPECT_EQ(caches[static_cast<std::size_t>(l)]->offset(), S + 13);
  }
  EXPECT_EQ(caches[0]->tokens_kept(), std::min(budgets[0], kAvg + 13));
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 5.4 step 4: deferral and the unfinalised fallback
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, DeferredCacheEvictsNothingUntilAdoption) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 16, Dv = 8, S = 40;
  constexpr int kAvg = 16, kSink = 2;
  const vc::KVCacheConfig config = squeeze_config(kAvg, kSink, /*defer=*/true);
  auto coord = std::make_shared<vc::SqueezeCoordinator>(2, kAvg, kSink, 1.0);
  vc::SqueezeAttentionCache<T> broad(config, 0, coord);
  vc::SqueezeAttentionCache<T> clustered(config, 1, coord);
  Stream s0(7u, B, H, D, Dv, {0.0});
  Stream s1(8u, B, H, D, Dv, {6.0});
  OracleLayer o0(B, H, kSink), o1(B, H, kSink);

  // Before its budget is known a deferring cache has no budget and evicts nothing (S > budget).
  EXPECT_FALSE(broad.budget().has_value());
  const auto [k0, v0] = s0.next(S);
  const auto out0 = broad.update_and_fetch(k0, v0);
  EXPECT_FALSE(coord->is_finalized());
  EXPECT_FALSE(broad.budget_adopted());
  EXPECT_FALSE(broad.budget().has_value());
  EXPECT_EQ(broad.protected_recent(), 0);
  expect_tensor_eq<T>(out0.first, through<T>(k0), "deferred prefill keys");
  expect_tensor_eq<T>(out0.second, through<T>(v0), "deferred prefill values");
  expect_rows_per_head(broad, static_cast<std::size_t>(S), "deferred prefill");
  Positions all(static_cast<std::size_t>(S));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  EXPECT_EQ(broad.positions(0, 1), all);
  o0.absorb(through<T>(k0), through<T>(v0));
  expect_matches_oracle(broad, o0, "deferred prefill (scores accumulate)");

  // The second layer completes the set and adopts before absorbing.
  const auto [k1, v1] = s1.next(S);
  (void)clustered.update_and_fetch(k1, v1);
  ASSERT_TRUE(coord->is_finalized());
  const std::vector<int> budgets =
      ref::squeeze_budgets({broad.concentration(), clustered.concentration()}, kAvg, kSink, 1.0);
  ASSERT_LT(budgets[0], S);  // so the adoption below has to trim
  ASSERT_LT(budgets[1], S);
  EXPECT_TRUE(clustered.budget_adopted());
  EXPECT_EQ(clustered.layer_budget(), budgets[1]);
  expect_rows_per_head(clustered, static_cast<std::size_t>(budgets[1]), "completing deferred prefill");
  o1.set_budget(budgets[1]);
  o1.absorb(through<T>(k1), through<T>(v1));
  expect_matches_oracle(clustered, o1, "completing deferred prefill");

  // The first layer's next call adopts: re-budget (4.5) of 40 rows, then the decode token.
  EXPECT_FALSE(broad.budget_adopted());
  expect_rows_per_head(broad, static_cast<std::size_t>(S), "still deferred");
  const auto [kd, vd] = s0.next(1);
  // The call returns the 40 rows retained before it, then itself; the re-budget applies after.
  const D4 expected_window = o0.window(through<T>(kd));
  o0.set_budget(budgets[0]);
  const auto outd = broad.update_and_fetch(kd, vd);
  EXPECT_TRUE(broad.budget_adopted());
  EXPECT_EQ(broad.layer_budget(), budgets[0]);
  EXPECT_EQ(outd.first.dimension(2), S + 1);
  expect_tensor_eq<T>(outd.first, expected_window, "window after adoption trim");
  o0.absorb(through<T>(kd), through<T>(vd));
  expect_rows_per_head(broad, static_cast<std::size_t>(budgets[0]), "after adoption");
  expect_matches_oracle(broad, o0, "after adoption");
  EXPECT_EQ(broad.offset(), S + 1);

  for (int step = 0; step < 20; ++step) {
    const auto [k, v] = s0.next(1);
    (void)broad.update_and_fetch(k, v);
    o0.absorb(through<T>(k), through<T>(v));
    EXPECT_EQ(broad.tokens_kept(), budgets[0]);
  }
  expect_matches_oracle(broad, o0, "20 decode steps after adoption");
}

TYPED_TEST(SqueezeAttentionCacheTest, DeferredCacheFallsBackWhenCoordinatorNeverFinalizes) {
  using T = TypeParam;
  constexpr Index B = 2, H = 1, D = 8, Dv = 8, S = 40;
  constexpr int kAvg = 16, kSink = 2;
  const vc::KVCacheConfig config = squeeze_config(kAvg, kSink, /*defer=*/true);
  // Built for 3 layers, but only layer 0 ever runs (a wrong layer count).
  auto coord = std::make_shared<vc::SqueezeCoordinator>(3, kAvg, kSink, 1.0);
  vc::SqueezeAttentionCache<T> cache(config, 0, coord);
  Stream stream(11u, B, H, D, Dv, {0.5});
  OracleLayer oracle(B, H, kSink);

  const auto [k, v] = stream.next(S);
  (void)cache.update_and_fetch(k, v);
  oracle.absorb(through<T>(k), through<T>(v));
  expect_rows_per_head(cache, static_cast<std::size_t>(S), "first deferred call");
  EXPECT_FALSE(cache.budget().has_value());

  // Second call, coordinator still unfinalised: fall back to squeeze_budget, trim, stay bounded.
  const auto [kd, vd] = stream.next(1);
  const D4 expected_window = oracle.window(through<T>(kd));  // rows retained before the call
  oracle.set_budget(kAvg);
  const auto out = cache.update_and_fetch(kd, vd);
  oracle.absorb(through<T>(kd), through<T>(vd));
  EXPECT_FALSE(coord->is_finalized());
  EXPECT_FALSE(cache.budget_adopted());
  EXPECT_EQ(cache.budget(), std::optional<int>(kAvg));
  EXPECT_EQ(cache.layer_budget(), kAvg);
  EXPECT_EQ(out.first.dimension(2), S + 1);
  expect_tensor_eq<T>(out.first, expected_window, "fallback window");
  expect_rows_per_head(cache, kAvg, "after fallback");
  expect_matches_oracle(cache, oracle, "after fallback");
  for (int step = 0; step < 30; ++step) {
    const auto [ks, vs] = stream.next(1);
    (void)cache.update_and_fetch(ks, vs);
    oracle.absorb(through<T>(ks), through<T>(vs));
    EXPECT_EQ(cache.tokens_kept(), kAvg);
  }
  expect_matches_oracle(cache, oracle, "30 steps on the fallback budget");

  // The missing layers finally report: the cache may still adopt its resolved budget.
  coord->report_concentration(1, 0.9);
  coord->report_concentration(2, 0.9);
  ASSERT_TRUE(coord->is_finalized());
  const int resolved =
      ref::squeeze_budgets({cache.concentration(), 0.9, 0.9}, kAvg, kSink, 1.0)[0];
  ASSERT_GT(resolved, kAvg + 10);
  oracle.set_budget(resolved);
  for (int step = 0; step < 40; ++step) {
    const auto [ks, vs] = stream.next(1);
    (void)cache.update_and_fetch(ks, vs);
    oracle.absorb(through<T>(ks), through<T>(vs));
    EXPECT_TRUE(cache.budget_adopted());
    EXPECT_EQ(cache.layer_budget(), resolved);
    EXPECT_EQ(cache.tokens_kept(), std::min(resolved, kAvg + step + 1));
  }
  expect_matches_oracle(cache, oracle, "after late adoption");
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 5.2: concentration over all heads of the first call
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, ConcentrationIsMeanOverAllHeadsOfFirstCall) {
  using T = TypeParam;
  constexpr Index B = 2, H = 3, D = 16, S = 24;
  auto coord = std::make_shared<vc::SqueezeCoordinator>(1, 16, 2, 1.0);
  vc::SqueezeAttentionCache<T> cache(squeeze_config(16, 2), 0, coord);
  EXPECT_EQ(cache.concentration(), 0.0);
  // Heads of very different concentration; head (0, 0) is the broadest.
  Stream stream(21u, B, H, D, D, {0.0, 1.0, 2.0, 4.0, 6.0, 10.0});
  const auto [k, v] = stream.next(S);
  (void)cache.update_and_fetch(k, v);
  const double expected = expected_concentration<T>(k);
  EXPECT_NEAR(cache.concentration(), expected, 1e-9);
  EXPECT_EQ(coord->reports().at(0), cache.concentration());
  // Sampling head (0, 0) only (the reference) would give a clearly different value.
  EXPECT_GT(std::abs(head_concentration<T>(k, 0, 0) - expected), 0.2);

  // Later calls do not change it, however different their keys.
  Stream other(22u, B, H, D, D, {20.0});
  const auto [k2, v2] = other.next(S);
  (void)cache.update_and_fetch(k2, v2);
  EXPECT_NEAR(cache.concentration(), expected, 1e-9);
  EXPECT_EQ(coord->reports().at(0), cache.concentration());
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 5.4 step 6: reset and generations through the builder
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, BuilderResetStartsFreshRound) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 16, S = 40;
  constexpr int kAvg = 24, kSink = 2;
  auto caches = vc::KVCacheBuilder::for_model<T>(3, squeeze_config(kAvg, kSink));
  std::vector<vc::SqueezeAttentionCache<T>*> sq;
  for (auto& c : caches) {
    sq.push_back(dynamic_cast<vc::SqueezeAttentionCache<T>*>(c.get()));
    ASSERT_NE(sq.back(), nullptr);
  }
  const auto coord = sq[0]->coordinator();
  ASSERT_NE(coord, nullptr);

  auto run_sequence = [&](const std::vector<double>& alphas, std::uint32_t seed) {
    std::vector<double> expected_c;
    std::vector<Stream> streams;
    for (int l = 0; l < 3; ++l) {
      streams.emplace_back(seed + static_cast<std::uint32_t>(l), B, H, D, D,
                           std::vector<double>{alphas[static_cast<std::size_t>(l)]});
      const auto [k, v] = streams.back().next(S);
      expected_c.push_back(expected_concentration<T>(k));
      EXPECT_EQ(coord->is_finalized(), false) << l;
      (void)caches[static_cast<std::size_t>(l)]->update_and_fetch(k, v);
      EXPECT_EQ(coord->reports().size(), static_cast<std::size_t>(l + 1));
      EXPECT_EQ(sq[static_cast<std::size_t>(l)]->positions(0, 0).front(), 0);
      EXPECT_EQ(caches[static_cast<std::size_t>(l)]->offset(), S);
    }
    EXPECT_TRUE(coord->is_finalized());
    std::vector<double> c;
    for (int l = 0; l < 3; ++l) {
      c.push_back(sq[static_cast<std::size_t>(l)]->concentration());
      EXPECT_NEAR(c.back(), expected_c[static_cast<std::size_t>(l)], 1e-9);
      EXPECT_EQ(coord->reports().at(l), c.back());
    }
    const std::vector<int> budgets = ref::squeeze_budgets(c, kAvg, kSink, 1.0);
    for (int l = 0; l < 3; ++l) {
      const auto [k, v] = streams[static_cast<std::size_t>(l)].next(1);
      (void)caches[static_cast<std::size_t>(l)]->update_and_fetch(k, v);
      EXPECT_TRUE(sq[static_cast<std::size_t>(l)]->budget_adopted());
      EXPECT_EQ(sq[static_cast<std::size_t>(l)]->layer_budget(), budgets[static_cast<std::size_t>(l)]);
      EXPECT_EQ(coord->resolved_budget(l), std::optional<int>(budgets[static_cast<std::size_t>(l)]));
      EXPECT_EQ(caches[static_cast<std::size_t>(l)]->offset(), S + 1);
      EXPECT_EQ(sq[static_cast<std::size_t>(l)]->positions(0, 0).back(), S);
    }
    return budgets;
  };

  const std::vector<int> first = run_sequence({0.0, 4.0, 8.0}, 300u);
  EXPECT_GT(first[0], first[2]);
  EXPECT_EQ(coord->generation(), 0u);

  vc::KVCacheBuilder::reset(caches);
  EXPECT_EQ(coord->generation(), 1u);  // reset once although three caches share it
  EXPECT_FALSE(coord->is_finalized());
  EXPECT_TRUE(coord->reports().empty());
  for (int l = 0; l < 3; ++l) {
    const auto& c = *sq[static_cast<std::size_t>(l)];
    EXPECT_EQ(c.offset(), 0);
    EXPECT_EQ(c.tokens_kept(), 0);
    EXPECT_EQ(c.tokens_seen(), 0);
    EXPECT_EQ(c.kept_bytes(), 0u);
    EXPECT_EQ(c.concentration(), 0.0);
    EXPECT_FALSE(c.budget_adopted());
    EXPECT_EQ(c.layer_budget(), kAvg);
  }

  // The new sequence reverses the layers' concentrations; the budgets follow.
  const std::vector<int> second = run_sequence({8.0, 4.0, 0.0}, 400u);
  EXPECT_LT(second[0], second[2]);
  EXPECT_NE(first, second);
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 4.2-4.3: protected recent window in a long decode (no freeze)
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, LongDecodeKeepsNewestRowsEveryStep) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 16, Dv = 4;
  constexpr int kBudget = 32, kSink = 4, kSteps = 200;
  vc::KVCacheConfig config = squeeze_config(64, kSink);
  config.squeeze_resolved_budget = kBudget;  // takes precedence over squeeze_budget
  vc::SqueezeAttentionCache<T> cache(config);
  const int g = grace(kBudget, kSink);
  ASSERT_EQ(g, 14);
  EXPECT_EQ(cache.protected_recent(), g);
  EXPECT_EQ(cache.layer_budget(), kBudget);
  Stream stream(31u, B, H, D, Dv, {1.0});
  OracleLayer oracle(B, H, kSink);
  oracle.set_budget(kBudget);

  const auto [k, v] = stream.next(48);
  (void)cache.update_and_fetch(k, v);
  oracle.absorb(through<T>(k), through<T>(v));
  expect_matches_oracle(cache, oracle, "prefill");

  std::set<std::int64_t> evicted_decode_positions;
  for (int step = 0; step < kSteps; ++step) {
    const std::int64_t pos = cache.offset();
    const auto before = cache.state();
    std::vector<Positions> prev;
    for (Index h = 0; h < H; ++h) prev.push_back(cache.positions(0, h));
    const auto [ks, vs] = stream.next(1);
    const auto out = cache.update_and_fetch(ks, vs);
    oracle.absorb(through<T>(ks), through<T>(vs));

    // Window: the budget retained rows (as in state() before the call) plus the current token last.
    ASSERT_EQ(out.first.dimension(2), kBudget + 1) << step;
    ASSERT_EQ(out.second.dimension(2), kBudget + 1) << step;
    const D4 kst = through<T>(ks);
    bool window_ok = true;
    for (Index h = 0; h < H; ++h) {
      for (Index r = 0; r < kBudget; ++r) {
        for (Index d = 0; d < D; ++d) {
          window_ok = window_ok && out.first(0, h, r, d) == before.first(0, h, r, d);
        }
      }
      for (Index d = 0; d < D; ++d) {
        window_ok = window_ok && static_cast<double>(static_cast<float>(out.first(0, h, kBudget, d))) ==
                                     kst(0, h, 0, d);
      }
    }
    EXPECT_TRUE(window_ok) << "step " << step;

    for (Index h = 0; h < H; ++h) {
      const Positions now = cache.positions(0, h);
      ASSERT_EQ(now.size(), static_cast<std::size_t>(kBudget)) << step;
      // Sinks and the newest g positions (including the current token) are retained.
      for (std::int64_t p = 0; p < kSink; ++p) EXPECT_EQ(now[static_cast<std::size_t>(p)], p);
      for (int j = 0; j < g; ++j) {
        EXPECT_EQ(now[static_cast<std::size_t>(kBudget - g + j)], pos - g + 1 + j) << step;
      }
      // Exactly one row left: neither a sink nor one of the newest g.
      std::vector<std::int64_t> gone;
      Positions prev_plus = prev[static_cast<std::size_t>(h)];
      prev_plus.push_back(pos);
      std::set_difference(prev_plus.begin(), prev_plus.end(), now.begin(), now.end(),
                          std::back_inserter(gone));
      ASSERT_EQ(gone.size(), 1u) << step;
      EXPECT_GE(gone[0], kSink);
      EXPECT_LE(gone[0], pos - g);
      if (gone[0] >= 48) evicted_decode_positions.insert(gone[0]);
    }
    EXPECT_EQ(cache.offset(), pos + 1);
  }
  expect_matches_oracle(cache, oracle, "after 200 decode steps");
  // The cache does not freeze on early tokens: decode tokens pass through and leave.
  EXPECT_GT(evicted_decode_positions.size(), 50u);
  EXPECT_EQ(cache.offset(), 48 + kSteps);
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 4.4: what a call returns and retains
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, ReturnsAllRowsOfCallAndRetainsBudget) {
  using T = TypeParam;
  constexpr Index B = 2, H = 3, D = 8, Dv = 5;
  constexpr int kBudget = 8, kSink = 2;
  vc::KVCacheConfig config = squeeze_config(512, kSink);
  config.squeeze_resolved_budget = kBudget;
  vc::SqueezeAttentionCache<T> cache(config);
  Stream stream(41u, B, H, D, Dv, {0.0, 1.0, 2.0, 3.0, 4.0, 5.0});
  OracleLayer oracle(B, H, kSink);
  oracle.set_budget(kBudget);
  const std::size_t row_bytes = static_cast<std::size_t>(D + Dv) * sizeof(T);

  // Prefill of 40 > budget: every prompt row comes back, in ascending position, as T.
  const auto [k, v] = stream.next(40);
  const auto view = cache.update_and_view(k, v);
  EXPECT_EQ(view.rows(), 40);
  EXPECT_EQ(view.new_rows(), 40);
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      for (Index s = 0; s < 40; ++s) EXPECT_EQ(view.positions(b, h)(s), s);
    }
  }
  oracle.absorb(through<T>(k), through<T>(v));
  {
    // Same call through update_and_fetch on a twin cache: ascending positions 0..39.
    vc::SqueezeAttentionCache<T> twin(config);
    const auto out = twin.update_and_fetch(k, v);
    expect_tensor_eq<T>(out.first, through<T>(k), "prefill keys");
    expect_tensor_eq<T>(out.second, through<T>(v), "prefill values");
    EXPECT_EQ(twin.offset(), 40);
  }
  EXPECT_EQ(cache.offset(), 40);
  EXPECT_EQ(cache.tokens_kept(), kBudget);
  EXPECT_EQ(cache.tokens_seen(), B * H * 40);
  expect_rows_per_head(cache, kBudget, "after prefill");
  expect_matches_oracle(cache, oracle, "after prefill");
  EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * kBudget) * row_bytes);
  EXPECT_EQ(cache.full_seq_bytes(), static_cast<std::size_t>(B * H * 40) * row_bytes);
  EXPECT_DOUBLE_EQ(cache.compression_ratio(), 40.0 / kBudget);
  const auto st = cache.state();
  EXPECT_EQ(st.first.dimension(2), kBudget);
  EXPECT_EQ(st.second.dimension(3), Dv);

  // Decode through the view: budget + 1 rows, the current token last at position 40.
  const auto [kd, vd] = stream.next(1);
  std::vector<std::set<std::int64_t>> retained_before;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const Positions p = cache.positions(b, h);
      retained_before.emplace_back(p.begin(), p.end());
    }
  const auto dview = cache.update_and_view(kd, vd);
  oracle.absorb(through<T>(kd), through<T>(vd));
  EXPECT_EQ(dview.rows(), kBudget + 1);
  EXPECT_EQ(dview.new_rows(), 1);
  const D4 kdt = through<T>(kd);
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto pos = dview.positions(b, h);
      EXPECT_EQ(pos(kBudget), 40);
      std::set<std::int64_t> old_rows;
      for (Index r = 0; r < kBudget; ++r) old_rows.insert(pos(r));
      EXPECT_EQ(old_rows, retained_before[static_cast<std::size_t>(b * H + h)]);
      for (Index d = 0; d < D; ++d) {
        EXPECT_EQ(static_cast<double>(static_cast<float>(dview.keys(b, h)(kBudget, d))),
                  kdt(b, h, 0, d));
      }
    }
  }
  EXPECT_EQ(cache.offset(), 41);

  // Decode through update_and_fetch: the previous state then the new row, ascending.
  const auto [kd2, vd2] = stream.next(1);
  const D4 expected_window = oracle.window(through<T>(kd2));
  const auto out = cache.update_and_fetch(kd2, vd2);
  oracle.absorb(through<T>(kd2), through<T>(vd2));
  EXPECT_EQ(out.first.dimension(2), kBudget + 1);
  EXPECT_EQ(out.second.dimension(3), Dv);
  expect_tensor_eq<T>(out.first, expected_window, "decode window");
  EXPECT_EQ(cache.offset(), 42);
  expect_rows_per_head(cache, kBudget, "after decode");

  // A chunk of 5: 8 retained + 5 returned; offset counts tokens, never retained rows.
  const auto [kc, vc5] = stream.next(5);
  const D4 expected_chunk = oracle.window(through<T>(kc));
  const auto outc = cache.update_and_fetch(kc, vc5);
  oracle.absorb(through<T>(kc), through<T>(vc5));
  expect_tensor_eq<T>(outc.first, expected_chunk, "chunk window");
  EXPECT_EQ(outc.first.dimension(2), kBudget + 5);
  EXPECT_EQ(cache.offset(), 47);
  EXPECT_EQ(cache.tokens_seen(), B * H * 47);
  EXPECT_EQ(cache.full_seq_bytes(), static_cast<std::size_t>(B * H * 47) * row_bytes);
  expect_rows_per_head(cache, kBudget, "after chunk");
  expect_matches_oracle(cache, oracle, "after chunk");

  // S = 0: nothing changes, the retained set comes back.
  const auto [k0, v0] = stream.next(0);
  const auto out0 = cache.update_and_fetch(k0, v0);
  EXPECT_EQ(out0.first.dimension(2), kBudget);
  EXPECT_EQ(cache.offset(), 47);
  expect_matches_oracle(cache, oracle, "after empty call");
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 4.5: re-budget on adoption; ties keep the later positions
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SqueezeAttentionCacheTest, AdoptionTrimKeepsLaterPositionsOnTies) {
  using T = TypeParam;
  // D = 4. "A" rows (200, 0, 0, 0) and "Z" rows (10, -1, 0, 0): every query puts all its mass on
  // the A rows (the Z rows' logits are > 900 lower, so their weight underflows to exactly 0 in
  // float and in double). Z rows keep score exactly 0: exact ties.
  constexpr Index B = 1, H = 2, D = 4;
  constexpr int kAvg = 16, kSink = 2;
  const vc::KVCacheConfig config = squeeze_config(kAvg, kSink, /*defer=*/true);
  auto coord = std::make_shared<vc::SqueezeCoordinator>(2, kAvg, kSink, 0.0);  // strength 0: 16
  vc::SqueezeAttentionCache<T> cache(config, 0, coord);
  auto is_a = [](Index p) { return p < 2 || (p >= 21 && p <= 23) || p >= 33; };
  auto tokens = [&](Index first, Index count) {
    D4 k(B, H, count, D);
    k.setZero();
    D4 v(B, H, count, D);
    for (Index h = 0; h < H; ++h) {
      for (Index s = 0; s < count; ++s) {
        if (is_a(first + s)) {
          k(0, h, s, 0) = 200.0;
        } else {
          k(0, h, s, 0) = 10.0;
          k(0, h, s, 1) = -1.0;
        }
        for (Index d = 0; d < D; ++d) v(0, h, s, d) = static_cast<double>(first + s) + 0.25 * static_cast<double>(d);
      }
    }
    return std::make_pair(k, v);
  };
  OracleLayer oracle(B, H, kSink);
  const auto [k, v] = tokens(0, 40);
  (void)cache.update_and_fetch(k, v);
  oracle.absorb(through<T>(k), through<T>(v));
  expect_rows_per_head(cache, 40, "deferred prefill");
  for (Index h = 0; h < H; ++h) {
    const std::vector<float> s = cache.scores(0, h);
    for (Index p = 2; p < 33; ++p) {
      if (!is_a(p)) {
        // Mathematically e^-949 / n_A: zero (float and double underflow), so Z rows tie.
        EXPECT_LT(s[static_cast<std::size_t>(p)], 1e-30f) << "Z row " << p;
      }
    }
  }
  coord->report_concentration(1, 0.5);  // the other layer: the set is complete
  ASSERT_EQ(coord->resolved_budget(0), std::optional<int>(kAvg));

  // Adoption on the next call: keep sinks {0, 1}, the newest g = 7 (33..39), then the
  // highest scores among 2..32: A rows 21, 22, 23 and the four latest of the tied Z rows
  // (29..32). Then the decode token (A, position 40) evicts the earliest tied Z row (29).
  const auto [kd, vd] = tokens(40, 1);
  // The call returns the 40 rows retained before it (the re-budget applies at its start, after
  // the snapshot of what it returns), then itself.
  const D4 expected_window = oracle.window(through<T>(kd));
  const Positions before_trim = oracle.head(0, 0).positions();
  oracle.set_budget(kAvg);
  const Positions after_trim = {0, 1, 21, 22, 23, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39};
  EXPECT_EQ(oracle.head(0, 0).positions(), after_trim);
  const auto out = cache.update_and_fetch(kd, vd);
  oracle.absorb(through<T>(kd), through<T>(vd));
  EXPECT_TRUE(cache.budget_adopted());
  expect_tensor_eq<T>(out.first, expected_window, "window after tie trim");
  // Values travel with their keys: row r of the window holds the value of its position.
  ASSERT_EQ(out.second.dimension(2), static_cast<Index>(before_trim.size()) + 1);
  for (Index h = 0; h < H; ++h) {
    Positions window_positions;
    for (Index r = 0; r < out.second.dimension(2); ++r) {
      window_positions.push_back(
          static_cast<std::int64_t>(static_cast<float>(out.second(0, h, r, 0))));
    }
    Positions expected_positions = before_trim;
    expected_positions.push_back(40);
    EXPECT_EQ(window_positions, expected_positions) << "value rows of head " << h;
  }
  const Positions after_decode = {0, 1, 21, 22, 23, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40};
  for (Index h = 0; h < H; ++h) EXPECT_EQ(cache.positions(0, h), after_decode) << h;
  expect_matches_oracle(cache, oracle, "tie trim");
}

// ---------------------------------------------------------------------------------------------
// Builder end to end (docs/design.md 2.7 and the issue text)
// ---------------------------------------------------------------------------------------------

/// Runs a 6-layer model whose keys grow more clustered with depth: a prefill of 96 tokens per
/// layer, then 20 decode steps over all layers; returns each layer's concentration and budget.
template <class T>
struct ModelRun {
  std::vector<double> concentrations;
  std::vector<double> expected_concentrations;
  std::vector<int> budgets;
  std::vector<std::int64_t> kept;
};

template <class T>
ModelRun<T> run_six_layer_model(double strength) {
  constexpr Index B = 1, H = 2, D = 16, S = 96;
  constexpr int kLayers = 6, kAvg = 32, kSink = 4, kSteps = 20;
  vc::KVCacheConfig config = squeeze_config(kAvg, kSink);
  config.squeeze_strength = strength;
  auto caches = vc::KVCacheBuilder::for_model<T>(kLayers, config);
  const std::vector<double> alphas = {0.0, 1.0, 2.0, 3.0, 5.0, 8.0};
  std::vector<Stream> streams;
  ModelRun<T> run;
  for (int l = 0; l < kLayers; ++l) {
    streams.emplace_back(500u + static_cast<std::uint32_t>(l), B, H, D, D,
                         std::vector<double>{alphas[static_cast<std::size_t>(l)]});
    const auto [k, v] = streams.back().next(S);
    run.expected_concentrations.push_back(expected_concentration<T>(k));
    const auto out = caches[static_cast<std::size_t>(l)]->update_and_fetch(k, v);
    EXPECT_EQ(out.first.dimension(2), S);
  }
  for (int step = 0; step < kSteps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      const auto [k, v] = streams[static_cast<std::size_t>(l)].next(1);
      const std::int64_t kept_before = caches[static_cast<std::size_t>(l)]->tokens_kept();
      const auto out = caches[static_cast<std::size_t>(l)]->update_and_fetch(k, v);
      auto* sq = dynamic_cast<vc::SqueezeAttentionCache<T>*>(caches[static_cast<std::size_t>(l)].get());
      // The rows retained before the call (before a possible adoption re-budget) and the token.
      const std::int64_t b = sq->layer_budget();
      EXPECT_EQ(out.first.dimension(2), kept_before + 1) << "layer " << l;
      EXPECT_EQ(sq->tokens_kept(), std::min(kept_before + 1, b)) << "layer " << l;
    }
  }
  for (int l = 0; l < kLayers; ++l) {
    auto* sq = dynamic_cast<vc::SqueezeAttentionCache<T>*>(caches[static_cast<std::size_t>(l)].get());
    EXPECT_NE(sq, nullptr);
    if (sq == nullptr) return run;
    EXPECT_TRUE(sq->budget_adopted());
    EXPECT_EQ(sq->layer_id(), std::optional<int>(l));
    run.concentrations.push_back(sq->concentration());
    run.budgets.push_back(sq->layer_budget());
    run.kept.push_back(sq->tokens_kept());
    // Every head within its budget, the same count everywhere, sinks and newest g retained.
    const int g = grace(sq->layer_budget(), kSink);
    EXPECT_EQ(sq->protected_recent(), g);
    for (Index h = 0; h < H; ++h) {
      const Positions p = sq->positions(0, h);
      EXPECT_EQ(static_cast<std::int64_t>(p.size()), sq->tokens_kept());
      EXPECT_LE(p.size(), static_cast<std::size_t>(sq->layer_budget()));
      for (std::int64_t s = 0; s < kSink; ++s) EXPECT_EQ(p[static_cast<std::size_t>(s)], s);
      for (int j = 0; j < g; ++j) {
        EXPECT_EQ(p[p.size() - static_cast<std::size_t>(g) + static_cast<std::size_t>(j)],
                  S + kSteps - g + j);
      }
    }
    EXPECT_EQ(sq->offset(), S + kSteps);
  }
  return run;
}

TYPED_TEST(KVCacheBuilderSqueezeTest, SixLayerModelReallocatesByConcentration) {
  using T = TypeParam;
  constexpr int kAvg = 32, kSink = 4;
  const ModelRun<T> run = run_six_layer_model<T>(1.0);
  ASSERT_EQ(run.budgets.size(), 6u);
  for (std::size_t l = 0; l < 6; ++l) {
    EXPECT_NEAR(run.concentrations[l], run.expected_concentrations[l], 1e-9) << l;
  }
  EXPECT_EQ(run.budgets, ref::squeeze_budgets(run.concentrations, kAvg, kSink, 1.0));
  // Broad early layers get more than clustered late ones.
  EXPECT_GT(run.budgets.front(), run.budgets.back());
  EXPECT_GT(run.budgets.front(), kAvg);
  EXPECT_LT(run.budgets.back(), kAvg);
  for (std::size_t l = 1; l < 6; ++l) EXPECT_LE(run.budgets[l], run.budgets[l - 1]) << l;
  const double mean =
      std::accumulate(run.budgets.begin(), run.budgets.end(), 0.0) / static_cast<double>(6);
  EXPECT_GE(mean, 0.95 * kAvg);
  EXPECT_LE(mean, kAvg + kSink + 1);
  // Layers 0..4 evicted against the average during prefill and adopted at the first decode
  // step (20 steps to fill a larger budget); layer 5 completed the set and adopted at once.
  for (std::size_t l = 0; l < 5; ++l) {
    EXPECT_EQ(run.kept[l], std::min(run.budgets[l], kAvg + 20)) << l;
  }
  EXPECT_EQ(run.kept[5], run.budgets[5]);
}

TYPED_TEST(KVCacheBuilderSqueezeTest, StrengthZeroGivesEveryLayerTheAverage) {
  using T = TypeParam;
  const ModelRun<T> run = run_six_layer_model<T>(0.0);
  ASSERT_EQ(run.budgets.size(), 6u);
  EXPECT_EQ(run.budgets, std::vector<int>(6, 32));
  EXPECT_EQ(run.kept, std::vector<std::int64_t>(6, 32));
  // The concentrations still differ: only the strength makes the budgets uniform.
  EXPECT_GT(run.concentrations.back() - run.concentrations.front(), 0.3);
}

TYPED_TEST(KVCacheBuilderSqueezeTest, ForModelGivesStandardCachesToNonAttentionLayers) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 8, S = 30;
  constexpr int kAvg = 12, kSink = 2;
  const std::vector<std::optional<int>> dims = {8, std::nullopt, 8, std::nullopt, 8};
  auto caches = vc::KVCacheBuilder::for_model<T>(dims, squeeze_config(kAvg, kSink));
  ASSERT_EQ(caches.size(), 5u);
  std::shared_ptr<vc::SqueezeCoordinator> coord;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    auto* sq = dynamic_cast<vc::SqueezeAttentionCache<T>*>(caches[i].get());
    if (!dims[i]) {
      EXPECT_EQ(sq, nullptr) << i;
      EXPECT_TRUE(typeid(*caches[i]) == typeid(vc::KVCache<T>)) << i;
      EXPECT_TRUE(caches[i]->is_trimmable()) << i;
      continue;
    }
    ASSERT_NE(sq, nullptr) << i;
    EXPECT_FALSE(sq->is_trimmable());
    EXPECT_EQ(sq->layer_id(), std::optional<int>(static_cast<int>(i)));
    if (!coord) coord = sq->coordinator();
    EXPECT_EQ(sq->coordinator(), coord) << "one shared coordinator";
  }
  ASSERT_NE(coord, nullptr);
  EXPECT_EQ(coord->n_layers(), 3);
  EXPECT_EQ(coord->avg_budget(), kAvg);
  EXPECT_EQ(coord->n_sink(), kSink);

  std::vector<Stream> streams;
  const std::vector<double> alphas = {0.0, 9.0, 3.0, 9.0, 6.0};
  std::vector<double> expected_c;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    streams.emplace_back(600u + static_cast<std::uint32_t>(i), B, H, D, D,
                         std::vector<double>{alphas[i]});
    const auto [k, v] = streams.back().next(S);
    (void)caches[i]->update_and_fetch(k, v);
    if (dims[i]) expected_c.push_back(expected_concentration<T>(k));
    // Standard caches do not count: the set completes with the third attention layer (index 4).
    EXPECT_EQ(coord->is_finalized(), i == 4) << i;
  }
  const std::map<int, double> reports = coord->reports();
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_EQ(reports.count(0) + reports.count(2) + reports.count(4), 3u);
  EXPECT_NEAR(reports.at(0), expected_c[0], 1e-9);
  EXPECT_NEAR(reports.at(2), expected_c[1], 1e-9);
  EXPECT_NEAR(reports.at(4), expected_c[2], 1e-9);
  const std::vector<int> budgets =
      ref::squeeze_budgets({reports.at(0), reports.at(2), reports.at(4)}, kAvg, kSink, 1.0);
  EXPECT_EQ(coord->resolved_budget(0), std::optional<int>(budgets[0]));
  EXPECT_EQ(coord->resolved_budget(2), std::optional<int>(budgets[1]));
  EXPECT_EQ(coord->resolved_budget(4), std::optional<int>(budgets[2]));
  EXPECT_FALSE(coord->resolved_budget(1).has_value());
  EXPECT_FALSE(coord->resolved_budget(3).has_value());
  // Standard layers keep everything; their offset is the same.
  EXPECT_EQ(caches[1]->tokens_kept(), S);
  EXPECT_EQ(caches[3]->offset(), S);

  for (std::size_t i = 0; i < dims.size(); ++i) {
    const auto [k, v] = streams[i].next(1);
    (void)caches[i]->update_and_fetch(k, v);
  }
  EXPECT_EQ(caches[1]->tokens_kept(), S + 1);
  for (std::size_t a = 0; a < 3; ++a) {
    auto* sq = dynamic_cast<vc::SqueezeAttentionCache<T>*>(caches[2 * a].get());
    EXPECT_EQ(sq->layer_budget(), budgets[a]) << a;
    EXPECT_LE(sq->tokens_kept(), budgets[a]) << a;
  }
}

TYPED_TEST(KVCacheBuilderSqueezeTest, PyramidBudgetsFollowAttentionLayerOrder) {
  using T = TypeParam;
  constexpr Index B = 1, H = 1, D = 8, S = 250;
  vc::KVCacheConfig config;
  config.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  config.method = "pyramidkv";
  config.pyramid_budget = 100;
  config.pyramid_n_sink = 4;
  config.pyramid_beta = 2.0;
  const std::vector<int> expected = {195, 132, 68, 5};  // docs/design.md 6 vector (4, 100, 4, 2)
  ASSERT_EQ(ref::pyramid_budgets(4, 100, 4, 2.0), expected);
  const std::vector<std::optional<int>> dims = {8, std::nullopt, 8, 8, std::nullopt, 8};
  auto caches = vc::KVCacheBuilder::for_model<T>(dims, config);
  ASSERT_EQ(caches.size(), dims.size());
  std::size_t attn = 0;
  Stream stream(700u, B, H, D, D, {1.0});
  const auto [k, v] = stream.next(S);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    auto* py = dynamic_cast<vc::PyramidKVCache<T>*>(caches[i].get());
    (void)caches[i]->update_and_fetch(k, v);
    if (!dims[i]) {
      EXPECT_EQ(py, nullptr) << i;
      EXPECT_TRUE(typeid(*caches[i]) == typeid(vc::KVCache<T>)) << i;
      EXPECT_EQ(caches[i]->tokens_kept(), S) << i;
      continue;
    }
    ASSERT_NE(py, nullptr) << i;
    EXPECT_EQ(py->layer_budget(), expected[attn]) << i;
    EXPECT_EQ(py->tokens_kept(), expected[attn]) << i;
    EXPECT_EQ(py->protected_recent(), grace(expected[attn], 4)) << i;
    ++attn;
  }
  EXPECT_EQ(attn, 4u);

  // The n_layers overload: every layer attention-bearing, budgets in layer order.
  auto all = vc::KVCacheBuilder::for_model<T>(4, config);
  ASSERT_EQ(all.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    auto* py = dynamic_cast<vc::PyramidKVCache<T>*>(all[i].get());
    ASSERT_NE(py, nullptr) << i;
    EXPECT_EQ(py->layer_budget(), expected[i]) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// docs/design.md 5.4 step 1: the calibration window (squeeze_calibration_tokens)
// ---------------------------------------------------------------------------------------------

/// Tokens [s0, s0 + n) of a [B, H, S, D] double tensor.
D4 tokens(const D4& t, Index s0, Index n) {
  D4 out(t.dimension(0), t.dimension(1), n, t.dimension(3));
  for (Index b = 0; b < t.dimension(0); ++b)
    for (Index h = 0; h < t.dimension(1); ++h)
      for (Index s = 0; s < n; ++s)
        for (Index d = 0; d < t.dimension(3); ++d) out(b, h, s, d) = t(b, h, s0 + s, d);
  return out;
}

/// A prompt fed one token at a time gets the same concentrations, reports and per-layer budgets as
/// the same prompt fed as one prefill call (prompts of up to squeeze_calibration_tokens tokens,
/// then decode): the layers report in the call that completes 32 tokens, over those 32 keys.
TYPED_TEST(SqueezeAttentionCacheTest, TokenAtATimePromptGetsTheBudgetsOfOnePrefillCall) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 16;
  constexpr int kLayers = 3, kPrompt = 20, kTotal = 40;
  vc::KVCacheConfig c;
  c.squeeze_budget = 24;
  c.squeeze_n_sink = 2;
  ASSERT_EQ(c.squeeze_calibration_tokens, 32);
  std::vector<D4> keys, values;
  for (int l = 0; l < kLayers; ++l) {
    // Layers of different concentration, so the budgets differ.
    Stream stream(900u + static_cast<std::uint32_t>(l), B, H, D, D, {1.0 + 3.0 * l});
    auto [k, v] = stream.next(kTotal);
    keys.push_back(k);
    values.push_back(v);
  }
  auto one_call = vc::KVCacheBuilder::for_model<T>(kLayers, c);
  auto token_by_token = vc::KVCacheBuilder::for_model<T>(kLayers, c);
  const auto coordinator = [](const auto& caches) {
    return dynamic_cast<vc::SqueezeAttentionCache<T>&>(*caches.front()).coordinator();
  };
  for (int l = 0; l < kLayers; ++l) {
    (void)one_call[static_cast<std::size_t>(l)]->update_and_fetch(tokens(keys[l], 0, kPrompt),
                                                                  tokens(values[l], 0, kPrompt));
  }
  EXPECT_TRUE(coordinator(one_call)->reports().empty()) << "20 tokens are fewer than 32";
  for (Index s = 0; s < kPrompt; ++s) {
    for (int l = 0; l < kLayers; ++l) {
      (void)token_by_token[static_cast<std::size_t>(l)]->update_and_fetch(tokens(keys[l], s, 1),
                                                                          tokens(values[l], s, 1));
    }
  }
  EXPECT_TRUE(coordinator(token_by_token)->reports().empty());
  for (Index s = kPrompt; s < kTotal; ++s) {
    for (auto* model : {&one_call, &token_by_token}) {
      for (int l = 0; l < kLayers; ++l) {
        (void)(*model)[static_cast<std::size_t>(l)]->update_and_fetch(tokens(keys[l], s, 1),
                                                                      tokens(values[l], s, 1));
      }
    }
    // Both report in the call that completes 32 tokens (s = 31), not before.
    EXPECT_EQ(coordinator(one_call)->is_finalized(), s >= 31) << s;
    EXPECT_EQ(coordinator(token_by_token)->is_finalized(), s >= 31) << s;
  }
  EXPECT_EQ(coordinator(one_call)->reports(), coordinator(token_by_token)->reports());
  std::vector<int> budgets;
  for (int l = 0; l < kLayers; ++l) {
    const auto& a = dynamic_cast<const vc::SqueezeAttentionCache<T>&>(*one_call[static_cast<std::size_t>(l)]);
    const auto& b = dynamic_cast<const vc::SqueezeAttentionCache<T>&>(*token_by_token[static_cast<std::size_t>(l)]);
    EXPECT_TRUE(a.calibrated() && b.calibrated());
    EXPECT_EQ(a.concentration(), b.concentration()) << l;
    // The concentration of the first 32 keys, as stored.
    EXPECT_NEAR(a.concentration(), expected_concentration<T>(tokens(keys[l], 0, 32)), 1e-9) << l;
    EXPECT_EQ(a.layer_budget(), b.layer_budget()) << l;
    EXPECT_TRUE(a.budget_adopted() && b.budget_adopted()) << l;
    budgets.push_back(a.layer_budget());
  }
  EXPECT_NE(budgets.front(), budgets.back()) << "the layers' budgets should differ";
}

/// With a window of 10 tokens and calls of 3, a layer reports in its fourth call (12 tokens),
/// before that call's tokens are absorbed, over the keys of all four calls; until then its
/// concentration follows the keys seen so far. A rejected call during calibration changes nothing;
/// reset() starts calibrating again.
TYPED_TEST(SqueezeAttentionCacheTest, ReportsWhenTheCalibrationWindowIsFull) {
  using T = TypeParam;
  constexpr Index B = 2, H = 2, D = 8;
  vc::KVCacheConfig c = squeeze_config(6, 1);
  c.squeeze_calibration_tokens = 10;
  auto coord = std::make_shared<vc::SqueezeCoordinator>(2, 6, 1, 1.0);
  vc::SqueezeAttentionCache<T> cache(c, 0, coord);
  Stream stream(31u, B, H, D, D, {0.5, 2.0, 4.0, 8.0});
  const auto [k, v] = stream.next(12);
  for (int call = 0; call < 4; ++call) {
    if (call == 2) {
      // A call with a NaN key is rejected and leaves the calibration where it was.
      D4 bad = tokens(k, 3 * call, 3);
      bad(1, 1, 2, 3) = std::numeric_limits<double>::quiet_NaN();
      const double before = cache.concentration();
      EXPECT_THROW((void)cache.update_and_fetch(bad, tokens(v, 3 * call, 3)), std::invalid_argument);
      EXPECT_EQ(cache.concentration(), before);
    }
    (void)cache.update_and_fetch(tokens(k, 3 * call, 3), tokens(v, 3 * call, 3));
    const Index seen = 3 * (call + 1);
    EXPECT_NEAR(cache.concentration(), expected_concentration<T>(tokens(k, 0, seen)), 1e-9) << call;
    EXPECT_EQ(cache.calibrated(), call == 3) << call;
    EXPECT_EQ(coord->reports().count(0), call == 3 ? 1u : 0u) << call;
  }
  EXPECT_EQ(coord->reports().at(0), cache.concentration());
  // Calibrated: later keys no longer move it.
  const double frozen = cache.concentration();
  (void)cache.update_and_fetch(tokens(k, 0, 3), tokens(v, 0, 3));
  EXPECT_EQ(cache.concentration(), frozen);
  coord->reset();
  cache.reset();
  EXPECT_FALSE(cache.calibrated());
  EXPECT_EQ(cache.concentration(), 0.0);
  (void)cache.update_and_fetch(tokens(k, 0, 10), tokens(v, 0, 10));
  EXPECT_TRUE(cache.calibrated());
  EXPECT_NEAR(cache.concentration(), expected_concentration<T>(tokens(k, 0, 10)), 1e-9);
}

/// A deferring layer keeps every row until it reports (docs/design.md 5.4.4) and falls back to
/// squeeze_budget only in a call after its own report that still finds the coordinator
/// unfinalized, however many calls calibration took.
TYPED_TEST(SqueezeAttentionCacheTest, DeferringLayerFallsBackOnlyAfterItsOwnReport) {
  using T = TypeParam;
  constexpr Index B = 1, H = 2, D = 8;
  vc::KVCacheConfig c = squeeze_config(6, 1, /*defer=*/true);
  c.squeeze_calibration_tokens = 8;
  auto coord = std::make_shared<vc::SqueezeCoordinator>(2, 6, 1, 1.0);  // layer 1 never reports
  vc::SqueezeAttentionCache<T> cache(c, 0, coord);
  Stream stream(32u, B, H, D, D, {1.0});
  const auto [k, v] = stream.next(16);
  for (int call = 0; call < 4; ++call) {
    (void)cache.update_and_fetch(tokens(k, 3 * call, 3), tokens(v, 3 * call, 3));
    const bool reported = 3 * (call + 1) >= 8;  // the third call completes 8 tokens
    EXPECT_EQ(coord->reports().count(0), reported ? 1u : 0u) << call;
    if (call < 3) {
      // No budget yet: every row stays (3, 6, 9 rows).
      EXPECT_FALSE(cache.budget().has_value()) << call;
      EXPECT_EQ(cache.tokens_kept(), 3 * (call + 1)) << call;
    } else {
      // The call after the report falls back to squeeze_budget and is within it.
      EXPECT_EQ(cache.budget(), std::optional<int>(6));
      EXPECT_EQ(cache.tokens_kept(), 6);
    }
  }
}

}  // namespace
