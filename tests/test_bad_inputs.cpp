// Bad input at every public entry point, beyond what test_errors.cpp, test_config.cpp,
// test_budgets.cpp, test_squeeze_coordinator.cpp, test_queries.cpp and the per-policy tests
// already cover:
//  * KVCacheConfig::validate at the extremes (INT_MIN / INT_MAX, +-inf, -0, denormals), and caches
//    built from huge but valid values (INT_MAX budgets, windows, grace) behaving without overflow;
//  * non-finite keys at every element of a call, for every policy, through every API (fetch, view,
//    fetch_into, each with and without queries, and the converting double overloads), with the
//    strong guarantee (docs/design.md 8) and a following valid call equal to an untouched twin's;
//  * mismatched shapes and shape changes between calls through the same table of policies/APIs;
//  * coordinator wiring mistakes through caches: a duplicate layer id (docs/design.md 5.4.1: the
//  first
//    report per layer wins), a layer id the coordinator does not know (docs/design.md A(h);
//  * squeeze_budgets / pyramid_budgets / concentration_score edge arguments; trim of a negative or
//    extreme count on every policy; KVView accessors out of range on every policy; the builder
//    with bad layer counts, head dims and methods;
//  * hostile input (docs/robustness.md): magnitudes at and beyond the bounds (finite outputs and
//    scores at them, the element named beyond them), empty calls claiming 2^40 heads, shapes
//    whose products overflow, attend's output sized only from valid shapes, integers at the
//    extremes in set_budget, the coordinator and the builder, a null cache in the builder's
//    reset, and every way an engine's parallel-for can break its contract.
// Built twice (tests/CMakeLists.txt): with the suite (the library's internal assertions on), and
// as test_bad_inputs_ndebug with -DNDEBUG and those assertions compiled out, so that the checks,
// not the assertions, are what the tests see.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
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
#include <thread>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

// ---------------------------------------------------------------------------------------------
// KVCacheConfig at the extremes
// ---------------------------------------------------------------------------------------------

struct ExtremeCase {
  std::string field;
  std::string value;  // as the message prints it ("" when not checked)
  std::function<void(vc::KVCacheConfig&)> apply;
};

std::vector<ExtremeCase> extreme_rejections() {
  std::vector<ExtremeCase> out;
  const auto add_int = [&](const std::string& field, int v,
                           std::function<void(vc::KVCacheConfig&, int)> set) {
    out.push_back({field, std::to_string(v), [set, v](vc::KVCacheConfig& c) { set(c, v); }});
  };
  for (const int v : {INT_MIN, -1000000, -1}) {
    add_int("squeeze_budget", v, [](vc::KVCacheConfig& c, int x) { c.squeeze_budget = x; });
    add_int("h2o_budget", v, [](vc::KVCacheConfig& c, int x) { c.h2o_budget = x; });
    add_int("pyramid_budget", v, [](vc::KVCacheConfig& c, int x) { c.pyramid_budget = x; });
    add_int("tova_budget", v, [](vc::KVCacheConfig& c, int x) { c.tova_budget = x; });
    add_int("snap_budget", v, [](vc::KVCacheConfig& c, int x) { c.snap_budget = x; });
    add_int("squeeze_resolved_budget", v,
            [](vc::KVCacheConfig& c, int x) { c.squeeze_resolved_budget = x; });
    add_int("pyramid_resolved_budget", v,
            [](vc::KVCacheConfig& c, int x) { c.pyramid_resolved_budget = x; });
    add_int("squeeze_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.squeeze_n_sink = x; });
    add_int("h2o_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.h2o_n_sink = x; });
    add_int("pyramid_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.pyramid_n_sink = x; });
    add_int("tova_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.tova_n_sink = x; });
    add_int("stream_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.stream_n_sink = x; });
    add_int("snap_n_sink", v, [](vc::KVCacheConfig& c, int x) { c.snap_n_sink = x; });
    add_int("h2o_grace", v, [](vc::KVCacheConfig& c, int x) { c.h2o_grace = x; });
    add_int("stream_window_size", v, [](vc::KVCacheConfig& c, int x) { c.stream_window_size = x; });
    add_int("snap_obs_window", v, [](vc::KVCacheConfig& c, int x) { c.snap_obs_window = x; });
  }
  const auto add_double = [&](const std::string& field, double v, const std::string& printed,
                              std::function<void(vc::KVCacheConfig&, double)> set) {
    out.push_back({field, printed, [set, v](vc::KVCacheConfig& c) { set(c, v); }});
  };
  // Fractions in [0, 1]: strength and the recent ratios.
  const std::vector<std::pair<double, std::string>> bad_unit = {
      {kInf, "inf"},       {-kInf, "-inf"},    {kDblMax, "e+308"},
      {-kDenorm, "-4.94"}, {1.0 + 1e-15, "1"}, {-kNaN, "nan"}};
  for (const auto& [v, printed] : bad_unit) {
    add_double("squeeze_strength", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.squeeze_strength = x; });
    add_double("squeeze_recent_ratio", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.squeeze_recent_ratio = x; });
    add_double("pyramid_recent_ratio", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.pyramid_recent_ratio = x; });
  }
  // Decays in (0, 1].
  const std::vector<std::pair<double, std::string>> bad_decay = {
      {kInf, "inf"}, {-kInf, "-inf"}, {-0.0, "0"}, {-kDenorm, "-4.94"}, {kDblMax, "e+308"}};
  for (const auto& [v, printed] : bad_decay) {
    add_double("squeeze_decay", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.squeeze_decay = x; });
    add_double("h2o_decay", v, printed, [](vc::KVCacheConfig& c, double x) { c.h2o_decay = x; });
    add_double("pyramid_decay", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.pyramid_decay = x; });
  }
  // pyramid_beta: >= 1 and finite.
  for (const auto& [v, printed] : std::vector<std::pair<double, std::string>>{
           {kInf, "inf"}, {-kInf, "-inf"}, {-kDblMax, "e+308"}, {1.0 - 1e-15, "1"}}) {
    add_double("pyramid_beta", v, printed,
               [](vc::KVCacheConfig& c, double x) { c.pyramid_beta = x; });
  }
  return out;
}

/// Every method's name, in the table's order (support/methods.hpp).
std::vector<std::string> method_names() {
  std::vector<std::string> out;
  for (const Method m : kMethods) out.emplace_back(method_name(m));
  return out;
}
const std::vector<std::string> kMethodNames = method_names();

/// The method whose fields `field` belongs to, by its prefix.
std::string method_of_field(const std::string& field) {
  for (const MethodEntry& e : kMethodEntries) {
    if (*e.prefix != '\0' && field.rfind(e.prefix, 0) == 0) return method_name(e.id);
  }
  return "";
}

/// Every extreme value is rejected by validate(), the factory and the builder, with
/// std::invalid_argument naming the field and its value, when the field is the method's own
/// (docs/design.md 2.1: validate() checks the method in use only; the other methods accept it).
TEST(BadInputConfigTest, ExtremeValuesThrowNamingTheField) {
  for (const ExtremeCase& ec : extreme_rejections()) {
    for (const std::string& m : kMethodNames) {
      SCOPED_TRACE(m + ": " + ec.field + " = " + ec.value);
      vc::KVCacheConfig c;
      c.method = m;
      ec.apply(c);
      if (method_of_field(ec.field) != m) {
        EXPECT_NO_THROW(c.validate());
        continue;
      }
      for (const auto& f : std::vector<std::function<void()>>{
               [&] { c.validate(); }, [&] { (void)vc::KVCacheFactory::create<float>(c); },
               [&] { (void)vc::KVCacheBuilder::for_model<float>(3, c); },
               [&] {
                 (void)vc::KVCacheBuilder::for_model<Eigen::half>({8, std::nullopt}, c);
               }}) {
        const std::string what = invalid_argument_message(f);
        const std::size_t at = what.find(ec.field);
        ASSERT_NE(at, std::string::npos) << what;
        EXPECT_NE(what.find(ec.value, at), std::string::npos) << "value missing: " << what;
      }
    }
  }
}

