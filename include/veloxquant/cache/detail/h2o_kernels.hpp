// veloxquant — the H2O core kernels shared by SqueezeAttention, H2O and PyramidKV (SPEC 4).
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "head_store.hpp"
#include "proxy.hpp"

namespace veloxquant::cache::detail {

/// How a policy's protected recent window `g` follows its budget (SPEC 4.2 step 3).
struct GracePolicy {
  bool ratio = true;          ///< true: g = floor(recent_ratio * (budget - n_sink)); false: fixed
  double recent_ratio = 0.5;  ///< used when ratio
  int grace = 16;             ///< used when !ratio

  /// g for `budget`, clamped to [0, budget - n_sink - 1] so one row stays evictable.
  int protected_recent(int budget, int n_sink) const {
    const long long span = static_cast<long long>(budget) - n_sink;
    long long g = ratio ? static_cast<long long>(std::floor(recent_ratio * static_cast<double>(span)))
                        : static_cast<long long>(grace);
    g = std::min(g, span - 1);
    g = std::max(g, 0LL);
    return static_cast<int>(g);
  }
};

/// Scratch buffers of the H2O kernels, reserved before a call mutates anything.
struct H2OScratch {
  std::vector<float> weights;  // [n] proxy attention of one token
  std::vector<float> query;    // [Dk] the proxy query in float32
  std::vector<Slot> picks;     // [n] candidates of a re-budget

  void reserve(Index rows, Index dk) {
    weights.reserve(static_cast<std::size_t>(rows));
    query.reserve(static_cast<std::size_t>(dk));
    picks.reserve(static_cast<std::size_t>(rows));
  }
};

/// Number of leading live rows (ascending position) that are sinks (position < n_sink).
template <class T>
inline Index count_sinks(const HeadStore<T>& head, int n_sink) {
  const auto& ord = head.order();
  Index i = 0;
  const Index n = head.live();
  while (i < n && head.position(ord[static_cast<std::size_t>(i)]) < n_sink) ++i;
  return i;
}

/// Evicts one row: the lowest score among the live rows that are neither sinks nor among the
/// newest `g`; ties go to the earliest position (SPEC 4.2 step 3). Returns false if none qualifies.
template <class T>
inline bool evict_lowest(HeadStore<T>& head, int n_sink, int g) {
  const auto& ord = head.order();
  const Index lo = count_sinks(head, n_sink);
  const Index hi = head.live() - g;
  if (lo >= hi) return false;
  Index best = lo;
  float best_score = head.score(ord[static_cast<std::size_t>(lo)]);
  for (Index i = lo + 1; i < hi; ++i) {
    const float s = head.score(ord[static_cast<std::size_t>(i)]);
    if (s < best_score) {
      best_score = s;
      best = i;
    }
  }
  head.evict_at(best);
  return true;
}

/// Re-budget (SPEC 4.5): keeps the sinks, the newest `g` rows and the highest-score others up to
/// `budget`; among equal scores later positions survive. Order and scores are preserved.
template <class T>
inline void rebudget(HeadStore<T>& head, int budget, int n_sink, int g, H2OScratch& scratch) {
  if (head.live() <= budget) return;
  const auto& ord = head.order();
  const Index lo = count_sinks(head, n_sink);
  const Index hi = std::max(lo, head.live() - g);
  const Index keep_mid = std::max<Index>(0, budget - lo - (head.live() - hi));
  auto& picks = scratch.picks;
  picks.assign(ord.begin() + lo, ord.begin() + hi);
  if (static_cast<Index>(picks.size()) > keep_mid) {
    // Best first: higher score, then later position.
    auto better = [&head](Slot a, Slot b) {
      const float sa = head.score(a), sb = head.score(b);
      if (sa != sb) return sa > sb;
      return head.position(a) > head.position(b);
    };
    std::nth_element(picks.begin(), picks.begin() + keep_mid, picks.end(), better);
    for (auto it = picks.begin() + keep_mid; it != picks.end(); ++it) head.mark_dead(*it);
    head.drop_dead();
  }
}

/// Absorbs one appended row (slot `s`, not yet live) per SPEC 4.2: proxy attention of its key over
/// the live rows, decay and accumulate, join with score 0, then evict one row if over `budget`.
template <class T>
inline void absorb_token(HeadStore<T>& head, Slot s, std::optional<int> budget, int n_sink, int g,
                         float decay, H2OScratch& scratch) {
  const Index n = head.live();
  if (n == 0) {
    head.score(s) = 1.0f;
    head.push_live(s);
    return;
  }
  const Index d = head.key_dim();
  scratch.query.resize(static_cast<std::size_t>(d));
  scratch.weights.resize(static_cast<std::size_t>(n));
  load_row(head.key_ptr(s), d, scratch.query.data());
  const Slot* live = head.order().data();
  proxy_attention(head, live, n, scratch.query.data(), scratch.weights.data());
  for (Index i = 0; i < n; ++i) {
    float& sc = head.score(live[i]);
    sc = sc * decay + scratch.weights[static_cast<std::size_t>(i)];
  }
  head.score(s) = 0.0f;
  head.push_live(s);
  if (budget && head.live() > *budget) evict_lowest(head, n_sink, g);
}

}  // namespace veloxquant::cache::detail
