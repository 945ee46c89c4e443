// SnapKVCache<T> (docs/design.md 6, SnapKV) against the naive double-precision SnapKVHeadOracle of
// tests/reference/policy_oracles.hpp on random call sequences (the driver of
// support/oracle_driver.hpp: every update API, with and without queries, compressed() after every
// call), plus hand-built cases: no causal mask
// in the scoring, exact ties keep the earliest row, a chunk ranks the rows held before it and keeps
// the sinks, which calls compress (SPEC 13.3: every prompt chunk past the budget; decode steps
// never), reset() re-arms the compression, validation at
// construction, bad input with the strong guarantee (docs/design.md 8, including calls that would
// compress) and bounded memory over a long decode. Parallel heads: test_parallel.cpp.

// Internal invariants of the library are checked (and abort) even in Release builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/policy_oracles.hpp"
#include "support/oracle_driver.hpp"
#include "support/storage_types.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)
using Positions = std::vector<std::int64_t>;


/// Call-relative indices SnapKV keeps from scores `score`: the first `sinks`, then the best others
/// (ties: earliest). Returns them ascending.
std::vector<std::size_t> selection(const std::vector<double>& score, int budget, int n_sink) {
  const std::size_t sinks = static_cast<std::size_t>(std::min(n_sink, budget));
  std::vector<std::size_t> others;
  for (std::size_t r = sinks; r < score.size(); ++r) others.push_back(r);
  std::stable_sort(others.begin(), others.end(),
                   [&score](std::size_t x, std::size_t y) { return score[x] > score[y]; });
  std::vector<std::size_t> keep;
  for (std::size_t r = 0; r < sinks && r < score.size(); ++r) keep.push_back(r);
  for (std::size_t k = 0; k < others.size() && k + sinks < static_cast<std::size_t>(budget); ++k)
    keep.push_back(others[k]);
  std::sort(keep.begin(), keep.end());
  return keep;
}

// ---------------------------------------------------------------------------------------------
// Random sequences against the oracle (support/oracle_driver.hpp)
// ---------------------------------------------------------------------------------------------

/// A SnapKV subject, checked fresh: its accessors, not compressed.
template <class T>
Subject<T> snap_subject(int budget, int n_sink, int obs_window) {
  Subject<T> s{nullptr,
               std::make_unique<vc::SnapKVCache<T>>(snap_config(budget, n_sink, obs_window))};
  const auto& snap = dynamic_cast<const vc::SnapKVCache<T>&>(*s.cache);
  EXPECT_EQ(snap.layer_budget(), budget);
  EXPECT_EQ(snap.obs_window(), obs_window);
  EXPECT_EQ(snap.n_sink(), n_sink);
  EXPECT_FALSE(snap.compressed());
  return s;
}

/// SnapKV's own state after every call: compressed() as the oracle's.
template <class T>
std::function<std::string(std::int64_t)> compressed_as_oracle(const vc::KVCache<T>& c,
                                                              const SnapHeads& oracle) {
  return [&c, &oracle](std::int64_t) -> std::string {
    const bool got = dynamic_cast<const vc::SnapKVCache<T>&>(c).compressed();
    if (got == oracle.compressed()) return "";
    return std::string("compressed() is ") + (got ? "true" : "false") + ", oracle disagrees";
  };
}

