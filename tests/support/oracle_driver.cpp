// The differential driver of support/oracle_driver.hpp, compiled once with the library's
// instances (tests/CMakeLists.txt; -O1 in scripts/test.sh): the oracles' double-precision loops
// are most of what the policy sweeps run.
//
// Only the executables that call the driver pull this object out of the static library:
// test_contract_q84, whose TU sees other VELOXQUANT_TEST_KEY_BITS / VALUE_BITS, never does.
#include "support/oracle_driver.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace veloxquant::test {

namespace ref = veloxquant::reference;

namespace {

constexpr double kNearTie = 1e-5;

/// Relative gap between the lowest and the second lowest of `values[i]` over the i that
/// `evictable` accepts, scaled by `scale(lowest)`; +inf when fewer than two are accepted.
template <class Evictable, class Scale>
double low_gap(const std::vector<double>& values, Evictable evictable, Scale scale) {
  const double inf = std::numeric_limits<double>::infinity();
  double lo1 = inf, lo2 = inf;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!evictable(i)) continue;
    if (values[i] < lo1) {
      lo2 = lo1;
      lo1 = values[i];
    } else if (values[i] < lo2) {
      lo2 = values[i];
    }
  }
  return lo2 == inf ? inf : (lo2 - lo1) / scale(lo1);
}

/// Relative gap between the two lowest evictable ranks if `head` absorbed `key` now and had to
/// evict (docs/design.md 4.2 step 3), or +inf when no eviction happens or only one row is
/// evictable. Computed by the oracle itself on a copy with an unbounded budget.
double core_eviction_margin(const ref::H2OHeadOracle& head, const std::vector<double>& key,
                            const std::vector<double>& value, int budget, int n_sink, int g) {
  if (head.rows().empty() || static_cast<int>(head.rows().size()) + 1 <= budget) {
    return std::numeric_limits<double>::infinity();
  }
  ref::H2OHeadOracle probe = head;
  probe.set_budget(1 << 30);  // larger: just stamped, nothing evicted
  probe.absorb(key, value);
  const auto& rows = probe.rows();
  const std::size_t n = rows.size();
  return low_gap(
      probe.rank(),  // what the eviction ranks by
      [&](std::size_t i) { return rows[i].position >= n_sink && i + static_cast<std::size_t>(g) < n; },
      [](double lo) { return std::max(1.0, std::fabs(lo)); });
}

/// Relative gap between the two lowest evictable weights of a TOVA eviction the oracle just ran:
/// `weights` and `positions` cover the budget + 1 rows before the eviction; +inf when fewer than
/// two rows were evictable.
double tova_eviction_margin(const std::vector<double>& weights,
                            const std::vector<std::int64_t>& positions, int n_sink) {
  return low_gap(
      weights, [&](std::size_t i) { return positions[i] >= n_sink; },
      [](double lo) { return std::max(lo, std::numeric_limits<double>::min()); });
}

/// Runs one call of `plan` through `api` and checks what it returned against the rows retained
/// before it (`before`, one list per head) and the call's own rows. kd, vd: the call as double;
/// k, v: converted to T; q: float32 queries (query APIs). Returns the first mismatch, or "".
template <class T>
std::string call_and_compare(cache::KVCache<T>& c, Api api, const cache::Tensor4<double>& kd,
                             const cache::Tensor4<double>& vd, const cache::Tensor4<T>& k,
                             const cache::Tensor4<T>& v, const cache::Tensor4<float>& q,
                             cache::KVPair<T>& into,
                             const std::vector<std::vector<ref::OracleRow>>& before,
                             std::int64_t offset, const RunDims& dm) {
  const auto fetched = [&](const cache::KVPair<T>& got) {
    return compare_returned(got, before, k, v, dm.B, dm.H, dm.Dk, dm.Dv);
  };
  const bool queries = api_has_queries(api);
  if (is_view_api(api)) {
    return compare_view(api == Api::kViewDouble ? c.update_and_view(kd, vd)
                        : queries               ? c.update_and_view(k, v, q)
                                                : c.update_and_view(k, v),
                        before, k, v, offset);
  }
  if (api == Api::kFetchIntoDoubleQ) {
    c.update_and_fetch_into(kd, vd, cache::Tensor4<double>(q.template cast<double>()), into);
  } else if (is_into_api(api)) {
    queries ? c.update_and_fetch_into(k, v, q, into) : c.update_and_fetch_into(k, v, into);
  } else {
    return fetched(api == Api::kFetchDouble ? c.update_and_fetch(kd, vd)
                   : queries                ? c.update_and_fetch(k, v, q)
                                            : c.update_and_fetch(k, v));
  }
  return fetched(into);
}

