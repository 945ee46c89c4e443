// veloxquant — SnapKVCache<T>: one-shot prompt compression (docs/design.md 6). After "SnapKV: LLM
// Knows What You are Looking for Before Generation" (Li et al., 2024): the prompt's rows are ranked
// by the attention of its last `obs_window` tokens; decode appends. The attention is that of the
// engine's queries when the call brings them (docs/design.md 4.6), else the key-as-query proxy's.
#pragma once

#include <algorithm>
#include <limits>

#include <Eigen/Core>

#include "detail/h2o_core.hpp"
#include "detail/policy_kernels.hpp"
#include "detail/scored_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Compresses the first call with S > `snap_budget` to `snap_budget` rows per head; later calls
/// append without eviction.
template <class T = Eigen::half>
class SnapKVCache : public detail::ScoredCache<T> {
 public:
  using Index = Eigen::Index;

  /// Validates `config` as method "snapkv"; throws std::invalid_argument.
  explicit SnapKVCache(const KVCacheConfig& config)
      : budget_((detail::validate_as(config, "snapkv"), config.snap_budget)),
        n_sink_(config.snap_n_sink),
        obs_window_(config.snap_obs_window) {}

  /// The prompt budget (rows per head kept by the compression).
  int layer_budget() const { return budget_; }
  int n_sink() const { return n_sink_; }
  int obs_window() const { return obs_window_; }
  /// True once a call has been compressed (until reset()).
  bool compressed() const { return compressed_; }

  void reset() override {
    detail::ScoredCache<T>::reset();
    compressed_ = false;
    compress_now_ = false;
  }

 protected:
  void prepare_call(const Tensor4<T>& keys) override {
    compress_now_ = !compressed_ && keys.dimension(2) > budget_;
    if (compress_now_) compressed_ = true;  // absorb_rows cannot fail from here on
  }
  Index block_tokens(Index groups) const override {
    return std::max<Index>(detail::ScoredCache<T>::block_tokens(groups), obs_window_);
  }
  void absorb_rows(detail::HeadStore<T>& head, detail::Slot first, Index count, int worker,
                   const detail::QuerySlice& queries) override {
    if (compress_now_) {
      detail::snapkv_compress(head, first, count, budget_, n_sink_, obs_window_,
                              this->scratch(worker), queries);
    } else {
      for (Index i = 0; i < count; ++i) head.push_live(static_cast<detail::Slot>(first + i));
    }
  }

 private:
  int budget_;
  int n_sink_;
  int obs_window_;
  bool compressed_ = false;
  bool compress_now_ = false;
};

}  // namespace veloxquant::cache
