// veloxquant — internal assertions (tier 2 of the error model, see docs/design.md F).
#pragma once

#include <cstdio>
#include <cstdlib>

/// Internal invariant check on the hot path. Compiled out under NDEBUG unless the user
/// defines VELOXQUANT_ASSERT first (the tests redefine it to abort in every build, NDEBUG or not: tests/support/checked_asserts.hpp).
#ifndef VELOXQUANT_ASSERT
#ifdef NDEBUG
#define VELOXQUANT_ASSERT(cond, msg) ((void)0)
#else
#define VELOXQUANT_ASSERT(cond, msg)                                                    \
  ((cond) ? (void)0                                                                     \
          : (std::fprintf(stderr, "veloxquant assertion failed: %s (%s:%d): %s\n", #cond, \
                          __FILE__, __LINE__, msg),                                     \
             std::abort()))
#endif
#endif
