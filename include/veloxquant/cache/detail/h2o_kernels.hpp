// veloxquant — the H2O core kernels shared by SqueezeAttention, H2O and PyramidKV
// (docs/design.md 4).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "head_store.hpp"
#include "proxy.hpp"
#include "scoring.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

/// How a policy's protected recent window `g` follows its budget (docs/design.md 4.2 step 3).
struct GracePolicy {
  bool ratio = true;          ///< true: g = floor(recent_ratio * (budget - n_sink)); false: fixed
  double recent_ratio = 0.5;  ///< used when ratio
  int grace = 16;             ///< used when !ratio

  /// g for `budget`, clamped to [0, budget - n_sink - 1] so one row stays evictable.
  int protected_recent(int budget, int n_sink) const {
    const long long span = static_cast<long long>(budget) - n_sink;
    long long g = ratio ? static_cast<long long>(std::floor(recent_ratio * static_cast<double>(span)))
                        : static_cast<long long>(grace);
    g = std::min(g, span - 1);
    g = std::max(g, 0LL);
    return static_cast<int>(g);
  }
};

/// Evicts one row: the lowest score among the live rows that are neither sinks nor among the
/// newest `g`; ties go to the earliest position (docs/design.md 4.2 step 3). Returns false if none
/// qualifies.
template <class T>
inline bool evict_lowest(HeadStore<T>& head, int n_sink, int g) {
  const auto& ord = head.order();
  const Index lo = count_sinks_of(head, n_sink);
  const Index hi = head.live() - g;
  if (lo >= hi) return false;
  Index best = lo;
  float best_score = head.score(ord[static_cast<std::size_t>(lo)]);
  for (Index i = lo + 1; i < hi; ++i) {
    const float s = head.score(ord[static_cast<std::size_t>(i)]);
    if (s < best_score) {
      best_score = s;
      best = i;
    }
  }
  head.evict_at(best);
  return true;
}

/// Re-budget (docs/design.md 4.5): keeps the sinks, the newest `g` rows and the highest-score
/// others up to `budget`; among equal scores later positions survive. Order and scores are
/// preserved.
template <class T>
inline void rebudget(HeadStore<T>& head, int budget, int n_sink, int g, KernelScratch& scratch) {
  if (head.live() <= budget) return;
  const auto& ord = head.order();
  const Index lo = count_sinks_of(head, n_sink);
  const Index hi = std::max(lo, head.live() - g);
  const Index keep_mid = std::max<Index>(0, budget - lo - (head.live() - hi));
  scratch.picks.assign(ord.begin() + lo, ord.begin() + hi);
  keep_highest(head, scratch.picks, keep_mid, /*later_wins_ties=*/true);
}

/// Absorbs one appended row (slot `s`, not yet live) per docs/design.md 4.2: proxy attention of its
/// key over the live rows, decay and accumulate, join with score 0, then evict one row if over
/// `budget`.
template <class T>
inline void absorb_token(HeadStore<T>& head, Slot s, std::optional<int> budget, int n_sink, int g,
                         float decay, KernelScratch& scratch) {
  const Index n = head.live();
  if (n == 0) {
    head.score(s) = 1.0f;
    head.push_live(s);
    return;
  }
  const float* w = live_weights(head, s, scratch.query, scratch.weights);
  const Slot* live = head.order().data();
  // Gather, accumulate with the shared kernel, scatter back (same rounding as the fast paths).
  scratch.scores.resize(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) scratch.scores[static_cast<std::size_t>(i)] = head.score(live[i]);
  decay_accumulate(scratch.scores.data(), w, n, decay);
  for (Index i = 0; i < n; ++i) head.score(live[i]) = scratch.scores[static_cast<std::size_t>(i)];
  head.score(s) = 0.0f;
  head.push_live(s);
  if (budget && head.live() > *budget) evict_lowest(head, n_sink, g);
}

