// veloxquant — KVCacheFactory: one cache for config.method (docs/design.md 2.7).
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

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
  template <class T = Eigen::half>
  static std::unique_ptr<KVCache<T>> create(const KVCacheConfig& config) {
    config.validate();
    const std::string& m = config.method;
    if (m == "squeeze") return std::make_unique<SqueezeAttentionCache<T>>(config);
    if (m == "h2o") return std::make_unique<H2OCache<T>>(config);
    if (m == "pyramidkv") return std::make_unique<PyramidKVCache<T>>(config);
    if (m == "tova") return std::make_unique<TOVACache<T>>(config);
    if (m == "streaming_llm") return std::make_unique<StreamingLLMCache<T>>(config);
    if (m == "snapkv") return std::make_unique<SnapKVCache<T>>(config);
    if (m == "standard") return std::make_unique<KVCache<T>>(config);
    // validate() accepts only the methods above; this guards a future method without a class.
    throw std::invalid_argument("KVCacheFactory: method '" + m + "' has no cache class; valid: " +
                                detail::method_list());
  }
};

}  // namespace veloxquant::cache
