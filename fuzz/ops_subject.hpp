// fuzz target `ops` (fuzz/fuzz_ops.hpp): the caches under test — every cache of the run (one,
// or a whole builder model), the layer the operations drive, its policy class as the public API
// shows it, and the shared coordinator.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ops_config.hpp"
#include "ops_input.hpp"

namespace veloxquant::fuzz::detail {

/// Everything a cache and its coordinator report without being called (the shared snapshot of
/// tests/support/subjects.hpp, read through the public API); compared around rejected calls.
using Snapshot = vt::Snapshot;

template <class T>
class CacheUnderTest {
 public:
  /// Makes the caches of `s` (throws what the factory, builder or constructor throws). Returns
  /// false when the builder made another number of caches than `s.layers`.
  bool make(const RunSpec& s) {
    owned.clear();
    layer = nullptr;
    if (s.builder()) {
      owned = vc::KVCacheBuilder::for_model<T>(s.layers, s.cfg);
      if (static_cast<int>(owned.size()) != s.layers) return false;
      layer = owned[static_cast<std::size_t>(s.layer)].get();
      return true;
    }
    std::unique_ptr<vc::KVCache<T>> c =
        s.direct ? construct(s.method, s.cfg) : vc::KVCacheFactory::create<T>(s.cfg);
    layer = c.get();
    owned.push_back(std::move(c));
    return true;
  }

  /// Typed pointers, checking that the factory/builder made the class of the method. Returns ""
  /// or what is wrong.
  std::string bind(const RunSpec& s) {
    vc::KVCache<T>* c = layer;
    if (c == nullptr) return "no cache was made";
    // Scores, positions, budget, n_sink and protected window are read through the public policy
    // classes (tests/support/test_support.hpp), never through the library's detail layer.
    scored = vt::visit_scored(*c, [](const auto&) {});
    core = vt::visit_core(*c, [](const auto&) {});
    squeeze = dynamic_cast<vc::SqueezeAttentionCache<T>*>(c);
    h2o = dynamic_cast<vc::H2OCache<T>*>(c);
    pyramid = dynamic_cast<vc::PyramidKVCache<T>*>(c);
    tova = dynamic_cast<vc::TOVACache<T>*>(c);
    stream = dynamic_cast<vc::StreamingLLMCache<T>*>(c);
    snap = dynamic_cast<vc::SnapKVCache<T>*>(c);
    if (!is_class_of(s)) return "the factory/builder made the wrong cache class for the method";
    if (s.method != Method::standard && c->is_trimmable()) return "an eviction cache is trimmable";
    if (s.squeeze_builder()) coordinator = squeeze->coordinator();
    return "";
  }

  /// Carries on with `caches` (a loaded or forked copy of `owned`): the layer under test keeps
  /// its index. Returns the set it replaces.
  std::vector<std::unique_ptr<vc::KVCache<T>>> replace(
      std::vector<std::unique_ptr<vc::KVCache<T>>> caches) {
    const std::size_t index = layer_index();
    std::vector<std::unique_ptr<vc::KVCache<T>>> old = std::move(owned);
    owned = std::move(caches);
    layer = owned[index].get();
    return old;
  }
  /// The index of the layer under test in `owned`.
  std::size_t layer_index() const {
    std::size_t index = 0;
    while (owned[index].get() != layer) ++index;
    return index;
  }

  Snapshot snapshot() const { return vt::snapshot(*layer, coordinator.get()); }

  std::vector<std::unique_ptr<vc::KVCache<T>>> owned;  ///< every cache of the run
  vc::KVCache<T>* layer = nullptr;                     ///< the one the operations drive
  bool scored = false;  ///< H2O core, TOVA or SnapKV: publishes scores() and positions()
  bool core = false;    ///< SqueezeAttention, H2O or PyramidKV: also budget(), protected_recent()
  vc::SqueezeAttentionCache<T>* squeeze = nullptr;
  vc::H2OCache<T>* h2o = nullptr;
  vc::PyramidKVCache<T>* pyramid = nullptr;
  vc::TOVACache<T>* tova = nullptr;
  vc::StreamingLLMCache<T>* stream = nullptr;
  vc::SnapKVCache<T>* snap = nullptr;
  std::shared_ptr<vc::SqueezeCoordinator> coordinator;  ///< squeeze builder models only
  vc::KVPair<T> out;  ///< the output reused by update_and_fetch_into

 private:
  /// The method's own class's constructor (a single cache: not a builder run).
  static std::unique_ptr<vc::KVCache<T>> construct(Method m, const vc::KVCacheConfig& cfg) {
    switch (m) {
      case Method::standard:
        return std::make_unique<vc::KVCache<T>>(cfg);
      case Method::squeeze:
        return std::make_unique<vc::SqueezeAttentionCache<T>>(cfg);
      case Method::h2o:
        return std::make_unique<vc::H2OCache<T>>(cfg);
      case Method::pyramidkv:
        return std::make_unique<vc::PyramidKVCache<T>>(cfg);
      case Method::tova:
        return std::make_unique<vc::TOVACache<T>>(cfg);
      case Method::streaming_llm:
        return std::make_unique<vc::StreamingLLMCache<T>>(cfg);
      case Method::snapkv:
        return std::make_unique<vc::SnapKVCache<T>>(cfg);
      default:  // a method without a run in kRunMethods
        return nullptr;
    }
  }

  /// Whether the bound cache is of the class `s` asks for.
  bool is_class_of(const RunSpec& s) const {
    switch (s.method) {
      case Method::standard:
        return !scored && !stream && layer->is_trimmable();
      case Method::squeeze:
        if (!s.builder()) return squeeze && !squeeze->coordinator() && !squeeze->layer_id();
        return squeeze && squeeze->coordinator() && squeeze->layer_id() == s.layer &&
               squeeze->coordinator()->n_layers() == s.layers;
      case Method::h2o:
        return h2o != nullptr;
      case Method::pyramidkv:
        return pyramid != nullptr;
      case Method::tova:
        return tova != nullptr;
      case Method::streaming_llm:
        return stream != nullptr;
      case Method::snapkv:
        return snap != nullptr;
      default:  // a method without a run in kRunMethods
        return false;
    }
  }
};

}  // namespace veloxquant::fuzz::detail
