// Kernel test, on purpose: detail/checks.hpp alone. The limits no tensor built in a test can
// reach through the public API, and the word-at-a-time magnitude scan against its definition.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache/detail/checks.hpp>

namespace {

namespace vc = veloxquant::cache;
using Index = Eigen::Index;

/// Rows are addressed by 32-bit slots: a call that would take a head past 2^31 - 1 rows is
/// rejected before anything changes (the check itself; a tensor that size cannot be built here).
TEST(RowCapacityTest, AHeadHoldsAtMostInt32MaxRows) {
  constexpr Index kMax = 2147483647;
  EXPECT_NO_THROW(vc::detail::check_rows_fit(0, kMax, "update_and_fetch"));
  EXPECT_NO_THROW(vc::detail::check_rows_fit(kMax - 5, 5, "update_and_fetch"));
  EXPECT_NO_THROW(vc::detail::check_rows_fit(kMax, 0, "update_and_fetch"));
  for (const auto& [live, add] : {std::pair<Index, Index>{1, kMax}, {kMax - 5, 6}, {kMax, 1},
                                  {0, kMax + 1}, {kMax, kMax}}) {
    try {
      vc::detail::check_rows_fit(live, add, "update_and_view");
      ADD_FAILURE() << "no exception for " << live << " + " << add;
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("update_and_view"), std::string::npos) << what;
      EXPECT_NE(what.find("rows per head"), std::string::npos) << what;
    }
  }
}

/// all_within (a 64-bit word at a time, carries within each lane) against its definition,
/// |x| <= limit and not NaN: every bfloat16 bit pattern, and float32 patterns around the limit,
/// the specials and random ones, in every lane of a word and in a tail.
TEST(MagnitudeScanTest, AllWithinMatchesItsDefinition) {
  const auto check = [](auto x, float limit) {
    using X = decltype(x);
    const bool expect = std::abs(static_cast<float>(x)) <= limit;  // false for NaN
    for (const Index n : {1, 3, 4, 7}) {  // one lane, a tail, a full word, a word and a tail
      for (Index at = 0; at < n; ++at) {
        X v[7] = {X(1.0f), X(1.0f), X(1.0f), X(1.0f), X(1.0f), X(1.0f), X(1.0f)};
        v[at] = x;
        ASSERT_EQ(vc::detail::all_within(v, n, limit), expect)
            << static_cast<float>(x) << " at " << at << " of " << n << ", limit " << limit;
      }
    }
  };
  for (const float limit : {vc::detail::kMaxKeyMagnitude, vc::detail::kMaxQueryMagnitude, 1.0f}) {
    for (std::uint32_t b = 0; b < 65536; b += 1) {
      const auto bits = static_cast<std::uint16_t>(b);
      check(Eigen::numext::bit_cast<Eigen::bfloat16>(bits), limit);
    }
    std::uint32_t limit_bits = 0;
    std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
    std::vector<std::uint32_t> patterns = {0u,          0x80000000u, 0x7F800000u, 0xFF800000u,
                                           0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7F7FFFFFu};
    for (std::uint32_t d = 0; d < 4; ++d) {
      for (const std::uint32_t sign : {0u, 0x80000000u}) {
        patterns.push_back(sign | (limit_bits - d));
        patterns.push_back(sign | (limit_bits + d));
      }
    }
    std::mt19937 rng(3);
    for (int i = 0; i < 20000; ++i) patterns.push_back(static_cast<std::uint32_t>(rng()));
    for (const std::uint32_t p : patterns) {
      float x = 0.0f;
      std::memcpy(&x, &p, sizeof(x));
      check(x, limit);
    }
  }
}

}  // namespace
