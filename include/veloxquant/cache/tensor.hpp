// veloxquant — the tensor types that cross the API: [B, H, S, D], row-major (D fastest).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <type_traits>
#include <unsupported/Eigen/CXX11/Tensor>
#include <utility>

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
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16> ||
    std::is_same_v<T, float>;

/// True for the element types accepted as input (storage types and double).
template <class T>
inline constexpr bool is_input_type_v = is_storage_type_v<T> || std::is_same_v<T, double>;

/// How an engine's [B, ·, S, D] buffer is ordered; rows are contiguous in D in both
/// (docs/design.md 2.3).
enum class Layout {
  head_major,  ///< [B, H, S, D]: every head's rows together (Tensor4, mlx, PyTorch's default)
  token_major  ///< [B, S, H, D]: every token's heads together (llama.cpp, llama2.c's q/k/v)
};

/// A read-only reference to an engine's input tensor, read in place: `data` holds
/// batch x heads x seq x dim elements of U in `layout`. Converts implicitly from Tensor4<U> and
/// from Eigen TensorMaps of one (head-major). The referenced memory must outlive the call it is
/// passed to; nothing is copied. The cache validates it (null data with a non-zero size or a
/// negative dimension throws std::invalid_argument naming the tensor). U: half, bfloat16, float,
/// double.
template <class U>
struct TensorRef {
  static_assert(is_input_type_v<U>, "veloxquant: inputs must be half, bfloat16, float or double");
  using Index = Eigen::Index;

  const U* data = nullptr;
  Index batch = 0, heads = 0, seq = 0, dim = 0;
  Layout layout = Layout::head_major;

  TensorRef(const U* data_, Index batch_, Index heads_, Index seq_, Index dim_,
            Layout layout_ = Layout::head_major)
      : data(data_), batch(batch_), heads(heads_), seq(seq_), dim(dim_), layout(layout_) {}
  // NOLINTBEGIN(google-explicit-constructor): the conversions are the point
  TensorRef(const Tensor4<U>& t)  // [B, H, S, D]
      : TensorRef(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)) {}
  TensorRef(const Eigen::TensorMap<const Tensor4<U>>& t)  // [B, H, S, D]
      : TensorRef(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)) {}
  TensorRef(const Eigen::TensorMap<Tensor4<U>>& t)  // [B, H, S, D]
      : TensorRef(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)) {}
  // NOLINTEND(google-explicit-constructor)
};

namespace detail {
/// input_element<X>::type is U when X is Tensor4<U>, a TensorMap of one, or TensorRef<U> (the
/// argument types every update API takes); no member otherwise.
template <class X>
struct input_element {};
template <class U>
struct input_element<Tensor4<U>> {
  using type = U;
};
template <class U>
struct input_element<Eigen::TensorMap<Tensor4<U>>> {
  using type = U;
};
template <class U>
struct input_element<Eigen::TensorMap<const Tensor4<U>>> {
  using type = U;
};
template <class U>
struct input_element<TensorRef<U>> {
  using type = U;
};
template <class X>
using input_element_t = typename input_element<std::remove_cv_t<std::remove_reference_t<X>>>::type;
/// void when K and V are inputs of one element type (SFINAE for the update APIs).
template <class K, class V>
using same_input_t = std::enable_if_t<std::is_same_v<input_element_t<K>, input_element_t<V>>>;
}  // namespace detail

}  // namespace veloxquant::cache
