// veloxquant — one memory cap over many sequences (SPEC 19, docs/design.md 10.5): the accounting
// and the arbitration behind MemoryPool. Caches attach as seats (PoolClient: what the pool may
// ask of a cache); every call on a seat begins and ends under the pool's lock, and the end of a
// call that leaves the pool above its cap takes rows from the seats no call is running on, the
// caller included, down to their floors.
//
// The arbitration rule, fair shares: every seat's heads are limited to the same number of rows
// L, the largest for which the pool fits its cap (a water-fill: seats holding less than L keep
// what they hold, and a head never goes below its floor). A seat above L is re-budgeted to L by
// its own policy's ranking (PoolClient::pool_trim). Why this rule and not a ranking of rows
// across sequences: docs/design.md 10.5.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "scratch.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// What a trim of a seat may need of the pool's scratch: a head's slots, its heads, its padded
/// head dim (KeyDiff's ranking converts key rows).
struct PoolNeed {
  Index rows = 0, heads = 0, dim = 0;
};

/// What the pool reads of a seat's rows (under the pool's lock, while no call runs on it).
struct PoolRows {
  Index heads = 0;             ///< B·H (0 before the first call)
  Index max_rows = 0;          ///< the most rows a head holds
  Index total_rows = 0;        ///< rows over all heads
  Index floor = 0;             ///< rows per head the pool never takes a head below
  std::size_t row_bytes = 0;   ///< bytes one row's slot takes
  std::size_t bytes = 0;       ///< kept_bytes() now
};

/// What an attach or a first call throws when its floors do not fit beside the pool's others: a
/// std::length_error (SPEC 19) the C ABI tells from others (VQ_ENOROOM).
class FloorsDoNotFit : public std::length_error {
 public:
  using std::length_error::length_error;
};

/// How the pool chooses the rows that go (docs/design.md 10.5, where the measurement is).
enum class PoolRule : std::uint8_t {
  fair_share,  ///< every head limited to the same rows, each cache ranking its own (the default)
  scores,      ///< the rows of lowest score across caches, each score over its head's mean
};

/// A row the scores rule may take: its score over its head's mean, its position, where it is.
struct PoolRow {
  float rank;
  std::uint32_t seat;
  std::int32_t head;
  std::int32_t slot;
  std::int64_t pos;
};

/// What the pool may ask of an attached cache. Called under the pool's lock only, on a cache no
/// call or set operation is running on (or on the caller, at the end of its own call).
class PoolClient {
 public:
  virtual PoolRows pool_rows() const noexcept = 0;
  /// Brings every head within max(rows, its floor) rows by the policy's own re-budget ranking;
  /// `sc` is the pool's scratch, sized by the bound the seat gave at its last begin.
  virtual void pool_trim(Index rows, Scratch& sc) noexcept = 0;
  /// The scores rule: appends every row a head may give up (above its floor, not a sink, not
  /// among its protected newest), ranked by its score over the head's mean; `out` has the room.
  virtual void pool_candidates(std::uint32_t seat, std::vector<PoolRow>& out) const noexcept = 0;
  /// The scores rule: evicts `n` rows of this cache, ascending by head then slot (head -1: a row
  /// of every head, pool_candidates_layer), on the pool's scratch.
  virtual void pool_drop(const PoolRow* rows, std::size_t n, Scratch& sc) noexcept = 0;

 protected:
  PoolClient() = default;
  PoolClient(const PoolClient&) = default;
  PoolClient& operator=(const PoolClient&) = default;
  ~PoolClient() = default;
};

/// The pool itself: shared by the MemoryPool handle and every seat attached to it, so either may
/// outlive the other.
class PoolCore {
 public:
  explicit PoolCore(std::size_t max_bytes, PoolRule rule = PoolRule::fair_share)
      : max_(max_bytes), rule_(rule) {}
  PoolRule rule() const { return rule_; }

