// veloxquant — the core's speed against the engine's own attention over the same rows, in one
// binary built with one set of flags (scripts/bench.sh builds it at each of -O2/-O3 x
// -march=x86-64/x86-64-v3/native, or -O2/-O3 x -march=armv8-a/-mcpu=native on aarch64;
// BENCHMARKS.md section 1). Single thread unless the name says
// otherwise. Shapes: B = 1, H = 32 KV heads, D = 128, half storage.
//
//   BM_DecodeView/budget          one decode step through update_and_view (key-as-query H2O core,
//                                 evicting every step: budget + 1 rows attended)
//   BM_AttentionF32Gemv/rows      the engine's decode attention over `rows` fp32 rows per head:
//                                 Eigen GEMV q.K^T, softmax, GEMV p.V
//   BM_AttentionF16Dot/rows       the same over fp16 rows with hardware fp16 conversion + FMA dots
//                                 (AVX2 + F16C on x86-64, NEON on aarch64)
//   BM_DecodeViewThreads/budget   BM_DecodeView with the heads on 2 threads (the engine's
//                                 parallel-for; here a small persistent pool)
//   BM_DecodeViewKeyDiff/budget   BM_DecodeView scored by KeyDiff (proxy_scoring = "keydiff",
//                                 docs/design.md 4.7)
//   BM_DecodeViewKNorm/budget     BM_DecodeView scored by the key norm ("knorm")
//   BM_PrefillView/S              an S-token prompt into budget 512 (key-as-query, H = 32)
//   BM_PrefillViewQueries/S       the same scored with the engine's queries (G = 4: 32 query heads,
//                                 H = 8 KV heads)
//   BM_CausalAttention/S/H        the engine's causal attention of the prompt (32 query heads over
//                                 H KV heads): per query head, blocks of 64 query rows, Eigen GEMM
//                                 over the keys they see, softmax, GEMM with V
//
// attend (docs/design.md 2.8): G = 4 query heads per KV head, H = 8 KV heads, D = 128, half rows.
//   BM_DecodeAttend/budget        one decode step through attend() on a SqueezeAttention layer at
//                                 `budget` (evicting every step: budget + 1 rows attended)
//   BM_DecodeGQAF16/rows          the engine's dense GQA decode attention over fp16 rows: per KV
//                                 head its 4 query rows meet each key and value row once (F16C;
//                                 NEON on aarch64)
//   BM_DecodeGQAF32Gemm/rows      the same over fp32 rows with Eigen: [4, D] x [D, n], softmax,
//                                 [4, n] x [n, D]
//   BM_DecodeAttendPath/budget/level  BM_DecodeAttend on the kernel path `level` (0 scalar, 1 sse2,
//                                 2 avx2, 3 avx512, 4 neon; others skipped)
//   BM_DecodeAttendQuant/budget/bits  BM_DecodeAttend over quantized rows (docs/design.md 2.9):
//                                 keys and values at `bits` (8 or 4), group 32; its comparison
//                                 point is BM_DecodeAttend (half rows) at the same budget
//   BM_DecodeAttendChannel/budget/bits  the same with keys and values quantized along channels
//                                 (docs/design.md 7.5), blocks of 32; same comparison point
//   BM_ChannelHeap/budget         heap_bytes() / kept_bytes() of an H2O cache over 4-bit
//                                 channel-axis rows after 2,000 decode steps (counters)
//   BM_DecodeLayers/budget/bits/layers  a decode step through `layers` layers, half rows (16) or
//                                 4-bit channel rows (4): the rows read from memory, not cache
//   BM_PrefillAttend/S            an S-token prompt through attend() into budget 512
//   BM_CausalAttention/S/8        its comparison point (above, 32 query heads over 8 KV heads)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <veloxquant/cache.hpp>

#include "bench_support.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_neon.h>
#endif

namespace vc = veloxquant::cache;
using Eigen::Index;

namespace {

constexpr Index kDim = 128;
constexpr Index kHeads = 32;
using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

using veloxquant::bench::random_tensor;

vc::KVCacheConfig h2o_config(int budget) {
  vc::KVCacheConfig cfg;
  cfg.method = "h2o";
  cfg.h2o_budget = budget;
  return cfg;
}

// A small persistent pool: the engine's parallel-for. run(tasks, task) returns when all are done.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { loop(i); });
    size_ = threads;
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  vc::ParallelFor parallel_for() {
    return [this](int tasks, const std::function<void(int)>& task) { run(tasks, task); };
  }
  int size() const { return size_; }

