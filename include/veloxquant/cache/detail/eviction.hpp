// veloxquant — choosing the rows a head gives up (docs/design.md 4.2, 4.5, 4.8, 4.9): the re-budget
// of a whole head, the one row a decode step evicts, the value-weighted ranking they may use, and
// the pooled re-budget of the heads of one sequence that share their rows (adaptive heads).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "assert.hpp"
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

/// The ranks of `head`'s candidates, the rows at order[sinks, hi), laid out by slot in `buf`
/// ([physical()]) with every other slot (sinks, newest rows, dead slots) at +inf: what the SIMD
/// argmin searches. `every_slot`: `rank` holds a value at every slot below physical() (the
/// scores: copied, the others then masked); else only at the candidates' slots (a ranking).
template <class T>
void ranks_by_slot(const HeadStore<T>& head, const float* rank, bool every_slot, Index sinks,
                   Index hi, float* buf) {
  const Slot* ord = head.order().data();
  const Index n_phys = head.physical();
  const float inf = std::numeric_limits<float>::infinity();
  if (every_slot) {
    std::copy(rank, rank + n_phys, buf);
    for (Index i = 0; i < sinks; ++i) buf[ord[i]] = inf;
    for (Index i = hi; i < head.live(); ++i) buf[ord[i]] = inf;
    for (const Slot h : head.holes()) buf[h] = inf;
  } else {
    std::fill(buf, buf + n_phys, inf);
    for (Index i = sinks; i < hi; ++i) buf[ord[i]] = rank[ord[i]];
  }
}

/// The live row of `head` to evict first among all but the sinks and the newest `g` (its index in
/// the live order), by the order of select.hpp with ties to the earliest; -1 if none. The SIMD
/// argmin searches the scores laid out by slot (ranks_by_slot). When that lowest value is not
/// unique (a tie: positions decide) or not a number, the exact search over the live order decides.
template <class T>
Index worst_live(const HeadStore<T>& head, int n_sink, int g, float* buf) {
  const Index n = head.live();
  const Index sinks = head.leading_sinks(n_sink);
  if (n - g <= sinks) return -1;
  const float inf = std::numeric_limits<float>::infinity();
  const float* score = head.scores_data_const();
  ranks_by_slot(head, score, true, sinks, n - g, buf);
  int hits = 0;
  const Index k = argmin(buf, head.physical(), false, &hits);
  if (k >= 0 && hits == 1 && buf[k] < inf) return head.order_index(static_cast<Slot>(k));
  return worst_in_order(head.order().data(), sinks, n - g, score, Tie::evict_earliest, buf);
}

/// Candidates per head up to which pooled_rebudget selects them one by one (a decode step: up to
/// one row per head over the pool) rather than by nth_element over all of them.
inline constexpr Index kSmallQuota = 16;

/// The ranks (ascending) of the `cap` lowest-ranked rows a pooled eviction has kept so far, a NaN
/// (which goes first) counted as -inf: once `cap` are known, a row ranked above the last cannot be
/// among the `cap` that go.
struct PoolBound {
  float rank[kSmallQuota];
  Index n = 0, cap = 0;

  float value() const {
    return cap > 0 && n == cap ? rank[cap - 1] : std::numeric_limits<float>::infinity();
  }
  void add(float r) {
    if (cap == 0) return;
    if (std::isnan(r)) r = -std::numeric_limits<float>::infinity();
    if (n == cap && !(r < rank[cap - 1])) return;
    Index at = n < cap ? n++ : cap - 1;
    for (; at > 0 && r < rank[at - 1]; --at) rank[at] = rank[at - 1];
    rank[at] = r;
  }
};

/// pooled_rebudget's search of one head with a small quota: its lowest-ranked unprotected rows,
/// lowest first, each found by the SIMD argmin over the ranks laid out by slot (ranks_by_slot,
/// in `buf`; each row found is then set to +inf too), appended to `out` until `quota` are there or
/// the next ranks above `bound` (the pool already holds enough rows ranked lower). Returns false
/// when a search meets equal ranks, a NaN or a +inf minimum not above `bound` (indistinguishable
/// from the masked slots) (positions or the exact order decide; the caller's one-pass search takes
/// over, its rows in `out` then discarded). `buf` holds physical() floats: sc.weights, sized for
/// every row a call may hold (live rows + its tokens).
template <class T, class Pick>
bool pool_lowest_by_argmin(const HeadStore<T>& head, const float* r, bool every_slot, Index sinks,
                           Index hi, Index quota, float bound, float* buf, const Pick& pick,
                           PoolPick* out, Index& n_out) {
  const Index n_phys = head.physical();
  const float inf = std::numeric_limits<float>::infinity();
  ranks_by_slot(head, r, every_slot, sinks, hi, buf);
  for (Index got = 0; got < quota; ++got) {
    int hits = 0;
    const Index k = argmin(buf, n_phys, false, &hits);
    if (k < 0) return false;
    if (buf[k] > bound) return true;
    if (hits != 1 || buf[k] == inf) return false;
    out[n_out++] = pick(static_cast<Slot>(k));
    buf[k] = inf;
  }
  return true;
}

