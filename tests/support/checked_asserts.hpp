// Include FIRST (before any veloxquant header): turns the library's internal invariant checks
// (VELOXQUANT_ASSERT, compiled out under NDEBUG by default) on in every build, aborting with a
// message, so the tests exercise them in Release too.
#pragma once

#include <cstdio>
#include <cstdlib>

[[noreturn]] inline void veloxquant_test_assert_failed(const char* msg) {
  std::fprintf(stderr, "veloxquant internal assertion failed: %s\n", msg);
  std::abort();
}
#define VELOXQUANT_ASSERT(cond, msg) ((cond) ? (void)0 : veloxquant_test_assert_failed(msg))