  std::size_t max_bytes() const { return max_; }
  std::size_t used_bytes() const {
    std::lock_guard<std::recursive_mutex> lock(m_);
    return used_;
  }
  std::size_t floor_bytes() const {
    std::lock_guard<std::recursive_mutex> lock(m_);
    return floors_;
  }
  /// Attached sets (sequences) with at least one seat.
  std::size_t sequences() const {
    std::lock_guard<std::recursive_mutex> lock(m_);
    std::size_t n = 0;
    for (std::size_t i = 0; i < seats_.size(); ++i) {
      bool first = true;
      for (std::size_t j = 0; j < i && first; ++j) first = seats_[j].set != seats_[i].set;
      n += first ? 1 : 0;
    }
    return n;
  }
  /// The pool's lock: while it is held, no call on another thread begins or ends and no
  /// arbitration runs (MemoryPool::hold).
  std::unique_lock<std::recursive_mutex> lock() const { return std::unique_lock(m_); }
  /// A fresh set id (one per for_model, fork or load).
  std::uint64_t new_set() {
    std::lock_guard<std::recursive_mutex> lock(m_);
    return ++next_set_;
  }

  /// One seat of an attach: the cache, the floor bytes it claims now (0 while its shape is
  /// unknown: it claims them at its first call), and a bound on the rows a head may hold at its
  /// next trim (sizes the pool's scratch).
  struct Join {
    PoolClient* client;
    std::size_t floor_bytes;
    std::size_t provisional;  ///< what it claims while its shape is unknown (after a reset)
    PoolNeed need;
  };
  /// Attaches a set's seats, all or none: throws std::length_error, attaching nothing, when their
  /// floors do not fit beside the floors already claimed; may throw std::bad_alloc. Then takes
  /// rows, if the set brought more than fits, from every seat no call runs on.
  void attach(std::uint64_t set, const std::vector<Join>& joins, const char* api) {
    std::lock_guard<std::recursive_mutex> lock(m_);
    std::size_t claim = 0;
    for (const Join& j : joins) claim += j.floor_bytes;
    check_floor_fits(claim, api);
    seats_.reserve(seats_.size() + joins.size());
    rows_.reserve(seats_.size() + joins.size());
    std::size_t rows = candidate_room();
    for (const Join& j : joins) rows += static_cast<std::size_t>(j.need.rows * j.need.heads);
    if (rule_ == PoolRule::scores) candidates_.reserve(rows);
    for (const Join& j : joins) fit_scratch(j.need);
    for (const Join& j : joins) {
      const PoolRows r = j.client->pool_rows();
      seats_.push_back(Seat{j.client, set, r, j.floor_bytes, j.provisional, 0,
                            static_cast<std::size_t>(j.need.rows * j.need.heads)});
      used_ += r.bytes;
      floors_ += j.floor_bytes;
    }
    arbitrate(nullptr);
  }
  /// Detaches a seat (its bytes and floor return to the pool); nothing if it is not attached.
  void detach(const PoolClient* c) noexcept {
    std::lock_guard<std::recursive_mutex> lock(m_);
    const auto it = find(c);
    if (it == seats_.end()) return;
    used_ -= it->rows.bytes;
    floors_ -= it->floor;
    seats_.erase(it);
  }

  /// A call or set operation begins on seat `c`: no arbitration touches it until end(c).
  /// `claim`: the floor bytes its first call claims (0: none); throws std::length_error when
  /// they do not fit, and std::bad_alloc; then the seat is as it was. `need`: what a trim of it
  /// may need when it ends (sizes the scratch).
  void begin(const PoolClient* c, std::size_t claim, const PoolNeed& need, const char* api) {
    std::lock_guard<std::recursive_mutex> lock(m_);
    const auto it = find(c);
    if (it == seats_.end()) return;
    if (claim > it->floor) check_floor_fits(claim - it->floor, api);
    fit_scratch(need);
    if (rule_ == PoolRule::scores) {
      // Room for every row of every seat as candidates.
      const auto rows = static_cast<std::size_t>(need.rows * need.heads);
      candidates_.reserve(candidate_room() - it->room + std::max(rows, it->room));
      it->room = std::max(rows, it->room);
    }
    if (claim > it->floor) {
      floors_ += claim - it->floor;
      it->floor = claim;
    }
    ++it->busy;
  }
  /// The call on `c` has ended: its bytes are counted again, and if the pool is above its cap,
  /// rows go (arbitrate). `shape_unknown`: the seat has no shape (reset, or its first call
  /// failed): it claims the lower bound it attached with until its next first call. `failed`:
  /// the call threw, so it changed nothing of its cache and the arbitration takes no row of it.
  void end(const PoolClient* c, bool shape_unknown = false, bool failed = false) noexcept {
    std::lock_guard<std::recursive_mutex> lock(m_);
    const auto it = find(c);
    if (it == seats_.end()) return;
    if (shape_unknown) {
      floors_ = floors_ - it->floor + it->provisional;
      it->floor = it->provisional;
    }
    recount(*it);
    if (failed) {
      arbitrate(nullptr);  // while the seat still counts as busy
      if (it->busy > 0) --it->busy;
      return;
    }
    if (it->busy > 0) --it->busy;
    arbitrate(c);
  }

