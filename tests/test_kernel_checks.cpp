// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

// Kernel test, on purpose: detail/checks.hpp alone. The limits no tensor built in a test can
// reach through the public API.

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
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

}  // namespace
