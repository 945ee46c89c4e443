// StreamingLLMCache<T> (docs/design.md 6, with 2.2, 2.3, 4.4 and 8): after every call each head keeps exactly
// the positions {0 .. n_sink-1} and the newest `window` others, checked against the closed form and
// against StreamingLLMHeadOracle (tests/reference/policy_oracles.hpp) on random call sequences
// through the driver of support/oracle_driver.hpp (every update API); what a call returns,
// offset(), stored content,
// accounting, and bounded memory over long decodes. Trim and bad input are part of the contract
// every cache keeps: test_contract.cpp.

// Internal invariants of the library are checked (and abort) even in Release builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/policy_oracles.hpp"
#include "support/oracle_driver.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)
using Positions = std::vector<std::int64_t>;


/// The closed form (docs/design.md 6): positions p < offset with p < n_sink or p >= offset - window.
Positions closed_form(std::int64_t offset, int n_sink, int window) {
  Positions out;
  for (std::int64_t p = 0; p < offset; ++p) {
    if (p < n_sink || p >= offset - window) out.push_back(p);
  }
  return out;
}

/// `n` consecutive positions starting at `first`.
Positions range(std::int64_t first, std::int64_t n) {
  Positions out;
  for (std::int64_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

Positions concat(Positions a, const Positions& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Positions of a view's head (b, h), in view order.
template <class T>
Positions view_positions(const vc::KVView<T>& view, Index b, Index h) {
  Positions out;
  const auto p = view.positions(b, h);
  for (Index r = 0; r < p.size(); ++r) out.push_back(p(r));
  return out;
}

/// Retained positions of every head, read through an empty update_and_view call (docs/design.md 8: S = 0
/// changes nothing and returns the retained set). Each head's positions are sorted.
template <class T>
std::vector<Positions> retained_positions(vc::StreamingLLMCache<T>& cache) {
  const vc::Tensor4<T> k(cache.batch(), cache.heads(), 0, cache.key_dim());
  const vc::Tensor4<T> v(cache.batch(), cache.heads(), 0, cache.value_dim());
  const std::int64_t offset = cache.offset();
  const vc::KVView<T> view = cache.update_and_view(k, v);
  EXPECT_EQ(view.new_rows(), 0);
  EXPECT_EQ(cache.offset(), offset);
  std::vector<Positions> out;
  for (Index b = 0; b < cache.batch(); ++b) {
    for (Index h = 0; h < cache.heads(); ++h) {
      Positions p = view_positions(view, b, h);
      std::sort(p.begin(), p.end());
      out.push_back(std::move(p));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Random runs against the oracle and the closed form
// ---------------------------------------------------------------------------------------------

/// StreamingLLM's own rules after every call of a run: the oracle holds the closed form, and
/// (a quarter of the calls, drawn from `rng`) the cache's retained positions read through an empty
/// update_and_view are the closed form too. `probes` counts those reads.
template <class T>
std::function<std::string(std::int64_t)> closed_form_checks(vc::StreamingLLMCache<T>& cache,
                                                            const StreamingHeads& oracle,
                                                            int n_sink, int window,
                                                            std::mt19937& rng, int& probes) {
  return [&cache, &oracle, n_sink, window, &rng, &probes](std::int64_t offset) -> std::string {
    const Positions want = closed_form(offset, n_sink, window);
    for (std::size_t h = 0; h < oracle.size(); ++h) {
      if (ref::oracle_detail::positions_of(oracle.rows(h)) != want) {
        return "oracle of head " + std::to_string(h) + " disagrees with the closed form";
      }
    }
    if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) >= 0.25) return "";
    ++probes;
    const std::vector<Positions> got = retained_positions(cache);
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want) return "head " + std::to_string(i) + " retains other positions";
    }
    return "";
  };
}

template <class T>
class StreamingLLMOracleTest : public ::testing::Test {};
TYPED_TEST_SUITE(StreamingLLMOracleTest, StorageTypes);

/// Random runs over n_sink {0, 1, 4} x window {1, 2, 3, 8, 17}, random B, H in 1..3 and D in
/// {2, 4, 8, 16}; prefills longer, shorter than and equal to n_sink + window; then single-token and
/// multi-token calls (a few larger than 64, a few empty) through every update API without queries
/// (StreamingLLM scores nothing), compared after every call with one oracle per head
/// (support/oracle_driver.hpp) and with the closed form.
TYPED_TEST(StreamingLLMOracleTest, KeepsSinksAndTheLastWindowOnRandomCalls) {
  using T = TypeParam;
  std::mt19937 rng(5005u);
  int runs = 0, prefill_over = 0, prefill_under = 0, calls = 0, evicting_calls = 0;
  int big_calls = 0, probes = 0;
  for (const int n_sink : {0, 1, 4}) {
    for (const int window : {1, 2, 3, 8, 17}) {
      const int full = n_sink + window;
      for (int rep = 0; rep < 4; ++rep) {
        const RunDims dm = random_dims(rng);
        PlanShape shape;
        switch (rep) {
          case 0:
            shape.prefill = std::uniform_int_distribution<Index>(full + 1, 2 * full + 8)(rng);
            break;
          case 1:
            shape.prefill = std::uniform_int_distribution<Index>(1, std::max(1, full - 1))(rng);
            break;
          case 2:
            shape.prefill = std::uniform_int_distribution<Index>(65, 200)(rng);
            break;
          default:
            shape.prefill = full;
            break;
        }
        (shape.prefill > full ? prefill_over : prefill_under) += 1;
        shape.calls = std::uniform_int_distribution<int>(30, 80)(rng);
        shape.empty = 0.05;
        shape.short_calls = 0.20;
        shape.short_max = full + 5;
        shape.long_calls = 0.04;
        shape.long_max = 150;
        shape.apis.assign(std::begin(kProxyApis), std::end(kProxyApis));
        const auto seed = static_cast<unsigned>(rng());
        std::mt19937 run_rng(seed);
        auto owned = std::make_unique<vc::StreamingLLMCache<T>>(stream_config(n_sink, window));
        vc::StreamingLLMCache<T>& cache = *owned;
        ASSERT_EQ(cache.layer_budget(), full);
        ASSERT_EQ(cache.n_sink(), n_sink);
        ASSERT_EQ(cache.window_size(), window);
        Subject<T> subject{nullptr, std::move(owned)};
        StreamingHeads oracle(static_cast<std::size_t>(dm.B * dm.H), n_sink, window);
        RunChecks<T> checks;
        checks.what = "streaming n_sink=" + std::to_string(n_sink) + " window=" +
                      std::to_string(window) + " B=" + std::to_string(dm.B) +
                      " H=" + std::to_string(dm.H) + " Dk=" + std::to_string(dm.Dk) +
                      " Dv=" + std::to_string(dm.Dv) + " seed=" + std::to_string(seed);
        std::mt19937 probe_rng(seed + 1);
        checks.after_call = closed_form_checks(cache, oracle, n_sink, window, probe_rng, probes);
        const std::vector<DriverCall> plan = random_plan(run_rng, shape);
        const RunOutcome r = run_against_oracle(subject, oracle, dm, plan, run_rng, checks);
        ASSERT_EQ(r.failure, "");
        ++runs;
        calls += r.calls_checked;
        evicting_calls += r.evicting_calls;
        for (const DriverCall& c : plan) big_calls += c.S > 64 ? 1 : 0;
      }
    }
  }
  std::printf(
      "[ stats    ] %d runs, %d calls checked (%d evicting, %d of S > 64), "
      "%d retained sets read through empty views\n",
      runs, calls, evicting_calls, big_calls, probes);
  EXPECT_EQ(runs, 60);
  EXPECT_GT(prefill_over, 20);
  EXPECT_GT(prefill_under, 20);
  EXPECT_GT(evicting_calls, calls / 2);
  EXPECT_GT(big_calls, 20);
  EXPECT_GT(probes, 200);
}

// ---------------------------------------------------------------------------------------------
// Closed-form cases
// ---------------------------------------------------------------------------------------------

template <class T>
class StreamingLLMCacheTest : public ::testing::Test {};
TYPED_TEST_SUITE(StreamingLLMCacheTest, StorageTypes);

/// Rows of the whole input so far, indexed by position, for every head.
template <class T>
struct History {
  std::vector<std::vector<std::vector<double>>> keys, values;  // [head][position][D]
  void add(const vc::Tensor4<T>& k, const vc::Tensor4<T>& v) {
    const Index B = k.dimension(0), H = k.dimension(1);
    keys.resize(static_cast<std::size_t>(B * H));
    values.resize(static_cast<std::size_t>(B * H));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index s = 0; s < k.dimension(2); ++s) {
          keys[static_cast<std::size_t>(b * H + h)].push_back(row_of(k, b, h, s));
          values[static_cast<std::size_t>(b * H + h)].push_back(row_of(v, b, h, s));
        }
  }
  /// The rows at `positions` of head `hi`.
  std::vector<std::vector<double>> key_rows(std::size_t hi, const Positions& positions) const {
    std::vector<std::vector<double>> out;
    for (const auto p : positions) out.push_back(keys[hi][static_cast<std::size_t>(p)]);
    return out;
  }
  std::vector<std::vector<double>> value_rows(std::size_t hi, const Positions& positions) const {
    std::vector<std::vector<double>> out;
    for (const auto p : positions) out.push_back(values[hi][static_cast<std::size_t>(p)]);
    return out;
  }
};

/// Checks a fetch result and state() of every head against the history at given positions.
template <class T>
void expect_rows(const vc::KVPair<T>& kv, const History<T>& hist, const Positions& positions,
                 const std::string& ctx) {
  const Index B = kv.first.dimension(0), H = kv.first.dimension(1);
  ASSERT_EQ(kv.first.dimension(2), static_cast<Index>(positions.size())) << ctx;
  ASSERT_EQ(kv.second.dimension(2), static_cast<Index>(positions.size())) << ctx;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const auto hi = static_cast<std::size_t>(b * H + h);
      EXPECT_EQ(rows_of(kv.first, b, h), hist.key_rows(hi, positions)) << ctx << " head " << hi;
      EXPECT_EQ(rows_of(kv.second, b, h), hist.value_rows(hi, positions)) << ctx << " head " << hi;
    }
}

