// veloxquant — per-head row storage shared by every policy (docs/design.md 7.1).
//
// A head keeps its rows in "slots": key rows [cap, Dk] and value rows [cap, Dv] of T, and per slot
// a position (int64), a score (float32) and an alive flag. `order` lists the live slots in
// ascending position. Evicting a row clears its alive flag (and drops it from `order`), with no
// data movement; the hole is refilled at the start of the next call by moving one row from the tail
// (O(D)), so every row the current call returned stays addressable until then: the window of a
// call is slots [0, physical()), the rows retained before it (`window()` lists them in ascending
// position) followed by the call's rows in arrival order.
//
// Keys and values are each stored as T or quantized (quant.hpp, docs/design.md 7.4); a quantized
// row takes whole elements of T (its bytes rounded up), so one buffer and one slot arithmetic
// serve both kinds.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "assert.hpp"
#include "simd_kernels.hpp"
#include "value_rank.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;
/// Slot index; 32 bits keep the per-row bookkeeping small next to the K/V rows.
using Slot = std::int32_t;

/// Rows, positions and scores of one (batch, head).
template <class T>
class HeadStore {
 public:
  HeadStore() = default;
  /// Rows of keys and values in the formats given (fmt.dim: the head dims).
  HeadStore(const RowFormat& kf, const RowFormat& vf)
      : dk_(kf.dim), dv_(vf.dim), kf_(kf), vf_(vf), ks_(stride_of(kf)), vs_(stride_of(vf)) {}

  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  /// Live (retained) rows.
  Index live() const { return static_cast<Index>(order_.size()); }
  /// Slots in use, live or dead (dead ones are refilled by compact()).
  Index physical() const { return n_phys_; }
  Index capacity() const { return cap_; }
  /// First slot of the current call's rows (== physical() before they are appended).
  Index call_begin() const { return call_begin_; }

  /// Makes room for `rows` slots; exact capacity; strong exception guarantee.
  void reserve(Index rows) {
    if (rows > cap_) reallocate(rows);
  }

  /// Releases capacity beyond `rows` when more than half of it is unused (hysteresis against
  /// grow/shrink cycles; `tight`: more than a quarter plus 32 rows, still above what a tight
  /// growth leaves: grow_heads).
  /// Call only after compact(). Strong exception guarantee.
  void shrink_if_oversized(Index rows, bool tight = false) {
    VELOXQUANT_ASSERT(n_phys_ == live(), "shrink before compaction");
    // A live checkpoint's slots stay (reallocate keeps them): the floor, so that a head held
    // above twice its rows by a checkpoint does not reallocate at every call.
    const Index floor = has_checkpoint() ? std::max(rows, undo_->phys) : rows;
    const Index limit = tight ? floor + floor / 4 + 32 : 2 * floor;
    if (cap_ > limit && cap_ > 16) reallocate(std::max(rows, n_phys_));
  }

  /// Refills the holes left by evictions with rows from the tail, so that slots [0, live()) hold
  /// exactly the live rows. Never allocates; the logical state is unchanged.
  void compact() noexcept {
    const Index n_live = live();
    if (n_phys_ != n_live) {
      Index moved = 0;
      for_each_compaction_move([&](Index from, Index to) {
        move_slot(from, to);
        // A forwarding address in the vacated slot for the pass over `order` below.
        pos_[at(from)] = to;
        alive_[at(from)] = kMoved;
        ++moved;
      });
      // The moved rows were in the highest slots, the most recently appended: near the end of
      // `order` (ascending position), so the search runs from the back and stops when all are
      // found (one step in a decode loop).
      for (Index i = live() - 1; moved > 0; --i) {
        Slot& s = order_[at(i)];
        if (s < n_live) continue;
        s = static_cast<Slot>(pos_[at(s)]);
        --moved;
      }
      n_phys_ = n_live;
    }
    holes_.clear();
    call_begin_ = n_phys_;
  }

