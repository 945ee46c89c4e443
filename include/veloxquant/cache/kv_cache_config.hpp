// veloxquant — KVCacheConfig: every knob of every eviction policy (mirrors the Python
// KVCacheConfig).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "detail/checked.hpp"

namespace veloxquant::cache {

namespace detail {

/// "a, b, c" for error messages.
template <std::size_t N>
std::string name_list(const std::array<const char*, N>& names) {
  std::string out;
  for (const char* m : names) {
    if (!out.empty()) out += ", ";
    out += m;
  }
  return out;
}

/// The values of KVCacheConfig::proxy_scoring (docs/design.md 4.7): how the H2O-core policies score
/// a call that brings no queries; detail::ProxyScoring lists the scorers in this order.
inline constexpr std::array<const char*, 3> kProxyScorings = {"key_as_query", "keydiff", "knorm"};
/// KVCacheConfig::head_budgets, by name (SPEC 14, docs/design.md 4.9).
inline constexpr std::array<const char*, 2> kHeadBudgets = {"uniform", "adaptive"};

/// Index of `name` in kProxyScorings, or -1.
inline int proxy_scoring_index(const std::string& name) {
  for (std::size_t i = 0; i < kProxyScorings.size(); ++i) {
    if (name == kProxyScorings[i]) return static_cast<int>(i);
  }
  return -1;
}

template <class V>
[[noreturn]] void config_error(const char* field, const V& value, const char* rule) {
  std::ostringstream os;
  os << "KVCacheConfig: " << field << " (" << value << ") " << rule;
  throw std::invalid_argument(os.str());
}

/// Largest accepted PyramidKV beta: beyond it the taper's arithmetic loses the average (and at
/// infinity turns into NaN); every beta this large already gives the bottom layer everything.
inline constexpr double kMaxPyramidBeta = 1e6;

/// Largest accepted KVCacheConfig::value_norm_power: keeps |v|^p and score * |v|^p within what
/// the ranking can order (docs/design.md 4.8).
inline constexpr double kMaxValueNormPower = 4.0;

inline void check_budget(const char* field, long long v) {
  if (v < 1) config_error(field, v, "must be >= 1");
}
inline void check_bits(const char* field, long long v) {
  if (v != 16 && v != 8 && v != 4 && v != 2) config_error(field, v, "must be 16, 8, 4 or 2");
}
inline void check_non_negative(const char* field, long long v) {
  if (v < 0) config_error(field, v, "must be >= 0");
}
inline void check_unit_interval(const char* field, double v) {
  if (!(v >= 0.0 && v <= 1.0)) config_error(field, v, "must be in [0, 1]");
}
inline void check_decay(const char* field, double v) {
  // Scores decay in float32: a decay that rounds to 0 there would silently mean "no memory".
  if (!(v > 0.0 && v <= 1.0) || !(static_cast<float>(v) > 0.0f)) {
    config_error(field, v, "must be in (0, 1] and above 0 in float32");
  }
}
inline void check_sink_below(const char* sink_field, int n_sink, const char* budget_field,
                             long long budget) {
  if (n_sink >= budget) {
    std::ostringstream os;
    os << "KVCacheConfig: " << sink_field << " (" << n_sink << ") must be < " << budget_field
       << " (" << budget << ")";
    throw std::invalid_argument(os.str());
  }
}

}  // namespace detail

/// Configuration of every cache policy; an aggregate with the Python defaults (docs/design.md 2.1).
struct KVCacheConfig {
  // Every field is also listed in detail::for_each_config_field (below): the prompt-cache format.
  std::string method =
      "squeeze";  ///< squeeze, h2o, pyramidkv, tova, streaming_llm, snapkv, kvzip, standard

  // SqueezeAttention
  int squeeze_budget = 512;                      ///< average budget; budget without coordinator
  int squeeze_n_sink = 4;                        ///< leading positions never evicted
  double squeeze_strength = 1.0;                 ///< reallocation strength in [0, 1]
  std::optional<int> squeeze_resolved_budget{};  ///< explicit starting budget
  double squeeze_recent_ratio = 0.5;             ///< share of evictable budget kept recent
  double squeeze_decay = 0.98;                   ///< per-token score decay in (0, 1]
  bool squeeze_defer = false;                    ///< hold rows until the budget is known
  int squeeze_calibration_tokens = 32;           ///< tokens absorbed before the layer reports

  // H2O
  int h2o_budget = 512;
  int h2o_n_sink = 4;
  int h2o_grace = 16;  ///< newest rows never evicted
  double h2o_decay = 0.98;