std::size_t total_rows(const std::vector<std::vector<ref::OracleRow>>& heads) {
  std::size_t n = 0;
  for (const auto& h : heads) n += h.size();
  return n;
}

}  // namespace

std::vector<double> snap_call_scores(const Rows& keys, int obs_window, bool causal) {
  const std::size_t S = keys.size();
  const std::size_t w = std::min(static_cast<std::size_t>(obs_window), S);
  std::vector<double> score(S, 0.0);
  for (std::size_t j = S - w; j < S; ++j) {
    const Rows seen =
        causal ? Rows(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(j + 1)) : keys;
    const std::vector<double> a = ref::proxy_softmax(seen, keys[j]);
    for (std::size_t r = 0; r < a.size(); ++r) score[r] += a[r];
  }
  for (auto& s : score) s /= static_cast<double>(w);
  return score;
}

double snap_selection_margin(const Rows& keys, int budget, int n_sink, int obs_window) {
  return snap_selection_margin(Rows{}, keys, static_cast<std::size_t>(std::min(n_sink, budget)),
                               budget, obs_window);
}

double snap_selection_margin(const Rows& held, const Rows& keys, std::size_t sinks, int budget,
                             int obs_window) {
  Rows all = held;
  all.insert(all.end(), keys.begin(), keys.end());
  const std::size_t w = std::min(static_cast<std::size_t>(obs_window), keys.size());
  std::vector<double> score(all.size(), 0.0);
  for (std::size_t j = keys.size() - w; j < keys.size(); ++j) {
    const std::vector<double> a = ref::proxy_softmax(all, keys[j]);
    for (std::size_t r = 0; r < a.size(); ++r) score[r] += a[r] / static_cast<double>(w);
  }
  const std::size_t keep = static_cast<std::size_t>(budget) - sinks;
  std::vector<double> others(score.begin() + static_cast<std::ptrdiff_t>(sinks), score.end());
  if (others.size() <= keep) return std::numeric_limits<double>::infinity();
  std::sort(others.begin(), others.end(), std::greater<double>());
  const double hi = others[keep - 1], lo = others[keep];
  return (hi - lo) / std::max(std::fabs(hi), 1e-300);
}

// ---------------------------------------------------------------------------------------------
// Oracle heads
// ---------------------------------------------------------------------------------------------

CoreHeads::CoreHeads(std::size_t n, int n_sink, double decay, std::function<int(int)> grace,
                     std::optional<int> budget, Scorer scorer)
    : heads_(n, ref::H2OHeadOracle(n_sink, decay, grace)),
      n_sink_(n_sink),
      grace_(std::move(grace)),
      budget_(budget) {
  for (auto& h : heads_) {
    h.set_scorer(scorer);
    if (budget) h.set_budget(*budget);
  }
}

bool CoreHeads::absorb(std::size_t head, const Rows& keys, const Rows& values,
                       const TokenQueries* queries) {
  ref::H2OHeadOracle& o = heads_[head];
  if (queries) {
    o.absorb_call(keys, values, *queries);
    return false;
  }
  bool near_tie = false;
  const int g = budget_ ? ref::clamp_recent(grace_(*budget_), *budget_, n_sink_) : 0;
  for (std::size_t s = 0; s < keys.size(); ++s) {
    if (budget_ &&
        core_eviction_margin(o, keys[s], values[s], *budget_, n_sink_, g) < kNearTie) {
      near_tie = true;
    }
    o.absorb(keys[s], values[s]);
  }
  return near_tie;
}

void CoreHeads::set_budget(int budget) {
  budget_ = budget;
  for (auto& h : heads_) h.set_budget(budget);
}

void CoreHeads::set_value_power(double p) {
  for (auto& h : heads_) h.set_value_power(p);
}

void CoreHeads::reset() {
  for (auto& h : heads_) h.reset();
}

