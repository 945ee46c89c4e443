// Include FIRST (before any veloxquant header): turns the library's internal invariant checks
// (VELOXQUANT_ASSERT, compiled out under NDEBUG by default) on in every build, aborting with a
// message, so the tests exercise them in Release too. With VELOXQUANT_TEST_UNCHECKED (the
// -DNDEBUG twin of test_bad_inputs, tests/CMakeLists.txt) it defines nothing: the library's
// default applies.
#pragma once

#ifndef VELOXQUANT_TEST_UNCHECKED
#include <cstdio>
#include <cstdlib>

[[noreturn]] inline void veloxquant_test_assert_failed(const char* msg) {
  std::fprintf(stderr, "veloxquant internal assertion failed: %s\n", msg);
  std::abort();
}
#define VELOXQUANT_ASSERT(cond, msg) ((cond) ? (void)0 : veloxquant_test_assert_failed(msg))
#endif
