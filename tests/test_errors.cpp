// Bad input at the API boundary (SPEC 8) on every cache class (standard, squeeze with a
// coordinator, H2O, PyramidKV), through update_and_fetch and update_and_view: the exception type,
// its message (offending shapes or first bad index), the strong guarantee (nothing observable
// changed, nothing reported to the coordinator), and that the next valid call gives exactly what an
// untouched twin cache gives.

#include <gtest/gtest.h>

#include <array>
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
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

using StorageTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float>;

enum class Kind { kStandard, kSqueeze, kH2O, kPyramid };

constexpr int kBudget = 6;           // h2o / pyramid budget, squeeze coordinator average
constexpr int kSqueezeFallback = 8;  // squeeze_budget before adoption

/// A cache under test, with its coordinator for squeeze.
template <class T>
struct Subject {
  std::shared_ptr<vc::SqueezeCoordinator> coordinator;
  std::unique_ptr<vc::KVCache<T>> cache;
};

template <class T>
Subject<T> make_subject(Kind kind) {
  Subject<T> s;
  vc::KVCacheConfig c;
  switch (kind) {
    case Kind::kStandard:
      c.method = "standard";
      s.cache = std::make_unique<vc::KVCache<T>>(c);
      break;
    case Kind::kSqueeze:
      c.method = "squeeze";
      c.squeeze_budget = kSqueezeFallback;
      c.squeeze_n_sink = 1;
      c.squeeze_recent_ratio = 0.5;
      s.coordinator = std::make_shared<vc::SqueezeCoordinator>(1, kBudget, 1, 1.0);
      s.cache = std::make_unique<vc::SqueezeAttentionCache<T>>(c, 0, s.coordinator);
      break;
    case Kind::kH2O:
      c.method = "h2o";
      c.h2o_budget = kBudget;
      c.h2o_n_sink = 1;
      c.h2o_grace = 2;
      s.cache = std::make_unique<vc::H2OCache<T>>(c);
      break;
    case Kind::kPyramid:
      c.method = "pyramidkv";
      c.pyramid_budget = kBudget;
      c.pyramid_n_sink = 1;
      c.pyramid_recent_ratio = 0.25;
      s.cache = std::make_unique<vc::PyramidKVCache<T>>(c);
      break;
  }
  return s;
}

/// Everything observable about a cache (and its coordinator).
struct Snapshot : BasicSnapshot {
  std::optional<int> layer_budget, budget, protected_recent;
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<std::int64_t>> positions;
  bool adopted = false;
  double concentration = 0.0;
  std::map<int, double> reports;
  bool finalized = false;

  bool operator==(const Snapshot& o) const {
    return BasicSnapshot::operator==(o) && layer_budget == o.layer_budget &&
           budget == o.budget && protected_recent == o.protected_recent &&
           scores == o.scores && positions == o.positions && adopted == o.adopted &&
           concentration == o.concentration && reports == o.reports && finalized == o.finalized;
  }
};

std::ostream& operator<<(std::ostream& os, const Snapshot& s) {
  os << "{offset " << s.offset << ", rows " << s.key_shape[2] << ", kept_bytes " << s.kept_bytes
     << ", tokens_seen " << s.tokens_seen << ", tokens_kept " << s.tokens_kept << ", layer_budget "
     << (s.layer_budget ? std::to_string(*s.layer_budget) : "-") << ", reports " << s.reports.size()
     << ", adopted " << s.adopted << "}";
  return os;
}