/// Runs the same calls on `cache` and on a standard cache: with a budget larger than everything
/// it sees, an eviction cache keeps and returns exactly what the standard cache does.
template <class T>
void behaves_like_standard(vc::KVCache<T>& cache, const std::string& ctx) {
  cache.set_parallel_heads(false);
  vc::KVCache<T> standard;
  std::mt19937 rng(8u);
  for (const Index S : {Index{7}, Index{1}, Index{3}, Index{1}, Index{1}}) {
    const Call c = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
    vc::KVPair<T> a_out, b_out;
    const Returned a = invoke(cache, Api::kFetch, c, a_out);
    const Returned b = invoke(standard, Api::kFetch, c, b_out);
    EXPECT_TRUE(a == b) << ctx << " S=" << S;
    EXPECT_TRUE(bitwise_equal(cache.state().first, standard.state().first)) << ctx;
    EXPECT_EQ(cache.offset(), standard.offset()) << ctx;
    EXPECT_EQ(cache.kept_bytes(), standard.kept_bytes()) << ctx;
    EXPECT_EQ(cache.full_seq_bytes(), standard.full_seq_bytes()) << ctx;
    EXPECT_EQ(cache.compression_ratio(), 1.0) << ctx;
  }
  EXPECT_EQ(cache.tokens_kept(), 13) << ctx;
}

/// docs/design.md 2.1 sets no upper bound: INT_MAX budgets, windows, grace and sinks just below them are
/// valid, and such caches behave (no overflow) like the standard cache. The one exception: a
/// StreamingLLM head holds stream_n_sink + stream_window_size rows, which must fit in an int.
TEST(BadInputConfigTest, IntMaxBudgetsAreValidAndBehaveLikeTheStandardCache) {
  const int big = INT_MAX;
  vc::KVCacheConfig c;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  c.set_budget(big);
  c.squeeze_resolved_budget = big;
  c.pyramid_resolved_budget = big;
  c.stream_window_size = big;
  {
    c.method = "streaming_llm";
    const std::string what = invalid_argument_message([&] { c.validate(); });
    EXPECT_TRUE(contains(what, "stream_window_size")) << what;
  }
  c.stream_window_size = big - c.stream_n_sink;
  c.snap_obs_window = big;
  c.h2o_grace = big;
  for (const std::string& m : kMethodNames) {
    c.method = m;
    EXPECT_NO_THROW(c.validate()) << m;
  }
  using T = float;
  behaves_like_standard(*vc::KVCacheFactory::create<T>([&] {
    auto x = c;
    x.method = "squeeze";
    return x;
  }()),
                        "squeeze");
  for (const Method m : kMethods) {
    if (m == Method::squeeze || m == Method::standard) continue;
    behaves_like_standard(*vc::KVCacheFactory::create<T>(vc::detail::with_method(c, m)),
                          method_name(m));
  }
  // Sinks just below an INT_MAX budget: every row is a sink (StreamingLLM's sit beside its
  // window, not within a budget).
  vc::KVCacheConfig sinks = c;
  set_n_sinks(sinks, big - 1);
  for (const Method m : kMethods) {
    if (m == Method::streaming_llm || m == Method::standard) continue;
    behaves_like_standard(*vc::KVCacheFactory::create<T>(vc::detail::with_method(sinks, m)),
                          std::string(method_name(m)) + " with INT_MAX - 1 sinks");
  }
  // The H2O core's protected window is clamped to budget - n_sink - 1 without overflow.
  vc::H2OCache<T> h2o([&] {
    auto x = c;
    x.method = "h2o";
    return x;
  }());
  EXPECT_EQ(h2o.protected_recent(), big - 4 - 1);
  vc::PyramidKVCache<T> pyr([&] {
    auto x = c;
    x.pyramid_recent_ratio = 1.0;
    return x;
  }());
  EXPECT_EQ(pyr.protected_recent(), big - 4 - 1);
  EXPECT_EQ(pyr.layer_budget(), big);
}

/// The builder with INT_MAX average budgets: the coordinator's and the pyramid's budgets stay in
/// [n_sink + 1, INT_MAX] (no overflow) and are what squeeze_budgets / pyramid_budgets give.
TEST(BadInputConfigTest, BuilderWithIntMaxAverageBudgets) {
  using T = float;
  vc::KVCacheConfig c;
  c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  c.squeeze_budget = INT_MAX;
  auto caches = vc::KVCacheBuilder::for_model<T>(3, c);
  std::mt19937 rng(3u);
  std::vector<double> conc;
  for (std::size_t l = 0; l < caches.size(); ++l) {
    caches[l]->set_parallel_heads(false);
    vc::Tensor4<double> k = random_doubles(rng, kKeys);
    for (Index i = 0; i < k.size(); i += kKeys[3]) k.data()[i] += 2.0 * static_cast<double>(l);
    (void)caches[l]->update_and_fetch(k, random_doubles(rng, kValues));
    conc.push_back(dynamic_cast<vc::SqueezeAttentionCache<T>&>(*caches[l]).concentration());
  }
  const std::vector<int> want = vc::squeeze_budgets(conc, INT_MAX, 4, 1.0);
  for (std::size_t l = 0; l < caches.size(); ++l) {
    (void)caches[l]->update_and_fetch(random_doubles(rng, with_s(kKeys, 1)),
                                      random_doubles(rng, with_s(kValues, 1)));
    const auto& sq = dynamic_cast<vc::SqueezeAttentionCache<T>&>(*caches[l]);
    EXPECT_TRUE(sq.budget_adopted());
    EXPECT_EQ(sq.layer_budget(), want[l]);
    EXPECT_GE(sq.layer_budget(), 5);
    EXPECT_EQ(sq.tokens_kept(), 4);
  }
  c.method = "pyramidkv";
  c.pyramid_budget = INT_MAX;
  const std::vector<int> pyr = vc::pyramid_budgets(4, INT_MAX, 4, 2.0);
  auto pcaches = vc::KVCacheBuilder::for_model<T>(4, c);
  for (std::size_t l = 0; l < pcaches.size(); ++l) {
    const auto& p = dynamic_cast<vc::PyramidKVCache<T>&>(*pcaches[l]);
    EXPECT_EQ(p.layer_budget(), pyr[l]);
    EXPECT_GE(p.layer_budget(), 5);
  }
  EXPECT_EQ(pyr.front(), INT_MAX);
  EXPECT_EQ(pyr.back(), 5);
}