 private:
  struct Seat {
    PoolClient* client;
    std::uint64_t set;
    PoolRows rows;            ///< its rows and bytes at its last end (or attach, or trim)
    std::size_t floor;        ///< floor bytes claimed
    std::size_t provisional;  ///< what it claims while its shape is unknown
    int busy;           ///< calls and set operations running on it
    std::size_t room;  ///< the most rows it may hold over all its heads (sizes candidates_)
  };
  std::size_t candidate_room() const {
    std::size_t n = 0;
    for (const Seat& s : seats_) n += s.room;
    return n;
  }

  std::vector<Seat>::iterator find(const PoolClient* c) {
    return std::find_if(seats_.begin(), seats_.end(), [c](const Seat& s) { return s.client == c; });
  }
  void check_floor_fits(std::size_t more, const char* api) const {
    if (floors_ + more > max_) {
      throw FloorsDoNotFit(std::string(api) + ": the pool's floors would need " +
                              std::to_string(floors_ + more) + " bytes (" +
                              std::to_string(floors_) + " claimed, " + std::to_string(more) +
                              " more), above its cap of " + std::to_string(max_) +
                              " bytes; nothing was attached or changed (queue the request, or "
                              "lower pool_floor_rows)");
    }
  }
  // The scratch only grows (a high-water mark of every seat's need): a trim never allocates.
  void fit_scratch(const PoolNeed& need) {
    const Index rows = std::max<Index>(need.rows, 1);
    need_.rows = std::max(need_.rows, rows);
    need_.heads = std::max(need_.heads, need.heads);
    need_.dim = std::max(need_.dim, need.dim);
    ScratchSize z;
    z.rows = 2;  // KeyDiff's ranking: a key row and its unit vector
    z.columns = need_.rows;
    z.dim = need_.dim;
    z.pooled = need_.rows * std::max<Index>(need_.heads, 1);
    if (z.columns != fitted_.columns || z.dim != fitted_.dim || z.pooled != fitted_.pooled) {
      scratch_.fit(z);
      fitted_ = z;
    }
  }
  void recount(Seat& s) noexcept {
    const PoolRows now = s.client->pool_rows();
    used_ = used_ - s.rows.bytes + now.bytes;
    s.rows = now;
  }

  // What a seat would hold with its heads limited to max(L, floor) rows (a linear estimate: the
  // trims then measure what they freed).
  static std::size_t estimate(const PoolRows& r, Index L) {
    const Index keep = std::max(L, r.floor) * r.heads;
    if (r.total_rows <= keep) return r.bytes;
    const std::size_t freed = static_cast<std::size_t>(r.total_rows - keep) * r.row_bytes;
    return freed >= r.bytes ? 0 : r.bytes - freed;
  }