template <class T>
Snapshot snapshot(const Subject<T>& subject) {
  const vc::KVCache<T>& c = *subject.cache;
  Snapshot s;
  take_basic_snapshot(c, s);
  if (const auto* core = dynamic_cast<const vc::detail::H2OCore<T>*>(&c)) {
    s.budget = core->budget();
    s.protected_recent = core->protected_recent();
    for (Index b = 0; b < c.batch(); ++b) {
      for (Index h = 0; h < c.heads(); ++h) {
        s.scores.push_back(core->scores(b, h));
        s.positions.push_back(core->positions(b, h));
      }
    }
  }
  if (const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&c)) {
    s.layer_budget = sq->layer_budget();
    s.adopted = sq->budget_adopted();
    s.concentration = sq->concentration();
  } else if (const auto* h2o = dynamic_cast<const vc::H2OCache<T>*>(&c)) {
    s.layer_budget = h2o->layer_budget();
  } else if (const auto* pk = dynamic_cast<const vc::PyramidKVCache<T>*>(&c)) {
    s.layer_budget = pk->layer_budget();
  }
  if (subject.coordinator) {
    s.reports = subject.coordinator->reports();
    s.finalized = subject.coordinator->is_finalized();
  }
  return s;
}

/// One bad call and what its error message must say.
struct BadCall {
  std::string name;
  vc::Tensor4<double> keys, values;
  bool as_double = false;          // pass the double tensors (converting overload)
  bool needs_established = false;  // only meaningful after a first valid call
  bool show_shapes = true;         // the message must contain both input shapes
  std::optional<Shape> bad_index;  // the message must name this [b, h, s, d]
};

constexpr Shape kKeys{2, 2, 3, 4};
constexpr Shape kValues{2, 2, 3, 3};

template <class T>
std::vector<BadCall> bad_calls(std::mt19937& rng) {
  std::vector<BadCall> out;
  const auto shape_case = [&](std::string name, Shape k, Shape v, bool established) {
    BadCall c;
    c.name = std::move(name);
    c.keys = random_doubles(rng, k);
    c.values = random_doubles(rng, v);
    c.needs_established = established;
    out.push_back(std::move(c));
  };
  shape_case("values B differs", kKeys, {1, 2, 3, 3}, false);
  shape_case("values H differs", kKeys, {2, 1, 3, 3}, false);
  shape_case("values S differs", kKeys, {2, 2, 2, 3}, false);
  shape_case("keys S differs", {2, 2, 1, 4}, kValues, false);
  shape_case("zero key D", {2, 2, 3, 0}, kValues, false);
  shape_case("zero value D", kKeys, {2, 2, 3, 0}, false);
  shape_case("zero B", {0, 2, 3, 4}, {0, 2, 3, 3}, false);
  shape_case("zero H", {2, 0, 3, 4}, {2, 0, 3, 3}, false);
  shape_case("B differs from the first call", {1, 2, 1, 4}, {1, 2, 1, 3}, true);
  shape_case("H differs from the first call", {2, 3, 1, 4}, {2, 3, 1, 3}, true);
  shape_case("key D differs from the first call", {2, 2, 1, 5}, {2, 2, 1, 3}, true);
  shape_case("value D differs from the first call", {2, 2, 1, 4}, {2, 2, 1, 4}, true);
  shape_case("empty call with another B", {3, 2, 0, 4}, {3, 2, 0, 3}, true);

  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Shape> where = {{0, 0, 0, 0}, {1, 1, 2, 3}, {0, 1, 1, 2}, {1, 0, 2, 0}};
  for (const double bad : {nan, inf, -inf}) {
    for (const Shape& at : where) {
      BadCall c;
      c.name = "key " + std::to_string(bad) + " at [" + std::to_string(at[0]) + "," +
               std::to_string(at[1]) + "," + std::to_string(at[2]) + "," + std::to_string(at[3]) +
               "]";
      c.keys = random_doubles(rng, kKeys);
      c.values = random_doubles(rng, kValues);
      c.keys(at[0], at[1], at[2], at[3]) = bad;
      c.show_shapes = false;
      c.bad_index = at;
      out.push_back(std::move(c));
    }
  }
  {  // two bad keys: the first in row-major order is named
    BadCall c;
    c.name = "two bad keys";
    c.keys = random_doubles(rng, kKeys);
    c.values = random_doubles(rng, kValues);
    c.keys(1, 1, 0, 1) = inf;
    c.keys(1, 0, 2, 3) = nan;
    c.show_shapes = false;
    c.bad_index = Shape{1, 0, 2, 3};
    out.push_back(std::move(c));
  }
  {  // finite as double, infinite once converted to T
    BadCall c;
    c.name = "double key overflowing the storage type";
    c.keys = random_doubles(rng, kKeys);
    c.values = random_doubles(rng, kValues);
    c.keys(0, 1, 2, 1) = std::is_same_v<T, Eigen::half> ? 1e6 : 1e300;
    c.as_double = true;
    c.show_shapes = false;
    c.bad_index = Shape{0, 1, 2, 1};
    out.push_back(std::move(c));
  }
  {
    BadCall c;
    c.name = "double NaN key";
    c.keys = random_doubles(rng, kKeys);
    c.values = random_doubles(rng, kValues);
    c.keys(1, 1, 1, 1) = nan;
    c.as_double = true;
    c.show_shapes = false;
    c.bad_index = Shape{1, 1, 1, 1};
    out.push_back(std::move(c));
  }
  return out;
}

