// veloxquant — CRC-32C (Castagnoli), the checksum of the prompt-cache format (docs/design.md G).
//
// The polynomial 0x1EDC6F41 (reflected: 0x82F63B78), register preset to all ones and inverted at
// the end: crc32c(0, "123456789", 9) == 0xE3069283. crc32c(crc32c(0, a), b) is the CRC of a then b.
//
// Two paths, the same value: a CRC-32C instruction — SSE4.2 `crc32` where the kernels run AVX2 or
// AVX-512 and the CPU reports SSE4.2, ARMv8 `crc32cx` where they run NEON and the CPU has the CRC
// extension (read from the hardware capabilities on Linux, assumed on Apple) — and eight 256-entry
// tables (one table lookup per byte, eight bytes at a time) everywhere else
// (set_simd_level(scalar), or sse2, selects the table path). The instructions have a latency of
// three cycles and a throughput of one, so long inputs run three independent streams over
// consecutive blocks and join them: the register after a block B from state s is
// A_|B|(s) xor crc_raw(0, B), where A_n (n zero bytes fed to the register) is linear over GF(2)
// and is applied through four byte-indexed tables built once for the block length.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../cpu.hpp"

#if VELOXQUANT_DETAIL_X86
#include <nmmintrin.h>
#endif
#if VELOXQUANT_DETAIL_ARM64
#include <arm_acle.h>
#endif

namespace veloxquant::cache::detail {

/// The reflected CRC-32C polynomial.
inline constexpr std::uint32_t kCrc32cPoly = 0x82F63B78u;

/// Table k maps a byte b to the register contribution of b followed by k zero bytes.
inline constexpr std::array<std::array<std::uint32_t, 256>, 8> crc32c_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t r = b;
    for (int i = 0; i < 8; ++i) r = (r >> 1) ^ (kCrc32cPoly & (0u - (r & 1u)));
    t[0][b] = r;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}
inline constexpr auto kCrc32cTables = crc32c_tables();

/// The register (not inverted) after feeding n bytes from state `s`, by the tables.
inline std::uint32_t crc32c_raw_tables(std::uint32_t s, const unsigned char* p, std::size_t n) {
  const auto& t = kCrc32cTables;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    lo = __builtin_bswap32(lo);
    hi = __builtin_bswap32(hi);
#endif
    lo ^= s;
    s = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) s = (s >> 8) ^ t[0][(s ^ *p) & 0xFFu];
  return s;
}

#if VELOXQUANT_DETAIL_X86 || VELOXQUANT_DETAIL_ARM64

// The CPU's CRC-32C step over 8 bytes (on a register of CrcReg: x86's instruction reads and
// writes 64 bits, so the register stays 64-bit between steps, with no zero-extension in the chain)
// and over one byte, in a target region of their own.
#if VELOXQUANT_DETAIL_X86
#define VELOXQUANT_DETAIL_CRC_TARGET __attribute__((target("sse4.2")))
using CrcReg = std::uint64_t;
VELOXQUANT_DETAIL_CRC_TARGET inline CrcReg crc32c_step8(CrcReg r, std::uint64_t w) {
  return _mm_crc32_u64(r, w);
}
VELOXQUANT_DETAIL_CRC_TARGET inline std::uint32_t crc32c_step1(std::uint32_t r, unsigned char b) {
  return _mm_crc32_u8(r, b);
}
#else
#if defined(__clang__)
#define VELOXQUANT_DETAIL_CRC_TARGET __attribute__((target("crc")))
#define VELOXQUANT_DETAIL_CRC32CD __builtin_arm_crc32cd
#define VELOXQUANT_DETAIL_CRC32CB __builtin_arm_crc32cb
#else
#define VELOXQUANT_DETAIL_CRC_TARGET __attribute__((target("+crc")))
#define VELOXQUANT_DETAIL_CRC32CD __crc32cd
#define VELOXQUANT_DETAIL_CRC32CB __crc32cb
#endif
using CrcReg = std::uint32_t;
VELOXQUANT_DETAIL_CRC_TARGET inline CrcReg crc32c_step8(CrcReg r, std::uint64_t w) {
  return VELOXQUANT_DETAIL_CRC32CD(r, w);
}
VELOXQUANT_DETAIL_CRC_TARGET inline std::uint32_t crc32c_step1(std::uint32_t r, unsigned char b) {
  return VELOXQUANT_DETAIL_CRC32CB(r, b);
}
#undef VELOXQUANT_DETAIL_CRC32CD
#undef VELOXQUANT_DETAIL_CRC32CB
#endif

