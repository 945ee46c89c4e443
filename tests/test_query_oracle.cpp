// Self-tests of the oracles' real-query scorer (tests/reference/oracle.hpp, policy_oracles.hpp) against hand-computed facts
// from docs/design.md 4.5, 4.6 and 6, so that the oracles can be trusted when the fast caches' real-query
// path (update_and_fetch(keys, values, queries)) is compared against them.
//
// Most examples use the scale kC below: with every key and query written as kC * e (e small integer
// vectors, D = 2), logit = kC^2 * dot(e_k, e_q) / sqrt(2) = ln(2) * dot(e_k, e_q), so each exp(logit)
// is a power of two and every softmax is a ratio of small integers (up to exp/log rounding, far below
// the 1e-12 tolerance).

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "reference/oracle.hpp"          // H2OHeadOracle (proxy and real queries)
#include "reference/policy_oracles.hpp"  // TOVAHeadOracle, SnapKVHeadOracle (proxy and real queries)

namespace {

namespace ref = veloxquant::reference;
using Positions = std::vector<std::int64_t>;
using Vec = std::vector<double>;
using Rows = std::vector<Vec>;           // [n][D]
using Queries = std::vector<Rows>;       // [S][G][D]

const double kC = std::sqrt(std::sqrt(2.0) * std::log(2.0));
constexpr double kTol = 1e-12;

/// kC * (x, y): a D = 2 key or query in units where logits are ln(2) * dot.
Vec c2(double x, double y) { return Vec{kC * x, kC * y}; }

/// n value rows of dimension 1: {100}, {101}, ...
// returns: [n][1]
Rows value_rows(std::size_t n) {
    Rows out;
    for (std::size_t i = 0; i < n; ++i) out.push_back(Vec{100.0 + static_cast<double>(i)});
    return out;
}

/// A grace rule returning g for every budget.
std::function<int(int)> fixed_grace(int g) {
    return [g](int) { return g; };
}

/// Expect two score vectors to agree element-wise within kTol.
void expect_scores(const std::vector<double>& actual, const std::vector<double>& expected) {
    ASSERT_EQ(actual.size(), expected.size());
    for (std::size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], kTol) << "row " << i;
}

// ---------------------------------------------------------------------------------------------------
// The issue's example: B = H = 1, G = 2, D = 2, three tokens, decay 0.5, no rows before.
//   keys (units of kC):  k0 = (0,0)   k1 = (1,0)   k2 = (0,1)
//   queries: token 0: (1,0), (0,1)   token 1: (1,0), (0,1)   token 2: (1,1), (0,2)
// Token 0, window {0}: any softmax over one row is 1, so a = [1]; s0 = 0 * 0.5 + 1 = 1.
// Token 1, window {0, 1} (row 2 untouched):
//   head (1,0): dots [0, 1] -> exps [1, 2] -> [1/3, 2/3]
//   head (0,1): dots [0, 0] -> [1/2, 1/2]
//   mean a = [5/12, 7/12];  s0 = 1 * 0.5 + 5/12 = 11/12,  s1 = 0 * 0.5 + 7/12 = 7/12,  s2 = 0
// Token 2, window {0, 1, 2}:
//   head (1,1): dots [0, 1, 1] -> exps [1, 2, 2] -> [1/5, 2/5, 2/5]
//   head (0,2): dots [0, 0, 2] -> exps [1, 1, 4] -> [1/6, 1/6, 4/6]
//   mean a = [11/60, 17/60, 32/60]
//   s0 = 11/12 * 0.5 + 11/60 = 55/120 + 22/120 = 77/120
//   s1 =  7/12 * 0.5 + 17/60 = 35/120 + 34/120 = 69/120
//   s2 =     0 * 0.5 + 32/60 =                  64/120
// Check: the scores sum to 1 + 0.5 * (1 + 0.5 * 1) ... = 0.5 * 1.5 + 1 = 1.75 = 210/120.
const Rows kIssueKeys = {c2(0, 0), c2(1, 0), c2(0, 1)};
const Queries kIssueQueries = {{c2(1, 0), c2(0, 1)}, {c2(1, 0), c2(0, 1)}, {c2(1, 1), c2(0, 2)}};
const std::vector<double> kIssueScores = {77.0 / 120.0, 69.0 / 120.0, 64.0 / 120.0};

