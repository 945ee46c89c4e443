// SnapKVCache<T> (docs/design.md 6, SnapKV) against the naive double-precision SnapKVHeadOracle of
// tests/reference/policy_oracles.hpp on random call sequences, plus hand-built cases: no causal mask
// in the scoring, exact ties keep the earliest row, sinks are the compressing call's first rows,
// a call of exactly `budget` rows is not compressed, reset() re-arms the compression, validation at
// construction, bad input with the strong guarantee (docs/design.md 8, including calls that would compress)
// and bounded memory over a long decode. Parallel heads: test_contract.cpp.

// Internal invariants of the library are checked (and abort) even in Release builds.
// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

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
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)
using Positions = std::vector<std::int64_t>;

using StorageTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float>;

/// SnapKV scores of a call's rows (docs/design.md 6), from the oracle's proxy_softmax: the mean over the
/// last min(obs, S) keys of their softmax over all S rows, or (causal) over rows 0..j only (rows
/// after the proxy get 0). keys: [S][D]; returns [S]
std::vector<double> call_scores(const Rows& keys, int obs_window, bool causal = false) {
  const std::size_t S = keys.size();
  const std::size_t w = std::min(static_cast<std::size_t>(obs_window), S);
  std::vector<double> score(S, 0.0);
  for (std::size_t j = S - w; j < S; ++j) {
    const Rows seen = causal ? Rows(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(j + 1))
                             : keys;
    const std::vector<double> a = ref::proxy_softmax(seen, keys[j]);
    for (std::size_t r = 0; r < a.size(); ++r) score[r] += a[r];
  }
  for (auto& s : score) s /= static_cast<double>(w);
  return score;
}

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

/// Relative gap between the last kept and the first dropped non-sink score of a compression
/// (+inf when nothing is dropped). keys: [S][D]
double selection_margin(const Rows& keys, int budget, int n_sink, int obs_window) {
  const std::vector<double> score = call_scores(keys, obs_window);
  const std::size_t sinks = static_cast<std::size_t>(std::min(n_sink, budget));
  const std::size_t keep = static_cast<std::size_t>(budget) - sinks;
  std::vector<double> others(score.begin() + static_cast<std::ptrdiff_t>(sinks), score.end());
  if (others.size() <= keep) return std::numeric_limits<double>::infinity();
  std::sort(others.begin(), others.end(), std::greater<double>());
  const double hi = others[keep - 1], lo = others[keep];
  return (hi - lo) / std::max(std::fabs(hi), 1e-300);
}

/// Everything about the cache's retained set checked against the oracle heads: state() shape and
/// contents, positions, the scores of the compressed call's rows (positions in
/// [comp_first, comp_end)), tokens_kept, kept_bytes. Returns the first mismatch or "".
template <class T>
std::string compare_with_oracle(const vc::SnapKVCache<T>& cache,
                                const std::vector<ref::SnapKVHeadOracle>& oracle, Index B, Index H,
                                Index Dk, Index Dv, std::int64_t comp_first,
                                std::int64_t comp_end) {
  std::ostringstream err;
  const vc::KVPair<T> st = cache.state();
  const auto n = static_cast<Index>(oracle.front().rows().size());
  if (st.first.dimension(0) != B || st.first.dimension(1) != H || st.first.dimension(2) != n ||
      st.first.dimension(3) != Dk || st.second.dimension(2) != n || st.second.dimension(3) != Dv) {
    err << "state() holds " << st.first.dimension(2) << " rows, oracle " << n;
    return err.str();
  }
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto& o = oracle[static_cast<std::size_t>(b * H + h)];
      const Positions got_pos = cache.positions(b, h);
      if (got_pos != o.positions()) {
        err << "head (" << b << ", " << h << ") retained positions differ from the oracle's";
        return err.str();
      }
      const std::vector<float> sc = cache.scores(b, h);
      if (sc.size() != o.rows().size()) {
        err << "head (" << b << ", " << h << ") has " << sc.size() << " scores";
        return err.str();
      }
      for (std::size_t r = 0; r < o.rows().size(); ++r) {
        const ref::OracleRow& row = o.rows()[r];
        if (row.position >= comp_first && row.position < comp_end &&
            !scores_close(static_cast<double>(sc[r]), row.score)) {
          err << "head (" << b << ", " << h << ") position " << row.position << " score " << sc[r]
              << ", oracle " << row.score;
          return err.str();
        }
        const std::string row_err = compare_state_row(st, b, h, static_cast<Index>(r), row);
        if (!row_err.empty()) return row_err;
      }
    }
  }
  if (cache.tokens_kept() != n) err << "tokens_kept " << cache.tokens_kept() << ", oracle " << n;
  const auto want_bytes =
      static_cast<std::size_t>(B * H * n * (Dk + Dv)) * sizeof(T);
  if (err.str().empty() && cache.kept_bytes() != want_bytes)
    err << "kept_bytes " << cache.kept_bytes() << ", expected " << want_bytes;
  return err.str();
}


