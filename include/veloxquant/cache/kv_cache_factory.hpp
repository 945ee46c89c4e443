// veloxquant — KVCacheFactory: one cache for config.method (docs/design.md 2.7).
#pragma once

#include <memory>

#include <Eigen/Core>

#include "h2o_cache.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "pyramidkv_cache.hpp"
#include "snapkv_cache.hpp"
#include "squeeze_cache.hpp"
#include "streaming_llm_cache.hpp"
#include "tova_cache.hpp"

namespace veloxquant::cache {

/// Builds single caches by method name.
class KVCacheFactory {
 public:
  /// One cache for `config.method` (validated first). A squeeze cache gets no coordinator and so
  /// a uniform budget. Throws std::invalid_argument for a bad config or an unknown method.
  /// (Defined below the class, not inline: with VELOXQUANT_EXTERN_TEMPLATES a consumer TU does
  /// not compile it; extern_templates.hpp.)
  template <class T = Eigen::half>
  static std::unique_ptr<KVCache<T>> create(const KVCacheConfig& config);
};

template <class T>
std::unique_ptr<KVCache<T>> KVCacheFactory::create(const KVCacheConfig& config) {
  config.validate();
  // One case per row of detail::kMethodTable (-Wswitch names a row without its class).
  switch (detail::method_of(config).id) {
    case detail::Method::squeeze:
      return std::make_unique<SqueezeAttentionCache<T>>(config);
    case detail::Method::h2o:
      return std::make_unique<H2OCache<T>>(config);
    case detail::Method::pyramidkv:
      return std::make_unique<PyramidKVCache<T>>(config);
    case detail::Method::tova:
      return std::make_unique<TOVACache<T>>(config);
    case detail::Method::streaming_llm:
      return std::make_unique<StreamingLLMCache<T>>(config);
    case detail::Method::snapkv:
      return std::make_unique<SnapKVCache<T>>(config);
    case detail::Method::standard:
      break;
  }
  return std::make_unique<KVCache<T>>(config);
}

}  // namespace veloxquant::cache
