// veloxquant fuzz target `pool`: turns a byte string into a run of operations on several sets of
// caches sharing one MemoryPool (SPEC 19, docs/design.md 10.5) and checks the pool's promises
// after every one. It has no oracle of which rows a trim takes (test_memory_pool.cpp and the
// serve measurement are about that); it checks what must hold whatever the rows' values.
//
// Entry point: std::string veloxquant::fuzz::run_pool(data, size) -> "" or the first violation.
//
// What the bytes choose (a missing byte reads as 0, so every input is a valid run):
//   * the storage type, the rule (fair shares or scores), the model's shape (1-2 layers, B 1-2,
//     H 1-3, Dk and Dv 1-8, 1-2 query heads per KV head) and the cap, 0 to 95 rows a head of one
//     set (so floors sometimes do not fit);
//   * then up to kPoolOps operations, each on one of at most kPoolSets live sets:
//     a new set (for_model into the pool: any evicting method, a budget of 6-40, pool_floor_rows
//     0-7, half or 8-bit rows, adaptive heads on the H2O core); a step of every layer (S 0-12
//     tokens, through attend, update_and_view with queries or update_and_fetch without), or the
//     same with a NaN key in one layer; a fork (it joins the pool); release; destruction; a
//     checkpoint, 1-3 draft steps and a rollback; reset; save and load into the pool.
//
// Checks after every operation:
//   * used_bytes() <= max_bytes() and floor_bytes() <= max_bytes();
//   * used_bytes() is the sum of kept_bytes() over the attached caches, and sequences() counts the
//     attached sets; a released set's caches are out of the pool, a set's children in it;
//   * every head of every attached cache the operation did not call holds at least
//     min(its rows before, its floor) (pool_floor(): pool_floor_rows + sinks), so the pool's
//     trims never take a head below its floor;
//   * a refused operation changes nothing it touched: a bad call throws std::invalid_argument
//     and leaves its layer as it was (positions, scores, offset, bytes) and the pool's bytes as
//     they were; floors that do not fit throw std::length_error (only at attach and at a set's
//     first call) and leave the pool, and the set, as they were;
//   * every other operation succeeds: once attached, no call fails for room.
#pragma once

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#include <veloxquant/cache.hpp>
#include <veloxquant/cache/memory_pool.hpp>

#include "ops_input.hpp"  // its byte reader

namespace veloxquant::fuzz {

inline constexpr int kPoolOps = 40;
inline constexpr std::size_t kPoolSets = 5;

/// What the runs reached (test_fuzz_regressions checks the corpus reaches every kind, and
/// write_pool_seeds keeps the inputs that reach a new one).
struct PoolStats {
  std::uint64_t runs = 0, sets = 0, calls = 0, refused_calls = 0, forks = 0, releases = 0;
  std::uint64_t rollbacks = 0, resets = 0, loads = 0;
  /// Floors that did not fit: at a new set, a first call, a fork, a load.
  std::uint64_t floors_refused = 0;
  /// Operations after which the pool had taken rows from a cache the operation did not call.
  std::uint64_t takes = 0;
  /// Kinds reached: "<method> <rule>", "take <rule>", "refused <where>", "<operation>", ...
  std::set<std::string> reached;
};

namespace pool_detail {

namespace vc = veloxquant::cache;
using Index = Eigen::Index;

/// A violation of the pool's promises (the run stops at the first).
struct PoolViolation {
  std::string what;
};

/// The input bytes (the ops target's reader: a missing byte reads as 0).
using PoolBytes = veloxquant::fuzz::detail::Bytes;

/// What one cache shows of its rows: every head's positions and scores, and its counters.
struct Look {
  std::int64_t offset = 0, seen = 0;
  std::size_t bytes = 0;
  std::vector<std::vector<std::int64_t>> positions;
  std::vector<std::vector<float>> scores;
  bool operator==(const Look& o) const {
    // Scores compare bitwise (a refused call must not have touched them); NaN never appears.
    return offset == o.offset && seen == o.seen && bytes == o.bytes && positions == o.positions &&
           scores == o.scores;
  }
};

template <class T>
Look look(const vc::KVCache<T>& c) {
  Look l{c.offset(), c.tokens_seen(), c.kept_bytes(), {}, {}};
  for (Index b = 0; b < c.batch(); ++b) {
    for (Index h = 0; h < c.heads(); ++h) {
      l.positions.push_back(c.positions(b, h));
      l.scores.push_back(c.scores(b, h));
    }
  }
  return l;
}

template <class T>
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

/// One set of the run: its caches, and whether it is attached.
template <class T>
struct Set {
  Caches<T> caches;
  bool attached = false;
};

const char* const kPoolMethods[] = {"squeeze",       "h2o",    "pyramidkv", "tova",
                                    "streaming_llm", "snapkv", "kvzip"};

template <class T>
class PoolHarness {
 public:
  PoolHarness(PoolBytes& in, PoolStats& stats) : in_(in), stats_(stats), rng_(0x5eedu + in.u8()) {}

