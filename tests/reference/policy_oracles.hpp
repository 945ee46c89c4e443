/// Naive, independent reference oracles for the sibling policies of docs/design.md section 6: TOVA,
/// StreamingLLM and SnapKV (one head each), written only from docs/design.md sections 1-4 and 6.
//
// Purpose: the fast caches (TOVACache, StreamingLLMCache, SnapKVCache) are compared against these
// classes in tests and in the fuzzer. Like oracle.hpp, everything here is written for clarity, not
// speed: plain std::vector<double>, one token at a time (SnapKV: one call at a time, because its
// rule is a per-call rule), double precision throughout, standard library only.
//
// Scoring is pluggable (oracle.hpp): TOVA and SnapKV score with the key-as-query proxy (absorb /
// absorb_call without queries: a token's only query head is its own key) or with the token's G real
// query heads (the overloads taking queries, docs/design.md 4.6); both run the same rule through
// the same scorer, mean_head_weights. StreamingLLM does not score.
//
// What these oracles model: the *retained set* of one head after each token / call
// (docs/design.md 4.4). The returned window of a call (rows retained before the call plus every row
// of the call) is not modelled here; it follows from the retained set before the call and the
// call's input.
//
// Precision note: the library stores keys at precision T and scores in float32 (docs/design.md 3),
// this oracle is double throughout. Compare weights/scores with a tolerance and retained sets only
// on data without near-ties (or with ties that are exact by construction, e.g. identical keys).
//
// Resolved ambiguities (each is also noted where it applies):
//  * Sinks. TOVA and StreamingLLM: a sink is a row whose absolute position is < n_sink
//  (docs/design.md 1).
//    SnapKV: the leading rows at positions < n_sink, at most budget of them (SPEC 13.3: the
//    rows held before a compressing chunk are ranked with it).
//  * n_sink >= budget. KVCacheConfig::validate rejects it, so the library never sees it; the
//  oracles
//    accept it and do the literal thing: TOVA evicts nothing when no non-sink row exists (the head
//    then exceeds the budget), SnapKV keeps the first min(n_sink, budget) rows and no others.
//  * StreamingLLM's window counts non-sink rows only ("the last window *others*"), so a full head
//    holds n_sink + window rows.
//  * SnapKV (SPEC 13.3) compresses every prompt chunk, a call with S > 1 after which the head would
//    hold more than budget rows; the rows retained from earlier calls are scored (attended over)
//    and may be evicted with the call's, and the sinks are the leading rows at positions below
//    n_sink. Decode steps (S == 1) append without eviction, so a prompt fed one token per call is
//    never compressed, and a head grows past the budget while decoding until the next chunk.
//  * "More than budget" is strict: a chunk that leaves exactly budget rows is not compressed.
//  * SnapKV with queries: the score is the mean over the w = min(obs_window, S) last tokens AND
//  their
//    G query heads, i.e. a plain mean over w * G softmax rows (equal to the mean over tokens of the
//    per-token head mean; with the proxy, G = 1).
//  * TOVA with queries: the weights are computed only when the head is over budget (as in
//    docs/design.md 6), but the token's queries are validated on every absorb.
//  * Queries are checked like keys (G >= 1, D of the key, finite; within a SnapKV call the same G
//  for
//    every token); values are not inspected (docs/design.md 8). All checks precede any change.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "oracle.hpp"  // OracleRow, the scorer (mean_head_weights, proxy_softmax), oracle_detail

namespace veloxquant {
namespace reference {

namespace policy_detail {
using oracle_detail::positions_of;  // Positions of rows, in row order (kept under this name for its users).
}  // namespace policy_detail

/// One TOVA head (docs/design.md 6): memoryless; when over budget, evict the non-sink row the newest token attends to least.
//
// Per token i: append row i; if the head now holds more than `budget` rows, compute
// a = mean over the token's query heads of softmax(q . k_r / sqrt(D)) over all rows including row i
// (proxy: the single head k_i, i.e. proxy_softmax(rows, k_i)) and evict the lowest-a row among
// non-sinks (position >= n_sink); ties go to the earliest position (strict '<' in an ascending scan).
// Row i itself is a candidate. Nothing is carried from one token to the next: OracleRow::score only
// records, for inspection, the weight each surviving row got in the latest token's eviction
// (all 0 when the latest token ran no eviction).
class TOVAHeadOracle : public oracle_detail::HeadRows {
public:
    /// An empty head; n_sink >= 0, budget >= 1.
    TOVAHeadOracle(int n_sink, int budget) : n_sink_(n_sink), budget_(budget) {
        if (n_sink < 0) throw std::invalid_argument("TOVAHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("TOVAHeadOracle: budget must be >= 1");
    }

    /// Absorb one token, scored with the key-as-query proxy (its only query head is its key).
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) { absorb(key, value, {key}); }

