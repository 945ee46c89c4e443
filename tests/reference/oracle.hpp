/// Naive, independent reference oracle for veloxquant, written only from docs/design.md (sections 3-6, 9).
//
// Purpose: the fast library (include/veloxquant/...) is compared against these functions and
// classes in tests. Everything here is written for clarity, not speed: plain std::vector<double>,
// one token at a time, double precision everywhere, standard library only (no Eigen).
//
// Scoring is pluggable: a token attends with its "query heads", either {its own key} (the key-as-query
// proxy, docs/design.md 3) or its G real query heads (docs/design.md 4.6); mean_head_weights below is
// the one scorer every oracle uses (also TOVA and SnapKV in policy_oracles.hpp). Each oracle class
// models ONE KV head, so a token's real queries arrive as its G query heads: [G][D].
//
// Precision note: the library keeps float32 scores (docs/design.md 4.1) and stores keys at precision T, while
// this oracle is double throughout. Compare scores with a tolerance; compare retained sets only on
// data where no two eviction candidates are near-tied (or where ties are exact by construction).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace veloxquant {
namespace reference {

/// Round to the nearest integer, ties to even (1.5 -> 2, 2.5 -> 2, -0.5 -> 0), independent of the FP rounding mode.
inline std::int64_t round_half_even(double x) {
    if (!std::isfinite(x)) {
        throw std::invalid_argument("round_half_even: non-finite input");
    }
    const double lower = std::floor(x);
    const double frac = x - lower;  // exact in binary floating point, in [0, 1)
    double result = lower;
    if (frac > 0.5) {
        result = lower + 1.0;
    } else if (frac == 0.5) {
        // Exactly half way: pick the even neighbour.
        result = (std::fmod(lower, 2.0) == 0.0) ? lower : lower + 1.0;
    }
    return static_cast<std::int64_t>(result);
}

/// SqueezeAttention per-layer budgets from per-layer concentrations, docs/design.md 5.3, computed literally.
// c: [n_layers], one concentration per layer (in ascending layer order).
inline std::vector<int> squeeze_budgets(const std::vector<double>& c, int avg_budget, int n_sink,
                                        double strength = 1.0) {
    // Step 1. (Resolved ambiguity: the empty-input rule is checked before strength, in the order of docs/design.md.)
    if (c.empty()) {
        return {};
    }
    if (std::isnan(strength) || strength < 0.0 || strength > 1.0) {
        throw std::invalid_argument("squeeze_budgets: strength must be in [0, 1], got " +
                                    std::to_string(strength));
    }
    for (std::size_t i = 0; i < c.size(); ++i) {
        // Not in docs/design.md 5.3; a NaN would make the arithmetic meaningless, so the oracle refuses it.
        if (std::isnan(c[i])) {
            throw std::invalid_argument("squeeze_budgets: NaN concentration at index " +
                                        std::to_string(i));
        }
    }

    // Step 2.
    const int floor_budget = n_sink + 1;
    const std::size_t n = c.size();
    if (n == 1) {
        return {std::max(avg_budget, floor_budget)};
    }

    // Step 3.
    std::vector<double> raw(n);
    double raw_sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
        const double clamped = std::min(1.0, std::max(0.0, c[i]));
        raw[i] = 1.0 - clamped;
        raw_sum += raw[i];
    }
    std::vector<double> w(n, 1.0);
    if (raw_sum > 0.0) {
        for (std::size_t i = 0; i < n; ++i) {
            w[i] = raw[i] * static_cast<double>(n) / raw_sum;
        }
    }

    // Step 4.
    std::vector<int> budgets(n);
    for (std::size_t i = 0; i < n; ++i) {
        const double b = static_cast<double>(avg_budget) * ((1.0 - strength) + strength * w[i]);
        const std::int64_t rounded = round_half_even(b);
        budgets[i] = static_cast<int>(std::max<std::int64_t>(rounded, floor_budget));
    }
    return budgets;
}

