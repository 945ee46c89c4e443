// veloxquant — one head's rows and their bookkeeping, shared by every policy (docs/design.md 7.1).
//
// A head keeps its rows in "slots" (a RowBuffer: key and value rows as T or quantized), and per
// slot a position (int64), a score (float32) and an alive flag. `order` lists the live slots in
// ascending position. Evicting a row clears its alive flag (and drops it from `order`), with no
// data movement; the hole is refilled at the start of the next call by moving one row from the tail
// (O(D)), so every row the current call returned stays addressable until then: the window of a
// call is slots [0, physical()), the rows retained before it (`window()` lists them in ascending
// position) followed by the call's rows in arrival order.
//
// Rows quantized along channels (docs/design.md 7.5) also live in blocks of positions: the head
// seals the pending block when its last position arrives, tells the blocks where a pending row
// moves, and has the blocks none of whose rows is live dropped at compaction.
//
// Three pieces live beside the rows, each defined where it is used: a checkpoint's journal
// (journal.hpp), and two scorers' state that must follow the rows: the value-weighted ranking's
// weight per slot (ValueWeights, value_rank.hpp) and KeyDiff's running sum over the live set
// (KeyDiffSum, proxy_scores.hpp). The head moves the first with its slots and marks the second
// stale whenever the live set changes; what they hold is their scorers' business.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "assert.hpp"
#include "journal.hpp"
#include "proxy_scores.hpp"
#include "row_buffer.hpp"
#include "value_rank.hpp"

namespace veloxquant::cache::detail {

/// Rows, positions and scores of one (batch, head).
template <class T>
class HeadStore {
 public:
  HeadStore() = default;
  /// Rows of keys and values in the formats given (fmt.dim: the head dims).
  HeadStore(const RowFormat& kf, const RowFormat& vf) : rows_(kf, vf) {}

  Index key_dim() const { return rows_.key_dim(); }
  Index value_dim() const { return rows_.value_dim(); }
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
    if (!has_checkpoint() && rows_.channel_axis()) rows_.channel().shrink();
  }

  /// Releases every slot beyond the live rows (a compress that frees memory, SPEC 18; a live
  /// checkpoint's slots stay, as reallocate keeps them). Call only after compact(). Strong
  /// exception guarantee.
  void shrink_to_fit() {
    VELOXQUANT_ASSERT(n_phys_ == live(), "shrink before compaction");
    if (cap_ > n_phys_) reallocate(n_phys_);
    if (!has_checkpoint() && rows_.channel_axis()) rows_.channel().shrink();
  }

