// Support code shared by the test executables (tests/test_*.cpp): random tensor builders,
// conversion of stored elements to double, row extraction, shape and byte helpers, the
// docs/design.md 4.4 check of what update_and_fetch returned, and feeding a bad call through either
// entry point.
//
// This header includes <veloxquant/cache.hpp> but never defines VELOXQUANT_ASSERT: a test file that
// wants the library's internal assertions to be testable defines that macro before including the
// library (or this header).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "support/methods.hpp"

namespace veloxquant::test {

using Index = Eigen::Index;
/// A tensor shape [B, H, S, D].
using Shape = std::array<Index, 4>;
/// Rows of doubles, e.g. one head's keys. [n][D]
using Rows = std::vector<std::vector<double>>;

/// A stored element (half, bfloat16, float or double) as double, through float (exact for every
/// storage type the caches use).
template <class T>
double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}

// The random inputs and their conversion to a storage type are defined once, in
// support/test_support.cpp, which is compiled with the library's instances (scripts/test.sh: at
// -O1, while the tests compile at -O0). Under the sanitizers at -O0 they were more than half the
// run time of the suite's longest tests (docs/testing.md). Each is declared for the storage types
// the tests use (half, bfloat16, float, double); another type fails to link.

/// Random [B, H, S, D] of N(0, 1) entries (double; the caches convert them to T on entry).
cache::Tensor4<double> random_doubles(std::mt19937& rng, Index B, Index H, Index S, Index D);

/// Random tensor of shape `sh` ([B, H, S, D]) of N(0, 1) entries (double).
inline cache::Tensor4<double> random_doubles(std::mt19937& rng, const Shape& sh) {
  return random_doubles(rng, sh[0], sh[1], sh[2], sh[3]);
}

/// `t` rounded to T element by element, as `t.cast<T>()`. t: [B, H, S, D]; returns [B, H, S, D].
template <class T>
cache::Tensor4<T> converted(const cache::Tensor4<double>& t);

/// Random [B, H, S, D] of N(0, 1) entries rounded to T (the same draws as random_doubles).
template <class T>
cache::Tensor4<T> random_tensor(std::mt19937& rng, Index B, Index H, Index S, Index D);

#define VELOXQUANT_TEST_SUPPORT_TYPES(X) \
  X(Eigen::half)                         \
  X(Eigen::bfloat16)                     \
  X(float)                               \
  X(double)
#define VELOXQUANT_TEST_SUPPORT_EXTERN(T)                                        \
  extern template cache::Tensor4<T> converted<T>(const cache::Tensor4<double>&); \
  extern template cache::Tensor4<T> random_tensor<T>(std::mt19937&, Index, Index, Index, Index);
VELOXQUANT_TEST_SUPPORT_TYPES(VELOXQUANT_TEST_SUPPORT_EXTERN)
#undef VELOXQUANT_TEST_SUPPORT_EXTERN

/// Random [b, h, s, d] float tensor of N(0, 1) entries drawn in float.
inline cache::Tensor4<float> random_float_tensor(Index b, Index h, Index s, Index d,
                                                 std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cache::Tensor4<float> t(b, h, s, d);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = nd(rng);
  return t;
}

/// Row s of head (b, h) of `t`, converted to double. t: [B, H, S, D]; returns [D].
template <class T>
std::vector<double> row_of(const cache::Tensor4<T>& t, Index b, Index h, Index s) {
  std::vector<double> out(static_cast<std::size_t>(t.dimension(3)));
  for (Index d = 0; d < t.dimension(3); ++d) {
    out[static_cast<std::size_t>(d)] = to_double(t(b, h, s, d));
  }
  return out;
}

/// All S rows of head (b, h) of `t`, converted to double. t: [B, H, S, D]; returns [S][D].
template <class T>
Rows rows_of(const cache::Tensor4<T>& t, Index b, Index h) {
  Rows out;
  for (Index s = 0; s < t.dimension(2); ++s) out.push_back(row_of(t, b, h, s));
  return out;
}

/// A [1, 1, S, D] tensor of the given rows (converted to T). rows: [S][D], not empty.
template <class T>
cache::Tensor4<T> tensor_of(const Rows& rows) {
  const auto S = static_cast<Index>(rows.size());
  const auto D = static_cast<Index>(rows.front().size());
  cache::Tensor4<T> t(1, 1, S, D);
  for (Index s = 0; s < S; ++s)
    for (Index d = 0; d < D; ++d)
      t(0, 0, s, d) =
          static_cast<T>(rows[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)]);
  return t;
}