/// PyramidKV per-layer budgets (linear ramp + water-filling), docs/design.md 6, computed literally.
inline std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta = 2.0) {
    // (Resolved ambiguity: the n <= 0 and n == 1 rules come before the beta check, in the order of docs/design.md.)
    if (n_layers <= 0) {
        return {};
    }
    const int floor_budget = n_sink + 1;
    if (n_layers == 1) {
        return {std::max(avg_budget, floor_budget)};
    }
    if (!(beta >= 1.0)) {  // also rejects NaN
        throw std::invalid_argument("pyramid_budgets: beta must be >= 1, got " + std::to_string(beta));
    }

    const std::size_t n = static_cast<std::size_t>(n_layers);
    const double avg = static_cast<double>(avg_budget);
    const double fl = static_cast<double>(floor_budget);
    const double span = (avg - fl) * (beta - 1.0);
    const double top = avg + span;
    const double bottom = avg - span;

    std::vector<double> v(n);
    for (std::size_t i = 0; i < n; ++i) {
        v[i] = top + (bottom - top) * static_cast<double>(i) / static_cast<double>(n - 1);
    }

    std::vector<bool> clamped(n, false);
    for (std::size_t pass = 0; pass < n; ++pass) {
        for (std::size_t i = 0; i < n; ++i) {
            if (v[i] < fl) {
                v[i] = fl;
                clamped[i] = true;
            }
        }
        double total = 0.0;
        for (double x : v) total += x;
        const double excess = total - avg * static_cast<double>(n);
        if (excess <= 1e-9) {
            break;
        }
        double slack = 0.0;
        std::size_t n_unclamped = 0;
        for (std::size_t i = 0; i < n; ++i) {
            if (!clamped[i]) {
                slack += v[i] - fl;
                ++n_unclamped;
            }
        }
        if (n_unclamped == 0 || slack <= 1e-9) {
            break;
        }
        for (std::size_t i = 0; i < n; ++i) {
            if (!clamped[i]) {
                v[i] -= excess * (v[i] - fl) / slack;
            }
        }
    }

    std::vector<int> budgets(n);
    for (std::size_t i = 0; i < n; ++i) {
        budgets[i] = static_cast<int>(std::max<std::int64_t>(round_half_even(v[i]), floor_budget));
    }
    return budgets;
}

/// Mean pairwise cosine similarity (diagonal excluded) from the explicit O(n^2 D) Gram matrix, docs/design.md 5.1.
// rows: [n][D], one key per row; all rows must have the same D.
inline double concentration_score_gram(const std::vector<std::vector<double>>& rows) {
    const std::size_t n = rows.size();
    if (n < 2) {
        return 0.0;
    }
    const std::size_t d = rows[0].size();
    for (const auto& r : rows) {
        if (r.size() != d) {
            throw std::invalid_argument("concentration_score_gram: rows of different length");
        }
    }
    // u_i = k_i / (|k_i| + 1e-8)
    std::vector<std::vector<double>> u(n, std::vector<double>(d));  // [n][D]
    for (std::size_t i = 0; i < n; ++i) {
        double sq = 0.0;
        for (std::size_t k = 0; k < d; ++k) sq += rows[i][k] * rows[i][k];
        const double denom = std::sqrt(sq) + 1e-8;
        for (std::size_t k = 0; k < d; ++k) u[i][k] = rows[i][k] / denom;
    }
    // Gram matrix G_ij = u_i . u_j, then the off-diagonal sum.
    std::vector<std::vector<double>> gram(n, std::vector<double>(n, 0.0));  // [n][n]
    for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t j = 0; j < n; ++j) {
            double dot = 0.0;
            for (std::size_t k = 0; k < d; ++k) dot += u[i][k] * u[j][k];
            gram[i][j] = dot;
        }
    }
    double off_diagonal = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t j = 0; j < n; ++j) {
            if (i != j) off_diagonal += gram[i][j];
        }
    }
    return off_diagonal / (static_cast<double>(n) * static_cast<double>(n - 1));
}

/// Clamp a recent-window size to [0, budget - n_sink - 1] (docs/design.md 4.2 step 3); the upper bound is floored at 0.
inline int clamp_recent(long long g, int budget, int n_sink) {
    const long long hi = std::max<long long>(0, static_cast<long long>(budget) - n_sink - 1);
    return static_cast<int>(std::min<long long>(std::max<long long>(g, 0), hi));
}

/// Protected recent rows for SqueezeAttention/PyramidKV: floor(recent_ratio*(budget-n_sink)), clamped (docs/design.md 4.2).
inline int protected_recent_ratio(double recent_ratio, int budget, int n_sink) {
    const double raw = std::floor(recent_ratio * static_cast<double>(budget - n_sink));
    if (!std::isfinite(raw)) {
        throw std::invalid_argument("protected_recent_ratio: non-finite recent_ratio");
    }
    return clamp_recent(static_cast<long long>(raw), budget, n_sink);
}

