// The differential driver of the uniform-head sweeps: a cache under test, fed a call sequence
// through the public API (any update API, with or without queries), against one double-precision
// oracle head per (b, h) of tests/reference/ fed the same rows. After every call it checks what
// the call returned (docs/design.md 4.4, 2.3), the retained rows (state(), positions and scores of
// a scored policy), offset(), the accounting; a policy adds its own checks through RunChecks.
//
// A policy plugs in through its oracle heads (CoreHeads: SqueezeAttention, H2O, PyramidKV;
// TovaHeads; SnapHeads; StreamingHeads), each of which takes a call per head and says whether the
// oracle met a near-tie (an eviction decided by a relative gap below 1e-5, where float32 may
// legitimately choose the other row). The per-policy test files choose the configurations, the
// call sequences and the statistics their grid must reach; the driver is compiled once, with the
// library's instances (support/oracle_driver.cpp, -O1 in scripts/test.sh), for the three storage
// types and four oracle kinds, since the oracles' double loops were most of these tests' run time
// at -O0. Adaptive heads (SPEC 14), whose heads hold different numbers of rows and share one pool
// per sequence, have a driver of their own against the pooled oracle (test_adaptive_heads.cpp,
// tests/reference/adaptive_oracle.hpp): the checks here read state(), which ragged heads refuse.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "reference/oracle.hpp"
#include "reference/policy_oracles.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace veloxquant::test {

/// Token s's G query heads: [S][G][D].
using TokenQueries = std::vector<Rows>;

/// Token s's G query heads of KV head (b, h): query heads h * G .. h * G + G - 1, read through
/// float32 (what the cache scores with). q: [B, G * H, S, D]; returns [S][G][D].
template <class Q>
TokenQueries queries_of(const cache::Tensor4<Q>& q, Index b, Index h, Index G) {
  TokenQueries out(static_cast<std::size_t>(q.dimension(2)));
  for (Index s = 0; s < q.dimension(2); ++s) {
    for (Index g = 0; g < G; ++g) {
      std::vector<double> r(static_cast<std::size_t>(q.dimension(3)));
      for (Index d = 0; d < q.dimension(3); ++d) {
        r[static_cast<std::size_t>(d)] = to_double(q(b, h * G + g, s, d));
      }
      out[static_cast<std::size_t>(s)].push_back(std::move(r));
    }
  }
  return out;
}

/// Whether `api` passes queries (the oracle then scores with them, docs/design.md 4.6).
inline bool api_has_queries(Api a) {
  return a == Api::kFetchQ || a == Api::kViewQ || a == Api::kFetchIntoQ ||
         a == Api::kFetchIntoDoubleQ;
}

/// The update APIs without queries, each with T and with double inputs.
inline constexpr Api kProxyApis[] = {Api::kFetch, Api::kView, Api::kFetchInto, Api::kFetchDouble,
                                     Api::kViewDouble};
/// The update APIs with queries (float32 queries; the last with double keys, values and queries).
inline constexpr Api kAllQueryApis[] = {Api::kFetchQ, Api::kViewQ, Api::kFetchIntoQ,
                                        Api::kFetchIntoDoubleQ};

// ---------------------------------------------------------------------------------------------
// Oracle heads: one oracle per (b, h), fed one call at a time
// ---------------------------------------------------------------------------------------------

/// SnapKV scores of a call's rows from the key-as-query proxy (docs/design.md 6): the mean over
/// the last min(obs, S) keys of their softmax over all S rows, or (causal) over rows 0..j only
/// (rows after the proxy get 0). keys: [S][D]; returns [S].
std::vector<double> snap_call_scores(const Rows& keys, int obs_window, bool causal = false);

/// Relative gap between the last kept and the first dropped non-sink score of a SnapKV
/// compression of `keys` by the proxy (+inf when nothing is dropped). keys: [S][D].
double snap_selection_margin(const Rows& keys, int budget, int n_sink, int obs_window);
/// The same for a prompt chunk `keys` ranked with the rows `held` before it (SPEC 13.3), the
/// first `sinks` of them all kept as sinks.
double snap_selection_margin(const Rows& held, const Rows& keys, std::size_t sinks, int budget,
                             int obs_window);

