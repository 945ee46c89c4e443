// veloxquant — KVCache<T>: the standard append-only cache (mirrors mlx_lm's KVCache), the base of
// every eviction cache, and the one pipeline every call goes through (docs/design.md 2.2, 7.1):
// validation, the strong guarantee, storage and the loop over heads live here; a policy is data
// (detail::Rule) plus, for SqueezeAttention alone, two hooks. Each cache writes and restores its
// own state (write_state / read_state, docs/design.md G). KVView<T>, the zero-copy window of one
// call, is in kv_view.hpp; the heads' growth and the copies of rows out of them in
// detail/layer_storage.hpp.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "detail/call_gate.hpp"
#include "detail/checks.hpp"
#include "detail/head_store.hpp"
#include "detail/input.hpp"
#include "detail/layer_storage.hpp"
#include "detail/policy.hpp"
#include "detail/scratch.hpp"
#include "detail/state_checks.hpp"
#include "detail/state_io.hpp"
#include "detail/task_ledger.hpp"
#include "kv_cache_config.hpp"
#include "kv_view.hpp"
#include "parallel.hpp"
#include "tensor.hpp"

namespace veloxquant::cache {

class KVCacheBuilder;  // kv_cache_builder.hpp: fork, checkpoint and rollback of a model's set

namespace detail {
/// The scorer KVCacheConfig::proxy_scoring names (validated before: an unknown name is an error
/// there), by its place in kProxyScorings.
inline ProxyScoring proxy_scoring_of(const std::string& name) {
  return static_cast<ProxyScoring>(std::max(proxy_scoring_index(name), 0));
}
/// The H2O core's scoring and sharing of rows from `config` (validated before): the query-free
/// scorer, the value-weighted ranking, adaptive heads and their floor.
inline void h2o_core_ranking(const KVCacheConfig& config, Rule& r) {
  r.proxy = proxy_scoring_of(config.proxy_scoring);
  r.value_power = config.value_norm_power;
  r.adaptive = config.head_budgets == "adaptive";
  r.head_floor = config.head_budget_floor;
}
}  // namespace detail

/// The standard append-only KV cache (method "standard") and the common base of every eviction
/// cache. One instance serves one layer; it holds B·H heads of rows.
template <class T = Eigen::half>
class KVCache {
  static_assert(is_storage_type_v<T>,
                "veloxquant: the storage type T must be Eigen::half, Eigen::bfloat16 or float");

 public:
  using Scalar = T;
  using Index = Eigen::Index;

  /// An empty standard cache.
  KVCache() : config_(detail::with_method(KVCacheConfig{}, detail::Method::standard)) {}
  /// An empty standard cache; validates `config`.
  explicit KVCache(const KVCacheConfig& config)
      : config_(detail::with_method(config, detail::Method::standard)), storage_(checked_storage(config)) {}
  virtual ~KVCache() = default;
  // A cache is polymorphic and owns per-call state: it is neither copied nor moved (hold it by
  // std::unique_ptr, as the factory and the builder do).
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // Every update API takes keys and values as Tensor4<U>, an Eigen::TensorMap of one, or a
  // TensorRef<U> (any layout), one U for both (half, bfloat16, float, double), and queries of any
  // such type and element type. Inputs are read in place; each row is converted to T as it is
  // stored (docs/design.md 2.3).

  /// Absorbs a call's rows and returns the rows retained before it plus all of its own rows, in
  /// ascending position. keys: [B, H, S, Dk], values: [B, H, S, Dv]; returns [B, H, n, D].
  virtual KVPair<T> update_and_fetch(const Tensor4<T>& keys, const Tensor4<T>& values) {
    KVPair<T> out;
    (void)run_tensors("update_and_fetch", keys, values, &out);
    return out;
  }
  /// update_and_fetch for every other input (see above). keys: [B, H, S, Dk], values: [B, H, S, Dv]
  template <class K, class V, class = detail::same_input_t<K, V>>
  KVPair<T> update_and_fetch(const K& keys, const V& values) {
    KVPair<T> out;
    (void)run_tensors("update_and_fetch", keys, values, &out);
    return out;
  }

  /// update_and_fetch into caller-owned tensors: `out` is resized only when its shape changes, so
  /// a decode loop that passes the same `out` every step copies without allocating.
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv]; out: [B, H, n, Dk] and [B, H, n, Dv]
  void update_and_fetch_into(const Tensor4<T>& keys, const Tensor4<T>& values, KVPair<T>& out) {
    (void)run_tensors("update_and_fetch_into", keys, values, &out);
  }
  template <class K, class V, class = detail::same_input_t<K, V>>
  void update_and_fetch_into(const K& keys, const V& values, KVPair<T>& out) {
    (void)run_tensors("update_and_fetch_into", keys, values, &out);
  }

