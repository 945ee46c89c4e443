// veloxquant — H2OCache<T>: Heavy-Hitter Oracle eviction with a uniform, fixed budget
// (docs/design.md 6). After "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
// Language Models" (Zhang et al., 2023). Rows are scored with the engine's queries when the call
// brings them (docs/design.md 4.6), else with the key-as-query proxy (docs/design.md 3).
#pragma once

#include <Eigen/Core>

#include "detail/h2o_core.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Cumulative attention-mass eviction at `h2o_budget` rows per head, `h2o_n_sink` sinks, the
/// newest `h2o_grace` rows protected and scores decayed by `h2o_decay` per token.
template <class T = Eigen::half>
class H2OCache : public detail::H2OCore<T> {
  using Core = detail::H2OCore<T>;

 public:
  /// Validates `config` as method "h2o"; throws std::invalid_argument.
  explicit H2OCache(const KVCacheConfig& config)
      : Core((detail::validate_as(config, "h2o"), config.h2o_n_sink), config.h2o_decay,
             detail::GracePolicy{false, 0.0, config.h2o_grace}, config.h2o_budget) {}

  /// The fixed budget (rows per head).
  int layer_budget() const { return *this->budget(); }
};

}  // namespace veloxquant::cache
