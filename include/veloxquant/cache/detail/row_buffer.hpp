// veloxquant — one head's key and value rows, by slot (docs/design.md 7.1).
//
// A RowBuffer is storage and nothing else: slot s holds one key row and one value row, each as T
// or quantized (quant.hpp, docs/design.md 7.4), a channel-axis row as its codes alone (its scales,
// and the pending rows at T, are its ChannelBlocks': channel_blocks.hpp, 7.5). A quantized row
// takes whole elements of T (its bytes rounded up), so one buffer and one slot arithmetic serve
// every kind. Which slots are live,
// their positions and scores are the head's bookkeeping (head_store.hpp); what a checkpoint saves
// of the rows is the journal's (journal.hpp).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "channel_blocks.hpp"
#include "quant.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// Key rows [slots, Dk] and value rows [slots, Dv] in their formats.
template <class T>
class RowBuffer {
 public:
  RowBuffer() = default;
  /// Rows of keys and values in the formats given (fmt.dim: the head dims); no slot yet.
  RowBuffer(const RowFormat& kf, const RowFormat& vf)
      : dk_(kf.dim),
        dv_(vf.dim),
        kf_(kf),
        vf_(vf),
        ks_(stride_of(kf)),
        vs_(stride_of(vf)),
        ch_(kf.channel_axis() || vf.channel_axis() ? std::make_unique<ChannelBlocks<T>>(kf, vf)
                                                   : nullptr) {}
  RowBuffer(RowBuffer&&) noexcept = default;
  RowBuffer& operator=(RowBuffer&&) noexcept = default;

  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  /// Elements of T one stored key (value) row takes.
  Index key_stride() const { return ks_; }
  Index value_stride() const { return vs_; }
  const RowFormat& key_format() const { return kf_; }
  const RowFormat& value_format() const { return vf_; }
  bool quantized() const { return kf_.quantized() || vf_.quantized(); }
  /// Bytes one slot's key and value rows take (codes and scales of quantized rows).
  std::size_t slot_bytes() const { return static_cast<std::size_t>(ks_ + vs_) * sizeof(T); }
  /// Bytes held for `live` rows: their slots, and the channel blocks' tables and pending rows.
  std::size_t held_bytes(Index live) const {
    return static_cast<std::size_t>(live) * slot_bytes() + (ch_ ? ch_->held_bytes() : 0);
  }
  /// The most bytes `rows` live rows of these formats can hold (held_bytes): their slots, a
  /// sealed table per row (each in a block of its own) and a full pending block, for each tensor
  /// quantized along channels. A memory pool's floors are claimed at this bound (SPEC 19).
  static std::size_t max_held_bytes(const RowFormat& kf, const RowFormat& vf, Index rows) {
    const auto n = static_cast<std::size_t>(rows);
    std::size_t bytes = n * static_cast<std::size_t>(stride_of(kf) + stride_of(vf)) * sizeof(T);
    for (const RowFormat* f : {&kf, &vf}) {
      if (!f->channel_axis()) continue;
      const auto dim = static_cast<std::size_t>(f->dim);
      bytes += n * 2 * dim * sizeof(std::uint16_t) +
               static_cast<std::size_t>(f->block) * dim * sizeof(T);
    }
    return bytes;
  }
  /// True when keys or values are quantized along channels (they then have blocks: channel()).
  bool channel_axis() const { return ch_ != nullptr; }
  const ChannelBlocks<T>& channel() const { return *ch_; }
  ChannelBlocks<T>& channel() { return *ch_; }

  /// Slot s's stored key (value) row: dk (dv) elements of T, or a quantized row's bytes.
  T* key_ptr(Index s) { return k_.data() + s * ks_; }
  const T* key_ptr(Index s) const { return k_.data() + s * ks_; }
  T* value_ptr(Index s) { return v_.data() + s * vs_; }
  const T* value_ptr(Index s) const { return v_.data() + s * vs_; }
  /// The stored rows as the kernels read them, slot = row index (channel-axis rows also need
  /// their positions: pos, by slot; and, for the folded kernels, the live slots in ascending
  /// position, order [live], among `slots`).
  StoredRows<T> key_rows(const std::int64_t* pos = nullptr, const Slot* order = nullptr,
                         Index live = 0, Index slots = 0) const {
    return described(StoredRows<T>{k_.data(), ks_, kf_}, true, pos, order, live, slots);
  }
  StoredRows<T> value_rows(const std::int64_t* pos = nullptr, const Slot* order = nullptr,
                           Index live = 0, Index slots = 0) const {
    return described(StoredRows<T>{v_.data(), vs_, vf_}, false, pos, order, live, slots);
  }