/// The H2O core (SqueezeAttention, H2O, PyramidKV; docs/design.md 4.2, 4.5-4.8): calls without
/// queries token by token (the key-as-query proxy or the scorer set), with queries one call at a
/// time. A near-tie: an eviction of the proxy path decided by a relative gap below 1e-5.
class CoreHeads {
 public:
  using Scorer = reference::H2OHeadOracle::Scorer;
  /// n heads; `grace` gives the protected-recent rows for a budget (clamped as the library does);
  /// no budget: nothing is evicted until set_budget.
  CoreHeads(std::size_t n, int n_sink, double decay, std::function<int(int)> grace,
            std::optional<int> budget, Scorer scorer = Scorer::key_as_query);
  /// Head `head` absorbs one call (queries: [S][G][D], or null for the proxy); returns whether
  /// the oracle met a near-tie. keys: [S][Dk]; values: [S][Dv].
  bool absorb(std::size_t head, const Rows& keys, const Rows& values, const TokenQueries* queries);
  const std::vector<reference::OracleRow>& rows(std::size_t head) const {
    return heads_[head].rows();
  }
  std::size_t size() const { return heads_.size(); }
  /// The budget becomes known or changes (a docs/design.md 4.5 re-budget of every head).
  void set_budget(int budget);
  /// KVCacheConfig::value_norm_power of the cache under test (docs/design.md 4.8).
  void set_value_power(double p);
  void reset();

 private:
  std::vector<reference::H2OHeadOracle> heads_;
  int n_sink_;
  std::function<int(int)> grace_;
  std::optional<int> budget_;
};

/// TOVA (docs/design.md 6): one token at a time, with or without queries. A near-tie: the two
/// lowest evictable weights of an eviction within a relative 1e-5.
class TovaHeads {
 public:
  TovaHeads(std::size_t n, int n_sink, int budget)
      : heads_(n, reference::TOVAHeadOracle(n_sink, budget)), n_sink_(n_sink) {}
  bool absorb(std::size_t head, const Rows& keys, const Rows& values, const TokenQueries* queries);
  const std::vector<reference::OracleRow>& rows(std::size_t head) const {
    return heads_[head].rows();
  }
  std::size_t size() const { return heads_.size(); }
  void reset();

 private:
  std::vector<reference::TOVAHeadOracle> heads_;
  int n_sink_;
};

/// SnapKV (docs/design.md 6, 10.3): one call at a time; a prompt chunk after which a head would
/// pass the budget is compressed. A near-tie: a compression, by the proxy, cut between scores
/// within 1e-5.
class SnapHeads {
 public:
  SnapHeads(std::size_t n, int n_sink, int budget, int obs_window)
      : heads_(n, reference::SnapKVHeadOracle(n_sink, budget, obs_window)),
        n_sink_(n_sink),
        budget_(budget),
        obs_window_(obs_window) {}
  bool absorb(std::size_t head, const Rows& keys, const Rows& values, const TokenQueries* queries);
  const std::vector<reference::OracleRow>& rows(std::size_t head) const {
    return heads_[head].rows();
  }
  std::size_t size() const { return heads_.size(); }
  bool compressed() const { return heads_.front().compressed(); }
  void reset();

 private:
  std::vector<reference::SnapKVHeadOracle> heads_;
  int n_sink_, budget_, obs_window_;
};

/// StreamingLLM (docs/design.md 6): the sinks and the newest `window` others, token by token;
/// queries are ignored. Never a near-tie.
class StreamingHeads {
 public:
  StreamingHeads(std::size_t n, int n_sink, int window)
      : heads_(n, reference::StreamingLLMHeadOracle(n_sink, window)) {}
  bool absorb(std::size_t head, const Rows& keys, const Rows& values, const TokenQueries* queries);
  const std::vector<reference::OracleRow>& rows(std::size_t head) const {
    return heads_[head].rows();
  }
  std::size_t size() const { return heads_.size(); }

 private:
  std::vector<reference::StreamingLLMHeadOracle> heads_;
};

// ---------------------------------------------------------------------------------------------
// Call sequences
// ---------------------------------------------------------------------------------------------

/// One call of a run: its tokens, the API it goes through, the query heads per KV head (query
/// APIs), and whether two bad query tensors are tried first (rejected, nothing changed).
struct DriverCall {
  Index S = 1;
  Api api = Api::kFetch;
  Index G = 1;
  bool inject_bad = false;
};

/// How random_plan draws a sequence: a prefill, then `calls` more, each empty, short
/// ([2, short_max]), long ([long_min, long_max]) or one token with the given chances; an API
/// drawn from `apis` per call; G fixed or drawn from {1, 2, 4}; bad queries injected with chance
/// `bad_queries` before a call with queries.
struct PlanShape {
  Index prefill = 1;
  int calls = 30;
  double empty = 0.03, short_calls = 0.15, long_calls = 0.0;
  Index short_max = 8, long_min = 65, long_max = 160;
  std::vector<Api> apis = {Api::kFetch};
  Index G = 1;
  bool vary_g = false;
  double bad_queries = 0.0;
};

std::vector<DriverCall> random_plan(std::mt19937& rng, const PlanShape& shape);