bool TovaHeads::absorb(std::size_t head, const Rows& keys, const Rows& values,
                       const TokenQueries* queries) {
  ref::TOVAHeadOracle& o = heads_[head];
  bool near_tie = false;
  for (std::size_t s = 0; s < keys.size(); ++s) {
    std::vector<std::int64_t> pre = o.positions();
    pre.push_back(o.next_position());
    if (queries) {
      o.absorb(keys[s], values[s], (*queries)[s]);
    } else {
      o.absorb(keys[s], values[s]);
    }
    const std::vector<double> w = o.last_weights();
    if (!w.empty() && tova_eviction_margin(w, pre, n_sink_) < kNearTie) near_tie = true;
  }
  return near_tie;
}

void TovaHeads::reset() {
  for (auto& h : heads_) h.reset();
}

bool SnapHeads::absorb(std::size_t head, const Rows& keys, const Rows& values,
                       const TokenQueries* queries) {
  ref::SnapKVHeadOracle& o = heads_[head];
  // Only the proxy's compressions are measured (the query runs tolerate no near-tie): a prompt
  // chunk that passes the budget, ranked with every row held (SPEC 13.3).
  const std::vector<ref::OracleRow>& held = o.rows();
  const bool measured = queries == nullptr && keys.size() > 1 &&
                        held.size() + keys.size() > static_cast<std::size_t>(budget_);
  bool near_tie = false;
  if (measured) {
    Rows held_keys;
    for (const auto& r : held) held_keys.push_back(r.key);
    // The leading positions below n_sink, at most budget of them.
    std::size_t sinks = 0;
    const auto total = held.size() + keys.size();
    while (sinks < total && sinks < static_cast<std::size_t>(budget_) &&
           (sinks < held.size()
                ? held[sinks].position
                : o.next_position() + static_cast<std::int64_t>(sinks - held.size())) < n_sink_) {
      ++sinks;
    }
    near_tie = snap_selection_margin(held_keys, keys, sinks, budget_, obs_window_) < kNearTie;
  }
  queries ? o.absorb_call(keys, values, *queries) : o.absorb_call(keys, values);
  return near_tie;
}

void SnapHeads::reset() {
  for (auto& h : heads_) h.reset();
}

bool StreamingHeads::absorb(std::size_t head, const Rows& keys, const Rows& values,
                            const TokenQueries*) {
  for (std::size_t s = 0; s < keys.size(); ++s) heads_[head].absorb(keys[s], values[s]);
  return false;
}

// ---------------------------------------------------------------------------------------------
// Call sequences
// ---------------------------------------------------------------------------------------------

std::vector<DriverCall> random_plan(std::mt19937& rng, const PlanShape& shape) {
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<std::size_t> api(0, shape.apis.size() - 1);
  const Index gs[] = {1, 2, 4};
  std::vector<DriverCall> plan;
  for (int c = 0; c <= shape.calls; ++c) {
    DriverCall p;
    if (c == 0) {
      p.S = shape.prefill;
    } else {
      const double r = u01(rng);
      if (r < shape.empty) {
        p.S = 0;
      } else if (r < shape.empty + shape.short_calls) {
        p.S = std::uniform_int_distribution<Index>(2, std::max<Index>(2, shape.short_max))(rng);
      } else if (r < shape.empty + shape.short_calls + shape.long_calls) {
        p.S = std::uniform_int_distribution<Index>(shape.long_min, shape.long_max)(rng);
      }
    }
    p.api = shape.apis[api(rng)];
    p.G = shape.vary_g ? gs[std::uniform_int_distribution<int>(0, 2)(rng)] : shape.G;
    p.inject_bad = api_has_queries(p.api) && u01(rng) < shape.bad_queries;
    plan.push_back(p);
  }
  return plan;
}

std::vector<DriverCall> random_query_plan(std::mt19937& rng, int calls, Index G, bool vary_g) {
  PlanShape shape;
  shape.prefill = std::uniform_int_distribution<Index>(1, 150)(rng);
  shape.calls = calls - 1;
  shape.empty = 0.05;
  shape.short_calls = 0.12;
  shape.short_max = 40;
  shape.long_calls = 0.08;
  shape.long_min = 65;
  shape.long_max = 150;
  shape.apis.assign(std::begin(kAllQueryApis), std::end(kAllQueryApis));
  shape.G = G;
  shape.vary_g = vary_g;
  shape.bad_queries = 0.12;
  return random_plan(rng, shape);
}

