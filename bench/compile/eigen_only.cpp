// Compile-time baseline (scripts/compile_time.sh): the same work as consumer.cpp with Eigen's
// Tensor module alone: a [B, H, S, D] half tensor filled, copied and reduced.
#include <unsupported/Eigen/CXX11/Tensor>

#include <cstdio>

using Tensor4 = Eigen::Tensor<Eigen::half, 4, Eigen::RowMajor>;

int main() {
  Tensor4 k(1, 8, 16, 64), v(1, 8, 16, 64);
  k.setConstant(Eigen::half(0.5f));
  v.setConstant(Eigen::half(0.25f));
  Tensor4 both = k + v;
  const Eigen::Tensor<float, 0, Eigen::RowMajor> sum = both.cast<float>().sum();
  std::printf("%g\n", static_cast<double>(sum()));
  return 0;
}
