/// squeeze_demo: SqueezeAttention on a synthetic six-layer model.
///
/// Each layer's keys are `alpha_l * u_h + noise`: `u_h` is a fixed unit direction per head and the
/// noise is N(0, 1) per element. Deeper layers get a larger alpha, so their keys are more clustered
/// (higher concentration, about alpha^2 / (alpha^2 + D)). At the prefill boundary the coordinator
/// the builder shares between the layers moves budget from the clustered (deep) layers to the broad
/// (shallow) ones; the average stays at the configured budget.
///
/// Deterministic: every number comes from one fixed-seed std::mt19937.

#include <veloxquant/cache.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

namespace vc = veloxquant::cache;
using T = Eigen::half;  // storage type of every cache

namespace {

constexpr std::size_t kLayers = 6;
constexpr int kB = 1;         // batch size
constexpr int kH = 4;         // KV heads
constexpr int kD = 64;        // head dimension (keys and values)
constexpr int kPrompt = 256;  // prefill tokens
constexpr int kDecode = 128;  // decode steps, one token each
constexpr int kBudget = 64;   // average rows per head across layers

/// How strongly layer `layer` clusters its keys: 0 for the first layer, growing with depth.
float alpha_of(std::size_t layer) { return 2.5f * static_cast<float>(layer); }

/// One unit direction per head. Returns dirs: [H, D].
Eigen::MatrixXf make_directions(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Eigen::MatrixXf dirs(kH, kD);
  for (Eigen::Index i = 0; i < dirs.size(); ++i) dirs.data()[i] = normal(rng);
  for (Eigen::Index h = 0; h < dirs.rows(); ++h) dirs.row(h).normalize();
  return dirs;
}

/// `s` new tokens of one layer. dirs: [H, D]. Returns keys: [B, H, S, D].
vc::Tensor4<float> make_keys(std::mt19937& rng, const Eigen::MatrixXf& dirs, float alpha, int s) {
  std::normal_distribution<float> noise(0.0f, 1.0f);
  vc::Tensor4<float> keys(kB, kH, s, kD);
  for (int b = 0; b < kB; ++b)
    for (int h = 0; h < kH; ++h)
      for (int t = 0; t < s; ++t)
        for (int d = 0; d < kD; ++d) keys(b, h, t, d) = alpha * dirs(h, d) + noise(rng);
  return keys;
}

/// Values of `s` new tokens, plain noise (the policy never reads values). Returns [B, H, S, D].
vc::Tensor4<float> make_values(std::mt19937& rng, int s) {
  std::normal_distribution<float> noise(0.0f, 1.0f);
  vc::Tensor4<float> values(kB, kH, s, kD);
  for (Eigen::Index i = 0; i < values.size(); ++i) values.data()[i] = noise(rng);
  return values;
}

}  // namespace

