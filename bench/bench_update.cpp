// veloxquant — Google Benchmark suite for the eviction core. Every group runs its comparison point
// in the same binary, so each figure reads as a ratio (see BENCHMARKS.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <veloxquant/cache.hpp>

#include "bench_support.hpp"
#include "reference/oracle.hpp"

namespace vc = veloxquant::cache;
using Eigen::Index;

namespace {

constexpr Index kHeadDim = 128;

// The comparison points' own helpers: rows of T to float32, and a max-subtracted softmax.
template <class T>
void convert_rows(const T* rows, Index n, Index d, float* out) {
  Eigen::Map<Eigen::VectorXf>(out, n * d) =
      Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(rows, n * d).template cast<float>();
}
inline void softmax_inplace(float* x, Index n) {
  Eigen::Map<Eigen::ArrayXf> a(x, n);
  a = (a - a.maxCoeff()).exp();
  a /= a.sum();
}

template <class T>
vc::Tensor4<T> random_tokens(Index heads, Index s, std::uint32_t seed) {
  return veloxquant::bench::random_tensor<T>(1, heads, s, kHeadDim, seed);
}

vc::KVCacheConfig h2o_config(int budget) {
  vc::KVCacheConfig cfg;
  cfg.method = "h2o";
  cfg.h2o_budget = budget;
  return cfg;
}

// A pool of decode tokens so the timed loop does no random generation. keys: [1, H, 1, D]
template <class T>
std::vector<vc::Tensor4<T>> token_pool(Index heads, int n) {
  std::vector<vc::Tensor4<T>> pool;
  for (int i = 0; i < n; ++i) pool.push_back(random_tokens<T>(heads, 1, 1000u + static_cast<unsigned>(i)));
  return pool;
}

// ---- 1. decode step: update_and_view vs dense single-query attention over the same rows ----

// An H2O cache prefilled to its budget (H heads, D = 128), then `step(cache, token)` timed per
// decode step over a pool of pre-generated tokens. range(0): budget, range(1): heads.
template <class T, class Step>
void run_decode(benchmark::State& state, Step step) {
  const int budget = static_cast<int>(state.range(0));
  const Index heads = state.range(1);
  vc::H2OCache<T> cache(h2o_config(budget));
  const auto prompt = random_tokens<T>(heads, budget, 1);
  cache.update_and_fetch(prompt, prompt);
  const auto pool = token_pool<T>(heads, 64);
  std::size_t i = 0;
  for (auto _ : state) step(cache, pool[i++ % pool.size()]);
  state.SetItemsProcessed(state.iterations());
  state.counters["rows"] = static_cast<double>(budget + 1);
}

template <class T>
void BM_DecodeView(benchmark::State& state) {
  run_decode<T>(state, [](vc::H2OCache<T>& cache, const vc::Tensor4<T>& k) {
    auto view = cache.update_and_view(k, k);
    benchmark::DoNotOptimize(view.rows());
  });
}

template <class T>
void BM_DecodeFetch(benchmark::State& state) {
  run_decode<T>(state, [](vc::H2OCache<T>& cache, const vc::Tensor4<T>& k) {
    auto kv = cache.update_and_fetch(k, k);
    benchmark::DoNotOptimize(kv.first.data());
  });
}

template <class T>
void BM_DecodeFetchInto(benchmark::State& state) {
  vc::KVPair<T> out;
  run_decode<T>(state, [&out](vc::H2OCache<T>& cache, const vc::Tensor4<T>& k) {
    cache.update_and_fetch_into(k, k, out);
    benchmark::DoNotOptimize(out.first.data());
  });
}

// Dense attention of one query per head over n rows: softmax(q K^T / sqrt(D)) V, with half rows
// converted to float32 in chunks (a lazy cast inside the product is ~25x slower).
template <class T>
void BM_DenseAttention(benchmark::State& state) {
  const Index n = state.range(0) + 1;
  const Index heads = state.range(1);
  const auto k = random_tokens<T>(heads, n, 2);
  const auto v = random_tokens<T>(heads, n, 3);
  const auto q = random_tokens<float>(heads, 1, 4);
  using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  constexpr Index kChunk = 64;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (auto _ : state) {
    // Heads on all cores, as an engine would (and as the cache does).
#pragma omp parallel
    {
    std::vector<float> buf(static_cast<std::size_t>(kChunk * kHeadDim));
    Eigen::VectorXf logits(n), out(kHeadDim);
#pragma omp for schedule(static)
    for (Index h = 0; h < heads; ++h) {
      const T* kh = k.data() + h * n * kHeadDim;
      const T* vh = v.data() + h * n * kHeadDim;
      const Eigen::Map<const Eigen::VectorXf> qh(q.data() + h * kHeadDim, kHeadDim);
      for (Index r0 = 0; r0 < n; r0 += kChunk) {
        const Index m = std::min(kChunk, n - r0);
        convert_rows(kh + r0 * kHeadDim, m, kHeadDim, buf.data());
        logits.segment(r0, m).noalias() = RowsF(buf.data(), m, kHeadDim) * qh;
      }
      logits *= scale;
      softmax_inplace(logits.data(), n);
      out.setZero();
      for (Index r0 = 0; r0 < n; r0 += kChunk) {
        const Index m = std::min(kChunk, n - r0);
        convert_rows(vh + r0 * kHeadDim, m, kHeadDim, buf.data());
        out.noalias() += RowsF(buf.data(), m, kHeadDim).transpose() * logits.segment(r0, m);
      }
      benchmark::DoNotOptimize(out.data());
    }
    }
  }
  state.SetItemsProcessed(state.iterations());
}

void DecodeArgs(benchmark::internal::Benchmark* b) {
  for (int budget : {256, 512, 1024, 2048}) b->Args({budget, 32});
  for (int heads : {8, 16, 64}) b->Args({512, heads});
}

BENCHMARK_TEMPLATE(BM_DecodeView, Eigen::half)->Apply(DecodeArgs);
BENCHMARK_TEMPLATE(BM_DecodeView, float)->Apply(DecodeArgs);
BENCHMARK_TEMPLATE(BM_DenseAttention, Eigen::half)->Apply(DecodeArgs);
BENCHMARK_TEMPLATE(BM_DenseAttention, float)->Apply(DecodeArgs);
BENCHMARK_TEMPLATE(BM_DecodeFetchInto, Eigen::half)->Args({512, 32})->Args({2048, 32});
BENCHMARK_TEMPLATE(BM_DecodeFetchInto, float)->Args({512, 32})->Args({2048, 32});
BENCHMARK_TEMPLATE(BM_DecodeFetch, Eigen::half)->Args({512, 32})->Args({2048, 32});
BENCHMARK_TEMPLATE(BM_DecodeFetch, float)->Args({512, 32})->Args({2048, 32});

// ---- 3. prefill into budget 512 vs causal attention logits + softmax over the same tokens ----

template <class T>
void BM_PrefillSqueeze(benchmark::State& state) {
  const Index S = state.range(0);
  const bool defer = state.range(1) != 0;
  constexpr Index kHeads = 32;
  const auto prompt = random_tokens<T>(kHeads, S, 5);
  vc::KVCacheConfig cfg;
  cfg.squeeze_budget = 512;
  cfg.squeeze_defer = defer;
  for (auto _ : state) {
    // Layer 0 of a two-layer model: its prefill does not complete the coordinator, so without
    // deferral it evicts against squeeze_budget meanwhile and with deferral it keeps every row.
    auto caches = vc::KVCacheBuilder::for_model<T>(2, cfg);
    auto view = caches[0]->update_and_view(prompt, prompt);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

template <class T>
void BM_CausalAttentionScores(benchmark::State& state) {
  const Index S = state.range(0);
  constexpr Index kHeads = 32;
  const auto k = random_tokens<T>(kHeads, S, 5);
  const auto q = random_tokens<float>(kHeads, S, 6);
  using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (auto _ : state) {
#pragma omp parallel
    {
    std::vector<float> kf(static_cast<std::size_t>(S * kHeadDim));
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> logits(64, S);
#pragma omp for schedule(static)
    for (Index h = 0; h < kHeads; ++h) {
      convert_rows(k.data() + h * S * kHeadDim, S, kHeadDim, kf.data());
      const RowsF kh(kf.data(), S, kHeadDim);
      for (Index i0 = 0; i0 < S; i0 += 64) {
        const Index nb = std::min<Index>(64, S - i0);
        const Index cols = i0 + nb;  // causal: rows up to the block's last token
        const RowsF qb(q.data() + (h * S + i0) * kHeadDim, nb, kHeadDim);
        logits.topLeftCorner(nb, cols).noalias() = qb * kh.topRows(cols).transpose() * scale;
        for (Index t = 0; t < nb; ++t) {
          softmax_inplace(logits.row(t).data(), i0 + t + 1);
        }
      }
      benchmark::DoNotOptimize(logits.data());
    }
    }
  }
  state.SetItemsProcessed(state.iterations() * S);
}

void BM_PrefillReferenceOracle(benchmark::State& state) {
  const Index S = state.range(0);
  constexpr Index kHeads = 32;
  const auto k = random_tokens<float>(kHeads, S, 5);
  for (auto _ : state) {
    for (Index h = 0; h < kHeads; ++h) {
      veloxquant::reference::ReferenceAlgorithmHeadOracle oracle(4, 512);
      for (Index s = 0; s < S; ++s) {
        const float* row = k.data() + (h * S + s) * kHeadDim;
        std::vector<double> key(row, row + kHeadDim);
        oracle.absorb(key, key);
      }
      benchmark::DoNotOptimize(oracle.rows().data());
    }
  }
  state.SetItemsProcessed(state.iterations() * S);
}

BENCHMARK_TEMPLATE(BM_PrefillSqueeze, Eigen::half)
    ->ArgsProduct({{512, 2048, 8192}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_PrefillSqueeze, float)
    ->ArgsProduct({{512, 2048, 8192}, {0, 1}})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_CausalAttentionScores, Eigen::half)
    ->Arg(512)->Arg(2048)->Arg(8192)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_CausalAttentionScores, float)
    ->Arg(512)->Arg(2048)->Arg(8192)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PrefillReferenceOracle)->Arg(2048)->Unit(benchmark::kMillisecond)->Iterations(1);

// ---- 4. memory: heap held vs kept_bytes() after prefill and after many decode steps ----

template <class T>
void BM_MemoryAfterDecode(benchmark::State& state) {
  const Index S = state.range(0);
  const Index steps = state.range(1);
  constexpr Index kHeads = 32;
  const auto prompt = random_tokens<T>(kHeads, S, 7);
  const auto pool = token_pool<T>(kHeads, 64);
  double heap = 0, kept = 0, heap_prefill = 0, kept_prefill = 0;
  for (auto _ : state) {
    vc::H2OCache<T> cache(h2o_config(512));
    cache.update_and_view(prompt, prompt);
    heap_prefill = static_cast<double>(cache.heap_bytes());
    kept_prefill = static_cast<double>(cache.kept_bytes());
    for (Index i = 0; i < steps; ++i) cache.update_and_view(pool[static_cast<std::size_t>(i) % 64], pool[static_cast<std::size_t>(i) % 64]);
    heap = static_cast<double>(cache.heap_bytes());
    kept = static_cast<double>(cache.kept_bytes());
  }
  state.counters["heap_prefill_MiB"] = heap_prefill / (1 << 20);
  state.counters["kept_prefill_MiB"] = kept_prefill / (1 << 20);
  state.counters["heap_MiB"] = heap / (1 << 20);
  state.counters["kept_MiB"] = kept / (1 << 20);
  state.counters["heap_over_kept"] = heap / kept;
}
BENCHMARK_TEMPLATE(BM_MemoryAfterDecode, Eigen::half)
    ->Args({8192, 100000})->Iterations(1)->Unit(benchmark::kSecond);

// ---- policies side by side: decode step and prefill of TOVA, StreamingLLM, SnapKV vs H2O ----

const char* const kPolicies[] = {"h2o", "tova", "streaming_llm", "snapkv", "pyramidkv"};

template <class T>
std::unique_ptr<vc::KVCache<T>> make_policy(Index which, int budget) {
  vc::KVCacheConfig cfg;
  cfg.method = kPolicies[which];
  cfg.h2o_budget = cfg.tova_budget = cfg.snap_budget = cfg.pyramid_budget = budget;
  cfg.stream_window_size = budget - cfg.stream_n_sink;
  return vc::KVCacheFactory::create<T>(cfg);
}

// Decode steps after a prompt of `budget` tokens. SnapKV never evicts after the prompt, so its
// rows grow by one per step; it runs a fixed 2000 steps (budget + 1 .. budget + 2000 rows).
// Decode steps of `cache` (H = 32, D = 128) after a prompt of budget + 1 tokens, one per iteration.
template <class T>
void decode_steps(benchmark::State& state, vc::KVCache<T>& cache, int budget) {
  constexpr Index kHeads = 32;
  const auto prompt = random_tokens<T>(kHeads, budget + 1, 1);
  cache.update_and_view(prompt, prompt);
  const auto pool = token_pool<T>(kHeads, 64);
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& k = pool[i++ % pool.size()];
    auto view = cache.update_and_view(k, k);
    benchmark::DoNotOptimize(view.rows());
  }
}

