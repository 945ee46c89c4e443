// veloxquant — KVCache<T>: the standard append-only cache and the base of every eviction cache
// (mirrors mlx_lm's KVCache), plus KVView<T>, the zero-copy window of one call
// (docs/design.md 2.2, 2.3).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "detail/checks.hpp"
#include "detail/head_store.hpp"
#include "detail/queries.hpp"
#include "kv_cache_config.hpp"
#include "tensor.hpp"

namespace veloxquant::cache {

namespace detail {

/// While alive, Eigen products started on this thread (and in OpenMP teams it forks) run
/// single-threaded: OpenMP's thread-count setting is per thread, so the caller's own setting and
/// other threads are untouched, and it is restored on destruction.
class OneEigenThread {
 public:
#ifdef _OPENMP
  OneEigenThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneEigenThread() { omp_set_num_threads(saved_); }

 private:
  int saved_;
#else
  OneEigenThread() = default;
#endif
 public:
  OneEigenThread(const OneEigenThread&) = delete;
  OneEigenThread& operator=(const OneEigenThread&) = delete;
};

}  // namespace detail

/// Zero-copy view of the rows a call hands back: one block of `rows()` rows per (b, h), living in
/// the cache's own storage. Valid until the next non-const call on the cache. Rows retained before
/// the call may come in any order (positions() says which is which); the rows of the call come
/// last, in arrival order.
template <class T>
class KVView {
 public:
  using RowsMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  using PositionsMap = Eigen::Map<const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>>;

  KVView(const std::vector<detail::HeadStore<T>>* heads, Eigen::Index batch, Eigen::Index n_heads,
         Eigen::Index key_dim, Eigen::Index value_dim, Eigen::Index rows, Eigen::Index new_rows)
      : heads_(heads), batch_(batch), n_heads_(n_heads), key_dim_(key_dim), value_dim_(value_dim),
        rows_(rows), new_rows_(new_rows) {}

  /// Rows per head in this window (the same for every head).
  Eigen::Index rows() const { return rows_; }
  /// Rows of the current call among them (the last new_rows() rows).
  Eigen::Index new_rows() const { return new_rows_; }
  Eigen::Index batch() const { return batch_; }
  Eigen::Index heads() const { return n_heads_; }
  Eigen::Index key_dim() const { return key_dim_; }
  Eigen::Index value_dim() const { return value_dim_; }

  /// Keys of head (b, h): [rows(), Dk].
  RowsMap keys(Eigen::Index b, Eigen::Index h) const {
    check(b, h);
    return RowsMap(rows_ ? head(b, h).keys_data() : nullptr, rows_, key_dim_);
  }
  /// Values of head (b, h): [rows(), Dv].
  RowsMap values(Eigen::Index b, Eigen::Index h) const {
    check(b, h);
    return RowsMap(rows_ ? head(b, h).values_data() : nullptr, rows_, value_dim_);
  }
  /// Position of each row of head (b, h): [rows()].
  PositionsMap positions(Eigen::Index b, Eigen::Index h) const {
    check(b, h);
    return PositionsMap(rows_ ? head(b, h).positions_data() : nullptr, rows_);
  }

 private:
  // Throws std::out_of_range for a head outside [0, B) x [0, H) (also on an empty view).
  void check(Eigen::Index b, Eigen::Index h) const {
    if (b < 0 || b >= batch_ || h < 0 || h >= n_heads_) {
      throw std::out_of_range("KVView: head (" + std::to_string(b) + ", " + std::to_string(h) +
                              ") out of range");
    }
  }
  const detail::HeadStore<T>& head(Eigen::Index b, Eigen::Index h) const {
    check(b, h);
    return (*heads_)[static_cast<std::size_t>(b * n_heads_ + h)];
  }