/// Checks the message of a caught error against what `bc` must say.
void check_message(const BadCall& bc, const std::string& what) {
  if (bc.show_shapes) {
    EXPECT_TRUE(std::regex_search(what, shape_regex(shape_of(bc.keys))))
        << bc.name << ": message lacks the keys shape: " << what;
    EXPECT_TRUE(std::regex_search(what, shape_regex(shape_of(bc.values))))
        << bc.name << ": message lacks the values shape: " << what;
  }
  if (bc.bad_index) {
    std::smatch m;
    const std::regex idx(R"(b\s*=\s*(\d+)\D*?h\s*=\s*(\d+)\D*?s\s*=\s*(\d+)\D*?d\s*=\s*(\d+))");
    ASSERT_TRUE(std::regex_search(what, m, idx)) << bc.name << ": no index in: " << what;
    const Shape got{std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3]), std::stoll(m[4])};
    EXPECT_EQ(got, *bc.bad_index) << bc.name << ": " << what;
  }
}

/// Runs `call` expecting std::invalid_argument; returns its message ("" if none was thrown).
std::string expect_invalid_argument(const std::function<void()>& call, const std::string& name) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << name << ": threw something else: " << e.what();
    return "";
  }
  ADD_FAILURE() << name << ": did not throw";
  return "";
}

/// The rows of a view sorted by position, per head: (position, key bytes, value bytes); plus
/// the positions of its last new_rows() rows.
template <class T>
std::vector<std::vector<std::pair<std::int64_t, std::vector<unsigned char>>>> view_content(
    const vc::KVView<T>& v) {
  std::vector<std::vector<std::pair<std::int64_t, std::vector<unsigned char>>>> out;
  for (Index b = 0; b < v.batch(); ++b) {
    for (Index h = 0; h < v.heads(); ++h) {
      std::vector<std::pair<std::int64_t, std::vector<unsigned char>>> rows;
      for (Index r = 0; r < v.rows(); ++r) {
        std::vector<unsigned char> bytes(static_cast<std::size_t>(v.key_dim() + v.value_dim()) *
                                         sizeof(T));
        std::memcpy(bytes.data(), v.keys(b, h).row(r).data(),
                    static_cast<std::size_t>(v.key_dim()) * sizeof(T));
        std::memcpy(bytes.data() + static_cast<std::size_t>(v.key_dim()) * sizeof(T),
                    v.values(b, h).row(r).data(),
                    static_cast<std::size_t>(v.value_dim()) * sizeof(T));
        rows.emplace_back(v.positions(b, h)(r), std::move(bytes));
      }
      // The call's rows stay last (in arrival order); the retained ones are compared as a set.
      std::sort(rows.begin(), rows.end() - v.new_rows());
      out.push_back(std::move(rows));
    }
  }
  return out;
}

