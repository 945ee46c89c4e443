// Tests of KVCacheConfig (docs/design.md 2.1: defaults and validate()), of the validation done by every
// cache constructor and by SqueezeCoordinator (docs/design.md 2.4, 2.6), and of KVCacheFactory::create
// (docs/design.md 2.7): dispatch by method, unknown and not-yet-implemented methods, trimmability.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>
#include <gtest/gtest.h>

#include <veloxquant/cache.hpp>

namespace {

namespace vc = veloxquant::cache;
using vc::KVCacheConfig;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

const std::vector<std::string> kAllMethods = {"squeeze", "tova",     "h2o",          "pyramidkv",
                                              "snapkv",  "standard", "streaming_llm", "kvzip"};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return s;
}

/// Expects `f` to throw std::invalid_argument whose message contains `field` and, after the first
/// occurrence of `field`, `value` (both matched case-insensitively; `value` may be empty). Every
/// string of `also` must appear somewhere in the message too.
template <class F>
void ExpectInvalid(F&& f, const std::string& field, const std::string& value,
                   const std::vector<std::string>& also = {}) {
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument naming '" << field << "' and '" << value
                  << "'";
  } catch (const std::invalid_argument& e) {
    const std::string msg = Lower(e.what());
    const std::size_t at = msg.find(Lower(field));
    ASSERT_NE(at, std::string::npos) << "message '" << e.what() << "' does not name '" << field
                                     << "'";
    EXPECT_NE(msg.find(Lower(value), at + field.size()), std::string::npos)
        << "message '" << e.what() << "' does not give the value '" << value << "' after '"
        << field << "'";
    for (const std::string& s : also) {
      EXPECT_NE(msg.find(Lower(s)), std::string::npos)
          << "message '" << e.what() << "' does not mention '" << s << "'";
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected std::invalid_argument, got: " << e.what();
  }
}

KVCacheConfig WithMethod(const std::string& method) {
  KVCacheConfig c;
  c.method = method;
  return c;
}

/// One invalid field setting: the mutation, the field it breaks and how its value prints.
struct FieldCase {
  std::string field;
  std::string value;
  std::function<void(KVCacheConfig&)> apply;
};

/// Every field-level rule of docs/design.md 2.1 (independent of the method in use).
std::vector<FieldCase> FieldCases() {
  std::vector<FieldCase> cases;
  // A budget < 1, for every budget field (the resolved ones included).
  for (const int v : {0, -5}) {
    const std::string s = std::to_string(v);
    cases.push_back({"squeeze_budget", s, [v](KVCacheConfig& c) { c.squeeze_budget = v; }});
    cases.push_back({"h2o_budget", s, [v](KVCacheConfig& c) { c.h2o_budget = v; }});
    cases.push_back({"pyramid_budget", s, [v](KVCacheConfig& c) { c.pyramid_budget = v; }});
    cases.push_back({"tova_budget", s, [v](KVCacheConfig& c) { c.tova_budget = v; }});
    cases.push_back({"snap_budget", s, [v](KVCacheConfig& c) { c.snap_budget = v; }});
    cases.push_back({"squeeze_resolved_budget", s,
                     [v](KVCacheConfig& c) { c.squeeze_resolved_budget = v; }});
    cases.push_back({"pyramid_resolved_budget", s,
                     [v](KVCacheConfig& c) { c.pyramid_resolved_budget = v; }});
  }
  // A negative n_sink, for every policy, and a negative grace.
  for (const int v : {-1, -7}) {
    const std::string s = std::to_string(v);
    cases.push_back({"squeeze_n_sink", s, [v](KVCacheConfig& c) { c.squeeze_n_sink = v; }});
    cases.push_back({"h2o_n_sink", s, [v](KVCacheConfig& c) { c.h2o_n_sink = v; }});
    cases.push_back({"pyramid_n_sink", s, [v](KVCacheConfig& c) { c.pyramid_n_sink = v; }});
    cases.push_back({"tova_n_sink", s, [v](KVCacheConfig& c) { c.tova_n_sink = v; }});
    cases.push_back({"stream_n_sink", s, [v](KVCacheConfig& c) { c.stream_n_sink = v; }});
    cases.push_back({"snap_n_sink", s, [v](KVCacheConfig& c) { c.snap_n_sink = v; }});
    cases.push_back({"kvzip_n_sink", s, [v](KVCacheConfig& c) { c.kvzip_n_sink = v; }});
    cases.push_back({"h2o_grace", s, [v](KVCacheConfig& c) { c.h2o_grace = v; }});
  }
  // Strength and recent ratios outside [0, 1] or NaN.
  const std::vector<std::pair<double, std::string>> bad_unit = {
      {-0.1, "-0.1"}, {1.1, "1.1"}, {kNaN, "nan"}};
  for (const auto& [v, s] : bad_unit) {
    const double x = v;
    cases.push_back({"squeeze_strength", s, [x](KVCacheConfig& c) { c.squeeze_strength = x; }});
    cases.push_back(
        {"squeeze_recent_ratio", s, [x](KVCacheConfig& c) { c.squeeze_recent_ratio = x; }});
    cases.push_back(
        {"pyramid_recent_ratio", s, [x](KVCacheConfig& c) { c.pyramid_recent_ratio = x; }});
  }
  // Decay outside (0, 1] or NaN.
  const std::vector<std::pair<double, std::string>> bad_decay = {
      {0.0, "0"}, {-0.5, "-0.5"}, {1.5, "1.5"}, {kNaN, "nan"}};
  for (const auto& [v, s] : bad_decay) {
    const double x = v;
    cases.push_back({"squeeze_decay", s, [x](KVCacheConfig& c) { c.squeeze_decay = x; }});
    cases.push_back({"h2o_decay", s, [x](KVCacheConfig& c) { c.h2o_decay = x; }});
    cases.push_back({"pyramid_decay", s, [x](KVCacheConfig& c) { c.pyramid_decay = x; }});
  }
  // pyramid_beta < 1 or NaN.
  const std::vector<std::pair<double, std::string>> bad_beta = {
      {0.5, "0.5"}, {0.25, "0.25"}, {-2.0, "-2"}, {kNaN, "nan"}};
  for (const auto& [v, s] : bad_beta) {
    const double x = v;
    cases.push_back({"pyramid_beta", s, [x](KVCacheConfig& c) { c.pyramid_beta = x; }});
  }
  // Window and observation window < 1.
  for (const int v : {0, -4}) {
    const std::string s = std::to_string(v);
    cases.push_back(
        {"stream_window_size", s, [v](KVCacheConfig& c) { c.stream_window_size = v; }});
    cases.push_back({"snap_obs_window", s, [v](KVCacheConfig& c) { c.snap_obs_window = v; }});
  }
  return cases;
}