/// docs/design.md 4.4 on the worked case: n_sink 4, window 8. A 100-token prefill returns all 100 rows and
/// retains 12; each decode step returns 13 rows, the current token last.
TYPED_TEST(StreamingLLMCacheTest, PrefillReturnsEveryRowAndDecodeReturnsBudgetPlusOne) {
  using T = TypeParam;
  const Index B = 2, H = 2, Dk = 8, Dv = 4;
  std::mt19937 rng(21);
  vc::StreamingLLMCache<T> cache(stream_config(4, 8));
  EXPECT_EQ(cache.layer_budget(), 12);
  EXPECT_EQ(cache.n_sink(), 4);
  EXPECT_EQ(cache.window_size(), 8);
  EXPECT_FALSE(cache.is_trimmable());
  History<T> hist;
  const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, 100, Dk);
  const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, 100, Dv);
  hist.add(k, v);
  const vc::KVPair<T> out = cache.update_and_fetch(k, v);
  EXPECT_EQ(cache.offset(), 100);
  expect_rows(out, hist, range(0, 100), "prefill");
  EXPECT_TRUE(bytes_of(out.first) == bytes_of(k));  // exactly the prompt, in order
  EXPECT_TRUE(bytes_of(out.second) == bytes_of(v));
  EXPECT_EQ(cache.tokens_kept(), 12);
  expect_rows(cache.state(), hist, concat(range(0, 4), range(92, 8)), "after prefill");

  for (int step = 0; step < 20; ++step) {
    const vc::Tensor4<T> kd = random_tensor<T>(rng, B, H, 1, Dk);
    const vc::Tensor4<T> vd = random_tensor<T>(rng, B, H, 1, Dv);
    hist.add(kd, vd);
    const std::int64_t pos = 100 + step;
    const vc::KVPair<T> d = cache.update_and_fetch(kd, vd);
    ASSERT_EQ(d.first.dimension(2), 13);
    // The rows retained before the step, then the current token last.
    expect_rows(d, hist, concat(concat(range(0, 4), range(pos - 8, 8)), {pos}),
                "decode " + std::to_string(step));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        EXPECT_EQ(row_of(d.first, b, h, 12), row_of(kd, b, h, 0));
        EXPECT_EQ(row_of(d.second, b, h, 12), row_of(vd, b, h, 0));
      }
    EXPECT_EQ(cache.offset(), pos + 1);
    expect_rows(cache.state(), hist, concat(range(0, 4), range(pos - 7, 8)),
                "state after decode " + std::to_string(step));
  }
}

