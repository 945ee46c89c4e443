// veloxquant — PyramidKVCache<T>: the H2O core with a fixed per-layer budget that tapers with
// depth (docs/design.md 6). After "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
// Information Funneling" (Cai et al., 2024). Rows are scored with the engine's queries when the
// call brings them (docs/design.md 4.6), else with the key-as-query proxy (docs/design.md 3).
#pragma once

#include <vector>

#include <Eigen/Core>

#include "detail/budgets.hpp"
#include "detail/h2o_core.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Per-layer pyramid budgets (docs/design.md 6): linear taper from avg + span to avg - span with
/// span = (avg - n_sink - 1)(beta - 1), water-filled so every budget is >= n_sink + 1 and the mean
/// stays at avg. Throws std::invalid_argument for beta outside [1, 1e6].
inline std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta = 2.0) {
  return detail::pyramid_budgets(n_layers, avg_budget, n_sink, beta);
}

/// One layer of PyramidKV: budget `pyramid_resolved_budget` (the builder sets it per layer from
/// pyramid_budgets), else `pyramid_budget`.
template <class T = Eigen::half>
class PyramidKVCache : public detail::H2OCore<T> {
  using Core = detail::H2OCore<T>;

 public:
  /// Validates `config` as method "pyramidkv"; throws std::invalid_argument.
  explicit PyramidKVCache(const KVCacheConfig& config)
      : Core((detail::validate_as(config, "pyramidkv"), config.pyramid_n_sink), config.pyramid_decay,
             detail::GracePolicy{true, config.pyramid_recent_ratio, 0},
             config.pyramid_resolved_budget.value_or(config.pyramid_budget)) {}

  /// This layer's budget (rows per head).
  int layer_budget() const { return *this->budget(); }
};

}  // namespace veloxquant::cache
