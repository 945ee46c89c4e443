// veloxquant — concentration_score kernel (docs/design.md 5.1): mean pairwise cosine similarity in
// O(n D).
#pragma once

#include <cmath>

#include <Eigen/Core>

namespace veloxquant::cache::detail {

/// Mean off-diagonal cosine similarity of the rows of `rows` (n x D, any scalar type).
/// Uses |sum_i u_i|^2 - sum_i |u_i|^2 for the off-diagonal Gram sum; accumulates in double.
/// Returns 0.0 when n < 2.
template <class Derived>
double concentration_score(const Eigen::MatrixBase<Derived>& rows) {
  const Eigen::Index n = rows.rows();
  const Eigen::Index d = rows.cols();
  if (n < 2) return 0.0;
  // Accumulate sum_i u_i without a heap allocation for the common head dims.
  constexpr Eigen::Index kStack = 256;
  double stack_sum[kStack];
  Eigen::VectorXd heap_sum;
  double* sum = stack_sum;
  if (d > kStack) {
    heap_sum.setZero(d);
    sum = heap_sum.data();
  } else {
    for (Eigen::Index j = 0; j < d; ++j) stack_sum[j] = 0.0;
  }
  double diag = 0.0;
  for (Eigen::Index i = 0; i < n; ++i) {
    double nrm2 = 0.0;
    for (Eigen::Index j = 0; j < d; ++j) {
      const double x = static_cast<double>(rows(i, j));
      nrm2 += x * x;
    }
    const double inv = 1.0 / (std::sqrt(nrm2) + 1e-8);
    for (Eigen::Index j = 0; j < d; ++j) sum[j] += static_cast<double>(rows(i, j)) * inv;
    diag += nrm2 * inv * inv;
  }
  double total = 0.0;
  for (Eigen::Index j = 0; j < d; ++j) total += sum[j] * sum[j];
  const double nd = static_cast<double>(n);
  return (total - diag) / (nd * (nd - 1.0));
}

}  // namespace veloxquant::cache::detail
