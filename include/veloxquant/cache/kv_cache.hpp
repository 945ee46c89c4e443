// veloxquant — KVCache<T>: the standard append-only cache (mirrors mlx_lm's KVCache), the base of
// every eviction cache, and the interface every call goes through (docs/design.md 2.2, 7.1). What
// a layer holds is a detail::Layer<T> (detail/layer.hpp: its state between calls as one value,
// its heads, its scratch); every update API runs detail::run_call, the one call pipeline
// (detail/call_pipeline.hpp); a policy is data (detail::Rule) plus, for SqueezeAttention alone,
// the pipeline's hooks. Each cache writes and restores its own state (write_state / read_state,
// detail/format/layer_io.hpp, docs/design.md G). KVView<T>, the zero-copy window of one call, is in
// kv_view.hpp.
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
#include "detail/call_pipeline.hpp"
#include "detail/checks.hpp"
#include "detail/head_store.hpp"
#include "detail/input.hpp"
#include "detail/layer.hpp"
#include "detail/observed_call.hpp"
#include "detail/pool_core.hpp"
#include "detail/format/layer_io.hpp"
#include "detail/format/state_io.hpp"
#include "kv_cache_config.hpp"
#include "kv_view.hpp"
#include "parallel.hpp"
#include "tensor.hpp"