TEST(H2OHeadOracleQueriesTest, IssueExampleOneCall) {
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    head.absorb_call(kIssueKeys, value_rows(3), kIssueQueries);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    EXPECT_EQ(head.next_position(), 3);
    expect_scores(head.scores(), kIssueScores);
    EXPECT_NEAR(head.scores()[0] + head.scores()[1] + head.scores()[2], 1.75, kTol);
    EXPECT_EQ(head.rows()[2].value, (Vec{102.0}));  // values travel with their keys
}

TEST(H2OHeadOracleQueriesTest, IssueExampleIntermediateScores) {
    // The first two tokens alone: s0 = 11/12, s1 = 7/12 (see the derivation above).
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    head.absorb_call(Rows{kIssueKeys[0], kIssueKeys[1]}, value_rows(2), Queries{kIssueQueries[0], kIssueQueries[1]});
    expect_scores(head.scores(), {11.0 / 12.0, 7.0 / 12.0});
}

TEST(H2OHeadOracleQueriesTest, IssueExampleAsThreeOneTokenCallsGivesTheSameScores) {
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    for (std::size_t i = 0; i < 3; ++i) {
        head.absorb_call(Rows{kIssueKeys[i]}, Rows{Vec{100.0 + static_cast<double>(i)}}, Queries{kIssueQueries[i]});
    }
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2}));
    expect_scores(head.scores(), kIssueScores);

    ref::H2OHeadOracle one_call(0, 0.5, fixed_grace(0));
    one_call.absorb_call(kIssueKeys, value_rows(3), kIssueQueries);
    expect_scores(head.scores(), one_call.scores());
}

TEST(H2OHeadOracleQueriesTest, FirstTokenOnAnEmptyHeadScoresOne) {
    // docs/design.md 4.2 step 1 gives 1.0; the 4.6 rule gives 0 * decay + softmax over one row = 1 as well.
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    head.absorb_call(Rows{c2(3, -2)}, value_rows(1), Queries{{c2(7, 1), c2(-4, 2)}});
    expect_scores(head.scores(), {1.0});
}

// ---------------------------------------------------------------------------------------------------
// Eviction once per call, after all of its tokens are scored. G = 1, D = 2, decay 1, n_sink 1,
// g = 1, budget 3. Five tokens:
//   keys (kC units): k0 = (0,0)  k1 = (1,0)  k2 = (0,1)  k3 = (0,0)  k4 = (0,0)
//   queries:         q0 = (0,0)  q1 = (0,0)  q2 = (0,0)  q3 = (0,3)  q4 = (3,0)
// ONE call of five tokens (no eviction until all five are scored):
//   t0 {0}:         a = [1]                      s = [1]
//   t1 {0,1}:       a = [1/2, 1/2]               s = [3/2, 1/2]
//   t2 {0,1,2}:     a = [1/3, 1/3, 1/3]          s = [11/6, 5/6, 1/3]
//   t3 {0..3}:      dots [0,0,3,0] -> exps [1,1,8,1] / 11
//                                                s = [11/6+1/11, 5/6+1/11, 1/3+8/11, 1/11]
//   t4 {0..4}:      dots [0,3,0,0,0] -> exps [1,8,1,1,1] / 12
//     s0 = 11/6 + 1/11 + 1/12 = 265/132
//     s1 =  5/6 + 1/11 + 8/12 = 210/132 (= 35/22)
//     s2 =  1/3 + 8/11 + 1/12 = 151/132
//     s3 =        1/11 + 1/12 =  23/132
//     s4 =               1/12 =  11/132           (sum 660/132 = 5 tokens' mass)
//   Then evict 2 rows: row 0 is a sink, row 4 the newest g = 1; candidates {1, 2, 3}:
//   evict 3 (23/132), then 2 (151/132)  ->  retained {0, 1, 4}.
// FIVE one-token calls (eviction after each):
//   after t3 the head holds 4 rows: candidates {1, 2}: s1 = 5/6+1/11 < s2 = 1/3+8/11 -> evict 1.
//   t4 over {0, 2, 3, 4}: all dots with q4 are 0 -> a = 1/4 each;
//     s0 = 11/6+1/11+1/4, s2 = 1/3+8/11+1/4, s3 = 1/11+1/4, s4 = 1/4; candidates {2, 3}: evict 3
//   -> retained {0, 2, 4}.
const Rows kEvictKeys = {c2(0, 0), c2(1, 0), c2(0, 1), c2(0, 0), c2(0, 0)};
const Queries kEvictQueries = {{c2(0, 0)}, {c2(0, 0)}, {c2(0, 0)}, {c2(0, 3)}, {c2(3, 0)}};