/// Decode fast path for one new row at slot `s` == live() when the live rows fill slots
/// [0, live()) (no holes): one pass of dot products over contiguous storage, a vectorised score
/// update, and a protected argmin in slot order (ties to the earliest position). Without
/// `queries` (docs/design.md 4.2) the key attends over the rows before it and joins with score 0;
/// with a one-token call's queries (docs/design.md 4.6) the token's G query heads attend over those
/// rows and itself. Returns false (nothing done) when the layout does not allow it or, without
/// queries, the head is empty; the caller then takes absorb_token or the blocked path.
template <class T>
inline bool absorb_decode(HeadStore<T>& head, Slot s, std::optional<int> budget, int n_sink, int g,
                          float decay, KernelScratch& scratch, Index chunk,
                          const QuerySlice& queries = {}) {
  const Index n = head.live();
  if (head.physical() != n + 1 || s != n || (n == 0 && !queries)) return false;
  head.score(s) = 0.0f;
  const Index window = queries ? n + 1 : n;
  const float* w = decode_weights(head, s, window, scratch, chunk, queries);
  decay_accumulate(&head.score(0), w, window, decay);
  head.push_live(s);
  if (!budget || head.live() <= *budget) return true;
  // Protected: sinks and the newest g rows (position >= that of the g-th newest).
  const std::int64_t newest_protected =
      g > 0 ? head.position(head.order()[static_cast<std::size_t>(head.live() - g)])
            : std::numeric_limits<std::int64_t>::max();
  const Index best = protected_argmin(head, &head.score(0), n + 1, n_sink, newest_protected);
  if (best >= 0) evict_slot(head, best);
  return true;
}

/// Blocked absorption over the blocked driver. Without `queries` (docs/design.md 4.2): per token,
/// proxy attention over the live rows (not itself), decay and accumulate, join with score 0, evict
/// one row if over budget -- the same retained sets as the one-token loop. With the call's queries
/// (docs/design.md 4.6): per token, the mean attention of its G query heads over the rows retained
/// before the call and the call's rows up to itself, decay and accumulate; then one re-budget per
/// call (the lowest-score unprotected rows go, ties earliest: the same rows as evicting one by
/// one).
template <class T>
inline void absorb_blocked(HeadStore<T>& head, Slot first, Index count, std::optional<int> budget,
                           int n_sink, int g, float decay, KernelScratch& scratch, Index block,
                           const QuerySlice& queries = {}) {
  if (queries) {
    for_each_token_blocked(head, first, count, n_sink, scratch, block, queries,
                           [&](BlockRows& rows, Slot s, const float* logit_rows, std::int32_t col) {
                             rows.push(s, col, 0.0f);
                             const Index n = rows.size();
                             float* w = scratch.weights.data();
                             rows.weights(logit_rows, n, w);
                             decay_accumulate(rows.scores.data(), w, n, decay);
                           });
    if (budget) rebudget(head, *budget, n_sink, g, scratch);
    return;
  }
  for_each_token_blocked(
      head, first, count, n_sink, scratch, block, queries,
      [&](BlockRows& rows, Slot s, const float* logit_row, std::int32_t col) {
        const Index n = rows.size();
        float entry = 1.0f;  // an empty head keeps its first row with score 1
        if (n > 0) {
          float* w = scratch.weights.data();
          rows.weights(logit_row, n, w);
          decay_accumulate(rows.scores.data(), w, n, decay);
          entry = 0.0f;
        }
        rows.push(s, col, entry);
        if (head.position(s) < n_sink) ++rows.sinks;
        if (!budget || rows.size() <= *budget) return;
        const Index hi = rows.size() - g;
        if (rows.sinks >= hi) return;
        const Index k = rows.argmin(rows.sinks, hi);
        head.mark_dead(rows.slots[static_cast<std::size_t>(k)]);
        rows.erase(k);
      });
}

}  // namespace veloxquant::cache::detail
