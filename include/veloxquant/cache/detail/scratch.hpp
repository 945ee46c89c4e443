// veloxquant — per-worker scratch of the attention and selection kernels, sized before a call
// mutates anything (so a bad_alloc leaves the cache unchanged) and released after a long prompt.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// An uninitialised array that grows by an eighth at least (a size creeping up call by call, the
/// longest of adaptive heads, does not reallocate at every call) and gives memory back, to exactly
/// what is asked, when it holds more than twice that (a long prompt's scratch does not outlive it).
template <class X>
class Buffer {
 public:
  void fit(std::size_t n) {
    if (n > cap_ || cap_ > 2 * n + 64) {
      const std::size_t size = n > cap_ ? std::max(n, cap_ + cap_ / 8) : n;
      std::unique_ptr<X[]> fresh(size ? new X[size] : nullptr);
      data_.swap(fresh);
      cap_ = size;
    }
  }
  X* data() { return data_.get(); }
  const X* data() const { return data_.get(); }
  std::size_t capacity() const { return cap_; }
  std::size_t heap_bytes() const { return cap_ * sizeof(X); }

 private:
  std::unique_ptr<X[]> data_;
  std::size_t cap_ = 0;
};

/// A row the pooled eviction of adaptive heads may take (docs/design.md 4.9): its rank, its
/// position and where it lives (a head of the sequence, a slot of that head).
struct PoolPick {
  float rank;
  std::int32_t head;
  std::int64_t pos;
  std::int32_t slot;
};

/// Sizes of one call's scratch.
struct ScratchSize {
  Index rows = 0;       // logit rows of one product (tokens of a block x query heads per token)
  Index columns = 0;    // rows a token may attend over (retained + the call's)
  Index dim = 0;        // padded head dim
  bool gather = false;  // the call gathers its live rows into dense columns
  bool packed = false;  // the call's keys are packed as columns for the prefill logits
  Index pooled = 0;     // adaptive heads: rows one sequence's heads may give up (heads x columns)
  Index own = 0;        // KVzip's observe with the re-read's keys: its tokens S (0: none)
};

/// Scratch of one worker.
struct Scratch {
  Buffer<float> queries;       // [rows, dim] the block's query rows, float32
  Buffer<float> keys;          // [4, dim] four key rows converted to float32
  Buffer<float> logits;        // [rows, ld] the block's logits (then exp values)
  Buffer<float> weights;       // [columns] one token's attention (mean over its rows)
  Buffer<std::int32_t> slot;   // [columns] gathered column -> slot
  Buffer<float> score;         // [columns] gathered scores
  Buffer<std::int64_t> pos;    // [columns] gathered positions
  Buffer<std::uint8_t> alive;  // [columns] gathered alive flags
  Buffer<std::int32_t> picks;  // [columns] selection candidates
  Buffer<float> inv;           // [rows] each logit row's softmax normaliser (attend)
  Buffer<float> packed;        // [dim, packed ld(columns)] key columns (prefill logits)
  Buffer<PoolPick> pool;       // [pooled] candidates of a pooled eviction (adaptive heads)
  Buffer<float> own;           // [own, dim], packed [dim, 32-rounded own], [rows, ld(own)]: a
                               // re-read's keys, packed, and their logits

  /// Row stride of `logits` for `columns` columns: a multiple of 16 floats.
  static Index ld(Index columns) { return (columns + 15) / 16 * 16; }

  void fit(const ScratchSize& z) {
    const auto rows = static_cast<std::size_t>(z.rows);
    const auto cols = static_cast<std::size_t>(z.columns);
    const auto dim = static_cast<std::size_t>(z.dim);
    queries.fit(rows * dim);
    keys.fit(4 * dim);
    logits.fit(rows * static_cast<std::size_t>(ld(z.columns)));
    weights.fit(static_cast<std::size_t>(ld(z.columns)));
    const std::size_t g = z.gather ? cols : 0;
    slot.fit(g);
    score.fit(g);
    pos.fit(g);
    alive.fit(g);
    picks.fit(cols);
    inv.fit(rows);
    // packed_size(columns, dim) of simd_kernels.hpp
    packed.fit(z.packed ? dim * static_cast<std::size_t>((z.columns + 31) / 32 * 32) : 0);
    pool.fit(static_cast<std::size_t>(z.pooled));
    // (packed: packed_size(own, dim) of simd_kernels.hpp)
    const std::size_t own_tokens = static_cast<std::size_t>(z.own);
    own.fit(z.own > 0 ? own_tokens * dim + (own_tokens + 31) / 32 * 32 * dim +
                            rows * static_cast<std::size_t>(ld(z.own))
                      : 0);
  }

  std::size_t heap_bytes() const {
    return queries.heap_bytes() + keys.heap_bytes() + logits.heap_bytes() + weights.heap_bytes() +
           slot.heap_bytes() + score.heap_bytes() + pos.heap_bytes() + alive.heap_bytes() +
           picks.heap_bytes() + inv.heap_bytes() + packed.heap_bytes() + pool.heap_bytes() +
           own.heap_bytes();
  }
};

}  // namespace veloxquant::cache::detail
