// veloxquant — SqueezeAttentionCache<T>: H2O cumulative attention-mass eviction with a data-driven
// per-layer budget decided once at the prefill boundary by a shared SqueezeCoordinator.
//
// After "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via Layer-wise Optimal
// Budget" (Wang et al., 2024, arXiv:2404.04793), as adapted by veloxquant_mlx. Adaptation limits,
// stated once here:
//   * Without the engine's queries, eviction scores come from a query-free scorer chosen by
//     `proxy_scoring`: the key-as-query proxy by default (docs/design.md 3), or keydiff or knorm
//     (docs/design.md 4.7). An engine that passes its queries (update_and_fetch(keys, values,
//     queries)) gets real-query scoring instead, whatever `proxy_scoring` says
//     (docs/design.md 4.6).
//   * A layer's concentration is the mean pairwise cosine similarity of its first
//     squeeze_calibration_tokens keys (all of the call that reaches that count; docs/design.md
//     5.2), a proxy for the attention entropy the paper measures on real attention maps.
//   * The per-layer budget is decided once, when every layer has calibrated (the prefill
//     boundary for prompts of at least squeeze_calibration_tokens tokens), and then frozen.
//   * No RoPE position re-mapping after eviction; the engine rotates with offset().
//   * One budget for all heads of a layer.
// Deliberate differences from the Python reference are listed in docs/design.md 9.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "detail/concentration.hpp"
#include "detail/input.hpp"
#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "squeeze_coordinator.hpp"
#include "tensor.hpp"

namespace veloxquant::cache {

/// Mean pairwise cosine similarity of the rows (diagonal excluded), in O(n D), accumulated in
/// double; 0.0 when n < 2. rows: [n, D], any scalar type.
template <class Derived>
double concentration_score(const Eigen::MatrixBase<Derived>& rows) {
  return detail::concentration_score(rows);
}

/// One layer of SqueezeAttention-adapted eviction (docs/design.md 5): the H2O core whose budget
/// the shared coordinator decides from every layer's concentration.
template <class T = Eigen::half>
class SqueezeAttentionCache : public KVCache<T> {
 public:
  using Index = Eigen::Index;

  /// Validates `config` (as method "squeeze") and a negative layer id; throws
  /// std::invalid_argument. Without a coordinator or a layer id the cache is a uniform-budget H2O
  /// layer at squeeze_resolved_budget (or squeeze_budget).
  explicit SqueezeAttentionCache(const KVCacheConfig& config,
                                 std::optional<int> layer_id = std::nullopt,
                                 std::shared_ptr<SqueezeCoordinator> coordinator = nullptr)
      : KVCache<T>(rule_of(config, layer_id, coordinator), config, detail::Method::squeeze),
        layer_id_(layer_id),
        coordinator_(std::move(coordinator)) {}

  /// This layer's budget: the resolved one once adopted, else the fallback
  /// (squeeze_resolved_budget or squeeze_budget).
  int layer_budget() const override {
    const std::optional<int> b = this->budget();
    return b ? *b : fallback_budget();
  }
  /// True once the coordinator's budget has been adopted.
  bool budget_adopted() const { return adopted_; }
  /// The layer's concentration (docs/design.md 5.2): the mean over its heads of concentration_score
  /// of every key it has been given since its reset, frozen once it has absorbed
  /// squeeze_calibration_tokens tokens (0.0 before the first call).
  double concentration() const { return concentration_; }
  /// True once the layer has absorbed squeeze_calibration_tokens tokens since its reset: its
  /// concentration is final (and reported, when it has a coordinator).
  bool calibrated() const { return calibrated_; }
  /// Same as kept_bytes() (the reference's name).
  std::size_t squeeze_kept_bytes() const { return this->kept_bytes(); }
  /// The shared coordinator, or nullptr.
  std::shared_ptr<SqueezeCoordinator> coordinator() const { return coordinator_; }
  /// The layer id reported to the coordinator, if any.
  std::optional<int> layer_id() const { return layer_id_; }

  using KVCache<T>::budget;
  using KVCache<T>::n_sink;
  using KVCache<T>::protected_recent;
  using KVCache<T>::decay;

  void reset() override {
    KVCache<T>::reset();
    concentration_ = 0.0;
    pending_concentration_ = 0.0;
    sums_.clear();
    pending_sums_.clear();
    calibrated_ = false;
    reported_ = false;
    reported_now_ = false;
    adopted_ = false;
    report_generation_ = 0;
    if (coordinated() && this->config().squeeze_defer) {
      this->set_budget(std::nullopt);
    } else {
      this->set_budget(fallback_budget());
    }
  }

