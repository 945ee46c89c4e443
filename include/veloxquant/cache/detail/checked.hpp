// veloxquant — checked arithmetic on the integers a caller supplies (docs/robustness.md,
// "Integers"): sums, differences and products of signed integers that report an overflow instead
// of having one. Every computation on an integer from the API that could leave its type goes
// through these, before the value is validated or used.
#pragma once

#include <initializer_list>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace veloxquant::cache::detail {

/// a + b, or nothing when it does not fit I.
template <class I>
constexpr std::optional<I> checked_add(I a, I b) {
  static_assert(std::is_integral_v<I> && std::is_signed_v<I>, "signed integers");
  constexpr I kMax = std::numeric_limits<I>::max(), kMin = std::numeric_limits<I>::min();
  if ((b > 0 && a > kMax - b) || (b < 0 && a < kMin - b)) return std::nullopt;
  return static_cast<I>(a + b);
}

/// a - b, or nothing when it does not fit I.
template <class I>
constexpr std::optional<I> checked_sub(I a, I b) {
  static_assert(std::is_integral_v<I> && std::is_signed_v<I>, "signed integers");
  constexpr I kMax = std::numeric_limits<I>::max(), kMin = std::numeric_limits<I>::min();
  if ((b < 0 && a > kMax + b) || (b > 0 && a < kMin + b)) return std::nullopt;
  return static_cast<I>(a - b);
}

/// a * b, or nothing when it does not fit I.
template <class I>
constexpr std::optional<I> checked_mul(I a, I b) {
  static_assert(std::is_integral_v<I> && std::is_signed_v<I>, "signed integers");
  constexpr I kMax = std::numeric_limits<I>::max(), kMin = std::numeric_limits<I>::min();
  if (a == 0 || b == 0) return I{0};
  const bool fits =
      a > 0 ? (b > 0 ? a <= kMax / b : b >= kMin / a) : (b > 0 ? a >= kMin / b : a >= kMax / b);
  if (!fits) return std::nullopt;
  return static_cast<I>(a * b);
}

/// The product of `factors` (each >= 0), or nothing when it, or a product of some of them taken
/// in order, does not fit I.
template <class I>
constexpr std::optional<I> checked_product(std::initializer_list<I> factors) {
  I p = 1;
  for (const I f : factors) {
    const std::optional<I> next = checked_mul(p, f);
    if (!next) return std::nullopt;
    p = *next;
  }
  return p;
}

/// The value of a checked operation, or std::invalid_argument "<api>: <what> overflows".
template <class I>
I value_or_throw(const std::optional<I>& v, const char* api, const char* what) {
  if (!v) throw std::invalid_argument(std::string(api) + ": " + what + " overflows");
  return *v;
}

}  // namespace veloxquant::cache::detail
