// veloxquant fuzz harness: turns a byte string into a sequence of operations on ONE cache and
// checks every operation against the naive double-precision oracles of tests/reference/ and against
// the invariants of docs/design.md sections 2, 4, 5, 6 and 8. Used by the libFuzzer target
// (fuzz/fuzz_cache.cpp, clang) and by the corpus replay test (tests/test_fuzz_regressions.cpp,
// g++).
//
// Entry points:
//   std::string veloxquant::fuzz::run_ops(data, size, options)  -> "" or the first violation
//   void veloxquant::fuzz::check_ops(data, size, on_failure)    -> calls on_failure(message)
//
// What the bytes choose (a missing byte reads as 0, so every input is valid and short inputs are
// short runs):
//   * the policy: standard, squeeze without coordinator (factory or constructor), squeeze as one
//     layer of a KVCacheBuilder model (shared coordinator, L = 1..3 layers, optional deferral,
//     other layers' concentrations reported by the harness), h2o, pyramidkv as a single layer
//     (pyramid_resolved_budget) or one layer of a builder model, tova, streaming_llm, snapkv;
//   * the storage type (float, Eigen::half, Eigen::bfloat16);
//   * a small valid configuration (budgets 1..24, n_sink 0..5, grace, recent ratio, decay, beta,
//     window, obs window), or, 1 time in 12, a configuration with exactly one invalid field (counts
//     down to INT_MIN), which must throw std::invalid_argument naming that field at construction;
//   * adaptive head budgets (SPEC 14; flag bits 2-3 = 2): head_budgets = "adaptive" on any policy
//     (the others must ignore it), and for the H2O core a floor in {0.05 .. 1} and optionally a
//     resolved budget (one more byte); an adaptive run's invalid field may be head_budgets or
//     head_budget_floor;
//   * per sequence (at the start and after every reset): B 1..2, H 1..3, Dk and Dv 1..8, and the
//     query mode (no queries / every call with queries / mixed per call);
//   * then up to kMaxOps operations: calls with S in 0..40 through update_and_fetch,
//     update_and_view or update_and_fetch_into, with storage-typed or double inputs, with or
//     without queries (G 1..3; float, double or half), reset() (of the cache alone or of the whole
//     builder model and its coordinator), trim(n), save_prompt_cache + load_prompt_cache of every
//     cache of the run (carrying on with the loaded set), KVCacheBuilder::fork of the run's set
//     (carrying on with the copy or the source; the other side must never change after it),
//     KVCacheBuilder::checkpoint + one to three draft calls + rollback (everything observable
//     exactly as at the checkpoint; a second rollback refused), set_parallel_heads, a reused output
//     tensor of the wrong shape, reports of other layers to the coordinator, and bad inputs:
//     NaN/Inf keys at a chosen index, a double key overflowing the storage type, keys/values that
//     disagree in B, H or S, zero B/H/D, B/H/D changed after the first call, bad queries (Hq
//     not a positive multiple of H, wrong B/S/D, NaN/Inf query, double query overflowing float),
//     and the hostile ones of docs/robustness.md: finite keys and queries beyond +-2^48 and values
//     beyond +-2^96 (or beyond half), a head dim of 65537, empty calls through null TensorRefs
//     claiming 2^40 heads (refused once the dims are known) or dims whose product overflows, and
//     an empty call with null queries claiming 2^40 * H query heads (valid: it must return at
//     once).
//   Data: every key, value and query entry is a multiple of 0.25 in [-2, 2] (some modes use
//   {-1, 0, 1}, mostly-zero rows, or a small palette of repeated rows), so every storage type holds
//   it exactly, dot products are exact in float32, and exact ties (identical keys, identical
//   logits) are frequent. One sequence in four is "one-hot": keys and queries in {-64, 0, 64}, so
//   logits that differ at all differ by more than 1448 and every softmax weight is exactly 0 or
//   1/m, in the library (docs/design.md A(k)) and in the oracle alike: rows that receive no
//   attention tie exactly, which exercises the tie rules of the H2O core (earliest evicted; in a
//   re-budget the later position survives), where ordinary data almost never produces an exact tie.
//
// Checks after every accepted call:
//   * the returned window is the rows retained before the call followed by every row of the call
//     (docs/design.md 4.4): bitwise, in ascending position for update_and_fetch /
//     update_and_fetch_into; for update_and_view the earlier rows may come in any order
//     (positions() say which) and the call's rows come last in arrival order (docs/design.md 2.3);
//   * offset(), tokens_seen(), tokens_kept(), kept_bytes(), full_seq_bytes(), compression_ratio(),
//     heap_bytes() >= kept_bytes(), batch()/heads()/key_dim()/value_dim();
//   * the retained row count per head equals a count model that does not depend on which rows were
//     evicted (and so stays valid after a tolerated divergence, see below), and is within the
//     budget (H2O core and TOVA once the budget is known, StreamingLLM n_sink + window);
//   * retained positions are ascending, below offset(), include every sink, and (H2O core) include
//     the newest protected_recent() rows of the call; state() holds exactly the rows that were fed
//     at those positions;
//   * retained positions equal the oracle's per head, and scores are within 1e-6 absolute or 1e-4
//     relative of the oracle's (H2O core, TOVA; SnapKV);
//   * budget(), n_sink(), protected_recent(), layer_budget(), compressed(), concentration()
//     (against the Gram-matrix reference, 1e-9), budget_adopted(), and the coordinator's reports,
//     finalisation and resolved budget against a model of docs/design.md 5.4;
//   * adaptive heads (SPEC 14, docs/design.md 4.9) instead of a count per head: each sequence's
//     heads hold exactly min(every row fed, H x budget) (the pool bound), each head at least
//     min(its rows before + S, ceil(floor x budget)) (its floor), kept_bytes() = the rows held x
//     (Dk + Dv) x sizeof(T), tokens_kept() head (0, 0)'s rows; a returned window per head (its
//     rows before the call, then the call's), a view's ragged() and rows() (std::logic_error) when
//     its heads differ; state() on ragged heads throws std::invalid_argument naming attend and
//     update_and_view and changes nothing, else holds what an empty call's view shows; every
//     valid fetch (update_and_fetch, update_and_fetch_into, empty or not) on ragged heads throws
//     the same, changing neither the cache nor the reused output (and a draft of a checkpoint
//     is then made as a view); positions and scores against per-head oracles fed without a budget
//     and a pooled eviction modelled one row at a time (ops_oracle.hpp pool_evict: lowest rank
//     among the heads above their floor, sinks and the newest g protected, ties to the earlier
//     position then the lower head), a near-tie in a pooled decision excusing the whole sequence.
// Checks after every rejected call: it threw std::invalid_argument (nothing else), and state(),
// offset(), the accounting, heap_bytes(), dims, scores, positions, budget(), protected_recent(),
// layer_budget(), compressed(), concentration(), budget_adopted() and the coordinator (reports,
// finalisation, generation) are exactly as before (strong guarantee, docs/design.md 8): the shared
// Snapshot of tests/support/subjects.hpp. A call expected to be valid must not throw, and vice
// versa. Policy state (scores, positions, budget, n_sink, protected window) is read through the
// public policy classes (tests/support/test_support.hpp: visit_core / visit_scored and the policy_*
// / core_* helpers), never through the library's detail layer.
//
// Tolerance for float32 scoring against the double oracle (the only excused difference): a
// retained-set or score mismatch in a head is excused only after a near-tie decision in that head
// in the same call (ops_ties.hpp states the rule and its bounds in full).
//
// The harness, by part (namespace veloxquant::fuzz::detail):
//   ops_input.hpp    Options, Stats, the input reader (Bytes) and the tensor data generator
//   ops_kinds.hpp    the runs (a method, alone or in a builder model), query modes, entry points
//                    and bad inputs, and their names
//   ops_report.hpp   the violation, the operation trace and message formatting (Reporter)
//   ops_ties.hpp     the tolerances and the near-tie rule
//   ops_config.hpp   the run's method and configuration, valid or with one invalid field (RunSpec)
//   ops_subject.hpp  the caches under test and their classes (CacheUnderTest)
//   ops_calls.hpp    one call: its plan, dims and data, each entry point, the returned window
//   ops_budget.hpp   the H2O core's budget model and the squeeze coordinator's (BudgetModel)
//   ops_oracle.hpp   the sequence: dims, counters, rows fed, per-head oracles (SequenceModel)
//   ops_checks.hpp   every check of the cache against the models (Checks)
//   ops_harness.hpp  the run: construction and the operations (Harness)
#pragma once

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>

