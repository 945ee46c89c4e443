// veloxquant — SnapKVCache<T>: one-shot prompt compression (docs/design.md 6). After "SnapKV: LLM
// Knows What You are Looking for Before Generation" (Li et al., 2024): the prompt's rows are ranked
// by the attention of its last `obs_window` tokens; decode appends. The attention is that of the
// engine's queries when the call brings them (docs/design.md 4.6), else the key-as-query proxy's.
#pragma once

#include <Eigen/Core>

#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Compresses every prompt chunk (a call with S > 1) after which a head would hold more than
/// `snap_budget` rows to `snap_budget` rows per head, ranking everything it holds by that call's
/// observation window; decode steps (S == 1) append without eviction (docs/design.md 6, 10.3).
template <class T = Eigen::half>
class SnapKVCache : public KVCache<T> {
 public:
  /// Validates `config` as method "snapkv"; throws std::invalid_argument.
  explicit SnapKVCache(const KVCacheConfig& config)
      : KVCache<T>(rule_of(config), config, detail::Method::snapkv) {}

  using KVCache<T>::n_sink;
  /// Query tokens that rank the prompt.
  int obs_window() const { return this->rule().obs_window; }
  /// True once a call has been compressed (until reset()).
  bool compressed() const { return this->rule().compressed; }

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::snapkv);
    detail::Rule r;
    r.kind = detail::RuleKind::prompt;
    r.budget = config.snap_budget;
    r.n_sink = config.snap_n_sink;
    r.obs_window = config.snap_obs_window;
    return r;
  }
};

}  // namespace veloxquant::cache
