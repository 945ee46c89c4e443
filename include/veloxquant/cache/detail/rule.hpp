// veloxquant — what a policy does with a call's rows, as data: the Rule each cache class fills in
// (docs/design.md 4, 6) and the CallPlan one call of it follows (policy.hpp drives both).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "proxy_scores.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// The policies, by what they do with rows.
enum class RuleKind : std::uint8_t {
  keep_all,        ///< standard cache: every row stays
  window,          ///< StreamingLLM: sinks and the newest `window` others
  cumulative,      ///< H2O core (SqueezeAttention, H2O, PyramidKV): decayed attention mass
  last_attention,  ///< TOVA: the current token's attention
  prompt,          ///< SnapKV: a prompt chunk that would pass the budget is ranked and cut
  observed,        ///< KVzip: every row stays; observe scores them, a set's compress cuts them
};

/// KVzip: the score of a row no observe call has scored yet (observed scores are >= 0).
inline constexpr float kUnobserved = -1.0f;

/// One policy's parameters and the little state it carries between calls.
struct Rule {
  RuleKind kind = RuleKind::keep_all;
  std::optional<int> budget;  ///< rows per head once full; empty: unknown (no eviction)
  int n_sink = 0;             ///< leading positions never evicted
  // cumulative: the protected recent window g (docs/design.md 4.2 step 3) and the score decay
  bool recent_by_ratio = true;  ///< g = floor(recent_ratio * (budget - n_sink)); else g = grace
  double recent_ratio = 0.5;
  int grace = 0;
  float decay = 1.0f;
  ProxyScoring proxy = ProxyScoring::key_as_query;  ///< cumulative: calls without queries
  double value_power = 0.0;  ///< cumulative, calls with queries: rank by score * |v|^p (> 0)
  /// cumulative: adaptive heads (SPEC 14, docs/design.md 4.9): the heads of a sequence share
  /// H x budget rows, each keeping at least floor_rows(); evictions come once per call, pooled.
  bool adaptive = false;
  double head_floor = 1.0;   ///< adaptive: the share of the budget every head keeps at least
  int window = 0;            ///< window: rows kept besides the sinks
  int obs_window = 0;        ///< prompt: query tokens that rank the prompt
  bool compressed = false;   ///< prompt: a call has been ranked and cut; observed: a compress
                             ///< has cut the heads (until reset)
  bool observed = false;     ///< observed: an observe call has scored rows (until reset)
  /// The cache is in a memory pool (SPEC 19): TOVA then scores every token, not only those after
  /// which it evicts, so that the pool's trims rank rows by its attention.
  bool pooled = false;

  /// Whether the heads may hold different numbers of rows: adaptive heads (SPEC 14) and KVzip
  /// after a compress (SPEC 18).
  bool per_head_rows() const { return adaptive || kind == RuleKind::observed; }

  /// g for the budget in force, clamped to [0, budget - n_sink - 1] so one row stays evictable;
  /// 0 while the budget is unknown.
  int protected_recent() const {
    if (!budget) return 0;
    const long long span = static_cast<long long>(*budget) - n_sink;
    long long g = recent_by_ratio
                      ? static_cast<long long>(std::floor(recent_ratio * static_cast<double>(span)))
                      : static_cast<long long>(grace);
    g = std::min(g, span - 1);
    g = std::max(g, 0LL);
    return static_cast<int>(g);
  }
  /// Adaptive heads: the rows every head keeps at least under the budget in force,
  /// ceil(head_floor x budget) (0 while the budget is unknown).
  Index floor_rows() const {
    if (!budget) return 0;
    const double rows = std::ceil(head_floor * static_cast<double>(*budget));
    return std::min<Index>(*budget, static_cast<Index>(rows));
  }
  /// Rows a head holds in steady state (sizes storage growth): budget + 1, or unbounded.
  Index steady_rows() const {
    switch (kind) {
      case RuleKind::window:
        return static_cast<Index>(n_sink) + window + 1;
      case RuleKind::cumulative:
      case RuleKind::last_attention:
        // Adaptive heads hold anything from their floor to most of the pool: no steady size (a
        // head that grows at every call must not be copied at every call, SPEC 7).
        if (budget && !adaptive) return static_cast<Index>(*budget) + 1;
        break;
      case RuleKind::keep_all:
      case RuleKind::prompt:
      case RuleKind::observed:
        break;
    }
    return std::numeric_limits<Index>::max();
  }
};

/// Tokens of a call per logits product: about 64 logit rows.
inline constexpr Index kBlockRows = 64;

/// How one call is absorbed (the same for every head of the call).
struct CallPlan {
  bool compress = false;  ///< prompt: this call is ranked and cut to the budget
  bool gather = false;    ///< blocks attend over gathered live rows (per-token eviction, S > 1)
  Index block = 1;        ///< tokens per logits product
  Index rows = 0;         ///< logit rows per product (0: nothing is scored)
  bool packed = false;    ///< prefill logits over packed key columns (S > 1, no gather)
};

/// Tokens per logits product of a call of S tokens with G query rows per token.
inline Index block_tokens(Index S, Index G) {
  return S == 1 ? 1 : std::max<Index>(1, kBlockRows / G);
}

/// The plan of a call of S >= 1 tokens with `groups` query heads per KV head (0: key-as-query)
/// on heads holding `held` rows. With `attend`, the rows are enough for the attention output's
/// blocks as well.
inline CallPlan plan_call(const Rule& r, Index S, Index groups, bool attend = false,
                          Index held = 0) {
  CallPlan p;
  const Index G = std::max<Index>(groups, 1);
  if (attend) {
    p.rows = std::min(block_tokens(S, G), S) * G;
    p.packed = S > 1;
  }
  switch (r.kind) {
    case RuleKind::keep_all:
    case RuleKind::window:
    case RuleKind::observed:
      break;
    case RuleKind::prompt:
      // A prompt chunk (S > 1) after which a head would hold more than the budget (SPEC 13.3);
      // decode steps never evict.
      p.compress = r.budget && S > 1 && held + S > *r.budget;
      if (p.compress) p.rows = std::max(p.rows, std::min<Index>(r.obs_window, S) * G);
      break;
    case RuleKind::cumulative:
    case RuleKind::last_attention: {
      if (r.kind == RuleKind::cumulative && groups == 0 && r.proxy != ProxyScoring::key_as_query) {
        p.rows = std::max<Index>(p.rows, 2);  // absorb_proxy: two rows of queries
        break;
      }
      // Adaptive heads evict once per call in every case: the pool is the layer's, after every
      // head has taken the call.
      const bool once_per_call = r.kind == RuleKind::cumulative && (groups > 0 || r.adaptive);
      p.gather = S > 1 && !once_per_call;
      p.block = block_tokens(S, G);
      p.rows = std::min(p.block, S) * G;
      p.packed = p.packed || (S > 1 && !p.gather);
      break;
    }
  }
  return p;
}

}  // namespace veloxquant::cache::detail