namespace veloxquant::cache {

class SqueezeCoordinator;  // squeeze_coordinator.hpp

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
      : config_(detail::with_method(config, detail::Method::standard)) {
    config.validate();
    layer_.storage = storage_of(config);
  }
  /// Leaves its memory pool, if any (its bytes and floor return to the pool).
  virtual ~KVCache() { leave_pool(); }
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
    detail::validate_call(layer_, k, v, &q, "attend");
    detail::check_attend_output(q, v);
    Tensor4<float> out(q.batch, q.heads, q.seq, v.dim);
    float empty = 0.0f;  // an empty output has no data but is not "out == nullptr"
    attend_rows(q, k, v, out.size() ? out.data() : &empty, Layout::head_major);
    return out;
  }

  /// KVzip's scores (SPEC 18, docs/design.md 6.1): every retained row of every head is scored by
  /// the attention these queries give it, the most any of the S queries and any of the G query
  /// heads of its KV head gives it in their softmax over that head's retained rows (no mask:
  /// the engine observes with queries that come after the rows, a re-read of the prompt); a row
  /// keeps the most any observe call since the reset gave it. Changes no row, offset or budget;
  /// KVCacheBuilder::compress then keeps the set's best-observed rows. Only a kvzip cache
  /// (KVzipCache) takes observed scores. Throws std::invalid_argument, changing nothing, for a
  /// cache of another method, a cache that holds no rows yet, or queries that are not
  /// [B, G·H, S, Dk] (this cache's B, H and Dk) or hold a value that is not finite in float32.
  /// queries: [B, Hq = G·H, S, Dk], RoPE applied at their positions
  template <class Q>
  void observe(TensorRef<Q> queries) {
    observe_rows(rows_of(queries, "queries", "observe"), nullptr);
  }
  /// observe for Tensor4s and TensorMaps (see above).
  template <class QX, class = detail::input_element_t<QX>>
  void observe(const QX& queries) {
    observe_rows(rows_of(queries, "queries", "observe"), nullptr);
  }
  /// observe with the re-read's own keys as well (KVzip's own normalisation, docs/design.md 6.1):
  /// each query's softmax then also runs over the keys of the re-read up to its own token, as the
  /// re-read's attention does, though only the retained rows are scored. Throws as observe, and
  /// for keys that are not [B, H, S, Dk] (the queries' B and S) or hold a value that is not
  /// finite or beyond +-2^48 in float32. queries: [B, G·H, S, Dk]; keys: [B, H, S, Dk], RoPE
  /// applied to both
  template <class Q, class K>
  void observe(TensorRef<Q> queries, TensorRef<K> keys) {
    const detail::InputRows q = rows_of(queries, "queries", "observe");
    const detail::InputRows k = rows_of(keys, "keys", "observe");
    observe_rows(q, &k);
  }
  /// observe with the re-read's keys for Tensor4s and TensorMaps (see above).
  template <class QX, class KX, class = detail::input_element_t<QX>,
            class = detail::input_element_t<KX>>
  void observe(const QX& queries, const KX& keys) {
    const detail::InputRows q = rows_of(queries, "queries", "observe");
    const detail::InputRows k = rows_of(keys, "keys", "observe");
    observe_rows(q, &k);
  }

  /// Position the next token will take (tokens per sequence absorbed since the last reset).
  std::int64_t offset() const { return layer_.state.offset; }

  /// The retained set, rows in ascending position: [B, H, n, D] (keys and values).
  /// (Defined after the class, not inline: like run, it reaches the row kernels, which a TU built
  /// against the compiled library only declares; detail/simd_kernels.hpp.)
  KVPair<T> state() const;

  /// Positions of head (b, h)'s retained rows, ascending: [n] (empty before the first call).
  /// Throws std::out_of_range for a head outside [0, B) x [0, H).
  std::vector<std::int64_t> positions(Index b, Index h) const {
    std::vector<std::int64_t> out;
    if (const auto* head = layer_.head_at(b, h)) {
      for (const detail::Slot s : head->order()) out.push_back(head->position(s));
    }
    return out;
  }
  /// Scores of head (b, h)'s retained rows, ascending position: [n] (0 for policies that do not
  /// score; empty before the first call). Throws std::out_of_range outside [0, B) x [0, H).
  std::vector<float> scores(Index b, Index h) const {
    std::vector<float> out;
    if (const auto* head = layer_.head_at(b, h)) {
      for (const detail::Slot s : head->order()) out.push_back(head->score(s));
    }
    return out;
  }

  /// True when trim() can roll back tokens (only the standard cache).
  virtual bool is_trimmable() const { return rule().kind == detail::RuleKind::keep_all; }

  /// Drops the newest min(n, offset()) tokens and returns how many were dropped. Non-trimmable
  /// caches return 0 and change nothing. Throws std::invalid_argument for n < 0.
  virtual std::int64_t trim(std::int64_t n) {
    if (n < 0) throw std::invalid_argument("trim: n (" + std::to_string(n) + ") must be >= 0");
    const detail::CallGate::Entry entry = gate_.enter("trim");
    if (!is_trimmable()) return 0;
    n = std::min(n, layer_.state.offset);
    // With a checkpoint: room to save the rows the compactions below may overwrite.
    for (auto& h : layer_.heads) h.reserve_journal(static_cast<Index>(n));
    for (auto& h : layer_.heads) {
      h.compact();
      h.drop_newest(std::min<Index>(static_cast<Index>(n), h.live()));
    }
    layer_.state.offset -= n;
    return n;
  }

  /// Forgets everything; the next call starts a new sequence at position 0 (B, H, D may change).
  /// In a memory pool the cache stays attached; its floor is claimed again at its next call.
  void reset() {
    const PoolTurn turn(*this, "reset");
    do_reset();
  }

  /// The rows per head the cache evicts down to; -1 for the standard cache (docs/design.md 2.6).
  virtual int layer_budget() const { return rule().budget.value_or(-1); }

  /// Bytes of retained K and V over all heads as stored: sizeof(T) per element, or a quantized
  /// row's codes, scales and offsets (rounded up to whole elements of T).
  std::size_t kept_bytes() const { return layer_.kept_bytes(); }
  /// Bytes the cache would hold if every token were kept: B·H·offset()·(Dk + Dv)·sizeof(T).
  std::size_t full_seq_bytes() const {
    const detail::LayerDims& d = layer_.state.dims;
    return static_cast<std::size_t>(d.batch * d.heads) *
           static_cast<std::size_t>(layer_.state.offset) *
           static_cast<std::size_t>(d.key_dim + d.value_dim) * sizeof(T);
  }
  /// full_seq_bytes() / kept_bytes(); 1.0 while nothing is kept.
  double compression_ratio() const {
    const std::size_t kept = kept_bytes();
    return kept == 0 ? 1.0 : static_cast<double>(full_seq_bytes()) / static_cast<double>(kept);
  }
  /// B·H·S summed over calls since the last reset (as the reference counts).
  std::int64_t tokens_seen() const { return layer_.state.tokens_seen; }
  /// Rows retained in head (b=0, h=0).
  std::int64_t tokens_kept() const {
    return layer_.heads.empty() ? 0 : layer_.heads.front().live();
  }
  /// Rows retained in head (b, h) (adaptive heads differ, SPEC 14; 0 before the first call).
  /// Throws std::out_of_range for a head outside [0, B) x [0, H).
  std::int64_t head_rows(Index b, Index h) const {
    const auto* head = layer_.head_at(b, h);
    return head ? head->live() : 0;
  }
  /// The most rows any head holds (tokens_kept() unless adaptive heads differ; 0 before the first
  /// call).
  std::int64_t max_head_rows() const { return layer_.live_rows(); }
  /// Whether the heads hold different numbers of rows (only adaptive heads can, SPEC 14): then
  /// update_and_fetch(_into) and state() refuse, and a view's rows() throws.
  bool ragged_heads() const { return layer_.ragged(); }

  /// Heap bytes the cache holds right now (rows, bookkeeping, scratch, by capacity).
  std::size_t heap_bytes() const { return layer_.heap_bytes(); }

  /// Lets calls spread their heads over the engine's threads (docs/design.md 7.3): `run` executes
  /// up to `workers` tasks at once. Without one (the default) heads run serially. Results are
  /// bit-identical either way. Throws std::invalid_argument for workers < 1.
  void set_parallel_for(ParallelFor run, int workers) {
    if (workers < 1) {
      throw std::invalid_argument("set_parallel_for: workers (" + std::to_string(workers) +
                                  ") must be >= 1");
    }
    layer_.threads.run = std::move(run);
    layer_.threads.workers = layer_.threads.run ? workers : 1;
  }
  /// Switches the use of the parallel-for given to set_parallel_for on or off (default on).
  void set_parallel_heads(bool on) { layer_.threads.on = on; }
  bool parallel_heads() const { return layer_.threads.on; }

  /// The configuration the cache was built with; its `method` names the cache's own policy
  /// ("standard" for this class, whatever method the config given to it named: the builder gives
  /// a model's non-attention layers the model's config).
  const KVCacheConfig& config() const { return config_; }

  /// Batch size, KV heads and head dims fixed by the first call (0 before it).
  Index batch() const { return layer_.state.dims.batch; }
  Index heads() const { return layer_.state.dims.heads; }
  Index key_dim() const { return layer_.state.dims.key_dim; }
  Index value_dim() const { return layer_.state.dims.value_dim; }

  // ---- its state: what a prompt cache saves of it (docs/design.md G) -------------------------

  /// Writes the cache's state after the config the container wrote: the descriptor (state flags,
  /// budget, dims, offset, tokens_seen, rows per head), then, when it holds rows, one block per
  /// head (b-major): positions, scores where the policy scores rows, keys, values, in the slot
  /// order compaction would leave (detail/format/layer_io.hpp). Only reads the cache. A class that
  /// adds state overrides this and read_state, its fields after the base descriptor's.
  virtual void write_state(detail::StateWriter& w) const {
    detail::write_descriptor(layer_, w);
    w.end_descriptor();
    detail::write_heads(layer_, w, detail::NoExtra{});
  }
  /// Restores what write_state wrote into this cache, which must be of the class and config the
  /// state was saved from (the loader builds a fresh one from the saved config). Every rule a
  /// cache keeps between calls is checked before anything changes (docs/design.md G, "what a
  /// loader checks"): a state that breaks one throws std::invalid_argument naming it, and the
  /// reader's own errors (a truncated or corrupt file) pass through; the cache is then unchanged.
  virtual void read_state(detail::StateReader& r) {
    SavedState s = detail::read_descriptor<T>(r);
    r.end_descriptor();
    detail::check_saved_flags(s);
    detail::check_descriptor(layer_, s, true);
    detail::NoExtra none;
    detail::read_heads(layer_, r, s, none);
    install(s);
  }
  /// Adds to `links` what the cache's state refers to outside itself, in the order write_state
  /// refers to it (a squeeze layer's coordinator); the container saves each of those once.
  virtual void link_state(detail::StateLinks& /*links*/) const {}
  /// The coordinator this cache reports to (a squeeze layer's), or nullptr: the set operations
  /// of KVCacheBuilder checkpoint, roll back and reset each distinct one once.
  virtual SqueezeCoordinator* shared_coordinator() const { return nullptr; }

  // ---- a memory pool (SPEC 19, docs/design.md 10.5): MemoryPool and KVCacheBuilder's --------
  // ---- pooled overloads attach a set through these; an engine uses those. -------------------

  /// A call's or a set operation's turn in the cache's pool (nothing outside one): from its
  /// start the pool takes no rows of the cache; at its end the pool counts the cache's bytes and,
  /// above its cap, takes rows (detail::PoolCore::begin, end).
  class PoolTurn {
   public:
    /// Begins a turn that claims no floor. Throws std::bad_alloc (the pool's scratch grows).
    PoolTurn(const KVCache& c, const char* api) : PoolTurn(c, 0, 0, 0, 0, api) {}
    /// Begins a turn: `claim` floor bytes (the cache's first call), a head may hold `extra` more
    /// rows than now when it ends, of `heads` heads and head dim `dim` at the most. Throws
    /// std::length_error when the claim does not fit beside the pool's other floors, and
    /// std::bad_alloc.
    PoolTurn(const KVCache& c, std::size_t claim, Index extra, Index heads, Index dim,
             const char* api)
        : c_(&c), core_(c.seat_.core), unwinding_(std::uncaught_exceptions()) {
      if (!core_) return;
      const detail::Layer<T>& L = c.layer_;
      detail::PoolNeed need;
      Index cap = 0;
      for (const auto& h : L.heads) cap = std::max(cap, h.capacity());
      need.rows = std::max(cap, L.max_physical() + extra);
      need.heads = std::max<Index>(static_cast<Index>(L.heads.size()), heads);
      need.dim = detail::padded_dim(
          std::max({L.state.dims.key_dim, L.state.dims.value_dim, dim}));
      core_->begin(&c.seat_, claim, need, api);
    }
    PoolTurn(PoolTurn&& o) noexcept
        : c_(o.c_), core_(std::move(o.core_)), unwinding_(o.unwinding_) {
      o.core_.reset();
    }
    PoolTurn(const PoolTurn&) = delete;
    PoolTurn& operator=(const PoolTurn&) = delete;
    PoolTurn& operator=(PoolTurn&&) = delete;
    ~PoolTurn() {
      if (!core_) return;
      // A cache whose shape is unknown (reset, or its first call failed) claims the lower bound
      // it attached with; a turn that failed (an exception unwinds it) gives no row up itself.
      core_->end(&c_->seat_, !c_->layer_.state.dims.known,
                 std::uncaught_exceptions() > unwinding_);
    }

   private:
    const KVCache* c_;
    std::shared_ptr<detail::PoolCore> core_;  // held: a release during the turn leaves it valid
    int unwinding_;
  };

  /// Whether the cache is attached to a memory pool.
  bool in_pool() const { return seat_.core != nullptr; }
  /// The pool the cache is attached to (null outside one).
  const std::shared_ptr<detail::PoolCore>& pool_core() const { return seat_.core; }
  /// What attaching the cache to a pool claims: the floor bytes of its heads if its shape is
  /// known (else a lower bound, a head of dim 1: its first call claims the rest), and what a trim
  /// of it needs. Throws std::invalid_argument for a standard cache (it gives no row up).
  detail::PoolCore::Join pool_join(const char* api) const {
    if (rule().kind == detail::RuleKind::keep_all) {
      throw std::invalid_argument(std::string(api) +
                                  ": a standard cache cannot join a memory pool (it never evicts, "
                                  "so the pool could not take its rows); use an evicting method");
    }
    const detail::LayerDims& d = layer_.state.dims;
    detail::PoolCore::Join j{&seat_, 0, 0, detail::PoolNeed{}};
    j.provisional = static_cast<std::size_t>(pool_floor()) * 2 * sizeof(T);
    j.floor_bytes = d.known ? floor_bytes(d.batch * d.heads, d.key_dim, d.value_dim)
                            : j.provisional;
    Index cap = 0;
    for (const auto& h : layer_.heads) cap = std::max(cap, h.capacity());
    j.need = detail::PoolNeed{cap, static_cast<Index>(layer_.heads.size()),
                              detail::padded_dim(std::max(d.key_dim, d.value_dim))};
    return j;
  }
  /// Takes its seat in `core`, which has attached it (detail::PoolCore::attach).
  void seat_in_pool(std::shared_ptr<detail::PoolCore> core) noexcept {
    seat_.core = std::move(core);
    layer_.state.rule.pooled = true;
  }
  /// Leaves its pool, if any: its bytes and floor return to the pool.
  void leave_pool() noexcept {
    if (!seat_.core) return;
    seat_.core->detach(&seat_);
    seat_.core.reset();
    layer_.state.rule.pooled = false;
  }
  /// The rows every head keeps at least in a pool: pool_floor_rows plus the policy's sinks, and
  /// at least 1 (a head after a call holds a row).
  Index pool_floor() const {
    return std::max<Index>(
        1, static_cast<Index>(config_.pool_floor_rows) + std::max(0, rule().n_sink));
  }

  // ---- the set's operations (docs/design.md 10): KVCacheBuilder's fork, checkpoint and ------
  // ---- rollback run these on every cache of a set; an engine calls the builder's. ------------

  /// Holds the cache's call gate for a set operation; throws std::logic_error while a call runs.
  [[nodiscard]] detail::CallGate::Entry enter_set_operation(const char* api) const {
    return gate_.enter(api);
  }
  /// Fork (KVCacheBuilder::fork, docs/design.md 10.1): makes this cache, fresh from the factory
  /// with `src`'s config (so of its class: the builder checks KVCacheFactory::builds_class_of),
  /// an independent copy of `src`'s state: rows (only the retained ones, compacted), positions,
  /// scores, the layer's state (budget, offset, counters, the pending re-budget), the class's own
  /// state and the engine's parallel-for. Throws std::invalid_argument, changing nothing, when
  /// `src` is of another method. Only allocates before it changes this cache; `src` is only read.
  void fork_from(const KVCache& src, detail::StateLinks& links) {
    if (src.config_.method != config_.method) {
      throw std::invalid_argument("fork_from: the source's method '" + src.config_.method +
                                  "' is not this cache's '" + config_.method + "'");
    }
    do_fork_from(src, links);
  }
  /// Compress (KVCacheBuilder::compress, SPEC 18, docs/design.md 6.1): the builder holds every
  /// cache's call gate and runs this on the set. Its kvzip caches keep ceil(keep x the rows they
  /// hold) rows together, the best-observed over all their heads (detail::plan_compress); the
  /// standard caches of a model's non-attention layers are left as they are. Throws
  /// std::invalid_argument, changing nothing, for keep outside (0, 1], a cache of another method,
  /// or a kvzip cache no observe call has scored since its reset.
  /// (Defined after the class, not inline: with VELOXQUANT_EXTERN_TEMPLATES a consumer TU does
  /// not compile the selection; extern_templates.hpp.)
  static void compress_set(const std::vector<KVCache*>& set, double keep);

  /// Checkpoint (KVCacheBuilder::checkpoint, docs/design.md 10.2): marks the cache's state under
  /// `token` (the set's), replacing a live checkpoint. The heads copy their bookkeeping and
  /// journal the rows later calls overwrite. Allocates only; if it throws, the cache holds no
  /// checkpoint and its state is unchanged.
  void take_checkpoint(std::uint64_t token) { do_take_checkpoint(token); }
  /// The token of the live checkpoint, or empty (none taken, dropped by a reset or a load, or
  /// consumed by a rollback).
  std::optional<std::uint64_t> checkpoint_token() const {
    const auto& m = layer_.mark;
    return m.live ? std::optional<std::uint64_t>(m.token) : std::nullopt;
  }
  /// Returns the cache to its live checkpoint and consumes it; without one it does nothing.
  /// Never throws (the heads kept the room, docs/design.md 10.2).
  void roll_back() noexcept {
    if (!layer_.mark.live) return;
    do_roll_back();
    layer_.state.rule.pooled = seat_.core != nullptr;  // as it is now, not at the checkpoint
  }
  /// Forgets the live checkpoint, if any.
  void drop_checkpoint() noexcept { layer_.drop_checkpoint(); }

 protected:
  /// The set's operations as a class that adds state extends them: it overrides each, calls the
  /// base's and adds its own (a squeeze layer takes its coordinator's copy from `links`,
  /// StateLinks::counterpart). fork_from has checked that `src` is of this cache's method;
  /// do_roll_back runs only with a live checkpoint.
  virtual void do_fork_from(const KVCache& src, detail::StateLinks& /*links*/) {
    layer_.fork_from(src.layer_);
  }
  virtual void do_take_checkpoint(std::uint64_t token) { layer_.checkpoint(token); }
  /// reset()'s own part: a class that adds state resets it after the base's.
  virtual void do_reset() {
    layer_.clear();  // and its checkpoint
  }
  virtual void do_roll_back() noexcept { layer_.roll_back(); }

  /// A policy's cache: `rule` says what the calls do with rows (docs/design.md 7.1).
  /// `config` gives the storage of rows (key_bits, value_bits, quant_group; docs/design.md 2.9).
  /// `method` names the policy (config().method).
  KVCache(const detail::Rule& rule, const KVCacheConfig& config, detail::Method method)
      : config_(detail::with_method(config, method)) {
    layer_.state.rule = rule;
    layer_.storage = storage_of(config);
  }

  /// Hooks of the call pipeline (detail::CallHooks, detail/call_pipeline.hpp): before anything
  /// changes, may inspect the call's keys ([B, H, S, Dk], any input type) and throw...
  virtual void inspect_call(const detail::InputRows& /*keys*/) {}
  /// ... and after storage and scratch are reserved, before any row is touched: may throw only
  /// before it changes anything; may change the budget (set_budget).
  virtual void start_call() {}

  const detail::Rule& rule() const { return layer_.state.rule; }
  // Policy accessors, published by the classes they mean something for (`using`).
  /// The budget in force (rows per head), or empty while it is unknown.
  std::optional<int> budget() const { return rule().budget; }
  /// Leading positions never evicted.
  int n_sink() const { return rule().n_sink; }
  /// Newest rows never evicted under the current budget (0 while the budget is unknown).
  int protected_recent() const { return rule().protected_recent(); }
  /// Per-token decay of cumulative scores.
  float decay() const { return rule().decay; }
  /// Makes `budget` the budget in force; the heads are brought within it (docs/design.md 4.5) at
  /// the start of the call in progress, or of the next one.
  void set_budget(std::optional<int> budget) {
    layer_.state.rule.budget = budget;
    layer_.state.rebudget = true;
  }

  /// What the layer holds: a class that adds state builds its write_state and read_state from
  /// detail/format/layer_io.hpp's parts over it.
  const detail::Layer<T>& layer() const { return layer_; }
  /// A state read and not yet installed (detail/format/state_checks.hpp).
  using SavedState = detail::SavedCache<T>;
  /// Makes the cache stand where the saved one stood (its heads leave `s`).
  void install(SavedState& s) { detail::install(layer_, s); }

 private:
  // The rows of an input (`what` names it in errors); throws std::invalid_argument for a
  // negative dimension, an element count beyond Index, or null data with a non-zero size.
  template <class X>
  static detail::InputRows rows_of(const X& x, const char* what, const char* api) {
    return detail::rows_of(TensorRef<detail::input_element_t<X>>(x), what, api);
  }

  // Every update API's entry: the tensors' rows taken in a fixed order (keys, values, then
  // queries), so the first malformed tensor named is the same whichever order a compiler
  // evaluates function arguments in; then run().
  template <class K, class V>
  KVView<T> run_tensors(const char* api, const K& keys, const V& values, KVPair<T>* out) {
    const detail::InputRows k = rows_of(keys, "keys", api);
    const detail::InputRows v = rows_of(values, "values", api);
    return run(detail::Call{k, v, nullptr, api, nullptr}, out);
  }
  template <class K, class V, class Q>
  KVView<T> run_tensors(const char* api, const K& keys, const V& values, const Q& queries,
                        KVPair<T>* out) {
    const detail::InputRows k = rows_of(keys, "keys", api);
    const detail::InputRows v = rows_of(values, "values", api);
    const detail::InputRows q = rows_of(queries, "queries", api);
    return run(detail::Call{k, v, &q, api, nullptr}, out);
  }
  // observe's body (detail/observed_call.hpp), behind the call gate; `keys`: the re-read's own,
  // or null. (Defined after the class, not inline, as run.)
  void observe_rows(const detail::InputRows& queries, const detail::InputRows* keys);
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
    const detail::AttendOut att =
        detail::attend_out(out, queries, values, layout == Layout::head_major);
    (void)run(detail::Call{keys, values, &queries, "attend", &att}, nullptr);
  }

  // The one body of every update API (detail::run_call, after the call gate: one call at a
  // time, a second call while this one runs throws, changing nothing); `out` (fetch and
  // fetch_into) receives a copy of the window.
  // (Defined after the class, not inline: a TU built with VELOXQUANT_EXTERN_TEMPLATES then
  // does not compile the pipeline behind the API's member templates; extern_templates.hpp.)
  KVView<T> run(const detail::Call& call, KVPair<T>* out);

  // The pipeline's hooks, as this cache's virtual functions.
  class Hooks final : public detail::CallHooks {
   public:
    explicit Hooks(KVCache& c) : c_(c) {}
    void inspect_call(const detail::InputRows& keys) override { c_.inspect_call(keys); }
    void start_call() override { c_.start_call(); }
    void abandon_call() override { c_.do_reset(); }

   private:
    KVCache& c_;
  };
  KVView<T> make_view(const detail::CallView& v, const detail::InputRows& keys,
                      const detail::InputRows& values) const {
    const detail::LayerDims& d = layer_.state.dims;
    if (!d.known)
      return KVView<T>(&layer_.heads, keys.batch, keys.heads, keys.dim, values.dim, 0, 0);
    // Adaptive and compressed KVzip heads may differ: each then shows its own slots in use (the
    // copy of a quantized window is laid out at the longest head's rows).
    const Index stride = rule().per_head_rows() ? layer_.max_physical() : v.rows;
    bool ragged = false;
    for (const auto& h : layer_.heads) ragged = ragged || h.physical() != stride;
    return KVView<T>(&layer_.heads, d.batch, d.heads, d.key_dim, d.value_dim, ragged ? -1 : stride,
                     v.new_rows, v.copy ? layer_.copy.view_keys() : nullptr,
                     v.copy ? layer_.copy.view_values() : nullptr, stride);
  }

  static detail::RowStorage storage_of(const KVCacheConfig& c) {
    return detail::RowStorage{c.key_bits,          c.value_bits,
                              c.quant_group,       c.key_axis == "channel",
                              c.value_axis == "channel", c.quant_block};
  }

  // Bytes `heads` heads of these dims hold at most at their pool floor.
  std::size_t floor_bytes(Index heads, Index dk, Index dv) const {
    const std::size_t head = detail::RowBuffer<T>::max_held_bytes(
        layer_.storage.key_format(dk), layer_.storage.value_format(dv), pool_floor());
    return static_cast<std::size_t>(heads) * head;
  }
  // What the pool reads of the cache (under its lock, with no call running on the cache).
  detail::PoolRows pool_rows() const noexcept {
    detail::PoolRows r;
    r.bytes = layer_.kept_bytes();
    if (layer_.heads.empty()) return r;
    r.heads = static_cast<Index>(layer_.heads.size());
    for (const auto& h : layer_.heads) {
      r.max_rows = std::max(r.max_rows, h.live());
      r.total_rows += h.live();
    }
    r.floor = pool_floor();
    r.row_bytes = layer_.heads.front().slot_bytes();
    return r;
  }
  // The pool's trim of the cache (detail::pool_trim_layer). (Defined after the class, not
  // inline, as run.)
  void pool_trim(Index rows, detail::Scratch& sc) noexcept;
  void pool_candidates(std::uint32_t seat, std::vector<detail::PoolRow>& out) const noexcept;
  void pool_drop(const detail::PoolRow* rows, std::size_t n, detail::Scratch& sc) noexcept;
  // The cache's seat in a memory pool: what the pool asks of it.
  class Seat final : public detail::PoolClient {
   public:
    explicit Seat(KVCache& c) : c_(c) {}
    detail::PoolRows pool_rows() const noexcept override { return c_.pool_rows(); }
    void pool_trim(Index rows, detail::Scratch& sc) noexcept override { c_.pool_trim(rows, sc); }
    void pool_candidates(std::uint32_t seat,
                         std::vector<detail::PoolRow>& out) const noexcept override {
      c_.pool_candidates(seat, out);
    }
    void pool_drop(const detail::PoolRow* rows, std::size_t n,
                   detail::Scratch& sc) noexcept override {
      c_.pool_drop(rows, n, sc);
    }
    std::shared_ptr<detail::PoolCore> core;  // null outside a pool

   private:
    KVCache& c_;
  };

  KVCacheConfig config_;
  detail::Layer<T> layer_;
  mutable detail::CallGate gate_;  // refuses a call that starts while another runs
  mutable Seat seat_{*this};
};