/// The grid: budgets x n_sink x obs_window, each with a long first call (sizes cycling through
/// just-above-budget, up to 2 budget, > 64 and > 200) and with short first calls (one of exactly
/// `budget`) before the long one; then decode steps, empty calls, short calls and long calls that
/// must not be compressed; every call through an update API without queries drawn at random.
template <class T>
void run_grid(unsigned seed_base) {
  std::mt19937 rng(seed_base);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<std::size_t> api(0, std::size(kProxyApis) - 1);
  int runs = 0, near_ties = 0, tie_divergences = 0, checked = 0;
  int over_64 = 0, over_200 = 0, short_first = 0, exact_budget_first = 0, window_over_s = 0;
  int long_after = 0;
  for (const int budget : {3, 8, 20, 64}) {
    for (const int n_sink : {0, 1, 4}) {
      if (n_sink >= budget) continue;
      for (const int obs : {1, 4, 32, 100}) {
        for (int mode = 0; mode < 2; ++mode) {
          const RunDims dm = random_dims(rng);
          std::vector<Index> calls;
          if (mode == 1) {  // short calls first: they append, even past the budget
            const int n_short = std::uniform_int_distribution<int>(1, 3)(rng);
            const int exact_at =
                (runs / 2) % 2 == 0 ? std::uniform_int_distribution<int>(0, n_short - 1)(rng) : -1;
            for (int i = 0; i < n_short; ++i) {
              calls.push_back(i == exact_at ? budget
                                            : std::uniform_int_distribution<Index>(1, budget)(rng));
            }
            if (exact_at >= 0) ++exact_budget_first;
            ++short_first;
          }
          Index prompt = 0;
          switch ((runs / 2 + runs / 8) % 4) {  // not tied to obs_window's cycle
            case 0:
              prompt = budget + 1;
              break;
            case 1:
              prompt = std::uniform_int_distribution<Index>(budget + 2, 2 * budget + 8)(rng);
              break;
            case 2:
              prompt = std::uniform_int_distribution<Index>(std::max(65, budget + 1), 140)(rng);
              break;
            default:
              prompt = std::uniform_int_distribution<Index>(201, 240)(rng);
              break;
          }
          if (prompt > 64) ++over_64;
          if (prompt > 200) ++over_200;
          if (obs > prompt) ++window_over_s;
          calls.push_back(prompt);
          int long_calls_after = 0;
          const int follow = std::uniform_int_distribution<int>(15, 40)(rng);
          for (int i = 0; i < follow; ++i) {
            const double r = u01(rng);
            if (i == 1 || r < 0.08) {
              calls.push_back(
                  std::uniform_int_distribution<Index>(budget + 1, 2 * budget + 10)(rng));
              ++long_calls_after;
            } else if (r < 0.13) {
              calls.push_back(0);
            } else if (r < 0.28) {
              calls.push_back(std::uniform_int_distribution<Index>(2, budget)(rng));
            } else {
              calls.push_back(1);
            }
          }
          std::vector<DriverCall> plan;
          for (const Index S : calls) plan.push_back(DriverCall{S, kProxyApis[api(rng)], 1, false});
          const auto seed = static_cast<unsigned>(rng());
          std::mt19937 run_rng(seed);
          Subject<T> subject = snap_subject<T>(budget, n_sink, obs);
          SnapHeads oracle(static_cast<std::size_t>(dm.B * dm.H), n_sink, budget, obs);
          RunChecks<T> checks;
          checks.what = "snapkv budget=" + std::to_string(budget) + " n_sink=" +
                        std::to_string(n_sink) + " obs_window=" + std::to_string(obs) +
                        " B=" + std::to_string(dm.B) + " H=" + std::to_string(dm.H) +
                        " Dk=" + std::to_string(dm.Dk) + " Dv=" + std::to_string(dm.Dv) +
                        " seed=" + std::to_string(seed);
          checks.tolerate_near_ties = true;
          checks.after_call = compressed_as_oracle(*subject.cache, oracle);
          const RunOutcome r = run_against_oracle(subject, oracle, dm, plan, run_rng, checks);
          ++runs;
          if (r.near_tie) ++near_ties;
          if (r.diverged_at_tie) ++tie_divergences;
          ASSERT_EQ(r.failure, "");
          if (!r.diverged_at_tie) {
            EXPECT_TRUE(oracle.compressed()) << checks.what;
            long_after += long_calls_after;
          }
          checked += r.calls_checked;
        }
      }
    }
  }
  std::printf("[ stats    ] %d runs, %d calls checked, %d met a near-tie, %d diverged after one\n",
              runs, checked, near_ties, tie_divergences);
  EXPECT_EQ(runs, 88);
  EXPECT_GT(over_64, 10);
  EXPECT_GT(over_200, 10);
  EXPECT_GT(short_first, 10);
  EXPECT_GT(exact_budget_first, 5);
  EXPECT_GT(window_over_s, 5);
  EXPECT_GT(long_after, runs);
  EXPECT_LE(tie_divergences * 20, runs)
      << tie_divergences << " of " << runs << " runs diverged after a near-tie";
  EXPECT_GT(checked, runs * 15);
}

template <class T>
class SnapKVOracleTest : public ::testing::Test {};
// Half and bfloat16 storage only: float rows give the same decisions with less rounding, and
// its paths run in the query sweeps, the contract suite and test_simd_* (docs/testing.md).
using SweepTypes = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(SnapKVOracleTest, SweepTypes);

TYPED_TEST(SnapKVOracleTest, MatchesOracleOnRandomCallSequences) {
  run_grid<TypeParam>(4004u + static_cast<unsigned>(sizeof(TypeParam)));
}