/// A decay that is valid as a double but rounds to 0 in float32 (the scores' precision) is
/// rejected, naming the field; the smallest decays that survive float32 are accepted, the caches
/// still run, scores stay finite and budgets hold.
TEST(BadInputConfigTest, DenormalDecaysAreAcceptedAndKeepScoresFinite) {
  for (const double decay : {1e-300, 1e-50}) {
    vc::KVCacheConfig c = small_config();
    c.method = "h2o";
    c.h2o_decay = decay;
    const std::string what = invalid_argument_message([&] { c.validate(); });
    EXPECT_TRUE(contains(what, "h2o_decay")) << decay << ": " << what;
  }
  for (const double decay : {static_cast<double>(std::numeric_limits<float>::denorm_min()), 1e-40,
                             1e-30}) {
    vc::KVCacheConfig c = small_config();
    c.squeeze_decay = c.h2o_decay = c.pyramid_decay = decay;
    for (const Kind kind : {Method::squeeze, Method::h2o, Method::pyramidkv}) {
      SCOPED_TRACE(std::string(kind_name(kind)) + " decay " + std::to_string(decay));
      ASSERT_NO_THROW(c.validate());
      Subject<float> s = make_subject<float>(kind, c);
      std::mt19937 rng(4u);
      vc::KVPair<float> into;
      for (const Index S : {Index{9}, Index{1}, Index{1}, Index{4}, Index{1}}) {
        (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, S), with_s(kValues, S)),
                     into);
      }
      EXPECT_EQ(s.cache->tokens_kept(), 6);
      const bool is_core = visit_core(*s.cache, [](const auto& core) {
        for (Index b = 0; b < 2; ++b) {
          for (Index h = 0; h < 2; ++h) {
            for (const float x : core.scores(b, h)) EXPECT_TRUE(std::isfinite(x) && x >= 0.0f) << x;
          }
        }
      });
      EXPECT_TRUE(is_core);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Magnitudes (docs/robustness.md, "Magnitudes"): keys and queries within +-2^48, values within
// +-2^96, head dims up to 2^16; finite input within them gives finite scores and outputs
// ---------------------------------------------------------------------------------------------

constexpr double kKeyLimit = 281474976710656.0;                  // 2^48
constexpr double kValueLimit = 79228162514264337593543950336.0;  // 2^96

/// Every element of `t` set to +-m with a random sign.
template <class X>
void fill_signed(std::mt19937& rng, vc::Tensor4<X>& t, double m) {
  std::bernoulli_distribution coin(0.5);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<X>(coin(rng) ? m : -m);
}

/// Keys and queries at exactly +-2^48 and values at +-2^96 (the largest a call may hold), float
/// and bfloat16 storage, every policy, through attend and update_and_view: every output and every
/// score is finite, and every policy keeps its contract (each call returns the rows retained
/// before it plus its own, bounded heads within budget, sinks and positions in order).
template <class T>
void extremes_at_the_limit_stay_finite() {
  vc::KVCacheConfig config = small_config();
  config.key_bits = config.value_bits = 16;
  for (const Kind kind : kKinds) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> s = make_subject<T>(kind, config);
    std::mt19937 rng(6u);
    std::int64_t offset = 0;
    int call = 0;
    for (const Index S : {Index{9}, Index{1}, Index{1}, Index{3}, Index{1}, Index{1}, Index{2}}) {
      vc::Tensor4<double> k(2, 2, S, 8), v(2, 2, S, 8), q(2, 4, S, 8);
      fill_signed(rng, k, kKeyLimit);
      fill_signed(rng, v, kValueLimit);
      fill_signed(rng, q, kKeyLimit);
      const Index before = s.cache->tokens_kept();
      if (call++ % 3 == 2) {  // without queries: the proxy and the query-free scorers
        const vc::KVView<T> view = s.cache->update_and_view(k, v);
        ASSERT_EQ(view.rows(), before + S);
      } else if (call % 3 == 1) {
        std::vector<float> out(static_cast<std::size_t>(2 * 4 * S * 8));
        ASSERT_NO_THROW(s.cache->attend(vc::TensorRef<double>(q), vc::TensorRef<double>(k),
                                        vc::TensorRef<double>(v), out.data()));
        for (const float x : out) ASSERT_TRUE(std::isfinite(x)) << x;
      } else {
        const vc::KVView<T> view = s.cache->update_and_view(k, v, q);
        ASSERT_EQ(view.rows(), before + S);
      }
      offset += S;
      ASSERT_EQ(s.cache->offset(), offset);
      visit_scored(*s.cache, [&](const auto& scored) {
        for (Index b = 0; b < 2; ++b) {
          for (Index h = 0; h < 2; ++h) {
            for (const float x : scored.scores(b, h)) ASSERT_TRUE(std::isfinite(x)) << x;
            const std::vector<std::int64_t> p = scored.positions(b, h);
            ASSERT_FALSE(p.empty());
            EXPECT_EQ(p.front(), 0) << "the sink was evicted";
            EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
          }
        }
      });
    }
    if (!keeps_every_row(kind.method) && kind != Method::snapkv) {
      EXPECT_LE(s.cache->tokens_kept(), 8);
    }
  }
}

TEST(BadInputMagnitudesTest, AtTheLimitScoresAndOutputsStayFiniteFloat) {
  extremes_at_the_limit_stay_finite<float>();
}

TEST(BadInputMagnitudesTest, AtTheLimitScoresAndOutputsStayFiniteBfloat16) {
  extremes_at_the_limit_stay_finite<Eigen::bfloat16>();
}

/// One element beyond the limit (or a finite one that overflows the storage type) is refused
/// through update_and_view and attend, naming the tensor and the element; nothing changes.
TEST(BadInputMagnitudesTest, BeyondTheLimitIsRefusedNamingTheElement) {
  struct Case {
    const char* what;   // the tensor
    double x;           // the element put at [b=1, h=1, s=2, d=5]
    bool half;          // half storage (else float)
    const char* words;  // expected in the message
  };
  const double above_key = kKeyLimit * (1.0 + 0x1p-20);  // a float above 2^48
  const Case cases[] = {
      {"keys", above_key, false, "key at [b=1, h=1, s=2, d=5]"},
      {"keys", -3e38, false, "beyond +-2^48"},
      {"queries", -above_key, false, "query at [b=1, hq=1, s=2, d=5]"},
      {"queries", 3e38, true, "beyond +-2^48"},
      {"values", kValueLimit * (1.0 + 0x1p-20), false, "value at [b=1, h=1, s=2, d=5]"},
      {"values", -3e38, false, "beyond +-2^96"},
      {"values", 1e5, true, "value at [b=1, h=1, s=2, d=5] is finite but overflows the storage"},
  };
  for (const Case& c : cases) {
    for (const bool attend : {false, true}) {
      SCOPED_TRACE(std::string(c.what) + " " + std::to_string(c.x) + (attend ? ", attend" : ""));
      vc::KVCacheConfig config;
      config.method = "h2o";
      config.h2o_budget = 8;
      std::unique_ptr<vc::KVCache<float>> f;
      std::unique_ptr<vc::KVCache<Eigen::half>> h;
      std::mt19937 rng(3);
      vc::Tensor4<double> k = random_doubles(rng, {2, 2, 6, 8});
      vc::Tensor4<double> v = random_doubles(rng, {2, 2, 6, 8});
      vc::Tensor4<double> q = random_doubles(rng, {2, 4, 6, 8});
      const auto run = [&](auto& cache) {
        (void)cache.update_and_view(k, v, q);  // a valid first call
        const Snapshot before = snapshot(cache, nullptr);
        (c.what[0] == 'k' ? k : c.what[0] == 'v' ? v : q)(1, 1, 2, 5) = c.x;
        std::vector<float> out(static_cast<std::size_t>(q.size()), -1.0f);
        const std::string message = invalid_argument_message([&] {
          if (attend) {
            cache.attend(vc::TensorRef<double>(q), vc::TensorRef<double>(k),
                         vc::TensorRef<double>(v), out.data());
          } else {
            (void)cache.update_and_view(k, v, q);
          }
        });
        EXPECT_TRUE(contains(message, c.words)) << message;
        EXPECT_TRUE(snapshot(cache, nullptr) == before) << "the cache changed";
        for (const float x : out) ASSERT_EQ(x, -1.0f) << "attend wrote its output";
      };
      if (c.half) {
        vc::H2OCache<Eigen::half> cache(config);
        run(cache);
      } else {
        vc::H2OCache<float> cache(config);
        run(cache);
      }
    }
  }
}

/// Values that are not finite as given are stored as given (docs/design.md 8); the limit is for
/// finite ones.
TEST(BadInputMagnitudesTest, NonFiniteValuesAreStillStoredAsGiven) {
  vc::KVCacheConfig config;
  config.method = "h2o";
  config.h2o_budget = 8;
  vc::H2OCache<float> cache(config);
  std::mt19937 rng(8);
  vc::Tensor4<double> k = random_doubles(rng, {1, 1, 3, 4});
  vc::Tensor4<double> v = random_doubles(rng, {1, 1, 3, 4});
  v(0, 0, 0, 1) = std::numeric_limits<double>::infinity();
  v(0, 0, 1, 2) = std::numeric_limits<double>::quiet_NaN();
  const vc::KVPair<float> out = cache.update_and_fetch(k, v);
  EXPECT_TRUE(std::isinf(out.second(0, 0, 0, 1)));
  EXPECT_TRUE(std::isnan(out.second(0, 0, 1, 2)));
}

/// A head dim above 2^16 is refused by the call and by the builder.
TEST(BadInputMagnitudesTest, HeadDimsAbove65536AreRefused) {
  vc::KVCache<float> cache;
  const std::vector<float> row(65537, 0.5f);
  const vc::TensorRef<float> wide(row.data(), 1, 1, 1, 65537);
  const vc::TensorRef<float> ok(row.data(), 1, 1, 1, 65536);
  EXPECT_TRUE(contains(invalid_argument_message([&] { (void)cache.update_and_view(wide, ok); }),
                       "head dim D must be <= 65536"));
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_NO_THROW((void)cache.update_and_view(ok, ok));
  const std::string what = invalid_argument_message([&] {
    (void)vc::KVCacheBuilder::for_model<float>({64, 65537}, vc::KVCacheConfig{});
  });
  EXPECT_TRUE(contains(what, "head dim of layer 1 (65537) must be in [1, 65536]")) << what;
}

// ---------------------------------------------------------------------------------------------
// Claimed sizes: work and memory follow the data, not what the shapes claim
// ---------------------------------------------------------------------------------------------