#include "ops_harness.hpp"

namespace veloxquant::fuzz {

/// Runs one input; returns "" or a description of the first violation (with the run's config
/// and its last operations).
inline std::string run_ops(const std::uint8_t* data, std::size_t size,
                           const Options& options = {}) {
  detail::Bytes in(data, size);
  if (options.stats) ++options.stats->runs;
  try {
    switch (in.pick(3)) {
      case 1:
        detail::Harness<Eigen::half>(in, options).run();
        break;
      case 2:
        detail::Harness<Eigen::bfloat16>(in, options).run();
        break;
      default:
        detail::Harness<float>(in, options).run();
        break;
    }
  } catch (const detail::Violation& v) {
    return v.what;
  } catch (const std::exception& e) {
    return std::string("unexpected exception escaped the harness: ") + e.what();
  }
  return {};
}

/// run_ops, calling on_failure(message) on a violation (default: print it and abort).
inline void check_ops(const std::uint8_t* data, std::size_t size,
                      const std::function<void(const std::string&)>& on_failure = nullptr,
                      const Options& options = {}) {
  const std::string msg = run_ops(data, size, options);
  if (msg.empty()) return;
  if (on_failure) {
    on_failure(msg);
    return;
  }
  std::fprintf(stderr, "veloxquant fuzz violation: %s\n", msg.c_str());
  std::abort();
}

}  // namespace veloxquant::fuzz