/// With real queries (docs/design.md 4.6: the observation window's G query heads per token):
/// 10 seeds covering G 1, 2, 4 and D 3, 8, 20, budgets 8-40, n_sink 0-4, obs_window 1-40; up to
/// two short calls (appended), the call that is compressed, then decode, multi-token and long
/// calls (appended), through every API with queries, bad queries injected; then reset() re-arms
/// the compression: the next long call is compressed again.
TYPED_TEST(SnapKVOracleTest, MatchesOracleWithQueriesOnRandomCallSequences) {
  using T = TypeParam;
  for (unsigned seed = 0; seed < 10; ++seed) {
    std::mt19937 rng(777u + seed * 57u);
    const auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const auto any_api = [&] { return kAllQueryApis[pick(0, 3)]; };
    const QuerySweepRun r = query_sweep_run(rng, seed);
    const RunDims dm = r.dims;
    const Index G = r.G;  // one G through the run
    const int budget = r.budget, n_sink = r.n_sink;
    const int obs = pick(1, 40);
    RunChecks<T> checks;
    checks.what = r.describe("snapkv", seed) + " obs_window=" + std::to_string(obs);
    Subject<T> subject = snap_subject<T>(budget, n_sink, obs);
    SnapHeads oracle(static_cast<std::size_t>(dm.B * dm.H), n_sink, budget, obs);
    checks.after_call = compressed_as_oracle(*subject.cache, oracle);
    std::vector<DriverCall> plan;
    const int n_short = pick(0, 2);
    for (int i = 0; i < n_short; ++i) {
      plan.push_back(DriverCall{pick(1, budget), any_api(), G, pick(0, 4) == 0});
    }
    plan.push_back(DriverCall{pick(budget + 1, 150), any_api(), G, pick(0, 2) == 0});
    for (DriverCall p : random_query_plan(rng, 14, G, false)) {
      if (p.S == 0 && pick(0, 1) == 0) p.S = pick(budget + 1, 80);  // a long call, appended
      if (plan.size() == static_cast<std::size_t>(n_short) + 1) p.S = 1;  // the plan's prefill
      plan.push_back(p);
    }
    ASSERT_EQ(run_against_oracle(subject, oracle, dm, plan, rng, checks).failure, "");
    EXPECT_TRUE(oracle.compressed()) << checks.what;
    subject.cache->reset();
    oracle.reset();
    EXPECT_FALSE(dynamic_cast<const vc::SnapKVCache<T>&>(*subject.cache).compressed());
    std::vector<DriverCall> again = {DriverCall{pick(budget + 1, 150), any_api(), G, true}};
    for (int i = 0; i < 4; ++i) again.push_back(DriverCall{1, kQueryApis[i % 3], G, false});
    checks.what += ", after reset()";
    ASSERT_EQ(run_against_oracle(subject, oracle, dm, again, rng, checks).failure, "");
    EXPECT_TRUE(oracle.compressed()) << checks.what;
  }
}

// ---------------------------------------------------------------------------------------------
// Hand-built cases
// ---------------------------------------------------------------------------------------------

template <class T>
class SnapKVCacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(SnapKVCacheTest, StorageTypes);

// With keys s * e (D = 2), logit = s^2 dot(e_r, e_q) / sqrt(2) = ln2 dot(e_r, e_q): every weight of
// the hand example is a ratio of small integers (as in tests/test_policy_oracles.cpp).
const double kSnapScale = std::sqrt(std::sqrt(2.0) * std::log(2.0));
//   e0 = (0, 0)  e1 = (2, 0)  e2 = (0, 1)  e3 = (1, 1)  e4 = (1, -1)
const Rows kSnapE = {{0.0, 0.0}, {2.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}, {1.0, -1.0}};

/// No causal mask: both proxies (e3, e4) attend over all five rows. Scores (15, 60, 18, 36, 39)/168:
/// keep p0 (sink), p1 and p4. A causal mask (e3 sees rows 0..3 only) would keep p3 instead of p4.
TYPED_TEST(SnapKVCacheTest, ScoringHasNoCausalMask) {
  using T = TypeParam;
  const Rows keys = scaled(kSnapE, kSnapScale);
  const vc::Tensor4<T> k = tensor_of<T>(keys);
  const vc::Tensor4<T> v = tensor_of<T>(value_rows(5));
  const Rows stored = rows_of(k, 0, 0);  // keys as the cache stores them

  // The example discriminates: with a causal mask the kept set would differ.
  EXPECT_EQ(selection(snap_call_scores(stored, 2, /*causal=*/true), 3, 1),
            (std::vector<std::size_t>{0, 1, 3}));
  EXPECT_EQ(selection(snap_call_scores(stored, 2), 3, 1), (std::vector<std::size_t>{0, 1, 4}));

  vc::SnapKVCache<T> cache(snap_config(3, 1, 2));
  const vc::KVPair<T> out = cache.update_and_fetch(k, v);
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(out.first.dimension(2), 5);  // the compressing call returns all of its rows
  EXPECT_EQ(cache.positions(0, 0), (Positions{0, 1, 4}));
  const std::vector<float> sc = cache.scores(0, 0);
  ASSERT_EQ(sc.size(), 3u);
  ref::SnapKVHeadOracle oracle(1, 3, 2);
  oracle.absorb_call(stored, value_rows(5));
  ASSERT_EQ(oracle.positions(), (Positions{0, 1, 4}));
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(scores_close(static_cast<double>(sc[r]), oracle.rows()[r].score))
        << "row " << r << ": " << sc[r] << " vs " << oracle.rows()[r].score;
  }
  if (std::is_same_v<T, float>) {
    EXPECT_NEAR(sc[0], 15.0 / 168.0, 1e-6);
    EXPECT_NEAR(sc[1], 60.0 / 168.0, 1e-6);
    EXPECT_NEAR(sc[2], 39.0 / 168.0, 1e-6);
  }
  const vc::KVPair<T> st = cache.state();
  EXPECT_EQ(to_double(st.second(0, 0, 2, 0)), 104.0);  // p4's value travelled with its key
}

