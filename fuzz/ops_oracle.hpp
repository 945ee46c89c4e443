// fuzz target `ops` (fuzz/fuzz_ops.hpp): the model of the current sequence — its dims and query
// mode, the counters a cache reports (offset, tokens seen, rows kept), every row fed, and per head
// the double-precision oracles of tests/reference/ fed the same calls, with every eviction
// decision they take checked for a near-tie (ops_ties.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ops_budget.hpp"
#include "ops_config.hpp"
#include "ops_input.hpp"
#include "ops_report.hpp"
#include "ops_ties.hpp"

namespace veloxquant::fuzz::detail {

/// The H2O core's oracle of one head, which the pooled eviction of adaptive heads (SPEC 14,
/// docs/design.md 4.9, modelled by SequenceModel::pool_evict) can also take a given row from.
/// (tests/reference/ has no pooled oracle: the pool is the sequence's, not a head's.)
class CoreOracle : public ref::H2OHeadOracle {
 public:
  using ref::H2OHeadOracle::H2OHeadOracle;
  /// Removes the row at `position` (it must be held).
  void erase_position(std::int64_t position) {
    const auto it = std::find_if(rows_.begin(), rows_.end(),
                                 [&](const ref::OracleRow& r) { return r.position == position; });
    if (it != rows_.end()) rows_.erase(it);
  }
};

/// One head's oracles (only those of the cache's policy are engaged) and the rows fed to it.
template <class T>
struct HeadModel {
  std::optional<CoreOracle> h2o;   // fed by absorb: key-as-query proxy (docs/design.md 4.2)
  std::optional<CoreOracle> h2oq;  // fed by absorb_call with queries (docs/design.md 4.6)
  std::optional<ref::TOVAHeadOracle> tova;
  std::optional<ref::TOVAHeadOracle> tovaq;
  std::optional<ref::StreamingLLMHeadOracle> stream;
  std::optional<ref::SnapKVHeadOracle> snap;  // fed the call's queries (or the proxy's)
  bool diverged = false;   // a tolerated near-tie divergence happened (until reset)
  bool ambiguous = false;  // an ambiguous decision in the current call
  /// Every row fed since the last reset, by position: key then value, as stored (T).
  std::vector<std::vector<T>> fed_keys, fed_values;
};

/// Head (b, h)'s row s of t as double. t: [B, H, S, D]
template <class U>
std::vector<double> tensor_row(const vc::Tensor4<U>& t, Index head, Index s) {
  const Index S = t.dimension(2), D = t.dimension(3);
  std::vector<double> out(static_cast<std::size_t>(D));
  for (Index d = 0; d < D; ++d)
    out[static_cast<std::size_t>(d)] = to_double(t.data()[(head * S + s) * D + d]);
  return out;
}

/// The rows of `o` with what an eviction ranks them by in place of their scores (KeyDiff's
/// ranking; the scores themselves for every other scorer).
inline std::vector<ref::OracleRow> ranked_rows(const ref::H2OHeadOracle& o) {
  std::vector<ref::OracleRow> rows = o.rows();
  const std::vector<double> rank = o.eviction_rank(o.value_power() > 0.0);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i].score = rank[i];
  return rows;
}

/// |m|, m the mean of the rows' unit keys k / (|k| + 1e-8) (KeyDiff, docs/design.md 4.7).
inline double mean_unit_key_norm(const std::vector<ref::OracleRow>& rows) {
  if (rows.empty()) return 0.0;
  std::vector<double> mean(rows.front().key.size(), 0.0);
  for (const ref::OracleRow& r : rows) {
    double norm = 0.0;
    for (const double x : r.key) norm += x * x;
    norm = std::sqrt(norm) + 1e-8;
    for (std::size_t i = 0; i < mean.size(); ++i) {
      mean[i] += r.key[i] / norm / static_cast<double>(rows.size());
    }
  }
  double mm = 0.0;
  for (const double x : mean) mm += x * x;
  return std::sqrt(mm);
}

