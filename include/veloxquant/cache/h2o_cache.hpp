// veloxquant — H2OCache<T>: Heavy-Hitter Oracle eviction with a uniform, fixed budget
// (docs/design.md 6). After "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
// Language Models" (Zhang et al., 2023). Rows are scored with the engine's queries when the call
// brings them (docs/design.md 4.6), else by the query-free scorer `proxy_scoring` names:
// key_as_query (the default, docs/design.md 3), keydiff or knorm (docs/design.md 4.7).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <string>

#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

namespace detail {
/// The H2O core's ranking and sharing of rows from a validated `config`, for every policy built on
/// it (H2O, SqueezeAttention, PyramidKV): the query-free scorer `proxy_scoring` names, the
/// value-weighted ranking, adaptive heads and their floor.
inline void h2o_core_ranking(const KVCacheConfig& config, Rule& r) {
  r.proxy = static_cast<ProxyScoring>(std::max(proxy_scoring_index(config.proxy_scoring), 0));
  r.value_power = config.value_norm_power;
  r.adaptive = config.head_budgets == "adaptive";
  r.head_floor = config.head_budget_floor;
}
}  // namespace detail

/// Cumulative attention-mass eviction at `h2o_budget` rows per head, `h2o_n_sink` sinks, the
/// newest `h2o_grace` rows protected and scores decayed by `h2o_decay` per token.
template <class T = Eigen::half>
class H2OCache : public KVCache<T> {
 public:
  /// Validates `config` as method "h2o"; throws std::invalid_argument.
  explicit H2OCache(const KVCacheConfig& config)
      : KVCache<T>(rule_of(config), config, detail::Method::h2o) {}

  using KVCache<T>::budget;
  using KVCache<T>::n_sink;
  using KVCache<T>::protected_recent;
  using KVCache<T>::decay;

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::h2o);
    detail::Rule r;
    r.kind = detail::RuleKind::cumulative;
    r.budget = config.h2o_budget;
    r.n_sink = config.h2o_n_sink;
    r.recent_by_ratio = false;
    r.grace = config.h2o_grace;
    r.decay = static_cast<float>(config.h2o_decay);
    detail::h2o_core_ranking(config, r);
    return r;
  }
};

}  // namespace veloxquant::cache
