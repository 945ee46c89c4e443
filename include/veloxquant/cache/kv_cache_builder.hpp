// veloxquant — KVCacheBuilder: one cache per model layer, with the shared SqueezeCoordinator or
// the pyramid schedule wired in (docs/design.md 2.7).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "kv_cache_factory.hpp"
#include "memory_pool.hpp"
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

  /// for_model, the set attached to `pool` (SPEC 19, docs/design.md 10.5): its layers' heads
  /// claim their floors at their first call (their shape is known from then on), and the pool
  /// takes rows from them, and gives them rows, with its other sets. Throws as for_model, and
  /// std::invalid_argument for the standard method (it never evicts: the pool could not take its
  /// rows), std::length_error when even one head of dim 1 per layer does not fit beside the
  /// floors the pool's sets claim; then nothing is attached.
  template <class T = Eigen::half>
  static std::vector<std::unique_ptr<KVCache<T>>> for_model(
      const std::vector<std::optional<int>>& layer_head_dims, const KVCacheConfig& config,
      MemoryPool& pool) {
    check_poolable(config, "KVCacheBuilder::for_model");
    std::vector<std::unique_ptr<KVCache<T>>> caches = for_model<T>(layer_head_dims, config);
    pool.attach(caches, "KVCacheBuilder::for_model");
    return caches;
  }
  template <class T = Eigen::half>
  static std::vector<std::unique_ptr<KVCache<T>>> for_model(int n_layers,
                                                            const KVCacheConfig& config,
                                                            MemoryPool& pool) {
    check_poolable(config, "KVCacheBuilder::for_model");
    std::vector<std::unique_ptr<KVCache<T>>> caches = for_model<T>(n_layers, config);
    pool.attach(caches, "KVCacheBuilder::for_model");
    return caches;
  }

  /// fork, the copy attached to `pool` (a fork without a pool joins its source's pool, if any).
  /// Throws as fork, and std::length_error when the copy's floors do not fit beside the pool's
  /// (then the copy is dropped and nothing is attached).
  template <class T>
  static std::vector<std::unique_ptr<KVCache<T>>> fork(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches, MemoryPool& pool) {
    std::vector<std::unique_ptr<KVCache<T>>> out = copy_set(caches);
    pool.attach(out, "KVCacheBuilder::fork");
    return out;
  }

  /// An independent copy of a model's set (docs/design.md 10.1, SPEC 13.1): the same classes,
  /// configs, retained rows (quantized rows stay quantized, compacted, at a capacity of exactly
  /// the rows retained), positions, scores, budgets, offset and counters; the copy's squeeze
  /// layers share one new coordinator per coordinator of the source, a copy of it (generation,
  /// reports, published budgets). Calls on the copy never change the source nor the other way
  /// round, and the same calls on both give bit-identical results. An empty set gives an empty
  /// set. Throws std::invalid_argument for a null entry or a cache of a class the library does
  /// not build (an engine's own subclass), and std::logic_error for a cache a call is running
  /// on; the source is never changed.
  template <class T>
  static std::vector<std::unique_ptr<KVCache<T>>> fork(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    std::vector<std::unique_ptr<KVCache<T>>> out = copy_set(caches);
    // The children of an attached set share its pool (SPEC 19).
    for (const auto& c : caches) {
      if (c->in_pool()) {
        MemoryPool::attach_to(c->pool_core(), out, "KVCacheBuilder::fork");
        break;
      }
    }
    return out;
  }

 private:
  /// fork's copy, attached to no pool.
  template <class T>
  static std::vector<std::unique_ptr<KVCache<T>>> copy_set(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    check_entries(caches, "KVCacheBuilder::fork");
    // Every source is held from before its coordinator is copied to the end, so that the copy
    // is of one moment of the set; the pool takes no rows of it meanwhile.
    const std::vector<detail::CallGate::Entry> entries = hold(caches, "KVCacheBuilder::fork");
    const std::vector<typename KVCache<T>::PoolTurn> turns =
        pool_turns(caches, "KVCacheBuilder::fork");
    detail::StateLinks links;
    for (const auto& c : caches) c->link_state(links);
    links.copy_saved([](const SqueezeCoordinator& co) {
      return SqueezeCoordinator::from_saved_state(co.saved_state());
    });
    std::vector<std::unique_ptr<KVCache<T>>> out;
    out.reserve(caches.size());
    for (std::size_t i = 0; i < caches.size(); ++i) {
      KVCache<T>& src = *caches[i];
      if (!KVCacheFactory::builds_class_of(src)) {
        throw std::invalid_argument("KVCacheBuilder::fork: cache " + std::to_string(i) +
                                    " is of a class the library does not build; it cannot be "
                                    "forked");
      }
      std::unique_ptr<KVCache<T>> copy = KVCacheFactory::create<T>(src.config());
      copy->fork_from(src, links);
      out.push_back(std::move(copy));
    }
    return out;
  }

 public:

  /// Marks the set's current state (docs/design.md 10.2, SPEC 13.2): every cache and every
  /// distinct coordinator of the set keep a checkpoint under one token, replacing the set's live
  /// one. The rows themselves are saved only when a later call is about to overwrite one. Throws
  /// std::invalid_argument for a null entry and std::logic_error for a cache a call is running
  /// on, before anything changes; if an allocation fails, the set holds no checkpoint (its
  /// state is unchanged).
  template <class T>
  static void checkpoint(std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    check_entries(caches, "KVCacheBuilder::checkpoint");
    const std::vector<detail::CallGate::Entry> entries = hold(caches, "KVCacheBuilder::checkpoint");
    const std::vector<typename KVCache<T>::PoolTurn> turns =
        pool_turns(caches, "KVCacheBuilder::checkpoint");
    const std::vector<SqueezeCoordinator*> coordinators = coordinators_of(caches);
    const std::uint64_t token = next_token();
    try {
      for (auto& c : caches) c->take_checkpoint(token);
      for (SqueezeCoordinator* co : coordinators) co->checkpoint(token);
    } catch (...) {
      for (auto& c : caches) c->drop_checkpoint();
      for (SqueezeCoordinator* co : coordinators) co->drop_checkpoint();
      throw;
    }
  }

  /// Returns every cache of the set, and its coordinators, to exactly the state of the set's live
  /// checkpoint, and consumes it: the caches stay the same objects, and the calls made next give
  /// bitwise what they would have given at the checkpoint. Throws std::logic_error, changing
  /// nothing, when some cache or coordinator of the set holds no live checkpoint of that same
  /// `checkpoint` call (none taken, dropped by a reset or a load, or consumed by a rollback), and
  /// std::invalid_argument for a null entry. Once it starts changing the set it cannot fail (it
  /// allocates nothing from there on).
  template <class T>
  static void rollback(std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    check_entries(caches, "KVCacheBuilder::rollback");
    const std::vector<detail::CallGate::Entry> entries = hold(caches, "KVCacheBuilder::rollback");
    const std::vector<typename KVCache<T>::PoolTurn> turns =
        pool_turns(caches, "KVCacheBuilder::rollback");
    const std::vector<SqueezeCoordinator*> coordinators = coordinators_of(caches);
    std::optional<std::uint64_t> token;
    const auto same = [&](std::optional<std::uint64_t> t, const std::string& what) {
      if (!t || (token && *t != *token)) {
        throw std::logic_error("KVCacheBuilder::rollback: " + what +
                               " holds no live checkpoint of this set (none was taken, a reset "
                               "or a load dropped it, or a rollback consumed it); nothing was "
                               "changed");
      }
      token = t;
    };
    for (std::size_t i = 0; i < caches.size(); ++i) {
      same(caches[i]->checkpoint_token(), "cache " + std::to_string(i));
    }
    for (SqueezeCoordinator* co : coordinators) same(co->checkpoint_token(), "its coordinator");
    for (auto& c : caches) {
      if (c->checkpoint_token()) c->roll_back();  // (a cache listed twice: once)
    }
    for (SqueezeCoordinator* co : coordinators) co->rollback();
  }

  /// KVzip's compress (SPEC 18, docs/design.md 6.1): the set's kvzip caches keep ceil(keep x R)
  /// of the R rows they hold (std::ceil of the double product), keep in (0, 1]: every head's sinks (kvzip_n_sink) and the rows no
  /// observe call has scored, each head's best-observed rows up to its floor (head_budget_floor
  /// of ceil(keep x its rows)), then the best-observed rows of the whole set, one threshold across
  /// layers and heads (ties keep the earlier position). Heads then hold their own numbers of rows
  /// (ragged_heads(): use attend or update_and_view) and the memory of the dropped rows is freed
  /// (kept_bytes() at once, the heap as far as the allocator allows). The standard caches of a
  /// model's non-attention layers are left as they are. Throws std::invalid_argument for a null
  /// entry, keep outside (0, 1], a cache of another method, or a kvzip cache not observed since
  /// its reset, and std::logic_error for a cache a call is running on; the set is then unchanged.
  /// A live checkpoint of the set still returns it to before the compress. Views of earlier calls
  /// are invalidated.
  template <class T>
  static void compress(std::vector<std::unique_ptr<KVCache<T>>>& caches, double keep) {
    check_entries(caches, "KVCacheBuilder::compress");
    const std::vector<detail::CallGate::Entry> entries = hold(caches, "KVCacheBuilder::compress");
    const std::vector<typename KVCache<T>::PoolTurn> turns =
        pool_turns(caches, "KVCacheBuilder::compress");
    std::vector<KVCache<T>*> set;
    set.reserve(caches.size());
    for (const auto& c : caches) {
      if (std::find(set.begin(), set.end(), c.get()) == set.end()) set.push_back(c.get());
    }
    KVCache<T>::compress_set(set, keep);
  }

  /// Starts a new sequence: resets each distinct SqueezeCoordinator once, then every cache.
  /// Throws std::invalid_argument, before anything is reset, for a null entry.
  template <class T>
  static void reset(std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    check_entries(caches, "KVCacheBuilder::reset");
    for (SqueezeCoordinator* co : coordinators_of(caches)) co->reset();
    for (auto& c : caches) c->reset();
  }

 private:
  // The distinct coordinators of the set's squeeze layers, in order of first use.
  template <class T>
  static std::vector<SqueezeCoordinator*> coordinators_of(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    std::vector<SqueezeCoordinator*> out;
    for (const auto& c : caches) {
      SqueezeCoordinator* co = c->shared_coordinator();
      if (co && std::find(out.begin(), out.end(), co) == out.end()) out.push_back(co);
    }
    return out;
  }
  // Holds the call gate of every cache of the set (the same cache twice: once) for a set's
  // operation; throws std::logic_error, holding none, when a call is running on one.
  template <class T>
  static std::vector<detail::CallGate::Entry> hold(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches, const char* api) {
    std::vector<detail::CallGate::Entry> entries;
    entries.reserve(caches.size());
    std::vector<const KVCache<T>*> seen;
    for (const auto& c : caches) {
      if (std::find(seen.begin(), seen.end(), c.get()) != seen.end()) continue;
      seen.push_back(c.get());
      entries.push_back(c->enter_set_operation(api));
    }
    return entries;
  }
  // One token per checkpoint call: a rollback takes only a checkpoint all of its set share.
  // Every distinct cache's turn in its pool, for a set operation (after hold: no call runs).
  template <class T>
  static std::vector<typename KVCache<T>::PoolTurn> pool_turns(
      const std::vector<std::unique_ptr<KVCache<T>>>& caches, const char* api) {
    std::vector<typename KVCache<T>::PoolTurn> turns;
    turns.reserve(caches.size());
    std::vector<const KVCache<T>*> seen;
    for (const auto& c : caches) {
      if (std::find(seen.begin(), seen.end(), c.get()) != seen.end()) continue;
      seen.push_back(c.get());
      if (c->in_pool()) turns.emplace_back(*c, api);
    }
    return turns;
  }
  static void check_poolable(const KVCacheConfig& config, const char* api) {
    if (detail::method_of(config).id == detail::Method::standard) {
      throw std::invalid_argument(std::string(api) +
                                  ": method 'standard' cannot join a memory pool (it never "
                                  "evicts, so the pool could not take its rows); use an evicting "
                                  "method");
    }
  }
  static std::uint64_t next_token() {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  // Throws std::invalid_argument naming the first null entry of `caches`.
  template <class T>
  static void check_entries(const std::vector<std::unique_ptr<KVCache<T>>>& caches,
                            const char* api) {
    for (std::size_t i = 0; i < caches.size(); ++i) {
      if (!caches[i]) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) + " is null");
      }
    }
  }

  // for_model; `dims_known`: the head dims are real (quant_group must divide them when some
  // width is below 16). Defined out of the class, so that it is not inline: with
  // VELOXQUANT_EXTERN_TEMPLATES a consumer TU does not compile it (extern_templates.hpp).
  template <class T>
  static std::vector<std::unique_ptr<KVCache<T>>> build(
      const std::vector<std::optional<int>>& layer_head_dims, const KVCacheConfig& config,
      bool dims_known);
};