/// Empty calls (S = 0, no data) claiming 2^40 heads, and queries claiming 2^50 heads, through
/// every pointer overload: each returns at once (or refuses), nothing changes. Before the fix,
/// these looped over the claimed heads (hours).
TEST(BadInputClaimsTest, EmptyCallsWithHugeClaimedSizesReturnAtOnce) {
  for (const bool fresh : {true, false}) {
    SCOPED_TRACE(fresh ? "first call" : "after a call");
    vc::KVCacheConfig config;
    config.method = "h2o";
    config.h2o_budget = 8;
    vc::H2OCache<Eigen::half> cache(config);
    const std::vector<float> one(8, 0.25f);
    if (!fresh) {
      const vc::TensorRef<float> r(one.data(), 1, 1, 1, 8);
      (void)cache.update_and_view(r, r);
    }
    const std::int64_t offset = cache.offset();
    const Index big = Index{1} << 20;
    const vc::TensorRef<float> k(nullptr, fresh ? big : 1, fresh ? big : 1, 0, 8);
    const vc::TensorRef<float> q(nullptr, 1, Index{1} << 50, 0, 8);
    const vc::TensorRef<double> kd(nullptr, fresh ? big : 1, fresh ? big : 1, 0, 8);
    vc::KVPair<Eigen::half> into;
    float out = 0.0f;
    const auto quick = [&](const char* api, const std::function<void()>& f) {
      SCOPED_TRACE(api);
      try {
        f();
      } catch (const std::invalid_argument&) {
      }
      EXPECT_EQ(cache.offset(), offset);
    };
    quick("update_and_view", [&] { (void)cache.update_and_view(k, k); });
    quick("update_and_view(double)", [&] { (void)cache.update_and_view(kd, kd); });
    quick("update_and_fetch", [&] { (void)cache.update_and_fetch(k, k); });
    quick("update_and_fetch_into", [&] { cache.update_and_fetch_into(k, k, into); });
    if (!fresh) {
      const vc::TensorRef<float> k0(nullptr, 1, 1, 0, 8);
      quick("update_and_view(queries)", [&] { (void)cache.update_and_view(k0, k0, q); });
      quick("update_and_fetch(queries)", [&] { (void)cache.update_and_fetch(k0, k0, q); });
      quick("attend", [&] { cache.attend(q, k0, k0, &out); });
      quick("attend(token_major)", [&] { cache.attend(q, k0, k0, &out, vc::Layout::token_major); });
    }
  }
}

/// Dimensions whose product overflows are refused even when another dimension is 0 (the strides
/// multiply them), and attend refuses an output [B, Hq, S, Dv] that no Index can count before it
/// computes strides or sizes anything from it.
TEST(BadInputClaimsTest, OverflowingShapesAreRefusedBeforeAnythingIsSized) {
  vc::KVCache<float> cache;
  const Index huge = Index{1} << 62;
  const vc::TensorRef<float> k(nullptr, 0, huge, huge, huge);
  EXPECT_TRUE(contains(invalid_argument_message([&] { (void)cache.update_and_view(k, k); }),
                       "keys has too many elements"));
  // One row of D = 1 claims 2^50 query heads and a value dim of 2^16: the output would hold
  // 2^66 elements. Refused before a stride is computed or an element read (the data is one
  // float; reading the claimed rows would be a heap overflow under ASan).
  float one = 0.5f, out = 0.0f;
  const vc::TensorRef<float> q(&one, 1, Index{1} << 50, 1, 1);
  const vc::TensorRef<float> k1(&one, 1, 1, 1, 1);
  const vc::TensorRef<float> v1(&one, 1, 1, 1, Index{1} << 16);
  for (const vc::Layout layout : {vc::Layout::head_major, vc::Layout::token_major}) {
    const std::string what =
        invalid_argument_message([&] { cache.attend(q, k1, v1, &out, layout); });
    EXPECT_TRUE(contains(what,
                         "the output [B, Hq, S, Dv] = [1, 1125899906842624, 1, 65536] has more "
                         "elements than an Index holds"))
        << what;
  }
  // An empty output still has strides: with B = 0 (head-major) or S = 0 (token-major) the
  // non-zero dims' product must fit too (Hq * S * Dv, or Hq * Dv, would overflow).
  const Index p20 = Index{1} << 20, p30 = Index{1} << 30, p40 = Index{1} << 40;
  const vc::TensorRef<float> qb(nullptr, 0, p20, p20, 1), kb(nullptr, 0, 1, p20, 1),
      vb(nullptr, 0, 1, p20, p30);
  const vc::TensorRef<float> qs(nullptr, 1, p40, 0, 1), ks(nullptr, 1, 1, 0, 1),
      vs(nullptr, 1, 1, 0, p30);
  EXPECT_TRUE(contains(invalid_argument_message([&] { cache.attend(qb, kb, vb, &out); }),
                       "has more elements than an Index holds"));
  EXPECT_TRUE(contains(
      invalid_argument_message([&] { cache.attend(qs, ks, vs, &out, vc::Layout::token_major); }),
      "has more elements than an Index holds"));
  EXPECT_EQ(cache.offset(), 0);
}

/// The attend overload that returns its output sizes it only from shapes that passed: queries of
/// 2^40 rows over keys of none used to allocate [1, 2^20, 2^20, 64] floats first.
TEST(BadInputClaimsTest, AttendSizesItsOutputOnlyFromValidShapes) {
  vc::KVCache<float> cache;
  const vc::Tensor4<float> q(1, Index{1} << 20, Index{1} << 20, 0);
  const vc::Tensor4<float> k(1, 1, 0, 8);
  const vc::Tensor4<float> v(1, 1, 0, 64);
  const std::string what = invalid_argument_message([&] { (void)cache.attend(q, k, v); });
  EXPECT_TRUE(contains(what, "queries must have the keys' sequence length S")) << what;
}

// ---------------------------------------------------------------------------------------------
// Integers at the extremes outside validate(): set_budget, the coordinator, the builder
// ---------------------------------------------------------------------------------------------

TEST(BadInputIntegersTest, SetBudgetAtTheExtremesThenValidateNamesTheField) {
  for (const int rows : {INT_MIN, INT_MIN + 1, -1, 0, INT_MAX}) {
    for (const int sink : {INT_MIN, -1, 0, 4, INT_MAX}) {
      vc::KVCacheConfig c;
      c.method = "streaming_llm";
      c.stream_n_sink = sink;
      c.set_budget(rows);  // no overflow (UBSan): saturated
      const long long window = static_cast<long long>(rows) - sink;
      const long long expect = std::clamp<long long>(window, INT_MIN, INT_MAX);
      EXPECT_EQ(c.stream_window_size, expect) << rows << " " << sink;
      if (sink < 0 || expect < 1 || sink + expect > INT_MAX) {
        EXPECT_THROW(c.validate(), std::invalid_argument) << rows << " " << sink;
      } else {
        EXPECT_NO_THROW(c.validate()) << rows << " " << sink;
      }
    }
  }
}

TEST(BadInputIntegersTest, CoordinatorAndBuilderAtTheExtremes) {
  const std::string what =
      invalid_argument_message([] { (void)vc::SqueezeCoordinator(1, 5, INT_MAX, 1.0); });
  EXPECT_TRUE(contains(what, "must be >= n_sink + 1 (2147483648)")) << what;
  EXPECT_NO_THROW((void)vc::SqueezeCoordinator(1, INT_MAX, INT_MAX - 1, 1.0));
  // A bad configuration is named before anything is sized from the layer count.
  vc::KVCacheConfig bad;
  bad.method = "bogus";
  const std::string b =
      invalid_argument_message([&] { (void)vc::KVCacheBuilder::for_model<float>(INT_MAX, bad); });
  EXPECT_TRUE(contains(b, "bogus")) << b;
}

/// A null entry in a model's caches is refused by KVCacheBuilder::reset before anything is reset.
TEST(BadInputIntegersTest, BuilderResetRefusesANullEntryAndResetsNothing) {
  vc::KVCacheConfig c;
  c.method = "squeeze";
  c.squeeze_calibration_tokens = 1;
  auto caches = vc::KVCacheBuilder::for_model<float>(3, c);
  std::mt19937 rng(2);
  const vc::Tensor4<float> k = random_float_tensor(1, 2, 5, 8, rng);
  for (auto& cache : caches) (void)cache->update_and_view(k, k);
  caches[1].reset();
  const std::string what = invalid_argument_message([&] { vc::KVCacheBuilder::reset(caches); });
  EXPECT_TRUE(contains(what, "cache 1 is null")) << what;
  EXPECT_EQ(caches[0]->offset(), 5);
  EXPECT_EQ(caches[2]->offset(), 5);
}