/// Random [B, H, S, D] float tensor with N(0, 1) entries.
vc::Tensor4<float> RandomTensor(std::mt19937& rng, Eigen::Index b, Eigen::Index h, Eigen::Index s,
                                Eigen::Index d) {
  vc::Tensor4<float> t(b, h, s, d);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = dist(rng);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Defaults (docs/design.md 2.1 table)
// ---------------------------------------------------------------------------------------------

TEST(KVCacheConfigTest, IsAnAggregate) {
  EXPECT_TRUE(std::is_aggregate_v<KVCacheConfig>);
}

TEST(KVCacheConfigTest, DefaultsEqualSpecTable) {
  const KVCacheConfig c;
  EXPECT_EQ(c.method, "squeeze");
  EXPECT_EQ(c.squeeze_budget, 512);
  EXPECT_EQ(c.squeeze_n_sink, 4);
  EXPECT_EQ(c.squeeze_strength, 1.0);
  EXPECT_FALSE(c.squeeze_resolved_budget.has_value());
  EXPECT_EQ(c.squeeze_recent_ratio, 0.5);
  EXPECT_EQ(c.squeeze_decay, 0.98);
  EXPECT_FALSE(c.squeeze_defer);

  EXPECT_EQ(c.h2o_budget, 512);
  EXPECT_EQ(c.h2o_n_sink, 4);
  EXPECT_EQ(c.h2o_grace, 16);
  EXPECT_EQ(c.h2o_decay, 0.98);

  EXPECT_EQ(c.pyramid_budget, 512);
  EXPECT_EQ(c.pyramid_n_sink, 4);
  EXPECT_EQ(c.pyramid_beta, 2.0);
  EXPECT_FALSE(c.pyramid_resolved_budget.has_value());
  EXPECT_EQ(c.pyramid_recent_ratio, 0.5);
  EXPECT_EQ(c.pyramid_decay, 0.98);

  EXPECT_EQ(c.tova_budget, 512);
  EXPECT_EQ(c.tova_n_sink, 4);

  EXPECT_EQ(c.stream_n_sink, 4);
  EXPECT_EQ(c.stream_window_size, 512);

  EXPECT_EQ(c.snap_budget, 512);
  EXPECT_EQ(c.snap_obs_window, 32);
  EXPECT_EQ(c.snap_n_sink, 4);

  EXPECT_EQ(c.kvzip_n_sink, 4);
}

TEST(KVCacheConfigTest, FieldTypesEqualSpecTable) {
  const KVCacheConfig c;
  EXPECT_TRUE((std::is_same_v<decltype(c.method), std::string>));
  EXPECT_TRUE((std::is_same_v<decltype(c.squeeze_budget), int>));
  EXPECT_TRUE((std::is_same_v<decltype(c.squeeze_strength), double>));
  EXPECT_TRUE((std::is_same_v<decltype(c.squeeze_resolved_budget), std::optional<int>>));
  EXPECT_TRUE((std::is_same_v<decltype(c.squeeze_defer), bool>));
  EXPECT_TRUE((std::is_same_v<decltype(c.h2o_grace), int>));
  EXPECT_TRUE((std::is_same_v<decltype(c.h2o_decay), double>));
  EXPECT_TRUE((std::is_same_v<decltype(c.pyramid_beta), double>));
  EXPECT_TRUE((std::is_same_v<decltype(c.pyramid_resolved_budget), std::optional<int>>));
  EXPECT_TRUE((std::is_same_v<decltype(c.stream_window_size), int>));
  EXPECT_TRUE((std::is_same_v<decltype(c.snap_obs_window), int>));
}

// ---------------------------------------------------------------------------------------------
// validate()
// ---------------------------------------------------------------------------------------------

TEST(KVCacheConfigTest, ValidateAcceptsDefaultsForEveryMethod) {
  ASSERT_EQ(kAllMethods.size(), 8u);
  for (const std::string& m : kAllMethods) {
    EXPECT_NO_THROW(WithMethod(m).validate()) << m;
  }
}

TEST(KVCacheConfigTest, ValidateAcceptsBoundaryValues) {
  for (const std::string& m : kAllMethods) {
    SCOPED_TRACE(m);
    KVCacheConfig c = WithMethod(m);
    c.squeeze_strength = 0.0;
    c.squeeze_recent_ratio = 0.0;
    c.pyramid_recent_ratio = 1.0;
    c.squeeze_decay = 1.0;
    c.h2o_decay = 1e-6;
    c.pyramid_decay = 1.0;
    c.pyramid_beta = 1.0;
    c.h2o_grace = 0;
    c.stream_window_size = 1;
    c.snap_obs_window = 1;
    c.stream_n_sink = 0;
    EXPECT_NO_THROW(c.validate());
    c.squeeze_strength = 1.0;
    c.squeeze_recent_ratio = 1.0;
    c.pyramid_recent_ratio = 0.0;
    EXPECT_NO_THROW(c.validate());
    // Budget 1 with no sinks, for every policy.
    KVCacheConfig tiny = WithMethod(m);
    tiny.squeeze_budget = tiny.h2o_budget = tiny.pyramid_budget = tiny.tova_budget =
        tiny.snap_budget = 1;
    tiny.squeeze_n_sink = tiny.h2o_n_sink = tiny.pyramid_n_sink = tiny.tova_n_sink =
        tiny.snap_n_sink = 0;
    tiny.squeeze_resolved_budget = 1;
    tiny.pyramid_resolved_budget = 1;
    EXPECT_NO_THROW(tiny.validate());
  }
}

/// The method whose fields `field` belongs to (by its prefix).
std::string MethodOfField(const std::string& field) {
  const std::vector<std::pair<std::string, std::string>> prefixes = {
      {"squeeze_", "squeeze"}, {"h2o_", "h2o"},         {"pyramid_", "pyramidkv"},
      {"tova_", "tova"},       {"stream_", "streaming_llm"}, {"snap_", "snapkv"},
      {"kvzip_", "kvzip"}};
  for (const auto& [prefix, method] : prefixes) {
    if (field.rfind(prefix, 0) == 0) return method;
  }
  return "";
}

/// docs/design.md 2.1: validate() checks the fields of the method in use, and only those. Every
/// field rule throws naming the field and the value when its method is the one in use, and is
/// ignored under every other method.
TEST(KVCacheConfigTest, EveryFieldRuleThrowsForItsOwnMethodOnly) {
  const std::vector<FieldCase> cases = FieldCases();
  for (const std::string& m : kAllMethods) {
    for (const FieldCase& fc : cases) {
      SCOPED_TRACE("method " + m + ", " + fc.field + " = " + fc.value);
      KVCacheConfig c = WithMethod(m);
      fc.apply(c);
      if (MethodOfField(fc.field) == m) {
        ExpectInvalid([&] { c.validate(); }, fc.field, fc.value);
      } else {
        EXPECT_NO_THROW(c.validate());
      }
    }
  }
}

/// set_budget sets every method's budget, StreamingLLM's as its window beside the sinks; a
/// budget a method cannot take is that method's error at validate(), not the others'.
TEST(KVCacheConfigTest, SetBudgetSetsEveryMethodsBudget) {
  KVCacheConfig c;
  c.set_budget(100);
  EXPECT_EQ(c.squeeze_budget, 100);
  EXPECT_EQ(c.h2o_budget, 100);
  EXPECT_EQ(c.pyramid_budget, 100);
  EXPECT_EQ(c.tova_budget, 100);
  EXPECT_EQ(c.snap_budget, 100);
  EXPECT_EQ(c.stream_window_size, 100 - c.stream_n_sink);
  for (const std::string& m : kAllMethods) {
    KVCacheConfig k = WithMethod(m);
    k.set_budget(100);
    EXPECT_NO_THROW(k.validate()) << m;
    // Built caches evict down to it (StreamingLLM: sinks + window = the same rows); the standard
    // cache and KVzip (which keeps a share of the set's rows, not a budget) have none.
    if (m != "standard" && m != "kvzip") {
      EXPECT_EQ(vc::KVCacheFactory::create<float>(k)->layer_budget(), 100) << m;
    }
  }
  // A budget at the sink count: every scored method rejects it naming its own fields, and
  // StreamingLLM its window (0); the standard cache has nothing to check.
  KVCacheConfig t;
  t.set_budget(4);
  for (const auto& [m, field] : std::vector<std::pair<std::string, std::string>>{
           {"squeeze", "squeeze_n_sink"}, {"h2o", "h2o_n_sink"}, {"pyramidkv", "pyramid_n_sink"},
           {"tova", "tova_n_sink"}, {"snapkv", "snap_n_sink"}, {"streaming_llm", "stream_window_size"}}) {
    KVCacheConfig k = t;
    k.method = m;
    EXPECT_THROW(k.validate(), std::invalid_argument) << m;
    try {
      k.validate();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  }
  t.method = "standard";
  EXPECT_NO_THROW(t.validate());
}

/// squeeze_calibration_tokens (docs/design.md 5.4): at least 1, checked for squeeze.
TEST(KVCacheConfigTest, CalibrationTokensMustBePositive) {
  KVCacheConfig c;
  EXPECT_EQ(c.squeeze_calibration_tokens, 32);
  for (const int v : {0, -3}) {
    c.squeeze_calibration_tokens = v;
    ExpectInvalid([&] { c.validate(); }, "squeeze_calibration_tokens", std::to_string(v));
    KVCacheConfig h = c;
    h.method = "h2o";
    EXPECT_NO_THROW(h.validate());
  }
  c.squeeze_calibration_tokens = 1;
  EXPECT_NO_THROW(c.validate());
}

TEST(KVCacheConfigTest, SinksAtOrAboveBudgetThrowForTheMethodInUse) {
  struct SinkCase {
    std::string method;
    std::string sink_field;
    std::string budget_field;
    int n_sink;
    std::function<void(KVCacheConfig&)> apply;
  };
  const std::vector<SinkCase> cases = {
      {"squeeze", "squeeze_n_sink", "squeeze_budget", 64,
       [](KVCacheConfig& c) { c.squeeze_n_sink = 64; c.squeeze_budget = 64; }},
      {"squeeze", "squeeze_n_sink", "squeeze_budget", 100,
       [](KVCacheConfig& c) { c.squeeze_n_sink = 100; c.squeeze_budget = 64; }},
      {"squeeze", "squeeze_n_sink", "squeeze_resolved_budget", 4,
       [](KVCacheConfig& c) { c.squeeze_resolved_budget = 4; }},
      {"squeeze", "squeeze_n_sink", "squeeze_budget", 4,
       [](KVCacheConfig& c) { c.squeeze_budget = 4; c.squeeze_resolved_budget = 600; }},
      {"h2o", "h2o_n_sink", "h2o_budget", 16,
       [](KVCacheConfig& c) { c.h2o_n_sink = 16; c.h2o_budget = 16; }},
      {"h2o", "h2o_n_sink", "h2o_budget", 30,
       [](KVCacheConfig& c) { c.h2o_n_sink = 30; c.h2o_budget = 20; }},
      {"pyramidkv", "pyramid_n_sink", "pyramid_budget", 8,
       [](KVCacheConfig& c) { c.pyramid_n_sink = 8; c.pyramid_budget = 8; }},
      {"pyramidkv", "pyramid_n_sink", "pyramid_resolved_budget", 4,
       [](KVCacheConfig& c) { c.pyramid_resolved_budget = 3; }},
      {"tova", "tova_n_sink", "tova_budget", 9,
       [](KVCacheConfig& c) { c.tova_n_sink = 9; c.tova_budget = 9; }},
      {"snapkv", "snap_n_sink", "snap_budget", 33,
       [](KVCacheConfig& c) { c.snap_n_sink = 33; c.snap_budget = 32; }},
  };
  for (const SinkCase& sc : cases) {
    SCOPED_TRACE(sc.method + ": " + sc.sink_field + " vs " + sc.budget_field);
    KVCacheConfig c = WithMethod(sc.method);
    sc.apply(c);
    ExpectInvalid([&] { c.validate(); }, sc.sink_field, std::to_string(sc.n_sink),
                  {sc.budget_field});
    // The same fields are fine while another method is in use.
    for (const std::string& other : kAllMethods) {
      if (other == sc.method) continue;
      KVCacheConfig o = c;
      o.method = other;
      EXPECT_NO_THROW(o.validate()) << "method " << other;
    }
  }
}

TEST(KVCacheConfigTest, SinksJustBelowBudgetAreValid) {
  KVCacheConfig c;
  c.squeeze_n_sink = 63;
  c.squeeze_budget = 64;
  c.squeeze_resolved_budget = 64;
  EXPECT_NO_THROW(c.validate());
  c.method = "h2o";
  c.h2o_n_sink = 15;
  c.h2o_budget = 16;
  EXPECT_NO_THROW(c.validate());
  c.method = "pyramidkv";
  c.pyramid_n_sink = 7;
  c.pyramid_budget = 8;
  c.pyramid_resolved_budget = 8;
  EXPECT_NO_THROW(c.validate());
  c.method = "tova";
  c.tova_n_sink = 8;
  c.tova_budget = 9;
  EXPECT_NO_THROW(c.validate());
  c.method = "snapkv";
  c.snap_n_sink = 31;
  c.snap_budget = 32;
  EXPECT_NO_THROW(c.validate());
}

TEST(KVCacheConfigTest, UnknownMethodThrowsListingValidMethods) {
  for (const std::string& bad : {std::string("foo"), std::string("H2O"), std::string("squeeze "),
                                 std::string("streamingllm")}) {
    SCOPED_TRACE(bad);
    const KVCacheConfig c = WithMethod(bad);
    ExpectInvalid([&] { c.validate(); }, "method", bad, kAllMethods);
  }
  const KVCacheConfig empty = WithMethod("");
  ExpectInvalid([&] { empty.validate(); }, "method", "", kAllMethods);
}

/// proxy_scoring (docs/design.md 4.7): the SPEC's key-as-query proxy by default; every named
/// scorer is valid for the H2O-core methods, any other name is refused naming the field, the value
/// and the valid names, by those methods only (the others never read it).
TEST(KVCacheConfigTest, ProxyScoringNamesAScorerOfTheH2OCore) {
  EXPECT_EQ(KVCacheConfig{}.proxy_scoring, "key_as_query");
  EXPECT_TRUE((std::is_same_v<decltype(KVCacheConfig{}.proxy_scoring), std::string>));
  for (const std::string& m : kAllMethods) {
    for (const char* scorer : {"key_as_query", "keydiff", "knorm"}) {
      KVCacheConfig c = WithMethod(m);
      c.proxy_scoring = scorer;
      EXPECT_NO_THROW(c.validate()) << m << " " << scorer;
    }
    for (const char* bad : {"", "KeyDiff", "queries", "keydiff "}) {
      KVCacheConfig c = WithMethod(m);
      c.proxy_scoring = bad;
      const bool core = m == "squeeze" || m == "h2o" || m == "pyramidkv";
      if (!core) {
        EXPECT_NO_THROW(c.validate()) << m;
        continue;
      }
      try {
        c.validate();
        ADD_FAILURE() << m << ": '" << bad << "' accepted";
      } catch (const std::invalid_argument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("proxy_scoring '" + std::string(bad) + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find("key_as_query, keydiff, knorm"), std::string::npos) << msg;
      }
    }
  }
}

/// value_norm_power (docs/design.md 4.8): 0 by default (SPEC 4.6: rank by score alone); [0, 4]
/// is valid for the H2O-core methods, anything else (NaN included) refused naming the field and
/// the value, by those methods only.
TEST(KVCacheConfigTest, ValueNormPowerIsBetweenZeroAndFourForTheH2OCore) {
  EXPECT_EQ(KVCacheConfig{}.value_norm_power, 0.0);
  for (const std::string& m : kAllMethods) {
    const bool core = m == "squeeze" || m == "h2o" || m == "pyramidkv";
    for (const double ok : {0.0, 0.5, 2.0, 4.0}) {
      KVCacheConfig c = WithMethod(m);
      c.value_norm_power = ok;
      EXPECT_NO_THROW(c.validate()) << m << " " << ok;
    }
    for (const double bad : {-1e-9, -2.0, 4.0000001, 1e300, std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN()}) {
      KVCacheConfig c = WithMethod(m);
      c.value_norm_power = bad;
      if (!core) {
        EXPECT_NO_THROW(c.validate()) << m;
        continue;
      }
      try {
        c.validate();
        ADD_FAILURE() << m << ": " << bad << " accepted";
      } catch (const std::invalid_argument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("value_norm_power"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[0, 4]"), std::string::npos) << msg;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Cache constructors validate the config as their own method
// ---------------------------------------------------------------------------------------------

TEST(CacheConstructionTest, SqueezeAttentionCacheValidatesAsSqueeze) {
  KVCacheConfig c = WithMethod("h2o");  // another method named in the config
  c.squeeze_n_sink = 32;
  c.squeeze_budget = 32;
  ASSERT_NO_THROW(c.validate());  // fine for h2o
  ExpectInvalid([&] { vc::SqueezeAttentionCache<float> cache(c); }, "squeeze_n_sink", "32",
                {"squeeze_budget"});
  ExpectInvalid([&] { vc::SqueezeAttentionCache<> cache(c); }, "squeeze_n_sink", "32");

  KVCacheConfig r = WithMethod("standard");
  r.squeeze_resolved_budget = 2;
  ExpectInvalid([&] { vc::SqueezeAttentionCache<float> cache(r); }, "squeeze_n_sink", "4",
                {"squeeze_resolved_budget"});

  KVCacheConfig d = WithMethod("pyramidkv");
  d.squeeze_decay = 0.0;
  ExpectInvalid([&] { vc::SqueezeAttentionCache<float> cache(d); }, "squeeze_decay", "0");

  // Another method's sink rule does not concern a squeeze cache.
  KVCacheConfig ok = WithMethod("h2o");
  ok.h2o_n_sink = 600;
  ok.squeeze_budget = 96;
  ok.squeeze_n_sink = 2;
  ASSERT_THROW(ok.validate(), std::invalid_argument);  // bad for h2o, the method named
  const vc::SqueezeAttentionCache<float> cache(ok);
  EXPECT_EQ(cache.layer_budget(), 96);
  EXPECT_EQ(cache.n_sink(), 2);
}

TEST(CacheConstructionTest, H2OCacheValidatesAsH2O) {
  KVCacheConfig c = WithMethod("squeeze");
  c.h2o_n_sink = 16;
  c.h2o_budget = 16;
  ASSERT_NO_THROW(c.validate());
  ExpectInvalid([&] { vc::H2OCache<float> cache(c); }, "h2o_n_sink", "16", {"h2o_budget"});
  ExpectInvalid([&] { vc::H2OCache<> cache(c); }, "h2o_n_sink", "16");

  KVCacheConfig g = WithMethod("pyramidkv");
  g.h2o_grace = -2;
  ExpectInvalid([&] { vc::H2OCache<float> cache(g); }, "h2o_grace", "-2");

  KVCacheConfig ok = WithMethod("h2o");
  ok.squeeze_n_sink = 512;  // squeeze's rule: not this cache's business
  ok.h2o_budget = 40;
  ok.method = "squeeze";
  ASSERT_THROW(ok.validate(), std::invalid_argument);
  const vc::H2OCache<float> cache(ok);
  EXPECT_EQ(cache.layer_budget(), 40);
}

TEST(CacheConstructionTest, PyramidKVCacheValidatesAsPyramidKV) {
  KVCacheConfig c = WithMethod("h2o");
  c.pyramid_n_sink = 10;
  c.pyramid_budget = 10;
  ASSERT_NO_THROW(c.validate());
  ExpectInvalid([&] { vc::PyramidKVCache<float> cache(c); }, "pyramid_n_sink", "10",
                {"pyramid_budget"});
  ExpectInvalid([&] { vc::PyramidKVCache<> cache(c); }, "pyramid_n_sink", "10");

  KVCacheConfig r = WithMethod("squeeze");
  r.pyramid_resolved_budget = 4;
  ExpectInvalid([&] { vc::PyramidKVCache<float> cache(r); }, "pyramid_n_sink", "4",
                {"pyramid_resolved_budget"});

  KVCacheConfig b = WithMethod("standard");
  b.pyramid_beta = 0.5;
  ExpectInvalid([&] { vc::PyramidKVCache<float> cache(b); }, "pyramid_beta", "0.5");

  KVCacheConfig ok = WithMethod("squeeze");
  ok.pyramid_resolved_budget = 77;
  ok.h2o_n_sink = 900;
  ok.method = "h2o";
  ASSERT_THROW(ok.validate(), std::invalid_argument);
  const vc::PyramidKVCache<float> cache(ok);
  EXPECT_EQ(cache.layer_budget(), 77);
}

TEST(CacheConstructionTest, StandardCacheValidatesConfig) {
  // The config of the method it names (the builder gives non-attention layers a standard cache
  // built from the model's config).
  KVCacheConfig c = WithMethod("squeeze");
  c.squeeze_decay = 1.5;
  ExpectInvalid([&] { vc::KVCache<float> cache(c); }, "squeeze_decay", "1.5");
  KVCacheConfig w = WithMethod("streaming_llm");
  w.stream_window_size = 0;
  ExpectInvalid([&] { vc::KVCache<float> cache(w); }, "stream_window_size", "0");
  KVCacheConfig other = WithMethod("squeeze");
  other.h2o_decay = 1.5;  // another method's field
  EXPECT_NO_THROW(vc::KVCache<float>{other});
  const KVCacheConfig u = WithMethod("nonsense");
  ExpectInvalid([&] { vc::KVCache<> cache(u); }, "method", "nonsense", kAllMethods);
  EXPECT_NO_THROW(vc::KVCache<float>{WithMethod("standard")});
}

TEST(CacheConstructionTest, SqueezeAttentionCacheRejectsNegativeLayerId) {
  const KVCacheConfig c;
  ExpectInvalid([&] { vc::SqueezeAttentionCache<float> cache(c, -1); }, "layer_id", "-1");
  auto coord = std::make_shared<vc::SqueezeCoordinator>(2, 512, 4, 1.0);
  ExpectInvalid([&] { vc::SqueezeAttentionCache<float> cache(c, -3, coord); }, "layer_id", "-3");
  EXPECT_TRUE(coord->reports().empty());
  const vc::SqueezeAttentionCache<float> ok(c, 0, coord);
  EXPECT_EQ(ok.layer_id(), std::optional<int>(0));
  EXPECT_EQ(ok.coordinator(), coord);
}

// ---------------------------------------------------------------------------------------------
// SqueezeCoordinator constructor (docs/design.md 2.4)
// ---------------------------------------------------------------------------------------------

TEST(SqueezeCoordinatorConstructionTest, RejectsBadArguments) {
  ExpectInvalid([] { vc::SqueezeCoordinator c(0, 512, 4, 1.0); }, "n_layers", "0");
  ExpectInvalid([] { vc::SqueezeCoordinator c(-2, 512, 4, 1.0); }, "n_layers", "-2");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 4, 4, 1.0); }, "avg_budget", "4");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 2, 4, 1.0); }, "avg_budget", "2");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 0, 0, 1.0); }, "avg_budget", "0");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 100, -1, 1.0); }, "n_sink", "-1");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 100, 4, -0.1); }, "strength", "-0.1");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 100, 4, 1.1); }, "strength", "1.1");
  ExpectInvalid([] { vc::SqueezeCoordinator c(4, 100, 4, kNaN); }, "strength", "nan");
}

