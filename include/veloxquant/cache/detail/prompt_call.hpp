// veloxquant — SnapKV's one ranking of a prompt (docs/design.md 6).
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

/// SnapKV (docs/design.md 6): ranks the `count` rows of the call at [call_begin(), +count) by the
/// mean, over the last w = min(obs_window, count) tokens' query rows (their keys, or their G query
/// heads), of their softmax over all the call's rows (no causal mask); keeps the call's first
/// min(n_sink, budget) rows and the top budget - sinks others (ties: the earliest stay).
template <class T>
void compress_prompt(HeadStore<T>& head, const Rule& rule, Index count, const HeadQueries& q,
                     Scratch& sc) {
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q ? q.groups : 1;
  const Index w = std::min<Index>(rule.obs_window, count);
  float* qrows = sc.queries.data();
  load_queries(head, q, count - w, w, qrows);  // the last w tokens observe
  const Index ld = Scratch::ld(count);
  float* lg = sc.logits.data();
  float* mean = sc.weights.data();
  logits(qrows, w * G, dp, head.key_rows().from(first), nullptr, count, d,
         1.0f / std::sqrt(static_cast<float>(d)), lg, ld, sc.keys.data());
  softmax_mean(lg, w * G, ld, count, mean);
  for (Index i = 0; i < count; ++i) {
    head.score(first + i) = mean[i];
    head.push_live(static_cast<Slot>(first + i));
  }
  const int budget = *rule.budget;
  const Index sinks = std::min<Index>(rule.n_sink, budget);
  const Index keep = budget - sinks;
  const Index m = count - sinks;
  if (m <= keep) return;
  std::int32_t* picks = sc.picks.data();
  for (Index i = 0; i < m; ++i) picks[i] = static_cast<std::int32_t>(first + sinks + i);
  order_worst_first(picks, m, m - keep, head.scores_data(), head.positions_data(),
                    Tie::evict_latest);
  for (Index i = 0; i < m - keep; ++i) head.mark_dead(picks[i]);
  head.drop_dead();
}

}  // namespace veloxquant::cache::detail