  /// The moves compact() makes, in its order: move(from, to) for every hole below live(), which
  /// takes the highest live slot not moved yet (holes above live() just disappear). Reads only
  /// slots at or below the current `from`, so compact() may mark each source as it goes.
  template <class Move>
  void for_each_compaction_move(Move move) const {
    const Index n_live = live();
    Index tail = n_phys_ - 1;
    for (const Slot h : holes_) {
      if (h >= n_live) continue;
      while (alive_[at(tail)] != kAlive) --tail;
      move(tail, static_cast<Index>(h));
      --tail;
    }
  }

  /// The rows of the head as compact() would leave them, without moving any: src[i] is the slot
  /// whose row compaction puts in slot i, i < live() (a saved head is its compacted form,
  /// docs/design.md G).
  void compacted_slots(std::vector<Slot>& src) const {
    src.resize(static_cast<std::size_t>(live()));
    for (Index i = 0; i < live(); ++i) src[at(i)] = static_cast<Slot>(i);
    for_each_compaction_move([&](Index from, Index to) { src[at(to)] = static_cast<Slot>(from); });
  }

  /// An independent copy of the head holding its live rows only, in the slots compact() would
  /// leave them in, at a capacity of exactly live() and with no window: what a fork copies
  /// (docs/design.md 10.1). Rows are copied in runs of consecutive slots (one run unless the last
  /// call evicted). Allocates only (the source is untouched).
  HeadStore forked() const {
    HeadStore c(kf_, vf_);
    const Index n = live();
    const auto rows = static_cast<std::size_t>(n);
    const auto ks = static_cast<std::size_t>(ks_), vs = static_cast<std::size_t>(vs_);
    // Rows are appended run by run into exactly reserved buffers (no zero fill first: the rows
    // are most of the bytes); the bookkeeping at exactly `rows` slots; a quantized head's row
    // buffer comes with its next growth (reallocate), which its next call with rows makes.
    c.k_.reserve(rows * ks);
    c.v_.reserve(rows * vs);
    c.pos_.resize(rows);
    c.score_.resize(rows);
    c.alive_.resize(rows, kAlive);
    c.order_.reserve(rows);
    c.holes_.reserve(rows);
    if (value_power_ > 0.0) {
      c.value_weight_.resize(rows);
      c.value_row_.resize(value_row_.size());
      c.value_power_ = value_power_;
    }
    c.key_sum_ = key_sum_;
    std::vector<Slot> src;  // src[i]: the slot whose row lands in slot i
    compacted_slots(src);
    std::vector<Slot> to(static_cast<std::size_t>(n_phys_));  // the inverse, on live slots
    for (Index i = 0; i < n;) {
      Index j = i + 1;
      while (j < n && src[at(j)] == src[at(j - 1)] + 1) ++j;
      const auto first = static_cast<std::size_t>(src[at(i)]);
      const auto run = static_cast<std::size_t>(j - i);
      c.k_.insert(c.k_.end(), k_.begin() + static_cast<std::ptrdiff_t>(first * ks),
                  k_.begin() + static_cast<std::ptrdiff_t>((first + run) * ks));
      c.v_.insert(c.v_.end(), v_.begin() + static_cast<std::ptrdiff_t>(first * vs),
                  v_.begin() + static_cast<std::ptrdiff_t>((first + run) * vs));
      for (Index r = i; r < j; ++r) {
        const Slot from = src[at(r)];
        c.pos_[at(r)] = pos_[at(from)];
        c.score_[at(r)] = score_[at(from)];
        if (value_power_ > 0.0) c.value_weight_[at(r)] = value_weight_[at(from)];
        to[at(from)] = static_cast<Slot>(r);
      }
      i = j;
    }
    c.order_.resize(order_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) c.order_[i] = to[at(order_[i])];
    c.cap_ = n;
    c.n_phys_ = n;
    c.call_begin_ = n;
    c.key_sum_valid_ = key_sum_valid_;
    return c;
  }

  // ---- checkpoint and rollback (docs/design.md 10.2) ----