TEST(SqueezeCoordinatorConstructionTest, AcceptsBoundaryArguments) {
  const vc::SqueezeCoordinator a(1, 5, 4, 0.0);
  EXPECT_EQ(a.n_layers(), 1);
  EXPECT_EQ(a.avg_budget(), 5);
  EXPECT_EQ(a.n_sink(), 4);
  EXPECT_EQ(a.strength(), 0.0);
  EXPECT_EQ(a.generation(), 0u);
  EXPECT_FALSE(a.is_finalized());
  const vc::SqueezeCoordinator b(32, 1, 0, 1.0);
  EXPECT_EQ(b.n_layers(), 32);
  EXPECT_EQ(b.avg_budget(), 1);
  EXPECT_EQ(b.strength(), 1.0);
  EXPECT_FALSE(b.resolved_budget(0).has_value());
}

// ---------------------------------------------------------------------------------------------
// KVCacheFactory::create (docs/design.md 2.7)
// ---------------------------------------------------------------------------------------------

TEST(KVCacheFactoryTest, SqueezeGivesUncoordinatedSqueezeCache) {
  KVCacheConfig c;
  c.squeeze_budget = 300;
  auto cache = vc::KVCacheFactory::create<float>(c);
  auto* sq = dynamic_cast<vc::SqueezeAttentionCache<float>*>(cache.get());
  ASSERT_NE(sq, nullptr);
  EXPECT_EQ(sq->coordinator(), nullptr);
  EXPECT_EQ(sq->layer_budget(), 300);
  EXPECT_EQ(sq->budget(), std::optional<int>(300));
  EXPECT_EQ(dynamic_cast<vc::H2OCache<float>*>(cache.get()), nullptr);
  EXPECT_EQ(dynamic_cast<vc::PyramidKVCache<float>*>(cache.get()), nullptr);

  c.squeeze_resolved_budget = 200;
  auto resolved = vc::KVCacheFactory::create<float>(c);
  auto* sq2 = dynamic_cast<vc::SqueezeAttentionCache<float>*>(resolved.get());
  ASSERT_NE(sq2, nullptr);
  EXPECT_EQ(sq2->layer_budget(), 200);
  EXPECT_EQ(sq2->coordinator(), nullptr);

  // squeeze_defer without a coordinator: the budget is still known from the start.
  c.squeeze_defer = true;
  auto deferred = vc::KVCacheFactory::create<float>(c);
  auto* sq3 = dynamic_cast<vc::SqueezeAttentionCache<float>*>(deferred.get());
  ASSERT_NE(sq3, nullptr);
  EXPECT_EQ(sq3->budget(), std::optional<int>(200));
}

