// veloxquant — one call absorbed by a scored policy (docs/design.md 4.2, 4.6, 6): the H2O core
// (SqueezeAttention, H2O, PyramidKV) and TOVA. The call's tokens go in blocks: a block's query
// rows against the columns they may attend to (block_logits), then per token a softmax over its
// visible columns averaged over its query rows, then the policy's step for that token.
//
// Columns are either the head's storage slots themselves (one-token calls, and calls scored with
// queries whose evictions come once at the end: no copy at all) or the live rows gathered per block
// (multi-token calls that evict per token, so that a long prompt attends over the budget, not over
// everything it has seen). An evicted or dead column gets logit -inf and so weight exactly 0.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "call_io.hpp"
#include "eviction.hpp"
#include "head_store.hpp"
#include "rule.hpp"
#include "scratch.hpp"
#include "select.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

/// The columns one block of a call attends to: the head's storage slots [0, nc + nb) themselves,
/// or (gathered) copies of the live rows' state followed by the block's own rows.
struct BlockColumns {
  Index nc = 0;                       ///< columns before the block's first token
  const Slot* slot = nullptr;         ///< gathered: column -> slot; null: column c is slot c
  float* score = nullptr;             ///< by column
  const std::int64_t* pos = nullptr;  ///< by column
  std::uint8_t* alive = nullptr;      ///< by column
};

/// Absorbs the `count` rows appended at slots [call_begin(), call_begin() + count) of a head by
/// a scored rule. With `att` (only for a call whose columns are exactly its window: no gather, no
/// holes) it also writes the attention output of every query row from the very softmax rows the
/// scores come from (docs/design.md 2.8).
template <class T>
class ScoredCall {
 public:
  ScoredCall(HeadStore<T>& head, const Rule& rule, const CallPlan& plan, const HeadQueries& q,
             const HeadAttend& att, Scratch& sc)
      : head_(head),
        rule_(rule),
        plan_(plan),
        q_(q),
        att_(att),
        sc_(sc),
        first_(head.call_begin()),
        G_(q ? q.groups : 1),
        tova_(rule.kind == RuleKind::last_attention),
        once_per_call_(!tova_ && q),  // docs/design.md 4.6: evictions once, at the end
        g_(rule.protected_recent()),
        holes_(!plan.gather && head.live() < first_),  // a re-budget at the call's start
        live_(head.live()) {}

