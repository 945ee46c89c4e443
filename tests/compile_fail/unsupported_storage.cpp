// Must NOT compile: KVCache<T> only stores Eigen::half, Eigen::bfloat16 or float, and rejects any
// other T with a static_assert ("veloxquant: the storage type T must be ..."). The compile_fail.*
// tests build this file with VELOXQUANT_TEST_STORAGE = int (the default) and = double (an accepted
// *input* type, but not a storage type) and pass only when the build fails with that message.

#include <veloxquant/cache/kv_cache.hpp>

#ifndef VELOXQUANT_TEST_STORAGE
#define VELOXQUANT_TEST_STORAGE int
#endif

int instantiate_unsupported_storage() {
  veloxquant::cache::KVCache<VELOXQUANT_TEST_STORAGE> cache;  // static_assert fires here
  return static_cast<int>(cache.offset());
}
