// Every policy at every SIMD path this CPU runs (docs/design.md 7.2), through the public API: the
// same call sequence keeps the same rows at every path, with scores within float32 rounding of
// each other; the scalar path is bitwise equal to the AVX2 and NEON paths. (The oracle tests run at
// the best path; this ties the other paths to it.) KVzip's observe and compress (SPEC 18), which
// no call sequence reaches, are held to the same rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

/// KVzip at the active path: scores after observe (without and with the re-read's keys) and the
/// positions a compress keeps, every head of two layers, as bytes.
template <class T>
std::vector<std::string> kvzip_run() {
  std::mt19937 rng(77u);
  vc::KVCacheConfig c;
  c.method = "kvzip";
  auto set = vc::KVCacheBuilder::for_model<T>(2, c);
  constexpr Index B = 2, H = 2, G = 3, S = 70, D = 20;  // D: vector tails on every path
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto draw = [&](Index b, Index h, Index s, Index d) {
    vc::Tensor4<float> t(b, h, s, d);
    for (Index i = 0; i < t.size(); ++i) t.data()[i] = u(rng);
    return t;
  };
  std::vector<std::string> out;
  const auto record = [&](const auto& cache, bool scores) {
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        std::string bytes;
        const std::vector<std::int64_t> p = cache.positions(b, h);
        bytes.append(reinterpret_cast<const char*>(p.data()), p.size() * sizeof(std::int64_t));
        if (scores) {
          const std::vector<float> sc = cache.scores(b, h);
          bytes.append(reinterpret_cast<const char*>(sc.data()), sc.size() * sizeof(float));
        }
        out.push_back(bytes);
      }
    }
  };
  for (auto& cache : set) {
    (void)cache->update_and_view(draw(B, H, S, D), draw(B, H, S, D));
    cache->observe(draw(B, G * H, 50, D));
    record(*cache, true);
    cache->observe(draw(B, G * H, 33, D), draw(B, H, 33, D));
    record(*cache, true);
  }
  vc::KVCacheBuilder::compress(set, 0.3);
  for (auto& cache : set) record(*cache, false);
  return out;
}

/// KVzip's observe and compress keep the same rows at every path, their scores within float32
/// rounding of the best path's (checked through the kept positions, which the scores decide), and
/// the paths with the scalar bits give them bit for bit.
TYPED_TEST(SimdLevelsTest, KVzipObserveAndCompressAgreeAcrossPaths) {
  using T = TypeParam;
  const vc::SimdLevel saved = vc::simd_level();
  vc::set_simd_level(vc::SimdLevel::scalar);
  const std::vector<std::string> scalar = kvzip_run<T>();
  for (const vc::SimdLevel l : kAllLevels) {
    if (!vc::simd_level_supported(l) || l == vc::SimdLevel::scalar) continue;
    vc::set_simd_level(l);
    const std::vector<std::string> other = kvzip_run<T>();
    ASSERT_EQ(other.size(), scalar.size());
    if (same_bits_as_scalar(l)) {
      EXPECT_TRUE(other == scalar) << vc::simd_level_name(l) << " differs from scalar";
    } else {
      // The positions the compress kept: the last record of each of the 2 x B x H heads.
      for (std::size_t i = other.size() - 8; i < other.size(); ++i) {
        EXPECT_TRUE(other[i] == scalar[i]) << vc::simd_level_name(l) << ": other rows kept";
      }
    }
  }
  vc::set_simd_level(saved);
}

}  // namespace
