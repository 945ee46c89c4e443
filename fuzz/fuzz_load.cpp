// libFuzzer target for the prompt-cache loader (docs/design.md G): every input is a mode byte and
// a file, run through fuzz_load.hpp (loaded, or refused with std::runtime_error; a loaded set must
// save back to its bytes and go on with valid calls). A violation prints its description and
// aborts, so libFuzzer saves the input as a crash.
//
// Build (scripts/fuzz.sh does this):
//   clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -O1 -g -std=c++17 \
//     -I include -I tests -isystem /usr/include/eigen3 fuzz/fuzz_load.cpp -o fuzz_load
// The seed corpus (fuzz/corpus_load/) is written by this binary:
//   VELOXQUANT_FUZZ_WRITE_SEEDS=fuzz/corpus_load ./fuzz_load

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include "fuzz_load.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("VELOXQUANT_FUZZ_WRITE_SEEDS")) {
    veloxquant::fuzz::write_seeds(dir);
    std::printf("wrote the seed corpus to %s\n", dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string msg = veloxquant::fuzz::run_load(data, size);
  if (!msg.empty()) {
    std::fprintf(stderr, "\n==== veloxquant load fuzz violation ====\n%s\n", msg.c_str());
    std::abort();
  }
  return 0;
}
