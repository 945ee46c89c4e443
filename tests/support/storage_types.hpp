// The storage types a typed test runs over: every T a cache may hold (tensor.hpp).
#pragma once

#include <gtest/gtest.h>

#include <Eigen/Core>

namespace veloxquant::test {

using StorageTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float>;

}  // namespace veloxquant::test