/// obs_window larger than S uses every key of the call; obs_window 1 only the last
/// (keys s'(1, 0, -1), D = 1, s'^2 = ln2): means (22, 19, 22)/63 vs (1, 2, 4)/7.
TYPED_TEST(SnapKVCacheTest, ObsWindowLongerThanTheCallUsesEveryKey) {
  using T = TypeParam;
  const double s = std::sqrt(std::log(2.0));
  const Rows keys = {{s}, {0.0}, {-s}};
  vc::SnapKVCache<T> wide(snap_config(2, 0, 100));
  wide.update_and_fetch(tensor_of<T>(keys), tensor_of<T>(value_rows(3)));
  EXPECT_EQ(wide.positions(0, 0), (Positions{0, 2}));
  vc::SnapKVCache<T> narrow(snap_config(2, 0, 1));
  narrow.update_and_fetch(tensor_of<T>(keys), tensor_of<T>(value_rows(3)));
  EXPECT_EQ(narrow.positions(0, 0), (Positions{1, 2}));
  const std::vector<float> sc = narrow.scores(0, 0);
  ASSERT_EQ(sc.size(), 2u);
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-2;  // s rounded to T
  EXPECT_NEAR(sc[0], 2.0 / 7.0, tol);
  EXPECT_NEAR(sc[1], 4.0 / 7.0, tol);
}

/// Exact ties (identical keys give identical scores) keep the earliest position: small calls.
TYPED_TEST(SnapKVCacheTest, ExactTiesKeepTheEarliest) {
  using T = TypeParam;
  {  // e4 == e1: scores (19, 38, 27, 54, 38)/176; budget 3, n_sink 1 -> p0, p3 and p1 (not p4).
    const Rows e = {{0.0, 0.0}, {1.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}, {1.0, 0.0}};
    vc::SnapKVCache<T> cache(snap_config(3, 1, 2));
    cache.update_and_fetch(tensor_of<T>(scaled(e, kSnapScale)), tensor_of<T>(value_rows(5)));
    EXPECT_EQ(cache.positions(0, 0), (Positions{0, 1, 3}));
    const std::vector<float> sc = cache.scores(0, 0);
    ASSERT_EQ(sc.size(), 3u);
    EXPECT_NEAR(sc[1], 38.0 / 176.0, 1e-3);
  }
  {  // All keys equal: every score 1/S; the earliest rows survive.
    vc::SnapKVCache<T> cache(snap_config(3, 0, 2));
    cache.update_and_fetch(tensor_of<T>(Rows(6, {0.5, -0.25})), tensor_of<T>(value_rows(6)));
    EXPECT_EQ(cache.positions(0, 0), (Positions{0, 1, 2}));
  }
}

/// A long call of identical keys: every row ties exactly (docs/design.md 6: ties keep the earliest), so
/// each head keeps positions 0..budget-1 whatever the key.
TYPED_TEST(SnapKVCacheTest, IdenticalKeysInALongCallKeepTheEarliest) {
  using T = TypeParam;
  {  // 150 identical keys in 8 heads, budget 20, n_sink 4: positions 0..19 everywhere.
    std::mt19937 rng(5);
    const Index B = 2, H = 4, S = 150, D = 16;
    vc::Tensor4<T> k(B, H, S, D);
    const vc::Tensor4<T> one = random_tensor<T>(rng, B, H, 1, D);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index s = 0; s < S; ++s)
          for (Index d = 0; d < D; ++d) k(b, h, s, d) = one(b, h, 0, d);
    vc::SnapKVCache<T> cache(snap_config(20, 4, 32));
    cache.update_and_fetch(k, random_tensor<T>(rng, B, H, S, D));
    Positions first20(20);
    for (int i = 0; i < 20; ++i) first20[static_cast<std::size_t>(i)] = i;
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) EXPECT_EQ(cache.positions(b, h), first20) << b << "," << h;
  }
}

/// Random keys repeated in groups: the budget cuts through groups of exactly tied rows; the
/// earliest rows of the group survive, as in the oracle.
TYPED_TEST(SnapKVCacheTest, RepeatedKeyGroupsCutByTheBudgetKeepTheEarliest) {
  using T = TypeParam;
  {  // Random keys repeated in groups: the budget cuts through tie groups; compare with the oracle.
    std::mt19937 rng(17);
    int cut_ties = 0;
    for (int rep = 0; rep < 20; ++rep) {
      const Index S = 90, D = 4;
      const int distinct = 7 + rep % 5;
      const vc::Tensor4<T> base = random_tensor<T>(rng, 1, 1, distinct, D);
      vc::Tensor4<T> k(1, 1, S, D);
      for (Index s = 0; s < S; ++s)
        for (Index d = 0; d < D; ++d) k(0, 0, s, d) = base(0, 0, (s * 5 + s / 3) % distinct, d);
      const int budget = 10 + 3 * rep, n_sink = rep % 3;
      const Rows stored = rows_of(k, 0, 0);
      ref::SnapKVHeadOracle oracle(n_sink, budget, 32);
      oracle.absorb_call(stored, value_rows(static_cast<std::size_t>(S)));
      // Count runs where the last kept and the first dropped non-sink rows tie exactly.
      if (snap_selection_margin(stored, budget, n_sink, 32) == 0.0) ++cut_ties;
      vc::SnapKVCache<T> cache(snap_config(budget, n_sink, 32));
      cache.update_and_fetch(k, tensor_of<T>(value_rows(static_cast<std::size_t>(S))));
      EXPECT_EQ(cache.positions(0, 0), oracle.positions()) << "rep " << rep;
    }
    EXPECT_GT(cut_ties, 10);
  }
}

