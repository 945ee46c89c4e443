// veloxquant — KVCacheFactory: one cache for config.method (docs/design.md 2.7).
#pragma once

#include <Eigen/Core>
#include <memory>
#include <typeinfo>

#include "h2o_cache.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "kvzip_cache.hpp"
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

  /// Whether `c` is of exactly the class its config's method builds: an engine's subclass of a
  /// library class is not (it may hold state the library's fork and prompt caches do not know, so
  /// KVCacheBuilder::fork and save_prompt_cache refuse it). The one run-time type comparison of
  /// the library: C++ has no other way to tell a subclass from its base (docs/design.md F).
  template <class T>
  static bool builds_class_of(const KVCache<T>& c) {
    const detail::MethodSpec* m = detail::find_method(c.config().method);
    return m != nullptr && with_class<T>(m->id, [&c](auto tag) {
             return typeid(c) == typeid(typename decltype(tag)::type);
           });
  }

 private:
  template <class C>
  struct Tag {
    using type = C;
  };
  /// f(Tag<C>{}) for C the cache class of method `id`: one case per row of detail::kMethodTable
  /// (-Wswitch names a row without its class).
  template <class T, class F>
  static decltype(auto) with_class(detail::Method id, F&& f) {
    switch (id) {
      case detail::Method::squeeze:
        return f(Tag<SqueezeAttentionCache<T>>{});
      case detail::Method::h2o:
        return f(Tag<H2OCache<T>>{});
      case detail::Method::pyramidkv:
        return f(Tag<PyramidKVCache<T>>{});
      case detail::Method::tova:
        return f(Tag<TOVACache<T>>{});
      case detail::Method::streaming_llm:
        return f(Tag<StreamingLLMCache<T>>{});
      case detail::Method::snapkv:
        return f(Tag<SnapKVCache<T>>{});
      case detail::Method::kvzip:
        return f(Tag<KVzipCache<T>>{});
      case detail::Method::standard:
        break;
    }
    return f(Tag<KVCache<T>>{});
  }
};

template <class T>
std::unique_ptr<KVCache<T>> KVCacheFactory::create(const KVCacheConfig& config) {
  config.validate();
  return with_class<T>(detail::method_of(config).id, [&config](auto tag) {
    return std::unique_ptr<KVCache<T>>(std::make_unique<typename decltype(tag)::type>(config));
  });
}

}  // namespace veloxquant::cache