  /// Same work as update_and_fetch, but returns a view into the cache's own storage.
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv]
  KVView<T> update_and_view(const Tensor4<T>& keys, const Tensor4<T>& values) {
    return run_tensors("update_and_view", keys, values, nullptr);
  }
  template <class K, class V, class = detail::same_input_t<K, V>>
  KVView<T> update_and_view(const K& keys, const V& values) {
    return run_tensors("update_and_view", keys, values, nullptr);
  }

  /// Real-query scoring ("observed attention", docs/design.md 4.6): the same call, with the queries
  /// the engine attends with for these tokens (RoPE applied). Query head j belongs to KV head
  /// j / G. The scored policies rank rows by this real attention instead of the key-as-query proxy
  /// (H2O core: mass of each token's G query heads over the rows it attends to, eviction once per
  /// call; TOVA: the current token's attention; SnapKV: the last obs_window tokens'); StreamingLLM
  /// and the standard cache validate and ignore them. Throws std::invalid_argument (cache
  /// unchanged) for a query tensor that is not [B, G·H, S, Dk] or holds a value that is not
  /// finite in float32. keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk]
  template <class K, class V, class Q, class = detail::same_input_t<K, V>,
            class = detail::input_element_t<Q>>
  KVPair<T> update_and_fetch(const K& keys, const V& values, const Q& queries) {
    KVPair<T> out;
    (void)run_tensors("update_and_fetch", keys, values, queries, &out);
    return out;
  }
  /// update_and_view with real queries (see update_and_fetch above).
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk]
  template <class K, class V, class Q, class = detail::same_input_t<K, V>,
            class = detail::input_element_t<Q>>
  KVView<T> update_and_view(const K& keys, const V& values, const Q& queries) {
    return run_tensors("update_and_view", keys, values, queries, nullptr);
  }
  /// update_and_fetch_into with real queries (see update_and_fetch above).
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk];
  /// out: [B, H, n, Dk] and [B, H, n, Dv]
  template <class K, class V, class Q, class = detail::same_input_t<K, V>,
            class = detail::input_element_t<Q>>
  void update_and_fetch_into(const K& keys, const V& values, const Q& queries, KVPair<T>& out) {
    (void)run_tensors("update_and_fetch_into", keys, values, queries, &out);
  }

  /// Fused attention (docs/design.md 2.8): absorbs the call exactly as update_and_view(keys,
  /// values, queries) does (the same rows, positions, offset and scores, bit for bit) and writes
  /// the attention output over the rows that call returns: token s, query head j attends with
  /// softmax(q K^T / sqrt(Dk)) over the rows retained before the call and the call's rows 0..s
  /// (the lower-right causal mask). The scored policies take their scores from the same softmax
  /// rows the output uses. Errors as update_and_view with queries, and out == nullptr; on any
  /// of those nothing is written and the cache is unchanged. If the engine's parallel-for fails
  /// (docs/robustness.md, "The engine's thread pool"), part of `out` may be written and the cache
  /// is reset.
  /// queries: [B, Hq = G·H, S, Dk], keys: [B, H, S, Dk], values: [B, H, S, Dv];
  /// out: [B, Hq, S, Dv] float32 (head_major) or [B, S, Hq, Dv] (token_major), dense
  template <class Q, class U>
  void attend(TensorRef<Q> queries, TensorRef<U> keys, TensorRef<U> values, float* out,
              Layout out_layout = Layout::head_major) {
    attend_call(queries, keys, values, out, out_layout);
  }
  /// attend for Tensor4s and TensorMaps (see above).
  template <class QX, class K, class V, class = detail::same_input_t<K, V>,
            class = detail::input_element_t<QX>>
  void attend(const QX& queries, const K& keys, const V& values, float* out,
              Layout out_layout = Layout::head_major) {
    attend_call(queries, keys, values, out, out_layout);
  }
  /// attend into a new tensor: returns [B, Hq, S, Dv] float32.
  template <class Q, class U>
  Tensor4<float> attend(const Tensor4<Q>& queries, const Tensor4<U>& keys,
                        const Tensor4<U>& values) {
    const detail::InputRows k = rows_of(keys, "keys", "attend");
    const detail::InputRows v = rows_of(values, "values", "attend");
    const detail::InputRows q = rows_of(queries, "queries", "attend");
    // The whole call is checked before the output is sized from its shapes (run() checks it
    // again: this overload allocates anyway; the pointer overloads are the hot path).
    validate_call(k, v, &q, "attend");
    detail::check_attend_output(q, v);
    Tensor4<float> out(q.batch, q.heads, q.seq, v.dim);
    float empty = 0.0f;  // an empty output has no data but is not "out == nullptr"
    attend_rows(q, k, v, out.size() ? out.data() : &empty, Layout::head_major);
    return out;
  }

  /// Position the next token will take (tokens per sequence absorbed since the last reset).
  std::int64_t offset() const { return offset_; }

  /// The retained set, rows in ascending position: [B, H, n, D] (keys and values).
  /// (Defined after the class, not inline: like run, it reaches the row kernels, which a TU built
  /// against the compiled library only declares; detail/simd_kernels.hpp.)
  KVPair<T> state() const;

  /// Positions of head (b, h)'s retained rows, ascending: [n] (empty before the first call).
  /// Throws std::out_of_range for a head outside [0, B) x [0, H).
  std::vector<std::int64_t> positions(Index b, Index h) const {
    std::vector<std::int64_t> out;
    if (heads_.empty()) {
      if (dims_.known) (void)head_index(b, h);  // a loaded cache of no rows (see live_rows)
      return out;
    }
    const auto& head = head_at(b, h);
    for (const detail::Slot s : head.order()) out.push_back(head.position(s));
    return out;
  }
  /// Scores of head (b, h)'s retained rows, ascending position: [n] (0 for policies that do not
  /// score; empty before the first call). Throws std::out_of_range outside [0, B) x [0, H).
  std::vector<float> scores(Index b, Index h) const {
    std::vector<float> out;
    if (heads_.empty()) {
      if (dims_.known) (void)head_index(b, h);
      return out;
    }
    const auto& head = head_at(b, h);
    for (const detail::Slot s : head.order()) out.push_back(head.score(s));
    return out;
  }

  /// True when trim() can roll back tokens (only the standard cache).
  virtual bool is_trimmable() const { return rule_.kind == detail::RuleKind::keep_all; }

  /// Drops the newest min(n, offset()) tokens and returns how many were dropped. Non-trimmable
  /// caches return 0 and change nothing. Throws std::invalid_argument for n < 0.
  virtual std::int64_t trim(std::int64_t n) {
    if (n < 0) throw std::invalid_argument("trim: n (" + std::to_string(n) + ") must be >= 0");
    const detail::CallGate::Entry entry = gate_.enter("trim");
    if (!is_trimmable()) return 0;
    n = std::min(n, offset_);
    // With a checkpoint: room to save the rows the compactions below may overwrite.
    for (auto& h : heads_) h.reserve_journal(static_cast<Index>(n));
    for (auto& h : heads_) {
      h.compact();
      h.drop_newest(std::min<Index>(static_cast<Index>(n), h.live()));
    }
    offset_ -= n;
    return n;
  }

  /// Forgets everything; the next call starts a new sequence at position 0 (B, H, D may change).
  virtual void reset() {
    mark_.live = false;  // a reset drops the checkpoint (the heads go with theirs)
    heads_.clear();
    dims_ = detail::LayerDims{};
    offset_ = 0;
    tokens_seen_ = 0;
    rule_.compressed = false;
    copy_.release_view();
  }

  /// The rows per head the cache evicts down to; -1 for the standard cache (docs/design.md 2.6).
  virtual int layer_budget() const { return rule_.budget.value_or(-1); }

  /// Bytes of retained K and V over all heads as stored: sizeof(T) per element, or a quantized
  /// row's codes, scales and offsets (rounded up to whole elements of T).
  std::size_t kept_bytes() const {
    std::size_t bytes = 0;
    for (const auto& h : heads_) bytes += static_cast<std::size_t>(h.live()) * h.slot_bytes();
    return bytes;
  }
  /// Bytes the cache would hold if every token were kept: B·H·offset()·(Dk + Dv)·sizeof(T).
  std::size_t full_seq_bytes() const {
    return static_cast<std::size_t>(dims_.batch * dims_.heads) * static_cast<std::size_t>(offset_) *
           row_bytes();
  }
  /// full_seq_bytes() / kept_bytes(); 1.0 while nothing is kept.
  double compression_ratio() const {
    const std::size_t kept = kept_bytes();
    return kept == 0 ? 1.0 : static_cast<double>(full_seq_bytes()) / static_cast<double>(kept);
  }
  /// B·H·S summed over calls since the last reset (as the reference counts).
  std::int64_t tokens_seen() const { return tokens_seen_; }
  /// Rows retained in head (b=0, h=0).
  std::int64_t tokens_kept() const { return heads_.empty() ? 0 : heads_.front().live(); }
  /// Rows retained in head (b, h) (adaptive heads differ, SPEC 14; 0 before the first call).
  /// Throws std::out_of_range for a head outside [0, B) x [0, H).
  std::int64_t head_rows(Index b, Index h) const {
    if (heads_.empty()) {
      if (dims_.known) (void)head_index(b, h);
      return 0;
    }
    return head_at(b, h).live();
  }
  /// The most rows any head holds (tokens_kept() unless adaptive heads differ; 0 before the first
  /// call).
  std::int64_t max_head_rows() const { return live_rows(); }
  /// Whether the heads hold different numbers of rows (only adaptive heads can, SPEC 14): then
  /// update_and_fetch(_into) and state() refuse, and a view's rows() throws.
  bool ragged_heads() const { return ragged(); }

  /// Heap bytes the cache holds right now (rows, bookkeeping, scratch, by capacity).
  std::size_t heap_bytes() const {
    std::size_t total = heads_.capacity() * sizeof(detail::HeadStore<T>) +
                        scratch_.capacity() * sizeof(detail::Scratch) + copy_.heap_bytes();
    for (const auto& h : heads_) total += h.heap_bytes();
    for (const auto& s : scratch_) total += s.heap_bytes();
    return total;
  }

  /// Lets calls spread their heads over the engine's threads (docs/design.md 7.3): `run` executes
  /// up to `workers` tasks at once. Without one (the default) heads run serially. Results are
  /// bit-identical either way. Throws std::invalid_argument for workers < 1.
  void set_parallel_for(ParallelFor run, int workers) {
    if (workers < 1) {
      throw std::invalid_argument("set_parallel_for: workers (" + std::to_string(workers) +
                                  ") must be >= 1");
    }
    parallel_for_ = std::move(run);
    workers_ = parallel_for_ ? workers : 1;
  }
  /// Switches the use of the parallel-for given to set_parallel_for on or off (default on).
  void set_parallel_heads(bool on) { parallel_heads_ = on; }
  bool parallel_heads() const { return parallel_heads_; }

  /// The configuration the cache was built with; its `method` names the cache's own policy
  /// ("standard" for this class, whatever method the config given to it named: the builder gives
  /// a model's non-attention layers the model's config).
  const KVCacheConfig& config() const { return config_; }

  /// Batch size, KV heads and head dims fixed by the first call (0 before it).
  Index batch() const { return dims_.batch; }
  Index heads() const { return dims_.heads; }
  Index key_dim() const { return dims_.key_dim; }
  Index value_dim() const { return dims_.value_dim; }

  // ---- its state: what a prompt cache saves of it (docs/design.md G) -------------------------

  /// Writes the cache's state after the config the container wrote: the descriptor (state flags,
  /// budget, dims, offset, tokens_seen, rows per head), then, when it holds rows, one block per
  /// head (b-major): positions, scores where the policy scores rows, keys, values, in the slot
  /// order compaction would leave. Only reads the cache. A class that adds state overrides this
  /// and read_state, its fields after the base descriptor's.
  virtual void write_state(detail::StateWriter& w) const {
    write_descriptor(w);
    w.end_descriptor();
    write_heads(w, NoExtra{});
  }
  /// Restores what write_state wrote into this cache, which must be of the class and config the
  /// state was saved from (the loader builds a fresh one from the saved config). Every rule a
  /// cache keeps between calls is checked before anything changes (docs/design.md G, "what a
  /// loader checks"): a state that breaks one throws std::invalid_argument naming it, and the
  /// reader's own errors (a truncated or corrupt file) pass through; the cache is then unchanged.
  virtual void read_state(detail::StateReader& r) {
    SavedState s = read_descriptor(r);
    r.end_descriptor();
    check_flags(s);
    check_descriptor(s, true);
    NoExtra none;
    read_heads(r, s, none);
    install(s);
  }
  /// Adds to `links` what the cache's state refers to outside itself, in the order write_state
  /// refers to it (a squeeze layer's coordinator); the container saves each of those once.
  virtual void link_state(detail::StateLinks& /*links*/) const {}

 protected:
  // The builder forks, checkpoints and rolls back a model's set through the hooks below (the
  // set's operations: a squeeze layer's coordinator is shared by the set).
  friend class KVCacheBuilder;

  /// Fork (KVCacheBuilder::fork, docs/design.md 10.1): makes this cache, fresh from the factory
  /// with `src`'s config (so of its class), an independent copy of `src`'s state: rows (only the
  /// retained ones, compacted), positions, scores, budget, offset, counters, the pending
  /// re-budget and the engine's parallel-for. A class that adds state overrides it, calls this and
  /// takes its coordinator's copy from `links` (StateLinks::counterpart). Only allocates before it
  /// changes this cache; `src` is only read.
  virtual void fork_from(const KVCache& src, detail::StateLinks& /*links*/) {
    std::vector<detail::HeadStore<T>> heads;
    heads.reserve(src.heads_.size());
    for (const auto& h : src.heads_) heads.push_back(h.forked());
    std::vector<float> row;
    if (storage_.quantized() && src.dims_.known && src.live_rows() > 0) {
      row.assign(
          static_cast<std::size_t>(detail::row_floats(src.dims_.key_dim, src.dims_.value_dim)),
          0.0f);
    }
    ParallelFor run = src.parallel_for_;
    // No-throw from here on.
    heads_.swap(heads);
    dims_ = src.dims_;
    offset_ = src.offset_;
    tokens_seen_ = src.tokens_seen_;
    rule_ = src.rule_;
    rebudget_ = src.rebudget_;
    if (!row.empty()) copy_.install_row(row);
    parallel_for_.swap(run);
    workers_ = src.workers_;
    parallel_heads_ = src.parallel_heads_;
  }

  /// Checkpoint (KVCacheBuilder::checkpoint, docs/design.md 10.2): marks the cache's state under
  /// `token` (the set's), replacing a live checkpoint. The heads copy their bookkeeping and
  /// journal the rows later calls overwrite. Allocates only; if it throws, the cache holds no
  /// checkpoint and its state is unchanged. A class that adds state overrides it, calls this and
  /// keeps its own.
  virtual void take_checkpoint(std::uint64_t token) {
    mark_.live = false;
    try {
      for (auto& h : heads_) h.checkpoint();
    } catch (...) {
      for (auto& h : heads_) h.drop_checkpoint();
      throw;
    }
    mark_ = Mark{true, token, heads_.size(), dims_, offset_, tokens_seen_, rule_, rebudget_};
  }
  /// The token of the live checkpoint, or empty (none taken, dropped by a reset or a load, or
  /// consumed by a rollback).
  std::optional<std::uint64_t> checkpoint_token() const {
    return mark_.live ? std::optional<std::uint64_t>(mark_.token) : std::nullopt;
  }
  /// Returns the cache to its live checkpoint and consumes it; never throws (the heads kept the
  /// room, docs/design.md 10.2).
  virtual void roll_back() noexcept {
    VELOXQUANT_ASSERT(mark_.live, "roll_back without a checkpoint");
    if (mark_.heads == 0) {
      heads_.clear();  // the checkpoint came before the first call (or a load of no rows)
    } else {
      for (auto& h : heads_) h.rollback();
    }
    dims_ = mark_.dims;
    offset_ = mark_.offset;
    tokens_seen_ = mark_.tokens_seen;
    rule_ = mark_.rule;
    rebudget_ = mark_.rebudget;
    mark_.live = false;
  }
  /// Forgets the live checkpoint, if any.
  virtual void drop_checkpoint() noexcept {
    mark_.live = false;
    for (auto& h : heads_) h.drop_checkpoint();
  }

  /// A policy's cache: `rule` says what the calls do with rows (docs/design.md 7.1).
  /// `config` gives the storage of rows (key_bits, value_bits, quant_group; docs/design.md 2.9).
  /// `method` names the policy (config().method).
  KVCache(const detail::Rule& rule, const KVCacheConfig& config, detail::Method method)
      : rule_(rule), config_(detail::with_method(config, method)), storage_(storage_of(config)) {}

  /// Hook: before anything changes; may inspect the call's keys ([B, H, S, Dk], any input type)
  /// and throw.
  virtual void inspect_call(const detail::InputRows& /*keys*/) {}
  /// Hook: after storage and scratch are reserved, before any row is touched. May throw only
  /// before it changes anything (the strong guarantee); may change the budget (set_budget).
  virtual void start_call() {}

  const detail::Rule& rule() const { return rule_; }
  // Policy accessors, published by the classes they mean something for (`using`).
  /// The budget in force (rows per head), or empty while it is unknown.
  std::optional<int> budget() const { return rule_.budget; }
  /// Leading positions never evicted.
  int n_sink() const { return rule_.n_sink; }
  /// Newest rows never evicted under the current budget (0 while the budget is unknown).
  int protected_recent() const { return rule_.protected_recent(); }
  /// Per-token decay of cumulative scores.
  float decay() const { return rule_.decay; }
  /// Makes `budget` the budget in force; the heads are brought within it (docs/design.md 4.5) at
  /// the start of the call in progress, or of the next one.
  void set_budget(std::optional<int> budget) {
    rule_.budget = budget;
    rebudget_ = true;
  }

  // The parts of write_state and read_state a class that adds state builds its own from.

  /// A state read and not yet installed (detail/state_checks.hpp).
  using SavedState = detail::SavedCache<T>;
  /// What a class adds to each head block: nothing.
  struct NoExtra {
    void operator()(detail::ByteWriter& /*out*/, std::size_t /*head*/) const {}
    void read(detail::ByteReader& /*in*/) {}
    void check(const SavedState& /*s*/) {}
  };
  void write_descriptor(detail::StateWriter& w) const {
    detail::ByteWriter& out = w.out();
    out.u8(static_cast<std::uint8_t>((dims_.known ? SavedState::kDimsKnown : 0) |
                                     (rule_.budget ? SavedState::kHasBudget : 0) |
                                     (rule_.compressed ? SavedState::kCompressed : 0)));
    out.i32(rule_.budget.value_or(0));
    for (const Index v : {dims_.batch, dims_.heads, dims_.key_dim, dims_.value_dim, Index{offset_},
                          Index{tokens_seen_}, live_rows()}) {
      out.i64(static_cast<std::int64_t>(v));
    }
  }
  /// The head blocks; `extra(out, i)` writes what the class adds to head i's, after its scores.
  template <class Extra>
  void write_heads(detail::StateWriter& w, const Extra& extra) const {
    if (!dims_.known || live_rows() == 0) return;  // a cache of no rows has no head objects
    std::vector<detail::Slot>& src = w.slots();
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      const detail::HeadStore<T>& h = heads_[i];
      h.compacted_slots(src);
      w.begin_head();
      if (rule_.adaptive) w.out().i64(static_cast<std::int64_t>(h.live()));  // its own rows
      w.positions(h, src);
      if (detail::scored_rows(rule_.kind)) w.scores(h, src);
      extra(w.out(), i);
      w.rows(h, src);
      w.end_head();
    }
  }
  SavedState read_descriptor(detail::StateReader& r) const {
    detail::ByteReader& in = r.in();
    SavedState s;
    s.flags = in.u8();
    s.budget = in.i32();
    for (std::int64_t* v :
         {&s.batch, &s.heads, &s.key_dim, &s.value_dim, &s.offset, &s.tokens_seen, &s.rows}) {
      *v = in.i64();
    }
    return s;
  }
  /// The rules every cache keeps between calls (docs/design.md G, "what a loader checks"), on the
  /// descriptor: its flags first (check_flags), then the rest (check_descriptor;
  /// `budget_from_config`: the budget in force is the one the config gives).
  static void check_flags(const SavedState& s) { detail::check_saved_flags(s); }
  void check_descriptor(const SavedState& s, bool budget_from_config) const {
    detail::check_saved_descriptor(s, rule_, key_format(s.key_dim), value_format(s.value_dim),
                                   budget_from_config);
  }
  /// Reads the head blocks into s.stores, checking each as it comes; `extra` reads what the
  /// class adds to each block (extra.read, after the scores) and checks it (extra.check).
  template <class Extra>
  void read_heads(detail::StateReader& r, SavedState& s, Extra& extra) const {
    if (!s.dims_known() || s.rows == 0) return;
    const detail::RowFormat kf = key_format(s.key_dim), vf = value_format(s.value_dim);
    const bool with_scores = detail::scored_rows(rule_.kind);
    std::vector<std::int64_t> pos;
    std::vector<float> score;
    std::int64_t most = 0;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      std::int64_t held = 0;
      for (std::int64_t hh = 0; hh < s.heads; ++hh) {
        r.begin_head(b, hh);
        // Adaptive heads hold their own number of rows (docs/design.md G, 4.9).
        std::int64_t rows = s.rows;
        if (rule_.adaptive) {
          rows = r.in().i64();
          detail::check_saved_head_rows(s, rows);
        }
        const auto n = static_cast<std::uint64_t>(rows);
        r.in().array(pos, n);
        if (with_scores) r.in().array(score, n);
        extra.read(r.in());
        detail::HeadStore<T> head(kf, vf);
        r.rows(head, rows);
        // After the rows: its buffers (one weight per slot, one value row) are then no larger
        // than what the file has already paid for; restore computes the weights.
        if (rule_.value_power > 0.0) head.enable_value_weights(rule_.value_power);
        r.end_head();
        detail::check_saved_head(s, rule_, head, rows, pos, with_scores ? &score : nullptr);
        extra.check(s);
        r.keep_head();
        s.stores.push_back(std::move(head));
        held += rows;
        most = std::max(most, rows);
      }
      if (rule_.adaptive) detail::check_saved_pool(s, rule_, held);
    }
    if (most != s.rows) {
      detail::bad_state("the descriptor's " + std::to_string(s.rows) +
                        " rows per head are not what the most-holding head holds (" +
                        std::to_string(most) + ")");
    }
  }
  /// Makes the cache stand where the saved one stood (its heads leave `s`).
  void install(SavedState& s) {
    mark_.live = false;  // a loaded state drops the checkpoint (the heads are new)
    // The buffer quantized rows leave the cache through (a cache that has made a call with rows
    // holds one; an empty call's view or fetch after the load needs it). Allocated first.
    if (storage_.quantized() && s.rows > 0) {
      s.row_buf.assign(static_cast<std::size_t>(detail::row_floats(s.key_dim, s.value_dim)), 0.0f);
    }
    heads_.swap(s.stores);
    dims_ = detail::LayerDims{s.batch, s.heads, s.key_dim, s.value_dim, s.dims_known()};
    offset_ = s.offset;
    tokens_seen_ = s.tokens_seen;
    rule_.budget = s.has_budget() ? std::optional<int>(s.budget) : std::nullopt;
    rule_.compressed = s.compressed();
    rebudget_ = false;
    if (!s.row_buf.empty()) copy_.install_row(s.row_buf);
  }

 private:
  // The rows of an input (`what` names it in errors); throws std::invalid_argument for a
  // negative dimension, an element count beyond Index, or null data with a non-zero size.
  template <class X>
  static detail::InputRows rows_of(const X& x, const char* what, const char* api) {
    const TensorRef<detail::input_element_t<X>> t(x);
    const Index dims[4] = {t.batch, t.heads, t.seq, t.dim};
    detail::check_tensor_ref(t.data, dims, what, api);
    return t.layout == Layout::head_major
               ? detail::head_major_rows(t.data, t.batch, t.heads, t.seq, t.dim)
               : detail::token_major_rows(t.data, t.batch, t.heads, t.seq, t.dim);
  }

  // Every update API's entry: the tensors' rows taken in a fixed order (keys, values, then
  // queries), so the first malformed tensor named is the same whichever order a compiler
  // evaluates function arguments in; then run().
  template <class K, class V>
  KVView<T> run_tensors(const char* api, const K& keys, const V& values, KVPair<T>* out) {
    const detail::InputRows k = rows_of(keys, "keys", api);
    const detail::InputRows v = rows_of(values, "values", api);
    return run(k, v, nullptr, api, out);
  }
  template <class K, class V, class Q>
  KVView<T> run_tensors(const char* api, const K& keys, const V& values, const Q& queries,
                        KVPair<T>* out) {
    const detail::InputRows k = rows_of(keys, "keys", api);
    const detail::InputRows v = rows_of(values, "values", api);
    const detail::InputRows q = rows_of(queries, "queries", api);
    return run(k, v, &q, api, out);
  }
  // attend's entry, in the same order.
  template <class Q, class K, class V>
  void attend_call(const Q& queries, const K& keys, const V& values, float* out, Layout layout) {
    const detail::InputRows k = rows_of(keys, "keys", "attend");
    const detail::InputRows v = rows_of(values, "values", "attend");
    const detail::InputRows q = rows_of(queries, "queries", "attend");
    attend_rows(q, k, v, out, layout);
  }

  // The body of attend: the output's strides, then run().
  void attend_rows(const detail::InputRows& queries, const detail::InputRows& keys,
                   const detail::InputRows& values, float* out, Layout layout) {
    if (out == nullptr) throw std::invalid_argument("attend: out is null");
    detail::check_attend_output(queries, values);  // the strides below fit
    const Index Hq = queries.heads, S = queries.seq, Dv = values.dim;
    detail::AttendOut att{out, 0, 0, 0};
    if (layout == Layout::head_major) {
      att.stride_j = S * Dv;
      att.stride_s = Dv;
      att.stride_b = Hq * S * Dv;
    } else {
      att.stride_j = Dv;
      att.stride_s = Hq * Dv;
      att.stride_b = S * Hq * Dv;
    }
    (void)run(keys, values, &queries, "attend", nullptr, &att);
  }

  // Index of head (b, h); std::out_of_range outside [0, B) x [0, H).
  std::size_t head_index(Index b, Index h) const {
    if (b < 0 || b >= dims_.batch || h < 0 || h >= dims_.heads) {
      throw std::out_of_range("scores/positions: head (" + std::to_string(b) + ", " +
                              std::to_string(h) + ") out of range");
    }
    return static_cast<std::size_t>(b * dims_.heads + h);
  }
  // Head (b, h); std::out_of_range outside [0, B) x [0, H).
  const detail::HeadStore<T>& head_at(Index b, Index h) const { return heads_[head_index(b, h)]; }

  // How rows are stored: widths of keys and values (16: as T) and the group of quantized rows.
  struct Storage {
    int key_bits = 16, value_bits = 16, group = 32;
    bool quantized() const { return key_bits < 16 || value_bits < 16; }
  };
  static Storage storage_of(const KVCacheConfig& c) {
    return Storage{c.key_bits, c.value_bits, c.quant_group};
  }
  // The standard cache's: validates `c` first.
  static Storage checked_storage(const KVCacheConfig& c) {
    c.validate();
    return storage_of(c);
  }
  detail::RowFormat key_format(Index dk) const {
    return detail::RowFormat{storage_.key_bits, dk, storage_.group};
  }
  detail::RowFormat value_format(Index dv) const {
    return detail::RowFormat{storage_.value_bits, dv, storage_.group};
  }

  // Throws std::invalid_argument when offset() + S or tokens_seen() + B·H·S would leave int64 (a
  // prompt cache may load a cache near 2^62).
  void check_counters(const detail::InputRows& keys, const char* api) const {
    const std::optional<std::int64_t> bhs =
        detail::checked_product<std::int64_t>({keys.batch, keys.heads, keys.seq});
    (void)detail::value_or_throw(bhs, api, "B * H * S");
    (void)detail::value_or_throw(detail::checked_add<std::int64_t>(offset_, keys.seq), api,
                                 "offset() + S");
    (void)detail::value_or_throw(detail::checked_add<std::int64_t>(tokens_seen_, *bhs), api,
                                 "tokens_seen() + B * H * S");
  }

  // Rows each head holds (the same for all heads; adaptive heads: the most any holds), 0 before
  // the first call. A cache loaded from a prompt cache with no rows holds no head objects until
  // its next call brings rows (their number is B·H, which only the call's own tensors make real;
  // docs/design.md G).
  Index live_rows() const {
    if (heads_.empty()) return 0;
    if (!rule_.adaptive) return heads_.front().live();
    Index n = 0;
    for (const auto& h : heads_) n = std::max(n, h.live());
    return n;
  }
  // Whether the heads hold different numbers of rows (only adaptive heads can).
  bool ragged() const {
    if (!rule_.adaptive) return false;
    for (const auto& h : heads_) {
      if (h.live() != heads_.front().live()) return true;
    }
    return false;
  }
  static std::string ragged_message(const char* api) {
    return std::string(api) +
           ": the heads hold different numbers of rows (adaptive head budgets, SPEC 14), which "
           "one dense tensor cannot return; use attend or update_and_view";
  }

  std::size_t row_bytes() const {
    return static_cast<std::size_t>(dims_.key_dim + dims_.value_dim) * sizeof(T);
  }

  // Step 1 of run(): throws std::invalid_argument for a call it must refuse. The keys' and
  // values' shapes and counts first (nothing is read before the shapes are known to describe
  // data), then the quantized formats' own limits (the more specific message), then the
  // magnitude bounds of every row; the queries after everything about the keys and values
  // (docs/design.md 4.6). keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, G·H, S, Dk]
  // or nullptr.
  void validate_call(const detail::InputRows& keys, const detail::InputRows& values,
                     const detail::InputRows* queries, const char* api) const {
    detail::check_update_shapes(keys, values, dims_, api);
    detail::check_rows_fit(live_rows(), keys.seq, api);
    check_counters(keys, api);
    // (An empty call stores nothing: its D is either the first call's or still free.)
    if (storage_.key_bits < 16 && keys.seq > 0) {
      detail::check_quantizable<T>(keys, key_format(keys.dim), "keys", "key_bits", api);
    }
    if (storage_.value_bits < 16 && keys.seq > 0) {
      detail::check_quantizable<T>(values, value_format(values.dim), "values", "value_bits", api);
    }
    detail::check_update_rows<T>(keys, values, api);
    if (queries) detail::check_queries(*queries, keys, api);
  }
  // update_and_fetch(_into) returns the window, [B, H, n, D]: refused when the heads hold
  // different numbers of rows (the window is the rows held now plus the call's).
  void check_dense(const char* api) const {
    if (ragged()) throw std::invalid_argument(ragged_message(api));
  }

  // The one body of every update API; `api` names the caller in errors; `out` (fetch and
  // fetch_into) receives a copy of the window. keys: [B, H, S, Dk], values: [B, H, S, Dv],
  // queries: [B, G·H, S, Dk] or nullptr.
  // (Defined after the class, not inline: a TU built with VELOXQUANT_EXTERN_TEMPLATES then
  // does not compile the pipeline behind the API's member templates; extern_templates.hpp.)
  KVView<T> run(const detail::InputRows& keys, const detail::InputRows& values,
                const detail::InputRows* queries, const char* api, KVPair<T>* out,
                const detail::AttendOut* att = nullptr);

  // Reserves room for the call: fresh heads for a cache's first call (returned, swapped in by
  // run()), otherwise compaction (logically invisible) and growth of every head; then the scratch
  // of every worker. The logical state is unchanged even if an allocation throws.
  std::vector<detail::HeadStore<T>> reserve(const detail::InputRows& keys,
                                            const detail::InputRows& values,
                                            const detail::CallPlan& plan) {
    const Index S = keys.seq;
    const bool key_sum = rule_.proxy == detail::ProxyScoring::keydiff;
    std::vector<detail::HeadStore<T>> fresh;
    if (heads_.empty()) {
      fresh = detail::fresh_heads<T>(keys.batch * keys.heads, key_format(keys.dim),
                                     value_format(values.dim), S, rule_.value_power, key_sum);
    } else {
      detail::grow_heads(heads_, S, rule_.steady_rows(), key_sum, rule_.adaptive);
    }
    const auto workers =
        static_cast<std::size_t>(tasks_for(keys.batch * keys.heads, scratch_size(keys, plan)));
    if (scratch_.size() < workers) scratch_.resize(workers);
    const detail::ScratchSize size = scratch_size(keys, plan);
    for (std::size_t i = 0; i < scratch_.size(); ++i) {
      // Adaptive heads: the pooled eviction runs on the first worker's scratch, after the heads
      // (sized here once: fitting it twice released and reallocated the pool every call).
      detail::ScratchSize z = size;
      if (rule_.adaptive && i == 0) z.pooled = keys.heads * z.columns;
      scratch_[i].fit(z);
    }
    return fresh;
  }
  detail::ScratchSize scratch_size(const detail::InputRows& keys,
                                   const detail::CallPlan& plan) const {
    return detail::ScratchSize{plan.rows, live_rows() + keys.seq, detail::padded_dim(keys.dim),
                               plan.gather, plan.packed};
  }

  // What a call hands the engine's parallel-for: the task function and the ledger that checks
  // the pool's use of it (detail/task_ledger.hpp); empty when the heads run serially. Built
  // before the cache changes (both may allocate).
  struct PoolCall {
    int tasks = 1;
    std::shared_ptr<detail::TaskLedger> ledger;
    std::function<void(int)> task;
  };
  PoolCall pool_call(Index n_heads, const detail::InputRows& keys,
                     const detail::CallPlan& plan) const {
    PoolCall p;
    p.tasks = tasks_for(n_heads, scratch_size(keys, plan));
    if (p.tasks <= 1) return p;
    p.ledger = std::make_shared<detail::TaskLedger>(p.tasks);
    p.task = [ledger = p.ledger](int t) { ledger->run(t); };
    return p;
  }

  // Tasks a call of this size runs on: 1 unless a parallel-for is set and the call is large
  // enough to be worth a fork.
  int tasks_for(Index n_heads, const detail::ScratchSize& size) const {
    if (!parallel_for_ || !parallel_heads_ || workers_ < 2 || n_heads < 2) return 1;
    // In double: the product of four counts may not fit an Index.
    const double work = static_cast<double>(std::max<Index>(size.rows, 1)) *
                        static_cast<double>(size.columns) * static_cast<double>(size.dim) *
                        static_cast<double>(n_heads);
    if (work < static_cast<double>(kParallelWork)) return 1;
    return static_cast<int>(std::min<Index>(workers_, n_heads));
  }

  // Step 5 of run(): per head, the window starts (with its order when `copy`: fetch), a pending
  // re-budget applies, the call's rows are stored and the policy absorbs them. Heads are
  // independent: with a parallel-for, each task takes a contiguous range of heads and its own
  // scratch.
  void absorb_heads(const detail::InputRows& keys, const detail::InputRows& values,
                    const detail::InputRows* queries, Index groups, const detail::CallPlan& plan,
                    bool copy, const detail::AttendOut* att, PoolCall& pool, const char* api) {
    const Index S = keys.seq;
    const Index n_heads = dims_.batch * dims_.heads;
    // Adaptive heads (docs/design.md 4.9): the windows start and a pending re-budget applies to
    // each sequence's pool before the heads take the call, which evicts nothing; the pool gives up
    // its excess after all of them have.
    const bool pooled = rule_.adaptive;
    detail::Rule head_rule = rule_;
    if (pooled) {
      head_rule.budget.reset();
      for (auto& head : heads_) head.begin_window(copy);
      if (rebudget_ && rule_.budget) pool_rebudget(queries != nullptr);
    }
    const auto one = [&](Index i, detail::Scratch& sc) {
      auto& head = heads_[static_cast<std::size_t>(i)];
      const Index b = i / dims_.heads, h = i % dims_.heads;
      if (!pooled) head.begin_window(copy);
      if (!pooled && rebudget_ && rule_.budget) {
        // KeyDiff ranks the rows it holds now, in a call without queries (with queries, the
        // scores are attention mass, docs/design.md 4.7, weighted by |v|^p under
        // value_norm_power, 4.8).
        const float* rank = nullptr;
        if (rule_.proxy == detail::ProxyScoring::keydiff && queries == nullptr &&
            head.live() > *rule_.budget) {
          rank = detail::keydiff_rank_head(head, 0, head.live(), sc);
        } else if (rule_.value_power > 0.0 && queries != nullptr && head.live() > *rule_.budget) {
          rank = detail::value_rank_head(head, sc);
        }
        detail::rebudget(head, *rule_.budget, rule_.n_sink, rule_.protected_recent(), sc, rank);
      }
      for (Index s = 0; s < S; ++s) {
        detail::with_row(keys, b, h, s, [&](const auto* k) {
          using U = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
          (void)head.append(k, values.template row<U>(b, h, s), offset_ + s);
        });
      }
      const detail::HeadQueries q{queries, b, h, groups};
      const detail::HeadAttend a{att, b, h, groups};
      detail::absorb_head(head, head_rule, plan, S, q, a, sc);
    };
    const int tasks = pool.tasks;
    if (tasks <= 1) {
      for (Index i = 0; i < n_heads; ++i) one(i, scratch_.front());
      if (pooled && rule_.budget) pool_rebudget(queries != nullptr);
      return;
    }
    // Task t takes heads [start(t), start(t + 1)): n / tasks each, the first n % tasks one more
    // (no product that could overflow).
    const auto start = [&](int t) {
      return n_heads / tasks * t + std::min<Index>(t, n_heads % tasks);
    };
    auto range = [&](int task) {
      const Index lo = start(task), hi = start(task + 1);
      for (Index i = lo; i < hi; ++i) one(i, scratch_[static_cast<std::size_t>(task)]);
    };
    pool.ledger->bind(range);
    std::exception_ptr thrown;
    try {
      parallel_for_(tasks, pool.task);
    } catch (...) {
      thrown = std::current_exception();
    }
    pool.ledger->close();
    if (!thrown && !pool.ledger->misused()) {
      if (pooled && rule_.budget) pool_rebudget(queries != nullptr);
      return;
    }
    // Some heads took the call and others did not: no state the cache can go on from. Reset
    // before the message is built (building it may throw bad_alloc).
    reset();
    if (thrown) std::rethrow_exception(thrown);
    throw std::logic_error(std::string(api) + ": the parallel-for given to set_parallel_for ran " +
                           std::to_string(tasks) + " tasks wrongly (" + pool.ledger->misuse() +
                           "); the cache was reset");
  }

  // Adaptive heads: every sequence's heads brought within their pool of H x budget rows
  // (docs/design.md 4.9), at a call's start (a pending re-budget) and after its heads took it;
  // ranked as a head's own re-budget ranks: KeyDiff's ranking in a call without queries,
  // score x |v|^p under value_norm_power in a call with them, else the scores.
  void pool_rebudget(bool with_queries) {
    detail::Scratch& sc = scratch_.front();
    const int budget = *rule_.budget;
    const bool keydiff = rule_.proxy == detail::ProxyScoring::keydiff && !with_queries;
    const bool weighted = rule_.value_power > 0.0 && with_queries;
    for (Index b = 0; b < dims_.batch; ++b) {
      detail::HeadStore<T>* seq = heads_.data() + b * dims_.heads;
      const auto rank = [&](Index h, Index lo, Index hi, detail::Scratch& s) -> const float* {
        detail::HeadStore<T>& head = seq[h];
        if (keydiff) return detail::keydiff_rank_head(head, lo, hi, s);
        if (weighted) return detail::value_rank_head(head, s);
        return nullptr;
      };
      // KeyDiff's running sum follows each row out (absorb_proxy's way), so that the next
      // ranking does not rebuild it from every row.
      const auto mark_dead = [&](Index h, detail::Slot slot) {
        detail::HeadStore<T>& head = seq[h];
        const bool sum_valid = keydiff && detail::keydiff_take_out(head, slot, sc);
        head.mark_dead(slot);
        if (sum_valid) head.set_key_sum_valid();
      };
      detail::pooled_rebudget(seq, dims_.heads, budget, rule_.floor_rows(), rule_.n_sink,
                              rule_.protected_recent(), sc, rank, mark_dead);
    }
  }

  KVView<T> make_view(Index rows, Index new_rows, const detail::InputRows& keys,
                      const detail::InputRows& values, bool view_copy) const {
    if (!dims_.known) {
      return KVView<T>(&heads_, keys.batch, keys.heads, keys.dim, values.dim, 0, 0);
    }
    // Adaptive heads may differ: each then shows its own slots in use (the copy of a quantized
    // window is laid out at the longest head's rows).
    const Index stride = rule_.adaptive ? max_physical() : rows;
    bool ragged = false;
    for (const auto& h : heads_) ragged = ragged || h.physical() != stride;
    return KVView<T>(&heads_, dims_.batch, dims_.heads, dims_.key_dim, dims_.value_dim,
                     ragged ? -1 : stride, new_rows, view_copy ? copy_.view_keys() : nullptr,
                     view_copy ? copy_.view_values() : nullptr, stride);
  }

  static void resize_pair(KVPair<T>& out, Index b, Index h, Index n, Index dk, Index dv) {
    const Eigen::array<Index, 4> kshape{b, h, n, dk};
    const Eigen::array<Index, 4> vshape{b, h, n, dv};
    if (out.first.dimensions() != kshape) out.first.resize(kshape);
    if (out.second.dimensions() != vshape) out.second.resize(vshape);
  }

  // The retained rows of every head in ascending position into `out` (resized if needed).
  void copy_retained(KVPair<T>& out) const {
    std::vector<float> buf(storage_.quantized() ? static_cast<std::size_t>(detail::row_floats(
                                                      dims_.key_dim, dims_.value_dim))
                                                : 0);
    copy_rows(out, buf.data(), detail::RetainedRows{});
  }
  // The window of the call just made: the rows retained before it, then its own.
  void copy_window(KVPair<T>& out) { copy_rows(out, copy_.row(), detail::WindowRows{}); }
  // Every head's slots [0, physical()) in slot order into the view buffers (sized by
  // CopyBuffers::refit_view): a quantized cache's view.
  void copy_slots() {
    detail::copy_rows(heads_, dims_.key_dim, dims_.value_dim, storage_.quantized(),
                      copy_.view_keys(), copy_.view_values(), copy_.row(), max_physical(),
                      detail::SlotRows{});
  }
  // The most slots in use in any head (the window's longest head after a call).
  Index max_physical() const {
    Index n = 0;
    for (const auto& h : heads_) n = std::max(n, h.physical());
    return n;
  }
  // The rows `each` takes of every head (detail/layer_storage.hpp) into `out`: [B, H, n, D] twice.
  template <class Each>
  void copy_rows(KVPair<T>& out, float* buf, const Each& each) const {
    const Index n = detail::rows_taken(heads_, each);
    resize_pair(out, dims_.batch, dims_.heads, n, dims_.key_dim, dims_.value_dim);
    detail::copy_rows(heads_, dims_.key_dim, dims_.value_dim, storage_.quantized(),
                      out.first.data(), out.second.data(), buf, n, each);
  }

  // Multiply-adds per call below which heads run serially (a fork costs more).
  static constexpr Index kParallelWork = Index{1} << 16;

  detail::Rule rule_{};
  KVCacheConfig config_;
  bool rebudget_ = false;
  detail::LayerDims dims_{};
  std::vector<detail::HeadStore<T>> heads_;
  std::vector<detail::Scratch> scratch_;
  Storage storage_{};
  // A quantized cache's view (the window dequantized) and the row quantized rows leave through.
  detail::CopyBuffers<T> copy_;
  std::int64_t offset_ = 0;
  std::int64_t tokens_seen_ = 0;
  ParallelFor parallel_for_;
  detail::CallGate gate_;  // refuses a call that starts while another runs (run(), step 0)
  // The live checkpoint's part outside the heads (take_checkpoint).
  struct Mark {
    bool live = false;
    std::uint64_t token = 0;
    std::size_t heads = 0;
    detail::LayerDims dims{};
    std::int64_t offset = 0, tokens_seen = 0;
    detail::Rule rule{};
    bool rebudget = false;
  };
  Mark mark_;
  int workers_ = 1;
  bool parallel_heads_ = true;
};