/// A chunk that passes the budget ranks the rows held before it with its own (SPEC 13.3): after a
/// short first call (positions 0..2, appended), a chunk of 30 whose first 8 rows point away from
/// its observation window keeps the sinks (positions below n_sink, for being first, not for their
/// score) and otherwise only rows the window attends to; the kept set and every score agree with
/// the oracle.
TYPED_TEST(SnapKVCacheTest, AChunkRanksTheRowsHeldBeforeItAndKeepsTheSinks) {
  using T = TypeParam;
  std::mt19937 rng(11);
  for (const int n_sink : {0, 1, 4, 7}) {
    const int budget = 8;
    const Index D = 8, S = 30;
    vc::SnapKVCache<T> cache(snap_config(budget, n_sink, 4));
    ref::SnapKVHeadOracle oracle(n_sink, budget, 4);
    // A short first call (3 rows, positions 0..2): appended, not compressed.
    const vc::Tensor4<T> k0 = random_tensor<T>(rng, 1, 1, 3, D);
    const vc::Tensor4<T> v0 = random_tensor<T>(rng, 1, 1, 3, D);
    cache.update_and_fetch(k0, v0);
    oracle.absorb_call(rows_of(k0, 0, 0), rows_of(v0, 0, 0));
    EXPECT_FALSE(cache.compressed());
    // The chunk: its first rows point away from the others (low attention everywhere).
    vc::Tensor4<T> k1 = random_tensor<T>(rng, 1, 1, S, D);
    for (Index s = 0; s < S; ++s) k1(0, 0, s, 0) = static_cast<T>(s < 8 ? -3.0 : 3.0);
    const vc::Tensor4<T> v1 = random_tensor<T>(rng, 1, 1, S, D);
    const vc::KVPair<T> out = cache.update_and_fetch(k1, v1);
    oracle.absorb_call(rows_of(k1, 0, 0), rows_of(v1, 0, 0));
    EXPECT_EQ(out.first.dimension(2), 3 + S);  // every row it brought, and the ones held before
    EXPECT_TRUE(cache.compressed());
    const Positions pos = cache.positions(0, 0);
    EXPECT_EQ(pos, oracle.positions()) << "n_sink " << n_sink;
    ASSERT_EQ(pos.size(), static_cast<std::size_t>(budget));
    for (std::int64_t p = 0; p < n_sink; ++p) EXPECT_EQ(pos[static_cast<std::size_t>(p)], p);
    // Positions n_sink .. 10 (the first call's rows and the chunk's rows pointing away) are not
    // kept unless they are sinks.
    for (std::size_t r = static_cast<std::size_t>(n_sink); r < pos.size(); ++r) {
      EXPECT_GE(pos[r], 11) << "n_sink " << n_sink;
    }
    const std::vector<float> sc = cache.scores(0, 0);
    const std::vector<double> want = oracle.scores();
    ASSERT_EQ(sc.size(), want.size());
    for (std::size_t r = 0; r < sc.size(); ++r) {
      EXPECT_TRUE(scores_close(static_cast<double>(sc[r]), want[r])) << r << ": " << sc[r];
    }
  }
}