  /// Marks the head's state: its bookkeeping (positions, scores, flags, weights, the live order,
  /// the holes, KeyDiff's sum) is copied now; a row is saved only when a later change is about to
  /// overwrite it (journal). Replaces a live checkpoint. Allocates only (strong guarantee); the
  /// buffers of the previous checkpoint are reused.
  void checkpoint() {
    Undo& u = undo_ ? *undo_ : *(undo_ = std::make_unique<Undo>());
    u.live = false;
    const auto n = static_cast<std::size_t>(n_phys_);
    u.pos.assign(pos_.begin(), pos_.begin() + static_cast<std::ptrdiff_t>(n));
    u.score.assign(score_.begin(), score_.begin() + static_cast<std::ptrdiff_t>(n));
    u.alive.assign(alive_.begin(), alive_.begin() + static_cast<std::ptrdiff_t>(n));
    u.weight.assign(
        value_weight_.begin(),
        value_weight_.begin() + static_cast<std::ptrdiff_t>(value_weight_.empty() ? 0 : n));
    u.order.assign(order_.begin(), order_.end());
    u.holes.assign(holes_.begin(), holes_.end());
    u.key_sum.assign(key_sum_.begin(), key_sum_.end());
    // A slot dead at the checkpoint needs no saving: its row is never read again.
    u.saved.resize(n);
    u.unsaved = 0;
    for (std::size_t i = 0; i < n; ++i) {
      u.saved[i] = alive_[i] == kAlive ? 0 : 1;
      u.unsaved += alive_[i] == kAlive ? 1 : 0;
    }
    u.slots.clear();
    u.rows.clear();
    u.phys = n_phys_;
    u.call_begin = call_begin_;
    u.key_sum_valid = key_sum_valid_;
    u.live = true;
  }
  bool has_checkpoint() const { return undo_ && undo_->live; }
  /// Forgets the checkpoint (its buffers stay for the next one).
  void drop_checkpoint() noexcept {
    if (undo_) undo_->live = false;
  }
  /// Room in the journal for every row a compaction and then `writes` more slot writes (a call's
  /// appends, a trim's second compaction) may overwrite, taken before the call (or trim) changes
  /// anything: a compaction overwrites at most holes().size() slots, and no more rows than the
  /// checkpoint held live and the journal has not saved yet are ever saved. Strong guarantee.
  void reserve_journal(Index writes) {
    if (!has_checkpoint()) return;
    Undo& u = *undo_;
    const std::size_t rows = holes_.size() + static_cast<std::size_t>(writes);
    const std::size_t want = u.slots.size() + std::min(rows, u.unsaved);
    if (u.slots.capacity() < want) u.slots.reserve(std::max(want, 2 * u.slots.capacity()));
    const std::size_t per = static_cast<std::size_t>(ks_ + vs_);
    if (u.rows.capacity() < want * per) u.rows.reserve(std::max(want * per, 2 * u.rows.capacity()));
  }
  /// Bytes the journal holds now (saved rows and bookkeeping, by capacity).
  std::size_t journal_bytes() const {
    if (!undo_) return 0;
    const Undo& u = *undo_;
    return u.pos.capacity() * sizeof(std::int64_t) +
           (u.score.capacity() + u.weight.capacity()) * sizeof(float) + u.alive.capacity() +
           u.saved.capacity() +
           (u.order.capacity() + u.holes.capacity() + u.slots.capacity()) * sizeof(Slot) +
           u.key_sum.capacity() * sizeof(std::int64_t) + u.rows.capacity() * sizeof(T);
  }
  /// Returns the head to its checkpoint, which it consumes: the saved rows go back to their
  /// slots, the bookkeeping is restored. Never allocates: while a checkpoint is live the head
  /// keeps the capacity and the rows of the checkpoint's slots (reallocate).
  void rollback() noexcept {
    VELOXQUANT_ASSERT(has_checkpoint() && cap_ >= undo_->phys, "rollback without a checkpoint");
    Undo& u = *undo_;
    const std::size_t per = static_cast<std::size_t>(ks_ + vs_);
    for (std::size_t i = 0; i < u.slots.size(); ++i) {
      const T* row = u.rows.data() + i * per;
      std::memcpy(key_ptr(u.slots[i]), row, sizeof(T) * static_cast<std::size_t>(ks_));
      std::memcpy(value_ptr(u.slots[i]), row + ks_, sizeof(T) * static_cast<std::size_t>(vs_));
    }
    std::copy(u.pos.begin(), u.pos.end(), pos_.begin());
    std::copy(u.score.begin(), u.score.end(), score_.begin());
    std::copy(u.alive.begin(), u.alive.end(), alive_.begin());
    std::copy(u.weight.begin(), u.weight.end(), value_weight_.begin());
    // The rows appended since are gone; order_ and holes_ keep their room (the capacity).
    std::fill(alive_.begin() + static_cast<std::ptrdiff_t>(u.phys),
              alive_.begin() + static_cast<std::ptrdiff_t>(std::max(n_phys_, u.phys)), kDead);
    order_.assign(u.order.begin(), u.order.end());
    holes_.assign(u.holes.begin(), u.holes.end());
    std::copy(u.key_sum.begin(), u.key_sum.end(), key_sum_.begin());
    n_phys_ = u.phys;
    call_begin_ = u.call_begin;
    key_sum_valid_ = u.key_sum_valid;
    u.live = false;
  }

