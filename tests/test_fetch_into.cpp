// update_and_fetch_into gives exactly update_and_fetch's result and reuses the caller's tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include <veloxquant/cache.hpp>

#include "support/test_support.hpp"

namespace vc = veloxquant::cache;
using Eigen::Index;
using veloxquant::test::random_float_tensor;

namespace {

template <class T>
void expect_same(const vc::Tensor4<T>& a, const vc::Tensor4<T>& b) {
  ASSERT_EQ(a.dimensions(), b.dimensions());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(T) * static_cast<std::size_t>(a.size())));
}

TEST(FetchIntoTest, MatchesFetchAndReusesStorageInSteadyState) {
  vc::KVCacheConfig cfg;
  cfg.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  cfg.method = "h2o";
  cfg.h2o_budget = 16;
  vc::H2OCache<Eigen::half> fetched(cfg);
  vc::H2OCache<Eigen::half> into(cfg);
  std::mt19937 rng(3);
  vc::KVPair<Eigen::half> out;
  const Eigen::half* steady_data = nullptr;
  for (int call = 0; call < 60; ++call) {
    const Index s = call == 0 ? 40 : (call == 7 ? 5 : 1);
    const vc::Tensor4<Eigen::half> k = random_float_tensor(2, 3, s, 8, rng).cast<Eigen::half>();
    const vc::Tensor4<Eigen::half> v = random_float_tensor(2, 3, s, 6, rng).cast<Eigen::half>();
    const auto expected = fetched.update_and_fetch(k, v);
    into.update_and_fetch_into(k, v, out);
    expect_same(expected.first, out.first);
    expect_same(expected.second, out.second);
    if (call == 20) steady_data = out.first.data();
    // Every decode step returns budget + 1 rows: the tensors keep their storage.
    if (call > 20) {
      EXPECT_EQ(steady_data, out.first.data()) << "call " << call;
    }
  }
  // An empty call returns the retained set, like update_and_fetch.
  const vc::Tensor4<Eigen::half> k0(2, 3, 0, 8), v0(2, 3, 0, 6);
  into.update_and_fetch_into(k0, v0, out);
  expect_same(into.state().first, out.first);
  EXPECT_EQ(out.first.dimension(2), 16);
}

TEST(FetchIntoTest, BadInputThrowsNamingTheApiAndLeavesOutputAlone) {
  vc::KVCache<float> cache;
  std::mt19937 rng(4);
  vc::KVPair<float> out;
  cache.update_and_fetch_into(random_float_tensor(1, 2, 3, 4, rng),
                              random_float_tensor(1, 2, 3, 4, rng), out);
  const vc::Tensor4<float> before = out.first;
  try {
    cache.update_and_fetch_into(random_float_tensor(1, 2, 3, 4, rng),
                                random_float_tensor(1, 2, 2, 4, rng), out);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("update_and_fetch_into"), std::string::npos) << e.what();
  }
  expect_same(before, out.first);
  EXPECT_EQ(cache.offset(), 3);
}

}  // namespace

namespace {

// A call that adopts a budget (and re-budgets at its start) returns the same rows through the view
// as through fetch: the rows retained before the call, then the call's rows.
TEST(FetchIntoTest, ViewAndFetchAgreeOnTheCallThatAdoptsABudget) {
  vc::KVCacheConfig cfg;
  cfg.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  cfg.squeeze_budget = 12;
  cfg.squeeze_n_sink = 2;
  cfg.squeeze_defer = true;  // layer 0 keeps its whole prompt until the budget is known
  auto fetched = vc::KVCacheBuilder::for_model<float>(2, cfg);
  auto viewed = vc::KVCacheBuilder::for_model<float>(2, cfg);
  std::mt19937 rng(9);
  const auto k0 = random_float_tensor(1, 2, 40, 8, rng), v0 = random_float_tensor(1, 2, 40, 8, rng);
  const auto k1 = random_float_tensor(1, 2, 40, 8, rng), v1 = random_float_tensor(1, 2, 40, 8, rng);
  for (auto* model : {&fetched, &viewed}) {
    (*model)[0]->update_and_fetch(k0, v0);  // not final yet: deferred, keeps 40 rows
    (*model)[1]->update_and_fetch(k1, v1);  // completes the coordinator
    ASSERT_EQ((*model)[0]->tokens_kept(), 40);
  }
  const auto kd = random_float_tensor(1, 2, 1, 8, rng), vd = random_float_tensor(1, 2, 1, 8, rng);
  const auto out = fetched[0]->update_and_fetch(kd, vd);
  const auto view = viewed[0]->update_and_view(kd, vd);
  ASSERT_EQ(out.first.dimension(2), 41);  // 40 retained before the call + the token
  ASSERT_EQ(view.rows(), 41);
  for (Index h = 0; h < 2; ++h) {
    // The view's rows sorted by position are the fetched rows.
    std::vector<std::pair<std::int64_t, Index>> order;
    for (Index r = 0; r < view.rows(); ++r) order.emplace_back(view.positions(0, h)[r], r);
    std::sort(order.begin(), order.end());
    for (Index i = 0; i < 41; ++i) {
      EXPECT_EQ(order[static_cast<std::size_t>(i)].first, i) << "head " << h;
      for (Index d = 0; d < 8; ++d) {
        EXPECT_EQ(view.keys(0, h)(order[static_cast<std::size_t>(i)].second, d),
                  out.first(0, h, i, d));
      }
    }
  }
  // After the call both hold the adopted budget.
  auto* sq = dynamic_cast<vc::SqueezeAttentionCache<float>*>(fetched[0].get());
  ASSERT_NE(sq, nullptr);
  EXPECT_TRUE(sq->budget_adopted());
  EXPECT_EQ(fetched[0]->tokens_kept(), sq->layer_budget());
  EXPECT_EQ(viewed[0]->tokens_kept(), sq->layer_budget());
}

}  // namespace