/// One valid call of the given S on the subject and its twin; the results must be identical.
template <class T>
void valid_call_on_both(Subject<T>& subject, Subject<T>& twin, std::mt19937& rng, Index S,
                        bool view, const std::string& context) {
  const vc::Tensor4<T> k =
      random_doubles(rng, {kKeys[0], kKeys[1], S, kKeys[3]}).template cast<T>();
  const vc::Tensor4<T> v =
      random_doubles(rng, {kValues[0], kValues[1], S, kValues[3]}).template cast<T>();
  if (view) {
    const vc::KVView<T> a = subject.cache->update_and_view(k, v);
    const vc::KVView<T> b = twin.cache->update_and_view(k, v);
    ASSERT_EQ(a.rows(), b.rows()) << context;
    ASSERT_EQ(a.new_rows(), S) << context;
    ASSERT_EQ(b.new_rows(), S) << context;
    EXPECT_TRUE(view_content(a) == view_content(b)) << context << ": views differ from the twin's";
  } else {
    const vc::KVPair<T> a = subject.cache->update_and_fetch(k, v);
    const vc::KVPair<T> b = twin.cache->update_and_fetch(k, v);
    EXPECT_EQ(shape_of(a.first), shape_of(b.first)) << context;
    EXPECT_EQ(shape_of(a.second), shape_of(b.second)) << context;
    EXPECT_TRUE(bytes_of(a.first) == bytes_of(b.first))
        << context << ": keys differ from the twin's";
    EXPECT_TRUE(bytes_of(a.second) == bytes_of(b.second))
        << context << ": values differ from the twin's";
  }
  EXPECT_EQ(snapshot(subject), snapshot(twin)) << context;
}

/// Every bad call on every phase of `kind`: on a fresh cache (first call) and on a cache that has
/// absorbed a prefill longer than the budget and some decode steps.
template <class T>
void run_error_cases(Kind kind) {
  std::mt19937 rng(static_cast<unsigned>(kind) * 97u + sizeof(T));
  const std::vector<BadCall> cases = bad_calls<T>(rng);
  int thrown = 0;

  for (const bool established : {false, true}) {
    for (const BadCall& bc : cases) {
      if (bc.needs_established && !established) continue;
      Subject<T> subject = make_subject<T>(kind);
      Subject<T> twin = make_subject<T>(kind);
      const std::string phase = established ? " (after decoding)" : " (first call)";
      if (established) {
        valid_call_on_both(subject, twin, rng, 9, false, bc.name + ": prefill");
        for (int i = 0; i < 3; ++i)
          valid_call_on_both(subject, twin, rng, 1, i == 1, bc.name + ": decode");
      }
      const Snapshot before = snapshot(subject);
      if (kind == Kind::kSqueeze && !established) {
        EXPECT_TRUE(before.reports.empty());
        EXPECT_EQ(before.layer_budget, std::optional<int>(kSqueezeFallback));
      }
      for (const bool view : {false, true}) {
        const std::string name =
            bc.name + phase + (view ? " via update_and_view" : " via update_and_fetch");
        const std::string what =
            expect_invalid_argument([&] { feed(*subject.cache, bc, view); }, name);
        if (!what.empty()) {
          ++thrown;
          check_message(bc, what);
        }
        EXPECT_EQ(snapshot(subject), before) << name << ": the cache changed";
        if (subject.coordinator && !established) {
          EXPECT_TRUE(subject.coordinator->reports().empty())
              << name << ": reported a concentration";
          EXPECT_FALSE(subject.coordinator->is_finalized()) << name;
        }
      }
      // The next valid calls give exactly what the untouched twin gives.
      valid_call_on_both(subject, twin, rng, established ? 1 : 5, false,
                         bc.name + phase + ": next fetch");
      valid_call_on_both(subject, twin, rng, 2, true, bc.name + phase + ": next view");
      if (kind == Kind::kSqueeze) {
        EXPECT_EQ(subject.coordinator->reports().size(), 1u) << bc.name << phase;
        EXPECT_EQ(snapshot(subject).layer_budget, std::optional<int>(kBudget)) << bc.name << phase;
      }
    }
  }
  int expected = 0;
  for (const BadCall& bc : cases) expected += bc.needs_established ? 2 : 4;
  EXPECT_EQ(thrown, expected);
}

