// fuzz target `ops` (fuzz/fuzz_ops.hpp): the checks of the cache under test against the models
// — the window a call returned, the state and accounting after every accepted call or trim, each
// head's retained rows against the oracle, the budget getters and the coordinator — and the
// difference of two snapshots for the messages of the strong-guarantee checks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ops_budget.hpp"
#include "ops_calls.hpp"
#include "ops_config.hpp"
#include "ops_oracle.hpp"
#include "ops_report.hpp"
#include "ops_subject.hpp"
#include "ops_ties.hpp"

namespace veloxquant::fuzz::detail {

/// What differs between two snapshots (names of fields).
inline std::string diff(const Snapshot& a, const Snapshot& b) {
  const auto shape = [](const vt::Shape& x) {
    return fmt_vec(std::vector<Index>(x.begin(), x.end()));
  };
  std::ostringstream os;
  if (a.offset != b.offset) os << " offset " << a.offset << "->" << b.offset;
  if (a.tokens_seen != b.tokens_seen)
    os << " tokens_seen " << a.tokens_seen << "->" << b.tokens_seen;
  if (a.tokens_kept != b.tokens_kept)
    os << " tokens_kept " << a.tokens_kept << "->" << b.tokens_kept;
  if (a.kept_bytes != b.kept_bytes) os << " kept_bytes " << a.kept_bytes << "->" << b.kept_bytes;
  if (a.full_seq_bytes != b.full_seq_bytes)
    os << " full_seq_bytes " << a.full_seq_bytes << "->" << b.full_seq_bytes;
  if (a.heap != b.heap) os << " heap_bytes " << a.heap << "->" << b.heap;
  if (a.key_shape != b.key_shape || a.value_shape != b.value_shape)
    os << " state shape " << shape(a.key_shape) << "->" << shape(b.key_shape);
  if (a.keys != b.keys || a.values != b.values) os << " state bytes";
  if (a.batch != b.batch || a.heads != b.heads || a.key_dim != b.key_dim ||
      a.value_dim != b.value_dim)
    os << " dims";
  if (a.ragged != b.ragged || a.head_keys != b.head_keys || a.head_values != b.head_values)
    os << " ragged heads' rows";
  if (a.scores != b.scores) os << " scores";
  if (a.positions != b.positions) os << " positions";
  if (a.budget != b.budget) os << " budget";
  if (a.protected_recent != b.protected_recent) os << " protected_recent";
  if (a.layer_budget != b.layer_budget) os << " layer_budget";
  if (a.compressed != b.compressed) os << " compressed";
  if (a.adopted != b.adopted) os << " adopted";
  if (a.concentration != b.concentration) os << " concentration";
  if (a.reports != b.reports || a.finalized != b.finalized || a.generation != b.generation)
    os << " coordinator";
  if (!(a == b) && os.str().empty()) os << " (a field diff() does not name)";
  return os.str();
}

/// The checks; they read the cache under test and the models (and mark a head's model diverged
/// after an excused near-tie difference).
template <class T>
class Checks {
 public:
  Checks(const RunSpec& spec, const CacheUnderTest<T>& cache, const BudgetModel& budget,
         SequenceModel<T>& seq, Reporter& report)
      : spec_(spec), cache_(cache), budget_(budget), seq_(seq), report_(report) {}

  /// The positions head i retains: reported (scored caches), else the exact models'.
  Positions positions(std::size_t i) const {
    const Index b = static_cast<Index>(i) / seq_.H, h = static_cast<Index>(i) % seq_.H;
    Positions out;
    if (cache_.scored) {
      out = vt::policy_positions(*cache_.layer, b, h);
    } else if (seq_.heads[i].stream) {
      out = seq_.heads[i].stream->positions();
    } else {
      for (std::int64_t p = 0; p < seq_.offset; ++p) out.push_back(p);
    }
    return out;
  }

