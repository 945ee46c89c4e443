// veloxquant — the query-free scorers of the H2O-core policies besides the key-as-query proxy
// (docs/design.md 4.7): KeyDiff (the keys least similar to the mean retained key are kept) and
// K-norm (low-norm keys are kept). Both keep one number per row, written once when it arrives:
// K-norm its score -|k|, KeyDiff the row's 1 / (|k| + 1e-8), with which keydiff_rank ranks the rows
// when one must go, against an exact running sum of the rows' unit vectors. Dot products go
// through the kernels of simd_kernels.hpp, so the results are the same in every build of a path
// (docs/design.md 7.2).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fp.hpp"
#include "quant.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// Query-free scorers (KVCacheConfig::proxy_scoring, in the order of kProxyScorings).
enum class ProxyScoring : std::uint8_t {
  key_as_query,  ///< docs/design.md 3, 4.2: each key attends as its own query, decayed mass
  keydiff,       ///< ranked by -cos(k, mean retained unit key); the score holds 1 / (|k| + eps)
  knorm,         ///< score = -|k|
};

/// Guard of the unit vectors (as concentration_score, docs/design.md 5.1): u = k / (|k| + eps).
inline constexpr float kUnitEps = 1e-8f;

/// |k_j| of stored key row j: the square root of k_j . k_j from the logits kernel; the row is left
/// in `row` as float32. row: [padded_dim(d)] and kbuf: [4 * padded_dim(d)] scratch.
template <class T>
float key_norm(const StoredRows<T>& keys, Index j, Index d, float* row, float* kbuf) {
  load_stored_row(keys, j, d, row);
  const auto slot = static_cast<std::int32_t>(j);
  float dot = 0.0f;
  logits(row, 1, padded_dim(d), keys, &slot, 1, d, 1.0f, &dot, 1, kbuf);
  return std::sqrt(dot);
}

/// KeyDiff's running sum (docs/design.md 4.7) in fixed point: component i of a row's unit vector
/// u = k / (|k| + 1e-8) is held as round(2^32 * k_i * w), w = 1 / (|k| + 1e-8) (|u_i| < 1, so
/// 2^31 rows fit an int64). The double product of two floats is exact and the rounding is to
/// nearest (even), so a sum of such integers is the same whatever the order of its additions and
/// removals, in every build: kept step by step, it equals the sum rebuilt over the live rows.
inline constexpr double kKeySumScale = 4294967296.0;
/// Rounds x (|x| < 2^51) to the nearest integer, ties to even, in the default rounding mode:
/// x + 1.5 * 2^52 - 1.5 * 2^52 (the compiler may not fold it without -ffast-math); where double
/// arithmetic carries excess precision (x87) the sum would not round there, so nearbyint instead.
inline double round_even(double x) {
#if defined(__FLT_EVAL_METHOD__) && __FLT_EVAL_METHOD__ != 0
  return std::nearbyint(x);
#else
  constexpr double kMagic = 6755399441055744.0;
  return (x + kMagic) - kMagic;
#endif
}

/// Adds (sign 1) or removes (sign -1) a key row of weight w = 1 / (|k| + 1e-8) (from key_norm of
/// that very row, so every term is below 2^32 in magnitude) to or from sum ([d]). row: [d], the
/// stored row as float32 (load_stored_row).
inline void key_sum_update(std::int64_t* sum, const float* row, Index d, float w, int sign) {
  for (Index i = 0; i < d; ++i) {
    const double u = static_cast<double>(row[i]) * static_cast<double>(w) * kKeySumScale;
    sum[i] += sign * static_cast<std::int64_t>(round_even(u));
  }
}

/// KeyDiff's state in one head (docs/design.md 4.7): per key dimension an exact integer sum of
/// the live rows' weighted keys (key_sum_update), and whether it is that sum now. The head marks
/// it stale at every change of its live set; the KeyDiff scorer (proxy_call.hpp) rebuilds it, or
/// follows a change it makes itself and marks it valid again. Being exact, a rebuilt sum equals the
/// one it replaces bit for bit.
struct KeyDiffSum {
  std::vector<std::int64_t> sum;  // [dk] or empty before the first KeyDiff call
  bool valid = false;

  /// Allocates the sum (strong exception guarantee), before a call changes anything.
  void reserve(Index dk) {
    if (sum.empty() && dk > 0) sum.assign(static_cast<std::size_t>(dk), 0);
  }
  /// A checkpoint's copy into `out`. Allocates only.
  void save(KeyDiffSum& out) const {
    out.sum.assign(sum.begin(), sum.end());
    out.valid = valid;
  }
  /// Writes a checkpoint's copy back (the sum was allocated by then, or the copy is empty).
  void restore(const KeyDiffSum& saved) noexcept {
    std::copy(saved.sum.begin(), saved.sum.end(), sum.begin());
    valid = saved.valid;
  }
  std::size_t heap_bytes() const { return sum.capacity() * sizeof(std::int64_t); }
};

/// KeyDiff's ranking (docs/design.md 4.7) among n >= 1 live rows of the first n_phys stored key
/// rows, whose running sum is `sum` ([d]) and whose weights 1 / (|k| + 1e-8) are weight[slot]: with
/// m the mean of their unit vectors (the sum / n), rank[c] = -(u_c . m) / (|m| + 1e-8), in [-1, 1],
/// for each candidate slot c of cand[0, n_cand): the row most like the others ranks lowest and goes
/// first. One pass of the logits kernel: over the storage as it lies (`whole`: every c < n_phys,
/// cheaper than gathering when few slots are dead) or over the candidates only.
/// weight, rank: [n_phys] by slot; dots: [n_cand]; anchor: [padded_dim(d)];
/// kbuf: [4 * padded_dim(d)] scratch.
template <class T>
void keydiff_rank(const StoredRows<T>& keys, Index d, const std::int64_t* sum, const float* weight,
                  Index n, Index n_phys, const std::int32_t* cand, Index n_cand, bool whole,
                  float* rank, float* dots, float* anchor, float* kbuf) {
  const Index dp = padded_dim(d);
  const double to_mean = 1.0 / (kKeySumScale * static_cast<double>(n));
  double mm = 0.0;
  for (Index i = 0; i < d; ++i) {
    anchor[i] = static_cast<float>(static_cast<double>(sum[i]) * to_mean);
    mm += product(anchor[i], anchor[i]);
  }
  for (Index i = d; i < dp; ++i) anchor[i] = 0.0f;
  const float inv_m = 1.0f / (static_cast<float>(std::sqrt(mm)) + kUnitEps);
  if (whole) {
    logits(anchor, 1, dp, keys, nullptr, n_phys, d, 1.0f, rank, n_phys, kbuf);
    // Every slot, candidate or not, in one contiguous pass that vectorises at any -O level
    // (Eigen's packets). The sign goes on the factor, not through a negation (Eigen's packet
    // negation is 0 - x, which turns -0 into +0): x * (-f) equals -(x * f) bit for bit for every
    // non-NaN x, so each candidate's rank is the candidate loop's below. Dead slots' ranks are
    // never read.
    Eigen::Map<Eigen::ArrayXf> r(rank, n_phys);
    r = (r * Eigen::Map<const Eigen::ArrayXf>(weight, n_phys)) * (-inv_m);
    return;
  }
  logits(anchor, 1, dp, keys, cand, n_cand, d, 1.0f, dots, n_cand, kbuf);
  for (Index j = 0; j < n_cand; ++j) rank[cand[j]] = -(dots[j] * weight[cand[j]]) * inv_m;
}

}  // namespace veloxquant::cache::detail
