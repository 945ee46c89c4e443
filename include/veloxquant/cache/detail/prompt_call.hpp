// veloxquant — SnapKV's ranking of a prompt chunk (docs/design.md 6, 10.3).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "call_io.hpp"
#include "head_store.hpp"
#include "rule.hpp"
#include "scratch.hpp"
#include "select.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// SnapKV (docs/design.md 6, 10.3): a prompt chunk of `count` rows (at [call_begin(), +count))
/// that would leave the head above its budget. Every row the head holds then, the retained ones
/// (slots [0, call_begin()), compacted) and the call's, is ranked by the mean, over the last
/// w = min(obs_window, count) tokens' query rows (their keys, or their G query heads), of their
/// softmax over all of those rows (no causal mask); the leading rows with a position below n_sink
/// (at most `budget` of them) stay, and the top budget - sinks others (ties: the earliest stay).
/// A first chunk on an empty head ranks the call's rows alone, as the one-shot compression of a
/// whole prompt does.
template <class T>
void compress_prompt(HeadStore<T>& head, const Rule& rule, Index count, const HeadQueries& q,
                     Scratch& sc) {
  const Index first = head.call_begin();
  const Index n = first + count;  // the retained rows, then the call's
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q ? q.groups : 1;
  const Index w = std::min<Index>(rule.obs_window, count);
  float* qrows = sc.queries.data();
  load_queries(head, q, count - w, w, qrows);  // the last w tokens observe
  const Index ld = Scratch::ld(n);
  float* lg = sc.logits.data();
  float* mean = sc.weights.data();
  logits(qrows, w * G, dp, head.key_rows(), nullptr, n, d, 1.0f / std::sqrt(static_cast<float>(d)),
         lg, ld, sc.keys.data());
  softmax_mean(lg, w * G, ld, n, mean);
  for (Index i = 0; i < n; ++i) head.score(i) = mean[i];
  for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
  const int budget = *rule.budget;
  const Index sinks = std::min<Index>(head.leading_sinks(rule.n_sink), budget);
  const Index keep = budget - sinks;
  const Index m = head.live() - sinks;
  if (m <= keep) return;
  std::int32_t* picks = sc.picks.data();
  const Slot* order = head.order().data();
  for (Index i = 0; i < m; ++i) picks[i] = order[sinks + i];
  order_worst_first(picks, m, m - keep, head.scores_data(), head.positions_data(),
                    Tie::evict_latest);
  for (Index i = 0; i < m - keep; ++i) head.mark_dead(picks[i]);
  head.drop_dead();
}

}  // namespace veloxquant::cache::detail
