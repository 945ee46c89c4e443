// veloxquant — the one selection kernel (docs/design.md 4.2, 4.5, 6): which rows go when a head is
// over budget. Every policy ranks rows by one order: lower score first, and among equal scores the
// earlier position first (H2O core, TOVA, re-budget: "ties evict the earliest") or the later first
// (SnapKV: "ties keep the earliest"). A NaN (only possible in a value-weighted rank, from a NaN or
// infinite value stored as given, docs/design.md E) ranks below every number, so the order stays a
// strict weak order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// Which of two rows of equal score goes first.
enum class Tie : std::uint8_t { evict_earliest, evict_latest };

/// True when row (score sa, position pa) goes before row (sb, pb).
inline bool evicts_before(float sa, std::int64_t pa, float sb, std::int64_t pb, Tie tie) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return na;
  if (!na && sa != sb) return sa < sb;
  return tie == Tie::evict_earliest ? pa < pb : pa > pb;
}

/// The row to evict first among the rows i < n that are alive and whose position p satisfies
/// lo <= p < hi (the unprotected ones), by the order above; -1 when none qualifies.
/// score, pos, alive: [n]
inline Index worst_of(const float* score, const std::int64_t* pos, const std::uint8_t* alive,
                      Index n, std::int64_t lo, std::int64_t hi, Tie tie) {
  Index best = -1;
  for (Index i = 0; i < n; ++i) {
    if (!alive[i] || pos[i] < lo || pos[i] >= hi) continue;
    if (best < 0 || evicts_before(score[i], pos[i], score[best], pos[best], tie)) best = i;
  }
  return best;
}

/// worst_of over rows listed in ascending position, all alive and unprotected: order[lo, hi)
/// (indices into score). Returns the index into `order`, or -1 when the range is empty. The
/// scores are gathered into `buf` ([hi - lo]) and searched with the SIMD argmin: the one-token
/// calls' eviction.
inline Index worst_in_order(const std::int32_t* order, Index lo, Index hi, const float* score,
                            Tie tie, float* buf)
// (It calls a kernel from non-template code: like the kernels, declared only in a TU built against
// the compiled library; simd_kernels.hpp.)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if (lo >= hi) return -1;
  const Index n = hi - lo;
  for (Index i = 0; i < n; ++i) buf[i] = score[order[lo + i]];
  const bool latest = tie == Tie::evict_latest;
  int hits = 0;
  const Index k = argmin(buf, n, latest, &hits);
  if (k >= 0) return lo + k;
  // A NaN: it ranks before every number; among NaNs the tie rule decides.
  Index best = 0;
  for (Index i = 1; i < n; ++i) {
    const float s = buf[i], b = buf[best];
    if (s < b || (latest && s == b) || (s != s && (b == b || latest))) best = i;
  }
  return lo + best;
}
#else
    ;
#endif

/// Moves the `k` rows to evict first among the `n` candidates (indices into score and pos) to the
/// front of `candidates`, by the order above, in ascending index (slot) order there (the rest in
/// any order): the order a caller marks them dead in decides which rows compaction moves where,
/// so it must not depend on the standard library's nth_element (docs/design.md E).
inline void order_worst_first(std::int32_t* candidates, Index n, Index k, const float* score,
                              const std::int64_t* pos, Tie tie) {
  if (k <= 0) return;
  if (k < n) {
    std::nth_element(candidates, candidates + k, candidates + n,
                     [&](std::int32_t a, std::int32_t b) {
                       return evicts_before(score[a], pos[a], score[b], pos[b], tie);
                     });
  }
  std::sort(candidates, candidates + std::min(k, n));
}

}  // namespace veloxquant::cache::detail
