// veloxquant — ScoredCache<T>: the base of every policy that scores rows (H2O core, TOVA, SnapKV).
// It owns the per-worker kernel scratch and the score/position diagnostics, so a policy class only
// says how its rows are absorbed and evicted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kv_cache.hpp"
#include "head_store.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

/// A KVCache whose policy keeps a float32 score per row and uses the scoring kernels.
template <class T>
class ScoredCache : public KVCache<T> {
 public:
  using Index = Eigen::Index;

  /// Not trimmable: per-row scores and evictions cannot be rolled back.
  bool is_trimmable() const override { return false; }

  /// Scores of head (b, h)'s retained rows, ascending position: [n] (empty before the first call).
  std::vector<float> scores(Index b, Index h) const {
    std::vector<float> out;
    if (this->head_stores().empty()) return out;
    const auto& head = head_at(b, h);
    out.reserve(head.order().size());
    for (const Slot s : head.order()) out.push_back(head.score(s));
    return out;
  }
  /// Positions of head (b, h)'s retained rows, ascending: [n] (empty before the first call).
  std::vector<std::int64_t> positions(Index b, Index h) const {
    std::vector<std::int64_t> out;
    if (this->head_stores().empty()) return out;
    const auto& head = head_at(b, h);
    out.reserve(head.order().size());
    for (const Slot s : head.order()) out.push_back(head.position(s));
    return out;
  }

  /// Heap bytes held, including the per-worker scratch.
  std::size_t heap_bytes() const override {
    std::size_t total = KVCache<T>::heap_bytes() + scratch_.capacity() * sizeof(KernelScratch);
    for (const auto& s : scratch_) total += s.heap_bytes();
    return total;
  }

 protected:
  /// New tokens per matrix product in blocked absorption, and rows per half->float chunk in decode.
  static constexpr Index kBlock = 64;
  static constexpr Index kDecodeChunk = 64;

  ScoredCache() = default;

  void reserve_scratch(Index rows, Index key_dim, Index new_rows, int workers,
                       Index groups) override {
    if (scratch_.size() < static_cast<std::size_t>(workers)) {
      scratch_.resize(static_cast<std::size_t>(workers));
    }
    const Index lhs_rows = std::min(block_tokens(groups), new_rows) * std::max<Index>(groups, 1);
    for (auto& s : scratch_) s.reserve(rows, key_dim, new_rows, lhs_rows, kDecodeChunk, groups);
  }
  /// Tokens of a call scored per matrix product with `groups` query heads per token (0: the
  /// key-as-query proxy): about kBlock rows of logits per product. Sizes the logits scratch.
  virtual Index block_tokens(Index groups) const {
    return groups > 0 ? std::max<Index>(1, kBlock / groups) : kBlock;
  }
  /// Worker `w`'s scratch (valid once a call has reserved it).
  KernelScratch& scratch(int w) { return scratch_[static_cast<std::size_t>(w)]; }
  /// True once a call has reserved scratch (so rows may exist).
  bool has_scratch() const { return !scratch_.empty(); }

 private:
  // Head (b, h); std::out_of_range outside [0, B) x [0, H).
  const HeadStore<T>& head_at(Index b, Index h) const {
    if (b < 0 || b >= this->batch() || h < 0 || h >= this->heads()) {
      throw std::out_of_range("scores/positions: head (" + std::to_string(b) + ", " +
                              std::to_string(h) + ") out of range");
    }
    return this->head_stores()[static_cast<std::size_t>(b * this->heads() + h)];
  }

  std::vector<KernelScratch> scratch_;  // one per worker
};

}  // namespace veloxquant::cache::detail
