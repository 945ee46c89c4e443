// fuzz target `ops` (fuzz/fuzz_ops.hpp): the run — construction of the cache, then the
// operations the input chooses (calls, reset, trim, reports to the coordinator, save and reload,
// fork, checkpoint and rollback, parallel heads, a scrambled output), each checked against the
// models.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops_budget.hpp"
#include "ops_calls.hpp"
#include "ops_checks.hpp"
#include "ops_config.hpp"
#include "ops_input.hpp"
#include "ops_kinds.hpp"
#include "ops_oracle.hpp"
#include "ops_report.hpp"
#include "ops_subject.hpp"

namespace veloxquant::fuzz::detail {

/// Runs one input on storage type T. Owns the run's parts: the trace (report_), what is tested
/// (spec_), the caches (cache_), the budget model (budget_), the sequence model (seq_) and the
/// checks that compare them (checks_).
template <class T>
class Harness {
 public:
  Harness(Bytes& in, const Options& opt)
      : in_(in),
        report_(opt, [this] { return describe(); }),
        budget_(spec_),
        seq_(spec_, budget_, report_),
        checks_(spec_, cache_, budget_, seq_, report_) {}

  void run() {
    spec_.run = in_.pick(kRunCount);
    spec_.method = kRunMethods[spec_.run].method;
    if (Stats* stats = report_.stats()) ++stats->method_runs[spec_.run];
    if (!construct()) return;
    if (spec_.adaptive) report_.count(&Stats::adaptive_runs);
    seq_.start(in_);
    for (report_.op = 0; report_.op < kMaxOps && !in_.exhausted(); ++report_.op) {
      step();
      check_other_set();
    }
  }

 private:
  std::string describe() const {
    std::ostringstream os;
    os << run_name(spec_.run) << " T=" << type_name<T>() << " via " << spec_.via;
    if (spec_.core()) {
      os << " budget=" << (budget_.budget ? std::to_string(*budget_.budget) : "unknown")
         << " n_sink=" << budget_.n_sink << " g=" << budget_.grace();
    }
    os << describe_config(spec_);
    os << " B=" << seq_.B << " H=" << seq_.H << " Dk=" << seq_.Dk << " Dv=" << seq_.Dv
       << " queries="
       << (seq_.qmode == QueryMode::None     ? "none"
           : seq_.qmode == QueryMode::Always ? "always"
                                             : "mixed");
    return os.str();
  }

  // ------------------------------------------------------------------------------------------
  // Construction (docs/design.md 2.1, 2.6, 2.7)
  // ------------------------------------------------------------------------------------------

  /// Builds the configuration and the cache. Returns false when the configuration was (rightly)
  /// rejected.
  bool construct() {
    decode_config(in_, spec_);
    // 1 time in 12: exactly one invalid field, which validate() must name.
    std::string bad_field;
    if (in_.pick(12) == 0) bad_field = break_config(in_, spec_, spec_.direct && !spec_.builder());
    // A field that validate() does not check for the method in use leaves the config valid.
    if (!bad_field.empty() && !validated_for(bad_field, spec_.cfg.method)) {
      report_.log("invalid " + bad_field + " is not checked for method " + spec_.cfg.method);
      bad_field.clear();
    }
    if (!bad_field.empty()) {
      expect_rejected_config(bad_field);
      return false;
    }
    try {
      make_caches();
    } catch (const std::exception& e) {
      report_.fail(std::string("a valid config was rejected: ") + e.what());
    }
    bind_caches();
    budget_.init();
    report_.log("constructed " + describe());
    checks_.budget_getters();
    return true;
  }