template <class T>
class ErrorsTest : public ::testing::Test {};
TYPED_TEST_SUITE(ErrorsTest, StorageTypes);

TYPED_TEST(ErrorsTest, StandardCacheRejectsBadInputAndStaysUnchanged) {
  run_error_cases<TypeParam>(Kind::kStandard);
}

TYPED_TEST(ErrorsTest, SqueezeCacheWithCoordinatorRejectsBadInputAndStaysUnchanged) {
  run_error_cases<TypeParam>(Kind::kSqueeze);
}

TYPED_TEST(ErrorsTest, H2OCacheRejectsBadInputAndStaysUnchanged) {
  run_error_cases<TypeParam>(Kind::kH2O);
}

TYPED_TEST(ErrorsTest, PyramidKVCacheRejectsBadInputAndStaysUnchanged) {
  run_error_cases<TypeParam>(Kind::kPyramid);
}

/// Values are not inspected for finiteness (SPEC 8): a NaN value is stored as given.
TYPED_TEST(ErrorsTest, NonFiniteValuesAreAccepted) {
  using T = TypeParam;
  for (const Kind kind : {Kind::kStandard, Kind::kSqueeze, Kind::kH2O, Kind::kPyramid}) {
    std::mt19937 rng(5);
    Subject<T> subject = make_subject<T>(kind);
    vc::Tensor4<double> k = random_doubles(rng, kKeys);
    vc::Tensor4<double> v = random_doubles(rng, kValues);
    v(1, 0, 2, 1) = std::numeric_limits<double>::quiet_NaN();
    v(0, 1, 0, 0) = std::numeric_limits<double>::infinity();
    vc::KVPair<T> out;
    ASSERT_NO_THROW(out = subject.cache->update_and_fetch(k, v));
    EXPECT_EQ(subject.cache->offset(), 3);
    ASSERT_EQ(out.second.dimension(2), 3);
    EXPECT_TRUE((Eigen::numext::isnan)(out.second(1, 0, 2, 1)));
    EXPECT_TRUE((Eigen::numext::isinf)(out.second(0, 1, 0, 0)));
    v = random_doubles(rng, {2, 2, 1, 3});
    v(0, 0, 0, 2) = std::numeric_limits<double>::quiet_NaN();
    k = random_doubles(rng, {2, 2, 1, 4});
    ASSERT_NO_THROW(subject.cache->update_and_view(k, v));
    EXPECT_EQ(subject.cache->offset(), 4);
    EXPECT_EQ(subject.cache->tokens_seen(), 16);
  }
}

/// A double that fits the storage type is accepted (only the converted value is checked).
TYPED_TEST(ErrorsTest, LargeFiniteDoubleKeysThatFitTheStorageTypeAreAccepted) {
  using T = TypeParam;
  std::mt19937 rng(6);
  vc::KVCache<T> cache;
  vc::Tensor4<double> k = random_doubles(rng, {1, 1, 2, 2});
  k(0, 0, 1, 1) = std::is_same_v<T, Eigen::half> ? 60000.0 : 1e6;
  const vc::KVPair<T> out = cache.update_and_fetch(k, random_doubles(rng, {1, 1, 2, 2}));
  EXPECT_EQ(static_cast<float>(out.first(0, 0, 1, 1)),
            static_cast<float>(static_cast<T>(k(0, 0, 1, 1))));
}

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
