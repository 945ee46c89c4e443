// veloxquant — the H2O core's calls without queries under a query-free scorer other than
// key-as-query (docs/design.md 4.7): K-norm and KeyDiff.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>

#include "head_store.hpp"
#include "proxy_scores.hpp"
#include "rule.hpp"
#include "scratch.hpp"
#include "select.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// KeyDiff's ranking (docs/design.md 4.7) of the live rows of `head` at order[lo, hi) (the
/// candidates), by slot; the scores hold each row's 1 / (|k| + 1e-8). When the live set changed
/// otherwise than through absorb_proxy (a call with queries, a re-budget, a load), first rewrites
/// every live row's score as that weight, from its key (a call with queries added attention mass
/// to it; a loaded file's scores are not trusted), and rebuilds the running sum from them.
/// Returns the ranking (in sc.logits; sc.queries row 0 holds the mean on the way, row 1 a row
/// while rebuilding).
template <class T>
const float* keydiff_rank_head(HeadStore<T>& head, Index lo, Index hi, Scratch& sc) {
  const Index n = head.live(), d = head.key_dim(), dp = padded_dim(d);
  const Slot* ord = head.order().data();
  KeyDiffSum& state = head.keydiff_sum();
  std::int64_t* sum = state.sum.data();
  if (!state.valid) {
    std::fill(sum, sum + d, std::int64_t{0});
    float* row = sc.queries.data() + dp;
    for (Index j = 0; j < n; ++j) {
      const float w = 1.0f / (key_norm(head.key_rows(), ord[j], d, row, sc.keys.data()) + kUnitEps);
      head.score(ord[j]) = w;
      key_sum_update(sum, row, d, w, 1);
    }
    state.valid = true;
  }
  const float* weight = head.scores_data_const();
  // Over the storage as it lies unless dead slots are many (a long prompt evicting as it goes).
  const Index n_phys = head.physical();
  float* rank = sc.logits.data();
  keydiff_rank(head.key_rows(), d, sum, weight, n, n_phys, ord + lo, hi - lo, n_phys - n <= n / 8,
               rank, sc.weights.data(), sc.queries.data(), sc.keys.data());
  return rank;
}

/// Before the live slot `victim` of a KeyDiff head is evicted: takes the row's unit vector out of
/// the running sum (docs/design.md 4.7) when the sum is valid, and says whether it was. The caller
/// then evicts the row and marks the sum valid again, so that the next ranking need not rebuild
/// it. Uses sc.queries row 1 for the row.
template <class T>
bool keydiff_take_out(HeadStore<T>& head, Slot victim, Scratch& sc) {
  KeyDiffSum& state = head.keydiff_sum();
  if (!state.valid) return false;
  const Index d = head.key_dim();
  float* row = sc.queries.data() + padded_dim(d);
  load_stored_row(head.key_rows(), victim, d, row);
  key_sum_update(state.sum.data(), row, d, head.score(victim), -1);
  return true;
}

/// The H2O core without queries under a query-free scorer other than key-as-query (docs/design.md
/// 4.7): the `count` rows at [call_begin(), +count) join one at a time, each with its score
/// (K-norm: -|k|; KeyDiff: 1 / (|k| + 1e-8)); over budget, the lowest-ranked row among all but the
/// sinks and the newest g goes (ties: the earliest), as in 4.2. K-norm ranks by the scores,
/// KeyDiff by keydiff_rank over the live rows at that moment (its running sum follows each row in
/// and out).
template <class T>
void absorb_proxy(HeadStore<T>& head, const Rule& rule, Index count, Scratch& sc) {
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const int g = rule.protected_recent();
  const bool keydiff = rule.proxy == ProxyScoring::keydiff;
  float* row = sc.queries.data() + dp;
  for (Index t = 0; t < count; ++t) {
    const auto s = static_cast<Slot>(first + t);
    const float norm = key_norm(head.key_rows(), s, d, row, sc.keys.data());
    const float w = keydiff ? 1.0f / (norm + kUnitEps) : -norm;
    head.score(s) = w;
    KeyDiffSum& state = head.keydiff_sum();
    bool sum_valid = keydiff && state.valid;
    head.push_live(s);
    if (sum_valid) {
      key_sum_update(state.sum.data(), row, d, w, 1);  // the row key_norm loaded
      state.valid = true;
    }
    if (!rule.budget || head.live() <= *rule.budget) continue;
    const Index n = head.live();
    const Slot* ord = head.order().data();
    const Index sinks = head.leading_sinks(rule.n_sink);
    if (n - g <= sinks) continue;
    const float* rank =
        keydiff ? keydiff_rank_head(head, sinks, n - g, sc) : head.scores_data_const();
    const Index at =
        worst_in_order(ord, sinks, n - g, rank, Tie::evict_earliest, sc.weights.data());
    sum_valid = keydiff && keydiff_take_out(head, ord[at], sc);
    head.evict_at(at);
    if (sum_valid) state.valid = true;
  }
}

}  // namespace veloxquant::cache::detail
