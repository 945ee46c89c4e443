// veloxquant — the value-weighted eviction ranking of the H2O-core policies in calls with queries
// (docs/design.md 4.8, KVCacheConfig::value_norm_power): a row's rank is its score times |v|^p,
// |v| the L2 norm of its stored value row, so among rows of equal attention mass the ones that
// move the attention output least go first. A head computes each row's |v|^p once, when the row
// is stored (head_store.hpp); the norm is summed in double in a fixed order, so the weight and
// the rank are the same in every build (docs/design.md 7.2).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "quant.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// |v_j|^power of stored value row j ([dv], dequantized as the attention sees it), in float,
/// at most the largest float (NaN for a NaN value). row: [padded_dim(dv)] scratch, left holding the
/// row as float32. power > 0 (the config allows (0, 4]).
template <class T>
float value_norm_weight(const StoredRows<T>& values, Index j, Index dv, double power, float* row) {
  load_stored_row(values, j, dv, row);
  double sum_sq = 0.0;
  for (Index i = 0; i < dv; ++i) {
    sum_sq += static_cast<double>(row[i]) * static_cast<double>(row[i]);
  }
  const double w = power == 2.0 ? sum_sq : std::pow(sum_sq, 0.5 * power);
  return static_cast<float>(std::min(w, static_cast<double>(std::numeric_limits<float>::max())));
}

/// rank[s] = score[s] * weight[s] for each slot s in cand[0, n_cand), computed in double and
/// saturated to the float range (no float conversion out of range). NaN only from a NaN weight (a
/// NaN value stored as given, docs/design.md E); the selection evicts NaN first. A score is
/// negative only where a query-free K-norm call left -|k|. score, weight, rank: by slot.
inline void value_weighted_rank(const float* score, const float* weight, const std::int32_t* cand,
                                Index n_cand, float* rank) {
  constexpr double kMaxFloat = static_cast<double>(std::numeric_limits<float>::max());
  for (Index c = 0; c < n_cand; ++c) {
    const Index s = cand[c];
    const double r = static_cast<double>(score[s]) * static_cast<double>(weight[s]);
    rank[s] = static_cast<float>(std::clamp(r, -kMaxFloat, kMaxFloat));
  }
}

}  // namespace veloxquant::cache::detail
