// veloxquant — the one pipeline every update call of every cache goes through (docs/design.md
// 2.2, 7.1, C): validation, the strong guarantee, storage, the loop over heads and the copies out.
// A policy is data (the layer's Rule) plus, for SqueezeAttention alone, the hooks of CallHooks.
// The steps, as run_call takes them:
//   1. validation (validate_call): nothing has changed if it throws;
//   2. the policy inspects the call (CallHooks::inspect_call, may throw);
//   3. storage and scratch are reserved (may throw bad_alloc; the logical state is unchanged);
//   4. the policy starts the call (CallHooks::start_call, may throw before it changes anything);
//   5. no-throw from here on: every head takes the call's rows and the policy absorbs them
//      (absorb_heads), unless the engine's parallel-for misbehaves (then the cache is reset);
//   6. the counters move and the window is copied out (fetch) or shown (view).
// The call gate (one call at a time) is the cache's, entered before step 1.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "checks.hpp"
#include "input.hpp"
#include "layer.hpp"
#include "layer_storage.hpp"
#include "policy.hpp"
#include "pool_core.hpp"
#include "task_ledger.hpp"

namespace veloxquant::cache::detail {

/// What a cache class does at the pipeline's hooks.
class CallHooks {
 public:
  /// Step 2: before anything changes; may inspect the call's keys ([B, H, S, Dk]) and throw.
  virtual void inspect_call(const InputRows& keys) = 0;
  /// Step 4: after storage and scratch are reserved, before any row is touched. May throw only
  /// before it changes anything; may change the budget in force.
  virtual void start_call() = 0;
  /// Step 5 failed half-way (the engine's parallel-for): the cache resets itself, its own state
  /// with its layer's.
  virtual void abandon_call() = 0;

 protected:
  CallHooks() = default;
  CallHooks(const CallHooks&) = default;
  CallHooks& operator=(const CallHooks&) = default;
  ~CallHooks() = default;
};

/// Where update_and_fetch's rows go: the pipeline sizes it ([B, H, n, Dk] and [B, H, n, Dv]) and
/// writes the two buffers size() returns.
template <class T>
class DenseOut {
 public:
  virtual std::pair<T*, T*> size(Index batch, Index heads, Index rows, Index dk, Index dv) = 0;

 protected:
  DenseOut() = default;
  DenseOut(const DenseOut&) = default;
  DenseOut& operator=(const DenseOut&) = default;
  ~DenseOut() = default;
};

/// One update call: keys [B, H, S, Dk], values [B, H, S, Dv], queries [B, G·H, S, Dk] or null;
/// `api` names the caller in errors; `att`: attend's output.
struct Call {
  const InputRows& keys;
  const InputRows& values;
  const InputRows* queries = nullptr;
  const char* api = "";
  const AttendOut* att = nullptr;
};

/// What the call's view shows: `rows` slots per head of which the last `new_rows` are the call's;
/// `copy`: a quantized cache's view, of the dequantized copy.
struct CallView {
  Index rows = 0, new_rows = 0;
  bool copy = false;
};

/// attend's output at `out`: [B, Hq, S, Dv] (`head_major`) or [B, S, Hq, Dv], dense; its dims
/// checked by check_attend_output first.
inline AttendOut attend_out(float* out, const InputRows& queries, const InputRows& values,
                            bool head_major) {
  check_attend_output(queries, values);
  const Index Hq = queries.heads, S = queries.seq, Dv = values.dim;
  return head_major ? AttendOut{out, Hq * S * Dv, S * Dv, Dv}
                    : AttendOut{out, S * Hq * Dv, Dv, Hq * Dv};
}

/// A fetch's tensors (KVPair<T>: two Eigen tensors [B, H, n, D]) as the pipeline's output.
template <class Pair>
class PairOut final : public DenseOut<typename Pair::first_type::Scalar> {
 public:
  using T = typename Pair::first_type::Scalar;
  explicit PairOut(Pair& p) : p_(p) {}
  std::pair<T*, T*> size(Index b, Index h, Index n, Index dk, Index dv) override {
    // Resized only when the shape changes: a decode loop passing the same pair never allocates.
    const auto fit = [&](auto& t, Index d) {
      if (t.dimension(0) != b || t.dimension(1) != h || t.dimension(2) != n ||
          t.dimension(3) != d) {
        t.resize(b, h, n, d);
      }
    };
    fit(p_.first, dk);
    fit(p_.second, dv);
    return {p_.first.data(), p_.second.data()};
  }