TEST(KVCacheFactoryTest, DefaultStorageTypeIsHalf) {
  std::unique_ptr<vc::KVCache<Eigen::half>> cache = vc::KVCacheFactory::create(KVCacheConfig{});
  EXPECT_NE(dynamic_cast<vc::SqueezeAttentionCache<Eigen::half>*>(cache.get()), nullptr);
  auto bf = vc::KVCacheFactory::create<Eigen::bfloat16>(WithMethod("h2o"));
  EXPECT_NE(dynamic_cast<vc::H2OCache<Eigen::bfloat16>*>(bf.get()), nullptr);
}

TEST(KVCacheFactoryTest, H2OGivesH2OCache) {
  KVCacheConfig c = WithMethod("h2o");
  c.h2o_budget = 48;
  c.h2o_n_sink = 2;
  auto cache = vc::KVCacheFactory::create<float>(c);
  auto* h = dynamic_cast<vc::H2OCache<float>*>(cache.get());
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->layer_budget(), 48);
  EXPECT_EQ(h->n_sink(), 2);
  EXPECT_EQ(dynamic_cast<vc::SqueezeAttentionCache<float>*>(cache.get()), nullptr);
  EXPECT_EQ(dynamic_cast<vc::PyramidKVCache<float>*>(cache.get()), nullptr);
}

