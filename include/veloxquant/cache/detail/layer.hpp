// veloxquant — what one layer's cache holds (docs/design.md 7.1): its state between calls as one
// value (LayerState, which fork, checkpoint, rollback and a load copy whole), its heads of rows,
// the scratch of its workers and the buffers rows leave through. KVCache<T> is the interface over
// a Layer<T>; the call pipeline that changes it is in call_pipeline.hpp, its saved form in
// format/layer_io.hpp.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "assert.hpp"
#include "checks.hpp"
#include "head_store.hpp"
#include "layer_storage.hpp"
#include "rule.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

/// Everything a layer keeps between calls outside its heads, as one value: a fork copies it, a
/// checkpoint keeps a copy, a rollback and a load assign one (docs/design.md 10).
struct LayerState {
  LayerDims dims{};              ///< B, H, Dk, Dv, fixed by the first call with rows
  std::int64_t offset = 0;       ///< the position the next token takes
  std::int64_t tokens_seen = 0;  ///< B·H·S summed over calls since the reset
  Rule rule{};                   ///< the policy and the budget in force
  bool rebudget = false;         ///< the budget changed: the next call brings the heads within it
};

/// How rows are stored: widths of keys and values (16: as T), the group of token-axis rows, and
/// for each tensor whether it is quantized along channels, in blocks of `block` positions.
struct RowStorage {
  int key_bits = 16, value_bits = 16, group = 32;
  bool key_channel = false, value_channel = false;
  int block = 32;
  bool quantized() const { return key_bits < 16 || value_bits < 16; }
  RowFormat key_format(Index dk) const {
    return RowFormat{key_bits, dk, group, key_bits < 16 && key_channel, block};
  }
  RowFormat value_format(Index dv) const {
    return RowFormat{value_bits, dv, group, value_bits < 16 && value_channel, block};
  }
  /// A tensor quantized along tokens (its head dim must be a multiple of the group).
  bool key_token_axis() const { return key_bits < 16 && !key_channel; }
  bool value_token_axis() const { return value_bits < 16 && !value_channel; }
};

/// The engine's parallel-for a layer's calls may spread their heads over (docs/design.md 7.3).
struct Threads {
  std::function<void(int, const std::function<void(int)>&)> run;  ///< ParallelFor
  int workers = 1;
  bool on = true;  ///< set_parallel_heads
  void swap(Threads& o) noexcept {
    run.swap(o.run);
    std::swap(workers, o.workers);
    std::swap(on, o.on);
  }
};

/// One layer's cache: its state, its B·H heads (b-major), the scratch of each worker, the
/// buffers of a quantized cache's view and its live checkpoint. Owned by KVCache<T>, which alone
/// changes it.
template <class T>
struct Layer {
  LayerState state;
  std::vector<HeadStore<T>> heads;
  std::vector<Scratch> scratch;
  RowStorage storage;
  CopyBuffers<T> copy;  ///< a quantized cache's view, and the row quantized rows leave through
  Threads threads;
  /// The live checkpoint's part outside the heads (which keep their own): the state, whole.
  struct Mark {
    bool live = false;
    std::uint64_t token = 0;
    std::size_t heads = 0;
    LayerState state{};
  };
  Mark mark;

