// veloxquant — one head's checkpoint: the journal a rollback replays (docs/design.md 10.2).
//
// A checkpoint copies the head's bookkeeping whole when it is taken (positions, scores, flags and
// scorer state of the slots in use, the live order, the holes: small next to the rows) and saves a
// row only when something is about to overwrite it: before every write to a slot that held a live
// row at the checkpoint, once. A decode step after a checkpoint thus copies one or two rows, not
// the head. The head (head_store.hpp) fills the bookkeeping and calls save() before each write;
// rollback puts the saved rows back and the head copies its bookkeeping back.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "assert.hpp"
#include "proxy_scores.hpp"
#include "row_buffer.hpp"

namespace veloxquant::cache::detail {

/// What a checkpoint of one head keeps.
template <class T>
struct Journal {
  bool live = false;  // a checkpoint is held (the buffers stay between checkpoints)

  // The bookkeeping at the checkpoint (the head copies it in and out).
  Index phys = 0, call_begin = 0;
  std::vector<std::int64_t> pos;     // [phys]
  std::vector<float> score, weight;  // [phys], [phys] or empty (ValueWeights)
  std::vector<std::uint8_t> alive;   // [phys]
  std::vector<Slot> order, holes;
  KeyDiffSum key_sum;
  ChannelState<T> channel;  // channel-axis blocks (docs/design.md 7.5), whole: small next to rows

  /// Starts saving rows for a checkpoint of `n` slots in use, of which those with alive[s] ==
  /// `alive_flag` hold rows (a slot dead at the checkpoint needs no saving: its row is never read
  /// again). Allocates only.
  void open_rows(const std::uint8_t* alive_now, Index n, std::uint8_t alive_flag) {
    const auto count = static_cast<std::size_t>(n);
    saved_.resize(count);
    unsaved_ = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const bool holds = alive_now[i] == alive_flag;
      saved_[i] = holds ? 0 : 1;
      unsaved_ += holds ? 1 : 0;
    }
    slots_.clear();
    rows_.clear();
  }

  /// Room for `writes` more slot writes, taken before a call (or a trim) changes anything: no more
  /// rows than the checkpoint held live and the journal has not saved yet are ever saved. per:
  /// elements of T of one slot's rows. Strong exception guarantee.
  void reserve(std::size_t writes, std::size_t per) {
    const std::size_t want = slots_.size() + std::min(writes, unsaved_);
    if (slots_.capacity() < want) slots_.reserve(std::max(want, 2 * slots_.capacity()));
    if (rows_.capacity() < want * per) rows_.reserve(std::max(want * per, 2 * rows_.capacity()));
  }

  /// Before slot s of `rows` is overwritten: with a live checkpoint, saves the rows it held then
  /// (once). The room was reserved.
  void save(Index s, const RowBuffer<T>& rows) noexcept {
    if (!live || s >= phys || saved_[at(s)]) return;
    saved_[at(s)] = 1;
    --unsaved_;
    VELOXQUANT_ASSERT(
        slots_.size() < slots_.capacity() &&
            rows_.size() + static_cast<std::size_t>(rows.key_stride() + rows.value_stride()) <=
                rows_.capacity(),
        "journal capacity");
    slots_.push_back(static_cast<Slot>(s));
    rows.save(s, rows_);
  }

  /// Writes every saved row back into its slot of `rows`.
  void put_back(RowBuffer<T>& rows) const noexcept {
    const auto per = static_cast<std::size_t>(rows.key_stride() + rows.value_stride());
    for (std::size_t i = 0; i < slots_.size(); ++i) rows.load(slots_[i], rows_.data() + i * per);
  }

  /// Bytes held (saved rows and bookkeeping, by capacity).
  std::size_t heap_bytes() const {
    return pos.capacity() * sizeof(std::int64_t) +
           (score.capacity() + weight.capacity()) * sizeof(float) + alive.capacity() +
           saved_.capacity() +
           (order.capacity() + holes.capacity() + slots_.capacity()) * sizeof(Slot) +
           key_sum.heap_bytes() + channel.heap_bytes() + rows_.capacity() * sizeof(T);
  }

 private:
  static std::size_t at(Index s) { return static_cast<std::size_t>(s); }

  std::vector<std::uint8_t> saved_;  // [phys]: 1 once the slot's row needs no saving
  std::size_t unsaved_ = 0;          // slots live at the checkpoint whose rows are not saved
  std::vector<Slot> slots_;          // the slots whose rows were saved, in order
  std::vector<T> rows_;              // their key and value rows, key_stride + value_stride each
};

}  // namespace veloxquant::cache::detail
