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
#include "queries.hpp"
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

/// Attention weights over the rows in slots [0, n_rows), which must all be live, of one token:
/// with `queries` empty, the key in slot `s` as proxy query (docs/design.md 3); else the mean over
/// the token's G query heads (docs/design.md 4.6; `queries` is a one-token call's slice,
/// [G, 1, Dk]). One pass over contiguous storage (half/bfloat16 rows converted in chunks of
/// `chunk`), logits scaled by 1/sqrt(Dk), one softmax per query head. Returns
/// scratch.weights.data() ([n_rows]).
template <class T>
inline float* decode_weights(const HeadStore<T>& head, Slot s, Index n_rows, KernelScratch& scratch,
                             Index chunk, const QuerySlice& queries = {}) {
  const Index d = head.key_dim();
  const Index groups = queries ? queries.groups : 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scratch.weights.resize(static_cast<std::size_t>(n_rows));
  const float* q = nullptr;  // [G, Dk]
  if (queries) {
    q = queries.row(0, 0);
  } else {
    scratch.query.resize(static_cast<std::size_t>(d));
    convert_rows(head.key_ptr(s), 1, d, scratch.query.data());
    q = scratch.query.data();
  }
  float* logits = scratch.weights.data();  // [G, n_rows]
  if (groups > 1) {
    scratch.logits.resize(static_cast<std::size_t>(groups * n_rows));
    logits = scratch.logits.data();
  }
  using RowsF =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  // Float rows need no conversion: one product over all of them when there is one query head,
  // chunks that stay in L1 while G query heads read them otherwise.
  const Index step = std::is_same_v<T, float> && groups == 1 ? std::max<Index>(n_rows, 1) : chunk;
  if constexpr (!std::is_same_v<T, float>) {
    scratch.keys.resize(static_cast<std::size_t>(std::min(step, n_rows) * d));
  }
  for (Index r0 = 0; r0 < n_rows; r0 += step) {
    const Index m = std::min(step, n_rows - r0);
    const float* rows = nullptr;  // [m, Dk]
    if constexpr (std::is_same_v<T, float>) {
      rows = head.key_ptr(r0);
    } else {
      convert_rows(head.key_ptr(r0), m, d, scratch.keys.data());
      rows = scratch.keys.data();
    }
    for (Index g = 0; g < groups; ++g) {
      Eigen::Map<Eigen::VectorXf>(logits + g * n_rows + r0, m).noalias() =
          RowsF(rows, m, d) * Eigen::Map<const Eigen::VectorXf>(q + g * d, d);
    }
  }
  for (Index g = 0; g < groups; ++g) {
    Eigen::Map<Eigen::VectorXf>(logits + g * n_rows, n_rows) *= scale;
    softmax_inplace(logits + g * n_rows, n_rows);
  }
  if (groups > 1) mean_of_rows(logits, groups, n_rows, n_rows, scratch.weights.data());
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
  Index groups = 1;                    // logit rows per token: G with queries, else 1
  Index stride = 0;                    // distance between a token's logit rows
  std::vector<float>* group = nullptr; // [n] scratch for one head's weights when groups > 1

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
  /// A token's attention over the first n live rows, into `out` ([n]): the softmax of its logit
  /// row, or with G query heads the mean of the softmax of each of its G rows (`stride` apart).
  void weights(const float* row, Index n, float* out) const {
    const std::int32_t* col = column.data();
    if (groups == 1) {
      for (Index k = 0; k < n; ++k) out[k] = row[col[k]];
      softmax_inplace(out, n);
      return;
    }
    float* one = group->data();
    for (Index g = 0; g < groups; ++g) {
      const float* r = row + g * stride;
      float* dst = g == 0 ? out : one;
      for (Index k = 0; k < n; ++k) dst[k] = r[col[k]];
      softmax_inplace(dst, n);
      if (g > 0) Eigen::Map<Eigen::ArrayXf>(out, n) += Eigen::Map<const Eigen::ArrayXf>(one, n);
    }
    Eigen::Map<Eigen::ArrayXf>(out, n) /= static_cast<float>(groups);
  }
};

/// Blocked driver (docs/design.md 7): absorbs the `count` appended rows at slots
/// [first, first + count) in blocks of `block` tokens. Per block, the float32 logits (scaled by
/// 1/sqrt(Dk)) of the block's tokens against the live rows and the block's own rows come from one
/// matrix product: one row per token whose key is its proxy query, or with `queries` (the call's
/// slice, [G, count, Dk]) G rows per token, one per query head. Then `on_token(rows, s, logit_row, column_of_s)` runs for
/// each token in arrival order over dense arrays (see BlockRows; rows.weights averages the G rows);
/// it must push the token and may evict (mark_dead + rows.erase). Scores and the live order are
/// written back at the end of each block.
template <class T, class OnToken>
inline void for_each_token_blocked(HeadStore<T>& head, Slot first, Index count, int n_sink,
                                   KernelScratch& scratch, Index block, const QuerySlice& queries,
                                   OnToken on_token) {
  const Index d = head.key_dim();
  const Index groups = queries ? queries.groups : 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  using RowsF = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  BlockRows rows{scratch.slots, scratch.column, scratch.scores, 0, groups, 0, &scratch.group};
  for (Index i0 = 0; i0 < count; i0 += block) {
    const Index nb = std::min(block, count - i0);
    const Index nc = head.live();
    const Index cols = padded_columns(nc + nb);  // real columns, then zero keys
    rows.stride = cols;
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
    scratch.logits.resize(static_cast<std::size_t>(nb * groups * cols));
    RowsF logits(scratch.logits.data(), nb * groups, cols);
    if (queries) {
      // The block's queries, token-major: row t * G + g is query head g of token i0 + t.
      scratch.query.resize(static_cast<std::size_t>(nb * groups * d));
      for (Index t = 0; t < nb; ++t) {
        for (Index g = 0; g < groups; ++g) {
          std::memcpy(scratch.query.data() + (t * groups + g) * d, queries.row(g, i0 + t),
                      sizeof(float) * static_cast<std::size_t>(d));
        }
      }
      logits.noalias() = RowsF(scratch.query.data(), nb * groups, d) * all.transpose();
    } else {
      logits.noalias() = all.middleRows(nc, nb) * all.transpose();
    }
    logits *= scale;
    rows.sinks = count_sinks_of(head, n_sink);  // rows.slots is the live order here
    for (Index t = 0; t < nb; ++t) {
      const auto s = static_cast<Slot>(first + i0 + t);
      scratch.weights.resize(static_cast<std::size_t>(rows.size() + 1));
      if (groups > 1) scratch.group.resize(static_cast<std::size_t>(rows.size() + 1));
      on_token(rows, s, scratch.logits.data() + t * groups * cols,
               static_cast<std::int32_t>(nc + t));
    }
    for (std::size_t k = 0; k < rows.slots.size(); ++k) head.score(rows.slots[k]) = rows.scores[k];
    head.replace_order(rows.slots);
  }
}

}  // namespace veloxquant::cache::detail
