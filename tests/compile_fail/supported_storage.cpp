// Control for unsupported_storage.cpp: the same instantiation with a supported storage type (float)
// must compile through the same harness (compile_pass.storage_float), showing that the compile_fail
// tests fail for the static_assert and not because the harness cannot build anything.

#include <veloxquant/cache/kv_cache.hpp>

int instantiate_supported_storage() {
  veloxquant::cache::KVCache<float> cache;
  veloxquant::cache::Tensor4<float> keys(1, 2, 3, 4);
  keys.setZero();
  const veloxquant::cache::KVPair<float> kv = cache.update_and_fetch(keys, keys);
  return static_cast<int>(kv.first.dimension(2) + cache.offset());
}
