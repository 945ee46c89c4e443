// veloxquant fuzz harness: turns a byte string into a sequence of operations on ONE cache and
// checks every operation against the naive double-precision oracles of tests/reference/ and against
// the invariants of docs/design.md sections 2, 4, 5, 6 and 8. Used by the libFuzzer target
// (fuzz/fuzz_cache.cpp, clang) and by the corpus replay test (tests/test_fuzz_regressions.cpp,
// g++).
//
// Entry points:
//   std::string veloxquant::fuzz::run_ops(data, size, options)  -> "" or the first violation
//   void veloxquant::fuzz::check_ops(data, size, on_failure)    -> calls on_failure(message)
//
// What the bytes choose (a missing byte reads as 0, so every input is valid and short inputs are
// short runs):
//   * the policy: standard, squeeze without coordinator (factory or constructor), squeeze as one
//     layer of a KVCacheBuilder model (shared coordinator, L = 1..3 layers, optional deferral,
//     other layers' concentrations reported by the harness), h2o, pyramidkv as a single layer
//     (pyramid_resolved_budget) or one layer of a builder model, tova, streaming_llm, snapkv;
//   * the storage type (float, Eigen::half, Eigen::bfloat16);
//   * a small valid configuration (budgets 1..24, n_sink 0..5, grace, recent ratio, decay, beta,
//     window, obs window), or, 1 time in 12, a configuration with exactly one invalid field, which
//     must throw std::invalid_argument naming that field at construction;
//   * per sequence (at the start and after every reset): B 1..2, H 1..3, Dk and Dv 1..8, and the
//     query mode (no queries / every call with queries / mixed per call);
//   * then up to kMaxOps operations: calls with S in 0..40 through update_and_fetch,
//     update_and_view or update_and_fetch_into, with storage-typed or double inputs, with or
//     without queries (G 1..3; float, double or half), reset() (of the cache alone or of the whole
//     builder model and its coordinator), trim(n), save_prompt_cache + load_prompt_cache of every
//     cache of the run (carrying on with the loaded set), set_parallel_heads, a reused output
//     tensor of the wrong shape, reports of other layers to the coordinator, and bad inputs:
//     NaN/Inf keys at a chosen index, a double key overflowing the storage type, keys/values that
//     disagree in B, H or S, zero B/H/D, B/H/D changed after the first call, and bad queries (Hq
//     not a positive multiple of H, wrong B/S/D, NaN/Inf query, double query overflowing float).
//   Data: every key, value and query entry is a multiple of 0.25 in [-2, 2] (some modes use
//   {-1, 0, 1}, mostly-zero rows, or a small palette of repeated rows), so every storage type holds
//   it exactly, dot products are exact in float32, and exact ties (identical keys, identical
//   logits) are frequent. One sequence in four is "one-hot": keys and queries in {-64, 0, 64}, so
//   logits that differ at all differ by more than 1448 and every softmax weight is exactly 0 or
//   1/m, in the library (docs/design.md A(k)) and in the oracle alike: rows that receive no
//   attention tie exactly, which exercises the tie rules of the H2O core (earliest evicted; in a
//   re-budget the later position survives), where ordinary data almost never produces an exact tie.
//
// Checks after every accepted call:
//   * the returned window is the rows retained before the call followed by every row of the call
//     (docs/design.md 4.4): bitwise, in ascending position for update_and_fetch /
//     update_and_fetch_into; for update_and_view the earlier rows may come in any order
//     (positions() say which) and the call's rows come last in arrival order (docs/design.md 2.3);
//   * offset(), tokens_seen(), tokens_kept(), kept_bytes(), full_seq_bytes(), compression_ratio(),
//     heap_bytes() >= kept_bytes(), batch()/heads()/key_dim()/value_dim();
//   * the retained row count per head equals a count model that does not depend on which rows were
//     evicted (and so stays valid after a tolerated divergence, see below), and is within the
//     budget (H2O core and TOVA once the budget is known, StreamingLLM n_sink + window);
//   * retained positions are ascending, below offset(), include every sink, and (H2O core) include
//     the newest protected_recent() rows of the call; state() holds exactly the rows that were fed
//     at those positions;
//   * retained positions equal the oracle's per head, and scores are within 1e-6 absolute or 1e-4
//     relative of the oracle's (H2O core, TOVA; SnapKV for the rows of the compressed call);
//   * budget(), n_sink(), protected_recent(), layer_budget(), compressed(), concentration()
//     (against the Gram-matrix reference, 1e-9), budget_adopted(), and the coordinator's reports,
//     finalisation and resolved budget against a model of docs/design.md 5.4.
// Checks after every rejected call: it threw std::invalid_argument (nothing else), and state(),
// offset(), the accounting, heap_bytes(), dims, scores, positions, budget(), protected_recent(),
// layer_budget(), compressed(), concentration(), budget_adopted() and the coordinator (reports,
// finalisation, generation) are exactly as before (strong guarantee, docs/design.md 8): the shared
// Snapshot of tests/support/subjects.hpp. A call expected to be valid must not throw, and vice
// versa. Policy state (scores, positions, budget, n_sink, protected window) is read through the
// public policy classes (tests/support/test_support.hpp: visit_core / visit_scored and the policy_*
// / core_* helpers), never through the library's detail layer.
//
// Tolerance for float32 scoring against the double oracle (the only excused difference):
//   The library scores in float32, the oracle in double. When the oracle takes an eviction decision
//   (one H2O token, one H2O once-per-call eviction, a re-budget trim, one TOVA token, the SnapKV
//   compression), the harness records whether the decision was *ambiguous*: some evicted
//   candidate and some kept candidate have oracle scores that differ, but by at most kTieRelTol
//   (1e-4) of the larger one, or by at most kTieAbsFloor (1e-42) in absolute terms (decayed
//   scores: float32 holds nothing below 1.4e-45 and spaces its subnormals 1.4e-45 apart, so a
//   decay of 0.25 per token takes 0.4 to 0 in float32 in about 74 tokens while double keeps
//   2e-47; the library's rounding there stays below 0.7e-45 / (1 - decay) <= 3.5e-44 for the
//   decays drawn), or are equal by coincidence (below). A retained-set or score mismatch in a head
//   is excused only if that head had an ambiguous decision in the same call; the head is then
//   marked diverged and its positions and scores are no longer compared with the oracle until the
//   next reset (the count, sink, recent-window and content checks above continue). A tie that is
//   exact by construction is never ambiguous: both scores exactly 0 (rows that never received
//   attention); for TOVA and SnapKV, bitwise-identical keys (identical columns of the same
//   softmaxes); for TOVA scored by one softmax row (no queries, or G = 1), every exact tie (equal
//   weights <=> equal logits, and the logits of this data are exact in float32). The library must
//   break those exactly as docs/design.md says (earliest evicted; in a re-budget the later position
//   survives). Other equal doubles are different computations that happen to round alike (sums such
//   as 9/15 + 1/2 + 1/2 and 9/15 + 1/4 + 1/4 + 1/4 + 1/4), which float32 may split, so they count
//   as near-ties. Scores that agree to 1e-4 are 100x wider than float32 accumulation error on this
//   data (ordinary logits are bounded by 2*2*8/sqrt(8) < 12, so no weight underflows; one-hot
//   weights are exact), so a real scoring or tie-breaking bug still shows, as does a mismatch in a
//   call with no near-tie. (Measured on ~130k fuzzed decisions: 1.3% were near-ties, most of them
//   differences of 1e-16..1e-8 between quantities that are equal in exact arithmetic.) With mixed
//   query mode the H2O-core and TOVA oracles (one scoring rule per sequence) are not consulted;
//   SnapKV keeps both oracles.
#pragma once

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "reference/policy_oracles.hpp"
#include "support/subjects.hpp"

namespace veloxquant::fuzz {

/// Relative gap below which two different oracle scores at an eviction boundary are a near-tie.
inline constexpr double kTieRelTol = 1e-4;
/// Absolute gap below which two oracle scores are a near-tie: about 700 of float32's smallest
/// subnormal (1.4e-45), 30x the library's accumulated rounding of a decayed subnormal score.
inline constexpr double kTieAbsFloor = 1e-42;
/// Library score vs oracle score: absolute or relative tolerance.
inline constexpr double kScoreAbsTol = 1e-6;
inline constexpr double kScoreRelTol = 1e-4;
/// The oracle ranks KeyDiff's candidates by -(u . m) (|u|, |m| <= 1; the library divides by
/// |m| + 1e-8, which changes no order): the library's error in it is absolute, float32 products
/// (about D * 6e-8) and the fixed-point mean (n * 2^-33 per component) (docs/design.md 4.7). The
/// tie floor of its decisions.
inline constexpr double kKeyDiffAbsTol = 1e-5;
/// concentration() vs the Gram-matrix reference.
inline constexpr double kConcentrationTol = 1e-9;
/// Operations per input, tokens per call.
inline constexpr int kMaxOps = 48;
inline constexpr int kMaxS = 40;

/// Counters of one or more runs (for the replay test and for tuning the corpus).
struct Stats {
  std::uint64_t runs = 0, invalid_configs = 0, calls = 0, rejected = 0, resets = 0, trims = 0;
  std::uint64_t tokens = 0, decisions = 0, ambiguous = 0, excused = 0, query_calls = 0;
  std::uint64_t reloads = 0;
  std::uint64_t policy_runs[9] = {};
};

struct Options {
  bool trace = false;      ///< print every operation to stderr
  Stats* stats = nullptr;  ///< accumulate counters here
};

namespace detail {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
namespace vt = veloxquant::test;
using Index = Eigen::Index;
using Positions = std::vector<std::int64_t>;
using Rows = std::vector<std::vector<double>>;

/// A violated check: unwinds the run (never derived from std::exception, so no catch of the
/// library's exceptions can swallow it).
struct Violation {
  std::string what;
};

/// Reads the input; past its end every byte is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : std::uint8_t{0}; }
  /// 0 .. n-1
  int pick(int n) { return static_cast<int>(u8()) % n; }
  /// lo .. hi inclusive
  int range(int lo, int hi) { return lo + pick(hi - lo + 1); }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    return v;
  }
  bool exhausted() const { return pos_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// Small deterministic generator for tensor data (xorshift64 seeded through splitmix64).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    std::uint64_t z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    s_ = (z ^ (z >> 31)) | 1u;
  }
  std::uint64_t next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t s_;
};

/// How the rows of a tensor are drawn. Every entry is a multiple of 0.25 in [-2, 2].
enum class DataMode { Uniform, Ternary, Sparse, Palette, Constant, kCount };

/// Entries of "one-hot" sequences: logits that differ at all differ by at least
/// 64 * 64 / sqrt(8) > 1448, so every softmax weight is exactly 0 or exactly 1/m (m tied maxima)
/// in float32 and in double alike (exp underflows below -745 in double, -87 in the library), and
/// exact score ties between different rows are common on every scored path.
inline constexpr double kOneHotLevel = 64.0;

inline double draw_level(Rng& rng, DataMode mode, bool one_hot = false) {
  if (one_hot) {
    if (mode == DataMode::Sparse)
      return rng.below(4) == 0 ? kOneHotLevel * (rng.below(2) ? 1 : -1) : 0.0;
    return kOneHotLevel * static_cast<double>(rng.below(3) - 1);
  }
  switch (mode) {
    case DataMode::Ternary:
      return static_cast<double>(rng.below(3) - 1);
    case DataMode::Sparse:
      return rng.below(4) == 0 ? 0.25 * static_cast<double>(rng.below(17) - 8) : 0.0;
    default:
      return 0.25 * static_cast<double>(rng.below(17) - 8);
  }
}

/// Fills t ([B, H, S, D], double) row by row. Palette/Constant rows repeat rows of `palette`
/// ([P][D], P >= 1), so identical keys recur within and across calls.
inline void fill(vc::Tensor4<double>& t, Rng& rng, DataMode mode, const Rows& palette,
                 bool one_hot = false) {
  const Index D = t.dimension(3);
  const Index rows = D == 0 ? 0 : t.size() / D;
  for (Index r = 0; r < rows; ++r) {
    double* row = t.data() + r * D;
    if ((mode == DataMode::Palette || mode == DataMode::Constant) && !palette.empty() &&
        static_cast<Index>(palette.front().size()) == D) {
      const std::size_t p =
          mode == DataMode::Constant
              ? 0
              : static_cast<std::size_t>(rng.below(static_cast<int>(palette.size())));
      for (Index d = 0; d < D; ++d) row[d] = palette[p][static_cast<std::size_t>(d)];
    } else {
      for (Index d = 0; d < D; ++d) row[d] = draw_level(rng, mode, one_hot);
    }
  }
}

template <class T>
double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}

template <class T>
std::string type_name() {
  if (std::is_same_v<T, float>) return "float";
  if (std::is_same_v<T, Eigen::half>) return "half";
  return "bfloat16";
}