  /// Rows each head holds (heads of their own sizes: the most any holds); 0 before the first
  /// call. A layer loaded from a prompt cache with no rows holds no head objects until a call
  /// brings rows (their number is B·H, which only the call's tensors make real; docs/design.md G).
  Index live_rows() const {
    if (heads.empty()) return 0;
    if (!state.rule.per_head_rows()) return heads.front().live();
    Index n = 0;
    for (const auto& h : heads) n = std::max(n, h.live());
    return n;
  }
  /// Whether the heads hold different numbers of rows (adaptive heads and compressed KVzip ones
  /// can).
  bool ragged() const {
    if (!state.rule.per_head_rows()) return false;
    for (const auto& h : heads) {
      if (h.live() != heads.front().live()) return true;
    }
    return false;
  }
  /// The most slots in use in any head (the window's longest head after a call).
  Index max_physical() const {
    Index n = 0;
    for (const auto& h : heads) n = std::max(n, h.physical());
    return n;
  }
  /// Index of head (b, h); std::out_of_range outside [0, B) x [0, H).
  std::size_t head_index(Index b, Index h) const {
    if (b < 0 || b >= state.dims.batch || h < 0 || h >= state.dims.heads) {
      throw std::out_of_range("scores/positions: head (" + std::to_string(b) + ", " +
                              std::to_string(h) + ") out of range");
    }
    return static_cast<std::size_t>(b * state.dims.heads + h);
  }
  /// Head (b, h), or nullptr when the layer holds no head objects (before the first call, or a
  /// loaded layer of no rows); std::out_of_range outside [0, B) x [0, H) once the dims are known.
  const HeadStore<T>* head_at(Index b, Index h) const {
    if (heads.empty()) {
      if (state.dims.known) (void)head_index(b, h);
      return nullptr;
    }
    return &heads[head_index(b, h)];
  }
  /// Bytes of the retained rows as stored.
  std::size_t kept_bytes() const {
    std::size_t bytes = 0;
    for (const auto& h : heads) bytes += h.held_bytes();
    return bytes;
  }
  /// Heap bytes held now, by capacity.
  std::size_t heap_bytes() const {
    std::size_t total = heads.capacity() * sizeof(HeadStore<T>) +
                        scratch.capacity() * sizeof(Scratch) + copy.heap_bytes();
    for (const auto& h : heads) total += h.heap_bytes();
    for (const auto& s : scratch) total += s.heap_bytes();
    return total;
  }
  /// Forgets every row, counter and the checkpoint (the rule keeps its parameters; its budget is
  /// the class's).
  void clear() {
    mark.live = false;  // the heads go with theirs
    heads.clear();
    state.dims = LayerDims{};
    state.offset = 0;
    state.tokens_seen = 0;
    state.rule.compressed = false;
    state.rule.observed = false;
    copy.release_view();
  }

  // ---- a set's operations (docs/design.md 10) -------------------------------------------------

  /// Fork: becomes an independent copy of `src`: its retained rows (compacted), positions,
  /// scores, state and the engine's parallel-for. Only allocates before it changes this layer.
  void fork_from(const Layer& src) {
    std::vector<HeadStore<T>> forked;
    forked.reserve(src.heads.size());
    for (const auto& h : src.heads) forked.push_back(h.forked());
    std::vector<float> row;
    if (src.storage.quantized() && src.state.dims.known && src.live_rows() > 0) {
      const LayerDims& d = src.state.dims;
      row.assign(static_cast<std::size_t>(row_floats(d.key_dim, d.value_dim)), 0.0f);
    }
    Threads t = src.threads;
    // No-throw from here on.
    heads.swap(forked);
    state = src.state;
    if (!row.empty()) copy.install_row(row);
    threads.swap(t);
  }
  /// Checkpoint under `token`, replacing a live one: the heads copy their bookkeeping and journal
  /// the rows later calls overwrite. Allocates only; if it throws, the layer holds no checkpoint
  /// and its state is unchanged.
  void checkpoint(std::uint64_t token) {
    mark.live = false;
    try {
      for (auto& h : heads) h.checkpoint();
    } catch (...) {
      for (auto& h : heads) h.drop_checkpoint();
      throw;
    }
    mark = Mark{true, token, heads.size(), state};
  }
  /// Back to the live checkpoint, which it consumes; never throws (the heads kept the room).
  void roll_back() noexcept {
    VELOXQUANT_ASSERT(mark.live, "roll_back without a checkpoint");
    if (mark.heads == 0) {
      heads.clear();  // the checkpoint came before the first call (or a load of no rows)
    } else {
      for (auto& h : heads) h.rollback();
    }
    state = mark.state;
    mark.live = false;
  }
  void drop_checkpoint() noexcept {
    mark.live = false;
    for (auto& h : heads) h.drop_checkpoint();
  }
};

}  // namespace veloxquant::cache::detail
