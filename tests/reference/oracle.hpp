/// Naive, independent reference oracle for veloxquant, written only from docs/design.md (sections 3-6, 9).
//
// Purpose: the fast library (include/veloxquant/...) is compared against these functions and
// classes in tests. Everything here is written for clarity, not speed: plain std::vector<double>,
// one token at a time, double precision everywhere, standard library only (no Eigen).
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

/// One head of the H2O core (docs/design.md 4.1, 4.2, 4.5) with the key-as-query proxy (docs/design.md 3), one token at a time.
class H2OHeadOracle {
public:
    /// Build an empty head; grace_for_budget maps a budget to g (the result is clamped again per docs/design.md 4.2).
    H2OHeadOracle(int n_sink, double decay, std::function<int(int budget)> grace_for_budget)
        : n_sink_(n_sink), decay_(decay), grace_for_budget_(std::move(grace_for_budget)) {
        if (n_sink < 0) throw std::invalid_argument("H2OHeadOracle: n_sink must be >= 0");
        if (!(decay > 0.0 && decay <= 1.0)) throw std::invalid_argument("H2OHeadOracle: decay must be in (0, 1]");
        if (!grace_for_budget_) throw std::invalid_argument("H2OHeadOracle: grace_for_budget is empty");
    }

    /// Make the budget known (or change it); trims per docs/design.md 4.5 if the head holds more rows than budget.
    void set_budget(int budget) {
        if (budget < 1) throw std::invalid_argument("H2OHeadOracle: budget must be >= 1");
        budget_ = budget;
        if (static_cast<int>(rows_.size()) <= budget) {
            return;  // a larger (or sufficient) budget is just stamped
        }
        const std::size_t n = rows_.size();
        const std::size_t g = static_cast<std::size_t>(grace(budget));

        // Protected: sinks and the newest g rows.
        std::vector<bool> keep(n, false);
        std::size_t n_kept = 0;
        for (std::size_t i = 0; i < n; ++i) {
            const bool is_sink = rows_[i].position < n_sink_;
            const bool is_recent = i + g >= n;  // among the last g rows
            if (is_sink || is_recent) {
                keep[i] = true;
                ++n_kept;
            }
        }
        // Remaining slots go to the highest scores; among equal scores the later position wins.
        std::vector<std::size_t> candidates;
        for (std::size_t i = 0; i < n; ++i) {
            if (!keep[i]) candidates.push_back(i);
        }
        std::sort(candidates.begin(), candidates.end(), [this](std::size_t a, std::size_t b) {
            if (rows_[a].score != rows_[b].score) return rows_[a].score > rows_[b].score;
            return rows_[a].position > rows_[b].position;
        });
        const std::size_t budget_sz = static_cast<std::size_t>(budget);
        const std::size_t slots = budget_sz > n_kept ? budget_sz - n_kept : 0;
        for (std::size_t k = 0; k < candidates.size() && k < slots; ++k) {
            keep[candidates[k]] = true;
        }
        std::vector<OracleRow> kept;
        for (std::size_t i = 0; i < n; ++i) {
            if (keep[i]) kept.push_back(rows_[i]);  // order preserved, scores untouched
        }
        rows_.swap(kept);
    }

    /// The budget if known (empty until set_budget is called).
    std::optional<int> budget() const { return budget_; }

    /// Absorb one token (docs/design.md 4.2): proxy attention, decayed accumulation, append, evict at most one row.
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        check_token(key, value);

        // Step 1: empty head.
        if (rows_.empty()) {
            rows_.push_back(OracleRow{key, value, next_position_, 1.0});
            ++next_position_;
            return;
        }

        // Step 2: proxy attention of key over the retained rows (not itself).
        const std::vector<double> a = proxy_attention(key);  // [n]
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            rows_[r].score = rows_[r].score * decay_ + a[r];
        }
        rows_.push_back(OracleRow{key, value, next_position_, 0.0});
        ++next_position_;

        // Step 3: evict one row if over a known budget.
        if (!budget_ || static_cast<int>(rows_.size()) <= *budget_) {
            return;
        }
        const std::size_t n = rows_.size();
        const std::size_t g = static_cast<std::size_t>(grace(*budget_));
        std::optional<std::size_t> victim;
        for (std::size_t i = 0; i < n; ++i) {
            const bool is_sink = rows_[i].position < n_sink_;
            const bool is_recent = i + g >= n;
            if (is_sink || is_recent) continue;
            // Strict '<' while scanning in ascending position: ties go to the earliest position.
            if (!victim || rows_[i].score < rows_[*victim].score) victim = i;
        }
        if (victim) {  // (no evictable row only happens when budget < number of sinks held)
            rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(*victim));
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

    /// softmax(K q / sqrt(D)) over the retained rows, max-subtracted.
    // q: [D]; returns [n_rows]
    std::vector<double> proxy_attention(const std::vector<double>& q) const {
        const double sqrt_d = std::sqrt(static_cast<double>(q.size()));
        std::vector<double> logits(rows_.size());
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            double dot = 0.0;
            for (std::size_t k = 0; k < q.size(); ++k) dot += rows_[r].key[k] * q[k];
            logits[r] = dot / sqrt_d;
        }
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        for (double& l : logits) {
            l = std::exp(l - mx);
            sum += l;
        }
        for (double& l : logits) l /= sum;
        return logits;
    }

    /// Shape and finiteness checks for one token (docs/design.md 8 spirit): D >= 1, same D as before, finite key.
    // key: [D], value: [Dv]
    void check_token(const std::vector<double>& key, const std::vector<double>& value) const {
        if (key.empty()) throw std::invalid_argument("H2OHeadOracle: empty key");
        for (std::size_t k = 0; k < key.size(); ++k) {
            if (!std::isfinite(key[k])) {
                throw std::invalid_argument("H2OHeadOracle: non-finite key at index " + std::to_string(k));
            }
        }
        if (!rows_.empty() &&
            (key.size() != rows_.front().key.size() || value.size() != rows_.front().value.size())) {
            throw std::invalid_argument("H2OHeadOracle: key/value dimension differs from earlier tokens");
        }
    }

    int n_sink_;
    double decay_;
    std::function<int(int)> grace_for_budget_;
    std::optional<int> budget_;
    std::vector<OracleRow> rows_;
    std::int64_t next_position_ = 0;
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