/// The pooled re-budget of adaptive heads (SPEC 14, docs/design.md 4.9): the `n` heads of one
/// sequence share `n * budget` rows; while they hold more, the row with the lowest rank among
/// the unprotected rows (not a sink, not among its head's newest `g`) of the heads holding more
/// than `floor_rows` goes, ties to the earlier position, then to the lower head. `rank(h, lo, hi,
/// sc)` gives head h's ranking by slot of the rows at order[lo, hi) (null: its scores); it is
/// asked once per head that may give rows up, before any row goes. `mark_dead(h, slot)` evicts a
/// row (dropped from the live order afterwards). sc.pool holds room for every unprotected row.
template <class T, class Rank, class MarkDead>
void pooled_rebudget(HeadStore<T>* heads, Index n, int budget, Index floor_rows, int n_sink, int g,
                     Scratch& sc, const Rank& rank, const MarkDead& mark_dead) {
  Index held = 0;
  for (Index h = 0; h < n; ++h) held += heads[h].live();
  const Index excess = held - n * static_cast<Index>(budget);
  if (excess <= 0) return;
  // Each head's candidates: its `quota` lowest-ranked unprotected rows at most (it never goes
  // below its floor), and never more than the excess. The union's `excess` lowest are exactly
  // what taking the pool's lowest row one at a time would take.
  const auto before = [](const PoolPick& a, const PoolPick& b) {
    if (evicts_before(a.rank, a.pos, b.rank, b.pos, Tie::evict_earliest)) return true;
    if (evicts_before(b.rank, b.pos, a.rank, a.pos, Tie::evict_earliest)) return false;
    return a.head < b.head;
  };
  PoolPick* pool = sc.pool.data();
  Index n_pool = 0;
  PoolBound bound;
  bound.cap = excess <= kSmallQuota ? excess : 0;
  for (Index h = 0; h < n; ++h) {
    HeadStore<T>& head = heads[h];
    const Index live = head.live();
    const Index sinks = head.leading_sinks(n_sink);
    const Index hi = std::max(sinks, live - g);
    const Index m = hi - sinks;
    const Index quota = std::min({m, std::max<Index>(0, live - floor_rows), excess});
    if (quota <= 0) continue;
    const float* r = rank(h, sinks, hi, sc);
    const bool scores = r == nullptr;
    if (scores) r = head.scores_data_const();
    const Slot* ord = head.order().data();
    const auto pick = [&](Slot s) {
      return PoolPick{r[s], static_cast<std::int32_t>(h), head.position(s), s};
    };
    if (quota <= kSmallQuota) {
      // A decode step (a few rows over the pool): the SIMD search, or when it cannot decide, one
      // pass over the live order keeping the `quota` lowest, sorted, in the pool itself (most
      // rows fail the first comparison with the highest kept).
      const Index first = n_pool;
      VELOXQUANT_ASSERT(sc.weights.capacity() >= static_cast<std::size_t>(head.physical()),
                        "pooled selection scratch");
      const bool found = pool_lowest_by_argmin(head, r, scores, sinks, hi, quota, bound.value(),
                                               sc.weights.data(), pick, pool, n_pool);
      if (!found) n_pool = first;
      for (Index i = first; i < n_pool; ++i) bound.add(pool[i].rank);
      if (found) continue;
      PoolPick* kept = pool + n_pool;
      Index n_kept = 0;
      for (Index i = sinks; i < hi; ++i) {
        const Slot s = ord[i];
        if (n_kept == quota && !(r[s] <= kept[quota - 1].rank) && !std::isnan(r[s])) continue;
        const PoolPick x = pick(s);
        if (n_kept == quota && !before(x, kept[quota - 1])) continue;
        Index at = n_kept < quota ? n_kept++ : quota - 1;
        for (; at > 0 && before(x, kept[at - 1]); --at) kept[at] = kept[at - 1];
        kept[at] = x;
      }
      for (Index i = 0; i < n_kept; ++i) bound.add(kept[i].rank);
      n_pool += n_kept;
      continue;
    }
    std::int32_t* picks = sc.picks.data();
    std::copy(ord + sinks, ord + hi, picks);
    order_worst_first(picks, m, quota, r, head.positions_data(), Tie::evict_earliest);
    for (Index i = 0; i < quota; ++i) {
      pool[n_pool++] = pick(picks[i]);
      bound.add(pool[n_pool - 1].rank);
    }
  }
  const Index take = std::min(excess, n_pool);
  if (take < n_pool) std::nth_element(pool, pool + take, pool + n_pool, before);
  // Marked head by head in ascending slot order, as a uniform head's re-budget marks its rows
  // (order_worst_first): the order decides where compaction moves rows (docs/design.md E).
  std::sort(pool, pool + take, [](const PoolPick& a, const PoolPick& b) {
    return a.head != b.head ? a.head < b.head : a.slot < b.slot;
  });
  for (Index i = 0; i < take; ++i) mark_dead(static_cast<Index>(pool[i].head), pool[i].slot);
  for (Index h = 0; h < n; ++h) {
    if (!heads[h].holes().empty()) heads[h].drop_dead();
  }
}

}  // namespace veloxquant::cache::detail