  /// Room for the channel blocks `rows` more appended rows may seal (one per block of positions,
  /// and one more for a block a trim cut short). Strong exception guarantee.
  void reserve_blocks(Index rows) {
    if (rows_.channel_axis()) rows_.channel().reserve(rows / rows_.channel().block() + 2);
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
      if (rows_.channel_axis()) {
        rows_.channel().prune(n_live, [this](Index i) { return pos_[at(order_[at(i)])]; });
      }
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
  /// (docs/design.md 10.1). Allocates only (the source is untouched).
  HeadStore forked() const {
    HeadStore c;
    const Index n = live();
    const auto rows = static_cast<std::size_t>(n);
    std::vector<Slot> src;  // src[i]: the slot whose row lands in slot i
    compacted_slots(src);
    c.rows_ = rows_.gathered(src.data(), n);
    c.weights_ = weights_.gathered(src.data(), n);
    c.key_sum_ = key_sum_;
    c.pos_.resize(rows);
    c.score_.resize(rows);
    c.alive_.resize(rows, kAlive);
    c.order_.reserve(rows);
    c.holes_.reserve(rows);
    std::vector<Slot> to(static_cast<std::size_t>(n_phys_));  // the inverse, on live slots
    for (Index r = 0; r < n; ++r) {
      const Slot from = src[at(r)];
      c.pos_[at(r)] = pos_[at(from)];
      c.score_[at(r)] = score_[at(from)];
      to[at(from)] = static_cast<Slot>(r);
    }
    c.order_.resize(order_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) c.order_[i] = to[at(order_[i])];
    if (rows_.channel_axis()) {
      // Lanes of rows not carried over (dead, or appended and not yet live) point nowhere.
      std::vector<Slot> lane_to(to.size(), -1);
      for (const Slot s : order_) lane_to[at(s)] = to[at(s)];
      c.rows_.channel().remap(lane_to);
    }
    c.cap_ = n;
    c.n_phys_ = n;
    c.call_begin_ = n;
    return c;
  }

  // ---- checkpoint and rollback (docs/design.md 10.2; the journal: journal.hpp) ----

  /// Marks the head's state: its bookkeeping is copied now, a row is saved only when a later
  /// change is about to overwrite it. Replaces a live checkpoint. Allocates only (strong
  /// guarantee); the buffers of the previous checkpoint are reused.
  void checkpoint() {
    Journal<T>& u = undo_ ? *undo_ : *(undo_ = std::make_unique<Journal<T>>());
    u.live = false;
    const auto n = static_cast<std::ptrdiff_t>(n_phys_);
    u.pos.assign(pos_.begin(), pos_.begin() + n);
    u.score.assign(score_.begin(), score_.begin() + n);
    u.alive.assign(alive_.begin(), alive_.begin() + n);
    weights_.save(n_phys_, u.weight);
    u.order.assign(order_.begin(), order_.end());
    u.holes.assign(holes_.begin(), holes_.end());
    key_sum_.save(u.key_sum);
    if (rows_.channel_axis()) u.channel = rows_.channel().state();
    u.open_rows(alive_.data(), n_phys_, kAlive);
    u.phys = n_phys_;
    u.call_begin = call_begin_;
    u.live = true;
  }
  bool has_checkpoint() const { return undo_ && undo_->live; }
  /// Forgets the checkpoint (its buffers stay for the next one).
  void drop_checkpoint() noexcept {
    if (undo_) undo_->live = false;
  }
  /// Room in the journal for every row a compaction and then `writes` more slot writes (a call's
  /// appends, a trim's second compaction) may overwrite, taken before the call (or trim) changes
  /// anything: a compaction overwrites at most holes().size() slots. Strong guarantee.
  void reserve_journal(Index writes) {
    if (!has_checkpoint()) return;
    // Sealing the pending block rewrites its rows' slots (at most a block of them).
    const Index seals = rows_.channel_axis() ? rows_.channel().block() : 0;
    undo_->reserve(holes_.size() + static_cast<std::size_t>(writes + seals),
                   static_cast<std::size_t>(key_stride() + value_stride()));
  }
  /// Bytes the journal holds now (saved rows and bookkeeping, by capacity).
  std::size_t journal_bytes() const { return undo_ ? undo_->heap_bytes() : 0; }
  /// Returns the head to its checkpoint, which it consumes: the saved rows go back to their
  /// slots, the bookkeeping is restored. Never allocates: while a checkpoint is live the head
  /// keeps the capacity and the rows of the checkpoint's slots (reallocate).
  void rollback() noexcept {
    VELOXQUANT_ASSERT(has_checkpoint() && cap_ >= undo_->phys, "rollback without a checkpoint");
    Journal<T>& u = *undo_;
    u.put_back(rows_);
    std::copy(u.pos.begin(), u.pos.end(), pos_.begin());
    std::copy(u.score.begin(), u.score.end(), score_.begin());
    std::copy(u.alive.begin(), u.alive.end(), alive_.begin());
    weights_.restore(u.weight);
    // The rows appended since are gone; order_ and holes_ keep their room (the capacity).
    std::fill(alive_.begin() + static_cast<std::ptrdiff_t>(u.phys),
              alive_.begin() + static_cast<std::ptrdiff_t>(std::max(n_phys_, u.phys)), kDead);
    order_.assign(u.order.begin(), u.order.end());
    holes_.assign(u.holes.begin(), u.holes.end());
    key_sum_.restore(u.key_sum);
    if (rows_.channel_axis()) rows_.channel().state().swap(u.channel);
    n_phys_ = u.phys;
    call_begin_ = u.call_begin;
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
    key_sum_.valid = false;
    for (Index s = 0; s < n; ++s) weights_.set(value_rows(), s, value_dim());
    return true;
  }
  /// Elements of T one stored key (value) row takes.
  Index key_stride() const { return rows_.key_stride(); }
  Index value_stride() const { return rows_.value_stride(); }
  const RowFormat& key_format() const { return rows_.key_format(); }
  const RowFormat& value_format() const { return rows_.value_format(); }

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
    const bool channel = rows_.channel_axis();
    // A position beyond the pending block (or before it, after a trim) starts a new one.
    if (channel && !rows_.channel().fits(position)) seal_pending(position);
    rows_.put(s, key, value, position);
    pos_[at(s)] = position;
    score_[at(s)] = 0.0f;
    alive_[at(s)] = kAlive;
    if (channel && rows_.channel().last_of_block(position)) seal_pending(position + 1);
    weights_.set(value_rows(), s, value_dim());
    return static_cast<Slot>(s);
  }