/// The same case through update_and_view: the prompt's 100 rows in arrival order, then 13-row
/// windows whose last row is the current token.
TYPED_TEST(StreamingLLMCacheTest, ViewsOfPrefillAndDecode) {
  using T = TypeParam;
  const Index B = 1, H = 3, D = 4;
  std::mt19937 rng(22);
  vc::StreamingLLMCache<T> cache(stream_config(4, 8));
  const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, 100, D);
  const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, 100, D);
  {
    const vc::KVView<T> view = cache.update_and_view(k, v);
    ASSERT_EQ(view.rows(), 100);
    ASSERT_EQ(view.new_rows(), 100);
    for (Index h = 0; h < H; ++h) {
      EXPECT_EQ(view_positions(view, 0, h), range(0, 100));
      for (Index r = 0; r < 100; ++r) {
        for (Index d = 0; d < D; ++d) {
          ASSERT_EQ(to_double(view.keys(0, h)(r, d)), to_double(k(0, h, r, d)));
          ASSERT_EQ(to_double(view.values(0, h)(r, d)), to_double(v(0, h, r, d)));
        }
      }
    }
  }
  Positions retained = concat(range(0, 4), range(92, 8));
  for (int step = 0; step < 30; ++step) {
    const std::int64_t pos = 100 + step;
    const Index S = step == 10 ? 5 : 1;  // one multi-token call among the decode steps
    const vc::Tensor4<T> kd = random_tensor<T>(rng, B, H, S, D);
    const vc::Tensor4<T> vd = random_tensor<T>(rng, B, H, S, D);
    const vc::KVView<T> view = cache.update_and_view(kd, vd);
    ASSERT_EQ(view.rows(), 12 + S);
    ASSERT_EQ(view.new_rows(), S);
    for (Index h = 0; h < H; ++h) {
      const Positions p = view_positions(view, 0, h);
      Positions old(p.begin(), p.end() - S);
      std::sort(old.begin(), old.end());
      EXPECT_EQ(old, retained) << "step " << step;
      for (Index s = 0; s < S; ++s) {
        EXPECT_EQ(p[static_cast<std::size_t>(12 + s)], pos + s);
        for (Index d = 0; d < D; ++d) {
          EXPECT_EQ(to_double(view.keys(0, h)(12 + s, d)), to_double(kd(0, h, s, d)));
          EXPECT_EQ(to_double(view.values(0, h)(12 + s, d)), to_double(vd(0, h, s, d)));
        }
      }
    }
    if (S > 1) step += static_cast<int>(S) - 1;
    retained = closed_form(cache.offset(), 4, 8);
    EXPECT_EQ(cache.offset(), pos + S);
  }
}

