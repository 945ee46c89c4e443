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
                                   (st.rule.compressed ? S::kCompressed : 0)));
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
    if (rule.adaptive) w.out().i64(static_cast<std::int64_t>(h.live()));  // its own rows
    w.positions(h, src);
    if (scored_rows(rule.kind)) w.scores(h, src);
    extra(w.out(), i);
    w.rows(h, src);
    w.end_head();
  }
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
      // Adaptive heads hold their own number of rows (docs/design.md G, 4.9).
      std::int64_t rows = s.rows;
      if (rule.adaptive) {
        rows = r.in().i64();
        check_saved_head_rows(s, rows);
      }
      const auto n = static_cast<std::uint64_t>(rows);
      r.in().array(pos, n);
      if (with_scores) r.in().array(score, n);
      extra.read(r.in());
      HeadStore<T> head(kf, vf);
      r.rows(head, rows);
      // After the rows: its buffers (one weight per slot, one value row) are then no larger than
      // what the file has already paid for; restore computes the weights.
      if (rule.value_power > 0.0) head.enable_value_weights(rule.value_power);
      r.end_head();
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
  // No-throw from here on. A loaded state drops the checkpoint (the heads are new).
  L.mark.live = false;
  L.heads.swap(s.stores);
  L.state = st;
  if (!s.row_buf.empty()) L.copy.install_row(s.row_buf);
}

}  // namespace veloxquant::cache::detail
