// Compile-time probe (scripts/compile_time.sh): an engine TU that includes the library and uses
// one cache (SqueezeAttention, half storage) through update_and_view and update_and_fetch, with
// and without queries.
#include <veloxquant/cache.hpp>

#include <cstdio>

namespace vc = veloxquant::cache;

int main() {
  vc::KVCacheConfig config;
  config.squeeze_budget = 8;
  vc::SqueezeAttentionCache<Eigen::half> cache(config);
  vc::Tensor4<Eigen::half> k(1, 8, 16, 64), v(1, 8, 16, 64);
  vc::Tensor4<float> q(1, 16, 16, 64);
  k.setConstant(Eigen::half(0.5f));
  v.setConstant(Eigen::half(0.25f));
  q.setConstant(0.1f);
  const vc::KVView<Eigen::half> view = cache.update_and_view(k, v);
  const vc::KVPair<Eigen::half> kv = cache.update_and_fetch(k, v, q);
  std::printf("%ld %ld %ld\n", static_cast<long>(view.rows()), static_cast<long>(kv.first.dimension(2)),
              static_cast<long>(cache.offset()));
  return 0;
}
