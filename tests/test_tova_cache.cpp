// TOVACache<T> (docs/design.md 6, with 3, 4.4, 4.6, 7 and 8): the fast path against the
// double-precision TOVAHeadOracle of tests/reference/policy_oracles.hpp on random call sequences
// through the differential driver of support/oracle_driver.hpp (decode path, the general path and
// the blocked path across block boundaries; every update API, with and without queries), and the
// properties TOVA promises on its own: it is memoryless, exact ties evict the earliest position,
// sinks are never evicted, a head retains min(offset, budget) rows. Trim and bad input are part of
// the contract every cache keeps (test_contract.cpp); parallel heads: test_parallel.cpp.

// Internal invariants of the library are checked (and abort) even in Release builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/policy_oracles.hpp"
#include "support/oracle_driver.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)


/// [B, H, S, D] of uniform(lo, hi) entries rounded to T.
template <class T>
vc::Tensor4<T> uniform_tensor(std::mt19937& rng, Index B, Index H, Index S, Index D, double lo,
                              double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  vc::Tensor4<T> t(B, H, S, D);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(dist(rng));
  return t;
}

/// A [B, H, S, D] tensor whose every row is `row` (converted to T).
template <class T>
vc::Tensor4<T> repeated_rows(Index B, Index H, Index S, const std::vector<double>& row) {
  const auto D = static_cast<Index>(row.size());
  vc::Tensor4<T> t(B, H, S, D);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index s = 0; s < S; ++s)
        for (Index d = 0; d < D; ++d)
          t(b, h, s, d) = static_cast<T>(row[static_cast<std::size_t>(d)]);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Random runs against the oracle (support/oracle_driver.hpp)
// ---------------------------------------------------------------------------------------------

/// A TOVA subject of `budget` rows and `n_sink` sinks, checked fresh: its accessors, nothing held.
template <class T>
Subject<T> tova_subject(int budget, int n_sink) {
  Subject<T> s{nullptr, std::make_unique<vc::TOVACache<T>>(tova_config(budget, n_sink))};
  const auto& tova = dynamic_cast<const vc::TOVACache<T>&>(*s.cache);
  EXPECT_EQ(tova.layer_budget(), budget);
  EXPECT_EQ(tova.n_sink(), n_sink);
  EXPECT_FALSE(tova.is_trimmable());
  EXPECT_TRUE(tova.positions(0, 0).empty());
  EXPECT_TRUE(tova.scores(0, 0).empty());
  return s;
}

/// TOVA's own rule after every call: a head holds exactly min(offset, budget) rows.
template <class T>
std::function<std::string(std::int64_t)> holds_min_of_offset_and_budget(const vc::KVCache<T>& c,
                                                                         int budget) {
  return [&c, budget](std::int64_t offset) -> std::string {
    if (c.tokens_kept() == std::min<std::int64_t>(offset, budget)) return "";
    return "holds " + std::to_string(c.tokens_kept()) + " rows at offset " +
           std::to_string(offset) + ", not min(offset, budget)";
  };
}

