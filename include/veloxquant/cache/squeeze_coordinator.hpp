// veloxquant — SqueezeCoordinator: collects every attention layer's concentration at the prefill
// boundary and publishes the per-layer budgets once (docs/design.md 5.3, 5.4). Thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "detail/budgets.hpp"
#include "detail/format/byte_io.hpp"
#include "detail/format/state_io.hpp"

namespace veloxquant::cache {

/// Per-layer budgets from concentrations (docs/design.md 5.3): broad (low-concentration) layers get
/// more, the mean stays at `avg_budget` (each budget at least n_sink + 1). Throws for strength
/// outside [0, 1] or NaN.
inline std::vector<int> squeeze_budgets(const std::vector<double>& concentrations, int avg_budget,
                                        int n_sink, double strength = 1.0) {
  return detail::squeeze_budgets(concentrations, avg_budget, n_sink, strength);
}

/// Shared by all attention layers of one model: the first report per layer wins; when n_layers
/// distinct layers have reported, squeeze_budgets over them (ascending layer id) is published.
/// Every method is thread-safe.
class SqueezeCoordinator {
 public:
  /// Throws std::invalid_argument unless n_layers >= 1, n_sink >= 0, avg_budget >= n_sink + 1 and
  /// strength is in [0, 1].
  SqueezeCoordinator(int n_layers, int avg_budget, int n_sink, double strength)
      : n_layers_(n_layers), avg_budget_(avg_budget), n_sink_(n_sink), strength_(strength) {
    std::ostringstream os;
    if (n_layers < 1) {
      os << "SqueezeCoordinator: n_layers (" << n_layers << ") must be >= 1";
    } else if (n_sink < 0) {
      os << "SqueezeCoordinator: n_sink (" << n_sink << ") must be >= 0";
    } else if (avg_budget <= n_sink) {  // avg_budget >= n_sink + 1, without the sum
      os << "SqueezeCoordinator: avg_budget (" << avg_budget << ") must be >= n_sink + 1 ("
         << static_cast<long long>(n_sink) + 1 << ")";
    } else if (!(strength >= 0.0 && strength <= 1.0)) {
      os << "SqueezeCoordinator: strength (" << strength << ") must be in [0, 1]";
    }
    if (!os.str().empty()) throw std::invalid_argument(os.str());
  }

  SqueezeCoordinator(const SqueezeCoordinator&) = delete;
  SqueezeCoordinator& operator=(const SqueezeCoordinator&) = delete;

  /// Records layer `layer_id`'s concentration (first report per layer wins; reports after
  /// finalisation are ignored). Throws std::invalid_argument for a negative layer id or a
  /// non-finite concentration, recording nothing.
  void report_concentration(int layer_id, double c) { (void)report(layer_id, c); }

  /// report_concentration that also returns the generation the report was made in.
  std::uint64_t report(int layer_id, double c) {
    if (layer_id < 0) {
      throw std::invalid_argument("SqueezeCoordinator: layer_id (" + std::to_string(layer_id) +
                                  ") must be >= 0");
    }
    if (!std::isfinite(c)) {
      std::ostringstream os;
      os << "SqueezeCoordinator: concentration (" << c << ") of layer " << layer_id
         << " must be finite";
      throw std::invalid_argument(os.str());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finalized_ && reports_.emplace(layer_id, c).second &&
        static_cast<int>(reports_.size()) == n_layers_) {
      std::vector<double> cs;
      cs.reserve(reports_.size());
      for (const auto& kv : reports_) cs.push_back(kv.second);  // ascending layer id
      const std::vector<int> b = detail::squeeze_budgets(cs, avg_budget_, n_sink_, strength_);
      std::size_t i = 0;
      for (const auto& kv : reports_) budgets_[kv.first] = b[i++];
      finalized_ = true;
    }
    return generation_;
  }

  /// The published budget of `layer_id`, or empty before finalisation / for an unknown layer.
  std::optional<int> resolved_budget(int layer_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lookup(layer_id);
  }

  /// resolved_budget, but only if the coordinator is still in `generation`.
  std::optional<int> resolved_budget(int layer_id, std::uint64_t generation) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (generation != generation_) return std::nullopt;
    return lookup(layer_id);
  }