  /// Restoring a saved head, step 1 (on a head with no slot in use): room for `rows` slots,
  /// keeping the rows of the first `keep` slots already written through key_ptr / value_ptr.
  /// Strong exception guarantee.
  void grow_for_restore(Index rows, Index keep) {
    VELOXQUANT_ASSERT(n_phys_ == 0 && order_.empty(), "restore into a head in use");
    if (rows > cap_) reallocate(rows, keep);
  }
  /// Restoring a saved head, step 2: slots [0, n) (capacity reserved, rows written) become the
  /// live rows, with positions pos[0..n) and scores score[0..n) (null: 0); the live order is
  /// rebuilt by position. Returns false when two rows share a position (the head then holds no
  /// live row).
  bool restore(Index n, const std::int64_t* pos, const float* score) {
    VELOXQUANT_ASSERT(n_phys_ == 0 && order_.empty() && n <= cap_, "restore beyond capacity");
    for (Index s = 0; s < n; ++s) {
      pos_[at(s)] = pos[s];
      score_[at(s)] = score ? score[s] : 0.0f;
      alive_[at(s)] = kAlive;
    }
    order_.resize(static_cast<std::size_t>(n));
    for (Index s = 0; s < n; ++s) order_[at(s)] = static_cast<Slot>(s);
    // Saved heads are mostly in position order already (a decode loop moves one row per step).
    if (!std::is_sorted(order_.begin(), order_.end(),
                        [&](Slot a, Slot b) { return pos[a] < pos[b]; })) {
      std::sort(order_.begin(), order_.end(), [&](Slot a, Slot b) { return pos[a] < pos[b]; });
    }
    for (Index i = 1; i < n; ++i) {
      if (pos[order_[at(i - 1)]] == pos[order_[at(i)]]) {
        order_.clear();
        std::fill(alive_.begin(), alive_.begin() + n, kDead);
        return false;
      }
    }
    n_phys_ = n;
    call_begin_ = n;
    holes_.clear();
    key_sum_valid_ = false;
    for (Index s = 0; s < n; ++s) set_value_weight(s);
    return true;
  }
  /// Elements of T one stored key (value) row takes.
  Index key_stride() const { return ks_; }
  Index value_stride() const { return vs_; }
  const RowFormat& key_format() const { return kf_; }
  const RowFormat& value_format() const { return vf_; }

  /// Starts the window of a call at the rows retained now; `keep_order` records their ascending
  /// order too (window(), for a copy of the window: the view needs none).
  void begin_window(bool keep_order) noexcept {
    if (keep_order) window_.assign(order_.begin(), order_.end());
    call_begin_ = n_phys_;
  }

