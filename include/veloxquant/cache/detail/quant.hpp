// veloxquant — the quantized row format (docs/design.md 7.4): a stored key or value row of D
// elements at 8 or 4 bits, in groups of `group` consecutive elements along D, each group with a
// half-precision scale and offset (x ~ offset + scale * code, code in [0, 2^bits - 1]).
//
// Bytes of one row: the codes of every group, group after group, then per group its scale and its
// offset (two IEEE half bit patterns, little endian). 8 bits: one byte per element. 4 bits: a
// group takes ceil(group / 2) bytes; element e < h = ceil(group / 2) is the low nibble of byte e,
// element e >= h the high nibble of byte e - h (so a vector of low nibbles and one of high nibbles
// come from the same bytes). The format does not depend on the instruction set.
//
// Storing a row (quantize_row) is plain C++ written so that no multiply-add can be contracted:
// the codes are the same whatever the consumer's flags. Reading rows is the kernels' job
// (simd/kernels.inl: dequantize in registers, the same multiply-add on every read).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// Largest finite half-precision value: quantized rows hold elements within +-kHalfMax.
inline constexpr float kHalfMax = 65504.0f;

/// How rows of one kind (keys or values) of a cache are stored.
struct RowFormat {
  int bits = 16;    ///< 16: rows of T; 8 or 4: quantized
  Index dim = 0;    ///< elements per row
  Index group = 0;  ///< elements per group (quantized only)

  bool quantized() const { return bits < 16; }
  Index groups() const { return dim / group; }
  /// Code bytes of one group.
  Index group_bytes() const { return bits == 8 ? group : (group + 1) / 2; }
  /// Code bytes of one row (the scales and offsets follow).
  Index code_bytes() const { return groups() * group_bytes(); }
  /// Bytes of one quantized row: codes, then a scale and an offset (2 bytes each) per group.
  Index row_bytes() const { return code_bytes() + 4 * groups(); }
  /// Highest code.
  int levels() const { return (1 << bits) - 1; }
};

/// Stored rows as the kernels read them: row j starts at data + j * stride (bytes).
struct QuantRows {
  const std::uint8_t* data = nullptr;
  Index stride = 0;  ///< bytes from one row to the next
  RowFormat fmt;

  const std::uint8_t* row(Index j) const { return data + j * stride; }
};

/// Rows of a head as they are stored: T rows (fmt.bits == 16; row j at data + j * stride, in
/// elements of T) or quantized rows (the same buffer read as bytes, stride elements of T per row).
template <class T>
struct StoredRows {
  const T* data = nullptr;
  Index stride = 0;  ///< elements of T from one row to the next
  RowFormat fmt;

  bool quantized() const { return fmt.quantized(); }
  /// The rows from row j on.
  StoredRows from(Index j) const { return StoredRows{data + j * stride, stride, fmt}; }
  QuantRows bytes() const {
    return QuantRows{reinterpret_cast<const std::uint8_t*>(data),
                     stride * static_cast<Index>(sizeof(T)), fmt};
  }
};

/// IEEE half bit patterns and float32, exactly (no F16C needed: storage is not on a hot path).
inline float half_bits_to_float(std::uint16_t h) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h));
}
inline std::uint16_t half_bits_of(float x) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x));
}
/// The largest half <= x (x finite, |x| <= kHalfMax), as bits.
inline std::uint16_t half_bits_down(float x) {
  std::uint16_t h = half_bits_of(x);
  if (half_bits_to_float(h) <= x) return h;
  // One step towards -inf (a tiny negative x rounds to -0, whose step is the smallest negative).
  return (h & 0x8000u) ? h + 1 : h - 1;
}
/// The smallest half >= x (x finite, 0 <= x <= kHalfMax), as bits.
inline std::uint16_t half_bits_up(float x) {
  std::uint16_t h = half_bits_of(x);
  if (half_bits_to_float(h) >= x) return h;
  return h + 1;  // x > 0 here: one step towards +inf
}

/// x rounded to the nearest integer, ties to even (the default rounding mode; on x86 one
/// conversion instruction, unaffected by -ffast-math).
inline int round_to_int(double x) {
#if defined(__SSE2__) || defined(_M_X64)
  return _mm_cvtsd_si32(_mm_set_sd(x));
#else
  return static_cast<int>(std::nearbyint(x));
#endif
}

/// Scale and offset of group g of a stored quantized row, as float32.
inline void group_scale_offset(const std::uint8_t* row, const RowFormat& f, Index g, float& scale,
                               float& offset) {
  std::uint16_t so[2];
  std::memcpy(so, row + f.code_bytes() + 4 * g, sizeof(so));
  scale = half_bits_to_float(so[0]);
  offset = half_bits_to_float(so[1]);
}

/// Code of element k of a stored quantized row.
inline int element_code(const std::uint8_t* row, const RowFormat& f, Index k) {
  const Index g = k / f.group, e = k % f.group;
  const std::uint8_t* codes = row + g * f.group_bytes();
  if (f.bits == 8) return codes[e];
  const Index h = f.group_bytes();
  return e < h ? codes[e] & 0x0F : codes[e - h] >> 4;
}

/// Quantizes one row x ([f.dim] float32, every element finite and within +-kHalfMax) into dst
/// ([f.row_bytes()] bytes). Per group: offset = the largest half <= min, scale = the smallest
/// half >= (max - offset) / levels, code = round-to-nearest((x - offset) / scale) in [0, levels];
/// so every element is within half a step (scale / 2) of offset + code * scale.
inline void quantize_row(const float* x, const RowFormat& f, std::uint8_t* dst) {
  const Index G = f.groups(), gb = f.group_bytes();
  const float levels = static_cast<float>(f.levels());
  std::memset(dst, 0, static_cast<std::size_t>(f.code_bytes()));
  for (Index g = 0; g < G; ++g) {
    const float* xg = x + g * f.group;
    const auto mm = std::minmax_element(xg, xg + f.group);
    const std::uint16_t off_bits = half_bits_down(*mm.first);
    const float off = half_bits_to_float(off_bits);
    const std::uint16_t scale_bits = half_bits_up(std::max(0.0f, (*mm.second - off) / levels));
    const float scale = half_bits_to_float(scale_bits);
    std::uint8_t* codes = dst + g * gb;
    for (Index e = 0; e < f.group; ++e) {
      int c = 0;
      if (scale > 0.0f) {
        // In double: x - offset is exact there, so the nearest code is found however far the
        // offset lies from x.
        double t = (static_cast<double>(xg[e]) - off) / scale;
        t = std::min(std::max(t, 0.0), static_cast<double>(levels));
        c = round_to_int(t);
      }
      if (f.bits == 8) {
        codes[e] = static_cast<std::uint8_t>(c);
      } else if (e < gb) {
        codes[e] = static_cast<std::uint8_t>(codes[e] | c);
      } else {
        codes[e - gb] = static_cast<std::uint8_t>(codes[e - gb] | (c << 4));
      }
    }
    const std::uint16_t so[2] = {scale_bits, off_bits};
    std::memcpy(dst + f.code_bytes() + 4 * g, so, sizeof(so));
  }
}

}  // namespace veloxquant::cache::detail
