/// Naive, independent reference oracles for the sibling policies of docs/design.md sections 6: TOVA,
/// StreamingLLM and SnapKV (one head each), written only from docs/design.md sections 1-4 and 6.
//
// Purpose: the fast caches (TOVACache, StreamingLLMCache, SnapKVCache) are compared against these
// classes in tests. Like oracle.hpp, everything here is written for clarity, not speed: plain
// std::vector<double>, one token at a time (SnapKV: one call at a time, because its rule is a
// per-call rule), double precision throughout, standard library only.
//
// What these oracles model: the *retained set* of one head after each token / call (docs/design.md 4.4). The
// returned window of a call (rows retained before the call plus every row of the call) is not
// modelled here; it follows from the retained set before the call and the call's input.
//
// Precision note: the library stores keys at precision T and scores in float32 (docs/design.md 3), this
// oracle is double throughout. Compare weights/scores with a tolerance and retained sets only on
// data without near-ties (or with ties that are exact by construction, e.g. identical keys).
//
// Resolved ambiguities (each is also noted where it applies):
//  * Sinks. TOVA and StreamingLLM: a sink is a row whose absolute position is < n_sink (docs/design.md 1).
//    SnapKV: "the first min(n_sink, budget) rows" is read as the first rows *of the compressing
//    call* (identical to positions < n_sink when, as usual, the prompt is the first call).
//  * n_sink >= budget. KVCacheConfig::validate rejects it, so the library never sees it; the oracles
//    accept it and do the literal thing: TOVA evicts nothing when no non-sink row exists (the head
//    then exceeds the budget), SnapKV keeps min(n_sink, budget) call rows and no others.
//  * StreamingLLM's window counts non-sink rows only ("the last window *others*"), so a full head
//    holds n_sink + window rows.
//  * SnapKV compresses only the first call (since construction or reset()) whose S > budget; calls
//    with S <= budget before it append everything, even if the head then holds more than budget
//    rows. Rows retained from earlier calls are neither scored nor evicted by the compression, and
//    they are not attended over when scoring (the softmax runs over the call's S rows only). Every
//    later call appends without eviction, whatever its S.
//  * S > budget is strict: a call of exactly budget rows is not compressed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "oracle.hpp"  // OracleRow