 private:
  void run(int tasks, const std::function<void(int)>& task) {
    {
      std::lock_guard<std::mutex> l(m_);
      task_ = &task;
      tasks_ = tasks;
      next_ = 1;
      pending_ = tasks - 1;
      ++epoch_;
    }
    cv_.notify_all();
    task(0);
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [this] { return pending_ == 0; });
  }
  void loop(int) {
    std::uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> l(m_);
      cv_.wait(l, [&] { return stop_ || epoch_ != seen; });
      if (stop_) return;
      seen = epoch_;
      while (next_ < tasks_) {
        const int t = next_++;
        l.unlock();
        (*task_)(t);
        l.lock();
        if (--pending_ == 0) done_.notify_one();
      }
    }
  }
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* task_ = nullptr;
  int tasks_ = 0, next_ = 0, pending_ = 0, size_ = 1;
  std::uint64_t epoch_ = 0;
  bool stop_ = false;
};

// ---- decode ------------------------------------------------------------------------------------

void decode_view(benchmark::State& state, int threads, const char* scorer = "key_as_query") {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig cfg = h2o_config(budget);
  cfg.proxy_scoring = scorer;
  vc::H2OCache<Eigen::half> cache(cfg);
  std::unique_ptr<Pool> pool;
  if (threads > 1) {
    pool = std::make_unique<Pool>(threads);
    cache.set_parallel_for(pool->parallel_for(), threads);
  }
  const auto prompt = random_tensor<Eigen::half>(1, kHeads, budget, kDim, 1);
  (void)cache.update_and_view(prompt, prompt);
  std::vector<vc::Tensor4<Eigen::half>> tokens;
  for (int i = 0; i < 64; ++i) tokens.push_back(random_tensor<Eigen::half>(1, kHeads, 1, kDim, 100u + i));
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& t = tokens[i++ % tokens.size()];
    auto view = cache.update_and_view(t, t);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["rows"] = budget + 1;
}
void BM_DecodeView(benchmark::State& state) { decode_view(state, 1); }
void BM_DecodeViewThreads(benchmark::State& state) { decode_view(state, 2); }
void BM_DecodeViewKeyDiff(benchmark::State& state) { decode_view(state, 1, "keydiff"); }
void BM_DecodeViewKNorm(benchmark::State& state) { decode_view(state, 1, "knorm"); }

// Softmax in place with Eigen's vectorised exp (the build's flags).
void softmax(float* x, Index n) {
  Eigen::Map<Eigen::ArrayXf> a(x, n);
  a = (a - a.maxCoeff()).exp();
  a /= a.sum();
}

// Decode attention over fp32 rows: Eigen GEMVs (the build's flags), Eigen's vectorised exp.
void BM_AttentionF32Gemv(benchmark::State& state) {
  const Index n = state.range(0);
  const auto k = random_tensor<float>(1, kHeads, n, kDim, 2);
  const auto v = random_tensor<float>(1, kHeads, n, kDim, 3);
  const auto q = random_tensor<float>(1, kHeads, 1, kDim, 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  Eigen::VectorXf logits(n), out(kDim);
  for (auto _ : state) {
    for (Index h = 0; h < kHeads; ++h) {
      const RowsF kh(k.data() + h * n * kDim, n, kDim), vh(v.data() + h * n * kDim, n, kDim);
      const Eigen::Map<const Eigen::VectorXf> qh(q.data() + h * kDim, kDim);
      logits.noalias() = kh * qh;
      logits *= scale;
      softmax(logits.data(), n);
      out.noalias() = vh.transpose() * logits;
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetItemsProcessed(state.iterations());
}

// The engine's own fp16 attention is written with the CPU's vector instructions: AVX2 + FMA + F16C
// on x86-64 (eight lanes), NEON with its fp16 conversion on aarch64 (four lanes). A few helpers
// give both ISAs one body.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VQ_BENCH_F16 __attribute__((target("avx2,fma,f16c")))
using EV = __m256;
constexpr Index kEL = 8;
bool engine_f16_supported() { return vc::simd_level_supported(vc::SimdLevel::avx2); }
VQ_BENCH_F16 inline EV ev_zero() { return _mm256_setzero_ps(); }
VQ_BENCH_F16 inline EV ev_set1(float a) { return _mm256_set1_ps(a); }
VQ_BENCH_F16 inline EV ev_loadf(const float* p) { return _mm256_loadu_ps(p); }
VQ_BENCH_F16 inline EV load(const Eigen::half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
VQ_BENCH_F16 inline EV ev_fmadd(EV a, EV b, EV c) { return _mm256_fmadd_ps(a, b, c); }
VQ_BENCH_F16 inline void ev_store(float* p, EV a) { _mm256_storeu_ps(p, a); }
VQ_BENCH_F16 float hsum(EV a) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h = _mm_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define VQ_BENCH_F16
using EV = float32x4_t;
constexpr Index kEL = 4;
bool engine_f16_supported() { return true; }
inline EV ev_zero() { return vdupq_n_f32(0.0f); }
inline EV ev_set1(float a) { return vdupq_n_f32(a); }
inline EV ev_loadf(const float* p) { return vld1q_f32(p); }
inline EV load(const Eigen::half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))));
}
inline EV ev_fmadd(EV a, EV b, EV c) { return vfmaq_f32(c, a, b); }
inline void ev_store(float* p, EV a) { vst1q_f32(p, a); }
inline float hsum(EV a) { return vaddvq_f32(a); }
#endif