template <class T>
KVPair<T> KVCache<T>::state() const {
  detail::check_dense(layer_, "state");
  KVPair<T> out;
  detail::PairOut<KVPair<T>> sink(out);
  detail::copy_retained(layer_, sink);
  return out;
}

template <class T>
KVView<T> KVCache<T>::run(const detail::Call& call, KVPair<T>* out) {
  const detail::CallGate::Entry entry = gate_.enter(call.api);
  // In a pool, a cache's first call claims its heads' floors (its shape is known from now on):
  // the call is validated first, so a refused call names its input, not the pool.
  std::size_t claim = 0;
  const Index S = call.keys.seq;
  if (seat_.core && !layer_.state.dims.known && S > 0) {
    detail::validate_call(layer_, call.keys, call.values, call.queries, call.api);
    claim = floor_bytes(call.keys.batch * call.keys.heads, call.keys.dim, call.values.dim);
  }
  const PoolTurn turn(*this, claim, S, call.keys.batch * call.keys.heads,
                      std::max(call.keys.dim, call.values.dim), call.api);
  Hooks hooks(*this);
  std::optional<detail::PairOut<KVPair<T>>> sink;
  if (out) sink.emplace(*out);
  const detail::CallView v = detail::run_call(layer_, call, sink ? &*sink : nullptr, hooks);
  return make_view(v, call.keys, call.values);
}