template <class V>
std::string fmt_vec(const std::vector<V>& v, std::size_t max_items = 64) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < v.size() && i < max_items; ++i) os << (i ? " " : "") << v[i];
  if (v.size() > max_items) os << " ...";
  os << ']';
  return os.str();
}

/// A candidate row of one eviction decision: its oracle score and position.
struct Candidate {
  double score;
  std::int64_t position;
};

/// Whether the rows at two positions hold bitwise-identical keys (nullptr: unknown).
using SameKey = std::function<bool(std::int64_t, std::int64_t)>;

/// True when the decision could legitimately go the other way in float32: some evicted candidate
/// and some kept candidate have oracle scores within kTieRelTol of each other, or within
/// kTieAbsFloor (decayed scores that float32 rounds to a subnormal or to 0). Ties that are exact
/// by construction are not ambiguous (the tie rules decide them, in the library too): both scores
/// exactly 0 (rows that never received attention); when `same_key` is given (candidates scored
/// by columns of the same softmaxes: TOVA, SnapKV), bitwise-identical keys; with
/// `all_exact_ties_decided` (one softmax row: TOVA without queries or with G = 1, whose weights
/// are equal exactly when the logits are, and logits of this data are exact), every exact tie.
/// Any other pair of equal doubles is two different computations that happen to round alike
/// (e.g. 9/15 + 2 * 1/2 and 9/15 + 4 * 1/4), which float32 may split either way: a near-tie.
/// `abs_floor` widens kTieAbsFloor for scores whose float32 error is absolute (KeyDiff's cosines,
/// for which a tie at 0 is no exact state either).
inline bool near_tie(const std::vector<Candidate>& cands, const std::set<std::int64_t>& evicted,
                     const SameKey& same_key = nullptr, bool all_exact_ties_decided = false,
                     double abs_floor = kTieAbsFloor) {
  for (const Candidate& e : cands) {
    if (!evicted.count(e.position)) continue;
    for (const Candidate& c : cands) {
      if (evicted.count(c.position)) continue;
      if (c.score == e.score) {
        // (Zero is exact for attention mass, never given; not for KeyDiff's cosines, whose
        // float32 values near an exact 0 may be +-1e-9: abs_floor above kTieAbsFloor.)
        if ((e.score == 0.0 && abs_floor <= kTieAbsFloor) || all_exact_ties_decided) continue;
        if (same_key && same_key(e.position, c.position)) continue;
        return true;
      }
      const double scale = std::max(std::fabs(c.score), std::fabs(e.score));
      const double gap = std::fabs(c.score - e.score);
      // Close relative to their size; or so close in absolute terms that float32 holds them as
      // subnormals or 0 (a decay of 0.25 per token takes 0.4 to 2e-47 in about 77 tokens, 0 in
      // float32), so it may order them either way or tie them at 0.
      if (gap <= kTieRelTol * scale || gap <= std::max(kTieAbsFloor, abs_floor)) return true;
    }
  }
  return false;
}

inline std::set<std::int64_t> minus(const Positions& all, const Positions& kept) {
  std::set<std::int64_t> out(all.begin(), all.end());
  for (const std::int64_t p : kept) out.erase(p);
  return out;
}

enum class Policy {
  Standard,
  SqueezeSingle,
  SqueezeBuilder,
  H2O,
  PyramidSingle,
  PyramidBuilder,
  TOVA,
  Streaming,
  SnapKV,
  kCount
};

inline const char* policy_name(Policy p) {
  switch (p) {
    case Policy::Standard:
      return "standard";
    case Policy::SqueezeSingle:
      return "squeeze(single)";
    case Policy::SqueezeBuilder:
      return "squeeze(builder)";
    case Policy::H2O:
      return "h2o";
    case Policy::PyramidSingle:
      return "pyramidkv(single)";
    case Policy::PyramidBuilder:
      return "pyramidkv(builder)";
    case Policy::TOVA:
      return "tova";
    case Policy::Streaming:
      return "streaming_llm";
    case Policy::SnapKV:
      return "snapkv";
    default:
      return "?";
  }
}

enum class QueryMode { None, Always, Mixed };
enum class Api { Fetch, View, FetchInto };

inline const char* api_name(Api a) {
  return a == Api::Fetch ? "fetch" : a == Api::View ? "view" : "fetch_into";
}

/// What is wrong with a call (None: a valid call).
enum class Bad {
  None,
  NanKey,
  InfKey,
  OverflowKey,  // double key that is +-inf after conversion to T
  ValuesB,      // values' B differs from the keys'
  ValuesH,
  ValuesS,
  ZeroB,
  ZeroH,
  ZeroKeyD,
  ZeroValueD,
  ChangeB,  // differs from the first call (only once dims are known)
  ChangeH,
  ChangeDk,
  ChangeDv,
  QueryHq,  // Hq not a positive multiple of H
  QueryB,
  QueryS,
  QueryD,
  QueryNan,
  QueryInf,
  QueryOverflow,  // double query that is inf in float32
  kCount
};

inline const char* bad_name(Bad b) {
  static const char* names[] = {
      "none",     "nan-key",   "inf-key",   "overflow-key",  "values-B", "values-H",
      "values-S", "zero-B",    "zero-H",    "zero-Dk",       "zero-Dv",  "change-B",
      "change-H", "change-Dk", "change-Dv", "query-Hq",      "query-B",  "query-S",
      "query-D",  "query-nan", "query-inf", "query-overflow"};
  return names[static_cast<int>(b)];
}

inline bool is_query_bad(Bad b) { return b >= Bad::QueryHq; }

/// One head's oracles (only those of the cache's policy are engaged) and the rows fed to it.
template <class T>
struct HeadModel {
  std::optional<ref::H2OHeadOracle> h2o;   // fed by absorb: key-as-query proxy (docs/design.md 4.2)
  std::optional<ref::H2OHeadOracle> h2oq;  // fed by absorb_call with queries (docs/design.md 4.6)
  std::optional<ref::TOVAHeadOracle> tova;
  std::optional<ref::TOVAHeadOracle> tovaq;
  std::optional<ref::StreamingLLMHeadOracle> stream;
  std::optional<ref::SnapKVHeadOracle> snap;
  std::optional<ref::SnapKVHeadOracle> snapq;
  bool diverged = false;   // a tolerated near-tie divergence happened (until reset)
  bool ambiguous = false;  // an ambiguous decision in the current call
  /// Every row fed since the last reset, by position: key then value, as stored (T).
  std::vector<std::vector<T>> fed_keys, fed_values;
};

/// Everything a cache and its coordinator report without being called (the shared snapshot of
/// tests/support/subjects.hpp, read through the public API); compared around rejected calls.
using Snapshot = vt::Snapshot;

/// The window a call returned, copied out of the tensors or the view: per head n rows.
template <class T>
struct Window {
  Index B = 0, H = 0, n = 0, S = 0, Dk = 0, Dv = 0;
  std::vector<T> keys, values;  // [B, H, n, Dk], [B, H, n, Dv]
  Positions positions;          // [B, H, n] (views only)
  bool is_view = false;
};

/// Runs one input on storage type T.
template <class T>
class Harness {
 public:
  Harness(Bytes& in, const Options& opt) : in_(in), opt_(opt) {}

  void run() {
    policy_ = static_cast<Policy>(in_.pick(static_cast<int>(Policy::kCount)));
    if (opt_.stats) ++opt_.stats->policy_runs[static_cast<int>(policy_)];
    if (!construct()) return;
    start_sequence();
    for (op_ = 0; op_ < kMaxOps && !in_.exhausted(); ++op_) step();
  }

 private:
  // ------------------------------------------------------------------------------------------
  // Failure reporting
  // ------------------------------------------------------------------------------------------

