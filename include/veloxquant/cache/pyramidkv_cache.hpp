// veloxquant — PyramidKVCache<T>: the H2O core with a fixed per-layer budget that tapers with
// depth (docs/design.md 6). After "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
// Information Funneling" (Cai et al., 2024). Rows are scored with the engine's queries when the
// call brings them (docs/design.md 4.6), else by the query-free scorer `proxy_scoring` names:
// key_as_query (the default, docs/design.md 3), keydiff or knorm (docs/design.md 4.7).
#pragma once

#include <Eigen/Core>
#include <vector>

#include "detail/budgets.hpp"
#include "detail/policy.hpp"
#include "h2o_cache.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Per-layer pyramid budgets (docs/design.md 6): linear taper from avg + span to avg - span with
/// span = (avg - n_sink - 1)(beta - 1), water-filled so every budget is >= n_sink + 1 and the mean
/// stays at avg. Throws std::invalid_argument for beta outside [1, 1e6].
inline std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink,
                                        double beta = 2.0) {
  return detail::pyramid_budgets(n_layers, avg_budget, n_sink, beta);
}

/// One layer of PyramidKV: budget `pyramid_resolved_budget` (the builder sets it per layer from
/// pyramid_budgets), else `pyramid_budget`.
template <class T = Eigen::half>
class PyramidKVCache : public KVCache<T> {
 public:
  /// Validates `config` as method "pyramidkv"; throws std::invalid_argument.
  explicit PyramidKVCache(const KVCacheConfig& config)
      : KVCache<T>(rule_of(config), config, detail::Method::pyramidkv) {}

  using KVCache<T>::budget;
  using KVCache<T>::n_sink;
  using KVCache<T>::protected_recent;
  using KVCache<T>::decay;

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::pyramidkv);
    detail::Rule r;
    r.kind = detail::RuleKind::cumulative;
    r.budget = config.pyramid_resolved_budget.value_or(config.pyramid_budget);
    r.n_sink = config.pyramid_n_sink;
    r.recent_ratio = config.pyramid_recent_ratio;
    r.decay = static_cast<float>(config.pyramid_decay);
    detail::h2o_core_ranking(config, r);
    return r;
  }
};

}  // namespace veloxquant::cache