/// concentration_score of double rows whose squares overflow double is the score of the same rows
/// scaled down (cosines do not depend on the scale), not NaN.
TEST(BadInputIntegersTest, ConcentrationOfHugeDoubleRowsIsFinite) {
  Eigen::MatrixXd m(3, 2);
  m << 1e200, 1e200, 2e200, 2e200, 1e200, -1e200;
  Eigen::MatrixXd small = m / 1e200;
  const double got = vc::concentration_score(m);
  ASSERT_TRUE(std::isfinite(got));
  EXPECT_NEAR(got, vc::concentration_score(small), 1e-7);  // the 1e-8 of u = k / (|k| + 1e-8)
}

// ---------------------------------------------------------------------------------------------
// The coordinator wired wrongly through caches (docs/design.md 5.4, docs/design.md 8, docs/design.md A(h)
// ---------------------------------------------------------------------------------------------

/// Keys whose concentration rises with `alpha` (alpha * e_0 + N(0, 1)). [B, H, S, D]
vc::Tensor4<double> keys_with_alpha(std::mt19937& rng, Shape sh, double alpha) {
  vc::Tensor4<double> k = random_doubles(rng, sh);
  for (Index i = 0; i < k.size(); i += sh[3]) k.data()[i] += alpha;
  return k;
}

/// Two caches built with the same layer id: the first one's report wins (docs/design.md 5.4.1), the second
/// is ignored, the coordinator waits for a second distinct layer, and once it comes both caches
/// adopt the budget computed from the first report.
TEST(BadInputCoordinatorTest, DuplicateLayerIdOnTwoCachesFirstReportWins) {
  using T = float;
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "no defer");
    vc::KVCacheConfig c = small_config();
    c.squeeze_budget = 12;
    c.squeeze_defer = defer;
    auto coord = std::make_shared<vc::SqueezeCoordinator>(2, 10, 1, 1.0);
    vc::SqueezeAttentionCache<T> first(c, 0, coord), duplicate(c, 0, coord), other(c, 1, coord);
    for (auto* x : {&first, &duplicate, &other}) x->set_parallel_heads(false);
    std::mt19937 rng(9u);
    const Shape k16{1, 2, 16, 4}, v16{1, 2, 16, 4};
    (void)first.update_and_fetch(keys_with_alpha(rng, k16, 4.0), random_doubles(rng, v16));
    (void)duplicate.update_and_fetch(keys_with_alpha(rng, k16, 0.0), random_doubles(rng, v16));
    ASSERT_NE(first.concentration(), duplicate.concentration());
    EXPECT_EQ(coord->reports(), (std::map<int, double>{{0, first.concentration()}}));
    EXPECT_FALSE(coord->is_finalized());
    EXPECT_FALSE(duplicate.budget_adopted());
    EXPECT_EQ(duplicate.layer_budget(), 12);
    EXPECT_EQ(duplicate.tokens_kept(), defer ? 16 : 12);
    // A second call before finalisation: a deferring cache falls back (docs/design.md 5.4.4).
    (void)duplicate.update_and_fetch(random_doubles(rng, {1, 2, 1, 4}),
                                     random_doubles(rng, {1, 2, 1, 4}));
    EXPECT_EQ(duplicate.tokens_kept(), 12);

    (void)other.update_and_fetch(keys_with_alpha(rng, k16, 1.0), random_doubles(rng, v16));
    ASSERT_TRUE(coord->is_finalized());
    const std::vector<int> want =
        vc::squeeze_budgets({first.concentration(), other.concentration()}, 10, 1, 1.0);
    const std::vector<int> had_duplicate_won =
        vc::squeeze_budgets({duplicate.concentration(), other.concentration()}, 10, 1, 1.0);
    ASSERT_NE(want, had_duplicate_won);
    for (auto* x : {&first, &duplicate}) {
      const std::int64_t kept_before = x->tokens_kept();
      (void)x->update_and_fetch(random_doubles(rng, {1, 2, 1, 4}),
                                random_doubles(rng, {1, 2, 1, 4}));
      EXPECT_TRUE(x->budget_adopted());
      EXPECT_EQ(x->layer_budget(), want[0]);
      EXPECT_EQ(x->tokens_kept(), std::min<std::int64_t>(want[0], kept_before + 1));
    }
    EXPECT_EQ(other.layer_budget(), want[1]);
    EXPECT_EQ(coord->reports().size(), 2u);
  }
}

/// A cache whose layer id the coordinator does not know, reporting after finalisation: its report
/// is ignored (docs/design.md A(h), it never adopts and runs on its fallback budget; the
/// coordinator is unchanged. Before finalisation such an id counts as a layer of its own.
TEST(BadInputCoordinatorTest, UnknownLayerIdAfterFinalisationRunsOnTheFallbackBudget) {
  using T = float;
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "no defer");
    vc::KVCacheConfig c = small_config();
    c.squeeze_budget = 7;
    c.squeeze_defer = defer;
    auto coord = std::make_shared<vc::SqueezeCoordinator>(1, 10, 1, 1.0);
    vc::SqueezeAttentionCache<T> known(c, 0, coord), unknown(c, 1, coord), far(c, INT_MAX, coord);
    std::mt19937 rng(10u);
    const Shape k12{1, 2, 12, 4};
    (void)known.update_and_fetch(random_doubles(rng, k12), random_doubles(rng, k12));
    ASSERT_TRUE(coord->is_finalized());
    const auto reports = coord->reports();
    for (auto* x : {&unknown, &far}) {
      x->set_parallel_heads(false);
      (void)x->update_and_fetch(random_doubles(rng, k12), random_doubles(rng, k12));
      EXPECT_EQ(x->tokens_kept(), defer ? 12 : 7);
      for (int i = 0; i < 3; ++i) {
        (void)x->update_and_fetch(random_doubles(rng, {1, 2, 1, 4}),
                                  random_doubles(rng, {1, 2, 1, 4}));
      }
      EXPECT_FALSE(x->budget_adopted());
      EXPECT_EQ(x->layer_budget(), 7);
      EXPECT_EQ(x->budget(), std::optional<int>(7));
      EXPECT_EQ(x->tokens_kept(), 7);
      EXPECT_EQ(x->offset(), 15);
    }
    EXPECT_EQ(coord->reports(), reports);
    EXPECT_FALSE(coord->resolved_budget(1).has_value());
    EXPECT_FALSE(coord->resolved_budget(INT_MAX).has_value());
    EXPECT_EQ(coord->resolved_budget(0), std::optional<int>(10));

    // Before finalisation an id >= n_layers is a distinct layer (docs/design.md 5.4.2 counts distinct ids).
    auto coord2 = std::make_shared<vc::SqueezeCoordinator>(2, 10, 1, 1.0);
    vc::SqueezeAttentionCache<T> a(c, 0, coord2), b(c, INT_MAX, coord2);
    (void)a.update_and_fetch(keys_with_alpha(rng, k12, 3.0), random_doubles(rng, k12));
    (void)b.update_and_fetch(keys_with_alpha(rng, k12, 0.0), random_doubles(rng, k12));
    ASSERT_TRUE(coord2->is_finalized());
    const std::vector<int> want =
        vc::squeeze_budgets({a.concentration(), b.concentration()}, 10, 1, 1.0);
    EXPECT_TRUE(b.budget_adopted());
    EXPECT_EQ(b.layer_budget(), want[1]);
    EXPECT_EQ(coord2->resolved_budget(INT_MAX), std::optional<int>(want[1]));
  }
}

/// docs/design.md 8 / docs/design.md A(h) at the coordinator: negative ids (down to INT_MIN) throw naming the id and
/// record nothing; extreme but finite concentrations are accepted (clamped by squeeze_budgets);
/// non-finite ones throw even for an id that already reported and after finalisation.
TEST(BadInputCoordinatorTest, ExtremeReports) {
  vc::SqueezeCoordinator coord(2, 50, 2, 1.0);
  for (const int id : {INT_MIN, -1000}) {
    const std::string what = invalid_argument_message([&] { coord.report_concentration(id, 0.5); });
    EXPECT_TRUE(contains(what, std::to_string(id))) << what;
  }
  EXPECT_TRUE(coord.reports().empty());
  coord.report_concentration(0, -kDblMax);
  EXPECT_THROW(coord.report_concentration(0, kNaN), std::invalid_argument);
  coord.report_concentration(INT_MAX, kDblMax);
  ASSERT_TRUE(coord.is_finalized());
  // Clamped to 0 and 1: {0, 1} -> weights {2, 0} -> {100, floor 3}.
  EXPECT_EQ(coord.resolved_budget(0), std::optional<int>(100));
  EXPECT_EQ(coord.resolved_budget(INT_MAX), std::optional<int>(3));
  EXPECT_THROW(coord.report_concentration(1, -kInf), std::invalid_argument);
  EXPECT_THROW(coord.report_concentration(INT_MIN, 0.1), std::invalid_argument);
  EXPECT_EQ(coord.reports().size(), 2u);
  EXPECT_FALSE(coord.resolved_budget(INT_MIN).has_value());
  EXPECT_FALSE(coord.resolved_budget(-1, coord.generation()).has_value());
}