TEST(KVCacheFactoryTest, PyramidKVGivesPyramidCache) {
  KVCacheConfig c = WithMethod("pyramidkv");
  c.pyramid_budget = 128;
  auto cache = vc::KVCacheFactory::create<float>(c);
  auto* p = dynamic_cast<vc::PyramidKVCache<float>*>(cache.get());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->layer_budget(), 128);
  EXPECT_EQ(dynamic_cast<vc::SqueezeAttentionCache<float>*>(cache.get()), nullptr);
  EXPECT_EQ(dynamic_cast<vc::H2OCache<float>*>(cache.get()), nullptr);

  c.pyramid_resolved_budget = 57;
  auto resolved = vc::KVCacheFactory::create<float>(c);
  auto* p2 = dynamic_cast<vc::PyramidKVCache<float>*>(resolved.get());
  ASSERT_NE(p2, nullptr);
  EXPECT_EQ(p2->layer_budget(), 57);
}

TEST(KVCacheFactoryTest, StandardGivesPlainTrimmableCache) {
  auto cache = vc::KVCacheFactory::create<float>(WithMethod("standard"));
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(dynamic_cast<vc::SqueezeAttentionCache<float>*>(cache.get()), nullptr);
  EXPECT_EQ(dynamic_cast<vc::H2OCache<float>*>(cache.get()), nullptr);
  EXPECT_EQ(dynamic_cast<vc::PyramidKVCache<float>*>(cache.get()), nullptr);
  EXPECT_TRUE(cache->is_trimmable());

  std::mt19937 rng(11);
  const auto k = RandomTensor(rng, 1, 2, 6, 4);
  const auto v = RandomTensor(rng, 1, 2, 6, 4);
  cache->update_and_fetch(k, v);
  EXPECT_EQ(cache->offset(), 6);
  EXPECT_EQ(cache->trim(2), 2);
  EXPECT_EQ(cache->offset(), 4);
  EXPECT_EQ(cache->state().first.dimension(2), 4);
}

