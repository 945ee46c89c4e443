// veloxquant — MemoryPool: one byte cap over many sequences' caches (SPEC 19, docs/design.md
// 10.5). A set attaches through KVCacheBuilder::for_model(..., pool), fork(..., pool) (a fork of
// an attached set joins its pool by itself) or load_prompt_cache(..., pool), and leaves when its
// caches are destroyed or by release(). Above the cap, the pool takes rows from the attached
// caches instead of refusing or preempting a sequence (detail/pool_core.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "detail/pool_core.hpp"
#include "kv_cache.hpp"

namespace veloxquant::cache {

/// A byte cap over every cache attached to it. After every call on an attached cache,
/// used_bytes() (the sum of their kept_bytes()) is at most max_bytes(): during a call it may be
/// above by that call's new rows; when the call ends, rows go by the pool's arbitration (fair
/// shares: every head limited to the same number of rows, the most that fits; each cache gives
/// rows up by its own policy's ranking, docs/design.md 10.5), never below a head's floor
/// (KVCacheConfig::pool_floor_rows plus its sinks), and never a whole sequence. Thread-safe:
/// calls on different sets from different threads may run while the pool arbitrates. The pool
/// and its caches may be destroyed in any order.
class MemoryPool {
 public:
  /// A pool of `max_bytes` bytes.
  explicit MemoryPool(std::size_t max_bytes) : MemoryPool(max_bytes, Rule::fair_share) {}
  /// The arbitration rules: fair_share (the default, docs/design.md 10.5: measured the better on
  /// stories260K) and scores (the rows of lowest score across caches, each score over its head's
  /// mean), kept for engines that want to measure their own model.
  using Rule = detail::PoolRule;
  MemoryPool(std::size_t max_bytes, Rule rule)
      : core_(std::make_shared<detail::PoolCore>(max_bytes, rule)) {}
  Rule rule() const { return core_->rule(); }
  // One pool, one object: a copy would look like a second cap over the same caches.
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  std::size_t max_bytes() const { return core_->max_bytes(); }
  /// The sum of kept_bytes() of every attached cache, as counted at the end of its last call.
  std::size_t used_bytes() const { return core_->used_bytes(); }
  /// The bytes the attached caches' floors claim (a set from for_model claims its heads' floors
  /// at each layer's first call, when its shape is known).
  std::size_t floor_bytes() const { return core_->floor_bytes(); }
  /// Attached sets (one per for_model, fork or load that attached).
  std::size_t sequences() const { return core_->sequences(); }

  /// A hold on the pool (hold()): movable, released when destroyed, which must happen on the
  /// thread that took it (it holds the pool's mutex). Not assignable: an assignment would release
  /// the old core before its lock.
  class Hold {
   public:
    Hold(Hold&&) noexcept = default;
    Hold& operator=(Hold&&) = delete;

   private:
    friend class MemoryPool;
    explicit Hold(std::shared_ptr<detail::PoolCore> core)
        : core_(std::move(core)), lock_(core_->lock()) {}
    std::shared_ptr<detail::PoolCore> core_;  // declared first: outlives the lock
    std::unique_lock<std::recursive_mutex> lock_;
  };
  /// Holds the pool until the returned Hold is destroyed: meanwhile no call on another thread
  /// begins or ends on an attached cache (such calls wait), so the pool takes no rows and the
  /// accessors of attached caches no call is running on may be read safely from this thread
  /// (docs/design.md 10.5, threads). The holding thread may go on calling, forking, releasing and
  /// destroying its own sets. Hold briefly: every other thread's calls on attached caches wait.
  [[nodiscard]] Hold hold() const { return Hold(core_); }

  /// Detaches every cache of `caches` (their bytes and floors return to the pool; the caches keep
  /// their rows and work on, unlimited). Null entries and caches of no pool are skipped.
  template <class T>
  void release(std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    for (auto& c : caches) {
      if (c && c->pool_core() == core_) c->leave_pool();
    }
  }

  /// Attaches the set `caches` (KVCacheBuilder's and load_prompt_cache's pooled overloads call
  /// this): its evicting caches join, a model's standard layers stay outside. Throws
  /// std::invalid_argument for a null entry, a cache already in a pool, or a set with no
  /// evicting cache (a standard cache cannot join), std::length_error when the set's floors do
  /// not fit beside those the pool's sets claim; then nothing is attached or changed. Above the
  /// cap after the attach, rows go as after a call.
  template <class T>
  void attach(std::vector<std::unique_ptr<KVCache<T>>>& caches, const char* api) {
    attach_to(core_, caches, api);
  }

  /// attach into the pool `core` (a fork joins its source's pool through this).
  template <class T>
  static void attach_to(const std::shared_ptr<detail::PoolCore>& core,
                        std::vector<std::unique_ptr<KVCache<T>>>& caches, const char* api) {
    std::vector<detail::PoolCore::Join> joins;
    std::vector<KVCache<T>*> seated;
    for (std::size_t i = 0; i < caches.size(); ++i) {
      KVCache<T>* c = caches[i].get();
      if (!c) throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                          " is null");
      if (c->in_pool()) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                    " is attached to a memory pool already");
      }
      if (std::find(seated.begin(), seated.end(), c) != seated.end()) continue;
      if (c->is_trimmable() && !all_standard(caches)) continue;  // a non-attention layer
      joins.push_back(c->pool_join(api));
      seated.push_back(c);
    }
    if (joins.empty()) return;
    // Seated before the pool knows them: from the attach on, another thread's arbitration may
    // trim them, and a trim reads what seat_in_pool writes.
    for (KVCache<T>* c : seated) c->seat_in_pool(core);
    try {
      core->attach(core->new_set(), joins, api);
    } catch (...) {
      for (KVCache<T>* c : seated) c->leave_pool();  // (not attached: only unseats)
      throw;
    }
  }

  /// The pool's shared state (what attached caches hold).
  const std::shared_ptr<detail::PoolCore>& core() const { return core_; }

 private:
  // Standard caches (a model's non-attention layers, or the standard method) never evict.
  template <class T>
  static bool all_standard(const std::vector<std::unique_ptr<KVCache<T>>>& caches) {
    for (const auto& c : caches) {
      if (c && !c->is_trimmable()) return false;
    }
    return true;
  }

  std::shared_ptr<detail::PoolCore> core_;
};

}  // namespace veloxquant::cache