  /// Stores one input row pair of position p in slot s: converted to T, and quantized from that
  /// (every input type gives the codes its conversion to T gives); a channel-axis tensor's row
  /// joins the pending block (channel().fits(p) must hold). key: [Dk], value: [Dv] of U.
  template <class U>
  void put(Index s, const U* key, const U* value, std::int64_t p) noexcept {
    if (!kf_.channel_axis()) put_row(key, kf_, key_ptr(s));
    if (!vf_.channel_axis()) put_row(value, vf_, value_ptr(s));
    if (ch_) ch_->put(p, static_cast<Slot>(s), key, value);
  }
  /// Slot s's rows (position p) as T: key [dk], value [dv] (quantized rows dequantized; float32
  /// through buf, [padded_dim(max(dk, dv))]).
  void read(Index s, std::int64_t p, T* key, T* value, float* buf) const {
    get_row(slot_view(true, s, &p), key, buf);
    get_row(slot_view(false, s, &p), value, buf);
  }
  /// Copies slot `from`'s rows over slot `to`'s.
  void move(Index from, Index to) noexcept {
    std::memcpy(key_ptr(to), key_ptr(from), sizeof(T) * static_cast<std::size_t>(ks_));
    std::memcpy(value_ptr(to), value_ptr(from), sizeof(T) * static_cast<std::size_t>(vs_));
  }
  /// Slot s's rows as stored, key then value (ks + vs elements), appended to `out`, whose
  /// capacity must suffice (the journal reserves it).
  void save(Index s, std::vector<T>& out) const noexcept {
    out.insert(out.end(), key_ptr(s), key_ptr(s) + ks_);
    out.insert(out.end(), value_ptr(s), value_ptr(s) + vs_);
  }
  /// Writes rows saved by save() back into slot s.
  void load(Index s, const T* saved) noexcept {
    std::memcpy(key_ptr(s), saved, sizeof(T) * static_cast<std::size_t>(ks_));
    std::memcpy(value_ptr(s), saved + ks_, sizeof(T) * static_cast<std::size_t>(vs_));
  }

  /// A buffer of `slots` slots holding the rows of the first `keep` of this one's. A quantized
  /// buffer gets the float row it quantizes through here, with its first slots (a head that never
  /// holds a row allocates nothing: a loaded head of 0 rows, docs/design.md G). Allocates only.
  RowBuffer resized(Index slots, Index keep) const {
    RowBuffer b(kf_, vf_);
    const auto r = static_cast<std::size_t>(slots), used = static_cast<std::size_t>(keep);
    b.k_.resize(r * static_cast<std::size_t>(ks_));
    b.v_.resize(r * static_cast<std::size_t>(vs_));
    if (quantized()) b.row_buf_.resize(static_cast<std::size_t>(padded_dim(std::max(dk_, dv_))));
    b.ch_ = copied(ch_);
    std::copy_n(k_.begin(), used * static_cast<std::size_t>(ks_), b.k_.begin());
    std::copy_n(v_.begin(), used * static_cast<std::size_t>(vs_), b.v_.begin());
    return b;
  }
  /// A buffer whose slot i holds this one's slot src[i], i < n, at a capacity of exactly n (what
  /// a fork copies, docs/design.md 10.1). Rows are copied in runs of consecutive source slots;
  /// no zero fill first (the rows are most of the bytes). A quantized buffer that holds a row
  /// gets its float row now: a slot freed before its next growth (a trim, a memory pool's cut)
  /// is refilled without one. Allocates only.
  RowBuffer gathered(const Slot* src, Index n) const {
    RowBuffer b(kf_, vf_);
    b.ch_ = copied(ch_);  // the caller remaps its lanes (ChannelBlocks::remap)
    if (quantized() && n > 0) {
      b.row_buf_.resize(static_cast<std::size_t>(padded_dim(std::max(dk_, dv_))));
    }
    const auto ks = static_cast<std::size_t>(ks_), vs = static_cast<std::size_t>(vs_);
    b.k_.reserve(static_cast<std::size_t>(n) * ks);
    b.v_.reserve(static_cast<std::size_t>(n) * vs);
    for (Index i = 0; i < n;) {
      Index j = i + 1;
      while (j < n && src[j] == src[j - 1] + 1) ++j;
      const auto first = static_cast<std::size_t>(src[i]);
      const auto run = static_cast<std::size_t>(j - i);
      b.k_.insert(b.k_.end(), k_.begin() + static_cast<std::ptrdiff_t>(first * ks),
                  k_.begin() + static_cast<std::ptrdiff_t>((first + run) * ks));
      b.v_.insert(b.v_.end(), v_.begin() + static_cast<std::ptrdiff_t>(first * vs),
                  v_.begin() + static_cast<std::ptrdiff_t>((first + run) * vs));
      i = j;
    }
    return b;
  }
  void swap(RowBuffer& o) noexcept {
    std::swap(dk_, o.dk_);
    std::swap(dv_, o.dv_);
    std::swap(kf_, o.kf_);
    std::swap(vf_, o.vf_);
    std::swap(ks_, o.ks_);
    std::swap(vs_, o.vs_);
    k_.swap(o.k_);
    v_.swap(o.v_);
    row_buf_.swap(o.row_buf_);
    ch_.swap(o.ch_);
  }

