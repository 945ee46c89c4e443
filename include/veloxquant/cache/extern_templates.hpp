// veloxquant — explicit instantiation of the cache templates for the three storage types, the way
// fmt offers a compiled library beside its header-only mode.
//
// Header-only use needs nothing from this file. A project that builds many translation units
// against the library can compile the caches once instead of in every TU:
//   - in every TU, define VELOXQUANT_EXTERN_TEMPLATES before including <veloxquant/cache.hpp> (the
//     CMake target veloxquant::compiled does this for its consumers): the class templates below
//     are then declared `extern template` for half, bfloat16 and float, and not instantiated;
//   - in exactly one TU, define VELOXQUANT_INSTANTIATE_TEMPLATES as well and include
//     <veloxquant/cache.hpp>: it holds the explicit instantiation definitions.
// Every TU of a program must see the same library configuration (VELOXQUANT_ASSERT, NDEBUG).
// In the consumer TUs the SIMD kernels are declared, not defined (detail/simd_kernels.hpp).
// docs/design.md describes this choice.
#pragma once

#include <Eigen/Core>

#include "h2o_cache.hpp"
#include "kv_cache.hpp"
#include "kv_cache_builder.hpp"
#include "kv_cache_factory.hpp"
#include "kv_view.hpp"
#include "kvzip_cache.hpp"
#include "prompt_cache.hpp"
#include "pyramidkv_cache.hpp"
#include "snapkv_cache.hpp"
#include "squeeze_cache.hpp"
#include "streaming_llm_cache.hpp"
#include "tova_cache.hpp"

#if defined(VELOXQUANT_INSTANTIATE_TEMPLATES)
#define VELOXQUANT_DETAIL_INSTANTIATE(...) template class __VA_ARGS__;
#define VELOXQUANT_DETAIL_INSTANTIATE_FUNCTION(...) template __VA_ARGS__;
#else
#define VELOXQUANT_DETAIL_INSTANTIATE(...) extern template class __VA_ARGS__;
#define VELOXQUANT_DETAIL_INSTANTIATE_FUNCTION(...) extern template __VA_ARGS__;
#endif

#define VELOXQUANT_DETAIL_INSTANTIATE_ALL(T)                                                       \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::detail::HeadStore<T>)                           \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::KVView<T>)                                      \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::KVCache<T>)                                     \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::SqueezeAttentionCache<T>)                       \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::H2OCache<T>)                                    \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::PyramidKVCache<T>)                              \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::TOVACache<T>)                                   \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::StreamingLLMCache<T>)                           \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::SnapKVCache<T>)                                 \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::KVzipCache<T>)                                  \
  VELOXQUANT_DETAIL_INSTANTIATE(veloxquant::cache::detail::PromptCacheIO<T>)                       \
  VELOXQUANT_DETAIL_INSTANTIATE_FUNCTION(                                                          \
      std::unique_ptr<veloxquant::cache::KVCache<T>> veloxquant::cache::KVCacheFactory::create<T>( \
          const veloxquant::cache::KVCacheConfig&))                                                \
  VELOXQUANT_DETAIL_INSTANTIATE_FUNCTION(                                                          \
      std::vector<std::unique_ptr<veloxquant::cache::KVCache<T>>>                                  \
          veloxquant::cache::KVCacheBuilder::build<T>(const std::vector<std::optional<int>>&,      \
                                                      const veloxquant::cache::KVCacheConfig&,     \
                                                      bool))

VELOXQUANT_DETAIL_INSTANTIATE_ALL(Eigen::half)
VELOXQUANT_DETAIL_INSTANTIATE_ALL(Eigen::bfloat16)
VELOXQUANT_DETAIL_INSTANTIATE_ALL(float)

#undef VELOXQUANT_DETAIL_INSTANTIATE_ALL
#undef VELOXQUANT_DETAIL_INSTANTIATE_FUNCTION
#undef VELOXQUANT_DETAIL_INSTANTIATE