  /// Construction with an invalid `bad_field` throws std::invalid_argument naming it.
  void expect_rejected_config(const std::string& bad_field) {
    report_.count(&Stats::invalid_configs);
    report_.log("construct with invalid " + bad_field);
    try {
      make_caches();
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      report_.expect(msg.find(bad_field) != std::string::npos,
                     "config error message does not name the bad field " + bad_field + ": " + msg);
      return;
    } catch (const std::exception& e) {
      report_.fail(std::string("invalid config threw a non-invalid_argument exception: ") +
                   e.what());
    }
    report_.fail("a config with an invalid " + bad_field + " was accepted");
  }

  void make_caches() {
    report_.expect(cache_.make(spec_), "for_model returned the wrong number of caches");
  }

  void bind_caches() {
    const std::string problem = cache_.bind(spec_);
    report_.expect(problem.empty(), problem);
  }

  // ------------------------------------------------------------------------------------------
  // Operations
  // ------------------------------------------------------------------------------------------

  void step() {
    const int kind = in_.pick(16);
    switch (kind) {
      case 0:
      case 1:
      case 2:
      case 12:
        do_call(1, Bad::None);
        break;
      case 3:
        do_call(static_cast<Index>(in_.range(0, 4)), Bad::None);
        break;
      case 4:
      case 13:
        do_call(static_cast<Index>(in_.range(0, kMaxS)), Bad::None);
        break;
      case 5:
        do_call(0, Bad::None);
        break;
      case 6:
      case 14: {
        const auto bad = static_cast<Bad>(1 + in_.pick(static_cast<int>(Bad::kCount) - 1));
        do_call(static_cast<Index>(in_.range(0, 6)), bad);
        break;
      }
      case 7:
        do_reset();
        break;
      case 8:
        do_trim();
        break;
      case 9:
        do_report();
        break;
      case 10:
        do_parallel_heads();
        break;
      case 15: {
        const int which = in_.pick(3);
        if (which == 0) do_reload();
        if (which == 1) do_fork();
        if (which == 2) do_speculate();
        break;
      }
      case 11:
        do_scramble_output();
        break;
      default:
        do_call(static_cast<Index>(in_.range(1, kMaxS)), Bad::None);
        break;
    }
  }

  void do_parallel_heads() {
    const bool on = in_.pick(2) != 0;
    cache_.layer->set_parallel_heads(on);
    report_.expect(cache_.layer->parallel_heads() == on, "set_parallel_heads did not stick");
    report_.log(std::string("parallel_heads ") + (on ? "on" : "off"));
  }

  /// Gives the output reused by update_and_fetch_into a wrong shape.
  void do_scramble_output() {
    // (One read per statement: argument evaluation order is unspecified.)
    const Index n = in_.range(0, 5);
    const Index kb = in_.range(0, 2), kh = in_.range(0, 3), kd = in_.range(0, 9);
    const Index vb = in_.range(0, 2), vh = in_.range(0, 3), vd = in_.range(0, 9);
    cache_.out.first.resize(kb, kh, n, kd);
    cache_.out.second.resize(vb, vh, n, vd);
    report_.log("scramble the reused output");
  }

  /// Saves every cache of the run (the whole builder model, its coordinator included) and carries
  /// on with the loaded set (docs/design.md G): everything observable must be as before (the heap
  /// aside: capacities are not saved), the loaded set must save to the same bytes, and the run's
  /// later checks against the oracles then hold for the loaded caches.
  void do_reload() {
    Snapshot before = cache_.snapshot();
    const bool parallel = cache_.layer->parallel_heads();
    std::ostringstream out;
    vc::save_prompt_cache(out, cache_.owned, {{"op", std::to_string(report_.op)}});
    const std::string bytes = out.str();
    std::istringstream in(bytes);
    vc::PromptCache<T> loaded;
    try {
      loaded = vc::load_prompt_cache<T>(in);
    } catch (const std::exception& e) {
      report_.fail(std::string("a saved set did not load: ") + e.what());
    }
    report_.expect(loaded.caches.size() == cache_.owned.size(),
                   "the loaded set has another number of caches");
    std::ostringstream again;
    vc::save_prompt_cache(again, loaded.caches, loaded.metadata);
    report_.expect(again.str() == bytes, "the loaded set saves to other bytes");
    cache_.replace(std::move(loaded.caches));
    cache_.layer->set_parallel_heads(parallel);
    bind_caches();
    Snapshot after = cache_.snapshot();
    before.heap = after.heap = 0;
    report_.expect(after == before, "the loaded cache differs from the saved one");
    report_.count(&Stats::reloads);
    report_.log("save and reload (" + std::to_string(bytes.size()) + " bytes)");
  }