  /// Makes slot `s` join the live set at the end of `order` (its position must be the largest).
  void push_live(Slot s) noexcept {
    VELOXQUANT_ASSERT(order_.size() < order_.capacity(), "order capacity");
    order_.push_back(s);
    key_sum_.valid = false;
  }
  /// Marks slot `s` dead (drop_dead() then removes it from `order`).
  /// Drops the channel blocks none of whose live rows remain, without moving a row (a memory
  /// pool's trim outside a call: the tables of the rows it took go at once). Never allocates.
  void prune_blocks() noexcept {
    if (!rows_.channel_axis()) return;
    rows_.channel().prune(live(), [this](Index i) { return pos_[at(order_[at(i)])]; });
  }
  void mark_dead(Slot s) noexcept {
    VELOXQUANT_ASSERT(alive_[at(s)] == kAlive, "mark_dead of a dead slot");
    alive_[at(s)] = kDead;
    holes_.push_back(s);
    key_sum_.valid = false;
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
    key_sum_.valid = false;
  }

  /// KeyDiff's running sum over the live rows (proxy_scores.hpp): stale after every change of the
  /// live set made here; the KeyDiff scorer keeps it (proxy_call.hpp).
  KeyDiffSum& keydiff_sum() { return key_sum_; }
  /// Whether KeyDiff's running sum is allocated (a head's first call with KeyDiff allocates it).
  bool keydiff_sum_ready() const {
    return static_cast<Index>(key_sum_.sum.size()) >= key_dim() && key_dim() > 0;
  }

  /// The value-weighted ranking (docs/design.md 4.8, KVCacheConfig::value_norm_power): from now
  /// on every slot holds |v|^power of its stored value row, computed once when the row is stored
  /// (append, restore) and moved with it. Call on a head holding no row; strong exception
  /// guarantee. power > 0.
  void enable_value_weights(double power) {
    VELOXQUANT_ASSERT(n_phys_ == 0 && power > 0.0, "value weights on a head in use");
    weights_.enable(power, cap_, value_dim());
  }
  /// |v|^power by slot ([physical()]); only after enable_value_weights.
  const float* value_weights_data() const { return weights_.data(); }