// ---------------------------------------------------------------------------------------------
// Free functions
// ---------------------------------------------------------------------------------------------

TEST(BadInputFunctionsTest, SqueezeBudgetsRejectsNonFiniteConcentrationsNamingTheIndex) {
  for (const double bad : {kNaN, kInf, -kInf}) {
    for (const std::size_t at : {std::size_t{0}, std::size_t{2}, std::size_t{4}}) {
      std::vector<double> c = {0.1, 0.2, 0.3, 0.4, 0.5};
      c[at] = bad;
      for (const double strength : {0.0, 0.5, 1.0}) {  // even where the result ignores them
        const std::string what =
            invalid_argument_message([&] { (void)vc::squeeze_budgets(c, 100, 4, strength); });
        EXPECT_TRUE(contains(what, "concentration " + std::to_string(at))) << what;
      }
    }
    const std::string one =
        invalid_argument_message([&] { (void)vc::squeeze_budgets({bad}, 100, 4); });
    EXPECT_TRUE(contains(one, "concentration")) << one;
  }
  // Strength is checked first, even on empty input (docs/design.md A(l).
  for (const double s : {kNaN, -kInf, kInf, -1e-300}) {
    const std::string what =
        invalid_argument_message([&] { (void)vc::squeeze_budgets({}, 100, 4, s); });
    EXPECT_TRUE(contains(what, "strength")) << what;
    const std::string both =
        invalid_argument_message([&] { (void)vc::squeeze_budgets({kNaN}, 100, 4, s); });
    EXPECT_TRUE(contains(both, "strength")) << both;
  }
}

/// Huge averages and out-of-range concentrations: budgets clamped to [n_sink + 1, INT_MAX].
TEST(BadInputFunctionsTest, SqueezeBudgetsAtTheExtremesStayInRange) {
  const std::vector<int> b = vc::squeeze_budgets({0.1, 0.5, 0.99}, INT_MAX, 4, 1.0);
  EXPECT_EQ(b, (std::vector<int>{INT_MAX, INT_MAX, 45691141}));
  const std::vector<int> clamped = vc::squeeze_budgets({-kDblMax, kDblMax}, 100, 4, 1.0);
  EXPECT_EQ(clamped, (std::vector<int>{200, 5}));
  for (const int avg : {0, -5, INT_MIN}) {
    EXPECT_EQ(vc::squeeze_budgets({0.2, 0.8}, avg, 4, 1.0), (std::vector<int>{5, 5})) << avg;
    EXPECT_EQ(vc::squeeze_budgets({0.2}, avg, 4, 1.0), (std::vector<int>{5})) << avg;
  }
  EXPECT_EQ(vc::squeeze_budgets({0.0, 0.0}, INT_MAX, 0, 0.0), (std::vector<int>{INT_MAX, INT_MAX}));
}

TEST(BadInputFunctionsTest, PyramidBudgetsBadBetaWhateverTheLayerCount) {
  for (const int n : {INT_MIN, -1, 0, 1, 2, 7}) {
    for (const double beta : {-kInf, -kDblMax, 0.0, 1.0 - 1e-12, kNaN}) {
      const std::string what =
          invalid_argument_message([&] { (void)vc::pyramid_budgets(n, 100, 4, beta); });
      EXPECT_TRUE(contains(what, "beta")) << n << " " << beta << ": " << what;
    }
  }
  EXPECT_TRUE(vc::pyramid_budgets(INT_MIN, 100, 4, 2.0).empty());
  EXPECT_EQ(vc::pyramid_budgets(1, INT_MAX, 4, 2.0), (std::vector<int>{INT_MAX}));
  EXPECT_EQ(vc::pyramid_budgets(1, -7, 4, 2.0), (std::vector<int>{5}));
  // Betas above 1e6 are rejected (the taper's arithmetic would lose the average, and turn into
  // NaN at infinity).
  for (const double beta : {1e6 * (1 + 1e-12), 1e12, kDblMax, kInf}) {
    const std::string what =
        invalid_argument_message([&] { (void)vc::pyramid_budgets(4, 100, 4, beta); });
    EXPECT_TRUE(contains(what, "beta")) << beta << ": " << what;
  }
  // Large but moderate betas: the schedule stays within [floor, INT_MAX] and keeps the average.
  for (const double beta : {10.0, 1e3, 1e6}) {
    const std::vector<int> b = vc::pyramid_budgets(4, 100, 4, beta);
    ASSERT_EQ(b.size(), 4u);
    long sum = 0;
    for (const int x : b) {
      EXPECT_GE(x, 5);
      sum += x;
    }
    EXPECT_NEAR(static_cast<double>(sum) / 4.0, 100.0, 1.0) << beta;
    EXPECT_TRUE(std::is_sorted(b.rbegin(), b.rend())) << beta;
  }
}

TEST(BadInputFunctionsTest, ConcentrationScoreDegenerateInputs) {
  EXPECT_EQ(vc::concentration_score(Eigen::MatrixXd(0, 4)), 0.0);
  EXPECT_EQ(vc::concentration_score(Eigen::MatrixXd(0, 0)), 0.0);
  EXPECT_EQ(vc::concentration_score(Eigen::MatrixXf::Ones(1, 8)), 0.0);
  EXPECT_EQ(vc::concentration_score(Eigen::MatrixXd(5, 0)), 0.0);  // no dimensions: no similarity
  EXPECT_EQ(vc::concentration_score(Eigen::MatrixXd::Zero(4, 3)), 0.0);  // zero rows: u_i = 0
  // Heap path (D > 256) with one zero row among parallel ones: of the 4 * 3 ordered pairs, 6 are
  // parallel (cosine 1 up to the 1e-8 of the normalisation), the rest involve the zero row (0).
  Eigen::MatrixXd m = Eigen::MatrixXd::Ones(4, 300);
  m.row(2).setZero();
  EXPECT_NEAR(vc::concentration_score(m), 0.5, 1e-8);
  // Non-finite rows give a non-finite score (what the cache rejects as a layer concentration).
  Eigen::MatrixXd bad = Eigen::MatrixXd::Ones(3, 4);
  bad(1, 2) = kNaN;
  EXPECT_TRUE(std::isnan(vc::concentration_score(bad)));
  bad(1, 2) = kInf;
  EXPECT_FALSE(std::isfinite(vc::concentration_score(bad)));
  // The largest half and float values are fine (accumulated in double).
  const Eigen::Matrix<Eigen::half, 3, 2> h =
      Eigen::Matrix<Eigen::half, 3, 2>::Constant(Eigen::half(65504.0f));
  EXPECT_NEAR(vc::concentration_score(h), 1.0, 1e-12);
  const Eigen::MatrixXf f = Eigen::MatrixXf::Constant(3, 2, std::numeric_limits<float>::max());
  EXPECT_NEAR(vc::concentration_score(f), 1.0, 1e-12);
}

// ---------------------------------------------------------------------------------------------
// trim, views, factory, builder
// ---------------------------------------------------------------------------------------------

