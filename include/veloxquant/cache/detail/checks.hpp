// veloxquant — input validation at the API boundary (docs/design.md 8): shapes and finiteness.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <sstream>
#include <stdexcept>
#include <string>

#include <Eigen/Core>

#include "../tensor.hpp"

namespace veloxquant::cache::detail {

/// Shape of one cache's calls, fixed by its first call with S >= 1 (until reset()).
struct LayerDims {
  Eigen::Index batch = 0;
  Eigen::Index heads = 0;
  Eigen::Index key_dim = 0;
  Eigen::Index value_dim = 0;
  bool known = false;
};

template <class T>
std::string shape_str(const Tensor4<T>& t) {
  std::ostringstream os;
  os << '[' << t.dimension(0) << ", " << t.dimension(1) << ", " << t.dimension(2) << ", "
     << t.dimension(3) << ']';
  return os.str();
}

/// True when every element of x[0..n) is finite. A branch-free exponent-bits test that the
/// compiler vectorises (the per-element isfinite of half/bfloat16 does not).
template <class T>
bool all_finite(const T* x, Eigen::Index n) {
  using Bits = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
  static_assert(sizeof(T) == sizeof(Bits), "storage types are 16 or 32 bits");
  constexpr auto exponent = static_cast<Bits>(std::is_same_v<T, float>            ? 0x7F800000u
                                              : std::is_same_v<T, Eigen::bfloat16> ? 0x7F80u
                                                                                    : 0x7C00u);
  Bits bad = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, x + i, sizeof(Bits));
    bad |= static_cast<Bits>((b & exponent) == exponent);
  }
  return bad == 0;
}

/// Throws std::invalid_argument when a head that holds `live` rows cannot take `new_rows` more:
/// rows are addressed by 32-bit slots, so a head holds at most 2^31 - 1 rows.
inline void check_rows_fit(Eigen::Index live, Eigen::Index new_rows, const char* api) {
  constexpr Eigen::Index kMaxRows = 2147483647;  // std::numeric_limits<std::int32_t>::max()
  if (new_rows > kMaxRows - live) {
    std::ostringstream os;
    os << api << ": a head holding " << live << " rows cannot take " << new_rows
       << " more (at most " << kMaxRows << " rows per head)";
    throw std::invalid_argument(os.str());
  }
}

/// Throws std::invalid_argument for keys/values whose shapes disagree with each other or with the
/// dims of the first call, for a zero B, H or D, and for a non-finite key (first bad index).
/// keys: [B, H, S, Dk], values: [B, H, S, Dv]
template <class T>
void check_update(const Tensor4<T>& keys, const Tensor4<T>& values, const LayerDims& dims,
                  const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (keys " << shape_str(keys) << ", values " << shape_str(values)
       << ')';
    throw std::invalid_argument(os.str());
  };
  if (keys.dimension(0) != values.dimension(0) || keys.dimension(1) != values.dimension(1) ||
      keys.dimension(2) != values.dimension(2)) {
    fail("keys and values must share B, H and S");
  }
  if (keys.dimension(0) == 0 || keys.dimension(1) == 0) fail("B and H must be >= 1");
  if (keys.dimension(3) == 0 || values.dimension(3) == 0) fail("head dim D must be >= 1");
  if (dims.known) {
    if (keys.dimension(0) != dims.batch || keys.dimension(1) != dims.heads ||
        keys.dimension(3) != dims.key_dim || values.dimension(3) != dims.value_dim) {
      std::ostringstream os;
      os << "B, H or D differ from the first call's (B=" << dims.batch << ", H=" << dims.heads
         << ", key D=" << dims.key_dim << ", value D=" << dims.value_dim << ")";
      fail(os.str());
    }
  }
  const T* k = keys.data();
  const Eigen::Index n = keys.size();
  if (all_finite(k, n)) return;
  for (Eigen::Index i = 0; i < n; ++i) {
    if (!(Eigen::numext::isfinite)(k[i])) {
      const Eigen::Index d = keys.dimension(3), s = keys.dimension(2), h = keys.dimension(1);
      std::ostringstream os;
      os << "non-finite key at [b=" << i / (d * s * h) << ", h=" << (i / (d * s)) % h
         << ", s=" << (i / d) % s << ", d=" << i % d << "] (value " << static_cast<double>(k[i])
         << " after conversion to the storage type)";
      fail(os.str());
    }
  }
}

}  // namespace veloxquant::cache::detail