  /// Forks every cache of the run (KVCacheBuilder::fork, docs/design.md 10.1) and carries on with
  /// the copy or with the source, as the input chooses: the copy shows everything its source shows
  /// (the heap aside), the run's later checks hold for whichever goes on, and the other set is
  /// kept and must not change while the run goes on (check_other_set, after every operation).
  void do_fork() {
    Snapshot before = cache_.snapshot();
    std::vector<std::unique_ptr<vc::KVCache<T>>> copy;
    try {
      copy = vc::KVCacheBuilder::fork(cache_.owned);
    } catch (const std::exception& e) {
      report_.fail(std::string("fork threw: ") + e.what());
    }
    report_.expect(copy.size() == cache_.owned.size(), "the fork has another number of caches");
    const std::size_t index = cache_.layer_index();
    const bool go_on_with_copy = in_.pick(2) != 0;
    if (go_on_with_copy) {
      other_ = cache_.replace(std::move(copy));
    } else {
      other_ = std::move(copy);
    }
    bind_caches();
    Snapshot after = cache_.snapshot();
    before.heap = after.heap = 0;
    report_.expect(after == before, "the fork differs from its source");
    other_layer_ = other_[index].get();
    other_state_ = other_snapshot();
    report_.count(&Stats::forks);
    report_.log(std::string("fork, going on with the ") + (go_on_with_copy ? "copy" : "source"));
  }

  /// The set a fork left aside, as observed now (the heap aside).
  Snapshot other_snapshot() const {
    const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(other_layer_);
    Snapshot s = vt::snapshot(*other_layer_, sq ? sq->coordinator().get() : nullptr);
    s.heap = 0;
    return s;
  }
  /// Calls on one side of a fork never change the other.
  void check_other_set() {
    if (other_layer_ == nullptr) return;
    report_.expect(other_snapshot() == other_state_,
                   "calls on one side of a fork changed the other side");
  }

