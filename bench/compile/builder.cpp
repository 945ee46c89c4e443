// Compile-time probe (scripts/compile_time.sh): an engine TU written the way the README starts,
// a model's caches built with KVCacheBuilder::for_model (every policy can be chosen at run time),
// then attend and update_and_fetch with queries on each layer, and a reset. Compiled header-only
// and with VELOXQUANT_EXTERN_TEMPLATES (what linking veloxquant::compiled defines).
#include <cstdio>
#include <vector>
#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;

int main() {
  vc::KVCacheConfig cfg;
  cfg.set_budget(64);
  auto caches = vc::KVCacheBuilder::for_model<Eigen::half>(4, cfg);
  vc::Tensor4<float> q(1, 16, 16, 64), k(1, 8, 16, 64), v(1, 8, 16, 64);
  q.setConstant(0.1f);
  k.setConstant(0.5f);
  v.setConstant(0.25f);
  std::vector<float> out(static_cast<std::size_t>(q.size()));
  for (auto& cache : caches) cache->attend(q, k, v, out.data());
  const vc::KVPair<Eigen::half> kv = caches[0]->update_and_fetch(k, v, q);
  std::printf("%ld %ld %g\n", static_cast<long>(caches[0]->offset()),
              static_cast<long>(kv.first.dimension(2)), static_cast<double>(out[0]));
  vc::KVCacheBuilder::reset(caches);
  return 0;
}