  /// Appends one row in a new slot (capacity must be reserved) with score 0, alive but not yet in
  /// `order` (the policy decides when it joins); returns its slot. key: [Dk], value: [Dv] of U.
  template <class U>
  Slot append(const U* key, const U* value, std::int64_t position) noexcept {
    VELOXQUANT_ASSERT(n_phys_ < cap_, "append beyond reserved capacity");
    const Index s = n_phys_++;
    journal(s);
    put_row(key, kf_, key_ptr(s));
    put_row(value, vf_, value_ptr(s));
    pos_[at(s)] = position;
    score_[at(s)] = 0.0f;
    alive_[at(s)] = kAlive;
    set_value_weight(s);
    return static_cast<Slot>(s);
  }

  /// Makes slot `s` join the live set at the end of `order` (its position must be the largest).
  void push_live(Slot s) noexcept {
    VELOXQUANT_ASSERT(order_.size() < order_.capacity(), "order capacity");
    order_.push_back(s);
    key_sum_valid_ = false;
  }
  /// Marks slot `s` dead (drop_dead() then removes it from `order`).
  void mark_dead(Slot s) noexcept {
    VELOXQUANT_ASSERT(alive_[at(s)] == kAlive, "mark_dead of a dead slot");
    alive_[at(s)] = kDead;
    holes_.push_back(s);
    key_sum_valid_ = false;
  }
  /// Evicts the row at index `i` of `order` (marks it dead and removes it from `order`).
  void evict_at(Index i) noexcept {
    mark_dead(order_[at(i)]);
    order_.erase(order_.begin() + i);
  }
  /// Removes dead slots from `order`, keeping the order of the rest.
  void drop_dead() noexcept {
    order_.erase(std::remove_if(order_.begin(), order_.end(),
                                [this](Slot s) { return alive_[at(s)] != kAlive; }),
                 order_.end());
  }
  /// Replaces the live order (every slot left out must be dead). o: ascending position.
  void assign_order(const Slot* o, Index n) noexcept {
    VELOXQUANT_ASSERT(static_cast<std::size_t>(n) <= order_.capacity(), "order capacity");
    order_.assign(o, o + n);
    key_sum_valid_ = false;
  }

  /// KeyDiff's running sum (docs/design.md 4.7): per key dimension, an exact integer sum over the
  /// live rows (proxy_scores.hpp), kept by the KeyDiff scorer alone. Every change of the live set
  /// makes it invalid; the scorer rebuilds it or, after a change it made itself, updates it and
  /// marks it valid again. reserve_key_sum allocates it (strong exception guarantee) before a call
  /// changes anything.
  void reserve_key_sum() {
    if (key_sum_.empty() && dk_ > 0) key_sum_.assign(static_cast<std::size_t>(dk_), 0);
  }
  std::int64_t* key_sum() { return key_sum_.data(); }

  /// The value-weighted ranking (docs/design.md 4.8, KVCacheConfig::value_norm_power): from now
  /// on every slot holds |v|^power of its stored value row, computed once when the row is stored
  /// (append, restore) and moved with it. Call on a head holding no row; strong exception
  /// guarantee. power > 0.
  void enable_value_weights(double power) {
    VELOXQUANT_ASSERT(n_phys_ == 0 && power > 0.0, "value weights on a head in use");
    std::vector<float> weight(static_cast<std::size_t>(cap_));
    std::vector<float> row(static_cast<std::size_t>(padded_dim(dv_)));
    value_weight_.swap(weight);
    value_row_.swap(row);
    value_power_ = power;
  }
  /// |v|^power by slot ([physical()]); only after enable_value_weights.
  const float* value_weights_data() const { return value_weight_.data(); }
  bool key_sum_valid() const { return key_sum_valid_; }
  void set_key_sum_valid() noexcept { key_sum_valid_ = true; }

  /// Drops the newest `n` live rows (standard cache trim; valid only with no holes).
  void drop_newest(Index n) noexcept {
    VELOXQUANT_ASSERT(n_phys_ == live(), "drop_newest with holes");
    for (Index i = 0; i < n; ++i) {
      mark_dead(order_.back());
      order_.pop_back();
    }
    compact();
  }