 private:
  Pair& p_;
};

inline std::string ragged_message(const char* api) {
  return std::string(api) +
         ": the heads hold different numbers of rows (adaptive head budgets, SPEC 14, or a KVzip "
         "compress, SPEC 18), which one "
         "dense tensor cannot return; use attend or update_and_view";
}
/// update_and_fetch(_into) and state() return one dense tensor: refused when the heads hold
/// different numbers of rows.
template <class T>
void check_dense(const Layer<T>& L, const char* api) {
  if (L.ragged()) throw std::invalid_argument(ragged_message(api));
}

/// Step 1: throws std::invalid_argument for a call the layer must refuse. The keys' and values'
/// shapes and counts first (nothing is read before the shapes are known to describe data), then
/// offset() + S and tokens_seen() + B·H·S within int64 (a prompt cache may load a layer near
/// 2^62), then the quantized formats' own limits (the more specific message), then the magnitude
/// bounds of every row; the queries after everything about the keys and values (docs/design.md
/// 4.6).
template <class T>
void validate_call(const Layer<T>& L, const InputRows& keys, const InputRows& values,
                   const InputRows* queries, const char* api) {
  check_update_shapes(keys, values, L.state.dims, api);
  check_rows_fit(L.live_rows(), keys.seq, api);
  const std::optional<std::int64_t> bhs =
      checked_product<std::int64_t>({keys.batch, keys.heads, keys.seq});
  (void)value_or_throw(bhs, api, "B * H * S");
  (void)value_or_throw(checked_add<std::int64_t>(L.state.offset, keys.seq), api, "offset() + S");
  (void)value_or_throw(checked_add<std::int64_t>(L.state.tokens_seen, *bhs), api,
                       "tokens_seen() + B * H * S");
  // (An empty call stores nothing: its D is either the first call's or still free.)
  if (L.storage.key_bits < 16 && keys.seq > 0) {
    check_quantizable<T>(keys, L.storage.key_format(keys.dim), "keys", "key_bits", api);
  }
  if (L.storage.value_bits < 16 && keys.seq > 0) {
    check_quantizable<T>(values, L.storage.value_format(values.dim), "values", "value_bits", api);
  }
  check_update_rows<T>(keys, values, api);
  if (queries) check_queries(*queries, keys, api);
}

// ---- copies out -----------------------------------------------------------------------------

/// The rows `each` takes of every head (layer_storage.hpp) into `out`: [B, H, n, D] twice.
template <class T, class Each>
void copy_rows_out(const Layer<T>& L, DenseOut<T>& out, float* buf, const Each& each) {
  const LayerDims& d = L.state.dims;
  const Index n = rows_taken(L.heads, each);
  const std::pair<T*, T*> to = out.size(d.batch, d.heads, n, d.key_dim, d.value_dim);
  copy_rows(L.heads, d.key_dim, d.value_dim, L.storage.quantized(), to.first, to.second, buf, n,
            each);
}
/// The retained rows of every head in ascending position (state(), an empty call's fetch).
template <class T>
void copy_retained(const Layer<T>& L, DenseOut<T>& out) {
  const LayerDims& d = L.state.dims;
  std::vector<float> buf(
      L.storage.quantized() ? static_cast<std::size_t>(row_floats(d.key_dim, d.value_dim)) : 0);
  copy_rows_out(L, out, buf.data(), RetainedRows{});
}
/// Every head's slots [0, physical()) in slot order into the view buffers (sized by
/// CopyBuffers::refit_view): a quantized cache's view.
template <class T>
void copy_slots(Layer<T>& L) {
  const LayerDims& d = L.state.dims;
  copy_rows(L.heads, d.key_dim, d.value_dim, L.storage.quantized(), L.copy.view_keys(),
            L.copy.view_values(), L.copy.row(), L.max_physical(), SlotRows{});
}

// ---- step 3: room for the call ----------------------------------------------------------------

/// Multiply-adds per call below which heads run serially (a fork costs more).
inline constexpr Index kParallelWork = Index{1} << 16;

template <class T>
ScratchSize scratch_size(const Layer<T>& L, const InputRows& keys, const CallPlan& plan) {
  return ScratchSize{plan.rows, L.live_rows() + keys.seq, padded_dim(keys.dim), plan.gather,
                     plan.packed};
}

/// Tasks a call of this size runs on: 1 unless a parallel-for is set and the call is large enough
/// to be worth a fork.
template <class T>
int tasks_for(const Layer<T>& L, Index n_heads, const ScratchSize& size) {
  const Threads& t = L.threads;
  if (!t.run || !t.on || t.workers < 2 || n_heads < 2) return 1;
  // In double: the product of four counts may not fit an Index.
  const double work = static_cast<double>(std::max<Index>(size.rows, 1)) *
                      static_cast<double>(size.columns) * static_cast<double>(size.dim) *
                      static_cast<double>(n_heads);
  if (work < static_cast<double>(kParallelWork)) return 1;
  return static_cast<int>(std::min<Index>(t.workers, n_heads));
}

/// Reserves room for the call: fresh heads for a layer's first call (returned, swapped in by
/// run_call), otherwise compaction (logically invisible) and growth of every head; then the
/// scratch (`size`) of each of the call's `tasks` workers. The logical state is unchanged even if
/// an allocation throws.
template <class T>
std::vector<HeadStore<T>> reserve(Layer<T>& L, const InputRows& keys, const InputRows& values,
                                  const ScratchSize& size, int tasks) {
  const Rule& rule = L.state.rule;
  const bool key_sum = rule.proxy == ProxyScoring::keydiff;
  std::vector<HeadStore<T>> fresh;
  if (L.heads.empty()) {
    fresh = fresh_heads<T>(keys.batch * keys.heads, L.storage.key_format(keys.dim),
                           L.storage.value_format(values.dim), keys.seq, rule.value_power, key_sum);
  } else {
    grow_heads(L.heads, keys.seq, rule.steady_rows(), key_sum, rule.adaptive);
  }
  const auto workers = static_cast<std::size_t>(tasks);
  if (L.scratch.size() < workers) L.scratch.resize(workers);
  for (std::size_t i = 0; i < L.scratch.size(); ++i) {
    // Adaptive heads: the pooled eviction runs on the first worker's scratch, after the heads
    // (sized here once: fitting it twice released and reallocated the pool every call).
    ScratchSize z = size;
    if (rule.adaptive && i == 0) z.pooled = keys.heads * z.columns;
    L.scratch[i].fit(z);
  }
  return fresh;
}

/// What a call hands the engine's parallel-for: the task function and the ledger that checks the
/// pool's use of it (task_ledger.hpp); empty when the heads run serially. Built before the cache
/// changes (both may allocate).
struct PoolCall {
  int tasks = 1;
  std::shared_ptr<TaskLedger> ledger;
  std::function<void(int)> task;
};
inline PoolCall pool_call(int tasks) {
  PoolCall p;
  p.tasks = tasks;
  if (p.tasks <= 1) return p;
  p.ledger = std::make_shared<TaskLedger>(p.tasks);
  p.task = [ledger = p.ledger](int t) { ledger->run(t); };
  return p;
}

// ---- step 5: the heads take the call ----------------------------------------------------------

/// Adaptive heads: every sequence's heads brought within their pool of H x budget rows
/// (docs/design.md 4.9), at a call's start (a pending re-budget) and after its heads took it;
/// ranked as a head's own re-budget ranks: KeyDiff's ranking in a call without queries,
/// score x |v|^p under value_norm_power in a call with them, else the scores.
template <class T>
void pool_rebudget(Layer<T>& L, bool with_queries) {
  const Rule& rule = L.state.rule;
  pool_rebudget(L, rule, rule.floor_rows(), with_queries, L.scratch.front());
}
/// pool_rebudget by `rule` (its budget, sinks and protected rows) with heads kept at
/// `floor_rows` at least, on scratch `sc`.
template <class T>
void pool_rebudget(Layer<T>& L, const Rule& rule, Index floor_rows, bool with_queries,
                   Scratch& sc) {
  const bool keydiff = rule.proxy == ProxyScoring::keydiff && !with_queries;
  const bool weighted = rule.value_power > 0.0 && with_queries;
  const Index H = L.state.dims.heads;
  for (Index b = 0; b < L.state.dims.batch; ++b) {
    HeadStore<T>* seq = L.heads.data() + b * H;
    const auto rank = [&](Index h, Index lo, Index hi, Scratch& s) -> const float* {
      HeadStore<T>& head = seq[h];
      if (keydiff) return keydiff_rank_head(head, lo, hi, s);
      if (weighted) return value_rank_head(head, s);
      return nullptr;
    };
    // KeyDiff's running sum follows each row out (absorb_proxy's way), so that the next ranking
    // does not rebuild it from every row.
    const auto mark_dead = [&](Index h, Slot slot) {
      HeadStore<T>& head = seq[h];
      const bool sum_valid = keydiff && keydiff_take_out(head, slot, sc);
      head.mark_dead(slot);
      if (sum_valid) head.keydiff_sum().valid = true;
    };
    pooled_rebudget(seq, H, *rule.budget, floor_rows, rule.n_sink, rule.protected_recent(), sc,
                    rank, mark_dead);
  }
}

/// A uniform head's pending re-budget (docs/design.md 4.5): KeyDiff ranks the rows it holds now
/// in a call without queries; with queries the scores are attention mass (4.7), weighted by
/// |v|^p under value_norm_power (4.8).
template <class T>
void rebudget_head(const Rule& rule, HeadStore<T>& head, bool with_queries, Scratch& sc) {
  const float* rank = nullptr;
  if (rule.proxy == ProxyScoring::keydiff && !with_queries && head.live() > *rule.budget) {
    rank = keydiff_rank_head(head, 0, head.live(), sc);
  } else if (rule.value_power > 0.0 && with_queries && head.live() > *rule.budget) {
    rank = value_rank_head(head, sc);
  }
  rebudget(head, *rule.budget, rule.n_sink, rule.protected_recent(), sc, rank);
}

/// A memory pool's trim (SPEC 19, docs/design.md 10.5), outside any call: every head of `L`
/// brought within max(rows, floor) rows exactly as a re-budget to that many rows brings it
/// (4.5; adaptive heads: their sequence's pooled re-budget, 4.9, each head keeping `floor` at
/// least), with the protected rows of that budget. KVzip ranks its rows not yet observed above
/// every observed one (they are the newest; among them the earliest goes first) and protects no
/// recent rows of its own. `sc`: the pool's scratch, sized for the heads' slots and dims.
template <class T>
void pool_trimmed(Layer<T>& L) noexcept;

/// KVzip's ranking of a head's slots under a pool, in `sc.logits`: a row not yet observed
/// (score < 0) ranks above every observed one, which ranks by its score.
template <class T>
const float* observed_pool_rank(const HeadStore<T>& head, Scratch& sc) noexcept {
  float* rank = sc.logits.data();
  const float* score = head.scores_data_const();
  for (Index s = 0; s < head.physical(); ++s) {
    rank[s] = score[s] < 0.0f ? std::numeric_limits<float>::max() : score[s];
  }
  return rank;
}

template <class T>
void pool_trim_layer(Layer<T>& L, Index rows, Index floor, Scratch& sc) noexcept {
  if (L.heads.empty()) return;
  const Index limit = std::max(rows, floor);
  Rule r = L.state.rule;
  r.budget = static_cast<int>(std::min<Index>(limit, std::numeric_limits<int>::max()));
  // KeyDiff's ranking needs its running sum, which a loaded head has not allocated until its
  // first call: until then such heads rank by their scores (1/|k|, the ranking's weights).
  bool keydiff = r.proxy == ProxyScoring::keydiff;
  for (const auto& head : L.heads) {
    keydiff = keydiff && head.keydiff_sum_ready();
  }
  const bool with_queries = !keydiff;
  // Only the H2O core protects its newest rows (4.2); SnapKV keeps its own default share.
  if (r.kind == RuleKind::window || r.kind == RuleKind::last_attention ||
      r.kind == RuleKind::observed) {
    r.recent_by_ratio = false;
    r.grace = 0;
  }
  if (r.adaptive) {
    pool_rebudget(L, r, std::min(limit, std::max(r.floor_rows(), floor)), with_queries, sc);
  } else {
    for (auto& head : L.heads) {
      if (head.live() <= limit) continue;
      if (r.kind != RuleKind::observed) {
        rebudget_head(r, head, with_queries, sc);
        continue;
      }
      rebudget(head, *r.budget, r.n_sink, 0, sc, observed_pool_rank(head, sc));
    }
  }
  pool_trimmed(L);
}

// The scores rule of a memory pool (docs/design.md 10.5). A head's candidates: its rows that are
// not sinks nor (H2O core) protected newest rows, at most (live - floor) of them; a row's rank is
// its score over the mean score of its head's candidates (StreamingLLM: all 1, so the earliest
// go; KVzip: rows not yet observed last). Heads that must hold equal rows (every policy but
// adaptive heads and KVzip) give rows up together: the layer's k-th candidate is "each head's
// k-th lowest", ranked by the mean of those ranks.

/// g: the protected newest rows of a head of `live` rows under the scores rule.
inline Index pool_protected(const Rule& r, Index live) {
  if (r.kind != RuleKind::cumulative) return 0;
  Rule at = r;
  at.budget = static_cast<int>(std::min<Index>(live, std::numeric_limits<int>::max()));
  return at.protected_recent();
}

/// A head's candidates under the scores rule: the rows at [sinks, hi) of its order, of which at
/// most `quota` may go (0 when the head holds its floor or less).
struct PoolQuota {
  Index sinks = 0, hi = 0, quota = 0;
};
template <class T>
PoolQuota pool_quota(const HeadStore<T>& head, const Rule& r, Index floor) noexcept {
  const Index live = head.live();
  if (live <= floor) return {};
  PoolQuota q;
  q.sinks = head.leading_sinks(r.n_sink);
  q.hi = std::max(q.sinks, live - pool_protected(r, live));
  q.quota = std::max<Index>(0, std::min(q.hi - q.sinks, live - floor));
  return q;
}

/// Appends `head`'s candidates (see above) to `out`, sorted by rank when `sorted`, else its
/// lowest-ranked `quota` in any order. Returns how many.
template <class T>
Index pool_head_candidates(const HeadStore<T>& head, const Rule& r, Index floor,
                           std::uint32_t seat, std::int32_t index, bool sorted,
                           std::vector<PoolRow>& out) noexcept {
  const PoolQuota q = pool_quota(head, r, floor);
  const Index sinks = q.sinks, hi = q.hi, quota = q.quota;
  if (quota <= 0) return 0;
  const Slot* ord = head.order().data();
  double sum = 0.0;
  for (Index k = sinks; k < hi; ++k) sum += std::max(0.0f, head.score(ord[k]));
  const double mean = sum / static_cast<double>(hi - sinks);
  const std::size_t start = out.size();
  for (Index k = sinks; k < hi; ++k) {
    const Slot s = ord[k];
    const float sc = head.score(s);
    float rank = 1.0f;
    if (r.kind == RuleKind::observed && sc < 0.0f) {
      rank = std::numeric_limits<float>::max();
    } else if (r.kind != RuleKind::window && mean > 0.0) {
      rank = static_cast<float>(static_cast<double>(sc) / mean);
    }
    out.push_back(PoolRow{rank, seat, index, s, head.position(s)});
  }
  const auto first = out.begin() + static_cast<std::ptrdiff_t>(start);
  const auto by_rank = [](const PoolRow& a, const PoolRow& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos;
  };
  if (quota < hi - sinks) std::nth_element(first, first + quota, out.end(), by_rank);
  out.resize(start + static_cast<std::size_t>(quota));
  if (sorted) std::sort(first, out.end(), by_rank);
  return quota;
}

/// Appends the candidates of layer `L` (seat `seat`) to `out`, which has room for all its rows.
template <class T>
void pool_candidates_layer(const Layer<T>& L, Index floor, std::uint32_t seat,
                           std::vector<PoolRow>& out) noexcept {
  const Rule& r = L.state.rule;
  if (r.per_head_rows()) {
    for (std::size_t i = 0; i < L.heads.size(); ++i) {
      (void)pool_head_candidates(L.heads[i], r, floor, seat, static_cast<std::int32_t>(i), false,
                                 out);
    }
    return;
  }
  // Equal heads: each head's sorted candidates one after the other, then the layer's rows.
  const std::size_t start = out.size();
  Index quota = std::numeric_limits<Index>::max();
  const std::size_t heads = L.heads.size();
  for (std::size_t i = 0; i < heads; ++i) {
    quota = std::min(quota, pool_head_candidates(L.heads[i], r, floor, seat,
                                                 static_cast<std::int32_t>(i), true, out));
  }
  if (heads == 0 || quota <= 0 || quota == std::numeric_limits<Index>::max()) {
    out.resize(start);
    return;
  }
  // Head i's sorted list follows head i - 1's, as long as that head's quota. The layer's row k
  // is head 0's entry k, its rank summed over the heads' k-th ranks, then averaged.
  const auto layer_quota = static_cast<std::size_t>(quota);
  std::size_t base = start + static_cast<std::size_t>(pool_quota(L.heads[0], r, floor).quota);
  for (std::size_t i = 1; i < heads; ++i) {
    for (std::size_t k = 0; k < layer_quota; ++k) out[start + k].rank += out[base + k].rank;
    base += static_cast<std::size_t>(pool_quota(L.heads[i], r, floor).quota);
  }
  for (std::size_t k = 0; k < layer_quota; ++k) {
    PoolRow& row = out[start + k];
    row = PoolRow{row.rank / static_cast<float>(heads), seat, -1, static_cast<std::int32_t>(k),
                  row.pos};
  }
  out.resize(start + layer_quota);
}

/// After a memory pool took rows of `L` outside a call: channel blocks left without a live row
/// go (their tables count in kept_bytes()), and a SnapKV or KVzip layer is marked compressed: its
/// rows were cut, as its own compress cuts them (the prompt-cache format's checks, G).
template <class T>
void pool_trimmed(Layer<T>& L) noexcept {
  Index rows = 0;
  for (auto& h : L.heads) {
    h.prune_blocks();
    rows += h.live();
  }
  const RuleKind k = L.state.rule.kind;
  const Index all = L.state.offset * static_cast<Index>(L.heads.size());
  if ((k == RuleKind::prompt || k == RuleKind::observed) && rows < all) {
    L.state.rule.compressed = true;
  }
}

/// The scores rule's eviction of `n` rows of `L` (ascending by head, then slot; head -1: one row
/// of every head, each its lowest-ranked candidate), on the pool's scratch `sc`.
template <class T>
void pool_drop_layer(Layer<T>& L, const PoolRow* rows, std::size_t n, Scratch& sc) noexcept {
  const Rule& r = L.state.rule;
  if (n > 0 && rows[0].head < 0) {
    for (auto& head : L.heads) {
      const Index live = head.live();
      const float* rank = r.kind == RuleKind::observed ? observed_pool_rank(head, sc) : nullptr;
      rebudget(head, static_cast<int>(live - static_cast<Index>(n)), r.n_sink,
               static_cast<int>(pool_protected(r, live)), sc, rank);
    }
    pool_trimmed(L);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    L.heads[static_cast<std::size_t>(rows[i].head)].mark_dead(rows[i].slot);
    if (i + 1 == n || rows[i + 1].head != rows[i].head) {
      L.heads[static_cast<std::size_t>(rows[i].head)].drop_dead();
    }
  }
  pool_trimmed(L);
}

/// Runs `one(i, scratch)` for every head i, on the engine's parallel-for when the call has tasks:
/// task t takes heads [start(t), start(t + 1)), n / tasks each, the first n % tasks one more.
/// Returns false when the pool failed or misused the task (then `thrown` may hold its exception).
template <class T, class One>
bool for_each_head(Layer<T>& L, Index n_heads, PoolCall& pool, const One& one,
                   std::exception_ptr& thrown) {
  const int tasks = pool.tasks;
  if (tasks <= 1) {
    for (Index i = 0; i < n_heads; ++i) one(i, L.scratch.front());
    return true;
  }
  const auto start = [&](int t) {
    return n_heads / tasks * t + std::min<Index>(t, n_heads % tasks);
  };
  auto range = [&](int task) {
    const Index lo = start(task), hi = start(task + 1);
    for (Index i = lo; i < hi; ++i) one(i, L.scratch[static_cast<std::size_t>(task)]);
  };
  pool.ledger->bind(range);
  try {
    L.threads.run(tasks, pool.task);
  } catch (...) {
    thrown = std::current_exception();
  }
  pool.ledger->close();
  return !thrown && !pool.ledger->misused();
}

/// After for_each_head failed and the cache was reset: rethrows what the engine's parallel-for
/// threw, else throws std::logic_error naming how it ran `api`'s tasks wrongly.
[[noreturn]] inline void rethrow_pool_failure(const char* api, const PoolCall& pool,
                                              const std::exception_ptr& thrown) {
  if (thrown) std::rethrow_exception(thrown);
  throw std::logic_error(std::string(api) + ": the parallel-for given to set_parallel_for ran " +
                         std::to_string(pool.tasks) + " tasks wrongly (" + pool.ledger->misuse() +
                         "); the cache was reset");
}

/// Step 5: per head, the window starts (with its order when `copy`: fetch), a pending re-budget
/// applies, the call's rows are stored and the policy absorbs them. Heads are independent: with a
/// parallel-for, each task takes a contiguous range of heads and its own scratch.
template <class T>
void absorb_heads(Layer<T>& L, const Call& c, Index groups, const CallPlan& plan, bool copy,
                  PoolCall& pool, CallHooks& hooks) {
  const LayerState& st = L.state;
  const Index S = c.keys.seq;
  const Index n_heads = st.dims.batch * st.dims.heads;
  const bool with_queries = c.queries != nullptr;
  // Adaptive heads (docs/design.md 4.9): the windows start and a pending re-budget applies to
  // each sequence's pool before the heads take the call, which evicts nothing; the pool gives up
  // its excess after all of them have.
  const bool pooled = st.rule.adaptive;
  Rule head_rule = st.rule;
  if (pooled) {
    head_rule.budget.reset();
    for (auto& head : L.heads) head.begin_window(copy);
    if (st.rebudget && st.rule.budget) pool_rebudget(L, with_queries);
  }
  const auto one = [&](Index i, Scratch& sc) {
    auto& head = L.heads[static_cast<std::size_t>(i)];
    const Index b = i / st.dims.heads, h = i % st.dims.heads;
    if (!pooled) head.begin_window(copy);
    if (!pooled && st.rebudget && st.rule.budget) rebudget_head(st.rule, head, with_queries, sc);
    for (Index s = 0; s < S; ++s) {
      with_row(c.keys, b, h, s, [&](const auto* k) {
        using U = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
        (void)head.append(k, c.values.template row<U>(b, h, s), st.offset + s);
      });
    }
    absorb_head(head, head_rule, plan, S, HeadQueries{c.queries, b, h, groups},
                HeadAttend{c.att, b, h, groups}, sc);
  };
  std::exception_ptr thrown;
  if (for_each_head(L, n_heads, pool, one, thrown)) {
    if (pooled && st.rule.budget) pool_rebudget(L, with_queries);
    return;
  }
  // Some heads took the call and others did not: no state the cache can go on from. Reset
  // before the message is built (building it may throw bad_alloc).
  hooks.abandon_call();
  rethrow_pool_failure(c.api, pool, thrown);
}

// ---- the pipeline -----------------------------------------------------------------------------

/// An empty call (S = 0): it changes no rows; the heads compact, the fetch gets the retained
/// rows and a view shows them.
template <class T>
CallView run_empty_call(Layer<T>& L, const Call& c, DenseOut<T>* out,
                        typename CopyBuffers<T>::Refit& buffers, bool view_copy) {
  // With a checkpoint: room to save the rows the compaction below may overwrite.
  for (auto& h : L.heads) h.reserve_journal(0);
  if (view_copy) L.copy.commit(buffers);  // nothing else can throw now
  const bool known = L.state.dims.known;
  if (out && !known) (void)out->size(c.keys.batch, c.keys.heads, 0, c.keys.dim, c.values.dim);
  for (auto& h : L.heads) h.compact();
  if (out && known) copy_retained(L, *out);
  if (view_copy && known) copy_slots(L);
  return CallView{L.live_rows(), 0, view_copy};
}

/// The one body of every update API (steps 1-6 above); `out` (fetch and fetch_into) receives a
/// copy of the window.
template <class T>
CallView run_call(Layer<T>& L, const Call& c, DenseOut<T>* out, CallHooks& hooks) {
  const InputRows& keys = c.keys;
  const InputRows& values = c.values;
  validate_call(L, keys, values, c.queries, c.api);
  if (out) check_dense(L, c.api);
  const Index S = keys.seq;
  // A view of a quantized cache shows a dequantized copy of the window (docs/design.md 2.3).
  const bool view_copy = !out && !c.att && L.storage.quantized();
  // The view's buffers and the row buffer, allocated now and swapped in at step 5.
  typename CopyBuffers<T>::Refit buffers;
  if (view_copy) {
    L.copy.refit_view(buffers, keys.batch, keys.heads, L.live_rows() + S, keys.dim, values.dim,
                      S > 0);
  }
  if (S == 0) return run_empty_call(L, c, out, buffers, view_copy);
  // The buffer quantized rows leave the cache through (fetch and view copies).
  if (L.storage.quantized()) {
    L.copy.refit_row(buffers, static_cast<std::size_t>(row_floats(keys.dim, values.dim)));
  }
  hooks.inspect_call(keys);
  const Index groups = c.queries ? c.queries->heads / keys.heads : 0;
  const CallPlan plan = plan_call(L.state.rule, S, groups, c.att != nullptr, L.live_rows());
  const ScratchSize size = scratch_size(L, keys, plan);
  const int tasks = tasks_for(L, keys.batch * keys.heads, size);
  std::vector<HeadStore<T>> fresh = reserve(L, keys, values, size, tasks);
  PoolCall pool = pool_call(tasks);
  // The output (the retained rows plus the call's) is sized last before the policy starts the
  // call: a call refused before here leaves `out` as it was, and a bad_alloc here leaves the
  // cache unchanged (a policy that refuses in start_call leaves `out` resized).
  if (out) (void)out->size(keys.batch, keys.heads, L.live_rows() + S, keys.dim, values.dim);
  hooks.start_call();
  // Step 5: no-throw from here on, unless the engine's parallel-for misbehaves (absorb_heads).
  L.copy.commit(buffers);
  LayerState& st = L.state;
  if (L.heads.empty()) {
    L.heads.swap(fresh);
    st.dims = LayerDims{keys.batch, keys.heads, keys.dim, values.dim, true};
  }
  if (plan.compress) st.rule.compressed = true;
  absorb_heads(L, c, groups, plan, out != nullptr, pool, hooks);
  // Step 6.
  st.rebudget = false;
  st.offset += S;
  st.tokens_seen += st.dims.batch * st.dims.heads * S;
  if (out) copy_rows_out(L, *out, L.copy.row(), WindowRows{});
  if (view_copy) copy_slots(L);
  return CallView{L.heads.front().physical(), S, view_copy};
}

}  // namespace veloxquant::cache::detail