TEST(H2OHeadOracleQueriesTest, EvictsOncePerCallAfterScoring) {
    ref::H2OHeadOracle head(1, 1.0, fixed_grace(1));
    head.set_budget(3);
    head.absorb_call(kEvictKeys, value_rows(5), kEvictQueries);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 4}));
    expect_scores(head.scores(), {265.0 / 132.0, 210.0 / 132.0, 11.0 / 132.0});
    EXPECT_EQ(head.next_position(), 5);
    EXPECT_EQ(head.rows()[1].value, (Vec{101.0}));
}

TEST(H2OHeadOracleQueriesTest, OneTokenCallsEvictAfterEachToken) {
    ref::H2OHeadOracle head(1, 1.0, fixed_grace(1));
    head.set_budget(3);
    for (std::size_t i = 0; i < 5; ++i) {
        head.absorb_call(Rows{kEvictKeys[i]}, Rows{Vec{100.0 + static_cast<double>(i)}}, Queries{kEvictQueries[i]});
        EXPECT_LE(head.rows().size(), 3u);
    }
    EXPECT_EQ(head.positions(), (Positions{0, 2, 4}));
    expect_scores(head.scores(), {11.0 / 6.0 + 1.0 / 11.0 + 0.25, 1.0 / 3.0 + 8.0 / 11.0 + 0.25, 0.25});
}

TEST(H2OHeadOracleQueriesTest, NoBudgetKeepsEverythingAndSetBudgetTrimsLikeTheCallEnd) {
    ref::H2OHeadOracle head(1, 1.0, fixed_grace(1));
    EXPECT_FALSE(head.budget().has_value());
    head.absorb_call(kEvictKeys, value_rows(5), kEvictQueries);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 2, 3, 4}));
    expect_scores(head.scores(), {265.0 / 132.0, 210.0 / 132.0, 151.0 / 132.0, 23.0 / 132.0, 11.0 / 132.0});

    // docs/design.md 4.5 with budget 3, g = 1: keep sink 0, newest 4, and the best of {1, 2, 3} (row 1).
    head.set_budget(3);
    ASSERT_TRUE(head.budget().has_value());
    EXPECT_EQ(*head.budget(), 3);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 4}));
    expect_scores(head.scores(), {265.0 / 132.0, 210.0 / 132.0, 11.0 / 132.0});  // scores not reset

    // Budget 2: g = 1 is clamped to [0, 2 - 1 - 1] = 0, so the newest row is no longer protected:
    // keep sink 0 and the best of {1, 4} (row 1, 210/132 > 11/132).
    head.set_budget(2);
    EXPECT_EQ(head.positions(), (Positions{0, 1}));

    // A larger budget is just stamped.
    head.set_budget(10);
    EXPECT_EQ(head.positions(), (Positions{0, 1}));
    EXPECT_EQ(*head.budget(), 10);
}

// ---------------------------------------------------------------------------------------------------
// Exact ties from one-hot attention: D = 4, key r = M e_r, token r's query = M e_r with M = 100.
// Logits are M^2 / 2 = 5000 on the own row and 0 elsewhere: exp(-5000) underflows to exactly 0, so
// each token puts exactly mass 1 on its own row. With decay 1 all four rows end with score exactly 1.
Rows onehot_rows(std::size_t n, double m) {
    Rows out(n, Vec(4, 0.0));
    for (std::size_t i = 0; i < n; ++i) out[i][i] = m;
    return out;
}

