// decode_steps: the decode step of one SqueezeAttention layer (H 8, G 4, D 128, half storage,
// `attend`, a budget-token prompt, then fresh random rows each step, every step evicting) over
// half rows and over 4-bit rows along channels (blocks of 32), stepped alternately so that a
// drifting machine slows both alike (BENCHMARKS.md 17).
//
//   decode_steps [--budget N] [--steps S] [--only half|channel] [--avx2]
//
// Prints each cache's median step time and their ratio. Under callgrind the instruction count of
// the steps after the 20th is what is counted (valgrind --tool=callgrind --instr-atstart=no:
// the prefill and warm-up are not instrumented); run one cache at a time there (--only), and
// divide by S - 20. --avx2 runs the AVX2 path (valgrind has no AVX-512).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <veloxquant/cache.hpp>

#include "bench_support.hpp"

#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#endif
#endif
#ifndef CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_START_INSTRUMENTATION
#endif

namespace vc = veloxquant::cache;
using Eigen::Index;

namespace {

constexpr Index kKv = 8, kQueries = 32, kDim = 128;
constexpr int kWarmSteps = 20;

template <class T>
vc::Tensor4<T> random_rows(Index heads, Index tokens, std::uint32_t seed) {
  return veloxquant::bench::random_tensor<T>(1, heads, tokens, kDim, seed);
}

vc::KVCacheConfig config(int budget, bool channel) {
  vc::KVCacheConfig c;
  c.method = "squeeze";
  c.set_budget(budget);
  if (channel) {
    c.key_bits = c.value_bits = 4;
    c.key_axis = c.value_axis = "channel";
    c.quant_block = 32;
  }
  return c;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: decode_steps [--budget N] [--steps S] [--only half|channel] [--avx2]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int budget = 512, steps = 1500;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--avx2") {
      vc::set_simd_level(vc::SimdLevel::avx2);
    } else if (i + 1 < argc && (a == "--budget" || a == "--steps" || a == "--only")) {
      const std::string v = argv[++i];
      if (a == "--only") {
        if (v != "half" && v != "channel") usage();
        only = v;
      } else {
        const int n = std::atoi(v.c_str());
        if (n <= 0) usage();
        (a == "--budget" ? budget : steps) = n;
      }
    } else {
      usage();
    }
  }
  if (steps <= kWarmSteps) usage();
  const char* names[2] = {"half", "channel"};
  std::unique_ptr<vc::SqueezeAttentionCache<Eigen::half>> caches[2];
  const auto prompt_k = random_rows<Eigen::half>(kKv, budget, 1);
  const auto prompt_q = random_rows<float>(kQueries, budget, 2);
  for (int c = 0; c < 2; ++c) {
    if (!only.empty() && only != names[c]) continue;
    caches[c] = std::make_unique<vc::SqueezeAttentionCache<Eigen::half>>(config(budget, c == 1));
    (void)caches[c]->update_and_view(prompt_k, prompt_k, prompt_q);
  }
  // 64 different steps, cycled.
  std::vector<vc::Tensor4<Eigen::half>> keys, values;
  std::vector<vc::Tensor4<float>> queries;
  for (std::uint32_t s = 0; s < 64; ++s) {
    keys.push_back(random_rows<Eigen::half>(kKv, 1, 10 + s));
    values.push_back(random_rows<Eigen::half>(kKv, 1, 100 + s));
    queries.push_back(random_rows<float>(kQueries, 1, 200 + s));
  }
  std::vector<float> out(static_cast<std::size_t>(kQueries * kDim));
  std::vector<double> us[2];
  for (int s = 0; s < steps; ++s) {
    if (s == kWarmSteps) CALLGRIND_START_INSTRUMENTATION;
    const auto at = static_cast<std::size_t>(s % 64);
    for (int c = 0; c < 2; ++c) {
      if (!caches[c]) continue;
      const auto t0 = std::chrono::steady_clock::now();
      caches[c]->attend(queries[at], keys[at], values[at], out.data());
      const auto t1 = std::chrono::steady_clock::now();
      if (s >= kWarmSteps) us[c].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  const double h = median(us[0]), ch = median(us[1]);
  std::printf("budget %d, %d steps (median of the last %d):", budget, steps, steps - kWarmSteps);
  if (caches[0]) std::printf(" half %.0f us", h);
  if (caches[1]) std::printf(" channel 4-bit %.0f us", ch);
  if (caches[0] && caches[1]) std::printf(", ratio %.2f", ch / h);
  std::printf("\n");
  return 0;
}