/// The current sequence (from the start of the run or the last reset) as the library must see it.
template <class T>
class SequenceModel {
 public:
  SequenceModel(const RunSpec& spec, const BudgetModel& budget, Reporter& report)
      : spec_(spec), budget_(budget), report_(report) {}

  /// Chooses the dims and the query mode of a new sequence and makes fresh oracles.
  void start(Bytes& in) {
    B = in.range(1, 2);
    H = in.range(1, 3);
    Dk = in.range(1, 8);
    Dv = in.pick(3) == 0 ? Dk : static_cast<Index>(in.range(1, 8));
    const std::uint8_t qb = in.u8();
    const int q = qb % 4;
    qmode = q < 2 ? QueryMode::None : q == 2 ? QueryMode::Always : QueryMode::Mixed;
    one_hot = (qb & 0x30) == 0x30;  // 1 sequence in 4: keys and queries in {-64, 0, 64}
    dims_known = false;
    offset = 0;
    tokens_seen = 0;
    count = 0;
    pooled = 0;
    snap_compressed = false;
    snap_end = 0;
    Rng rng(in.u32());
    palette_k.assign(static_cast<std::size_t>(1 + rng.below(4)), std::vector<double>());
    for (auto& r : palette_k) {
      r.resize(static_cast<std::size_t>(Dk));
      for (auto& x : r) x = draw_level(rng, DataMode::Uniform, one_hot);
    }
    make_head_models();
    report_.log("sequence B=" + std::to_string(B) + " H=" + std::to_string(H) +
                " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) +
                " qmode=" + std::to_string(q) + (one_hot ? " one-hot" : ""));
  }

  /// True while the per-head oracles of the policy are consulted (not in mixed query mode for the
  /// policies whose oracle has one scoring rule).
  bool oracle_on() const {
    if (qmode != QueryMode::Mixed) return true;
    return !(spec_.core() || spec_.method == Method::tova);
  }

  /// Budget `b` comes into force (set in the budget model by the caller): the count and every
  /// head's H2O oracles are trimmed to it (docs/design.md 4.5); adaptive heads: each sequence's
  /// pool is brought within H x b (docs/design.md 4.9).
  void rebudget(int b) {
    count = std::min<Index>(count, b);
    if (spec_.adaptive) {
      pooled = std::min<Index>(pooled, H * b);
      if (oracle_on()) pool_evict(b);
      return;
    }
    if (!oracle_on()) return;
    for (auto& hm : heads) {
      for (auto* o : {hm.h2o ? &*hm.h2o : nullptr, hm.h2oq ? &*hm.h2oq : nullptr}) {
        if (o == nullptr) continue;
        const Positions before = o->positions();
        // What the re-budget ranks by (KeyDiff: its ranking, not the scores; under
        // value_norm_power, the weighted ranks of a call with queries, whose start it is).
        std::vector<Candidate> cands = trim_candidates(ranked_rows(*o), b);
        o->set_budget(b);
        const bool keydiff =
            spec_.scorer == ref::H2OHeadOracle::Scorer::keydiff && hm.h2o && o == &*hm.h2o;
        note_decision(hm, cands, minus(before, o->positions()), false, false, keydiff);
      }
    }
  }

  /// Feeds an accepted call of S >= 1 tokens to every head's rows and oracles, recording their
  /// eviction decisions, and advances the counters.
  void absorb_call(const vc::Tensor4<T>& kt, const vc::Tensor4<T>& vt,
                   const vc::Tensor4<double>& qd, bool with_queries, Index G, Index S) {
    const std::int64_t first = offset;
    last_call_first = first;
    for (std::size_t i = 0; i < heads.size(); ++i) {
      HeadModel<T>& hm = heads[i];
      const auto head = static_cast<Index>(i);
      Rows keys, values;
      std::vector<Rows> queries;
      for (Index s = 0; s < S; ++s) {
        keys.push_back(tensor_row(kt, head, s));
        values.push_back(tensor_row(vt, head, s));
        queries.push_back(with_queries ? token_queries(qd, head, G, s) : Rows{keys.back()});
        const auto ks = static_cast<std::size_t>(Dk), vs = static_cast<std::size_t>(Dv);
        const T* kp = kt.data() + static_cast<std::size_t>(head * S + s) * ks;
        const T* vp = vt.data() + static_cast<std::size_t>(head * S + s) * vs;
        hm.fed_keys.emplace_back(kp, kp + ks);
        hm.fed_values.emplace_back(vp, vp + vs);
      }
      absorb(hm, keys, values, queries, first);
    }
    // Adaptive heads: the pool gives up its excess once every head has taken the call.
    if (spec_.adaptive && budget_.budget && oracle_on()) pool_evict(*budget_.budget);
    offset += S;
    tokens_seen += B * H * S;
    count_call(S, first);
  }

