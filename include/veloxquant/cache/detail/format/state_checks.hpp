// veloxquant — the rules a cache's restored state keeps between calls (docs/design.md G, "what a
// loader checks", 5), as free functions over the saved descriptor, the policy's Rule and the
// heads as they are read. KVCache::read_state runs them before it installs anything; every
// refusal is a std::invalid_argument naming the rule (the prompt-cache loader adds where in the
// file it was).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../checks.hpp"
#include "../head_store.hpp"
#include "../policy.hpp"
#include "../quant.hpp"

namespace veloxquant::cache::detail {

/// A cache's state as read and not yet installed: its descriptor (docs/design.md G, "cache
/// descriptor"), then its heads as they are read, and the row buffer a quantized cache needs.
template <class T>
struct SavedCache {
  enum : std::uint8_t { kDimsKnown = 1, kHasBudget = 2, kCompressed = 4, kObserved = 8 };
  std::uint8_t flags = 0;
  std::int32_t budget = 0;
  std::int64_t batch = 0, heads = 0, key_dim = 0, value_dim = 0;
  std::int64_t offset = 0, tokens_seen = 0, rows = 0;
  std::vector<HeadStore<T>> stores;
  std::vector<float> row_buf;
  bool dims_known() const { return (flags & kDimsKnown) != 0; }
  bool has_budget() const { return (flags & kHasBudget) != 0; }
  bool compressed() const { return (flags & kCompressed) != 0; }
  bool observed() const { return (flags & kObserved) != 0; }
};

/// Throws std::invalid_argument(why): a saved state no cache can be in.
[[noreturn]] inline void bad_state(const std::string& why) { throw std::invalid_argument(why); }

/// Flag bits no version of the format sets; a budget value without a budget.
template <class T>
void check_saved_flags(const SavedCache<T>& s) {
  using S = SavedCache<T>;
  if ((s.flags & ~(S::kDimsKnown | S::kHasBudget | S::kCompressed | S::kObserved)) != 0) {
    bad_state("unknown state flags");
  }
  if (!s.has_budget() && s.budget != 0) bad_state("no budget but a budget value");
}

/// True for the policies whose rows carry scores (the others' are all 0 and not saved).
inline bool scored_rows(RuleKind k) {
  return k == RuleKind::cumulative || k == RuleKind::last_attention || k == RuleKind::prompt ||
         k == RuleKind::observed;
}
/// Dims, counters and the row count of a cache that has seen a call; kf and vf: its row formats.
template <class T>
void check_saved_dims(const SavedCache<T>& s, const Rule& rule, const RowFormat& kf,
                      const RowFormat& vf) {
  constexpr std::int64_t kMaxDim = std::numeric_limits<std::int32_t>::max();
  for (const std::int64_t v : {s.batch, s.heads, s.key_dim, s.value_dim}) {
    if (v < 1 || v > kMaxDim) {
      bad_state("dims [" + std::to_string(s.batch) + ", " + std::to_string(s.heads) + ", ., " +
                std::to_string(s.key_dim) + " / " + std::to_string(s.value_dim) +
                "] are not in [1, 2^31 - 1]");
    }
  }
  if (s.key_dim > kMaxHeadDim || s.value_dim > kMaxHeadDim) {
    bad_state("head dims " + std::to_string(s.key_dim) + " / " + std::to_string(s.value_dim) +
              " are beyond " + std::to_string(kMaxHeadDim) + ", the most a call may bring");
  }
  // Far beyond any sequence, and room left for the counters to grow without overflow.
  constexpr std::int64_t kMaxCount = std::int64_t{1} << 62;
  if (s.offset > kMaxCount || s.tokens_seen > kMaxCount) {
    bad_state("offset " + std::to_string(s.offset) + " or tokens_seen " +
              std::to_string(s.tokens_seen) + " is beyond 2^62");
  }
  if (s.offset < 0 || s.rows < 0 || s.rows > s.offset || s.rows > kMaxDim) {
    bad_state(std::to_string(s.rows) + " rows per head at offset " + std::to_string(s.offset));
  }
  // tokens_seen is B·H·S summed over calls: B·H times the offset (trim lowers the offset of a
  // standard cache, not tokens_seen).
  const std::int64_t bh = s.batch * s.heads;
  const bool trimmable = rule.kind == RuleKind::keep_all;
  if (s.tokens_seen < 0 || s.tokens_seen % bh != 0 ||
      (trimmable ? s.tokens_seen / bh < s.offset : s.tokens_seen / bh != s.offset)) {
    bad_state("tokens_seen " + std::to_string(s.tokens_seen) + " does not fit " +
              std::to_string(bh) + " heads at offset " + std::to_string(s.offset));
  }
  for (const RowFormat* f : {&kf, &vf}) {
    if (f->token_axis() && f->dim % f->group != 0) {
      bad_state("quant_group " + std::to_string(f->group) + " does not divide the " +
                (f == &kf ? "key" : "value") + " dim " + std::to_string(f->dim));
    }
  }
}
/// The retained count against the policy and the budget in force (docs/design.md 4.2, 6).
template <class T>
void check_saved_rows(const SavedCache<T>& s, const Rule& rule) {
  const bool keep_all = rule.kind == RuleKind::keep_all;
  const bool prompt = rule.kind == RuleKind::prompt;
  if (s.dims_known() && s.rows == 0 && !keep_all) {
    bad_state("no rows after a call: only a trimmed standard cache can hold none");
  }
  const bool observed = rule.kind == RuleKind::observed;
  if (s.compressed() && (!(prompt || observed) || !s.dims_known())) {
    bad_state("compressed, but not a SnapKV or KVzip cache that has seen a call");
  }
  if (s.observed() && (!observed || !s.dims_known() || s.rows == 0)) {
    bad_state("observed, but not a KVzip cache that holds rows");
  }
  // (A KVzip cache may be compressed without being observed: a memory pool cut it, SPEC 19.)
  if (observed && !s.compressed() && s.rows != s.offset) {
    bad_state("a KVzip cache that has not compressed holds every row (" + std::to_string(s.rows) +
              " at offset " + std::to_string(s.offset) + ")");
  }
  if (prompt && !s.compressed() && s.rows != s.offset) {
    bad_state("a SnapKV cache that has not compressed holds every row (" + std::to_string(s.rows) +
              " at offset " + std::to_string(s.offset) + ")");
  }
  if (s.has_budget() && s.budget < 1) {
    bad_state("budget " + std::to_string(s.budget) + " is below 1");
  }
  // Evictions never take a sink, so a budget below the sinks (an adopted budget from a
  // coordinator with fewer sinks than the layer) leaves the sinks: at most max(budget, sinks).
  const bool bounded = rule.kind == RuleKind::window || rule.kind == RuleKind::cumulative ||
                       rule.kind == RuleKind::last_attention;
  const std::int64_t sinks = std::min<std::int64_t>(rule.n_sink, s.offset);
  // Adaptive heads share H x budget rows per sequence (check_saved_pool); one head may hold more.
  if (bounded && !rule.adaptive && s.has_budget() &&
      s.rows > std::max<std::int64_t>(s.budget, sinks)) {
    bad_state(std::to_string(s.rows) + " rows per head over its budget of " +
              std::to_string(s.budget));
  }
}

/// Scores are sums of softmax weights (or the weights themselves): never negative, always finite
/// (the bounds on keys and queries keep every logit finite, docs/design.md E). K-norm (4.7) writes
/// negative scores (-|k|, finite for keys within bounds); KeyDiff recomputes its weights from the
/// keys before it uses them, whatever the file says.
inline void check_saved_scores(const std::vector<float>& score, const Rule& rule) {
  const bool signed_scores =
      rule.kind == RuleKind::cumulative && rule.proxy != ProxyScoring::key_as_query;
  if (rule.kind == RuleKind::observed) {
    // KVzip: a softmax weight, or kUnobserved for a row no observe call has scored.
    for (const float x : score) {
      if (!(x == kUnobserved || (x >= 0.0f && x <= 1.0f))) {
        bad_state("a KVzip score (" + std::to_string(x) + ") is neither a softmax weight nor -1");
      }
    }
    return;
  }
  for (const float x : score) {
    if ((x < 0.0f && !signed_scores) || !std::isfinite(x)) {
      bad_state("a score (" + std::to_string(x) + ") is negative or not finite");
    }
  }
}
/// Keys are finite and within +-kMaxKeyMagnitude (the update calls refuse others); a quantized
/// row's scales and offsets are finite halves (keys and values alike).
template <class T>
void check_stored_rows(const HeadStore<T>& head, Index n) {
  const RowFormat& kf = head.key_format();
  if (!kf.quantized() && n > 0 && !all_within(head.key_ptr(0), n * kf.dim, kMaxKeyMagnitude)) {
    bad_state("a key is not finite or beyond +-2^48");
  }
  for (const bool keys : {true, false}) {
    const RowFormat& f = keys ? kf : head.value_format();
    if (!f.token_axis()) continue;  // channel-axis rows are codes alone (check_saved_channel)
    for (Index s = 0; s < n; ++s) {
      const auto* row =
          reinterpret_cast<const std::uint8_t*>(keys ? head.key_ptr(s) : head.value_ptr(s));
      const auto* meta = reinterpret_cast<const Eigen::half*>(row + f.code_bytes());
      if (!all_finite(meta, 2 * f.groups())) {
        bad_state(std::string("a quantized ") + (keys ? "key" : "value") +
                  " row's scale or offset is not finite");
      }
    }
  }
}

/// Adaptive heads (docs/design.md 4.9): a head's own row count, at most the descriptor's (the
/// most any head holds).
template <class T>
void check_saved_head_rows(const SavedCache<T>& s, std::int64_t rows) {
  // After a call a head holds a row at least: its floor is ceil(floor x budget) >= 1, and a head
  // whose budget is not known yet holds every row.
  if (rows < 1 || rows > s.rows) {
    bad_state("a head holds " + std::to_string(rows) + " rows, the most any holds being " +
              std::to_string(s.rows));
  }
}
/// Adaptive heads: one sequence's heads hold `held` rows together, within their pool of
/// H x budget (or H x the sinks, when an adopted budget is below them).
template <class T>
void check_saved_pool(const SavedCache<T>& s, const Rule& rule, std::int64_t held) {
  if (!s.has_budget()) return;
  const std::int64_t sinks = std::min<std::int64_t>(rule.n_sink, s.offset);
  const std::int64_t per_head = std::max<std::int64_t>(s.budget, sinks);
  if (held > per_head * s.heads) {
    bad_state("a sequence's heads hold " + std::to_string(held) + " rows, over their pool of " +
              std::to_string(s.heads) + " x " + std::to_string(per_head));
  }
}

/// One head of `rows` rows as read: its scores (null for a policy that does not score them),
/// positions, sinks, keys and quantized rows' scales. Restores the head's live order from the
/// positions.
template <class T>
void check_saved_head(const SavedCache<T>& s, const Rule& rule, HeadStore<T>& head,
                      std::int64_t rows, const std::vector<std::int64_t>& pos,
                      const std::vector<float>* score) {
  if (score) check_saved_scores(*score, rule);
  if (!head.restore(rows, pos.data(), score ? score->data() : nullptr)) {
    bad_state("two rows share a position");
  }
  const auto& order = head.order();
  if (rows > 0) {
    const std::int64_t first = head.position(order.front()), last = head.position(order.back());
    if (first < 0 || last >= s.offset) {
      bad_state("positions " + std::to_string(first) + ".." + std::to_string(last) +
                " are not in [0, offset " + std::to_string(s.offset) + ")");
    }
  }
  // Sinks are never evicted: positions 0..min(n_sink, offset) - 1 are all retained.
  if (rule.kind != RuleKind::keep_all) {
    const std::int64_t k = std::min<std::int64_t>(rule.n_sink, s.offset);
    if (k > 0 && (rows < k || head.position(order[static_cast<std::size_t>(k - 1)]) != k - 1)) {
      bad_state("a sink (one of the first " + std::to_string(k) + " positions) is missing");
    }
  }
  check_stored_rows(head, rows);
}

/// A head's channel blocks (docs/design.md 7.5, G) against its rows' positions `pos` (as saved,
/// slot i at pos[i], n rows): the pending block starts at or after 0 and holds only positions
/// within a block of it; sealed blocks start in ascending order below it, each holds a row, and
/// every row below the pending block lies in one; tables hold finite halves, scales not
/// negative; pending rows (at T) are finite and within +-65504, as quantizable rows are.
template <class T>
void check_saved_channel(const ChannelState<T>& c, const RowFormat& kf, const RowFormat& vf,
                         const std::vector<std::int64_t>& pos, Index n) {
  const Index block = kf.channel_axis() ? kf.block : vf.block;
  const std::int64_t pend = c.pending_start;
  if (pend < 0) bad_state("the pending block starts at a negative position");
  const std::size_t nb = c.starts.size();
  for (std::size_t b = 0; b < nb; ++b) {
    if (c.starts[b] < 0 || c.starts[b] >= pend || (b > 0 && c.starts[b] <= c.starts[b - 1])) {
      bad_state("channel block starts are not ascending below the pending block's");
    }
  }
  std::vector<std::uint8_t> used(nb, 0);
  for (Index i = 0; i < n; ++i) {
    const std::int64_t p = pos[static_cast<std::size_t>(i)];
    if (p >= pend) {
      if (p - pend >= block) bad_state("a row lies beyond the pending block");
      continue;
    }
    if (nb == 0 || p < c.starts.front()) bad_state("a quantized row lies in no channel block");
    used[static_cast<std::size_t>(block_at(c.starts.data(), static_cast<Index>(nb), p))] = 1;
  }
  if (std::find(used.begin(), used.end(), 0) != used.end()) {
    bad_state("a channel block holds no row");
  }
  for (const auto* tab : {&c.ktab, &c.vtab}) {
    const Index d = tab == &c.ktab ? kf.dim : vf.dim;
    for (std::size_t b = 0; b < tab->size() / static_cast<std::size_t>(2 * std::max<Index>(d, 1)); ++b) {
      const std::uint16_t* t = tab->data() + b * static_cast<std::size_t>(2 * d);
      for (Index k = 0; k < 2 * d; ++k) {
        const float x = half_bits_to_float(t[k]);
        if (!std::isfinite(x) || (k < d && (t[k] & 0x8000u) != 0 && x != 0.0f)) {
          bad_state("a channel block's scale or offset is not a finite half (or a scale is "
                    "negative)");
        }
      }
    }
  }
  for (const auto* rows : {&c.kpend, &c.vpend}) {
    for (const T& x : *rows) {
      const float f = static_cast<float>(x);
      if (!(std::abs(f) <= kHalfMax)) bad_state("a pending row is not finite or beyond +-65504");
    }
  }
}

/// The descriptor of a cache whose policy is `rule` and rows kf / vf (their dims unused):
/// check_saved_dims, the budget (with `budget_from_config`: the one `rule` has from the config),
/// check_saved_rows.
template <class T>
void check_saved_descriptor(const SavedCache<T>& s, const Rule& rule, const RowFormat& kf,
                            const RowFormat& vf, bool budget_from_config) {
  if (!s.dims_known()) {
    if (s.batch || s.heads || s.key_dim || s.value_dim || s.offset || s.tokens_seen || s.rows) {
      bad_state("a cache that has seen no call holds dims, rows, tokens or an offset");
    }
  } else {
    check_saved_dims(s, rule, kf, vf);
  }
  if (budget_from_config && (s.has_budget() != rule.budget.has_value() ||
                             (s.has_budget() && s.budget != rule.budget.value_or(0)))) {
    bad_state("its budget is not the one its configuration gives");
  }
  check_saved_rows(s, rule);
}

}  // namespace veloxquant::cache::detail