  // PyramidKV
  int pyramid_budget = 512;
  int pyramid_n_sink = 4;
  double pyramid_beta = 2.0;
  std::optional<int> pyramid_resolved_budget{};
  double pyramid_recent_ratio = 0.5;
  double pyramid_decay = 0.98;

  // TOVA
  int tova_budget = 512;
  int tova_n_sink = 4;

  // StreamingLLM
  int stream_n_sink = 4;
  int stream_window_size = 512;

  // SnapKV
  int snap_budget = 512;
  int snap_obs_window = 32;
  int snap_n_sink = 4;

  // KVzip (SPEC 18, docs/design.md 6.1): keeps every row until KVCacheBuilder::compress keeps the
  // set's best-observed rows; head_budget_floor is each head's least share of what it keeps.
  int kvzip_n_sink = 4;  ///< leading positions compress never drops

  // Storage of rows (docs/design.md 2.9): every method, every storage type
  int key_bits = 16;     ///< 16 (rows of T), 8, 4 or 2 (quantized along key_axis)
  int value_bits = 16;   ///< the same for values, chosen independently
  int quant_group = 32;  ///< token axis: elements per group (one half scale and offset each);
                         ///< divides D, >= 8
  /// "token" (each row quantized in groups of quant_group along D) or "channel" (each channel
  /// quantized over blocks of quant_block positions; docs/design.md 7.5). Keys keep their
  /// outliers in channels: "channel" is what makes 4-bit keys usable.
  std::string key_axis = "token";
  std::string value_axis = "token";  ///< the same for values
  int quant_block = 32;  ///< channel axis: positions per block (one half scale and offset per
                         ///< channel each); 8..1024

  /// How SqueezeAttention, H2O and PyramidKV score a call without queries (docs/design.md 4.7):
  /// "key_as_query" (the SPEC's proxy: each key attends as its own query, decayed mass),
  /// "keydiff" (keep the keys least similar to the mean retained key) or "knorm" (keep the
  /// lowest-norm keys). Calls with queries are scored by them whatever this says.
  std::string proxy_scoring = "key_as_query";

  /// How SqueezeAttention, H2O and PyramidKV rank rows for eviction in a call with queries
  /// (docs/design.md 4.8): by score * |v|^p, |v| the L2 norm of the stored value row (a row whose
  /// value is small moves the output little, whatever its attention). 0 (the default) ranks by the
  /// score alone (SPEC 4.6); 2 with squeeze_decay 0.95 and squeeze_n_sink 0 is the measured best
  /// (docs/fidelity.md). In [0, 4]. Calls without queries ignore it.
  double value_norm_power = 0.0;

  /// How SqueezeAttention, H2O and PyramidKV share a layer's rows among its heads (SPEC 14,
  /// docs/design.md 4.9): "uniform" (every head keeps the budget) or "adaptive" (AdaKV: the
  /// heads of a sequence share a pool of H x budget rows, each eviction takes the least-scored
  /// row of the layer among the heads above their floor; heads then hold different numbers of
  /// rows, so update_and_fetch and state() refuse ragged heads: use attend or update_and_view).
  /// The other methods ignore it.
  std::string head_budgets = "uniform";
  /// Adaptive heads: the share of the budget every head keeps at least (its sinks and protected
  /// recent rows count toward it), in (0, 1]; 1 keeps every head at the budget.
  double head_budget_floor = 0.2;

  /// Under a memory pool (SPEC 19, docs/design.md 10.5): the rows every head keeps at least
  /// besides its policy's sinks, whatever the pool's other sequences need (a head holding fewer
  /// keeps what it holds). >= 0. Caches outside a pool ignore it.
  int pool_floor_rows = 16;

  /// Sets the rows-per-head budget of every method (docs/design.md 2.1): squeeze_budget,
  /// h2o_budget, pyramid_budget, tova_budget, snap_budget, and stream_window_size = rows -
  /// stream_n_sink. Checks nothing: validate() (or the cache that is built) does.
  void set_budget(int rows);