  /// trim(n) of a standard cache removed the newest `n` rows.
  void trim(std::int64_t n) {
    offset -= n;
    count -= static_cast<Index>(n);
    for (auto& hm : heads) {
      hm.fed_keys.resize(static_cast<std::size_t>(offset));
      hm.fed_values.resize(static_cast<std::size_t>(offset));
    }
  }

  Index B = 1, H = 1, Dk = 1, Dv = 1;
  QueryMode qmode = QueryMode::None;
  bool one_hot = false;
  bool dims_known = false;  ///< a call fixed the dims
  std::int64_t offset = 0, tokens_seen = 0;
  std::int64_t last_call_first = 0;  ///< the position of the last call's first token
  Index count = 0;  ///< rows per head (a model independent of which rows were evicted)
  /// Adaptive heads: rows each sequence's heads hold together, min(all of them, H x budget) (the
  /// pool; its budgets exceed the sinks here, so the protected rows always fit, docs/design.md
  /// 4.9); which head holds them depends on the evictions.
  Index pooled = 0;
  bool snap_compressed = false;  ///< SnapKV has compressed a chunk
  std::int64_t snap_end = 0;     ///< the end of the last compressed chunk's positions
  Rows palette_k;  ///< rows that keys (and queries) of Palette/Constant data repeat
  std::vector<HeadModel<T>> heads;  ///< b * H + h

 private:
  void make_head_models() {
    const vc::KVCacheConfig& cfg = spec_.cfg;
    heads.clear();
    heads.resize(static_cast<std::size_t>(B * H));
    for (auto& hm : heads) {
      switch (spec_.method) {
        case Method::squeeze:
        case Method::h2o:
        case Method::pyramidkv:
          // Adaptive heads: no budget of their own (the pool's evictions are pool_evict's).
          if (qmode == QueryMode::None) {
            hm.h2o.emplace(budget_.n_sink, budget_.decay, budget_.grace_fn());
            hm.h2o->set_scorer(spec_.scorer);
            if (budget_.budget && !spec_.adaptive) hm.h2o->set_budget(*budget_.budget);
          } else if (qmode == QueryMode::Always) {
            // Calls with queries ignore the scorer, and so do their re-budgets.
            hm.h2oq.emplace(budget_.n_sink, budget_.decay, budget_.grace_fn());
            hm.h2oq->set_value_power(cfg.value_norm_power);
            if (budget_.budget && !spec_.adaptive) hm.h2oq->set_budget(*budget_.budget);
          }
          break;
        case Method::tova:
          if (qmode == QueryMode::None) hm.tova.emplace(cfg.tova_n_sink, cfg.tova_budget);
          if (qmode == QueryMode::Always) hm.tovaq.emplace(cfg.tova_n_sink, cfg.tova_budget);
          break;
        case Method::streaming_llm:
          hm.stream.emplace(cfg.stream_n_sink, cfg.stream_window_size);
          break;
        case Method::snapkv:
          hm.snap.emplace(cfg.snap_n_sink, cfg.snap_budget, cfg.snap_obs_window);
          break;
        default:
          break;
      }
    }
  }

