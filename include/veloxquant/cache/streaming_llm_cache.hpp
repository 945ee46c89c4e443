// veloxquant — StreamingLLMCache<T>: attention sinks plus a sliding window (docs/design.md 6).
// After "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2024). No scoring.
#pragma once

#include <Eigen/Core>

#include "detail/h2o_core.hpp"
#include "detail/policy_kernels.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Keeps the first `stream_n_sink` positions and the newest `stream_window_size` others (FIFO).
template <class T = Eigen::half>
class StreamingLLMCache : public KVCache<T> {
 public:
  using Index = Eigen::Index;

  /// Validates `config` as method "streaming_llm"; throws std::invalid_argument.
  explicit StreamingLLMCache(const KVCacheConfig& config)
      : n_sink_((detail::validate_as(config, "streaming_llm"), config.stream_n_sink)),
        window_(config.stream_window_size) {}

  /// Not trimmable: evicted rows cannot be brought back.
  bool is_trimmable() const override { return false; }
  /// Rows retained per head once full: n_sink + window.
  int layer_budget() const { return n_sink_ + window_; }
  int n_sink() const { return n_sink_; }
  int window_size() const { return window_; }

 protected:
  /// Queries, if the call brought any, are ignored: the policy does not score rows.
  void absorb_rows(detail::HeadStore<T>& head, detail::Slot first, Index count, int /*worker*/,
                   const detail::QuerySlice& /*queries*/) override {
    detail::streaming_absorb(head, first, count, n_sink_, window_);
  }
  Index steady_rows() const override { return static_cast<Index>(n_sink_) + window_ + 1; }

 private:
  int n_sink_;
  int window_;
};

}  // namespace veloxquant::cache