  [[noreturn]] void fail(const std::string& what) const {
    std::ostringstream os;
    os << what << "\n  run: " << describe() << "\n  ops:\n" << trace_;
    throw Violation{os.str()};
  }
  void expect(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  void log(const std::string& line) {
    if (opt_.trace) std::fprintf(stderr, "[fuzz] %s\n", line.c_str());
    trace_ += "    #" + std::to_string(op_) + " " + line + "\n";
    // Keep the tail only (the message names the last operations).
    if (trace_.size() > 6000) trace_.erase(0, trace_.find('\n', trace_.size() - 5000) + 1);
  }
  std::string describe() const {
    std::ostringstream os;
    os << policy_name(policy_) << " T=" << type_name<T>() << " via " << via_;
    if (core_policy()) {
      os << " budget=" << (model_budget_ ? std::to_string(*model_budget_) : "unknown")
         << " n_sink=" << n_sink_ << " g=" << model_grace();
    }
    const auto& c = cfg_;
    if (core_policy() && c.value_norm_power > 0.0) os << " value_norm_power=" << c.value_norm_power;
    switch (policy_) {
      case Policy::SqueezeSingle:
      case Policy::SqueezeBuilder:
        os << " squeeze_budget=" << c.squeeze_budget << " resolved="
           << (c.squeeze_resolved_budget ? std::to_string(*c.squeeze_resolved_budget) : "-")
           << " ratio=" << c.squeeze_recent_ratio << " decay=" << c.squeeze_decay
           << " strength=" << c.squeeze_strength << " defer=" << c.squeeze_defer << " L=" << layers_
           << " layer=" << layer_ << " proxy_scoring=" << c.proxy_scoring;
        break;
      case Policy::H2O:
        os << " h2o_budget=" << c.h2o_budget << " grace=" << c.h2o_grace << " decay=" << c.h2o_decay
           << " proxy_scoring=" << c.proxy_scoring;
        break;
      case Policy::PyramidSingle:
      case Policy::PyramidBuilder:
        os << " pyramid_budget=" << c.pyramid_budget << " resolved="
           << (c.pyramid_resolved_budget ? std::to_string(*c.pyramid_resolved_budget) : "-")
           << " beta=" << c.pyramid_beta << " ratio=" << c.pyramid_recent_ratio
           << " decay=" << c.pyramid_decay << " L=" << layers_ << " layer=" << layer_
           << " proxy_scoring=" << c.proxy_scoring;
        break;
      case Policy::TOVA:
        os << " tova_budget=" << c.tova_budget << " n_sink=" << c.tova_n_sink;
        break;
      case Policy::Streaming:
        os << " n_sink=" << c.stream_n_sink << " window=" << c.stream_window_size;
        break;
      case Policy::SnapKV:
        os << " snap_budget=" << c.snap_budget << " n_sink=" << c.snap_n_sink
           << " obs=" << c.snap_obs_window;
        break;
      default:
        break;
    }
    os << " B=" << B_ << " H=" << H_ << " Dk=" << Dk_ << " Dv=" << Dv_ << " queries="
       << (qmode_ == QueryMode::None     ? "none"
           : qmode_ == QueryMode::Always ? "always"
                                         : "mixed");
    return os.str();
  }

  // ------------------------------------------------------------------------------------------
  // Construction (docs/design.md 2.1, 2.6, 2.7)
  // ------------------------------------------------------------------------------------------

  bool core_policy() const {
    return policy_ == Policy::SqueezeSingle || policy_ == Policy::SqueezeBuilder ||
           policy_ == Policy::H2O || policy_ == Policy::PyramidSingle ||
           policy_ == Policy::PyramidBuilder;
  }
  bool scored_policy() const {
    return core_policy() || policy_ == Policy::TOVA || policy_ == Policy::SnapKV;
  }

  static double pick_from(Bytes& in, std::initializer_list<double> xs) {
    const int i = in.pick(static_cast<int>(xs.size()));
    return *(xs.begin() + i);
  }

  /// Builds the configuration and the cache. Returns false when the configuration was (rightly)
  /// rejected.
  bool construct() {
    Bytes& in = in_;
    vc::KVCacheConfig& c = cfg_;
    // The oracles report on the first call (docs/design.md 5.4 with squeeze_calibration_tokens
    // = 1); the calibration window has its own tests (test_squeeze_cache.cpp).
    c.squeeze_calibration_tokens = 1;
    const int budget = in.range(1, 24);
    const int n_sink = in.range(0, std::min(budget - 1, 5));
    const double ratio = pick_from(in, {0.5, 0.0, 0.25, 0.75, 1.0, 0.3});
    const double decay = pick_from(in, {0.98, 1.0, 0.9, 0.5, 0.25});
    const std::uint8_t flags = in.u8();
    const bool direct = (flags & 1) != 0;  // constructor instead of factory
    switch (policy_) {
      case Policy::Standard:
        c.method = "standard";
        break;
      case Policy::SqueezeSingle:
      case Policy::SqueezeBuilder:
        c.method = "squeeze";
        c.squeeze_budget = budget;
        c.squeeze_n_sink = n_sink;
        c.squeeze_recent_ratio = ratio;
        c.squeeze_decay = decay;
        c.squeeze_strength = pick_from(in, {1.0, 0.0, 0.5, 0.25});
        c.squeeze_defer = (flags & 2) != 0;
        if ((flags & 12) == 4) c.squeeze_resolved_budget = in.range(n_sink + 1, 24);
        if (policy_ == Policy::SqueezeBuilder) {
          layers_ = in.range(1, 3);
          layer_ = in.range(0, layers_ - 1);
        }
        break;
      case Policy::H2O:
        c.method = "h2o";
        c.h2o_budget = budget;
        c.h2o_n_sink = n_sink;
        c.h2o_grace = in.range(0, 10);
        c.h2o_decay = decay;
        break;
      case Policy::PyramidSingle:
      case Policy::PyramidBuilder:
        c.method = "pyramidkv";
        c.pyramid_budget = budget;
        c.pyramid_n_sink = n_sink;
        c.pyramid_recent_ratio = ratio;
        c.pyramid_decay = decay;
        c.pyramid_beta = pick_from(in, {2.0, 1.0, 1.5, 3.0});
        if (policy_ == Policy::PyramidSingle && (flags & 12) == 4) {
          c.pyramid_resolved_budget = in.range(n_sink + 1, 24);
        }
        if (policy_ == Policy::PyramidBuilder) {
          layers_ = in.range(1, 4);
          layer_ = in.range(0, layers_ - 1);
        }
        break;
      case Policy::TOVA:
        c.method = "tova";
        c.tova_budget = budget;
        c.tova_n_sink = n_sink;
        break;
      case Policy::Streaming:
        c.method = "streaming_llm";
        c.stream_n_sink = in.range(0, 5);
        c.stream_window_size = in.range(1, 16);
        break;
      case Policy::SnapKV:
        c.method = "snapkv";
        c.snap_budget = budget;
        c.snap_n_sink = n_sink;
        c.snap_obs_window = (flags & 16) ? in.range(1, 40) : in.range(1, 8);
        break;
      default:
        break;
    }
    if (core_policy()) {
      // Flag bits 5-6: the query-free scorer (docs/design.md 4.7); 0 (and 3): the SPEC proxy.
      const int proxy = (flags >> 5) & 3;
      scorer_ = proxy == 1   ? ref::H2OHeadOracle::Scorer::keydiff
                : proxy == 2 ? ref::H2OHeadOracle::Scorer::knorm
                             : ref::H2OHeadOracle::Scorer::key_as_query;
      c.proxy_scoring = proxy == 1 ? "keydiff" : proxy == 2 ? "knorm" : "key_as_query";
      // Flag bit 7: value-weighted eviction in calls with queries (docs/design.md 4.8), p = 2
      // (squared norms) or, with bit 4 (SnapKV's alone otherwise), p = 0.5 (through pow).
      c.value_norm_power = (flags & 128) ? ((flags & 16) ? 0.5 : 2.0) : 0.0;
    }
    const bool builder = policy_ == Policy::SqueezeBuilder || policy_ == Policy::PyramidBuilder;
    via_ = builder ? "builder" : direct ? "constructor" : "factory";

    // 1 time in 12: exactly one invalid field, which validate() must name.
    std::string bad_field;
    if (in.pick(12) == 0) bad_field = break_config(in, direct && !builder);
    // A field that validate() does not check for the method in use leaves the config valid.
    if (!bad_field.empty() && !validated_for(bad_field, c.method)) {
      log("invalid " + bad_field + " is not checked for method " + c.method);
      bad_field.clear();
    }
    if (!bad_field.empty()) {
      if (opt_.stats) ++opt_.stats->invalid_configs;
      log("construct with invalid " + bad_field);
      try {
        make_cache(direct);
      } catch (const std::invalid_argument& e) {
        const std::string msg = e.what();
        expect(msg.find(bad_field) != std::string::npos,
               "config error message does not name the bad field " + bad_field + ": " + msg);
        return false;
      } catch (const std::exception& e) {
        fail(std::string("invalid config threw a non-invalid_argument exception: ") + e.what());
      }
      fail("a config with an invalid " + bad_field + " was accepted");
    }
    try {
      make_cache(direct);
    } catch (const std::exception& e) {
      fail(std::string("a valid config was rejected: ") + e.what());
    }
    bind_cache();
    init_budget_model();
    log("constructed " + describe());
    check_budget_getters();
    return true;
  }

  /// Whether validate() checks `field` in a config of `method` (docs/design.md 2.1): a method's
  /// own fields (by their prefix) for that method only, the H2O core's proxy_scoring and
  /// value_norm_power for squeeze, h2o and pyramidkv, the common fields always.
  static bool validated_for(const std::string& field, const std::string& method) {
    if (field == "proxy_scoring" || field == "value_norm_power") {
      return method == "squeeze" || method == "h2o" || method == "pyramidkv";
    }
    for (const auto& [prefix, owner] :
         std::initializer_list<std::pair<const char*, const char*>>{{"squeeze_", "squeeze"},
                                                                    {"h2o_", "h2o"},
                                                                    {"pyramid_", "pyramidkv"},
                                                                    {"tova_", "tova"},
                                                                    {"stream_", "streaming_llm"},
                                                                    {"snap_", "snapkv"}}) {
      if (field.rfind(prefix, 0) == 0) return owner == method;
    }
    return true;
  }

  /// Makes one field invalid; returns the field's name (the message must contain it), or "" when
  /// the chosen breakage does not apply.
  std::string break_config(Bytes& in, bool direct) {
    vc::KVCacheConfig& c = cfg_;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    switch (in.pick(27)) {
      case 0:
        c.squeeze_budget = -in.range(0, 3);
        return "squeeze_budget";
      case 1:
        c.squeeze_n_sink = -in.range(1, 3);
        return "squeeze_n_sink";
      case 2:
        c.squeeze_strength = pick_from(in, {1.5, -0.1, nan, inf});
        return "squeeze_strength";
      case 3:
        c.squeeze_resolved_budget = -in.range(0, 2);
        return "squeeze_resolved_budget";
      case 4:
        c.squeeze_recent_ratio = pick_from(in, {nan, 1.01, -0.5});
        return "squeeze_recent_ratio";
      case 5:
        c.squeeze_decay = pick_from(in, {0.0, 1.1, nan, -1.0});
        return "squeeze_decay";
      case 6:
        c.h2o_budget = -in.range(0, 3);
        return "h2o_budget";
      case 7:
        c.h2o_n_sink = -in.range(1, 3);
        return "h2o_n_sink";
      case 8:
        c.h2o_grace = -in.range(1, 3);
        return "h2o_grace";
      case 9:
        c.h2o_decay = pick_from(in, {0.0, 2.0, nan});
        return "h2o_decay";
      case 10:
        c.pyramid_budget = -in.range(0, 3);
        return "pyramid_budget";
      case 11:
        c.pyramid_n_sink = -in.range(1, 3);
        return "pyramid_n_sink";
      case 12:
        c.pyramid_beta = pick_from(in, {0.5, nan, inf, 0.999});
        return "pyramid_beta";
      case 13:
        c.pyramid_resolved_budget = -in.range(0, 2);
        return "pyramid_resolved_budget";
      case 14:
        c.pyramid_recent_ratio = pick_from(in, {-0.5, 2.0, nan});
        return "pyramid_recent_ratio";
      case 15:
        c.pyramid_decay = pick_from(in, {2.0, 0.0, nan});
        return "pyramid_decay";
      case 16:
        c.tova_budget = -in.range(0, 3);
        return "tova_budget";
      case 17:
        c.tova_n_sink = -in.range(1, 3);
        return "tova_n_sink";
      case 18:
        c.stream_n_sink = -in.range(1, 3);
        return "stream_n_sink";
      case 19:
        c.stream_window_size = -in.range(0, 3);
        return "stream_window_size";
      case 20:
        c.snap_budget = -in.range(0, 3);
        return "snap_budget";
      case 21:
        c.snap_obs_window = -in.range(0, 3);
        return "snap_obs_window";
      case 22:
        c.snap_n_sink = -in.range(1, 3);
        return "snap_n_sink";
      case 23: {  // n_sink >= budget for the method in use
        const int extra = in.range(0, 2);
        switch (policy_) {
          case Policy::SqueezeSingle:
          case Policy::SqueezeBuilder:
            if (c.squeeze_resolved_budget && (extra & 1)) {
              c.squeeze_n_sink = *c.squeeze_resolved_budget + extra;
              if (c.squeeze_n_sink >= c.squeeze_budget) c.squeeze_budget = c.squeeze_n_sink + 1;
            } else {
              c.squeeze_n_sink = c.squeeze_budget + extra;
              c.squeeze_resolved_budget.reset();
            }
            return "squeeze_n_sink";
          case Policy::H2O:
            c.h2o_n_sink = c.h2o_budget + extra;
            return "h2o_n_sink";
          case Policy::PyramidSingle:
          case Policy::PyramidBuilder:
            if (c.pyramid_resolved_budget && (extra & 1)) {
              c.pyramid_n_sink = *c.pyramid_resolved_budget + extra;
              if (c.pyramid_n_sink >= c.pyramid_budget) c.pyramid_budget = c.pyramid_n_sink + 1;
            } else {
              c.pyramid_n_sink = c.pyramid_budget + extra;
              c.pyramid_resolved_budget.reset();
            }
            return "pyramid_n_sink";
          case Policy::TOVA:
            c.tova_n_sink = c.tova_budget + extra;
            return "tova_n_sink";
          case Policy::SnapKV:
            c.snap_n_sink = c.snap_budget + extra;
            return "snap_n_sink";
          default:
            return "";  // standard and streaming_llm have no such rule
        }
      }
      case 25:  // the H2O core's own common fields (validated for squeeze, h2o, pyramidkv)
        c.proxy_scoring = std::array<const char*, 4>{"bogus", "KeyDiff", "", "knorm "}[in.pick(4)];
        return "proxy_scoring";
      case 26:
        c.value_norm_power = pick_from(in, {nan, -0.5, 4.5, inf});
        return "value_norm_power";
      default:  // an unknown method, only through the factory or the builder
        if (direct) return "";
        c.method = in.pick(2) ? "bogus" : "SQUEEZE";
        return "method";
    }
  }

  void make_cache(bool direct) {
    owned_.clear();
    layer_cache_ = nullptr;
    switch (policy_) {
      case Policy::SqueezeBuilder:
      case Policy::PyramidBuilder:
        owned_ = vc::KVCacheBuilder::for_model<T>(layers_, cfg_);
        expect(static_cast<int>(owned_.size()) == layers_,
               "for_model returned the wrong number of caches");
        layer_cache_ = owned_[static_cast<std::size_t>(layer_)].get();
        return;
      default:
        break;
    }
    std::unique_ptr<vc::KVCache<T>> c;
    if (!direct) {
      c = vc::KVCacheFactory::create<T>(cfg_);
    } else {
      switch (policy_) {
        case Policy::Standard:
          c = std::make_unique<vc::KVCache<T>>(cfg_);
          break;
        case Policy::SqueezeSingle:
          c = std::make_unique<vc::SqueezeAttentionCache<T>>(cfg_);
          break;
        case Policy::H2O:
          c = std::make_unique<vc::H2OCache<T>>(cfg_);
          break;
        case Policy::PyramidSingle:
          c = std::make_unique<vc::PyramidKVCache<T>>(cfg_);
          break;
        case Policy::TOVA:
          c = std::make_unique<vc::TOVACache<T>>(cfg_);
          break;
        case Policy::Streaming:
          c = std::make_unique<vc::StreamingLLMCache<T>>(cfg_);
          break;
        case Policy::SnapKV:
          c = std::make_unique<vc::SnapKVCache<T>>(cfg_);
          break;
        default:
          break;
      }
    }
    layer_cache_ = c.get();
    owned_.push_back(std::move(c));
  }

  /// Typed pointers, checking that the factory/builder made the class of the policy.
  void bind_cache() {
    vc::KVCache<T>* c = layer_cache_;
    expect(c != nullptr, "no cache was made");
    // Scores, positions, budget, n_sink and protected window are read through the public policy
    // classes (tests/support/test_support.hpp), never through the library's detail layer.
    scored_ = vt::visit_scored(*c, [](const auto&) {});
    core_ = vt::visit_core(*c, [](const auto&) {});
    squeeze_ = dynamic_cast<vc::SqueezeAttentionCache<T>*>(c);
    h2o_ = dynamic_cast<vc::H2OCache<T>*>(c);
    pyramid_ = dynamic_cast<vc::PyramidKVCache<T>*>(c);
    tova_ = dynamic_cast<vc::TOVACache<T>*>(c);
    stream_ = dynamic_cast<vc::StreamingLLMCache<T>*>(c);
    snap_ = dynamic_cast<vc::SnapKVCache<T>*>(c);
    bool ok = false;
    switch (policy_) {
      case Policy::Standard:
        ok = !scored_ && !stream_ && c->is_trimmable();
        break;
      case Policy::SqueezeSingle:
        ok = squeeze_ && !squeeze_->coordinator() && !squeeze_->layer_id();
        break;
      case Policy::SqueezeBuilder:
        ok = squeeze_ && squeeze_->coordinator() && squeeze_->layer_id() == layer_ &&
             squeeze_->coordinator()->n_layers() == layers_;
        break;
      case Policy::H2O:
        ok = h2o_ != nullptr;
        break;
      case Policy::PyramidSingle:
      case Policy::PyramidBuilder:
        ok = pyramid_ != nullptr;
        break;
      case Policy::TOVA:
        ok = tova_ != nullptr;
        break;
      case Policy::Streaming:
        ok = stream_ != nullptr;
        break;
      case Policy::SnapKV:
        ok = snap_ != nullptr;
        break;
      default:
        break;
    }
    expect(ok, "the factory/builder made the wrong cache class for the method");
    expect(policy_ == Policy::Standard || !c->is_trimmable(), "an eviction cache is trimmable");
    if (policy_ == Policy::SqueezeBuilder) coordinator_ = squeeze_->coordinator();
  }

  // ------------------------------------------------------------------------------------------
  // Budget model of the H2O core (docs/design.md 4.2, 4.5, 5.4, 6)
  // ------------------------------------------------------------------------------------------

  int fallback_budget() const { return cfg_.squeeze_resolved_budget.value_or(cfg_.squeeze_budget); }

  void init_budget_model() {
    switch (policy_) {
      case Policy::SqueezeSingle:
      case Policy::SqueezeBuilder:
        n_sink_ = cfg_.squeeze_n_sink;
        decay_ = cfg_.squeeze_decay;
        ratio_grace_ = true;
        ratio_ = cfg_.squeeze_recent_ratio;
        break;
      case Policy::H2O:
        n_sink_ = cfg_.h2o_n_sink;
        decay_ = cfg_.h2o_decay;
        ratio_grace_ = false;
        grace_ = cfg_.h2o_grace;
        break;
      case Policy::PyramidSingle:
      case Policy::PyramidBuilder:
        n_sink_ = cfg_.pyramid_n_sink;
        decay_ = cfg_.pyramid_decay;
        ratio_grace_ = true;
        ratio_ = cfg_.pyramid_recent_ratio;
        break;
      default:
        break;
    }
    reset_budget_model(true);
  }

  /// The budget at construction or after reset().
  void reset_budget_model(bool coordinator_too) {
    calls_since_reset_ = 0;
    sq_reported_ = false;
    sq_adopted_ = false;
    switch (policy_) {
      case Policy::SqueezeSingle:
        model_budget_ = fallback_budget();
        break;
      case Policy::SqueezeBuilder:
        if (cfg_.squeeze_defer) {
          model_budget_.reset();
        } else {
          model_budget_ = fallback_budget();
        }
        if (coordinator_too) {
          coord_reports_.clear();
          coord_budgets_.clear();
          coord_finalized_ = false;
        }
        break;
      case Policy::H2O:
        model_budget_ = cfg_.h2o_budget;
        break;
      case Policy::PyramidSingle:
        model_budget_ = cfg_.pyramid_resolved_budget.value_or(cfg_.pyramid_budget);
        break;
      case Policy::PyramidBuilder: {
        const std::vector<int> b = ref::pyramid_budgets(layers_, cfg_.pyramid_budget,
                                                        cfg_.pyramid_n_sink, cfg_.pyramid_beta);
        model_budget_ = b[static_cast<std::size_t>(layer_)];
        break;
      }
      default:
        break;
    }
  }

  int grace_for(int budget) const {
    return ratio_grace_ ? ref::protected_recent_ratio(ratio_, budget, n_sink_)
                        : ref::protected_recent_fixed(grace_, budget, n_sink_);
  }
  int model_grace() const { return model_budget_ ? grace_for(*model_budget_) : 0; }
  std::function<int(int)> grace_fn() const {
    if (ratio_grace_) {
      const double r = ratio_;
      const int s = n_sink_;
      return [r, s](int b) { return ref::protected_recent_ratio(r, b, s); };
    }
    const int g = grace_;
    const int s = n_sink_;
    return [g, s](int b) { return ref::protected_recent_fixed(g, b, s); };
  }

  /// The coordinator model: the first report per layer wins; finalised at n_layers reports.
  void coord_report(int layer, double c) {
    if (coord_finalized_ || coord_reports_.count(layer)) return;
    coord_reports_[layer] = c;
    if (static_cast<int>(coord_reports_.size()) < layers_) return;
    std::vector<double> cs;
    for (const auto& kv : coord_reports_) cs.push_back(kv.second);
    const std::vector<int> b =
        ref::squeeze_budgets(cs, cfg_.squeeze_budget, cfg_.squeeze_n_sink, cfg_.squeeze_strength);
    std::size_t i = 0;
    for (const auto& kv : coord_reports_) coord_budgets_[kv.first] = b[i++];
    coord_finalized_ = true;
  }

  /// Makes `b` the budget in force (docs/design.md 4.5 trim in every head's oracle).
  void set_model_budget(int b) {
    model_budget_ = b;
    count_ = std::min<Index>(count_, b);
    if (!oracle_on()) return;
    for (auto& hm : heads_) {
      for (auto* o : {hm.h2o ? &*hm.h2o : nullptr, hm.h2oq ? &*hm.h2oq : nullptr}) {
        if (o == nullptr) continue;
        const Positions before = o->positions();
        // What the re-budget ranks by (KeyDiff: its ranking, not the scores; under
        // value_norm_power, the weighted ranks of a call with queries, whose start it is).
        std::vector<Candidate> cands = trim_candidates(ranked_rows(*o), b);
        o->set_budget(b);
        const bool keydiff =
            scorer_ == ref::H2OHeadOracle::Scorer::keydiff && hm.h2o && o == &*hm.h2o;
        note_decision(hm, cands, minus(before, o->positions()), false, false, keydiff);
      }
    }
  }

  /// The rows of `o` with what an eviction ranks them by in place of their scores (KeyDiff's
  /// ranking; the scores themselves for every other scorer).
  static std::vector<ref::OracleRow> ranked_rows(const ref::H2OHeadOracle& o) {
    std::vector<ref::OracleRow> rows = o.rows();
    const std::vector<double> rank = o.eviction_rank(o.value_power() > 0.0);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i].score = rank[i];
    return rows;
  }