/// Random runs over budgets {2, 3, 5, 8, 16, 40} x n_sink {0, 1, 4} (below the budget), with
/// random B, H in 1..3, D in {2, 4, 8, 16}, prefills above, below and up to the budget and across
/// blocks of 64, then 30-100 calls (some multi-token, some over 64 tokens, some empty) through
/// every update API without queries (decode path, general path, blocked path).
template <class T>
void run_grid(unsigned seed_base) {
  std::mt19937 rng(seed_base);
  int runs = 0, near_ties = 0, tie_divergences = 0, checked_calls = 0;
  int prefill_over = 0, prefill_under = 0, big_calls = 0, decode_evictions = 0;
  for (const int n_sink : {0, 1, 4}) {
    for (const int budget : {2, 3, 5, 8, 16, 40}) {
      if (n_sink >= budget) continue;
      for (int rep = 0; rep < 4; ++rep) {
        const RunDims dm = random_dims(rng);
        PlanShape shape;
        switch (rep) {
          case 0:  // above the budget, within a block
            shape.prefill = std::uniform_int_distribution<Index>(budget + 1, 2 * budget + 8)(rng);
            break;
          case 1:  // below the budget
            shape.prefill = std::uniform_int_distribution<Index>(1, std::max(1, budget - 1))(rng);
            break;
          case 2:  // above the budget, across block boundaries
            shape.prefill = std::uniform_int_distribution<Index>(65, 200)(rng);
            break;
          default:  // up to exactly the budget
            shape.prefill = std::uniform_int_distribution<Index>(1, budget)(rng);
            break;
        }
        (shape.prefill > budget ? prefill_over : prefill_under) += 1;
        shape.calls = std::uniform_int_distribution<int>(30, 100)(rng);
        shape.short_calls = 0.12;
        shape.short_max = budget + 5;
        shape.long_calls = 0.03;
        shape.apis.assign(std::begin(kProxyApis), std::end(kProxyApis));
        const auto seed = static_cast<unsigned>(rng());
        std::mt19937 run_rng(seed);
        Subject<T> subject = tova_subject<T>(budget, n_sink);
        TovaHeads oracle(static_cast<std::size_t>(dm.B * dm.H), n_sink, budget);
        RunChecks<T> checks;
        checks.what = "tova budget=" + std::to_string(budget) + " n_sink=" + std::to_string(n_sink) +
                      " B=" + std::to_string(dm.B) + " H=" + std::to_string(dm.H) +
                      " Dk=" + std::to_string(dm.Dk) + " Dv=" + std::to_string(dm.Dv) +
                      " seed=" + std::to_string(seed);
        checks.tolerate_near_ties = true;
        checks.after_call = holds_min_of_offset_and_budget(*subject.cache, budget);
        const RunOutcome r =
            run_against_oracle(subject, oracle, dm, random_plan(run_rng, shape), run_rng, checks);
        ++runs;
        if (r.near_tie) ++near_ties;
        if (r.diverged_at_tie) ++tie_divergences;
        ASSERT_EQ(r.failure, "");
        checked_calls += r.calls_checked;
        big_calls += r.big_evicting_calls;
        decode_evictions += r.decode_evictions;
      }
    }
  }
  std::printf(
      "[ stats    ] %d runs, %d calls checked (%d evicting calls of S > 64, %d evicting "
      "decode steps), %d met a near-tie, %d diverged after one\n",
      runs, checked_calls, big_calls, decode_evictions, near_ties, tie_divergences);
  EXPECT_EQ(runs, 64);
  EXPECT_GT(prefill_over, 20);
  EXPECT_GT(prefill_under, 20);
  EXPECT_GT(big_calls, 20);
  EXPECT_GT(decode_evictions, 1000);
  // A divergence after a near-tie of the oracle's decision ends a run early without failing it;
  // that must stay rare (at most 5% of runs).
  EXPECT_LE(tie_divergences * 20, runs)
      << tie_divergences << " of " << runs << " runs diverged after a near-tie";
  EXPECT_GT(checked_calls, runs * 25);
}

template <class T>
class TOVAOracleTest : public ::testing::Test {};
// Half and bfloat16 storage only: float rows give the same decisions with less rounding, and
// its paths run in the query sweeps, the contract suite and test_simd_* (docs/testing.md).
using SweepTypes = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(TOVAOracleTest, SweepTypes);

TYPED_TEST(TOVAOracleTest, MatchesOracleOnRandomCalls) { run_grid<TypeParam>(4004u); }

