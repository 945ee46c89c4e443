// The tests' and the fuzzer's one registry of methods (docs/design.md H, docs/testing.md "Adding a
// method"): what they know of each row of the library's detail::kMethodTable beyond the row itself
// (its name, set_budget and checks stay the library's), and the subjects the sweeps run: a method,
// plus the axes the tests add on top of it (a squeeze layer's coordinator, the query-free scorer,
// adaptive head budgets). No GoogleTest here: the fuzzer and the ThreadSanitizer build include it.
//
// tests/test_config.cpp alone writes the methods' names and field prefixes out literally: it checks
// that the library's table says what the SPEC says. Everything else reads them from here.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <veloxquant/cache.hpp>

namespace veloxquant::test {

using Method = cache::detail::Method;

// ---------------------------------------------------------------------------------------------
// The methods
// ---------------------------------------------------------------------------------------------

/// One method as the tests and the fuzzer know it, beside its row of the library's table.
struct MethodEntry {
  Method id;
  /// The prefix of its own KVCacheConfig fields ("" for the standard cache, which has none).
  const char* prefix;
  /// Its sinks field (null: it has none).
  int cache::KVCacheConfig::*n_sink;
  /// Of the H2O core (SqueezeAttention, H2O, PyramidKV): proxy_scoring, value_norm_power and
  /// head_budgets apply to it, and its class publishes budget() and protected_recent().
  bool h2o_core;
  /// It scores its rows (a cache's scores() and positions() mean something).
  bool scored;
};

/// One entry per row of kMethodTable, in its order (a static_assert below holds them to it).
inline constexpr std::array<MethodEntry, cache::detail::kMethodTable.size()> kMethodEntries = {{
    {Method::squeeze, "squeeze_", &cache::KVCacheConfig::squeeze_n_sink, true, true},
    {Method::h2o, "h2o_", &cache::KVCacheConfig::h2o_n_sink, true, true},
    {Method::pyramidkv, "pyramid_", &cache::KVCacheConfig::pyramid_n_sink, true, true},
    {Method::tova, "tova_", &cache::KVCacheConfig::tova_n_sink, false, true},
    {Method::streaming_llm, "stream_", &cache::KVCacheConfig::stream_n_sink, false, false},
    {Method::snapkv, "snap_", &cache::KVCacheConfig::snap_n_sink, false, true},
    // Its calls keep every row unscored (-1); its scores come from observe (test_kvzip_cache).
    {Method::kvzip, "kvzip_", &cache::KVCacheConfig::kvzip_n_sink, false, false},
    {Method::standard, "", nullptr, false, false},
}};

constexpr bool entries_follow_the_table() {
  for (std::size_t i = 0; i < kMethodEntries.size(); ++i) {
    if (kMethodEntries[i].id != cache::detail::kMethodTable[i].id) return false;
  }
  return true;
}
static_assert(entries_follow_the_table(), "kMethodEntries: one entry per row of kMethodTable");

constexpr const MethodEntry& method_entry(Method m) {
  return kMethodEntries[static_cast<std::size_t>(m)];
}
/// KVCacheConfig::method of `m` (the library's table).
inline const char* method_name(Method m) { return cache::detail::method_spec(m).name; }
/// Every method, in the table's order.
constexpr std::array<Method, kMethodEntries.size()> all_methods() {
  std::array<Method, kMethodEntries.size()> out{};
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = kMethodEntries[i].id;
  return out;
}
inline constexpr std::array<Method, kMethodEntries.size()> kMethods = all_methods();

constexpr bool is_core(Method m) { return method_entry(m).h2o_core; }
/// Whether its calls keep every row: the standard cache, and KVzip, whose rows go only in a set's
/// compress (KVCacheBuilder::compress, tests/test_kvzip_cache.cpp), which the sweeps do not make.
constexpr bool keeps_every_row(Method m) { return m == Method::standard || m == Method::kvzip; }

/// The methods of the H2O core, in the order the core's sweeps run them (their seeds follow it).
inline constexpr Method kCoreMethods[] = {Method::h2o, Method::squeeze, Method::pyramidkv};
constexpr bool core_methods_complete() {
  std::size_t n = 0;
  for (const MethodEntry& e : kMethodEntries) n += e.h2o_core ? 1 : 0;
  for (const Method m : kCoreMethods) {
    if (!is_core(m)) return false;
  }
  return n == std::size(kCoreMethods);
}
static_assert(core_methods_complete(), "kCoreMethods: every method of the H2O core, once");
/// The index of `m` in kCoreMethods (the core's sweeps seed their draws with it).
constexpr unsigned core_index(Method m) {
  unsigned i = 0;
  while (i < std::size(kCoreMethods) && kCoreMethods[i] != m) ++i;
  return i;
}

/// Sets the sinks of every method that has them to `n`. (Budgets: KVCacheConfig::set_budget, whose
/// StreamingLLM window is the rows beside its sinks: set the sinks first.)
inline void set_n_sinks(cache::KVCacheConfig& c, int n) {
  for (const MethodEntry& e : kMethodEntries) {
    if (e.n_sink != nullptr) c.*e.n_sink = n;
  }
}

// ---------------------------------------------------------------------------------------------
// Subjects: a method and the axes the tests add on top of it
// ---------------------------------------------------------------------------------------------

/// How a SqueezeAttention subject is wired to a coordinator: not at all (the factory's cache), as
/// the one layer of its own coordinator (it adopts in its first call), or deferring as layer 1 of
/// a two-layer coordinator that never finalises (it falls back).
enum class Wiring : std::uint8_t { alone, coordinated, deferring };

/// What a subject is: a method, and on top of it its wiring (squeeze), its query-free scorer
/// (an index of detail::kProxyScorings; 0: the key-as-query proxy, the config's default) and
/// adaptive head budgets (SPEC 14, docs/design.md 4.9; floor 0: uniform heads). A method converts
/// to its plain subject.
struct Kind {
  Method method = Method::standard;
  Wiring wiring = Wiring::alone;
  std::uint8_t proxy = 0;
  double floor = 0.0;