/// trim(n < 0) throws naming n on every policy, before and after calls, changing nothing
/// (docs/design.md A(d); a huge n trims at most offset() on the standard cache and nothing
/// on the others.
TEST(BadInputTrimTest, NegativeAndExtremeCountsOnEveryPolicy) {
  using T = Eigen::half;
  for (const Kind kind : kKinds) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> s = make_subject<T>(kind);
    for (const std::int64_t n : {std::int64_t{-1}, std::numeric_limits<std::int64_t>::min()}) {
      const std::string what = invalid_argument_message([&] { (void)s.cache->trim(n); });
      EXPECT_TRUE(contains(what, std::to_string(n))) << what;
    }
    std::mt19937 rng(2u);
    vc::KVPair<T> into;
    (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, 9), with_s(kValues, 9)),
                 into);
    const Snapshot before = snapshot(s);
    for (const std::int64_t n :
         {std::int64_t{-1}, std::int64_t{-9}, std::numeric_limits<std::int64_t>::min()}) {
      EXPECT_THROW((void)s.cache->trim(n), std::invalid_argument);
      EXPECT_TRUE(snapshot(s) == before);
    }
    const std::int64_t trimmed = s.cache->trim(std::numeric_limits<std::int64_t>::max());
    if (kind == Method::standard) {
      EXPECT_EQ(trimmed, 9);
      EXPECT_EQ(s.cache->offset(), 0);
      EXPECT_EQ(s.cache->kept_bytes(), 0u);
      EXPECT_EQ(s.cache->trim(std::numeric_limits<std::int64_t>::max()), 0);
    } else {
      EXPECT_EQ(trimmed, 0);
      EXPECT_TRUE(snapshot(s) == before);
    }
  }
}

/// KVView accessors with a head out of range throw std::out_of_range on every policy; in range
/// they do not. An empty view (S = 0 before any call) holds no rows whatever is asked.
TEST(BadInputViewTest, AccessorsOutOfRangeOnEveryPolicy) {
  using T = float;
  for (const Kind kind : kKinds) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> s = make_subject<T>(kind);
    std::mt19937 rng(3u);
    const Call empty = random_call(rng, with_s(kKeys, 0), with_s(kValues, 0));
    const vc::KVView<T> none = s.cache->update_and_view(empty.keys, empty.values);
    EXPECT_EQ(none.rows(), 0);
    for (const auto& [b, h] : std::vector<std::pair<Index, Index>>{{0, 0}, {2, 0}, {-1, 5}}) {
      // Either out_of_range or an empty block: never a read of storage that does not exist.
      try {
        EXPECT_EQ(none.keys(b, h).rows(), 0);
        EXPECT_EQ(none.values(b, h).rows(), 0);
        EXPECT_EQ(none.positions(b, h).rows(), 0);
      } catch (const std::out_of_range&) {
      }
    }
    const Call c = random_call(rng, kKeys, kValues);
    const vc::KVView<T> v = s.cache->update_and_view(c.keys, c.values);
    ASSERT_EQ(v.rows(), 3);
    const std::vector<std::pair<Index, Index>> bad = {{-1, 0},
                                                      {0, -1},
                                                      {2, 0},
                                                      {0, 2},
                                                      {2, 2},
                                                      {-1, -1},
                                                      {1, 2},
                                                      {-1, 2},
                                                      {std::numeric_limits<Index>::max(), 0},
                                                      {0, std::numeric_limits<Index>::min()}};
    for (const auto& [b, h] : bad) {
      EXPECT_THROW((void)v.keys(b, h), std::out_of_range) << b << "," << h;
      EXPECT_THROW((void)v.values(b, h), std::out_of_range) << b << "," << h;
      EXPECT_THROW((void)v.positions(b, h), std::out_of_range) << b << "," << h;
    }
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 2; ++h) {
        EXPECT_EQ(v.keys(b, h).rows(), 3);
        EXPECT_EQ(v.values(b, h).cols(), 3);
        EXPECT_EQ(v.positions(b, h)(2), 2);
      }
    }
  }
}

TEST(BadInputFactoryTest, UnknownMethodsThroughFactoryAndBuilder) {
  const std::vector<std::string> unknown = {
      std::string("h2o\0", 4), "tova\n", " squeeze", "pyramid", "SnapKV", "standard_",
      std::string(1000, 'x')};
  for (const std::string& m : unknown) {
    vc::KVCacheConfig c;
    c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
    c.method = m;
    for (const auto& f : std::vector<std::function<void()>>{
             [&] { (void)vc::KVCacheFactory::create<float>(c); },
             [&] { (void)vc::KVCacheFactory::create<Eigen::bfloat16>(c); },
             [&] { (void)vc::KVCacheBuilder::for_model<float>(2, c); },
             [&] { (void)vc::KVCacheBuilder::for_model<float>({std::nullopt}, c); },
             [&] { (void)vc::KVCacheBuilder::for_model<float>(0, c); }}) {
      const std::string what = invalid_argument_message(f);
      EXPECT_TRUE(contains(what, "method")) << what;
      // what() is a C string: a method name with a NUL cuts the message there.
      if (m.find('\0') != std::string::npos) continue;
      for (const std::string& valid : kMethodNames) EXPECT_TRUE(contains(what, valid)) << what;
    }
  }
}

