// veloxquant — the value-weighted eviction ranking of the H2O-core policies in calls with queries
// (docs/design.md 4.8, KVCacheConfig::value_norm_power): a row's rank is its score times |v|^p,
// |v| the L2 norm of its stored value row, so among rows of equal attention mass the ones that
// move the attention output least go first. A head computes each row's |v|^p once, when the row
// is stored (ValueWeights below, which a head carries along its slots); the norm is summed in
// double in a fixed order, so the weight and the rank are the same in every build
// (docs/design.md 7.2).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

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

/// The value-weighted ranking's state in one head: |v|^power of the value row stored in each
/// slot, computed once when the row is stored and moved with it. Off (no weight, no allocation)
/// until enable(). The head calls set / move / resized / gathered wherever its rows change slots.
class ValueWeights {
 public:
  bool on() const { return power_ > 0.0; }
  /// From now on keep a weight per slot, for `slots` slots; value rows have dv elements. Strong
  /// exception guarantee. power > 0.
  void enable(double power, Index slots, Index dv) {
    std::vector<float> weight(static_cast<std::size_t>(slots));
    std::vector<float> row(static_cast<std::size_t>(padded_dim(dv)));
    weight_.swap(weight);
    row_.swap(row);
    power_ = power;
  }
  /// Weighs the value row stored in slot s of `values` (nothing when off).
  template <class T>
  void set(const StoredRows<T>& values, Index s, Index dv) noexcept {
    if (on()) weight_[at(s)] = value_norm_weight(values, s, dv, power_, row_.data());
  }
  void move(Index from, Index to) noexcept {
    if (on()) weight_[at(to)] = weight_[at(from)];
  }
  /// The weights of the first `keep` slots, at `slots` slots (empty when off). Allocates only.
  std::vector<float> resized(Index slots, Index keep) const {
    std::vector<float> w(on() ? static_cast<std::size_t>(slots) : 0);
    if (on()) std::copy_n(weight_.begin(), static_cast<std::size_t>(keep), w.begin());
    return w;
  }
  /// Takes weights made by resized().
  void swap_weights(std::vector<float>& w) noexcept { weight_.swap(w); }
  /// A checkpoint's copy of the first n weights (empty when off). Allocates only.
  void save(Index n, std::vector<float>& out) const {
    out.assign(weight_.begin(), weight_.begin() + static_cast<std::ptrdiff_t>(on() ? n : 0));
  }
  /// Writes a checkpoint's copy back (the slots it covers are still there).
  void restore(const std::vector<float>& saved) noexcept {
    std::copy(saved.begin(), saved.end(), weight_.begin());
  }
  /// Weights in the same state with weight i that of slot src[i], i < n. Allocates only.
  template <class SlotT>
  ValueWeights gathered(const SlotT* src, Index n) const {
    ValueWeights c;
    if (!on()) return c;
    c.weight_.resize(static_cast<std::size_t>(n));
    c.row_.resize(row_.size());
    c.power_ = power_;
    for (Index i = 0; i < n; ++i) c.weight_[at(i)] = weight_[at(src[i])];
    return c;
  }
  /// |v|^power by slot; only when on().
  const float* data() const { return weight_.data(); }
  float* data() { return weight_.data(); }
  std::size_t heap_bytes() const { return (weight_.capacity() + row_.capacity()) * sizeof(float); }

 private:
  static std::size_t at(Index s) { return static_cast<std::size_t>(s); }

  std::vector<float> weight_;  // [slots] or empty: |v|^power_ per slot
  std::vector<float> row_;     // [padded_dim(dv)] or empty: a value row being weighed
  double power_ = 0.0;         // > 0: on
};

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