TEST(KVCacheFactoryTest, UnknownMethodThrowsListingValidMethods) {
  for (const std::string& bad : {std::string("bogus"), std::string("Squeeze"), std::string("")}) {
    SCOPED_TRACE(bad);
    const KVCacheConfig c = WithMethod(bad);
    ExpectInvalid([&] { (void)vc::KVCacheFactory::create<float>(c); }, "method", bad, kAllMethods);
    ExpectInvalid([&] { (void)vc::KVCacheFactory::create(c); }, "method", bad, kAllMethods);
  }
}

TEST(KVCacheFactoryTest, TovaStreamingAndSnapKVGiveTheirClasses) {
  KVCacheConfig t = WithMethod("tova");
  t.tova_budget = 9;
  auto tova = vc::KVCacheFactory::create<float>(t);
  auto* tc = dynamic_cast<vc::TOVACache<float>*>(tova.get());
  ASSERT_NE(tc, nullptr);
  EXPECT_EQ(tc->layer_budget(), 9);
  EXPECT_FALSE(tova->is_trimmable());

  KVCacheConfig st = WithMethod("streaming_llm");
  st.stream_n_sink = 2;
  st.stream_window_size = 7;
  auto stream = vc::KVCacheFactory::create<float>(st);
  auto* sc = dynamic_cast<vc::StreamingLLMCache<float>*>(stream.get());
  ASSERT_NE(sc, nullptr);
  EXPECT_EQ(sc->layer_budget(), 9);
  EXPECT_FALSE(stream->is_trimmable());

  KVCacheConfig sn = WithMethod("snapkv");
  sn.snap_budget = 11;
  auto snap = vc::KVCacheFactory::create<float>(sn);
  auto* nc = dynamic_cast<vc::SnapKVCache<float>*>(snap.get());
  ASSERT_NE(nc, nullptr);
  EXPECT_EQ(nc->layer_budget(), 11);
  EXPECT_FALSE(snap->is_trimmable());
}