TEST(H2OHeadOracleQueriesTest, TiesEvictTheEarliestPosition) {
    const Rows keys = onehot_rows(4, 100.0);
    Queries queries;
    for (const auto& k : keys) queries.push_back(Rows{k});

    ref::H2OHeadOracle head(0, 1.0, fixed_grace(0));
    head.set_budget(2);
    head.absorb_call(keys, value_rows(4), queries);
    // All four scores are 1; no sinks, g = 0: evict positions 0 then 1.
    EXPECT_EQ(head.positions(), (Positions{2, 3}));
    EXPECT_EQ(head.scores(), (std::vector<double>{1.0, 1.0}));

    // With one sink: evict 1 then 2.
    ref::H2OHeadOracle sunk(1, 1.0, fixed_grace(0));
    sunk.set_budget(2);
    sunk.absorb_call(keys, value_rows(4), queries);
    EXPECT_EQ(sunk.positions(), (Positions{0, 3}));

    // docs/design.md 4.5 trim on the same tie: later positions survive.
    ref::H2OHeadOracle late(0, 1.0, fixed_grace(0));
    late.absorb_call(keys, value_rows(4), queries);
    EXPECT_EQ(late.scores(), (std::vector<double>{1.0, 1.0, 1.0, 1.0}));
    late.set_budget(2);
    EXPECT_EQ(late.positions(), (Positions{2, 3}));
}

TEST(H2OHeadOracleQueriesTest, DecayAppliesPerToken) {
    // The one-hot setup with decay 0.5: row r gets 1 at token r, then halves at each later token.
    const Rows keys = onehot_rows(4, 100.0);
    Queries queries;
    for (const auto& k : keys) queries.push_back(Rows{k});
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    head.absorb_call(keys, value_rows(4), queries);
    EXPECT_EQ(head.scores(), (std::vector<double>{0.125, 0.25, 0.5, 1.0}));
}

// ---------------------------------------------------------------------------------------------------
// G = 1 and queries equal to the keys, one-token calls, no budget, against the key-as-query
// H2OHeadOracle. The only difference is the window: the query oracle's token i also attends to itself.
// With l_r = k_r . k_i / sqrt(D) over the retained rows r < i, Z = sum_r exp(l_r), e = exp(l_ii):
//   proxy (H2OHeadOracle):  a_r = exp(l_r) / Z,            new row's score 0
//   query oracle:           a'_r = exp(l_r) / (Z + e) = a_r (1 - w),   new row's score w = e / (Z + e)
// so after token i:  q_r = decay * q_r(before) + a_r (1 - w)  and  q_i = w, where a_r is recovered from
// H2OHeadOracle as  a_r = p_r(after) - decay * p_r(before).
TEST(H2OHeadOracleQueriesTest, QueriesEqualToKeysDifferFromKeyAsQueryOnlyBySelfAttention) {
    const double decay = 0.9;
    const std::size_t d = 3;
    std::mt19937 rng(12345);
    std::normal_distribution<double> normal(0.0, 1.0);

    ref::H2OHeadOracle proxy(0, decay, fixed_grace(0));
    ref::H2OHeadOracle query(0, decay, fixed_grace(0));
    Rows seen;  // keys so far, [i][D]
    for (std::size_t i = 0; i < 8; ++i) {
        Vec key(d);
        for (auto& x : key) x = normal(rng);
        const std::vector<double> p_before = proxy.scores();
        const std::vector<double> q_before = query.scores();
        proxy.absorb(key, Vec{0.0});
        query.absorb_call(Rows{key}, Rows{Vec{0.0}}, Queries{Rows{key}});

        const std::vector<double> p_after = proxy.scores();
        const std::vector<double> q_after = query.scores();
        ASSERT_EQ(q_after.size(), i + 1);
        ASSERT_EQ(p_after.size(), i + 1);
        if (i == 0) {
            EXPECT_NEAR(q_after[0], 1.0, kTol);
            EXPECT_NEAR(p_after[0], 1.0, kTol);
        } else {
            // Self weight w, computed inline: 1 / (1 + sum_r exp(l_r - l_ii)).
            double self_dot = 0.0;
            for (std::size_t k = 0; k < d; ++k) self_dot += key[k] * key[k];
            double denom = 1.0;
            for (const auto& kr : seen) {
                double dot = 0.0;
                for (std::size_t k = 0; k < d; ++k) dot += kr[k] * key[k];
                denom += std::exp((dot - self_dot) / std::sqrt(static_cast<double>(d)));
            }
            const double w = 1.0 / denom;
            EXPECT_GT(w, 1e-3);  // the relation below is a real difference, not a rounding
            EXPECT_EQ(p_after[i], 0.0);
            EXPECT_NEAR(q_after[i], w, kTol);
            for (std::size_t r = 0; r < i; ++r) {
                const double a_r = p_after[r] - decay * p_before[r];
                EXPECT_NEAR(q_after[r], decay * q_before[r] + a_r * (1.0 - w), kTol) << "token " << i << " row " << r;
            }
        }
        seen.push_back(key);
    }
}

