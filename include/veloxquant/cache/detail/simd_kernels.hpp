// veloxquant — the numeric kernels of every policy (docs/design.md 7.2), compiled for each
// instruction set the build can target and chosen at run time (cpu.hpp): scaled dot products of
// query rows with stored key rows, softmax with the mean over several rows, score decay, and row
// conversion. The x86 paths carry GCC/Clang target attributes, so they exist whatever -march the
// consumer builds with; the NEON path (aarch64) needs none. Their arithmetic is explicit (no
// contraction left to the compiler): results are bit-identical across builds that run the same
// path, and scalar, avx2 and neon give the same bits.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu.hpp"
#include "quant.hpp"
#include "simd/common.hpp"

// A TU built against the compiled library (VELOXQUANT_EXTERN_TEMPLATES, the veloxquant::compiled
// target) instantiates no cache member, so it calls no kernel: there the dispatching kernels
// below are declared, not defined, and the instruction-set paths and their intrinsics headers are
// not read (a third of such a TU's compile time, BENCHMARKS.md section 4). The one TU that
// instantiates the caches (VELOXQUANT_INSTANTIATE_TEMPLATES), a header-only TU, and a TU that
// calls the kernels itself (VELOXQUANT_DEFINE_KERNELS: the kernel tests) define them.
#if defined(VELOXQUANT_EXTERN_TEMPLATES) && !defined(VELOXQUANT_INSTANTIATE_TEMPLATES) && \
    !defined(VELOXQUANT_DEFINE_KERNELS)
#define VELOXQUANT_DETAIL_KERNELS_DEFINED 0
#else
#define VELOXQUANT_DETAIL_KERNELS_DEFINED 1
#endif

#if VELOXQUANT_DETAIL_KERNELS_DEFINED && VELOXQUANT_DETAIL_X86
#include <emmintrin.h>
#include <immintrin.h>
#endif

namespace veloxquant::cache::detail {
using Index = Eigen::Index;

/// The per-call scratch of the folded channel-axis kernels (kernels.inl, docs/design.md 7.5):
/// block[j] is row j's block (`blocks` for a pending row); qs [blocks, m, dp] and cst [blocks, m]
/// the query rows times each block's scales and their dots with its offsets, filled as blocks are
/// met (ready [blocks]); row [dp] a row being read; perm and run the rows sorted by block (block
/// b's at perm[run[b], run[b + 1]), the pending ones last).
struct ChannelFold {
  const Index* block = nullptr;
  float* qs = nullptr;
  float* cst = nullptr;
  std::uint8_t* ready = nullptr;
  float* row = nullptr;  ///< [2, padded_dim(d)]
  const std::int32_t* perm = nullptr;
  const Index* run = nullptr;
  float* esum = nullptr;  ///< [blocks + 1, 4]: each block's sum of e per output row
};
}  // namespace veloxquant::cache::detail

#if VELOXQUANT_DETAIL_KERNELS_DEFINED

#include "simd/scalar.hpp"

namespace veloxquant::cache::detail::scalar {
#include "simd/kernels.inl"
}  // namespace veloxquant::cache::detail::scalar

#if VELOXQUANT_DETAIL_X86

#include "simd/sse2.hpp"
namespace veloxquant::cache::detail::sse2 {
#include "simd/kernels.inl"
}  // namespace veloxquant::cache::detail::sse2

#include "simd/avx2.hpp"
VELOXQUANT_DETAIL_TARGET_AVX2_BEGIN
namespace veloxquant::cache::detail::avx2 {
#include "simd/kernels.inl"
}  // namespace veloxquant::cache::detail::avx2
VELOXQUANT_DETAIL_TARGET_AVX2_END

#include "simd/avx512.hpp"
VELOXQUANT_DETAIL_TARGET_AVX512_BEGIN
namespace veloxquant::cache::detail::avx512 {
#include "simd/kernels.inl"
}  // namespace veloxquant::cache::detail::avx512
VELOXQUANT_DETAIL_TARGET_AVX512_END

#endif  // VELOXQUANT_DETAIL_X86