TEST(KVCacheFactoryTest, BadConfigThrowsBeforeDispatch) {
  KVCacheConfig c = WithMethod("h2o");
  c.h2o_budget = 0;
  ExpectInvalid([&] { (void)vc::KVCacheFactory::create<float>(c); }, "h2o_budget", "0");
  KVCacheConfig s = WithMethod("squeeze");
  s.squeeze_strength = 2.0;
  ExpectInvalid([&] { (void)vc::KVCacheFactory::create<float>(s); }, "squeeze_strength", "2");
  KVCacheConfig t = WithMethod("standard");
  t.squeeze_strength = 2.0;  // not the standard cache's field
  EXPECT_NO_THROW((void)vc::KVCacheFactory::create<float>(t));
  KVCacheConfig p = WithMethod("pyramidkv");
  p.pyramid_n_sink = 512;
  ExpectInvalid([&] { (void)vc::KVCacheFactory::create<float>(p); }, "pyramid_n_sink", "512",
                {"pyramid_budget"});
}

TEST(KVCacheFactoryTest, EvictionCachesAreNotTrimmable) {
  std::mt19937 rng(12);
  for (const std::string m : {"squeeze", "h2o", "pyramidkv"}) {
    SCOPED_TRACE(m);
    auto cache = vc::KVCacheFactory::create<float>(WithMethod(m));
    EXPECT_FALSE(cache->is_trimmable());
    const auto k = RandomTensor(rng, 1, 2, 6, 4);
    const auto v = RandomTensor(rng, 1, 2, 6, 4);
    cache->update_and_fetch(k, v);
    EXPECT_EQ(cache->trim(3), 0);
    EXPECT_EQ(cache->offset(), 6);
    EXPECT_EQ(cache->tokens_kept(), 6);
    EXPECT_EQ(cache->state().first.dimension(2), 6);
  }
  const KVCacheConfig c;
  EXPECT_FALSE(vc::SqueezeAttentionCache<float>(c).is_trimmable());
  EXPECT_FALSE(vc::H2OCache<float>(c).is_trimmable());
  EXPECT_FALSE(vc::PyramidKVCache<float>(c).is_trimmable());
  EXPECT_TRUE(vc::KVCache<float>(c).is_trimmable());
}

}  // namespace