// ---------------------------------------------------------------------------------------------------
TEST(H2OHeadOracleQueriesTest, RejectsBadInputWithoutChangingState) {
    ref::H2OHeadOracle head(0, 0.5, fixed_grace(0));
    head.absorb_call(kIssueKeys, value_rows(3), kIssueQueries);
    const Positions positions = head.positions();
    const std::vector<double> scores = head.scores();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();

    // S differs among keys / values / queries.
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0), c2(0, 1)}, value_rows(1), Queries{{c2(0, 0)}, {c2(0, 0)}}),
                 std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0), c2(0, 1)}, value_rows(2), Queries{{c2(0, 0)}}),
                 std::invalid_argument);
    // G = 0, and G varying inside a call.
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0)}, value_rows(1), Queries{Rows{}}), std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0), c2(0, 1)}, value_rows(2), Queries{{c2(0, 0)}, {c2(0, 0), c2(1, 1)}}),
                 std::invalid_argument);
    // Query D differs from key D (the second head, so a check of head 0 only would miss it).
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0)}, value_rows(1), Queries{{c2(0, 0), Vec{1.0, 2.0, 3.0}}}),
                 std::invalid_argument);
    // Non-finite query (in the second token, so the first token's rows must not be appended).
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0), c2(0, 1)}, value_rows(2), Queries{{c2(0, 0)}, {Vec{0.0, nan}}}),
                 std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0)}, value_rows(1), Queries{{Vec{inf, 0.0}}}), std::invalid_argument);
    // Non-finite key, empty key, key D or value Dv different from the retained rows.
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0), Vec{nan, 0.0}}, value_rows(2), Queries{{c2(0, 0)}, {c2(0, 0)}}),
                 std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{Vec{}}, value_rows(1), Queries{{Vec{}}}), std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{Vec{1.0, 2.0, 3.0}}, value_rows(1), Queries{{Vec{1.0, 2.0, 3.0}}}),
                 std::invalid_argument);
    EXPECT_THROW(head.absorb_call(Rows{c2(1, 0)}, Rows{Vec{1.0, 2.0}}, Queries{{c2(0, 0)}}), std::invalid_argument);
    // Bad budget.
    EXPECT_THROW(head.set_budget(0), std::invalid_argument);

    EXPECT_EQ(head.positions(), positions);
    EXPECT_EQ(head.scores(), scores);
    EXPECT_EQ(head.next_position(), 3);
    EXPECT_FALSE(head.budget().has_value());

    // S = 0 changes nothing; a non-finite value is not inspected (docs/design.md 8).
    head.absorb_call(Rows{}, Rows{}, Queries{});
    EXPECT_EQ(head.positions(), positions);
    EXPECT_EQ(head.scores(), scores);
    EXPECT_NO_THROW(head.absorb_call(Rows{c2(1, 0)}, Rows{Vec{nan}}, Queries{{c2(0, 0)}}));
    EXPECT_EQ(head.next_position(), 4);

    // G may change from one call to the next.
    EXPECT_NO_THROW(head.absorb_call(Rows{c2(1, 0)}, value_rows(1), Queries{{c2(0, 0), c2(1, 0), c2(0, 1)}}));

    EXPECT_THROW(ref::H2OHeadOracle(-1, 0.5, fixed_grace(0)), std::invalid_argument);
    EXPECT_THROW(ref::H2OHeadOracle(0, 0.0, fixed_grace(0)), std::invalid_argument);
    EXPECT_THROW(ref::H2OHeadOracle(0, 1.5, fixed_grace(0)), std::invalid_argument);
    EXPECT_THROW(ref::H2OHeadOracle(0, 0.5, std::function<int(int)>{}), std::invalid_argument);
}