  /// Candidates of a re-budget: rows that are neither sinks nor among the newest g(b).
  std::vector<Candidate> trim_candidates(const std::vector<ref::OracleRow>& rows, int b) const {
    std::vector<Candidate> out;
    const std::size_t n = rows.size();
    if (n <= static_cast<std::size_t>(b)) return out;
    const auto g = static_cast<std::size_t>(grace_for(b));
    for (std::size_t i = 0; i < n; ++i) {
      if (rows[i].position < n_sink_ || i + g >= n) continue;
      out.push_back({rows[i].score, rows[i].position});
    }
    return out;
  }

  /// Records one eviction decision of the oracle; `keys_decide`: the candidates are columns of
  /// the same softmaxes (TOVA, SnapKV), so bitwise-identical keys tie exactly; `one_softmax`:
  /// their scores are one softmax row, so every exact tie is exact in float32 too (near_tie);
  /// `keydiff`: the candidates are ranked by KeyDiff's cosines (an absolute tie floor).
  void note_decision(HeadModel<T>& hm, const std::vector<Candidate>& cands,
                     const std::set<std::int64_t>& evicted, bool keys_decide = false,
                     bool one_softmax = false, bool keydiff = false) {
    if (evicted.empty()) return;
    if (opt_.stats) ++opt_.stats->decisions;
    SameKey same_key;
    if (keys_decide) {
      same_key = [&hm](std::int64_t a, std::int64_t b) {
        const auto& ka = hm.fed_keys[static_cast<std::size_t>(a)];
        const auto& kb = hm.fed_keys[static_cast<std::size_t>(b)];
        return ka.size() == kb.size() &&
               std::memcmp(ka.data(), kb.data(), ka.size() * sizeof(T)) == 0;
      };
    }
    const double floor = keydiff ? kKeyDiffAbsTol : kTieAbsFloor;
    if (near_tie(cands, evicted, same_key, one_softmax, floor)) {
      hm.ambiguous = true;
      if (opt_.stats) ++opt_.stats->ambiguous;
      std::ostringstream os;
      os.precision(17);
      os << "near-tie decision: evicted";
      for (const Candidate& c : cands) {
        if (evicted.count(c.position)) os << " " << c.position << ":" << c.score;
      }
      os << " kept";
      for (const Candidate& c : cands) {
        if (!evicted.count(c.position)) os << " " << c.position << ":" << c.score;
      }
      log(os.str());
    }
  }

  /// True while the per-head oracles of the policy are consulted (not in mixed query mode for the
  /// policies whose oracle has one scoring rule).
  bool oracle_on() const {
    if (qmode_ != QueryMode::Mixed) return true;
    return !(core_policy() || policy_ == Policy::TOVA);
  }

  // ------------------------------------------------------------------------------------------
  // Sequences
  // ------------------------------------------------------------------------------------------

  /// Chooses the dims and the query mode of a new sequence and makes fresh oracles.
  void start_sequence() {
    B_ = in_.range(1, 2);
    H_ = in_.range(1, 3);
    Dk_ = in_.range(1, 8);
    Dv_ = in_.pick(3) == 0 ? Dk_ : static_cast<Index>(in_.range(1, 8));
    const std::uint8_t qb = in_.u8();
    const int q = qb % 4;
    qmode_ = q < 2 ? QueryMode::None : q == 2 ? QueryMode::Always : QueryMode::Mixed;
    one_hot_ = (qb & 0x30) == 0x30;  // 1 sequence in 4: keys and queries in {-64, 0, 64}
    dims_known_ = false;
    offset_ = 0;
    tokens_seen_ = 0;
    count_ = 0;
    snap_compressed_ = false;
    snap_by_queries_ = false;
    snap_first_ = snap_end_ = 0;
    Rng rng(in_.u32());
    palette_k_.assign(static_cast<std::size_t>(1 + rng.below(4)), std::vector<double>());
    for (auto& r : palette_k_) {
      r.resize(static_cast<std::size_t>(Dk_));
      for (auto& x : r) x = draw_level(rng, DataMode::Uniform, one_hot_);
    }
    make_head_models();
    log("sequence B=" + std::to_string(B_) + " H=" + std::to_string(H_) +
        " Dk=" + std::to_string(Dk_) + " Dv=" + std::to_string(Dv_) +
        " qmode=" + std::to_string(q) + (one_hot_ ? " one-hot" : ""));
  }

  void make_head_models() {
    heads_.clear();
    heads_.resize(static_cast<std::size_t>(B_ * H_));
    for (auto& hm : heads_) {
      switch (policy_) {
        case Policy::SqueezeSingle:
        case Policy::SqueezeBuilder:
        case Policy::H2O:
        case Policy::PyramidSingle:
        case Policy::PyramidBuilder:
          if (qmode_ == QueryMode::None) {
            hm.h2o.emplace(n_sink_, decay_, grace_fn());
            hm.h2o->set_scorer(scorer_);
            if (model_budget_) hm.h2o->set_budget(*model_budget_);
          } else if (qmode_ == QueryMode::Always) {
            // Calls with queries ignore the scorer, and so do their re-budgets.
            hm.h2oq.emplace(n_sink_, decay_, grace_fn());
            hm.h2oq->set_value_power(cfg_.value_norm_power);
            if (model_budget_) hm.h2oq->set_budget(*model_budget_);
          }
          break;
        case Policy::TOVA:
          if (qmode_ == QueryMode::None) hm.tova.emplace(cfg_.tova_n_sink, cfg_.tova_budget);
          if (qmode_ == QueryMode::Always) hm.tovaq.emplace(cfg_.tova_n_sink, cfg_.tova_budget);
          break;
        case Policy::Streaming:
          hm.stream.emplace(cfg_.stream_n_sink, cfg_.stream_window_size);
          break;
        case Policy::SnapKV:
          hm.snap.emplace(cfg_.snap_n_sink, cfg_.snap_budget, cfg_.snap_obs_window);
          hm.snapq.emplace(cfg_.snap_n_sink, cfg_.snap_budget, cfg_.snap_obs_window);
          break;
        default:
          break;
      }
    }
  }

  // ------------------------------------------------------------------------------------------
  // Operations
  // ------------------------------------------------------------------------------------------

