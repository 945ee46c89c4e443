// fuzz target `ops` (fuzz/fuzz_ops.hpp): the tolerances of the comparison with the double
// oracles, and the near-tie rule that alone excuses a difference from them.
//
// Tolerance for float32 scoring against the double oracle (the only excused difference):
//   The library scores in float32, the oracle in double. When the oracle takes an eviction decision
//   (one H2O token, one H2O once-per-call eviction, a re-budget trim, one TOVA token, the SnapKV
//   compression), the harness records whether the decision was *ambiguous*: some evicted
//   candidate and some kept candidate have oracle scores that differ, but by at most kTieRelTol
//   (1e-4) of the larger one, or by at most kTieAbsFloor (1e-42) in absolute terms (decayed
//   scores: float32 holds nothing below 1.4e-45 and spaces its subnormals 1.4e-45 apart, so a
//   decay of 0.25 per token takes 0.4 to 0 in float32 in about 74 tokens while double keeps
//   2e-47; the library's rounding there stays below 0.7e-45 / (1 - decay) <= 3.5e-44 for the
//   decays drawn), or are equal by coincidence (below). A retained-set or score mismatch in a head
//   is excused only if that head had an ambiguous decision in the same call; the head is then
//   marked diverged and its positions and scores are no longer compared with the oracle until the
//   next reset (the count, sink, recent-window and content checks continue). A tie that is
//   exact by construction is never ambiguous: both scores exactly 0 (rows that never received
//   attention); for TOVA and SnapKV, bitwise-identical keys (identical columns of the same
//   softmaxes); for TOVA scored by one softmax row (no queries, or G = 1), every exact tie (equal
//   weights <=> equal logits, and the logits of this data are exact in float32). The library must
//   break those exactly as docs/design.md says (earliest evicted; in a re-budget the later position
//   survives). Other equal doubles are different computations that happen to round alike (sums such
//   as 9/15 + 1/2 + 1/2 and 9/15 + 1/4 + 1/4 + 1/4 + 1/4), which float32 may split, so they count
//   as near-ties. Scores that agree to 1e-4 are 100x wider than float32 accumulation error on this
//   data (ordinary logits are bounded by 2*2*8/sqrt(8) < 12, so no weight underflows; one-hot
//   weights are exact), so a real scoring or tie-breaking bug still shows, as does a mismatch in a
//   call with no near-tie. (Measured on ~130k fuzzed decisions: 1.3% were near-ties, most of them
//   differences of 1e-16..1e-8 between quantities that are equal in exact arithmetic.) With mixed
//   query mode the H2O-core and TOVA oracles (one scoring rule per sequence) are not consulted;
//   SnapKV keeps both oracles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <vector>

namespace veloxquant::fuzz {

/// Relative gap below which two different oracle scores at an eviction boundary are a near-tie.
inline constexpr double kTieRelTol = 1e-4;
/// Absolute gap below which two oracle scores are a near-tie: about 700 of float32's smallest
/// subnormal (1.4e-45), 30x the library's accumulated rounding of a decayed subnormal score.
inline constexpr double kTieAbsFloor = 1e-42;
/// Library score vs oracle score: absolute or relative tolerance.
inline constexpr double kScoreAbsTol = 1e-6;
inline constexpr double kScoreRelTol = 1e-4;
/// The oracle ranks KeyDiff's candidates by -(u . m) (|u|, |m| <= 1; the library divides by
/// |m| + 1e-8, which changes no order): the library's error in it is absolute, float32 products
/// (about D * 6e-8) and the fixed-point mean (n * 2^-33 per component) (docs/design.md 4.7). The
/// tie floor of its decisions.
inline constexpr double kKeyDiffAbsTol = 1e-5;
/// concentration() vs the Gram-matrix reference.
inline constexpr double kConcentrationTol = 1e-9;

namespace detail {

/// A candidate row of one eviction decision: its oracle score and position.
struct Candidate {
  double score;
  std::int64_t position;
};

/// Whether the rows at two positions hold bitwise-identical keys (nullptr: unknown).
using SameKey = std::function<bool(std::int64_t, std::int64_t)>;

/// True when the decision could legitimately go the other way in float32: some evicted candidate
/// and some kept candidate have oracle scores within kTieRelTol of each other, or within
/// kTieAbsFloor (decayed scores that float32 rounds to a subnormal or to 0). Ties that are exact
/// by construction are not ambiguous (the tie rules decide them, in the library too): both scores
/// exactly 0 (rows that never received attention); when `same_key` is given (candidates scored
/// by columns of the same softmaxes: TOVA, SnapKV), bitwise-identical keys; with
/// `all_exact_ties_decided` (one softmax row: TOVA without queries or with G = 1, whose weights
/// are equal exactly when the logits are, and logits of this data are exact), every exact tie.
/// Any other pair of equal doubles is two different computations that happen to round alike
/// (e.g. 9/15 + 2 * 1/2 and 9/15 + 4 * 1/4), which float32 may split either way: a near-tie.
/// `abs_floor` widens kTieAbsFloor for scores whose float32 error is absolute (KeyDiff's cosines,
/// for which a tie at 0 is no exact state either).
inline bool near_tie(const std::vector<Candidate>& cands, const std::set<std::int64_t>& evicted,
                     const SameKey& same_key = nullptr, bool all_exact_ties_decided = false,
                     double abs_floor = kTieAbsFloor) {
  for (const Candidate& e : cands) {
    if (!evicted.count(e.position)) continue;
    for (const Candidate& c : cands) {
      if (evicted.count(c.position)) continue;
      if (c.score == e.score) {
        // (Zero is exact for attention mass, never given; not for KeyDiff's cosines, whose
        // float32 values near an exact 0 may be +-1e-9: abs_floor above kTieAbsFloor.)
        if ((e.score == 0.0 && abs_floor <= kTieAbsFloor) || all_exact_ties_decided) continue;
        if (same_key && same_key(e.position, c.position)) continue;
        return true;
      }
      const double scale = std::max(std::fabs(c.score), std::fabs(e.score));
      const double gap = std::fabs(c.score - e.score);
      // Close relative to their size; or so close in absolute terms that float32 holds them as
      // subnormals or 0 (a decay of 0.25 per token takes 0.4 to 2e-47 in about 77 tokens, 0 in
      // float32), so it may order them either way or tie them at 0.
      if (gap <= kTieRelTol * scale || gap <= std::max(kTieAbsFloor, abs_floor)) return true;
    }
  }
  return false;
}

/// The positions of `all` that are not in `kept`.
inline std::set<std::int64_t> minus(const std::vector<std::int64_t>& all,
                                    const std::vector<std::int64_t>& kept) {
  std::set<std::int64_t> out(all.begin(), all.end());
  for (const std::int64_t p : kept) out.erase(p);
  return out;
}

}  // namespace detail
}  // namespace veloxquant::fuzz
