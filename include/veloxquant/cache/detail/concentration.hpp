// veloxquant — concentration_score kernel (docs/design.md 5.1): mean pairwise cosine similarity in
// O(n D), from running sums, so rows can be added a call at a time.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "fp.hpp"

namespace veloxquant::cache::detail {

/// The running sums of concentration_score: sum_i u_i (D doubles), sum_i |u_i|^2 and n, with
/// u_i = k_i / (|k_i| + 1e-8). The off-diagonal Gram sum is |sum_i u_i|^2 - sum_i |u_i|^2.
class ConcentrationSums {
 public:
  /// Adds one row; x(j) gives element j as double, j < d (d fixed by the first row).
  template <class Get>
  void add(Eigen::Index d, Get x) {
    if (sum_.empty()) sum_.assign(static_cast<std::size_t>(d), 0.0);
    double nrm2 = 0.0;
    for (Eigen::Index j = 0; j < d; ++j) nrm2 += product(x(j), x(j));
    if (!std::isfinite(nrm2)) return add_scaled(d, x);
    const double inv = 1.0 / (std::sqrt(nrm2) + 1e-8);
    for (Eigen::Index j = 0; j < d; ++j) sum_[static_cast<std::size_t>(j)] += product(x(j), inv);
    diag_ += product(product(nrm2, inv), inv);
    ++n_;
  }
  /// add() for a row whose squared norm overflows double (finite elements beyond about 1e154,
  /// only from double input: a cache's rows are far smaller): u = (k / m) / (|k / m| + 1e-8 / m),
  /// m = max |k_j|, the same u without the overflow. A non-finite element still gives a
  /// non-finite sum, as in add().
  template <class Get>
  void add_scaled(Eigen::Index d, Get x) {
    double m = 0.0;
    for (Eigen::Index j = 0; j < d; ++j) m = std::max(m, std::abs(x(j)));
    double nrm2 = 0.0;
    for (Eigen::Index j = 0; j < d; ++j) nrm2 += product(x(j) / m, x(j) / m);
    const double inv = 1.0 / (std::sqrt(nrm2) + 1e-8 / m);
    for (Eigen::Index j = 0; j < d; ++j) {
      sum_[static_cast<std::size_t>(j)] += product(x(j) / m, inv);
    }
    diag_ += product(product(nrm2, inv), inv);
    ++n_;
  }

  /// Mean off-diagonal cosine similarity of the rows added; 0.0 for fewer than two.
  double score() const {
    if (n_ < 2) return 0.0;
    double total = 0.0;
    for (const double s : sum_) total += product(s, s);
    const double nd = static_cast<double>(n_);
    return (total - diag_) / (nd * (nd - 1.0));
  }
  Eigen::Index rows() const { return n_; }

  /// The sums themselves (a saved layer that has not calibrated yet, docs/design.md G): sum_i u_i
  /// ([D], empty before the first row), sum_i |u_i|^2, and n.
  const std::vector<double>& direction_sum() const { return sum_; }
  double diagonal() const { return diag_; }
  /// Sums as saved (direction_sum(), diagonal(), rows()).
  static ConcentrationSums restored(std::vector<double> sum, double diag, Eigen::Index n) {
    ConcentrationSums s;
    s.sum_ = std::move(sum);
    s.diag_ = diag;
    s.n_ = n;
    return s;
  }

 private:
  std::vector<double> sum_;
  double diag_ = 0.0;
  Eigen::Index n_ = 0;
};

/// Mean off-diagonal cosine similarity of the rows of `rows` (n x D, any scalar type), accumulated
/// in double; 0.0 when n < 2.
template <class Derived>
double concentration_score(const Eigen::MatrixBase<Derived>& rows) {
  ConcentrationSums sums;
  for (Eigen::Index i = 0; i < rows.rows(); ++i) {
    sums.add(rows.cols(), [&](Eigen::Index j) { return static_cast<double>(rows(i, j)); });
  }
  return sums.score();
}

}  // namespace veloxquant::cache::detail