/// Which calls compress (SPEC 13.3): a call that leaves exactly the budget does not (strict);
/// decode steps (S == 1) never do, even past the budget, so a prompt fed one token per call is
/// never compressed; every later chunk (S > 1) that would pass the budget does, down to it, and
/// returns every row it brought plus those held before it. In a prompt fed in chunks of C tokens
/// a head never holds more than budget + C rows, and budget after each chunk.
TYPED_TEST(SnapKVCacheTest, EveryChunkPastTheBudgetIsCompressedAndDecodeStepsAppend) {
  using T = TypeParam;
  const int budget = 6;
  const Index B = 2, H = 2, D = 4;
  std::mt19937 rng(3);
  vc::SnapKVCache<T> cache(snap_config(budget, 2, 3));
  const auto call = [&](Index S) {
    const vc::KVPair<T> out =
        cache.update_and_fetch(random_tensor<T>(rng, B, H, S, D), random_tensor<T>(rng, B, H, S, D));
    return out.first.dimension(2);
  };
  EXPECT_EQ(call(budget), budget);
  EXPECT_FALSE(cache.compressed());
  EXPECT_EQ(cache.tokens_kept(), budget);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(call(1), budget + 1 + i);  // decode steps append
  EXPECT_FALSE(cache.compressed());
  EXPECT_EQ(cache.tokens_kept(), budget + 4);
  EXPECT_EQ(call(2), budget + 6);  // a chunk past the budget: everything returned, then cut
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(cache.tokens_kept(), budget);
  Positions pos = cache.positions(1, 1);
  EXPECT_EQ(pos[0], 0);  // the 2 sinks
  EXPECT_EQ(pos[1], 1);
  EXPECT_EQ(call(1), budget + 1);
  EXPECT_EQ(call(5 * budget), 6 * budget + 1);
  EXPECT_EQ(cache.tokens_kept(), budget);
  EXPECT_EQ(cache.offset(), budget + 4 + 2 + 1 + 5 * budget);
  pos = cache.positions(0, 1);
  EXPECT_EQ(pos.size(), static_cast<std::size_t>(budget));
  EXPECT_EQ(cache.tokens_seen(), B * H * cache.offset());
  // Empty calls change nothing and return the retained set.
  EXPECT_EQ(call(0), budget);
  EXPECT_EQ(cache.positions(0, 1), pos);

  // A prompt of 40 tokens fed one token per call: never compressed.
  cache.reset();
  for (int i = 0; i < 40; ++i) EXPECT_EQ(call(1), i + 1);
  EXPECT_FALSE(cache.compressed());
  // In chunks of C = 4 (and a last one of 3): at most budget + C rows during a chunk's call,
  // budget after it (the kept bytes of budget rows).
  cache.reset();
  std::size_t row_bytes = 0;  // per row of one head, from the first chunk
  for (const Index C : {4, 4, 4, 4, 4, 3}) {
    const Index before = cache.tokens_kept();
    EXPECT_EQ(call(C), before + C);
    EXPECT_LE(before + C, budget + C);
    EXPECT_LE(cache.tokens_kept(), budget);
    if (row_bytes == 0) row_bytes = cache.kept_bytes() / static_cast<std::size_t>(B * H * C);
    EXPECT_LE(cache.kept_bytes(), row_bytes * static_cast<std::size_t>(B * H * budget));
  }
  EXPECT_EQ(cache.tokens_kept(), budget);
}

/// reset() forgets the rows, restarts positions at 0 and re-arms the compression (B, H, D may
/// change).
TYPED_TEST(SnapKVCacheTest, ResetReArmsCompression) {
  using T = TypeParam;
  std::mt19937 rng(9);
  vc::SnapKVCache<T> cache(snap_config(8, 1, 4));
  cache.update_and_fetch(random_tensor<T>(rng, 2, 2, 40, 4), random_tensor<T>(rng, 2, 2, 40, 4));
  for (int i = 0; i < 5; ++i)
    cache.update_and_fetch(random_tensor<T>(rng, 2, 2, 1, 4), random_tensor<T>(rng, 2, 2, 1, 4));
  ASSERT_TRUE(cache.compressed());
  ASSERT_EQ(cache.tokens_kept(), 13);
  EXPECT_FALSE(cache.is_trimmable());
  EXPECT_EQ(cache.trim(3), 0);
  EXPECT_EQ(cache.offset(), 45);
  EXPECT_EQ(cache.tokens_kept(), 13);

  cache.reset();
  EXPECT_FALSE(cache.compressed());
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.tokens_kept(), 0);
  EXPECT_TRUE(cache.positions(0, 0).empty());

  // New shape; a long call is compressed again, positions from 0; matches a fresh oracle.
  const Index B = 1, H = 3, S = 50, D = 8;
  const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
  const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, 2);
  const vc::KVPair<T> out = cache.update_and_fetch(k, v);
  EXPECT_EQ(out.first.dimension(2), S);
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(cache.offset(), S);
  for (Index h = 0; h < H; ++h) {
    ref::SnapKVHeadOracle oracle(1, 8, 4);
    oracle.absorb_call(rows_of(k, 0, h), rows_of(v, 0, h));
    const Positions pos = cache.positions(0, h);
    EXPECT_EQ(pos, oracle.positions()) << "head " << h;
    ASSERT_FALSE(pos.empty());
    EXPECT_EQ(pos.front(), 0);  // the sink of the new sequence
  }
  // And the next chunk past the budget is compressed too (SPEC 13.3), down to the budget.
  cache.update_and_fetch(random_tensor<T>(rng, B, H, 20, D), random_tensor<T>(rng, B, H, 20, 2));
  EXPECT_EQ(cache.tokens_kept(), 8);
}