#if defined(VQ_BENCH_F16)
// Decode attention over fp16 rows: hardware fp16 conversion and FMA dots, four rows at a time; the
// weighted sum of values accumulates in eight vectors.
VQ_BENCH_F16 void attention_f16(const Eigen::half* k, const Eigen::half* v, const float* q,
                                Index n, float scale, float* logits, float* out) {
  Index r = 0;
  for (; r + 4 <= n; r += 4) {
    EV a0 = ev_zero(), a1 = a0, a2 = a0, a3 = a0;
    for (Index d = 0; d < kDim; d += kEL) {
      const EV x = ev_loadf(q + d);
      a0 = ev_fmadd(x, load(k + r * kDim + d), a0);
      a1 = ev_fmadd(x, load(k + (r + 1) * kDim + d), a1);
      a2 = ev_fmadd(x, load(k + (r + 2) * kDim + d), a2);
      a3 = ev_fmadd(x, load(k + (r + 3) * kDim + d), a3);
    }
    logits[r] = hsum(a0) * scale;
    logits[r + 1] = hsum(a1) * scale;
    logits[r + 2] = hsum(a2) * scale;
    logits[r + 3] = hsum(a3) * scale;
  }
  for (; r < n; ++r) {
    EV a = ev_zero();
    for (Index d = 0; d < kDim; d += kEL) a = ev_fmadd(ev_loadf(q + d), load(k + r * kDim + d), a);
    logits[r] = hsum(a) * scale;
  }
  softmax(logits, n);
  // p.V in passes of eight vectors of columns (named accumulators: no spills at -O2).
  for (Index d = 0; d < kDim; d += 8 * kEL) {
    EV a0 = ev_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (Index i = 0; i < n; ++i) {
      const EV p = ev_set1(logits[i]);
      const Eigen::half* row = v + i * kDim + d;
      a0 = ev_fmadd(p, load(row), a0);
      a1 = ev_fmadd(p, load(row + kEL), a1);
      a2 = ev_fmadd(p, load(row + 2 * kEL), a2);
      a3 = ev_fmadd(p, load(row + 3 * kEL), a3);
      a4 = ev_fmadd(p, load(row + 4 * kEL), a4);
      a5 = ev_fmadd(p, load(row + 5 * kEL), a5);
      a6 = ev_fmadd(p, load(row + 6 * kEL), a6);
      a7 = ev_fmadd(p, load(row + 7 * kEL), a7);
    }
    ev_store(out + d, a0);
    ev_store(out + d + kEL, a1);
    ev_store(out + d + 2 * kEL, a2);
    ev_store(out + d + 3 * kEL, a3);
    ev_store(out + d + 4 * kEL, a4);
    ev_store(out + d + 5 * kEL, a5);
    ev_store(out + d + 6 * kEL, a6);
    ev_store(out + d + 7 * kEL, a7);
  }
}