/// Protected recent rows for H2O: the fixed grace, clamped to [0, budget-n_sink-1] (docs/design.md 4.2).
inline int protected_recent_fixed(int grace, int budget, int n_sink) {
    return clamp_recent(grace, budget, n_sink);
}

/// One retained row of an oracle head: key, value, absolute position and cumulative score.
struct OracleRow {
    std::vector<double> key;    // [D]
    std::vector<double> value;  // [Dv]
    std::int64_t position;
    double score;
};

// ---------------------------------------------------------------------------------------------------
// The scorer, shared by every oracle (here and in policy_oracles.hpp).
//
// A token attends with its "query heads" [G][D]: either {its own key} (the key-as-query proxy,
// docs/design.md 3; G = 1) or its G real query heads (docs/design.md 4.6). Either way the weights
// over a window of keys are the mean over the heads of softmax(q . k_r / sqrt(D)). With the proxy's
// single head the mean is exactly that head's softmax (bit for bit).
// ---------------------------------------------------------------------------------------------------

/// softmax(dot(k_r, q) / sqrt(D)) over the given keys, max-subtracted; shapes are checked by the caller.
// keys: [n][D] (n >= 1), q: [D]; returns [n]
inline std::vector<double> attention_weights(const std::vector<const std::vector<double>*>& keys,
                                             const std::vector<double>& q) {
    const double sqrt_d = std::sqrt(static_cast<double>(q.size()));
    std::vector<double> w(keys.size());  // [n], logits first
    double max_logit = -std::numeric_limits<double>::infinity();
    for (std::size_t r = 0; r < keys.size(); ++r) {
        double dot = 0.0;
        for (std::size_t k = 0; k < q.size(); ++k) dot += (*keys[r])[k] * q[k];
        w[r] = dot / sqrt_d;
        if (w[r] > max_logit) max_logit = w[r];
    }
    double total = 0.0;
    for (std::size_t r = 0; r < w.size(); ++r) {
        w[r] = std::exp(w[r] - max_logit);
        total += w[r];
    }
    for (std::size_t r = 0; r < w.size(); ++r) w[r] /= total;
    return w;
}

/// The scorer: mean over a token's query heads of attention_weights(keys, q_j).
// keys: [n][D] (n >= 1), heads: [G][D] (G >= 1); returns [n]
inline std::vector<double> mean_head_weights(const std::vector<const std::vector<double>*>& keys,
                                             const std::vector<std::vector<double>>& heads) {
    std::vector<double> mean(keys.size(), 0.0);  // [n]
    for (const auto& q : heads) {
        const std::vector<double> a = attention_weights(keys, q);
        for (std::size_t r = 0; r < mean.size(); ++r) mean[r] += a[r];
    }
    for (std::size_t r = 0; r < mean.size(); ++r) mean[r] /= static_cast<double>(heads.size());
    return mean;
}

/// The proxy scorer's query heads for a call: token i attends with {k_i} (G = 1).
// keys: [S][D]; returns [S][1][D]
inline std::vector<std::vector<std::vector<double>>> proxy_queries(const std::vector<std::vector<double>>& keys) {
    std::vector<std::vector<std::vector<double>>> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back({k});
    return out;
}

/// Key-as-query proxy attention (docs/design.md 3): attention_weights of q over rows, with shape checks.
// rows: [n][D], q: [D]; returns [n] (empty when n == 0). Throws if D == 0 or a row's D differs from q's.
inline std::vector<double> proxy_softmax(const std::vector<std::vector<double>>& rows,
                                         const std::vector<double>& q) {
    if (q.empty()) throw std::invalid_argument("proxy_softmax: empty query (D == 0)");
    std::vector<const std::vector<double>*> keys;  // [n][D]
    for (std::size_t r = 0; r < rows.size(); ++r) {
        if (rows[r].size() != q.size()) {
            throw std::invalid_argument("proxy_softmax: row " + std::to_string(r) + " has D = " +
                                        std::to_string(rows[r].size()) + ", query has D = " +
                                        std::to_string(q.size()));
        }
        keys.push_back(&rows[r]);
    }
    return attention_weights(keys, q);
}