/// Runs `calls` (sizes) through update_and_fetch and checks the retained positions, the returned
/// rows and offset() after each against the closed form.
template <class T>
void check_closed_form(int n_sink, int window, const std::vector<Index>& calls, unsigned seed,
                       const std::string& name) {
  const Index B = 2, H = 1, D = 4;
  std::mt19937 rng(seed);
  vc::StreamingLLMCache<T> cache(stream_config(n_sink, window));
  History<T> hist;
  std::int64_t offset = 0;
  for (std::size_t c = 0; c < calls.size(); ++c) {
    const Index S = calls[c];
    const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
    const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, D);
    hist.add(k, v);
    const Positions before = closed_form(offset, n_sink, window);
    const vc::KVPair<T> out = cache.update_and_fetch(k, v);
    const std::string ctx = name + " call " + std::to_string(c) + " (S=" + std::to_string(S) + ")";
    expect_rows(out, hist, S == 0 ? before : concat(before, range(offset, S)), ctx + " returned");
    offset += S;
    EXPECT_EQ(cache.offset(), offset) << ctx;
    const Positions want = closed_form(offset, n_sink, window);
    expect_rows(cache.state(), hist, want, ctx + " state");
    for (const Positions& got : retained_positions(cache)) EXPECT_EQ(got, want) << ctx;
  }
}

