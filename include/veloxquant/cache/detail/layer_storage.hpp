// veloxquant — a layer's row storage beyond one head (docs/design.md 2.3, B): the heads' growth
// before a call, the copies of stored rows out of the heads as T (quantized rows dequantized), and
// the buffers a quantized cache's view and its dequantized rows go through. KVCache runs the calls;
// this is what it stores rows in and copies them out with.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "assert.hpp"
#include "head_store.hpp"

namespace veloxquant::cache::detail {

/// Floats of a row being dequantized: padded_dim of the wider head dim.
inline Index row_floats(Index dk, Index dv) { return padded_dim(std::max(dk, dv)); }

/// `n` empty heads of rows in formats kf and vf, room reserved for `rows` rows each; with
/// `value_power` > 0 they keep value weights, with `key_sum` KeyDiff's running sum.
template <class T>
std::vector<HeadStore<T>> fresh_heads(Index n, const RowFormat& kf, const RowFormat& vf, Index rows,
                                      double value_power, bool key_sum) {
  std::vector<HeadStore<T>> out;
  out.reserve(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    out.emplace_back(kf, vf);
    if (value_power > 0.0) out.back().enable_value_weights(value_power);
    out.back().reserve(rows);
    if (key_sum) out.back().keydiff_sum().reserve(out.back().key_dim());
  }
  return out;
}

/// Room for `rows` more rows in every head: each is compacted (logically invisible), shrunk when
/// far too large, and grown by half again, at least to what the call needs and at most to
/// `steady_rows` (the rows a head holds once full) unless the call needs more (then exactly to
/// that). `tight` (adaptive heads, whose sizes keep moving within their pool: docs/design.md
/// 4.9): grown by an eighth, and shrunk once more than a quarter is unused (above what growth
/// leaves, so the two never alternate). Strong exception guarantee per head; the logical state
/// is unchanged even if an allocation throws.
template <class T>
void grow_heads(std::vector<HeadStore<T>>& heads, Index rows, Index steady_rows, bool key_sum,
                bool tight = false) {
  for (auto& h : heads) {
    if (key_sum) h.keydiff_sum().reserve(h.key_dim());
    // With a checkpoint: room to save every row this call may overwrite (compaction, appends).
    h.reserve_journal(rows);
    h.reserve_blocks(rows);
    h.compact();
    const Index needed = h.live() + rows;
    h.shrink_if_oversized(needed, tight);
    if (h.capacity() < needed) {
      const Index grown = h.capacity() + (tight ? h.capacity() / 8 + 16 : h.capacity() / 2);
      h.reserve(std::max(needed, std::min(grown, std::max(steady_rows, needed))));
    }
  }
}

// ---- which rows of a head a copy takes: each(head, emit) calls emit(slot) per row, in order ----

/// The retained rows in ascending position.
struct RetainedRows {
  template <class T, class Emit>
  void operator()(const HeadStore<T>& h, const Emit& emit) const {
    for (const Slot s : h.order()) emit(s);
  }
};
/// The window of the call just made: the rows retained before it, then its own.
struct WindowRows {
  template <class T, class Emit>
  void operator()(const HeadStore<T>& h, const Emit& emit) const {
    for (const Slot s : h.window()) emit(s);
    for (Index s = h.call_begin(); s < h.physical(); ++s) emit(s);
  }
};
/// Every slot in use, in slot order (a quantized cache's view).
struct SlotRows {
  template <class T, class Emit>
  void operator()(const HeadStore<T>& h, const Emit& emit) const {
    for (Index s = 0; s < h.physical(); ++s) emit(s);
  }
};

/// Rows per head `each` takes (the same for every head: the caller refuses ragged heads; 0
/// without heads).
template <class T, class Each>
Index rows_taken(const std::vector<HeadStore<T>>& heads, const Each& each) {
  Index n = 0;
  if (!heads.empty()) each(heads.front(), [&n](Index) { ++n; });
  return n;
}

/// Gathers, per head, the rows `each` takes into kout ([B·H, stride, Dk]) and vout ([B·H, stride,
/// Dv]), sized by the caller: head i's rows from row i·stride on (`stride` at least the most rows
/// a head gives). Rows of a `quantized` layer are dequantized through `buf` (float32,
/// row_floats(Dk, Dv)).
template <class T, class Each>
void copy_rows(const std::vector<HeadStore<T>>& heads, Index dk, Index dv, bool quantized, T* kout,
               T* vout, float* buf, Index stride, const Each& each) {
  const auto k_elems = static_cast<std::size_t>(dk);
  const auto v_elems = static_cast<std::size_t>(dv);
  float* row = quantized ? buf : nullptr;
  for (std::size_t i = 0; i < heads.size(); ++i) {
    const HeadStore<T>& h = heads[i];
    const std::size_t first = i * static_cast<std::size_t>(stride);
    T* ko = kout + first * k_elems;
    T* vo = vout + first * v_elems;
    each(h, [&](Index s) {
      VELOXQUANT_ASSERT(row || !quantized, "quantized rows copied without a buffer");
      if (row) {
        h.read_rows(s, ko, vo, row);
      } else {
        std::memcpy(ko, h.key_ptr(s), k_elems * sizeof(T));
        std::memcpy(vo, h.value_ptr(s), v_elems * sizeof(T));
      }
      ko += k_elems;
      vo += v_elems;
    });
  }
}

/// The buffers rows leave a cache through: a quantized cache's view (its window dequantized,
/// [B·H, rows, Dk] and [B·H, rows, Dv]) and the float32 row a quantized row is dequantized in. A
/// call sizes new buffers first (refit_*, which may throw) and swaps them in once nothing else
/// can throw (commit), so a call that fails leaves the buffers as they were.
template <class T>
class CopyBuffers {
 public:
  /// Buffers sized for a call, not yet in use (empty and not refit: keep the current one).
  struct Refit {
    std::vector<T> k, v;
    std::vector<float> row;
    bool refit_k = false, refit_v = false;
  };