  const std::vector<detail::HeadStore<T>>* heads_;
  Eigen::Index batch_, n_heads_, key_dim_, value_dim_, rows_, new_rows_;
};

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
  KVCache() = default;
  /// An empty standard cache; validates `config`.
  explicit KVCache(const KVCacheConfig& config) { config.validate(); }
  virtual ~KVCache() = default;
  KVCache(const KVCache&) = default;
  KVCache& operator=(const KVCache&) = default;
  KVCache(KVCache&&) noexcept = default;
  KVCache& operator=(KVCache&&) noexcept = default;

  /// Absorbs a call's rows and returns the rows retained before it plus all of its own rows, in
  /// ascending position. keys: [B, H, S, Dk], values: [B, H, S, Dv]; returns [B, H, n, D].
  virtual KVPair<T> update_and_fetch(const Tensor4<T>& keys, const Tensor4<T>& values) {
    KVPair<T> out;
    fetch_into(keys, values, nullptr, out, "update_and_fetch");
    return out;
  }

  /// update_and_fetch into caller-owned tensors: `out` is resized only when its shape changes, so
  /// a decode loop that passes the same `out` every step copies without allocating (fresh output
  /// tensors cost page faults that can exceed the copy itself). Same result as update_and_fetch.
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv]; out: [B, H, n, Dk] and [B, H, n, Dv]
  void update_and_fetch_into(const Tensor4<T>& keys, const Tensor4<T>& values, KVPair<T>& out) {
    fetch_into(keys, values, nullptr, out, "update_and_fetch_into");
  }

  /// Converting overload: inputs of another element type (half, bfloat16, float, double) are
  /// converted to T first. keys: [B, H, S, Dk], values: [B, H, S, Dv]
  template <class U>
  KVPair<T> update_and_fetch(const Tensor4<U>& keys, const Tensor4<U>& values) {
    return update_and_fetch(to_storage(keys), to_storage(values));
  }

  /// Same work as update_and_fetch, but returns a view into the cache's own storage.
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv]
  KVView<T> update_and_view(const Tensor4<T>& keys, const Tensor4<T>& values) {
    return update(keys, values, nullptr, "update_and_view");
  }

  /// Converting overload of update_and_view.
  template <class U>
  KVView<T> update_and_view(const Tensor4<U>& keys, const Tensor4<U>& values) {
    return update_and_view(to_storage(keys), to_storage(values));
  }

  /// Real-query scoring ("observed attention", docs/design.md 4.6): the same call, with the queries
  /// the engine attends with for these tokens (RoPE applied). Query head j belongs to KV head
  /// j / G. The scored policies rank rows by this real attention instead of the key-as-query proxy
  /// (H2O core: mass of each token's G query heads over the rows it attends to, eviction once per
  /// call; TOVA: the current token's attention; SnapKV: the last obs_window tokens'); StreamingLLM
  /// and the standard cache validate and ignore them. Keys/values of any input type are converted
  /// to T, queries to float32. Throws std::invalid_argument (cache unchanged) for a query tensor
  /// that is not [B, G·H, S, Dk] or holds a non-finite value.
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk]
  template <class U, class Q>
  KVPair<T> update_and_fetch(const Tensor4<U>& keys, const Tensor4<U>& values,
                             const Tensor4<Q>& queries) {
    KVPair<T> out;
    with_queries(keys, values, queries, [&](const auto& k, const auto& v, const auto* q) {
      fetch_into(k, v, q, out, "update_and_fetch");
    });
    return out;
  }

  /// update_and_view with real queries (see update_and_fetch above).
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk]
  template <class U, class Q>
  KVView<T> update_and_view(const Tensor4<U>& keys, const Tensor4<U>& values,
                            const Tensor4<Q>& queries) {
    return with_queries(keys, values, queries, [&](const auto& k, const auto& v, const auto* q) {
      return update(k, v, q, "update_and_view");
    });
  }

  /// update_and_fetch_into with real queries (see update_and_fetch above).
  /// keys: [B, H, S, Dk], values: [B, H, S, Dv], queries: [B, Hq = G·H, S, Dk];
  /// out: [B, H, n, Dk] and [B, H, n, Dv]
  template <class U, class Q>
  void update_and_fetch_into(const Tensor4<U>& keys, const Tensor4<U>& values,
                             const Tensor4<Q>& queries, KVPair<T>& out) {
    with_queries(keys, values, queries, [&](const auto& k, const auto& v, const auto* q) {
      fetch_into(k, v, q, out, "update_and_fetch_into");
    });
  }

  /// Position the next token will take (tokens per sequence absorbed since the last reset).
  std::int64_t offset() const { return offset_; }

  /// The retained set, rows in ascending position: [B, H, n, D] (keys and values).
  KVPair<T> state() const {
    return copy_rows([](const detail::HeadStore<T>& h) -> const std::vector<detail::Slot>& {
      return h.order();
    });
  }

  /// True when trim() can roll back tokens (only the standard cache).
  virtual bool is_trimmable() const { return true; }

  /// Drops the newest min(n, offset()) tokens and returns how many were dropped. Non-trimmable
  /// caches return 0 and change nothing. Throws std::invalid_argument for n < 0.
  virtual std::int64_t trim(std::int64_t n) {
    if (n < 0) throw std::invalid_argument("trim: n (" + std::to_string(n) + ") must be >= 0");
    if (!is_trimmable()) return 0;
    n = std::min(n, offset_);
    for (auto& h : heads_) {
      h.compact();
      h.drop_newest(std::min<Index>(static_cast<Index>(n), h.live()));
    }
    offset_ -= n;
    return n;
  }

  /// Forgets everything; the next call starts a new sequence at position 0 (B, H, D may change).
  virtual void reset() {
    heads_.clear();
    dims_ = detail::LayerDims{};
    offset_ = 0;
    tokens_seen_ = 0;
  }

  /// Bytes of retained K and V over all heads (sizeof(T) per element).
  std::size_t kept_bytes() const {
    std::size_t rows = 0;
    for (const auto& h : heads_) rows += static_cast<std::size_t>(h.live());
    return rows * row_bytes();
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

  /// Heap bytes the cache holds right now (row storage, bookkeeping and capacity).
  virtual std::size_t heap_bytes() const {
    std::size_t total = heads_.capacity() * sizeof(detail::HeadStore<T>);
    for (const auto& h : heads_) total += h.heap_bytes();
    return total;
  }

  /// Lets calls spread the B·H heads over OpenMP threads (when built with OpenMP; default on).
  /// Results are identical either way.
  void set_parallel_heads(bool on) { parallel_heads_ = on; }
  bool parallel_heads() const { return parallel_heads_; }

  /// Batch size, KV heads and head dims fixed by the first call (0 before it).
  Index batch() const { return dims_.batch; }
  Index heads() const { return dims_.heads; }
  Index key_dim() const { return dims_.key_dim; }
  Index value_dim() const { return dims_.value_dim; }

 protected:
  /// Before anything is mutated: may inspect the keys and throw. keys: [B, H, S, Dk]
  virtual void inspect_call(const Tensor4<T>& /*keys*/) {}
  /// After capacity is reserved, before the rows are appended. May throw only before it changes
  /// the cache's logical state (strong guarantee).
  virtual void prepare_call(const Tensor4<T>& /*keys*/) {}
  /// Takes the `count` rows just appended at slots [first, first + count) of `head` into the live
  /// set (and evicts). The standard cache keeps them all. Must not throw.
  /// `worker` (0 <= worker < workers()) names the scratch to use; heads may run in parallel.
  /// `queries` is this head's slice of the call's queries ([G, count, Dk] float32), empty when the
  /// call brought none.
  virtual void absorb_rows(detail::HeadStore<T>& head, detail::Slot first, Index count,
                           int /*worker*/, const detail::QuerySlice& /*queries*/) {
    for (Index i = 0; i < count; ++i) head.push_live(static_cast<detail::Slot>(first + i));
  }
  /// Reserves the policy's scratch of `workers` workers for a call holding up to `rows` rows per
  /// head, `new_rows` of them new, with `groups` query heads per KV head (0: no queries); may throw.
  virtual void reserve_scratch(Index /*rows*/, Index /*key_dim*/, Index /*new_rows*/,
                               int /*workers*/, Index /*groups*/) {}
  /// Workers the next call may use: the OpenMP thread count when built with OpenMP and
  /// parallel heads are enabled, else 1.
  int workers() const {
#ifdef _OPENMP
    return parallel_heads_ ? std::max(1, omp_get_max_threads()) : 1;
#else
    return 1;
#endif
  }
  /// Rows a head needs in steady state (budget + 1), or max() when unbounded. Sizes growth.
  virtual Index steady_rows() const { return std::numeric_limits<Index>::max(); }

  /// Converts an input tensor to the storage type. t: [B, H, S, D]
  template <class U>
  static Tensor4<T> to_storage(const Tensor4<U>& t) {
    static_assert(is_input_type_v<U>, "veloxquant: inputs must be half, bfloat16, float or double");
    return t.template cast<T>();
  }

  std::vector<detail::HeadStore<T>>& head_stores() { return heads_; }
  const std::vector<detail::HeadStore<T>>& head_stores() const { return heads_; }
  const detail::LayerDims& dims() const { return dims_; }

 private:
  // Converts keys and values to T and queries to float32 where their types differ (no copy
  // otherwise), then returns f(keys, values, &queries).
  template <class U, class Q, class F>
  static decltype(auto) with_queries(const Tensor4<U>& keys, const Tensor4<U>& values,
                                     const Tensor4<Q>& queries, F f) {
    static_assert(is_input_type_v<U> && is_input_type_v<Q>,
                  "veloxquant: keys, values and queries must be half, bfloat16, float or double");
    Tensor4<float> q_converted;
    const Tensor4<float>* q = &q_converted;
    if constexpr (std::is_same_v<Q, float>) {
      q = &queries;
    } else {
      q_converted = queries.template cast<float>();
    }
    if constexpr (std::is_same_v<U, T>) {
      return f(keys, values, q);
    } else {
      return f(to_storage(keys), to_storage(values), q);
    }
  }

  // Validates the call's queries (after the keys and values) and describes them for the kernels.
  // queries: [B, Hq, S, Dk] or nullptr; keys: [B, H, S, Dk]
  static detail::CallQueries checked_queries(const Tensor4<float>* queries, const Tensor4<T>& keys,
                                             const char* api) {
    if (queries == nullptr) return {};
    detail::check_queries(*queries, keys, api);
    return detail::CallQueries{queries->data(), queries->dimension(1) / keys.dimension(1),
                               keys.dimension(2), keys.dimension(3)};
  }

  // The shared body of every update_*; `api` names the caller in errors.
  // queries: [B, Hq, S, Dk] or nullptr
  KVView<T> update(const Tensor4<T>& keys, const Tensor4<T>& values,
                   const Tensor4<float>* queries, const char* api) {
    detail::check_update(keys, values, dims_, api);
    detail::check_rows_fit(live_rows(), keys.dimension(2), api);
    return update_checked(keys, values, checked_queries(queries, keys, api));
  }

  // update() after the input checks passed.
  KVView<T> update_checked(const Tensor4<T>& keys, const Tensor4<T>& values,
                           const detail::CallQueries& queries) {
    const Index S = keys.dimension(2);
    if (S == 0) {
      for (auto& h : heads_) h.compact();
      return make_view(dims_.known ? heads_.front().live() : 0, 0, keys, values);
    }
    inspect_call(keys);
    reserve_for_call(keys, values, queries.groups);
    // The call returns the rows retained before it: snapshot them before a re-budget at the start
    // of the call (prepare_call) marks any dead; they stay in their slots until the next call.
    for (auto& h : heads_) h.begin_window();
    prepare_call(keys);
    absorb_call(keys, values, queries);
    offset_ += S;
    tokens_seen_ += dims_.batch * dims_.heads * S;
    return make_view(heads_.front().physical(), S, keys, values);
  }

  // update + copy of the returned window into `out`. The output is sized before the cache changes
  // (the window is the rows retained before the call plus the call's rows), so a bad_alloc leaves
  // the cache unchanged. out: [B, H, n, Dk] and [B, H, n, Dv]
  void fetch_into(const Tensor4<T>& keys, const Tensor4<T>& values, const Tensor4<float>* queries,
                  KVPair<T>& out, const char* api) {
    detail::check_update(keys, values, dims_, api);
    detail::check_rows_fit(live_rows(), keys.dimension(2), api);
    const detail::CallQueries call_queries = checked_queries(queries, keys, api);
    const Index rows = live_rows() + keys.dimension(2);
    resize_pair(out, keys.dimension(0), keys.dimension(1), rows, keys.dimension(3),
                values.dimension(3));
    const KVView<T> view = update_checked(keys, values, call_queries);
    if (view.new_rows() == 0 && !dims_.known) return;  // [B, H, 0, D]
    const bool whole_window = view.new_rows() != 0;
    copy_rows_into(
        [whole_window](const detail::HeadStore<T>& h) -> const std::vector<detail::Slot>& {
          return whole_window ? h.window() : h.order();
        },
        out);
  }

  // Rows each head holds (the same for all heads), 0 before the first call.
  Index live_rows() const { return dims_.known ? heads_.front().live() : 0; }

  static void resize_pair(KVPair<T>& out, Index b, Index h, Index n, Index dk, Index dv) {
    const Eigen::array<Index, 4> kshape{b, h, n, dk};
    const Eigen::array<Index, 4> vshape{b, h, n, dv};
    if (out.first.dimensions() != kshape) out.first.resize(kshape);
    if (out.second.dimensions() != vshape) out.second.resize(vshape);
  }

  std::size_t row_bytes() const {
    return static_cast<std::size_t>(dims_.key_dim + dims_.value_dim) * sizeof(T);
  }

  // Compacts every head and reserves room for the call; the logical state is unchanged even if
  // an allocation throws (strong guarantee).
  void reserve_for_call(const Tensor4<T>& keys, const Tensor4<T>& values, Index groups) {
    const Index S = keys.dimension(2);
    if (!dims_.known) {
      const Index n = keys.dimension(0) * keys.dimension(1);
      std::vector<detail::HeadStore<T>> fresh;
      fresh.reserve(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i) {
        fresh.emplace_back(keys.dimension(3), values.dimension(3));
        fresh.back().reserve(S);
      }
      reserve_scratch(S, keys.dimension(3), S, workers(), groups);
      heads_.swap(fresh);
      dims_ = detail::LayerDims{keys.dimension(0), keys.dimension(1), keys.dimension(3),
                                values.dimension(3), true};
      return;
    }
    Index max_needed = 0;
    for (auto& h : heads_) {
      h.compact();
      const Index needed = h.live() + S;
      h.shrink_if_oversized(needed);
      if (h.capacity() < needed) {
        const Index grown = h.capacity() + h.capacity() / 2;
        const Index bound = std::max(steady_rows(), needed);
        h.reserve(std::max(needed, std::min(grown, bound)));
      }
      max_needed = std::max(max_needed, needed);
    }
    reserve_scratch(max_needed, dims_.key_dim, S, workers(), groups);
  }

  // Appends the call's rows to every head and lets the policy absorb them.
  // keys: [B, H, S, Dk], values: [B, H, S, Dv]; queries: [B, G·H, S, Dk] or none
  void absorb_call(const Tensor4<T>& keys, const Tensor4<T>& values,
                   const detail::CallQueries& queries) {
    const Index S = keys.dimension(2);
    const Index dk = dims_.key_dim, dv = dims_.value_dim;
    const auto n_heads = static_cast<Index>(heads_.size());
    const int n_workers = workers();
    // Heads are independent and each runs the same serial code, so results are bit-identical
    // whatever the number of threads. Small calls stay serial (a fork costs more than they do).
    const bool parallel = n_workers > 1 && n_heads > 1 &&
                          (heads_.front().live() + S) * S * dk * n_heads *
                                  std::max<Index>(queries.groups, 1) >=
                              kParallelWork;
    (void)parallel;
    // Every product of a head runs on the thread that owns the head: Eigen would otherwise spread
    // a serial call's GEMMs over OpenMP threads of its own (measured 5-25x slower, and far worse
    // on a loaded machine), since it parallelises whenever it is not inside a team of several.
    [[maybe_unused]] const detail::OneEigenThread one_eigen_thread;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(n_workers) if (parallel)
#endif
    for (Index hi = 0; hi < n_heads; ++hi) {
      auto& head = heads_[static_cast<std::size_t>(hi)];
      const auto first = static_cast<detail::Slot>(head.physical());
      for (Index s = 0; s < S; ++s) {
        const detail::Slot slot =
            head.append(keys.data() + (hi * S + s) * dk, values.data() + (hi * S + s) * dv,
                        offset_ + static_cast<std::int64_t>(s));
        head.extend_window(slot);
      }
#ifdef _OPENMP
      const int worker = parallel ? omp_get_thread_num() : 0;
#else
      const int worker = 0;
#endif
      absorb_rows(head, first, S, worker, queries.slice(hi));
    }
  }

  KVView<T> make_view(Index rows, Index new_rows, const Tensor4<T>& keys,
                      const Tensor4<T>& values) const {
    if (!dims_.known) {
      return KVView<T>(&heads_, keys.dimension(0), keys.dimension(1), keys.dimension(3),
                       values.dimension(3), 0, 0);
    }
    return KVView<T>(&heads_, dims_.batch, dims_.heads, dims_.key_dim, dims_.value_dim, rows,
                     new_rows);
  }

  // Gathers rows of every head in the slot order `pick(head)` gives: [B, H, n, D] twice.
  template <class Pick>
  KVPair<T> copy_rows(Pick pick) const {
    KVPair<T> out;
    copy_rows_into(pick, out);
    return out;
  }

  // Gathers into `out`, resizing its tensors only when their shape differs.
  template <class Pick>
  void copy_rows_into(Pick pick, KVPair<T>& out) const {
    const Index n = heads_.empty() ? 0 : static_cast<Index>(pick(heads_.front()).size());
    resize_pair(out, dims_.batch, dims_.heads, n, dims_.key_dim, dims_.value_dim);
    Tensor4<T>& k = out.first;
    Tensor4<T>& v = out.second;
    const auto dk = static_cast<std::size_t>(dims_.key_dim);
    const auto dv = static_cast<std::size_t>(dims_.value_dim);
    T* kout = k.data();
    T* vout = v.data();
    for (const auto& h : heads_) {
      for (const detail::Slot s : pick(h)) {
        std::memcpy(kout, h.key_ptr(s), dk * sizeof(T));
        std::memcpy(vout, h.value_ptr(s), dv * sizeof(T));
        kout += dk;
        vout += dv;
      }
    }
  }

  // Multiply-adds per call below which heads run serially.
  static constexpr Index kParallelWork = Index{1} << 16;

  detail::LayerDims dims_{};
  bool parallel_heads_ = true;
  std::vector<detail::HeadStore<T>> heads_;
  std::int64_t offset_ = 0;
  std::int64_t tokens_seen_ = 0;
};

}  // namespace veloxquant::cache