  void run() {
    const auto rule =
        in_.pick(2) == 1 ? vc::MemoryPool::Rule::scores : vc::MemoryPool::Rule::fair_share;
    layers_ = in_.range(1, 2);
    B_ = in_.range(1, 2);
    H_ = in_.range(1, 3);
    Dk_ = in_.range(1, 8);
    Dv_ = in_.range(1, 8);
    G_ = in_.range(1, 2);
    const std::size_t row = static_cast<std::size_t>(Dk_ + Dv_) * sizeof(T);
    const std::size_t cap = row * static_cast<std::size_t>(layers_ * B_ * H_) *
                            static_cast<std::size_t>(in_.range(0, 95));
    pool_ = std::make_unique<vc::MemoryPool>(cap, rule);
    rule_ = rule == vc::MemoryPool::Rule::scores ? "scores" : "fair";
    stats_.reached.insert(std::is_same_v<T, float>         ? "float"
                          : std::is_same_v<T, Eigen::half> ? "half"
                                                           : "bfloat16");
    trace_ << "T=" << sizeof(T) << "B"
           << (rule == vc::MemoryPool::Rule::scores ? " scores" : " fair") << " L=" << layers_
           << " B=" << B_ << " H=" << H_ << " Dk=" << Dk_ << " Dv=" << Dv_ << " G=" << G_
           << " cap=" << cap << "\n";
    for (int op = 0; op < kPoolOps && !in_.exhausted(); ++op) {
      step();
      check_pool();
    }
  }

  std::string trace() const { return trace_.str(); }

 private:
  // ---- the operations ----------------------------------------------------------------------

  void step() {
    flush_trace();
    const int kind = in_.pick(9);
    if (sets_.empty() || kind == 0) return new_set();
    const auto i = static_cast<std::size_t>(in_.pick(static_cast<int>(sets_.size())));
    Set<T>& s = sets_[i];
    trace_ << "set " << i << ": ";
    switch (kind) {
      case 1:
      case 2:
        return call_set(s, in_.range(0, 12), false);
      case 3:
        return call_set(s, in_.range(1, 12), true);
      case 4:
        return fork_set(s);
      case 5:
        return release_set(s);
      case 6:
        return destroy_set(s);
      case 7:
        return draft_and_rollback(s);
      default:
        return in_.pick(2) == 0 ? reset_set(s) : save_and_load(s);
    }
  }

  vc::KVCacheConfig config() {
    vc::KVCacheConfig c;
    c.method = kPoolMethods[in_.pick(7)];
    const int flags = in_.u8();
    c.set_budget(in_.range(6, 40));  // above every method's 4 sinks
    c.pool_floor_rows = in_.range(0, 7);
    if (c.method == "snapkv") c.snap_obs_window = std::min(c.snap_budget, in_.range(1, 8));
    if ((flags & 1) != 0 && Dk_ == 8 && Dv_ == 8) {  // token groups divide the head dim
      c.key_bits = c.value_bits = 8;
      c.quant_group = 8;
    } else if ((flags & 5) != 0) {  // channel blocks: any head dim
      c.key_bits = (flags & 4) != 0 ? 4 : 8;
      c.key_axis = "channel";
      c.quant_block = 8;
    }
    const bool core = c.method == "h2o" || c.method == "squeeze" || c.method == "pyramidkv";
    if ((flags & 2) != 0 && core) {
      c.head_budgets = "adaptive";
      c.head_budget_floor = 0.25;
    }
    return c;
  }

