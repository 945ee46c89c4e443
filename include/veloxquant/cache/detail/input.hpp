// veloxquant — the rows a call brings (keys, values, queries), read in place (docs/design.md 7.1):
// an element type tag, the four dimensions and the strides, so one compiled pipeline serves every
// input type and layout; rows are converted only as they are stored or scored.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// Element type of an input tensor.
enum class ElementType : std::uint8_t { half, bfloat16, float32, float64 };

template <class U>
constexpr ElementType element_type_of() {
  if constexpr (std::is_same_v<U, Eigen::half>) {
    return ElementType::half;
  } else if constexpr (std::is_same_v<U, Eigen::bfloat16>) {
    return ElementType::bfloat16;
  } else if constexpr (std::is_same_v<U, float>) {
    return ElementType::float32;
  } else {
    static_assert(std::is_same_v<U, double>,
                  "veloxquant: inputs are half, bfloat16, float or double");
    return ElementType::float64;
  }
}

/// Rows of a [B, H, S, D] input tensor: row (b, h, s) starts at element b*stride_b + h*stride_h
/// + s*stride_s of `data` and holds D contiguous elements of `type`.
struct InputRows {
  const void* data = nullptr;
  ElementType type = ElementType::float32;
  Index batch = 0, heads = 0, seq = 0, dim = 0;
  Index stride_b = 0, stride_h = 0, stride_s = 0;
  bool dense = true;  ///< the rows fill data[0, size()) without gaps (any layout)

  Index size() const { return batch * heads * seq * dim; }
  Index offset(Index b, Index h, Index s) const {
    return b * stride_b + h * stride_h + s * stride_s;
  }
  template <class U>
  const U* row(Index b, Index h, Index s) const {
    return static_cast<const U*>(data) + offset(b, h, s);
  }
};

/// The rows of a head-major (row-major [B, H, S, D]) buffer.
template <class U>
InputRows head_major_rows(const U* data, Index b, Index h, Index s, Index d) {
  return InputRows{data, element_type_of<U>(), b, h, s, d, h * s * d, s * d, d, true};
}
/// The rows of a token-major (row-major [B, S, H, D]) buffer, addressed as [B, H, S, D].
template <class U>
InputRows token_major_rows(const U* data, Index b, Index h, Index s, Index d) {
  return InputRows{data, element_type_of<U>(), b, h, s, d, s * h * d, d, h * d, true};
}

/// Calls f(p) with p the typed pointer to row (b, h, s) of `in`.
template <class F>
decltype(auto) with_row(const InputRows& in, Index b, Index h, Index s, F&& f) {
  switch (in.type) {
    case ElementType::half:
      return f(in.row<Eigen::half>(b, h, s));
    case ElementType::bfloat16:
      return f(in.row<Eigen::bfloat16>(b, h, s));
    case ElementType::float32:
      return f(in.row<float>(b, h, s));
    case ElementType::float64:
      break;
  }
  return f(in.row<double>(b, h, s));
}

/// Row (b, h, s) of `in` stored as T. out: [D]
template <class T>
void read_row(const InputRows& in, Index b, Index h, Index s, T* out) {
  with_row(in, b, h, s, [&](const auto* p) { store_row(p, out, in.dim); });
}

/// Row (b, h, s) of `in` as float32, zero-padded to padded_dim(D). out: [padded_dim(D)]
inline void read_float_row(const InputRows& in, Index b, Index h, Index s, float* out) {
  with_row(in, b, h, s, [&](const auto* p) { load_query_row(p, in.dim, out); });
}

}  // namespace veloxquant::cache::detail
