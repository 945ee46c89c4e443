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

 protected:
  H2OCore(int n_sink, double decay, GracePolicy grace, std::optional<int> budget)
      : n_sink_(n_sink), decay_(static_cast<float>(decay)), grace_(grace), budget_(budget) {}

  /// Makes `budget` the budget in force and re-budgets every head to it (SPEC 4.5).
  /// Call only after the call's scratch is reserved (from prepare_call).
  void set_budget(int budget) noexcept {
    budget_ = budget;
    const int g = grace_.protected_recent(budget, n_sink_);
    for (auto& head : this->head_stores()) rebudget(head, budget, n_sink_, g, scratch_);
  }
  /// Forgets the budget (back to "unknown"), e.g. on reset of a deferring cache.
  void clear_budget() noexcept { budget_.reset(); }

  void absorb_rows(HeadStore<T>& head, Slot first, Index count) override {
    const int g = protected_recent();
    for (Index i = 0; i < count; ++i) {
      absorb_token(head, static_cast<Slot>(first + i), budget_, n_sink_, g, decay_, scratch_);
    }
  }
  void reserve_scratch(Index rows, Index key_dim) override { scratch_.reserve(rows, key_dim); }
  Index steady_rows() const override {
    return budget_ ? static_cast<Index>(*budget_) + 1 : std::numeric_limits<Index>::max();
  }

 private:
  int n_sink_;
  float decay_;
  GracePolicy grace_;
  std::optional<int> budget_;
  H2OScratch scratch_;
};

}  // namespace veloxquant::cache::detail
