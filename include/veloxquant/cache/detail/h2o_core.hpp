// veloxquant — H2OCore<T>: the one eviction loop shared by SqueezeAttention, H2O and PyramidKV.
// A policy derived from it differs only in how its budget is decided (SPEC 4, 5, 6).
#pragma once

#include <limits>
#include <optional>
#include <string>

#include "../kv_cache.hpp"
#include "../kv_cache_config.hpp"
#include "h2o_kernels.hpp"

namespace veloxquant::cache::detail {

/// Validates `config` as if `method` were in use (a cache class knows its own method).
inline void validate_as(const KVCacheConfig& config, const char* method) {
  KVCacheConfig c = config;
  c.method = method;
  c.validate();
}

/// Cumulative attention-mass eviction with sinks, a protected recent window and score decay.
template <class T>
class H2OCore : public KVCache<T> {
 public:
  using Index = Eigen::Index;

  /// Not trimmable: per-row scores cannot be rolled back.
  bool is_trimmable() const override { return false; }

  /// The budget in force, or empty while it is unknown (deferred squeeze before adoption).
  std::optional<int> budget() const { return budget_; }
  /// Leading positions never evicted.
  int n_sink() const { return n_sink_; }
  /// Newest rows never evicted under the current budget (0 while the budget is unknown).
  int protected_recent() const {
    return budget_ ? grace_.protected_recent(*budget_, n_sink_) : 0;
  }
  /// Per-token decay of cumulative scores.
  float decay() const { return decay_; }

  /// Scores of head (b, h)'s retained rows, ascending position: [n] (empty before the first call).
  std::vector<float> scores(Index b, Index h) const {
    if (this->head_stores().empty()) return {};
    const auto& head = this->head_stores().at(static_cast<std::size_t>(b * this->heads() + h));
    std::vector<float> out;
    out.reserve(head.order().size());
    for (const Slot s : head.order()) out.push_back(head.score(s));
    return out;
  }
  /// Positions of head (b, h)'s retained rows, ascending: [n].
  std::vector<std::int64_t> positions(Index b, Index h) const {
    if (this->head_stores().empty()) return {};
    const auto& head = this->head_stores().at(static_cast<std::size_t>(b * this->heads() + h));
    std::vector<std::int64_t> out;
    out.reserve(head.order().size());
    for (const Slot s : head.order()) out.push_back(head.position(s));
    return out;
  }

  /// Heap bytes held, including the per-worker scratch.
  std::size_t heap_bytes() const override {
    std::size_t total = KVCache<T>::heap_bytes() + scratch_.capacity() * sizeof(H2OScratch);
    for (const auto& s : scratch_) total += s.heap_bytes();
    return total;
  }

 protected:
  H2OCore(int n_sink, double decay, GracePolicy grace, std::optional<int> budget)
      : n_sink_(n_sink), decay_(static_cast<float>(decay)), grace_(grace), budget_(budget) {}

  /// Makes `budget` the budget in force and re-budgets every head to it (SPEC 4.5).
  /// Call only after the call's scratch is reserved (from prepare_call).
  void set_budget(int budget) noexcept {
    budget_ = budget;
    const int g = grace_.protected_recent(budget, n_sink_);
    if (scratch_.empty()) return;  // no call yet: no rows to re-budget
    for (auto& head : this->head_stores()) rebudget(head, budget, n_sink_, g, scratch_.front());
  }
  /// Forgets the budget (back to "unknown"), e.g. on reset of a deferring cache.
  void clear_budget() noexcept { budget_.reset(); }

  void absorb_rows(HeadStore<T>& head, Slot first, Index count, int worker) override {
    const int g = protected_recent();
    H2OScratch& scratch = scratch_[static_cast<std::size_t>(worker)];
    if (count == 1 &&
        absorb_decode(head, first, budget_, n_sink_, g, decay_, scratch, kDecodeChunk)) {
      return;
    }
    if (count == 1) {
      absorb_token(head, first, budget_, n_sink_, g, decay_, scratch);
      return;
    }
    absorb_blocked(head, first, count, budget_, n_sink_, g, decay_, scratch, kBlock);
  }
  void reserve_scratch(Index rows, Index key_dim, Index new_rows, int workers) override {
    if (scratch_.size() < static_cast<std::size_t>(workers)) {
      scratch_.resize(static_cast<std::size_t>(workers));
    }
    for (auto& s : scratch_) s.reserve(rows, key_dim, new_rows, kBlock, kDecodeChunk);
  }
  Index steady_rows() const override {
    return budget_ ? static_cast<Index>(*budget_) + 1 : std::numeric_limits<Index>::max();
  }

 private:
  int n_sink_;
  float decay_;
  GracePolicy grace_;
  std::optional<int> budget_;
  // New tokens per matrix product in blocked absorption, and rows per half->float chunk in decode.
  static constexpr Index kBlock = 64;
  static constexpr Index kDecodeChunk = 64;

  std::vector<H2OScratch> scratch_;  // one per worker
};

}  // namespace veloxquant::cache::detail
