/// Naive, independent reference oracles for real-query scoring ("observed attention", docs/design.md 4.6),
/// written only from docs/design.md sections 3, 4 and 6: one KV head each of the H2O core, TOVA and SnapKV.
//
// Purpose: when an engine passes its queries ([B, Hq, S, D], Hq = G * H, query head j belongs to KV
// head j / G), the fast caches are compared against these classes. Like oracle.hpp and
// policy_oracles.hpp, everything here is written for clarity, not speed: plain std::vector<double>,
// one token at a time (one call at a time where the rule is a per-call rule), double precision
// throughout, standard library only. Each class models ONE KV head, so a token's queries arrive as
// its G query heads: [G][D].
//
// Precision note: the library keeps float32 scores and stores keys at precision T; this oracle is
// double throughout. Compare scores with a tolerance, and retained sets only on data without
// near-ties (or with ties that are exact by construction, e.g. one-hot attention from huge logits
// whose other weights underflow to exactly 0, or identical logits).
//
// Resolved ambiguities (each is also noted where it applies):
//  * H2O core, empty head: docs/design.md 4.2 step 1 gives the first row score 1.0 with no attention; the design
//    4.6 has no such rule. Here the 4.6 rule runs literally: the first token's window is just
//    itself, softmax over one row is 1, so its score is 0 * decay + 1 = 1.0 -- the same number.
//  * H2O core, eviction in 4.6 step 3 "evict ... until it fits": a literal one-at-a-time loop. The
//    protected set (sinks and the newest g rows) is recomputed before each eviction. Computing it
//    once per call would give the same result: a victim is never among the newest g rows, so after
//    an eviction the newest g rows are the very same rows; sinks are fixed by position.
//  * H2O core, no evictable row (only when the head holds more sinks than budget - g): the loop
//    stops and the head stays over budget, like oracle.hpp's H2OHeadOracle.
//  * S = 0 (empty keys, values and queries): nothing changes, per docs/design.md 8. Inconsistent S among
//    keys / values / queries throws.
//  * G: every token of a call must bring the same G >= 1 query heads (Hq is one tensor dimension).
//    Across calls G is not required to stay the same: the design only fixes B, H and D across calls,
//    and a per-head oracle cannot tell; the mean over G heads is taken per token either way.
//  * Queries are checked for finiteness like keys (a non-finite query would make every weight of its
//    window NaN); values are not inspected (docs/design.md 8). All checks precede any change (strong guarantee).
//  * TOVA with queries: the weights are computed only when the head is over budget (as in docs/design.md 6),
//    but the token's queries are validated on every absorb.
//  * SnapKV with queries: as in policy_oracles.hpp, only the first call (since construction or reset)
//    with S > budget is compressed; earlier calls with S <= budget and every later call append. The
//    softmax runs over the call's S rows only (rows retained from earlier calls are neither attended
//    nor evicted), and "the first min(n_sink, budget) rows" are the first rows of that call.
//    The score is the mean over the w = min(obs_window, S) last tokens AND their G query heads, i.e.
//    a plain mean over w * G softmax rows (equal to the mean over tokens of the per-token head mean).
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

#include "oracle.hpp"  // OracleRow, clamp_recent

