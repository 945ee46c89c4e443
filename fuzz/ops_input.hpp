// fuzz target `ops` (fuzz/fuzz_ops.hpp): the run's options and counters, the reader of the input
// bytes, and the generator of tensor data (docs in fuzz_ops.hpp: "What the bytes choose", "Data").
#pragma once

// clang-format off
#include "support/checked_asserts.hpp"  // must precede every veloxquant header
// clang-format on

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>
#include <veloxquant/cache.hpp>

#include "ops_kinds.hpp"
#include "reference/oracle.hpp"
#include "reference/policy_oracles.hpp"
#include "support/subjects.hpp"

namespace veloxquant::fuzz {

/// Operations per input, tokens per call.
inline constexpr int kMaxOps = 48;
inline constexpr int kMaxS = 40;

/// Counters of one or more runs (for the replay test and for tuning the corpus).
struct Stats {
  std::uint64_t runs = 0, invalid_configs = 0, calls = 0, rejected = 0, resets = 0, trims = 0;
  std::uint64_t tokens = 0, decisions = 0, ambiguous = 0, excused = 0, query_calls = 0;
  std::uint64_t reloads = 0, forks = 0, rollbacks = 0;
  std::uint64_t method_runs[detail::kRunCount] = {};  ///< runs of each of detail::kRunMethods
  /// Adaptive head budgets (SPEC 14): runs, calls that left the heads ragged, fetches refused on
  /// ragged heads, pooled evictions the oracle decided.
  std::uint64_t adaptive_runs = 0, ragged_calls = 0, ragged_refusals = 0, pool_decisions = 0;
};

struct Options {
  bool trace = false;      ///< print every operation to stderr
  Stats* stats = nullptr;  ///< accumulate counters here
};

namespace detail {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
namespace vt = veloxquant::test;
using Index = Eigen::Index;
using Positions = std::vector<std::int64_t>;
using Rows = std::vector<std::vector<double>>;

/// Reads the input; past its end every byte is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : std::uint8_t{0}; }
  /// 0 .. n-1
  int pick(int n) { return static_cast<int>(u8()) % n; }
  /// lo .. hi inclusive
  int range(int lo, int hi) { return lo + pick(hi - lo + 1); }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    return v;
  }
  bool exhausted() const { return pos_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// One of `xs`, chosen by one byte.
inline double pick_from(Bytes& in, std::initializer_list<double> xs) {
  const int i = in.pick(static_cast<int>(xs.size()));
  return *(xs.begin() + i);
}

/// Small deterministic generator for tensor data (xorshift64 seeded through splitmix64).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    std::uint64_t z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    s_ = (z ^ (z >> 31)) | 1u;
  }
  std::uint64_t next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t s_;
};

/// How the rows of a tensor are drawn. Every entry is a multiple of 0.25 in [-2, 2].
enum class DataMode { Uniform, Ternary, Sparse, Palette, Constant, kCount };

/// Entries of "one-hot" sequences: logits that differ at all differ by at least
/// 64 * 64 / sqrt(8) > 1448, so every softmax weight is exactly 0 or exactly 1/m (m tied maxima)
/// in float32 and in double alike (exp underflows below -745 in double, -87 in the library), and
/// exact score ties between different rows are common on every scored path.
inline constexpr double kOneHotLevel = 64.0;

inline double draw_level(Rng& rng, DataMode mode, bool one_hot = false) {
  if (one_hot) {
    if (mode == DataMode::Sparse)
      return rng.below(4) == 0 ? kOneHotLevel * (rng.below(2) ? 1 : -1) : 0.0;
    return kOneHotLevel * static_cast<double>(rng.below(3) - 1);
  }
  switch (mode) {
    case DataMode::Ternary:
      return static_cast<double>(rng.below(3) - 1);
    case DataMode::Sparse:
      return rng.below(4) == 0 ? 0.25 * static_cast<double>(rng.below(17) - 8) : 0.0;
    default:
      return 0.25 * static_cast<double>(rng.below(17) - 8);
  }
}

/// Fills t ([B, H, S, D], double) row by row. Palette/Constant rows repeat rows of `palette`
/// ([P][D], P >= 1), so identical keys recur within and across calls.
inline void fill(vc::Tensor4<double>& t, Rng& rng, DataMode mode, const Rows& palette,
                 bool one_hot = false) {
  const Index D = t.dimension(3);
  const Index rows = D == 0 ? 0 : t.size() / D;
  for (Index r = 0; r < rows; ++r) {
    double* row = t.data() + r * D;
    if ((mode == DataMode::Palette || mode == DataMode::Constant) && !palette.empty() &&
        static_cast<Index>(palette.front().size()) == D) {
      const std::size_t p =
          mode == DataMode::Constant
              ? 0
              : static_cast<std::size_t>(rng.below(static_cast<int>(palette.size())));
      for (Index d = 0; d < D; ++d) row[d] = palette[p][static_cast<std::size_t>(d)];
    } else {
      for (Index d = 0; d < D; ++d) row[d] = draw_level(rng, mode, one_hot);
    }
  }
}

}  // namespace detail
}  // namespace veloxquant::fuzz