TEST(H2OHeadOracleQueriesTest, ResetRestartsPositionsAndKeepsTheBudget) {
    ref::H2OHeadOracle head(1, 1.0, fixed_grace(1));
    head.set_budget(3);
    head.absorb_call(kEvictKeys, value_rows(5), kEvictQueries);
    head.reset();
    EXPECT_TRUE(head.rows().empty());
    EXPECT_EQ(head.next_position(), 0);
    ASSERT_TRUE(head.budget().has_value());
    EXPECT_EQ(*head.budget(), 3);
    head.absorb_call(kEvictKeys, value_rows(5), kEvictQueries);
    EXPECT_EQ(head.positions(), (Positions{0, 1, 4}));
}

// ---------------------------------------------------------------------------------------------------
// TOVA with queries: n_sink 1, budget 2, G = 2, D = 2 (kC units).
//   t0: k (0,0); t1: k (1,0): within budget, nothing computed.
//   t2: k (0,1), queries (1,0), (0,0), rows {0, 1, 2}:
//     head (1,0): dots [0,1,0] -> [1,2,1]/4;  head (0,0): [1/3, 1/3, 1/3]
//     a = [7/24, 10/24, 7/24]; non-sinks {1, 2}: evict 2 (the token itself)  -> {0, 1}
//     (the key-as-query proxy k2 = (0,1) gives [1/4, 1/4, 1/2] and evicts 1 instead)
//   t3: k (1,1), queries (0,1), (0,1), rows {0, 1, 3}: dots [0,0,1] -> a = [1/4, 1/4, 1/2]
//     row 0 ties row 1 but is a sink: evict 1  -> {0, 3}
//   t4: k (0,0), queries (0,0), (0,0): uniform 1/3 over {0, 3, 4}; tie 3 vs 4: evict 3 -> {0, 4}
TEST(TOVAHeadOracleQueriesTest, HandExample) {
    ref::TOVAHeadOracle head(1, 2);
    head.absorb(c2(0, 0), Vec{100.0}, Rows{c2(5, 5), c2(-5, 5)});
    head.absorb(c2(1, 0), Vec{101.0}, Rows{c2(5, 5), c2(-5, 5)});
    EXPECT_EQ(head.positions(), (Positions{0, 1}));
    EXPECT_TRUE(head.last_weights().empty());

    head.absorb(c2(0, 1), Vec{102.0}, Rows{c2(1, 0), c2(0, 0)});
    EXPECT_EQ(head.positions(), (Positions{0, 1}));
    expect_scores(head.last_weights(), {7.0 / 24.0, 10.0 / 24.0, 7.0 / 24.0});

    head.absorb(c2(1, 1), Vec{103.0}, Rows{c2(0, 1), c2(0, 1)});
    EXPECT_EQ(head.positions(), (Positions{0, 3}));
    expect_scores(head.last_weights(), {0.25, 0.25, 0.5});

    head.absorb(c2(0, 0), Vec{104.0}, Rows{c2(0, 0), c2(0, 0)});
    EXPECT_EQ(head.positions(), (Positions{0, 4}));
    EXPECT_EQ(head.rows()[1].value, (Vec{104.0}));

    // Contrast: the key-as-query TOVA oracle evicts row 1 at t2.
    ref::TOVAHeadOracle proxy(1, 2);
    proxy.absorb(c2(0, 0), Vec{100.0});
    proxy.absorb(c2(1, 0), Vec{101.0});
    proxy.absorb(c2(0, 1), Vec{102.0});
    EXPECT_EQ(proxy.positions(), (Positions{0, 2}));
}

