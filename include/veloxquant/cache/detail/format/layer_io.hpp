// veloxquant — a layer's saved form (docs/design.md G): the descriptor every cache writes first
// (state flags, budget, dims, offset, tokens_seen, rows per head), the head blocks (b-major:
// positions, scores where the policy scores rows, what the class adds, keys, values, in the slot
// order compaction would leave), and the way back: read, checked against every rule a layer keeps
// between calls (format/state_checks.hpp), then installed in one step. KVCache<T>::write_state and
// read_state are built from these; a class that adds state adds its fields after the descriptor
// and, through an Extra, in each head block.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "byte_io.hpp"
#include "../layer.hpp"
#include "state_checks.hpp"
#include "state_io.hpp"

namespace veloxquant::cache::detail {

/// What a class adds to each head block: nothing.
struct NoExtra {
  void operator()(ByteWriter& /*out*/, std::size_t /*head*/) const {}
  void read(ByteReader& /*in*/) {}
  template <class Saved>
  void check(const Saved& /*s*/) {}
};

template <class T>
void write_descriptor(const Layer<T>& L, StateWriter& w) {
  using S = SavedCache<T>;
  const LayerState& st = L.state;
  ByteWriter& out = w.out();
  out.u8(static_cast<std::uint8_t>((st.dims.known ? S::kDimsKnown : 0) |
                                   (st.rule.budget ? S::kHasBudget : 0) |
                                   (st.rule.compressed ? S::kCompressed : 0) |
                                   (st.rule.observed ? S::kObserved : 0)));
  out.i32(st.rule.budget.value_or(0));
  for (const Index v : {st.dims.batch, st.dims.heads, st.dims.key_dim, st.dims.value_dim,
                        Index{st.offset}, Index{st.tokens_seen}, L.live_rows()}) {
    out.i64(static_cast<std::int64_t>(v));
  }
}

/// The head blocks; `extra(out, i)` writes what the class adds to head i's, after its scores.
template <class T, class Extra>
void write_heads(const Layer<T>& L, StateWriter& w, const Extra& extra) {
  const Rule& rule = L.state.rule;
  if (!L.state.dims.known || L.live_rows() == 0) return;  // no rows: no head objects
  std::vector<Slot>& src = w.slots();
  for (std::size_t i = 0; i < L.heads.size(); ++i) {
    const HeadStore<T>& h = L.heads[i];
    h.compacted_slots(src);
    w.begin_head();
    if (rule.per_head_rows()) w.out().i64(static_cast<std::int64_t>(h.live()));  // its own rows
    w.positions(h, src);
    if (scored_rows(rule.kind)) w.scores(h, src);
    extra(w.out(), i);
    w.rows(h, src);
    if (h.channel_axis()) write_channel(h, src, w.out());
    w.end_head();
  }
}

/// A head's channel blocks (docs/design.md 7.5, G), after its rows: i64 pending start, u64
/// blocks, their i64 first positions, the key tables then the value tables (u16 halves, [2, D] per
/// block, only for a tensor along channels), then each pending row (position at or after the
/// pending start) in the saved slot order, its key row then its value row at T (likewise).
/// Only the blocks that hold a live row are written.
template <class T>
void write_channel(const HeadStore<T>& h, const std::vector<Slot>& src, ByteWriter& out) {
  const ChannelState<T>& c = h.channel().state();
  const RowFormat& kf = h.key_format();
  const RowFormat& vf = h.value_format();
  const std::int64_t pend = c.pending_start;
  std::vector<std::uint8_t> used(c.starts.size(), 0);
  for (const Slot s : src) {
    const std::int64_t p = h.position(s);
    if (p >= pend) continue;
    const Index b = block_at(c.starts.data(), static_cast<Index>(c.starts.size()), p);
    used[static_cast<std::size_t>(b)] = 1;
  }
  out.i64(pend);
  out.u64(static_cast<std::uint64_t>(std::count(used.begin(), used.end(), 1)));
  for (std::size_t b = 0; b < used.size(); ++b) {
    if (used[b]) out.i64(c.starts[b]);
  }
  for (const auto& [tab, f] : {std::pair<const std::vector<std::uint16_t>*, const RowFormat*>{
                                   &c.ktab, &kf}, {&c.vtab, &vf}}) {
    if (!f->channel_axis()) continue;
    const auto w = static_cast<std::size_t>(2 * f->dim);
    for (std::size_t b = 0; b < used.size(); ++b) {
      if (used[b]) out.bytes(tab->data() + b * w, w * sizeof(std::uint16_t));
    }
  }
  for (const Slot s : src) {
    const std::int64_t p = h.position(s);
    if (p < pend) continue;
    const auto lane = static_cast<std::size_t>(p - pend);
    if (kf.channel_axis()) {
      out.bytes(c.kpend.data() + lane * static_cast<std::size_t>(kf.dim),
                static_cast<std::size_t>(kf.dim) * sizeof(T));
    }
    if (vf.channel_axis()) {
      out.bytes(c.vpend.data() + lane * static_cast<std::size_t>(vf.dim),
                static_cast<std::size_t>(vf.dim) * sizeof(T));
    }
  }
}

/// Reads what write_channel wrote for a head of n rows at positions pos (slot i: pos[i]) into
/// its blocks, checked (check_saved_channel); allocations grow no faster than the file.
template <class T>
void read_channel(ByteReader& in, HeadStore<T>& head, const std::vector<std::int64_t>& pos,
                  Index n) {
  const RowFormat& kf = head.key_format();
  const RowFormat& vf = head.value_format();
  ChannelState<T> c;
  c.pending_start = in.i64();
  const std::uint64_t blocks = in.u64();
  if (blocks > static_cast<std::uint64_t>(n)) bad_state("more channel blocks than rows");
  in.array(c.starts, blocks);
  if (kf.channel_axis()) in.array(c.ktab, blocks * static_cast<std::uint64_t>(2 * kf.dim));
  if (vf.channel_axis()) in.array(c.vtab, blocks * static_cast<std::uint64_t>(2 * vf.dim));
  const Index block = kf.channel_axis() ? kf.block : vf.block;
  const auto lanes = static_cast<std::size_t>(block);
  if (kf.channel_axis()) c.kpend.assign(lanes * static_cast<std::size_t>(kf.dim), T(0.0f));
  if (vf.channel_axis()) c.vpend.assign(lanes * static_cast<std::size_t>(vf.dim), T(0.0f));
  c.lane_slot.assign(lanes, -1);
  std::vector<T> row;
  for (Index i = 0; i < n; ++i) {
    const std::int64_t p = pos[static_cast<std::size_t>(i)];
    if (p < c.pending_start) continue;
    if (p - c.pending_start >= block) bad_state("a row lies beyond the pending block");
    const auto lane = static_cast<std::size_t>(p - c.pending_start);
    if (c.lane_slot[lane] >= 0) bad_state("two rows share a position");
    c.lane_slot[lane] = static_cast<Slot>(i);
    if (kf.channel_axis()) {
      in.array(row, static_cast<std::uint64_t>(kf.dim));
      std::copy(row.begin(), row.end(), c.kpend.begin() + static_cast<std::ptrdiff_t>(lane * static_cast<std::size_t>(kf.dim)));
    }
    if (vf.channel_axis()) {
      in.array(row, static_cast<std::uint64_t>(vf.dim));
      std::copy(row.begin(), row.end(), c.vpend.begin() + static_cast<std::ptrdiff_t>(lane * static_cast<std::size_t>(vf.dim)));
    }
  }
  check_saved_channel(c, kf, vf, pos, n);
  head.channel().state().swap(c);
}

template <class T>
SavedCache<T> read_descriptor(StateReader& r) {
  ByteReader& in = r.in();
  SavedCache<T> s;
  s.flags = in.u8();
  s.budget = in.i32();
  for (std::int64_t* v :
       {&s.batch, &s.heads, &s.key_dim, &s.value_dim, &s.offset, &s.tokens_seen, &s.rows}) {
    *v = in.i64();
  }
  return s;
}

/// The rules every layer keeps between calls, on the descriptor (format/state_checks.hpp; its
/// flags are
/// checked first, by check_saved_flags). `budget_from_config`: the budget in force is the one the
/// config gives.
template <class T>
void check_descriptor(const Layer<T>& L, const SavedCache<T>& s, bool budget_from_config) {
  check_saved_descriptor(s, L.state.rule, L.storage.key_format(s.key_dim),
                         L.storage.value_format(s.value_dim), budget_from_config);
}

/// Reads the head blocks into s.stores, checking each as it comes; `extra` reads what the class
/// adds to each block (extra.read, after the scores) and checks it (extra.check).
template <class T, class Extra>
void read_heads(const Layer<T>& L, StateReader& r, SavedCache<T>& s, Extra& extra) {
  if (!s.dims_known() || s.rows == 0) return;
  const Rule& rule = L.state.rule;
  const RowFormat kf = L.storage.key_format(s.key_dim), vf = L.storage.value_format(s.value_dim);
  const bool with_scores = scored_rows(rule.kind);
  std::vector<std::int64_t> pos;
  std::vector<float> score;
  std::int64_t most = 0;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    std::int64_t held = 0;
    for (std::int64_t hh = 0; hh < s.heads; ++hh) {
      r.begin_head(b, hh);
      // Adaptive and KVzip heads hold their own number of rows (docs/design.md G, 4.9, 6.1); a
      // KVzip cache's before its compress, every row.
      std::int64_t rows = s.rows;
      if (rule.per_head_rows()) {
        rows = r.in().i64();
        check_saved_head_rows(s, rows);
        if (rule.kind == RuleKind::observed && !s.compressed() && rows != s.rows) {
          bad_state("a KVzip head that has not compressed holds every row");
        }
      }
      const auto n = static_cast<std::uint64_t>(rows);
      r.in().array(pos, n);
      if (with_scores) r.in().array(score, n);
      extra.read(r.in());
      HeadStore<T> head(kf, vf);
      r.rows(head, rows);
      // Channel blocks before the rows become live: restore reads them (value weights).
      if (head.channel_axis()) read_channel(r.in(), head, pos, rows);
      // After the rows: its buffers (one weight per slot, one value row) are then no larger than
      // what the file has already paid for; restore computes the weights.
      if (rule.value_power > 0.0) head.enable_value_weights(rule.value_power);
      r.end_head();
      if (rule.kind == RuleKind::observed && !s.observed() &&
          std::any_of(score.begin(), score.end(), [](float x) { return x != kUnobserved; })) {
        bad_state("a KVzip cache never observed holds an observed score");
      }
      check_saved_head(s, rule, head, rows, pos, with_scores ? &score : nullptr);
      extra.check(s);
      r.keep_head();
      s.stores.push_back(std::move(head));
      held += rows;
      most = std::max(most, rows);
    }
    if (rule.adaptive) check_saved_pool(s, rule, held);
  }
  if (most != s.rows) {
    bad_state("the descriptor's " + std::to_string(s.rows) +
              " rows per head are not what the most-holding head holds (" + std::to_string(most) +
              ")");
  }
}

/// Makes the layer stand where the saved one stood (its heads leave `s`): one value for the
/// state, the heads swapped in.
template <class T>
void install(Layer<T>& L, SavedCache<T>& s) {
  // The buffer quantized rows leave the cache through (a layer that has made a call with rows
  // holds one; an empty call's view or fetch after the load needs it). Allocated first.
  if (L.storage.quantized() && s.rows > 0) {
    s.row_buf.assign(static_cast<std::size_t>(row_floats(s.key_dim, s.value_dim)), 0.0f);
  }
  LayerState st;
  st.dims = LayerDims{s.batch, s.heads, s.key_dim, s.value_dim, s.dims_known()};
  st.offset = s.offset;
  st.tokens_seen = s.tokens_seen;
  st.rule = L.state.rule;
  st.rule.budget = s.has_budget() ? std::optional<int>(s.budget) : std::nullopt;
  st.rule.compressed = s.compressed();
  st.rule.observed = s.observed();
  // No-throw from here on. A loaded state drops the checkpoint (the heads are new).
  L.mark.live = false;
  L.heads.swap(s.stores);
  L.state = st;
  if (!s.row_buf.empty()) L.copy.install_row(s.row_buf);
}

}  // namespace veloxquant::cache::detail
