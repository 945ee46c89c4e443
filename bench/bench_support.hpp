// What the benchmark programs share (bench/*.cpp).
#pragma once

#include <cstdint>
#include <random>

#include <veloxquant/cache.hpp>

namespace veloxquant::bench {

/// A [b, h, s, d] tensor of standard normal draws from mt19937(seed), each cast to T.
template <class T>
cache::Tensor4<T> random_tensor(Eigen::Index b, Eigen::Index h, Eigen::Index s, Eigen::Index d,
                                std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cache::Tensor4<T> t(b, h, s, d);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(nd(rng));
  return t;
}

}  // namespace veloxquant::bench