namespace veloxquant {
namespace reference {

namespace query_detail {

/// softmax(dot(K_r, q) / sqrt(D)) over the given keys, max-subtracted; shapes are checked by the caller.
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

/// Mean over a token's G query heads of attention_weights(keys, q_j).
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

/// Checks one token: key non-empty and finite, key/value dims equal to (d, dv) if given, queries [G][D].
// key: [D], value: [Dv], heads: [G][D]; g_expected == 0 means "any G >= 1".
inline void check_token(const char* who, std::size_t token, const std::vector<double>& key,
                        const std::vector<double>& value, const std::vector<std::vector<double>>& heads,
                        const std::optional<std::pair<std::size_t, std::size_t>>& dims, std::size_t g_expected) {
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

/// Checks a whole call before anything changes: equal S, then every token (same D/Dv as earlier rows, same G).
// keys: [S][D], values: [S][Dv], queries: [S][G][D]; existing: any retained row, or nullptr.
inline void check_call(const char* who, const std::vector<std::vector<double>>& keys,
                       const std::vector<std::vector<double>>& values,
                       const std::vector<std::vector<std::vector<double>>>& queries, const OracleRow* existing) {
    if (keys.size() != values.size() || keys.size() != queries.size()) {
        throw std::invalid_argument(std::string(who) + ": S differs: " + std::to_string(keys.size()) + " keys, " +
                                    std::to_string(values.size()) + " values, " + std::to_string(queries.size()) +
                                    " query tokens");
    }
    std::optional<std::pair<std::size_t, std::size_t>> dims;
    if (existing != nullptr) dims = std::make_pair(existing->key.size(), existing->value.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        check_token(who, i, keys[i], values[i], queries[i], dims, queries[0].size());
        if (!dims) dims = std::make_pair(keys[i].size(), values[i].size());
    }
}

/// Positions of rows, in row order.
inline std::vector<std::int64_t> positions_of(const std::vector<OracleRow>& rows) {
    std::vector<std::int64_t> out;
    for (const auto& r : rows) out.push_back(r.position);
    return out;
}

}  // namespace query_detail

/// One KV head of the H2O core (SqueezeAttention, H2O, PyramidKV) with real-query scoring (docs/design.md 4.6).
//
// absorb_call, literally:
//  1. append the call's S rows with score 0;
//  2. for each token i of the call in arrival order: a = mean over its G query heads of
//     softmax(q . k_r / sqrt(D)) over exactly the rows retained before the call plus the call's rows
//     0..i; every row in that window gets score = score * decay + a_r (call rows after i untouched);
//  3. once per call, if the budget is known: evict the lowest-score row that is neither a sink
//     (position < n_sink) nor among the newest g rows, ties to the earliest position, one at a time
//     until the head holds at most `budget` rows.
class H2OQueryHeadOracle {
public:
    /// An empty head; grace_for_budget maps a budget to g (clamped again to [0, budget - n_sink - 1]).
    H2OQueryHeadOracle(int n_sink, double decay, std::function<int(int budget)> grace_for_budget)
        : n_sink_(n_sink), decay_(decay), grace_for_budget_(std::move(grace_for_budget)) {
        if (n_sink < 0) throw std::invalid_argument("H2OQueryHeadOracle: n_sink must be >= 0");
        if (!(decay > 0.0 && decay <= 1.0)) throw std::invalid_argument("H2OQueryHeadOracle: decay must be in (0, 1]");
        if (!grace_for_budget_) throw std::invalid_argument("H2OQueryHeadOracle: grace_for_budget is empty");
    }

