// veloxquant — a call's rows in and out of one head (docs/design.md 2.8, 4.6): the engine's query
// rows (or the keys standing in for them), the attention output rows, the logits of one block of
// tokens against its columns, and the attention output computed on its own (attend_window).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "head_store.hpp"
#include "input.hpp"
#include "rule.hpp"
#include "scratch.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// One KV head's query heads for the call (docs/design.md 4.6): query head g of this KV head is
/// head h * G + g of the call's queries. Empty (rows == nullptr) without queries.
struct HeadQueries {
  const InputRows* rows = nullptr;
  Index b = 0, h = 0, groups = 0;

  explicit operator bool() const { return rows != nullptr; }
  /// Query head g of the call's token s as float32. out: [padded_dim(D)]
  void read(Index g, Index s, float* out) const {
    read_float_row(*rows, b, h * groups + g, s, out);
  }
};

/// Where `attend` writes its output: row (b, j, s) (query head j, token s of the call) starts at
/// data + b * stride_b + j * stride_j + s * stride_s and holds Dv float32.
struct AttendOut {
  float* data = nullptr;
  Index stride_b = 0, stride_j = 0, stride_s = 0;
};

/// One KV head's share of the attention output: the rows of its G query heads. Empty without
/// attend.
struct HeadAttend {
  const AttendOut* out = nullptr;
  Index b = 0, h = 0, groups = 0;

  explicit operator bool() const { return out != nullptr; }
  /// Output row of query head g (of this KV head) for the call's token s; the G rows of a token
  /// are stride() apart.
  float* row(Index s, Index g) const {
    return out->data + b * out->stride_b + (h * groups + g) * out->stride_j + s * out->stride_s;
  }
  Index stride() const { return out->stride_j; }
};

/// Query rows of the call's tokens [s0, s0 + n) to `dst`, row (t, g) at (t * G + g) * padded_dim:
/// with queries, each token's G query heads (docs/design.md 4.6); without, each token's own stored
/// key (key-as-query, G = 1: docs/design.md 4.2).
template <class T>
void load_queries(const HeadStore<T>& head, const HeadQueries& q, Index s0, Index n, float* dst) {
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q ? q.groups : 1;
  for (Index t = 0; t < n; ++t) {
    for (Index gi = 0; gi < G; ++gi) {
      float* row = dst + (t * G + gi) * dp;
      if (q) {
        q.read(gi, s0 + t, row);
      } else {
        load_stored_row(head.key_rows(), head.call_begin() + s0 + t, d, row);
      }
    }
  }
}

/// Packed key columns of a prefill, packed as the blocks of a call reach them: each block packs
/// only the columns the earlier blocks did not (logits_packed).
struct PackedColumns {
  bool on = false;  ///< the call's blocks use packed columns
  Index upto = 0;   ///< columns packed so far
};

/// The scaled logits of `rows` query rows (sc.queries) against columns [0, ncols) to sc.logits
/// (row stride ld): over the packed key columns when `packed.on`, else over the stored key rows
/// (the slots `slot[c]` if gathered, else slot c).
template <class T>
void block_logits(const HeadStore<T>& head, Index rows, const Slot* slot, Index ncols, Index ld,
                  PackedColumns& packed, Scratch& sc) {
  const Index d = head.key_dim(), dp = padded_dim(d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qrows = sc.queries.data();
  float* lg = sc.logits.data();
  if (packed.on) {
    pack_keys(head.key_rows(), packed.upto, ncols, d, sc.packed.data(), sc.keys.data());
    packed.upto = ncols;
    logits_packed(qrows, rows, dp, sc.packed.data(), ncols, d, scale, lg, ld, sc.keys.data());
  } else {
    logits(qrows, rows, dp, head.key_rows(), slot, ncols, d, scale, lg, ld, sc.keys.data());
  }
}

/// The attention output of the call just absorbed (docs/design.md 2.8), computed on its own: the
/// `count` call tokens' G query heads each attend over the head's window, slots [0, physical())
/// (the rows retained before the call, then the call's), token t over the slots before
/// call_begin() + t + 1. For the calls whose scores do not come from that softmax: policies that
/// do not score, SnapKV, TOVA's multi-token calls (they evict inside the call), and calls that
/// began with a re-budget (its rows are in the window but no longer scored).
template <class T>
void attend_window(const HeadStore<T>& head, Index count, const HeadQueries& q,
                   const HeadAttend& att, Scratch& sc) {
  const Index first = head.call_begin();
  const Index G = q.groups;
  const Index block = block_tokens(count, G);
  float* lg = sc.logits.data();
  PackedColumns packed{count > 1, 0};
  for (Index i0 = 0; i0 < count; i0 += block) {
    const Index nb = std::min(block, count - i0);
    const Index ncols = first + i0 + nb;
    const Index ld = Scratch::ld(ncols);
    load_queries(head, q, i0, nb, sc.queries.data());
    block_logits(head, nb * G, nullptr, ncols, ld, packed, sc);
    for (Index t = 0; t < nb; ++t) {
      float* rows_t = lg + t * G * ld;
      const Index n = first + i0 + t + 1;
      softmax_mean(rows_t, G, ld, n, nullptr, sc.inv.data());
      weighted_rows(rows_t, ld, sc.inv.data(), G, head.value_rows(), head.value_dim(), n,
                    att.row(i0 + t, 0), att.stride());
    }
  }
}

}  // namespace veloxquant::cache::detail