#if VELOXQUANT_DETAIL_ARM64
#include "simd/neon.hpp"
namespace veloxquant::cache::detail::neon {
#include "simd/kernels.inl"
}  // namespace veloxquant::cache::detail::neon
#endif  // VELOXQUANT_DETAIL_ARM64

#endif  // VELOXQUANT_DETAIL_KERNELS_DEFINED

namespace veloxquant::cache::detail {

#if VELOXQUANT_DETAIL_KERNELS_DEFINED
#if VELOXQUANT_DETAIL_X86
#define VELOXQUANT_DETAIL_DISPATCH(call) \
  switch (active_simd_level()) {         \
    case SimdLevel::avx512:              \
      return avx512::call;               \
    case SimdLevel::avx2:                \
      return avx2::call;                 \
    case SimdLevel::sse2:                \
      return sse2::call;                 \
    case SimdLevel::scalar:              \
    case SimdLevel::neon:                \
      break;                             \
  }                                      \
  return scalar::call
#elif VELOXQUANT_DETAIL_ARM64
#define VELOXQUANT_DETAIL_DISPATCH(call)                           \
  if (active_simd_level() == SimdLevel::neon) return neon::call; \
  return scalar::call
#else
#define VELOXQUANT_DETAIL_DISPATCH(call) return scalar::call
#endif
#endif  // VELOXQUANT_DETAIL_KERNELS_DEFINED

/// Row length the kernels of every path accept: D rounded up to 16 floats (the widest vector).
inline Index padded_dim(Index d) { return (d + 15) / 16 * 16; }

/// out[i * ldo + j] = scale * (q_i . k_j), i < m, j < n. q: [m, ldq] float32 rows, zero from d to
/// padded_dim(d); key row j at keys + (idx ? idx[j] : j) * key_stride ([d] of T); kbuf: scratch of
/// 4 * padded_dim(d) floats; out: [m, ldo].
template <class T>
inline void logits(const float* q, Index m, Index ldq, const T* keys, Index key_stride,
                   const std::int32_t* idx, Index n, Index d, float scale, float* out, Index ldo,
                   float* kbuf)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(logits(q, m, ldq, keys, key_stride, idx, n, d, scale, out, ldo, kbuf));
}
#else
    ;
#endif

/// Keys for logits_packed: rows [j0, j1) of keys (row j at keys + j * key_stride, [d] of T) as
/// float32 in the path's tiles of kt (packed_size(n, d) floats for n keys). buf: scratch of
/// padded_dim(d) floats.
template <class T>
inline void pack_keys(const T* keys, Index key_stride, Index j0, Index j1, Index d, float* kt,
                      float* buf)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(pack_keys(keys, key_stride, j0, j1, d, kt, buf));
}
#else
    ;
#endif

/// Floats the packed keys of n keys of dim d take on any path: n rounded up to 32 (two of the
/// widest vectors), times d.
inline Index packed_size(Index n, Index d) { return (n + 31) / 32 * 32 * d; }

/// out[i * ldo + j] = scale * (q_i . k_j), i < m, j < n, with the keys packed by pack_keys: the
/// prefill blocks' logits (no horizontal sums). q: [m, ldq] float32 rows; out: [m, ldo];
/// qbuf: scratch of 4 * d floats.
inline void logits_packed(const float* q, Index m, Index ldq, const float* kt, Index n, Index d,
                          float scale, float* out, Index ldo, float* qbuf)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(logits_packed(q, m, ldq, kt, n, d, scale, out, ldo, qbuf));
}
#else
    ;
#endif

/// w[0, n) = the mean over `rows` rows of x ([rows, ldx]) of their softmax over [0, n); -inf
/// logits get weight exactly 0; the rows are overwritten with their exp values and inv ([rows],
/// optional) receives each row's normaliser (row r's softmax = x[r] * inv[r]). w may be null.
inline void softmax_mean(float* x, Index rows, Index ldx, Index n, float* w, float* inv = nullptr)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(softmax_mean(x, rows, ldx, n, w, inv));
}
#else
    ;
#endif