namespace veloxquant {
namespace reference {

/// Key-as-query proxy attention (docs/design.md 3): softmax over rows of dot(K_r, q) / sqrt(D), max-subtracted.
// rows: [n][D], q: [D]; returns [n] (empty when n == 0). Throws if D == 0 or a row's D differs from q's.
inline std::vector<double> proxy_softmax(const std::vector<std::vector<double>>& rows,
                                         const std::vector<double>& q) {
    if (q.empty()) throw std::invalid_argument("proxy_softmax: empty query (D == 0)");
    const std::size_t n = rows.size();
    const std::size_t d = q.size();
    const double sqrt_d = std::sqrt(static_cast<double>(d));

    std::vector<double> weights(n);  // [n], logits first
    double max_logit = -std::numeric_limits<double>::infinity();
    for (std::size_t r = 0; r < n; ++r) {
        if (rows[r].size() != d) {
            throw std::invalid_argument("proxy_softmax: row " + std::to_string(r) + " has D = " +
                                        std::to_string(rows[r].size()) + ", query has D = " +
                                        std::to_string(d));
        }
        double dot = 0.0;
        for (std::size_t k = 0; k < d; ++k) dot += rows[r][k] * q[k];
        weights[r] = dot / sqrt_d;
        max_logit = std::max(max_logit, weights[r]);
    }
    double total = 0.0;
    for (std::size_t r = 0; r < n; ++r) {
        weights[r] = std::exp(weights[r] - max_logit);
        total += weights[r];
    }
    for (std::size_t r = 0; r < n; ++r) weights[r] /= total;
    return weights;
}

namespace policy_detail {

/// Throws std::invalid_argument if key is empty or non-finite, or if key/value D differ from an existing row's.
// key: [D], value: [Dv]; reference: any retained row (nullptr when the head is empty).
inline void check_token(const char* who, const std::vector<double>& key, const std::vector<double>& value,
                        const OracleRow* reference) {
    if (key.empty()) throw std::invalid_argument(std::string(who) + ": empty key (D == 0)");
    for (std::size_t k = 0; k < key.size(); ++k) {
        if (!std::isfinite(key[k])) {
            throw std::invalid_argument(std::string(who) + ": non-finite key at index " + std::to_string(k));
        }
    }
    if (reference != nullptr &&
        (key.size() != reference->key.size() || value.size() != reference->value.size())) {
        throw std::invalid_argument(std::string(who) + ": key/value dimension differs from earlier tokens");
    }
}

/// Positions of rows, in row order.
inline std::vector<std::int64_t> positions_of(const std::vector<OracleRow>& rows) {
    std::vector<std::int64_t> out;
    out.reserve(rows.size());
    for (const auto& r : rows) out.push_back(r.position);
    return out;
}

}  // namespace policy_detail

/// One TOVA head (docs/design.md 6): memoryless; when over budget, evict the non-sink row the newest key attends to least.
//
// Per token i: append row i; if the head now holds more than `budget` rows, compute
// a = proxy_softmax(all rows including row i, k_i) and evict the lowest-a row among non-sinks
// (position >= n_sink); ties go to the earliest position (strict '<' in an ascending scan). Row i
// itself is a candidate. Nothing is carried from one token to the next: OracleRow::score only
// records, for inspection, the weight each surviving row got in the latest token's eviction
// (all 0 when the latest token ran no eviction).
class TOVAHeadOracle {
public:
    /// An empty head; n_sink >= 0, budget >= 1.
    TOVAHeadOracle(int n_sink, int budget) : n_sink_(n_sink), budget_(budget) {
        if (n_sink < 0) throw std::invalid_argument("TOVAHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("TOVAHeadOracle: budget must be >= 1");
    }

    /// Absorb one token: append, and if over budget evict at most one row (see the class comment).
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        policy_detail::check_token("TOVAHeadOracle", key, value, rows_.empty() ? nullptr : &rows_.front());

        for (auto& r : rows_) r.score = 0.0;  // memoryless: nothing survives from the previous token
        last_weights_.clear();
        rows_.push_back(OracleRow{key, value, next_position_, 0.0});
        ++next_position_;

        if (static_cast<int>(rows_.size()) <= budget_) {
            return;  // within budget: no attention is computed, no eviction
        }

        // Proxy attention of k_i over every row, including row i itself.
        std::vector<std::vector<double>> keys;  // [n][D]
        for (const auto& r : rows_) keys.push_back(r.key);
        last_weights_ = proxy_softmax(keys, key);  // [n], in row order (ascending position)
        for (std::size_t r = 0; r < rows_.size(); ++r) rows_[r].score = last_weights_[r];

        // Lowest weight among non-sinks; ascending scan with strict '<' => ties evict the earliest.
        bool found = false;
        std::size_t victim = 0;
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            if (rows_[r].position < n_sink_) continue;  // sinks are never evicted
            if (!found || last_weights_[r] < last_weights_[victim]) {
                victim = r;
                found = true;
            }
        }
        if (found) {  // (no candidate only when n_sink >= budget + 1 rows are all sinks)
            rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(victim));
        }
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return policy_detail::positions_of(rows_); }

    /// Weights of the latest eviction over all budget + 1 rows *before* the eviction (row order,
    /// ascending position, the evicted row included); empty if the latest token ran no eviction.
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

/// One StreamingLLM head (docs/design.md 6): the first n_sink positions plus the newest `window` other positions (FIFO).
//
// Per token t: append; if more than `window` non-sink rows are held, drop the earliest non-sink row.
// After token t the retained positions are exactly {p <= t : p < n_sink or p > t - window}.
// No scoring: OracleRow::score is always 0.
class StreamingLLMHeadOracle {
public:
    /// An empty head; n_sink >= 0, window >= 1.
    StreamingLLMHeadOracle(int n_sink, int window) : n_sink_(n_sink), window_(window) {
        if (n_sink < 0) throw std::invalid_argument("StreamingLLMHeadOracle: n_sink must be >= 0");
        if (window < 1) throw std::invalid_argument("StreamingLLMHeadOracle: window must be >= 1");
    }

    /// Absorb one token: append, then evict the oldest non-sink row if the window overflows.
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        policy_detail::check_token("StreamingLLMHeadOracle", key, value,
                                   rows_.empty() ? nullptr : &rows_.front());
        rows_.push_back(OracleRow{key, value, next_position_, 0.0});
        ++next_position_;

        std::size_t non_sinks = 0;
        for (const auto& r : rows_) {
            if (r.position >= n_sink_) ++non_sinks;
        }
        if (non_sinks <= static_cast<std::size_t>(window_)) return;
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            if (rows_[r].position >= n_sink_) {  // the first non-sink in ascending order is the oldest
                rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(r));
                return;
            }
        }
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return policy_detail::positions_of(rows_); }

    /// Forget all rows and restart at position 0.
    void reset() {
        rows_.clear();
        next_position_ = 0;
    }

private:
    int n_sink_;
    int window_;
    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
};

