// The fast H2O core (SqueezeAttentionCache without a coordinator, H2OCache, PyramidKVCache) against
// the naive double-precision oracle of tests/reference/oracle.hpp on random call sequences
// (docs/design.md 3, 4.2, 4.4, 6), and the reference algorithm special case (docs/design.md 4.3, 9.1).

// Internal invariants of the library are checked (and abort) even in Release builds.
// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

using StorageTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float>;

enum class Policy { kH2O, kPyramid, kSqueeze };

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kH2O:
      return "h2o";
    case Policy::kPyramid:
      return "pyramidkv";
    case Policy::kSqueeze:
      return "squeeze";
  }
  return "?";
}

/// KVCacheConfig::proxy_scoring of an oracle scorer.
const char* scorer_name(ref::H2OHeadOracle::Scorer s) {
  switch (s) {
    case ref::H2OHeadOracle::Scorer::keydiff:
      return "keydiff";
    case ref::H2OHeadOracle::Scorer::knorm:
      return "knorm";
    case ref::H2OHeadOracle::Scorer::key_as_query:
      break;
  }
  return "key_as_query";
}

/// One random configuration of a run.
struct RunConfig {
  Policy policy = Policy::kH2O;
  int budget = 8;
  int n_sink = 0;
  double ratio = 0.5;  // squeeze / pyramid
  int grace = 16;      // h2o
  double decay = 0.98;
  ref::H2OHeadOracle::Scorer scorer = ref::H2OHeadOracle::Scorer::key_as_query;  // no queries
  bool resolved = false;  // squeeze/pyramid: budget through *_resolved_budget
  Index B = 1, H = 1, Dk = 4, Dv = 4;
  Index prefill = 1;
  int decode_calls = 30;
  unsigned seed = 0;

  std::string describe() const {
    std::ostringstream os;
    os << policy_name(policy) << " budget=" << budget << " n_sink=" << n_sink << " ratio=" << ratio
       << " grace=" << grace << " decay=" << decay << " resolved=" << resolved << " B=" << B
       << " H=" << H << " Dk=" << Dk << " Dv=" << Dv << " prefill=" << prefill
       << " decode_calls=" << decode_calls << " seed=" << seed
       << " proxy_scoring=" << scorer_name(scorer);
    return os.str();
  }
};

/// Builds the cache of `rc` (budget known from the start: no coordinator).
template <class T>
std::unique_ptr<vc::KVCache<T>> make_cache(const RunConfig& rc) {
  vc::KVCacheConfig c;
  c.proxy_scoring = scorer_name(rc.scorer);
  switch (rc.policy) {
    case Policy::kH2O:
      c.method = "h2o";
      c.h2o_budget = rc.budget;
      c.h2o_n_sink = rc.n_sink;
      c.h2o_grace = rc.grace;
      c.h2o_decay = rc.decay;
      return std::make_unique<vc::H2OCache<T>>(c);
    case Policy::kPyramid:
      c.method = "pyramidkv";
      if (rc.resolved) {
        c.pyramid_budget = 300;  // must be ignored in favour of the resolved budget
        c.pyramid_resolved_budget = rc.budget;
      } else {
        c.pyramid_budget = rc.budget;
      }
      c.pyramid_n_sink = rc.n_sink;
      c.pyramid_recent_ratio = rc.ratio;
      c.pyramid_decay = rc.decay;
      return std::make_unique<vc::PyramidKVCache<T>>(c);
    case Policy::kSqueeze:
      c.method = "squeeze";
      if (rc.resolved) {
        c.squeeze_budget = 300;  // must be ignored in favour of the resolved budget
        c.squeeze_resolved_budget = rc.budget;
      } else {
        c.squeeze_budget = rc.budget;
      }
      c.squeeze_n_sink = rc.n_sink;
      c.squeeze_recent_ratio = rc.ratio;
      c.squeeze_decay = rc.decay;
      c.squeeze_defer = false;
      return std::make_unique<vc::SqueezeAttentionCache<T>>(c);
  }
  return nullptr;
}

/// The protected-recent rule of `rc` for the oracle.
std::function<int(int)> grace_rule(const RunConfig& rc) {
  if (rc.policy == Policy::kH2O) {
    const int grace = rc.grace, n_sink = rc.n_sink;
    return
        [grace, n_sink](int budget) { return ref::protected_recent_fixed(grace, budget, n_sink); };
  }
  const double ratio = rc.ratio;
  const int n_sink = rc.n_sink;
  return [ratio, n_sink](int budget) { return ref::protected_recent_ratio(ratio, budget, n_sink); };
}

