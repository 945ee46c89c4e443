// veloxquant — what every policy does with a call's rows, as data (Rule) and one driver per head
// (docs/design.md 4, 6, 7). The scored policies share one attention path: a block of tokens'
// query rows against the columns they may attend to (logits kernel), then per token a softmax over
// its visible columns averaged over its query rows (softmax_mean), then the policy's step: decay
// and accumulate (H2O core), replace (TOVA), or rank once (SnapKV); and one selection kernel
// decides evictions (select.hpp).
//
// Columns are either the head's storage slots themselves (one-token calls, and calls scored with
// queries whose evictions come once at the end: no copy at all) or the live rows gathered per block
// (multi-token calls that evict per token, so that a long prompt attends over the budget, not over
// everything it has seen). An evicted or dead column gets logit -inf and so weight exactly 0.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "head_store.hpp"
#include "input.hpp"
#include "proxy_scores.hpp"
#include "scratch.hpp"
#include "select.hpp"
#include "simd_kernels.hpp"
#include "value_rank.hpp"

namespace veloxquant::cache::detail {

/// The policies, by what they do with rows.
enum class RuleKind : std::uint8_t {
  keep_all,        ///< standard cache: every row stays
  window,          ///< StreamingLLM: sinks and the newest `window` others
  cumulative,      ///< H2O core (SqueezeAttention, H2O, PyramidKV): decayed attention mass
  last_attention,  ///< TOVA: the current token's attention
  prompt,          ///< SnapKV: the first call longer than the budget is ranked once
};

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
  int window = 0;            ///< window: rows kept besides the sinks
  int obs_window = 0;        ///< prompt: query tokens that rank the prompt
  bool compressed = false;   ///< prompt: a call has been ranked (until reset)

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
  /// Rows a head holds in steady state (sizes storage growth): budget + 1, or unbounded.
  Index steady_rows() const {
    switch (kind) {
      case RuleKind::window:
        return static_cast<Index>(n_sink) + window + 1;
      case RuleKind::cumulative:
      case RuleKind::last_attention:
        if (budget) return static_cast<Index>(*budget) + 1;
        break;
      case RuleKind::keep_all:
      case RuleKind::prompt:
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

/// The plan of a call of S >= 1 tokens with `groups` query heads per KV head (0: key-as-query).
/// With `attend`, the rows are enough for the attention output's blocks as well.
inline CallPlan plan_call(const Rule& r, Index S, Index groups, bool attend = false) {
  CallPlan p;
  const Index G = std::max<Index>(groups, 1);
  if (attend) {
    p.rows = std::min(block_tokens(S, G), S) * G;
    p.packed = S > 1;
  }
  switch (r.kind) {
    case RuleKind::keep_all:
    case RuleKind::window:
      break;
    case RuleKind::prompt:
      p.compress = !r.compressed && r.budget && S > *r.budget;
      if (p.compress) p.rows = std::max(p.rows, std::min<Index>(r.obs_window, S) * G);
      break;
    case RuleKind::cumulative:
    case RuleKind::last_attention: {
      if (r.kind == RuleKind::cumulative && groups == 0 && r.proxy != ProxyScoring::key_as_query) {
        p.rows = std::max<Index>(p.rows, 2);  // absorb_proxy: two rows of queries
        break;
      }
      const bool once_per_call = r.kind == RuleKind::cumulative && groups > 0;
      p.gather = S > 1 && !once_per_call;
      p.block = block_tokens(S, G);
      p.rows = std::min(p.block, S) * G;
      p.packed = p.packed || (S > 1 && !p.gather);
      break;
    }
  }
  return p;
}

/// One KV head's query heads for the call (docs/design.md 4.6): query head g of this KV head is
/// head h * G + g of the call's queries. Empty (rows == nullptr) without queries.
struct HeadQueries {
  const InputRows* rows = nullptr;
  Index b = 0, h = 0, groups = 0;

  explicit operator bool() const { return rows != nullptr; }
  /// Query head g of the call's token s as float32. out: [padded_dim(D)]
  void read(Index g, Index s, float* out) const {
    read_float_row(*rows, b, h * groups + g, s, out);
  }
};

/// Where `attend` writes its output: row (b, j, s) (query head j, token s of the call) starts at
/// data + b * stride_b + j * stride_j + s * stride_s and holds Dv float32.
struct AttendOut {
  float* data = nullptr;
  Index stride_b = 0, stride_j = 0, stride_s = 0;
};

/// One KV head's share of the attention output: the rows of its G query heads. Empty without
/// attend.
struct HeadAttend {
  const AttendOut* out = nullptr;
  Index b = 0, h = 0, groups = 0;

  explicit operator bool() const { return out != nullptr; }
  /// Output row of query head g (of this KV head) for the call's token s; the G rows of a token
  /// are stride() apart.
  float* row(Index s, Index g) const {
    return out->data + b * out->stride_b + (h * groups + g) * out->stride_j + s * out->stride_s;
  }
  Index stride() const { return out->stride_j; }
};

/// The value-weighted ranking (docs/design.md 4.8) of every live row of `head` (whose value
/// weights are on), by slot: score * |v|^p. Returns it (in sc.logits).
template <class T>
const float* value_rank_head(const HeadStore<T>& head, Scratch& sc) {
  float* rank = sc.logits.data();
  value_weighted_rank(head.scores_data_const(), head.value_weights_data(), head.order().data(),
                      head.live(), rank);
  return rank;
}

/// Re-budget (docs/design.md 4.5): keeps the sinks, the newest `g` rows and the highest-score
/// others up to `budget`; among equal scores the later positions survive. `rank` (by slot; null:
/// the scores) is what "score" means here (KeyDiff's ranking, keydiff_rank_head).
template <class T>
void rebudget(HeadStore<T>& head, int budget, int n_sink, int g, Scratch& sc,
              const float* rank = nullptr) {
  const Index n = head.live();
  if (n <= budget) return;
  const Slot* ord = head.order().data();
  const Index sinks = head.leading_sinks(n_sink);
  const Index hi = std::max(sinks, n - g);
  const Index keep = std::max<Index>(0, budget - sinks - (n - hi));
  const Index m = hi - sinks;
  if (m <= keep) return;
  const float* score = rank != nullptr ? rank : head.scores_data();
  if (m - keep == 1) {
    // One row goes (a decode step over budget): the SIMD search over the live order.
    head.evict_at(worst_in_order(ord, sinks, hi, score, Tie::evict_earliest, sc.weights.data()));
    return;
  }
  std::int32_t* picks = sc.picks.data();
  std::copy(ord + sinks, ord + hi, picks);
  order_worst_first(picks, m, m - keep, score, head.positions_data(), Tie::evict_earliest);
  for (Index i = 0; i < m - keep; ++i) head.mark_dead(picks[i]);
  head.drop_dead();
}

/// The live row of `head` to evict first among all but the sinks and the newest `g` (its index in
/// the live order), by the order of select.hpp with ties to the earliest; -1 if none. The scores
/// go to `buf` in slot order (contiguous) with the protected and dead slots at +inf, and the
/// SIMD argmin finds the lowest. When that lowest value is not unique (a tie: positions decide)
/// or not a number, the exact search over the live order decides.
template <class T>
Index worst_live(const HeadStore<T>& head, int n_sink, int g, float* buf) {
  const Slot* ord = head.order().data();
  const Index n = head.live(), n_phys = head.physical();
  const Index sinks = head.leading_sinks(n_sink);
  if (n - g <= sinks) return -1;
  const float inf = std::numeric_limits<float>::infinity();
  const float* score = head.scores_data_const();
  std::copy(score, score + n_phys, buf);
  for (Index i = 0; i < sinks; ++i) buf[ord[i]] = inf;
  for (Index i = n - g; i < n; ++i) buf[ord[i]] = inf;
  for (const Slot h : head.holes()) buf[h] = inf;
  int hits = 0;
  const Index k = argmin(buf, n_phys, false, &hits);
  if (k >= 0 && hits == 1 && buf[k] < inf) return head.order_index(static_cast<Slot>(k));
  return worst_in_order(ord, sinks, n - g, score, Tie::evict_earliest, buf);
}

/// The scored policies' driver: absorbs the `count` rows appended at slots
/// [call_begin(), call_begin() + count) of `head` (docs/design.md 4.2, 4.6, 6). With `att` (only
/// for a call whose columns are exactly its window: no gather, no holes) it also writes the
/// attention output of every query row from the very softmax rows the scores come from
/// (docs/design.md 2.8).
template <class T>
void absorb_scored(HeadStore<T>& head, const Rule& rule, const CallPlan& plan, Index count,
                   const HeadQueries& q, const HeadAttend& att, Scratch& sc) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kAll = std::numeric_limits<std::int64_t>::max();
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q ? q.groups : 1;
  const bool tova = rule.kind == RuleKind::last_attention;
  const bool once_per_call = !tova && q;  // docs/design.md 4.6: evictions once, at the end
  const int g = rule.protected_recent();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // A re-budget at the start of the call left dead slots before the call's rows.
  const bool holes = !plan.gather && head.live() < first;
  Index live = head.live();
  // Prefill blocks without gather: the keys as columns, packed once each (logits_packed).
  const bool packed = count > 1 && !plan.gather;
  Index packed_upto = 0;
  for (Index i0 = 0; i0 < count; i0 += plan.block) {
    const Index nb = std::min(plan.block, count - i0);
    // The columns: storage slots [0, first + i0 + nb), or the live rows then the block's rows.
    Index nc = first + i0;
    const Slot* slot = nullptr;
    float* score = head.scores_data();
    const std::int64_t* pos = head.positions_data();
    std::uint8_t* alive = head.alive_data();
    if (plan.gather) {
      nc = head.live();
      slot = sc.slot.data();
      score = sc.score.data();
      std::int64_t* gpos = sc.pos.data();
      pos = gpos;
      alive = sc.alive.data();
      const Slot* ord = head.order().data();
      for (Index j = 0; j < nc + nb; ++j) {
        const Slot sl = j < nc ? ord[j] : static_cast<Slot>(first + i0 + (j - nc));
        sc.slot.data()[j] = sl;
        score[j] = head.score(sl);
        gpos[j] = head.position(sl);
        alive[j] = 1;
      }
    }
    const Index ncols = nc + nb;
    const Index ld = Scratch::ld(ncols);
    // The block's query rows: per token its G query heads, or its own key (key-as-query).
    float* qrows = sc.queries.data();
    for (Index t = 0; t < nb; ++t) {
      for (Index gi = 0; gi < G; ++gi) {
        float* dst = qrows + (t * G + gi) * dp;
        if (q) {
          q.read(gi, i0 + t, dst);
        } else {
          load_stored_row(head.key_rows(), first + i0 + t, d, dst);
        }
      }
    }
    float* lg = sc.logits.data();
    if (packed) {
      pack_keys(head.key_rows(), packed_upto, ncols, d, sc.packed.data(), sc.keys.data());
      packed_upto = ncols;
      logits_packed(qrows, nb * G, dp, sc.packed.data(), ncols, d, scale, lg, ld, sc.keys.data());
    } else {
      logits(qrows, nb * G, dp, head.key_rows(), slot, ncols, d, scale, lg, ld, sc.keys.data());
    }
    if (holes) {
      for (Index c = 0; c < first; ++c) {
        if (alive[c]) continue;
        for (Index r = 0; r < nb * G; ++r) lg[r * ld + c] = kNegInf;
      }
    }
    float* w = sc.weights.data();
    for (Index t = 0; t < nb; ++t) {
      const Index ct = nc + t;
      const auto s = static_cast<Slot>(first + i0 + t);
      float* rows_t = lg + t * G * ld;
      // Evicts column c: a slot found by worst_live (at index `at` of the live order), or a
      // gathered column (its logits in the block's later rows become -inf).
      const auto kill = [&](Index c, Index at) {
        if (!plan.gather) {
          head.evict_at(at);
          return;
        }
        alive[c] = HeadStore<T>::kDead;
        head.mark_dead(slot[c]);
        for (Index r = (t + 1) * G; r < nb * G; ++r) lg[r * ld + c] = kNegInf;
      };
      if (tova) {
        if (!plan.gather) head.push_live(s);
        ++live;
        const bool evict = rule.budget && live > *rule.budget;
        if (!evict && !att) continue;
        softmax_mean(rows_t, G, ld, ct + 1, w, sc.inv.data());  // over every row, itself included
        if (att) {
          weighted_rows(rows_t, ld, sc.inv.data(), G, head.value_rows(), head.value_dim(), ct + 1,
                        att.row(i0 + t, 0), att.stride());
        }
        if (!evict) continue;
        std::copy(w, w + ct + 1, score);
        if (plan.gather) {
          const Index k =
              worst_of(score, pos, alive, ct + 1, rule.n_sink, kAll, Tie::evict_earliest);
          if (k >= 0) kill(k, -1), --live;
        } else {
          const Index at = worst_live(head, rule.n_sink, 0, w);
          if (at >= 0) kill(-1, at), --live;
        }
        continue;
      }
      if (once_per_call) {
        // Over the rows retained before the call and the call's rows up to itself.
        softmax_mean(rows_t, G, ld, ct + 1, w, sc.inv.data());
        if (att) {
          weighted_rows(rows_t, ld, sc.inv.data(), G, head.value_rows(), head.value_dim(), ct + 1,
                        att.row(i0 + t, 0), att.stride());
        }
        decay_accumulate(score, w, ct + 1, rule.decay);
        head.push_live(s);
        continue;
      }
      // Key-as-query (docs/design.md 4.2): the key attends over the rows retained before it.
      if (live == 0) {
        score[ct] = 1.0f;
      } else {
        softmax_mean(rows_t, 1, ld, ct, w);
        decay_accumulate(score, w, ct, rule.decay);
        score[ct] = 0.0f;
      }
      if (!plan.gather) head.push_live(s);
      ++live;
      if (!rule.budget || live <= *rule.budget) continue;
      // Protected: sinks and the newest g rows. The newest g live rows are always the last g of
      // the position-ordered sequence (a row is protected from the moment it arrives until g
      // newer ones have, and only unprotected rows are evicted).
      if (plan.gather) {
        const std::int64_t newest = g == 0 ? kAll : ct + 1 >= g ? pos[ct + 1 - g] : kNone;
        const Index k =
            worst_of(score, pos, alive, ct + 1, rule.n_sink, newest, Tie::evict_earliest);
        if (k >= 0) kill(k, -1), --live;
      } else {
        const Index at = worst_live(head, rule.n_sink, g, w);
        if (at >= 0) kill(-1, at), --live;
      }
    }
    if (plan.gather) {
      // Scores back to their slots; the live order is the surviving columns in column order.
      std::int32_t* order = sc.picks.data();
      Index n = 0;
      for (Index c = 0; c < ncols; ++c) {
        if (!alive[c]) continue;
        head.score(slot[c]) = score[c];
        order[n++] = slot[c];
      }
      head.assign_order(order, n);
    }
  }
  if (once_per_call && rule.budget) {
    const bool weighted = rule.value_power > 0.0 && head.live() > *rule.budget;
    rebudget(head, *rule.budget, rule.n_sink, g, sc,
             weighted ? value_rank_head(head, sc) : nullptr);
  }
}

/// KeyDiff's ranking (docs/design.md 4.7) of the live rows of `head` at order[lo, hi) (the
/// candidates), by slot; the scores hold each row's 1 / (|k| + 1e-8). When the live set changed
/// otherwise than through absorb_proxy (a call with queries, a re-budget, a load), first rewrites
/// every live row's score as that weight, from its key (a call with queries added attention mass
/// to it; a loaded file's scores are not trusted), and rebuilds the running sum from them.
/// Returns the ranking (in sc.logits; sc.queries row 0 holds the mean on the way, row 1 a row
/// while rebuilding).
template <class T>
const float* keydiff_rank_head(HeadStore<T>& head, Index lo, Index hi, Scratch& sc) {
  const Index n = head.live(), d = head.key_dim(), dp = padded_dim(d);
  const Slot* ord = head.order().data();
  std::int64_t* sum = head.key_sum();
  if (!head.key_sum_valid()) {
    std::fill(sum, sum + d, std::int64_t{0});
    float* row = sc.queries.data() + dp;
    for (Index j = 0; j < n; ++j) {
      const float w = 1.0f / (key_norm(head.key_rows(), ord[j], d, row, sc.keys.data()) + kUnitEps);
      head.score(ord[j]) = w;
      key_sum_update(sum, row, d, w, 1);
    }
    head.set_key_sum_valid();
  }
  const float* weight = head.scores_data_const();
  // Over the storage as it lies unless dead slots are many (a long prompt evicting as it goes).
  const Index n_phys = head.physical();
  float* rank = sc.logits.data();
  keydiff_rank(head.key_rows(), d, sum, weight, n, n_phys, ord + lo, hi - lo, n_phys - n <= n / 8,
               rank, sc.weights.data(), sc.queries.data(), sc.keys.data());
  return rank;
}

/// The H2O core without queries under a query-free scorer other than key-as-query (docs/design.md
/// 4.7): the `count` rows at [call_begin(), +count) join one at a time, each with its score
/// (K-norm: -|k|; KeyDiff: 1 / (|k| + 1e-8)); over budget, the lowest-ranked row among all but the
/// sinks and the newest g goes (ties: the earliest), as in 4.2. K-norm ranks by the scores,
/// KeyDiff by keydiff_rank over the live rows at that moment (its running sum follows each row in
/// and out).
template <class T>
void absorb_proxy(HeadStore<T>& head, const Rule& rule, Index count, Scratch& sc) {
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const int g = rule.protected_recent();
  const bool keydiff = rule.proxy == ProxyScoring::keydiff;
  float* row = sc.queries.data() + dp;
  for (Index t = 0; t < count; ++t) {
    const auto s = static_cast<Slot>(first + t);
    const float norm = key_norm(head.key_rows(), s, d, row, sc.keys.data());
    const float w = keydiff ? 1.0f / (norm + kUnitEps) : -norm;
    head.score(s) = w;
    bool sum_valid = keydiff && head.key_sum_valid();
    head.push_live(s);
    if (sum_valid) {
      key_sum_update(head.key_sum(), row, d, w, 1);  // the row key_norm loaded
      head.set_key_sum_valid();
    }
    if (!rule.budget || head.live() <= *rule.budget) continue;
    const Index n = head.live();
    const Slot* ord = head.order().data();
    const Index sinks = head.leading_sinks(rule.n_sink);
    if (n - g <= sinks) continue;
    const float* rank =
        keydiff ? keydiff_rank_head(head, sinks, n - g, sc) : head.scores_data_const();
    const Index at =
        worst_in_order(ord, sinks, n - g, rank, Tie::evict_earliest, sc.weights.data());
    const Slot victim = ord[at];
    sum_valid = keydiff && head.key_sum_valid();
    if (sum_valid) {
      load_stored_row(head.key_rows(), victim, d, row);
      key_sum_update(head.key_sum(), row, d, head.score(victim), -1);
    }
    head.evict_at(at);
    if (sum_valid) head.set_key_sum_valid();
  }
}

/// SnapKV (docs/design.md 6): ranks the `count` rows of the call at [call_begin(), +count) by the
/// mean, over the last w = min(obs_window, count) tokens' query rows (their keys, or their G query
/// heads), of their softmax over all the call's rows (no causal mask); keeps the call's first
/// min(n_sink, budget) rows and the top budget - sinks others (ties: the earliest stay).
template <class T>
void compress_prompt(HeadStore<T>& head, const Rule& rule, Index count, const HeadQueries& q,
                     Scratch& sc) {
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q ? q.groups : 1;
  const Index w = std::min<Index>(rule.obs_window, count);
  float* qrows = sc.queries.data();
  for (Index t = 0; t < w; ++t) {
    for (Index gi = 0; gi < G; ++gi) {
      float* dst = qrows + (t * G + gi) * dp;
      if (q) {
        q.read(gi, count - w + t, dst);
      } else {
        load_stored_row(head.key_rows(), first + count - w + t, d, dst);
      }
    }
  }
  const Index ld = Scratch::ld(count);
  float* lg = sc.logits.data();
  float* mean = sc.weights.data();
  logits(qrows, w * G, dp, head.key_rows().from(first), nullptr, count, d,
         1.0f / std::sqrt(static_cast<float>(d)), lg, ld, sc.keys.data());
  softmax_mean(lg, w * G, ld, count, mean);
  for (Index i = 0; i < count; ++i) {
    head.score(first + i) = mean[i];
    head.push_live(static_cast<Slot>(first + i));
  }
  const int budget = *rule.budget;
  const Index sinks = std::min<Index>(rule.n_sink, budget);
  const Index keep = budget - sinks;
  const Index m = count - sinks;
  if (m <= keep) return;
  std::int32_t* picks = sc.picks.data();
  for (Index i = 0; i < m; ++i) picks[i] = static_cast<std::int32_t>(first + sinks + i);
  order_worst_first(picks, m, m - keep, head.scores_data(), head.positions_data(),
                    Tie::evict_latest);
  for (Index i = 0; i < m - keep; ++i) head.mark_dead(picks[i]);
  head.drop_dead();
}

/// The attention output of the call just absorbed (docs/design.md 2.8), computed on its own: the
/// `count` call tokens' G query heads each attend over the head's window, slots [0, physical())
/// (the rows retained before the call, then the call's), token t over the slots before
/// call_begin() + t + 1. For the calls whose scores do not come from that softmax: policies that
/// do not score, SnapKV, TOVA's multi-token calls (they evict inside the call), and calls that
/// began with a re-budget (its rows are in the window but no longer scored).
template <class T>
void attend_window(const HeadStore<T>& head, Index count, const HeadQueries& q,
                   const HeadAttend& att, Scratch& sc) {
  const Index first = head.call_begin();
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index G = q.groups;
  const Index block = block_tokens(count, G);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* qrows = sc.queries.data();
  float* lg = sc.logits.data();
  for (Index i0 = 0; i0 < count; i0 += block) {
    const Index nb = std::min(block, count - i0);
    const Index ncols = first + i0 + nb;
    const Index ld = Scratch::ld(ncols);
    for (Index t = 0; t < nb; ++t) {
      for (Index gi = 0; gi < G; ++gi) q.read(gi, i0 + t, qrows + (t * G + gi) * dp);
    }
    if (count > 1) {
      // Each block packs only its own keys' columns (the earlier ones are there already).
      pack_keys(head.key_rows(), i0 == 0 ? 0 : first + i0, ncols, d, sc.packed.data(),
                sc.keys.data());
      logits_packed(qrows, nb * G, dp, sc.packed.data(), ncols, d, scale, lg, ld, sc.keys.data());
    } else {
      logits(qrows, nb * G, dp, head.key_rows(), nullptr, ncols, d, scale, lg, ld,
             sc.keys.data());
    }
    for (Index t = 0; t < nb; ++t) {
      float* rows_t = lg + t * G * ld;
      const Index n = first + i0 + t + 1;
      softmax_mean(rows_t, G, ld, n, nullptr, sc.inv.data());
      weighted_rows(rows_t, ld, sc.inv.data(), G, head.value_rows(), head.value_dim(), n,
                    att.row(i0 + t, 0), att.stride());
    }
  }
}

/// Absorbs the `count` rows appended at [call_begin(), call_begin() + count) of `head` by `rule`;
/// with `att`, also writes the call's attention output (fused into the scoring where the scoring
/// softmax is the attention's, else by attend_window).
template <class T>
void absorb_head(HeadStore<T>& head, const Rule& rule, const CallPlan& plan, Index count,
                 const HeadQueries& q, const HeadAttend& att, Scratch& sc) {
  const Index first = head.call_begin();
  switch (rule.kind) {
    case RuleKind::cumulative:
      if (!q && rule.proxy != ProxyScoring::key_as_query) {
        absorb_proxy(head, rule, count, sc);  // no queries, so no attention output either
        return;
      }
      [[fallthrough]];
    case RuleKind::last_attention:
      if (att && !plan.gather && head.live() == first) {
        absorb_scored(head, rule, plan, count, q, att, sc);
        return;
      }
      absorb_scored(head, rule, plan, count, q, HeadAttend{}, sc);
      if (att) attend_window(head, count, q, att, sc);
      return;
    case RuleKind::prompt:
      if (plan.compress) {
        compress_prompt(head, rule, count, q, sc);
        if (att) attend_window(head, count, q, att, sc);
        return;
      }
      break;
    case RuleKind::window: {
      for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
      const Slot* ord = head.order().data();
      const Index sinks = head.leading_sinks(rule.n_sink);
      const Index excess = head.live() - sinks - rule.window;
      if (excess > 0) {
        for (Index i = sinks; i < sinks + excess; ++i) head.mark_dead(ord[i]);
        head.drop_dead();
      }
      if (att) attend_window(head, count, q, att, sc);
      return;
    }
    case RuleKind::keep_all:
      break;
  }
  for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
  if (att) attend_window(head, count, q, att, sc);
}

}  // namespace veloxquant::cache::detail
