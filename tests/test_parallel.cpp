// Heads spread over the engine's parallel-for give bit-identical results to a serial run
// (docs/design.md 7.3), and the blocked prefill path agrees with token-by-token calls.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <veloxquant/cache.hpp>

#include "support/test_support.hpp"

namespace vc = veloxquant::cache;
using Eigen::Index;
using veloxquant::test::random_float_tensor;
using veloxquant::test::bitwise_equal;

namespace {

template <class T>
std::unique_ptr<vc::KVCache<T>> make_cache(const std::string& method) {
  vc::KVCacheConfig cfg;
  cfg.method = method;
  cfg.h2o_budget = 96;
  cfg.squeeze_budget = 96;
  cfg.pyramid_budget = 96;
  if (method == "h2o") return std::make_unique<vc::H2OCache<T>>(cfg);
  if (method == "pyramidkv") return std::make_unique<vc::PyramidKVCache<T>>(cfg);
  return std::make_unique<vc::SqueezeAttentionCache<T>>(cfg);
}

template <class T>
class ParallelHeadsTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float>;
TYPED_TEST_SUITE(ParallelHeadsTest, StorageTypes);

TYPED_TEST(ParallelHeadsTest, ParallelRunIsBitIdenticalToSerialRun) {
  using T = TypeParam;
  for (const std::string method : {"h2o", "pyramidkv", "squeeze"}) {
    auto serial = make_cache<T>(method);
    auto parallel = make_cache<T>(method);
    serial->set_parallel_heads(false);
    veloxquant::test::enable_parallel_heads(*parallel);
    std::mt19937 rng(42);
    // Big enough that the parallel path is taken (B*H = 16 heads, 400-token prefill, D = 64).
    std::vector<Index> calls = {400, 1, 1, 7, 1, 130, 1};
    for (int i = 0; i < 40; ++i) calls.push_back(1);
    for (const Index s : calls) {
      const auto k = random_float_tensor(2, 8, s, 64, rng);
      const auto v = random_float_tensor(2, 8, s, 64, rng);
      const auto a = serial->update_and_fetch(k, v);
      const auto b = parallel->update_and_fetch(k, v);
      ASSERT_TRUE(bitwise_equal(a.first, b.first)) << method << " S=" << s;
      ASSERT_TRUE(bitwise_equal(a.second, b.second)) << method << " S=" << s;
      for (Index bb = 0; bb < 2; ++bb) {
        for (Index h = 0; h < 8; ++h) {
          const std::vector<float> scores = veloxquant::test::policy_scores(*serial, bb, h);
          ASSERT_EQ(scores.size(), 96u) << method;
          ASSERT_EQ(scores, veloxquant::test::policy_scores(*parallel, bb, h)) << method;
          ASSERT_EQ(veloxquant::test::policy_positions(*serial, bb, h),
                    veloxquant::test::policy_positions(*parallel, bb, h))
              << method;
        }
      }
    }
    EXPECT_EQ(serial->tokens_kept(), 96);
  }
}

TYPED_TEST(ParallelHeadsTest, BlockedPrefillMatchesTokenByTokenCalls) {
  using T = TypeParam;
  // The blocked path (one call of S tokens) and the decode path (S calls of one token) implement
  // the same per-token semantics; with the budget known from the start they retain the same rows.
  vc::KVCacheConfig cfg;
  cfg.method = "h2o";
  cfg.h2o_budget = 40;
  vc::H2OCache<T> blocked(cfg);
  vc::H2OCache<T> stepped(cfg);
  std::mt19937 rng(7);
  const auto k = random_float_tensor(1, 4, 300, 32, rng);
  const auto v = random_float_tensor(1, 4, 300, 32, rng);
  blocked.update_and_fetch(k, v);
  for (Index s = 0; s < 300; ++s) {
    const Eigen::array<Index, 4> off{0, 0, s, 0};
    const Eigen::array<Index, 4> ext{1, 4, 1, 32};
    const vc::Tensor4<float> ks = k.slice(off, ext);
    const vc::Tensor4<float> vs = v.slice(off, ext);
    stepped.update_and_fetch(ks, vs);
  }
  for (Index h = 0; h < 4; ++h) {
    EXPECT_EQ(blocked.positions(0, h), stepped.positions(0, h)) << "head " << h;
    const auto sa = blocked.scores(0, h);
    const auto sb = stepped.scores(0, h);
    ASSERT_EQ(sa.size(), sb.size());
    for (std::size_t i = 0; i < sa.size(); ++i) EXPECT_NEAR(sa[i], sb[i], 1e-4f * (1.0f + sb[i]));
  }
}

}  // namespace
