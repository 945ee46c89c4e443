// Every policy at every SIMD path this CPU runs (docs/design.md 7.2), through the public API: the
// same call sequence keeps the same rows at every path, with scores within float32 rounding of
// each other; the scalar path is bitwise equal to the AVX2 and NEON paths. (The oracle tests run at
// the best path; this ties the other paths to it.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/simd_levels.hpp"
#include "support/storage_types.hpp"
#include "support/subjects.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;

/// What one run leaves: every call's return and the snapshot after it.
template <class T>
struct Run {
  std::vector<Returned> returns;
  std::vector<Snapshot> states;
};

/// One fixed sequence (a 70-token prefill across kernel blocks, decode, multi-token calls, an
/// empty call) on a fresh subject at the active path.
template <class T>
Run<T> run_sequence(Kind kind, Api api) {
  Subject<T> s = make_subject<T>(kind);
  std::mt19937 rng(900u + kind_index(kind));
  Run<T> out;
  const Shape k{2, 2, 0, 20}, v{2, 2, 0, 12};
  for (const Index S : {Index{70}, Index{1}, Index{1}, Index{3}, Index{1}, Index{0}, Index{9},
                        Index{1}, Index{1}, Index{1}}) {
    const Call call = random_call(rng, with_s(k, S), with_s(v, S));
    vc::KVPair<T> into;
    out.returns.push_back(invoke(*s.cache, api, call, into));
    Snapshot snap = snapshot(s);
    snap.heap = 0;
    out.states.push_back(snap);
  }
  return out;
}

/// Same retained positions, scores within 1e-5 relative (rounding of the other path).
std::string compare_loosely(const Snapshot& a, const Snapshot& b) {
  if (a.positions != b.positions) return "retained positions differ";
  if (a.scores.size() != b.scores.size()) return "score counts differ";
  for (std::size_t h = 0; h < a.scores.size(); ++h) {
    if (a.scores[h].size() != b.scores[h].size()) return "score counts differ";
    for (std::size_t i = 0; i < a.scores[h].size(); i += sizeof(float)) {
      float x, y;
      std::memcpy(&x, a.scores[h].data() + i, sizeof(float));
      std::memcpy(&y, b.scores[h].data() + i, sizeof(float));
      if (std::fabs(x - y) > 1e-5f * std::max(1.0f, std::fabs(x))) {
        return "score " + std::to_string(x) + " vs " + std::to_string(y);
      }
    }
  }
  if (a.budget != b.budget || a.layer_budget != b.layer_budget || a.compressed != b.compressed) {
    return "budgets differ";
  }
  return "";
}

template <class T>
class SimdLevelsTest : public ::testing::Test {};
TYPED_TEST_SUITE(SimdLevelsTest, StorageTypes);

TYPED_TEST(SimdLevelsTest, EveryPathKeepsTheSameRowsAsTheBestPath) {
  using T = TypeParam;
  const vc::SimdLevel saved = vc::simd_level();
  for (const Kind kind : kKinds) {
    for (const Api api : {Api::kFetch, Api::kViewQ, Api::kFetchIntoQ}) {
      const std::string ctx = std::string(kind_name(kind)) + ", " + api_name(api);
      vc::set_simd_level(vc::best_simd_level());
      const Run<T> best = run_sequence<T>(kind, api);
      std::vector<std::pair<vc::SimdLevel, Run<T>>> runs;  // the paths with the scalar bits
      for (const vc::SimdLevel l : kAllLevels) {
        if (!vc::simd_level_supported(l)) continue;
        vc::set_simd_level(l);
        const Run<T> r = run_sequence<T>(kind, api);
        for (std::size_t c = 0; c < r.states.size(); ++c) {
          EXPECT_EQ(compare_loosely(best.states[c], r.states[c]), "")
              << ctx << " at " << vc::simd_level_name(l) << ", call " << c;
        }
        if (same_bits_as_scalar(l)) runs.emplace_back(l, r);
      }
      ASSERT_EQ(runs.front().first, vc::SimdLevel::scalar);
      for (std::size_t i = 1; i < runs.size(); ++i) {
        const Run<T>& scalar = runs.front().second;
        const Run<T>& other = runs[i].second;
        for (std::size_t c = 0; c < scalar.states.size(); ++c) {
          EXPECT_TRUE(scalar.returns[c] == other.returns[c])
              << ctx << ", call " << c << ": " << vc::simd_level_name(runs[i].first);
          EXPECT_TRUE(scalar.states[c] == other.states[c])
              << ctx << ": scalar and " << vc::simd_level_name(runs[i].first)
              << " differ after call " << c;
        }
      }
    }
  }
  vc::set_simd_level(saved);
}

}  // namespace
