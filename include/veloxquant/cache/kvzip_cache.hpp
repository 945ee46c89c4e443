// veloxquant — KVzipCache<T>: compress once, from observed queries (SPEC 18, docs/design.md 6.1).
// After "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (Kim et al.,
// 2025): the engine re-reads the prompt (on a fork of the set), observe scores every row by the
// attention the re-read gives it, and KVCacheBuilder::compress keeps the best-observed rows of the
// whole set with one threshold; the calls themselves keep every row.
#pragma once

#include <Eigen/Core>

#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Keeps every row it is given; observe scores them, KVCacheBuilder::compress cuts the set's heads
/// to its best-observed rows (heads then hold their own numbers of rows: ragged_heads()); rows
/// that come after are kept, unscored (score -1) until an observe call scores them. The first
/// `kvzip_n_sink` positions are never dropped.
template <class T = Eigen::half>
class KVzipCache : public KVCache<T> {
 public:
  /// Validates `config` as method "kvzip"; throws std::invalid_argument.
  explicit KVzipCache(const KVCacheConfig& config)
      : KVCache<T>(rule_of(config), config, detail::Method::kvzip) {}

  using KVCache<T>::n_sink;
  /// True once an observe call has scored rows (until reset()).
  bool observed() const { return this->rule().observed; }
  /// True once a compress has cut the heads (until reset()).
  bool compressed() const { return this->rule().compressed; }

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::kvzip);
    detail::Rule r;
    r.kind = detail::RuleKind::observed;
    r.n_sink = config.kvzip_n_sink;
    r.head_floor = config.head_budget_floor;
    return r;
  }
};

}  // namespace veloxquant::cache