 protected:
  void inspect_call(const detail::InputRows& keys) override {
    if (calibrated_) return;
    // The running sums of every (b, h) with this call's keys as stored (T) added; the
    // concentration is their mean over heads (the reference sampled head (0,0) of the first call).
    // Computed aside: start_call commits them once nothing can fail any more.
    const Index n_heads = keys.batch * keys.heads;
    pending_sums_ = sums_.empty()
                        ? std::vector<detail::ConcentrationSums>(static_cast<std::size_t>(n_heads))
                        : sums_;
    std::vector<T> row(static_cast<std::size_t>(keys.dim));
    double sum = 0.0;
    for (Index b = 0; b < keys.batch; ++b) {
      for (Index h = 0; h < keys.heads; ++h) {
        detail::ConcentrationSums& sums =
            pending_sums_[static_cast<std::size_t>(b * keys.heads + h)];
        for (Index s = 0; s < keys.seq; ++s) {
          detail::read_row(keys, b, h, s, row.data());
          sums.add(keys.dim,
                   [&](Index j) { return static_cast<double>(row[static_cast<std::size_t>(j)]); });
        }
        sum += sums.score();
      }
    }
    pending_concentration_ = sum / static_cast<double>(n_heads);
    if (!std::isfinite(pending_concentration_)) {
      throw std::invalid_argument(
          "SqueezeAttentionCache: the concentration of the keys is not "
          "finite");
    }
    pending_calibrated_ = this->offset() + keys.seq >= this->config().squeeze_calibration_tokens;
  }

  void start_call() override {
    reported_now_ = false;
    if (!calibrated_) {
      // The report is the only step here that can throw (bad_alloc, a mutex error); it comes
      // before any change to this cache, so a throw leaves the cache as it was.
      if (pending_calibrated_ && coordinated()) {
        report_generation_ = coordinator_->report(*layer_id_, pending_concentration_);
        reported_ = true;
        reported_now_ = true;
      }
      sums_.swap(pending_sums_);
      concentration_ = pending_concentration_;
      calibrated_ = pending_calibrated_;
      pending_sums_.clear();
      if (calibrated_) sums_ = {};  // the running sums are done with
    }
    if (coordinated() && !adopted_ && reported_) {
      if (const std::optional<int> b =
              coordinator_->resolved_budget(*layer_id_, report_generation_)) {
        this->set_budget(*b);
        adopted_ = true;
      }
    }
    // A deferring cache whose call after its own report still finds no budget falls back
    // (docs/design.md 5.4.4).
    if (!this->budget() && reported_ && !reported_now_) this->set_budget(fallback_budget());
  }

 private:
  static detail::Rule rule_of(const KVCacheConfig& config, std::optional<int> layer_id,
                              const std::shared_ptr<SqueezeCoordinator>& coordinator) {
    detail::validate_as(config, detail::Method::squeeze);
    if (layer_id && *layer_id < 0) {
      throw std::invalid_argument("SqueezeAttentionCache: layer_id (" + std::to_string(*layer_id) +
                                  ") must be >= 0");
    }
    detail::Rule r;
    r.kind = detail::RuleKind::cumulative;
    if (!(layer_id && coordinator && config.squeeze_defer)) {
      r.budget = config.squeeze_resolved_budget.value_or(config.squeeze_budget);
    }
    r.n_sink = config.squeeze_n_sink;
    r.recent_ratio = config.squeeze_recent_ratio;
    r.decay = static_cast<float>(config.squeeze_decay);
    r.proxy = detail::proxy_scoring_of(config.proxy_scoring);
    r.value_power = config.value_norm_power;
    return r;
  }
  bool coordinated() const { return coordinator_ && layer_id_; }
  int fallback_budget() const {
    return this->config().squeeze_resolved_budget.value_or(this->config().squeeze_budget);
  }

  friend class detail::PromptCacheIO<T>;

  std::optional<int> layer_id_;
  std::shared_ptr<SqueezeCoordinator> coordinator_;
  double concentration_ = 0.0;
  double pending_concentration_ = 0.0;
  std::vector<detail::ConcentrationSums> sums_;          // per (b, h), until calibrated
  std::vector<detail::ConcentrationSums> pending_sums_;  // this call's, until start_call
  bool pending_calibrated_ = false;
  bool calibrated_ = false;
  bool reported_ = false;
  bool reported_now_ = false;  // in the call in progress
  bool adopted_ = false;
  std::uint64_t report_generation_ = 0;
};

}  // namespace veloxquant::cache
