// veloxquant — the H2O core kernels shared by SqueezeAttention, H2O and PyramidKV (SPEC 4).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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

/// Keeps a scratch vector's capacity at `n` elements: grows exactly, and releases memory when
/// more than twice what is needed is held (so a long prompt's scratch does not outlive it).
template <class V>
inline void fit_capacity(V& v, std::size_t n) {
  if (v.capacity() < n) {
    V fresh;
    fresh.reserve(n);
    v.swap(fresh);
  } else if (v.capacity() > 2 * n + 64) {
    V fresh;
    fresh.reserve(n);
    v.swap(fresh);
  }
}

/// Scratch buffers of the H2O kernels of one worker, sized before a call mutates anything.
struct H2OScratch {
  std::vector<float> weights;         // [n] proxy attention of one token over the live rows
  std::vector<float> query;           // [Dk] the proxy query in float32
  std::vector<Slot> picks;            // [n] candidates of a re-budget
  std::vector<float> keys;            // [rows, Dk] keys converted to float32 (block or chunk)
  std::vector<float> logits;          // [block, rows] logits of a block of new tokens
  std::vector<std::int32_t> column;   // [rows] live row (ascending position) -> column of `logits`
  std::vector<Slot> slots;            // [rows] live row (ascending position) -> slot
  std::vector<float> scores;          // [rows] live row (ascending position) -> score

  /// Room for a call that holds up to `rows` rows per head with `new_rows` new ones.
  void reserve(Index rows, Index dk, Index new_rows, Index block, Index chunk) {
    const auto r = static_cast<std::size_t>(rows);
    const auto d = static_cast<std::size_t>(dk);
    fit_capacity(weights, r);
    fit_capacity(query, d);
    fit_capacity(picks, r);
    if (new_rows > 1) {
      const auto b = static_cast<std::size_t>(std::min(block, new_rows));
      fit_capacity(keys, r * d);
      fit_capacity(logits, b * r);
      fit_capacity(column, r);
      fit_capacity(slots, r);
      fit_capacity(scores, r);
    } else {
      fit_capacity(keys, static_cast<std::size_t>(std::min(chunk, rows)) * d);
      fit_capacity(logits, 0);
      fit_capacity(column, 0);
      fit_capacity(slots, 0);
      fit_capacity(scores, 0);
    }
  }

  std::size_t heap_bytes() const {
    return weights.capacity() * sizeof(float) + query.capacity() * sizeof(float) +
           picks.capacity() * sizeof(Slot) + keys.capacity() * sizeof(float) +
           logits.capacity() * sizeof(float) + column.capacity() * sizeof(std::int32_t) +
           slots.capacity() * sizeof(Slot) + scores.capacity() * sizeof(float);
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

/// Converts `n` stored rows starting at `rows` (contiguous, [n, D] of T) to float32 `out` [n, D].
template <class T>
inline void convert_rows(const T* rows, Index n, Index d, float* out) {
  using In = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;
  using Out = Eigen::Map<Eigen::VectorXf>;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, rows, sizeof(float) * static_cast<std::size_t>(n * d));
  } else {
    Out(out, n * d) = In(rows, n * d).template cast<float>();
  }
}

/// Decode fast path of SPEC 4.2 for one new row at slot `s` == live() when the live rows fill
/// slots [0, live()) (no holes): one pass of dot products over contiguous storage (converted in
/// chunks of `chunk` rows), a vectorised softmax and score update, and a protected argmin in slot
/// order (ties to the earliest position). Returns false (nothing done) when the layout does not
/// allow it; the caller then takes the general path.
template <class T>
inline bool absorb_decode(HeadStore<T>& head, Slot s, std::optional<int> budget, int n_sink, int g,
                          float decay, H2OScratch& scratch, Index chunk) {
  const Index n = head.live();
  if (n == 0 || head.physical() != n + 1 || s != n) return false;
  const Index d = head.key_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scratch.query.resize(static_cast<std::size_t>(d));
  scratch.weights.resize(static_cast<std::size_t>(n));
  convert_rows(head.key_ptr(s), 1, d, scratch.query.data());
  const Eigen::Map<const Eigen::VectorXf> q(scratch.query.data(), d);
  Eigen::Map<Eigen::VectorXf> logits(scratch.weights.data(), n);
  using RowsF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  if constexpr (std::is_same_v<T, float>) {
    logits.noalias() = RowsF(head.key_ptr(0), n, d) * q;
  } else {
    scratch.keys.resize(static_cast<std::size_t>(std::min(chunk, n) * d));
    for (Index r0 = 0; r0 < n; r0 += chunk) {
      const Index m = std::min(chunk, n - r0);
      convert_rows(head.key_ptr(r0), m, d, scratch.keys.data());
      logits.segment(r0, m).noalias() = RowsF(scratch.keys.data(), m, d) * q;
    }
  }
  logits *= scale;
  softmax_inplace(logits.data(), n);
  Eigen::Map<Eigen::VectorXf> scores(&head.score(0), n);
  scores = scores * decay + logits;
  head.score(s) = 0.0f;
  head.push_live(s);
  if (!budget || head.live() <= *budget) return true;
  // Protected: sinks (position < n_sink) and the newest g rows (position >= that of the g-th newest).
  const auto& ord = head.order();
  const std::int64_t newest_protected =
      g > 0 ? head.position(ord[static_cast<std::size_t>(head.live() - g)])
            : std::numeric_limits<std::int64_t>::max();
  const std::int64_t* pos = head.positions_data();
  Index best = -1;
  float best_score = 0.0f;
  for (Index i = 0; i <= n; ++i) {
    if (pos[i] < n_sink || pos[i] >= newest_protected) continue;
    const float sc = head.score(i);
    if (best < 0 || sc < best_score || (sc == best_score && pos[i] < pos[best])) {
      best = i;
      best_score = sc;
    }
  }
  if (best < 0) return true;
  const auto it = std::find(ord.begin(), ord.end(), static_cast<Slot>(best));
  head.evict_at(it - ord.begin());
  return true;
}