namespace oracle_detail {

/// (D, Dv) of the retained rows, or empty when the head holds none.
using Dims = std::optional<std::pair<std::size_t, std::size_t>>;

inline Dims dims_of(const std::vector<OracleRow>& rows) {
    if (rows.empty()) return std::nullopt;
    return std::make_pair(rows.front().key.size(), rows.front().value.size());
}

/// Throws std::invalid_argument naming the token and index if any entry of v is NaN or infinite.
// v: [D]
inline void check_finite(const char* who, const char* what, std::size_t token, const std::vector<double>& v) {
    for (std::size_t k = 0; k < v.size(); ++k) {
        if (!std::isfinite(v[k])) {
            throw std::invalid_argument(std::string(who) + ": non-finite " + what + " of token " +
                                        std::to_string(token) + " at index " + std::to_string(k));
        }
    }
}

/// Checks one row: key non-empty and finite, key/value dims equal to dims if given. Values are not inspected.
// key: [D], value: [Dv]
inline void check_row(const char* who, std::size_t token, const std::vector<double>& key,
                      const std::vector<double>& value, const Dims& dims) {
    if (key.empty()) {
        throw std::invalid_argument(std::string(who) + ": empty key (D == 0) for token " + std::to_string(token));
    }
    check_finite(who, "key", token, key);
    if (dims && (key.size() != dims->first || value.size() != dims->second)) {
        throw std::invalid_argument(std::string(who) + ": token " + std::to_string(token) + " has D = " +
                                    std::to_string(key.size()) + ", Dv = " + std::to_string(value.size()) +
                                    ", expected D = " + std::to_string(dims->first) + ", Dv = " +
                                    std::to_string(dims->second));
    }
}

/// Checks a token's query heads: G >= 1 (== g_expected unless 0), each [D] like the key, finite.
// key: [D], heads: [G][D]
inline void check_heads(const char* who, std::size_t token, const std::vector<double>& key,
                        const std::vector<std::vector<double>>& heads, std::size_t g_expected) {
    if (heads.empty()) {
        throw std::invalid_argument(std::string(who) + ": token " + std::to_string(token) + " has G = 0 query heads");
    }
    if (g_expected != 0 && heads.size() != g_expected) {
        throw std::invalid_argument(std::string(who) + ": token " + std::to_string(token) + " has G = " +
                                    std::to_string(heads.size()) + ", expected " + std::to_string(g_expected));
    }
    for (std::size_t j = 0; j < heads.size(); ++j) {
        if (heads[j].size() != key.size()) {
            throw std::invalid_argument(std::string(who) + ": query head " + std::to_string(j) + " of token " +
                                        std::to_string(token) + " has D = " + std::to_string(heads[j].size()) +
                                        ", key has D = " + std::to_string(key.size()));
        }
        check_finite(who, "query", token, heads[j]);
    }
}

/// Checks a whole call before anything changes: equal S, then every token (same D/Dv as earlier rows and
/// as the call's first token, the same G for every token).
// keys: [S][D], values: [S][Dv], queries: [S][G][D]
inline void check_call(const char* who, const std::vector<std::vector<double>>& keys,
                       const std::vector<std::vector<double>>& values,
                       const std::vector<std::vector<std::vector<double>>>& queries, Dims dims) {
    if (keys.size() != values.size() || keys.size() != queries.size()) {
        throw std::invalid_argument(std::string(who) + ": S differs: " + std::to_string(keys.size()) + " keys, " +
                                    std::to_string(values.size()) + " values, " + std::to_string(queries.size()) +
                                    " query tokens");
    }
    for (std::size_t i = 0; i < keys.size(); ++i) {
        check_row(who, i, keys[i], values[i], dims);
        check_heads(who, i, keys[i], queries[i], queries[0].size());
        if (!dims) dims = std::make_pair(keys[i].size(), values[i].size());
    }
}

/// Positions of rows, in row order.
inline std::vector<std::int64_t> positions_of(const std::vector<OracleRow>& rows) {
    std::vector<std::int64_t> out;
    out.reserve(rows.size());
    for (const auto& r : rows) out.push_back(r.position);
    return out;
}

/// Row bookkeeping shared by every oracle head: retained rows in ascending position, the next position.
class HeadRows {
public:
    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return positions_of(rows_); }