void BM_AttentionF16Dot(benchmark::State& state) {
  if (!engine_f16_supported()) {
    state.SkipWithError("no F16C/AVX2 on this CPU");
    return;
  }
  const Index n = state.range(0);
  const auto k = random_tensor<Eigen::half>(1, kHeads, n, kDim, 2);
  const auto v = random_tensor<Eigen::half>(1, kHeads, n, kDim, 3);
  const auto q = random_tensor<float>(1, kHeads, 1, kDim, 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  std::vector<float> logits(static_cast<std::size_t>(n)), out(kDim);
  for (auto _ : state) {
    for (Index h = 0; h < kHeads; ++h) {
      attention_f16(k.data() + h * n * kDim, v.data() + h * n * kDim, q.data() + h * kDim, n, scale,
                    logits.data(), out.data());
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AttentionF16Dot)->Arg(513)->Arg(2049)->Unit(benchmark::kMicrosecond);
#endif

BENCHMARK(BM_DecodeView)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AttentionF32Gemv)->Arg(513)->Arg(2049)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeViewThreads)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_DecodeViewKeyDiff)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeViewKNorm)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);

// ---- attend: decode ----------------------------------------------------------------------------

constexpr Index kAttendKv = 8;
constexpr Index kAttendGroups = 4;
constexpr Index kAttendQ = kAttendKv * kAttendGroups;

vc::KVCacheConfig squeeze_config(int budget) {
  vc::KVCacheConfig cfg;  // method "squeeze"; no coordinator: the uniform budget
  cfg.set_budget(budget);
  return cfg;
}