/// w[c] = max(w[c], the most any of `rows` rows of x ([rows, ldx]) gives column c < n in its
/// softmax over [0, n)): KVzip's observed score. The rows are overwritten with their exp values
/// and inv ([rows], scratch) with their normalisers, as softmax_mean leaves them.
inline void softmax_max(float* x, Index rows, Index ldx, Index n, float* w, float* inv)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(softmax_max(x, rows, ldx, n, w, inv));
}
#else
    ;
#endif

/// The attention output of softmax rows: out[r][0, dv) = inv[r] * sum_{c < n} e[r][c] *
/// values[c][0, dv), r < rows. e: [rows, lde] exp values, inv: [rows] (as softmax_mean leaves
/// them); values: [n, dv] stored rows of T; out: row r at out + r * ldo ([dv] float32).
template <class T>
inline void weighted_rows(const float* e, Index lde, const float* inv, Index rows, const T* values,
                          Index dv, Index n, float* out, Index ldo)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(weighted_rows(e, lde, inv, rows, values, dv, n, out, ldo));
}
#else
    ;
#endif

/// Index of the lowest of x[0, n) (n >= 1), the first among equals or the last when `last`; *hits:
/// how many hold that value (up to 2); -1 when some x[i] is NaN.
inline Index argmin(const float* x, Index n, bool last, int* hits)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(argmin(x, n, last, hits));
}
#else
    ;
#endif

/// s[i] = s[i] * decay + w[i], i < n.
inline void decay_accumulate(float* s, const float* w, Index n, float decay)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  VELOXQUANT_DETAIL_DISPATCH(decay_accumulate(s, w, n, decay));
}
#else
    ;
#endif

/// One row of n input elements stored as T (round to nearest even; a double is converted as
/// Eigen converts it: to float32 first).
template <class U, class T>
inline void store_row(const U* src, T* dst, Index n)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if constexpr (std::is_same_v<U, T>) {
    std::memcpy(dst, src, sizeof(T) * static_cast<std::size_t>(n));
  } else if constexpr (std::is_same_v<U, double>) {
    for (Index i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  } else {
    VELOXQUANT_DETAIL_DISPATCH(convert_row(src, dst, n));
  }
}
#else
    ;
#endif