  /// Slots made dead since the last compaction.
  const std::vector<Slot>& holes() const { return holes_; }
  /// Index in `order` of the live slot `s` (binary search by position).
  Index order_index(Slot s) const {
    const std::int64_t p = pos_[at(s)];
    const auto it = std::lower_bound(order_.begin(), order_.end(), p,
                                     [this](Slot a, std::int64_t q) { return pos_[at(a)] < q; });
    VELOXQUANT_ASSERT(it != order_.end() && *it == s, "order_index of a slot not live");
    return it - order_.begin();
  }
  /// Live slots in ascending position.
  const std::vector<Slot>& order() const { return order_; }
  /// How many rows lead the live order with a position below `n_sink`: the sinks, which a policy
  /// never evicts (positions ascend along the order, so they come first).
  Index leading_sinks(int n_sink) const {
    Index sinks = 0;
    while (sinks < live() && position(order_[static_cast<std::size_t>(sinks)]) < n_sink) ++sinks;
    return sinks;
  }
  /// The rows retained before the current call, ascending position (when begin_window kept it).
  const std::vector<Slot>& window() const { return window_; }

  /// Slot s's stored key (value) row: dk (dv) elements of T, or a quantized row's bytes.
  T* key_ptr(Index s) { return k_.data() + s * ks_; }
  const T* key_ptr(Index s) const { return k_.data() + s * ks_; }
  T* value_ptr(Index s) { return v_.data() + s * vs_; }
  const T* value_ptr(Index s) const { return v_.data() + s * vs_; }
  /// The stored rows as the kernels read them, slot = row index.
  StoredRows<T> key_rows() const { return StoredRows<T>{k_.data(), ks_, kf_}; }
  StoredRows<T> value_rows() const { return StoredRows<T>{v_.data(), vs_, vf_}; }
  bool quantized() const { return kf_.quantized() || vf_.quantized(); }
  /// Bytes one slot's key and value rows take (codes and scales of quantized rows).
  std::size_t slot_bytes() const { return static_cast<std::size_t>(ks_ + vs_) * sizeof(T); }
  /// Slot s's rows as T: key [dk], value [dv] (quantized rows dequantized; float32 through buf,
  /// [padded_dim(max(dk, dv))]).
  void read_rows(Index s, T* key, T* value, float* buf) const {
    get_row(kf_, key_ptr(s), key, buf);
    get_row(vf_, value_ptr(s), value, buf);
  }
  const T* keys_data() const { return k_.data(); }
  const T* values_data() const { return v_.data(); }
  const std::int64_t* positions_data() const { return pos_.data(); }
  float* scores_data() { return score_.data(); }
  const float* scores_data_const() const { return score_.data(); }
  std::uint8_t* alive_data() { return alive_.data(); }

  std::int64_t position(Index s) const { return pos_[at(s)]; }
  float score(Index s) const { return score_[at(s)]; }
  float& score(Index s) { return score_[at(s)]; }

  /// Heap bytes held by this head (all buffers, by capacity).
  std::size_t heap_bytes() const {
    return k_.capacity() * sizeof(T) + v_.capacity() * sizeof(T) +
           row_buf_.capacity() * sizeof(float) + pos_.capacity() * sizeof(std::int64_t) +
           score_.capacity() * sizeof(float) + alive_.capacity() +
           key_sum_.capacity() * sizeof(std::int64_t) +
           (value_weight_.capacity() + value_row_.capacity()) * sizeof(float) +
           (order_.capacity() + window_.capacity() + holes_.capacity()) * sizeof(Slot) +
           journal_bytes();
  }

  static constexpr std::uint8_t kDead = 0;
  static constexpr std::uint8_t kAlive = 1;

 private:
  static constexpr std::uint8_t kMoved = 2;

  static std::size_t at(Index s) { return static_cast<std::size_t>(s); }

