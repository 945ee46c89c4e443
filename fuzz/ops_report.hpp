// fuzz target `ops` (fuzz/fuzz_ops.hpp): failure reporting — the violation that unwinds a run,
// the operation trace it carries, the run's counters, and the formatting helpers of messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops_input.hpp"

namespace veloxquant::fuzz::detail {

/// A violated check: unwinds the run (never derived from std::exception, so no catch of the
/// library's exceptions can swallow it).
struct Violation {
  std::string what;
};

template <class T>
double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}

template <class T>
std::string type_name() {
  if (std::is_same_v<T, float>) return "float";
  if (std::is_same_v<T, Eigen::half>) return "half";
  return "bfloat16";
}

template <class V>
std::string fmt_vec(const std::vector<V>& v, std::size_t max_items = 64) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < v.size() && i < max_items; ++i) os << (i ? " " : "") << v[i];
  if (v.size() > max_items) os << " ...";
  os << ']';
  return os.str();
}

/// Owns the trace of the run's operations (its tail goes into every violation, after the run's
/// description) and the number of the current operation; counts into the options' Stats.
class Reporter {
 public:
  /// `describe`: the run's configuration, for violation messages.
  Reporter(const Options& opt, std::function<std::string()> describe)
      : opt_(opt), describe_(std::move(describe)) {}

  [[noreturn]] void fail(const std::string& what) const {
    std::ostringstream os;
    os << what << "\n  run: " << describe_() << "\n  ops:\n" << trace_;
    throw Violation{os.str()};
  }
  void expect(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  void log(const std::string& line) {
    if (opt_.trace) std::fprintf(stderr, "[fuzz] %s\n", line.c_str());
    trace_ += "    #" + std::to_string(op) + " " + line + "\n";
    // Keep the tail only (the message names the last operations).
    if (trace_.size() > 6000) trace_.erase(0, trace_.find('\n', trace_.size() - 5000) + 1);
  }
  /// Adds n to one counter of the options' Stats (if any).
  void count(std::uint64_t Stats::*counter, std::uint64_t n = 1) const {
    if (opt_.stats) opt_.stats->*counter += n;
  }
  Stats* stats() const { return opt_.stats; }

  int op = -1;  ///< the current operation (-1: construction)

 private:
  const Options& opt_;
  std::function<std::string()> describe_;
  std::string trace_;
};

}  // namespace veloxquant::fuzz::detail