    /// The scores of the retained rows, in row order (what each policy keeps in OracleRow::score).
    std::vector<double> scores() const {
        std::vector<double> out;
        out.reserve(rows_.size());
        for (const auto& r : rows_) out.push_back(r.score);
        return out;
    }

    /// The position the next absorbed token will take (tokens absorbed since the last reset).
    std::int64_t next_position() const { return next_position_; }

protected:
    /// Append one row at the next position.
    void append(const std::vector<double>& key, const std::vector<double>& value, double score) {
        rows_.push_back(OracleRow{key, value, next_position_, score});
        ++next_position_;
    }

    /// Pointers to the keys of rows_[0 .. n).
    // returns: [n][D]
    std::vector<const std::vector<double>*> window_keys(std::size_t n) const {
        std::vector<const std::vector<double>*> out;
        out.reserve(n);
        for (std::size_t r = 0; r < n; ++r) out.push_back(&rows_[r].key);
        return out;
    }

    /// Forget all rows and restart at position 0.
    void clear_rows() {
        rows_.clear();
        next_position_ = 0;
    }

    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
};

}  // namespace oracle_detail

/// One head of the H2O core (SqueezeAttention, H2O, PyramidKV; docs/design.md 4.1, 4.2, 4.5, 4.6).
//
// Two scorers, one state (rows, budget, re-budget, victim selection):
//  * absorb(key, value): the key-as-query proxy, one token at a time (docs/design.md 4.2):
//    1. empty head: append with score 1.0, no attention;
//    2. a = softmax(k_t . k_r / sqrt(D)) over the retained rows (NOT the token itself); every retained
//       row gets score = score * decay + a_r; append the token with score 0;
//    3. if over a known budget, evict at most one row (see evict_one).
//  * absorb_call(keys, values, queries): real queries, one call at a time (docs/design.md 4.6):
//    1. append the call's S rows with score 0;
//    2. for each token i of the call in arrival order: a = mean over its G query heads of
//       softmax(q . k_r / sqrt(D)) over exactly the rows retained before the call plus the call's rows
//       0..i; every row in that window gets score = score * decay + a_r (call rows after i untouched);
//    3. once per call, if the budget is known: evict_one until the head holds at most `budget` rows.
//  evict_one: the lowest-score row that is neither a sink (position < n_sink) nor among the newest g
//  rows, ties to the earliest position; none when only such rows are left (only possible when the
//  head holds more sinks than budget - g): the head then stays over budget.
//
// Resolved ambiguities of the 4.6 path:
//  * Empty head: 4.2 step 1 gives the first row score 1.0 with no attention; 4.6 has no such rule.
//    The 4.6 rule runs literally: the first token's window is just itself, softmax over one row is 1,
//    so its score is 0 * decay + 1 = 1.0 -- the same number.
//  * "evict ... until it fits": a literal one-at-a-time loop, the protected set recomputed before each
//    eviction. Computing it once per call would give the same result: a victim is never among the
//    newest g rows, so after an eviction the newest g rows are the very same rows; sinks are fixed.
//  * S = 0 (empty keys, values and queries): nothing changes (docs/design.md 8). Inconsistent S among
//    keys / values / queries throws.
//  * G: every token of a call must bring the same G >= 1 query heads (Hq is one tensor dimension).
//    Across calls G may change: the design only fixes B, H and D across calls.
//  * Queries are checked for finiteness like keys; values are not inspected (docs/design.md 8). All
//    checks precede any change (strong guarantee).
//
// The query-free scorers of docs/design.md 4.7 (set_scorer; absorb only, absorb_call is unchanged):
//  * knorm: the token is appended with score -|k|; over budget, evict_one ranks by the scores.
//  * keydiff: the token is appended with score 1 / (|k| + 1e-8); over budget, evict_one ranks the
//    rows by rank(): -(u_r . m) with u_r = k_r / (|k_r| + 1e-8) and m the mean of the u_r over
//    the rows held (the library divides by |m| + 1e-8, which changes no order). A re-budget
//    (set_budget) ranks by rank() too (the library's re-budget at the start of a call without
//    queries; a head fed with queries, by absorb_call, keeps the key-as-query scorer).
//    Scores never change under either scorer.
class H2OHeadOracle : public oracle_detail::HeadRows {
public:
    /// How absorb scores (docs/design.md 4.7): the key-as-query proxy of 4.2, KeyDiff or K-norm.
    enum class Scorer { key_as_query, keydiff, knorm };
    /// KVCacheConfig::proxy_scoring of a scorer.
    static const char* scorer_name(Scorer s) {
      switch (s) {
        case Scorer::keydiff:
          return "keydiff";
        case Scorer::knorm:
          return "knorm";
        case Scorer::key_as_query:
          break;
      }
      return "key_as_query";
    }