  /// True once every layer has reported and the budgets are published.
  bool is_finalized() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return finalized_;
  }

  /// Forgets every report and budget and starts a new generation.
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.live = false;  // a reset drops the checkpoint
    reports_.clear();
    budgets_.clear();
    finalized_ = false;
    ++generation_;
  }

  /// Concentrations reported so far, by ascending layer id.
  std::map<int, double> reports() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reports_;
  }

  int n_layers() const { return n_layers_; }
  int avg_budget() const { return avg_budget_; }
  int n_sink() const { return n_sink_; }
  double strength() const { return strength_; }
  /// Incremented by every reset().
  std::uint64_t generation() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return generation_;
  }

  /// A coordinator's state as a prompt cache saves it (docs/design.md G): its parameters, its
  /// generation and that generation's reports (ascending layer id).
  struct SavedState {
    int n_layers = 0, avg_budget = 0, n_sink = 0;
    double strength = 0.0;
    std::uint64_t generation = 0;
    std::vector<std::pair<int, double>> reports;
  };
  /// Its state now (taken under its lock).
  SavedState saved_state() const {
    SavedState s{n_layers_, avg_budget_, n_sink_, strength_, 0, {}};
    std::lock_guard<std::mutex> lock(mutex_);
    s.generation = generation_;
    s.reports.assign(reports_.begin(), reports_.end());
    return s;
  }
  /// Writes its state now to a prompt cache (docs/design.md G): parameters, generation, then the
  /// reports, each charged to the loader's memory bound.
  void write_state(detail::ByteWriter& w) const {
    const SavedState s = saved_state();
    w.charge(detail::kChargeCoordinator, "the coordinators");
    w.i32(s.n_layers);
    w.i32(s.avg_budget);
    w.i32(s.n_sink);
    w.f64(s.strength);
    w.u64(s.generation);
    w.u32(static_cast<std::uint32_t>(s.reports.size()));
    for (const auto& [layer, c] : s.reports) {
      w.i32(layer);
      w.f64(c);
      w.charge(detail::kChargeReport, "the coordinators' reports");
    }
  }
  /// Reads what write_state wrote; from_saved_state checks it.
  static SavedState read_state(detail::ByteReader& r) {
    r.charge(detail::kChargeCoordinator, "the coordinators");
    SavedState s;
    s.n_layers = r.i32();
    s.avg_budget = r.i32();
    s.n_sink = r.i32();
    s.strength = r.f64();
    s.generation = r.u64();
    const std::uint32_t reports = r.u32();
    for (std::uint32_t k = 0; k < reports; ++k) {
      const std::int32_t layer = r.i32();
      const double c = r.f64();
      r.charge(detail::kChargeReport, "the coordinators' reports");
      s.reports.emplace_back(layer, c);
    }
    return s;
  }
  /// A coordinator in state `s`: finalised exactly when every layer has reported, with the
  /// budgets the reports give (docs/design.md 5.3, 5.4 step 2). Throws std::invalid_argument
  /// naming the problem for parameters the constructor refuses, more reports than layers, report
  /// layer ids that are negative, out of order or repeated, or a concentration that is not finite.
  static std::shared_ptr<SqueezeCoordinator> from_saved_state(const SavedState& s) {
    auto co = std::make_shared<SqueezeCoordinator>(s.n_layers, s.avg_budget, s.n_sink, s.strength);
    if (s.reports.size() > static_cast<std::size_t>(s.n_layers)) {
      throw std::invalid_argument(std::to_string(s.reports.size()) + " reports for " +
                                  std::to_string(s.n_layers) + " layers");
    }
    std::vector<double> concentrations;
    for (std::size_t i = 0; i < s.reports.size(); ++i) {
      const auto [layer, c] = s.reports[i];
      if (layer < 0 || (i > 0 && layer <= s.reports[i - 1].first)) {
        throw std::invalid_argument(
            "report layer ids are negative, out of order or repeated (layer " +
            std::to_string(layer) + ")");
      }
      if (!std::isfinite(c)) {
        throw std::invalid_argument("the report of layer " + std::to_string(layer) +
                                    " is not finite");
      }
      co->reports_.emplace_hint(co->reports_.end(), layer, c);
      concentrations.push_back(c);
    }
    co->generation_ = s.generation;
    co->finalized_ = static_cast<int>(s.reports.size()) == s.n_layers;
    if (co->finalized_) {
      const std::vector<int> b =
          squeeze_budgets(concentrations, s.avg_budget, s.n_sink, s.strength);
      std::size_t i = 0;
      for (const auto& kv : co->reports_) co->budgets_[kv.first] = b[i++];
    }
    return co;
  }

  /// Checkpoint of a set (KVCacheBuilder::checkpoint, docs/design.md 10.2): keeps the reports,
  /// published budgets and generation under `token`, replacing a live checkpoint. Allocates
  /// only.
  void checkpoint(std::uint64_t token) {
    std::lock_guard<std::mutex> lock(mutex_);
    Kept k{true, token, reports_, budgets_, finalized_, generation_};
    kept_ = std::move(k);
  }
  /// The token of the live checkpoint, or empty (none, dropped by reset(), or consumed).
  std::optional<std::uint64_t> checkpoint_token() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_.live ? std::optional<std::uint64_t>(kept_.token) : std::nullopt;
  }
  /// Returns to the live checkpoint and consumes it; never allocates.
  void rollback() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    reports_.swap(kept_.reports);
    budgets_.swap(kept_.budgets);
    finalized_ = kept_.finalized;
    generation_ = kept_.generation;
    kept_.live = false;
  }
  /// Forgets the live checkpoint, if any.
  void drop_checkpoint() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.live = false;
  }

 private:
  struct Kept {
    bool live = false;
    std::uint64_t token = 0;
    std::map<int, double> reports;
    std::map<int, int> budgets;
    bool finalized = false;
    std::uint64_t generation = 0;
  };
  Kept kept_;

  std::optional<int> lookup(int layer_id) const {
    if (!finalized_) return std::nullopt;
    const auto it = budgets_.find(layer_id);
    if (it == budgets_.end()) return std::nullopt;
    return it->second;
  }

  const int n_layers_;
  const int avg_budget_;
  const int n_sink_;
  const double strength_;
  mutable std::mutex mutex_;
  std::map<int, double> reports_;
  std::map<int, int> budgets_;
  bool finalized_ = false;
  std::uint64_t generation_ = 0;
};

}  // namespace veloxquant::cache