    /// Absorb one token with its G query heads: append, and if over budget evict at most one row.
    // key: [D], value: [Dv], queries: [G][D]
    void absorb(const std::vector<double>& key, const std::vector<double>& value,
                const std::vector<std::vector<double>>& queries) {
        oracle_detail::check_row("TOVAHeadOracle", 0, key, value, oracle_detail::dims_of(rows_));
        oracle_detail::check_heads("TOVAHeadOracle", 0, key, queries, 0);

        for (auto& r : rows_) r.score = 0.0;  // memoryless: nothing survives from the previous token
        last_weights_.clear();
        append(key, value, 0.0);
        if (rows_.size() <= static_cast<std::size_t>(budget_)) {
            return;  // within budget: no attention is computed, no eviction
        }

        last_weights_ = mean_head_weights(window_keys(rows_.size()), queries);  // [n], row i included
        for (std::size_t r = 0; r < rows_.size(); ++r) rows_[r].score = last_weights_[r];

        // Lowest weight among non-sinks; ascending scan with strict '<' => ties evict the earliest.
        std::optional<std::size_t> victim;
        for (std::size_t r = 0; r < rows_.size(); ++r) {
            if (rows_[r].position < n_sink_) continue;  // sinks are never evicted
            if (!victim || last_weights_[r] < last_weights_[*victim]) victim = r;
        }
        if (victim) {  // (no candidate only when n_sink >= budget + 1 rows are all sinks)
            rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(*victim));
        }
    }

    /// Weights of the latest eviction over all budget + 1 rows *before* the eviction (row order,
    /// ascending position, the evicted row included); empty if the latest token ran no eviction.
    // returns: [budget + 1] or [0]
    std::vector<double> last_weights() const { return last_weights_; }

    /// Forget all rows and restart at position 0.
    void reset() {
        clear_rows();
        last_weights_.clear();
    }

private:
    int n_sink_;
    int budget_;
    std::vector<double> last_weights_;
};

/// One StreamingLLM head (docs/design.md 6): the first n_sink positions plus the newest `window` other positions (FIFO).
//
// Per token t: append; if more than `window` non-sink rows are held, drop the earliest non-sink row.
// After token t the retained positions are exactly {p <= t : p < n_sink or p > t - window}.
// No scoring: OracleRow::score is always 0.
class StreamingLLMHeadOracle : public oracle_detail::HeadRows {
public:
    /// An empty head; n_sink >= 0, window >= 1.
    StreamingLLMHeadOracle(int n_sink, int window) : n_sink_(n_sink), window_(window) {
        if (n_sink < 0) throw std::invalid_argument("StreamingLLMHeadOracle: n_sink must be >= 0");
        if (window < 1) throw std::invalid_argument("StreamingLLMHeadOracle: window must be >= 1");
    }

    /// Absorb one token: append, then evict the oldest non-sink row if the window overflows.
    // key: [D], value: [Dv]
    void absorb(const std::vector<double>& key, const std::vector<double>& value) {
        oracle_detail::check_row("StreamingLLMHeadOracle", 0, key, value, oracle_detail::dims_of(rows_));
        append(key, value, 0.0);

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

    /// Forget all rows and restart at position 0.
    void reset() { clear_rows(); }

private:
    int n_sink_;
    int window_;
};

/// One SnapKV head (docs/design.md 6, 10.3): compress every prompt chunk (S > 1) after which the
/// head would hold more than the budget; append otherwise (decode steps never evict).
//
// Compression of a call with keys k_0..k_{S-1} on a head holding rows r_0..r_{m-1}:
//   w = min(obs_window, S); the observation window is the call's last w tokens;
//   score_x = mean over those w tokens and each token's query heads (proxy: the single head k_j) of
//     softmax(q . k_x / sqrt(D)) over all m + S rows held then (no causal mask);
//   keep the leading rows at positions below n_sink (at most budget of them), plus the
//   (budget - sinks) highest scores among the others (equal scores: the earlier position wins),
//   order preserved; every kept row carries its new score in OracleRow::score.
// Every appended (uncompressed) row has 0. A first chunk on an empty head is the one-shot
// compression of a whole prompt.
class SnapKVHeadOracle : public oracle_detail::HeadRows {
public:
    /// An empty head; n_sink >= 0, budget >= 1, obs_window >= 1.
    SnapKVHeadOracle(int n_sink, int budget, int obs_window)
        : n_sink_(n_sink), budget_(budget), obs_window_(obs_window) {
        if (n_sink < 0) throw std::invalid_argument("SnapKVHeadOracle: n_sink must be >= 0");
        if (budget < 1) throw std::invalid_argument("SnapKVHeadOracle: budget must be >= 1");
        if (obs_window < 1) throw std::invalid_argument("SnapKVHeadOracle: obs_window must be >= 1");
    }