RunDims random_dims(std::mt19937& rng) {
  const Index dims[] = {2, 4, 8, 16};
  RunDims dm;
  dm.B = std::uniform_int_distribution<Index>(1, 3)(rng);
  dm.H = std::uniform_int_distribution<Index>(1, 3)(rng);
  dm.Dk = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
  dm.Dv = dims[std::uniform_int_distribution<std::size_t>(0, 3)(rng)];
  return dm;
}

QuerySweepRun query_sweep_run(std::mt19937& rng, unsigned seed) {
  const auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const Index gs[] = {1, 2, 4};
  const Index ds[] = {3, 8, 20};
  QuerySweepRun r;
  r.G = gs[seed % 3];
  r.vary_g = seed % 4 == 3;
  r.dims = RunDims{pick(1, 2), pick(1, 3), ds[(seed + seed / 3) % 3], pick(1, 5)};
  r.budget = pick(8, 40);
  r.n_sink = pick(0, 4);
  return r;
}

std::string QuerySweepRun::describe(const std::string& policy, unsigned seed) const {
  std::ostringstream os;
  os << policy << " seed=" << seed << " B=" << dims.B << " H=" << dims.H << " D=" << dims.Dk
     << " G=" << (vary_g ? std::string("varying") : std::to_string(G)) << " budget=" << budget
     << " n_sink=" << n_sink;
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------------

template <class T, class Heads>
std::string compare_with_oracle(const cache::KVCache<T>& c, const Heads& oracle,
                                const RunDims& dm, std::int64_t offset) {
  std::ostringstream err;
  if (c.offset() != offset) {
    err << "offset " << c.offset() << ", expected " << offset;
    return err.str();
  }
  if (c.tokens_seen() != offset * dm.B * dm.H) {
    err << "tokens_seen " << c.tokens_seen() << ", expected " << offset * dm.B * dm.H;
    return err.str();
  }
  const auto n = static_cast<Index>(oracle.rows(0).size());
  const cache::KVPair<T> st = c.state();
  if (shape_of(st.first) != Shape{dm.B, dm.H, n, dm.Dk} ||
      shape_of(st.second) != Shape{dm.B, dm.H, n, dm.Dv}) {
    err << "state() holds " << st.first.dimension(2) << " rows per head, oracle " << n;
    return err.str();
  }
  const bool scored = visit_scored(c, [](const auto&) {});
  for (Index b = 0; b < dm.B; ++b) {
    for (Index h = 0; h < dm.H; ++h) {
      const auto& rows = oracle.rows(static_cast<std::size_t>(b * dm.H + h));
      if (scored) {
        if (policy_positions(c, b, h) != ref::oracle_detail::positions_of(rows)) {
          err << "head (" << b << ", " << h << ") retained positions differ from the oracle's";
          return err.str();
        }
        const std::vector<float> sc = policy_scores(c, b, h);
        if (sc.size() != rows.size()) {
          err << "head (" << b << ", " << h << ") has " << sc.size() << " scores for "
              << rows.size() << " rows";
          return err.str();
        }
        for (std::size_t r = 0; r < rows.size(); ++r) {
          if (!scores_close(static_cast<double>(sc[r]), rows[r].score)) {
            err << "head (" << b << ", " << h << ") position " << rows[r].position << " score "
                << sc[r] << ", oracle " << rows[r].score;
            return err.str();
          }
        }
      }
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const std::string row_err = compare_state_row(st, b, h, static_cast<Index>(r), rows[r]);
        if (!row_err.empty()) return row_err;
      }
    }
  }
  if (c.tokens_kept() != n) err << "tokens_kept " << c.tokens_kept() << ", expected " << n;
  const auto row_bytes = static_cast<std::size_t>(dm.Dk + dm.Dv) * sizeof(T);
  const std::size_t kept = static_cast<std::size_t>(dm.B * dm.H * n) * row_bytes;
  const std::size_t full = static_cast<std::size_t>(dm.B * dm.H * offset) * row_bytes;
  if (c.kept_bytes() != kept) err << "kept_bytes " << c.kept_bytes() << ", expected " << kept;
  if (c.full_seq_bytes() != full) {
    err << "full_seq_bytes " << c.full_seq_bytes() << ", expected " << full;
  }
  const double ratio = kept == 0 ? 1.0 : static_cast<double>(full) / static_cast<double>(kept);
  if (c.compression_ratio() != ratio) {
    err << "compression_ratio " << c.compression_ratio() << ", expected " << ratio;
  }
  return err.str();
}

