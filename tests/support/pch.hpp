// The precompiled header of the test TUs (tests/CMakeLists.txt, VELOXQUANT_TEST_PCH): the checked
// assertions first, as the force-included prelude of the other test TUs puts them, then the
// headers nearly every test includes. A test still includes what it uses itself; this only saves
// parsing them 30 times. It must not include support/test_support.hpp (or anything that reads
// VELOXQUANT_TEST_KEY_BITS / VALUE_BITS): test_contract_q84 shares it with other values.
#pragma once

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>