  void run(Index count) {
    packed_.on = count > 1 && !plan_.gather;
    for (Index i0 = 0; i0 < count; i0 += plan_.block) block(i0, std::min(plan_.block, count - i0));
    if (once_per_call_ && rule_.budget) {
      const bool weighted = rule_.value_power > 0.0 && head_.live() > *rule_.budget;
      rebudget(head_, *rule_.budget, rule_.n_sink, g_, sc_,
               weighted ? value_rank_head(head_, sc_) : nullptr);
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  static constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min();
  static constexpr std::int64_t kAll = std::numeric_limits<std::int64_t>::max();

  /// Tokens [i0, i0 + nb) of the call.
  void block(Index i0, Index nb) {
    i0_ = i0;
    nb_ = nb;
    cols_ = columns(first_ + i0);
    const Index ncols = cols_.nc + nb;
    ld_ = Scratch::ld(ncols);
    lg_ = sc_.logits.data();
    load_queries(head_, q_, i0, nb, sc_.queries.data());
    block_logits(head_, nb * G_, cols_.slot, ncols, ld_, packed_, sc_);
    if (holes_) mask_holes();
    for (Index t = 0; t < nb; ++t) {
      if (tova_) {
        tova_token(t);
      } else if (once_per_call_) {
        accumulate_token(t);
      } else {
        proxy_token(t);
      }
    }
    if (plan_.gather) scatter(ncols);
  }

  /// The block's columns, its first row at slot `row0`.
  BlockColumns columns(Index row0) {
    BlockColumns c;
    if (!plan_.gather) {
      c.nc = row0;
      c.score = head_.scores_data();
      c.pos = head_.positions_data();
      c.alive = head_.alive_data();
      return c;
    }
    c.nc = head_.live();
    Slot* slot = sc_.slot.data();
    std::int64_t* pos = sc_.pos.data();
    c.slot = slot;
    c.score = sc_.score.data();
    c.pos = pos;
    c.alive = sc_.alive.data();
    const Slot* ord = head_.order().data();
    for (Index j = 0; j < c.nc + nb_; ++j) {
      const Slot sl = j < c.nc ? ord[j] : static_cast<Slot>(row0 + (j - c.nc));
      slot[j] = sl;
      c.score[j] = head_.score(sl);
      pos[j] = head_.position(sl);
      c.alive[j] = 1;
    }
    return c;
  }

  /// Slots left dead before the call's rows by a re-budget get weight 0.
  void mask_holes() {
    for (Index c = 0; c < first_; ++c) {
      if (cols_.alive[c]) continue;
      for (Index r = 0; r < nb_ * G_; ++r) lg_[r * ld_ + c] = kNegInf;
    }
  }

  /// Gathered scores back to their slots; the live order is the surviving columns in order.
  void scatter(Index ncols) {
    std::int32_t* order = sc_.picks.data();
    Index n = 0;
    for (Index c = 0; c < ncols; ++c) {
      if (!cols_.alive[c]) continue;
      head_.score(cols_.slot[c]) = cols_.score[c];
      order[n++] = cols_.slot[c];
    }
    head_.assign_order(order, n);
  }

  float* rows_of(Index t) const { return lg_ + t * G_ * ld_; }
  Slot slot_of(Index t) const { return static_cast<Slot>(first_ + i0_ + t); }

  /// Token t's attention output from its softmax rows (normalisers in sc.inv), over columns [0, n).
  void attend(Index t, Index n) {
    weighted_rows(rows_of(t), ld_, sc_.inv.data(), G_, head_.value_rows(), head_.value_dim(), n,
                  att_.row(i0_ + t, 0), att_.stride());
  }

  /// TOVA (docs/design.md 6): the token's attention over every row, itself included, replaces
  /// the scores; over budget, the lowest-scored row but the sinks goes.
  void tova_token(Index t) {
    const Index ct = cols_.nc + t;
    if (!plan_.gather) head_.push_live(slot_of(t));
    ++live_;
    const bool evict = rule_.budget && live_ > *rule_.budget;
    if (!evict && !att_ && !rule_.pooled) return;
    float* w = sc_.weights.data();
    softmax_mean(rows_of(t), G_, ld_, ct + 1, w, sc_.inv.data());
    if (att_) attend(t, ct + 1);
    if (!evict && !rule_.pooled) return;
    std::copy(w, w + ct + 1, cols_.score);
    if (!evict) return;
    evict_worst(t, ct, rule_.n_sink, kAll, 0);
  }

  /// A call with queries (docs/design.md 4.6): the token's mean softmax over the rows retained
  /// before the call and the call's rows up to itself accumulates into their scores; evictions
  /// wait for the end of the call (run).
  void accumulate_token(Index t) {
    const Index ct = cols_.nc + t;
    float* w = sc_.weights.data();
    softmax_mean(rows_of(t), G_, ld_, ct + 1, w, sc_.inv.data());
    if (att_) attend(t, ct + 1);
    decay_accumulate(cols_.score, w, ct + 1, rule_.decay);
    head_.push_live(slot_of(t));
  }

  /// Key-as-query (docs/design.md 4.2): the token's key attends over the rows retained before it;
  /// over budget, the lowest-scored row but the sinks and the newest g goes.
  void proxy_token(Index t) {
    const Index ct = cols_.nc + t;
    if (live_ == 0) {
      cols_.score[ct] = 1.0f;
    } else {
      float* w = sc_.weights.data();
      softmax_mean(rows_of(t), 1, ld_, ct, w);
      decay_accumulate(cols_.score, w, ct, rule_.decay);
      cols_.score[ct] = 0.0f;
    }
    if (!plan_.gather) head_.push_live(slot_of(t));
    ++live_;
    if (!rule_.budget || live_ <= *rule_.budget) return;
    // The newest g live rows are always the last g of the position-ordered sequence (a row is
    // protected from the moment it arrives until g newer ones have, and only unprotected rows
    // are evicted).
    const std::int64_t* pos = cols_.pos;
    const std::int64_t newest = g_ == 0 ? kAll : ct + 1 >= g_ ? pos[ct + 1 - g_] : kNone;
    evict_worst(t, ct, rule_.n_sink, newest, g_);
  }

  /// After token t (column ct) joined: evicts the lowest-scored row among all but the first
  /// `n_sink` positions and the newest `g` rows (gathered: positions from `newest` on), ties to
  /// the earliest, if there is one.
  void evict_worst(Index t, Index ct, int n_sink, std::int64_t newest, int g) {
    if (plan_.gather) {
      const Index k = worst_of(cols_.score, cols_.pos, cols_.alive, ct + 1, n_sink, newest,
                               Tie::evict_earliest);
      if (k >= 0) kill(t, k, -1), --live_;
    } else {
      const Index at = worst_live(head_, n_sink, g, sc_.weights.data());
      if (at >= 0) kill(t, -1, at), --live_;
    }
  }

  /// Evicts column c: a slot found by worst_live (at index `at` of the live order), or a gathered
  /// column (its logits in the block's rows after token t's become -inf).
  void kill(Index t, Index c, Index at) {
    if (!plan_.gather) {
      head_.evict_at(at);
      return;
    }
    cols_.alive[c] = HeadStore<T>::kDead;
    head_.mark_dead(cols_.slot[c]);
    for (Index r = (t + 1) * G_; r < nb_ * G_; ++r) lg_[r * ld_ + c] = kNegInf;
  }

  HeadStore<T>& head_;
  const Rule& rule_;
  const CallPlan& plan_;
  const HeadQueries& q_;
  const HeadAttend& att_;
  Scratch& sc_;
  const Index first_, G_;
  const bool tova_, once_per_call_;
  const int g_;
  const bool holes_;
  Index live_;
  PackedColumns packed_;
  // The block in progress.
  Index i0_ = 0, nb_ = 0, ld_ = 0;
  BlockColumns cols_;
  float* lg_ = nullptr;
};

/// The scored policies' driver (docs/design.md 4.2, 4.6, 6): see ScoredCall.
template <class T>
void absorb_scored(HeadStore<T>& head, const Rule& rule, const CallPlan& plan, Index count,
                   const HeadQueries& q, const HeadAttend& att, Scratch& sc) {
  ScoredCall<T>(head, rule, plan, q, att, sc).run(count);
}

}  // namespace veloxquant::cache::detail