  /// The returned window (docs/design.md 4.4 / 2.3): the rows retained before the call (from
  /// `before`, at `pos_before`) then the call's rows; (B, H, Dk, Dv): the call's dims. Adaptive
  /// heads (SPEC 14) may hold different numbers of rows before the call: head (b, h) returns its
  /// own and the call's, and a view whose heads differ says ragged() and refuses rows().
  void window(const Window<T>& w, const Snapshot& before, const std::vector<Positions>& pos_before,
              const CallInputs<T>& in, Index S, const CallDims& d, bool dims_were_known) const {
    if (spec_.adaptive) {
      adaptive_window(w, before, pos_before, in, S, d, dims_were_known);
      return;
    }
    const Index n_before = dims_were_known ? static_cast<Index>(seq_.count) : 0;
    const Index n = n_before + S;
    std::ostringstream os;
    os << "returned window: " << (w.is_view ? "view " : "tensors ") << "[" << w.B << ", " << w.H
       << ", " << w.n << ", " << w.Dk << "/" << w.Dv << "], expected [" << d.B << ", " << d.H
       << ", " << n << " = " << n_before << " + " << S << ", " << d.Dk << "/" << d.Dv << "]";
    report_.expect(w.B == d.B && w.H == d.H && w.n == n && w.Dk == d.Dk && w.Dv == d.Dv, os.str());
    if (w.is_view) report_.expect(w.S == S, "view new_rows() " + std::to_string(w.S) + " != S");
    if (n == 0) return;
    for (Index b = 0; b < d.B; ++b) {
      for (Index h = 0; h < d.H; ++h) {
        window_head(w, before, pos_before, in, S, d, n_before, n_before, b, h);
      }
    }
  }

  /// window() for adaptive heads: each head's rows before the call are its positions before it.
  void adaptive_window(const Window<T>& w, const Snapshot& before,
                       const std::vector<Positions>& pos_before, const CallInputs<T>& in, Index S,
                       const CallDims& d, bool dims_were_known) const {
    const Index heads = d.B * d.H;
    std::vector<Index> n_before(static_cast<std::size_t>(heads), 0);
    if (dims_were_known) {
      for (Index i = 0; i < heads; ++i) {
        n_before[static_cast<std::size_t>(i)] =
            static_cast<Index>(pos_before[static_cast<std::size_t>(i)].size());
      }
    }
    const bool differ = std::adjacent_find(n_before.begin(), n_before.end(),
                                           std::not_equal_to<>()) != n_before.end();
    report_.expect(w.B == d.B && w.H == d.H && w.Dk == d.Dk && w.Dv == d.Dv &&
                       static_cast<Index>(w.rows.size()) == heads,
                   "returned window: [" + std::to_string(w.B) + ", " + std::to_string(w.H) +
                       ", ., " + std::to_string(w.Dk) + "/" + std::to_string(w.Dv) +
                       "], expected [" + std::to_string(d.B) + ", " + std::to_string(d.H) +
                       ", ., " + std::to_string(d.Dk) + "/" + std::to_string(d.Dv) + "]");
    report_.expect(w.is_view || !differ, "a fetch returned ragged heads " + fmt_vec(n_before));
    if (w.is_view) {
      report_.expect(w.S == S, "view new_rows() " + std::to_string(w.S) + " != S");
      report_.expect(w.ragged == differ && w.rows_threw == differ,
                     std::string("a view of heads holding ") + fmt_vec(n_before) + " + S rows " +
                         (w.ragged ? "says" : "does not say") + " ragged() and rows() " +
                         (w.rows_threw ? "throws" : "does not throw"));
    }
    for (Index i = 0; i < heads; ++i) {
      const Index want = n_before[static_cast<std::size_t>(i)] + S;
      const Index got = w.rows[static_cast<std::size_t>(i)];
      report_.expect(got == want, "returned window: head " + std::to_string(i) + " holds " +
                                      std::to_string(got) + " rows, expected " +
                                      std::to_string(want) + " = " +
                                      std::to_string(n_before[static_cast<std::size_t>(i)]) +
                                      " + " + std::to_string(S));
      if (!w.is_view && w.n != want) report_.fail("fetched window of the wrong row count");
    }
    for (Index b = 0; b < d.B; ++b) {
      for (Index h = 0; h < d.H; ++h) {
        // The state before: per head when ragged (Snapshot::head_keys), else state()'s tensors.
        // (A head with no rows has nothing to compare: an empty call before the first call may
        // claim other dims than the sequence's.)
        const Index nb = n_before[static_cast<std::size_t>(b * d.H + h)];
        if (nb + S == 0) continue;
        window_head(w, before, pos_before, in, S, d, nb, before.ragged ? -1 : nb, b, h);
      }
    }
  }