/// Relative gap between the two lowest evictable scores if `head` absorbed `key` now and had to
/// evict (docs/design.md 4.2 step 3), or +inf when no eviction happens or only one row is evictable. Computed
/// by the oracle itself on a copy with an unbounded budget.
double eviction_margin(const ref::H2OHeadOracle& head, const std::vector<double>& key,
                       const std::vector<double>& value, int budget, int n_sink, int g) {
  const double inf = std::numeric_limits<double>::infinity();
  if (head.rows().empty() || static_cast<int>(head.rows().size()) + 1 <= budget) return inf;
  ref::H2OHeadOracle probe = head;
  probe.set_budget(1 << 30);  // larger: just stamped, nothing evicted
  probe.absorb(key, value);
  const std::vector<double> rank = probe.rank();  // what the eviction ranks by
  const auto& rows = probe.rows();
  const std::size_t n = rows.size();
  double lo1 = inf, lo2 = inf;
  for (std::size_t i = 0; i < n; ++i) {
    if (rows[i].position < n_sink || i + static_cast<std::size_t>(g) >= n) continue;
    const double s = rank[i];
    if (s < lo1) {
      lo2 = lo1;
      lo1 = s;
    } else if (s < lo2) {
      lo2 = s;
    }
  }
  return (lo2 - lo1) / std::max(1.0, std::fabs(lo1));
}

/// Compares the cache with the oracle heads after a call; returns a description of the first
/// mismatch, or an empty string.
/// `cache`: the public class of an H2O-core policy (visit_core).
template <class Cache>
std::string compare_with_oracle(const Cache& cache,
                                const std::vector<ref::H2OHeadOracle>& oracle,
                                const RunConfig& rc) {
  using T = typename Cache::Scalar;
  std::ostringstream err;
  const vc::KVPair<T> st = cache.state();
  const Index n = static_cast<Index>(oracle.front().rows().size());
  if (st.first.dimension(0) != rc.B || st.first.dimension(1) != rc.H ||
      st.first.dimension(2) != n || st.first.dimension(3) != rc.Dk || st.second.dimension(2) != n ||
      st.second.dimension(3) != rc.Dv) {
    err << "state() shape [" << st.first.dimension(0) << ", " << st.first.dimension(1) << ", "
        << st.first.dimension(2) << ", " << st.first.dimension(3) << "], oracle holds " << n
        << " rows";
    return err.str();
  }
  for (Index b = 0; b < rc.B; ++b) {
    for (Index h = 0; h < rc.H; ++h) {
      const auto& o = oracle[static_cast<std::size_t>(b * rc.H + h)];
      if (cache.positions(b, h) != o.positions()) {
        err << "head (" << b << ", " << h << ") retained positions differ from the oracle's";
        return err.str();
      }
      const std::vector<float> sc = cache.scores(b, h);
      const auto& rows = o.rows();
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const double want = rows[r].score;
        const double got = static_cast<double>(sc[r]);
        if (!scores_close(got, want)) {
          err << "head (" << b << ", " << h << ") row " << r << " (position " << rows[r].position
              << ") score " << got << ", oracle " << want;
          return err.str();
        }
        const std::string row_err = compare_state_row(st, b, h, static_cast<Index>(r), rows[r]);
        if (!row_err.empty()) return row_err;
      }
    }
  }
  if (cache.tokens_kept() != n) err << "tokens_kept " << cache.tokens_kept() << ", oracle " << n;
  return err.str();
}

/// Outcome of one random run.
struct RunResult {
  bool ok = true;
  bool near_tie = false;         // the oracle met an eviction decided by a relative gap < 1e-5
  bool diverged_at_tie = false;  // ... and the float32 fast path then chose the other row
  int calls_checked = 0;
};

