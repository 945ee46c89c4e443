// Bit-identity across builds and machines (docs/design.md 7.2): the same call sequence on every
// policy, with and without queries, at every SIMD path this CPU supports; prints one digest of
// every returned row, score and position per path, and fails unless the paths that compute the
// scalar path's bits (avx2 on x86-64, neon on aarch64) print the scalar path's digest.
// tests/determinism/CMakeLists.txt builds this file with several sets of flags and CTest checks
// that they print the same digests, and that the scalar digest is the one recorded in
// expected_scalar_digest.txt, which x86-64 and aarch64 must both reproduce.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;
using Eigen::Index;

namespace {

struct Digest {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

// Inputs from exact integer arithmetic: a library distribution is compiled with this TU's flags
// and may itself round differently under another -march (contracted multiply-adds).
template <class T>
vc::Tensor4<T> random_tensor(std::mt19937& rng, Index b, Index h, Index s, Index d) {
  vc::Tensor4<T> t(b, h, s, d);
  for (Index i = 0; i < t.size(); ++i) {
    const auto centred = static_cast<std::int32_t>(rng() >> 9) - (std::int32_t{1} << 22);
    t.data()[i] = static_cast<T>(static_cast<float>(centred) * (1.0f / 2097152.0f));  // [-2, 2)
  }
  return t;
}

template <class T>
void run(const char* method, bool queries, Digest& digest, const char* proxy = "key_as_query") {
  vc::KVCacheConfig c;
  c.method = method;
  c.proxy_scoring = proxy;
  c.squeeze_budget = c.h2o_budget = c.pyramid_budget = c.tova_budget = c.snap_budget = 24;
  c.stream_window_size = 20;
  auto caches = vc::KVCacheBuilder::for_model<T>(2, c);
  std::mt19937 rng(7);
  const Index H = 2, Dk = 64, Dv = 32;
  for (const Index S : {Index{70}, Index{1}, Index{1}, Index{5}, Index{1}, Index{40}, Index{1}}) {
    for (auto& cache : caches) {
      const auto k = random_tensor<T>(rng, 1, H, S, Dk);
      const auto v = random_tensor<T>(rng, 1, H, S, Dv);
      const vc::KVPair<T> out = queries
                                    ? cache->update_and_fetch(k, v, random_tensor<float>(rng, 1, 2 * H, S, Dk))
                                    : cache->update_and_fetch(k, v);
      digest.add(out.first.data(), sizeof(T) * static_cast<std::size_t>(out.first.size()));
      for (Index h = 0; h < H; ++h) {
        const std::vector<float> sc = cache->scores(0, h);
        const std::vector<std::int64_t> pos = cache->positions(0, h);
        digest.add(sc.data(), sizeof(float) * sc.size());
        digest.add(pos.data(), sizeof(std::int64_t) * pos.size());
      }
    }
  }
}

/// KVzip (SPEC 18): a prompt, observe without and with the re-read's keys, a compress, then
/// views of decode steps (its heads are ragged): the views' rows, scores and positions.
template <class T>
void run_kvzip(Digest& digest) {
  vc::KVCacheConfig c;
  c.method = "kvzip";
  auto caches = vc::KVCacheBuilder::for_model<T>(2, c);
  std::mt19937 rng(11);
  const Index H = 2, Dk = 64, Dv = 32;
  // Every draw is a statement of its own: the order in which a call's arguments are evaluated
  // is unspecified (GCC takes them right to left, Clang left to right), and the digest must not
  // depend on the compiler.
  for (auto& cache : caches) {
    const vc::Tensor4<T> k = random_tensor<T>(rng, 1, H, 70, Dk);
    const vc::Tensor4<T> v = random_tensor<T>(rng, 1, H, 70, Dv);
    (void)cache->update_and_view(k, v);
    cache->observe(random_tensor<float>(rng, 1, 2 * H, 45, Dk));
    const vc::Tensor4<float> q = random_tensor<float>(rng, 1, 2 * H, 20, Dk);
    const vc::Tensor4<float> own = random_tensor<float>(rng, 1, H, 20, Dk);
    cache->observe(q, own);
  }
  vc::KVCacheBuilder::compress(caches, 0.3);
  for (int step = 0; step < 3; ++step) {
    for (auto& cache : caches) {
      const vc::Tensor4<T> k = random_tensor<T>(rng, 1, H, 1, Dk);
      const vc::Tensor4<T> v = random_tensor<T>(rng, 1, H, 1, Dv);
      const vc::KVView<T> view = cache->update_and_view(k, v);
      for (Index h = 0; h < H; ++h) {
        const auto keys = view.keys(0, h);
        digest.add(keys.data(), sizeof(T) * static_cast<std::size_t>(keys.size()));
        const std::vector<float> sc = cache->scores(0, h);
        const std::vector<std::int64_t> pos = cache->positions(0, h);
        digest.add(sc.data(), sizeof(float) * sc.size());
        digest.add(pos.data(), sizeof(std::int64_t) * pos.size());
      }
    }
  }
}

}  // namespace

int main() {
  std::uint64_t scalar = 0;
  int status = 0;
  for (const vc::SimdLevel l : {vc::SimdLevel::scalar, vc::SimdLevel::sse2, vc::SimdLevel::avx2,
                                vc::SimdLevel::avx512, vc::SimdLevel::neon}) {
    if (!vc::simd_level_supported(l)) continue;
    vc::set_simd_level(l);
    Digest d;
    for (const char* m : {"squeeze", "h2o", "pyramidkv", "tova", "snapkv"}) {
      for (const bool q : {false, true}) {
        run<Eigen::half>(m, q, d);
        run<float>(m, q, d);
      }
    }
    // The query-free scorers (docs/design.md 4.7): KeyDiff's fixed-point sum and its ranking.
    for (const char* proxy : {"keydiff", "knorm"}) {
      run<Eigen::half>("squeeze", false, d, proxy);
      run<float>("h2o", false, d, proxy);
    }
    // KVzip's observe (softmax_max) and compress.
    run_kvzip<Eigen::half>(d);
    run_kvzip<float>(d);
    std::printf("%s %016llx\n", vc::simd_level_name(l), static_cast<unsigned long long>(d.h));
    if (l == vc::SimdLevel::scalar) scalar = d.h;
    const bool scalar_bits = l == vc::SimdLevel::avx2 || l == vc::SimdLevel::neon;
    if (scalar_bits && d.h != scalar) {
      std::fprintf(stderr, "%s differs from the scalar path\n", vc::simd_level_name(l));
      status = 1;
    }
  }
  return status;
}
