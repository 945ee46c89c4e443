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
#include <utility>
#include <vector>

#include "detail/concentration.hpp"
#include "detail/input.hpp"
#include "detail/policy.hpp"
#include "h2o_cache.hpp"
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
  bool budget_adopted() const { return own_.adopted; }
  /// The layer's concentration (docs/design.md 5.2): the mean over its heads of concentration_score
  /// of every key it has been given since its reset, frozen once it has absorbed
  /// squeeze_calibration_tokens tokens (0.0 before the first call).
  double concentration() const { return own_.concentration; }
  /// True once the layer has absorbed squeeze_calibration_tokens tokens since its reset: its
  /// concentration is final (and reported, when it has a coordinator).
  bool calibrated() const { return own_.calibrated; }
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

  /// write_state, with the layer's own state after the base descriptor (its flags, layer id, the
  /// index of its coordinator in the container's table, report generation, concentration) and,
  /// while it calibrates, its concentration sums in every head block (docs/design.md G).
  void write_state(detail::StateWriter& w) const override {
    detail::write_descriptor(this->layer(), w);
    detail::ByteWriter& out = w.out();
    out.u8(static_cast<std::uint8_t>(
        (layer_id_ ? kHasLayerId : 0) | (own_.calibrated ? kCalibrated : 0) |
        (own_.reported ? kReported : 0) | (own_.adopted ? kAdopted : 0) |
        (own_.sums.empty() ? 0 : kHasSums)));
    out.i32(layer_id_.value_or(0));
    out.i32(w.links().link(coordinator_.get()));
    out.u64(own_.report_generation);
    out.f64(own_.concentration);
    w.end_descriptor();
    detail::write_heads(this->layer(), w, [this](detail::ByteWriter& o, std::size_t head) {
      if (own_.sums.empty()) return;
      const detail::ConcentrationSums& sums = own_.sums[head];
      o.bytes(sums.direction_sum().data(), sums.direction_sum().size() * sizeof(double));
      o.f64(sums.diagonal());
      o.i64(sums.rows());
    });
  }
  /// read_state, with the layer's own state and the rules it keeps (docs/design.md G): its
  /// coordinator is the entry of the container's table its state names.
  void read_state(detail::StateReader& r) override {
    typename KVCache<T>::SavedState s = detail::read_descriptor<T>(r);
    SavedLayer q = read_layer(r.in());
    r.end_descriptor();
    detail::check_saved_flags(s);
    check_layer_flags(q);
    q.coordinator = r.links().take(q.coordinator_index);
    check_layer_id(q);
    detail::check_descriptor(this->layer(), s, false);
    check_calibration(s, q);
    check_budget(s, q);
    SumsReader sums;
    sums.on = q.has(kHasSums);
    sums.dim = s.key_dim;
    detail::read_heads(this->layer(), r, s, sums);
    this->install(s);
    install_layer(q, sums.sums);
  }
  void link_state(detail::StateLinks& links) const override {
    (void)links.link(coordinator_.get());
  }
  SqueezeCoordinator* shared_coordinator() const override { return coordinator_.get(); }

 protected:
  /// reset(): the base's, then the layer's calibration, report and adoption, and its budget.
  void do_reset() override {
    KVCache<T>::do_reset();
    own_ = Calibration{};
    pending_ = Pending{};
    if (coordinated() && this->config().squeeze_defer) {
      this->set_budget(std::nullopt);
    } else {
      this->set_budget(fallback_budget());
    }
  }
  /// Fork: the base state, then the layer's own (its calibration, report and adoption, and its
  /// layer id) with the copy of its coordinator that `links` holds.
  void do_fork_from(const KVCache<T>& src, detail::StateLinks& links) override {
    const auto& from = static_cast<const SqueezeAttentionCache&>(src);  // a squeeze cache
    std::shared_ptr<SqueezeCoordinator> coordinator = links.counterpart(from.coordinator_.get());
    Calibration own = from.own_;
    KVCache<T>::do_fork_from(src, links);
    // No-throw from here on.
    layer_id_ = from.layer_id_;
    coordinator_.swap(coordinator);
    std::swap(own_, own);
  }
  /// Checkpoint: the base's, then a copy of the layer's own state.
  void do_take_checkpoint(std::uint64_t token) override {
    Calibration own = own_;
    KVCache<T>::do_take_checkpoint(token);
    std::swap(kept_, own);
  }
  void do_roll_back() noexcept override {
    KVCache<T>::do_roll_back();
    std::swap(own_, kept_);
  }

  void inspect_call(const detail::InputRows& keys) override {
    if (own_.calibrated) return;
    // The running sums of every (b, h) with this call's keys as stored (T) added; the
    // concentration is their mean over heads (the reference sampled head (0,0) of the first call).
    // Computed aside: start_call commits them once nothing can fail any more.
    const Index n_heads = keys.batch * keys.heads;
    pending_.sums = own_.sums.empty()
                        ? std::vector<detail::ConcentrationSums>(static_cast<std::size_t>(n_heads))
                        : own_.sums;
    std::vector<T> row(static_cast<std::size_t>(keys.dim));
    double sum = 0.0;
    for (Index b = 0; b < keys.batch; ++b) {
      for (Index h = 0; h < keys.heads; ++h) {
        detail::ConcentrationSums& sums =
            pending_.sums[static_cast<std::size_t>(b * keys.heads + h)];
        for (Index s = 0; s < keys.seq; ++s) {
          detail::read_row(keys, b, h, s, row.data());
          sums.add(keys.dim,
                   [&](Index j) { return static_cast<double>(row[static_cast<std::size_t>(j)]); });
        }
        sum += sums.score();
      }
    }
    pending_.concentration = sum / static_cast<double>(n_heads);
    if (!std::isfinite(pending_.concentration)) {
      throw std::invalid_argument(
          "SqueezeAttentionCache: the concentration of the keys is not "
          "finite");
    }
    pending_.calibrated = this->offset() + keys.seq >= this->config().squeeze_calibration_tokens;
  }

  void start_call() override {
    pending_.reported_now = false;
    if (!own_.calibrated) {
      // The report is the only step here that can throw (bad_alloc, a mutex error); it comes
      // before any change to this cache, so a throw leaves the cache as it was.
      if (pending_.calibrated && coordinated()) {
        own_.report_generation = coordinator_->report(*layer_id_, pending_.concentration);
        own_.reported = true;
        pending_.reported_now = true;
      }
      own_.sums.swap(pending_.sums);
      own_.concentration = pending_.concentration;
      own_.calibrated = pending_.calibrated;
      pending_.sums.clear();
      if (own_.calibrated) own_.sums = {};  // the running sums are done with
    }
    if (coordinated() && !own_.adopted && own_.reported) {
      if (const std::optional<int> b =
              coordinator_->resolved_budget(*layer_id_, own_.report_generation)) {
        this->set_budget(*b);
        own_.adopted = true;
      }
    }
    // A deferring cache whose call after its own report still finds no budget falls back
    // (docs/design.md 5.4.4).
    if (!this->budget() && own_.reported && !pending_.reported_now) {
      this->set_budget(fallback_budget());
    }
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
    detail::h2o_core_ranking(config, r);
    return r;
  }
  bool coordinated() const { return coordinator_ && layer_id_; }
  int fallback_budget() const {
    return this->config().squeeze_resolved_budget.value_or(this->config().squeeze_budget);
  }

  // ---- its state (write_state, read_state) ----

  enum : std::uint8_t {
    kHasLayerId = 1,
    kCalibrated = 2,
    kReported = 4,
    kAdopted = 8,
    kHasSums = 16
  };
  // The layer's own part of a saved state, read and not yet installed.
  struct SavedLayer {
    std::uint8_t flags = 0;
    std::int32_t layer_id = 0, coordinator_index = -1;
    std::uint64_t report_generation = 0;
    double concentration = 0.0;
    std::shared_ptr<SqueezeCoordinator> coordinator;
    bool has(std::uint8_t bit) const { return (flags & bit) != 0; }
    bool coordinated() const { return coordinator && has(kHasLayerId); }
  };
  // The concentration sums of each head block, read after its scores and checked after its rows.
  struct SumsReader {
    bool on = false;
    std::int64_t dim = 0;
    std::vector<double> sum;
    double diag = 0.0;
    std::int64_t rows = 0;
    std::vector<detail::ConcentrationSums> sums;
    void read(detail::ByteReader& in) {
      if (!on) return;
      in.array(sum, static_cast<std::uint64_t>(dim));
      diag = in.f64();
      rows = in.i64();
    }
    void check(const typename KVCache<T>::SavedState& s) {
      if (!on) return;
      if (rows != s.offset) {
        detail::bad_state("the concentration sums count " + std::to_string(rows) +
                          " rows, not the " + std::to_string(s.offset) + " the layer has seen");
      }
      if (!detail::all_finite(sum.data(), static_cast<Index>(sum.size())) || !std::isfinite(diag)) {
        detail::bad_state("the concentration sums are not finite");
      }
      // Sums of unit vectors (docs/design.md 5.1): no coordinate beyond the row count, and the
      // sum of squared norms in [0, rows].
      const double bound = static_cast<double>(rows) * (1.0 + 1e-9) + 1e-9;
      bool within = diag >= 0.0 && diag <= bound;
      for (const double x : sum) within = within && std::abs(x) <= bound;
      if (!within) {
        detail::bad_state("the concentration sums exceed what " + std::to_string(rows) +
                          " rows can add up to");
      }
      sums.push_back(detail::ConcentrationSums::restored(sum, diag, rows));
    }
  };

  static SavedLayer read_layer(detail::ByteReader& in) {
    SavedLayer q;
    q.flags = in.u8();
    q.layer_id = in.i32();
    q.coordinator_index = in.i32();
    q.report_generation = in.u64();
    q.concentration = in.f64();
    return q;
  }
  static void check_layer_flags(const SavedLayer& q) {
    if ((q.flags & ~(kHasLayerId | kCalibrated | kReported | kAdopted | kHasSums)) != 0) {
      detail::bad_state("unknown squeeze flags");
    }
    if (!q.has(kHasLayerId) && q.layer_id != 0) {
      detail::bad_state("no layer id but a layer id value");
    }
  }
  static void check_layer_id(const SavedLayer& q) {
    if (q.has(kHasLayerId) && q.layer_id < 0) {
      detail::bad_state("its configuration is invalid: SqueezeAttentionCache: layer_id (" +
                        std::to_string(q.layer_id) + ") must be >= 0");
    }
  }
  // Calibration, sums and the report against the offset and the coordinator.
  void check_calibration(const typename KVCache<T>::SavedState& s, const SavedLayer& q) const {
    const KVCacheConfig& cfg = this->config();
    if (!std::isfinite(q.concentration)) detail::bad_state("its concentration is not finite");
    if (!s.dims_known() &&
        (q.has(kCalibrated) || q.has(kReported) || q.has(kAdopted) || q.has(kHasSums) ||
         q.report_generation != 0 || q.concentration != 0.0)) {
      detail::bad_state("a cache that has seen no call is calibrated, has reported or holds sums");
    }
    if (s.dims_known() && q.has(kCalibrated) != (s.offset >= cfg.squeeze_calibration_tokens)) {
      detail::bad_state("calibrated is " + std::string(q.has(kCalibrated) ? "true" : "false") +
                        " at offset " + std::to_string(s.offset) +
                        " with squeeze_calibration_tokens " +
                        std::to_string(cfg.squeeze_calibration_tokens));
    }
    if (q.has(kHasSums) != (s.dims_known() && !q.has(kCalibrated))) {
      detail::bad_state("the concentration sums are there exactly while a layer calibrates");
    }
    if (q.has(kReported) != (q.has(kCalibrated) && q.coordinated())) {
      detail::bad_state("reported must be: calibrated, with a coordinator and a layer id");
    }
    if (q.has(kAdopted) && !q.has(kReported)) {
      detail::bad_state("adopted a budget without reporting");
    }
    if (!q.has(kReported) && q.report_generation != 0) {
      detail::bad_state("a report generation without a report");
    }
  }
  // The budget in force against the fallback and the coordinator's published budget.
  void check_budget(const typename KVCache<T>::SavedState& s, const SavedLayer& q) const {
    if (!s.has_budget() && !(q.coordinated() && this->config().squeeze_defer && !q.has(kAdopted))) {
      detail::bad_state("no budget, but not a deferring layer waiting for its coordinator");
    }
    if (s.has_budget() && !q.has(kAdopted) && s.budget != fallback_budget()) {
      detail::bad_state("budget " + std::to_string(s.budget) +
                        " before adoption; the fallback is " + std::to_string(fallback_budget()));
    }
    if (!q.has(kReported) || !q.coordinator) return;
    const std::uint64_t now = q.coordinator->generation();
    if (q.report_generation > now) {
      detail::bad_state("reported in generation " + std::to_string(q.report_generation) +
                        " of a coordinator at generation " + std::to_string(now));
    }
    if (q.has(kAdopted) && q.report_generation == now) {
      // Within a generation the published budgets never change.
      const std::optional<int> b = q.coordinator->resolved_budget(q.layer_id, now);
      if (!b || *b != s.budget) {
        detail::bad_state("adopted budget " + std::to_string(s.budget) +
                          " is not the one its coordinator published for layer " +
                          std::to_string(q.layer_id));
      }
    }
  }
  void install_layer(SavedLayer& q, std::vector<detail::ConcentrationSums>& sums) noexcept {
    Calibration own;
    own.concentration = q.concentration;
    own.sums.swap(sums);
    own.calibrated = q.has(kCalibrated);
    own.reported = q.has(kReported);
    own.adopted = q.has(kAdopted);
    own.report_generation = q.report_generation;
    layer_id_ = q.has(kHasLayerId) ? std::optional<int>(q.layer_id) : std::nullopt;
    coordinator_ = std::move(q.coordinator);
    std::swap(own_, own);
    pending_ = Pending{};
  }

  // What the layer keeps between calls besides the base's, as one value (fork copies it, a
  // checkpoint keeps a copy, a rollback and a load swap one in: moves that cannot throw).
  struct Calibration {
    double concentration = 0.0;
    std::vector<detail::ConcentrationSums> sums;  // per (b, h), until calibrated
    bool calibrated = false, reported = false, adopted = false;
    std::uint64_t report_generation = 0;
  };
  // What inspect_call computed for the call in progress, until start_call commits it.
  struct Pending {
    double concentration = 0.0;
    std::vector<detail::ConcentrationSums> sums;
    bool calibrated = false;
    bool reported_now = false;
  };

  std::optional<int> layer_id_;
  std::shared_ptr<SqueezeCoordinator> coordinator_;
  Calibration own_;
  Pending pending_;
  Calibration kept_;  // the layer's part of the live checkpoint (take_checkpoint)
};

}  // namespace veloxquant::cache