  /// KVCacheBuilder::checkpoint, one to three valid calls of any size and API that the models do
  /// not see (a draft, verified), then rollback (docs/design.md 10.2): everything observable is
  /// exactly as at the checkpoint, bitwise (the heap aside), and the run's later checks against
  /// the oracles hold for the rolled-back set. A second rollback is refused and changes nothing.
  void do_speculate() {
    Snapshot before = cache_.snapshot();
    before.heap = 0;
    vc::KVCacheBuilder::checkpoint(cache_.owned);
    const int calls = 1 + in_.pick(3);
    std::string drafted;
    // The dims the drafts must keep: the sequence's, or those of the first draft with rows when
    // the set has seen no call (the rollback then takes them back).
    Index B = seq_.B, H = seq_.H, Dk = seq_.Dk, Dv = seq_.Dv;
    bool known = seq_.dims_known;
    for (int i = 0; i < calls; ++i) {
      const CallPlan p = decode_call(in_, seq_.qmode, known, Bad::None);
      const Index S = static_cast<Index>(in_.range(0, 12));
      Rng rng(p.seed);
      const CallDims d = call_dims(p, S, rng, B, H, Dk, Dv, known);
      const CallInputs<T> in = call_inputs<T>(p, d, rng, seq_.palette_k, seq_.one_hot);
      if (in.expect_reject) continue;  // a valid plan can still draw dims a known set refuses
      drafted += " " + describe_call(p, S, d, B, H, Dk, Dv);
      try {
        if (p.api != Api::View && spec_.adaptive && vt::ragged_heads(*cache_.layer)) {
          // A fetch on ragged heads (SPEC 14) is refused (checked in execute()); the draft is made
          // as a view.
          CallPlan view = p;
          view.api = Api::View;
          try {
            (void)invoke(*cache_.layer, cache_.out, p, in);
            report_.fail("a draft fetch on ragged heads was accepted");
          } catch (const std::invalid_argument& e) {
            report_.expect(vt::is_ragged_refusal(e.what()),
                           std::string("a draft fetch on ragged heads: ") + e.what());
          }
          (void)invoke(*cache_.layer, cache_.out, view, in);
        } else {
          (void)invoke(*cache_.layer, cache_.out, p, in);
        }
      } catch (const std::exception& e) {
        report_.fail(std::string("a draft call threw: ") + e.what());
      }
      if (S > 0 && !known) {
        B = d.B;
        H = d.H;
        Dk = d.Dk;
        Dv = d.Dv;
        known = true;
      }
    }
    vc::KVCacheBuilder::rollback(cache_.owned);
    Snapshot after = cache_.snapshot();
    after.heap = 0;
    report_.expect(after == before,
                   "rollback did not return to the checkpoint: " + diff(before, after));
    try {
      vc::KVCacheBuilder::rollback(cache_.owned);
      report_.fail("a second rollback was not refused");
    } catch (const std::logic_error&) {
    }
    Snapshot again = cache_.snapshot();
    again.heap = 0;
    report_.expect(again == after, "a refused rollback changed the cache");
    report_.count(&Stats::rollbacks);
    report_.log("checkpoint," + drafted + ", rollback");
  }

  void do_reset() {
    const bool whole_model = spec_.squeeze_builder() ? in_.pick(2) != 0 : false;
    if (whole_model) {
      const std::uint64_t gen = cache_.coordinator->generation();
      vc::KVCacheBuilder::reset(cache_.owned);
      report_.expect(cache_.coordinator->generation() == gen + 1,
                     "KVCacheBuilder::reset did not reset the coordinator once");
      report_.log("KVCacheBuilder::reset");
    } else {
      cache_.layer->reset();
      report_.log("reset");
    }
    report_.count(&Stats::resets);
    budget_.reset(whole_model);
    seq_.start(in_);
    checks_.after_reset();
  }

  void do_trim() {
    const int k = in_.range(-2, 60);
    const Snapshot before = cache_.snapshot();
    const std::string call = "trim(" + std::to_string(k) + ")";
    if (k < 0) {
      try {
        (void)cache_.layer->trim(k);
      } catch (const std::invalid_argument&) {
        report_.expect(cache_.snapshot() == before, call + " threw but changed the cache");
        report_.log(call + " rejected");
        return;
      }
      report_.fail(call + " with n < 0 did not throw std::invalid_argument");
    }
    const std::int64_t got = cache_.layer->trim(k);
    report_.count(&Stats::trims);
    report_.log(call + " -> " + std::to_string(got));
    if (spec_.method != Method::standard) {
      report_.expect(got == 0, "a non-trimmable cache trimmed " + std::to_string(got));
      report_.expect(cache_.snapshot() == before, "trim on a non-trimmable cache changed it");
      return;
    }
    const std::int64_t want = std::min<std::int64_t>(k, seq_.offset);
    if (!seq_.dims_known) {
      report_.expect(got == 0 && cache_.snapshot() == before,
                     "trim before the first call changed the cache");
      return;
    }
    report_.expect(got == want, call + " returned " + std::to_string(got) + ", expected " +
                                    std::to_string(want));
    seq_.trim(want);
    checks_.after_call();
  }

