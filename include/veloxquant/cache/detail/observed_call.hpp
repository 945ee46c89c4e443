// veloxquant — KVzip's two steps (SPEC 18, docs/design.md 6.1): observe scores every retained row
// of a layer by the attention the engine's observed queries give it (the most any query and any
// query head of its group gives it), and a set's compress keeps the best-observed rows over every
// head of every layer with one threshold, each head keeping a floor. The calls themselves keep
// every row (absorb_head, RuleKind::observed).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "call_io.hpp"
#include "call_pipeline.hpp"
#include "checks.hpp"
#include "head_store.hpp"
#include "input.hpp"
#include "layer.hpp"
#include "rule.hpp"
#include "scratch.hpp"
#include "simd_kernels.hpp"

namespace veloxquant::cache::detail {

// ---- observe ----------------------------------------------------------------------------------

/// The scratch of observing S query tokens of G query heads each over `columns` rows of dim d
/// (`own`: with the S tokens' own keys): blocks of about kBlockRows logit rows; a prompt's worth
/// of queries packs the key columns once.
inline ScratchSize observe_scratch(Index S, Index G, Index columns, Index d, bool own) {
  ScratchSize z{std::min(block_tokens(S, G), S) * G, columns + (own ? S : 0), padded_dim(d), false,
                S > 1};
  z.own = own ? S : 0;
  return z;
}

/// The re-read's own keys of head (b, h): [S] rows of an input, KVzip's observe with them.
struct OwnKeys {
  const InputRows* rows = nullptr;
  Index b = 0, h = 0;
  explicit operator bool() const { return rows != nullptr; }
};

/// Scores the rows of one compacted head (slots [0, live())) by the S observed tokens of `q`
/// (KVzip's score: docs/design.md 6.1): each query row's softmax runs over every row of the head
/// (no mask: observed queries come after the rows they score) and, with `own`, over the re-read's
/// own keys up to its token too (causal, as the re-read attends: those columns are not scored);
/// the most any query row gives a slot raises its score.
template <class T>
void observe_head(HeadStore<T>& head, const HeadQueries& q, const OwnKeys& own, Index S,
                  Scratch& sc) {
  const Index n = head.live();
  if (n == 0 || S == 0) return;
  const Index G = q.groups;
  const Index d = head.key_dim(), dp = padded_dim(d);
  const Index block = block_tokens(S, G);
  const Index extra = own ? S : 0;
  const Index ld = Scratch::ld(n + extra);
  float* w = sc.weights.data();
  std::fill(w, w + n + extra, 0.0f);
  // The re-read's keys as float32 rows (read_float_row zero-pads them to dp), packed once as the
  // prefill packs its columns; then each block's logits on them.
  float* own_keys = sc.own.data();
  float* own_packed = own_keys + extra * dp;
  float* own_logits = own_packed + (extra > 0 ? packed_size(extra, d) : 0);
  const Index own_ld = Scratch::ld(extra);
  for (Index j = 0; j < extra; ++j) read_float_row(*own.rows, own.b, own.h, j, own_keys + j * dp);
  if (own) pack_keys(own_keys, dp, 0, extra, d, own_packed, sc.keys.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  PackedColumns packed{S > 1, 0};
  for (Index s0 = 0; s0 < S; s0 += block) {
    const Index nb = std::min(block, S - s0);
    const Index rows = nb * G;
    float* lg = sc.logits.data();
    load_queries(head, q, s0, nb, sc.queries.data());
    block_logits(head, rows, nullptr, n, ld, packed, sc);
    Index cols = n;
    if (own) {
      // Token s0 + t sees the re-read's keys 0 .. s0 + t.
      cols = n + s0 + nb;
      logits_packed(sc.queries.data(), rows, dp, own_packed, s0 + nb, d, scale, own_logits,
                    own_ld, sc.keys.data());
      for (Index r = 0; r < rows; ++r) {
        const Index sees = s0 + r / G + 1;
        float* dst = lg + r * ld + n;
        std::copy(own_logits + r * own_ld, own_logits + r * own_ld + sees, dst);
        std::fill(dst + sees, dst + s0 + nb, neg_inf);
      }
    }
    softmax_max(lg, rows, ld, cols, w, sc.inv.data());
  }
  for (Index i = 0; i < n; ++i) head.score(i) = std::max(head.score(i), w[i]);
}

/// observe on a layer (KVCache::observe): checks the call (nothing changes if it throws), then
/// scores every head's rows; `method` names the cache's in errors. If the engine's parallel-for
/// fails, the layer is cleared and the failure rethrown (as a call's, docs/robustness.md).
template <class T>
void observe_layer(Layer<T>& L, const InputRows& q, const InputRows* own, const char* method) {
  const char* api = "observe";
  if (L.state.rule.kind != RuleKind::observed) {
    throw std::invalid_argument(std::string(api) + ": a '" + method +
                                "' cache keeps scores of its own; observed scores are KVzip's "
                                "(method 'kvzip', SPEC 18)");
  }
  const LayerDims& d = L.state.dims;
  if (!d.known || L.heads.empty()) {
    throw std::invalid_argument(std::string(api) +
                                ": the cache holds no rows yet (observe follows the calls that "
                                "brought the rows it scores)");
  }
  check_observed_queries(q, d.batch, d.heads, d.key_dim, api);
  if (own) check_observed_keys(*own, q, d.heads, d.key_dim, api);
  if (q.seq == 0) return;
  const Index G = q.heads / d.heads;
  const Index n_heads = d.batch * d.heads;
  const ScratchSize size = observe_scratch(q.seq, G, L.live_rows(), d.key_dim, own != nullptr);
  const int tasks = tasks_for(L, n_heads, size);
  const auto workers = static_cast<std::size_t>(tasks);
  if (L.scratch.size() < workers) L.scratch.resize(workers);
  for (auto& s : L.scratch) s.fit(size);
  // With a checkpoint: room to save the rows compaction overwrites (the scores are bookkeeping
  // the checkpoint copied whole).
  for (auto& h : L.heads) h.reserve_journal(0);
  PoolCall pool = pool_call(tasks);
  // No-throw from here on, unless the engine's parallel-for misbehaves.
  for (auto& h : L.heads) h.compact();
  const auto one = [&](Index i, Scratch& sc) {
    const Index b = i / d.heads, h = i % d.heads;
    observe_head(L.heads[static_cast<std::size_t>(i)], HeadQueries{&q, b, h, G},
                 OwnKeys{own, b, h}, q.seq, sc);
  };
  std::exception_ptr thrown;
  if (!for_each_head(L, n_heads, pool, one, thrown)) {
    L.clear();
    rethrow_pool_failure(api, pool, thrown);
  }
  L.state.rule.observed = true;
}

// ---- compress ---------------------------------------------------------------------------------

/// One row compress may drop: its observed score and position, and where it lives (a layer of
/// the set, a head of that layer, a slot of that head).
struct CompressCandidate {
  float score;
  std::int32_t layer;
  std::int64_t pos;
  std::int32_t head;
  Slot slot;
};

/// True when candidate a is kept before b: the higher score, then the earlier position, then the
/// lower layer and head (a total order: the selection is the same on every platform).
inline bool kept_before(const CompressCandidate& a, const CompressCandidate& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.pos != b.pos) return a.pos < b.pos;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.head < b.head;
}

/// The rows a head keeps at least when a compress keeps `keep` of the set: its floor,
/// ceil(head_floor x ceil(keep x rows)), at most its rows.
inline Index compress_floor(Index rows, double keep, double head_floor) {
  const double share = std::ceil(keep * static_cast<double>(rows));
  const auto floor = static_cast<Index>(std::ceil(head_floor * share));
  return std::min(rows, floor);
}

/// KVzip's compress of a set (SPEC 18, docs/design.md 6.1), decided: of the rows the layers'
/// heads hold, R in all, it keeps ceil(keep x R), keep in (0, 1]: first every head's sinks
/// (positions below the layer's n_sink) and the rows no observe call has scored, then each head's
/// best-observed rows up to its floor (compress_floor with the layer's head_floor), then the best
/// of the rest over the whole set (kept_before). Floors that need more than ceil(keep x R) rows
/// win. Returns, per layer and head, the slots to drop. Reads only; may throw bad_alloc.
template <class T>
std::vector<std::vector<std::vector<Slot>>> plan_compress(const std::vector<const Layer<T>*>& set,
                                                          double keep) {
  std::vector<std::vector<std::vector<Slot>>> drop(set.size());
  std::vector<CompressCandidate> rest;  // rows beyond every floor, across the set
  std::vector<CompressCandidate> head_rows;
  Index held = 0, kept = 0;
  for (std::size_t l = 0; l < set.size(); ++l) {
    const Layer<T>& L = *set[l];
    const Rule& rule = L.state.rule;
    drop[l].resize(L.heads.size());
    for (std::size_t hi = 0; hi < L.heads.size(); ++hi) {
      const HeadStore<T>& h = L.heads[hi];
      const Index n = h.live();
      held += n;
      head_rows.clear();
      Index forced = 0;
      for (const Slot s : h.order()) {
        const float score = h.score(s);
        if (h.position(s) < rule.n_sink || score < 0.0f) {
          ++forced;  // a sink, or a row no query has observed yet
          continue;
        }
        head_rows.push_back(CompressCandidate{score, static_cast<std::int32_t>(l), h.position(s),
                                              static_cast<std::int32_t>(hi), s});
      }
      // The head's floor comes from its best-observed rows.
      const Index floor = compress_floor(n, keep, rule.head_floor);
      const auto own = static_cast<std::size_t>(std::max<Index>(0, floor - forced));
      if (own > 0 && own < head_rows.size()) {
        std::nth_element(head_rows.begin(), head_rows.begin() + static_cast<std::ptrdiff_t>(own),
                         head_rows.end(), kept_before);
      }
      const std::size_t taken = std::min(own, head_rows.size());
      kept += forced + static_cast<Index>(taken);
      rest.insert(rest.end(), head_rows.begin() + static_cast<std::ptrdiff_t>(taken),
                  head_rows.end());
    }
  }
  const auto target =
      std::min<Index>(held, static_cast<Index>(std::ceil(keep * static_cast<double>(held))));
  const auto more = static_cast<std::size_t>(std::max<Index>(0, target - kept));
  if (more > 0 && more < rest.size()) {
    std::nth_element(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(more), rest.end(),
                     kept_before);
  }
  for (std::size_t i = std::min(more, rest.size()); i < rest.size(); ++i) {
    const CompressCandidate& c = rest[i];
    drop[static_cast<std::size_t>(c.layer)][static_cast<std::size_t>(c.head)].push_back(c.slot);
  }
  return drop;
}

/// Room for a compress of `drop` (per head, the slots it drops): the journal of a live
/// checkpoint gets room for the rows compaction overwrites. Strong guarantee.
template <class T>
void reserve_compress(Layer<T>& L, const std::vector<std::vector<Slot>>& drop) {
  for (std::size_t i = 0; i < L.heads.size(); ++i) {
    L.heads[i].reserve_journal(static_cast<Index>(drop[i].size()));
  }
}

/// Applies a compress reserved by reserve_compress: the dropped rows go, every head is compacted
/// and the layer is marked compressed; then each head gives back the room it no longer needs
/// (a head whose reallocation fails keeps its room: the memory is freed where it can be, the
/// compress itself never fails).
template <class T>
void apply_compress(Layer<T>& L, const std::vector<std::vector<Slot>>& drop) noexcept {
  for (std::size_t i = 0; i < L.heads.size(); ++i) {
    HeadStore<T>& h = L.heads[i];
    for (const Slot s : drop[i]) h.mark_dead(s);
    h.drop_dead();
    h.compact();
  }
  L.state.rule.compressed = true;
  for (auto& h : L.heads) {
    try {
      h.shrink_to_fit();
    } catch (const std::bad_alloc&) {
    }
  }
  L.scratch.clear();  // a prompt's scratch (the next call sizes its own)
  L.copy.release_view();
}

}  // namespace veloxquant::cache::detail
