// veloxquant — `steps` decode attend() steps (SqueezeAttention, half rows, H = 8 KV heads, G = 4,
// D = 128, budget `budget`, evicting every step, as BM_DecodeAttend) on the kernel path argv[1]
// ("scalar" or "neon"), after a prompt of `budget` tokens. scripts/bench_qemu.sh runs it under
// qemu-aarch64 with bench/qemu/insn_count.c: the count at k steps less the count at 0 steps is k
// steps' instructions (BENCHMARKS.md section 12).
//   attend_steps PATH STEPS BUDGET
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <veloxquant/cache.hpp>
namespace vc = veloxquant::cache;
using Eigen::Index;
// Values k / 500, k in [-1000, 1000]: exact in every storage type's range.
template <class T>
vc::Tensor4<T> rt(Index b, Index h, Index s, Index d, unsigned seed) {
  std::mt19937 rng(seed);
  vc::Tensor4<T> t(b, h, s, d);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 500.0f);
  return t;
}
int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: attend_steps scalar|neon STEPS BUDGET\n");
    return 2;
  }
  const vc::SimdLevel level = std::strcmp(argv[1], "neon") == 0 ? vc::SimdLevel::neon : vc::SimdLevel::scalar;
  const int steps = std::atoi(argv[2]);
  const int budget = std::atoi(argv[3]);
  vc::set_simd_level(level);
  vc::KVCacheConfig cfg;
  cfg.set_budget(budget);
  vc::SqueezeAttentionCache<Eigen::half> cache(cfg);
  const Index H = 8, G = 4, D = 128;
  const auto pk = rt<Eigen::half>(1, H, budget, D, 1);
  const auto pq = rt<float>(1, H * G, budget, D, 2);
  (void)cache.update_and_view(pk, pk, pq);
  const auto k = rt<Eigen::half>(1, H, 1, D, 3);
  const auto q = rt<float>(1, H * G, 1, D, 5);
  std::vector<float> out(static_cast<std::size_t>(H * G * D));
  for (int i = 0; i < steps; ++i) cache.attend(q, k, k, out.data());
  std::printf("%s %d %g\n", vc::simd_level_name(level), steps, static_cast<double>(out[7]));
  return 0;
}