  /// A report of another layer to the shared coordinator (squeeze builder); on other policies
  /// this op is a decode call.
  void do_report() {
    if (!spec_.squeeze_builder()) {
      do_call(1, Bad::None);
      return;
    }
    const int layer = in_.range(-1, spec_.layers + 1);
    const double c = pick_from(in_, {0.5, 0.0, 0.25, 1.0, 0.9, -0.5, 1.5, 0.1, kNaN, kInf});
    const bool bad = layer < 0 || !std::isfinite(c);
    std::ostringstream os;
    os << "report(layer " << layer << ", " << c << ")";
    report_.log(os.str());
    const Snapshot before = cache_.snapshot();
    try {
      cache_.coordinator->report_concentration(layer, c);
    } catch (const std::invalid_argument&) {
      report_.expect(bad, os.str() + " was rejected");
      report_.expect(cache_.snapshot() == before,
                     os.str() + " threw but changed the coordinator or the cache");
      return;
    }
    report_.expect(!bad, os.str() + " was accepted");
    budget_.coord.report(layer, c, spec_);
    checks_.coordinator();
  }

  // ------------------------------------------------------------------------------------------
  // Calls
  // ------------------------------------------------------------------------------------------

  void do_call(Index S, Bad bad) {
    const CallPlan p = decode_call(in_, seq_.qmode, seq_.dims_known, bad);
    // Claimed query heads are claimed by an empty call.
    execute(p.bad == Bad::ClaimedQueryHeads ? 0 : S, p);
  }

  void execute(Index S, const CallPlan& p) {
    Rng rng(p.seed);
    const CallDims d = call_dims(p, S, rng, seq_.B, seq_.H, seq_.Dk, seq_.Dv, seq_.dims_known);
    const CallInputs<T> in = call_inputs<T>(p, d, rng, seq_.palette_k, seq_.one_hot);
    report_.log(describe_call(p, S, d, seq_.B, seq_.H, seq_.Dk, seq_.Dv));

    const Snapshot before = cache_.snapshot();
    const bool dims_were_known = seq_.dims_known;
    // Positions retained before the call: reported by scored caches, else the exact models'.
    const std::vector<Positions> pos_before = !dims_were_known
                                                  ? std::vector<Positions>(seq_.heads.size())
                                              : cache_.scored ? before.positions
                                                              : retained_positions();
    // Adaptive heads that hold different numbers of rows (SPEC 14): a fetch must be refused.
    const bool ragged = spec_.adaptive && vt::ragged_heads(*cache_.layer);
    const vc::KVPair<T> out_before = cache_.out;
    Window<T> win;
    bool rejected = false;
    std::string reject_msg;
    try {
      win = invoke(*cache_.layer, cache_.out, p, in);
    } catch (const std::invalid_argument& e) {
      rejected = true;
      reject_msg = e.what();
    } catch (const std::exception& e) {
      report_.fail(std::string("call threw a non-invalid_argument exception: ") + e.what());
    }
    report_.count(&Stats::calls);
    if (p.with_queries) report_.count(&Stats::query_calls);
    if (in.expect_reject) {
      expect_rejected(p, rejected, reject_msg, before);
      return;
    }
    if (ragged && p.api != Api::View) {
      expect_ragged_refusal(rejected, reject_msg, before, out_before);
      return;
    }
    report_.expect(!rejected, "valid call was rejected: " + reject_msg);

    // The returned window (docs/design.md 4.4 / 2.3), against the state before the call.
    checks_.window(win, before, pos_before, in, S, d, dims_were_known);
    if (S == 0) {
      report_.expect(cache_.snapshot() == before, "an empty call changed the cache");
      return;
    }
    if (!dims_were_known) {
      seq_.dims_known = true;
      seq_.B = d.B;
      seq_.H = d.H;
      seq_.Dk = d.Dk;
      seq_.Dv = d.Dv;
    }
    report_.count(&Stats::tokens, static_cast<std::uint64_t>(S));
    update_models(in, p.with_queries, p.G, S);
    checks_.after_call(pos_before, S);
  }