/// Bytes per stream and block of the three-stream path.
inline constexpr std::size_t kCrc32cBlock = 4096;

/// A_n for n = kCrc32cBlock as four byte tables: A(s) = T0[s & 255] ^ T1[(s >> 8) & 255] ^ ...
struct Crc32cShift {
  std::uint32_t t[4][256];
};

VELOXQUANT_DETAIL_CRC_TARGET inline std::uint32_t crc32c_raw_hw(std::uint32_t s,
                                                                const unsigned char* p,
                                                                std::size_t n) {
  CrcReg r = s;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    r = crc32c_step8(r, w);
  }
  auto r32 = static_cast<std::uint32_t>(r);
  for (; n > 0; --n, ++p) r32 = crc32c_step1(r32, *p);
  return r32;
}

/// The tables of A_kCrc32cBlock, built once: column j is the register after the block of zeros
/// from the state with only bit j set.
inline const Crc32cShift& crc32c_block_shift() {
  static const Crc32cShift shift = [] {
    Crc32cShift sh{};
    static const unsigned char zeros[kCrc32cBlock] = {};
    std::uint32_t col[32];
    for (int j = 0; j < 32; ++j) col[j] = crc32c_raw_hw(1u << j, zeros, kCrc32cBlock);
    for (int k = 0; k < 4; ++k) {
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t v = 0;
        for (int i = 0; i < 8; ++i) {
          if ((b >> i) & 1u) v ^= col[8 * k + i];
        }
        sh.t[k][b] = v;
      }
    }
    return sh;
  }();
  return shift;
}

inline std::uint32_t crc32c_apply(const Crc32cShift& a, std::uint32_t s) {
  return a.t[0][s & 0xFFu] ^ a.t[1][(s >> 8) & 0xFFu] ^ a.t[2][(s >> 16) & 0xFFu] ^ a.t[3][s >> 24];
}

/// Three streams over each run of 3 * kCrc32cBlock bytes, joined; the rest in one stream.
VELOXQUANT_DETAIL_CRC_TARGET inline std::uint32_t crc32c_raw_hw3(std::uint32_t s,
                                                                 const unsigned char* p,
                                                                 std::size_t n) {
  constexpr std::size_t L = kCrc32cBlock;
  if (n >= 3 * L) {
    const Crc32cShift& a = crc32c_block_shift();
    for (; n >= 3 * L; n -= 3 * L, p += 3 * L) {
      CrcReg r0 = s, r1 = 0, r2 = 0;
      for (std::size_t i = 0; i < L; i += 8) {
        std::uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p + L + i, 8);
        std::memcpy(&w2, p + 2 * L + i, 8);
        r0 = crc32c_step8(r0, w0);
        r1 = crc32c_step8(r1, w1);
        r2 = crc32c_step8(r2, w2);
      }
      s = crc32c_apply(
              a, crc32c_apply(a, static_cast<std::uint32_t>(r0)) ^ static_cast<std::uint32_t>(r1)) ^
          static_cast<std::uint32_t>(r2);
    }
  }
  return crc32c_raw_hw(s, p, n);
}

#undef VELOXQUANT_DETAIL_CRC_TARGET
#endif  // VELOXQUANT_DETAIL_X86 || VELOXQUANT_DETAIL_ARM64

/// True when crc32c() uses a CRC-32C instruction: the kernels run AVX2 or AVX-512 and the CPU
/// reports SSE4.2 (every such CPU has it; a virtual machine might hide it), or they run NEON and
/// the CPU has the ARMv8 CRC extension (optional in ARMv8.0, required from ARMv8.1).
inline bool crc32c_hardware() {
#if VELOXQUANT_DETAIL_X86
  const SimdLevel l = active_simd_level();
  return (l == SimdLevel::avx2 || l == SimdLevel::avx512) && x86_features().sse42;
#elif VELOXQUANT_DETAIL_ARM64
  return active_simd_level() == SimdLevel::neon && arm64_has_crc32();
#else
  return false;
#endif
}

/// The CRC-32C of `n` bytes at `data` following a message whose CRC-32C is `crc` (0: none).
inline std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if VELOXQUANT_DETAIL_X86 || VELOXQUANT_DETAIL_ARM64
  if (crc32c_hardware()) return ~crc32c_raw_hw3(~crc, p, n);
#endif
  return ~crc32c_raw_tables(~crc, p, n);
}

}  // namespace veloxquant::cache::detail
