// The kernel tests' loop over SIMD paths (GoogleTest side): runs a check at every level this CPU
// supports, tracing which, and restores the level in force afterwards. Used by
// test_simd_kernels.cpp and test_quant.cpp.
#pragma once

#include <gtest/gtest.h>

#include <veloxquant/cache.hpp>

namespace veloxquant::test {

/// Runs f(level) at every level this CPU supports, restoring the level in force afterwards.
template <class F>
void for_each_level(F f) {
  namespace vc = veloxquant::cache;
  const vc::SimdLevel saved = vc::simd_level();
  for (const vc::SimdLevel l :
       {vc::SimdLevel::scalar, vc::SimdLevel::sse2, vc::SimdLevel::avx2, vc::SimdLevel::avx512}) {
    if (!vc::simd_level_supported(l)) continue;
    vc::set_simd_level(l);
    SCOPED_TRACE(vc::simd_level_name(l));
    f(l);
  }
  vc::set_simd_level(saved);
}

}  // namespace veloxquant::test
