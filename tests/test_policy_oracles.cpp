// Self-tests of the sibling-policy oracles (tests/reference/policy_oracles.hpp) against hand-computed
// facts from docs/design.md sections 6 (TOVA, StreamingLLM, SnapKV), so that the oracles can be trusted when
// the fast caches are compared against them.

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "reference/policy_oracles.hpp"
#include "support/test_support.hpp"

namespace {

namespace ref = veloxquant::reference;
using Positions = std::vector<std::int64_t>;
using veloxquant::test::Rows;
using veloxquant::test::scaled;
using veloxquant::test::value_rows;

/// A one-element vector (D = 1 key or value).
std::vector<double> v1(double x) { return std::vector<double>{x}; }

/// n rows of dimension d, all zero.
// returns: [n][d]
Rows zero_rows(std::size_t n, std::size_t d) { return Rows(n, std::vector<double>(d, 0.0)); }

/// Feed D = 1 keys to a per-token oracle (values are 100 + position).
template <class Oracle>
void feed_1d(Oracle& oracle, const std::vector<double>& keys) {
    for (double k : keys) oracle.absorb(v1(k), v1(100.0 + k));
}

// Scale for the SnapKV examples with D = 2: with keys s * e, logit = s^2 * dot(e_r, e_q) / sqrt(2)
// = ln(2) * dot(e_r, e_q), so every exp(logit) is a power of two and the softmax is a ratio of small
// integers (up to rounding of exp/log).
const double kSnapScale = std::sqrt(std::sqrt(2.0) * std::log(2.0));

// SnapKV hand example (S = 5, D = 2), in units of kSnapScale.
//   e0 = (0, 0)  e1 = (2, 0)  e2 = (0, 1)  e3 = (1, 1)  e4 = (1, -1)
const Rows kSnapE = {{0.0, 0.0}, {2.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}, {1.0, -1.0}};

// ---------------------------------------------------------------------------------------------
// proxy_softmax
// ---------------------------------------------------------------------------------------------

TEST(ProxySoftmaxTest, HandComputedPowersOfTwo) {
    // Proxy e3 = (1, 1) against e0..e4: dots 0, 2, 1, 2, 0 -> exp = 1, 4, 2, 4, 1, sum 12.
    const Rows keys = scaled(kSnapE, kSnapScale);
    const std::vector<double> a = ref::proxy_softmax(keys, keys[3]);
    ASSERT_EQ(a.size(), 5u);
    EXPECT_NEAR(a[0], 1.0 / 12.0, 1e-12);
    EXPECT_NEAR(a[1], 4.0 / 12.0, 1e-12);
    EXPECT_NEAR(a[2], 2.0 / 12.0, 1e-12);
    EXPECT_NEAR(a[3], 4.0 / 12.0, 1e-12);
    EXPECT_NEAR(a[4], 1.0 / 12.0, 1e-12);
}

TEST(ProxySoftmaxTest, ScalesBySqrtDAndSurvivesHugeLogits) {
    // D = 4, q = (1,1,1,1): dot with (1,1,1,1) is 4, logit 4 / sqrt(4) = 2; with 0 it is 0.
    const Rows keys = {{1.0, 1.0, 1.0, 1.0}, {0.0, 0.0, 0.0, 0.0}};
    const std::vector<double> a = ref::proxy_softmax(keys, {1.0, 1.0, 1.0, 1.0});
    const double e2 = std::exp(2.0);
    EXPECT_NEAR(a[0], e2 / (e2 + 1.0), 1e-12);
    EXPECT_NEAR(a[1], 1.0 / (e2 + 1.0), 1e-12);
    // Logits of 1e6 would overflow exp without max subtraction.
    const std::vector<double> b = ref::proxy_softmax({{1000.0}, {999.0}}, {1000.0});
    EXPECT_NEAR(b[0], 1.0, 1e-12);
    EXPECT_NEAR(b[1], 0.0, 1e-12);
    EXPECT_TRUE(ref::proxy_softmax({}, {1.0}).empty());
    EXPECT_THROW(ref::proxy_softmax({{1.0, 2.0}}, {1.0}), std::invalid_argument);
    EXPECT_THROW(ref::proxy_softmax({{1.0}}, {}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// TOVA
// ---------------------------------------------------------------------------------------------

TEST(TOVAHeadOracleTest, HandComputedExampleD1) {
    // n_sink = 1, budget = 3, D = 1 (sqrt(D) = 1, logit = K_r * k_i).
    ref::TOVAHeadOracle tova(1, 3);
    const double ln2 = std::log(2.0);
    feed_1d(tova, {0.0, ln2, 2.0 * ln2});  // positions 0..2: within budget, no attention computed
    EXPECT_EQ(tova.positions(), (Positions{0, 1, 2}));
    EXPECT_TRUE(tova.last_weights().empty());
    for (const auto& r : tova.rows()) EXPECT_EQ(r.score, 0.0);

    // Token 3, key 1. Rows (incl. itself) keys 0, ln2, 2ln2, 1 -> logits 0, ln2, 2ln2, 1
    // -> exp 1, 2, 4, e; sum 7 + e = 9.71828...
    // a = 0.102899 (sink p0), 0.205798 (p1), 0.411595 (p2), 0.279708 (p3).
    // The sink has the lowest weight but is protected: evict p1.
    tova.absorb(v1(1.0), v1(103.0));
    const double s3 = 7.0 + std::exp(1.0);
    const std::vector<double> a3 = tova.last_weights();
    ASSERT_EQ(a3.size(), 4u);
    EXPECT_NEAR(a3[0], 1.0 / s3, 1e-12);
    EXPECT_NEAR(a3[1], 2.0 / s3, 1e-12);
    EXPECT_NEAR(a3[2], 4.0 / s3, 1e-12);
    EXPECT_NEAR(a3[3], std::exp(1.0) / s3, 1e-12);
    EXPECT_EQ(tova.positions(), (Positions{0, 2, 3}));
    ASSERT_EQ(tova.rows().size(), 3u);
    EXPECT_NEAR(tova.rows()[0].score, 0.102899, 1e-6);
    EXPECT_NEAR(tova.rows()[1].score, 0.411595, 1e-6);
    EXPECT_NEAR(tova.rows()[2].score, 0.279708, 1e-6);
    EXPECT_EQ(tova.rows()[2].value, v1(103.0));

    // Token 4, key -1. Rows keys 0, 2ln2, 1, -1 -> logits 0, -2ln2, -1, 1 -> exp 1, 1/4, 1/e, e;
    // sum 4.336161; a = 0.230619, 0.057655 (p2), 0.084840 (p3), 0.626887 (p4).
    // Memoryless: the former heavy hitter p2 now has the lowest weight and goes.
    tova.absorb(v1(-1.0), v1(104.0));
    const std::vector<double> a4 = tova.last_weights();
    ASSERT_EQ(a4.size(), 4u);
    EXPECT_NEAR(a4[0], 0.230619, 1e-6);
    EXPECT_NEAR(a4[1], 0.057655, 1e-6);
    EXPECT_NEAR(a4[2], 0.084840, 1e-6);
    EXPECT_NEAR(a4[3], 0.626887, 1e-6);
    EXPECT_EQ(tova.positions(), (Positions{0, 3, 4}));
}

TEST(TOVAHeadOracleTest, CanEvictTheNewToken) {
    // n_sink = 1, budget = 3, D = 1. Keys 0, 3, 2, then 1: logits (q = 1) 0, 3, 2, 1
    // -> exp 1, e^3, e^2, e. Lowest non-sink is the newcomer p3 (the token attends to itself too).
    ref::TOVAHeadOracle tova(1, 3);
    feed_1d(tova, {0.0, 3.0, 2.0, 1.0});
    EXPECT_EQ(tova.positions(), (Positions{0, 1, 2}));
    const double sum = 1.0 + std::exp(3.0) + std::exp(2.0) + std::exp(1.0);
    const std::vector<double> a = tova.last_weights();
    ASSERT_EQ(a.size(), 4u);
    EXPECT_NEAR(a[3], std::exp(1.0) / sum, 1e-12);
    // Scores of the survivors are their weights in this eviction.
    EXPECT_NEAR(tova.rows()[1].score, std::exp(3.0) / sum, 1e-12);
}

TEST(TOVAHeadOracleTest, NeverEvictsASinkEvenWhenSinksWeighLeast) {
    // D = 2, n_sink = 2, budget = 4. Sink keys (-3, 0); other keys (u in [1,2], v in [-1,1]).
    // For a non-sink query q: sink logit = -3 q0 / sqrt(2) < -2, any non-sink logit >= (1 - 1) / sqrt(2) = 0,
    // so the sinks always have the two lowest weights; they must stay anyway.
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> u(1.0, 2.0);
    std::uniform_real_distribution<double> v(-1.0, 1.0);
    ref::TOVAHeadOracle tova(2, 4);
    tova.absorb({-3.0, 0.0}, {0.0});
    tova.absorb({-3.0, 0.0}, {1.0});
    for (int t = 2; t < 200; ++t) {
        tova.absorb({u(rng), v(rng)}, {static_cast<double>(t)});
        const Positions pos = tova.positions();
        if (t < 4) {
            EXPECT_EQ(pos.size(), static_cast<std::size_t>(t + 1));
            continue;
        }
        ASSERT_EQ(pos.size(), 4u) << "t=" << t;  // exactly one eviction per token once full
        EXPECT_EQ(pos[0], 0) << "t=" << t;
        EXPECT_EQ(pos[1], 1) << "t=" << t;
        // The test is meaningful: the sinks really were the lowest-weight rows.
        const std::vector<double> a = tova.last_weights();
        ASSERT_EQ(a.size(), 5u);
        for (std::size_t r = 2; r < a.size(); ++r) {
            EXPECT_LT(a[0], a[r]);
            EXPECT_LT(a[1], a[r]);
        }
    }
}

TEST(TOVAHeadOracleTest, MemorylessSameRetainedSetSameEviction) {
    // n_sink = 1, budget = 3, D = 1. Two histories that differ at positions 1..3 and evict them in
    // different orders, both ending with positions {0, 4, 5} holding keys 0, 1, 2:
    //   A: keys 0, -3, -2, -1, 1, 2 -> evicts p3, then p1, then p2.
    //   B: keys 0, 0.5, -4, -0.5, 1, 2 -> evicts p1, then p2, then p3.
    ref::TOVAHeadOracle a(1, 3);
    ref::TOVAHeadOracle b(1, 3);
    feed_1d(a, {0.0, -3.0, -2.0});
    feed_1d(b, {0.0, 0.5, -4.0});
    a.absorb(v1(-1.0), v1(0.0));
    b.absorb(v1(-0.5), v1(0.0));
    ASSERT_EQ(a.positions(), (Positions{0, 1, 2}));  // A evicted p3 (the newcomer, logit 1 vs 3, 2)
    ASSERT_EQ(b.positions(), (Positions{0, 2, 3}));  // B evicted p1 (logit -0.25)
    a.absorb(v1(1.0), v1(4.0));
    b.absorb(v1(1.0), v1(4.0));
    a.absorb(v1(2.0), v1(5.0));
    b.absorb(v1(2.0), v1(5.0));
    ASSERT_EQ(a.positions(), (Positions{0, 4, 5}));
    ASSERT_EQ(b.positions(), (Positions{0, 4, 5}));
    for (std::size_t r = 0; r < 3; ++r) ASSERT_EQ(a.rows()[r].key, b.rows()[r].key);

    // Same next token (key -1): rows keys 0, 1, 2, -1 -> logits 0, -1, -2, 1 -> exp 1, 1/e, 1/e^2, e.
    // Lowest non-sink: p5 (weight e^-2 / sum).
    a.absorb(v1(-1.0), v1(6.0));
    b.absorb(v1(-1.0), v1(6.0));
    EXPECT_EQ(a.positions(), (Positions{0, 4, 6}));
    EXPECT_EQ(b.positions(), (Positions{0, 4, 6}));
    const std::vector<double> wa = a.last_weights();
    const std::vector<double> wb = b.last_weights();
    ASSERT_EQ(wa.size(), 4u);
    ASSERT_EQ(wb.size(), 4u);
    const double sum = 1.0 + std::exp(-1.0) + std::exp(-2.0) + std::exp(1.0);
    for (std::size_t r = 0; r < 4; ++r) EXPECT_EQ(wa[r], wb[r]) << "r=" << r;
    EXPECT_NEAR(wa[2], std::exp(-2.0) / sum, 1e-12);
    for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(a.rows()[r].score, b.rows()[r].score);
}

TEST(TOVAHeadOracleTest, TiesEvictTheEarliestNonSink) {
    // All keys 0: every logit is 0, the weights are exactly 1/4 each, and the earliest non-sink goes.
    ref::TOVAHeadOracle tova(1, 3);
    feed_1d(tova, {0.0, 0.0, 0.0, 0.0});
    for (double w : tova.last_weights()) EXPECT_EQ(w, 0.25);
    EXPECT_EQ(tova.positions(), (Positions{0, 2, 3}));
    tova.absorb(v1(0.0), v1(0.0));
    EXPECT_EQ(tova.positions(), (Positions{0, 3, 4}));

    // Tie between two non-adjacent rows with identical keys, the newcomer above them:
    // n_sink = 0, budget = 3, keys 1, 2, 1, then 3: logits 3, 6, 3, 9 -> p0 and p2 tie, p0 goes.
    ref::TOVAHeadOracle tied(0, 3);
    feed_1d(tied, {1.0, 2.0, 1.0, 3.0});
    EXPECT_EQ(tied.positions(), (Positions{1, 2, 3}));
}

TEST(TOVAHeadOracleTest, ResetRestartsAtPositionZero) {
    ref::TOVAHeadOracle tova(1, 2);
    feed_1d(tova, {0.0, 1.0, 2.0});
    ASSERT_EQ(tova.positions().size(), 2u);
    tova.reset();
    EXPECT_TRUE(tova.rows().empty());
    EXPECT_TRUE(tova.last_weights().empty());
    tova.absorb(v1(5.0), v1(0.0));
    EXPECT_EQ(tova.positions(), (Positions{0}));
}

TEST(TOVAHeadOracleTest, RejectsBadInputUnchanged) {
    EXPECT_THROW(ref::TOVAHeadOracle(-1, 3), std::invalid_argument);
    EXPECT_THROW(ref::TOVAHeadOracle(0, 0), std::invalid_argument);
    ref::TOVAHeadOracle tova(1, 3);
    tova.absorb({1.0, 2.0}, {0.0});
    EXPECT_THROW(tova.absorb({}, {0.0}), std::invalid_argument);
    EXPECT_THROW(tova.absorb({1.0}, {0.0}), std::invalid_argument);
    EXPECT_THROW(tova.absorb({1.0, std::nan("")}, {0.0}), std::invalid_argument);
    EXPECT_EQ(tova.positions(), (Positions{0}));
}

// ---------------------------------------------------------------------------------------------
// StreamingLLM
// ---------------------------------------------------------------------------------------------

/// Positions StreamingLLM must retain after token t: {p <= t : p < n_sink or p > t - window}.
Positions expected_streaming(std::int64_t t, std::int64_t n_sink, std::int64_t window) {
    Positions out;
    for (std::int64_t p = 0; p <= t; ++p) {
        if (p < n_sink || p > t - window) out.push_back(p);
    }
    return out;
}

void check_streaming(int n_sink, int window, int n_tokens) {
    std::mt19937 rng(static_cast<unsigned>(11 + n_sink * 31 + window));
    std::normal_distribution<double> dist(0.0, 1.0);
    ref::StreamingLLMHeadOracle stream(n_sink, window);
    Rows keys;
    for (int t = 0; t < n_tokens; ++t) {
        keys.push_back({dist(rng), dist(rng), dist(rng)});
        stream.absorb(keys.back(), v1(static_cast<double>(t)));
        const Positions expected = expected_streaming(t, n_sink, window);
        ASSERT_EQ(stream.positions(), expected) << "n_sink=" << n_sink << " window=" << window << " t=" << t;
        for (const auto& r : stream.rows()) {
            const std::size_t p = static_cast<std::size_t>(r.position);
            EXPECT_EQ(r.key, keys[p]);  // each row keeps its own key and value
            EXPECT_EQ(r.value, v1(static_cast<double>(p)));
            EXPECT_EQ(r.score, 0.0);
        }
        if (t + 1 >= n_sink + window) {
            EXPECT_EQ(stream.rows().size(), static_cast<std::size_t>(n_sink + window));
        }
    }
}

TEST(StreamingLLMHeadOracleTest, KeepsSinksAndLastWindowFor100Tokens) { check_streaming(4, 8, 100); }

TEST(StreamingLLMHeadOracleTest, NoSinks) {
    check_streaming(0, 5, 100);
    // Spelled out: window 2, no sinks -> after token 4 only {3, 4}.
    ref::StreamingLLMHeadOracle stream(0, 2);
    feed_1d(stream, {0.0, 1.0, 2.0, 3.0, 4.0});
    EXPECT_EQ(stream.positions(), (Positions{3, 4}));
}

TEST(StreamingLLMHeadOracleTest, WindowOfOneAndMoreSinksThanTokens) {
    check_streaming(3, 1, 100);
    ref::StreamingLLMHeadOracle stream(6, 2);
    feed_1d(stream, {0.0, 1.0, 2.0, 3.0});
    EXPECT_EQ(stream.positions(), (Positions{0, 1, 2, 3}));
    feed_1d(stream, {4.0, 5.0, 6.0, 7.0, 8.0});
    EXPECT_EQ(stream.positions(), (Positions{0, 1, 2, 3, 4, 5, 7, 8}));
}

TEST(StreamingLLMHeadOracleTest, ResetAndBadInput) {
    EXPECT_THROW(ref::StreamingLLMHeadOracle(-1, 4), std::invalid_argument);
    EXPECT_THROW(ref::StreamingLLMHeadOracle(1, 0), std::invalid_argument);
    ref::StreamingLLMHeadOracle stream(1, 2);
    feed_1d(stream, {0.0, 1.0, 2.0, 3.0});
    EXPECT_EQ(stream.positions(), (Positions{0, 2, 3}));
    EXPECT_THROW(stream.absorb({1.0, 2.0}, {0.0}), std::invalid_argument);
    EXPECT_EQ(stream.positions(), (Positions{0, 2, 3}));
    stream.reset();
    EXPECT_TRUE(stream.rows().empty());
    stream.absorb(v1(9.0), v1(9.0));
    EXPECT_EQ(stream.positions(), (Positions{0}));
}

// ---------------------------------------------------------------------------------------------
// SnapKV
// ---------------------------------------------------------------------------------------------

TEST(SnapKVHeadOracleTest, HandComputedExample) {
    // S = 5, budget = 3, n_sink = 1, obs_window = 2, D = 2, keys s * e (see kSnapE; logit = ln2 * dot(e)).
    // Proxies: the last w = 2 keys, e3 = (1, 1) and e4 = (1, -1). No causal mask: both see all 5 rows.
    //   e3: dots 0, 2, 1, 2, 0  -> 1, 4, 2, 4, 1    / 12 = (7, 28, 14, 28, 7) / 84
    //   e4: dots 0, 2, -1, 0, 2 -> 1, 4, 1/2, 1, 4  / 10.5 = (2, 8, 1, 2, 8) / 21 = (8, 32, 4, 8, 32) / 84
    //   score = mean = (15, 60, 18, 36, 39) / 168 = 0.0893, 0.3571, 0.1071, 0.2143, 0.2321
    // Keep the first min(1, 3) = 1 row (p0, although it scores lowest) and the top 2 others: p1 (60), p4 (39).
    // (A causal mask would give e3 only rows 0..3 and keep p3 instead of p4.)
    ref::SnapKVHeadOracle snap(1, 3, 2);
    EXPECT_FALSE(snap.compressed());
    const Rows values = value_rows(5);
    snap.absorb_call(scaled(kSnapE, kSnapScale), values);
    EXPECT_TRUE(snap.compressed());
    EXPECT_EQ(snap.positions(), (Positions{0, 1, 4}));
    ASSERT_EQ(snap.rows().size(), 3u);
    EXPECT_NEAR(snap.rows()[0].score, 15.0 / 168.0, 1e-12);
    EXPECT_NEAR(snap.rows()[1].score, 60.0 / 168.0, 1e-12);
    EXPECT_NEAR(snap.rows()[2].score, 39.0 / 168.0, 1e-12);
    EXPECT_EQ(snap.rows()[2].value, values[4]);
    EXPECT_EQ(snap.rows()[2].key, scaled(kSnapE, kSnapScale)[4]);
}

TEST(SnapKVHeadOracleTest, ObsWindowLongerThanCallUsesEveryKey) {
    // D = 1, keys s' * (1, 0, -1) with s'^2 = ln2 (logit = ln2 * e_r * e_q), budget 2, n_sink 0.
    //   proxy  1: 2, 1, 1/2 -> (4, 2, 1) / 7;  proxy 0: (1, 1, 1) / 3;  proxy -1: (1, 2, 4) / 7
    //   obs_window 100 -> w = 3: mean = (22, 19, 22) / 63 -> keep p0, p2.
    //   obs_window 1   -> w = 1: (1, 2, 4) / 7          -> keep p1, p2.
    const double s = std::sqrt(std::log(2.0));
    const Rows keys = {v1(s), v1(0.0), v1(-s)};
    ref::SnapKVHeadOracle wide(0, 2, 100);
    wide.absorb_call(keys, value_rows(3));
    EXPECT_EQ(wide.positions(), (Positions{0, 2}));
    EXPECT_NEAR(wide.rows()[0].score, 22.0 / 63.0, 1e-12);
    EXPECT_NEAR(wide.rows()[1].score, 22.0 / 63.0, 1e-12);

    ref::SnapKVHeadOracle narrow(0, 2, 1);
    narrow.absorb_call(keys, value_rows(3));
    EXPECT_EQ(narrow.positions(), (Positions{1, 2}));
    EXPECT_NEAR(narrow.rows()[0].score, 2.0 / 7.0, 1e-12);
    EXPECT_NEAR(narrow.rows()[1].score, 4.0 / 7.0, 1e-12);
}

TEST(SnapKVHeadOracleTest, TiesKeepTheEarliest) {
    // Exact tie by construction (identical keys give bit-identical weights). Units of s, D = 2:
    //   e0 = (0,0), e1 = (1,0), e2 = (0,1), e3 = (1,1), e4 = (1,0) = e1; budget 3, n_sink 1, obs 2.
    //   proxy e3: dots 0,1,1,2,1 -> (1,2,2,4,2)/11;  proxy e4: dots 0,1,0,1,1 -> (1,2,1,2,2)/8
    //   score = (19, 38, 27, 54, 38) / 176: keep p0 (sink), p3 (54), and of the tied p1/p4 (38) p1.
    const Rows e = {{0.0, 0.0}, {1.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}, {1.0, 0.0}};
    ref::SnapKVHeadOracle snap(1, 3, 2);
    snap.absorb_call(scaled(e, kSnapScale), value_rows(5));
    EXPECT_EQ(snap.positions(), (Positions{0, 1, 3}));
    ASSERT_EQ(snap.rows().size(), 3u);
    EXPECT_NEAR(snap.rows()[1].score, 38.0 / 176.0, 1e-12);
    EXPECT_NEAR(snap.rows()[2].score, 54.0 / 176.0, 1e-12);

    // All keys equal: every score is 1/6; the earliest rows survive.
    ref::SnapKVHeadOracle flat(0, 3, 2);
    flat.absorb_call(zero_rows(6, 2), value_rows(6));
    EXPECT_EQ(flat.positions(), (Positions{0, 1, 2}));
    for (const auto& r : flat.rows()) EXPECT_NEAR(r.score, 1.0 / 6.0, 1e-15);
}

TEST(SnapKVHeadOracleTest, CompressesEveryChunkPastTheBudgetWithTheRowsHeldBeforeIt) {
  // budget 3, n_sink 1, obs 2.
  ref::SnapKVHeadOracle snap(1, 3, 2);
  // Call 1: S = 2 <= budget -> appended, positions 0, 1, zero keys (logit 0: weight 1).
  snap.absorb_call(zero_rows(2, 2), value_rows(2));
  EXPECT_FALSE(snap.compressed());
  EXPECT_EQ(snap.positions(), (Positions{0, 1}));
  // Call 2: the hand example (positions 2..6) as a chunk past the budget (SPEC 13.3): the two
  // held rows join its softmaxes. Observers e3 = (1,1): weights [1,1 | 1,4,2,4,1], sum 14;
  // e4 = (1,-1): [1,1 | 1,4,0.5,1,4], sum 12.5. Score = the mean of the two (denominator 700):
  // held rows and e0: 53; e1: 212; e2: 64; e3: 128; e4: 137. Keep position 0 (the sink) and the
  // two best others: e1 (position 3), e4 (position 6).
  snap.absorb_call(scaled(kSnapE, kSnapScale), value_rows(5, 200.0));
  EXPECT_TRUE(snap.compressed());
  EXPECT_EQ(snap.positions(), (Positions{0, 3, 6}));
  ASSERT_EQ(snap.rows().size(), 3u);
  EXPECT_NEAR(snap.rows()[0].score, 53.0 / 700.0, 1e-12);
  EXPECT_NEAR(snap.rows()[1].score, 212.0 / 700.0, 1e-12);
  EXPECT_NEAR(snap.rows()[2].score, 137.0 / 700.0, 1e-12);
  EXPECT_EQ(snap.rows()[2].value, v1(204.0));
  // Call 3: one decode token -> appended at position 7 (past the budget), score 0.
  snap.absorb_call({{1.0, 1.0}}, value_rows(1));
  EXPECT_EQ(snap.positions(), (Positions{0, 3, 6, 7}));
  EXPECT_EQ(snap.rows()[3].score, 0.0);
  // Call 4: a chunk of 2 zero keys: every row held weighs 1/6 (all logits 0 against zero
  // observers), a full tie: the sink and the earliest others stay.
  snap.absorb_call(zero_rows(2, 2), value_rows(2));
  EXPECT_EQ(snap.positions(), (Positions{0, 3, 6}));
  for (const auto& r : snap.rows()) EXPECT_NEAR(r.score, 1.0 / 6.0, 1e-12);

  // reset() restarts positions; a whole prompt in one call is the hand example.
  snap.reset();
  EXPECT_FALSE(snap.compressed());
  EXPECT_TRUE(snap.rows().empty());
  snap.absorb_call(scaled(kSnapE, kSnapScale), value_rows(5));
  EXPECT_TRUE(snap.compressed());
  EXPECT_EQ(snap.positions(), (Positions{0, 1, 4}));
}

TEST(SnapKVHeadOracleTest, CallsWithinTheBudgetAndDecodeStepsAppend) {
  // budget 5: calls of S = 3, 0, 2 leave exactly the budget (not more): appended.
  ref::SnapKVHeadOracle snap(1, 5, 2);
  snap.absorb_call(zero_rows(3, 2), value_rows(3));
  snap.absorb_call({}, {});  // S = 0: nothing changes
  EXPECT_EQ(snap.positions(), (Positions{0, 1, 2}));
  snap.absorb_call(zero_rows(2, 2), value_rows(2));
  EXPECT_FALSE(snap.compressed());
  // Decode steps (S = 1) never compress, even past the budget.
  for (int i = 0; i < 4; ++i) snap.absorb_call(zero_rows(1, 2), value_rows(1));
  EXPECT_FALSE(snap.compressed());
  EXPECT_EQ(snap.positions(), (Positions{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  for (const auto& r : snap.rows()) EXPECT_EQ(r.score, 0.0);
  // The next chunk (S = 2) is compressed with all of them (equal keys: the earliest 5 of 11).
  snap.absorb_call(zero_rows(2, 2), value_rows(2));
  EXPECT_TRUE(snap.compressed());
  EXPECT_EQ(snap.positions(), (Positions{0, 1, 2, 3, 4}));
}

TEST(SnapKVHeadOracleTest, RejectsBadInputUnchanged) {
    EXPECT_THROW(ref::SnapKVHeadOracle(-1, 3, 2), std::invalid_argument);
    EXPECT_THROW(ref::SnapKVHeadOracle(1, 0, 2), std::invalid_argument);
    EXPECT_THROW(ref::SnapKVHeadOracle(1, 3, 0), std::invalid_argument);
    ref::SnapKVHeadOracle snap(1, 3, 2);
    snap.absorb_call(zero_rows(2, 2), value_rows(2));
    EXPECT_THROW(snap.absorb_call(zero_rows(5, 2), value_rows(4)), std::invalid_argument);
    EXPECT_THROW(snap.absorb_call(zero_rows(5, 3), value_rows(5)), std::invalid_argument);
    Rows bad = zero_rows(5, 2);
    bad[3][1] = std::nan("");
    EXPECT_THROW(snap.absorb_call(bad, value_rows(5)), std::invalid_argument);
    EXPECT_FALSE(snap.compressed());
    EXPECT_EQ(snap.positions(), (Positions{0, 1}));
    // A mixed-D call on an empty head is rejected too.
    ref::SnapKVHeadOracle fresh(1, 3, 2);
    EXPECT_THROW(fresh.absorb_call({{1.0, 2.0}, {1.0}}, value_rows(2)), std::invalid_argument);
    EXPECT_TRUE(fresh.rows().empty());
}

}  // namespace
