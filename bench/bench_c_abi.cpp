// The C ABI's cost (BENCHMARKS.md 15): a decode step through vq_attend (libveloxquant_c, built
// with this binary's flags) against the same step through KVCache::attend in C++, on the same
// model shape and rows: SqueezeAttention at budget 2048 (every step evicts), 8 KV heads of 4 query
// heads, D = 128, half rows, float token-major buffers as a C engine holds them. Each benchmark
// builds its own one-layer set, prefills the same 2112 rows, then attends one token per
// iteration.
#include <benchmark/benchmark.h>
#include <veloxquant/veloxquant.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;

namespace {

constexpr int kKv = 8, kGroups = 4, kQ = kKv * kGroups, kDim = 128, kBudget = 2048;
constexpr int kPrompt = kBudget + 64;

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

struct Rows {  // token-major [S, H, D] buffers of a prompt and of one decode token
  std::vector<float> pq = random_floats(std::size_t{kPrompt} * kQ * kDim, 1);
  std::vector<float> pk = random_floats(std::size_t{kPrompt} * kKv * kDim, 2);
  std::vector<float> pv = random_floats(std::size_t{kPrompt} * kKv * kDim, 3);
  std::vector<float> q = random_floats(std::size_t{kQ} * kDim, 4);
  std::vector<float> k = random_floats(std::size_t{kKv} * kDim, 5);
  std::vector<float> v = random_floats(std::size_t{kKv} * kDim, 6);
};

void BM_CppDecodeAttend(benchmark::State& state) {
  const Rows r;
  vc::KVCacheConfig cfg;
  cfg.set_budget(kBudget);
  auto caches = vc::KVCacheBuilder::for_model<Eigen::half>(1, cfg);
  vc::KVCache<Eigen::half>& cache = *caches.front();
  const auto tm = vc::Layout::token_major;
  std::vector<float> prompt_out(std::size_t{kPrompt} * kQ * kDim), out(std::size_t{kQ} * kDim);
  cache.attend(vc::TensorRef<float>(r.pq.data(), 1, kQ, kPrompt, kDim, tm),
               vc::TensorRef<float>(r.pk.data(), 1, kKv, kPrompt, kDim, tm),
               vc::TensorRef<float>(r.pv.data(), 1, kKv, kPrompt, kDim, tm), prompt_out.data(), tm);
  for (auto _ : state) {
    cache.attend(vc::TensorRef<float>(r.q.data(), 1, kQ, 1, kDim, tm),
                 vc::TensorRef<float>(r.k.data(), 1, kKv, 1, kDim, tm),
                 vc::TensorRef<float>(r.v.data(), 1, kKv, 1, kDim, tm), out.data(), tm);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["rows"] = static_cast<double>(cache.tokens_kept());
}
BENCHMARK(BM_CppDecodeAttend)->Unit(benchmark::kMicrosecond);

void BM_CAbiDecodeAttend(benchmark::State& state) {
  const Rows r;
  vq_config* cfg = vq_config_new();
  vq_caches* caches = nullptr;
  std::vector<float> prompt_out(std::size_t{kPrompt} * kQ * kDim), out(std::size_t{kQ} * kDim);
  if (vq_config_set(cfg, "budget", "2048") != VQ_OK ||
      vq_caches_new(cfg, 1, VQ_HALF, &caches) != VQ_OK ||
      vq_attend(caches, 0, r.pq.data(), r.pk.data(), r.pv.data(), prompt_out.data(), 1, kQ, kKv,
                kPrompt, kDim, VQ_TOKEN_MAJOR) != VQ_OK) {
    state.SkipWithError(vq_last_error());
    vq_caches_free(caches);
    vq_config_free(cfg);
    return;
  }
  for (auto _ : state) {
    if (vq_attend(caches, 0, r.q.data(), r.k.data(), r.v.data(), out.data(), 1, kQ, kKv, 1, kDim,
                  VQ_TOKEN_MAJOR) != VQ_OK) {
      state.SkipWithError(vq_last_error());
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["rows"] = static_cast<double>(vq_rows(caches, 0));
  vq_caches_free(caches);
  vq_config_free(cfg);
}
BENCHMARK(BM_CAbiDecodeAttend)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