template <class T>
KVPair<T> KVCache<T>::state() const {
  check_dense("state");
  KVPair<T> out;
  copy_retained(out);
  return out;
}

template <class T>
KVView<T> KVCache<T>::run(const detail::InputRows& keys, const detail::InputRows& values,
                          const detail::InputRows* queries, const char* api, KVPair<T>* out,
                          const detail::AttendOut* att) {
  // 0. One call at a time: a second call while this one runs throws, changing nothing.
  const detail::CallGate::Entry entry = gate_.enter(api);
  // 1. Validation: nothing has changed if it throws.
  validate_call(keys, values, queries, api);
  if (out) check_dense(api);
  const Index S = keys.seq;
  // A view of a quantized cache shows a dequantized copy of the window (docs/design.md 2.3).
  const bool view_copy = !out && !att && storage_.quantized();
  // The view's buffers and the row buffer, allocated now and swapped in at step 5.
  typename detail::CopyBuffers<T>::Refit buffers;
  if (view_copy) {
    copy_.refit_view(buffers, keys.batch, keys.heads, live_rows() + S, keys.dim, values.dim, S > 0);
  }
  if (S == 0) {
    // With a checkpoint: room to save the rows the compaction below may overwrite.
    for (auto& h : heads_) h.reserve_journal(0);
    if (view_copy) copy_.commit(buffers);  // nothing else can throw now
    if (out && !dims_.known) resize_pair(*out, keys.batch, keys.heads, 0, keys.dim, values.dim);
    for (auto& h : heads_) h.compact();
    if (out && dims_.known) copy_retained(*out);
    if (view_copy && dims_.known) copy_slots();
    return make_view(live_rows(), 0, keys, values, view_copy);
  }
  // The buffer quantized rows leave the cache through (fetch and view copies).
  if (storage_.quantized()) {
    copy_.refit_row(buffers, static_cast<std::size_t>(detail::row_floats(keys.dim, values.dim)));
  }
  // 2. The policy inspects the call (may throw); 3. storage and scratch are reserved (may
  // throw bad_alloc); 4. the policy starts the call (may throw before it changes anything).
  inspect_call(keys);
  const Index groups = queries ? queries->heads / keys.heads : 0;
  const detail::CallPlan plan = detail::plan_call(rule_, S, groups, att != nullptr, live_rows());
  std::vector<detail::HeadStore<T>> fresh = reserve(keys, values, plan);
  PoolCall pool = pool_call(keys.batch * keys.heads, keys, plan);
  // The output (the retained rows plus the call's) is sized last before the policy starts the
  // call: a call refused before here leaves `out` as it was, and a bad_alloc here leaves the
  // cache unchanged (a policy that refuses in start_call leaves `out` resized).
  if (out) resize_pair(*out, keys.batch, keys.heads, live_rows() + S, keys.dim, values.dim);
  start_call();
  // 5. No-throw from here on, unless the engine's parallel-for misbehaves (absorb_heads).
  copy_.commit(buffers);
  if (heads_.empty()) {
    heads_.swap(fresh);
    dims_ = detail::LayerDims{keys.batch, keys.heads, keys.dim, values.dim, true};
  }
  if (plan.compress) rule_.compressed = true;
  absorb_heads(keys, values, queries, groups, plan, out != nullptr, att, pool, api);
  rebudget_ = false;
  offset_ += S;
  tokens_seen_ += dims_.batch * dims_.heads * S;
  if (out) copy_window(*out);
  if (view_copy) copy_slots();
  return make_view(heads_.front().physical(), S, keys, values, view_copy);
}

}  // namespace veloxquant::cache