  /// Throws std::invalid_argument naming the first bad field and its value (docs/design.md 2.1).
  /// Checks the method name and the fields of `method` only: a StreamingLLM window is not checked
  /// when the method is squeeze.
  void validate() const;
};

namespace detail {

// Each method's own checks (its row of kMethodTable), after the checks every method shares.

/// SqueezeAttention, H2O and PyramidKV score calls without queries by proxy_scoring and rank
/// calls with queries by value_norm_power (docs/design.md 4.7, 4.8).
inline void validate_h2o_core(const KVCacheConfig& c) {
  if (proxy_scoring_index(c.proxy_scoring) < 0) {
    throw std::invalid_argument("KVCacheConfig: proxy_scoring '" + c.proxy_scoring +
                                "' is unknown; valid: " + name_list(kProxyScorings));
  }
  if (!(c.value_norm_power >= 0.0 && c.value_norm_power <= kMaxValueNormPower)) {
    config_error("value_norm_power", c.value_norm_power, "must be in [0, 4]");
  }
}

inline void validate_squeeze(const KVCacheConfig& c) {
  validate_h2o_core(c);
  check_budget("squeeze_budget", c.squeeze_budget);
  check_non_negative("squeeze_n_sink", c.squeeze_n_sink);
  check_unit_interval("squeeze_strength", c.squeeze_strength);
  if (c.squeeze_resolved_budget)
    check_budget("squeeze_resolved_budget", *c.squeeze_resolved_budget);
  check_unit_interval("squeeze_recent_ratio", c.squeeze_recent_ratio);
  check_decay("squeeze_decay", c.squeeze_decay);
  if (c.squeeze_calibration_tokens < 1) {
    config_error("squeeze_calibration_tokens", c.squeeze_calibration_tokens, "must be >= 1");
  }
  check_sink_below("squeeze_n_sink", c.squeeze_n_sink, "squeeze_budget", c.squeeze_budget);
  if (c.squeeze_resolved_budget) {
    check_sink_below("squeeze_n_sink", c.squeeze_n_sink, "squeeze_resolved_budget",
                     *c.squeeze_resolved_budget);
  }
}

inline void validate_h2o(const KVCacheConfig& c) {
  validate_h2o_core(c);
  check_budget("h2o_budget", c.h2o_budget);
  check_non_negative("h2o_n_sink", c.h2o_n_sink);
  check_non_negative("h2o_grace", c.h2o_grace);
  check_decay("h2o_decay", c.h2o_decay);
  check_sink_below("h2o_n_sink", c.h2o_n_sink, "h2o_budget", c.h2o_budget);
}

inline void validate_pyramidkv(const KVCacheConfig& c) {
  validate_h2o_core(c);
  check_budget("pyramid_budget", c.pyramid_budget);
  check_non_negative("pyramid_n_sink", c.pyramid_n_sink);
  if (!(c.pyramid_beta >= 1.0 && c.pyramid_beta <= kMaxPyramidBeta)) {
    config_error("pyramid_beta", c.pyramid_beta, "must be in [1, 1e6]");
  }
  if (c.pyramid_resolved_budget)
    check_budget("pyramid_resolved_budget", *c.pyramid_resolved_budget);
  check_unit_interval("pyramid_recent_ratio", c.pyramid_recent_ratio);
  check_decay("pyramid_decay", c.pyramid_decay);
  check_sink_below("pyramid_n_sink", c.pyramid_n_sink, "pyramid_budget", c.pyramid_budget);
  if (c.pyramid_resolved_budget) {
    check_sink_below("pyramid_n_sink", c.pyramid_n_sink, "pyramid_resolved_budget",
                     *c.pyramid_resolved_budget);
  }
}

inline void validate_tova(const KVCacheConfig& c) {
  check_budget("tova_budget", c.tova_budget);
  check_non_negative("tova_n_sink", c.tova_n_sink);
  check_sink_below("tova_n_sink", c.tova_n_sink, "tova_budget", c.tova_budget);
}

inline void validate_streaming_llm(const KVCacheConfig& c) {
  check_non_negative("stream_n_sink", c.stream_n_sink);
  if (c.stream_window_size < 1)
    config_error("stream_window_size", c.stream_window_size, "must be >= 1");
  if (static_cast<long long>(c.stream_n_sink) + c.stream_window_size > 2147483647LL) {
    config_error("stream_window_size", c.stream_window_size,
                 "plus stream_n_sink must fit in an int (rows per head)");
  }
}

inline void validate_snapkv(const KVCacheConfig& c) {
  check_budget("snap_budget", c.snap_budget);
  if (c.snap_obs_window < 1) config_error("snap_obs_window", c.snap_obs_window, "must be >= 1");
  check_non_negative("snap_n_sink", c.snap_n_sink);
  check_sink_below("snap_n_sink", c.snap_n_sink, "snap_budget", c.snap_budget);
}

inline void validate_kvzip(const KVCacheConfig& c) {
  check_non_negative("kvzip_n_sink", c.kvzip_n_sink);
}

inline void validate_standard(const KVCacheConfig&) {}

/// The policies, in the order of kMethodTable.
enum class Method : std::uint8_t {
  squeeze,
  h2o,
  pyramidkv,
  tova,
  streaming_llm,
  snapkv,
  kvzip,
  standard
};

/// One policy as the configuration, the factory, the builder and the prompt-cache file know it
/// (docs/design.md "Adding a policy"). Its cache class is the one whose constructor passes `id`
/// to KVCache (KVCacheFactory::create builds it by `id`).
struct MethodSpec {
  Method id;
  /// KVCacheConfig::method; also the tag that names the class in a prompt-cache file (the
  /// stored config's "method" field).
  const char* name;
  /// Sets its rows-per-head budget (set_budget); null: it has none.
  void (*set_budget)(KVCacheConfig&, int rows);
  /// Its own checks (validate() runs the shared ones first).
  void (*validate)(const KVCacheConfig&);
};

inline constexpr std::array<MethodSpec, 8> kMethodTable = {{
    {Method::squeeze, "squeeze", [](KVCacheConfig& c, int rows) { c.squeeze_budget = rows; },
     validate_squeeze},
    {Method::h2o, "h2o", [](KVCacheConfig& c, int rows) { c.h2o_budget = rows; }, validate_h2o},
    {Method::pyramidkv, "pyramidkv", [](KVCacheConfig& c, int rows) { c.pyramid_budget = rows; },
     validate_pyramidkv},
    {Method::tova, "tova", [](KVCacheConfig& c, int rows) { c.tova_budget = rows; }, validate_tova},
    {Method::streaming_llm, "streaming_llm",
     [](KVCacheConfig& c, int rows) {
       // Saturated to the int range (validate() refuses what comes of it).
       c.stream_window_size = checked_sub(rows, c.stream_n_sink)
                                  .value_or(c.stream_n_sink > 0 ? std::numeric_limits<int>::min()
                                                                : std::numeric_limits<int>::max());
     },
     validate_streaming_llm},
    {Method::snapkv, "snapkv", [](KVCacheConfig& c, int rows) { c.snap_budget = rows; },
     validate_snapkv},
    // Keeps every row until compressed: no rows-per-head budget (KVCacheBuilder::compress keeps a
    // share of the set instead).
    {Method::kvzip, "kvzip", nullptr, validate_kvzip},
    {Method::standard, "standard", nullptr, validate_standard},
}};

/// Whether every row of kMethodTable sits at the index of its id (method_spec relies on it).
constexpr bool method_table_in_order() {
  for (std::size_t i = 0; i < kMethodTable.size(); ++i) {
    if (static_cast<std::size_t>(kMethodTable[i].id) != i) return false;
  }
  return true;
}
static_assert(method_table_in_order(), "kMethodTable: rows in the order of enum Method");

/// The row of `id`.
inline const MethodSpec& method_spec(Method id) {
  return kMethodTable[static_cast<std::size_t>(id)];
}

/// The row named `name`, or null.
inline const MethodSpec* find_method(const std::string& name) {
  for (const MethodSpec& m : kMethodTable) {
    if (name == m.name) return &m;
  }
  return nullptr;
}

/// "squeeze, h2o, ..." for error messages.
inline std::string method_list() {
  std::string out;
  for (const MethodSpec& m : kMethodTable) {
    if (!out.empty()) out += ", ";
    out += m.name;
  }
  return out;
}

/// The row of config.method; throws std::invalid_argument for an unknown name.
inline const MethodSpec& method_of(const KVCacheConfig& config) {
  const MethodSpec* m = find_method(config.method);
  if (m == nullptr) {
    throw std::invalid_argument("KVCacheConfig: method '" + config.method +
                                "' is unknown; valid methods: " + method_list());
  }
  return *m;
}

}  // namespace detail

inline void KVCacheConfig::set_budget(int rows) {
  for (const detail::MethodSpec& m : detail::kMethodTable) {
    if (m.set_budget != nullptr) m.set_budget(*this, rows);
  }
}

inline void KVCacheConfig::validate() const {
  using namespace detail;
  const MethodSpec& m = method_of(*this);
  check_bits("key_bits", key_bits);
  check_bits("value_bits", value_bits);
  if (quant_group < 8) config_error("quant_group", quant_group, "must be >= 8");
  for (const auto& [field, axis] : {std::pair<const char*, const std::string*>{"key_axis", &key_axis},
                                    {"value_axis", &value_axis}}) {
    if (*axis != "token" && *axis != "channel") {
      throw std::invalid_argument(std::string("KVCacheConfig: ") + field + " '" + *axis +
                                  "' is unknown; valid: token, channel");
    }
  }
  if (quant_block < 8 || quant_block > 1024) {
    config_error("quant_block", quant_block, "must be in [8, 1024]");
  }
  if (std::find(kHeadBudgets.begin(), kHeadBudgets.end(), head_budgets) == kHeadBudgets.end()) {
    throw std::invalid_argument("KVCacheConfig: head_budgets '" + head_budgets +
                                "' is unknown; valid: " + name_list(kHeadBudgets));
  }
  if (!(head_budget_floor > 0.0 && head_budget_floor <= 1.0)) {
    config_error("head_budget_floor", head_budget_floor, "must be in (0, 1]");
  }
  check_non_negative("pool_floor_rows", pool_floor_rows);
  m.validate(*this);
}

namespace detail {

/// Every field of KVCacheConfig, by name in declaration order: f(name, c.field) for each (the
/// prompt-cache format stores a cache's config this way, docs/design.md G). A field added to
/// KVCacheConfig is added here too; tests/test_prompt_cache.cpp round-trips every field.
template <class Config, class F>
void for_each_config_field(Config& c, F&& f) {
  f("method", c.method);
  f("squeeze_budget", c.squeeze_budget);
  f("squeeze_n_sink", c.squeeze_n_sink);
  f("squeeze_strength", c.squeeze_strength);
  f("squeeze_resolved_budget", c.squeeze_resolved_budget);
  f("squeeze_recent_ratio", c.squeeze_recent_ratio);
  f("squeeze_decay", c.squeeze_decay);
  f("squeeze_defer", c.squeeze_defer);
  f("squeeze_calibration_tokens", c.squeeze_calibration_tokens);
  f("h2o_budget", c.h2o_budget);
  f("h2o_n_sink", c.h2o_n_sink);
  f("h2o_grace", c.h2o_grace);
  f("h2o_decay", c.h2o_decay);
  f("pyramid_budget", c.pyramid_budget);
  f("pyramid_n_sink", c.pyramid_n_sink);
  f("pyramid_beta", c.pyramid_beta);
  f("pyramid_resolved_budget", c.pyramid_resolved_budget);
  f("pyramid_recent_ratio", c.pyramid_recent_ratio);
  f("pyramid_decay", c.pyramid_decay);
  f("tova_budget", c.tova_budget);
  f("tova_n_sink", c.tova_n_sink);
  f("stream_n_sink", c.stream_n_sink);
  f("stream_window_size", c.stream_window_size);
  f("snap_budget", c.snap_budget);
  f("snap_obs_window", c.snap_obs_window);
  f("snap_n_sink", c.snap_n_sink);
  f("key_bits", c.key_bits);
  f("value_bits", c.value_bits);
  f("quant_group", c.quant_group);
  f("proxy_scoring", c.proxy_scoring);        // since prompt-cache format version 2
  f("value_norm_power", c.value_norm_power);  // since prompt-cache format version 3
  f("head_budgets", c.head_budgets);          // since prompt-cache format version 4
  f("head_budget_floor", c.head_budget_floor);  // since prompt-cache format version 4
  f("key_axis", c.key_axis);                    // since prompt-cache format version 5
  f("value_axis", c.value_axis);                // since prompt-cache format version 5
  f("quant_block", c.quant_block);              // since prompt-cache format version 5
  f("kvzip_n_sink", c.kvzip_n_sink);            // since prompt-cache format version 6
  f("pool_floor_rows", c.pool_floor_rows);      // since prompt-cache format version 7
}

/// The prompt-cache format version that first stored config field `name` (docs/design.md G): a
/// file of an older version lacks it and loads with the field's default (the behaviour of the
/// library that wrote the file).
inline unsigned config_field_since(const char* name) {
  const std::string n(name);
  if (n == "pool_floor_rows") return 7U;
  if (n == "kvzip_n_sink") return 6U;
  if (n == "key_axis" || n == "value_axis" || n == "quant_block") return 5U;
  if (n == "head_budgets" || n == "head_budget_floor") return 4U;
  return n == "value_norm_power" ? 3U : n == "proxy_scoring" ? 2U : 1U;
}

/// `config` with method `id` in place of its own.
inline KVCacheConfig with_method(KVCacheConfig config, Method id) {
  config.method = method_spec(id).name;
  return config;
}

/// Validates `config` as if method `id` were in use (a cache class knows its own method).
inline void validate_as(const KVCacheConfig& config, Method id) {
  with_method(config, id).validate();
}

}  // namespace detail

}  // namespace veloxquant::cache