  /// A valid fetch on ragged heads (SPEC 14): std::invalid_argument naming attend and
  /// update_and_view, and nothing changed: the cache (strong guarantee) and the reused output.
  void expect_ragged_refusal(bool rejected, const std::string& reject_msg, const Snapshot& before,
                             const vc::KVPair<T>& out_before) {
    report_.expect(rejected, "a fetch on ragged heads was accepted");
    report_.expect(vt::is_ragged_refusal(reject_msg),
                   "a fetch on ragged heads was refused without naming attend and "
                   "update_and_view: " +
                       reject_msg);
    const Snapshot after = cache_.snapshot();
    report_.expect(after == before,
                   "a refused fetch on ragged heads changed the cache: " + diff(before, after));
    const auto same = [](const vc::Tensor4<T>& a, const vc::Tensor4<T>& b) {
      return a.dimensions() == b.dimensions() &&
             (a.size() == 0 ||
              std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0);
    };
    report_.expect(
        same(cache_.out.first, out_before.first) && same(cache_.out.second, out_before.second),
        "a refused fetch on ragged heads touched the reused output");
    report_.count(&Stats::ragged_refusals);
    report_.count(&Stats::rejected);
  }

  /// A bad call threw std::invalid_argument with a message and changed nothing (strong
  /// guarantee, docs/design.md 8).
  void expect_rejected(const CallPlan& p, bool rejected, const std::string& reject_msg,
                       const Snapshot& before) {
    report_.expect(rejected, std::string("bad call (") + bad_name(p.bad) + ") was accepted");
    report_.expect(!reject_msg.empty(), "rejection without a message");
    const Snapshot after = cache_.snapshot();
    report_.expect(after == before,
                   std::string("rejected call (") + bad_name(p.bad) +
                       ") changed the cache (strong guarantee): " + diff(before, after));
    report_.count(&Stats::rejected);
  }

  /// Positions the cache retains, per head (checked against state() after every call).
  std::vector<Positions> retained_positions() const {
    std::vector<Positions> out(seq_.heads.size());
    for (std::size_t i = 0; i < seq_.heads.size(); ++i) out[i] = checks_.positions(i);
    return out;
  }

  /// Updates the models with an accepted call of S >= 1 tokens and records eviction decisions.
  void update_models(const CallInputs<T>& in, bool with_queries, Index G, Index S) {
    for (auto& hm : seq_.heads) hm.ambiguous = false;
    if (spec_.method == Method::squeeze) {
      squeeze_budget_step(in.kt);
    }
    ++budget_.calls_since_reset;
    seq_.absorb_call(in.kt, in.vt, in.qd, with_queries, G, S);
  }

  /// docs/design.md 5.4: report, adoption, fallback; before the call's tokens are absorbed.
  void squeeze_budget_step(const vc::Tensor4<T>& kt) {
    if (budget_.calls_since_reset == 0) checks_.concentration(kt);
    if (!spec_.squeeze_builder()) return;
    if (budget_.calls_since_reset == 0) budget_.report_own(cache_.squeeze->concentration());
    if (const std::optional<int> b = budget_.due_budget()) adopt_budget(*b);
  }

  /// Makes `b` the budget in force (docs/design.md 4.5 trim in every head's oracle).
  void adopt_budget(int b) {
    budget_.budget = b;
    seq_.rebudget(b);
  }

  Bytes& in_;
  Reporter report_;
  // The set a fork left aside (do_fork), its layer under test and what it showed then.
  std::vector<std::unique_ptr<vc::KVCache<T>>> other_;
  const vc::KVCache<T>* other_layer_ = nullptr;
  Snapshot other_state_;
  RunSpec spec_;
  CacheUnderTest<T> cache_;
  BudgetModel budget_;
  SequenceModel<T> seq_;
  Checks<T> checks_;
};

}  // namespace veloxquant::fuzz::detail