// One decode step through attend() on a SqueezeAttention layer of `config`, at `budget`.
void decode_attend(benchmark::State& state, const vc::KVCacheConfig& config, int budget) {
  vc::SqueezeAttentionCache<Eigen::half> cache(config);
  const auto prompt_k = random_tensor<Eigen::half>(1, kAttendKv, budget, kDim, 1);
  const auto prompt_q = random_tensor<float>(1, kAttendQ, budget, kDim, 2);
  (void)cache.update_and_view(prompt_k, prompt_k, prompt_q);
  const auto k = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, 3);
  const auto v = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, 4);
  const auto q = random_tensor<float>(1, kAttendQ, 1, kDim, 5);
  std::vector<float> out(static_cast<std::size_t>(kAttendQ * kDim));
  for (auto _ : state) {
    cache.attend(q, k, v, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["kept_bytes"] = static_cast<double>(cache.kept_bytes());
  state.counters["heap_bytes"] = static_cast<double>(cache.heap_bytes());
}

// ---- speculative decoding (docs/design.md 10.2) ----------------------------------------------
// A layer at budget 2048 (past it: every call evicts), k-token attend calls (a draft verified in
// one call): alone (BM_DraftAttend), and between KVCacheBuilder::checkpoint and rollback
// (BM_CheckpointAttendRollback), which must cost at most 1.3x (SPEC 13.2).

std::vector<std::unique_ptr<vc::KVCache<Eigen::half>>> speculative_layer(int budget) {
  std::vector<std::unique_ptr<vc::KVCache<Eigen::half>>> set;
  set.push_back(std::make_unique<vc::SqueezeAttentionCache<Eigen::half>>(squeeze_config(budget)));
  const auto prompt_k = random_tensor<Eigen::half>(1, kAttendKv, budget + 64, kDim, 1);
  const auto prompt_q = random_tensor<float>(1, kAttendQ, budget + 64, kDim, 2);
  (void)set.front()->update_and_view(prompt_k, prompt_k, prompt_q);
  return set;
}

void draft_attend(benchmark::State& state, bool rollback) {
  const Index k = state.range(0);
  auto set = speculative_layer(2048);
  const auto keys = random_tensor<Eigen::half>(1, kAttendKv, k, kDim, 3);
  const auto values = random_tensor<Eigen::half>(1, kAttendKv, k, kDim, 4);
  const auto q = random_tensor<float>(1, kAttendQ, k, kDim, 5);
  std::vector<float> out(static_cast<std::size_t>(kAttendQ * k * kDim));
  const std::size_t heap_before = set.front()->heap_bytes();
  for (auto _ : state) {
    if (rollback) vc::KVCacheBuilder::checkpoint(set);
    set.front()->attend(q, keys, values, out.data());
    if (rollback) vc::KVCacheBuilder::rollback(set);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["extra_heap"] =
      static_cast<double>(set.front()->heap_bytes()) - static_cast<double>(heap_before);
  state.counters["kept_bytes"] = static_cast<double>(set.front()->kept_bytes());
}
void BM_DraftAttend(benchmark::State& state) { draft_attend(state, false); }
void BM_CheckpointAttendRollback(benchmark::State& state) { draft_attend(state, true); }
BENCHMARK(BM_DraftAttend)->DenseRange(1, 8)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CheckpointAttendRollback)->DenseRange(1, 8)->Unit(benchmark::kMicrosecond);

void BM_DecodeAttend(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  decode_attend(state, squeeze_config(budget), budget);
}

// BM_DecodeAttend with keys and values quantized to `bits`, group 32.
void BM_DecodeAttendQuant(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config = squeeze_config(budget);
  config.key_bits = config.value_bits = static_cast<int>(state.range(1));
  config.quant_group = 32;
  decode_attend(state, config, budget);
}
// BM_DecodeAttend with keys and values quantized to `bits` along channels, blocks of 32.
void BM_DecodeAttendChannel(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config = squeeze_config(budget);
  config.key_bits = config.value_bits = static_cast<int>(state.range(1));
  config.key_axis = config.value_axis = "channel";
  config.quant_block = 32;
  decode_attend(state, config, budget);
}
// The heap a channel-axis cache holds against kept_bytes() (SPEC 17: at most 1.25x after 2,000
// decode steps at budget 512): H2O at budget `budget`, keys and values at 4 bits along channels
// in blocks of 32, a `budget`-token prompt and then 2,000 one-token attend calls of fresh random
// rows, every one evicting. One iteration; the counters are the measurement.
void BM_ChannelHeap(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config;
  config.method = "h2o";
  config.set_budget(budget);
  config.key_bits = config.value_bits = 4;
  config.key_axis = config.value_axis = "channel";
  config.quant_block = 32;
  for (auto _ : state) {
    vc::H2OCache<Eigen::half> cache(config);
    const auto pk = random_tensor<Eigen::half>(1, kAttendKv, budget, kDim, 1);
    const auto pq = random_tensor<float>(1, kAttendQ, budget, kDim, 2);
    (void)cache.attend(pq, pk, pk);
    for (int step = 0; step < 2000; ++step) {
      const auto seed = static_cast<std::uint32_t>(10 + 3 * step);
      const auto k = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, seed);
      const auto v = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, seed + 1);
      const auto q = random_tensor<float>(1, kAttendQ, 1, kDim, seed + 2);
      benchmark::DoNotOptimize(cache.attend(q, k, v).data());
    }
    state.counters["kept_bytes"] = static_cast<double>(cache.kept_bytes());
    state.counters["heap_bytes"] = static_cast<double>(cache.heap_bytes());
    state.counters["heap_per_kept"] =
        static_cast<double>(cache.heap_bytes()) / static_cast<double>(cache.kept_bytes());
    state.counters["half_rows_bytes"] = static_cast<double>(budget) * kAttendKv * kDim * 2 * 2;
  }
}
// BM_DecodeAttend ranking the evictions by score * |v|^2 (value_norm_power, docs/design.md 4.8).
void BM_DecodeAttendValueNorm(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config = squeeze_config(budget);
  config.value_norm_power = 2.0;
  decode_attend(state, config, budget);
}
BENCHMARK(BM_DecodeAttendValueNorm)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);
// BM_DecodeAttend with adaptive heads (SPEC 14, docs/design.md 4.9): the layer's 8 heads share
// 8 x budget rows; every step's up to 8 evictions are one pooled selection. Default floor; the
// second variant also ranks by score * |v|^2 (the recommended setting with queries).
void BM_DecodeAttendAdaptive(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config = squeeze_config(budget);
  config.head_budgets = "adaptive";
  decode_attend(state, config, budget);
}
void BM_DecodeAttendAdaptiveValueNorm(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  vc::KVCacheConfig config = squeeze_config(budget);
  config.head_budgets = "adaptive";
  config.value_norm_power = 2.0;
  decode_attend(state, config, budget);
}
BENCHMARK(BM_DecodeAttendAdaptive)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAttendAdaptiveValueNorm)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);

