// veloxquant — the tensor types that cross the API: [B, H, S, D], row-major (D fastest).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

namespace veloxquant::cache {

/// A batch of per-head token rows: [B, H, S, D], row-major (D fastest).
template <class T>
using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;

/// (keys, values), both [B, H, n, D] (their D may differ).
template <class T>
using KVPair = std::pair<Tensor4<T>, Tensor4<T>>;

/// True for the storage types a cache may hold: Eigen::half, Eigen::bfloat16, float.
template <class T>
inline constexpr bool is_storage_type_v =
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16> || std::is_same_v<T, float>;

/// True for the element types accepted as input (storage types and double).
template <class T>
inline constexpr bool is_input_type_v = is_storage_type_v<T> || std::is_same_v<T, double>;

}  // namespace veloxquant::cache
