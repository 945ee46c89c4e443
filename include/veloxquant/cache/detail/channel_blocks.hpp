// veloxquant — the blocks of channel-axis rows (docs/design.md 7.5): what a head's rows quantized
// along channels share.
//
// Rows arrive at consecutive positions. The newest ones, up to `block` positions from
// `pending_start` on, are the pending block: each is held at T in lane (position -
// pending_start). When the block's last position arrives, its rows still live are quantized
// together (quantize_block: per channel one half scale and offset over those rows) and the block
// is sealed: its first position and its table join the sealed blocks, the rows keep only their
// codes (in their slots, row_buffer.hpp), and the next block starts. A sealed row's block is the
// last one whose first position is <= its own, so a row carries no block number: it moves between
// slots as codes alone, and nothing is ever quantized twice. A block none of whose rows is live is
// dropped at the next compaction (prune), which frees its table.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// Slot index; 32 bits keep the per-row bookkeeping small next to the K/V rows.
using Slot = std::int32_t;
/// The largest block of positions (KVCacheConfig::quant_block).
inline constexpr Index kMaxBlock = 1024;

/// The blocks' state as one value: a checkpoint keeps a copy, a rollback swaps it back.
template <class T>
struct ChannelState {
  std::vector<std::int64_t> starts;       ///< [blocks] first position of each sealed block
  std::vector<std::uint16_t> ktab, vtab;  ///< [blocks, 2 * D]: scales then offsets, half bits
  std::int64_t pending_start = 0;         ///< first position of the pending block
  std::vector<T> kpend, vpend;            ///< [block, D]: pending rows at T, by lane
  std::vector<Slot> lane_slot;            ///< [block]: the slot holding each lane's row, or -1

  void swap(ChannelState& o) noexcept {
    starts.swap(o.starts);
    ktab.swap(o.ktab);
    vtab.swap(o.vtab);
    std::swap(pending_start, o.pending_start);
    kpend.swap(o.kpend);
    vpend.swap(o.vpend);
    lane_slot.swap(o.lane_slot);
  }
  std::size_t heap_bytes() const {
    return starts.capacity() * sizeof(std::int64_t) +
           (ktab.capacity() + vtab.capacity()) * sizeof(std::uint16_t) +
           (kpend.capacity() + vpend.capacity()) * sizeof(T) + lane_slot.capacity() * sizeof(Slot);
  }
};

/// The sealed blocks and the pending block of one head whose keys, values or both are quantized
/// along channels (a head holds one only then: RowBuffer).
template <class T>
class ChannelBlocks {
 public:
  ChannelBlocks(const RowFormat& kf, const RowFormat& vf)
      : keys_(kf.channel_axis()), values_(vf.channel_axis()), kf_(kf), vf_(vf) {
    block_ = keys_ ? kf.block : vf.block;
    const auto b = static_cast<std::size_t>(block_);
    if (keys_) s_.kpend.resize(b * static_cast<std::size_t>(kf.dim));
    if (values_) s_.vpend.resize(b * static_cast<std::size_t>(vf.dim));
    s_.lane_slot.assign(b, -1);
  }

  Index block() const { return block_; }
  Index blocks() const { return static_cast<Index>(s_.starts.size()); }
  std::int64_t pending_start() const { return s_.pending_start; }
  const ChannelState<T>& state() const { return s_; }
  ChannelState<T>& state() { return s_; }

  /// True when a row at position p has its lane in the pending block.
  bool fits(std::int64_t p) const { return p >= s_.pending_start && p < s_.pending_start + block_; }
  /// True when position p is the pending block's last.
  bool last_of_block(std::int64_t p) const { return p == s_.pending_start + block_ - 1; }
  /// The slot of lane l's row (-1: none), for sealing.
  Slot lane_slot(Index l) const { return s_.lane_slot[static_cast<std::size_t>(l)]; }

  /// Holds the row pair of position p (fits(p)) in slot s at T. key: [Dk], value: [Dv] of U,
  /// converted to T; only the channel-axis tensors are held here.
  template <class U>
  void put(std::int64_t p, Slot s, const U* key, const U* value) noexcept {
    const Index l = lane(p);
    if (keys_) store_row(key, s_.kpend.data() + l * kf_.dim, kf_.dim);
    if (values_) store_row(value, s_.vpend.data() + l * vf_.dim, vf_.dim);
    s_.lane_slot[static_cast<std::size_t>(l)] = s;
  }
  /// The row of position p moved to slot `to` (compaction): a pending row's lane follows it.
  void moved(std::int64_t p, Slot to) noexcept {
    if (fits(p)) s_.lane_slot[static_cast<std::size_t>(lane(p))] = to;
  }
  /// Slot `from` now holds slot map[from]'s row (a fork's gather): lanes follow, lanes of rows
  /// not carried over (map -1) are cleared.
  void remap(const std::vector<Slot>& map) noexcept {
    for (Slot& s : s_.lane_slot) {
      s = (s >= 0 && static_cast<std::size_t>(s) < map.size()) ? map[static_cast<std::size_t>(s)]
                                                                 : -1;
    }
  }

  /// Room for `more` sealed blocks beyond those held. Strong exception guarantee.
  void reserve(Index more) {
    const auto want = static_cast<std::size_t>(blocks() + more);
    if (s_.starts.capacity() >= want) return;
    // A quarter more than asked: the blocks grow by one now and then in a long decode.
    const std::size_t cap = want + want / 4;
    ChannelState<T> grown;
    grown.starts.reserve(cap);
    if (keys_) grown.ktab.reserve(cap * 2 * static_cast<std::size_t>(kf_.dim));
    if (values_) grown.vtab.reserve(cap * 2 * static_cast<std::size_t>(vf_.dim));
    // No-throw from here on.
    grown.starts.assign(s_.starts.begin(), s_.starts.end());
    grown.ktab.assign(s_.ktab.begin(), s_.ktab.end());
    grown.vtab.assign(s_.vtab.begin(), s_.vtab.end());
    s_.starts.swap(grown.starts);
    s_.ktab.swap(grown.ktab);
    s_.vtab.swap(grown.vtab);
  }