// ---------------------------------------------------------------------------------------------
// Random sequences against the oracle
// ---------------------------------------------------------------------------------------------

/// One random run.
struct RunConfig {
  int budget = 8;
  int n_sink = 0;
  int obs_window = 4;
  Index B = 1, H = 1, Dk = 4, Dv = 4;
  std::vector<Index> calls;  // S of every call in order
  unsigned seed = 0;

  std::string describe() const {
    std::ostringstream os;
    os << "budget=" << budget << " n_sink=" << n_sink << " obs_window=" << obs_window << " B=" << B
       << " H=" << H << " Dk=" << Dk << " Dv=" << Dv << " seed=" << seed << " calls=[";
    for (std::size_t i = 0; i < calls.size() && i < 8; ++i) os << (i ? "," : "") << calls[i];
    os << (calls.size() > 8 ? ",...]" : "]");
    return os.str();
  }
};

struct RunResult {
  bool ok = true;
  bool near_tie = false;
  bool diverged_at_tie = false;
  int calls_checked = 0;
  bool compressed = false;
  int long_calls_after = 0;  // calls with S > budget after the compression (all checked)
};

template <class T>
RunResult run_against_oracle(const RunConfig& rc) {
  RunResult res;
  std::mt19937 rng(rc.seed);
  vc::SnapKVCache<T> cache(snap_config(rc.budget, rc.n_sink, rc.obs_window));
  EXPECT_EQ(cache.layer_budget(), rc.budget);
  EXPECT_EQ(cache.obs_window(), rc.obs_window);
  EXPECT_EQ(cache.n_sink(), rc.n_sink);
  EXPECT_FALSE(cache.compressed());
  std::vector<ref::SnapKVHeadOracle> oracle(static_cast<std::size_t>(rc.B * rc.H),
                                            ref::SnapKVHeadOracle(rc.n_sink, rc.budget,
                                                                  rc.obs_window));
  std::int64_t offset = 0;
  std::int64_t comp_first = -1, comp_end = -1;
  int compressing_call = -1;
  for (std::size_t call = 0; call < rc.calls.size(); ++call) {
    const Index S = rc.calls[call];
    const vc::Tensor4<T> keys = random_tensor<T>(rng, rc.B, rc.H, S, rc.Dk);
    const vc::Tensor4<T> values = random_tensor<T>(rng, rc.B, rc.H, S, rc.Dv);
    std::vector<std::vector<ref::OracleRow>> before;
    for (const auto& o : oracle) before.push_back(o.rows());

    const bool compresses = !oracle.front().compressed() && S > rc.budget;
    for (Index hi = 0; hi < rc.B * rc.H; ++hi) {
      const Rows k = rows_of(keys, hi / rc.H, hi % rc.H);
      const Rows v = rows_of(values, hi / rc.H, hi % rc.H);
      if (compresses && selection_margin(k, rc.budget, rc.n_sink, rc.obs_window) < 1e-5)
        res.near_tie = true;
      oracle[static_cast<std::size_t>(hi)].absorb_call(k, v);
    }
    if (compresses) {
      comp_first = offset;
      comp_end = offset + S;
      compressing_call = static_cast<int>(call);
    } else if (oracle.front().compressed() && S > rc.budget) {
      ++res.long_calls_after;
    }

    std::string err;
    if (call % 3 == 2) {
      const vc::KVView<T> view = cache.update_and_view(keys, values);
      err = compare_view(view, before, keys, values, offset);
    } else {
      const vc::KVPair<T> got = cache.update_and_fetch(keys, values);
      err = compare_returned(got, before, keys, values, keys.dimension(0), keys.dimension(1),
                             keys.dimension(3), values.dimension(3));
    }
    offset += S;
    if (err.empty() && cache.offset() != offset)
      err = "offset " + std::to_string(cache.offset()) + ", expected " + std::to_string(offset);
    if (err.empty() && cache.compressed() != oracle.front().compressed())
      err = std::string("compressed() is ") + (cache.compressed() ? "true" : "false");
    if (err.empty() && cache.compressed() != (compressing_call >= 0))
      err = "oracle and test disagree on compression";
    if (err.empty())
      err = compare_with_oracle(cache, oracle, rc.B, rc.H, rc.Dk, rc.Dv, comp_first, comp_end);
    if (!err.empty()) {
      if (res.near_tie) {
        res.diverged_at_tie = true;
      } else {
        ADD_FAILURE() << rc.describe() << " call " << call << " (S=" << S << "): " << err;
        res.ok = false;
      }
      return res;
    }
    ++res.calls_checked;
  }
  res.compressed = cache.compressed();
  return res;
}