  /// The count model after a call of S tokens starting at `first` (independent of which rows
  /// were evicted).
  void count_call(Index S, std::int64_t first) {
    const vc::KVCacheConfig& cfg = spec_.cfg;
    switch (spec_.method) {
      case Method::standard:
        count += S;
        break;
      case Method::streaming_llm: {
        const Index sinks = std::min<Index>(offset, cfg.stream_n_sink);
        count = sinks + std::min<Index>(offset - sinks, cfg.stream_window_size);
        break;
      }
      case Method::tova:
        count = std::min<Index>(count + S, cfg.tova_budget);
        break;
      case Method::snapkv:
        // A prompt chunk past the budget is cut to it (SPEC 13.3); decode steps append.
        if (S > 1 && count + S > cfg.snap_budget) {
          snap_compressed = true;
          snap_end = first + S;
          count = cfg.snap_budget;
        } else {
          count += S;
        }
        break;
      default:  // H2O core
        count = budget_.budget ? std::min<Index>(count + S, *budget_.budget) : count + S;
        pooled =
            budget_.budget ? std::min<Index>(pooled + H * S, H * *budget_.budget) : pooled + H * S;
        break;
    }
  }

  /// The pooled eviction of adaptive heads under budget b (docs/design.md 4.9), in every
  /// sequence, one row at a time: while a sequence's heads hold more than H x b rows, the row
  /// with the lowest rank goes among the candidates (the rows of the heads holding more than
  /// ceil(floor x b), but a head's sinks and its newest g(b) rows), ties to the earlier position,
  /// then to the lower head. The rank is what the head's re-budget would rank by (ranked_rows:
  /// KeyDiff's ranking without queries, score x |v|^p under value_norm_power with them, else the
  /// score), taken once per head before any row goes. A decision that a near-tie could turn
  /// (ops_ties.hpp, across the heads: positions are told apart by head) makes every head of the
  /// sequence ambiguous: a row kept in one head instead of another changes both.
  void pool_evict(int b) {
    const Index floor_rows = std::min<Index>(
        b, static_cast<Index>(std::ceil(spec_.cfg.head_budget_floor * static_cast<double>(b))));
    const auto g = static_cast<std::size_t>(budget_.grace_for(b));
    const bool keydiff =
        spec_.scorer == ref::H2OHeadOracle::Scorer::keydiff && qmode == QueryMode::None;
    for (Index seq = 0; seq < B; ++seq) {
      std::vector<CoreOracle*> o;
      std::vector<std::vector<ref::OracleRow>> ranked;
      Index held = 0;
      double least_m = 1.0;  // KeyDiff: the smallest |m| of the sequence's heads
      for (Index h = 0; h < H; ++h) {
        HeadModel<T>& hm = heads[static_cast<std::size_t>(seq * H + h)];
        CoreOracle* x = hm.h2o ? &*hm.h2o : hm.h2oq ? &*hm.h2oq : nullptr;
        if (x == nullptr) return;
        o.push_back(x);
        ranked.push_back(ranked_rows(*x));
        if (keydiff) {
          // The oracle's rank() leaves out KeyDiff's division by |m| + 1e-8 (m: the mean unit
          // key of the head), which orders no row of one head differently; across heads it does:
          // the pool compares cosines, -(u . m) / (|m| + 1e-8) (docs/design.md 4.7, 4.9).
          const double m = mean_unit_key_norm(x->rows());
          least_m = std::min(least_m, m);
          for (ref::OracleRow& r : ranked.back()) r.score /= m + 1e-8;
        }
        held += static_cast<Index>(x->rows().size());
      }
      Index excess = held - H * static_cast<Index>(b);
      if (excess <= 0) continue;
      // The candidates at the start (for the near-tie rule), positions told apart by head.
      const auto key = [](Index h, std::int64_t position) {
        return static_cast<std::int64_t>(h) * (std::int64_t{1} << 40) + position;
      };
      const auto candidate = [&](Index h, std::size_t i) {
        const std::vector<ref::OracleRow>& r = ranked[static_cast<std::size_t>(h)];
        return static_cast<Index>(r.size()) > floor_rows && r[i].position >= budget_.n_sink &&
               i + g < r.size();
      };
      std::vector<Candidate> cands;
      for (Index h = 0; h < H; ++h) {
        for (std::size_t i = 0; i < ranked[static_cast<std::size_t>(h)].size(); ++i) {
          if (candidate(h, i)) {
            const ref::OracleRow& r = ranked[static_cast<std::size_t>(h)][i];
            cands.push_back({r.score, key(h, r.position)});
          }
        }
      }
      std::set<std::int64_t> evicted;
      for (; excess > 0; --excess) {
        Index best_h = -1;
        std::size_t best_i = 0;
        for (Index h = 0; h < H; ++h) {
          const std::vector<ref::OracleRow>& r = ranked[static_cast<std::size_t>(h)];
          for (std::size_t i = 0; i < r.size(); ++i) {
            if (!candidate(h, i)) continue;
            if (best_h < 0) {
              best_h = h;
              best_i = i;
              continue;
            }
            const ref::OracleRow& w = ranked[static_cast<std::size_t>(best_h)][best_i];
            // Strict: among equal ranks the earlier position, then the lower head (scanned first).
            if (r[i].score < w.score || (r[i].score == w.score && r[i].position < w.position)) {
              best_h = h;
              best_i = i;
            }
          }
        }
        if (best_h < 0) break;
        std::vector<ref::OracleRow>& r = ranked[static_cast<std::size_t>(best_h)];
        evicted.insert(key(best_h, r[best_i].position));
        o[static_cast<std::size_t>(best_h)]->erase_position(r[best_i].position);
        r.erase(r.begin() + static_cast<std::ptrdiff_t>(best_i));
      }
      if (evicted.empty()) continue;
      report_.count(&Stats::decisions);
      report_.count(&Stats::pool_decisions);
      // (KeyDiff: the library's absolute error in u . m, divided by |m| like the ranks.)
      const double floor = keydiff ? kKeyDiffAbsTol / (least_m + 1e-8) : kTieAbsFloor;
      if (!near_tie(cands, evicted, nullptr, false, floor)) continue;
      report_.count(&Stats::ambiguous);
      for (Index h = 0; h < H; ++h) heads[static_cast<std::size_t>(seq * H + h)].ambiguous = true;
      std::ostringstream os;
      os.precision(17);
      os << "near-tie pooled decision in sequence " << seq << ": evicted (head:position:rank)";
      for (const Candidate& c : cands) {
        if (evicted.count(c.position)) {
          os << " " << (c.position >> 40) << ":" << (c.position & ((std::int64_t{1} << 40) - 1))
             << ":" << c.score;
        }
      }
      report_.log(os.str());
    }
  }