// A small layer (8 heads, D = 64, H2O with queries at budget 256) whose decode steps cycle
// through 64 random tokens, so that the heads' shares drift: uniform heads (argument 0) against
// adaptive ones (1), where the pooled selection is a larger part of the step (BENCHMARKS.md 16).
void BM_DecodeAttendSmall(benchmark::State& state) {
  constexpr Index kSmallHeads = 8, kSmallDim = 64;
  constexpr int kBudget = 256;
  vc::KVCacheConfig config;
  config.method = "h2o";
  config.set_budget(kBudget);
  if (state.range(0) == 1) config.head_budgets = "adaptive";
  auto cache = vc::KVCacheFactory::create<Eigen::half>(config);
  const auto prompt_k = random_tensor<Eigen::half>(1, kSmallHeads, kBudget, kSmallDim, 1);
  const auto prompt_q = random_tensor<float>(1, kSmallHeads, kBudget, kSmallDim, 2);
  (void)cache->update_and_view(prompt_k, prompt_k, prompt_q);
  std::vector<vc::Tensor4<Eigen::half>> keys, values;
  std::vector<vc::Tensor4<float>> queries;
  for (std::uint32_t i = 0; i < 64; ++i) {
    keys.push_back(random_tensor<Eigen::half>(1, kSmallHeads, 1, kSmallDim, 100u + i));
    values.push_back(random_tensor<Eigen::half>(1, kSmallHeads, 1, kSmallDim, 200u + i));
    queries.push_back(random_tensor<float>(1, kSmallHeads, 1, kSmallDim, 300u + i));
  }
  std::vector<float> out(static_cast<std::size_t>(kSmallHeads * kSmallDim));
  std::size_t step = 0;
  for (auto _ : state) {
    const std::size_t t = step++ % 64;
    cache->attend(queries[t], keys[t], values[t], out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(state.range(0) == 1 ? "adaptive" : "uniform");
}
BENCHMARK(BM_DecodeAttendSmall)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// BM_DecodeAttend on one kernel path (second argument: the SimdLevel's number; paths this CPU
// cannot run are skipped): the paths side by side in one binary (BENCHMARKS.md section 12).
void BM_DecodeAttendPath(benchmark::State& state) {
  const auto level = static_cast<vc::SimdLevel>(state.range(1));
  if (!vc::simd_level_supported(level)) {
    state.SkipWithError("this CPU cannot run the path");
    return;
  }
  const vc::SimdLevel saved = vc::simd_level();
  vc::set_simd_level(level);
  const int budget = static_cast<int>(state.range(0));
  decode_attend(state, squeeze_config(budget), budget);
  vc::set_simd_level(saved);
  state.SetLabel(vc::simd_level_name(level));
}
BENCHMARK(BM_DecodeAttendPath)
    ->ArgsProduct({{512, 2048}, {0, 1, 2, 3, 4}})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_DecodeAttendQuant)
    ->Args({512, 8})
    ->Args({512, 4})
    ->Args({2048, 8})
    ->Args({2048, 4})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAttendChannel)
    ->Args({512, 4})
    ->Args({2048, 4})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ChannelHeap)->Arg(512)->Iterations(1)->Unit(benchmark::kMillisecond);

