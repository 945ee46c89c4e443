// veloxquant — scoring building blocks shared by every scored policy (H2O core, TOVA, SnapKV):
// half/bfloat16 -> float32 row conversion, the single-pass decode weights over contiguous slots,
// the protected argmin, and the blocked driver that gets a block of tokens' logits from one GEMM.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "head_store.hpp"
#include "proxy.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

/// Converts `n` stored rows starting at `rows` (contiguous, [n, D] of T) to float32 `out` [n, D].
template <class T>
inline void convert_rows(const T* rows, Index n, Index d, float* out) {
  using In = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;
  using Out = Eigen::Map<Eigen::VectorXf>;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, rows, sizeof(float) * static_cast<std::size_t>(n * d));
  } else {
    Out(out, n * d) = In(rows, n * d).template cast<float>();
  }
}

/// Number of leading live rows (ascending position) that are sinks (position < n_sink).
template <class T>
inline Index count_sinks_of(const HeadStore<T>& head, int n_sink) {
  const auto& ord = head.order();
  Index i = 0;
  const Index n = head.live();
  while (i < n && head.position(ord[static_cast<std::size_t>(i)]) < n_sink) ++i;
  return i;
}

/// Keeps the `keep` best of the live `candidates` (by score, higher first; among equal scores the
/// later position when `later_wins_ties`, else the earlier) and evicts the others, preserving the
/// order of the live rows. candidates: live slots, reordered in place.
template <class T>
inline void keep_highest(HeadStore<T>& head, std::vector<Slot>& candidates, Index keep,
                         bool later_wins_ties) {
  if (static_cast<Index>(candidates.size()) <= keep) return;
  auto better = [&head, later_wins_ties](Slot a, Slot b) {
    const float sa = head.score(a), sb = head.score(b);
    if (sa != sb) return sa > sb;
    return later_wins_ties ? head.position(a) > head.position(b)
                           : head.position(a) < head.position(b);
  };
  std::nth_element(candidates.begin(), candidates.begin() + keep, candidates.end(), better);
  for (auto it = candidates.begin() + keep; it != candidates.end(); ++it) head.mark_dead(*it);
  head.drop_dead();
}

/// Softmax weights of the key in slot `s` (as proxy query) over the rows in slots [0, n_rows), which
/// must all be live: one pass of dot products over contiguous storage (half/bfloat16 rows converted
/// in chunks of `chunk`), scaled by 1/sqrt(Dk). Returns scratch.weights.data() ([n_rows]).
template <class T>
inline float* decode_weights(const HeadStore<T>& head, Slot s, Index n_rows, KernelScratch& scratch,
                             Index chunk) {
  const Index d = head.key_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scratch.query.resize(static_cast<std::size_t>(d));
  scratch.weights.resize(static_cast<std::size_t>(n_rows));
  convert_rows(head.key_ptr(s), 1, d, scratch.query.data());
  const Eigen::Map<const Eigen::VectorXf> q(scratch.query.data(), d);
  Eigen::Map<Eigen::VectorXf> logits(scratch.weights.data(), n_rows);
  using RowsF =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  if constexpr (std::is_same_v<T, float>) {
    logits.noalias() = RowsF(head.key_ptr(0), n_rows, d) * q;
  } else {
    scratch.keys.resize(static_cast<std::size_t>(std::min(chunk, n_rows) * d));
    for (Index r0 = 0; r0 < n_rows; r0 += chunk) {
      const Index m = std::min(chunk, n_rows - r0);
      convert_rows(head.key_ptr(r0), m, d, scratch.keys.data());
      logits.segment(r0, m).noalias() = RowsF(scratch.keys.data(), m, d) * q;
    }
  }
  logits *= scale;
  softmax_inplace(logits.data(), n_rows);
  return scratch.weights.data();
}

/// Slot in [0, n_rows) with the lowest value[slot] among rows whose position p satisfies
/// n_sink <= p < newest_protected; ties go to the earliest position. -1 if none qualifies.
template <class T>
inline Index protected_argmin(const HeadStore<T>& head, const float* value, Index n_rows, int n_sink,
                              std::int64_t newest_protected) {
  const std::int64_t* pos = head.positions_data();
  Index best = -1;
  float best_value = 0.0f;
  for (Index i = 0; i < n_rows; ++i) {
    if (pos[i] < n_sink || pos[i] >= newest_protected) continue;
    if (best < 0 || value[i] < best_value || (value[i] == best_value && pos[i] < pos[best])) {
      best = i;
      best_value = value[i];
    }
  }
  return best;
}

