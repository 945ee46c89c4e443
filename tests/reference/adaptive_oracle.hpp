/// Naive, independent reference oracle of adaptive head budgets (SPEC 14, docs/design.md 4.9), for
/// the H2O core (SqueezeAttention, H2O, PyramidKV).
//
// One sequence of a layer: H heads, each an H2OHeadOracle that is never given a budget (so it
// scores every row it is fed and never evicts by itself), plus the pooled eviction of the sequence,
// done the naive way: after every head has absorbed the call, while the heads hold more than H *
// budget rows together, remove the single lowest (rank, position, head) candidate, one row at a
// time. A candidate is a row of a head that holds more than floor_rows = ceil(floor * budget) rows,
// that is not a sink (position < n_sink) and not among its head's newest g rows (g = the clamped
// grace of the budget).
//
// The rank (computed once per call, before the first row of that call's pooled eviction goes, as a
// uniform head's re-budget ranks):
//  * a call with queries: the score, or score * |v|^p under a value power p > 0;
//  * a call without queries: the score (key-as-query proxy, K-norm), or KeyDiff's
//    -cos(k_r, m) = -(u_r . m) / (|m| + 1e-8), u_r = k_r / (|k_r| + 1e-8) and m the mean of the u_r
//    over the head's rows at that moment (docs/design.md 4.9: in [-1, 1] whatever the head's scale,
//    so comparable across heads; H2OHeadOracle::rank() leaves the division by |m| out, which
//    changes no order within one head but does across heads).
//
// The budget may be unknown (nothing is evicted) and may change between calls (set_budget: the
// pending re-budget at the start of the next call, docs/design.md 4.5 and 4.9; g and floor_rows
// follow the new budget): the heads then give up their excess to the pool the same way, before
// they take that call, ranked as that call ranks.
//
// Calls without queries are absorbed token by token by H2OHeadOracle::absorb (the proxy or the
// query-free scorer), with no eviction between tokens: adaptive heads score the whole call first.
// Calls with queries go through H2OHeadOracle::absorb_call.
//
// Written from the spec only; everything in double precision, one row at a time.
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

#include "oracle.hpp"

namespace veloxquant {
namespace reference {

/// One head of an adaptive sequence: an H2OHeadOracle (never given a budget) whose rows the
/// sequence's pooled eviction may remove.
class PooledHeadOracle : public H2OHeadOracle {
 public:
  using H2OHeadOracle::H2OHeadOracle;

  /// Remove the row at index i (ascending position order).
  void remove_row(std::size_t i) {
    if (i >= rows_.size()) throw std::out_of_range("PooledHeadOracle::remove_row: no such row");
    rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(i));
  }
};

/// One sequence of an adaptive layer: `heads` heads sharing heads * budget rows.
class AdaptiveSequenceOracle {
 public:
  using Scorer = H2OHeadOracle::Scorer;
  using Rows = std::vector<std::vector<double>>;  // [n][D]
  using Queries = std::vector<Rows>;              // [S][G][D]

  /// `grace_for_budget` maps the budget to g before the clamp to [0, budget - n_sink - 1];
  /// `budget`: rows per head of the pool (empty: unknown, nothing is evicted); `floor` is
  /// head_budget_floor, in (0, 1].
  AdaptiveSequenceOracle(std::size_t heads, int n_sink, double decay,
                         std::function<int(int)> grace_for_budget, std::optional<int> budget,
                         double floor, Scorer scorer = Scorer::key_as_query,
                         double value_power = 0.0)
      : n_sink_(n_sink),
        floor_(floor),
        scorer_(scorer),
        value_power_(value_power),
        grace_for_budget_(std::move(grace_for_budget)) {
    if (heads < 1) throw std::invalid_argument("AdaptiveSequenceOracle: heads must be >= 1");
    if (!(floor > 0.0 && floor <= 1.0)) {
      throw std::invalid_argument("AdaptiveSequenceOracle: floor must be in (0, 1]");
    }
    if (!grace_for_budget_)
      throw std::invalid_argument("AdaptiveSequenceOracle: grace_for_budget is empty");
    if (budget) stamp_budget(*budget);
    for (std::size_t h = 0; h < heads; ++h) {
      heads_.emplace_back(n_sink, decay, grace_for_budget_);
      heads_.back().set_scorer(scorer);
      heads_.back().set_value_power(value_power);
    }
  }