  void step() {
    const int kind = in_.pick(16);
    switch (kind) {
      case 0:
      case 1:
      case 2:
      case 12:
        do_call(1, Bad::None);
        break;
      case 3:
        do_call(static_cast<Index>(in_.range(0, 4)), Bad::None);
        break;
      case 4:
      case 13:
        do_call(static_cast<Index>(in_.range(0, kMaxS)), Bad::None);
        break;
      case 5:
        do_call(0, Bad::None);
        break;
      case 6:
      case 14: {
        const auto bad = static_cast<Bad>(1 + in_.pick(static_cast<int>(Bad::kCount) - 1));
        do_call(static_cast<Index>(in_.range(0, 6)), bad);
        break;
      }
      case 7:
        do_reset();
        break;
      case 8:
        do_trim();
        break;
      case 9:
        do_report();
        break;
      case 10: {
        const bool on = in_.pick(2) != 0;
        layer_cache_->set_parallel_heads(on);
        expect(layer_cache_->parallel_heads() == on, "set_parallel_heads did not stick");
        log(std::string("parallel_heads ") + (on ? "on" : "off"));
        break;
      }
      case 15:
        do_reload();
        break;
      case 11: {
        // (One read per statement: argument evaluation order is unspecified.)
        const Index n = in_.range(0, 5);
        const Index kb = in_.range(0, 2), kh = in_.range(0, 3), kd = in_.range(0, 9);
        const Index vb = in_.range(0, 2), vh = in_.range(0, 3), vd = in_.range(0, 9);
        out_.first.resize(kb, kh, n, kd);
        out_.second.resize(vb, vh, n, vd);
        log("scramble the reused output");
        break;
      }
      default:
        do_call(static_cast<Index>(in_.range(1, kMaxS)), Bad::None);
        break;
    }
  }

  /// Saves every cache of the run (the whole builder model, its coordinator included) and carries
  /// on with the loaded set (docs/design.md G): everything observable must be as before (the heap
  /// aside: capacities are not saved), the loaded set must save to the same bytes, and the run's
  /// later checks against the oracles then hold for the loaded caches.
  void do_reload() {
    Snapshot before = snapshot();
    const bool parallel = layer_cache_->parallel_heads();
    std::ostringstream out;
    vc::save_prompt_cache(out, owned_, {{"op", std::to_string(op_)}});
    const std::string bytes = out.str();
    std::istringstream in(bytes);
    vc::PromptCache<T> loaded;
    try {
      loaded = vc::load_prompt_cache<T>(in);
    } catch (const std::exception& e) {
      fail(std::string("a saved set did not load: ") + e.what());
    }
    expect(loaded.caches.size() == owned_.size(), "the loaded set has another number of caches");
    std::ostringstream again;
    vc::save_prompt_cache(again, loaded.caches, loaded.metadata);
    expect(again.str() == bytes, "the loaded set saves to other bytes");
    std::size_t index = 0;
    while (owned_[index].get() != layer_cache_) ++index;
    owned_ = std::move(loaded.caches);
    layer_cache_ = owned_[index].get();
    layer_cache_->set_parallel_heads(parallel);
    bind_cache();
    Snapshot after = snapshot();
    before.heap = after.heap = 0;
    expect(after == before, "the loaded cache differs from the saved one");
    if (opt_.stats) ++opt_.stats->reloads;
    log("save and reload (" + std::to_string(bytes.size()) + " bytes)");
  }

  void do_reset() {
    const bool whole_model = policy_ == Policy::SqueezeBuilder ? in_.pick(2) != 0 : false;
    if (whole_model) {
      const std::uint64_t gen = coordinator_->generation();
      vc::KVCacheBuilder::reset(owned_);
      expect(coordinator_->generation() == gen + 1,
             "KVCacheBuilder::reset did not reset the coordinator once");
      log("KVCacheBuilder::reset");
    } else {
      layer_cache_->reset();
      log("reset");
    }
    if (opt_.stats) ++opt_.stats->resets;
    reset_budget_model(whole_model);
    start_sequence();
    check_state_after_reset();
  }

  void check_state_after_reset() {
    const auto st = layer_cache_->state();
    expect(layer_cache_->offset() == 0 && layer_cache_->tokens_seen() == 0 &&
               layer_cache_->kept_bytes() == 0 && layer_cache_->tokens_kept() == 0 &&
               st.first.size() == 0 && layer_cache_->batch() == 0,
           "reset() left rows, offset or dims behind");
    check_budget_getters();
  }

  void do_trim() {
    const int k = in_.range(-2, 60);
    const Snapshot before = snapshot();
    if (k < 0) {
      try {
        (void)layer_cache_->trim(k);
      } catch (const std::invalid_argument&) {
        expect(snapshot() == before, "trim(" + std::to_string(k) + ") threw but changed the cache");
        log("trim(" + std::to_string(k) + ") rejected");
        return;
      }
      fail("trim(" + std::to_string(k) + ") with n < 0 did not throw std::invalid_argument");
    }
    const std::int64_t got = layer_cache_->trim(k);
    if (opt_.stats) ++opt_.stats->trims;
    log("trim(" + std::to_string(k) + ") -> " + std::to_string(got));
    if (policy_ != Policy::Standard) {
      expect(got == 0, "a non-trimmable cache trimmed " + std::to_string(got));
      expect(snapshot() == before, "trim on a non-trimmable cache changed it");
      return;
    }
    const std::int64_t want = std::min<std::int64_t>(k, offset_);
    if (!dims_known_) {
      expect(got == 0 && snapshot() == before, "trim before the first call changed the cache");
      return;
    }
    expect(got == want, "trim(" + std::to_string(k) + ") returned " + std::to_string(got) +
                            ", expected " + std::to_string(want));
    offset_ -= want;
    count_ -= static_cast<Index>(want);
    for (auto& hm : heads_) {
      hm.fed_keys.resize(static_cast<std::size_t>(offset_));
      hm.fed_values.resize(static_cast<std::size_t>(offset_));
    }
    check_after_call();
  }

  /// A report of another layer to the shared coordinator (squeeze builder); on other policies
  /// this op is a decode call.
  void do_report() {
    if (policy_ != Policy::SqueezeBuilder) {
      do_call(1, Bad::None);
      return;
    }
    const int layer = in_.range(-1, layers_ + 1);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double c = pick_from(in_, {0.5, 0.0, 0.25, 1.0, 0.9, -0.5, 1.5, 0.1, nan,
                                     std::numeric_limits<double>::infinity()});
    const bool bad = layer < 0 || !std::isfinite(c);
    std::ostringstream os;
    os << "report(layer " << layer << ", " << c << ")";
    log(os.str());
    const Snapshot before = snapshot();
    try {
      coordinator_->report_concentration(layer, c);
    } catch (const std::invalid_argument&) {
      expect(bad, os.str() + " was rejected");
      expect(snapshot() == before, os.str() + " threw but changed the coordinator or the cache");
      return;
    }
    expect(!bad, os.str() + " was accepted");
    coord_report(layer, c);
    check_coordinator();
  }

  // ------------------------------------------------------------------------------------------
  // Calls
  // ------------------------------------------------------------------------------------------

  struct CallPlan {
    Api api = Api::Fetch;
    bool as_double = false;
    bool with_queries = false;
    int qtype = 0;  // 0 float, 1 double, 2 half
    Index G = 1;
    Bad bad = Bad::None;
  };

  void do_call(Index S, Bad bad) {
    const std::uint8_t f = in_.u8();
    CallPlan p;
    // Bits: 0-1 entry point, 2 double inputs, 3-4 query type, 5-6 G - 1, 7 queries (mixed mode).
    p.api = static_cast<Api>((f & 3) % 3);
    p.as_double = ((f >> 2) & 1) != 0;
    p.qtype = ((f >> 3) & 3) % 3;
    p.G = 1 + ((f >> 5) & 3) % 3;
    const std::uint8_t kmode = in_.u8();
    const std::uint32_t seed = in_.u32();
    switch (qmode_) {
      case QueryMode::None:
        p.with_queries = false;
        break;
      case QueryMode::Always:
        p.with_queries = true;
        break;
      case QueryMode::Mixed:
        p.with_queries = ((f >> 7) & 1) != 0;
        break;
    }
    p.bad = bad;
    if (is_query_bad(bad)) p.with_queries = true;
    // Changes of dims are only bad once the first call fixed them.
    if (!dims_known_ && (bad == Bad::ChangeB || bad == Bad::ChangeH || bad == Bad::ChangeDk ||
                         bad == Bad::ChangeDv)) {
      p.bad = Bad::None;
    }
    // Keys that are bad only through conversion need the double overload (fetch_into has no
    // converting overload without queries).
    if (p.bad == Bad::OverflowKey && p.api == Api::FetchInto && !p.with_queries) p.api = Api::Fetch;
    if (p.api == Api::FetchInto && !p.with_queries) p.as_double = false;
    if (p.bad == Bad::OverflowKey) p.as_double = true;
    if (p.bad == Bad::QueryOverflow) p.qtype = 1;
    execute(S, p, static_cast<DataMode>((kmode & 7) % static_cast<int>(DataMode::kCount)),
            static_cast<DataMode>((kmode >> 3) % static_cast<int>(DataMode::kCount)), seed);
  }

  void execute(Index S, const CallPlan& p, DataMode kmode, DataMode qmode, std::uint32_t seed) {
    Rng rng(seed);
    Index B = B_, H = H_, Dk = Dk_, Dv = Dv_;
    // An empty call before the first call may use any dims (it fixes nothing).
    if (!dims_known_ && S == 0 && p.bad == Bad::None && (seed & 3) == 0) {
      B = 1 + rng.below(2);
      H = 1 + rng.below(3);
      Dk = 1 + rng.below(8);
      Dv = 1 + rng.below(8);
    }
    Index kB = B, kH = H, kS = S, kD = Dk;
    Index vB = B, vH = H, vS = S, vD = Dv;
    const Index G = p.G;
    Index qB = B, qH = G * H, qS = S, qD = Dk;
    switch (p.bad) {
      case Bad::ValuesB:
        vB = B + 1;
        break;
      case Bad::ValuesH:
        vH = H + 1;
        break;
      case Bad::ValuesS:
        vS = S + 1;
        break;
      case Bad::ZeroB:
        kB = vB = qB = 0;
        break;
      case Bad::ZeroH:
        kH = vH = 0;
        qH = G;
        break;
      case Bad::ZeroKeyD:
        kD = qD = 0;
        break;
      case Bad::ZeroValueD:
        vD = 0;
        break;
      case Bad::ChangeB:
        kB = vB = qB = B == 1 ? 2 : 1;
        break;
      case Bad::ChangeH:
        kH = vH = (H % 3) + 1;
        qH = G * kH;
        break;
      case Bad::ChangeDk:
        kD = qD = (Dk % 8) + 1;
        break;
      case Bad::ChangeDv:
        vD = (Dv % 8) + 1;
        break;
      case Bad::QueryHq:
        qH = H >= 2 ? G * H + 1 : 0;
        break;
      case Bad::QueryB:
        qB = B + 1;
        break;
      case Bad::QueryS:
        qS = S + 1;
        break;
      case Bad::QueryD:
        qD = Dk + 1;
        break;
      default:
        break;
    }
    // Keys and values in double (exact in every storage type), converted to T.
    vc::Tensor4<double> kd(kB, kH, kS, kD), vd(vB, vH, vS, vD), qd(qB, qH, qS, qD);
    fill(kd, rng, kmode, palette_k_, one_hot_);
    fill(vd, rng, DataMode::Uniform, {});
    fill(qd, rng, qmode, palette_k_, one_hot_);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    const auto poke = [&](vc::Tensor4<double>& t, double x) {
      if (t.size() == 0) return false;
      const int at = rng.below(static_cast<int>(t.size()));
      const bool negative = rng.below(2) != 0;
      t.data()[at] = negative ? -x : x;
      return true;
    };
    bool expect_reject = p.bad != Bad::None;
    switch (p.bad) {
      case Bad::NanKey:
        expect_reject = poke(kd, nan);
        break;
      case Bad::InfKey:
        expect_reject = poke(kd, inf);
        break;
      case Bad::OverflowKey:
        expect_reject = poke(kd, 1e300);
        break;
      case Bad::QueryNan:
        expect_reject = poke(qd, nan);
        break;
      case Bad::QueryInf:
        expect_reject = poke(qd, inf);
        break;
      case Bad::QueryOverflow:
        expect_reject = poke(qd, 1e300);
        break;
      default:
        break;
    }
    // A value-only change of S with S = 0 keys still disagrees; a zero-size NaN poke is no error.
    const vc::Tensor4<T> kt = kd.template cast<T>();
    const vc::Tensor4<T> vt = vd.template cast<T>();

    std::ostringstream os;
    os << api_name(p.api) << " S=" << S << " " << bad_name(p.bad) << (p.as_double ? " double" : "")
       << (p.with_queries ? " queries G=" + std::to_string(G) + " qtype=" + std::to_string(p.qtype)
                          : std::string())
       << " kmode=" << static_cast<int>(kmode) << " qmode=" << static_cast<int>(qmode)
       << " seed=" << seed;
    if (!(B == B_ && H == H_ && Dk == Dk_ && Dv == Dv_)) {
      os << " dims=" << B << "," << H << "," << Dk << "," << Dv;
    }
    log(os.str());

    const Snapshot before = snapshot();
    const bool dims_were_known = dims_known_;
    // Positions retained before the call: reported by scored caches, else the exact models'.
    const std::vector<Positions> pos_before = !dims_were_known
                                                  ? std::vector<Positions>(heads_.size())
                                              : scored_ ? before.positions
                                                        : retained_positions();
    Window<T> win;
    bool rejected = false;
    std::string reject_msg;
    try {
      win = invoke(p, kt, vt, kd, vd, qd);
    } catch (const std::invalid_argument& e) {
      rejected = true;
      reject_msg = e.what();
    } catch (const std::exception& e) {
      fail(std::string("call threw a non-invalid_argument exception: ") + e.what());
    }
    if (opt_.stats) {
      ++opt_.stats->calls;
      if (p.with_queries) ++opt_.stats->query_calls;
    }
    if (expect_reject) {
      expect(rejected, std::string("bad call (") + bad_name(p.bad) + ") was accepted");
      expect(!reject_msg.empty(), "rejection without a message");
      const Snapshot after = snapshot();
      expect(after == before, std::string("rejected call (") + bad_name(p.bad) +
                                  ") changed the cache (strong guarantee): " + diff(before, after));
      if (opt_.stats) ++opt_.stats->rejected;
      return;
    }
    expect(!rejected, "valid call was rejected: " + reject_msg);

    // The returned window (docs/design.md 4.4 / 2.3), against the state before the call.
    check_window(win, before, pos_before, kt, vt, S, B, H, Dk, Dv, dims_were_known);
    if (S == 0) {
      expect(snapshot() == before, "an empty call changed the cache");
      return;
    }
    if (!dims_were_known) {
      dims_known_ = true;
      B_ = B;
      H_ = H;
      Dk_ = Dk;
      Dv_ = Dv;
    }
    if (opt_.stats) opt_.stats->tokens += static_cast<std::uint64_t>(S);
    update_models(kt, vt, qd, p.with_queries, G, S);
    check_after_call();
  }