template <class T, class Heads>
RunOutcome run_against_oracle(Subject<T>& subject, Heads& oracle, const RunDims& dm,
                              const std::vector<DriverCall>& plan, std::mt19937& rng,
                              const RunChecks<T>& checks) {
  RunOutcome res;
  cache::KVCache<T>& c = *subject.cache;
  cache::KVPair<T> into;  // reused across the fetch_into calls, as an engine would
  std::int64_t offset = c.offset();
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const DriverCall& p = plan[i];
    const bool with_queries = api_has_queries(p.api);
    std::ostringstream where_os;
    where_os << checks.what << ", call " << i << " (S=" << p.S;
    if (with_queries) where_os << ", G=" << p.G;
    where_os << ", " << api_name(p.api) << ")";
    const std::string where = where_os.str();
    const cache::Tensor4<double> kd = random_doubles(rng, dm.B, dm.H, p.S, dm.Dk);
    const cache::Tensor4<double> vd = random_doubles(rng, dm.B, dm.H, p.S, dm.Dv);
    const cache::Tensor4<T> keys = converted<T>(kd);
    const cache::Tensor4<T> values = converted<T>(vd);
    cache::Tensor4<float> queries;
    if (with_queries) queries = random_queries(rng, dm.B, p.G * dm.H, p.S, dm.Dk);

    if (p.inject_bad && with_queries) {
      std::vector<BadQueries> bad = bad_query_variants(queries, dm.H, rng);
      std::shuffle(bad.begin(), bad.end(), rng);
      for (std::size_t j = 0; j < 2 && j < bad.size(); ++j) {
        const std::string e =
            bad_queries_rejected(subject, kQueryApis[(i + j) % 3], keys, values, bad[j]);
        if (!e.empty()) {
          res.failure = where + ": " + e;
          return res;
        }
      }
    }

    // The call returns the rows retained before it (docs/design.md 4.4), even when it starts by
    // adopting a new budget (the re-budget applies to what the call retains).
    std::vector<std::vector<reference::OracleRow>> before;
    before.reserve(oracle.size());
    for (std::size_t h = 0; h < oracle.size(); ++h) before.push_back(oracle.rows(h));
    if (checks.before_call) checks.before_call(i, keys);
    for (Index b = 0; b < dm.B; ++b) {
      for (Index h = 0; h < dm.H; ++h) {
        const TokenQueries q = with_queries ? queries_of(queries, b, h, p.G) : TokenQueries{};
        if (oracle.absorb(static_cast<std::size_t>(b * dm.H + h), rows_of(keys, b, h),
                          rows_of(values, b, h), with_queries ? &q : nullptr)) {
          res.near_tie = true;
        }
      }
    }
    std::size_t rows_after = 0;
    for (std::size_t h = 0; h < oracle.size(); ++h) rows_after += oracle.rows(h).size();
    const bool evicted =
        total_rows(before) + static_cast<std::size_t>(p.S) * oracle.size() > rows_after;

    std::string err =
        call_and_compare(c, p.api, kd, vd, keys, values, queries, into, before, offset, dm);
    offset += p.S;
    if (err.empty()) err = compare_with_oracle(c, oracle, dm, offset);
    if (err.empty() && checks.after_call) err = checks.after_call(offset);
    if (!err.empty()) {
      if (checks.tolerate_near_ties && res.near_tie) {
        res.diverged_at_tie = true;
      } else {
        res.failure = where + ": " + err;
      }
      return res;
    }
    ++res.calls_checked;
    if (evicted) {
      ++res.evicting_calls;
      if (p.S > 64) ++res.big_evicting_calls;
      if (p.S == 1) ++res.decode_evictions;
    }
  }
  return res;
}

#define VELOXQUANT_TEST_DRIVER_INSTANCE(T) VELOXQUANT_TEST_DRIVER_HEADS(template, T)
VELOXQUANT_TEST_STORAGE_TYPES(VELOXQUANT_TEST_DRIVER_INSTANCE)
#undef VELOXQUANT_TEST_DRIVER_INSTANCE

}  // namespace veloxquant::test