  /// View buffers that hold `rows` rows per head: they grow by half again as needed and shrink
  /// (only when `shrink`: a call that brings rows) once more than twice the size needed, so that
  /// an empty call changes nothing.
  void refit_view(Refit& r, Index batch, Index heads, Index rows, Index dk, Index dv,
                  bool shrink) const {
    const auto fit = [&](const std::vector<T>& cur, Index d, std::vector<T>& fresh) {
      const auto need = static_cast<std::size_t>(batch * heads * rows * d);
      if (cur.size() >= need && !(shrink && cur.size() > 2 * need)) return false;
      const std::size_t grown =
          cur.size() < need ? std::max(need, cur.size() + cur.size() / 2) : need;
      fresh = std::vector<T>(grown);
      return true;
    };
    r.refit_k = fit(k_, dk, r.k);
    r.refit_v = fit(v_, dv, r.v);
  }
  /// A row buffer of `floats` floats, unless the current one has that size.
  void refit_row(Refit& r, std::size_t floats) const {
    if (row_.size() != floats) r.row.resize(floats);
  }
  void commit(Refit& r) noexcept {
    if (r.refit_k) k_.swap(r.k);
    if (r.refit_v) v_.swap(r.v);
    if (!r.row.empty()) row_.swap(r.row);
    r.refit_k = r.refit_v = false;
  }

  T* view_keys() { return k_.data(); }
  T* view_values() { return v_.data(); }
  const T* view_keys() const { return k_.data(); }
  const T* view_values() const { return v_.data(); }
  /// The row buffer (null before a quantized layer's first call with rows).
  float* row() { return row_.data(); }
  /// Makes `row` the row buffer (a restored state's, docs/design.md G).
  void install_row(std::vector<float>& row) noexcept { row_.swap(row); }
  /// Releases the view buffers (the row buffer stays: its size depends only on the dims).
  void release_view() {
    k_ = std::vector<T>{};
    v_ = std::vector<T>{};
  }
  std::size_t heap_bytes() const {
    return (k_.capacity() + v_.capacity()) * sizeof(T) + row_.capacity() * sizeof(float);
  }

 private:
  std::vector<T> k_, v_;
  std::vector<float> row_;
};

}  // namespace veloxquant::cache::detail