/// One query row as float32 into dst ([padded_dim(d)], zero-padded).
template <class Q>
inline void load_query_row(const Q* src, Index d, float* dst) {
  for (Index i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  for (Index i = d; i < padded_dim(d); ++i) dst[i] = 0.0f;
}

// ---- Stored rows of any kind (docs/design.md 7.4, 7.5): T rows go to the kernels above, quantized
// rows to their counterparts, which dequantize in registers and give the values the kernels above
// give on the dequantized rows as float32.

/// Room for a block's scales and offsets as float32 while channel-axis rows are read
/// ([2, padded_dim(d)]): per thread, grown once (kernels run on the engine's workers).
inline float* channel_scales(Index d) {
  thread_local std::vector<float> buf;
  const auto need = static_cast<std::size_t>(2 * padded_dim(d));
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

/// Channel-axis rows for the kernels: the pending block's rows as float32 (float rows as they are;
/// others converted, the lanes in use only, per thread, `slot` 0 for keys, 1 for values: a call
/// may hold both). With `convert` false other types' pending rows are not converted and left
/// null (a caller that reads sealed rows only).
template <class T>
ChannelRows channel_rows(const StoredRows<T>& r, int slot, bool convert = true) {
  const float* pending = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    pending = r.pending;
  } else if (convert) {
    thread_local std::vector<float> buf[2];
    std::vector<float>& b = buf[slot];
    const auto count = static_cast<std::size_t>(r.pending_lanes * r.fmt.dim);
    if (b.size() < count) b.resize(count);
    // The path's conversion (exact either way): a scalar loop here was 13% of a decode step over
    // 4-bit rows at budget 512 (callgrind, AVX2 path, 2026-12-06).
    store_row(r.pending, b.data(), static_cast<Index>(count));
    pending = b.data();
  }
  ChannelRows c;
  static_cast<ChannelIndex&>(c) = r;
  c.data = r.row_bytes(0);
  c.stride = r.stride * static_cast<Index>(sizeof(T));
  c.fmt = r.fmt;
  c.pending = pending;
  return c;
}

/// The scratch of the folded kernels for n rows (row j: idx ? idx[j] : j) of `rows` and m query
/// rows, per thread (grown, then reused): each row's block, and with `sort` the rows ordered by
/// block.
inline ChannelFold channel_fold(const ChannelRows& rows, const std::int32_t* idx, Index n, Index m,
                                bool sort) {
  struct Buffers {
    std::vector<float> qs, cst, row, esum;
    std::vector<std::uint8_t> ready;
    std::vector<Index> block, run, slot_block;
    std::vector<std::int32_t> perm;
  };
  thread_local Buffers s;
  const auto grow = [](auto& v, Index size) {
    if (v.size() < static_cast<std::size_t>(size)) v.resize(static_cast<std::size_t>(size));
  };
  const Index nb = rows.blocks, dp = padded_dim(rows.fmt.dim);
  grow(s.qs, nb * m * dp);
  grow(s.cst, nb * m);
  grow(s.ready, nb);
  grow(s.row, 2 * dp);  // a row, or a block's offsets and scales (fold_block)
  grow(s.esum, 4 * (nb + 1));
  grow(s.block, n);
  // Each live slot's block from one walk over the slots in ascending position, beside the
  // blocks' first positions (no search per row: after many evictions a window's rows come from
  // blocks in no order); a slot the walk does not reach (dead, or no order given) searches.
  Index* slot_block = nullptr;
  if (rows.order != nullptr) {
    grow(s.slot_block, rows.slots);
    slot_block = s.slot_block.data();
    if (rows.live < rows.slots) std::fill_n(slot_block, rows.slots, Index{-1});  // dead slots
    Index b = 0;
    for (Index i = 0; i < rows.live; ++i) {
      const std::int32_t slot = rows.order[i];
      const std::int64_t p = rows.pos[slot];
      if (p >= rows.pending_start || nb == 0) {
        slot_block[slot] = nb;
        continue;
      }
      while (b + 1 < nb && rows.starts[b + 1] <= p) ++b;
      slot_block[slot] = b;
    }
  }
  for (Index j = 0; j < n; ++j) {
    const Index row = idx ? idx[j] : j;
    Index b = slot_block != nullptr && row < rows.slots ? slot_block[row] : -1;
    if (b < 0) {
      const std::int64_t p = rows.pos[row];
      b = p < rows.pending_start && nb > 0 ? block_at(rows.starts, nb, p) : nb;
    }
    s.block[static_cast<std::size_t>(j)] = b;
  }
  if (sort) {
    s.run.assign(static_cast<std::size_t>(nb + 2), 0);
    grow(s.perm, n);
    for (Index j = 0; j < n; ++j) ++s.run[static_cast<std::size_t>(s.block[static_cast<std::size_t>(j)] + 1)];
    for (Index b = 0; b <= nb; ++b) s.run[static_cast<std::size_t>(b + 1)] += s.run[static_cast<std::size_t>(b)];
    thread_local std::vector<Index> fill;  // the next free place of each block's run
    fill.assign(s.run.begin(), s.run.end());
    for (Index j = 0; j < n; ++j) {
      const auto b = static_cast<std::size_t>(s.block[static_cast<std::size_t>(j)]);
      s.perm[static_cast<std::size_t>(fill[b]++)] = static_cast<std::int32_t>(idx ? idx[j] : j);
    }
  }
  return ChannelFold{s.block.data(), s.qs.data(), s.cst.data(), s.ready.data(),
                     s.row.data(),   s.perm.data(), s.run.data(), s.esum.data()};
}

/// logits over stored key rows (row j: (idx ? idx[j] : j)). As logits() above.
template <class T>
inline void logits(const float* q, Index m, Index ldq, const StoredRows<T>& keys,
                   const std::int32_t* idx, Index n, Index d, float scale, float* out, Index ldo,
                   float* kbuf)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if (!keys.quantized()) {
    return logits(q, m, ldq, keys.data, keys.stride, idx, n, d, scale, out, ldo, kbuf);
  }
  if (keys.channel()) {
    const ChannelRows c = channel_rows(keys, 0);
    const ChannelFold f = channel_fold(c, idx, n, m, false);
    VELOXQUANT_DETAIL_DISPATCH(cfold_logits(q, m, ldq, c, idx, n, scale, out, ldo, f));
  }
  const QuantRows r = keys.bytes();
  VELOXQUANT_DETAIL_DISPATCH(qlogits(q, m, ldq, r, idx, n, scale, out, ldo, kbuf));
}
#else
    ;
