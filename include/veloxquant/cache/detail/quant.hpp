// veloxquant — the quantized row formats (docs/design.md 7.4 and 7.5): a stored key or value row
// of D elements at 8, 4 or 2 bits (x ~ offset + scale * code, code in [0, 2^bits - 1]; scale and
// offset IEEE halves).
//
// Token axis (7.4): each row carries its scales, one scale and offset per group of `group`
// consecutive elements along D. Bytes of one row: the codes of every group, group after group,
// then per group its scale and its offset (two half bit patterns, little endian).
// Channel axis (7.5): a row is its codes only; the scale and offset of each channel are shared by
// the rows of a block of consecutive positions (channel_store.hpp keeps them).
//
// Codes of a span of n elements (a group, or a whole channel-axis row) at b bits: p = 8 / b codes
// per byte, the span takes h = ceil(n / p) bytes, and element e sits in byte e % h at bit
// b * (e / h). At 8 bits that is one byte per element; at 4 bits element e < h is the low nibble of
// byte e and element e >= h the high nibble of byte e - h (so a vector of low nibbles and one of
// high nibbles come from the same bytes). The format does not depend on the instruction set.
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
  int bits = 16;         ///< 16: rows of T; 8, 4 or 2: quantized
  Index dim = 0;         ///< elements per row
  Index group = 0;       ///< elements per group (token axis, quantized only)
  bool channel = false;  ///< quantized along channels, in blocks of `block` positions
  Index block = 0;       ///< positions per block (channel axis only)

  bool quantized() const { return bits < 16; }
  /// Quantized along the token axis (each row with its own scales).
  bool token_axis() const { return quantized() && !channel; }
  /// Quantized along the channel axis (scales shared by a block of rows).
  bool channel_axis() const { return quantized() && channel; }
  /// Groups of a token-axis row (a channel-axis row: one span of dim codes, no scales).
  Index groups() const { return channel ? 1 : dim / group; }
  /// Elements of one span of codes.
  Index span() const { return channel ? dim : group; }
  /// Code bytes of one span.
  Index group_bytes() const { return span_bytes(span(), bits); }
  /// Code bytes of one row (a token-axis row's scales and offsets follow).
  Index code_bytes() const { return groups() * group_bytes(); }
  /// Bytes of one quantized row: codes, then (token axis) a scale and an offset per group.
  Index row_bytes() const { return code_bytes() + (channel ? 0 : 4 * groups()); }
  /// Highest code.
  int levels() const { return (1 << bits) - 1; }

  /// Bytes of a span of n codes at b bits.
  static Index span_bytes(Index n, int b) {
    const Index per = 8 / b;
    return (n + per - 1) / per;
  }
};

/// Byte and bit of element e of a span of n codes at b bits (the layout above).
inline void code_place(Index e, Index n, int b, Index& byte, int& shift) {
  const Index h = RowFormat::span_bytes(n, b);
  byte = e % h;
  shift = b * static_cast<int>(e / h);
}
/// Code of element e of a span of n codes at b bits starting at `codes`.
inline int span_code(const std::uint8_t* codes, Index e, Index n, int b) {
  Index byte = 0;
  int shift = 0;
  code_place(e, n, b, byte, shift);
  return (codes[byte] >> shift) & ((1 << b) - 1);
}
/// Ors code c into element e of a span (whose bytes start zeroed).
inline void put_span_code(std::uint8_t* codes, Index e, Index n, int b, int c) {
  Index byte = 0;
  int shift = 0;
  code_place(e, n, b, byte, shift);
  codes[byte] = static_cast<std::uint8_t>(codes[byte] | (c << shift));
}

/// Stored rows as the kernels read them: row j starts at data + j * stride (bytes).
struct QuantRows {
  const std::uint8_t* data = nullptr;
  Index stride = 0;  ///< bytes from one row to the next
  RowFormat fmt;

  const std::uint8_t* row(Index j) const { return data + j * stride; }
};

/// Where channel-axis rows' scales are (docs/design.md 7.5): a row's position picks its block (the
/// last whose first position is <= it) or, from pending_start on, its lane of the pending block.
/// What the stored rows (StoredRows) and the kernels' view of them (ChannelRows) share.
struct ChannelIndex {
  const std::int64_t* pos = nullptr;       ///< position of row j: pos[j]
  const std::int64_t* starts = nullptr;    ///< [blocks] first position of each block, ascending
  Index blocks = 0;                        ///< sealed blocks
  const std::uint16_t* tables = nullptr;   ///< [blocks, 2 * dim]: scales then offsets (half bits)
  std::int64_t pending_start = 0;          ///< rows from this position on are pending
  const std::int32_t* order = nullptr;     ///< [live] the live rows in ascending position (or null)
  Index live = 0;
  Index slots = 0;                         ///< rows in the buffer, live or dead
};

/// Rows of a head as they are stored: T rows (fmt.bits == 16; row j at data + j * stride, in
/// elements of T) or quantized rows (the same buffer read as bytes, stride elements of T per row);
/// channel-axis rows also carry their ChannelIndex and the pending rows at T.
template <class T>
struct StoredRows : ChannelIndex {
  StoredRows() = default;
  StoredRows(const T* rows, Index row_stride, const RowFormat& format)
      : data(rows), stride(row_stride), fmt(format) {}

  const T* data = nullptr;
  Index stride = 0;  ///< elements of T from one row to the next
  RowFormat fmt;
  // Channel axis only, beside ChannelIndex.
  const T* pending = nullptr;              ///< [block, dim]: the pending row of position p at lane
                                           ///< p - pending_start, as T
  Index pending_lanes = 0;                 ///< lanes [0, pending_lanes) may hold a row

