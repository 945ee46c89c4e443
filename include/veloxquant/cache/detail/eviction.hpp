// veloxquant — choosing the rows a head gives up (docs/design.md 4.2, 4.5, 4.8): the re-budget of
// a whole head, the one row a decode step evicts, and the value-weighted ranking they may use.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <limits>

#include "head_store.hpp"
#include "scratch.hpp"
#include "select.hpp"
#include "simd_kernels.hpp"
#include "value_rank.hpp"

namespace veloxquant::cache::detail {

/// The value-weighted ranking (docs/design.md 4.8) of every live row of `head` (whose value
/// weights are on), by slot: score * |v|^p. Returns it (in sc.logits).
template <class T>
const float* value_rank_head(const HeadStore<T>& head, Scratch& sc) {
  float* rank = sc.logits.data();
  value_weighted_rank(head.scores_data_const(), head.value_weights_data(), head.order().data(),
                      head.live(), rank);
  return rank;
}

/// Re-budget (docs/design.md 4.5): keeps the sinks, the newest `g` rows and the highest-score
/// others up to `budget`; among equal scores the later positions survive. `rank` (by slot; null:
/// the scores) is what "score" means here (KeyDiff's ranking, keydiff_rank_head).
template <class T>
void rebudget(HeadStore<T>& head, int budget, int n_sink, int g, Scratch& sc,
              const float* rank = nullptr) {
  const Index n = head.live();
  if (n <= budget) return;
  const Slot* ord = head.order().data();
  const Index sinks = head.leading_sinks(n_sink);
  const Index hi = std::max(sinks, n - g);
  const Index keep = std::max<Index>(0, budget - sinks - (n - hi));
  const Index m = hi - sinks;
  if (m <= keep) return;
  const float* score = rank != nullptr ? rank : head.scores_data();
  if (m - keep == 1) {
    // One row goes (a decode step over budget): the SIMD search over the live order.
    head.evict_at(worst_in_order(ord, sinks, hi, score, Tie::evict_earliest, sc.weights.data()));
    return;
  }
  std::int32_t* picks = sc.picks.data();
  std::copy(ord + sinks, ord + hi, picks);
  order_worst_first(picks, m, m - keep, score, head.positions_data(), Tie::evict_earliest);
  for (Index i = 0; i < m - keep; ++i) head.mark_dead(picks[i]);
  head.drop_dead();
}

/// The live row of `head` to evict first among all but the sinks and the newest `g` (its index in
/// the live order), by the order of select.hpp with ties to the earliest; -1 if none. The scores
/// go to `buf` in slot order (contiguous) with the protected and dead slots at +inf, and the
/// SIMD argmin finds the lowest. When that lowest value is not unique (a tie: positions decide)
/// or not a number, the exact search over the live order decides.
template <class T>
Index worst_live(const HeadStore<T>& head, int n_sink, int g, float* buf) {
  const Slot* ord = head.order().data();
  const Index n = head.live(), n_phys = head.physical();
  const Index sinks = head.leading_sinks(n_sink);
  if (n - g <= sinks) return -1;
  const float inf = std::numeric_limits<float>::infinity();
  const float* score = head.scores_data_const();
  std::copy(score, score + n_phys, buf);
  for (Index i = 0; i < sinks; ++i) buf[ord[i]] = inf;
  for (Index i = n - g; i < n; ++i) buf[ord[i]] = inf;
  for (const Slot h : head.holes()) buf[h] = inf;
  int hits = 0;
  const Index k = argmin(buf, n_phys, false, &hits);
  if (k >= 0 && hits == 1 && buf[k] < inf) return head.order_index(static_cast<Slot>(k));
  return worst_in_order(ord, sinks, n - g, score, Tie::evict_earliest, buf);
}

}  // namespace veloxquant::cache::detail