/// One SnapKV head (docs/design.md 6): compress the first call with S > budget by observation-window scores; append otherwise.
//
// Compression of a call with keys k_0..k_{S-1} (call-relative indices):
//   w = min(obs_window, S); proxies are the call's last w keys k_{S-w}..k_{S-1};
//   score_r = (1/w) * sum over proxies j of proxy_softmax(call keys [S][D], k_j)[r]
//     (softmax over all S rows of the call, no causal mask, logits dot/sqrt(D));
//   keep call rows 0..sinks-1 with sinks = min(n_sink, budget), plus the (budget - sinks) highest
//   scores among the other call rows (equal scores: the earlier position wins), order preserved.
// Kept call rows carry their SnapKV score in OracleRow::score; every appended (uncompressed) row has 0.
// Rows retained from earlier calls are left untouched (see the file comment for this reading).
class SnapKVHeadOracle {
public:
    /// An empty head; n_sink >= 0, budget >= 1, obs_window >= 1.
    SnapKVHeadOracle(int n_sink, int budget, int obs_window)
        : n_sink_(n_sink), budget_(budget), obs_window_(obs_window) {
        if (n_sink < 0) throw std::invalid_argument("SnapKVHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("SnapKVHeadOracle: budget must be >= 1");
        if (obs_window < 1) throw std::invalid_argument("SnapKVHeadOracle: obs_window must be >= 1");
    }

    /// Absorb one call of S tokens (S may be 0: nothing changes).
    // keys: [S][D], values: [S][Dv]
    void absorb_call(const std::vector<std::vector<double>>& keys,
                     const std::vector<std::vector<double>>& values) {
        if (keys.size() != values.size()) {
            throw std::invalid_argument("SnapKVHeadOracle: " + std::to_string(keys.size()) + " keys but " +
                                        std::to_string(values.size()) + " values");
        }
        // Validate the whole call before changing anything.
        const OracleRow* reference = rows_.empty() ? nullptr : &rows_.front();
        OracleRow first_of_call;
        for (std::size_t i = 0; i < keys.size(); ++i) {
            policy_detail::check_token("SnapKVHeadOracle", keys[i], values[i], reference);
            if (reference == nullptr) {
                first_of_call = OracleRow{keys[i], values[i], 0, 0.0};
                reference = &first_of_call;
            }
        }

        const std::size_t s = keys.size();
        const std::int64_t first_position = next_position_;
        next_position_ += static_cast<std::int64_t>(s);

        if (compressed_ || s <= static_cast<std::size_t>(budget_)) {
            // Plain append: every row of the call, score 0.
            for (std::size_t i = 0; i < s; ++i) {
                rows_.push_back(OracleRow{keys[i], values[i], first_position + static_cast<std::int64_t>(i), 0.0});
            }
            return;
        }

        // The first call with S > budget: score the call's rows by the observation window.
        const std::size_t w = std::min(static_cast<std::size_t>(obs_window_), s);
        std::vector<double> score(s, 0.0);  // [S]
        for (std::size_t j = s - w; j < s; ++j) {
            const std::vector<double> a = proxy_softmax(keys, keys[j]);  // [S]
            for (std::size_t r = 0; r < s; ++r) score[r] += a[r];
        }
        for (std::size_t r = 0; r < s; ++r) score[r] /= static_cast<double>(w);

        // Selection: the first `sinks` call rows, then the best others (ties: earlier index first).
        const std::size_t budget_sz = static_cast<std::size_t>(budget_);
        const std::size_t sinks = std::min(static_cast<std::size_t>(n_sink_), budget_sz);
        std::vector<bool> keep(s, false);
        for (std::size_t r = 0; r < sinks && r < s; ++r) keep[r] = true;
        std::vector<std::size_t> others;
        for (std::size_t r = sinks; r < s; ++r) others.push_back(r);
        std::stable_sort(others.begin(), others.end(), [&score](std::size_t x, std::size_t y) {
            if (score[x] != score[y]) return score[x] > score[y];
            return x < y;
        });
        for (std::size_t k = 0; k < others.size() && k < budget_sz - sinks; ++k) keep[others[k]] = true;

        for (std::size_t i = 0; i < s; ++i) {
            if (keep[i]) {
                rows_.push_back(
                    OracleRow{keys[i], values[i], first_position + static_cast<std::int64_t>(i), score[i]});
            }
        }
        compressed_ = true;
    }

    /// Retained rows in ascending position.
    const std::vector<OracleRow>& rows() const { return rows_; }

    /// Positions of the retained rows, ascending.
    std::vector<std::int64_t> positions() const { return policy_detail::positions_of(rows_); }

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