  /// Drops the newest `n` live rows (standard cache trim; valid only with no holes).
  void drop_newest(Index n) noexcept {
    VELOXQUANT_ASSERT(n_phys_ == live(), "drop_newest with holes");
    for (Index i = 0; i < n; ++i) {
      mark_dead(order_.back());
      order_.pop_back();
    }
    compact();  // (channel blocks left without rows go; the next append restarts the pending
                // block if the trim reached before it)
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
  T* key_ptr(Index s) { return rows_.key_ptr(s); }
  const T* key_ptr(Index s) const { return rows_.key_ptr(s); }
  T* value_ptr(Index s) { return rows_.value_ptr(s); }
  const T* value_ptr(Index s) const { return rows_.value_ptr(s); }
  /// The stored rows as the kernels read them, slot = row index.
  StoredRows<T> key_rows() const {
    return rows_.key_rows(pos_.data(), order_.data(), live(), n_phys_);
  }
  StoredRows<T> value_rows() const {
    return rows_.value_rows(pos_.data(), order_.data(), live(), n_phys_);
  }
  bool quantized() const { return rows_.quantized(); }
  /// Bytes one slot's key and value rows take (codes and scales of quantized rows).
  std::size_t slot_bytes() const { return rows_.slot_bytes(); }
  /// Slot s's rows as T: key [dk], value [dv] (quantized rows dequantized; float32 through buf,
  /// [padded_dim(max(dk, dv))]).
  void read_rows(Index s, T* key, T* value, float* buf) const {
    rows_.read(s, pos_[at(s)], key, value, buf);
  }
  /// True when keys or values are quantized along channels; their blocks (docs/design.md 7.5).
  bool channel_axis() const { return rows_.channel_axis(); }
  const ChannelBlocks<T>& channel() const { return rows_.channel(); }
  ChannelBlocks<T>& channel() { return rows_.channel(); }
  /// Bytes of rows held for the live rows (slots, and channel blocks' tables and pending rows).
  std::size_t held_bytes() const { return rows_.held_bytes(live()); }
  const T* keys_data() const { return rows_.key_ptr(0); }
  const T* values_data() const { return rows_.value_ptr(0); }
  const std::int64_t* positions_data() const { return pos_.data(); }
  float* scores_data() { return score_.data(); }
  const float* scores_data_const() const { return score_.data(); }
  std::uint8_t* alive_data() { return alive_.data(); }

  std::int64_t position(Index s) const { return pos_[at(s)]; }
  float score(Index s) const { return score_[at(s)]; }
  float& score(Index s) { return score_[at(s)]; }

  /// Heap bytes held by this head (all buffers, by capacity).
  std::size_t heap_bytes() const {
    return rows_.heap_bytes() + pos_.capacity() * sizeof(std::int64_t) +
           score_.capacity() * sizeof(float) + alive_.capacity() + key_sum_.heap_bytes() +
           weights_.heap_bytes() +
           (order_.capacity() + window_.capacity() + holes_.capacity()) * sizeof(Slot) +
           journal_bytes();
  }

  static constexpr std::uint8_t kDead = 0;
  static constexpr std::uint8_t kAlive = 1;

 private:
  static constexpr std::uint8_t kMoved = 2;

  static std::size_t at(Index s) { return static_cast<std::size_t>(s); }

  // Before slot s is overwritten: the journal saves the row it held at a live checkpoint (once).
  void journal(Index s) noexcept {
    if (undo_) undo_->save(s, rows_);
  }

  void move_slot(Index from, Index to) noexcept {
    journal(to);
    rows_.move(from, to);
    if (rows_.channel_axis()) rows_.channel().moved(pos_[at(from)], static_cast<Slot>(to));
    pos_[at(to)] = pos_[at(from)];
    score_[at(to)] = score_[at(from)];
    weights_.move(from, to);
    alive_[at(to)] = kAlive;
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
    RowBuffer<T> stored = rows_.resized(rows, keep);
    std::vector<std::int64_t> pos(r);
    std::vector<float> score(r);
    std::vector<float> weight = weights_.resized(rows, keep);
    std::vector<std::uint8_t> alive(r, kDead);
    std::vector<Slot> order;
    order.reserve(r);
    std::vector<Slot> window;
    window.reserve(r);
    std::vector<Slot> holes;
    holes.reserve(r);
    // No-throw from here on.
    std::copy_n(pos_.begin(), used, pos.begin());
    std::copy_n(score_.begin(), used, score.begin());
    std::copy_n(alive_.begin(), used, alive.begin());
    order.assign(order_.begin(), order_.end());
    holes.assign(holes_.begin(), holes_.end());
    // The previous call's window is not carried over: reallocation happens only when a new call
    // starts (a long prompt's window would otherwise pin its capacity).
    rows_.swap(stored);
    pos_.swap(pos);
    score_.swap(score);
    weights_.swap_weights(weight);
    alive_.swap(alive);
    order_.swap(order);
    window_.swap(window);
    holes_.swap(holes);
    cap_ = rows;
  }

  // Seals the pending block of channel-axis rows (docs/design.md 7.5): its rows still live are
  // quantized together, their slots journaled first; the next block starts at `next`.
  void seal_pending(std::int64_t next) noexcept {
    ChannelBlocks<T>& ch = rows_.channel();
    Slot live[kMaxBlock];
    Index lanes[kMaxBlock];
    Index n = 0;
    for (Index l = 0; l < ch.block(); ++l) {
      const Slot s = ch.lane_slot(l);
      if (s < 0 || s >= n_phys_ || alive_[at(s)] != kAlive ||
          pos_[at(s)] != ch.pending_start() + l) {
        continue;
      }
      live[n] = s;
      lanes[n] = l;
      ++n;
    }
    for (Index i = 0; i < n; ++i) journal(live[i]);
    ch.seal(lanes, n, next, [&](Index i, bool keys) {
      return reinterpret_cast<std::uint8_t*>(keys ? key_ptr(live[i]) : value_ptr(live[i]));
    });
    for (Index i = 0; i < n; ++i) weights_.set(value_rows(), live[i], value_dim());
    if (n > 0) key_sum_.valid = false;
  }

  RowBuffer<T> rows_;  // the key and value rows, by slot
  Index n_phys_ = 0;
  Index cap_ = 0;
  Index call_begin_ = 0;
  std::vector<std::int64_t> pos_;     // [cap]
  std::vector<float> score_;          // [cap]
  std::vector<std::uint8_t> alive_;   // [cap]
  std::vector<Slot> order_;           // live slots, ascending position
  std::vector<Slot> window_;          // rows retained before the current call, ascending position
  std::vector<Slot> holes_;           // slots made dead since the last compaction
  ValueWeights weights_;              // |v|^p per slot, when the value-weighted ranking is on
  KeyDiffSum key_sum_;                // KeyDiff's running sum
  std::unique_ptr<Journal<T>> undo_;  // the checkpoint, or null before the first
};

}  // namespace veloxquant::cache::detail