/// Blocked absorption of the `count` rows at slots [first, first + count) (SPEC 7): per block of
/// `block` new tokens, the logits against the live rows and the block's own rows come from one
/// float32 matrix product; the per-token bookkeeping of SPEC 4.2 then runs over those logits on
/// dense arrays in ascending position (slot, logit column, score), so every O(n) pass is
/// contiguous; evicted rows leave the arrays. Same retained sets as the one-token loop.
template <class T>
inline void absorb_blocked(HeadStore<T>& head, Slot first, Index count, std::optional<int> budget,
                           int n_sink, int g, float decay, H2OScratch& scratch, Index block) {
  const Index d = head.key_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  using RowsF = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  auto& slots = scratch.slots;
  auto& column = scratch.column;
  auto& scores = scratch.scores;
  for (Index i0 = 0; i0 < count; i0 += block) {
    const Index nb = std::min(block, count - i0);
    const Index nc = head.live();
    const Index cols = nc + nb;
    // Dense state of the live rows, then their keys and the block's keys in float32.
    slots.assign(head.order().begin(), head.order().end());
    column.resize(static_cast<std::size_t>(nc));
    scores.resize(static_cast<std::size_t>(nc));
    scratch.keys.resize(static_cast<std::size_t>(cols * d));
    for (Index j = 0; j < nc; ++j) {
      const Slot sl = slots[static_cast<std::size_t>(j)];
      column[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
      scores[static_cast<std::size_t>(j)] = head.score(sl);
      convert_rows(head.key_ptr(sl), 1, d, scratch.keys.data() + j * d);
    }
    convert_rows(head.key_ptr(first + i0), nb, d, scratch.keys.data() + nc * d);
    const RowsF all(scratch.keys.data(), cols, d);
    scratch.logits.resize(static_cast<std::size_t>(nb * cols));
    RowsF logits(scratch.logits.data(), nb, cols);
    logits.noalias() = all.bottomRows(nb) * all.transpose();
    logits *= scale;
    // Sinks are the leading rows (ascending position) and are never evicted.
    Index sinks = 0;
    while (sinks < nc && head.position(slots[static_cast<std::size_t>(sinks)]) < n_sink) ++sinks;
    for (Index t = 0; t < nb; ++t) {
      const auto s = static_cast<Slot>(first + i0 + t);
      const Index n = static_cast<Index>(slots.size());
      float entry = 1.0f;  // an empty head keeps its first row with score 1
      if (n > 0) {
        scratch.weights.resize(static_cast<std::size_t>(n));
        float* w = scratch.weights.data();
        const float* row = scratch.logits.data() + t * cols;
        const std::int32_t* col = column.data();
        for (Index k = 0; k < n; ++k) w[k] = row[col[k]];
        softmax_inplace(w, n);
        Eigen::Map<Eigen::ArrayXf> sc(scores.data(), n);
        sc = sc * decay + Eigen::Map<const Eigen::ArrayXf>(w, n);
        entry = 0.0f;
      }
      slots.push_back(s);
      column.push_back(static_cast<std::int32_t>(nc + t));
      scores.push_back(entry);
      if (head.position(s) < n_sink) ++sinks;
      if (!budget || static_cast<Index>(slots.size()) <= *budget) continue;
      const Index hi = static_cast<Index>(slots.size()) - g;
      if (sinks >= hi) continue;
      Index best = sinks;
      for (Index k = sinks + 1; k < hi; ++k) {
        if (scores[static_cast<std::size_t>(k)] < scores[static_cast<std::size_t>(best)]) best = k;
      }
      head.mark_dead(slots[static_cast<std::size_t>(best)]);
      slots.erase(slots.begin() + best);
      column.erase(column.begin() + best);
      scores.erase(scores.begin() + best);
    }
    for (std::size_t k = 0; k < slots.size(); ++k) head.score(slots[k]) = scores[k];
    head.replace_order(slots);
  }
}

}  // namespace veloxquant::cache::detail
