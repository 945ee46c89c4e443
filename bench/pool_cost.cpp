// pool_cost: the memory pool's cost per decode call, counted by callgrind (BENCHMARKS.md 19).
// 8 sequences of `layers` Llama-3-8B attention layers (8 KV heads, G = 4, D = 128, half rows,
// H2O, the fused attend) decode one sequence after another, after a prefill of `rows` tokens:
//   mode 0  no pool: each cache's budget of `rows` is the limit;
//   mode 1  one MemoryPool of exactly 8 x layers x rows rows a head binds (the caches' budget is
//           one row above, so the pool takes the row each call adds);
//   mode 2  attached to a pool 4x that size, which never binds (the turns alone).
//
//   valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*decode_rounds*'
//            pool_cost MODE LAYERS ROWS ROUNDS
//
// counts the decode loop only: ROUNDS + 1 rounds of 8 x LAYERS calls (the first one after the
// prefill lets the heads' storage settle). Build at -march=x86-64-v3 at most (valgrind has no
// AVX-512).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;

namespace {

using T = Eigen::half;
using Set = std::vector<std::unique_ptr<vc::KVCache<T>>>;
constexpr int kHeads = 8, kDim = 128, kGroups = 4, kSequences = 8;

template <class U>
vc::Tensor4<U> random_rows(int heads, int seq, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  vc::Tensor4<U> t(1, heads, seq, kDim);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = U(normal(rng));
  return t;
}

__attribute__((noinline)) void decode_rounds(std::vector<Set>& sets, int rounds,
                                             const std::vector<vc::Tensor4<T>>& rows,
                                             const std::vector<vc::Tensor4<float>>& queries,
                                             float* out) {
  std::size_t i = 0;
  for (int r = 0; r < rounds; ++r) {
    for (auto& set : sets) {
      for (auto& c : set) {
        const std::size_t j = i++ % rows.size();
        c->attend(queries[j], rows[j], rows[j], out);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODE(0|1|2) LAYERS ROWS ROUNDS\n", argv[0]);
    return 2;
  }
  const int mode = std::atoi(argv[1]), layers = std::atoi(argv[2]), rows = std::atoi(argv[3]);
  const int rounds = std::atoi(argv[4]);
  if (mode < 0 || mode > 2 || layers < 1 || rows < 32 || rounds < 1) {
    std::fprintf(stderr, "pool_cost: MODE 0-2, LAYERS >= 1, ROWS >= 32, ROUNDS >= 1\n");
    return 2;
  }
  vc::KVCacheConfig config;
  config.method = "h2o";
  config.set_budget(mode == 1 ? rows + 1 : rows);
  const std::size_t row_bytes = 2 * kDim * sizeof(T) * kHeads;  // one row of every head
  vc::MemoryPool pool(static_cast<std::size_t>(kSequences) * static_cast<std::size_t>(rows) *
                      static_cast<std::size_t>(layers) * row_bytes * (mode == 2 ? 4 : 1));
  std::vector<Set> sets;
  std::vector<float> out(static_cast<std::size_t>(kHeads * kGroups * rows * kDim));
  const auto prompt = random_rows<T>(kHeads, rows, 1);
  const auto prompt_queries = random_rows<float>(kHeads * kGroups, rows, 2);
  for (int s = 0; s < kSequences; ++s) {
    sets.push_back(mode != 0 ? vc::KVCacheBuilder::for_model<T>(layers, config, pool)
                             : vc::KVCacheBuilder::for_model<T>(layers, config));
    for (auto& c : sets.back()) c->attend(prompt_queries, prompt, prompt, out.data());
  }
  std::vector<vc::Tensor4<T>> tokens;
  std::vector<vc::Tensor4<float>> queries;
  for (unsigned i = 0; i < 16; ++i) {
    tokens.push_back(random_rows<T>(kHeads, 1, 100 + i));
    queries.push_back(random_rows<float>(kHeads * kGroups, 1, 200 + i));
  }
  decode_rounds(sets, 1, tokens, queries, out.data());
  decode_rounds(sets, rounds, tokens, queries, out.data());
  std::printf("pool_cost: mode %d, %d x %d caches, %ld rows a head; pool %zu of %zu bytes\n", mode,
              kSequences, layers, static_cast<long>(sets[0][0]->max_head_rows()),
              pool.used_bytes(), pool.max_bytes());
  return mode == 1 && pool.used_bytes() > pool.max_bytes() ? 1 : 0;
}