/// The factory builds a SnapKVCache for method "snapkv" with the config's fields.
TYPED_TEST(SnapKVCacheTest, FactoryBuildsSnapKV) {
  using T = TypeParam;
  const auto made = vc::KVCacheFactory::create<T>(snap_config(16, 2, 5));
  const auto* snap = dynamic_cast<const vc::SnapKVCache<T>*>(made.get());
  ASSERT_NE(snap, nullptr);
  EXPECT_EQ(snap->layer_budget(), 16);
  EXPECT_EQ(snap->n_sink(), 2);
  EXPECT_EQ(snap->obs_window(), 5);
  EXPECT_FALSE(snap->is_trimmable());
}

// ---------------------------------------------------------------------------------------------
// Validation at construction
// ---------------------------------------------------------------------------------------------

/// Constructing with `c` throws std::invalid_argument whose message names `field` and `value`.
void expect_config_error(const vc::KVCacheConfig& c, const std::string& field,
                         const std::string& value) {
  try {
    vc::SnapKVCache<Eigen::half> cache(c);
    ADD_FAILURE() << field << " = " << value << ": no exception";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(field), std::string::npos) << what;
    EXPECT_NE(what.find(value), std::string::npos) << what;
  }
}

TEST(SnapKVCacheValidationTest, BadFieldsThrowAtConstructionNamingTheField) {
  vc::KVCacheConfig c = snap_config(8, 2, 4);
  c.snap_obs_window = 0;
  expect_config_error(c, "snap_obs_window", "0");
  c.snap_obs_window = -3;
  expect_config_error(c, "snap_obs_window", "-3");
  c = snap_config(0, 0, 4);
  expect_config_error(c, "snap_budget", "0");
  c = snap_config(-5, 0, 4);
  expect_config_error(c, "snap_budget", "-5");
  c = snap_config(8, 8, 4);
  expect_config_error(c, "snap_n_sink", "8");
  c = snap_config(8, 9, 4);
  expect_config_error(c, "snap_n_sink", "9");
  c = snap_config(8, -1, 4);
  expect_config_error(c, "snap_n_sink", "-1");
  // The cache validates as SnapKV whatever config.method says.
  c = snap_config(8, 8, 4);
  c.method = "h2o";
  expect_config_error(c, "snap_n_sink", "8");

  // Boundaries that are valid.
  EXPECT_NO_THROW({ vc::SnapKVCache<float> ok(snap_config(1, 0, 1)); });
  EXPECT_NO_THROW({ vc::SnapKVCache<float> ok(snap_config(8, 7, 1000)); });
  vc::SnapKVCache<float> tiny(snap_config(1, 0, 1));
  vc::Tensor4<float> k(1, 1, 2, 1), v(1, 1, 2, 1);
  k.setValues({{{{1.0f}, {2.0f}}}});
  v.setValues({{{{5.0f}, {6.0f}}}});
  EXPECT_EQ(tiny.update_and_fetch(k, v).first.dimension(2), 2);
  EXPECT_EQ(tiny.tokens_kept(), 1);
  EXPECT_TRUE(tiny.compressed());
}

// ---------------------------------------------------------------------------------------------
// Bad input (docs/design.md 8): strong guarantee, compressed() included
// ---------------------------------------------------------------------------------------------

constexpr int kErrBudget = 4;
constexpr Index kErrS = 9;  // > kErrBudget: the bad calls would compress

/// The same valid call of S tokens on both caches: the same return, and the same snapshot
/// (support/subjects.hpp: everything observable, compressed() included).
template <class T>
void valid_call_on_both(Subject<T>& a, Subject<T>& b, std::mt19937& rng, Index S,
                        const std::string& context) {
  const vc::Tensor4<T> k = random_tensor<T>(rng, kBadCallKeys[0], kBadCallKeys[1], S, kBadCallKeys[3]);
  const vc::Tensor4<T> v =
      random_tensor<T>(rng, kBadCallValues[0], kBadCallValues[1], S, kBadCallValues[3]);
  EXPECT_TRUE(from_pair(a.cache->update_and_fetch(k, v)) == from_pair(b.cache->update_and_fetch(k, v)))
      << context;
  EXPECT_TRUE(snapshot(a) == snapshot(b)) << context;
}

