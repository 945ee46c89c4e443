// Consumer program shared by the packaging tests (tests/cmake/*): it includes the umbrella header
// the way an application would, builds a two-layer SqueezeAttention model with the builder and
// checks the shapes the first two calls return. Exits nonzero on any mismatch.

#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>
#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;

namespace {

constexpr int kB = 1, kH = 2, kS = 8, kD = 4;

/// A random [B, H, S, D] half tensor.
vc::Tensor4<Eigen::half> random_rows(int s) {
  vc::Tensor4<float> rows(kB, kH, s, kD);
  rows.setRandom();
  return rows.cast<Eigen::half>();
}

bool has_shape(const vc::Tensor4<Eigen::half>& t, Eigen::Index b, Eigen::Index h, Eigen::Index n,
               Eigen::Index d) {
  return t.dimension(0) == b && t.dimension(1) == h && t.dimension(2) == n && t.dimension(3) == d;
}

int run() {
  vc::KVCacheConfig cfg;
  cfg.method = "squeeze";
  cfg.squeeze_budget = 16;
  cfg.squeeze_n_sink = 2;

  std::vector<std::unique_ptr<vc::KVCache<Eigen::half>>> caches =
      vc::KVCacheBuilder::for_model<Eigen::half>(2, cfg);
  if (caches.size() != 2) {
    std::fprintf(stderr, "expected 2 caches, got %zu\n", caches.size());
    return 1;
  }

  // Prefill (S rows), then one decode row: nothing is evicted below the budget.
  for (const int step_rows : {kS, 1}) {
    const Eigen::Index expected = step_rows == kS ? kS : kS + 1;
    for (std::size_t layer = 0; layer < caches.size(); ++layer) {
      const vc::KVPair<Eigen::half> kv =
          caches[layer]->update_and_fetch(random_rows(step_rows), random_rows(step_rows));
      if (!has_shape(kv.first, kB, kH, expected, kD) ||
          !has_shape(kv.second, kB, kH, expected, kD)) {
        std::fprintf(
            stderr,
            "layer %zu: unexpected shape [%ld, %ld, %ld, %ld], expected [%d, %d, %ld, %d]\n", layer,
            static_cast<long>(kv.first.dimension(0)), static_cast<long>(kv.first.dimension(1)),
            static_cast<long>(kv.first.dimension(2)), static_cast<long>(kv.first.dimension(3)), kB,
            kH, static_cast<long>(expected), kD);
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
#if defined(_OPENMP)
  // The library must not impose -fopenmp (or any other flag) on its consumers.
  std::fprintf(stderr, "veloxquant's package made this consumer compile with OpenMP\n");
  return 1;
#else
  try {
    const int rc = run();
    if (rc == 0) std::printf("veloxquant consumer: OK\n");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exception: %s\n", e.what());
    return 1;
  }
#endif
}
