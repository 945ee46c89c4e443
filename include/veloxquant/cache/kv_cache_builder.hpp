// veloxquant — KVCacheBuilder: one cache per model layer, with the shared SqueezeCoordinator or
// the pyramid schedule wired in (docs/design.md 2.7).
#pragma once

#include <Eigen/Core>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "kv_cache_factory.hpp"
#include "pyramidkv_cache.hpp"
#include "squeeze_cache.hpp"
#include "squeeze_coordinator.hpp"

namespace veloxquant::cache {

/// Builds the caches of a whole model.
class KVCacheBuilder {
 public:
  /// One cache per layer. A layer whose head dim is empty is not attention-bearing and gets a
  /// standard KVCache<T>. squeeze: one coordinator shared by the attention layers (n_layers = their
  /// count, layer_id = the raw layer index). pyramidkv: budgets from pyramid_budgets in
  /// attention-layer order. Throws std::invalid_argument for a bad config or a head dim < 1.
  template <class T = Eigen::half>
  static std::vector<std::unique_ptr<KVCache<T>>> for_model(
      const std::vector<std::optional<int>>& layer_head_dims, const KVCacheConfig& config) {
    return build<T>(layer_head_dims, config, true);
  }

  /// for_model with every one of `n_layers` layers attention-bearing.
  template <class T = Eigen::half>
  static std::vector<std::unique_ptr<KVCache<T>>> for_model(int n_layers,
                                                            const KVCacheConfig& config) {
    if (n_layers < 0) {
      throw std::invalid_argument("KVCacheBuilder::for_model: n_layers (" +
                                  std::to_string(n_layers) + ") must be >= 0");
    }
    config.validate();  // before anything is sized from n_layers
    // The head dims are unknown: the caches learn D (and check quant_group against it) from the
    // first call.
    return build<T>(std::vector<std::optional<int>>(static_cast<std::size_t>(n_layers), 1), config,
                    false);
  }

  /// Starts a new sequence: resets each distinct SqueezeCoordinator once, then every cache.
  /// Throws std::invalid_argument, before anything is reset, for a null entry.
  template <class T>
  static void reset(std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    for (std::size_t i = 0; i < caches.size(); ++i) {
      if (!caches[i]) {
        throw std::invalid_argument("KVCacheBuilder::reset: cache " + std::to_string(i) +
                                    " is null");
      }
    }
    std::set<SqueezeCoordinator*> seen;
    for (auto& c : caches) {
      if (auto* sq = dynamic_cast<SqueezeAttentionCache<T>*>(c.get())) {
        const auto coord = sq->coordinator();
        if (coord && seen.insert(coord.get()).second) coord->reset();
      }
    }
    for (auto& c : caches) c->reset();
  }

 private:
  // for_model; `dims_known`: the head dims are real (quant_group must divide them when some
  // width is below 16).
  template <class T>
  static std::vector<std::unique_ptr<KVCache<T>>> build(
      const std::vector<std::optional<int>>& layer_head_dims, const KVCacheConfig& config,
      bool dims_known) {
    config.validate();
    if (layer_head_dims.size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
      throw std::invalid_argument(
          "KVCacheBuilder::for_model: " + std::to_string(layer_head_dims.size()) +
          " layers (layer ids are ints: at most 2^31 - 1)");
    }
    const bool quantized = config.key_bits < 16 || config.value_bits < 16;
    std::vector<int> attention_layers;
    for (std::size_t i = 0; i < layer_head_dims.size(); ++i) {
      const std::optional<int>& d = layer_head_dims[i];
      if (!d) continue;
      if (*d < 1 || *d > detail::kMaxHeadDim) {
        throw std::invalid_argument(
            "KVCacheBuilder::for_model: head dim of layer " + std::to_string(i) + " (" +
            std::to_string(*d) + ") must be in [1, " + std::to_string(detail::kMaxHeadDim) + "]");
      }
      if (dims_known && quantized && *d % config.quant_group != 0) {
        throw std::invalid_argument("KVCacheBuilder::for_model: quant_group (" +
                                    std::to_string(config.quant_group) +
                                    ") must divide the head dim of layer " + std::to_string(i) +
                                    " (" + std::to_string(*d) + ")");
      }
      attention_layers.push_back(static_cast<int>(i));
    }
    const int n_attn = static_cast<int>(attention_layers.size());

    const detail::Method method = detail::method_of(config).id;
    std::shared_ptr<SqueezeCoordinator> coordinator;
    std::vector<int> pyramid;
    if (method == detail::Method::squeeze && n_attn > 0) {
      coordinator = std::make_shared<SqueezeCoordinator>(n_attn, config.squeeze_budget,
                                                         config.squeeze_n_sink,
                                                         config.squeeze_strength);
    } else if (method == detail::Method::pyramidkv) {
      pyramid = pyramid_budgets(n_attn, config.pyramid_budget, config.pyramid_n_sink,
                                config.pyramid_beta);
    }

    std::vector<std::unique_ptr<KVCache<T>>> caches;
    caches.reserve(layer_head_dims.size());
    std::size_t attn_index = 0;
    for (std::size_t i = 0; i < layer_head_dims.size(); ++i) {
      if (!layer_head_dims[i]) {
        caches.push_back(std::make_unique<KVCache<T>>(config));
        continue;
      }
      if (method == detail::Method::squeeze) {
        caches.push_back(
            std::make_unique<SqueezeAttentionCache<T>>(config, static_cast<int>(i), coordinator));
      } else if (method == detail::Method::pyramidkv) {
        KVCacheConfig layer_config = config;
        layer_config.pyramid_resolved_budget = pyramid[attn_index];
        caches.push_back(std::make_unique<PyramidKVCache<T>>(layer_config));
      } else {
        caches.push_back(KVCacheFactory::create<T>(config));
      }
      ++attn_index;
    }
    return caches;
  }
};

}  // namespace veloxquant::cache