  /// Calls the cache through the chosen entry point and copies what it returned.
  Window<T> invoke(const CallPlan& p, const vc::Tensor4<T>& kt, const vc::Tensor4<T>& vt,
                   const vc::Tensor4<double>& kd, const vc::Tensor4<double>& vd,
                   const vc::Tensor4<double>& qd) {
    vc::KVCache<T>& c = *layer_cache_;
    if (!p.with_queries) {
      switch (p.api) {
        case Api::Fetch:
          return from_pair(p.as_double ? c.update_and_fetch(kd, vd) : c.update_and_fetch(kt, vt));
        case Api::View:
          return from_view(p.as_double ? c.update_and_view(kd, vd) : c.update_and_view(kt, vt));
        case Api::FetchInto:
          c.update_and_fetch_into(kt, vt, out_);
          return from_pair(out_);
      }
    }
    switch (p.qtype) {
      case 1:
        return invoke_q(p, kt, vt, kd, vd, qd);
      case 2:
        return invoke_q(p, kt, vt, kd, vd,
                        vc::Tensor4<Eigen::half>(qd.template cast<Eigen::half>()));
      default:
        return invoke_q(p, kt, vt, kd, vd, vc::Tensor4<float>(qd.template cast<float>()));
    }
  }

  template <class Q>
  Window<T> invoke_q(const CallPlan& p, const vc::Tensor4<T>& kt, const vc::Tensor4<T>& vt,
                     const vc::Tensor4<double>& kd, const vc::Tensor4<double>& vd,
                     const vc::Tensor4<Q>& q) {
    vc::KVCache<T>& c = *layer_cache_;
    switch (p.api) {
      case Api::Fetch:
        return from_pair(p.as_double ? c.update_and_fetch(kd, vd, q)
                                     : c.update_and_fetch(kt, vt, q));
      case Api::View:
        return from_view(p.as_double ? c.update_and_view(kd, vd, q) : c.update_and_view(kt, vt, q));
      case Api::FetchInto:
        if (p.as_double) {
          c.update_and_fetch_into(kd, vd, q, out_);
        } else {
          c.update_and_fetch_into(kt, vt, q, out_);
        }
        return from_pair(out_);
    }
    return {};
  }

  static Window<T> from_pair(const vc::KVPair<T>& kv) {
    Window<T> w;
    w.B = kv.first.dimension(0);
    w.H = kv.first.dimension(1);
    w.n = kv.first.dimension(2);
    w.Dk = kv.first.dimension(3);
    w.Dv = kv.second.dimension(3);
    // Values must agree in B, H, n.
    if (kv.second.dimension(0) != w.B || kv.second.dimension(1) != w.H ||
        kv.second.dimension(2) != w.n) {
      w.n = -1;
      return w;
    }
    w.keys.assign(kv.first.data(), kv.first.data() + kv.first.size());
    w.values.assign(kv.second.data(), kv.second.data() + kv.second.size());
    return w;
  }

  static Window<T> from_view(const vc::KVView<T>& v) {
    Window<T> w;
    w.is_view = true;
    w.B = v.batch();
    w.H = v.heads();
    w.n = v.rows();
    w.S = v.new_rows();
    w.Dk = v.key_dim();
    w.Dv = v.value_dim();
    if (w.n == 0) return w;
    for (Index b = 0; b < w.B; ++b) {
      for (Index h = 0; h < w.H; ++h) {
        const auto k = v.keys(b, h);
        const auto val = v.values(b, h);
        const auto pos = v.positions(b, h);
        for (Index r = 0; r < w.n; ++r) {
          for (Index d = 0; d < w.Dk; ++d) w.keys.push_back(k(r, d));
          for (Index d = 0; d < w.Dv; ++d) w.values.push_back(val(r, d));
          w.positions.push_back(pos(r));
        }
      }
    }
    return w;
  }

