// Prompt caches on disk (docs/design.md G): save_prompt_cache / load_prompt_cache of a 7B-class
// layer set, to and from memory and a file, against copying the same number of bytes in the same
// binary (BENCHMARKS.md section 9); and KVCacheBuilder::fork of the same set against new +
// memcpy of its kept_bytes() (docs/design.md 10.1, BENCHMARKS.md section 14).
//
// The set: 32 layers of SqueezeAttention (KVCacheBuilder, one shared coordinator), B = 1,
// H = 32 KV heads, D = 128, half rows, average budget 2048 rows per head, after a 2048-token prompt
// and 16 decode steps (every layer calibrated and on its adopted budget, holes from the decode's
// evictions in every head). About 1.07 GB of rows.
//
// Comparison points, each moving exactly the file's bytes:
//   memory: memcpy into a buffer allocated once (save's yardstick: the file is written into a
//           buffer allocated once too) and new + memcpy into fresh memory, page faults included
//           (load's: the loaded caches are fresh memory);
//   file:   std::ofstream::write of the bytes to a file (save's), std::ifstream::read of that file
//           into fresh memory (load's), the page cache warm as for the library's own reads.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <streambuf>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

namespace {

namespace vc = veloxquant::cache;
using Half = Eigen::half;
using Caches = std::vector<std::unique_ptr<vc::KVCache<Half>>>;

constexpr int kLayers = 32, kHeads = 32, kDim = 128, kBudget = 2048;

/// A put area over a buffer allocated once (no growth, no copy at the end).
class SpanOut : public std::streambuf {
 public:
  explicit SpanOut(std::vector<char>& buf) { setp(buf.data(), buf.data() + buf.size()); }
  std::size_t size() const { return static_cast<std::size_t>(pptr() - pbase()); }
};
/// A get area over bytes in memory (read in place).
class SpanIn : public std::streambuf {
 public:
  explicit SpanIn(const std::vector<char>& buf) {
    char* p = const_cast<char*>(buf.data());
    setg(p, p, p + buf.size());
  }
};

struct LayerSet {
  Caches caches;
  std::vector<char> file;  // the set, saved
  std::string path;        // the set, saved to disk
};

const LayerSet& layer_set() {
  static const LayerSet set = [] {
    LayerSet s;
    vc::KVCacheConfig cfg;  // squeeze
    cfg.set_budget(kBudget);
    s.caches = vc::KVCacheBuilder::for_model<Half>(kLayers, cfg);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    const auto fill = [&](Eigen::Index heads, Eigen::Index S) {
      vc::Tensor4<Half> t(1, heads, S, kDim);
      for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = Half(nd(rng));
      return t;
    };
    for (auto& c : s.caches) {
      const vc::Tensor4<Half> k = fill(kHeads, kBudget), v = fill(kHeads, kBudget);
      const vc::Tensor4<Half> q = fill(kHeads, kBudget);
      (void)c->update_and_view(k, v, q);
    }
    for (int step = 0; step < 16; ++step) {
      for (auto& c : s.caches) {
        (void)c->update_and_view(fill(kHeads, 1), fill(kHeads, 1), fill(kHeads, 1));
      }
    }
    s.file.resize(std::size_t{1} << 31);
    SpanOut out(s.file);
    std::ostream os(&out);
    vc::save_prompt_cache(os, s.caches);
    s.file.resize(out.size());
    s.path = (std::filesystem::temp_directory_path() / "veloxquant_bench_prompt.vqkv").string();
    vc::save_prompt_cache(s.path, s.caches);
    return s;
  }();
  return set;
}

void bytes_processed(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(layer_set().file.size()));
  state.counters["MB"] = static_cast<double>(layer_set().file.size()) / 1e6;
}

// ---- memory ---------------------------------------------------------------------------------

void BM_SaveToMemory(benchmark::State& state) {
  const LayerSet& set = layer_set();
  std::vector<char> buf(set.file.size() + 4096);
  for (auto _ : state) {
    SpanOut out(buf);
    std::ostream os(&out);
    vc::save_prompt_cache(os, set.caches);
    benchmark::DoNotOptimize(buf.data());
  }
  bytes_processed(state);
}

void BM_MemcpySameBytes(benchmark::State& state) {
  const LayerSet& set = layer_set();
  std::vector<char> buf(set.file.size());
  for (auto _ : state) {
    std::memcpy(buf.data(), set.file.data(), set.file.size());
    benchmark::DoNotOptimize(buf.data());
    benchmark::ClobberMemory();
  }
  bytes_processed(state);
}