  /// Heap bytes held (by capacity).
  std::size_t heap_bytes() const {
    return (k_.capacity() + v_.capacity()) * sizeof(T) + row_buf_.capacity() * sizeof(float) +
           (ch_ ? sizeof(ChannelBlocks<T>) + ch_->heap_bytes() : 0);
  }

 private:
  static std::unique_ptr<ChannelBlocks<T>> copied(const std::unique_ptr<ChannelBlocks<T>>& c) {
    return c ? std::make_unique<ChannelBlocks<T>>(*c) : nullptr;
  }
  // Elements of T one row of format f takes.
  static Index stride_of(const RowFormat& f) {
    if (!f.quantized()) return f.dim;
    const auto size = static_cast<Index>(sizeof(T));
    return (f.row_bytes() + size - 1) / size;
  }

  template <class U>
  void put_row(const U* src, const RowFormat& f, T* dst) noexcept {
    if (!f.quantized()) return store_row(src, dst, f.dim);
    float* x = row_buf_.data();
    for (Index i = 0; i < f.dim; ++i) x[i] = static_cast<float>(static_cast<T>(src[i]));
    quantize_row(x, f, reinterpret_cast<std::uint8_t*>(dst));
  }
  // Slot s alone as a view (row 0; its position at *p).
  StoredRows<T> slot_view(bool keys, Index s, const std::int64_t* p) const {
    StoredRows<T> r = keys ? key_rows(p) : value_rows(p);
    r.data = keys ? key_ptr(s) : value_ptr(s);
    return r;
  }
  static void get_row(const StoredRows<T>& row, T* dst, float* buf) noexcept {
    const RowFormat& f = row.fmt;
    if (!f.quantized()) {
      std::memcpy(dst, row.data, sizeof(T) * static_cast<std::size_t>(f.dim));
      return;
    }
    if (f.channel_axis()) {
      load_stored_row(row, 0, f.dim, buf);
    } else {
      dequantize_row(row.bytes(), 0, buf);
    }
    if constexpr (std::is_same_v<T, Eigen::half>) {
      // A decoded element may lie up to half a step beyond its group's (block's) extremes; near
      // +-65504 that is past the largest half. The original was within +-65504: the clamp only
      // moves the element towards it.
      for (Index i = 0; i < f.dim; ++i) buf[i] = std::min(std::max(buf[i], -kHalfMax), kHalfMax);
    }
    store_row(buf, dst, f.dim);
  }

  StoredRows<T> described(StoredRows<T> r, bool keys, const std::int64_t* pos,
                          const Slot* order = nullptr, Index live = 0, Index slots = 0) const {
    if (!r.channel()) return r;
    ch_->describe(keys, r);
    r.pos = pos;
    r.order = order;
    r.live = live;
    r.slots = slots;
    return r;
  }

  Index dk_ = 0, dv_ = 0;
  RowFormat kf_, vf_;
  Index ks_ = 0, vs_ = 0;       // elements of T per key (value) row
  std::vector<T> k_;            // [slots, ks_]: Dk of T, or a quantized row's bytes
  std::vector<T> v_;            // [slots, vs_]
  std::vector<float> row_buf_;  // [padded_dim(max(Dk, Dv))]: the row being quantized
  std::unique_ptr<ChannelBlocks<T>> ch_;  // channel-axis rows' blocks, or null
};

}  // namespace veloxquant::cache::detail