  /// Positions the non-scored cache retains, per head, from the exact models (checked against
  /// state() after every call).
  std::vector<Positions> retained_positions() const {
    std::vector<Positions> out(heads_.size());
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      const Index b = static_cast<Index>(i) / H_, h = static_cast<Index>(i) % H_;
      if (scored_) {
        out[i] = vt::policy_positions(*layer_cache_, b, h);
      } else if (heads_[i].stream) {
        out[i] = heads_[i].stream->positions();
      } else {
        for (std::int64_t p = 0; p < offset_; ++p) out[i].push_back(p);
      }
    }
    return out;
  }

  void check_window(const Window<T>& w, const Snapshot& before,
                    const std::vector<Positions>& pos_before, const vc::Tensor4<T>& kt,
                    const vc::Tensor4<T>& vt, Index S, Index B, Index H, Index Dk, Index Dv,
                    bool dims_were_known) {
    const Index n_before = dims_were_known ? static_cast<Index>(count_) : 0;
    const Index n = n_before + S;
    std::ostringstream os;
    os << "returned window: " << (w.is_view ? "view " : "tensors ") << "[" << w.B << ", " << w.H
       << ", " << w.n << ", " << w.Dk << "/" << w.Dv << "], expected [" << B << ", " << H << ", "
       << n << " = " << n_before << " + " << S << ", " << Dk << "/" << Dv << "]";
    expect(w.B == B && w.H == H && w.n == n && w.Dk == Dk && w.Dv == Dv, os.str());
    if (w.is_view) expect(w.S == S, "view new_rows() " + std::to_string(w.S) + " != S");
    if (n == 0) return;
    // Rows retained before the call, from state() taken before the call (ascending position).
    const auto* kb = reinterpret_cast<const T*>(before.keys.data());
    const auto* vb = reinterpret_cast<const T*>(before.values.data());
    const auto dk = static_cast<std::size_t>(Dk), dv = static_cast<std::size_t>(Dv);
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const Index head = b * H + h;
        const Positions& pb = pos_before[static_cast<std::size_t>(head)];
        expect(static_cast<Index>(pb.size()) == n_before,
               "internal: positions before the call disagree with the count");
        std::map<std::int64_t, Index> index_of;
        for (Index r = 0; r < n_before; ++r) index_of[pb[static_cast<std::size_t>(r)]] = r;
        std::set<std::int64_t> seen;
        for (Index r = 0; r < n; ++r) {
          const T* gk = w.keys.data() + static_cast<std::size_t>((head * n + r) * Dk);
          const T* gv = w.values.data() + static_cast<std::size_t>((head * n + r) * Dv);
          const T* wk = nullptr;
          const T* wv = nullptr;
          std::int64_t want_pos = 0;
          if (r < n_before) {
            Index src = r;
            if (w.is_view) {
              const std::int64_t p = w.positions[static_cast<std::size_t>(head * n + r)];
              const auto it = index_of.find(p);
              expect(it != index_of.end() && seen.insert(p).second,
                     "view row " + std::to_string(r) + " of head (" + std::to_string(b) + ", " +
                         std::to_string(h) + ") has position " + std::to_string(p) +
                         ", not a distinct row retained before the call " + fmt_vec(pb));
              src = it->second;
            }
            wk = kb + static_cast<std::size_t>((head * n_before + src)) * dk;
            wv = vb + static_cast<std::size_t>((head * n_before + src)) * dv;
            want_pos = pb[static_cast<std::size_t>(src)];
          } else {
            const Index s = r - n_before;
            wk = kt.data() + static_cast<std::size_t>((head * S + s)) * dk;
            wv = vt.data() + static_cast<std::size_t>((head * S + s)) * dv;
            want_pos = offset_ + s;
            if (w.is_view) {
              const std::int64_t p = w.positions[static_cast<std::size_t>(head * n + r)];
              expect(p == want_pos, "view row " + std::to_string(r) + " (new row " +
                                        std::to_string(s) + ") has position " + std::to_string(p) +
                                        ", expected " + std::to_string(want_pos));
            }
          }
          if (std::memcmp(gk, wk, dk * sizeof(T)) != 0 ||
              std::memcmp(gv, wv, dv * sizeof(T)) != 0) {
            fail("returned row " + std::to_string(r) + " of head (" + std::to_string(b) + ", " +
                 std::to_string(h) + ") is not the row at position " + std::to_string(want_pos) +
                 " (n_before " + std::to_string(n_before) + ", S " + std::to_string(S) + ")");
          }
        }
      }
    }
  }

  // ------------------------------------------------------------------------------------------
  // Oracles
  // ------------------------------------------------------------------------------------------

  /// Head (b, h)'s row s of t as double. t: [B, H, S, D]
  template <class U>
  static std::vector<double> row(const vc::Tensor4<U>& t, Index head, Index s) {
    const Index S = t.dimension(2), D = t.dimension(3);
    std::vector<double> out(static_cast<std::size_t>(D));
    for (Index d = 0; d < D; ++d)
      out[static_cast<std::size_t>(d)] = to_double(t.data()[(head * S + s) * D + d]);
    return out;
  }

  /// Token s's G query heads of KV head `head` = b * H + h, through float32 (what the cache
  /// scores with). q: [B, G * H, S, D]; returns [G][D].
  Rows token_queries(const vc::Tensor4<double>& q, Index head, Index G, Index s) const {
    const Index b = head / H_, h = head % H_;
    Rows out;
    for (Index g = 0; g < G; ++g) {
      const Index qh = b * (G * H_) + h * G + g;
      std::vector<double> r = row(q, qh, s);
      for (double& x : r) x = static_cast<double>(static_cast<float>(x));
      out.push_back(std::move(r));
    }
    return out;
  }

  /// Updates the models with an accepted call of S >= 1 tokens and records eviction decisions.
  void update_models(const vc::Tensor4<T>& kt, const vc::Tensor4<T>& vt,
                     const vc::Tensor4<double>& qd, bool with_queries, Index G, Index S) {
    for (auto& hm : heads_) hm.ambiguous = false;
    // docs/design.md 5.4: report, adoption, fallback; before the call's tokens are absorbed.
    if (policy_ == Policy::SqueezeSingle || policy_ == Policy::SqueezeBuilder) {
      if (calls_since_reset_ == 0) check_concentration(kt);
      if (policy_ == Policy::SqueezeBuilder) {
        if (calls_since_reset_ == 0) {
          coord_report(layer_, squeeze_->concentration());
          sq_reported_ = true;
        }
        if (!sq_adopted_ && sq_reported_ && coord_finalized_) {
          const auto it = coord_budgets_.find(layer_);
          if (it != coord_budgets_.end()) {
            set_model_budget(it->second);
            sq_adopted_ = true;
          }
        }
        if (!model_budget_ && calls_since_reset_ >= 1) set_model_budget(fallback_budget());
      }
    }
    ++calls_since_reset_;

    const std::int64_t first = offset_;
    last_call_first_ = first;
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      HeadModel<T>& hm = heads_[i];
      const auto head = static_cast<Index>(i);
      Rows keys, values;
      std::vector<Rows> queries;
      for (Index s = 0; s < S; ++s) {
        keys.push_back(row(kt, head, s));
        values.push_back(row(vt, head, s));
        queries.push_back(with_queries ? token_queries(qd, head, G, s) : Rows{keys.back()});
        const auto ks = static_cast<std::size_t>(Dk_), vs = static_cast<std::size_t>(Dv_);
        const T* kp = kt.data() + static_cast<std::size_t>(head * S + s) * ks;
        const T* vp = vt.data() + static_cast<std::size_t>(head * S + s) * vs;
        hm.fed_keys.emplace_back(kp, kp + ks);
        hm.fed_values.emplace_back(vp, vp + vs);
      }
      absorb(hm, keys, values, queries, with_queries, first);
    }
    offset_ += S;
    tokens_seen_ += B_ * H_ * S;
    // Count model (independent of which rows were evicted).
    switch (policy_) {
      case Policy::Standard:
        count_ += S;
        break;
      case Policy::Streaming: {
        const Index sinks = std::min<Index>(offset_, cfg_.stream_n_sink);
        count_ = sinks + std::min<Index>(offset_ - sinks, cfg_.stream_window_size);
        break;
      }
      case Policy::TOVA:
        count_ = std::min<Index>(count_ + S, cfg_.tova_budget);
        break;
      case Policy::SnapKV:
        if (!snap_compressed_ && S > cfg_.snap_budget) {
          snap_compressed_ = true;
          snap_by_queries_ = with_queries;
          snap_first_ = first;
          snap_end_ = first + S;
          count_ += cfg_.snap_budget;
        } else {
          count_ += S;
        }
        break;
      default:  // H2O core
        count_ = model_budget_ ? std::min<Index>(count_ + S, *model_budget_) : count_ + S;
        break;
    }
  }

  void absorb(HeadModel<T>& hm, const Rows& keys, const Rows& values,
              const std::vector<Rows>& queries, bool with_queries, std::int64_t first) {
    const auto S = keys.size();
    if (hm.h2o && oracle_on()) {
      for (std::size_t s = 0; s < S; ++s) {
        const bool evicts =
            hm.h2o->budget() && static_cast<int>(hm.h2o->rows().size()) + 1 > *hm.h2o->budget();
        if (!evicts) {
          hm.h2o->absorb(keys[s], values[s]);
          continue;
        }
        // The scores every row has at the decision: the same token on a copy without a budget.
        ref::H2OHeadOracle all = *hm.h2o;
        all.set_budget(std::numeric_limits<int>::max());
        all.absorb(keys[s], values[s]);
        hm.h2o->absorb(keys[s], values[s]);
        note_decision(hm, evict_candidates(ranked_rows(all), *hm.h2o->budget()),
                      minus(all.positions(), hm.h2o->positions()), false, false,
                      scorer_ == ref::H2OHeadOracle::Scorer::keydiff);
      }
    }
    if (hm.h2oq && oracle_on()) {
      const bool evicts =
          hm.h2oq->budget() && static_cast<int>(hm.h2oq->rows().size() + S) > *hm.h2oq->budget();
      if (!evicts) {
        hm.h2oq->absorb_call(keys, values, queries);
      } else {
        ref::H2OHeadOracle all = *hm.h2oq;
        all.set_budget(std::numeric_limits<int>::max());
        all.absorb_call(keys, values, queries);
        hm.h2oq->absorb_call(keys, values, queries);
        note_decision(hm, evict_candidates(ranked_rows(all), *hm.h2oq->budget()),
                      minus(all.positions(), hm.h2oq->positions()));
      }
    }
    if ((hm.tova || hm.tovaq) && oracle_on()) {
      for (std::size_t s = 0; s < S; ++s) {
        Positions pos = hm.tova ? hm.tova->positions() : hm.tovaq->positions();
        pos.push_back(first + static_cast<std::int64_t>(s));
        std::vector<double> w;
        Positions after;
        if (hm.tova) {
          hm.tova->absorb(keys[s], values[s]);
          w = hm.tova->last_weights();
          after = hm.tova->positions();
        } else {
          hm.tovaq->absorb(keys[s], values[s], queries[s]);
          w = hm.tovaq->last_weights();
          after = hm.tovaq->positions();
        }
        if (w.empty()) continue;
        std::vector<Candidate> cands;
        for (std::size_t r = 0; r < pos.size() && r < w.size(); ++r) {
          if (pos[r] >= cfg_.tova_n_sink) cands.push_back({w[r], pos[r]});
        }
        note_decision(hm, cands, minus(pos, after), /*keys_decide=*/true,
                      /*one_softmax=*/queries[s].size() == 1);
      }
    }
    if (hm.stream) {
      for (std::size_t s = 0; s < S; ++s) hm.stream->absorb(keys[s], values[s]);
    }
    if (hm.snap) {
      const bool compress = !snap_compressed_ && static_cast<int>(S) > cfg_.snap_budget;
      hm.snap->absorb_call(keys, values);
      hm.snapq->absorb_call(keys, values, queries);
      if (compress) {
        // The call's scores (as the oracle computes them) for the ambiguity of the selection.
        const std::size_t w =
            std::min<std::size_t>(static_cast<std::size_t>(cfg_.snap_obs_window), S);
        std::vector<const std::vector<double>*> ptrs;
        for (const auto& k : keys) ptrs.push_back(&k);
        // The oracles' scorer; without real queries each token's query heads are {its key} (the
        // proxy).
        std::vector<double> score(S, 0.0);
        std::size_t n_soft = 0;
        for (std::size_t j = S - w; j < S; ++j) {
          for (const auto& q : queries[j]) {
            const std::vector<double> a = ref::attention_weights(ptrs, q);
            for (std::size_t r = 0; r < S; ++r) score[r] += a[r];
            ++n_soft;
          }
        }
        const auto sinks = static_cast<std::size_t>(std::min(cfg_.snap_n_sink, cfg_.snap_budget));
        std::vector<Candidate> cands;
        Positions call_pos;
        for (std::size_t r = 0; r < S; ++r) {
          score[r] /= static_cast<double>(n_soft);
          call_pos.push_back(first + static_cast<std::int64_t>(r));
          if (r >= sinks) cands.push_back({score[r], first + static_cast<std::int64_t>(r)});
        }
        const Positions kept = with_queries ? hm.snapq->positions() : hm.snap->positions();
        note_decision(hm, cands, minus(call_pos, kept), /*keys_decide=*/true);
      }
    }
  }

  /// Candidates of an eviction over rows that all carry their decision-time score: neither sinks
  /// nor among the newest g(budget).
  std::vector<Candidate> evict_candidates(const std::vector<ref::OracleRow>& rows,
                                          int budget) const {
    std::vector<Candidate> out;
    const std::size_t n = rows.size();
    const auto g = static_cast<std::size_t>(grace_for(budget));
    for (std::size_t i = 0; i < n; ++i) {
      if (rows[i].position < n_sink_ || i + g >= n) continue;
      out.push_back({rows[i].score, rows[i].position});
    }
    return out;
  }

  /// concentration() after the first call: mean over B·H heads of the Gram-matrix reference.
  void check_concentration(const vc::Tensor4<T>& kt) {
    double sum = 0.0;
    for (Index head = 0; head < B_ * H_; ++head) {
      Rows rows;
      for (Index s = 0; s < kt.dimension(2); ++s) rows.push_back(row(kt, head, s));
      sum += ref::concentration_score_gram(rows);
    }
    const double want = sum / static_cast<double>(B_ * H_);
    const double got = squeeze_->concentration();
    std::ostringstream os;
    os << "concentration() " << got << ", reference " << want;
    expect(std::fabs(got - want) <= kConcentrationTol, os.str());
  }

  // ------------------------------------------------------------------------------------------
  // State checks
  // ------------------------------------------------------------------------------------------

  Snapshot snapshot() const { return vt::snapshot(*layer_cache_, coordinator_.get()); }

  static std::string diff(const Snapshot& a, const Snapshot& b) {
    const auto shape = [](const vt::Shape& x) {
      return fmt_vec(std::vector<Index>(x.begin(), x.end()));
    };
    std::ostringstream os;
    if (a.offset != b.offset) os << " offset " << a.offset << "->" << b.offset;
    if (a.tokens_seen != b.tokens_seen)
      os << " tokens_seen " << a.tokens_seen << "->" << b.tokens_seen;
    if (a.tokens_kept != b.tokens_kept)
      os << " tokens_kept " << a.tokens_kept << "->" << b.tokens_kept;
    if (a.kept_bytes != b.kept_bytes) os << " kept_bytes " << a.kept_bytes << "->" << b.kept_bytes;
    if (a.full_seq_bytes != b.full_seq_bytes)
      os << " full_seq_bytes " << a.full_seq_bytes << "->" << b.full_seq_bytes;
    if (a.heap != b.heap) os << " heap_bytes " << a.heap << "->" << b.heap;
    if (a.key_shape != b.key_shape || a.value_shape != b.value_shape)
      os << " state shape " << shape(a.key_shape) << "->" << shape(b.key_shape);
    if (a.keys != b.keys || a.values != b.values) os << " state bytes";
    if (a.batch != b.batch || a.heads != b.heads || a.key_dim != b.key_dim ||
        a.value_dim != b.value_dim)
      os << " dims";
    if (a.scores != b.scores) os << " scores";
    if (a.positions != b.positions) os << " positions";
    if (a.budget != b.budget) os << " budget";
    if (a.protected_recent != b.protected_recent) os << " protected_recent";
    if (a.layer_budget != b.layer_budget) os << " layer_budget";
    if (a.compressed != b.compressed) os << " compressed";
    if (a.adopted != b.adopted) os << " adopted";
    if (a.concentration != b.concentration) os << " concentration";
    if (a.reports != b.reports || a.finalized != b.finalized || a.generation != b.generation)
      os << " coordinator";
    if (!(a == b) && os.str().empty()) os << " (a field diff() does not name)";
    return os.str();
  }

  void check_budget_getters() {
    if (core_) {
      const std::optional<int> budget = vt::core_budget(*layer_cache_);
      expect(budget.value_or(-1) == model_budget_.value_or(-1),
             "budget() " + (budget ? std::to_string(*budget) : std::string("unknown")) +
                 ", expected " +
                 (model_budget_ ? std::to_string(*model_budget_) : std::string("unknown")));
      int n_sink = -1;
      vt::visit_core(*layer_cache_, [&](const auto& p) { n_sink = p.n_sink(); });
      expect(n_sink == n_sink_, "n_sink() differs from the config");
      const int recent = vt::core_protected_recent(*layer_cache_);
      expect(recent == model_grace(), "protected_recent() " + std::to_string(recent) +
                                          ", expected " + std::to_string(model_grace()));
    }
    if (squeeze_) {
      const int want = model_budget_ ? *model_budget_ : fallback_budget();
      expect(squeeze_->layer_budget() == want, "squeeze layer_budget() " +
                                                   std::to_string(squeeze_->layer_budget()) +
                                                   ", expected " + std::to_string(want));
      expect(squeeze_->budget_adopted() == sq_adopted_, "budget_adopted() differs from the model");
    }
    if (h2o_) expect(h2o_->layer_budget() == cfg_.h2o_budget, "h2o layer_budget()");
    if (pyramid_) expect(pyramid_->layer_budget() == *model_budget_, "pyramidkv layer_budget()");
    if (tova_)
      expect(tova_->layer_budget() == cfg_.tova_budget && tova_->n_sink() == cfg_.tova_n_sink,
             "tova layer_budget()/n_sink()");
    if (stream_) {
      expect(stream_->layer_budget() == cfg_.stream_n_sink + cfg_.stream_window_size &&
                 stream_->n_sink() == cfg_.stream_n_sink &&
                 stream_->window_size() == cfg_.stream_window_size,
             "streaming layer_budget()/n_sink()/window_size()");
    }
    if (snap_) {
      expect(snap_->layer_budget() == cfg_.snap_budget && snap_->n_sink() == cfg_.snap_n_sink &&
                 snap_->obs_window() == cfg_.snap_obs_window,
             "snapkv layer_budget()/n_sink()/obs_window()");
      expect(snap_->compressed() == snap_compressed_, "snapkv compressed() differs from the model");
    }
    check_coordinator();
  }

  void check_coordinator() {
    if (!coordinator_) return;
    const std::map<int, double> got = coordinator_->reports();
    expect(got == coord_reports_, "coordinator reports differ from the model (" +
                                      std::to_string(got.size()) + " vs " +
                                      std::to_string(coord_reports_.size()) + " layers)");
    expect(coordinator_->is_finalized() == coord_finalized_, "coordinator finalisation differs");
    // (-1: none; budgets are >= 1.)
    const auto it = coord_budgets_.find(layer_);
    const int want = it == coord_budgets_.end() ? -1 : it->second;
    const int have = coordinator_->resolved_budget(layer_).value_or(-1);
    expect(have == want, "resolved_budget(" + std::to_string(layer_) + ") " + std::to_string(have) +
                             ", model " + std::to_string(want) + " (-1: none)");
  }

  /// Everything after an accepted call (or a trim) against the models.
  void check_after_call() {
    const vc::KVCache<T>& c = *layer_cache_;
    expect(c.offset() == offset_,
           "offset() " + std::to_string(c.offset()) + ", expected " + std::to_string(offset_));
    expect(c.tokens_seen() == tokens_seen_, "tokens_seen() " + std::to_string(c.tokens_seen()) +
                                                ", expected " + std::to_string(tokens_seen_));
    expect(c.batch() == B_ && c.heads() == H_ && c.key_dim() == Dk_ && c.value_dim() == Dv_,
           "batch()/heads()/key_dim()/value_dim() differ from the first call's");
    const vc::KVPair<T> st = c.state();
    const Index n = st.first.dimension(2);
    expect(st.first.dimension(0) == B_ && st.first.dimension(1) == H_ &&
               st.first.dimension(3) == Dk_ && st.second.dimension(0) == B_ &&
               st.second.dimension(1) == H_ && st.second.dimension(2) == n &&
               st.second.dimension(3) == Dv_,
           "state() has the wrong shape");
    expect(n == count_, "state() holds " + std::to_string(n) + " rows per head, expected " +
                            std::to_string(count_));
    expect(c.tokens_kept() == n, "tokens_kept() differs from state()");
    const std::size_t row_bytes = static_cast<std::size_t>(Dk_ + Dv_) * sizeof(T);
    const auto heads = static_cast<std::size_t>(B_ * H_);
    expect(c.kept_bytes() == heads * static_cast<std::size_t>(n) * row_bytes,
           "kept_bytes() is wrong");
    expect(c.full_seq_bytes() == heads * static_cast<std::size_t>(offset_) * row_bytes,
           "full_seq_bytes() is wrong");
    if (n > 0) {
      const double ratio =
          static_cast<double>(c.full_seq_bytes()) / static_cast<double>(c.kept_bytes());
      expect(c.compression_ratio() == ratio, "compression_ratio() is wrong");
    }
    expect(c.heap_bytes() >= c.kept_bytes(), "heap_bytes() < kept_bytes()");
    if (core_ && model_budget_) {
      expect(n <= *model_budget_, "H2O-core head holds " + std::to_string(n) +
                                      " rows over budget " + std::to_string(*model_budget_));
    }
    if (tova_) expect(n <= cfg_.tova_budget, "TOVA head over budget");
    if (stream_)
      expect(n <= cfg_.stream_n_sink + cfg_.stream_window_size,
             "StreamingLLM head over n_sink + window");
    check_budget_getters();

    for (Index b = 0; b < B_; ++b) {
      for (Index h = 0; h < H_; ++h) check_head(st, b, h, n);
    }
  }

  void check_head(const vc::KVPair<T>& st, Index b, Index h, Index n) {
    HeadModel<T>& hm = heads_[static_cast<std::size_t>(b * H_ + h)];
    const std::string where = "head (" + std::to_string(b) + ", " + std::to_string(h) + ")";
    // Positions: reported (scored caches) or the exact oracle's.
    Positions pos;
    if (scored_) {
      pos = vt::policy_positions(*layer_cache_, b, h);
      expect(static_cast<Index>(pos.size()) == n, where + " positions() size differs from state()");
      expect(vt::policy_scores(*layer_cache_, b, h).size() == pos.size(),
             where + " scores() size differs");
    } else if (hm.stream) {
      pos = hm.stream->positions();
    } else {
      for (std::int64_t p = 0; p < offset_; ++p) pos.push_back(p);
    }
    expect(static_cast<Index>(pos.size()) == n, where + " model holds " +
                                                    std::to_string(pos.size()) + " rows, state() " +
                                                    std::to_string(n));
    for (std::size_t i = 0; i < pos.size(); ++i) {
      expect(pos[i] >= 0 && pos[i] < offset_ && (i == 0 || pos[i - 1] < pos[i]),
             where + " positions are not ascending within [0, offset): " + fmt_vec(pos));
    }
    // state() holds the rows fed at those positions.
    const auto dk = static_cast<std::size_t>(Dk_), dv = static_cast<std::size_t>(Dv_);
    for (Index r = 0; r < n; ++r) {
      const auto p = static_cast<std::size_t>(pos[static_cast<std::size_t>(r)]);
      const T* k = st.first.data() + static_cast<std::size_t>((b * H_ + h) * n + r) * dk;
      const T* v = st.second.data() + static_cast<std::size_t>((b * H_ + h) * n + r) * dv;
      if (std::memcmp(k, hm.fed_keys[p].data(), dk * sizeof(T)) != 0 ||
          std::memcmp(v, hm.fed_values[p].data(), dv * sizeof(T)) != 0) {
        fail(where + " state() row " + std::to_string(r) + " is not the row fed at position " +
             std::to_string(p));
      }
    }
    const std::set<std::int64_t> have(pos.begin(), pos.end());
    // Sinks (docs/design.md 1): never evicted.
    int sinks = 0;
    if (core_) sinks = n_sink_;
    if (tova_) sinks = cfg_.tova_n_sink;
    if (stream_) sinks = cfg_.stream_n_sink;
    for (std::int64_t p = 0; p < std::min<std::int64_t>(sinks, offset_); ++p) {
      expect(have.count(p) == 1, where + " lost sink " + std::to_string(p) + ": " + fmt_vec(pos));
    }
    if (snap_) {
      // Rows of uncompressed calls are all kept; the compressed call keeps its first sinks.
      for (std::int64_t p = 0; p < offset_; ++p) {
        const bool in_call = snap_compressed_ && p >= snap_first_ && p < snap_end_;
        const bool call_sink =
            in_call && p < snap_first_ + std::min(cfg_.snap_n_sink, cfg_.snap_budget);
        if (!in_call || call_sink) {
          expect(have.count(p) == 1, where + " SnapKV lost position " + std::to_string(p));
        }
      }
    }
    // H2O core: the newest g rows of the last call are protected.
    if (core_ && model_budget_) {
      const std::int64_t g = model_grace();
      for (std::int64_t p = std::max<std::int64_t>(last_call_first(), offset_ - g); p < offset_;
           ++p) {
        expect(have.count(p) == 1, where + " lost protected recent position " + std::to_string(p) +
                                       " (g = " + std::to_string(g) + "): " + fmt_vec(pos));
      }
    }
    compare_oracle(hm, pos, where, b, h);
  }

  std::int64_t last_call_first() const { return last_call_first_; }

  /// Positions and scores against the per-head oracle (unless diverged after a near-tie).
  void compare_oracle(HeadModel<T>& hm, const Positions& pos, const std::string& where, Index b,
                      Index h) {
    if (!scored_ || hm.diverged || !oracle_on()) {
      hm.ambiguous = false;
      return;
    }
    const std::vector<ref::OracleRow>* rows = nullptr;
    bool compare_all_scores = true;
    if (hm.h2o) rows = &hm.h2o->rows();
    if (hm.h2oq) rows = &hm.h2oq->rows();
    if (hm.tova) rows = &hm.tova->rows();
    if (hm.tovaq) rows = &hm.tovaq->rows();
    if (hm.snap) {
      rows = snap_by_queries_ ? &hm.snapq->rows() : &hm.snap->rows();
      compare_all_scores = false;
    }
    if (rows == nullptr) return;
    Positions want;
    std::vector<double> want_scores;
    for (const auto& r : *rows) {
      want.push_back(r.position);
      want_scores.push_back(r.score);
    }
    const std::vector<float> got_scores = vt::policy_scores(*layer_cache_, b, h);
    std::string problem;
    if (pos != want) {
      problem = where + " retains " + fmt_vec(pos) + " with scores " + fmt_vec(got_scores) +
                "; oracle retains " + fmt_vec(want) + " with scores " + fmt_vec(want_scores);
    } else {
      for (std::size_t r = 0; r < want.size() && problem.empty(); ++r) {
        const bool compared = compare_all_scores || (want[r] >= snap_first_ && want[r] < snap_end_);
        if (!compared) continue;
        const double got = static_cast<double>(got_scores[r]);
        if (!(std::fabs(got - want_scores[r]) <=
              std::max(kScoreAbsTol, kScoreRelTol * std::fabs(want_scores[r])))) {
          std::ostringstream os;
          os.precision(9);
          os << where << " position " << want[r] << " score " << got << ", oracle "
             << want_scores[r];
          problem = os.str();
        }
      }
    }
    if (!problem.empty()) {
      if (!hm.ambiguous) fail("oracle mismatch without a near-tie: " + problem);
      hm.diverged = true;
      if (opt_.stats) ++opt_.stats->excused;
      log("excused near-tie divergence: " + problem);
    }
    hm.ambiguous = false;
  }

  // ------------------------------------------------------------------------------------------

  Bytes& in_;
  const Options& opt_;
  std::string trace_;
  int op_ = -1;

  Policy policy_ = Policy::Standard;
  vc::KVCacheConfig cfg_;
  std::string via_;
  int layers_ = 1, layer_ = 0;
  std::vector<std::unique_ptr<vc::KVCache<T>>> owned_;
  vc::KVCache<T>* layer_cache_ = nullptr;
  bool scored_ = false;  // H2O core, TOVA or SnapKV: publishes scores() and positions()
  bool core_ = false;    // SqueezeAttention, H2O or PyramidKV: also budget(), protected_recent()
  vc::SqueezeAttentionCache<T>* squeeze_ = nullptr;
  vc::H2OCache<T>* h2o_ = nullptr;
  vc::PyramidKVCache<T>* pyramid_ = nullptr;
  vc::TOVACache<T>* tova_ = nullptr;
  vc::StreamingLLMCache<T>* stream_ = nullptr;
  vc::SnapKVCache<T>* snap_ = nullptr;
  std::shared_ptr<vc::SqueezeCoordinator> coordinator_;
  vc::KVPair<T> out_;

  // H2O-core budget model.
  int n_sink_ = 0;
  double decay_ = 1.0;
  ref::H2OHeadOracle::Scorer scorer_ = ref::H2OHeadOracle::Scorer::key_as_query;
  bool ratio_grace_ = true;
  double ratio_ = 0.5;
  int grace_ = 0;
  std::optional<int> model_budget_;
  std::int64_t calls_since_reset_ = 0;
  bool sq_reported_ = false, sq_adopted_ = false;
  std::map<int, double> coord_reports_;
  std::map<int, int> coord_budgets_;
  bool coord_finalized_ = false;

  // Sequence.
  Index B_ = 1, H_ = 1, Dk_ = 1, Dv_ = 1;
  QueryMode qmode_ = QueryMode::None;
  bool one_hot_ = false;
  bool dims_known_ = false;
  std::int64_t offset_ = 0, tokens_seen_ = 0, last_call_first_ = 0;
  Index count_ = 0;
  bool snap_compressed_ = false, snap_by_queries_ = false;
  std::int64_t snap_first_ = 0, snap_end_ = 0;
  Rows palette_k_;
  std::vector<HeadModel<T>> heads_;
};

}  // namespace detail