  /// Token s's G query heads of KV head `head` = b * H + h, through float32 (what the cache
  /// scores with). q: [B, G * H, S, D]; returns [G][D].
  Rows token_queries(const vc::Tensor4<double>& q, Index head, Index G, Index s) const {
    const Index b = head / H, h = head % H;
    Rows out;
    for (Index g = 0; g < G; ++g) {
      const Index qh = b * (G * H) + h * G + g;
      std::vector<double> r = tensor_row(q, qh, s);
      for (double& x : r) x = static_cast<double>(static_cast<float>(x));
      out.push_back(std::move(r));
    }
    return out;
  }

  void absorb(HeadModel<T>& hm, const Rows& keys, const Rows& values,
              const std::vector<Rows>& queries, std::int64_t first) {
    if (hm.h2o && oracle_on()) absorb_h2o(hm, keys, values);
    if (hm.h2oq && oracle_on()) absorb_h2oq(hm, keys, values, queries);
    if ((hm.tova || hm.tovaq) && oracle_on()) absorb_tova(hm, keys, values, queries, first);
    if (hm.stream) {
      for (std::size_t s = 0; s < keys.size(); ++s) hm.stream->absorb(keys[s], values[s]);
    }
    if (hm.snap) absorb_snap(hm, keys, values, queries, first);
  }