template <class T>
std::vector<std::unique_ptr<KVCache<T>>> KVCacheBuilder::build(
    const std::vector<std::optional<int>>& layer_head_dims, const KVCacheConfig& config,
    bool dims_known) {
  config.validate();
  if (layer_head_dims.size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw std::invalid_argument(
        "KVCacheBuilder::for_model: " + std::to_string(layer_head_dims.size()) +
        " layers (layer ids are ints: at most 2^31 - 1)");
  }
  // Rows quantized along tokens need a head dim the group divides (channel-axis rows do not).
  const bool quantized = (config.key_bits < 16 && config.key_axis != "channel") ||
                         (config.value_bits < 16 && config.value_axis != "channel");
  std::vector<int> attention_layers;
  for (std::size_t i = 0; i < layer_head_dims.size(); ++i) {
    const std::optional<int>& d = layer_head_dims[i];
    if (!d) continue;
    if (*d < 1 || *d > detail::kMaxHeadDim) {
      throw std::invalid_argument("KVCacheBuilder::for_model: head dim of layer " +
                                  std::to_string(i) + " (" + std::to_string(*d) +
                                  ") must be in [1, " + std::to_string(detail::kMaxHeadDim) + "]");
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
    coordinator = std::make_shared<SqueezeCoordinator>(
        n_attn, config.squeeze_budget, config.squeeze_n_sink, config.squeeze_strength);
  } else if (method == detail::Method::pyramidkv) {
    pyramid =
        pyramid_budgets(n_attn, config.pyramid_budget, config.pyramid_n_sink, config.pyramid_beta);
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

}  // namespace veloxquant::cache
