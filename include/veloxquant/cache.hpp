// veloxquant — umbrella header of the KV-cache eviction module (like Eigen/Core).
#pragma once

#include "cache/h2o_cache.hpp"
#include "cache/kv_cache.hpp"
#include "cache/kv_cache_builder.hpp"
#include "cache/kv_cache_config.hpp"
#include "cache/kv_cache_factory.hpp"
#include "cache/kv_view.hpp"
#include "cache/kvzip_cache.hpp"
#include "cache/memory_pool.hpp"
#include "cache/parallel.hpp"
#include "cache/prompt_cache.hpp"
#include "cache/pyramidkv_cache.hpp"
#include "cache/simd.hpp"
#include "cache/snapkv_cache.hpp"
#include "cache/squeeze_cache.hpp"
#include "cache/squeeze_coordinator.hpp"
#include "cache/streaming_llm_cache.hpp"
#include "cache/tensor.hpp"
#include "cache/tova_cache.hpp"

// Opt-in: the caches compiled once in one TU (see cache/extern_templates.hpp).
#if defined(VELOXQUANT_EXTERN_TEMPLATES) || defined(VELOXQUANT_INSTANTIATE_TEMPLATES)
#include "cache/extern_templates.hpp"
#endif