    /// Choose absorb's scorer (key_as_query unless set).
    void set_scorer(Scorer s) { scorer_ = s; }

    /// KVCacheConfig::value_norm_power (docs/design.md 4.8): when p > 0, the evictions of
    /// absorb_call (a call with queries) and of set_budget (which then stands for the re-budget
    /// at the start of a call with queries) rank by score * |v|^p, |v| the L2 norm of the value.
    void set_value_power(double p) { value_power_ = p; }
    double value_power() const { return value_power_; }

    /// What an eviction ranks by, per row: rank(), or score * |v|^p (set_value_power) when
    /// value-weighted (the evictions of a call with queries).
    std::vector<double> eviction_rank(bool value_weighted) const {
        if (!value_weighted) return rank();
        std::vector<double> out;
        for (const auto& r : rows_) out.push_back(r.score * std::pow(norm_of(r.value), value_power_));
        return out;
    }

    /// What an eviction ranks by, per row (lowest goes first): the scores, or under keydiff
    /// -(u_r . m), computed from the keys (not from the scores). The library's ranking divides
    /// that by |m| + 1e-8, a positive factor common to all rows that changes no order; left out
    /// here so that gaps read in the units of the library's error (a few 1e-7 absolute), which
    /// stays meaningful when m nearly vanishes (keys that cancel out), where the divided values
    /// are rounding noise blown up.
    std::vector<double> rank() const {
        std::vector<double> out;
        for (const auto& r : rows_) out.push_back(r.score);
        if (scorer_ != Scorer::keydiff || rows_.empty()) return out;
        const std::size_t d = rows_.front().key.size();
        std::vector<std::vector<double>> unit;
        std::vector<double> mean(d, 0.0);
        for (const auto& r : rows_) {
            const double norm = norm_of(r.key) + 1e-8;
            std::vector<double> u(d);
            for (std::size_t k = 0; k < d; ++k) u[k] = r.key[k] / norm;
            for (std::size_t k = 0; k < d; ++k) mean[k] += u[k] / static_cast<double>(rows_.size());
            unit.push_back(std::move(u));
        }
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            double dot = 0.0;
            for (std::size_t k = 0; k < d; ++k) dot += unit[r][k] * mean[k];
            out[r] = -dot;
        }
        return out;
    }

    /// Build an empty head; grace_for_budget maps a budget to g (the result is clamped again per docs/design.md 4.2).
    H2OHeadOracle(int n_sink, double decay, std::function<int(int budget)> grace_for_budget)
        : n_sink_(n_sink), decay_(decay), grace_for_budget_(std::move(grace_for_budget)) {
        if (n_sink < 0) throw std::invalid_argument("H2OHeadOracle: n_sink must be >= 0");
        if (!(decay > 0.0 && decay <= 1.0)) throw std::invalid_argument("H2OHeadOracle: decay must be in (0, 1]");
        if (!grace_for_budget_) throw std::invalid_argument("H2OHeadOracle: grace_for_budget is empty");
    }

    /// Make the budget known (or change it); docs/design.md 4.5 re-budget if the head holds more rows than
    /// budget: keep the sinks, the newest g rows (g for the new budget) and the highest scores up to the
    /// budget; among equal scores the later positions survive. Order preserved, scores untouched.
    void set_budget(int budget) {
        if (budget < 1) {
            throw std::invalid_argument("H2OHeadOracle: budget must be >= 1, got " + std::to_string(budget));
        }
        budget_ = budget;
        const std::size_t n = rows_.size();
        const std::size_t budget_sz = static_cast<std::size_t>(budget);
        if (n <= budget_sz) return;  // a larger (or sufficient) budget is just stamped
        // Under set_value_power this is a re-budget at the start of a call with queries.
        const std::vector<double> score = eviction_rank(value_power_ > 0.0);

        // Protected: sinks and the newest g rows.
        const std::size_t g = static_cast<std::size_t>(grace(budget));
        std::vector<bool> keep(n, false);
        std::size_t n_kept = 0;
        std::vector<std::size_t> others;
        for (std::size_t i = 0; i < n; ++i) {
            if (rows_[i].position < n_sink_ || i + g >= n) {
                keep[i] = true;
                ++n_kept;
            } else {
                others.push_back(i);
            }
        }
        // Remaining slots go to the highest scores; among equal scores the later position wins.
        std::sort(others.begin(), others.end(), [&](std::size_t x, std::size_t y) {
            if (score[x] != score[y]) return score[x] > score[y];
            return rows_[x].position > rows_[y].position;
        });
        for (std::size_t k = 0; k < others.size() && n_kept < budget_sz; ++k, ++n_kept) keep[others[k]] = true;

        std::vector<OracleRow> kept;
        for (std::size_t i = 0; i < n; ++i) {
            if (keep[i]) kept.push_back(rows_[i]);
        }
        rows_.swap(kept);
    }

    /// The budget if known (empty until set_budget is called).
    std::optional<int> budget() const { return budget_; }

    /// Absorb one token with the key-as-query proxy (docs/design.md 4.2, see the class comment).
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        oracle_detail::check_row("H2OHeadOracle", 0, key, value, oracle_detail::dims_of(rows_));

        if (scorer_ != Scorer::key_as_query) {
            const double norm = norm_of(key);
            append(key, value, scorer_ == Scorer::knorm ? -norm : 1.0 / (norm + 1e-8));
            if (over_budget()) evict_one();
            return;
        }

        // Step 1: empty head.
        if (rows_.empty()) {
            append(key, value, 1.0);
            return;
        }
        // Step 2: the proxy's single query head {key} over the retained rows (not itself).
        accumulate(mean_head_weights(window_keys(rows_.size()), {key}));
        append(key, value, 0.0);

        // Step 3: evict at most one row if over a known budget.
        if (over_budget()) evict_one();
    }

    /// Absorb one call of S tokens with their real queries (docs/design.md 4.6, see the class comment).
    // keys: [S][D], values: [S][Dv], queries: [S][G][D] (token i's G query heads)
    void absorb_call(const std::vector<std::vector<double>>& keys, const std::vector<std::vector<double>>& values,
                     const std::vector<std::vector<std::vector<double>>>& queries) {
        oracle_detail::check_call("H2OHeadOracle", keys, values, queries, oracle_detail::dims_of(rows_));
        const std::size_t s = keys.size();
        if (s == 0) return;

        // Step 1: append every row of the call with score 0.
        const std::size_t n_before = rows_.size();
        for (std::size_t i = 0; i < s; ++i) append(keys[i], values[i], 0.0);

        // Step 2: token by token; token i's window is rows_[0 .. n_before + i] (the token included).
        for (std::size_t i = 0; i < s; ++i) accumulate(mean_head_weights(window_keys(n_before + i + 1), queries[i]));

        // Step 3: once per call, evict one row at a time until within a known budget (by score,
        // or by score * |v|^p under set_value_power).
        while (over_budget() && evict_one(value_power_ > 0.0)) {
        }
    }

    /// Forget all rows and restart at position 0 (the budget, if known, is kept).
    void reset() { clear_rows(); }