  /// Fair shares (the file's head): while the pool is above its cap, the largest limit L under
  /// which the seats no call runs on (and the caller) fit beside the busy ones, then a trim of
  /// every one above it; repeated with a lower L while the trims freed less than estimated.
  /// The scores rule goes first under that rule, in rounds while its candidates free bytes;
  /// what they cannot free (its rounds ran out of candidates: what is left is the heads' newest
  /// protected rows, or bytes a channel block's table holds beyond its rows) goes by fair shares.
  void arbitrate(const PoolClient* caller) noexcept {
    if (used_ <= max_) return;
    if (rule_ == PoolRule::scores) {
      for (int round = 0; round < 64 && used_ > max_; ++round) {
        if (!scores_round(caller)) break;
      }
      if (max_ >= used_) return;  // the ranks sufficed
    }
    rows_.clear();
    std::size_t fixed = 0;
    Index hi = 0;
    for (Seat& s : seats_) {
      if (s.busy > 0 && s.client != caller) {
        fixed += s.rows.bytes;
        continue;
      }
      rows_.push_back(s.rows);
      hi = std::max(hi, s.rows.max_rows);
    }
    if (fixed >= max_) return;  // only the busy seats' own ends can help
    const std::size_t room = max_ - fixed;
    const auto fits = [&](Index L) {
      std::size_t sum = 0;
      for (const PoolRows& r : rows_) sum += estimate(r, L);
      return sum <= room;
    };
    for (int round = 0; round < 64 && used_ > max_ && hi > 0; ++round) {
      // The largest L in [0, hi) whose estimate fits (0 if none: every head to its floor). In
      // steady decoding it is the last one (a call's new row went over it): two passes decide.
      Index L = 0;
      if (limit_ < hi && fits(limit_) && (limit_ + 1 >= hi || !fits(limit_ + 1))) {
        L = limit_;
      } else {
        Index a = 0, b = hi - 1;
        while (a <= b) {
          const Index mid = a + (b - a) / 2;
          if (fits(mid)) {
            L = mid;
            a = mid + 1;
          } else {
            b = mid - 1;
          }
        }
      }
      limit_ = L;
      std::size_t k = 0;
      for (Seat& s : seats_) {
        if (s.busy > 0 && s.client != caller) continue;
        PoolRows& r = rows_[k++];
        if (r.max_rows > std::max(L, r.floor) || r.total_rows > std::max(L, r.floor) * r.heads) {
          s.client->pool_trim(L, scratch_);
          recount(s);
          r = s.rows;
        }
      }
      hi = L;  // the next round, if any, goes lower
    }
  }

  /// A round of the scores rule: the lowest-ranked candidates of every seat no call runs on (and
  /// the caller's) go, fewest first, until by their rows' bytes the pool is back under its cap
  /// with a margin of a 64th of it (each round reads every candidate, so it frees enough for
  /// many calls). Returns whether it freed bytes (a row of a channel block may free none).
  bool scores_round(const PoolClient* caller) noexcept {
    const std::size_t was = used_;
    candidates_.clear();
    rows_.clear();
    for (std::size_t i = 0; i < seats_.size(); ++i) {
      const Seat& s = seats_[i];
      rows_.push_back(s.rows);
      if (s.busy > 0 && s.client != caller) continue;
      if (candidates_.capacity() - candidates_.size() <
          static_cast<std::size_t>(rows_.back().total_rows)) {
        continue;  // (never: the room is reserved at every begin)
      }
      s.client->pool_candidates(static_cast<std::uint32_t>(i), candidates_);
    }
    std::sort(candidates_.begin(), candidates_.end(), [](const PoolRow& a, const PoolRow& b) {
      if (a.rank != b.rank) return a.rank < b.rank;
      if (a.pos != b.pos) return a.pos < b.pos;
      return a.seat < b.seat;
    });
    const std::size_t target = max_ - std::min(max_, max_ / 64);
    std::size_t freed = 0, need = used_ - std::min(used_, target), n = 0;
    for (; n < candidates_.size() && freed < need; ++n) {
      const PoolRows& r = rows_[candidates_[n].seat];
      freed += r.row_bytes * static_cast<std::size_t>(candidates_[n].head < 0 ? r.heads : 1);
    }
    std::sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(n),
              [](const PoolRow& a, const PoolRow& b) {
                if (a.seat != b.seat) return a.seat < b.seat;
                if (a.head != b.head) return a.head < b.head;
                return a.slot < b.slot;
              });
    for (std::size_t i = 0; i < n;) {
      std::size_t j = i;
      while (j < n && candidates_[j].seat == candidates_[i].seat) ++j;
      Seat& s = seats_[candidates_[i].seat];
      s.client->pool_drop(candidates_.data() + i, j - i, scratch_);
      recount(s);
      i = j;
    }
    return used_ < was;
  }

  // Recursive: a thread holding the pool (MemoryPool::hold) may still call its own caches, and
  // destroy or release them.
  mutable std::recursive_mutex m_;
  const std::size_t max_;
  Index limit_ = 0;  ///< the fair share's last limit (where the next search starts)
  const PoolRule rule_;
  std::vector<PoolRow> candidates_;
  std::size_t used_ = 0, floors_ = 0;
  std::uint64_t next_set_ = 0;
  std::vector<Seat> seats_;
  std::vector<PoolRows> rows_;  // arbitrate's, reserved by fit
  Scratch scratch_;
  PoolNeed need_;
  ScratchSize fitted_;
};

}  // namespace veloxquant::cache::detail