template <class T>
void BM_PolicyDecode(benchmark::State& state) {
  const Index which = state.range(0);
  const int budget = static_cast<int>(state.range(1));
  auto cache = make_policy<T>(which, budget);
  decode_steps(state, *cache, budget);
  state.SetLabel(kPolicies[which]);
  state.SetItemsProcessed(state.iterations());
  state.counters["rows_end"] = static_cast<double>(cache->tokens_kept());
}
BENCHMARK_TEMPLATE(BM_PolicyDecode, Eigen::half)->Args({0, 512})->Args({1, 512})->Args({2, 512})
    ->Args({4, 512})->Args({0, 2048})->Args({1, 2048})->Args({2, 2048});
BENCHMARK_TEMPLATE(BM_PolicyDecode, Eigen::half)->Args({3, 512})->Iterations(2000);

template <class T>
void BM_PolicyPrefill(benchmark::State& state) {
  const Index which = state.range(0);
  const Index S = state.range(1);
  constexpr Index kHeads = 32;
  const auto prompt = random_tokens<T>(kHeads, S, 5);
  for (auto _ : state) {
    auto cache = make_policy<T>(which, 512);
    auto view = cache->update_and_view(prompt, prompt);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetLabel(kPolicies[which]);
  state.SetItemsProcessed(state.iterations() * S);
}
BENCHMARK_TEMPLATE(BM_PolicyPrefill, Eigen::half)
    ->ArgsProduct({{0, 1, 2, 3}, {2048, 8192}})->Unit(benchmark::kMillisecond);

// ---- query-free scorers (docs/design.md 4.7): H2O at a fixed budget, half, H = 32, D = 128 ----
const char* const kScorers[] = {"key_as_query", "keydiff", "knorm"};

template <class T>
std::unique_ptr<vc::KVCache<T>> make_scored_h2o(Index scorer, int budget) {
  vc::KVCacheConfig cfg;
  cfg.method = "h2o";
  cfg.h2o_budget = budget;
  cfg.proxy_scoring = kScorers[scorer];
  return vc::KVCacheFactory::create<T>(cfg);
}

// Decode steps (one eviction each) after a prompt of budget + 1 tokens. range(0): the scorer.
template <class T>
void BM_ScorerDecode(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(1));
  auto cache = make_scored_h2o<T>(state.range(0), budget);
  decode_steps(state, *cache, budget);
  state.SetLabel(kScorers[state.range(0)]);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK_TEMPLATE(BM_ScorerDecode, Eigen::half)->ArgsProduct({{0, 1, 2}, {512, 2048}});

// A prompt of S tokens into a fresh cache of budget 512 (evicting per token past the budget).
template <class T>
void BM_ScorerPrefill(benchmark::State& state) {
  const Index S = state.range(1);
  constexpr Index kHeads = 32;
  const auto prompt = random_tokens<T>(kHeads, S, 5);
  for (auto _ : state) {
    auto cache = make_scored_h2o<T>(state.range(0), 512);
    auto view = cache->update_and_view(prompt, prompt);
    benchmark::DoNotOptimize(view.rows());
  }
  state.SetLabel(kScorers[state.range(0)]);
  state.SetItemsProcessed(state.iterations() * S);
}
BENCHMARK_TEMPLATE(BM_ScorerPrefill, Eigen::half)
    ->ArgsProduct({{0, 1, 2}, {2048}})->Unit(benchmark::kMillisecond);

// ---- real-query scoring (docs/design.md 4.6): a Llama-3-8B layer, G = 4 per KV head ----
// H = 8 KV heads, Hq = 32 query heads, D = 128. Each comparison point runs the same shapes.

constexpr Index kKvHeads = 8;

// Decode steps of an H2O cache prefilled to its budget. range(0): budget; range(1): G, or 0 for
// the key-as-query proxy (no queries passed).
template <class T>
void BM_QueryDecode(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  const Index groups = state.range(1);
  vc::H2OCache<T> cache(h2o_config(budget));
  const auto prompt = random_tokens<T>(kKvHeads, budget, 1);
  cache.update_and_view(prompt, prompt);
  const auto pool = token_pool<T>(kKvHeads, 64);
  std::vector<vc::Tensor4<float>> queries;
  for (int i = 0; i < 64; ++i) {
    queries.push_back(random_tokens<float>(kKvHeads * std::max<Index>(groups, 1), 1,
                                           2000u + static_cast<unsigned>(i)));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t j = i++ % pool.size();
    if (groups > 0) {
      auto view = cache.update_and_view(pool[j], pool[j], queries[j]);
      benchmark::DoNotOptimize(view.rows());
    } else {
      auto view = cache.update_and_view(pool[j], pool[j]);
      benchmark::DoNotOptimize(view.rows());
    }
  }
  state.SetItemsProcessed(state.iterations());
}

// The engine's own decode attention with grouped queries: for each KV head, its G query heads
// attend over n rows (logits, softmax, weighted sum of values), half rows converted in chunks.
// range(0): rows - 1 (the budget); range(1): G.
template <class T>
void BM_DenseGQAAttention(benchmark::State& state) {
  const Index n = state.range(0) + 1;
  const Index groups = state.range(1);
  const auto k = random_tokens<T>(kKvHeads, n, 2);
  const auto v = random_tokens<T>(kKvHeads, n, 3);
  const auto q = random_tokens<float>(kKvHeads * groups, 1, 4);
  using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  constexpr Index kChunk = 64;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (auto _ : state) {
#pragma omp parallel
    {
    std::vector<float> buf(static_cast<std::size_t>(kChunk * kHeadDim));
    MatF logits(groups, n), out(groups, kHeadDim);
#pragma omp for schedule(static)
    for (Index h = 0; h < kKvHeads; ++h) {
      const T* kh = k.data() + h * n * kHeadDim;
      const T* vh = v.data() + h * n * kHeadDim;
      const RowsF qh(q.data() + h * groups * kHeadDim, groups, kHeadDim);
      for (Index r0 = 0; r0 < n; r0 += kChunk) {
        const Index m = std::min(kChunk, n - r0);
        convert_rows(kh + r0 * kHeadDim, m, kHeadDim, buf.data());
        logits.middleCols(r0, m).noalias() = qh * RowsF(buf.data(), m, kHeadDim).transpose();
      }
      logits *= scale;
      for (Index g = 0; g < groups; ++g) softmax_inplace(logits.row(g).data(), n);
      out.setZero();
      for (Index r0 = 0; r0 < n; r0 += kChunk) {
        const Index m = std::min(kChunk, n - r0);
        convert_rows(vh + r0 * kHeadDim, m, kHeadDim, buf.data());
        out.noalias() += logits.middleCols(r0, m) * RowsF(buf.data(), m, kHeadDim);
      }
      benchmark::DoNotOptimize(out.data());
    }
    }
  }
  state.SetItemsProcessed(state.iterations());
}

// Prefill of S tokens into an H2O cache of budget 512. range(0): S; range(1): G, or 0 for the
// proxy.
template <class T>
void BM_QueryPrefill(benchmark::State& state) {
  const Index S = state.range(0);
  const Index groups = state.range(1);
  const auto prompt = random_tokens<T>(kKvHeads, S, 5);
  const auto queries = random_tokens<float>(kKvHeads * std::max<Index>(groups, 1), S, 6);
  for (auto _ : state) {
    vc::H2OCache<T> cache(h2o_config(512));
    if (groups > 0) {
      auto view = cache.update_and_view(prompt, prompt, queries);
      benchmark::DoNotOptimize(view.rows());
    } else {
      auto view = cache.update_and_view(prompt, prompt);
      benchmark::DoNotOptimize(view.rows());
    }
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// The engine's causal prefill attention scores with grouped queries: per KV head, blocks of 16
// tokens x G = 4 query heads (64 rows) against the keys up to the block's end, then the softmax
// of each row over its causal prefix. range(0): S; range(1): G.
template <class T>
void BM_CausalGQAScores(benchmark::State& state) {
  const Index S = state.range(0);
  const Index groups = state.range(1);
  const Index tokens = std::max<Index>(1, 64 / groups);
  const auto k = random_tokens<T>(kKvHeads, S, 5);
  const auto q = random_tokens<float>(kKvHeads * groups, S, 6);
  using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (auto _ : state) {
#pragma omp parallel
    {
    std::vector<float> kf(static_cast<std::size_t>(S * kHeadDim));
    std::vector<float> qb(static_cast<std::size_t>(tokens * groups * kHeadDim));
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> logits(tokens * groups, S);
#pragma omp for schedule(static)
    for (Index h = 0; h < kKvHeads; ++h) {
      convert_rows(k.data() + h * S * kHeadDim, S, kHeadDim, kf.data());
      const RowsF kh(kf.data(), S, kHeadDim);
      for (Index i0 = 0; i0 < S; i0 += tokens) {
        const Index nb = std::min(tokens, S - i0);
        const Index cols = i0 + nb;  // causal: rows up to the block's last token
        for (Index t = 0; t < nb; ++t) {
          for (Index g = 0; g < groups; ++g) {
            std::memcpy(qb.data() + (t * groups + g) * kHeadDim,
                        q.data() + ((h * groups + g) * S + i0 + t) * kHeadDim,
                        sizeof(float) * static_cast<std::size_t>(kHeadDim));
          }
        }
        logits.topLeftCorner(nb * groups, cols).noalias() =
            RowsF(qb.data(), nb * groups, kHeadDim) * kh.topRows(cols).transpose() * scale;
        for (Index r = 0; r < nb * groups; ++r) {
          softmax_inplace(logits.row(r).data(), i0 + r / groups + 1);
        }
      }
      benchmark::DoNotOptimize(logits.data());
    }
    }
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// ---- one memory cap over many sequences (SPEC 19, docs/design.md 10.5) ----
// 8 sequences of range(2) Llama-3-8B layers each (8 KV heads, G = 4, D = 128), H2O, decoding with
// the fused attend, one sequence after another. range(1) 0: each cache's own budget of range(0)
// rows is the limit (the policy evicts a row per call); 1: the caches' budget is one row more and
// one MemoryPool of 8 x range(0) rows a head over every layer binds instead (its arbitration and
// trim take the row; a budget just above keeps the heads' storage the same size); 2: the caches
// are attached to a pool 4x that size, which never binds (the turns alone). The difference per
// call is the pool's cost.
constexpr int kPoolSequences = 8;
void BM_PoolDecode(benchmark::State& state) {
  using T = Eigen::half;
  const int rows = static_cast<int>(state.range(0));
  const bool pooled = state.range(1) != 0;
  const bool loose = state.range(1) == 2;  // attached to a pool that never binds
  const auto layers = static_cast<int>(state.range(2));
  const std::size_t row_bytes = 2 * kHeadDim * sizeof(T) * kKvHeads;
  vc::MemoryPool pool(static_cast<std::size_t>(kPoolSequences) * static_cast<std::size_t>(rows) *
                      static_cast<std::size_t>(layers) * row_bytes * (loose ? 4 : 1));
  std::vector<std::vector<std::unique_ptr<vc::KVCache<T>>>> sets;
  const vc::KVCacheConfig config = h2o_config(pooled && !loose ? rows + 1 : rows);
  const Index groups = 4;
  std::vector<float> out(static_cast<std::size_t>(kKvHeads * groups * kHeadDim));
  {
    const auto prompt = random_tokens<T>(kKvHeads, rows, 10u);
    const auto q = random_tokens<float>(kKvHeads * groups, rows, 20u);
    std::vector<float> prefill_out(static_cast<std::size_t>(kKvHeads * groups * rows * kHeadDim));
    for (int s = 0; s < kPoolSequences; ++s) {
      sets.push_back(pooled ? vc::KVCacheBuilder::for_model<T>(layers, config, pool)
                            : vc::KVCacheBuilder::for_model<T>(layers, config));
      for (auto& c : sets.back()) c->attend(q, prompt, prompt, prefill_out.data());
    }
  }
  const auto tokens = token_pool<T>(kKvHeads, 64);
  std::vector<vc::Tensor4<float>> queries;
  for (int i = 0; i < 64; ++i) {
    queries.push_back(random_tokens<float>(kKvHeads * groups, 1, 3000u + static_cast<unsigned>(i)));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    for (auto& set : sets) {
      for (auto& c : set) {
        const std::size_t j = i++ % tokens.size();
        c->attend(queries[j], tokens[j], tokens[j], out.data());
        benchmark::DoNotOptimize(out.data());
      }
    }
  }
  if (pooled && pool.used_bytes() > pool.max_bytes()) state.SkipWithError("above the cap");
  state.SetItemsProcessed(state.iterations() * kPoolSequences * layers);
}
BENCHMARK(BM_PoolDecode)->ArgsProduct({{512, 2048}, {0, 1, 2}, {1}});
BENCHMARK(BM_PoolDecode)->ArgsProduct({{512}, {0, 1, 2}, {32}})->Unit(benchmark::kMillisecond);

BENCHMARK_TEMPLATE(BM_QueryDecode, Eigen::half)->ArgsProduct({{512, 2048}, {0, 1, 4}});
BENCHMARK_TEMPLATE(BM_QueryDecode, float)->ArgsProduct({{512, 2048}, {0, 4}});
BENCHMARK_TEMPLATE(BM_DenseGQAAttention, Eigen::half)->ArgsProduct({{512, 2048}, {4}});
BENCHMARK_TEMPLATE(BM_DenseGQAAttention, float)->ArgsProduct({{512, 2048}, {4}});
BENCHMARK_TEMPLATE(BM_QueryPrefill, Eigen::half)
    ->ArgsProduct({{512, 2048, 8192}, {0, 4}})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_CausalGQAScores, Eigen::half)
    ->ArgsProduct({{512, 2048, 8192}, {4}})->Unit(benchmark::kMillisecond);

// ---- KVzip (SPEC 18, BENCHMARKS.md 18): observe and the whole procedure against the prefill ----
// One Llama-3-8B attention layer: 8 KV heads, 32 query heads (G = 4), D = 128, rows of half.
// range(0): the prompt's tokens S. Each iteration starts from a fresh kvzip cache (built, and
// for observe and the procedure prefilled, with the timer paused).

constexpr Index kKvzipGroups = 4;

vc::KVCacheConfig kvzip_config() {
  vc::KVCacheConfig cfg;
  cfg.method = "kvzip";
  return cfg;
}

// The comparison point: the prompt's prefill, one attend call of S tokens.
void BM_KVzipPrefillAttend(benchmark::State& state) {
  const Index S = state.range(0);
  const auto kv = random_tokens<Eigen::half>(kKvHeads, S, 5);
  const auto q = random_tokens<float>(kKvHeads * kKvzipGroups, S, 6);
  std::vector<float> out(static_cast<std::size_t>(kKvHeads * kKvzipGroups * S * kHeadDim));
  for (auto _ : state) {
    state.PauseTiming();
    vc::KVzipCache<Eigen::half> cache(kvzip_config());
    state.ResumeTiming();
    cache.attend(q, kv, kv, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// observe with S queries (the re-read of the whole prompt) over the S rows of the prompt.
void BM_KVzipObserve(benchmark::State& state) {
  const Index S = state.range(0);
  const auto kv = random_tokens<Eigen::half>(kKvHeads, S, 5);
  const auto q = random_tokens<float>(kKvHeads * kKvzipGroups, S, 7);
  for (auto _ : state) {
    state.PauseTiming();
    vc::KVzipCache<Eigen::half> cache(kvzip_config());
    (void)cache.update_and_view(kv, kv);
    state.ResumeTiming();
    cache.observe(q);
    benchmark::DoNotOptimize(cache.scores(0, 0).data());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// observe with the re-read's own keys too (KVzip's normalisation): the S tokens' keys join each
// query's softmax causally, one more causal product per head.
void BM_KVzipObserveKeys(benchmark::State& state) {
  const Index S = state.range(0);
  const auto kv = random_tokens<Eigen::half>(kKvHeads, S, 5);
  const auto q = random_tokens<float>(kKvHeads * kKvzipGroups, S, 7);
  const auto k = random_tokens<float>(kKvHeads, S, 8);
  for (auto _ : state) {
    state.PauseTiming();
    vc::KVzipCache<Eigen::half> cache(kvzip_config());
    (void)cache.update_and_view(kv, kv);
    state.ResumeTiming();
    cache.observe(q, k);
    benchmark::DoNotOptimize(cache.scores(0, 0).data());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

// The library's part of the whole procedure at this layer (llama2c::kvzip_compress): fork the
// prefilled set, checkpoint it, re-read the prompt in chunks of 64 tokens (an attend of each
// chunk over the prompt and the chunk on the fork, its queries observed on the original with the
// chunk's own keys, as the engine does, the fork rolled back), then compress to a quarter. The engine's projections and feed-forward are not in
// it (BENCHMARKS.md 18 composes them).
void BM_KVzipProcedure(benchmark::State& state) {
  const Index S = state.range(0);
  constexpr Index kChunk = 64;
  const auto kv = random_tokens<Eigen::half>(kKvHeads, S, 5);
  const auto q = random_tokens<float>(kKvHeads * kKvzipGroups, S, 7);
  std::vector<vc::Tensor4<Eigen::half>> chunk_kv;
  std::vector<vc::Tensor4<float>> chunk_q;
  for (Index at = 0; at < S; at += kChunk) {
    const Index n = std::min(kChunk, S - at);
    chunk_kv.push_back(random_tokens<Eigen::half>(kKvHeads, n, 100u + static_cast<unsigned>(at)));
    chunk_q.push_back(
        random_tokens<float>(kKvHeads * kKvzipGroups, n, 200u + static_cast<unsigned>(at)));
  }
  std::vector<float> out(static_cast<std::size_t>(kKvHeads * kKvzipGroups * kChunk * kHeadDim));
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<std::unique_ptr<vc::KVCache<Eigen::half>>> set;
    set.push_back(std::make_unique<vc::KVzipCache<Eigen::half>>(kvzip_config()));
    (void)set[0]->update_and_view(kv, kv);
    state.ResumeTiming();
    auto fork = vc::KVCacheBuilder::fork(set);
    vc::KVCacheBuilder::checkpoint(fork);
    for (std::size_t c = 0; c < chunk_kv.size(); ++c) {
      fork[0]->attend(chunk_q[c], chunk_kv[c], chunk_kv[c], out.data());
      set[0]->observe(chunk_q[c], chunk_kv[c]);
      vc::KVCacheBuilder::rollback(fork);
      vc::KVCacheBuilder::checkpoint(fork);
    }
    fork.clear();
    vc::KVCacheBuilder::compress(set, 0.25);
    benchmark::DoNotOptimize(set[0]->kept_bytes());
  }
  state.SetItemsProcessed(state.iterations() * S);
}

BENCHMARK(BM_KVzipPrefillAttend)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_KVzipObserve)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_KVzipObserveKeys)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_KVzipProcedure)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);

// ---- machine yardsticks for a roofline reading: float32 GEMM throughput and copy bandwidth ----

// The prefill's block product: [64, 128] x [128, 576] float32 (a budget-512 head plus a block).
void BM_GemmBlock(benchmark::State& state) {
  const Index m = 64, k = kHeadDim, n = state.range(0);
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> a(m, k), b(n, k), c(m, n);
  a.setRandom();
  b.setRandom();
  for (auto _ : state) {
    c.noalias() = a * b.transpose();
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(static_cast<double>(2 * m * k * n),
                                                benchmark::Counter::kIsIterationInvariantRate,
                                                benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GemmBlock)->Arg(576)->Arg(2048);

// Copy bandwidth into a reused destination (what update_and_fetch's gather is bounded by).
void BM_CopyBandwidth(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes));
}
BENCHMARK(BM_CopyBandwidth)->Arg(8 << 20)->Arg(64 << 20);

}  // namespace

BENCHMARK_MAIN();