  /// Absorb one call: keys[h]: [S][D], values[h]: [S][Dv] for every head h; queries: null (a
  /// call without queries), or (*queries)[h]: [S][G][D]. Then the pooled eviction.
  void absorb_call(const std::vector<Rows>& keys, const std::vector<Rows>& values,
                   const std::vector<Queries>* queries) {
    if (keys.size() != heads_.size() || values.size() != heads_.size() ||
        (queries && queries->size() != heads_.size())) {
      throw std::invalid_argument(
          "AdaptiveSequenceOracle::absorb_call: one entry per head expected");
    }
    if (!rebudgeted_) {
      evicted_ = 0;
      margin_ = std::numeric_limits<double>::infinity();
    }
    rebudgeted_ = false;
    for (std::size_t h = 0; h < heads_.size(); ++h) {
      if (queries) {
        heads_[h].absorb_call(keys[h], values[h], (*queries)[h]);
      } else {
        for (std::size_t s = 0; s < keys[h].size(); ++s) heads_[h].absorb(keys[h][s], values[h][s]);
      }
    }
    pooled_eviction(queries != nullptr);
  }

  /// The budget becomes known or changes before the next call (with queries or not: how that
  /// call ranks): the heads give up their excess over the new pool now, before that call's rows
  /// arrive. evicted_last_call() and last_margin() then count this eviction and the next call's.
  void set_budget(int budget, bool next_call_has_queries) {
    stamp_budget(budget);
    evicted_ = 0;
    margin_ = std::numeric_limits<double>::infinity();
    rebudgeted_ = true;
    pooled_eviction(next_call_has_queries);
  }

  std::size_t heads() const { return heads_.size(); }
  const std::vector<OracleRow>& rows(std::size_t h) const { return heads_[h].rows(); }
  std::vector<std::int64_t> positions(std::size_t h) const { return heads_[h].positions(); }
  std::vector<double> scores(std::size_t h) const { return heads_[h].scores(); }
  /// Rows held by all heads together.
  std::size_t total_rows() const {
    std::size_t n = 0;
    for (const auto& head : heads_) n += head.rows().size();
    return n;
  }
  /// ceil(floor * budget), at most the budget.
  std::size_t floor_rows() const { return floor_rows_; }
  /// The protected recent rows per head.
  int protected_recent() const { return g_; }
  std::optional<int> budget() const { return budget_; }
  /// head_budget_floor.
  double floor() const { return floor_; }
  /// Rows the last call's pooled eviction removed.
  std::size_t evicted_last_call() const { return evicted_; }
  /// The smallest gap, over the steps of the last call's pooled eviction, between the lowest and
  /// the second lowest candidate rank, relative to max(1, |lowest|): below ~1e-5, float32 ranks
  /// may legitimately order the two the other way. Two ranks both exactly 0 (rows nothing ever
  /// attended to) are an exact tie in float32 too and do not count. +inf when no step had two
  /// candidates.
  double last_margin() const { return margin_; }

 private:
  /// The rank of every row of head h, by row index, for a call with (or without) queries.
  std::vector<double> ranks_of(std::size_t h, bool with_queries) const {
    const PooledHeadOracle& head = heads_[h];
    if (with_queries) {
      if (value_power_ > 0.0) return head.eviction_rank(true);
      return head.scores();
    }
    if (scorer_ == Scorer::keydiff) return keydiff_cosines(head.rows());
    return head.scores();
  }