  /// The H2O oracle without queries: token by token (docs/design.md 4.2).
  void absorb_h2o(HeadModel<T>& hm, const Rows& keys, const Rows& values) {
    for (std::size_t s = 0; s < keys.size(); ++s) {
      const bool evicts =
          hm.h2o->budget() && static_cast<int>(hm.h2o->rows().size()) + 1 > *hm.h2o->budget();
      if (!evicts) {
        hm.h2o->absorb(keys[s], values[s]);
        continue;
      }
      // The scores every row has at the decision: the same token on a copy without a budget.
      ref::H2OHeadOracle all = *hm.h2o;
      all.set_budget(std::numeric_limits<int>::max());
      all.absorb(keys[s], values[s]);
      hm.h2o->absorb(keys[s], values[s]);
      note_decision(hm, evict_candidates(ranked_rows(all), *hm.h2o->budget()),
                    minus(all.positions(), hm.h2o->positions()), false, false,
                    spec_.scorer == ref::H2OHeadOracle::Scorer::keydiff);
    }
  }

  /// The H2O oracle with queries: one eviction per call (docs/design.md 4.6).
  void absorb_h2oq(HeadModel<T>& hm, const Rows& keys, const Rows& values,
                   const std::vector<Rows>& queries) {
    const auto S = keys.size();
    const bool evicts =
        hm.h2oq->budget() && static_cast<int>(hm.h2oq->rows().size() + S) > *hm.h2oq->budget();
    if (!evicts) {
      hm.h2oq->absorb_call(keys, values, queries);
      return;
    }
    ref::H2OHeadOracle all = *hm.h2oq;
    all.set_budget(std::numeric_limits<int>::max());
    all.absorb_call(keys, values, queries);
    hm.h2oq->absorb_call(keys, values, queries);
    note_decision(hm, evict_candidates(ranked_rows(all), *hm.h2oq->budget()),
                  minus(all.positions(), hm.h2oq->positions()));
  }

  /// The TOVA oracle (with or without queries): token by token.
  void absorb_tova(HeadModel<T>& hm, const Rows& keys, const Rows& values,
                   const std::vector<Rows>& queries, std::int64_t first) {
    for (std::size_t s = 0; s < keys.size(); ++s) {
      Positions pos = hm.tova ? hm.tova->positions() : hm.tovaq->positions();
      pos.push_back(first + static_cast<std::int64_t>(s));
      std::vector<double> w;
      Positions after;
      if (hm.tova) {
        hm.tova->absorb(keys[s], values[s]);
        w = hm.tova->last_weights();
        after = hm.tova->positions();
      } else {
        hm.tovaq->absorb(keys[s], values[s], queries[s]);
        w = hm.tovaq->last_weights();
        after = hm.tovaq->positions();
      }
      if (w.empty()) continue;
      std::vector<Candidate> cands;
      for (std::size_t r = 0; r < pos.size() && r < w.size(); ++r) {
        if (pos[r] >= spec_.cfg.tova_n_sink) cands.push_back({w[r], pos[r]});
      }
      note_decision(hm, cands, minus(pos, after), /*keys_decide=*/true,
                    /*one_softmax=*/queries[s].size() == 1);
    }
  }

