// veloxquant — the kernels of the TOVA, StreamingLLM and SnapKV policies (docs/design.md 6), on the
// shared storage and scoring building blocks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "head_store.hpp"
#include "proxy.hpp"
#include "queries.hpp"
#include "scoring.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

// ---------------------------------------------------------------------------------------------
// TOVA: memoryless. Append token i; when over budget, the proxy attention of k_i over every row
// including itself decides: the lowest non-sink row goes (ties: earliest). The weights of that
// step are kept as the rows' scores (diagnostic only; nothing carries over).

/// One TOVA token at slot `s` (appended, not yet live). General path over the live order.
template <class T>
inline void tova_absorb_token(HeadStore<T>& head, Slot s, int budget, int n_sink,
                              KernelScratch& scratch) {
  head.score(s) = 0.0f;
  head.push_live(s);
  const Index n = head.live();
  if (n <= budget) return;
  const float* w = live_weights(head, s, scratch.query, scratch.weights);
  const Slot* live = head.order().data();
  for (Index i = 0; i < n; ++i) head.score(live[i]) = w[i];
  const Index lo = count_sinks_of(head, n_sink);
  if (lo >= n) return;
  Index best = lo;
  for (Index i = lo + 1; i < n; ++i) {
    if (w[i] < w[best]) best = i;
  }
  head.evict_at(best);
}

/// One TOVA decode token at slot `s` == live() with no holes: a single pass over contiguous
/// slots. The attention is the key's (proxy) or, with a one-token call's `queries`, the mean of
/// the token's G query heads. Returns false when the layout does not allow it.
template <class T>
inline bool tova_decode(HeadStore<T>& head, Slot s, int budget, int n_sink, KernelScratch& scratch,
                        Index chunk, const QuerySlice& queries = {}) {
  const Index n = head.live();
  if (head.physical() != n + 1 || s != n) return false;
  head.score(s) = 0.0f;
  head.push_live(s);
  if (n + 1 <= budget) return true;
  const float* w = decode_weights(head, s, n + 1, scratch, chunk, queries);
  std::copy_n(w, n + 1, &head.score(0));
  const Index best = protected_argmin(head, w, n + 1, n_sink, std::numeric_limits<std::int64_t>::max());
  if (best >= 0) evict_slot(head, best);
  return true;
}

/// TOVA over a block of tokens with the blocked driver (same retained sets as tova_absorb_token);
/// with the call's `queries`, each token's attention is the mean over its G query heads.
template <class T>
inline void tova_blocked(HeadStore<T>& head, Slot first, Index count, int budget, int n_sink,
                         KernelScratch& scratch, Index block, const QuerySlice& queries = {}) {
  for_each_token_blocked(
      head, first, count, n_sink, scratch, block, queries,
      [&](BlockRows& rows, Slot s, const float* logit_row, std::int32_t col) {
        rows.push(s, col, 0.0f);
        if (head.position(s) < n_sink) ++rows.sinks;
        const Index n = rows.size();
        if (n <= budget || rows.sinks >= n) return;
        rows.weights(logit_row, n, rows.scores.data());
        const Index k = rows.argmin(rows.sinks, n);
        head.mark_dead(rows.slots[static_cast<std::size_t>(k)]);
        rows.erase(k);
      });
}

// ---------------------------------------------------------------------------------------------
// StreamingLLM: the first n_sink positions and the newest `window` others, FIFO. No scoring.

/// Takes the `count` appended rows at [first, first + count) live, then drops the oldest non-sink
/// rows beyond `window` in one range (the per-token FIFO has the same result).
template <class T>
inline void streaming_absorb(HeadStore<T>& head, Slot first, Index count, int n_sink, int window) {
  for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
  const Index sinks = count_sinks_of(head, n_sink);
  const Index excess = head.live() - sinks - window;
  if (excess > 0) head.evict_range(sinks, sinks + excess);
}

// ---------------------------------------------------------------------------------------------
// SnapKV: the first call with S > budget is compressed once; later calls append.

/// Scores the `count` rows of the call at [first, first + count) by the mean, over the call's last
/// w = min(obs_window, count) tokens, of their softmax attention over all of the call's rows (no
/// causal mask): each token's key as proxy query, or with `queries` (the call's slice) each of its
/// G query heads (a plain mean over the w * G rows). Keeps the call's first min(n_sink, budget)
/// rows and the top (budget - sinks) others (ties: earliest). Rows from earlier calls stay.
template <class T>
inline void snapkv_compress(HeadStore<T>& head, Slot first, Index count, int budget, int n_sink,
                            int obs_window, KernelScratch& scratch, const QuerySlice& queries = {}) {
  const Index d = head.key_dim();
  const Index w = std::min<Index>(obs_window, count);
  const Index groups = queries ? queries.groups : 1;
  const Index n_obs = w * groups;  // softmax rows averaged
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  using RowsF = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  const Index cols = padded_columns(count);  // the call's keys, then zero keys
  scratch.keys.resize(static_cast<std::size_t>(cols * d));
  convert_rows(head.key_ptr(first), count, d, scratch.keys.data());
  std::fill(scratch.keys.begin() + count * d, scratch.keys.end(), 0.0f);
  const RowsF keys(scratch.keys.data(), cols, d);
  scratch.logits.resize(static_cast<std::size_t>(n_obs * cols));
  RowsF logits(scratch.logits.data(), n_obs, cols);
  if (queries) {
    scratch.query.resize(static_cast<std::size_t>(n_obs * d));
    for (Index t = 0; t < w; ++t) {
      for (Index g = 0; g < groups; ++g) {
        std::memcpy(scratch.query.data() + (t * groups + g) * d, queries.row(g, count - w + t),
                    sizeof(float) * static_cast<std::size_t>(d));
      }
    }
    logits.noalias() = RowsF(scratch.query.data(), n_obs, d) * keys.transpose();
  } else {
    logits.noalias() = keys.middleRows(count - w, w) * keys.transpose();
  }
  logits *= scale;
  for (Index r = 0; r < n_obs; ++r) softmax_inplace(scratch.logits.data() + r * cols, count);
  scratch.weights.resize(static_cast<std::size_t>(count));
  mean_of_rows(scratch.logits.data(), n_obs, cols, count, scratch.weights.data());
  const float* mean = scratch.weights.data();
  for (Index i = 0; i < count; ++i) {
    const auto s = static_cast<Slot>(first + i);
    head.score(s) = mean[i];
    head.push_live(s);
  }
  const Index sinks = std::min<Index>(n_sink, budget);
  const Index keep = budget - sinks;
  auto& picks = scratch.picks;
  picks.clear();
  for (Index i = sinks; i < count; ++i) picks.push_back(static_cast<Slot>(first + i));
  keep_highest(head, picks, keep, /*later_wins_ties=*/false);
}

}  // namespace veloxquant::cache::detail