  /// Seals the pending block: its rows still live, lanes[0, n) (ascending), are quantized
  /// together, their codes written to codes_of(i, keys) (row i's key or value codes: the caller's
  /// slots), and the next block starts at `next`. With no live row no block is made. Room for one
  /// block must be reserved. n <= block.
  template <class CodesOf>
  void seal(const Index* lanes, Index n, std::int64_t next, CodesOf codes_of) noexcept {
    if (n > 0) {
      s_.starts.push_back(s_.pending_start);
      if (keys_) seal_tensor(lanes, n, kf_, s_.kpend, s_.ktab, [&](Index i) { return codes_of(i, true); });
      if (values_) seal_tensor(lanes, n, vf_, s_.vpend, s_.vtab, [&](Index i) { return codes_of(i, false); });
    }
    s_.pending_start = next;
    std::fill(s_.lane_slot.begin(), s_.lane_slot.end(), -1);
  }

  /// Drops the sealed blocks none of whose rows is live. pos_of(i) gives the live rows' positions
  /// in ascending order, i < n. Never allocates.
  template <class PosOf>
  void prune(Index n, PosOf pos_of) noexcept {
    const Index nb = blocks();
    Index kept = 0, i = 0;
    for (Index b = 0; b < nb; ++b) {
      const std::int64_t begin = s_.starts[at(b)];
      const std::int64_t end = b + 1 < nb ? s_.starts[at(b + 1)] : s_.pending_start;
      while (i < n && pos_of(i) < begin) ++i;
      if (i < n && pos_of(i) < end) {
        if (kept != b) move_block(b, kept);
        ++kept;
      }
    }
    s_.starts.resize(at(kept));
    if (keys_) s_.ktab.resize(at(kept) * 2 * at(kf_.dim));
    if (values_) s_.vtab.resize(at(kept) * 2 * at(vf_.dim));
  }

  /// Releases the blocks' room when more than a third of it (and 8 blocks) is unused. Strong
  /// exception guarantee.
  void shrink() {
    if (s_.starts.capacity() <= s_.starts.size() + s_.starts.size() / 2 + 8) return;
    ChannelState<T> tight;
    tight.starts = s_.starts;
    tight.ktab = s_.ktab;
    tight.vtab = s_.vtab;
    s_.starts.swap(tight.starts);
    s_.ktab.swap(tight.ktab);
    s_.vtab.swap(tight.vtab);
  }

  /// Bytes the blocks hold: the sealed tables and the pending block's rows.
  std::size_t held_bytes() const {
    return (s_.ktab.size() + s_.vtab.size()) * sizeof(std::uint16_t) +
           (s_.kpend.size() + s_.vpend.size()) * sizeof(T);
  }
  /// Heap bytes (by capacity; the per-thread scratch of seals is not the head's).
  std::size_t heap_bytes() const { return s_.heap_bytes(); }

  /// Fills the kernel view's channel fields of one tensor (keys: true) of rows `r`.
  void describe(bool keys, StoredRows<T>& r) const {
    r.starts = s_.starts.data();
    r.blocks = blocks();
    r.tables = keys ? s_.ktab.data() : s_.vtab.data();
    r.pending_start = s_.pending_start;
    r.pending = keys ? s_.kpend.data() : s_.vpend.data();
    Index lanes = block_;
    while (lanes > 0 && s_.lane_slot[at(lanes - 1)] < 0) --lanes;
    r.pending_lanes = lanes;
  }

 private:
  static std::size_t at(Index i) { return static_cast<std::size_t>(i); }
  Index lane(std::int64_t p) const { return static_cast<Index>(p - s_.pending_start); }

  void move_block(Index from, Index to) noexcept {
    s_.starts[at(to)] = s_.starts[at(from)];
    const auto copy = [&](std::vector<std::uint16_t>& t, Index d) {
      const std::size_t w = 2 * at(d);
      std::copy_n(t.begin() + static_cast<std::ptrdiff_t>(at(from) * w), w,
                  t.begin() + static_cast<std::ptrdiff_t>(at(to) * w));
    };
    if (keys_) copy(s_.ktab, kf_.dim);
    if (values_) copy(s_.vtab, vf_.dim);
  }

  // Quantizes lanes[0, n) of one tensor's pending rows into codes_of(i) and appends the block's
  // table to tab (capacity reserved).
  template <class CodesOf>
  static void seal_tensor(const Index* lanes, Index n, const RowFormat& f,
                          const std::vector<T>& pend, std::vector<std::uint16_t>& tab,
                          CodesOf codes_of) noexcept {
    const T* rows[kMaxBlock];
    std::uint8_t* codes[kMaxBlock];
    for (Index i = 0; i < n; ++i) {
      rows[i] = pend.data() + lanes[i] * f.dim;
      codes[i] = codes_of(i);
    }
    const std::size_t at_tab = tab.size();
    tab.resize(at_tab + 2 * at(f.dim));
    quantize_block(rows, n, f, codes, tab.data() + at_tab);
  }

  bool keys_ = false, values_ = false;
  RowFormat kf_, vf_;
  Index block_ = 0;
  ChannelState<T> s_;
};

}  // namespace veloxquant::cache::detail
