// libFuzzer targets, one binary (they share the library's instantiation, most of the build):
//  * VELOXQUANT_FUZZ_TARGET=ops (the default): every input is one run of fuzz_ops.hpp (one cache,
//    or a builder model, through a sequence of operations checked against the naive oracles and
//    the invariants of docs/design.md, save-and-reload included);
//  * VELOXQUANT_FUZZ_TARGET=load: every input is a mode byte and a prompt-cache file, run through
//    fuzz_load.hpp (loaded, or refused with std::runtime_error; a loaded set must save back to its
//    bytes and go on with valid calls).
// A violation prints its description and aborts, so libFuzzer saves the input as a crash.
//
// Build (scripts/fuzz.sh does this, and runs both targets side by side):
//   clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -O1 -g -std=c++17 \
//     -I include -I tests -isystem /usr/include/eigen3 fuzz/fuzz_cache.cpp -o fuzz_cache
// Replay one input: VELOXQUANT_FUZZ_TRACE=1 ./fuzz_cache crash-file (ops: with its operation
// trace), VELOXQUANT_FUZZ_TARGET=load ./fuzz_cache crash-file (load).
// The loader's seed corpus (fuzz/corpus_load/) is written by this binary:
//   VELOXQUANT_FUZZ_WRITE_SEEDS=fuzz/corpus_load ./fuzz_cache

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fuzz_load.hpp"
#include "fuzz_ops.hpp"

namespace {
bool g_load_target = false;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("VELOXQUANT_FUZZ_WRITE_SEEDS")) {
    veloxquant::fuzz::write_seeds(dir);
    std::printf("wrote the loader's seed corpus to %s\n", dir);
    std::exit(0);
  }
  const char* target = std::getenv("VELOXQUANT_FUZZ_TARGET");
  if (target != nullptr && std::strcmp(target, "load") != 0 && std::strcmp(target, "ops") != 0) {
    std::fprintf(stderr, "VELOXQUANT_FUZZ_TARGET must be ops or load, not '%s'\n", target);
    std::exit(2);
  }
  g_load_target = target != nullptr && std::strcmp(target, "load") == 0;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool trace = std::getenv("VELOXQUANT_FUZZ_TRACE") != nullptr;
  std::string msg;
  if (g_load_target) {
    msg = veloxquant::fuzz::run_load(data, size);
  } else {
    veloxquant::fuzz::Options options;
    options.trace = trace;
    msg = veloxquant::fuzz::run_ops(data, size, options);
  }
  if (!msg.empty()) {
    std::fprintf(stderr, "\n==== veloxquant fuzz violation (%s) ====\n%s\n",
                 g_load_target ? "load" : "ops", msg.c_str());
    std::abort();
  }
  return 0;
}