/// The query sweeps' sequence of `calls` calls: a prefill of 1-150 tokens, then decode calls mixed
/// with empty calls, calls of 2-40 tokens and of 65-150 (across the 64 / G token blocks), each
/// through a random API with queries, with bad queries tried before ~12% of them.
std::vector<DriverCall> random_query_plan(std::mt19937& rng, int calls, Index G, bool vary_g);

// ---------------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------------

/// The dimensions of a run's calls.
struct RunDims {
  Index B = 1, H = 1, Dk = 4, Dv = 4;
};

/// Random dims of a proxy grid's run: B and H in 1..3, Dk and Dv in {2, 4, 8, 16}.
RunDims random_dims(std::mt19937& rng);

/// The draws of run `seed` of a query sweep (10 seeds cover every (G, D) pair of G 1, 2, 4 and
/// D 3, 8, 20; G varies per call for seeds 3 and 7): B 1-2, H 1-3, Dv 1-5, a budget of 8-40 rows,
/// 0-4 sinks.
struct QuerySweepRun {
  RunDims dims;
  Index G = 1;
  bool vary_g = false;
  int budget = 8, n_sink = 0;
  /// "<policy> seed=... B=... H=... D=... G=... budget=... n_sink=...".
  std::string describe(const std::string& policy, unsigned seed) const;
};
QuerySweepRun query_sweep_run(std::mt19937& rng, unsigned seed);

/// What a policy adds to a run: a description for messages, whether a mismatch after a near-tie
/// ends the run quietly (the caller then bounds how often that happens), a check after every
/// call (given the offset; returns the first problem or ""), and a hook that sees each call's
/// index and keys before the oracle absorbs them (to set the oracle's budget when the cache
/// adopts one).
template <class T>
struct RunChecks {
  std::string what;
  bool tolerate_near_ties = false;
  std::function<std::string(std::int64_t offset)> after_call;
  std::function<void(std::size_t call, const cache::Tensor4<T>& keys)> before_call;
};

/// The outcome of a run: `failure` (empty if none) says where it first disagreed; a run that met
/// a near-tie and then disagreed under tolerate_near_ties ends with diverged_at_tie and no
/// failure. The counts say what the checked calls covered.
struct RunOutcome {
  std::string failure;
  bool near_tie = false;
  bool diverged_at_tie = false;
  int calls_checked = 0;
  int evicting_calls = 0;     // checked calls after which the oracle had dropped a row
  int big_evicting_calls = 0;  // ... of more than 64 tokens (the blocked paths)
  int decode_evictions = 0;    // ... of one token
};

/// Runs `plan` on `subject` and `oracle` (a CoreHeads, TovaHeads, SnapHeads or StreamingHeads of
/// B * H heads) with fresh N(0, 1) keys, values and float32 queries per call from `rng`. A run
/// may continue an earlier one on the same cache and oracle (after a reset() of both, too).
template <class T, class Heads>
RunOutcome run_against_oracle(Subject<T>& subject, Heads& oracle, const RunDims& dims,
                              const std::vector<DriverCall>& plan, std::mt19937& rng,
                              const RunChecks<T>& checks);

/// The cache's retained rows against the oracle heads after a call that brought the sequence to
/// `offset`: state() rows bitwise, positions and scores (scored policies), tokens_seen,
/// tokens_kept and the byte accounting of unquantized rows. Returns the first mismatch, or "".
template <class T, class Heads>
std::string compare_with_oracle(const cache::KVCache<T>& cache, const Heads& oracle,
                                const RunDims& dims, std::int64_t offset);

#define VELOXQUANT_TEST_DRIVER(PREFIX, T, HEADS)                                               \
  PREFIX RunOutcome run_against_oracle<T, HEADS>(Subject<T>&, HEADS&, const RunDims&,          \
                                                 const std::vector<DriverCall>&, std::mt19937&, \
                                                 const RunChecks<T>&);                         \
  PREFIX std::string compare_with_oracle<T, HEADS>(const cache::KVCache<T>&, const HEADS&,     \
                                                   const RunDims&, std::int64_t);
#define VELOXQUANT_TEST_DRIVER_HEADS(PREFIX, T) \
  VELOXQUANT_TEST_DRIVER(PREFIX, T, CoreHeads)  \
  VELOXQUANT_TEST_DRIVER(PREFIX, T, TovaHeads)  \
  VELOXQUANT_TEST_DRIVER(PREFIX, T, SnapHeads)  \
  VELOXQUANT_TEST_DRIVER(PREFIX, T, StreamingHeads)
#define VELOXQUANT_TEST_DRIVER_EXTERN(T) VELOXQUANT_TEST_DRIVER_HEADS(extern template, T)
VELOXQUANT_TEST_STORAGE_TYPES(VELOXQUANT_TEST_DRIVER_EXTERN)
#undef VELOXQUANT_TEST_DRIVER_EXTERN

}  // namespace veloxquant::test