  void new_set() {
    if (sets_.size() >= kPoolSets) return;
    const vc::KVCacheConfig c = config();
    trace_ << "new " << c.method << " floor " << c.pool_floor_rows << " key_bits " << c.key_bits
           << " " << c.key_axis << (c.head_budgets == "adaptive" ? " adaptive" : "") << "\n";
    const Pool before = pool_now();
    try {
      Set<T> s;
      s.caches = vc::KVCacheBuilder::for_model<T>(layers_, c, *pool_);
      s.attached = true;
      sets_.push_back(std::move(s));
      reach(&PoolStats::sets, c.method + " " + rule_ + (c.key_bits < 16 ? " quantized" : "") +
                                  (c.head_budgets == "adaptive" ? " adaptive" : ""));
    } catch (const std::length_error&) {
      expect(pool_now() == before, "a for_model refused for its floors changed the pool");
      trace_ << "  floors do not fit\n";
      reach(&PoolStats::floors_refused, "refused new set");
    }
  }

  vc::Tensor4<T> tensor(Index S, Index D, bool nan_at_first) {
    vc::Tensor4<T> t(B_, H_, S, D);
    for (Index i = 0; i < t.size(); ++i) {
      t.data()[i] = static_cast<T>(0.25f * static_cast<float>(static_cast<int>(rng_() % 17) - 8));
    }
    if (nan_at_first && t.size() > 0) t.data()[0] = static_cast<T>(std::nanf(""));
    return t;
  }

  /// One engine step: every layer of `s`, S tokens; `bad`: layer `bad_layer`'s keys hold a NaN.
  void call_set(Set<T>& s, Index S, bool bad) {
    const int api = in_.pick(3);
    const int bad_layer = bad ? in_.pick(layers_) : -1;
    trace_ << "call S=" << S << " api " << api << (bad ? " NaN in layer " : "")
           << (bad ? std::to_string(bad_layer) : "") << "\n";
    for (int l = 0; l < layers_; ++l) {
      vc::KVCache<T>& c = *s.caches[static_cast<std::size_t>(l)];
      const bool nan = l == bad_layer;
      flush_trace();
      const vc::Tensor4<T> k = tensor(S, Dk_, nan);
      const vc::Tensor4<T> v = tensor(S, Dv_, false);
      vc::Tensor4<float> q(B_, G_ * H_, S, Dk_);
      for (Index i = 0; i < q.size(); ++i) q.data()[i] = 0.25f * static_cast<float>(rng_() % 9);
      const std::vector<Look> idle = idle_looks(&c);
      const Look mine = look(c);
      const Pool before = pool_now();
      const bool first = c.offset() == 0;  // its floors are claimed now
      try {
        if (api == 0) {
          (void)c.attend(q, k, v);
        } else if (api == 1) {
          (void)c.update_and_view(k, v, q);
        } else {
          (void)c.update_and_view(k, v);
        }
        expect(!nan || S == 0, "a call with a NaN key was accepted");
        reach(&PoolStats::calls, "call");
      } catch (const std::invalid_argument& e) {
        expect(nan && S > 0, std::string("a valid call threw invalid_argument: ") + e.what());
        expect(look(c) == mine, "a refused call changed its cache");
        expect(pool_now().used == before.used, "a refused call changed the pool's bytes");
        reach(&PoolStats::refused_calls, "refused call");
      } catch (const std::length_error& e) {
        expect(s.attached && first, std::string("a call threw length_error after the "
                                                "cache's first call: ") +
                                        e.what());
        expect(look(c) == mine, "a call refused for its floors changed its cache");
        expect(pool_now() == before, "a call refused for its floors changed the pool");
        trace_ << "  floors do not fit at the first call\n";
        reach(&PoolStats::floors_refused, "refused first call");
        return;
      }
      check_floors(idle, &c);
    }
  }

  void fork_set(Set<T>& s) {
    if (sets_.size() >= kPoolSets) return;
    trace_ << "fork\n";
    const Pool before = pool_now();
    const std::vector<Look> idle = idle_looks(nullptr);
    try {
      Set<T> child;
      child.caches = vc::KVCacheBuilder::fork(s.caches);
      child.attached = s.attached;
      expect(child.caches.front()->in_pool() == s.attached, "a fork did not follow its source");
      sets_.push_back(std::move(child));
      reach(&PoolStats::forks, "fork");
    } catch (const std::length_error&) {
      expect(s.attached, "a fork outside the pool threw length_error");
      expect(pool_now() == before, "a fork refused for its floors changed the pool");
      trace_ << "  floors do not fit\n";
      reach(&PoolStats::floors_refused, "refused fork");
      return;
    }
    check_floors(idle, nullptr, sets_.size() - 1);
  }