template <class T>
class SnapKVOracleTest : public ::testing::Test {};
TYPED_TEST_SUITE(SnapKVOracleTest, StorageTypes);

/// The grid: budgets x n_sink x obs_window, each with a long first call (sizes cycling through
/// just-above-budget, up to 2 budget, > 64 and > 200) and with short first calls (one of exactly
/// `budget`) before the long one; then decode steps, empty calls, short calls and long calls that
/// must not be compressed.
template <class T>
void run_grid(unsigned seed_base) {
  const std::vector<int> budgets = {3, 8, 20, 64};
  const std::vector<int> sinks = {0, 1, 4};
  const std::vector<int> windows = {1, 4, 32, 100};
  const std::vector<Index> dims = {2, 4, 8, 16};
  std::mt19937 rng(seed_base);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  int runs = 0, failures = 0, near_ties = 0, tie_divergences = 0, checked = 0;
  int over_64 = 0, over_200 = 0, short_first = 0, exact_budget_first = 0, window_over_s = 0;
  int long_after = 0;
  for (int budget : budgets) {
    for (int n_sink : sinks) {
      if (n_sink >= budget) continue;
      for (int obs : windows) {
        for (int mode = 0; mode < 2; ++mode) {
          RunConfig rc;
          rc.budget = budget;
          rc.n_sink = n_sink;
          rc.obs_window = obs;
          rc.B = std::uniform_int_distribution<Index>(1, 3)(rng);
          rc.H = std::uniform_int_distribution<Index>(1, 3)(rng);
          rc.Dk = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
          rc.Dv = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
          if (mode == 1) {  // short calls first: they append, even past the budget
            const int n_short = std::uniform_int_distribution<int>(1, 3)(rng);
            const int exact_at =
                (runs / 2) % 2 == 0 ? std::uniform_int_distribution<int>(0, n_short - 1)(rng) : -1;
            for (int i = 0; i < n_short; ++i) {
              rc.calls.push_back(i == exact_at ? budget
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
          rc.calls.push_back(prompt);
          const int follow = std::uniform_int_distribution<int>(15, 40)(rng);
          for (int i = 0; i < follow; ++i) {
            const double r = u01(rng);
            if (i == 1 || r < 0.08) {
              rc.calls.push_back(std::uniform_int_distribution<Index>(budget + 1, 2 * budget + 10)(rng));
            } else if (r < 0.13) {
              rc.calls.push_back(0);
            } else if (r < 0.28) {
              rc.calls.push_back(std::uniform_int_distribution<Index>(2, budget)(rng));
            } else {
              rc.calls.push_back(1);
            }
          }
          rc.seed = static_cast<unsigned>(rng());
          const RunResult r = run_against_oracle<T>(rc);
          ++runs;
          if (r.near_tie) ++near_ties;
          if (r.diverged_at_tie) ++tie_divergences;
          if (!r.ok) ++failures;
          if (r.ok && !r.diverged_at_tie) {
            EXPECT_TRUE(r.compressed) << rc.describe();
            long_after += r.long_calls_after;
          }
          checked += r.calls_checked;
          if (failures > 3) FAIL() << "too many failing runs; stopping";
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
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

TYPED_TEST(SnapKVOracleTest, MatchesOracleOnRandomCallSequences) {
  run_grid<TypeParam>(4004u + static_cast<unsigned>(sizeof(TypeParam)));
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
  EXPECT_EQ(selection(call_scores(stored, 2, /*causal=*/true), 3, 1),
            (std::vector<std::size_t>{0, 1, 3}));
  EXPECT_EQ(selection(call_scores(stored, 2), 3, 1), (std::vector<std::size_t>{0, 1, 4}));

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
      if (selection_margin(stored, budget, n_sink, 32) == 0.0) ++cut_ties;
      vc::SnapKVCache<T> cache(snap_config(budget, n_sink, 32));
      cache.update_and_fetch(k, tensor_of<T>(value_rows(static_cast<std::size_t>(S))));
      EXPECT_EQ(cache.positions(0, 0), oracle.positions()) << "rep " << rep;
    }
    EXPECT_GT(cut_ties, 10);
  }
}

/// The sinks are the compressing call's first min(n_sink, budget) rows, kept even when they score
/// lowest; rows of earlier (short) calls are untouched and not scored.
TYPED_TEST(SnapKVCacheTest, SinksAreTheCompressingCallsFirstRows) {
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
    // The long call: its first rows point away from the others (low attention everywhere).
    vc::Tensor4<T> k1 = random_tensor<T>(rng, 1, 1, S, D);
    for (Index s = 0; s < S; ++s) k1(0, 0, s, 0) = static_cast<T>(s < 8 ? -3.0 : 3.0);
    const vc::Tensor4<T> v1 = random_tensor<T>(rng, 1, 1, S, D);
    const vc::KVPair<T> out = cache.update_and_fetch(k1, v1);
    oracle.absorb_call(rows_of(k1, 0, 0), rows_of(v1, 0, 0));
    EXPECT_EQ(out.first.dimension(2), 3 + S);
    EXPECT_TRUE(cache.compressed());
    const Positions pos = cache.positions(0, 0);
    EXPECT_EQ(pos, oracle.positions()) << "n_sink " << n_sink;
    ASSERT_EQ(pos.size(), static_cast<std::size_t>(3 + budget));
    for (std::int64_t p = 0; p < 3 + n_sink; ++p) EXPECT_EQ(pos[static_cast<std::size_t>(p)], p);
    // Positions 3 + n_sink .. 10 (the call's rows n_sink..7, pointing away) are not kept: the
    // sinks were kept for being first, not for their score.
    for (std::size_t r = static_cast<std::size_t>(3 + n_sink); r < pos.size(); ++r)
      EXPECT_GE(pos[r], 11) << "n_sink " << n_sink;
    // The earlier rows carry no SnapKV score; the call's sink scores are below every kept other.
    const std::vector<float> sc = cache.scores(0, 0);
    const std::vector<double> all = call_scores(rows_of(k1, 0, 0), 4);
    for (int i = 0; i < n_sink; ++i) {
      EXPECT_TRUE(scores_close(static_cast<double>(sc[static_cast<std::size_t>(3 + i)]),
                              all[static_cast<std::size_t>(i)]));
      for (std::size_t r = static_cast<std::size_t>(3 + n_sink); r < pos.size(); ++r)
        EXPECT_LT(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(pos[r] - 3)]);
    }
  }
}

/// S == budget is not compressed (strict S > budget); calls up to the budget append even past it;
/// only the first call with S > budget is compressed; later long calls and decode steps append.
TYPED_TEST(SnapKVCacheTest, OnlyTheFirstCallAboveBudgetIsCompressed) {
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
  EXPECT_EQ(call(budget), 2 * budget);
  EXPECT_FALSE(cache.compressed());
  EXPECT_EQ(cache.tokens_kept(), 2 * budget);  // past the budget, still not compressed
  EXPECT_EQ(call(budget + 1), 3 * budget + 1);
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(cache.tokens_kept(), 3 * budget);  // 2 budget earlier rows + budget of the call
  Positions pos = cache.positions(1, 1);
  for (std::int64_t p = 0; p < 2 * budget + 2; ++p)
    EXPECT_EQ(pos[static_cast<std::size_t>(p)], p);  // earlier rows, then the call's 2 sinks
  EXPECT_EQ(call(budget + 1), 4 * budget + 1);     // appended, not compressed again
  EXPECT_EQ(cache.tokens_kept(), 4 * budget + 1);
  EXPECT_EQ(call(5 * budget), 9 * budget + 1);
  EXPECT_EQ(cache.tokens_kept(), 9 * budget + 1);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(call(1), 9 * budget + 2 + i);
  EXPECT_EQ(cache.tokens_kept(), 9 * budget + 11);
  EXPECT_TRUE(cache.compressed());
  EXPECT_EQ(cache.offset(), 3 * budget + 1 + budget + 1 + 5 * budget + 10);
  pos = cache.positions(0, 1);
  EXPECT_EQ(pos.back(), cache.offset() - 1);
  EXPECT_EQ(cache.tokens_seen(), B * H * cache.offset());
  // Empty calls change nothing and return the retained set.
  EXPECT_EQ(call(0), 9 * budget + 11);
  EXPECT_EQ(cache.positions(0, 1), pos);
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
  // And the next long call after it is not compressed.
  cache.update_and_fetch(random_tensor<T>(rng, B, H, 20, D), random_tensor<T>(rng, B, H, 20, 2));
  EXPECT_EQ(cache.tokens_kept(), 28);
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

/// Everything observable about a SnapKV cache.
struct Snapshot : BasicSnapshot {
  bool compressed = false;
  std::vector<std::vector<float>> scores;
  std::vector<Positions> positions;

  bool operator==(const Snapshot& o) const {
    return BasicSnapshot::operator==(o) && compressed == o.compressed && scores == o.scores &&
           positions == o.positions;
  }
};

std::ostream& operator<<(std::ostream& os, const Snapshot& s) {
  return os << "{offset " << s.offset << ", rows " << s.key_shape[2] << ", compressed "
            << s.compressed << ", kept_bytes " << s.kept_bytes << ", tokens_seen " << s.tokens_seen
            << "}";
}

template <class T>
Snapshot snapshot(const vc::SnapKVCache<T>& c) {
  Snapshot s;
  take_basic_snapshot(c, s);
  s.compressed = c.compressed();
  for (Index b = 0; b < c.batch(); ++b) {
    for (Index h = 0; h < c.heads(); ++h) {
      s.scores.push_back(c.scores(b, h));
      s.positions.push_back(c.positions(b, h));
    }
  }
  return s;
}

/// One bad call; `keys`/`values` are double and converted to T unless `as_double`.
struct BadCall {
  std::string name;
  vc::Tensor4<double> keys, values;
  bool as_double = false;
  bool needs_established = false;
};

constexpr int kErrBudget = 4;
constexpr Index kB = 2, kH = 2, kS = 9, kDk = 4, kDv = 3;  // kS > kErrBudget: would compress

template <class T>
std::vector<BadCall> bad_calls(std::mt19937& rng) {
  std::vector<BadCall> out;
  const auto shape_case = [&](const std::string& name, std::array<Index, 4> k,
                              std::array<Index, 4> v, bool established) {
    BadCall c;
    c.name = name;
    c.keys = random_doubles(rng, k[0], k[1], k[2], k[3]);
    c.values = random_doubles(rng, v[0], v[1], v[2], v[3]);
    c.needs_established = established;
    out.push_back(std::move(c));
  };
  shape_case("values S differs", {kB, kH, kS, kDk}, {kB, kH, kS - 1, kDv}, false);
  shape_case("values B differs", {kB, kH, kS, kDk}, {1, kH, kS, kDv}, false);
  shape_case("values H differs", {kB, kH, kS, kDk}, {kB, 3, kS, kDv}, false);
  shape_case("zero key D", {kB, kH, kS, 0}, {kB, kH, kS, kDv}, false);
  shape_case("zero value D", {kB, kH, kS, kDk}, {kB, kH, kS, 0}, false);
  shape_case("zero B", {0, kH, kS, kDk}, {0, kH, kS, kDv}, false);
  shape_case("B differs from the first call", {1, kH, kS, kDk}, {1, kH, kS, kDv}, true);
  shape_case("H differs from the first call", {kB, 1, kS, kDk}, {kB, 1, kS, kDv}, true);
  shape_case("key D differs from the first call", {kB, kH, kS, 8}, {kB, kH, kS, kDv}, true);
  shape_case("value D differs from the first call", {kB, kH, kS, kDk}, {kB, kH, kS, 5}, true);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::array<Index, 4>> where = {
      {0, 0, 0, 0}, {1, 1, kS - 1, kDk - 1}, {0, 1, 4, 2}, {1, 0, kS - 1, 0}};
  for (const double bad : {nan, inf, -inf}) {
    for (const auto& at : where) {
      BadCall c;
      c.name = "key " + std::to_string(bad) + " at s=" + std::to_string(at[2]);
      c.keys = random_doubles(rng, kB, kH, kS, kDk);
      c.values = random_doubles(rng, kB, kH, kS, kDv);
      c.keys(at[0], at[1], at[2], at[3]) = bad;
      out.push_back(std::move(c));
    }
  }
  {
    BadCall c;
    c.name = "double key overflowing the storage type";
    c.keys = random_doubles(rng, kB, kH, kS, kDk);
    c.values = random_doubles(rng, kB, kH, kS, kDv);
    c.keys(1, 1, kS - 1, 3) = std::is_same_v<T, Eigen::half> ? 1e6 : 1e300;
    c.as_double = true;
    out.push_back(std::move(c));
  }
  return out;
}

/// The same valid call on both caches; results and snapshots must be identical.
template <class T>
void valid_call_on_both(vc::SnapKVCache<T>& a, vc::SnapKVCache<T>& b, std::mt19937& rng, Index S,
                        const std::string& context) {
  const vc::Tensor4<T> k = converted<T>(random_doubles(rng, kB, kH, S, kDk));
  const vc::Tensor4<T> v = converted<T>(random_doubles(rng, kB, kH, S, kDv));
  const vc::KVPair<T> ra = a.update_and_fetch(k, v);
  const vc::KVPair<T> rb = b.update_and_fetch(k, v);
  EXPECT_TRUE(bytes_of(ra.first) == bytes_of(rb.first)) << context;
  EXPECT_TRUE(bytes_of(ra.second) == bytes_of(rb.second)) << context;
  EXPECT_EQ(snapshot(a), snapshot(b)) << context;
}

TYPED_TEST(SnapKVCacheTest, BadInputLeavesEverythingUnchangedIncludingCompressed) {
  using T = TypeParam;
  std::mt19937 rng(31 + static_cast<unsigned>(sizeof(T)));
  const std::vector<BadCall> cases = bad_calls<T>(rng);
  int thrown = 0, expected = 0;
  // Phases: 0 fresh cache, 1 after a short (uncompressed) call, 2 after compression and decode.
  for (int phase = 0; phase < 3; ++phase) {
    for (const BadCall& bc : cases) {
      if (bc.needs_established && phase == 0) continue;
      vc::SnapKVCache<T> subject(snap_config(kErrBudget, 1, 2));
      vc::SnapKVCache<T> twin(snap_config(kErrBudget, 1, 2));
      const std::string ctx = bc.name + " (phase " + std::to_string(phase) + ")";
      if (phase >= 1) valid_call_on_both(subject, twin, rng, 3, ctx + ": short call");
      if (phase == 2) {
        valid_call_on_both(subject, twin, rng, 12, ctx + ": prompt");
        ASSERT_TRUE(subject.compressed());
        for (int i = 0; i < 2; ++i) valid_call_on_both(subject, twin, rng, 1, ctx + ": decode");
      }
      const Snapshot before = snapshot(subject);
      for (const bool view : {false, true}) {
        ++expected;
        try {
          feed(subject, bc, view);
          ADD_FAILURE() << ctx << (view ? " view" : " fetch") << ": did not throw";
        } catch (const std::invalid_argument& e) {
          ++thrown;
          EXPECT_FALSE(std::string(e.what()).empty());
        } catch (const std::exception& e) {
          ADD_FAILURE() << ctx << ": threw something else: " << e.what();
        }
        EXPECT_EQ(snapshot(subject), before) << ctx << (view ? " view" : " fetch");
        EXPECT_EQ(subject.compressed(), phase == 2) << ctx;
      }
      // The next valid long call gives exactly what the untouched twin gives (and compresses
      // unless already compressed).
      valid_call_on_both(subject, twin, rng, kS, ctx + ": next long call");
      EXPECT_TRUE(subject.compressed()) << ctx;
      if (phase < 2) {
        EXPECT_EQ(subject.tokens_kept(), (phase == 1 ? 3 : 0) + kErrBudget) << ctx;
      }
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
