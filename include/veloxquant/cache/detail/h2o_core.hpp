// veloxquant — H2OCore<T>: the one eviction loop shared by SqueezeAttention, H2O and PyramidKV.
// A policy derived from it differs only in how its budget is decided (docs/design.md 4, 5, 6).
#pragma once

#include <limits>
#include <optional>
#include <string>

#include "../kv_cache.hpp"
#include "../kv_cache_config.hpp"
#include "h2o_kernels.hpp"
#include "scored_cache.hpp"

namespace veloxquant::cache::detail {

/// Validates `config` as if `method` were in use (a cache class knows its own method).
inline void validate_as(const KVCacheConfig& config, const char* method) {
  KVCacheConfig c = config;
  c.method = method;
  c.validate();
}

/// Cumulative attention-mass eviction with sinks, a protected recent window and score decay.
template <class T>
class H2OCore : public ScoredCache<T> {
 public:
  using Index = Eigen::Index;

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

 protected:
  H2OCore(int n_sink, double decay, GracePolicy grace, std::optional<int> budget)
      : n_sink_(n_sink), decay_(static_cast<float>(decay)), grace_(grace), budget_(budget) {}

  /// Makes `budget` the budget in force and re-budgets every head to it (docs/design.md 4.5).
  /// Call only after the call's scratch is reserved (from prepare_call).
  void set_budget(int budget) noexcept {
    budget_ = budget;
    const int g = grace_.protected_recent(budget, n_sink_);
    if (!this->has_scratch()) return;  // no call yet: no rows to re-budget
    for (auto& head : this->head_stores()) rebudget(head, budget, n_sink_, g, this->scratch(0));
  }
  /// Forgets the budget (back to "unknown"), e.g. on reset of a deferring cache.
  void clear_budget() noexcept { budget_.reset(); }

  void absorb_rows(HeadStore<T>& head, Slot first, Index count, int worker,
                   const QuerySlice& queries) override {
    const int g = protected_recent();
    KernelScratch& scratch = this->scratch(worker);
    if (count == 1 && absorb_decode(head, first, budget_, n_sink_, g, decay_, scratch,
                                    this->kDecodeChunk, queries)) {
      return;
    }
    if (count == 1 && !queries) {
      absorb_token(head, first, budget_, n_sink_, g, decay_, scratch);
      return;
    }
    absorb_blocked(head, first, count, budget_, n_sink_, g, decay_, scratch,
                   this->block_tokens(queries.groups), queries);
  }
  Index steady_rows() const override {
    return budget_ ? static_cast<Index>(*budget_) + 1 : std::numeric_limits<Index>::max();
  }

 private:
  int n_sink_;
  float decay_;
  GracePolicy grace_;
  std::optional<int> budget_;
};

}  // namespace veloxquant::cache::detail