#endif

/// pack_keys over stored key rows [j0, j1). As pack_keys() above.
template <class T>
inline void pack_keys(const StoredRows<T>& keys, Index j0, Index j1, Index d, float* kt, float* buf)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if (!keys.quantized()) return pack_keys(keys.data, keys.stride, j0, j1, d, kt, buf);
  if (keys.channel()) {
    float* so = channel_scales(d);
    const ChannelRows c = channel_rows(keys, 0);
    VELOXQUANT_DETAIL_DISPATCH(cpack_keys(c, j0, j1, kt, buf, so));
  }
  const QuantRows r = keys.bytes();
  VELOXQUANT_DETAIL_DISPATCH(qpack_keys(r, j0, j1, kt, buf));
}
#else
    ;
#endif

/// weighted_rows over the first n stored value rows. As weighted_rows() above.
template <class T>
inline void weighted_rows(const float* e, Index lde, const float* inv, Index rows,
                          const StoredRows<T>& values, Index dv, Index n, float* out, Index ldo)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if (!values.quantized()) {
    return weighted_rows(e, lde, inv, rows, values.data, dv, n, out, ldo);
  }
  if (values.channel()) {
    const ChannelRows c = channel_rows(values, 1);
    const ChannelFold f = channel_fold(c, nullptr, n, 0, true);
    VELOXQUANT_DETAIL_DISPATCH(cfold_weighted_rows(e, lde, inv, rows, c, out, ldo, f));
  }
  const QuantRows r = values.bytes();
  VELOXQUANT_DETAIL_DISPATCH(qweighted_rows(e, lde, inv, rows, r, n, out, ldo));
}
#else
    ;
#endif

/// Row j of quantized rows dequantized to float32: out [padded_dim(d)], zero-padded.
inline void dequantize_row(const QuantRows& rows, Index j, float* out)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  const auto pad = [&] {
    for (Index k = rows.fmt.dim; k < padded_dim(rows.fmt.dim); ++k) out[k] = 0.0f;
  };
#if VELOXQUANT_DETAIL_X86
  switch (active_simd_level()) {
    case SimdLevel::avx512:
      avx512::qload_padded_row(rows, j, out);
      return pad();
    case SimdLevel::avx2:
      avx2::qload_padded_row(rows, j, out);
      return pad();
    case SimdLevel::sse2:
      sse2::qload_padded_row(rows, j, out);
      return pad();
    case SimdLevel::scalar:
    case SimdLevel::neon:
      break;
  }
#elif VELOXQUANT_DETAIL_ARM64
  if (active_simd_level() == SimdLevel::neon) {
    neon::qload_padded_row(rows, j, out);
    return pad();
  }
#endif
  scalar::qload_padded_row(rows, j, out);
  pad();
}
#else
    ;
#endif

/// Stored row j as float32 (the key-as-query row): dst [padded_dim(d)], zero-padded.
template <class T>
inline void load_stored_row(const StoredRows<T>& rows, Index j, Index d, float* dst)
#if VELOXQUANT_DETAIL_KERNELS_DEFINED
{
  if (rows.channel()) {
    const std::int64_t p = rows.pos[j];
    if (p >= rows.pending_start) {  // a pending row: its values at T, exactly
      return load_query_row(rows.pending + (p - rows.pending_start) * d, d, dst);
    }
    float* so = channel_scales(d);
    for (Index k = d; k < padded_dim(d); ++k) dst[k] = 0.0f;
    const ChannelRows c = channel_rows(rows, 0, false);
    VELOXQUANT_DETAIL_DISPATCH(cload_padded_row(c, j, dst, so));
  }
  if (rows.quantized()) return dequantize_row(rows.bytes(), j, dst);
  load_query_row(rows.data + j * rows.stride, d, dst);
}
#else
    ;
#endif

#undef VELOXQUANT_DETAIL_DISPATCH

}  // namespace veloxquant::cache::detail
