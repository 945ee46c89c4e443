// fuzz target `ops` (fuzz/fuzz_ops.hpp): the budget model of the H2O core (docs/design.md 4.2,
// 4.5, 5.4, 6) — the budget in force, the protected recent window it implies, SqueezeAttention's
// report and adoption — and the model of a squeeze builder model's shared coordinator.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "ops_config.hpp"

namespace veloxquant::fuzz::detail {

/// The shared coordinator of a squeeze builder model: the first report per layer wins; finalised
/// at n_layers reports, with the budgets of reference::squeeze_budgets.
struct CoordinatorModel {
  std::map<int, double> reports;
  std::map<int, int> budgets;
  bool finalized = false;

  void clear() {
    reports.clear();
    budgets.clear();
    finalized = false;
  }

  void report(int layer, double c, const RunSpec& s) {
    if (finalized || reports.count(layer)) return;
    reports[layer] = c;
    if (static_cast<int>(reports.size()) < s.layers) return;
    std::vector<double> cs;
    for (const auto& kv : reports) cs.push_back(kv.second);
    const std::vector<int> b = ref::squeeze_budgets(cs, s.cfg.squeeze_budget, s.cfg.squeeze_n_sink,
                                                    s.cfg.squeeze_strength);
    std::size_t i = 0;
    for (const auto& kv : reports) budgets[kv.first] = b[i++];
    finalized = true;
  }
};

/// The budget of the layer under test and what follows from it, as docs/design.md says it
/// evolves (the H2O-core policies; the others keep their defaults).
class BudgetModel {
 public:
  explicit BudgetModel(const RunSpec& s) : spec_(s) {}

  /// The policy's fields, and the budget at construction.
  void init() {
    const vc::KVCacheConfig& c = spec_.cfg;
    switch (spec_.method) {
      case Method::squeeze:
        set_rule(c.squeeze_n_sink, c.squeeze_decay, true, c.squeeze_recent_ratio, 0);
        break;
      case Method::h2o:
        set_rule(c.h2o_n_sink, c.h2o_decay, false, 0.5, c.h2o_grace);
        break;
      case Method::pyramidkv:
        set_rule(c.pyramid_n_sink, c.pyramid_decay, true, c.pyramid_recent_ratio, 0);
        break;
      default:
        break;
    }
    reset(true);
  }

  /// The budget at construction or after reset() (`coordinator_too`: of the whole model).
  void reset(bool coordinator_too) {
    const vc::KVCacheConfig& cfg = spec_.cfg;
    calls_since_reset = 0;
    sq_reported = false;
    sq_adopted = false;
    switch (spec_.method) {
      case Method::squeeze:
        if (!spec_.builder()) {
          budget = fallback();
          break;
        }
        if (cfg.squeeze_defer) {
          budget.reset();
        } else {
          budget = fallback();
        }
        if (coordinator_too) coord.clear();
        break;
      case Method::h2o:
        budget = cfg.h2o_budget;
        break;
      case Method::pyramidkv: {
        if (!spec_.builder()) {
          budget = cfg.pyramid_resolved_budget.value_or(cfg.pyramid_budget);
          break;
        }
        const std::vector<int> b = ref::pyramid_budgets(spec_.layers, cfg.pyramid_budget,
                                                        cfg.pyramid_n_sink, cfg.pyramid_beta);
        budget = b[static_cast<std::size_t>(spec_.layer)];
        break;
      }
      default:
        break;
    }
  }

  /// SqueezeAttention's budget without (or before) the coordinator's.
  int fallback() const {
    return spec_.cfg.squeeze_resolved_budget.value_or(spec_.cfg.squeeze_budget);
  }

  /// A squeeze builder layer's own report of its concentration, on its first call since reset.
  void report_own(double concentration) {
    coord.report(spec_.layer, concentration, spec_);
    sq_reported = true;
  }

  /// A squeeze builder layer's budget that comes into force before a call's tokens, if any: the
  /// coordinator's once it is final and the layer has reported (adopted once), else the fallback
  /// from the second call since reset on (docs/design.md 5.4).
  std::optional<int> due_budget() {
    if (!sq_adopted && sq_reported && coord.finalized) {
      const auto it = coord.budgets.find(spec_.layer);
      if (it != coord.budgets.end()) {
        sq_adopted = true;
        return it->second;
      }
    }
    if (!budget && calls_since_reset >= 1) return fallback();
    return std::nullopt;
  }

  /// The protected recent window g(b) of budget b.
  int grace_for(int b) const {
    return ratio_grace_ ? ref::protected_recent_ratio(ratio_, b, n_sink)
                        : ref::protected_recent_fixed(grace_, b, n_sink);
  }
  /// The protected recent window in force (0 while the budget is unknown).
  int grace() const { return budget ? grace_for(*budget) : 0; }
  /// g as a function, for the oracles.
  std::function<int(int)> grace_fn() const {
    if (ratio_grace_) {
      const double r = ratio_;
      const int s = n_sink;
      return [r, s](int b) { return ref::protected_recent_ratio(r, b, s); };
    }
    const int g = grace_;
    const int s = n_sink;
    return [g, s](int b) { return ref::protected_recent_fixed(g, b, s); };
  }

  int n_sink = 0;
  double decay = 1.0;
  std::optional<int> budget;  ///< in force (none: a deferring squeeze layer before its first call)
  std::int64_t calls_since_reset = 0;
  bool sq_reported = false, sq_adopted = false;  ///< the squeeze layer's report and adoption
  CoordinatorModel coord;

 private:
  /// The policy's sinks, decay and rule for g: a ratio of the budget, or a fixed grace.
  void set_rule(int sinks, double score_decay, bool by_ratio, double ratio, int grace) {
    n_sink = sinks;
    decay = score_decay;
    ratio_grace_ = by_ratio;
    ratio_ = ratio;
    grace_ = grace;
  }

  const RunSpec& spec_;
  bool ratio_grace_ = true;  ///< g from a ratio of the budget (else a fixed grace)
  double ratio_ = 0.5;
  int grace_ = 0;
};

}  // namespace veloxquant::fuzz::detail