  /// -cos(k_r, m) of every row, m the mean unit key of `rows`.
  static std::vector<double> keydiff_cosines(const std::vector<OracleRow>& rows) {
    std::vector<double> out(rows.size(), 0.0);
    if (rows.empty()) return out;
    const std::size_t d = rows.front().key.size();
    std::vector<std::vector<double>> unit;
    std::vector<double> mean(d, 0.0);
    for (const auto& r : rows) {
      double sq = 0.0;
      for (double x : r.key) sq += x * x;
      const double norm = std::sqrt(sq) + 1e-8;
      std::vector<double> u(d);
      for (std::size_t k = 0; k < d; ++k) u[k] = r.key[k] / norm;
      for (std::size_t k = 0; k < d; ++k) mean[k] += u[k] / static_cast<double>(rows.size());
      unit.push_back(std::move(u));
    }
    double mm = 0.0;
    for (double x : mean) mm += x * x;
    const double m_norm = std::sqrt(mm) + 1e-8;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      double dot = 0.0;
      for (std::size_t k = 0; k < d; ++k) dot += unit[i][k] * mean[k];
      out[i] = -dot / m_norm;
    }
    return out;
  }

  void stamp_budget(int budget) {
    if (budget < 1) throw std::invalid_argument("AdaptiveSequenceOracle: budget must be >= 1");
    budget_ = budget;
    g_ = clamp_recent(grace_for_budget_(budget), budget, n_sink_);
    const double f = std::ceil(floor_ * static_cast<double>(budget));
    floor_rows_ = std::min(static_cast<std::size_t>(budget), static_cast<std::size_t>(f));
  }

  /// Removes the lowest candidate, one at a time, while the heads hold more than the pool
  /// (adds to evicted_ and margin_).
  void pooled_eviction(bool with_queries) {
    if (!budget_) return;
    const std::size_t pool = heads_.size() * static_cast<std::size_t>(*budget_);
    if (total_rows() <= pool) return;
    // Ranks are fixed for the whole eviction: computed before any row goes.
    std::vector<std::vector<double>> rank;
    for (std::size_t h = 0; h < heads_.size(); ++h) rank.push_back(ranks_of(h, with_queries));

    while (total_rows() > pool) {
      bool found = false;
      double best_rank = 0.0, second_rank = std::numeric_limits<double>::infinity();
      std::int64_t best_pos = 0;
      std::size_t best_head = 0, best_index = 0;
      std::size_t candidates = 0;
      for (std::size_t h = 0; h < heads_.size(); ++h) {
        const std::vector<OracleRow>& rows = heads_[h].rows();
        const std::size_t n = rows.size();
        if (n <= floor_rows_) continue;  // at its floor: gives up nothing
        for (std::size_t i = 0; i < n; ++i) {
          if (rows[i].position < n_sink_) continue;             // a sink
          if (i + static_cast<std::size_t>(g_) >= n) continue;  // among its newest g
          ++candidates;
          const double r = rank[h][i];
          const std::int64_t p = rows[i].position;
          const bool lower = !found || r < best_rank || (r == best_rank && p < best_pos) ||
                             (r == best_rank && p == best_pos && h < best_head);
          if (lower) {
            if (found) second_rank = std::min(second_rank, best_rank);
            found = true;
            best_rank = r;
            best_pos = p;
            best_head = h;
            best_index = i;
          } else {
            second_rank = std::min(second_rank, r);
          }
        }
      }
      if (!found) break;  // only protected rows and heads at their floor are left
      if (candidates > 1 && !(best_rank == 0.0 && second_rank == 0.0)) {
        const double gap = (second_rank - best_rank) / std::max(1.0, std::fabs(best_rank));
        margin_ = std::min(margin_, gap);
      }
      heads_[best_head].remove_row(best_index);
      rank[best_head].erase(rank[best_head].begin() + static_cast<std::ptrdiff_t>(best_index));
      ++evicted_;
    }
  }

  std::vector<PooledHeadOracle> heads_;
  int n_sink_;
  std::optional<int> budget_;
  double floor_;
  Scorer scorer_;
  double value_power_;
  std::function<int(int)> grace_for_budget_;
  bool rebudgeted_ = false;
  int g_ = 0;
  std::size_t floor_rows_ = 0;
  std::size_t evicted_ = 0;
  double margin_ = std::numeric_limits<double>::infinity();
};

}  // namespace reference
}  // namespace veloxquant