/// n_sink 0: a pure sliding window of the newest `window` tokens.
TYPED_TEST(StreamingLLMCacheTest, NoSinksIsASlidingWindow) {
  using T = TypeParam;
  check_closed_form<T>(0, 5, {3, 1, 1, 1, 1, 3, 9, 1, 0, 1, 70, 1, 1}, 31, "n_sink 0 window 5");
  check_closed_form<T>(0, 5, {12, 1, 1}, 32, "n_sink 0 window 5, long prefill");
  // Spot checks of the closed form itself.
  EXPECT_EQ(closed_form(12, 0, 5), range(7, 5));
  EXPECT_EQ(closed_form(3, 0, 5), range(0, 3));
}

/// Window 1: only the sinks and the newest token stay; a decode step returns [retained...,
/// current].
TYPED_TEST(StreamingLLMCacheTest, WindowOfOneKeepsTheSinksAndTheNewestToken) {
  using T = TypeParam;
  check_closed_form<T>(0, 1, {1, 1, 1, 4, 1, 0, 1, 66, 1}, 41, "n_sink 0 window 1");
  check_closed_form<T>(2, 1, {1, 1, 1, 1, 4, 1, 9, 1}, 42, "n_sink 2 window 1");
  check_closed_form<T>(3, 1, {10, 1, 1}, 43, "n_sink 3 window 1");
  std::mt19937 rng(44);
  vc::StreamingLLMCache<T> cache(stream_config(0, 1));
  for (int step = 0; step < 6; ++step) {
    const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 1, 1, 2);
    const vc::KVPair<T> out = cache.update_and_fetch(k, k);
    ASSERT_EQ(out.first.dimension(2), step == 0 ? 1 : 2);
    EXPECT_EQ(row_of(out.first, 0, 0, out.first.dimension(2) - 1), row_of(k, 0, 0, 0));
    EXPECT_EQ(cache.tokens_kept(), 1);
    EXPECT_TRUE(bytes_of(cache.state().first) == bytes_of(k));
  }
}

/// Prefills shorter than n_sink: the sinks are the first n_sink positions of the sequence, so the
/// tokens that arrive later at positions < n_sink are sinks too and are never dropped.
TYPED_TEST(StreamingLLMCacheTest, PrefillShorterThanTheSinks) {
  using T = TypeParam;
  check_closed_form<T>(4, 3, {2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 51, "n_sink 4 window 3");
  check_closed_form<T>(4, 3, {1, 5, 1, 2, 1}, 52, "n_sink 4 window 3, straddling call");
  EXPECT_EQ(closed_form(10, 4, 3), (Positions{0, 1, 2, 3, 7, 8, 9}));
}

/// Multi-token calls longer than the window, shorter than it, and spanning block sizes.
TYPED_TEST(StreamingLLMCacheTest, MultiTokenCalls) {
  using T = TypeParam;
  check_closed_form<T>(2, 3, {4, 10, 2, 1, 3, 1, 200, 1}, 61, "n_sink 2 window 3");
  check_closed_form<T>(4, 8, {12, 12, 13, 11, 1, 100}, 62, "n_sink 4 window 8");
  check_closed_form<T>(1, 17, {5, 5, 5, 5, 5, 1, 0, 1}, 63, "n_sink 1 window 17");
}

/// Accounting on every call (docs/design.md 2.2): kept and full bytes, ratio, tokens seen and kept; reset.
TYPED_TEST(StreamingLLMCacheTest, Accounting) {
  using T = TypeParam;
  const Index B = 2, H = 3, Dk = 4, Dv = 6;
  const int n_sink = 2, window = 5;
  std::mt19937 rng(71);
  vc::StreamingLLMCache<T> cache(stream_config(n_sink, window));
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.full_seq_bytes(), 0u);
  EXPECT_EQ(cache.compression_ratio(), 1.0);
  EXPECT_EQ(cache.tokens_seen(), 0);
  EXPECT_EQ(cache.tokens_kept(), 0);
  const std::size_t row = static_cast<std::size_t>(Dk + Dv) * sizeof(T);
  std::int64_t offset = 0;
  for (const Index S : {Index{3}, Index{1}, Index{4}, Index{1}, Index{0}, Index{20}, Index{1}}) {
    cache.update_and_fetch(random_tensor<T>(rng, B, H, S, Dk), random_tensor<T>(rng, B, H, S, Dv));
    offset += S;
    const auto n = static_cast<std::int64_t>(closed_form(offset, n_sink, window).size());
    EXPECT_EQ(n, std::min<std::int64_t>(offset, n_sink + window));
    EXPECT_EQ(cache.kept_bytes(), static_cast<std::size_t>(B * H * n) * row);
    EXPECT_EQ(cache.full_seq_bytes(), static_cast<std::size_t>(B * H * offset) * row);
    EXPECT_DOUBLE_EQ(cache.compression_ratio(),
                     static_cast<double>(offset) / static_cast<double>(n));
    EXPECT_EQ(cache.tokens_seen(), B * H * offset);
    EXPECT_EQ(cache.tokens_kept(), n);
  }
  EXPECT_DOUBLE_EQ(cache.compression_ratio(), 30.0 / 7.0);
  cache.reset();
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_EQ(cache.kept_bytes(), 0u);
  EXPECT_EQ(cache.compression_ratio(), 1.0);
  EXPECT_EQ(cache.tokens_seen(), 0);
  // After reset the sequence restarts at position 0: the new first tokens are the sinks.
  cache.update_and_fetch(random_tensor<T>(rng, 1, 1, 9, 2), random_tensor<T>(rng, 1, 1, 9, 2));
  EXPECT_EQ(retained_positions(cache).front(), (Positions{0, 1, 4, 5, 6, 7, 8}));
}