int main() {
  vc::KVCacheConfig cfg;  // defaults: strength 1, recent ratio 0.5, decay 0.98
  cfg.method = "squeeze";
  cfg.squeeze_budget = kBudget;
  cfg.squeeze_n_sink = 4;

  // One cache per layer, all attention-bearing; the builder gives them one shared coordinator.
  std::vector<std::unique_ptr<vc::KVCache<T>>> caches =
      vc::KVCacheBuilder::for_model<T>(static_cast<int>(kLayers), cfg);

  std::mt19937 rng(20240404u);
  std::vector<Eigen::MatrixXf> dirs;  // per layer: [H, D]
  for (std::size_t l = 0; l < kLayers; ++l) dirs.push_back(make_directions(rng));

  // Prefill: the whole prompt, one call per layer. Layer l reports its concentration on this
  // call; the last layer's report completes the set and the coordinator publishes the budgets.
  for (std::size_t l = 0; l < kLayers; ++l) {
    const vc::Tensor4<float> keys = make_keys(rng, dirs[l], alpha_of(l), kPrompt);  // [B, H, S, D]
    const vc::Tensor4<float> values = make_values(rng, kPrompt);                    // [B, H, S, D]
    const vc::KVPair<T> kv = caches[l]->update_and_fetch(keys, values);  // [B, H, n_before + S, D]
    if (l == 0)
      std::printf("prefill: layer 0 returned [%ld, %ld, %ld, %ld] (every prompt row)\n",
                  static_cast<long>(kv.first.dimension(0)), static_cast<long>(kv.first.dimension(1)),
                  static_cast<long>(kv.first.dimension(2)), static_cast<long>(kv.first.dimension(3)));
  }

  // Decode: one token per call per layer. An engine rotates the new key with RoPE at position
  // offset() (the true position, never the retained row count) before handing it over.
  std::vector<long> window(kLayers, 0);  // rows the last decode call returned, per layer
  for (int step = 0; step < kDecode; ++step) {
    for (std::size_t l = 0; l < kLayers; ++l) {
      const std::int64_t position = caches[l]->offset();
      if (position != kPrompt + step) {
        std::fprintf(stderr, "layer %zu: offset %lld, expected %d\n", l,
                     static_cast<long long>(position), kPrompt + step);
        return 1;
      }
      const vc::Tensor4<float> keys = make_keys(rng, dirs[l], alpha_of(l), 1);  // [B, H, 1, D]
      const vc::Tensor4<float> values = make_values(rng, 1);                    // [B, H, 1, D]
      const vc::KVPair<T> kv = caches[l]->update_and_fetch(keys, values);  // [B, H, budget + 1, D]
      window[l] = static_cast<long>(kv.first.dimension(2));
    }
  }

  std::printf("\n%zu layers, B=%d, H=%d, D=%d, prompt %d + decode %d tokens, average budget %d\n\n",
              kLayers, kB, kH, kD, kPrompt, kDecode, kBudget);
  std::printf("layer  alpha  concentration  budget  kept rows  last window  kept bytes  full bytes"
              "  ratio\n");
  int budget_sum = 0;
  std::size_t kept_sum = 0, full_sum = 0;
  for (std::size_t l = 0; l < kLayers; ++l) {
    const vc::KVCache<T>& cache = *caches[l];
    const auto* squeeze = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&cache);
    if (squeeze == nullptr) {
      std::fprintf(stderr, "layer %zu is not a SqueezeAttentionCache\n", l);
      return 1;
    }
    budget_sum += squeeze->layer_budget();
    kept_sum += cache.kept_bytes();
    full_sum += cache.full_seq_bytes();
    std::printf("%5zu  %5.1f  %13.3f  %6d  %9lld  %11ld  %10zu  %10zu  %5.2f\n", l,
                static_cast<double>(alpha_of(l)), squeeze->concentration(),
                squeeze->layer_budget(), static_cast<long long>(cache.tokens_kept()),
                window[l], cache.kept_bytes(), cache.full_seq_bytes(),
                cache.compression_ratio());
  }
  std::printf("total                        %6d  %9s  %11s  %10zu  %10zu  %5.2f\n", budget_sum, "",
              "", kept_sum, full_sum,
              static_cast<double>(full_sum) / static_cast<double>(kept_sum));

  const auto* first = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(caches[0].get());
  std::printf("\nbudgets sum to %d (layers x average = %zu); coordinator finalised: %s\n",
              budget_sum, kLayers * static_cast<std::size_t>(kBudget),
              first->coordinator()->is_finalized() ? "yes" : "no");
  std::printf("offset() = %lld = %d tokens absorbed per sequence (tokens_seen() = B*H*tokens = %lld)\n",
              static_cast<long long>(caches[0]->offset()), kPrompt + kDecode,
              static_cast<long long>(caches[0]->tokens_seen()));
  std::printf("a full cache would hold %zu bytes; this one holds %zu\n", full_sum, kept_sum);
  return 0;
}