private:
    /// g for a budget: the caller's rule, clamped to [0, budget - n_sink - 1].
    int grace(int budget) const { return clamp_recent(grace_for_budget_(budget), budget, n_sink_); }

    /// Decayed accumulation over a window: rows_[r].score = score * decay + a[r] for r < a.size().
    // a: [window]
    void accumulate(const std::vector<double>& a) {
        for (std::size_t r = 0; r < a.size(); ++r) rows_[r].score = rows_[r].score * decay_ + a[r];
    }

    /// True if the budget is known and the head holds more rows.
    bool over_budget() const { return budget_ && rows_.size() > static_cast<std::size_t>(*budget_); }

    /// Evict the lowest-score row that is neither a sink nor among the newest g(budget) rows (ties: the
    /// earliest position); false if there is none. Requires a known budget.
    bool evict_one(bool value_weighted = false) {
        const std::size_t n = rows_.size();
        const std::size_t g = static_cast<std::size_t>(grace(*budget_));
        const std::vector<double> score = eviction_rank(value_weighted);
        std::optional<std::size_t> victim;
        for (std::size_t i = 0; i < n; ++i) {
            const bool is_sink = rows_[i].position < n_sink_;
            const bool is_recent = i + g >= n;
            if (is_sink || is_recent) continue;
            // Strict '<' while scanning in ascending position: ties go to the earliest position.
            if (!victim || score[i] < score[*victim]) victim = i;
        }
        if (!victim) return false;
        rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(*victim));
        return true;
    }

    static double norm_of(const std::vector<double>& x) {
        double s = 0.0;
        for (double v : x) s += v * v;
        return std::sqrt(s);
    }

    int n_sink_;
    double decay_;
    std::function<int(int)> grace_for_budget_;
    std::optional<int> budget_;
    Scorer scorer_ = Scorer::key_as_query;
    double value_power_ = 0.0;
};

