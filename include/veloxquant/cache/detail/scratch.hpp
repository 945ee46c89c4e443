// veloxquant — per-worker scratch buffers of the scoring kernels, sized before a call mutates
// anything (so a bad_alloc leaves the cache unchanged) and released after a long prompt.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "head_store.hpp"

namespace veloxquant::cache::detail {

/// Columns of a scoring product padded to a multiple of 16 (with zero keys). Eigen's GEMM computes
/// the columns past the last full register block with a different summation order, so without the
/// padding two identical keys could get logits an ulp apart and exact ties (docs/design.md 4.2,
/// 4.5, 6: the earliest position wins) would be decided by where a row falls in the matrix.
inline Index padded_columns(Index cols) { return (cols + 15) / 16 * 16; }

/// Keeps a scratch vector's capacity at `n` elements: grows exactly, and releases memory when
/// more than twice what is needed is held (so a long prompt's scratch does not outlive it).
template <class V>
inline void fit_capacity(V& v, std::size_t n) {
  if (v.capacity() < n) {
    V fresh;
    fresh.reserve(n);
    v.swap(fresh);
  } else if (v.capacity() > 2 * n + 64) {
    V fresh;
    fresh.reserve(n);
    v.swap(fresh);
  }
}

/// Scratch buffers of the scoring kernels of one worker, sized before a call mutates anything.
struct KernelScratch {
  std::vector<float> weights;         // [n] attention of one token over the rows (mean over G)
  std::vector<float> query;           // [Dk] proxy query, or [lhs_rows, Dk] a block's real queries
  std::vector<Slot> picks;            // [n] candidates of a re-budget
  std::vector<float> keys;            // [rows, Dk] keys converted to float32 (block or chunk)
  std::vector<float> logits;          // [lhs_rows, rows] logits of a block (or [G, rows] decode)
  std::vector<std::int32_t> column;   // [rows] live row (ascending position) -> column of `logits`
  std::vector<Slot> slots;            // [rows] live row (ascending position) -> slot
  std::vector<float> scores;          // [rows] live row (ascending position) -> score
  std::vector<float> group;           // [rows] one query head's weights while averaging over G

  /// Room for a call that holds up to `rows` rows per head with `new_rows` new ones. `lhs_rows`:
  /// rows of the left operand of one scoring product (block tokens, times G with queries);
  /// `groups`: G query heads per KV head, 0 when the call brings no queries.
  void reserve(Index rows, Index dk, Index new_rows, Index lhs_rows, Index chunk, Index groups) {
    const auto r = static_cast<std::size_t>(rows);
    const auto d = static_cast<std::size_t>(dk);
    const auto lhs = static_cast<std::size_t>(lhs_rows);
    fit_capacity(weights, r);
    fit_capacity(picks, r);
    // Blocked sizes also for a one-token call with queries: when the call adopts a budget, the
    // re-budget leaves holes in the slots and that token goes through the blocked driver.
    if (new_rows > 1 || groups > 0) {
      const auto padded = static_cast<std::size_t>(padded_columns(rows));
      fit_capacity(query, groups > 0 ? lhs * d : d);
      fit_capacity(keys, padded * d);
      fit_capacity(logits, lhs * padded);
      fit_capacity(column, r);
      fit_capacity(slots, r);
      fit_capacity(scores, r);
      fit_capacity(group, groups > 1 ? r : 0);
    } else {
      fit_capacity(query, d);
      fit_capacity(keys, static_cast<std::size_t>(std::min(chunk, rows)) * d);
      fit_capacity(logits, groups > 1 ? static_cast<std::size_t>(groups) * r : 0);
      fit_capacity(column, 0);
      fit_capacity(slots, 0);
      fit_capacity(scores, r);  // the one-token path gathers scores here
      fit_capacity(group, 0);
    }
  }

  std::size_t heap_bytes() const {
    return weights.capacity() * sizeof(float) + query.capacity() * sizeof(float) +
           picks.capacity() * sizeof(Slot) + keys.capacity() * sizeof(float) +
           logits.capacity() * sizeof(float) + column.capacity() * sizeof(std::int32_t) +
           slots.capacity() * sizeof(Slot) + scores.capacity() * sizeof(float) +
           group.capacity() * sizeof(float);
  }
};

}  // namespace veloxquant::cache::detail