  constexpr Kind() = default;
  constexpr Kind(Method m) : method(m) {}  // NOLINT(google-explicit-constructor)
  constexpr Kind(Method m, Wiring w, std::uint8_t scorer, double head_floor)
      : method(m), wiring(w), proxy(scorer), floor(head_floor) {}

  friend constexpr bool operator==(const Kind& a, const Kind& b) {
    return a.method == b.method && a.wiring == b.wiring && a.proxy == b.proxy && a.floor == b.floor;
  }
  friend constexpr bool operator!=(const Kind& a, const Kind& b) { return !(a == b); }

  // The subjects beyond the plain methods.
  static const Kind kSqueezeCoordinated;   // one-layer coordinator: adopts in its first call
  static const Kind kSqueezeDefer;         // deferring, two-layer coordinator that never finalises
  static const Kind kSqueezeDeferKeyDiff;  // kSqueezeDefer scored by KeyDiff without queries
  static const Kind kH2OKNorm;             // h2o scored by K-norm without queries
  // Adaptive head budgets: the H heads of a sequence share H x budget rows, each keeping at least
  // ceil(floor x budget); heads then hold different numbers of rows ("ragged"). Not in kKinds
  // (the other sweeps fetch and read state(), which ragged heads refuse): kAdaptiveKinds, and
  // kContractKinds for the contract suite.
  static const Kind kH2OAdaptive;           // h2o, floor 0.25 (2 rows of 6: below its sink and
                                            // recent window)
  static const Kind kSqueezeAdaptive;       // squeeze, floor 0.75 (5 rows of 6: above them)
  static const Kind kSqueezeDeferAdaptive;  // kSqueezeDeferKeyDiff, floor 0.25: a pooled
                                            // re-budget at a call's start
  static const Kind kPyramidAdaptive;       // pyramidkv, floor 0.5 (3 rows of 6)
};
inline constexpr Kind Kind::kSqueezeCoordinated{Method::squeeze, Wiring::coordinated, 0, 0.0};
inline constexpr Kind Kind::kSqueezeDefer{Method::squeeze, Wiring::deferring, 0, 0.0};
inline constexpr Kind Kind::kSqueezeDeferKeyDiff{Method::squeeze, Wiring::deferring, 1, 0.0};
inline constexpr Kind Kind::kH2OKNorm{Method::h2o, Wiring::alone, 2, 0.0};
inline constexpr Kind Kind::kH2OAdaptive{Method::h2o, Wiring::alone, 0, 0.25};
inline constexpr Kind Kind::kSqueezeAdaptive{Method::squeeze, Wiring::alone, 0, 0.75};
inline constexpr Kind Kind::kSqueezeDeferAdaptive{Method::squeeze, Wiring::deferring, 1, 0.25};
inline constexpr Kind Kind::kPyramidAdaptive{Method::pyramidkv, Wiring::alone, 0, 0.5};

/// What most sweeps run, read from the table: the standard cache first (the reference of the
/// others), then every other method in the table's order (squeeze followed by its coordinated and
/// deferring subjects), then the query-free scorers' subjects. KVzip, whose row came later, comes
/// last: the tests seed their draws with a subject's index (kind_index), so a subject added in the
/// middle would change every later one's draws.
constexpr std::array<Kind, kMethodEntries.size() + 4> uniform_kinds() {
  std::array<Kind, kMethodEntries.size() + 4> out{};
  std::size_t n = 0;
  out[n++] = Method::standard;
  for (const MethodEntry& e : kMethodEntries) {
    if (e.id == Method::standard || e.id == Method::kvzip) continue;
    out[n++] = e.id;
    if (e.id == Method::squeeze) {
      out[n++] = Kind::kSqueezeCoordinated;
      out[n++] = Kind::kSqueezeDefer;
    }
  }
  out[n++] = Kind::kSqueezeDeferKeyDiff;
  out[n++] = Kind::kH2OKNorm;
  out[n++] = Method::kvzip;
  return out;
}
inline constexpr std::array<Kind, kMethodEntries.size() + 4> kKinds = uniform_kinds();
/// The subjects with adaptive head budgets (SPEC 14).
inline constexpr Kind kAdaptiveKinds[] = {Kind::kH2OAdaptive, Kind::kSqueezeAdaptive,
                                          Kind::kSqueezeDeferAdaptive, Kind::kPyramidAdaptive};
/// What the contract suite sweeps: kKinds, then kAdaptiveKinds, KVzip last (the subjects keep
/// the indices, and so the draws, they had before it came).
constexpr std::array<Kind, kKinds.size() + std::size(kAdaptiveKinds)> contract_kinds() {
  std::array<Kind, kKinds.size() + std::size(kAdaptiveKinds)> out{};
  std::size_t n = 0;
  for (const Kind& k : kKinds) {
    if (k.method != Method::kvzip) out[n++] = k;
  }
  for (const Kind& k : kAdaptiveKinds) out[n++] = k;
  out[n++] = Method::kvzip;
  return out;
}
inline constexpr auto kContractKinds = contract_kinds();

/// The subject's number: its index in kContractKinds (the tests seed their random draws with it).
constexpr unsigned kind_index(const Kind& k) {
  for (std::size_t i = 0; i < kContractKinds.size(); ++i) {
    if (kContractKinds[i] == k) return static_cast<unsigned>(i);
  }
  return static_cast<unsigned>(kContractKinds.size());
}

/// Whether the subject's heads share their pool (adaptive head budgets, SPEC 14).
constexpr bool is_adaptive(const Kind& k) { return k.floor > 0.0; }
/// The subject an adaptive one is made from (its method, wiring and scorer, uniform heads).
constexpr Kind base_kind(Kind k) {
  k.floor = 0.0;
  return k;
}
/// The head_budget_floor of an adaptive subject (0: uniform heads).
constexpr double adaptive_floor(const Kind& k) { return k.floor; }
/// The deferring squeeze subjects (their budget is unknown until they fall back).
constexpr bool is_squeeze_defer(const Kind& k) { return k.wiring == Wiring::deferring; }

/// "squeeze+defer+keydiff+adaptive": the method, then each axis that is not its default.
inline std::string kind_name(const Kind& k) {
  std::string out = method_name(k.method);
  if (k.wiring == Wiring::coordinated) out += "+coordinator";
  if (k.wiring == Wiring::deferring) out += "+defer";
  if (k.proxy != 0) out += std::string("+") + cache::detail::kProxyScorings[k.proxy];
  if (is_adaptive(k)) out += "+adaptive";
  return out;
}

/// The cache of subject `kind` over `c` (which holds its budgets and sinks): a wired squeeze
/// subject is layer 0 (coordinated) or 1 (deferring, c.squeeze_defer set) of `coordinator`, any
/// other subject the factory's cache of its method. The scorer and head budgets of `kind` are
/// set in `c` first when they are not the defaults.
template <class T>
std::unique_ptr<cache::KVCache<T>> make_kind(
    Kind kind, cache::KVCacheConfig c,
    const std::shared_ptr<cache::SqueezeCoordinator>& coordinator) {
  if (is_adaptive(kind)) {
    c.head_budgets = "adaptive";
    c.head_budget_floor = kind.floor;
  }
  if (kind.proxy != 0) c.proxy_scoring = cache::detail::kProxyScorings[kind.proxy];
  switch (kind.wiring) {
    case Wiring::coordinated:
      return std::make_unique<cache::SqueezeAttentionCache<T>>(c, 0, coordinator);
    case Wiring::deferring:
      c.squeeze_defer = true;
      return std::make_unique<cache::SqueezeAttentionCache<T>>(c, 1, coordinator);
    case Wiring::alone:
      break;
  }
  return cache::KVCacheFactory::create<T>(cache::detail::with_method(c, kind.method));
}

}  // namespace veloxquant::test