/// Evicts the live row in slot `slot` (finds its index in the live order: O(n) scalar work).
template <class T>
inline void evict_slot(HeadStore<T>& head, Index slot) {
  const auto& ord = head.order();
  const auto it = std::find(ord.begin(), ord.end(), static_cast<Slot>(slot));
  head.evict_at(it - ord.begin());
}

/// Dense state of a head's live rows during one block of the blocked driver, ascending position.
struct BlockRows {
  std::vector<Slot>& slots;            // [n] slot of each live row
  std::vector<std::int32_t>& column;   // [n] its column in the block's logits
  std::vector<float>& scores;          // [n] its score
  Index sinks = 0;                     // leading rows with position < n_sink

  Index size() const { return static_cast<Index>(slots.size()); }
  void push(Slot s, std::int32_t col, float score) {
    slots.push_back(s);
    column.push_back(col);
    scores.push_back(score);
  }
  /// Index of the lowest score in [lo, hi); ties go to the earliest (lowest index).
  Index argmin(Index lo, Index hi) const {
    Index best = lo;
    for (Index k = lo + 1; k < hi; ++k) {
      if (scores[static_cast<std::size_t>(k)] < scores[static_cast<std::size_t>(best)]) best = k;
    }
    return best;
  }
  /// Drops row k (the caller marks its slot dead in the head).
  void erase(Index k) {
    slots.erase(slots.begin() + k);
    column.erase(column.begin() + k);
    scores.erase(scores.begin() + k);
  }
  /// Softmax of the logits `row` over the first n live rows, into `out` ([n]).
  void weights(const float* row, Index n, float* out) const {
    const std::int32_t* col = column.data();
    for (Index k = 0; k < n; ++k) out[k] = row[col[k]];
    softmax_inplace(out, n);
  }
};

/// Blocked driver (SPEC 7): absorbs the `count` appended rows at slots [first, first + count) in
/// blocks of `block` tokens. Per block, the float32 logits of the block's keys against the live
/// rows and the block's own rows come from one matrix product (scaled by 1/sqrt(Dk)); then
/// `on_token(rows, s, logit_row, column_of_s)` runs for each token in arrival order over dense
/// arrays (see BlockRows); it must push the token and may evict (mark_dead + rows.erase). Scores
/// and the live order are written back at the end of each block.
template <class T, class OnToken>
inline void for_each_token_blocked(HeadStore<T>& head, Slot first, Index count, int n_sink,
                                   KernelScratch& scratch, Index block, OnToken on_token) {
  const Index d = head.key_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  using RowsF = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  BlockRows rows{scratch.slots, scratch.column, scratch.scores, 0};
  for (Index i0 = 0; i0 < count; i0 += block) {
    const Index nb = std::min(block, count - i0);
    const Index nc = head.live();
    const Index cols = padded_columns(nc + nb);  // real columns, then zero keys
    rows.slots.assign(head.order().begin(), head.order().end());
    rows.column.resize(static_cast<std::size_t>(nc));
    rows.scores.resize(static_cast<std::size_t>(nc));
    scratch.keys.resize(static_cast<std::size_t>(cols * d));
    for (Index j = 0; j < nc; ++j) {
      const Slot sl = rows.slots[static_cast<std::size_t>(j)];
      rows.column[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
      rows.scores[static_cast<std::size_t>(j)] = head.score(sl);
      convert_rows(head.key_ptr(sl), 1, d, scratch.keys.data() + j * d);
    }
    convert_rows(head.key_ptr(first + i0), nb, d, scratch.keys.data() + nc * d);
    std::fill(scratch.keys.begin() + (nc + nb) * d, scratch.keys.end(), 0.0f);
    const RowsF all(scratch.keys.data(), cols, d);
    scratch.logits.resize(static_cast<std::size_t>(nb * cols));
    RowsF logits(scratch.logits.data(), nb, cols);
    logits.noalias() = all.middleRows(nc, nb) * all.transpose();
    logits *= scale;
    rows.sinks = count_sinks_of(head, n_sink);  // rows.slots is the live order here
    for (Index t = 0; t < nb; ++t) {
      const auto s = static_cast<Slot>(first + i0 + t);
      scratch.weights.resize(static_cast<std::size_t>(rows.size() + 1));
      on_token(rows, s, scratch.logits.data() + t * cols, static_cast<std::int32_t>(nc + t));
    }
    for (std::size_t k = 0; k < rows.slots.size(); ++k) head.score(rows.slots[k]) = rows.scores[k];
    head.replace_order(rows.slots);
  }
}

}  // namespace veloxquant::cache::detail
