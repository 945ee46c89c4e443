// veloxquant — TOVACache<T>: Token Omission Via Attention (docs/design.md 6). After "Transformers
// are Multi-State RNNs" (Oren et al., 2024): when over budget, the row the current token attends to
// least is dropped. Memoryless. The attention is that of the engine's queries when the call
// brings them (docs/design.md 4.6), else the key-as-query proxy's (docs/design.md 3).
#pragma once

#include <Eigen/Core>

#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// At most `tova_budget` rows per head; the first `tova_n_sink` positions are never evicted.
template <class T = Eigen::half>
class TOVACache : public KVCache<T> {
 public:
  /// Validates `config` as method "tova"; throws std::invalid_argument.
  explicit TOVACache(const KVCacheConfig& config) : KVCache<T>(rule_of(config), config, detail::Method::tova) {}

  using KVCache<T>::n_sink;

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::tova);
    detail::Rule r;
    r.kind = detail::RuleKind::last_attention;
    r.budget = config.tova_budget;
    r.n_sink = config.tova_n_sink;
    return r;
  }
};

}  // namespace veloxquant::cache