    /// Make the budget known (or change it); docs/design.md 4.5 re-budget if the head holds more rows than budget:
    /// keep the sinks, the newest g rows (g for the new budget) and the highest scores up to the budget;
    /// among equal scores the later positions survive. Order preserved, scores untouched.
    void set_budget(int budget) {
        if (budget < 1) {
            throw std::invalid_argument("H2OQueryHeadOracle: budget must be >= 1, got " + std::to_string(budget));
        }
        budget_ = budget;
        const std::size_t n = rows_.size();
        const std::size_t budget_sz = static_cast<std::size_t>(budget);
        if (n <= budget_sz) return;  // a larger (or sufficient) budget is just stamped

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
        // Best first: higher score, then (equal scores) the later position.
        std::sort(others.begin(), others.end(), [this](std::size_t x, std::size_t y) {
            if (rows_[x].score != rows_[y].score) return rows_[x].score > rows_[y].score;
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

    /// Absorb one call of S tokens with their queries (see the class comment). S = 0 changes nothing.
    // keys: [S][D], values: [S][Dv], queries: [S][G][D] (token i's G query heads)
    void absorb_call(const std::vector<std::vector<double>>& keys, const std::vector<std::vector<double>>& values,
                     const std::vector<std::vector<std::vector<double>>>& queries) {
        query_detail::check_call("H2OQueryHeadOracle", keys, values, queries,
                                 rows_.empty() ? nullptr : &rows_.front());
        const std::size_t s = keys.size();
        if (s == 0) return;

        // Step 1: append every row of the call with score 0.
        const std::size_t n_before = rows_.size();
        for (std::size_t i = 0; i < s; ++i) {
            rows_.push_back(OracleRow{keys[i], values[i], next_position_, 0.0});
            ++next_position_;
        }

        // Step 2: token by token; token i's window is rows_[0 .. n_before + i] (a prefix, ascending position).
        for (std::size_t i = 0; i < s; ++i) {
            const std::size_t window = n_before + i + 1;
            std::vector<const std::vector<double>*> window_keys;  // [window][D]
            for (std::size_t r = 0; r < window; ++r) window_keys.push_back(&rows_[r].key);
            const std::vector<double> a = query_detail::mean_head_weights(window_keys, queries[i]);  // [window]
            for (std::size_t r = 0; r < window; ++r) rows_[r].score = rows_[r].score * decay_ + a[r];
        }

        // Step 3: once per call, evict one row at a time until within a known budget.
        if (!budget_) return;
        const std::size_t budget_sz = static_cast<std::size_t>(*budget_);
        while (rows_.size() > budget_sz) {
            // The protected set is recomputed for each eviction, as the words read. (Computing the newest g
            // once per call is the same: a victim is never among the newest g, so they stay the same rows.)
            const std::size_t n = rows_.size();
            const std::size_t g = static_cast<std::size_t>(grace(*budget_));
            std::optional<std::size_t> victim;
            for (std::size_t r = 0; r < n; ++r) {
                const bool is_sink = rows_[r].position < n_sink_;
                const bool is_recent = r + g >= n;
                if (is_sink || is_recent) continue;
                // Ascending scan with strict '<': among equal scores the earliest position is evicted.
                if (!victim || rows_[r].score < rows_[*victim].score) victim = r;
            }
            if (!victim) break;  // only sinks and protected rows left: the head stays over budget
            rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(*victim));
        }
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return query_detail::positions_of(rows_); }

    /// Cumulative scores of the retained rows, in row order.
    std::vector<double> scores() const {
        std::vector<double> out;
        for (const auto& r : rows_) out.push_back(r.score);
        return out;
    }

    /// The position the next absorbed token will take (tokens absorbed since the last reset).
    std::int64_t next_position() const { return next_position_; }

    /// Forget all rows and restart at position 0 (the budget, if known, is kept).
    void reset() {
        rows_.clear();
        next_position_ = 0;
    }

private:
    /// g for a budget: the caller's rule, clamped to [0, budget - n_sink - 1].
    int grace(int budget) const { return clamp_recent(grace_for_budget_(budget), budget, n_sink_); }

    int n_sink_;
    double decay_;
    std::function<int(int)> grace_for_budget_;
    std::optional<int> budget_;
    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
};

/// One TOVA head (docs/design.md 6) scored with the token's real queries instead of its key.
//
// Per token i: append row i; if the head now holds more than `budget` rows, a = mean over the token's
// G query heads of softmax(q . k_r / sqrt(D)) over every row including row i itself; evict the
// lowest-a non-sink row (position >= n_sink), ties to the earliest position. Memoryless: OracleRow::score
// records the weight of the latest eviction (0 when the latest token ran none).
class TOVAQueryHeadOracle {
public:
    /// An empty head; n_sink >= 0, budget >= 1.
    TOVAQueryHeadOracle(int n_sink, int budget) : n_sink_(n_sink), budget_(budget) {
        if (n_sink < 0) throw std::invalid_argument("TOVAQueryHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("TOVAQueryHeadOracle: budget must be >= 1");
    }

    /// Absorb one token with its G query heads: append, and if over budget evict at most one row.
    // key: [D], value: [Dv], queries: [G][D]
    void absorb(const std::vector<double>& key, const std::vector<double>& value,
                const std::vector<std::vector<double>>& queries) {
        std::optional<std::pair<std::size_t, std::size_t>> dims;
        if (!rows_.empty()) dims = std::make_pair(rows_.front().key.size(), rows_.front().value.size());
        query_detail::check_token("TOVAQueryHeadOracle", 0, key, value, queries, dims, 0);

        for (auto& r : rows_) r.score = 0.0;
        last_weights_.clear();
        rows_.push_back(OracleRow{key, value, next_position_, 0.0});
        ++next_position_;
        if (rows_.size() <= static_cast<std::size_t>(budget_)) return;

        std::vector<const std::vector<double>*> all_keys;  // [n][D], row i included
        for (const auto& r : rows_) all_keys.push_back(&r.key);
        last_weights_ = query_detail::mean_head_weights(all_keys, queries);  // [n]
        for (std::size_t r = 0; r < rows_.size(); ++r) rows_[r].score = last_weights_[r];

        std::optional<std::size_t> victim;
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            if (rows_[r].position < n_sink_) continue;
            if (!victim || last_weights_[r] < last_weights_[*victim]) victim = r;  // ties: earliest
        }
        if (victim) rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(*victim));
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return query_detail::positions_of(rows_); }

    /// Weights of the latest eviction over all budget + 1 rows before it (row order); empty if none ran.
    // returns: [budget + 1] or [0]
    std::vector<double> last_weights() const { return last_weights_; }

    /// Forget all rows and restart at position 0.
    void reset() {
        rows_.clear();
        last_weights_.clear();
        next_position_ = 0;
    }

private:
    int n_sink_;
    int budget_;
    std::vector<OracleRow> rows_;
    std::vector<double> last_weights_;
    std::int64_t next_position_ = 0;
};

/// One SnapKV head (docs/design.md 6) whose observation window uses the real queries instead of the keys.
//
// On the first call (since construction or reset) with S > budget: w = min(obs_window, S);
// score_r = mean over the last w tokens and each token's G query heads of softmax(q . k_r / sqrt(D))
// over all S rows of the call (no causal mask); keep the call's first min(n_sink, budget) rows plus the
// (budget - sinks) highest-score other call rows (equal scores: the earlier position wins), order
// preserved. Kept rows carry their score in OracleRow::score. Every other call appends (score 0).
class SnapKVQueryHeadOracle {
public:
    /// An empty head; n_sink >= 0, budget >= 1, obs_window >= 1.
    SnapKVQueryHeadOracle(int n_sink, int budget, int obs_window)
        : n_sink_(n_sink), budget_(budget), obs_window_(obs_window) {
        if (n_sink < 0) throw std::invalid_argument("SnapKVQueryHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("SnapKVQueryHeadOracle: budget must be >= 1");
        if (obs_window < 1) throw std::invalid_argument("SnapKVQueryHeadOracle: obs_window must be >= 1");
    }

    /// Absorb one call of S tokens with their queries (S = 0: nothing changes).
    // keys: [S][D], values: [S][Dv], queries: [S][G][D]
    void absorb_call(const std::vector<std::vector<double>>& keys, const std::vector<std::vector<double>>& values,
                     const std::vector<std::vector<std::vector<double>>>& queries) {
        query_detail::check_call("SnapKVQueryHeadOracle", keys, values, queries,
                                 rows_.empty() ? nullptr : &rows_.front());
        const std::size_t s = keys.size();
        const std::int64_t first_position = next_position_;
        next_position_ += static_cast<std::int64_t>(s);

        if (compressed_ || s <= static_cast<std::size_t>(budget_)) {
            for (std::size_t i = 0; i < s; ++i) {
                rows_.push_back(OracleRow{keys[i], values[i], first_position + static_cast<std::int64_t>(i), 0.0});
            }
            return;
        }

        // Scores: plain mean over the w * G softmax rows of the observation window.
        std::vector<const std::vector<double>*> call_keys;  // [S][D]
        for (const auto& k : keys) call_keys.push_back(&k);
        const std::size_t w = std::min(static_cast<std::size_t>(obs_window_), s);
        std::vector<double> score(s, 0.0);  // [S]
        std::size_t n_softmax = 0;
        for (std::size_t j = s - w; j < s; ++j) {
            for (const auto& q : queries[j]) {
                const std::vector<double> a = query_detail::attention_weights(call_keys, q);  // [S]
                for (std::size_t r = 0; r < s; ++r) score[r] += a[r];
                ++n_softmax;
            }
        }
        for (std::size_t r = 0; r < s; ++r) score[r] /= static_cast<double>(n_softmax);

        // Keep the first `sinks` rows; fill the rest greedily: highest score, earlier index on ties.
        const std::size_t budget_sz = static_cast<std::size_t>(budget_);
        const std::size_t sinks = std::min(static_cast<std::size_t>(n_sink_), budget_sz);
        std::vector<bool> keep(s, false);
        for (std::size_t r = 0; r < sinks; ++r) keep[r] = true;
        for (std::size_t slot = sinks; slot < budget_sz; ++slot) {
            std::optional<std::size_t> best;
            for (std::size_t r = sinks; r < s; ++r) {
                if (keep[r]) continue;
                if (!best || score[r] > score[*best]) best = r;  // strict '>' in ascending scan: earliest wins ties
            }
            if (!best) break;
            keep[*best] = true;
        }
        for (std::size_t i = 0; i < s; ++i) {
            if (keep[i]) {
                rows_.push_back(OracleRow{keys[i], values[i], first_position + static_cast<std::int64_t>(i), score[i]});
            }
        }
        compressed_ = true;
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return query_detail::positions_of(rows_); }

    /// True once a call has been compressed since construction or the last reset().
    bool compressed() const { return compressed_; }

    /// Forget all rows, restart at position 0, and re-arm compression.
    void reset() {
        rows_.clear();
        next_position_ = 0;
        compressed_ = false;
    }

private:
    int n_sink_;
    int budget_;
    int obs_window_;
    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
    bool compressed_ = false;
};

}  // namespace reference
}  // namespace veloxquant