void BM_LoadFromMemory(benchmark::State& state) {
  const LayerSet& set = layer_set();
  for (auto _ : state) {
    SpanIn in(set.file);
    std::istream is(&in);
    vc::PromptCache<Half> loaded = vc::load_prompt_cache<Half>(is);
    benchmark::DoNotOptimize(loaded.caches.data());
    state.PauseTiming();
    loaded = {};
    state.ResumeTiming();
  }
  bytes_processed(state);
}

void BM_NewAndMemcpySameBytes(benchmark::State& state) {
  const LayerSet& set = layer_set();
  for (auto _ : state) {
    std::unique_ptr<char[]> buf(new char[set.file.size()]);
    std::memcpy(buf.get(), set.file.data(), set.file.size());
    benchmark::DoNotOptimize(buf.get());
    benchmark::ClobberMemory();
    state.PauseTiming();
    buf.reset();
    state.ResumeTiming();
  }
  bytes_processed(state);
}

// ---- fork (docs/design.md 10.1) ----------------------------------------------------------------

std::size_t kept_bytes(const Caches& caches) {
  std::size_t n = 0;
  for (const auto& c : caches) n += c->kept_bytes();
  return n;
}
void kept_bytes_processed(benchmark::State& state) {
  const std::size_t kept = kept_bytes(layer_set().caches);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(kept));
  state.counters["MB"] = static_cast<double>(kept) / 1e6;
}

void BM_Fork(benchmark::State& state) {
  const LayerSet& set = layer_set();
  std::size_t heap = 0;
  for (auto _ : state) {
    Caches copy = vc::KVCacheBuilder::fork(set.caches);
    benchmark::DoNotOptimize(copy.data());
    state.PauseTiming();
    heap = 0;
    for (const auto& c : copy) heap += c->heap_bytes();
    copy.clear();
    state.ResumeTiming();
  }
  kept_bytes_processed(state);
  state.counters["heap/kept"] =
      static_cast<double>(heap) / static_cast<double>(kept_bytes(set.caches));
}

// The yardstick: the kept bytes into freshly allocated memory, page faults included, one buffer
// per layer as the copy allocates its own.
void BM_NewAndMemcpyKeptBytes(benchmark::State& state) {
  const LayerSet& set = layer_set();
  const std::size_t per_layer = kept_bytes(set.caches) / set.caches.size();
  std::vector<char> src(per_layer, 1);
  for (auto _ : state) {
    std::vector<std::unique_ptr<char[]>> bufs;
    for (std::size_t l = 0; l < set.caches.size(); ++l) {
      bufs.emplace_back(new char[per_layer]);
      std::memcpy(bufs.back().get(), src.data(), per_layer);
    }
    benchmark::DoNotOptimize(bufs.data());
    benchmark::ClobberMemory();
    state.PauseTiming();
    bufs.clear();
    state.ResumeTiming();
  }
  kept_bytes_processed(state);
}

// ---- a file -------------------------------------------------------------------------------

void BM_SaveToFile(benchmark::State& state) {
  const LayerSet& set = layer_set();
  for (auto _ : state) vc::save_prompt_cache(set.path, set.caches);
  bytes_processed(state);
}

void BM_WriteSameBytesToFile(benchmark::State& state) {
  const LayerSet& set = layer_set();
  const std::string path = set.path + ".raw";
  for (auto _ : state) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(set.file.data(), static_cast<std::streamsize>(set.file.size()));
    out.close();
    if (!out) state.SkipWithError("write failed");
  }
  std::remove(path.c_str());
  bytes_processed(state);
}

void BM_LoadFromFile(benchmark::State& state) {
  const LayerSet& set = layer_set();
  for (auto _ : state) {
    vc::PromptCache<Half> loaded = vc::load_prompt_cache<Half>(set.path);
    benchmark::DoNotOptimize(loaded.caches.data());
    state.PauseTiming();
    loaded = {};
    state.ResumeTiming();
  }
  bytes_processed(state);
}

void BM_ReadSameBytesFromFile(benchmark::State& state) {
  const LayerSet& set = layer_set();
  for (auto _ : state) {
    std::ifstream in(set.path, std::ios::binary);
    std::unique_ptr<char[]> buf(new char[set.file.size()]);
    in.read(buf.get(), static_cast<std::streamsize>(set.file.size()));
    if (static_cast<std::size_t>(in.gcount()) != set.file.size()) state.SkipWithError("short read");
    benchmark::DoNotOptimize(buf.get());
    state.PauseTiming();
    buf.reset();
    state.ResumeTiming();
  }
  bytes_processed(state);
}

// Iterations of about a second each: a save or load moves a gigabyte.
BENCHMARK(BM_SaveToMemory)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_MemcpySameBytes)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_LoadFromMemory)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_NewAndMemcpySameBytes)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_SaveToFile)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_WriteSameBytesToFile)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_LoadFromFile)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_ReadSameBytesFromFile)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_Fork)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK(BM_NewAndMemcpyKeptBytes)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