template <class T>
void KVCache<T>::compress_set(const std::vector<KVCache*>& set, double keep) {
  const char* api = "KVCacheBuilder::compress";
  if (!(keep > 0.0 && keep <= 1.0)) {
    throw std::invalid_argument(std::string(api) + ": keep (" + std::to_string(keep) +
                                ") must be in (0, 1]");
  }
  std::vector<KVCache*> kvzip;
  std::vector<const detail::Layer<T>*> layers;
  for (std::size_t i = 0; i < set.size(); ++i) {
    const KVCache& c = *set[i];
    const detail::RuleKind kind = c.rule().kind;
    if (kind == detail::RuleKind::keep_all) continue;
    if (kind != detail::RuleKind::observed) {
      throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                  " is a '" + c.config_.method +
                                  "' cache; compress keeps the rows of kvzip caches");
    }
    if (!c.rule().observed) {
      throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                  " has not been observed since its reset (call observe with "
                                  "the queries of a re-read of its rows first)");
    }
    kvzip.push_back(set[i]);
    layers.push_back(&c.layer_);
  }
  const std::vector<std::vector<std::vector<detail::Slot>>> drop =
      detail::plan_compress(layers, keep);
  for (std::size_t i = 0; i < kvzip.size(); ++i) {
    detail::reserve_compress(kvzip[i]->layer_, drop[i]);
  }
  // No-throw from here on.
  for (std::size_t i = 0; i < kvzip.size(); ++i) {
    detail::apply_compress(kvzip[i]->layer_, drop[i]);
  }
}

template <class T>
void KVCache<T>::pool_trim(Index rows, detail::Scratch& sc) noexcept {
  detail::pool_trim_layer(layer_, rows, pool_floor(), sc);
}
template <class T>
void KVCache<T>::pool_candidates(std::uint32_t seat,
                                 std::vector<detail::PoolRow>& out) const noexcept {
  detail::pool_candidates_layer(layer_, pool_floor(), seat, out);
}
template <class T>
void KVCache<T>::pool_drop(const detail::PoolRow* rows, std::size_t n,
                           detail::Scratch& sc) noexcept {
  detail::pool_drop_layer(layer_, rows, n, sc);
}

template <class T>
void KVCache<T>::observe_rows(const detail::InputRows& queries, const detail::InputRows* keys) {
  const detail::CallGate::Entry entry = gate_.enter("observe");
  const PoolTurn turn(*this, "observe");
  detail::observe_layer(layer_, queries, keys, config_.method.c_str());
}

}  // namespace veloxquant::cache