  /// The SnapKV oracle (fed the call's queries, which are the proxy's {key} per token without
  /// real ones), and a compression's decision: every row held then is a candidate but the sinks.
  void absorb_snap(HeadModel<T>& hm, const Rows& keys, const Rows& values,
                   const std::vector<Rows>& queries, std::int64_t first) {
    const vc::KVCacheConfig& cfg = spec_.cfg;
    const auto S = keys.size();
    const std::vector<ref::OracleRow> held = hm.snap->rows();
    const bool compress = S > 1 && held.size() + S > static_cast<std::size_t>(cfg.snap_budget);
    hm.snap->absorb_call(keys, values, queries);
    if (!compress) return;
    // The scores (as the oracle computes them) for the ambiguity of the selection.
    const std::size_t w = std::min<std::size_t>(static_cast<std::size_t>(cfg.snap_obs_window), S);
    std::vector<const std::vector<double>*> ptrs;
    Positions all_pos;
    for (const auto& r : held) {
      ptrs.push_back(&r.key);
      all_pos.push_back(r.position);
    }
    for (std::size_t r = 0; r < S; ++r) {
      ptrs.push_back(&keys[r]);
      all_pos.push_back(first + static_cast<std::int64_t>(r));
    }
    const std::size_t n = ptrs.size();
    std::vector<double> score(n, 0.0);
    std::size_t n_soft = 0;
    for (std::size_t j = S - w; j < S; ++j) {
      for (const auto& q : queries[j]) {
        const std::vector<double> a = ref::attention_weights(ptrs, q);
        for (std::size_t r = 0; r < n; ++r) score[r] += a[r];
        ++n_soft;
      }
    }
    std::size_t sinks = 0;
    while (sinks < n && sinks < static_cast<std::size_t>(cfg.snap_budget) &&
           all_pos[sinks] < cfg.snap_n_sink) {
      ++sinks;
    }
    std::vector<Candidate> cands;
    for (std::size_t r = sinks; r < n; ++r) {
      cands.push_back({score[r] / static_cast<double>(n_soft), all_pos[r]});
    }
    note_decision(hm, cands, minus(all_pos, hm.snap->positions()), /*keys_decide=*/true);
  }

  /// Candidates of a re-budget: rows that are neither sinks nor among the newest g(b).
  std::vector<Candidate> trim_candidates(const std::vector<ref::OracleRow>& rows, int b) const {
    if (rows.size() <= static_cast<std::size_t>(b)) return {};
    return evict_candidates(rows, b);
  }

  /// Candidates of an eviction over rows that all carry their decision-time score: neither sinks
  /// nor among the newest g(budget).
  std::vector<Candidate> evict_candidates(const std::vector<ref::OracleRow>& rows,
                                          int budget) const {
    std::vector<Candidate> out;
    const std::size_t n = rows.size();
    const auto g = static_cast<std::size_t>(budget_.grace_for(budget));
    for (std::size_t i = 0; i < n; ++i) {
      if (rows[i].position < budget_.n_sink || i + g >= n) continue;
      out.push_back({rows[i].score, rows[i].position});
    }
    return out;
  }

  /// Records one eviction decision of the oracle; `keys_decide`: the candidates are columns of
  /// the same softmaxes (TOVA, SnapKV), so bitwise-identical keys tie exactly; `one_softmax`:
  /// their scores are one softmax row, so every exact tie is exact in float32 too (near_tie);
  /// `keydiff`: the candidates are ranked by KeyDiff's cosines (an absolute tie floor).
  void note_decision(HeadModel<T>& hm, const std::vector<Candidate>& cands,
                     const std::set<std::int64_t>& evicted, bool keys_decide = false,
                     bool one_softmax = false, bool keydiff = false) {
    if (evicted.empty()) return;
    report_.count(&Stats::decisions);
    SameKey same_key;
    if (keys_decide) {
      same_key = [&hm](std::int64_t a, std::int64_t b) {
        const auto& ka = hm.fed_keys[static_cast<std::size_t>(a)];
        const auto& kb = hm.fed_keys[static_cast<std::size_t>(b)];
        return ka.size() == kb.size() &&
               std::memcmp(ka.data(), kb.data(), ka.size() * sizeof(T)) == 0;
      };
    }
    const double floor = keydiff ? kKeyDiffAbsTol : kTieAbsFloor;
    if (!near_tie(cands, evicted, same_key, one_softmax, floor)) return;
    hm.ambiguous = true;
    report_.count(&Stats::ambiguous);
    std::ostringstream os;
    os.precision(17);
    os << "near-tie decision: evicted";
    for (const Candidate& c : cands) {
      if (evicted.count(c.position)) os << " " << c.position << ":" << c.score;
    }
    os << " kept";
    for (const Candidate& c : cands) {
      if (!evicted.count(c.position)) os << " " << c.position << ":" << c.score;
    }
    report_.log(os.str());
  }

  const RunSpec& spec_;
  const BudgetModel& budget_;
  Reporter& report_;
};

}  // namespace veloxquant::fuzz::detail