// ---------------------------------------------------------------------------------------------
// Memory (docs/design.md 7)
// ---------------------------------------------------------------------------------------------

/// heap_bytes() stays bounded over 5000 decode steps: the same at step 1000 and step 5000 (and at
/// every step between), through fetch and view, after a short and after a long prompt.
TYPED_TEST(StreamingLLMCacheTest, HeapBytesStayBoundedOverLongDecodes) {
  using T = TypeParam;
  const Index B = 2, H = 2, D = 16;
  const int n_sink = 4, window = 32;
  for (const bool view : {false, true}) {
    for (const Index prefill : {Index{10}, Index{300}}) {
      std::mt19937 rng(static_cast<unsigned>(101 + prefill + (view ? 1 : 0)));
      vc::StreamingLLMCache<T> cache(stream_config(n_sink, window));
      cache.update_and_fetch(random_tensor<T>(rng, B, H, prefill, D),
                             random_tensor<T>(rng, B, H, prefill, D));
      const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, 1, D);
      const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, 1, D);
      std::size_t at_1000 = 0, max_after = 0, min_after = std::numeric_limits<std::size_t>::max();
      for (int step = 1; step <= 5000; ++step) {
        const Index rows = std::min<Index>(prefill + step - 1, n_sink + window) + 1;
        if (view) {
          const vc::KVView<T> w = cache.update_and_view(k, v);
          ASSERT_EQ(w.rows(), rows);
        } else {
          const vc::KVPair<T> out = cache.update_and_fetch(k, v);
          ASSERT_EQ(out.first.dimension(2), rows);
        }
        const std::size_t heap = cache.heap_bytes();
        if (step == 1000) at_1000 = heap;
        if (step >= 1000) {
          max_after = std::max(max_after, heap);
          min_after = std::min(min_after, heap);
        }
      }
      const std::string ctx =
          std::string(view ? "view" : "fetch") + " prefill " + std::to_string(prefill);
      EXPECT_EQ(cache.heap_bytes(), at_1000) << ctx;
      EXPECT_EQ(max_after, at_1000) << ctx;
      EXPECT_EQ(min_after, at_1000) << ctx;
      EXPECT_EQ(cache.tokens_kept(), n_sink + window);
      EXPECT_EQ(cache.offset(), prefill + 5000);
      // Bounded by a small multiple of the steady-state rows, independent of the tokens seen.
      const std::size_t per_row = static_cast<std::size_t>(2 * D) * sizeof(T) + 64;
      const std::size_t bound =
          static_cast<std::size_t>(B * H) *
          (2 * static_cast<std::size_t>(n_sink + window + 1) * per_row + 1024);
      EXPECT_LE(at_1000, bound) << ctx;
      EXPECT_GT(at_1000, static_cast<std::size_t>(B * H * (n_sink + window) * 2 * D) * sizeof(T))
          << ctx;
    }
  }
}

}  // namespace