  void release_set(Set<T>& s) {
    trace_ << "release\n";
    pool_->release(s.caches);
    s.attached = false;
    reach(&PoolStats::releases, "release");
    for (const auto& c : s.caches) expect(!c->in_pool(), "a released cache is still in the pool");
  }

  void destroy_set(Set<T>& s) {
    trace_ << "destroy\n";
    const std::size_t i = static_cast<std::size_t>(&s - sets_.data());
    sets_.erase(sets_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void draft_and_rollback(Set<T>& s) {
    trace_ << "checkpoint\n";
    vc::KVCacheBuilder::checkpoint(s.caches);
    const int drafts = in_.range(1, 3);
    for (int d = 0; d < drafts && !in_.exhausted(); ++d) {
      trace_ << "  draft: ";
      call_set(s, in_.range(1, 4), false);
    }
    trace_ << "rollback\n";
    const std::vector<Look> idle = idle_looks(nullptr);
    vc::KVCacheBuilder::rollback(s.caches);
    reach(&PoolStats::rollbacks, "rollback");
    check_floors(idle, nullptr, std::numeric_limits<std::size_t>::max(), &s);  // s goes back
  }

  void reset_set(Set<T>& s) {
    trace_ << "reset\n";
    vc::KVCacheBuilder::reset(s.caches);
    reach(&PoolStats::resets, "reset");
  }

  void save_and_load(Set<T>& s) {
    if (sets_.size() >= kPoolSets) return;
    trace_ << "save and load\n";
    std::stringstream file;
    vc::save_prompt_cache(file, s.caches);
    const Pool before = pool_now();
    const std::vector<Look> idle = idle_looks(nullptr);
    try {
      vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file, *pool_);
      Set<T> set;
      set.caches = std::move(loaded.caches);
      set.attached = true;
      sets_.push_back(std::move(set));
      reach(&PoolStats::loads, "load");
    } catch (const std::length_error&) {
      expect(pool_now() == before, "a load refused for its floors changed the pool");
      trace_ << "  floors do not fit\n";
      reach(&PoolStats::floors_refused, "refused load");
      return;
    }
    check_floors(idle, nullptr, sets_.size() - 1);
  }

  /// With VELOXQUANT_FUZZ_TRACE set, the trace goes to stderr as the run goes (a crash, which
  /// returns no violation, would lose it).
  void flush_trace() {
    if (!live_trace_) return;
    std::fputs(trace_.str().c_str(), stderr);
    trace_.str("");
  }

  // ---- the checks ---------------------------------------------------------------------------

  struct Pool {
    std::size_t used, floors, sequences;
    bool operator==(const Pool& o) const {
      return used == o.used && floors == o.floors && sequences == o.sequences;
    }
  };
  Pool pool_now() const { return {pool_->used_bytes(), pool_->floor_bytes(), pool_->sequences()}; }

  void expect(bool ok, const std::string& what) const {
    if (!ok) throw PoolViolation{what};
  }
  void reach(std::uint64_t PoolStats::*counter, const std::string& kind) {
    ++(stats_.*counter);
    stats_.reached.insert(kind);
  }

  /// Every head's rows of every attached cache but `except`, in set order.
  std::vector<Look> idle_looks(const vc::KVCache<T>* except) const {
    std::vector<Look> out;
    for (const Set<T>& s : sets_) {
      for (const auto& c : s.caches) {
        out.push_back(s.attached && c.get() != except ? look(*c) : Look{});
      }
    }
    return out;
  }

  /// Every head of the caches in `before` (idle_looks) holds at least min(its rows before, its
  /// floor) now, on the same head, unless the cache was reset since (it holds none before).
  /// Sets from `first_new` on are new, and `moved` went back to a checkpoint: not compared.
  void check_floors(const std::vector<Look>& before, const vc::KVCache<T>* except,
                    std::size_t first_new = std::numeric_limits<std::size_t>::max(),
                    const Set<T>* moved = nullptr) {
    std::size_t i = 0;
    bool took = false;
    for (std::size_t si = 0; si < sets_.size() && si < first_new; ++si) {
      for (const auto& c : sets_[si].caches) {
        if (i >= before.size()) return;
        const Look& was = before[i++];
        if (!sets_[si].attached || c.get() == except || &sets_[si] == moved) continue;
        const Look now = look(*c);
        if (now.positions.size() != was.positions.size()) continue;  // not started before
        for (std::size_t h = 0; h < was.positions.size(); ++h) {
          const auto keep = std::min<std::size_t>(was.positions[h].size(),
                                                  static_cast<std::size_t>(c->pool_floor()));
          expect(now.positions[h].size() >= keep, "a head went below min(its rows, its floor): " +
                                                      std::to_string(now.positions[h].size()) +
                                                      " < " + std::to_string(keep));
          took = took || now.positions[h].size() < was.positions[h].size();
        }
      }
    }
    if (took) reach(&PoolStats::takes, "take " + rule_);
  }

  void check_pool() const {
    std::size_t used = 0, sequences = 0;
    for (const Set<T>& s : sets_) {
      for (const auto& c : s.caches) {
        expect(c->in_pool() == s.attached, "a cache's attachment differs from its set's");
        if (s.attached) used += c->kept_bytes();
      }
      sequences += s.attached ? 1 : 0;
    }
    const Pool p = pool_now();
    trace_ << "  pool: used " << p.used << " floors " << p.floors << " sets " << p.sequences
           << " of cap " << pool_->max_bytes() << "\n";
    expect(p.used <= pool_->max_bytes(), "used_bytes() above the cap");
    expect(p.floors <= pool_->max_bytes(), "floor_bytes() above the cap");
    expect(p.used == used, "used_bytes() " + std::to_string(p.used) +
                               " is not the attached caches' kept_bytes() " + std::to_string(used));
    expect(p.sequences == sequences, "sequences() is not the attached sets");
  }

  PoolBytes& in_;
  PoolStats& stats_;
  std::minstd_rand rng_;
  std::string rule_;
  const bool live_trace_ = std::getenv("VELOXQUANT_FUZZ_TRACE") != nullptr;
  int layers_ = 1;
  Index B_ = 1, H_ = 1, Dk_ = 1, Dv_ = 1, G_ = 1;
  mutable std::ostringstream trace_;
  std::unique_ptr<vc::MemoryPool> pool_;  // destroyed after the sets (declared before them)
  std::vector<Set<T>> sets_;
};

}  // namespace pool_detail

/// Runs one input of target `pool`; returns "" or the violation with the run's operations.
inline std::string run_pool(const std::uint8_t* data, std::size_t size,
                            PoolStats* stats = nullptr) {
  PoolStats own;
  PoolStats& st = stats != nullptr ? *stats : own;
  ++st.runs;
  pool_detail::PoolBytes in(data, size);
  const int type = in.pick(3);
  const auto go = [&](auto tag) -> std::string {
    pool_detail::PoolHarness<decltype(tag)> h(in, st);
    try {
      h.run();
    } catch (const pool_detail::PoolViolation& v) {
      return v.what + "\n" + h.trace();
    } catch (const std::exception& e) {
      return std::string("unexpected exception: ") + e.what() + "\n" + h.trace();
    }
    return {};
  };
  if (type == 1) return go(Eigen::half{});
  if (type == 2) return go(Eigen::bfloat16{});
  return go(float{});
}

/// The seed corpus of target `pool` (fuzz/corpus_pool/): random inputs of a fixed generator,
/// each kept when it reaches a kind no earlier one reached (PoolStats::reached), at most `n`.
/// Regenerated by `fuzz_cache` with VELOXQUANT_FUZZ_WRITE_POOL_SEEDS=<dir>.
inline std::vector<std::vector<std::uint8_t>> make_pool_seeds(std::size_t n = 40) {
  std::vector<std::vector<std::uint8_t>> out;
  std::mt19937 rng(2026u);
  PoolStats all;
  for (int i = 0; i < 20000 && out.size() < n; ++i) {
    std::vector<std::uint8_t> d(64 + rng() % 320);
    for (auto& b : d) b = static_cast<std::uint8_t>(rng());
    PoolStats one;
    if (!run_pool(d.data(), d.size(), &one).empty()) continue;
    const std::size_t before = all.reached.size();
    all.reached.insert(one.reached.begin(), one.reached.end());
    if (all.reached.size() > before) out.push_back(std::move(d));
  }
  return out;
}

}  // namespace veloxquant::fuzz