/// The shared list of bad calls (support/test_support.hpp), made of calls longer than the budget:
/// on a fresh cache, after a short call and after compression, each throws through fetch and
/// view, changes nothing (compressed() included), and the next long call and decode step give
/// what an untouched twin gives (compressing unless already compressed).
TYPED_TEST(SnapKVCacheTest, BadInputLeavesEverythingUnchangedIncludingCompressed) {
  using T = TypeParam;
  std::mt19937 rng(31 + static_cast<unsigned>(sizeof(T)));
  const std::vector<BadCall> cases = bad_calls(rng, std::is_same_v<T, Eigen::half>, kErrS);
  int thrown = 0, expected = 0;
  const auto is_compressed = [](const Subject<T>& s) {
    return dynamic_cast<const vc::SnapKVCache<T>&>(*s.cache).compressed();
  };
  // Phases: 0 fresh cache, 1 after a short (uncompressed) call, 2 after compression and decode.
  for (int phase = 0; phase < 3; ++phase) {
    for (const BadCall& bc : cases) {
      if (bc.needs_established && phase == 0) continue;
      Subject<T> subject = snap_subject<T>(kErrBudget, 1, 2);
      Subject<T> twin = snap_subject<T>(kErrBudget, 1, 2);
      const std::string ctx = bc.name + " (phase " + std::to_string(phase) + ")";
      if (phase >= 1) valid_call_on_both(subject, twin, rng, 3, ctx + ": short call");
      if (phase == 2) {
        valid_call_on_both(subject, twin, rng, 12, ctx + ": prompt");
        ASSERT_TRUE(is_compressed(subject));
        for (int i = 0; i < 2; ++i) valid_call_on_both(subject, twin, rng, 1, ctx + ": decode");
      }
      const Snapshot before = snapshot(subject);
      for (const bool view : {false, true}) {
        ++expected;
        try {
          feed(*subject.cache, bc, view);
          ADD_FAILURE() << ctx << (view ? " view" : " fetch") << ": did not throw";
        } catch (const std::invalid_argument& e) {
          ++thrown;
          EXPECT_FALSE(std::string(e.what()).empty());
        } catch (const std::exception& e) {
          ADD_FAILURE() << ctx << ": threw something else: " << e.what();
        }
        EXPECT_TRUE(snapshot(subject) == before) << ctx << (view ? " view" : " fetch");
        EXPECT_EQ(is_compressed(subject), phase == 2) << ctx;
      }
      valid_call_on_both(subject, twin, rng, kErrS, ctx + ": next long call");
      EXPECT_TRUE(is_compressed(subject)) << ctx;
      EXPECT_EQ(subject.cache->tokens_kept(), kErrBudget) << ctx;  // every chunk: to the budget
      valid_call_on_both(subject, twin, rng, 1, ctx + ": next decode");
    }
  }
  EXPECT_EQ(thrown, expected);
  EXPECT_GT(expected, 100);
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

TYPED_TEST(SnapKVCacheTest, HeapBytesBoundedOverALongDecodeAfterCompression) {
  using T = TypeParam;
  const Index B = 2, H = 8, D = 64;
  const int budget = 64;
  vc::SnapKVCache<T> cache(snap_config(budget, 4, 32));
  cache.set_parallel_heads(false);  // one worker: one scratch
  std::mt19937 rng(23);
  const std::size_t row_bytes = static_cast<std::size_t>(B * H * 2 * D) * sizeof(T);  // all heads
  cache.update_and_view(random_tensor<T>(rng, B, H, 500, D), random_tensor<T>(rng, B, H, 500, D));
  ASSERT_TRUE(cache.compressed());
  ASSERT_EQ(cache.kept_bytes(), static_cast<std::size_t>(budget) * row_bytes);
  // What the compressing call needed: 500 rows per head plus scratch over 500 rows.
  const std::size_t after_compression = cache.heap_bytes();
  // Bookkeeping per row and head (position, score, flags, order and window slots, scratch): far
  // below 64 bytes; a long decode holds at most ~1.5x its rows (geometric growth).
  const std::size_t per_row_all_heads = row_bytes + static_cast<std::size_t>(B * H) * 64;
  vc::Tensor4<T> kk(B, H, 1, D), vv(B, H, 1, D);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::size_t peak = 0;
  for (int step = 1; step <= 2000; ++step) {
    for (Index i = 0; i < kk.size(); ++i) kk.data()[i] = static_cast<T>(dist(rng));
    for (Index i = 0; i < vv.size(); ++i) vv.data()[i] = static_cast<T>(dist(rng));
    const std::size_t kept_before = cache.kept_bytes();
    const vc::KVView<T> view = cache.update_and_view(kk, vv);
    ASSERT_EQ(view.rows(), budget + step) << "step " << step;
    ASSERT_EQ(cache.kept_bytes(), kept_before + row_bytes) << "step " << step;
    const auto rows = static_cast<std::size_t>(budget + step);
    const std::size_t bound = static_cast<std::size_t>(
        std::max(1.6 * static_cast<double>(rows * per_row_all_heads),
                 1.6 * static_cast<double>(after_compression)) +
        65536.0);
    ASSERT_LE(cache.heap_bytes(), bound) << "step " << step;
    peak = std::max(peak, cache.heap_bytes());
  }
  EXPECT_EQ(cache.tokens_kept(), budget + 2000);
  EXPECT_EQ(cache.offset(), 2500);
  EXPECT_TRUE(cache.compressed());
  // No growth beyond the appended rows: 2000 rows per head plus their bookkeeping, with the
  // geometric growth factor.
  EXPECT_LE(peak, after_compression +
                      static_cast<std::size_t>(1.6 * 2064.0 * static_cast<double>(per_row_all_heads)));
  std::printf("[ heap     ] after compression %zu bytes, after 2000 steps %zu, kept %zu\n",
              after_compression, cache.heap_bytes(), cache.kept_bytes());
}

}  // namespace