/// With real queries (docs/design.md 4.6: the token's G query heads, one token at a time even in
/// a multi-token call): 10 seeds covering G 1, 2, 4 and varying, D 3, 8, 20, budgets 8-40, n_sink
/// 0-4, 22 calls through every API with queries, bad queries injected; then reset() and 6 more.
TYPED_TEST(TOVAOracleTest, MatchesOracleWithQueriesOnRandomCalls) {
  using T = TypeParam;
  for (unsigned seed = 0; seed < 10; ++seed) {
    std::mt19937 rng(4242u + seed * 131u);
    const QuerySweepRun r = query_sweep_run(rng, seed);
    const RunDims dm = r.dims;
    const int budget = r.budget, n_sink = r.n_sink;
    RunChecks<T> checks;
    checks.what = r.describe("tova", seed);
    Subject<T> subject = tova_subject<T>(budget, n_sink);
    checks.after_call = holds_min_of_offset_and_budget(*subject.cache, budget);
    TovaHeads oracle(static_cast<std::size_t>(dm.B * dm.H), n_sink, budget);
    ASSERT_EQ(run_against_oracle(subject, oracle, dm, random_query_plan(rng, 22, r.G, r.vary_g), rng,
                                 checks)
                  .failure,
              "");
    subject.cache->reset();
    oracle.reset();
    checks.what += ", after reset()";
    ASSERT_EQ(run_against_oracle(subject, oracle, dm, random_query_plan(rng, 6, r.G, r.vary_g), rng,
                                 checks)
                  .failure,
              "");
  }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

template <class T>
class TOVACacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(TOVACacheTest, StorageTypes);

/// Memoryless (docs/design.md 6): two caches with different histories that reach the same retained rows make
/// the same evictions from then on. History A is the rows themselves; history B holds junk rows
/// that every later row attends to least (keys in the negative orthant against rows in the
/// positive one), so TOVA evicts exactly the junk on the way.
TYPED_TEST(TOVACacheTest, MemorylessSameRetainedRowsGiveSameEvictions) {
  using T = TypeParam;
  const int budget = 6;
  const Index B = 1, H = 2, D = 8, junk = 5;
  int checked = 0, old_row_evictions = 0;
  for (const int n_sink : {0, 2}) {
    for (const bool one_call : {false, true}) {
      const std::string ctx =
          "n_sink " + std::to_string(n_sink) + (one_call ? " (history in one call)" : "");
      std::mt19937 rng(static_cast<unsigned>(100 + 10 * n_sink + (one_call ? 1 : 0)));
      const vc::Tensor4<T> rk = uniform_tensor<T>(rng, B, H, budget, D, 0.5, 1.5);
      const vc::Tensor4<T> rv = random_tensor<T>(rng, B, H, budget, D);
      const vc::Tensor4<T> jk = uniform_tensor<T>(rng, B, H, junk, D, -1.5, -0.5);
      const vc::Tensor4<T> jv = random_tensor<T>(rng, B, H, junk, D);

      vc::TOVACache<T> a(tova_config(budget, n_sink));
      vc::TOVACache<T> b(tova_config(budget, n_sink));
      a.update_and_fetch(rk, rv);
      // History B: the sinks, the junk, then the other rows.
      const vc::Tensor4<T> sink_k = slice_s(rk, 0, n_sink), sink_v = slice_s(rv, 0, n_sink);
      const vc::Tensor4<T> rest_k = slice_s(rk, n_sink, budget - n_sink);
      const vc::Tensor4<T> rest_v = slice_s(rv, n_sink, budget - n_sink);
      if (one_call) {
        vc::Tensor4<T> hk(B, H, budget + junk, D), hv(B, H, budget + junk, D);
        // (Eigen asserts on concatenating an empty slice, so the sinks join only when there are any.)
        if (n_sink > 0) {
          hk = sink_k.concatenate(jk, 2).concatenate(rest_k, 2);
          hv = sink_v.concatenate(jv, 2).concatenate(rest_v, 2);
        } else {
          hk = jk.concatenate(rest_k, 2);
          hv = jv.concatenate(rest_v, 2);
        }
        b.update_and_fetch(hk, hv);
      } else {
        for (Index s = 0; s < n_sink; ++s)
          b.update_and_fetch(slice_s(sink_k, s, 1), slice_s(sink_v, s, 1));
        for (Index s = 0; s < junk; ++s) b.update_and_fetch(slice_s(jk, s, 1), slice_s(jv, s, 1));
        for (Index s = 0; s < budget - n_sink; ++s) {
          b.update_and_fetch(slice_s(rest_k, s, 1), slice_s(rest_v, s, 1));
        }
      }
      ASSERT_EQ(b.offset(), budget + junk) << ctx;
      ASSERT_TRUE(bytes_of(a.state().first) == bytes_of(b.state().first))
          << ctx << ": history B did not reach the same retained rows";
      ASSERT_TRUE(bytes_of(a.state().second) == bytes_of(b.state().second)) << ctx;

      const auto shifted = [&](const std::vector<std::int64_t>& pa) {
        std::vector<std::int64_t> out = pa;
        for (auto& p : out) p += p >= n_sink ? junk : 0;
        return out;
      };
      // The same tokens to both: random single tokens, one 9-token call, then more single tokens.
      for (int step = 0; step < 30; ++step) {
        const Index S = step == 12 ? 9 : 1;
        const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
        const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, D);
        const std::vector<std::int64_t> before = a.positions(0, 0);
        a.update_and_fetch(k, v);
        b.update_and_fetch(k, v);
        const vc::KVPair<T> sa = a.state(), sb = b.state();
        ASSERT_TRUE(bytes_of(sa.first) == bytes_of(sb.first)) << ctx << " step " << step;
        ASSERT_TRUE(bytes_of(sa.second) == bytes_of(sb.second)) << ctx << " step " << step;
        for (Index h = 0; h < H; ++h) {
          EXPECT_EQ(shifted(a.positions(0, h)), b.positions(0, h)) << ctx << " step " << step;
          const std::vector<float> sca = a.scores(0, h), scb = b.scores(0, h);
          ASSERT_EQ(sca.size(), scb.size());
          for (std::size_t r = 0; r < sca.size(); ++r) {
            EXPECT_TRUE(scores_close(static_cast<double>(scb[r]), static_cast<double>(sca[r])))
                << ctx << " step " << step << " row " << r;
          }
        }
        // Count evictions of a row retained before the step (not the newcomer itself).
        const std::vector<std::int64_t> after = a.positions(0, 0);
        for (const std::int64_t p : before) {
          if (!std::binary_search(after.begin(), after.end(), p)) ++old_row_evictions;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 120);
  EXPECT_GT(old_row_evictions, 40);  // the comparison saw real decisions, not just newcomers
}

/// Feeds `keys` row by row or in one call to a TOVA cache and an oracle; after every call the
/// retained positions must match the oracle's (exact ties included) and `want(offset)` if given.
template <class T>
void check_exact_sequence(const std::vector<std::vector<double>>& keys, int budget, int n_sink,
                          bool one_call,
                          const std::function<std::vector<std::int64_t>(std::int64_t)>& want,
                          const std::string& ctx) {
  const auto D = static_cast<Index>(keys.front().size());
  const auto n = static_cast<Index>(keys.size());
  vc::Tensor4<T> k(1, 2, n, D), v(1, 2, n, D);
  for (Index s = 0; s < n; ++s) {
    for (Index d = 0; d < D; ++d) {
      for (Index h = 0; h < 2; ++h) {
        k(0, h, s, d) =
            static_cast<T>(keys[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)]);
        v(0, h, s, d) = static_cast<T>(static_cast<double>(s % 7) - static_cast<double>(d));
      }
    }
  }
  vc::TOVACache<T> cache(tova_config(budget, n_sink));
  ref::TOVAHeadOracle oracle(n_sink, budget);
  if (one_call) {
    const vc::KVPair<T> out = cache.update_and_fetch(k, v);
    ASSERT_EQ(out.first.dimension(2), n) << ctx;
    for (Index s = 0; s < n; ++s) oracle.absorb(row_of(k, 0, 0, s), row_of(v, 0, 0, s));
    ASSERT_EQ(cache.positions(0, 0), oracle.positions()) << ctx;
    ASSERT_EQ(cache.positions(0, 1), oracle.positions()) << ctx;
    if (want) {
      EXPECT_EQ(cache.positions(0, 0), want(n)) << ctx;
    }
    return;
  }
  for (Index s = 0; s < n; ++s) {
    cache.update_and_fetch(slice_s(k, s, 1), slice_s(v, s, 1));
    oracle.absorb(row_of(k, 0, 0, s), row_of(v, 0, 0, s));
    ASSERT_EQ(cache.positions(0, 0), oracle.positions()) << ctx << " token " << s;
    ASSERT_EQ(cache.positions(0, 1), oracle.positions()) << ctx << " token " << s;
    if (want) {
      ASSERT_EQ(cache.positions(0, 0), want(s + 1)) << ctx << " token " << s;
    }
  }
}

/// Sinks plus the newest (budget - n_sink) other positions: what exact ties in every step give.
std::function<std::vector<std::int64_t>(std::int64_t)> fifo(int budget, int n_sink) {
  return [budget, n_sink](std::int64_t offset) {
    std::vector<std::int64_t> out;
    for (std::int64_t p = 0; p < offset; ++p) {
      if (p < n_sink || p >= std::max<std::int64_t>(n_sink, offset - (budget - n_sink))) {
        out.push_back(p);
      }
    }
    return out;
  };
}

/// Exact ties (identical keys, integer entries so every dot product is exact): the earliest
/// position among the lowest weights is evicted (docs/design.md 6), on the decode path, the general path and
/// the blocked path, with ties both below the maximum weight and at it.
TYPED_TEST(TOVACacheTest, ExactTiesEvictTheEarliestPosition) {
  using T = TypeParam;
  const std::vector<double> a = {1, 0, 1, 0, 0, 1, 0, 0};
  const std::vector<double> x = {1, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> z = {0, 0, 0, 0, 0, 0, 0, 0};
  for (const bool one_call : {false, true}) {
    for (const int n_sink : {0, 1, 3}) {
      const std::string mode = one_call ? " (one call)" : " (token by token)";
      // Ties below the maximum: `budget` a's, then x's. Each x attends to every a with the same
      // lower weight (so the earliest non-sink a goes, one per step), then to the x's with the same
      // top weight (so the earliest non-sink x goes): sinks plus the newest budget - n_sink tokens.
      // Budgets 6 and 7 put tied weights both in whole SIMD packets and in a scalar tail.
      for (const int budget : {6, 7}) {
        std::vector<std::vector<double>> keys(static_cast<std::size_t>(budget), a);
        for (int i = 0; i < 20; ++i) keys.push_back(x);
        check_exact_sequence<T>(
            keys, budget, n_sink, one_call, fifo(budget, n_sink),
            "a^" + std::to_string(budget) + " x^20 n_sink " + std::to_string(n_sink) + mode);
      }
      // Ties interleaved with higher rows: x a x a ... then x's: the a's go first, earliest
      // first, skipping sinks; later the x's tie.
      for (const int budget : {8, 10}) {
        std::vector<std::vector<double>> keys;
        for (int i = 0; i < budget / 2; ++i) {
          keys.push_back(x);
          keys.push_back(a);
        }
        for (int i = 0; i < 12; ++i) keys.push_back(x);
        check_exact_sequence<T>(keys, budget, n_sink, one_call, nullptr,
                                "(x a)^" + std::to_string(budget / 2) + " x^12 n_sink " +
                                    std::to_string(n_sink) + mode);
        if (!one_call && n_sink == 0 && budget == 8) {
          // Hand-checked: token 8 (x) evicts a at position 1, token 9 the a at 3, ...
          vc::TOVACache<T> cache(tova_config(budget, 0));
          for (std::size_t s = 0; s < keys.size(); ++s) {
            cache.update_and_fetch(repeated_rows<T>(1, 1, 1, keys[s]),
                                   repeated_rows<T>(1, 1, 1, keys[s]));
            if (s == 8) {
              EXPECT_EQ(cache.positions(0, 0), (std::vector<std::int64_t>{0, 2, 3, 4, 5, 6, 7, 8}));
            }
            if (s == 11) {
              EXPECT_EQ(cache.positions(0, 0),
                        (std::vector<std::int64_t>{0, 2, 4, 6, 8, 9, 10, 11}));
            }
            if (s == 12) {  // all x now: tie at the top, the earliest goes
              EXPECT_EQ(cache.positions(0, 0),
                        (std::vector<std::int64_t>{2, 4, 6, 8, 9, 10, 11, 12}));
            }
          }
        }
      }
      // All keys zero: every weight is exactly 1/n.
      {
        const int budget = 5;
        std::vector<std::vector<double>> keys(40, z);
        check_exact_sequence<T>(keys, budget, n_sink, one_call, fifo(budget, n_sink),
                                "zero keys n_sink " + std::to_string(n_sink) + mode);
      }
    }
  }
  // One call of 150 identical keys crosses two block boundaries (64, 128).
  for (const int n_sink : {0, 2, 4}) {
    std::vector<std::vector<double>> keys(150, x);
    check_exact_sequence<T>(keys, 5, n_sink, true, fifo(5, n_sink),
                            "x^150 in one call, n_sink " + std::to_string(n_sink));
    std::vector<std::vector<double>> mixed;
    for (int i = 0; i < 150; ++i) mixed.push_back(i % 3 == 1 ? a : x);
    check_exact_sequence<T>(mixed, 9, n_sink, true, nullptr,
                            "(x a x)^50 in one call, n_sink " + std::to_string(n_sink));
    check_exact_sequence<T>(mixed, 9, n_sink, false, nullptr,
                            "(x a x)^50 token by token, n_sink " + std::to_string(n_sink));
  }
}

/// Sinks are never evicted, even when every new token attends to them least (docs/design.md 1, 6).
TYPED_TEST(TOVACacheTest, NeverEvictsASink) {
  using T = TypeParam;
  const Index B = 2, H = 2, D = 8;
  for (const int n_sink : {1, 3}) {
    for (const bool blocked : {false, true}) {
      const int budget = 5;
      std::mt19937 rng(static_cast<unsigned>(7 * n_sink + (blocked ? 1 : 0)));
      vc::TOVACache<T> cache(tova_config(budget, n_sink));
      std::vector<ref::TOVAHeadOracle> oracle(static_cast<std::size_t>(B * H),
                                              ref::TOVAHeadOracle(n_sink, budget));
      // Sinks anti-aligned with everything that follows.
      const vc::Tensor4<T> sk = uniform_tensor<T>(rng, B, H, n_sink, D, -1.5, -0.5);
      const vc::Tensor4<T> sv = random_tensor<T>(rng, B, H, n_sink, D);
      cache.update_and_fetch(sk, sv);
      for (Index hi = 0; hi < B * H; ++hi)
        for (Index s = 0; s < n_sink; ++s)
          oracle[static_cast<std::size_t>(hi)].absorb(row_of(sk, hi / H, hi % H, s),
                                                      row_of(sv, hi / H, hi % H, s));
      std::int64_t offset = n_sink;
      int sink_was_lowest = 0;
      for (int step = 0; step < 40; ++step) {
        const Index S = blocked ? (step % 2 == 0 ? 100 : 3) : 1;
        const vc::Tensor4<T> k = uniform_tensor<T>(rng, B, H, S, D, 0.5, 1.5);
        const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, D);
        for (Index hi = 0; hi < B * H; ++hi) {
          auto& o = oracle[static_cast<std::size_t>(hi)];
          for (Index s = 0; s < S; ++s) {
            o.absorb(row_of(k, hi / H, hi % H, s), row_of(v, hi / H, hi % H, s));
            const std::vector<double> w = o.last_weights();
            // Would a sink-blind policy have evicted a sink? (the lowest weight is a sink's)
            if (!w.empty() && std::min_element(w.begin(), w.end()) - w.begin() < n_sink) {
              ++sink_was_lowest;
            }
          }
        }
        cache.update_and_fetch(k, v);
        offset += S;
        for (Index b = 0; b < B; ++b) {
          for (Index h = 0; h < H; ++h) {
            const std::vector<std::int64_t> pos = cache.positions(b, h);
            ASSERT_EQ(static_cast<std::int64_t>(pos.size()),
                      std::min<std::int64_t>(offset, budget));
            for (int p = 0; p < n_sink; ++p) ASSERT_EQ(pos[static_cast<std::size_t>(p)], p);
            ASSERT_EQ(pos, oracle[static_cast<std::size_t>(b * H + h)].positions())
                << "n_sink " << n_sink << " step " << step;
          }
        }
      }
      EXPECT_EQ(cache.offset(), offset);
      EXPECT_GT(sink_was_lowest, 100) << "the sinks were never the least attended";
    }
  }
}

/// The current token is a candidate too (docs/design.md 6: attention over every row including itself): when
/// it gets the least weight it is evicted at once, yet the call still returned it (docs/design.md 4.4).
TYPED_TEST(TOVACacheTest, CurrentTokenIsEvictedWhenItGetsTheLeastWeight) {
  using T = TypeParam;
  const std::vector<double> big = {2, 2, 2, 2};
  const std::vector<double> small = {0.125, 0.125, 0.125, 0.125};  // self dot 1/16, others 1
  vc::TOVACache<T> cache(tova_config(4, 1));
  cache.update_and_fetch(repeated_rows<T>(1, 1, 4, big), repeated_rows<T>(1, 1, 4, big));
  for (int step = 0; step < 5; ++step) {
    const vc::Tensor4<T> k = repeated_rows<T>(1, 1, 1, small);
    const vc::Tensor4<T> v = repeated_rows<T>(1, 1, 1, {9, 8, 7, 6});
    const vc::KVPair<T> out = cache.update_and_fetch(k, v);
    ASSERT_EQ(out.first.dimension(2), 5);
    EXPECT_EQ(static_cast<float>(out.first(0, 0, 4, 0)), 0.125f);  // the current token, last
    EXPECT_EQ(static_cast<float>(out.second(0, 0, 4, 0)), 9.0f);
    EXPECT_EQ(cache.positions(0, 0), (std::vector<std::int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(cache.offset(), 5 + step);
    // Its weight was the lowest: below every kept row's.
    const std::vector<float> sc = cache.scores(0, 0);
    ASSERT_EQ(sc.size(), 4u);
    const float total = sc[0] + sc[1] + sc[2] + sc[3];
    EXPECT_LT(total, 1.0f);
    for (const float s : sc) EXPECT_GT(s, 1.0f - total);
  }
}

/// After every call a head retains exactly min(offset, budget) rows (docs/design.md 4.4, 6).
TYPED_TEST(TOVACacheTest, RetainsMinOfOffsetAndBudgetRows) {
  using T = TypeParam;
  std::mt19937 rng(31);
  const Index B = 2, H = 3, Dk = 4, Dv = 2;
  for (const int budget : {1, 2, 7}) {
    const int n_sink = budget > 1 ? 1 : 0;
    vc::TOVACache<T> cache(tova_config(budget, n_sink));
    std::int64_t offset = 0;
    for (const Index S : {Index{1}, Index{1}, Index{3}, Index{0}, Index{1}, Index{9}, Index{1},
                          Index{70}, Index{1}, Index{2}}) {
      const vc::KVPair<T> out = cache.update_and_fetch(random_tensor<T>(rng, B, H, S, Dk),
                                                       random_tensor<T>(rng, B, H, S, Dv));
      const std::int64_t n_before = std::min<std::int64_t>(offset, budget);
      offset += S;
      ASSERT_EQ(out.first.dimension(2), S == 0 ? n_before : n_before + S);
      ASSERT_EQ(out.second.dimension(2), out.first.dimension(2));
      const std::int64_t n = std::min<std::int64_t>(offset, budget);
      EXPECT_EQ(cache.offset(), offset);
      EXPECT_EQ(cache.tokens_kept(), n);
      EXPECT_EQ(cache.state().first.dimension(2), n);
      for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h) {
          EXPECT_EQ(static_cast<std::int64_t>(cache.positions(b, h).size()), n);
          EXPECT_EQ(static_cast<std::int64_t>(cache.scores(b, h).size()), n);
        }
      EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * n * (Dk + Dv)) * sizeof(T));
      EXPECT_EQ(cache.full_seq_bytes(),
                static_cast<std::size_t>(B * H * offset * (Dk + Dv)) * sizeof(T));
    }
  }
}

}  // namespace