// One decode step of a whole model: `layers` layers at budget `budget` (H 8, G 4, D 128 each, one
// cache per layer), each layer's attend once per iteration, its rows half (bits 16) or 4-bit along
// channels in blocks of 32 (bits 4). Unlike BM_DecodeAttend, whose one layer stays in the caches
// between steps, a layer's rows here come from memory as in an engine (64 layers at 2048 half
// rows: 512 MiB). Per iteration: a step of every layer. The prompts are absorbed without queries
// (the rows are what is measured; scoring them by queries would cost minutes of set-up).
void BM_DecodeLayers(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  const int bits = static_cast<int>(state.range(1));
  const auto layers = static_cast<std::size_t>(state.range(2));
  vc::KVCacheConfig config = squeeze_config(budget);
  if (bits < 16) {
    config.key_bits = config.value_bits = bits;
    config.key_axis = config.value_axis = "channel";
    config.quant_block = 32;
  }
  const auto prompt_k = random_tensor<Eigen::half>(1, kAttendKv, budget, kDim, 1);
  std::vector<std::unique_ptr<vc::SqueezeAttentionCache<Eigen::half>>> model;
  for (std::size_t l = 0; l < layers; ++l) {
    model.push_back(std::make_unique<vc::SqueezeAttentionCache<Eigen::half>>(config));
    (void)model.back()->update_and_view(prompt_k, prompt_k);
  }
  const auto k = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, 3);
  const auto v = random_tensor<Eigen::half>(1, kAttendKv, 1, kDim, 4);
  const auto q = random_tensor<float>(1, kAttendQ, 1, kDim, 5);
  std::vector<float> out(static_cast<std::size_t>(kAttendQ * kDim));
  for (auto _ : state) {
    for (auto& cache : model) cache->attend(q, k, v, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  std::size_t kept = 0;
  for (const auto& cache : model) kept += cache->kept_bytes();
  state.SetItemsProcessed(state.iterations());
  state.counters["kept_bytes"] = static_cast<double>(kept);
}
BENCHMARK(BM_DecodeLayers)
    ->Args({2048, 16, 64})
    ->Args({2048, 4, 64})
    ->Args({512, 16, 64})
    ->Args({512, 4, 64})
    ->Unit(benchmark::kMillisecond);

// Decode attention with grouped queries over fp32 rows: Eigen GEMMs (the build's flags).
void BM_DecodeGQAF32Gemm(benchmark::State& state) {
  const Index n = state.range(0);
  using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto k = random_tensor<float>(1, kAttendKv, n, kDim, 2);
  const auto v = random_tensor<float>(1, kAttendKv, n, kDim, 3);
  const auto q = random_tensor<float>(1, kAttendQ, 1, kDim, 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  MatF logits(kAttendGroups, n), out(kAttendGroups, kDim);
  for (auto _ : state) {
    for (Index h = 0; h < kAttendKv; ++h) {
      const RowsF kh(k.data() + h * n * kDim, n, kDim), vh(v.data() + h * n * kDim, n, kDim);
      const RowsF qh(q.data() + h * kAttendGroups * kDim, kAttendGroups, kDim);
      logits.noalias() = qh * kh.transpose();
      logits *= scale;
      for (Index g = 0; g < kAttendGroups; ++g) softmax(logits.row(g).data(), n);
      out.noalias() = logits * vh;
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetItemsProcessed(state.iterations());
}

#if defined(VQ_BENCH_F16)
// Dense GQA decode attention over fp16 rows: each key row is converted once and met by the four
// query rows; each value row is converted once and accumulated into the four outputs (two
// column vectors per pass: 8 accumulators).
VQ_BENCH_F16 void gqa_attention_f16(const Eigen::half* k, const Eigen::half* v, const float* q,
                                    Index n, float scale, float* logits, float* out) {
  for (Index r = 0; r < n; ++r) {
    EV a0 = ev_zero(), a1 = a0, a2 = a0, a3 = a0;
    for (Index d = 0; d < kDim; d += kEL) {
      const EV x = load(k + r * kDim + d);
      a0 = ev_fmadd(ev_loadf(q + d), x, a0);
      a1 = ev_fmadd(ev_loadf(q + kDim + d), x, a1);
      a2 = ev_fmadd(ev_loadf(q + 2 * kDim + d), x, a2);
      a3 = ev_fmadd(ev_loadf(q + 3 * kDim + d), x, a3);
    }
    logits[r] = hsum(a0) * scale;
    logits[n + r] = hsum(a1) * scale;
    logits[2 * n + r] = hsum(a2) * scale;
    logits[3 * n + r] = hsum(a3) * scale;
  }
  for (Index g = 0; g < kAttendGroups; ++g) softmax(logits + g * n, n);
  for (Index d = 0; d < kDim; d += 2 * kEL) {
    EV a0 = ev_zero(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, e0 = a0, e1 = a0;
    for (Index i = 0; i < n; ++i) {
      const Eigen::half* row = v + i * kDim + d;
      const EV x0 = load(row), x1 = load(row + kEL);
      const EV p0 = ev_set1(logits[i]), p1 = ev_set1(logits[n + i]);
      const EV p2 = ev_set1(logits[2 * n + i]), p3 = ev_set1(logits[3 * n + i]);
      a0 = ev_fmadd(p0, x0, a0);
      a1 = ev_fmadd(p0, x1, a1);
      b0 = ev_fmadd(p1, x0, b0);
      b1 = ev_fmadd(p1, x1, b1);
      c0 = ev_fmadd(p2, x0, c0);
      c1 = ev_fmadd(p2, x1, c1);
      e0 = ev_fmadd(p3, x0, e0);
      e1 = ev_fmadd(p3, x1, e1);
    }
    ev_store(out + d, a0);
    ev_store(out + d + kEL, a1);
    ev_store(out + kDim + d, b0);
    ev_store(out + kDim + d + kEL, b1);
    ev_store(out + 2 * kDim + d, c0);
    ev_store(out + 2 * kDim + d + kEL, c1);
    ev_store(out + 3 * kDim + d, e0);
    ev_store(out + 3 * kDim + d + kEL, e1);
  }
}

void BM_DecodeGQAF16(benchmark::State& state) {
  if (!engine_f16_supported()) {
    state.SkipWithError("no F16C/AVX2 on this CPU");
    return;
  }
  const Index n = state.range(0);
  const auto k = random_tensor<Eigen::half>(1, kAttendKv, n, kDim, 2);
  const auto v = random_tensor<Eigen::half>(1, kAttendKv, n, kDim, 3);
  const auto q = random_tensor<float>(1, kAttendQ, 1, kDim, 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  std::vector<float> logits(static_cast<std::size_t>(kAttendGroups * n)), out(kAttendGroups * kDim);
  for (auto _ : state) {
    for (Index h = 0; h < kAttendKv; ++h) {
      gqa_attention_f16(k.data() + h * n * kDim, v.data() + h * n * kDim,
                        q.data() + h * kAttendGroups * kDim, n, scale, logits.data(), out.data());
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DecodeGQAF16)->Arg(513)->Arg(2049)->Unit(benchmark::kMicrosecond);
#endif

BENCHMARK(BM_DecodeAttend)->Arg(512)->Arg(2048)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeGQAF32Gemm)->Arg(513)->Arg(2049)->Unit(benchmark::kMicrosecond);

// ---- prefill -----------------------------------------------------------------------------------

void BM_PrefillAttend(benchmark::State& state) {
  const Index S = state.range(0);
  const auto k = random_tensor<Eigen::half>(1, kAttendKv, S, kDim, 5);
  const auto q = random_tensor<float>(1, kAttendQ, S, kDim, 6);
  std::vector<float> out(static_cast<std::size_t>(kAttendQ * S * kDim));
  for (auto _ : state) {
    vc::SqueezeAttentionCache<Eigen::half> cache(squeeze_config(512));
    cache.attend(q, k, k, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * S);
}
BENCHMARK(BM_PrefillAttend)->Arg(512)->Arg(2048)->Arg(8192)->Unit(benchmark::kMillisecond);

void BM_PrefillView(benchmark::State& state) {
  const Index S = state.range(0);
  const auto k = random_tensor<Eigen::half>(1, kHeads, S, kDim, 5);
  for (auto _ : state) {
    vc::H2OCache<Eigen::half> cache(h2o_config(512));
    auto view = cache.update_and_view(k, k);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

void BM_PrefillViewQueries(benchmark::State& state) {
  const Index S = state.range(0);
  const auto k = random_tensor<Eigen::half>(1, kHeads / 4, S, kDim, 5);
  const auto q = random_tensor<float>(1, kHeads, S, kDim, 6);
  for (auto _ : state) {
    vc::H2OCache<Eigen::half> cache(h2o_config(512));
    auto view = cache.update_and_view(k, k, q);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// Causal attention of S tokens, 32 query heads over H KV heads (fp32 rows, Eigen GEMMs): per
// query head, blocks of 64 query rows attend over the keys up to their last row.
void BM_CausalAttention(benchmark::State& state) {
  const Index S = state.range(0), H = state.range(1), G = kHeads / H;
  const auto q = random_tensor<float>(1, kHeads, S, kDim, 6);
  const auto k = random_tensor<float>(1, H, S, kDim, 7);
  const auto v = random_tensor<float>(1, H, S, kDim, 8);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  constexpr Index kBlock = 64;
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> p(kBlock, S), out(kBlock, kDim);
  for (auto _ : state) {
    for (Index hq = 0; hq < kHeads; ++hq) {
      const Index h = hq / G;
      const RowsF qh(q.data() + hq * S * kDim, S, kDim), kh(k.data() + h * S * kDim, S, kDim),
          vh(v.data() + h * S * kDim, S, kDim);
      for (Index i0 = 0; i0 < S; i0 += kBlock) {
        const Index nb = std::min(kBlock, S - i0), cols = i0 + nb;
        auto pb = p.topLeftCorner(nb, cols);
        pb.noalias() = qh.middleRows(i0, nb) * kh.topRows(cols).transpose();
        for (Index t = 0; t < nb; ++t) {
          auto row = pb.row(t);
          const Index visible = i0 + t + 1;
          row.tail(cols - visible).setConstant(-std::numeric_limits<float>::infinity());
          row *= scale;
          row = (row.array() - row.maxCoeff()).exp();
          row /= row.sum();
        }
        out.topRows(nb).noalias() = pb * vh.topRows(cols);
        benchmark::DoNotOptimize(out.data());
      }
    }
  }
  state.SetItemsProcessed(state.iterations() * S);
}

BENCHMARK(BM_PrefillView)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PrefillViewQueries)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CausalAttention)->Args({1024, 32})->Args({4096, 32})->Args({1024, 8})->Args({4096, 8})->Args({512, 8})->Args({2048, 8})->Args({8192, 8})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
