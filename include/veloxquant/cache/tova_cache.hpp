// veloxquant — TOVACache<T>: Token Omission Via Attention (docs/design.md 6). After "Transformers
// are Multi-State RNNs" (Oren et al., 2024): when over budget, the row the current token attends to
// least is dropped. Memoryless. The attention is that of the engine's queries when the call
// brings them (docs/design.md 4.6), else the key-as-query proxy's (docs/design.md 3).
#pragma once

#include <limits>

#include <Eigen/Core>

#include "detail/h2o_core.hpp"
#include "detail/policy_kernels.hpp"
#include "detail/scored_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// At most `tova_budget` rows per head; the first `tova_n_sink` positions are never evicted.
template <class T = Eigen::half>
class TOVACache : public detail::ScoredCache<T> {
 public:
  using Index = Eigen::Index;

  /// Validates `config` as method "tova"; throws std::invalid_argument.
  explicit TOVACache(const KVCacheConfig& config)
      : budget_((detail::validate_as(config, "tova"), config.tova_budget)),
        n_sink_(config.tova_n_sink) {}

  /// The fixed budget (rows per head).
  int layer_budget() const { return budget_; }
  int n_sink() const { return n_sink_; }

 protected:
  void absorb_rows(detail::HeadStore<T>& head, detail::Slot first, Index count, int worker,
                   const detail::QuerySlice& queries) override {
    auto& scratch = this->scratch(worker);
    if (count == 1 &&
        detail::tova_decode(head, first, budget_, n_sink_, scratch, this->kDecodeChunk, queries)) {
      return;
    }
    if (count == 1 && !queries) {
      detail::tova_absorb_token(head, first, budget_, n_sink_, scratch);
      return;
    }
    detail::tova_blocked(head, first, count, budget_, n_sink_, scratch,
                         this->block_tokens(queries.groups), queries);
  }
  Index steady_rows() const override { return static_cast<Index>(budget_) + 1; }

 private:
  int budget_;
  int n_sink_;
};

}  // namespace veloxquant::cache