    /// Absorb one call of S tokens scored with the key-as-query proxy (S may be 0: nothing changes).
    // keys: [S][D], values: [S][Dv]
    void absorb_call(const std::vector<std::vector<double>>& keys,
                     const std::vector<std::vector<double>>& values) {
        absorb_call(keys, values, proxy_queries(keys));
    }

    /// Absorb one call of S tokens with their real queries (S may be 0: nothing changes).
    // keys: [S][D], values: [S][Dv], queries: [S][G][D]
    void absorb_call(const std::vector<std::vector<double>>& keys, const std::vector<std::vector<double>>& values,
                     const std::vector<std::vector<std::vector<double>>>& queries) {
        oracle_detail::check_call("SnapKVHeadOracle", keys, values, queries, oracle_detail::dims_of(rows_));
        const std::size_t s = keys.size();

        if (s <= 1 || rows_.size() + s <= static_cast<std::size_t>(budget_)) {
          // A decode step, or a chunk the budget still holds: plain append, score 0 (the
          // retained rows keep theirs).
          for (std::size_t i = 0; i < s; ++i) append(keys[i], values[i], 0.0);
          return;
        }

        // A prompt chunk that would pass the budget (SPEC 13.3): every row held then, the retained
        // ones and the call's, is scored by the call's observation window, a plain mean over its
        // w * G softmax rows over all of them.
        std::vector<OracleRow> all = rows_;
        for (std::size_t i = 0; i < s; ++i) {
          all.push_back(
              OracleRow{keys[i], values[i], next_position_ + static_cast<std::int64_t>(i), 0.0});
        }
        const std::size_t n = all.size();
        std::vector<const std::vector<double>*> all_keys;  // [n][D]
        for (const auto& r : all) all_keys.push_back(&r.key);
        const std::size_t w = std::min(static_cast<std::size_t>(obs_window_), s);
        std::vector<double> score(n, 0.0);  // [n]
        std::size_t n_softmax = 0;
        for (std::size_t j = s - w; j < s; ++j) {
            for (const auto& q : queries[j]) {
              const std::vector<double> a = attention_weights(all_keys, q);  // [n]
              for (std::size_t r = 0; r < n; ++r) score[r] += a[r];
              ++n_softmax;
            }
        }
        for (std::size_t r = 0; r < n; ++r) score[r] /= static_cast<double>(n_softmax);

        // Selection: the rows at positions below n_sink (at most `budget`), then the best others
        // (ties: earlier position first).
        const std::size_t budget_sz = static_cast<std::size_t>(budget_);
        std::size_t sinks = 0;
        while (sinks < n && sinks < budget_sz && all[sinks].position < n_sink_) ++sinks;
        std::vector<bool> keep(n, false);
        for (std::size_t r = 0; r < sinks; ++r) keep[r] = true;
        std::vector<std::size_t> others;
        for (std::size_t r = sinks; r < n; ++r) others.push_back(r);
        std::stable_sort(others.begin(), others.end(), [&score](std::size_t x, std::size_t y) {
            if (score[x] != score[y]) return score[x] > score[y];
            return x < y;
        });
        for (std::size_t k = 0; k < others.size() && k < budget_sz - sinks; ++k) keep[others[k]] = true;

        rows_.clear();
        for (std::size_t i = 0; i < n; ++i) {
          if (keep[i]) {
            all[i].score = score[i];
            rows_.push_back(all[i]);
          }
        }
        next_position_ += static_cast<std::int64_t>(s);  // every call row takes a position, kept or not
        compressed_ = true;
    }

    /// True once a call has been compressed since construction or the last reset().
    bool compressed() const { return compressed_; }

    /// Forget all rows, restart at position 0, and re-arm compression.
    void reset() {
        clear_rows();
        compressed_ = false;
    }

private:
    int n_sink_;
    int budget_;
    int obs_window_;
    bool compressed_ = false;
};

}  // namespace reference
}  // namespace veloxquant
