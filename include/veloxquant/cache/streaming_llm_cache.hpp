// veloxquant — StreamingLLMCache<T>: attention sinks plus a sliding window (docs/design.md 6).
// After "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2024). No scoring;
// queries, if a call brings them, are validated and ignored.
#pragma once

#include <Eigen/Core>

#include "detail/policy.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"

namespace veloxquant::cache {

/// Keeps the first `stream_n_sink` positions and the newest `stream_window_size` others (FIFO).
template <class T = Eigen::half>
class StreamingLLMCache : public KVCache<T> {
 public:
  /// Validates `config` as method "streaming_llm"; throws std::invalid_argument.
  explicit StreamingLLMCache(const KVCacheConfig& config)
      : KVCache<T>(rule_of(config), config, detail::Method::streaming_llm) {}

  using KVCache<T>::n_sink;
  /// Rows kept besides the sinks.
  int window_size() const { return this->rule().window; }

 private:
  static detail::Rule rule_of(const KVCacheConfig& config) {
    detail::validate_as(config, detail::Method::streaming_llm);
    detail::Rule r;
    r.kind = detail::RuleKind::window;
    r.budget = config.stream_n_sink + config.stream_window_size;
    r.n_sink = config.stream_n_sink;
    r.window = config.stream_window_size;
    return r;
  }
};

}  // namespace veloxquant::cache