/// The Python reference's per-token algorithm (docs/design.md 4.3, 9.1): no decay, no protected window, fixed budget.
//
// Written as its own loop (it does not call H2OHeadOracle) so that it is a second, independent
// oracle. With recent_ratio 0 (g = 0) and decay 1, the design's core (H2OHeadOracle with the same
// budget set from the start) must retain exactly the same positions with the same scores.
// Once full, every retained non-sink row has positive mass and the newcomer has 0, so this
// algorithm evicts the newest token every step ("freezes" on the first `budget` tokens).
class ReferenceAlgorithmHeadOracle {
public:
    /// Build an empty head with a budget fixed from the start.
    ReferenceAlgorithmHeadOracle(int n_sink, int budget) : n_sink_(n_sink), budget_(budget) {
        if (n_sink < 0) throw std::invalid_argument("ReferenceAlgorithmHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("ReferenceAlgorithmHeadOracle: budget must be >= 1");
    }

    /// Absorb one token: proxy attention over retained rows, add mass (no decay), append at 0, evict lowest non-sink.
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        if (key.empty()) throw std::invalid_argument("ReferenceAlgorithmHeadOracle: empty key");
        if (!rows_.empty() && key.size() != rows_.front().key.size()) {
            throw std::invalid_argument("ReferenceAlgorithmHeadOracle: key dimension changed");
        }
        const std::int64_t pos = next_position_++;
        if (rows_.empty()) {
            rows_.push_back(OracleRow{key, value, pos, 1.0});
            return;
        }

        // Attention of the new key over the retained rows.
        const std::size_t n = rows_.size();
        const double scale = std::sqrt(static_cast<double>(key.size()));
        std::vector<double> weights(n);  // [n]
        double max_logit = -std::numeric_limits<double>::infinity();
        for (std::size_t r = 0; r < n; ++r) {
            double dot = 0.0;
            for (std::size_t k = 0; k < key.size(); ++k) dot += rows_[r].key[k] * key[k];
            weights[r] = dot / scale;
            if (weights[r] > max_logit) max_logit = weights[r];
        }
        double total = 0.0;
        for (std::size_t r = 0; r < n; ++r) {
            weights[r] = std::exp(weights[r] - max_logit);
            total += weights[r];
        }
        for (std::size_t r = 0; r < n; ++r) {
            rows_[r].score += weights[r] / total;  // no decay
        }
        rows_.push_back(OracleRow{key, value, pos, 0.0});

        if (static_cast<int>(rows_.size()) > budget_) {
            // Lowest score among non-sinks; the newest row is a candidate too. Ties: earliest.
            std::ptrdiff_t victim = -1;
            for (std::size_t i = 0; i < rows_.size(); ++i) {
                if (rows_[i].position < n_sink_) continue;
                if (victim < 0 || rows_[i].score < rows_[static_cast<std::size_t>(victim)].score) {
                    victim = static_cast<std::ptrdiff_t>(i);
                }
            }
            if (victim >= 0) rows_.erase(rows_.begin() + victim);
        }
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const {
        std::vector<std::int64_t> out;
        for (const auto& r : rows_) out.push_back(r.position);
        return out;
    }

    /// Cumulative scores of the retained rows, in row order.
    std::vector<double> scores() const {
        std::vector<double> out;
        for (const auto& r : rows_) out.push_back(r.score);
        return out;
    }

private:
    int n_sink_;
    int budget_;
    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
};

}  // namespace reference
}  // namespace veloxquant
