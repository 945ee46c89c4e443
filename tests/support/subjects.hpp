// Caches of every method ("subjects", support/methods.hpp), one snapshot of everything observable
// about them through the public API, every update API a call can go through, the calls' results in
// a comparable form, and the parsing of error messages. No GoogleTest here: the fuzzer
// (fuzz/fuzz_ops.hpp) shares it with the tests; support/contract.hpp adds the GoogleTest-side
// helpers.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/methods.hpp"
#include "support/test_support.hpp"

namespace veloxquant::test {

namespace vc = veloxquant::cache;

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kDblMax = std::numeric_limits<double>::max();
inline constexpr double kDenorm = std::numeric_limits<double>::denorm_min();

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Caches of every method (the subjects: support/methods.hpp)
// ---------------------------------------------------------------------------------------------

/// Budget 6 everywhere (StreamingLLM: 1 sink + window 5; squeeze before adoption: 8); the storage
/// above.
inline vc::KVCacheConfig small_config() {
  vc::KVCacheConfig c;
  c.key_bits = kKeyBits;
  c.value_bits = kValueBits;
  c.quant_group = kQuantGroup;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  set_n_sinks(c, 1);
  c.set_budget(6);
  c.squeeze_budget = 8;
  c.h2o_grace = 2;
  c.snap_obs_window = 2;
  return c;
}

template <class T>
struct Subject {
  std::shared_ptr<vc::SqueezeCoordinator> coordinator;
  std::unique_ptr<vc::KVCache<T>> cache;
};

/// The subject `kind` over `c` (small_config by default), its heads serial. The plain squeeze
/// subject keeps 6 rows; a wired one gets its own coordinator of 1 layer (coordinated) or 2
/// (deferring), of average budget 6 and 1 sink.
template <class T>
Subject<T> make_subject(Kind kind, vc::KVCacheConfig c = small_config()) {
  Subject<T> s;
  if (kind.wiring != Wiring::alone) {
    const int layers = kind.wiring == Wiring::coordinated ? 1 : 2;
    s.coordinator = std::make_shared<vc::SqueezeCoordinator>(layers, 6, 1, 1.0);
  } else if (kind.method == Method::squeeze) {
    c.squeeze_budget = 6;
  }
  s.cache = make_kind<T>(kind, c, s.coordinator);
  s.cache->set_parallel_heads(false);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Ragged heads (adaptive head budgets, SPEC 14)
// ---------------------------------------------------------------------------------------------

/// Rows each head of `c` holds, b-major (positions(b, h) of the H2O core, the only policies whose
/// heads may differ); empty for the other policies and before the first call.
template <class T>
std::vector<std::size_t> core_head_rows(const vc::KVCache<T>& c) {
  std::vector<std::size_t> out;
  visit_core(c, [&](const auto& p) {
    for (Index b = 0; b < c.batch(); ++b)
      for (Index h = 0; h < c.heads(); ++h) out.push_back(p.positions(b, h).size());
  });
  return out;
}

/// Whether the heads of `c` hold different numbers of rows: only adaptive heads can (SPEC 14),
/// and update_and_fetch(_into) and state() then refuse.
template <class T>
bool ragged_heads(const vc::KVCache<T>& c) {
  if (c.config().head_budgets != "adaptive") return false;
  const std::vector<std::size_t> rows = core_head_rows(c);
  return std::adjacent_find(rows.begin(), rows.end(), std::not_equal_to<>()) != rows.end();
}

/// One head's rows as a view shows them: positions ascending, and at each the key's bytes, then
/// (in `values`) the value's, [n, Dk] and [n, Dv] like one head of state().
struct HeadRows {
  std::vector<std::int64_t> positions;
  std::vector<unsigned char> keys, values;
};

/// Every head's rows (b-major), through an empty update_and_view, which changes nothing
/// (docs/design.md 8) and serves ragged heads, which state() refuses. Empty before the first call.
template <class T>
std::vector<HeadRows> held_rows(vc::KVCache<T>& cache) {
  std::vector<HeadRows> out;
  if (cache.batch() == 0) return out;
  const Index B = cache.batch(), H = cache.heads(), Dk = cache.key_dim(), Dv = cache.value_dim();
  const vc::Tensor4<T> k(B, H, 0, Dk), v(B, H, 0, Dv);
  const vc::KVView<T> view = cache.update_and_view(k, v);
  const auto kb = static_cast<std::size_t>(Dk) * sizeof(T);
  const auto vb = static_cast<std::size_t>(Dv) * sizeof(T);
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const Index n = view.rows(b, h);
      std::vector<Index> order(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
      std::sort(order.begin(), order.end(), [&](Index x, Index y) {
        return view.positions(b, h)(x) < view.positions(b, h)(y);
      });
      HeadRows r;
      r.keys.resize(static_cast<std::size_t>(n) * kb);
      r.values.resize(static_cast<std::size_t>(n) * vb);
      for (std::size_t j = 0; j < order.size(); ++j) {
        const Index i = order[j];
        r.positions.push_back(view.positions(b, h)(i));
        std::memcpy(r.keys.data() + j * kb, view.keys(b, h).row(i).data(), kb);
        std::memcpy(r.values.data() + j * vb, view.values(b, h).row(i).data(), vb);
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

/// Everything observable about a cache and its coordinator.
struct Snapshot : BasicSnapshot {
  std::size_t heap = 0;
  // Scores bitwise: a NaN score (see FiniteKeysWhoseProductsOverflow...) equals itself here.
  std::vector<std::vector<unsigned char>> scores;
  std::vector<std::vector<std::int64_t>> positions;
  std::optional<int> budget;
  int protected_recent = -1;
  int layer_budget = -1;
  bool adopted = false;
  double concentration = 0.0;
  bool compressed = false;
  std::map<int, double> reports;
  bool finalized = false;
  std::uint64_t generation = 0;  // the coordinator's generation() (bumped by its reset())
  // Ragged heads (SPEC 14), which state() refuses: the BasicSnapshot's state() fields stay empty
  // and each head's rows are kept instead (b-major, ascending position, as held_rows reads them).
  bool ragged = false;
  std::vector<std::vector<unsigned char>> head_keys, head_values;

  bool operator==(const Snapshot& o) const {
    return BasicSnapshot::operator==(o) && ragged == o.ragged && head_keys == o.head_keys &&
           head_values == o.head_values && heap == o.heap && scores == o.scores &&
           positions == o.positions && budget == o.budget &&
           protected_recent == o.protected_recent && layer_budget == o.layer_budget &&
           adopted == o.adopted && concentration == o.concentration && compressed == o.compressed &&
           reports == o.reports && finalized == o.finalized && generation == o.generation;
  }
};

/// The snapshot of `c` and of its coordinator (none: nullptr), for a cache not held in a Subject
/// (the fuzzer's, fuzz/fuzz_ops.hpp).
template <class T>
Snapshot snapshot(const vc::KVCache<T>& c, const vc::SqueezeCoordinator* coordinator) {
  Snapshot out;
  if (ragged_heads(c)) {
    // state() refuses ragged heads; their rows come through an empty update_and_view, the one
    // public way to them, which changes nothing observable (docs/design.md 8) but is not const:
    // every cache the tests and the fuzzer snapshot is a non-const object. (A quantized cache's
    // first view sizes its view buffer: the heap is read after it.)
    out.ragged = true;
    for (HeadRows& r : held_rows(const_cast<vc::KVCache<T>&>(c))) {
      out.head_keys.push_back(std::move(r.keys));
      out.head_values.push_back(std::move(r.values));
    }
    take_basic_counters(c, out);
  } else {
    take_basic_snapshot(c, out);
  }
  out.heap = c.heap_bytes();
  visit_scored(c, [&](const auto& p) {
    for (Index b = 0; b < c.batch(); ++b) {
      for (Index h = 0; h < c.heads(); ++h) {
        const std::vector<float> sc = p.scores(b, h);
        std::vector<unsigned char> bytes(sc.size() * sizeof(float));
        if (!sc.empty()) std::memcpy(bytes.data(), sc.data(), bytes.size());
        out.scores.push_back(std::move(bytes));
        out.positions.push_back(p.positions(b, h));
      }
    }
  });
  visit_core(c, [&](const auto& p) {
    out.budget = p.budget();
    out.protected_recent = p.protected_recent();
  });
  if (const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&c)) {
    out.layer_budget = sq->layer_budget();
    out.adopted = sq->budget_adopted();
    out.concentration = sq->concentration();
  }
  if (const auto* snap = dynamic_cast<const vc::SnapKVCache<T>*>(&c)) {
    out.compressed = snap->compressed();
  }
  if (coordinator) {
    out.reports = coordinator->reports();
    out.finalized = coordinator->is_finalized();
    out.generation = coordinator->generation();
  }
  return out;
}

template <class T>
Snapshot snapshot(const Subject<T>& s) {
  return snapshot(*s.cache, s.coordinator.get());
}

/// The coordinator of a squeeze layer (nullptr for the other caches).
template <class T>
const vc::SqueezeCoordinator* coordinator_of(const vc::KVCache<T>& c) {
  const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&c);
  return sq ? sq->coordinator().get() : nullptr;
}

/// Everything observable but the heap, whose capacity depends on the history (a reset keeps
/// allocations) and on the worker count (scratch per thread), and on the
/// entry point (attend sizes scratch for its output).
template <class T>
Snapshot logical_state(const Subject<T>& s) {
  Snapshot out = snapshot(s);
  out.heap = 0;
  return out;
}

/// logical_state of every cache of a model's set, each with its coordinator's state (a squeeze
/// layer's), in the set's order.
template <class T>
std::vector<Snapshot> model_state(const std::vector<std::unique_ptr<vc::KVCache<T>>>& caches) {
  std::vector<Snapshot> out;
  for (const auto& c : caches) {
    const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(c.get());
    Snapshot s = snapshot(*c, sq ? sq->coordinator().get() : nullptr);
    s.heap = 0;
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The APIs a call can go through
// ---------------------------------------------------------------------------------------------

enum class Api {
  kFetch,
  kView,
  kFetchInto,
  kFetchQ,
  kViewQ,
  kFetchIntoQ,
  kFetchDouble,
  kViewDouble,
  kFetchIntoDoubleQ,
};
inline constexpr Api kApis[] = {Api::kFetch,       Api::kView,       Api::kFetchInto,
                         Api::kFetchQ,      Api::kViewQ,      Api::kFetchIntoQ,
                         Api::kFetchDouble, Api::kViewDouble, Api::kFetchIntoDoubleQ};

inline const char* api_name(Api a) {
  switch (a) {
    case Api::kFetch:
      return "update_and_fetch";
    case Api::kView:
      return "update_and_view";
    case Api::kFetchInto:
      return "update_and_fetch_into";
    case Api::kFetchQ:
      return "update_and_fetch(queries)";
    case Api::kViewQ:
      return "update_and_view(queries)";
    case Api::kFetchIntoQ:
      return "update_and_fetch_into(queries)";
    case Api::kFetchDouble:
      return "update_and_fetch(double)";
    case Api::kViewDouble:
      return "update_and_view(double)";
    case Api::kFetchIntoDoubleQ:
      return "update_and_fetch_into(double, double queries)";
  }
  return "?";
}

/// One call's inputs: double keys/values (converted to T for the storage-type APIs) and queries
/// [B, 2H, S, Dk] (valid, so any error is about the keys and values).
struct Call {
  vc::Tensor4<double> keys, values, queries;
};

inline Call random_call(std::mt19937& rng, const Shape& k, const Shape& v) {
  Call c{random_doubles(rng, k), random_doubles(rng, v),
         random_doubles(rng, {k[0], 2 * k[1], k[2], k[3]})};
  return c;
}

/// A call for the APIs without queries: random keys and values, no queries drawn (its queries
/// tensor is empty; a query API must not be given it).
inline Call random_kv_call(std::mt19937& rng, const Shape& k, const Shape& v) {
  Call c;
  c.keys = random_doubles(rng, k);
  c.values = random_doubles(rng, v);
  return c;
}

/// What a call gave back, comparable between a cache and its twin: fetched tensors, or a view's
/// rows keyed by position (the order of earlier rows in a view is free, docs/design.md 2.3) with the
/// positions of the call's own rows, which come last in arrival order.
struct Returned {
  std::vector<unsigned char> keys, values;
  Shape key_shape{}, value_shape{};
  std::map<std::int64_t, std::vector<unsigned char>> view_rows;
  std::vector<std::int64_t> view_tail;

  bool operator==(const Returned& o) const {
    return keys == o.keys && values == o.values && key_shape == o.key_shape &&
           value_shape == o.value_shape && view_rows == o.view_rows && view_tail == o.view_tail;
  }
};

template <class T>
Returned from_view(const vc::KVView<T>& v) {
  Returned r;
  for (Index b = 0; b < v.batch(); ++b) {
    for (Index h = 0; h < v.heads(); ++h) {
      // rows(b, h): heads may hold different numbers of rows (adaptive head budgets, SPEC 14).
      const Index rows = v.rows(b, h);
      for (Index i = 0; i < rows; ++i) {
        std::vector<unsigned char> bytes(static_cast<std::size_t>(v.key_dim() + v.value_dim()) *
                                         sizeof(T));
        std::memcpy(bytes.data(), v.keys(b, h).row(i).data(),
                    static_cast<std::size_t>(v.key_dim()) * sizeof(T));
        std::memcpy(bytes.data() + static_cast<std::size_t>(v.key_dim()) * sizeof(T),
                    v.values(b, h).row(i).data(),
                    static_cast<std::size_t>(v.value_dim()) * sizeof(T));
        const std::int64_t pos = v.positions(b, h)(i);
        r.view_rows[(b * v.heads() + h) * 1000000 + pos] = std::move(bytes);
        if (i >= rows - v.new_rows()) r.view_tail.push_back(pos);
      }
    }
  }
  return r;
}

template <class T>
Returned from_pair(const vc::KVPair<T>& p) {
  Returned r;
  r.keys = bytes_of(p.first);
  r.values = bytes_of(p.second);
  r.key_shape = shape_of(p.first);
  r.value_shape = shape_of(p.second);
  return r;
}

inline bool is_view_api(Api a) {
  return a == Api::kView || a == Api::kViewQ || a == Api::kViewDouble;
}
inline bool is_into_api(Api a) {
  return a == Api::kFetchInto || a == Api::kFetchIntoQ || a == Api::kFetchIntoDoubleQ;
}

/// Thrown by a helper without GoogleTest when a cache breaks the contract (the test reports it
/// as an exception it did not expect).
struct ContractViolation : std::logic_error {
  using std::logic_error::logic_error;
};

/// Whether `what` is the refusal of a fetch on ragged heads: it names attend and update_and_view
/// (SPEC 14).
inline bool is_ragged_refusal(const std::string& what) {
  return contains(what, "attend") && contains(what, "update_and_view");
}

/// A fetching call (`fetch`, through `api`) on ragged heads (SPEC 14): it must throw
/// std::invalid_argument naming attend and update_and_view and change nothing, neither the cache
/// and its coordinator (snapshot) nor `into` (ContractViolation otherwise). Another
/// std::invalid_argument is rethrown: a bad call's own error comes first. The same call then goes
/// through update_and_view (`view`), whose return is returned, so that a sequence of calls goes
/// on whatever API it names.
template <class T, class Fetch, class View>
Returned refused_then_viewed(vc::KVCache<T>& cache, Api api, vc::KVPair<T>& into,
                             const Fetch& fetch, const View& view);

/// Runs one call through `api`. `into` is the reused output of the fetch_into APIs. A fetching
/// API on ragged heads (adaptive head budgets) is refused and the call made as a view
/// (refused_then_viewed).
template <class T>
Returned invoke(vc::KVCache<T>& cache, Api api, const Call& c, vc::KVPair<T>& into);

/// invoke() with the API as given (no refusal handled).
template <class T>
Returned invoke_as_given(vc::KVCache<T>& cache, Api api, const Call& c, vc::KVPair<T>& into) {
  const vc::Tensor4<T> k = converted<T>(c.keys);
  const vc::Tensor4<T> v = converted<T>(c.values);
  const vc::Tensor4<float> q = converted<float>(c.queries);
  switch (api) {
    case Api::kFetch:
      return from_pair(cache.update_and_fetch(k, v));
    case Api::kView:
      return from_view(cache.update_and_view(k, v));
    case Api::kFetchInto:
      cache.update_and_fetch_into(k, v, into);
      return from_pair(into);
    case Api::kFetchQ:
      return from_pair(cache.update_and_fetch(k, v, q));
    case Api::kViewQ:
      return from_view(cache.update_and_view(k, v, q));
    case Api::kFetchIntoQ:
      cache.update_and_fetch_into(k, v, q, into);
      return from_pair(into);
    case Api::kFetchDouble:
      return from_pair(cache.update_and_fetch(c.keys, c.values));
    case Api::kViewDouble:
      return from_view(cache.update_and_view(c.keys, c.values));
    case Api::kFetchIntoDoubleQ:
      cache.update_and_fetch_into(c.keys, c.values, c.queries, into);
      return from_pair(into);
  }
  return {};
}

template <class T, class Fetch, class View>
Returned refused_then_viewed(vc::KVCache<T>& cache, Api api, vc::KVPair<T>& into,
                             const Fetch& fetch, const View& view) {
  const std::string where = std::string(api_name(api)) + " on ragged heads";
  const Snapshot before = snapshot(cache, coordinator_of(cache));
  const std::vector<unsigned char> into_keys = bytes_of(into.first);
  const std::vector<unsigned char> into_values = bytes_of(into.second);
  const Shape into_shape = shape_of(into.first);
  try {
    fetch();
  } catch (const std::invalid_argument& e) {
    if (!is_ragged_refusal(e.what())) throw;
    if (!(snapshot(cache, coordinator_of(cache)) == before)) {
      throw ContractViolation(where + ": refused, but the cache changed");
    }
    if (shape_of(into.first) != into_shape || bytes_of(into.first) != into_keys ||
        bytes_of(into.second) != into_values) {
      throw ContractViolation(where + ": refused, but the fetch_into output was touched");
    }
    return view();
  }
  throw ContractViolation(where +
                          " was accepted (SPEC 14: std::invalid_argument naming attend "
                          "and update_and_view)");
}

template <class T>
Returned invoke(vc::KVCache<T>& cache, Api api, const Call& c, vc::KVPair<T>& into) {
  if (is_view_api(api) || !ragged_heads(cache)) return invoke_as_given(cache, api, c, into);
  return refused_then_viewed(
      cache, api, into, [&] { (void)invoke_as_given(cache, api, c, into); },
      [&] {
        switch (api) {
          case Api::kFetch:
          case Api::kFetchInto:
            return invoke_as_given(cache, Api::kView, c, into);
          case Api::kFetchQ:
          case Api::kFetchIntoQ:
            return invoke_as_given(cache, Api::kViewQ, c, into);
          case Api::kFetchDouble:
            return invoke_as_given(cache, Api::kViewDouble, c, into);
          default:  // kFetchIntoDoubleQ: double keys, values and queries
            return from_view(cache.update_and_view(c.keys, c.values, c.queries));
        }
      });
}

inline constexpr Shape kKeys{2, 2, 3, dim(4)};
inline constexpr Shape kValues{2, 2, 3, dim(3)};

/// Bytes one retained row (key and value) of the subjects takes: (Dk + Dv) elements of T, or a
/// quantized row's codes (bits / 8 per element) and a 2-byte scale and offset per group, rounded
/// up to whole elements of T (docs/design.md 7.4).
template <class T>
std::size_t stored_row_bytes() {
  const auto one = [](int bits, Index d) -> std::size_t {
    if (bits == 16) return static_cast<std::size_t>(d) * sizeof(T);
    const auto bytes = static_cast<std::size_t>(d * bits / 8 + 4 * (d / kQuantGroup));
    return (bytes + sizeof(T) - 1) / sizeof(T) * sizeof(T);
  };
  return one(kKeyBits, kKeys[3]) + one(kValueBits, kValues[3]);
}

/// The rows of a call as caches of storage `storage` (the subjects' by default) store and
/// return them: converted to T, or quantized and dequantized (a standard cache of that storage,
/// fed the call).
template <class T>
vc::KVPair<T> stored_call(const vc::Tensor4<double>& keys, const vc::Tensor4<double>& values,
                          const vc::KVCacheConfig& storage = small_config()) {
  if (storage.key_bits == 16 && storage.value_bits == 16) {
    return {converted<T>(keys), converted<T>(values)};
  }
  vc::KVCacheConfig c = storage;
  c.method = "standard";
  vc::KVCache<T> standard(c);
  return standard.update_and_fetch(keys, values);
}

inline Shape with_s(Shape s, Index S) {
  s[2] = S;
  return s;
}

/// Parses "b=.., h=.., s=.., d=.." out of an error message; nullopt if absent.
inline std::optional<Shape> named_index(const std::string& what) {
  Shape out{};
  std::size_t at = 0;
  const char* keys[] = {"b=", "h=", "s=", "d="};
  for (int i = 0; i < 4; ++i) {
    at = what.find(keys[i], at);
    if (at == std::string::npos) return std::nullopt;
    at += 2;
    std::size_t used = 0;
    try {
      out[static_cast<std::size_t>(i)] = std::stoll(what.substr(at), &used);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    at += used;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Calls with queries of any element type, and the list of bad queries
// ---------------------------------------------------------------------------------------------

/// The three entry points with queries (float32 queries and keys as T in the typed sweeps).
inline constexpr Api kQueryApis[] = {Api::kFetchQ, Api::kViewQ, Api::kFetchIntoQ};

/// One call through the entry point of `api` (fetch, view or fetch_into) with keys and values of
/// any element type U (converted by the cache when U is not T) and queries of any element type Q.
/// A fetching API on ragged heads is refused and the call made as a view (refused_then_viewed).
/// k, v: [B, H, S, D*]; q: [B, G * H, S, Dk].
template <class T, class U, class Q>
Returned invoke_with(vc::KVCache<T>& cache, Api api, const vc::Tensor4<U>& k,
                     const vc::Tensor4<U>& v, const vc::Tensor4<Q>& q, vc::KVPair<T>& into) {
  if (is_view_api(api)) return from_view(cache.update_and_view(k, v, q));
  const auto fetch = [&] {
    if (is_into_api(api)) {
      cache.update_and_fetch_into(k, v, q, into);
      return from_pair(into);
    }
    return from_pair(cache.update_and_fetch(k, v, q));
  };
  if (!ragged_heads(cache)) return fetch();
  return refused_then_viewed(
      cache, api, into, [&] { (void)fetch(); },
      [&] { return from_view(cache.update_and_view(k, v, q)); });
}

/// The same call without queries (key-as-query scoring).
template <class T, class U>
Returned invoke_without_queries(vc::KVCache<T>& cache, Api api, const vc::Tensor4<U>& k,
                                const vc::Tensor4<U>& v, vc::KVPair<T>& into) {
  if (is_view_api(api)) return from_view(cache.update_and_view(k, v));
  const auto fetch = [&] {
    if (is_into_api(api)) {
      cache.update_and_fetch_into(k, v, into);
      return from_pair(into);
    }
    return from_pair(cache.update_and_fetch(k, v));
  };
  if (!ragged_heads(cache)) return fetch();
  return refused_then_viewed(
      cache, api, into, [&] { (void)fetch(); },
      [&] { return from_view(cache.update_and_view(k, v)); });
}

/// Random [B, Hq, S, D] float32 queries with N(0, sigma^2) entries.
inline vc::Tensor4<float> random_queries(std::mt19937& rng, Index B, Index Hq, Index S, Index D,
                                         double sigma = 1.0) {
  std::normal_distribution<double> dist(0.0, sigma);
  vc::Tensor4<float> t(B, Hq, S, D);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(dist(rng));
  return t;
}

/// One invalid query tensor (the query side of the list of bad calls); as float32, double or half.
struct BadQueries {
  std::string name;
  enum class Type { kFloat, kDouble, kHalf } type = Type::kFloat;
  vc::Tensor4<float> f;
  vc::Tensor4<double> d;
  vc::Tensor4<Eigen::half> h;
};

/// Every way a query tensor can be wrong for a call with valid queries `q` ([B, G * H, S, D])
/// against H KV heads: B, Hq, S or D off, and non-finite entries at several places (also a double
/// that overflows float32, and a half infinity).
inline std::vector<BadQueries> bad_query_variants(const vc::Tensor4<float>& q, Index H,
                                                  std::mt19937& rng) {
  const Index B = q.dimension(0), Hq = q.dimension(1), S = q.dimension(2), D = q.dimension(3);
  std::vector<BadQueries> out;
  const auto shaped = [&](std::string name, Index b, Index hq, Index s, Index d) {
    BadQueries bq;
    bq.name = std::move(name);
    bq.f = random_queries(rng, b, hq, s, d);
    out.push_back(std::move(bq));
  };
  shaped("queries B + 1", B + 1, Hq, S, D);
  shaped("queries B - 1", B - 1, Hq, S, D);
  shaped("queries Hq = 0", B, 0, S, D);
  if (H > 1) {
    shaped("queries Hq = G*H + 1 (not a multiple of H)", B, Hq + 1, S, D);
    shaped("queries Hq = H - 1 (not a multiple of H)", B, H - 1, S, D);
  }
  shaped("queries S + 1", B, Hq, S + 1, D);
  if (S > 0) shaped("queries S - 1", B, Hq, S - 1, D);
  shaped("queries D + 1", B, Hq, S, D + 1);
  shaped("queries D - 1", B, Hq, S, D - 1);
  if (q.size() == 0) return out;
  std::uniform_int_distribution<Index> any(0, q.size() - 1);
  const std::vector<std::pair<std::string, std::pair<double, Index>>> bad = {
      {"NaN query first", {kNaN, 0}},
      {"NaN query last", {kNaN, q.size() - 1}},
      {"NaN query inside", {kNaN, any(rng)}},
      {"+Inf query", {kInf, any(rng)}},
      {"-Inf query", {-kInf, any(rng)}}};
  for (const auto& [name, at] : bad) {
    BadQueries bq;
    bq.name = name + " at flat index " + std::to_string(at.second);
    bq.f = q;
    bq.f.data()[at.second] = static_cast<float>(at.first);
    out.push_back(std::move(bq));
  }
  for (const double big : {1e300, -1e300, 1e39}) {
    BadQueries bq;
    const Index at = any(rng);
    bq.name = "double query " + std::to_string(big) + " (overflows float32) at " + std::to_string(at);
    bq.type = BadQueries::Type::kDouble;
    bq.d = q.template cast<double>();
    bq.d.data()[at] = big;
    out.push_back(std::move(bq));
  }
  {
    BadQueries bq;
    const Index at = any(rng);
    bq.name = "half +Inf query at " + std::to_string(at);
    bq.type = BadQueries::Type::kHalf;
    bq.h = q.template cast<Eigen::half>();
    bq.h.data()[at] = Eigen::half(std::numeric_limits<float>::infinity());
    out.push_back(std::move(bq));
  }
  return out;
}

/// A fetch_into output of an earlier call, for checks that a refused call leaves it alone: the
/// cache's state(), or on ragged heads, which state() refuses, [B, H, 1, D] tensors of 0.5.
template <class T>
vc::KVPair<T> earlier_output(const vc::KVCache<T>& c) {
  if (!ragged_heads(c)) return c.state();
  vc::KVPair<T> out{vc::Tensor4<T>(c.batch(), c.heads(), 1, c.key_dim()),
                    vc::Tensor4<T>(c.batch(), c.heads(), 1, c.value_dim())};
  out.first.setConstant(T(0.5f));
  out.second.setConstant(T(0.5f));
  return out;
}

/// The call of invoke_with with the bad queries `bq` (whatever their element type).
template <class T, class U>
Returned invoke_with(vc::KVCache<T>& cache, Api api, const vc::Tensor4<U>& k,
                     const vc::Tensor4<U>& v, const BadQueries& bq, vc::KVPair<T>& into) {
  switch (bq.type) {
    case BadQueries::Type::kFloat:
      return invoke_with(cache, api, k, v, bq.f, into);
    case BadQueries::Type::kDouble:
      return invoke_with(cache, api, k, v, bq.d, into);
    case BadQueries::Type::kHalf:
      return invoke_with(cache, api, k, v, bq.h, into);
  }
  return {};
}

/// The call of invoke_with with the bad queries `bq` through `api`, checked against the strong
/// guarantee (docs/design.md 8): std::invalid_argument whose message names the queries, nothing
/// observable changed (snapshot), and a fetch_into output of an earlier call (the cache's state)
/// left untouched. Returns the first failure, or "".
template <class T, class U>
std::string bad_queries_rejected(Subject<T>& s, Api api, const vc::Tensor4<U>& k,
                                 const vc::Tensor4<U>& v, const BadQueries& bq) {
  const std::string where = bq.name + " through " + api_name(api);
  const Snapshot before = snapshot(s);
  vc::KVPair<T> into = earlier_output(*s.cache);
  const std::vector<unsigned char> into_keys = bytes_of(into.first);
  const std::vector<unsigned char> into_values = bytes_of(into.second);
  std::string what;
  try {
    (void)invoke_with(*s.cache, api, k, v, bq, into);
    return where + " was accepted";
  } catch (const std::invalid_argument& e) {
    what = e.what();
  } catch (const std::exception& e) {
    return where + ": threw something other than std::invalid_argument: " + e.what();
  }
  if (!contains(what, "quer")) return where + ": message does not name the queries: " + what;
  if (!(snapshot(s) == before)) return where + " changed the cache";
  if (bytes_of(into.first) != into_keys || bytes_of(into.second) != into_values) {
    return where + ": the fetch_into output was touched";
  }
  return "";
}

}  // namespace veloxquant::test