/// n value rows of dimension 1: {first}, {first + 1}, ... (only used to check that values travel
/// with keys). Returns [n][1].
inline Rows value_rows(std::size_t n, double first = 100.0) {
  Rows out;
  for (std::size_t i = 0; i < n; ++i) out.push_back({first + static_cast<double>(i)});
  return out;
}

/// Rows scaled by s: out[i][k] = s * e[i][k]. e: [n][D]; returns [n][D].
inline Rows scaled(const Rows& e, double s) {
  Rows out = e;
  for (auto& r : out)
    for (auto& x : r) x *= s;
  return out;
}

/// The bytes of `t`, in storage order. t: [B, H, S, D].
template <class T>
std::vector<unsigned char> bytes_of(const cache::Tensor4<T>& t) {
  std::vector<unsigned char> out(static_cast<std::size_t>(t.size()) * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), t.data(), out.size());
  return out;
}

/// The shape of `t`. t: [B, H, S, D]; returns {B, H, S, D}.
template <class T>
Shape shape_of(const cache::Tensor4<T>& t) {
  return {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
}

/// What every cache reports about itself without being called: offset, state() (shapes and bytes),
/// accounting and dimensions. Tests of the strong guarantee (docs/design.md 8) compare one taken
/// before a throwing call with one taken after; a file's own snapshot extends it with what its
/// cache adds.
struct BasicSnapshot {
  std::int64_t offset = 0;
  Shape key_shape{}, value_shape{};
  std::vector<unsigned char> keys, values;  // state(), bitwise
  std::size_t kept_bytes = 0, full_seq_bytes = 0;
  std::int64_t tokens_seen = 0, tokens_kept = 0;
  Index batch = 0, heads = 0, key_dim = 0, value_dim = 0;

  bool operator==(const BasicSnapshot& o) const {
    return offset == o.offset && key_shape == o.key_shape && value_shape == o.value_shape &&
           keys == o.keys && values == o.values && kept_bytes == o.kept_bytes &&
           full_seq_bytes == o.full_seq_bytes && tokens_seen == o.tokens_seen &&
           tokens_kept == o.tokens_kept && batch == o.batch && heads == o.heads &&
           key_dim == o.key_dim && value_dim == o.value_dim;
  }
};

/// Fills the BasicSnapshot fields that need no state() (offset, accounting, dimensions) from `c`:
/// all of it a cache with ragged heads, which state() refuses, can give.
template <class Cache>
void take_basic_counters(const Cache& c, BasicSnapshot& s) {
  s.offset = c.offset();
  s.kept_bytes = c.kept_bytes();
  s.full_seq_bytes = c.full_seq_bytes();
  s.tokens_seen = c.tokens_seen();
  s.tokens_kept = c.tokens_kept();
  s.batch = c.batch();
  s.heads = c.heads();
  s.key_dim = c.key_dim();
  s.value_dim = c.value_dim();
}

/// Fills the BasicSnapshot part of `s` from `c` (any cache: KVCache<T> or a derived class).
template <class Cache>
void take_basic_snapshot(const Cache& c, BasicSnapshot& s) {
  take_basic_counters(c, s);
  const auto st = c.state();
  s.key_shape = shape_of(st.first);
  s.value_shape = shape_of(st.second);
  s.keys = bytes_of(st.first);
  s.values = bytes_of(st.second);
}

/// Calls f(p) with `c` as its public class when it is one of the H2O-core policies
/// (SqueezeAttention, H2O, PyramidKV: they publish scores(), positions(), budget() and
/// protected_recent()); returns whether it was. Tests reach policy state this way, never through
/// the library's detail classes.
template <class T, class F>
bool visit_core(const cache::KVCache<T>& c, F&& f) {
  if (const auto* p = dynamic_cast<const cache::SqueezeAttentionCache<T>*>(&c)) return f(*p), true;
  if (const auto* p = dynamic_cast<const cache::H2OCache<T>*>(&c)) return f(*p), true;
  if (const auto* p = dynamic_cast<const cache::PyramidKVCache<T>*>(&c)) return f(*p), true;
  return false;
}

/// Calls f(p) when `c` is of a method that scores its rows (MethodEntry::scored), `p` its public
/// class for the H2O core (visit_core), else `c` (every cache publishes scores(b, h) and
/// positions(b, h)); returns whether it was.
template <class T, class F>
bool visit_scored(const cache::KVCache<T>& c, F&& f) {
  if (visit_core(c, f)) return true;
  const cache::detail::MethodSpec* m = cache::detail::find_method(c.config().method);
  if (m == nullptr || !method_entry(m->id).scored) return false;
  f(c);
  return true;
}

/// scores(b, h) of a scored cache through its public class; empty for the other policies.
template <class T>
std::vector<float> policy_scores(const cache::KVCache<T>& c, Index b, Index h) {
  std::vector<float> out;
  visit_scored(c, [&](const auto& p) { out = p.scores(b, h); });
  return out;
}

/// positions(b, h) of a scored cache through its public class; empty for the other policies.
template <class T>
std::vector<std::int64_t> policy_positions(const cache::KVCache<T>& c, Index b, Index h) {
  std::vector<std::int64_t> out;
  visit_scored(c, [&](const auto& p) { out = p.positions(b, h); });
  return out;
}

/// budget() of an H2O-core cache through its public class; nullopt for the other policies.
template <class T>
std::optional<int> core_budget(const cache::KVCache<T>& c) {
  std::optional<int> out;
  visit_core(c, [&](const auto& p) { out = p.budget(); });
  return out;
}

/// protected_recent() of an H2O-core cache through its public class; -1 for the other policies.
template <class T>
int core_protected_recent(const cache::KVCache<T>& c) {
  int out = -1;
  visit_core(c, [&](const auto& p) { out = p.protected_recent(); });
  return out;
}

/// A parallel-for for the tests (docs/design.md 7.3): `workers - 1` threads that live as long as
/// the pool, plus the calling thread; task t runs on worker t % workers. A fresh std::thread per
/// task would cost more than the calls it runs, especially under the sanitizers.
class ThreadPool {
 public:
  explicit ThreadPool(int workers) : size_(workers) {
    for (int w = 1; w < workers; ++w) threads_.emplace_back([this, w] { loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Runs task(0) .. task(tasks - 1) and returns when all are done.
  void run(int tasks, const std::function<void(int)>& task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      tasks_ = tasks;
      pending_ = size_ - 1;
      ++epoch_;
    }
    wake_.notify_all();
    for (int t = 0; t < tasks; t += size_) task(t);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void loop(int w) {
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task = nullptr;
      int tasks = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || epoch_ != seen; });
        if (stop_) return;
        seen = epoch_;
        task = task_;
        tasks = tasks_;
      }
      for (int t = w; t < tasks; t += size_) (*task)(t);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  const int size_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* task_ = nullptr;
  int tasks_ = 0, pending_ = 0;
  std::uint64_t epoch_ = 0;
  bool stop_ = false;
};

/// A parallel-for over a pool of `workers` threads shared by the caller's caches.
inline cache::ParallelFor thread_parallel_for(int workers = 4) {
  const auto pool = std::make_shared<ThreadPool>(workers);
  return [pool](int tasks, const std::function<void(int)>& task) { pool->run(tasks, task); };
}

/// Lets `c` spread the heads of its calls over `workers` threads.
template <class T>
void enable_parallel_heads(cache::KVCache<T>& c, int workers = 4) {
  c.set_parallel_for(thread_parallel_for(workers), workers);
  c.set_parallel_heads(true);
}

/// Same dimensions and the same bytes. a, b: [B, H, S, D].
template <class T>
bool bitwise_equal(const cache::Tensor4<T>& a, const cache::Tensor4<T>& b) {
  return a.dimensions() == b.dimensions() &&
         (a.size() == 0 ||  // an empty tensor has no data (memcmp of null is undefined)
          std::memcmp(a.data(), b.data(), sizeof(T) * static_cast<std::size_t>(a.size())) == 0);
}

/// A cache score (float) against the oracle's (double): absolute 1e-6 or relative 1e-4.
inline bool scores_close(double got, double want) {
  return std::fabs(got - want) <= std::max(1e-6, 1e-4 * std::fabs(want));
}

/// Regex matching the four numbers of a shape in order, e.g. "[2, 2, 3, 4]".
inline std::regex shape_regex(const Shape& s) {
  return std::regex("\\b" + std::to_string(s[0]) + "\\D{1,3}" + std::to_string(s[1]) + "\\D{1,3}" +
                    std::to_string(s[2]) + "\\D{1,3}" + std::to_string(s[3]) + "\\b");
}

/// Feeds a bad call (anything with double `keys` and `values` and a bool `as_double`) to `cache`
/// through update_and_view (`view`) or update_and_fetch: the double tensors through the converting
/// overload when `as_double`, else converted to T first. bc.keys: [B, H, S, Dk];
/// bc.values: [B, H, S, Dv].
template <template <class> class Cache, class T, class Call>
void feed(Cache<T>& cache, const Call& bc, bool view) {
  if (bc.as_double) {
    if (view) {
      (void)cache.update_and_view(bc.keys, bc.values);
    } else {
      (void)cache.update_and_fetch(bc.keys, bc.values);
    }
    return;
  }
  const cache::Tensor4<T> k = converted<T>(bc.keys);
  const cache::Tensor4<T> v = converted<T>(bc.values);
  if (view) {
    (void)cache.update_and_view(k, v);
  } else {
    (void)cache.update_and_fetch(k, v);
  }
}

/// Checks what update_and_fetch returned (docs/design.md 4.4): [B, H, n_before + S, Dk] keys and
/// [B, H, n_before + S, Dv] values holding, per head, the rows retained before the call
/// (`before[b * H + h]`, ascending position) then every row of the call. Returns a description of
/// the first mismatch, or "".
/// got: ([B, H, n, Dk], [B, H, n, Dv]); keys: [B, H, S, Dk]; values: [B, H, S, Dv].
template <class T>
std::string compare_returned(const cache::KVPair<T>& got,
                             const std::vector<std::vector<reference::OracleRow>>& before,
                             const cache::Tensor4<T>& keys, const cache::Tensor4<T>& values,
                             Index B, Index H, Index Dk, Index Dv);

/// compare_returned with the expected dimensions taken from a run configuration `rc` (any type
/// with Index members B, H, Dk, Dv). got, keys, values: as above.
template <class T, class RunConfig>
std::string compare_returned(const cache::KVPair<T>& got,
                             const std::vector<std::vector<reference::OracleRow>>& before,
                             const cache::Tensor4<T>& keys, const cache::Tensor4<T>& values,
                             const RunConfig& rc) {
  return compare_returned(got, before, keys, values, rc.B, rc.H, rc.Dk, rc.Dv);
}

/// Row r of head (b, h) of a state() pair (keys [B, H, n, Dk], values [B, H, n, Dv]) against an
/// oracle row: every key and value element bitwise equal after conversion to double. Returns the
/// first mismatch, or "".
template <class T>
std::string compare_state_row(const cache::KVPair<T>& st, Index b, Index h, Index r,
                              const reference::OracleRow& row);

/// Checks what update_and_view returned (docs/design.md 2.3, 4.4): n_before + S rows per head; the
/// first n_before are exactly the rows retained before the call (`before[b * H + h]`, ascending
/// position) in any order, their positions saying which is which; the call's rows come last, in
/// arrival order, at positions offset_before, offset_before + 1, ... Returns the first mismatch,
/// or "". keys: [B, H, S, Dk]; values: [B, H, S, Dv].
template <class T>
std::string compare_view(const cache::KVView<T>& view,
                         const std::vector<std::vector<reference::OracleRow>>& before,
                         const cache::Tensor4<T>& keys, const cache::Tensor4<T>& values,
                         std::int64_t offset_before);

// The three checks above are compiled once, in support/test_support.cpp, for every storage type.
#define VELOXQUANT_TEST_STORAGE_TYPES(X) \
  X(Eigen::half)                         \
  X(Eigen::bfloat16)                     \
  X(float)
#define VELOXQUANT_TEST_CHECKS(PREFIX, T)                                               \
  PREFIX std::string compare_returned<T>(                                               \
      const cache::KVPair<T>&, const std::vector<std::vector<reference::OracleRow>>&,   \
      const cache::Tensor4<T>&, const cache::Tensor4<T>&, Index, Index, Index, Index);  \
  PREFIX std::string compare_state_row<T>(const cache::KVPair<T>&, Index, Index, Index, \
                                          const reference::OracleRow&);                 \
  PREFIX std::string compare_view<T>(                                                   \
      const cache::KVView<T>&, const std::vector<std::vector<reference::OracleRow>>&,   \
      const cache::Tensor4<T>&, const cache::Tensor4<T>&, std::int64_t);
#define VELOXQUANT_TEST_CHECKS_EXTERN(T) VELOXQUANT_TEST_CHECKS(extern template, T)
VELOXQUANT_TEST_STORAGE_TYPES(VELOXQUANT_TEST_CHECKS_EXTERN)
#undef VELOXQUANT_TEST_CHECKS_EXTERN

/// Tokens [s0, s0 + n) of a [B, H, S, D] tensor (a slice along S).
template <class T>
cache::Tensor4<T> slice_s(const cache::Tensor4<T>& t, Index s0, Index n) {
  cache::Tensor4<T> out(t.dimension(0), t.dimension(1), n, t.dimension(3));
  for (Index b = 0; b < t.dimension(0); ++b)
    for (Index h = 0; h < t.dimension(1); ++h)
      for (Index s = 0; s < n; ++s)
        for (Index d = 0; d < t.dimension(3); ++d) out(b, h, s, d) = t(b, h, s0 + s, d);
  return out;
}

/// A config of an H2O-core method (docs/design.md 4): "h2o" (`recent`: its fixed grace of
/// protected rows), "squeeze" (reporting on its first call) or "pyramidkv" (`budget`: the average
/// over the layers); `recent`: the recent ratio of the other two.
inline cache::KVCacheConfig core_config(const std::string& method, int budget, int n_sink,
                                        double recent, double decay) {
  cache::KVCacheConfig c;
  c.method = method;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  const bool h2o = method == "h2o", squeeze = method == "squeeze";
  (h2o ? c.h2o_budget : squeeze ? c.squeeze_budget : c.pyramid_budget) = budget;
  (h2o ? c.h2o_n_sink : squeeze ? c.squeeze_n_sink : c.pyramid_n_sink) = n_sink;
  (h2o ? c.h2o_decay : squeeze ? c.squeeze_decay : c.pyramid_decay) = decay;
  if (h2o) {
    c.h2o_grace = static_cast<int>(recent);
  } else {
    (squeeze ? c.squeeze_recent_ratio : c.pyramid_recent_ratio) = recent;
  }
  return c;
}

/// core_config of method "h2o", "squeeze" and "pyramidkv".
inline cache::KVCacheConfig h2o_config(int budget, int n_sink, int grace, double decay) {
  return core_config("h2o", budget, n_sink, grace, decay);
}
inline cache::KVCacheConfig squeeze_config(int budget, int n_sink, double ratio, double decay) {
  return core_config("squeeze", budget, n_sink, ratio, decay);
}
inline cache::KVCacheConfig pyramid_config(int budget, int n_sink, double ratio, double decay) {
  return core_config("pyramidkv", budget, n_sink, ratio, decay);
}

/// A TOVA config (method "tova").
inline cache::KVCacheConfig tova_config(int budget, int n_sink) {
  cache::KVCacheConfig c;
  c.method = "tova";
  c.tova_budget = budget;
  c.tova_n_sink = n_sink;
  return c;
}

/// A SnapKV config (method "snapkv").
inline cache::KVCacheConfig snap_config(int budget, int n_sink, int obs_window) {
  cache::KVCacheConfig c;
  c.method = "snapkv";
  c.snap_budget = budget;
  c.snap_n_sink = n_sink;
  c.snap_obs_window = obs_window;
  return c;
}

/// A StreamingLLM config (method "streaming_llm").
inline cache::KVCacheConfig stream_config(int n_sink, int window) {
  cache::KVCacheConfig c;
  c.method = "streaming_llm";
  c.stream_n_sink = n_sink;
  c.stream_window_size = window;
  return c;
}

// The storage the subjects use: unquantized unless a TU asks otherwise (the contract suite is
// built a second time over quantized rows, tests/CMakeLists.txt; quantized rows need head dims
// that quant_group = 8 divides).
#ifndef VELOXQUANT_TEST_KEY_BITS
#define VELOXQUANT_TEST_KEY_BITS 16
#endif
#ifndef VELOXQUANT_TEST_VALUE_BITS
#define VELOXQUANT_TEST_VALUE_BITS 16
#endif
inline constexpr int kKeyBits = VELOXQUANT_TEST_KEY_BITS;
inline constexpr int kValueBits = VELOXQUANT_TEST_VALUE_BITS;
inline constexpr bool kQuantized = kKeyBits < 16 || kValueBits < 16;
inline constexpr int kQuantGroup = 8;

/// Head dims of the tests' calls: as written unquantized, times 8 over quantized rows (so that the
/// group of 8 divides every one, and their relations stay: 4 vs 3 vs 5 ...).
inline constexpr Index kDimScale = kQuantized ? 8 : 1;
constexpr Index dim(Index d) { return d * kDimScale; }

/// One invalid call for the strong-guarantee tests (docs/design.md 8).
struct BadCall {
  std::string name;
  cache::Tensor4<double> keys, values;  // [B, H, S, Dk], [B, H, S, Dv]
  bool as_double = false;               // through the converting overload
  bool needs_established = false;       // only bad after a first valid call
  std::optional<Shape> bad_index;       // the message must name this [b, h, s, d]
};

/// Shapes of the valid calls the bad calls are measured against.
constexpr Shape kBadCallKeys{2, 2, 3, dim(4)};
constexpr Shape kBadCallValues{2, 2, 3, dim(3)};

/// Every docs/design.md 8 error of update_and_fetch / update_and_view on a cache whose calls are
/// kBadCallKeys / kBadCallValues with S tokens (S >= 3; SnapKV's suite takes calls longer than its
/// budget, which would compress): mismatched shapes, zero sizes, shapes that differ from the first
/// call, NaN/Inf keys at the first, the last and inner elements (also as double), and a double key
/// that overflows T (`half`: the storage type is Eigen::half).
inline std::vector<BadCall> bad_calls(std::mt19937& rng, bool half, Index S = kBadCallKeys[2]) {
  std::vector<BadCall> out;
  const Shape keys{kBadCallKeys[0], kBadCallKeys[1], S, kBadCallKeys[3]};
  const Shape values{kBadCallValues[0], kBadCallValues[1], S, kBadCallValues[3]};
  const auto draw = [&](std::string name, const Shape& k, const Shape& v) {
    BadCall c;
    c.name = std::move(name);
    c.keys = random_doubles(rng, k);
    c.values = random_doubles(rng, v);
    return c;
  };
  const auto shape_case = [&](std::string name, Shape k, Shape v, bool established) {
    BadCall c = draw(std::move(name), k, v);
    c.needs_established = established;
    out.push_back(std::move(c));
  };
  shape_case("values B differs", keys, {1, 2, S, dim(3)}, false);
  shape_case("values H differs", keys, {2, 1, S, dim(3)}, false);
  shape_case("values S differs", keys, {2, 2, S - 1, dim(3)}, false);
  shape_case("zero key D", {2, 2, S, 0}, values, false);
  shape_case("zero value D", keys, {2, 2, S, 0}, false);
  shape_case("zero B", {0, 2, S, dim(4)}, {0, 2, S, dim(3)}, false);
  shape_case("B differs from the first call", {1, 2, 1, dim(4)}, {1, 2, 1, dim(3)}, true);
  shape_case("H differs from the first call", {2, 3, 1, dim(4)}, {2, 3, 1, dim(3)}, true);
  shape_case("key D differs from the first call", {2, 2, 1, dim(5)}, {2, 2, 1, dim(3)}, true);
  shape_case("value D differs from the first call", {2, 2, 1, dim(4)}, {2, 2, 1, dim(4)}, true);
  shape_case("empty call with another H", {2, 5, 0, dim(4)}, {2, 5, 0, dim(3)}, true);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::pair<double, Shape>> bad = {{nan, {0, 0, 0, 0}},
                                                     {nan, {1, 1, S - 1, dim(4) - 1}},
                                                     {inf, {0, 1, 2, 1}},
                                                     {-inf, {1, 0, 1, 2}}};
  for (const auto& [value, at] : bad) {
    for (const bool dbl : {false, true}) {
      BadCall c = draw("key " + std::to_string(value) + " at [" + std::to_string(at[0]) + "," +
                           std::to_string(at[1]) + "," + std::to_string(at[2]) + "," +
                           std::to_string(at[3]) + "]" + (dbl ? " as double" : ""),
                       keys, values);
      c.keys(at[0], at[1], at[2], at[3]) = value;
      c.as_double = dbl;
      c.bad_index = at;
      out.push_back(std::move(c));
    }
  }
  BadCall c = draw("double key overflowing the storage type", keys, values);
  c.keys(1, 0, 2, 3) = half ? 1e6 : 1e300;
  c.as_double = true;
  c.bad_index = Shape{1, 0, 2, 3};
  out.push_back(std::move(c));
  return out;
}

}  // namespace veloxquant::test