TEST(TOVAHeadOracleQueriesTest, RejectsBadInputAndResets) {
    ref::TOVAHeadOracle head(0, 1);
    head.absorb(c2(1, 0), Vec{1.0}, Rows{c2(0, 0)});
    EXPECT_THROW(head.absorb(c2(1, 0), Vec{1.0}, Rows{}), std::invalid_argument);
    EXPECT_THROW(head.absorb(c2(1, 0), Vec{1.0}, Rows{Vec{1.0}}), std::invalid_argument);
    EXPECT_THROW(head.absorb(c2(1, 0), Vec{1.0}, Rows{Vec{0.0, std::nan("")}}), std::invalid_argument);
    EXPECT_THROW(head.absorb(Vec{1.0, std::nan("")}, Vec{1.0}, Rows{c2(0, 0)}), std::invalid_argument);
    EXPECT_EQ(head.positions(), (Positions{0}));
    head.reset();
    EXPECT_TRUE(head.rows().empty());
    head.absorb(c2(1, 0), Vec{1.0}, Rows{c2(0, 0)});
    EXPECT_EQ(head.positions(), (Positions{0}));
    EXPECT_THROW(ref::TOVAHeadOracle(0, 0), std::invalid_argument);
    EXPECT_THROW(ref::TOVAHeadOracle(-1, 2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------------
// SnapKV with queries: n_sink 1, budget 3, obs_window 2, S = 5, G = 2, D = 2 (kC units).
//   keys: k0 = (0,0)  k1 = (1,0)  k2 = (0,1)  k3 = (1,1)  k4 = (0,0)
//   only tokens 3 and 4 observe (w = 2); tokens 0-2 get queries that would change the result if used.
//   token 3: (1,0): dots [0,1,0,1,0] -> [1,2,1,2,1]/7      (0,0): [1,1,1,1,1]/5
//   token 4: (0,1): dots [0,0,1,1,0] -> [1,1,2,2,1]/7      (0,2): [1,1,4,4,1]/11
//   score = mean of the four (denominator 4 * 385 = 1540; 1/7 = 55/385, 1/5 = 77/385, 1/11 = 35/385):
//     row0: 55 + 77 + 55 +  35 = 222      row1: 110 + 77 +  55 +  35 = 277
//     row2: 55 + 77 + 110 + 140 = 382     row3: 110 + 77 + 110 + 140 = 437     row4: 222
//   keep row 0 (first min(1, 3) rows) + top 2 of {1..4}: rows 3, 2  -> {0, 2, 3}
//   (the key-as-query proxies k3, k4 give row1 = row2 = 0.2, row3 = 0.3, row4 = 0.15 -> {0, 1, 3})
const Rows kSnapKeys = {c2(0, 0), c2(1, 0), c2(0, 1), c2(1, 1), c2(0, 0)};
const Queries kSnapQueries = {{c2(3, 0), c2(3, 0)}, {c2(3, 0), c2(3, 0)}, {c2(3, 0), c2(0, -3)},
                              {c2(1, 0), c2(0, 0)}, {c2(0, 1), c2(0, 2)}};

TEST(SnapKVHeadOracleQueriesTest, HandExample) {
    ref::SnapKVHeadOracle head(1, 3, 2);
    head.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);
    EXPECT_TRUE(head.compressed());
    EXPECT_EQ(head.positions(), (Positions{0, 2, 3}));
    ASSERT_EQ(head.rows().size(), 3u);
    EXPECT_NEAR(head.rows()[0].score, 222.0 / 1540.0, kTol);
    EXPECT_NEAR(head.rows()[1].score, 382.0 / 1540.0, kTol);
    EXPECT_NEAR(head.rows()[2].score, 437.0 / 1540.0, kTol);
    EXPECT_EQ(head.rows()[1].value, (Vec{102.0}));

    ref::SnapKVHeadOracle proxy(1, 3, 2);
    proxy.absorb_call(kSnapKeys, value_rows(5));
    EXPECT_EQ(proxy.positions(), (Positions{0, 1, 3}));
}

TEST(SnapKVHeadOracleQueriesTest, ObservationWindowAndTies) {
    // Budget 2, w = 2: keep row 0 and the best other, row 3 (437/1540).
    ref::SnapKVHeadOracle two(1, 2, 2);
    two.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);
    EXPECT_EQ(two.positions(), (Positions{0, 3}));

    // Budget 2, w = 1: only token 4 observes; rows 2 and 3 tie exactly at (2/7 + 4/11) / 2
    // (their logits against (0,1) and (0,2) are identical), so the earlier, row 2, is kept.
    ref::SnapKVHeadOracle one(1, 2, 1);
    one.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);
    EXPECT_EQ(one.positions(), (Positions{0, 2}));
    EXPECT_NEAR(one.rows()[1].score, (2.0 / 7.0 + 4.0 / 11.0) / 2.0, kTol);

    // All queries zero: uniform 1/5 everywhere, a full tie: keep the earliest others.
    const Queries zero(5, Rows{c2(0, 0), c2(0, 0)});
    ref::SnapKVHeadOracle flat(1, 3, 2);
    flat.absorb_call(kSnapKeys, value_rows(5), zero);
    EXPECT_EQ(flat.positions(), (Positions{0, 1, 2}));
}