/// One random run: prefill then decode calls (some multi-token, some empty), compared with one
/// H2OHeadOracle per head after every call. A mismatch counts as a failure unless the oracle met a
/// near-tie eviction before it (float32 scores may then legitimately choose the other row); the
/// run then stops, and the caller bounds how often that happens.
template <class T>
RunResult run_against_oracle(const RunConfig& rc) {
  RunResult res;
  std::mt19937 rng(rc.seed);
  auto cache = make_cache<T>(rc);
  EXPECT_EQ(core_budget(*cache), std::optional<int>(rc.budget)) << rc.describe();
  const auto rule = grace_rule(rc);
  const int g = ref::clamp_recent(rule(rc.budget), rc.budget, rc.n_sink);
  EXPECT_EQ(core_protected_recent(*cache), g) << rc.describe();

  std::vector<ref::H2OHeadOracle> oracle;
  for (Index i = 0; i < rc.B * rc.H; ++i) {
    oracle.emplace_back(rc.n_sink, rc.decay, rule);
    oracle.back().set_scorer(rc.scorer);
    oracle.back().set_budget(rc.budget);
  }

  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::int64_t offset = 0;
  for (int call = 0; call <= rc.decode_calls; ++call) {
    Index S = 1;
    if (call == 0) {
      S = rc.prefill;
    } else {
      const double r = u01(rng);
      if (r < 0.03) {
        S = 0;
      } else if (r < 0.18) {
        S = std::uniform_int_distribution<Index>(2, rc.budget + 5)(rng);
      }
    }
    const vc::Tensor4<T> keys = random_tensor<T>(rng, rc.B, rc.H, S, rc.Dk);
    const vc::Tensor4<T> values = random_tensor<T>(rng, rc.B, rc.H, S, rc.Dv);

    std::vector<std::vector<ref::OracleRow>> before;
    for (const auto& o : oracle) before.push_back(o.rows());

    // Oracle: one token at a time, in arrival order (docs/design.md 4.2).
    for (Index hi = 0; hi < rc.B * rc.H; ++hi) {
      const Index b = hi / rc.H, h = hi % rc.H;
      auto& o = oracle[static_cast<std::size_t>(hi)];
      for (Index s = 0; s < S; ++s) {
        const std::vector<double> k = row_of(keys, b, h, s);
        const std::vector<double> v = row_of(values, b, h, s);
        if (eviction_margin(o, k, v, rc.budget, rc.n_sink, g) < 1e-5) {
          res.near_tie = true;
        }
        o.absorb(k, v);
      }
    }

    const vc::KVPair<T> got = cache->update_and_fetch(keys, values);
    offset += S;

    std::string err;
    if (cache->offset() != offset) {
      err = "offset " + std::to_string(cache->offset()) + ", expected " + std::to_string(offset);
    }
    if (err.empty()) err = compare_returned(got, before, keys, values, rc);
    if (err.empty()) {
      const bool is_core = visit_core(
          *cache, [&](const auto& core) { err = compare_with_oracle(core, oracle, rc); });
      if (!is_core) err = "not an H2O-core cache";
    }
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
  return res;
}

template <class T>
class H2OCoreOracleTest : public ::testing::Test {};
TYPED_TEST_SUITE(H2OCoreOracleTest, StorageTypes);

/// Random runs over every policy and a grid of n_sink x recent ratio (or grace) x decay, with
/// random B, H, D, budget and call sizes.
template <class T>
void run_grid(Policy policy, unsigned seed_base) {
  const std::vector<int> budgets = {2, 5, 8, 13, 32, 64};
  const std::vector<int> sinks = {0, 1, 4};
  const std::vector<double> ratios = {0.0, 0.25, 0.5, 1.0};
  const std::vector<int> graces = {0, 3, 16, -1};  // -1: larger than the budget (clamped)
  const std::vector<double> decays = {0.9, 0.98, 1.0};
  const std::vector<Index> dims = {2, 4, 8, 16};

  std::mt19937 rng(seed_base);
  int runs = 0, near_ties = 0, tie_divergences = 0, checked_calls = 0, failures = 0;
  int prefill_over = 0, prefill_under = 0;
  for (int sink : sinks) {
    for (std::size_t k = 0; k < ratios.size(); ++k) {
      for (double decay : decays) {
        for (int rep = 0; rep < 2; ++rep) {
          RunConfig rc;
          rc.policy = policy;
          rc.n_sink = sink;
          rc.ratio = ratios[k];
          rc.decay = decay;
          std::vector<int> ok_budgets;
          for (int b : budgets) {
            if (b > sink) ok_budgets.push_back(b);
          }
          rc.budget = ok_budgets[static_cast<std::size_t>(runs) % ok_budgets.size()];
          rc.grace = graces[k] >= 0 ? graces[k] : rc.budget + 7;
          rc.resolved = (rep == 1);
          rc.B = std::uniform_int_distribution<Index>(1, 3)(rng);
          rc.H = std::uniform_int_distribution<Index>(1, 3)(rng);
          rc.Dk = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
          rc.Dv = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
          if (runs % 2 == 0) {
            rc.prefill =
                std::uniform_int_distribution<Index>(rc.budget + 1, 2 * rc.budget + 8)(rng);
            ++prefill_over;
          } else {
            rc.prefill = std::uniform_int_distribution<Index>(1, std::max(1, rc.budget - 1))(rng);
            ++prefill_under;
          }
          rc.decode_calls = std::uniform_int_distribution<int>(30, 100)(rng);
          rc.seed = static_cast<unsigned>(rng());
          const RunResult r = run_against_oracle<T>(rc);
          ++runs;
          if (r.near_tie) ++near_ties;
          if (r.diverged_at_tie) ++tie_divergences;
          if (!r.ok) ++failures;
          checked_calls += r.calls_checked;
          if (failures > 3) {
            FAIL() << "too many failing runs; stopping";
          }
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("[ stats    ] %d runs, %d calls checked, %d met a near-tie, %d diverged after one\n",
              runs, checked_calls, near_ties, tie_divergences);
  EXPECT_GT(prefill_over, 0);
  EXPECT_GT(prefill_under, 0);
  // A divergence after a near-tie of the oracle's eviction decision stops a run early without
  // failing it; that must stay rare.
  EXPECT_LE(tie_divergences * 20, runs)
      << tie_divergences << " of " << runs << " runs diverged after a near-tie";
  EXPECT_GT(checked_calls, runs * 25);
}

TYPED_TEST(H2OCoreOracleTest, H2OCacheMatchesOracleOnRandomCalls) {
  run_grid<TypeParam>(Policy::kH2O, 1001u);
}

TYPED_TEST(H2OCoreOracleTest, PyramidKVCacheMatchesOracleOnRandomCalls) {
  run_grid<TypeParam>(Policy::kPyramid, 2002u);
}

TYPED_TEST(H2OCoreOracleTest, SqueezeAttentionCacheWithoutCoordinatorMatchesOracleOnRandomCalls) {
  run_grid<TypeParam>(Policy::kSqueeze, 3003u);
}

/// The query-free scorers of docs/design.md 4.7 against the oracle: every policy, KeyDiff and
/// K-norm, n_sink x recent ratio (or grace), random dims, budgets and call sizes.
template <class T>
void run_proxy_grid(unsigned seed_base) {
  const std::vector<int> budgets = {2, 5, 8, 13, 32};
  std::mt19937 rng(seed_base);
  int runs = 0, tie_divergences = 0, checked_calls = 0, failures = 0;
  for (Policy policy : {Policy::kH2O, Policy::kPyramid, Policy::kSqueeze}) {
    for (auto scorer : {ref::H2OHeadOracle::Scorer::keydiff, ref::H2OHeadOracle::Scorer::knorm}) {
      for (int sink : {0, 1, 4}) {
        for (double ratio : {0.0, 0.5, 1.0}) {
          RunConfig rc;
          rc.policy = policy;
          rc.scorer = scorer;
          rc.n_sink = sink;
          rc.ratio = ratio;
          rc.grace = static_cast<int>(ratio * 8);
          rc.decay = 0.98;  // unused by these scorers
          std::vector<int> ok_budgets;
          for (int b : budgets) {
            if (b > sink) ok_budgets.push_back(b);
          }
          rc.budget = ok_budgets[static_cast<std::size_t>(runs) % ok_budgets.size()];
          rc.resolved = runs % 3 == 0;
          rc.B = std::uniform_int_distribution<Index>(1, 2)(rng);
          rc.H = std::uniform_int_distribution<Index>(1, 3)(rng);
          rc.Dk = std::vector<Index>{2, 4, 8, 16}[static_cast<std::size_t>(runs) % 4];
          rc.Dv = 4;
          rc.prefill =
              runs % 2 == 0
                  ? std::uniform_int_distribution<Index>(rc.budget + 1, 2 * rc.budget + 8)(rng)
                  : std::uniform_int_distribution<Index>(1, std::max(1, rc.budget - 1))(rng);
          rc.decode_calls = std::uniform_int_distribution<int>(30, 60)(rng);
          rc.seed = static_cast<unsigned>(rng());
          const RunResult r = run_against_oracle<T>(rc);
          ++runs;
          if (r.diverged_at_tie) ++tie_divergences;
          if (!r.ok) ++failures;
          checked_calls += r.calls_checked;
          if (failures > 3) FAIL() << "too many failing runs; stopping";
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("[ stats    ] %d runs, %d calls checked, %d diverged after a near-tie\n", runs,
              checked_calls, tie_divergences);
  EXPECT_LE(tie_divergences * 20, runs);
  EXPECT_GT(checked_calls, runs * 25);
}

TYPED_TEST(H2OCoreOracleTest, QueryFreeScorersMatchTheOracleOnRandomCalls) {
  run_proxy_grid<TypeParam>(4004u);
}

/// A deferring SqueezeAttention layer learns its budget from the coordinator after its prompt and
/// re-budgets at its next call (docs/design.md 4.5); under KeyDiff the rows it holds are rescored
/// first (docs/design.md 4.7), as the oracle's set_budget does, and decoding then goes on alike.
TYPED_TEST(H2OCoreOracleTest, KeyDiffRescoresBeforeADeferredRebudget) {
  using T = TypeParam;
  RunConfig rc;
  rc.policy = Policy::kSqueeze;
  rc.scorer = ref::H2OHeadOracle::Scorer::keydiff;
  rc.n_sink = 1;
  rc.ratio = 0.25;
  rc.B = 1;
  rc.H = 2;
  rc.Dk = 8;
  rc.Dv = 4;
  vc::KVCacheConfig c;
  c.method = "squeeze";
  c.proxy_scoring = "keydiff";
  c.squeeze_budget = 10;
  c.squeeze_n_sink = rc.n_sink;
  c.squeeze_recent_ratio = rc.ratio;
  c.squeeze_defer = true;
  c.squeeze_calibration_tokens = 4;
  auto layers = vc::KVCacheBuilder::for_model<T>(2, c);
  std::mt19937 rng(77);
  std::vector<ref::H2OHeadOracle> oracle;
  for (Index i = 0; i < rc.B * rc.H; ++i) {
    oracle.emplace_back(rc.n_sink, 0.98, grace_rule(rc));
    oracle.back().set_scorer(rc.scorer);
  }
  const auto feed_oracle = [&](const vc::Tensor4<T>& keys, const vc::Tensor4<T>& values) {
    for (Index h = 0; h < rc.H; ++h) {
      for (Index s = 0; s < keys.dimension(2); ++s) {
        oracle[static_cast<std::size_t>(h)].absorb(row_of(keys, 0, h, s), row_of(values, 0, h, s));
      }
    }
  };
  // The prompt: 24 rows, more than any budget the coordinator can give layer 0 (its average is 10).
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const auto keys = random_tensor<T>(rng, rc.B, rc.H, 24, rc.Dk);
    const auto values = random_tensor<T>(rng, rc.B, rc.H, 24, rc.Dv);
    layers[l]->update_and_fetch(keys, values);
    if (l == 0) feed_oracle(keys, values);
  }
  const int budget = layers[0]->layer_budget();
  ASSERT_GT(budget, 0);
  ASSERT_LT(budget, 24);
  rc.budget = budget;
  for (auto& o : oracle) o.set_budget(budget);
  for (int step = 0; step < 20; ++step) {
    const auto keys = random_tensor<T>(rng, rc.B, rc.H, 1, rc.Dk);
    const auto values = random_tensor<T>(rng, rc.B, rc.H, 1, rc.Dv);
    layers[0]->update_and_fetch(keys, values);
    feed_oracle(keys, values);
    std::string err;
    ASSERT_TRUE(visit_core(*layers[0],
                           [&](const auto& core) { err = compare_with_oracle(core, oracle, rc); }));
    ASSERT_EQ(err, "") << "step " << step;
  }
}

/// The grace larger than the budget is clamped to budget - n_sink - 1 (docs/design.md 4.2 step 3).
TYPED_TEST(H2OCoreOracleTest, GraceLargerThanBudgetIsClamped) {
  using T = TypeParam;
  vc::KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 10;
  c.h2o_n_sink = 3;
  c.h2o_grace = 50;
  vc::H2OCache<T> cache(c);
  EXPECT_EQ(cache.protected_recent(), 6);
  c.h2o_grace = 0;
  EXPECT_EQ(vc::H2OCache<T>(c).protected_recent(), 0);
  c.method = "squeeze";
  c.squeeze_resolved_budget = 10;
  c.squeeze_n_sink = 3;
  c.squeeze_recent_ratio = 1.0;
  EXPECT_EQ(vc::SqueezeAttentionCache<T>(c).protected_recent(), 6);
  c.squeeze_recent_ratio = 0.5;
  EXPECT_EQ(vc::SqueezeAttentionCache<T>(c).protected_recent(), 3);  // floor(0.5 * 7)
  c.method = "pyramidkv";
  c.pyramid_resolved_budget = 20;
  c.pyramid_n_sink = 4;
  c.pyramid_recent_ratio = 0.25;
  EXPECT_EQ(vc::PyramidKVCache<T>(c).protected_recent(), 4);  // floor(0.25 * 16)
}

template <class T>
class ReferenceAlgorithmTest : public ::testing::Test {};
TYPED_TEST_SUITE(ReferenceAlgorithmTest, StorageTypes);

/// With recent ratio 0, decay 1 and the budget known from the start, the core is the reference's
/// per-token algorithm (docs/design.md 4.3, 9.1): same retained positions token by token over 300 tokens.
TYPED_TEST(ReferenceAlgorithmTest, SqueezeWithoutRecentWindowOrDecayIsTheReferenceAlgorithm) {
  using T = TypeParam;
  const std::vector<int> budgets = {3, 8, 16, 40};
  const std::vector<int> sinks = {0, 1, 4};
  const std::vector<Index> dims = {2, 4, 8, 16};
  int runs = 0;
  for (int budget : budgets) {
    for (int n_sink : sinks) {
      if (n_sink >= budget) continue;
      for (unsigned seed = 0; seed < 3; ++seed) {
        vc::KVCacheConfig c;
        c.method = "squeeze";
        c.squeeze_budget = budget;
        c.squeeze_n_sink = n_sink;
        c.squeeze_recent_ratio = 0.0;
        c.squeeze_decay = 1.0;
        c.squeeze_defer = false;
        vc::SqueezeAttentionCache<T> cache(c);
        ASSERT_EQ(cache.layer_budget(), budget);
        ASSERT_EQ(cache.protected_recent(), 0);
        ref::ReferenceAlgorithmHeadOracle oracle(n_sink, budget);
        std::mt19937 rng(7919u * seed + 31u * static_cast<unsigned>(budget) +
                         static_cast<unsigned>(n_sink));
        const Index D = dims[(seed + static_cast<unsigned>(budget)) % dims.size()];
        for (int t = 0; t < 300; ++t) {
          const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 1, 1, D);
          const vc::Tensor4<T> v = random_tensor<T>(rng, 1, 1, 1, D);
          oracle.absorb(row_of(k, 0, 0, 0), row_of(v, 0, 0, 0));
          const vc::KVPair<T> out = cache.update_and_fetch(k, v);
          ASSERT_EQ(cache.positions(0, 0), oracle.positions())
              << "budget " << budget << " n_sink " << n_sink << " seed " << seed << " token " << t;
          ASSERT_EQ(out.first.dimension(2), std::min(t, budget) + 1);
          const std::vector<float> sc = cache.scores(0, 0);
          const std::vector<double> want = oracle.scores();
          for (std::size_t r = 0; r < want.size(); ++r) {
            ASSERT_NEAR(static_cast<double>(sc[r]), want[r],
                        std::max(1e-6, 1e-4 * std::fabs(want[r])))
                << "budget " << budget << " token " << t << " row " << r;
          }
        }
        // Once full, the reference evicts the newcomer every step: it froze on the first tokens.
        std::vector<std::int64_t> first(static_cast<std::size_t>(budget));
        for (int i = 0; i < budget; ++i) first[static_cast<std::size_t>(i)] = i;
        EXPECT_EQ(cache.positions(0, 0), first);
        EXPECT_EQ(cache.offset(), 300);
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 33);
}

}  // namespace
