// veloxquant — one call at a time on one cache (docs/robustness.md, "The engine's thread pool").
// A cache is not thread-safe, and nothing forces an engine to respect that: a work-stealing pool
// that runs other queued jobs while it waits inside the cache's parallel-for, or two threads
// driving the same layer, would start a second call while the first still writes the heads. The
// gate turns that into an error of the second call, which has then changed nothing, instead of
// two calls writing the same rows.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

namespace veloxquant::cache::detail {

class CallGate {
 public:
  /// The running call's hold on the gate, released when it ends (normally or by an exception).
  class Entry {
   public:
    explicit Entry(std::atomic<bool>& busy) : busy_(&busy) {}
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    /// Moves the hold (a set's operation holds every cache's gate at once).
    Entry(Entry&& o) noexcept : busy_(o.busy_) { o.busy_ = nullptr; }
    Entry& operator=(Entry&&) = delete;
    ~Entry() {
      if (busy_) busy_->store(false, std::memory_order_release);
    }

   private:
    std::atomic<bool>* busy_;
  };

  /// Marks a call of `api` as running; throws std::logic_error when another one already is.
  [[nodiscard]] Entry enter(const char* api) {
    if (busy_.exchange(true, std::memory_order_acquire)) {
      throw std::logic_error(std::string(api) +
                             ": called while another call on this cache is running (from another "
                             "thread, or from inside the engine's parallel-for); a cache takes "
                             "one call at a time, and this call changed nothing");
    }
    return Entry(busy_);
  }

 private:
  std::atomic<bool> busy_{false};
};

}  // namespace veloxquant::cache::detail