// A chunk past the budget ranks the rows held before it too (SPEC 13.3). Two zero keys held
// (positions 0, 1: logit 0, weight 1 under any query), then the hand example as a chunk
// (positions 2..6), whose softmaxes now also count the two held rows:
//   token 3: (1,0): [1,1 | 1,2,1,2,1]/9      (0,0): [1,1 | 1,1,1,1,1]/7
//   token 4: (0,1): [1,1 | 1,1,2,2,1]/9      (0,2): [1,1 | 1,1,4,4,1]/13
//   score = mean of the four (denominator 4 * 819 = 3276; 1/9 = 91/819, 1/7 = 117/819,
//   1/13 = 63/819): held rows, row0 and row4: 362; row1: 453; row2: 642; row3: 733
//   keep position 0 (the sink) + the top 2 others: row3 (position 5), row2 (position 4).
TEST(SnapKVHeadOracleQueriesTest, CompressesEveryChunkPastTheBudgetWithTheRowsHeldBeforeIt) {
  ref::SnapKVHeadOracle head(1, 3, 2);
  const Queries zero2(2, Rows{c2(0, 0), c2(0, 0)});
  // S = 2 within the budget: appended.
  head.absorb_call(Rows{c2(0, 0), c2(0, 0)}, value_rows(2), zero2);
  EXPECT_FALSE(head.compressed());
  EXPECT_EQ(head.positions(), (Positions{0, 1}));
  head.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);
  EXPECT_TRUE(head.compressed());
  EXPECT_EQ(head.positions(), (Positions{0, 4, 5}));
  ASSERT_EQ(head.rows().size(), 3u);
  EXPECT_NEAR(head.rows()[0].score, 362.0 / 3276.0, kTol);
  EXPECT_NEAR(head.rows()[1].score, 642.0 / 3276.0, kTol);
  EXPECT_NEAR(head.rows()[2].score, 733.0 / 3276.0, kTol);
  // A decode step appends, past the budget.
  head.absorb_call(Rows{c2(1, 1)}, value_rows(1), Queries{{c2(0, 0), c2(0, 0)}});
  EXPECT_EQ(head.positions(), (Positions{0, 4, 5, 7}));
  EXPECT_EQ(head.rows()[3].score, 0.0);
  // A chunk of 2 with zero queries: every row held weighs 1/6, a full tie: the earliest stay.
  head.absorb_call(Rows{c2(0, 0), c2(0, 0)}, value_rows(2), zero2);
  EXPECT_EQ(head.positions(), (Positions{0, 4, 5}));
  for (const auto& r : head.rows()) EXPECT_NEAR(r.score, 1.0 / 6.0, kTol);

  head.reset();
  EXPECT_FALSE(head.compressed());
  head.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);
  EXPECT_EQ(head.positions(), (Positions{0, 2, 3}));
}

TEST(SnapKVHeadOracleQueriesTest, RejectsBadInputWithoutChangingState) {
    ref::SnapKVHeadOracle head(1, 3, 2);
    Queries bad_d = kSnapQueries;
    bad_d[4][1] = Vec{1.0};
    EXPECT_THROW(head.absorb_call(kSnapKeys, value_rows(5), bad_d), std::invalid_argument);
    Queries bad_g = kSnapQueries;
    bad_g[2].pop_back();
    EXPECT_THROW(head.absorb_call(kSnapKeys, value_rows(5), bad_g), std::invalid_argument);
    Queries bad_nan = kSnapQueries;
    bad_nan[0][0][1] = std::nan("");
    EXPECT_THROW(head.absorb_call(kSnapKeys, value_rows(5), bad_nan), std::invalid_argument);
    EXPECT_THROW(head.absorb_call(kSnapKeys, value_rows(4), kSnapQueries), std::invalid_argument);
    EXPECT_TRUE(head.rows().empty());
    EXPECT_FALSE(head.compressed());
    head.absorb_call(kSnapKeys, value_rows(5), kSnapQueries);  // positions start at 0: nothing was consumed
    EXPECT_EQ(head.positions(), (Positions{0, 2, 3}));
    EXPECT_THROW(ref::SnapKVHeadOracle(0, 3, 0), std::invalid_argument);
}

}  // namespace
