// veloxquant — which SIMD kernels the caches run on (docs/design.md 7.2). The library picks the
// fastest path the CPU supports at run time, whatever flags it was compiled with; a program may
// choose another one (to reproduce results of another machine's path, or to compare paths).
#pragma once

#include "detail/cpu.hpp"

namespace veloxquant::cache {

/// The kernel paths: scalar (portable C++), sse2 (x86-64 baseline), avx2 (AVX2 + FMA + F16C),
/// avx512 (AVX-512F). Results are bit-identical across builds that run the same path; scalar and
/// avx2 are also bit-identical to each other.
using SimdLevel = detail::SimdLevel;

/// The path the kernels use now (the best supported one unless set_simd_level chose another).
inline SimdLevel simd_level() { return detail::active_simd_level(); }
/// The fastest path this CPU supports.
inline SimdLevel best_simd_level() { return detail::best_simd_level(); }
/// True when this CPU and build can run `level`.
inline bool simd_level_supported(SimdLevel level) { return detail::cpu_supports(level); }
/// "scalar", "sse2", "avx2" or "avx512".
inline const char* simd_level_name(SimdLevel level) { return detail::simd_level_name(level); }
/// Makes every later kernel call in the process use `level`. Not for use while other threads run
/// cache calls. Throws std::invalid_argument (changing nothing) when this CPU cannot run it.
inline void set_simd_level(SimdLevel level) { detail::set_simd_level(level); }

}  // namespace veloxquant::cache