  // What a checkpoint keeps (checkpoint(), rollback()).
  struct Undo {
    bool live = false;
    Index phys = 0, call_begin = 0;
    bool key_sum_valid = false;
    std::vector<std::int64_t> pos;     // [phys]
    std::vector<float> score, weight;  // [phys], [phys] or empty
    std::vector<std::uint8_t> alive;   // [phys]
    std::vector<std::uint8_t> saved;   // [phys]: 1 once the slot's row needs no saving
    std::size_t unsaved = 0;           // slots live at the checkpoint whose rows are not saved
    std::vector<Slot> order, holes;
    std::vector<std::int64_t> key_sum;
    std::vector<Slot> slots;  // the slots whose rows the journal saved, in order
    std::vector<T> rows;      // their key and value rows, ks_ + vs_ elements each
  };

  // Before slot s is overwritten: with a live checkpoint, saves the row it held then (once). The
  // room was reserved (reserve_journal).
  void journal(Index s) noexcept {
    if (!has_checkpoint() || s >= undo_->phys || undo_->saved[at(s)]) return;
    Undo& u = *undo_;
    u.saved[at(s)] = 1;
    --u.unsaved;
    VELOXQUANT_ASSERT(u.slots.size() < u.slots.capacity() &&
                          u.rows.size() + static_cast<std::size_t>(ks_ + vs_) <= u.rows.capacity(),
                      "journal capacity");
    u.slots.push_back(static_cast<Slot>(s));
    u.rows.insert(u.rows.end(), key_ptr(s), key_ptr(s) + ks_);
    u.rows.insert(u.rows.end(), value_ptr(s), value_ptr(s) + vs_);
  }

  // Elements of T one row of format f takes.
  static Index stride_of(const RowFormat& f) {
    if (!f.quantized()) return f.dim;
    const auto size = static_cast<Index>(sizeof(T));
    return (f.row_bytes() + size - 1) / size;
  }

  // One input row into its slot: converted to T, and quantized from that (every input type
  // gives the codes its conversion to T gives).
  template <class U>
  void put_row(const U* src, const RowFormat& f, T* dst) noexcept {
    if (!f.quantized()) return store_row(src, dst, f.dim);
    float* x = row_buf_.data();
    for (Index i = 0; i < f.dim; ++i) x[i] = static_cast<float>(static_cast<T>(src[i]));
    quantize_row(x, f, reinterpret_cast<std::uint8_t*>(dst));
  }
  static void get_row(const RowFormat& f, const T* src, T* dst, float* buf) noexcept {
    if (!f.quantized()) {
      std::memcpy(dst, src, sizeof(T) * static_cast<std::size_t>(f.dim));
      return;
    }
    const QuantRows one{reinterpret_cast<const std::uint8_t*>(src), 0, f};
    dequantize_row(one, 0, buf);
    if constexpr (std::is_same_v<T, Eigen::half>) {
      // A decoded element may lie up to half a step beyond the group's extremes; near +-65504
      // that is past the largest half. The original was within +-65504: the clamp only moves the
      // element towards it.
      for (Index i = 0; i < f.dim; ++i) buf[i] = std::min(std::max(buf[i], -kHalfMax), kHalfMax);
    }
    store_row(buf, dst, f.dim);
  }

  void move_slot(Index from, Index to) noexcept {
    journal(to);
    std::memcpy(key_ptr(to), key_ptr(from), sizeof(T) * static_cast<std::size_t>(ks_));
    std::memcpy(value_ptr(to), value_ptr(from), sizeof(T) * static_cast<std::size_t>(vs_));
    pos_[at(to)] = pos_[at(from)];
    score_[at(to)] = score_[at(from)];
    if (value_power_ > 0.0) value_weight_[at(to)] = value_weight_[at(from)];
    alive_[at(to)] = kAlive;
  }

  // The weight of the value row stored in slot s (enable_value_weights; else nothing).
  void set_value_weight(Index s) noexcept {
    if (value_power_ > 0.0) {
      value_weight_[at(s)] =
          value_norm_weight(value_rows(), s, dv_, value_power_, value_row_.data());
    }
  }