/// Runs one input; returns "" or a description of the first violation (with the run's config
/// and its last operations).
inline std::string run_ops(const std::uint8_t* data, std::size_t size,
                           const Options& options = {}) {
  detail::Bytes in(data, size);
  if (options.stats) ++options.stats->runs;
  try {
    switch (in.pick(3)) {
      case 1:
        detail::Harness<Eigen::half>(in, options).run();
        break;
      case 2:
        detail::Harness<Eigen::bfloat16>(in, options).run();
        break;
      default:
        detail::Harness<float>(in, options).run();
        break;
    }
  } catch (const detail::Violation& v) {
    return v.what;
  } catch (const std::exception& e) {
    return std::string("unexpected exception escaped the harness: ") + e.what();
  }
  return {};
}

/// run_ops, calling on_failure(message) on a violation (default: print it and abort).
inline void check_ops(const std::uint8_t* data, std::size_t size,
                      const std::function<void(const std::string&)>& on_failure = nullptr,
                      const Options& options = {}) {
  const std::string msg = run_ops(data, size, options);
  if (msg.empty()) return;
  if (on_failure) {
    on_failure(msg);
    return;
  }
  std::fprintf(stderr, "veloxquant fuzz violation: %s\n", msg.c_str());
  std::abort();
}

}  // namespace veloxquant::fuzz
