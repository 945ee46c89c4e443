// veloxquant — which SIMD instruction set the kernels run on (docs/design.md 7.2): CPU detection
// at run time, so a binary built for baseline x86-64 still runs the AVX2/F16C/AVX-512 kernels where
// the CPU has them (NEON is part of every aarch64 CPU), and a process-wide choice that tests and
// benchmarks may override.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <sys/auxv.h>
#endif

namespace veloxquant::cache::detail {

/// The kernel paths. scalar: portable C++ (every CPU); sse2: x86-64 baseline; avx2: AVX2 + FMA +
/// F16C (x86-64-v3); avx512: AVX-512F on top of avx2; neon: AdvSIMD with FMA and fp16 conversion
/// (every aarch64 CPU). The x86 levels are numbered slowest first; neon comes after them only
/// because it was added later.
enum class SimdLevel : int { scalar = 0, sse2 = 1, avx2 = 2, avx512 = 3, neon = 4 };

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define VELOXQUANT_DETAIL_X86 1
#else
#define VELOXQUANT_DETAIL_X86 0
#endif

// The NEON path: little-endian aarch64 with GCC or Clang (Linux, macOS, Android).
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && \
    defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define VELOXQUANT_DETAIL_ARM64 1
#else
#define VELOXQUANT_DETAIL_ARM64 0
#endif

inline const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::scalar:
      return "scalar";
    case SimdLevel::sse2:
      return "sse2";
    case SimdLevel::avx2:
      return "avx2";
    case SimdLevel::avx512:
      return "avx512";
    case SimdLevel::neon:
      return "neon";
  }
  return "unknown";
}

#if VELOXQUANT_DETAIL_X86
/// The x86 features the kernels need, read once from CPUID (and XGETBV: the OS must save the
/// AVX / AVX-512 register state).
struct X86Features {
  bool avx2_fma_f16c = false;
  bool avx512f = false;
  bool sse42 = false;  ///< the crc32 instruction (the prompt-cache checksum, format/crc32c.hpp)
};

inline X86Features read_x86_features() {
  X86Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.sse42 = (c >> 20) & 1u;
  const bool fma = (c >> 12) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
  const bool f16c = (c >> 29) & 1u;
  if (!osxsave || !avx) return f;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_avx = (xcr0_lo & 0x6u) == 0x6u;       // SSE and AVX state
  const bool os_avx512 = (xcr0_lo & 0xE6u) == 0xE6u;  // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_avx || __get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1u, avx512f = (b >> 16) & 1u;
  f.avx2_fma_f16c = avx2 && fma && f16c;
  f.avx512f = f.avx2_fma_f16c && avx512f && os_avx512;
  return f;
}

inline const X86Features& x86_features() {
  static const X86Features f = read_x86_features();
  return f;
}
#endif

#if VELOXQUANT_DETAIL_ARM64
/// True when the CPU has the ARMv8 CRC32 instructions (the prompt-cache checksum,
/// format/crc32c.hpp):
/// read from the kernel's hardware capabilities on Linux and Android, assumed on Apple (every
/// Apple CPU has them), else known from the compiler's target.
inline bool arm64_has_crc32() {
#if defined(__APPLE__) || defined(__ARM_FEATURE_CRC32)
  return true;
#elif defined(__linux__)
  static const bool has = (getauxval(AT_HWCAP) & (1ul << 7)) != 0;  // HWCAP_CRC32
  return has;
#else
  return false;
#endif
}
#endif

/// True when this CPU (and this build: the x86 paths exist only on x86-64, the NEON path only on
/// aarch64, each with GCC or Clang) can run the kernels of `level`.
inline bool cpu_supports(SimdLevel level) {
  switch (level) {
    case SimdLevel::scalar:
      return true;
#if VELOXQUANT_DETAIL_X86
    case SimdLevel::sse2:
      return true;  // part of x86-64
    case SimdLevel::avx2:
      return x86_features().avx2_fma_f16c;
    case SimdLevel::avx512:
      return x86_features().avx512f;
#else
    case SimdLevel::sse2:
    case SimdLevel::avx2:
    case SimdLevel::avx512:
      return false;
#endif
    case SimdLevel::neon:
      return VELOXQUANT_DETAIL_ARM64 != 0;  // part of every aarch64 CPU
  }
  return false;
}

/// The fastest level this CPU supports.
inline SimdLevel best_simd_level() {
  for (const SimdLevel l :
       {SimdLevel::neon, SimdLevel::avx512, SimdLevel::avx2, SimdLevel::sse2}) {
    if (cpu_supports(l)) return l;
  }
  return SimdLevel::scalar;
}

/// The process-wide level (-1 until first use).
inline std::atomic<int>& simd_level_slot() {
  static std::atomic<int> level{-1};
  return level;
}

/// The level the kernels run on: best_simd_level() unless set_simd_level chose another.
inline SimdLevel active_simd_level() {
  int v = simd_level_slot().load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(best_simd_level());
    simd_level_slot().store(v, std::memory_order_relaxed);
  }
  return static_cast<SimdLevel>(v);
}

/// Makes `level` the level of every later kernel call in the process. Throws
/// std::invalid_argument (and changes nothing) when this CPU or build cannot run it.
inline void set_simd_level(SimdLevel level) {
  const int v = static_cast<int>(level);
  if (v < 0 || v > static_cast<int>(SimdLevel::neon)) {
    throw std::invalid_argument("set_simd_level: unknown level " + std::to_string(v));
  }
  if (!cpu_supports(level)) {
    throw std::invalid_argument(std::string("set_simd_level: this CPU or build cannot run the ") +
                                simd_level_name(level) + " kernels");
  }
  simd_level_slot().store(v, std::memory_order_relaxed);
}

}  // namespace veloxquant::cache::detail