  // Allocates every buffer at exactly `rows` slots, copies the first `keep` slots (those in use),
  // then swaps.
  // With a live checkpoint the slots it covers keep their rows and room (rollback needs them).
  void reallocate(Index rows) {
    const Index keep = has_checkpoint() ? std::max(n_phys_, undo_->phys) : n_phys_;
    reallocate(std::max(rows, keep), keep);
  }
  void reallocate(Index rows, Index keep) {
    const auto r = static_cast<std::size_t>(rows);
    const auto used = static_cast<std::size_t>(keep);
    std::vector<T> k(r * static_cast<std::size_t>(ks_));
    std::vector<T> v(r * static_cast<std::size_t>(vs_));
    std::vector<std::int64_t> pos(r);
    std::vector<float> score(r);
    std::vector<float> value_weight(value_power_ > 0.0 ? r : 0);
    std::vector<std::uint8_t> alive(r, kDead);
    std::vector<Slot> order;
    order.reserve(r);
    std::vector<Slot> window;
    window.reserve(r);
    std::vector<Slot> holes;
    holes.reserve(r);
    // The buffer a quantized row is stored through, with the first rows (a head that never holds
    // a row allocates nothing: a loaded head of 0 rows, docs/design.md G).
    std::vector<float> row_buf;
    if (quantized() && row_buf_.empty()) {
      row_buf.resize(static_cast<std::size_t>(padded_dim(std::max(dk_, dv_))));
    }
    // No-throw from here on.
    std::copy_n(k_.begin(), used * static_cast<std::size_t>(ks_), k.begin());
    std::copy_n(v_.begin(), used * static_cast<std::size_t>(vs_), v.begin());
    std::copy_n(pos_.begin(), used, pos.begin());
    std::copy_n(score_.begin(), used, score.begin());
    if (!value_weight.empty()) std::copy_n(value_weight_.begin(), used, value_weight.begin());
    std::copy_n(alive_.begin(), used, alive.begin());
    order.assign(order_.begin(), order_.end());
    holes.assign(holes_.begin(), holes_.end());
    // The previous call's window is not carried over: reallocation happens only when a new call
    // starts (a long prompt's window would otherwise pin its capacity).
    k_.swap(k);
    v_.swap(v);
    pos_.swap(pos);
    score_.swap(score);
    value_weight_.swap(value_weight);
    alive_.swap(alive);
    order_.swap(order);
    window_.swap(window);
    holes_.swap(holes);
    if (!row_buf.empty()) row_buf_.swap(row_buf);
    cap_ = rows;
  }

  Index dk_ = 0;
  Index dv_ = 0;
  RowFormat kf_, vf_;
  Index ks_ = 0, vs_ = 0;  // elements of T per key (value) row
  Index n_phys_ = 0;
  Index cap_ = 0;
  Index call_begin_ = 0;
  std::vector<T> k_;                   // [cap, ks_]: Dk of T, or a quantized row's bytes
  std::vector<T> v_;                   // [cap, vs_]
  std::vector<float> row_buf_;         // [padded_dim(max(Dk, Dv))]: the row being quantized
  std::vector<std::int64_t> pos_;      // [cap]
  std::vector<float> score_;           // [cap]
  std::vector<std::int64_t> key_sum_;  // [dk] or empty: KeyDiff's running sum
  std::vector<float> value_weight_;    // [cap] or empty: |v|^value_power_ per slot
  std::vector<float> value_row_;       // [padded_dim(dv)] or empty: a value row being weighed
  std::vector<std::uint8_t> alive_;    // [cap]
  std::vector<Slot> order_;            // live slots, ascending position
  std::vector<Slot> window_;           // rows retained before the current call, ascending position
  std::vector<Slot> holes_;            // slots made dead since the last compaction
  std::unique_ptr<Undo> undo_;         // the checkpoint, or null before the first
  bool key_sum_valid_ = false;         // key_sum_ is the sum over the live rows
  double value_power_ = 0.0;           // > 0: value_weight_ is kept (enable_value_weights)
};

}  // namespace veloxquant::cache::detail