  bool quantized() const { return fmt.quantized(); }
  bool channel() const { return fmt.channel_axis(); }
  QuantRows bytes() const {
    return QuantRows{reinterpret_cast<const std::uint8_t*>(data),
                     stride * static_cast<Index>(sizeof(T)), fmt};
  }
  /// Row j's stored bytes (a quantized row's codes).
  const std::uint8_t* row_bytes(Index j) const {
    return reinterpret_cast<const std::uint8_t*>(data + j * stride);
  }
};

/// The block of position p among `blocks` sealed blocks whose first positions `starts` ascend:
/// the last one whose first position is <= p (0 when p precedes them all, which the blocks'
/// invariant rules out for a sealed row). No branch on the data: a window's rows come from
/// blocks in no order after many evictions.
inline Index block_at(const std::int64_t* starts, Index blocks, std::int64_t p) {
  const std::int64_t* base = starts;
  for (Index len = blocks; len > 1;) {
    const Index half = len / 2;
    base = base[half] <= p ? base + half : base;
    len -= half;
  }
  return base - starts;
}

/// Channel-axis rows as the kernels read them (docs/design.md 7.5): StoredRows' fields with the
/// pending rows already converted to float32 (simd_kernels.hpp, channel_rows), so that the
/// channel kernels are compiled once per instruction set, not once per storage type too.
struct ChannelRows : ChannelIndex {
  const std::uint8_t* data = nullptr;      ///< row j's codes at data + j * stride
  Index stride = 0;                        ///< bytes from one row to the next
  RowFormat fmt;
  const float* pending = nullptr;          ///< [block, dim] the pending rows as float32, by lane

  const std::uint8_t* row_bytes(Index j) const { return data + j * stride; }
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

/// Code of element k of a stored quantized row (either axis).
inline int element_code(const std::uint8_t* row, const RowFormat& f, Index k) {
  const Index n = f.span(), g = k / n;
  return span_code(row + g * f.group_bytes(), k % n, n, f.bits);
}

/// Scale and offset quantizing values in [lo, hi] at `levels` steps (lo, hi finite, within
/// +-kHalfMax): offset = the largest half <= lo, scale = the smallest half >= (hi - offset) /
/// levels, so every value in the range is within half a step of offset + code * scale.
inline void range_scale_offset(float lo, float hi, float levels, std::uint16_t& scale_bits,
                               std::uint16_t& offset_bits) {
  offset_bits = half_bits_down(lo);
  const float off = half_bits_to_float(offset_bits);
  scale_bits = half_bits_up(std::max(0.0f, (hi - off) / levels));
}
/// The nearest code of x at (scale, offset), in [0, levels]; 0 when the scale is 0.
inline int nearest_code(float x, float scale, float offset, float levels) {
  if (!(scale > 0.0f)) return 0;
  // In double: x - offset is exact there, so the nearest code is found however far the offset
  // lies from x.
  double t = (static_cast<double>(x) - offset) / scale;
  t = std::min(std::max(t, 0.0), static_cast<double>(levels));
  return round_to_int(t);
}

/// Quantizes one token-axis row x ([f.dim] float32, every element finite and within +-kHalfMax)
/// into dst ([f.row_bytes()] bytes). Per group: its range's scale and offset
/// (range_scale_offset) and each element's nearest code, so every element is within half a step
/// (scale / 2) of offset + code * scale.
inline void quantize_row(const float* x, const RowFormat& f, std::uint8_t* dst) {
  const Index G = f.groups(), gb = f.group_bytes();
  const float levels = static_cast<float>(f.levels());
  std::memset(dst, 0, static_cast<std::size_t>(f.code_bytes()));
  for (Index g = 0; g < G; ++g) {
    const float* xg = x + g * f.group;
    const auto mm = std::minmax_element(xg, xg + f.group);
    std::uint16_t so[2];
    range_scale_offset(*mm.first, *mm.second, levels, so[0], so[1]);
    const float scale = half_bits_to_float(so[0]), off = half_bits_to_float(so[1]);
    std::uint8_t* codes = dst + g * gb;
    for (Index e = 0; e < f.group; ++e) {
      put_span_code(codes, e, f.group, f.bits, nearest_code(xg[e], scale, off, levels));
    }
    std::memcpy(dst + f.code_bytes() + 4 * g, so, sizeof(so));
  }
}

/// Quantizes a block of n channel-axis rows together (docs/design.md 7.5): rows[r] ([f.dim]
/// elements of R, finite, within +-kHalfMax as float32); per channel c its range over the n rows
/// gives table[c] (scale) and table[f.dim + c] (offset), half bits; row r's codes go to codes[r]
/// ([f.code_bytes()] bytes each). Every element is within half a step of its channel's grid.
template <class R>
void quantize_block(const R* const* rows, Index n, const RowFormat& f, std::uint8_t* const* codes,
                    std::uint16_t* table) {
  const Index d = f.dim;
  const float levels = static_cast<float>(f.levels());
  for (Index r = 0; r < n; ++r) std::memset(codes[r], 0, static_cast<std::size_t>(f.code_bytes()));
  for (Index c = 0; c < d; ++c) {
    float lo = static_cast<float>(rows[0][c]), hi = lo;
    for (Index r = 1; r < n; ++r) {
      const float x = static_cast<float>(rows[r][c]);
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    range_scale_offset(lo, hi, levels, table[c], table[d + c]);
    const float scale = half_bits_to_float(table[c]), off = half_bits_to_float(table[d + c]);
    for (Index r = 0; r < n; ++r) {
      const float x = static_cast<float>(rows[r][c]);
      put_span_code(codes[r], c, d, f.bits, nearest_code(x, scale, off, levels));
    }
  }
}

}  // namespace veloxquant::cache::detail
