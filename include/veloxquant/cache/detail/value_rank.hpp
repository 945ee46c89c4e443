// veloxquant — the value-weighted eviction ranking of the H2O-core policies in calls with queries
// (docs/design.md 4.8, KVCacheConfig::value_norm_power): a row's rank is its score times |v|^p,
// |v| the L2 norm of its stored value row, so among rows of equal attention mass the ones that
// move the attention output least go first. The norm is summed in double in a fixed order, so the
// rank is the same in every build (docs/design.md 7.2).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "quant.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// |v_j|^power of stored value row j ([dv], dequantized as the attention sees it). row:
/// [padded_dim(dv)] scratch, left holding the row as float32. power in (0, 4]; the result is
/// finite (at most the largest double).
template <class T>
double value_norm_weight(const StoredRows<T>& values, Index j, Index dv, double power, float* row) {
  load_stored_row(values, j, dv, row);
  double sum_sq = 0.0;
  for (Index i = 0; i < dv; ++i)
    sum_sq += static_cast<double>(row[i]) * static_cast<double>(row[i]);
  const double w = power == 2.0 ? sum_sq : std::pow(sum_sq, 0.5 * power);
  return std::min(w, std::numeric_limits<double>::max());
}

/// rank[s] = score[s] * |v_s|^power for each slot s in cand[0, n_cand), saturated to the float
/// range (a finite score times a finite weight is never NaN; a score is negative only where a
/// query-free K-norm call left -|k|). rank: by slot, [max slot + 1]; row:
/// [padded_dim(dv)] scratch.
template <class T>
void value_weighted_rank(const StoredRows<T>& values, Index dv, const float* score,
                         const std::int32_t* cand, Index n_cand, double power, float* rank,
                         float* row) {
  constexpr double kMaxFloat = static_cast<double>(std::numeric_limits<float>::max());
  for (Index c = 0; c < n_cand; ++c) {
    const Index s = cand[c];
    const double w = value_norm_weight(values, s, dv, power, row);
    rank[s] =
        static_cast<float>(std::clamp(static_cast<double>(score[s]) * w, -kMaxFloat, kMaxFloat));
  }
}

}  // namespace veloxquant::cache::detail
