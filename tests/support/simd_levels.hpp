// The kernel tests' loop over SIMD paths (GoogleTest side): runs a check at every level this CPU
// supports, tracing which, and restores the level in force afterwards. Used by
// test_simd_kernels.cpp and test_quant.cpp.
#pragma once

#include <gtest/gtest.h>

#include <veloxquant/cache.hpp>

namespace veloxquant::test {

/// Every kernel path of the library, supported here or not.
inline constexpr veloxquant::cache::SimdLevel kAllLevels[] = {
    veloxquant::cache::SimdLevel::scalar, veloxquant::cache::SimdLevel::sse2,
    veloxquant::cache::SimdLevel::avx2, veloxquant::cache::SimdLevel::avx512,
    veloxquant::cache::SimdLevel::neon};

/// The paths whose results are bit-identical to the scalar path's (docs/design.md 7.2): the same
/// eight lanes, fused multiply-adds and reduction trees. sse2 (no FMA) and avx512 (sixteen lanes)
/// round differently.
inline bool same_bits_as_scalar(veloxquant::cache::SimdLevel l) {
  namespace vc = veloxquant::cache;
  return l == vc::SimdLevel::scalar || l == vc::SimdLevel::avx2 || l == vc::SimdLevel::neon;
}

/// Runs f(level) at every level this CPU supports, restoring the level in force afterwards.
template <class F>
void for_each_level(F f) {
  namespace vc = veloxquant::cache;
  const vc::SimdLevel saved = vc::simd_level();
  for (const vc::SimdLevel l : kAllLevels) {
    if (!vc::simd_level_supported(l)) continue;
    vc::set_simd_level(l);
    SCOPED_TRACE(vc::simd_level_name(l));
    f(l);
  }
  vc::set_simd_level(saved);
}

}  // namespace veloxquant::test
