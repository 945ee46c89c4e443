// fuzz target `ops` (fuzz/fuzz_ops.hpp): what a run tests — the method, a small valid
// configuration decoded from the input (docs/design.md 2.1, 2.6, 2.7), or one with exactly one
// invalid field, which construction must reject naming it — and its description in messages.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "ops_input.hpp"
#include "ops_kinds.hpp"

namespace veloxquant::fuzz::detail {

/// The run's method, configuration and way of construction (fixed for the whole run).
struct RunSpec {
  int run = 0;  ///< its index in kRunMethods
  Method method = Method::standard;
  vc::KVCacheConfig cfg;
  std::string via;            ///< "factory", "constructor" or "builder"
  bool direct = false;        ///< the class's own constructor instead of the factory
  int layers = 1, layer = 0;  ///< a builder model's layers, and the one under test
  /// The H2O core's query-free scorer (docs/design.md 4.7), as the oracle names it.
  ref::H2OHeadOracle::Scorer scorer = ref::H2OHeadOracle::Scorer::key_as_query;
  /// Adaptive head budgets (SPEC 14, docs/design.md 4.9) on an H2O-core policy: the heads of a
  /// sequence share H x budget rows (cfg.head_budget_floor: each keeps its share at least).
  bool adaptive = false;

  bool core() const { return is_core(method); }
  /// One layer of a builder model (squeeze, pyramidkv).
  bool builder() const { return kRunMethods[run].builder; }
  bool squeeze_builder() const { return method == Method::squeeze && builder(); }
};

/// The fields of each method's configuration, from the common choices and the input.
inline void decode_method_fields(Bytes& in, RunSpec& s, int budget, int n_sink, double ratio,
                                 double decay, std::uint8_t flags) {
  vc::KVCacheConfig& c = s.cfg;
  c.method = vt::method_name(s.method);
  switch (s.method) {
    case Method::squeeze:
      c.squeeze_budget = budget;
      c.squeeze_n_sink = n_sink;
      c.squeeze_recent_ratio = ratio;
      c.squeeze_decay = decay;
      c.squeeze_strength = pick_from(in, {1.0, 0.0, 0.5, 0.25});
      c.squeeze_defer = (flags & 2) != 0;
      if ((flags & 12) == 4) c.squeeze_resolved_budget = in.range(n_sink + 1, 24);
      if (s.builder()) {
        s.layers = in.range(1, 3);
        s.layer = in.range(0, s.layers - 1);
      }
      break;
    case Method::h2o:
      c.h2o_budget = budget;
      c.h2o_n_sink = n_sink;
      c.h2o_grace = in.range(0, 10);
      c.h2o_decay = decay;
      break;
    case Method::pyramidkv:
      c.pyramid_budget = budget;
      c.pyramid_n_sink = n_sink;
      c.pyramid_recent_ratio = ratio;
      c.pyramid_decay = decay;
      c.pyramid_beta = pick_from(in, {2.0, 1.0, 1.5, 3.0});
      if (!s.builder() && (flags & 12) == 4) {
        c.pyramid_resolved_budget = in.range(n_sink + 1, 24);
      }
      if (s.builder()) {
        s.layers = in.range(1, 4);
        s.layer = in.range(0, s.layers - 1);
      }
      break;
    case Method::tova:
      c.tova_budget = budget;
      c.tova_n_sink = n_sink;
      break;
    case Method::streaming_llm:
      c.stream_n_sink = in.range(0, 5);
      c.stream_window_size = in.range(1, 16);
      break;
    case Method::snapkv:
      c.snap_budget = budget;
      c.snap_n_sink = n_sink;
      c.snap_obs_window = (flags & 16) ? in.range(1, 40) : in.range(1, 8);
      break;
    default:  // standard: no fields (a method without a run in kRunMethods never comes here)
      break;
  }
}

/// Decodes a valid configuration for `s.method` (already chosen) and the way of construction.
inline void decode_config(Bytes& in, RunSpec& s) {
  vc::KVCacheConfig& c = s.cfg;
  // The oracles report on the first call (docs/design.md 5.4 with squeeze_calibration_tokens
  // = 1); the calibration window has its own tests (test_squeeze_cache.cpp).
  c.squeeze_calibration_tokens = 1;
  const int budget = in.range(1, 24);
  const int n_sink = in.range(0, std::min(budget - 1, 5));
  const double ratio = pick_from(in, {0.5, 0.0, 0.25, 0.75, 1.0, 0.3});
  const double decay = pick_from(in, {0.98, 1.0, 0.9, 0.5, 0.25});
  const std::uint8_t flags = in.u8();
  s.direct = (flags & 1) != 0;  // constructor instead of factory
  decode_method_fields(in, s, budget, n_sink, ratio, decay, flags);
  if (s.core()) {
    // Flag bits 5-6: the query-free scorer (docs/design.md 4.7); 0 (and 3): the SPEC proxy.
    const int proxy = (flags >> 5) & 3;
    s.scorer = proxy == 1   ? ref::H2OHeadOracle::Scorer::keydiff
               : proxy == 2 ? ref::H2OHeadOracle::Scorer::knorm
                            : ref::H2OHeadOracle::Scorer::key_as_query;
    c.proxy_scoring = proxy == 1 ? "keydiff" : proxy == 2 ? "knorm" : "key_as_query";
    // Flag bit 7: value-weighted eviction in calls with queries (docs/design.md 4.8), p = 2
    // (squared norms) or, with bit 4 (SnapKV's alone otherwise), p = 0.5 (through pow).
    c.value_norm_power = (flags & 128) ? ((flags & 16) ? 0.5 : 2.0) : 0.0;
  }
  // Flag bits 2-3 = 2 (no resolved budget; no H2O-core input saved before adaptive heads has
  // them, so those keep their runs): adaptive head budgets (SPEC 14). Every policy takes the field
  // (the others must ignore it); an H2O-core policy reads one more byte: its floor (bits 0-2)
  // and, with bit 3, a resolved budget (squeeze, single pyramidkv).
  if ((flags & 12) == 8) {
    c.head_budgets = "adaptive";
    if (s.core()) {
      s.adaptive = true;
      const std::uint8_t a = in.u8();
      c.head_budget_floor =
          std::array<double, 8>{0.2, 0.25, 0.5, 0.75, 1.0, 0.1, 0.34, 0.05}[a & 7];
      const bool squeeze = s.method == Method::squeeze;
      if ((a & 8) && squeeze) c.squeeze_resolved_budget = in.range(n_sink + 1, 24);
      if ((a & 8) && s.method == Method::pyramidkv && !s.builder()) {
        c.pyramid_resolved_budget = in.range(n_sink + 1, 24);
      }
    }
  }
  s.via = s.builder() ? "builder" : s.direct ? "constructor" : "factory";
}

/// Whether validate() checks `field` in a config of `method` (docs/design.md 2.1): a method's
/// own fields (by their prefix, tests/support/methods.hpp) for that method only, the H2O core's
/// proxy_scoring and value_norm_power for its methods, the common fields always.
inline bool validated_for(const std::string& field, const std::string& method) {
  const vc::detail::MethodSpec* m = vc::detail::find_method(method);
  if (field == "proxy_scoring" || field == "value_norm_power") {
    return m != nullptr && is_core(m->id);
  }
  for (const vt::MethodEntry& e : vt::kMethodEntries) {
    if (*e.prefix != '\0' && field.rfind(e.prefix, 0) == 0) return m != nullptr && m->id == e.id;
  }
  return true;
}

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// An invalid count: -hi..-lo, or (one time in four) INT_MIN or -2^30, the extremes a caller's
/// arithmetic can produce (docs/robustness.md, "Integers").
inline int negative(Bytes& in, int lo, int hi) {
  switch (in.pick(8)) {
    case 0:
      return std::numeric_limits<int>::min();
    case 1:
      return -(1 << 30);
    default:
      return -in.range(lo, hi);
  }
}

/// Breakage `k` (0..5) of a squeeze field; returns the field's name.
inline std::string break_squeeze(Bytes& in, vc::KVCacheConfig& c, int k) {
  switch (k) {
    case 0:
      c.squeeze_budget = negative(in, 0, 3);
      return "squeeze_budget";
    case 1:
      c.squeeze_n_sink = negative(in, 1, 3);
      return "squeeze_n_sink";
    case 2:
      c.squeeze_strength = pick_from(in, {1.5, -0.1, kNaN, kInf});
      return "squeeze_strength";
    case 3:
      c.squeeze_resolved_budget = negative(in, 0, 2);
      return "squeeze_resolved_budget";
    case 4:
      c.squeeze_recent_ratio = pick_from(in, {kNaN, 1.01, -0.5});
      return "squeeze_recent_ratio";
    default:
      c.squeeze_decay = pick_from(in, {0.0, 1.1, kNaN, -1.0});
      return "squeeze_decay";
  }
}

/// Breakage `k` (6..9) of an h2o field.
inline std::string break_h2o(Bytes& in, vc::KVCacheConfig& c, int k) {
  switch (k) {
    case 6:
      c.h2o_budget = negative(in, 0, 3);
      return "h2o_budget";
    case 7:
      c.h2o_n_sink = negative(in, 1, 3);
      return "h2o_n_sink";
    case 8:
      c.h2o_grace = negative(in, 1, 3);
      return "h2o_grace";
    default:
      c.h2o_decay = pick_from(in, {0.0, 2.0, kNaN});
      return "h2o_decay";
  }
}

/// Breakage `k` (10..15) of a pyramidkv field.
inline std::string break_pyramid(Bytes& in, vc::KVCacheConfig& c, int k) {
  switch (k) {
    case 10:
      c.pyramid_budget = negative(in, 0, 3);
      return "pyramid_budget";
    case 11:
      c.pyramid_n_sink = negative(in, 1, 3);
      return "pyramid_n_sink";
    case 12:
      c.pyramid_beta = pick_from(in, {0.5, kNaN, kInf, 0.999});
      return "pyramid_beta";
    case 13:
      c.pyramid_resolved_budget = negative(in, 0, 2);
      return "pyramid_resolved_budget";
    case 14:
      c.pyramid_recent_ratio = pick_from(in, {-0.5, 2.0, kNaN});
      return "pyramid_recent_ratio";
    default:
      c.pyramid_decay = pick_from(in, {2.0, 0.0, kNaN});
      return "pyramid_decay";
  }
}

/// Breakage `k` (16..22) of a tova, streaming_llm or snapkv field.
inline std::string break_tova_stream_snap(Bytes& in, vc::KVCacheConfig& c, int k) {
  switch (k) {
    case 16:
      c.tova_budget = negative(in, 0, 3);
      return "tova_budget";
    case 17:
      c.tova_n_sink = negative(in, 1, 3);
      return "tova_n_sink";
    case 18:
      c.stream_n_sink = negative(in, 1, 3);
      return "stream_n_sink";
    case 19:
      c.stream_window_size = negative(in, 0, 3);
      return "stream_window_size";
    case 20:
      c.snap_budget = negative(in, 0, 3);
      return "snap_budget";
    case 21:
      c.snap_obs_window = negative(in, 0, 3);
      return "snap_obs_window";
    default:
      c.snap_n_sink = negative(in, 1, 3);
      return "snap_n_sink";
  }
}

/// n_sink >= budget for the method in use ("" for standard and streaming_llm: no such rule).
inline std::string break_sink_budget(Bytes& in, RunSpec& s) {
  vc::KVCacheConfig& c = s.cfg;
  const int extra = in.range(0, 2);
  switch (s.method) {
    case Method::squeeze:
      if (c.squeeze_resolved_budget && (extra & 1)) {
        c.squeeze_n_sink = *c.squeeze_resolved_budget + extra;
        if (c.squeeze_n_sink >= c.squeeze_budget) c.squeeze_budget = c.squeeze_n_sink + 1;
      } else {
        c.squeeze_n_sink = c.squeeze_budget + extra;
        c.squeeze_resolved_budget.reset();
      }
      return "squeeze_n_sink";
    case Method::h2o:
      c.h2o_n_sink = c.h2o_budget + extra;
      return "h2o_n_sink";
    case Method::pyramidkv:
      if (c.pyramid_resolved_budget && (extra & 1)) {
        c.pyramid_n_sink = *c.pyramid_resolved_budget + extra;
        if (c.pyramid_n_sink >= c.pyramid_budget) c.pyramid_budget = c.pyramid_n_sink + 1;
      } else {
        c.pyramid_n_sink = c.pyramid_budget + extra;
        c.pyramid_resolved_budget.reset();
      }
      return "pyramid_n_sink";
    case Method::tova:
      c.tova_n_sink = c.tova_budget + extra;
      return "tova_n_sink";
    case Method::snapkv:
      c.snap_n_sink = c.snap_budget + extra;
      return "snap_n_sink";
    default:
      return "";
  }
}

/// Adaptive heads' fields (SPEC 14): an unknown head_budgets, or a floor outside (0, 1].
inline std::string break_head_budgets(Bytes& in, vc::KVCacheConfig& c) {
  if (in.pick(2) == 0) {
    c.head_budgets = std::array<const char*, 4>{"bogus", "Adaptive", "", "adaptive "}[in.pick(4)];
    return "head_budgets";
  }
  c.head_budget_floor = pick_from(in, {0.0, -0.25, 1.5, kNaN, kInf, -kInf});
  return "head_budget_floor";
}

/// Makes one field invalid; returns the field's name (the message must contain it), or "" when
/// the chosen breakage does not apply. `direct`: the cache is made by its constructor.
inline std::string break_config(Bytes& in, RunSpec& s, bool direct) {
  vc::KVCacheConfig& c = s.cfg;
  // An adaptive run first chooses whether to break its own fields (1 time in 3).
  if (s.adaptive && in.pick(3) == 0) return break_head_budgets(in, c);
  const int k = in.pick(27);
  if (k <= 5) return break_squeeze(in, c, k);
  if (k <= 9) return break_h2o(in, c, k);
  if (k <= 15) return break_pyramid(in, c, k);
  if (k <= 22) return break_tova_stream_snap(in, c, k);
  switch (k) {
    case 23:
      return break_sink_budget(in, s);
    case 25:  // the H2O core's own common fields (validated for squeeze, h2o, pyramidkv)
      c.proxy_scoring = std::array<const char*, 4>{"bogus", "KeyDiff", "", "knorm "}[in.pick(4)];
      return "proxy_scoring";
    case 26:
      c.value_norm_power = pick_from(in, {kNaN, -0.5, 4.5, kInf});
      return "value_norm_power";
    default:  // an unknown method, only through the factory or the builder
      if (direct) return "";
      c.method = in.pick(2) ? "bogus" : "SQUEEZE";
      return "method";
  }
}

/// The configuration fields of the run's method, for the run's description.
inline std::string describe_config(const RunSpec& s) {
  std::ostringstream os;
  const auto& c = s.cfg;
  if (s.core() && c.value_norm_power > 0.0) os << " value_norm_power=" << c.value_norm_power;
  if (c.head_budgets != "uniform") {
    os << " head_budgets=" << c.head_budgets << " floor=" << c.head_budget_floor;
  }
  switch (s.method) {
    case Method::squeeze:
      os << " squeeze_budget=" << c.squeeze_budget << " resolved="
         << (c.squeeze_resolved_budget ? std::to_string(*c.squeeze_resolved_budget) : "-")
         << " ratio=" << c.squeeze_recent_ratio << " decay=" << c.squeeze_decay
         << " strength=" << c.squeeze_strength << " defer=" << c.squeeze_defer << " L=" << s.layers
         << " layer=" << s.layer << " proxy_scoring=" << c.proxy_scoring;
      break;
    case Method::h2o:
      os << " h2o_budget=" << c.h2o_budget << " grace=" << c.h2o_grace << " decay=" << c.h2o_decay
         << " proxy_scoring=" << c.proxy_scoring;
      break;
    case Method::pyramidkv:
      os << " pyramid_budget=" << c.pyramid_budget << " resolved="
         << (c.pyramid_resolved_budget ? std::to_string(*c.pyramid_resolved_budget) : "-")
         << " beta=" << c.pyramid_beta << " ratio=" << c.pyramid_recent_ratio
         << " decay=" << c.pyramid_decay << " L=" << s.layers << " layer=" << s.layer
         << " proxy_scoring=" << c.proxy_scoring;
      break;
    case Method::tova:
      os << " tova_budget=" << c.tova_budget << " n_sink=" << c.tova_n_sink;
      break;
    case Method::streaming_llm:
      os << " n_sink=" << c.stream_n_sink << " window=" << c.stream_window_size;
      break;
    case Method::snapkv:
      os << " snap_budget=" << c.snap_budget << " n_sink=" << c.snap_n_sink
         << " obs=" << c.snap_obs_window;
      break;
    default:
      break;
  }
  return os.str();
}

}  // namespace veloxquant::fuzz::detail