TEST(BadInputBuilderTest, BadLayerCountsAndHeadDims) {
  for (const int n : {-1, -100, INT_MIN}) {
    const std::string what = invalid_argument_message(
        [&] { (void)vc::KVCacheBuilder::for_model<float>(n, vc::KVCacheConfig{}); });
    EXPECT_TRUE(contains(what, "n_layers")) << what;
    EXPECT_TRUE(contains(what, std::to_string(n))) << what;
  }
  for (const std::string& m : kMethodNames) {
    SCOPED_TRACE(m);
    vc::KVCacheConfig c;
    c.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
    c.method = m;
    EXPECT_TRUE(vc::KVCacheBuilder::for_model<float>(0, c).empty());
    EXPECT_TRUE(vc::KVCacheBuilder::for_model<float>(std::vector<std::optional<int>>{}, c).empty());
    // Only non-attention layers: standard caches, no coordinator needed.
    const auto plain = vc::KVCacheBuilder::for_model<float>({std::nullopt, std::nullopt}, c);
    ASSERT_EQ(plain.size(), 2u);
    for (const auto& p : plain) {
      EXPECT_TRUE(p->is_trimmable());
      EXPECT_FALSE(visit_scored(*p, [](const auto&) {}));
    }
    // A head dim < 1 anywhere: the first bad layer is named with its value, nothing is built.
    const std::vector<std::pair<std::vector<std::optional<int>>, std::pair<int, int>>> bad = {
        {{0}, {0, 0}},
        {{64, std::nullopt, -1, 0}, {2, -1}},
        {{std::nullopt, INT_MIN}, {1, INT_MIN}},
        {{8, 8, 8, 0}, {3, 0}}};
    for (const auto& [layer_dims, first_bad] : bad) {
      const auto& dims = layer_dims;  // C++17 lambdas cannot capture a structured binding
      const std::string what =
          invalid_argument_message([&] { (void)vc::KVCacheBuilder::for_model<float>(dims, c); });
      EXPECT_TRUE(contains(what, "layer " + std::to_string(first_bad.first))) << what;
      EXPECT_TRUE(contains(what, std::to_string(first_bad.second))) << what;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The engine's parallel-for breaking its contract (docs/robustness.md, "The engine's thread pool")
// ---------------------------------------------------------------------------------------------

/// Ways an engine's parallel-for can break its contract.
enum class PoolFault {
  kThrowsFirst,
  kThrowsAfterOne,
  kSkipsLast,
  kRepeats,
  kOutOfRange,
  kReturnsEarly
};

const char* fault_name(PoolFault f) {
  switch (f) {
    case PoolFault::kThrowsFirst:
      return "throws before any task";
    case PoolFault::kThrowsAfterOne:
      return "throws after task 0";
    case PoolFault::kSkipsLast:
      return "skips the last task";
    case PoolFault::kRepeats:
      return "runs every task twice";
    case PoolFault::kOutOfRange:
      return "also runs task `tasks`";
    case PoolFault::kReturnsEarly:
      return "returns while its thread still runs the tasks";
  }
  return "";
}

/// The thread a kReturnsEarly pool leaves behind: it runs every task but the last at once, and the
/// last (from its own copy of the task function) only once the test says the call has ended, so
/// the pool always returns with that task unstarted whatever the scheduler does.
struct LateRunner {
  std::thread thread;
  std::atomic<bool> call_ended{false};
  void finish() {
    call_ended.store(true);
    if (thread.joinable()) thread.join();
  }
};

/// A parallel-for with `fault` (kReturnsEarly: see LateRunner).
vc::ParallelFor faulty_pool(PoolFault fault, LateRunner& late) {
  return [fault, &late](int tasks, const std::function<void(int)>& task) {
    switch (fault) {
      case PoolFault::kThrowsFirst:
        throw std::runtime_error("pool is shutting down");
      case PoolFault::kThrowsAfterOne:
        task(0);
        throw std::runtime_error("pool is shutting down");
      case PoolFault::kSkipsLast:
        for (int t = 0; t + 1 < tasks; ++t) task(t);
        return;
      case PoolFault::kRepeats:
        for (int t = 0; t < tasks; ++t) task(t);
        for (int t = 0; t < tasks; ++t) task(t);
        return;
      case PoolFault::kOutOfRange:
        for (int t = 0; t <= tasks; ++t) task(t);
        return;
      case PoolFault::kReturnsEarly:
        late.thread = std::thread([tasks, copy = task, &ended = late.call_ended] {
          for (int t = 0; t + 1 < tasks; ++t) copy(t);
          while (!ended.load()) std::this_thread::yield();
          copy(tasks - 1);  // after the call: finds its ledger closed and does nothing
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
    }
  };
}

/// Every policy, every fault, through attend and update_and_view: the call throws (the pool's
/// own exception, or std::logic_error naming the misuse), the cache is reset (offset 0, no rows),
/// and it goes on: the next calls, serial, give bitwise what a fresh cache gives.
TEST(MisbehavingPoolTest, EveryFaultThrowsAndLeavesAResetCacheThatGoesOn) {
  using T = Eigen::half;
  vc::KVCacheConfig config = small_config();
  config.key_bits = config.value_bits = 16;
  // 130 tokens of 8 heads of D = 64: above kParallelWork (kv_cache.hpp) for every policy, the
  // unscored ones included (130 columns x 64 x 8 heads), so every call takes the pool.
  const Index B = 1, H = 8, G = 2, D = 64;
  std::mt19937 rng(5);
  const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, 130, D);
  const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, 130, D);
  const vc::Tensor4<float> q = random_queries(rng, B, G * H, 130, D);
  const vc::Tensor4<T> k1 = random_tensor<T>(rng, B, H, 1, D);
  const vc::Tensor4<T> v1 = random_tensor<T>(rng, B, H, 1, D);
  const vc::Tensor4<float> q1 = random_queries(rng, B, G * H, 1, D);
  for (const Kind kind : kKinds) {
    for (const PoolFault fault :
         {PoolFault::kThrowsFirst, PoolFault::kThrowsAfterOne, PoolFault::kSkipsLast,
          PoolFault::kRepeats, PoolFault::kOutOfRange, PoolFault::kReturnsEarly}) {
      for (const bool attend : {true, false}) {
        const std::string ctx = std::string(kind_name(kind)) + ", pool " + fault_name(fault) +
                                (attend ? ", attend" : ", update_and_view");
        Subject<T> s = make_subject<T>(kind, config);
        Subject<T> fresh = make_subject<T>(kind, config);
        LateRunner late;
        s.cache->set_parallel_for(faulty_pool(fault, late), 4);
        s.cache->set_parallel_heads(true);
        const auto bad_call = [&] {
          if (attend) {
            (void)s.cache->attend(q, k, v);
          } else {
            (void)s.cache->update_and_view(k, v);
          }
        };
        const bool pool_threw =
            fault == PoolFault::kThrowsFirst || fault == PoolFault::kThrowsAfterOne;
        try {
          bad_call();
          ADD_FAILURE() << ctx << ": no exception";
        } catch (const std::runtime_error& e) {
          EXPECT_TRUE(pool_threw) << ctx << ": " << e.what();
          EXPECT_STREQ(e.what(), "pool is shutting down") << ctx;
        } catch (const std::logic_error& e) {
          EXPECT_FALSE(pool_threw) << ctx << ": " << e.what();
          EXPECT_NE(std::string(e.what()).find("the cache was reset"), std::string::npos) << ctx;
        }
        late.finish();
        EXPECT_EQ(s.cache->offset(), 0) << ctx;
        EXPECT_EQ(s.cache->kept_bytes(), 0u) << ctx;
        // It goes on (serially) exactly like a fresh cache; a coordinated layer's report stays
        // with its coordinator (first report wins), so the fresh subject reports the same.
        s.cache->set_parallel_heads(false);
        for (Subject<T>* x : {&s, &fresh}) {
          if (x->coordinator) x->coordinator->reset();
          x->cache->reset();
        }
        for (int step = 0; step < 3; ++step) {
          const vc::Tensor4<float> a =
              step == 0 ? s.cache->attend(q, k, v) : s.cache->attend(q1, k1, v1);
          const vc::Tensor4<float> b =
              step == 0 ? fresh.cache->attend(q, k, v) : fresh.cache->attend(q1, k1, v1);
          ASSERT_TRUE(bitwise_equal(a, b)) << ctx << ", step " << step;
          ASSERT_TRUE(logical_state(s) == logical_state(fresh)) << ctx << ", step " << step;
        }
      }
    }
  }
}

/// A pool that runs other work while it waits (a work-stealing pool picking up the engine's next
/// job on the same layer) starts a second call on a cache whose first call is still running: the
/// second call is refused by name and changes nothing, and the first one completes exactly as it
/// would have without it.
TEST(MisbehavingPoolTest, ACallFromInsideThePoolIsRefusedAndChangesNothing) {
  vc::KVCacheConfig config = small_config();
  config.key_bits = config.value_bits = 16;
  config.method = "h2o";
  vc::H2OCache<float> cache(config), serial(config);
  std::mt19937 rng(11);
  const vc::Tensor4<float> k = random_tensor<float>(rng, 1, 8, 150, 64);
  const vc::Tensor4<float> v = random_tensor<float>(rng, 1, 8, 150, 64);
  const vc::Tensor4<float> q = random_queries(rng, 1, 8, 150, 64);
  const vc::Tensor4<float> k1 = random_tensor<float>(rng, 1, 8, 1, 64);
  const vc::Tensor4<float> q1 = random_queries(rng, 1, 8, 1, 64);
  std::vector<std::string> refused;
  int pool_calls = 0;
  cache.set_parallel_for(
      [&](int tasks, const std::function<void(int)>& task) {
        ++pool_calls;
        try {
          (void)cache.update_and_view(k1, k1);
          ADD_FAILURE() << "the nested call was accepted";
        } catch (const std::logic_error& e) {
          refused.emplace_back(e.what());
        }
        try {
          (void)cache.trim(1);
          ADD_FAILURE() << "the nested trim was accepted";
        } catch (const std::logic_error& e) {
          EXPECT_NE(std::string(e.what()).find("trim: called while another call"),
                    std::string::npos)
              << e.what();
        }
        for (int t = 0; t < tasks; ++t) task(t);
      },
      4);
  for (int step = 0; step < 3; ++step) {
    const vc::Tensor4<float> a = step == 0 ? cache.attend(q, k, v) : cache.attend(q1, k1, k1);
    const vc::Tensor4<float> b = step == 0 ? serial.attend(q, k, v) : serial.attend(q1, k1, k1);
    ASSERT_TRUE(bitwise_equal(a, b)) << "step " << step;
    ASSERT_EQ(cache.offset(), serial.offset()) << "step " << step;
  }
  ASSERT_GE(pool_calls, 1);  // the prefill is large enough to take the pool
  ASSERT_EQ(refused.size(), static_cast<std::size_t>(pool_calls));
  EXPECT_NE(
      refused.front().find("update_and_view: called while another call on this cache is running"),
      std::string::npos)
      << refused.front();
  EXPECT_NE(refused.front().find("this call changed nothing"), std::string::npos);
}

/// The detection names what the pool did.
TEST(MisbehavingPoolTest, TheErrorNamesTheMisuse) {
  vc::KVCacheConfig config = small_config();
  config.key_bits = config.value_bits = 16;
  config.method = "h2o";
  vc::H2OCache<float> cache(config);
  std::mt19937 rng(9);
  const vc::Tensor4<float> k = random_tensor<float>(rng, 1, 8, 150, 64);
  LateRunner unused;
  const std::pair<PoolFault, const char*> cases[] = {
      {PoolFault::kSkipsLast, "1 task never run"},
      {PoolFault::kRepeats, "4 repeated task runs"},
      {PoolFault::kOutOfRange, "1 task indices out of range"}};
  for (const auto& [fault, words] : cases) {
    cache.reset();
    cache.set_parallel_for(faulty_pool(fault, unused), 4);
    try {
      (void)cache.update_and_view(k, k);
      ADD_FAILURE() << fault_name(fault) << ": no exception";
    } catch (const std::logic_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("update_and_view: the parallel-for given to set_parallel_for ran 4 "
                          "tasks wrongly"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find(words), std::string::npos) << what;
    }
  }
}

}  // namespace
