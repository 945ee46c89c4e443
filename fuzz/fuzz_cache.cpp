// libFuzzer targets, one binary (they share the library's instantiation, most of the build):
//  * VELOXQUANT_FUZZ_TARGET=ops (the default): every input is one run of fuzz_ops.hpp (one cache,
//    or a builder model, through a sequence of operations checked against the naive oracles and
//    the invariants of docs/design.md, save-and-reload included);
//  * VELOXQUANT_FUZZ_TARGET=load: every input is a mode byte and a prompt-cache file, run through
//    fuzz_load.hpp (loaded, or refused with std::runtime_error; a loaded set must save back to its
//    bytes and go on with valid calls);
//  * VELOXQUANT_FUZZ_TARGET=pool: every input is one run of fuzz_pool.hpp (several sets of caches
//    sharing one MemoryPool through calls, forks, releases, rollbacks and loads; the cap, the
//    accounting, the floors and the refusals checked after every operation).
// A violation prints its description and aborts, so libFuzzer saves the input as a crash.
//
// Build (scripts/fuzz.sh does this, and runs the targets side by side):
//   clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -O1 -g -std=c++17 \
//     -I include -I tests -isystem /usr/include/eigen3 fuzz/fuzz_cache.cpp -o fuzz_cache
// Replay one input: VELOXQUANT_FUZZ_TRACE=1 ./fuzz_cache crash-file (ops: with its operation
// trace), VELOXQUANT_FUZZ_TARGET=load ./fuzz_cache crash-file (load), VELOXQUANT_FUZZ_TARGET=pool
// ./fuzz_cache crash-file (pool: the violation with the run's operations).
// The loader's seed corpus (fuzz/corpus_load/) is written by this binary:
//   VELOXQUANT_FUZZ_WRITE_SEEDS=fuzz/corpus_load ./fuzz_cache
// and the pool target's (fuzz/corpus_pool/):
//   VELOXQUANT_FUZZ_WRITE_POOL_SEEDS=fuzz/corpus_pool ./fuzz_cache

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "fuzz_load.hpp"
#include "fuzz_ops.hpp"
#include "fuzz_pool.hpp"

namespace {
enum class Target { ops, load, pool };
Target g_target = Target::ops;
const char* const kTargetNames[] = {"ops", "load", "pool"};
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("VELOXQUANT_FUZZ_WRITE_SEEDS")) {
    veloxquant::fuzz::write_seeds(dir);
    std::printf("wrote the loader's seed corpus to %s\n", dir);
    std::exit(0);
  }
  if (const char* dir = std::getenv("VELOXQUANT_FUZZ_WRITE_POOL_SEEDS")) {
    const auto seeds = veloxquant::fuzz::make_pool_seeds();
    for (std::size_t i = 0; i < seeds.size(); ++i) {
      char name[32];
      std::snprintf(name, sizeof name, "/seed-%02zu.bin", i);
      std::ofstream f(std::string(dir) + name, std::ios::binary);
      f.write(reinterpret_cast<const char*>(seeds[i].data()),
              static_cast<std::streamsize>(seeds[i].size()));
    }
    std::printf("wrote %zu seeds of target pool to %s\n", seeds.size(), dir);
    std::exit(0);
  }
  const char* target = std::getenv("VELOXQUANT_FUZZ_TARGET");
  if (target == nullptr) return 0;
  for (const Target t : {Target::ops, Target::load, Target::pool}) {
    if (std::strcmp(target, kTargetNames[static_cast<int>(t)]) == 0) {
      g_target = t;
      return 0;
    }
  }
  std::fprintf(stderr, "VELOXQUANT_FUZZ_TARGET must be ops, load or pool, not '%s'\n", target);
  std::exit(2);
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool trace = std::getenv("VELOXQUANT_FUZZ_TRACE") != nullptr;
  std::string msg;
  if (g_target == Target::load) {
    msg = veloxquant::fuzz::run_load(data, size);
  } else if (g_target == Target::pool) {
    msg = veloxquant::fuzz::run_pool(data, size);
  } else {
    veloxquant::fuzz::Options options;
    options.trace = trace;
    msg = veloxquant::fuzz::run_ops(data, size, options);
  }
  if (!msg.empty()) {
    std::fprintf(stderr, "\n==== veloxquant fuzz violation (%s) ====\n%s\n",
                 kTargetNames[static_cast<int>(g_target)], msg.c_str());
    std::abort();
  }
  return 0;
}
