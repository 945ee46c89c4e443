// veloxquant — the tasks a call hands to the engine's parallel-for, checked (docs/robustness.md,
// "The engine's thread pool"). The pool is the engine's code: it may throw, skip a task, run one
// twice, pass an index out of range, or return while a task still runs. The ledger makes each of
// these harmless to memory and visible to the call: every task index is claimed once (a second
// claim, or one outside [0, tasks), does nothing and is recorded), and close() — after the pool
// returned or threw — claims the tasks that never started, so that none can start later, and
// waits for the ones still running. The ledger is shared with the task function handed to the
// pool, so a copy of that function called after the call has ended finds it closed and does
// nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

namespace veloxquant::cache::detail {

class TaskLedger {
 public:
  explicit TaskLedger(int tasks)
      : tasks_(tasks), state_(new std::atomic<std::uint8_t>[static_cast<std::size_t>(tasks)]) {
    for (int t = 0; t < tasks; ++t) at(t).store(kFree, std::memory_order_relaxed);
  }

  /// The work of task t while the call lasts: body(t), body outliving every run() until close().
  template <class Body>
  void bind(Body& body) {
    ctx_ = &body;
    fn_ = [](void* ctx, int t) { (*static_cast<Body*>(ctx))(t); };
  }
  /// What the pool calls: the bound work for task t, if claim(t) lets it run.
  void run(int t) {
    if (!claim(t)) return;
    fn_(ctx_, t);
    finish(t);
  }

  /// True when the caller may run task t now (it is in range, not yet started, not closed);
  /// otherwise the misuse is recorded and the caller must do nothing.
  bool claim(int t) {
    if (t < 0 || t >= tasks_) {
      out_of_range_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    std::uint8_t expected = kFree;
    if (at(t).compare_exchange_strong(expected, kRunning, std::memory_order_acquire)) {
      return true;
    }
    if (expected != kClosed) repeated_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  /// Task t (claimed) has finished.
  void finish(int t) { at(t).store(kDone, std::memory_order_release); }

  /// After the pool returned or threw: the tasks that never started can no longer start; waits
  /// for the ones still running. Returns the number that never ran.
  int close() {
    int skipped = 0;
    for (int t = 0; t < tasks_; ++t) {
      for (;;) {
        std::uint8_t s = kFree;
        if (at(t).compare_exchange_strong(s, kClosed, std::memory_order_acquire)) {
          ++skipped;
          break;
        }
        if (s != kRunning) break;
        std::this_thread::yield();
      }
    }
    skipped_ = skipped;
    return skipped;
  }
  /// True when the pool misused the tasks (call after close()); allocates nothing.
  bool misused() const {
    return skipped_ != 0 || repeated_.load() != 0 || out_of_range_.load() != 0;
  }
  /// The misuse seen ("" when none; call after close()): tasks skipped, repeated, out of range.
  std::string misuse() const {
    std::ostringstream os;
    const auto add = [&](int n, const char* what) {
      if (n == 0) return;
      if (os.tellp() > 0) os << ", ";
      os << n << ' ' << what;
    };
    add(skipped_, skipped_ == 1 ? "task never run" : "tasks never run");
    add(repeated_.load(), "repeated task runs");
    add(out_of_range_.load(), "task indices out of range");
    return os.str();
  }

 private:
  enum : std::uint8_t { kFree = 0, kRunning = 1, kDone = 2, kClosed = 3 };
  std::atomic<std::uint8_t>& at(int t) { return state_[static_cast<std::size_t>(t)]; }
  int tasks_;
  void* ctx_ = nullptr;
  void (*fn_)(void*, int) = nullptr;
  std::unique_ptr<std::atomic<std::uint8_t>[]> state_;
  std::atomic<int> repeated_{0};
  std::atomic<int> out_of_range_{0};
  int skipped_ = 0;
};

}  // namespace veloxquant::cache::detail