  /// Everything after an accepted call (or a trim) against the models; `pos_before`: each
  /// head's positions before the call, `S`: its tokens (adaptive heads' floors need them).
  void after_call(const std::vector<Positions>& pos_before = {}, Index S = 0) {
    if (spec_.adaptive) {
      adaptive_after_call(pos_before, S);
      return;
    }
    const vc::KVPair<T> st = accounting();
    const Index n = st.first.dimension(2);
    if (cache_.core && budget_.budget) {
      report_.expect(n <= *budget_.budget, "H2O-core head holds " + std::to_string(n) +
                                               " rows over budget " +
                                               std::to_string(*budget_.budget));
    }
    if (cache_.tova) report_.expect(n <= spec_.cfg.tova_budget, "TOVA head over budget");
    if (cache_.stream)
      report_.expect(n <= spec_.cfg.stream_n_sink + spec_.cfg.stream_window_size,
                     "StreamingLLM head over n_sink + window");
    budget_getters();

    for (Index b = 0; b < seq_.B; ++b) {
      for (Index h = 0; h < seq_.H; ++h) head(st, b, h, n);
    }
  }

  /// after_call for adaptive heads (SPEC 14, docs/design.md 4.9), whose heads may hold
  /// different numbers of rows: each sequence's heads hold exactly the pool model's rows (all of
  /// them, or H x budget: never more), each head at least min(its rows before + S, ceil(floor x
  /// budget)); kept_bytes() is the sum of the rows held, tokens_kept() head (0, 0)'s; ragged heads
  /// make state() throw std::invalid_argument naming attend and update_and_view, changing nothing,
  /// and else state() holds what an empty call's view shows; then every head as after_call does
  /// (positions, the rows fed at them, sinks, the protected recent rows, the oracle), an excused
  /// divergence of one head ending the comparison of its whole sequence (the pool couples them).
  void adaptive_after_call(const std::vector<Positions>& pos_before, Index S) {
    vc::KVCache<T>& c = *cache_.layer;
    const Index B = seq_.B, H = seq_.H;
    counters();
    std::vector<Positions> pos;
    std::vector<Index> rows;
    for (Index i = 0; i < B * H; ++i) {
      pos.push_back(positions(static_cast<std::size_t>(i)));
      rows.push_back(static_cast<Index>(pos.back().size()));
    }
    const std::optional<int>& budget = budget_.budget;
    const Index floor_rows =
        budget
            ? std::min<Index>(*budget, static_cast<Index>(std::ceil(spec_.cfg.head_budget_floor *
                                                                    static_cast<double>(*budget))))
            : 0;
    std::size_t total = 0;
    for (Index b = 0; b < B; ++b) {
      Index held = 0;
      for (Index h = 0; h < H; ++h) held += rows[static_cast<std::size_t>(b * H + h)];
      total += static_cast<std::size_t>(held);
      report_.expect(held == seq_.pooled, "sequence " + std::to_string(b) + "'s heads hold " +
                                              std::to_string(held) + " rows " + fmt_vec(rows) +
                                              ", the pool model " + std::to_string(seq_.pooled));
      if (budget) {
        report_.expect(held <= H * *budget, "sequence " + std::to_string(b) + " holds " +
                                                std::to_string(held) + " rows, over its pool of " +
                                                std::to_string(H) + " x " +
                                                std::to_string(*budget));
      }
    }
    for (Index i = 0; i < B * H && budget; ++i) {
      const Index was = pos_before.empty()
                            ? 0
                            : static_cast<Index>(pos_before[static_cast<std::size_t>(i)].size());
      report_.expect(rows[static_cast<std::size_t>(i)] >= std::min(was + S, floor_rows),
                     "head " + std::to_string(i) + " holds " +
                         std::to_string(rows[static_cast<std::size_t>(i)]) +
                         " rows, below its floor " + std::to_string(floor_rows) + " (it held " +
                         std::to_string(was) + " + " + std::to_string(S) + ")");
    }
    report_.expect(c.tokens_kept() == rows.front(), "tokens_kept() is not head (0, 0)'s rows");
    byte_accounting(static_cast<std::size_t>(total));
    // state() serves equal heads only; an empty call's view serves every head.
    const bool ragged =
        std::adjacent_find(rows.begin(), rows.end(), std::not_equal_to<>()) != rows.end();
    if (ragged) report_.count(&Stats::ragged_calls);
    const std::vector<vt::HeadRows> held = vt::held_rows(c);
    if (ragged) {
      const Snapshot before = cache_.snapshot();
      std::string what;
      try {
        (void)c.state();
      } catch (const std::invalid_argument& e) {
        what = e.what();
      }
      report_.expect(vt::is_ragged_refusal(what),
                     "state() on ragged heads " + fmt_vec(rows) +
                         (what.empty() ? std::string(" did not throw") : " threw: " + what));
      const Snapshot after = cache_.snapshot();
      report_.expect(after == before,
                     "a refused state() changed the cache: " + diff(before, after));
    } else {
      const vc::KVPair<T> st = c.state();
      std::vector<T> keys, values;
      for (const vt::HeadRows& r : held) {
        const auto* k = reinterpret_cast<const T*>(r.keys.data());
        const auto* v = reinterpret_cast<const T*>(r.values.data());
        keys.insert(keys.end(), k, k + r.keys.size() / sizeof(T));
        values.insert(values.end(), v, v + r.values.size() / sizeof(T));
      }
      report_.expect(
          st.first.dimension(0) == B && st.first.dimension(1) == H &&
              st.first.dimension(2) == rows.front() && st.first.dimension(3) == seq_.Dk &&
              st.second.dimension(2) == rows.front() && st.second.dimension(3) == seq_.Dv,
          "state() of equal heads has the wrong shape");
      report_.expect(
          std::equal(keys.begin(), keys.end(), st.first.data(), st.first.data() + st.first.size(),
                     [](T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }) &&
              std::equal(values.begin(), values.end(), st.second.data(),
                         st.second.data() + st.second.size(),
                         [](T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }),
          "state() is not the rows an empty call's view shows");
    }
    budget_getters();
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const auto i = static_cast<std::size_t>(b * H + h);
        const std::string where = "head (" + std::to_string(b) + ", " + std::to_string(h) + ")";
        const Positions& p = pos[i];
        report_.expect(vt::policy_scores(c, b, h).size() == p.size(),
                       where + " scores() size differs");
        report_.expect(held[i].positions == p, where + " an empty call's view holds " +
                                                   fmt_vec(held[i].positions) + ", positions() " +
                                                   fmt_vec(p));
        for (std::size_t k = 0; k < p.size(); ++k) {
          report_.expect(p[k] >= 0 && p[k] < seq_.offset && (k == 0 || p[k - 1] < p[k]),
                         where + " positions are not ascending within [0, offset): " + fmt_vec(p));
        }
        held_head_rows(held[i], i, where);
        head_keeps(p, where);
        compare_oracle(seq_.heads[i], p, where, b, h);
      }
      // The pool couples a sequence's heads: one head's excused divergence ends them all.
      bool diverged = false;
      for (Index h = 0; h < H; ++h)
        diverged = diverged || seq_.heads[static_cast<std::size_t>(b * H + h)].diverged;
      for (Index h = 0; h < H; ++h)
        seq_.heads[static_cast<std::size_t>(b * H + h)].diverged = diverged;
    }
  }

  /// reset() left nothing behind.
  void after_reset() const {
    const vc::KVCache<T>& c = *cache_.layer;
    const auto st = c.state();
    report_.expect(c.offset() == 0 && c.tokens_seen() == 0 && c.kept_bytes() == 0 &&
                       c.tokens_kept() == 0 && st.first.size() == 0 && c.batch() == 0,
                   "reset() left rows, offset or dims behind");
    budget_getters();
  }

  /// budget(), n_sink(), protected_recent(), layer_budget() and the rest of each policy's
  /// getters against the config and the budget model; then the coordinator.
  void budget_getters() const {
    if (cache_.core) core_getters();
    const vc::KVCacheConfig& cfg = spec_.cfg;
    if (cache_.squeeze) {
      const int want = budget_.budget ? *budget_.budget : budget_.fallback();
      report_.expect(cache_.squeeze->layer_budget() == want,
                     "squeeze layer_budget() " + std::to_string(cache_.squeeze->layer_budget()) +
                         ", expected " + std::to_string(want));
      report_.expect(cache_.squeeze->budget_adopted() == budget_.sq_adopted,
                     "budget_adopted() differs from the model");
    }
    if (cache_.h2o)
      report_.expect(cache_.h2o->layer_budget() == cfg.h2o_budget, "h2o layer_budget()");
    if (cache_.pyramid)
      report_.expect(cache_.pyramid->layer_budget() == *budget_.budget, "pyramidkv layer_budget()");
    if (cache_.tova)
      report_.expect(cache_.tova->layer_budget() == cfg.tova_budget &&
                         cache_.tova->n_sink() == cfg.tova_n_sink,
                     "tova layer_budget()/n_sink()");
    if (cache_.stream) {
      report_.expect(cache_.stream->layer_budget() == cfg.stream_n_sink + cfg.stream_window_size &&
                         cache_.stream->n_sink() == cfg.stream_n_sink &&
                         cache_.stream->window_size() == cfg.stream_window_size,
                     "streaming layer_budget()/n_sink()/window_size()");
    }
    if (cache_.snap) {
      report_.expect(cache_.snap->layer_budget() == cfg.snap_budget &&
                         cache_.snap->n_sink() == cfg.snap_n_sink &&
                         cache_.snap->obs_window() == cfg.snap_obs_window,
                     "snapkv layer_budget()/n_sink()/obs_window()");
      report_.expect(cache_.snap->compressed() == seq_.snap_compressed,
                     "snapkv compressed() differs from the model");
    }
    coordinator();
  }

  /// The coordinator's reports, finalisation and resolved budget against its model.
  void coordinator() const {
    if (!cache_.coordinator) return;
    const CoordinatorModel& m = budget_.coord;
    const std::map<int, double> got = cache_.coordinator->reports();
    report_.expect(got == m.reports, "coordinator reports differ from the model (" +
                                         std::to_string(got.size()) + " vs " +
                                         std::to_string(m.reports.size()) + " layers)");
    report_.expect(cache_.coordinator->is_finalized() == m.finalized,
                   "coordinator finalisation differs");
    // (-1: none; budgets are >= 1.)
    const auto it = m.budgets.find(spec_.layer);
    const int want = it == m.budgets.end() ? -1 : it->second;
    const int have = cache_.coordinator->resolved_budget(spec_.layer).value_or(-1);
    report_.expect(have == want, "resolved_budget(" + std::to_string(spec_.layer) + ") " +
                                     std::to_string(have) + ", model " + std::to_string(want) +
                                     " (-1: none)");
  }

  /// concentration() after the first call: mean over B·H heads of the Gram-matrix reference.
  void concentration(const vc::Tensor4<T>& kt) const {
    double sum = 0.0;
    for (Index head = 0; head < seq_.B * seq_.H; ++head) {
      Rows rows;
      for (Index s = 0; s < kt.dimension(2); ++s) rows.push_back(tensor_row(kt, head, s));
      sum += ref::concentration_score_gram(rows);
    }
    const double want = sum / static_cast<double>(seq_.B * seq_.H);
    const double got = cache_.squeeze->concentration();
    std::ostringstream os;
    os << "concentration() " << got << ", reference " << want;
    report_.expect(std::fabs(got - want) <= kConcentrationTol, os.str());
  }

 private:
  /// Head (b, h) of the returned window, row by row. `stride`: the rows per head of the state()
  /// taken before the call, or -1 when the heads were ragged (their rows then come from the
  /// snapshot's head_keys / head_values).
  void window_head(const Window<T>& w, const Snapshot& before,
                   const std::vector<Positions>& pos_before, const CallInputs<T>& in, Index S,
                   const CallDims& d, Index n_before, Index stride, Index b, Index h) const {
    const Index n = n_before + S;
    const auto dk = static_cast<std::size_t>(d.Dk), dv = static_cast<std::size_t>(d.Dv);
    const Index head = b * d.H + h;
    if (static_cast<Index>(w.rows.size()) <= head || w.rows[static_cast<std::size_t>(head)] != n) {
      return;  // (reported by the caller)
    }
    // Rows retained before the call, from state() taken before the call (ascending position), or
    // from the ragged heads' rows of the snapshot.
    const T* kb = nullptr;
    const T* vb = nullptr;
    if (stride < 0) {
      kb = reinterpret_cast<const T*>(before.head_keys[static_cast<std::size_t>(head)].data());
      vb = reinterpret_cast<const T*>(before.head_values[static_cast<std::size_t>(head)].data());
    } else {
      kb = reinterpret_cast<const T*>(before.keys.data()) +
           static_cast<std::size_t>(head * stride) * dk;
      vb = reinterpret_cast<const T*>(before.values.data()) +
           static_cast<std::size_t>(head * stride) * dv;
    }
    const Positions& pb = pos_before[static_cast<std::size_t>(head)];
    report_.expect(static_cast<Index>(pb.size()) == n_before,
                   "internal: positions before the call disagree with the count");
    std::map<std::int64_t, Index> index_of;
    for (Index r = 0; r < n_before; ++r) index_of[pb[static_cast<std::size_t>(r)]] = r;
    std::set<std::int64_t> seen;
    for (Index r = 0; r < n; ++r) {
      const T* gk = w.keys.data() + static_cast<std::size_t>(w.at(head, r) * d.Dk);
      const T* gv = w.values.data() + static_cast<std::size_t>(w.at(head, r) * d.Dv);
      const T* wk = nullptr;
      const T* wv = nullptr;
      std::int64_t want_pos = 0;
      if (r < n_before) {
        Index src = r;
        if (w.is_view) {
          const std::int64_t p = w.positions[static_cast<std::size_t>(w.at(head, r))];
          const auto it = index_of.find(p);
          report_.expect(it != index_of.end() && seen.insert(p).second,
                         "view row " + std::to_string(r) + " of head (" + std::to_string(b) + ", " +
                             std::to_string(h) + ") has position " + std::to_string(p) +
                             ", not a distinct row retained before the call " + fmt_vec(pb));
          src = it->second;
        }
        wk = kb + static_cast<std::size_t>(src) * dk;
        wv = vb + static_cast<std::size_t>(src) * dv;
        want_pos = pb[static_cast<std::size_t>(src)];
      } else {
        const Index s = r - n_before;
        wk = in.kt.data() + static_cast<std::size_t>((head * S + s)) * dk;
        wv = in.vt.data() + static_cast<std::size_t>((head * S + s)) * dv;
        want_pos = seq_.offset + s;
        if (w.is_view) {
          const std::int64_t p = w.positions[static_cast<std::size_t>(w.at(head, r))];
          report_.expect(p == want_pos, "view row " + std::to_string(r) + " (new row " +
                                            std::to_string(s) + ") has position " +
                                            std::to_string(p) + ", expected " +
                                            std::to_string(want_pos));
        }
      }
      if (std::memcmp(gk, wk, dk * sizeof(T)) != 0 || std::memcmp(gv, wv, dv * sizeof(T)) != 0) {
        report_.fail("returned row " + std::to_string(r) + " of head (" + std::to_string(b) + ", " +
                     std::to_string(h) + ") is not the row at position " +
                     std::to_string(want_pos) + " (n_before " + std::to_string(n_before) + ", S " +
                     std::to_string(S) + ")");
      }
    }
  }

  /// offset(), tokens_seen() and the dims against the sequence model.
  void counters() const {
    const vc::KVCache<T>& c = *cache_.layer;
    report_.expect(c.offset() == seq_.offset, "offset() " + std::to_string(c.offset()) +
                                                  ", expected " + std::to_string(seq_.offset));
    report_.expect(c.tokens_seen() == seq_.tokens_seen,
                   "tokens_seen() " + std::to_string(c.tokens_seen()) + ", expected " +
                       std::to_string(seq_.tokens_seen));
    report_.expect(c.batch() == seq_.B && c.heads() == seq_.H && c.key_dim() == seq_.Dk &&
                       c.value_dim() == seq_.Dv,
                   "batch()/heads()/key_dim()/value_dim() differ from the first call's");
  }

  /// Adaptive heads: the rows an empty call's view shows for head i are the rows fed at their
  /// positions.
  void held_head_rows(const vt::HeadRows& r, std::size_t i, const std::string& where) const {
    const HeadModel<T>& hm = seq_.heads[i];
    const auto kb = static_cast<std::size_t>(seq_.Dk) * sizeof(T);
    const auto vb = static_cast<std::size_t>(seq_.Dv) * sizeof(T);
    for (std::size_t k = 0; k < r.positions.size(); ++k) {
      const auto p = static_cast<std::size_t>(r.positions[k]);
      if (std::memcmp(r.keys.data() + k * kb, hm.fed_keys[p].data(), kb) != 0 ||
          std::memcmp(r.values.data() + k * vb, hm.fed_values[p].data(), vb) != 0) {
        report_.fail(where + " row " + std::to_string(k) + " of its view is not the row fed at " +
                     "position " + std::to_string(p));
      }
    }
  }

  /// offset(), tokens_seen(), dims, state()'s shape and row count, and the byte accounting;
  /// returns state().
  vc::KVPair<T> accounting() const {
    const vc::KVCache<T>& c = *cache_.layer;
    const Index B = seq_.B, H = seq_.H, Dk = seq_.Dk, Dv = seq_.Dv;
    counters();
    vc::KVPair<T> st = c.state();
    const Index n = st.first.dimension(2);
    report_.expect(st.first.dimension(0) == B && st.first.dimension(1) == H &&
                       st.first.dimension(3) == Dk && st.second.dimension(0) == B &&
                       st.second.dimension(1) == H && st.second.dimension(2) == n &&
                       st.second.dimension(3) == Dv,
                   "state() has the wrong shape");
    report_.expect(n == seq_.count, "state() holds " + std::to_string(n) +
                                        " rows per head, expected " + std::to_string(seq_.count));
    report_.expect(c.tokens_kept() == n, "tokens_kept() differs from state()");
    byte_accounting(static_cast<std::size_t>(B * H * n));
    return st;
  }

  /// The byte accounting of a cache holding `rows` rows over all its heads (unquantized):
  /// kept_bytes() those rows, full_seq_bytes() every head's `offset` rows, compression_ratio()
  /// their quotient, heap_bytes() at least kept_bytes().
  void byte_accounting(std::size_t rows) const {
    const vc::KVCache<T>& c = *cache_.layer;
    const std::size_t row_bytes = static_cast<std::size_t>(seq_.Dk + seq_.Dv) * sizeof(T);
    report_.expect(c.kept_bytes() == rows * row_bytes,
                   "kept_bytes() " + std::to_string(c.kept_bytes()) + " is not the " +
                       std::to_string(rows) + " rows held");
    report_.expect(c.full_seq_bytes() == static_cast<std::size_t>(seq_.B * seq_.H) *
                                             static_cast<std::size_t>(seq_.offset) * row_bytes,
                   "full_seq_bytes() is wrong");
    if (rows > 0) {
      const double ratio =
          static_cast<double>(c.full_seq_bytes()) / static_cast<double>(c.kept_bytes());
      report_.expect(c.compression_ratio() == ratio, "compression_ratio() is wrong");
    }
    report_.expect(c.heap_bytes() >= c.kept_bytes(), "heap_bytes() < kept_bytes()");
  }

  /// The H2O core's budget(), n_sink() and protected_recent().
  void core_getters() const {
    const vc::KVCache<T>& c = *cache_.layer;
    const std::optional<int>& model = budget_.budget;
    const std::optional<int> got = vt::core_budget(c);
    report_.expect(got.value_or(-1) == model.value_or(-1),
                   "budget() " + (got ? std::to_string(*got) : std::string("unknown")) +
                       ", expected " + (model ? std::to_string(*model) : std::string("unknown")));
    int n_sink = -1;
    vt::visit_core(c, [&](const auto& p) { n_sink = p.n_sink(); });
    report_.expect(n_sink == budget_.n_sink, "n_sink() differs from the config");
    const int recent = vt::core_protected_recent(c);
    report_.expect(recent == budget_.grace(), "protected_recent() " + std::to_string(recent) +
                                                  ", expected " + std::to_string(budget_.grace()));
  }

  /// Head (b, h) after a call: its positions, the rows at them, what it must keep, the oracle.
  void head(const vc::KVPair<T>& st, Index b, Index h, Index n) {
    const auto i = static_cast<std::size_t>(b * seq_.H + h);
    const std::string where = "head (" + std::to_string(b) + ", " + std::to_string(h) + ")";
    const Positions pos = positions(i);
    if (cache_.scored) {
      report_.expect(static_cast<Index>(pos.size()) == n,
                     where + " positions() size differs from state()");
      report_.expect(vt::policy_scores(*cache_.layer, b, h).size() == pos.size(),
                     where + " scores() size differs");
    }
    report_.expect(static_cast<Index>(pos.size()) == n, where + " model holds " +
                                                            std::to_string(pos.size()) +
                                                            " rows, state() " + std::to_string(n));
    for (std::size_t k = 0; k < pos.size(); ++k) {
      report_.expect(pos[k] >= 0 && pos[k] < seq_.offset && (k == 0 || pos[k - 1] < pos[k]),
                     where + " positions are not ascending within [0, offset): " + fmt_vec(pos));
    }
    head_rows(st, b, h, n, pos, where);
    head_keeps(pos, where);
    compare_oracle(seq_.heads[i], pos, where, b, h);
  }

  /// state() holds the rows fed at the head's positions.
  void head_rows(const vc::KVPair<T>& st, Index b, Index h, Index n, const Positions& pos,
                 const std::string& where) const {
    const HeadModel<T>& hm = seq_.heads[static_cast<std::size_t>(b * seq_.H + h)];
    const auto dk = static_cast<std::size_t>(seq_.Dk), dv = static_cast<std::size_t>(seq_.Dv);
    for (Index r = 0; r < n; ++r) {
      const auto p = static_cast<std::size_t>(pos[static_cast<std::size_t>(r)]);
      const T* k = st.first.data() + static_cast<std::size_t>((b * seq_.H + h) * n + r) * dk;
      const T* v = st.second.data() + static_cast<std::size_t>((b * seq_.H + h) * n + r) * dv;
      if (std::memcmp(k, hm.fed_keys[p].data(), dk * sizeof(T)) != 0 ||
          std::memcmp(v, hm.fed_values[p].data(), dv * sizeof(T)) != 0) {
        report_.fail(where + " state() row " + std::to_string(r) +
                     " is not the row fed at position " + std::to_string(p));
      }
    }
  }

  /// What the head must keep: its sinks (docs/design.md 1), SnapKV's uncompressed rows and the
  /// compressed call's sinks, the H2O core's newest g rows of the last call.
  void head_keeps(const Positions& pos, const std::string& where) const {
    const vc::KVCacheConfig& cfg = spec_.cfg;
    const std::int64_t offset = seq_.offset;
    const std::set<std::int64_t> have(pos.begin(), pos.end());
    int sinks = 0;
    if (cache_.core) sinks = budget_.n_sink;
    if (cache_.tova) sinks = cfg.tova_n_sink;
    if (cache_.stream) sinks = cfg.stream_n_sink;
    for (std::int64_t p = 0; p < std::min<std::int64_t>(sinks, offset); ++p) {
      report_.expect(have.count(p) == 1,
                     where + " lost sink " + std::to_string(p) + ": " + fmt_vec(pos));
    }
    if (cache_.snap) {
      // The sinks stay; so does every row since the last compressed chunk (decode steps append),
      // and every row before the first compression.
      for (std::int64_t p = 0; p < offset; ++p) {
        const bool sink = p < std::min(cfg.snap_n_sink, cfg.snap_budget);
        if (sink || !seq_.snap_compressed || p >= seq_.snap_end) {
          report_.expect(have.count(p) == 1, where + " SnapKV lost position " + std::to_string(p));
        }
      }
    }
    if (cache_.core && budget_.budget) {
      const std::int64_t g = budget_.grace();
      for (std::int64_t p = std::max<std::int64_t>(seq_.last_call_first, offset - g); p < offset;
           ++p) {
        report_.expect(have.count(p) == 1, where + " lost protected recent position " +
                                               std::to_string(p) + " (g = " + std::to_string(g) +
                                               "): " + fmt_vec(pos));
      }
    }
  }

  /// Positions and scores against the per-head oracle (unless diverged after a near-tie).
  void compare_oracle(HeadModel<T>& hm, const Positions& pos, const std::string& where, Index b,
                      Index h) {
    if (!cache_.scored || hm.diverged || !seq_.oracle_on()) {
      hm.ambiguous = false;
      return;
    }
    const std::vector<ref::OracleRow>* rows = oracle_rows(hm);
    if (rows == nullptr) return;
    Positions want;
    std::vector<double> want_scores;
    for (const auto& r : *rows) {
      want.push_back(r.position);
      want_scores.push_back(r.score);
    }
    const std::vector<float> got_scores = vt::policy_scores(*cache_.layer, b, h);
    std::string problem;
    if (pos != want) {
      problem = where + " retains " + fmt_vec(pos) + " with scores " + fmt_vec(got_scores) +
                "; oracle retains " + fmt_vec(want) + " with scores " + fmt_vec(want_scores);
    } else {
      problem = score_mismatch(want, want_scores, got_scores, where);
    }
    if (!problem.empty()) {
      if (!hm.ambiguous) report_.fail("oracle mismatch without a near-tie: " + problem);
      hm.diverged = true;
      report_.count(&Stats::excused);
      report_.log("excused near-tie divergence: " + problem);
    }
    hm.ambiguous = false;
  }

  /// The rows of the head's oracle (nullptr: none).
  const std::vector<ref::OracleRow>* oracle_rows(const HeadModel<T>& hm) const {
    const std::vector<ref::OracleRow>* rows = nullptr;
    if (hm.h2o) rows = &hm.h2o->rows();
    if (hm.h2oq) rows = &hm.h2oq->rows();
    if (hm.tova) rows = &hm.tova->rows();
    if (hm.tovaq) rows = &hm.tovaq->rows();
    if (hm.snap) rows = &hm.snap->rows();
    return rows;
  }

  /// The first retained row whose score is off the oracle's ("" if none).
  std::string score_mismatch(const Positions& want, const std::vector<double>& want_scores,
                             const std::vector<float>& got_scores, const std::string& where) const {
    for (std::size_t r = 0; r < want.size(); ++r) {
      const double got = static_cast<double>(got_scores[r]);
      if (!(std::fabs(got - want_scores[r]) <=
            std::max(kScoreAbsTol, kScoreRelTol * std::fabs(want_scores[r])))) {
        std::ostringstream os;
        os.precision(9);
        os << where << " position " << want[r] << " score " << got << ", oracle " << want_scores[r];
        return os.str();
      }
    }
    return "";
  }

  const RunSpec& spec_;
  const CacheUnderTest<T>& cache_;
  const BudgetModel& budget_;
  SequenceModel<T>& seq_;
  Reporter& report_;
};

}  // namespace veloxquant::fuzz::detail
