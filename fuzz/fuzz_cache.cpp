// libFuzzer target: every input is one run of fuzz_ops.hpp (one cache, a sequence of operations
// checked against the naive oracles and the invariants of docs/design.md). A violation prints its description
// and aborts, so libFuzzer saves the input as a crash.
//
// Build (scripts/fuzz.sh does this):
//   clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -O1 -g -std=c++17 \
//     -I include -I tests -isystem /usr/include/eigen3 fuzz/fuzz_cache.cpp -o fuzz_cache
// Replay one input with its operation trace: VELOXQUANT_FUZZ_TRACE=1 ./fuzz_cache crash-file

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_ops.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool trace = std::getenv("VELOXQUANT_FUZZ_TRACE") != nullptr;
  veloxquant::fuzz::Options options;
  options.trace = trace;
  const std::string msg = veloxquant::fuzz::run_ops(data, size, options);
  if (!msg.empty()) {
    std::fprintf(stderr, "\n==== veloxquant fuzz violation ====\n%s\n", msg.c_str());
    std::abort();
  }
  return 0;
}
