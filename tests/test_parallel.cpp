// Heads spread over the engine's parallel-for give bit-identical results to a serial run
// (docs/design.md 7.3), tested once for the whole library: every policy (the subjects of
// support/subjects.hpp) x every entry point (update_and_fetch, update_and_view,
// update_and_fetch_into, each with and without queries, and attend) x half and float storage, and
// quantized rows; and the blocked prefill path agrees with token-by-token calls. (A parallel-for
// that misbehaves is bad input: test_bad_inputs.cpp.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/storage_types.hpp"
#include "support/subjects.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

/// The entry points a call can take: the update APIs of subjects.hpp, or attend.
struct EntryPoint {
  const char* name;
  std::optional<Api> api;  // none: attend
};

const EntryPoint kEntryPoints[] = {
    {"update_and_fetch", Api::kFetch},
    {"update_and_view", Api::kView},
    {"update_and_fetch_into", Api::kFetchInto},
    {"update_and_fetch(queries)", Api::kFetchQ},
    {"update_and_view(queries)", Api::kViewQ},
    {"update_and_fetch_into(queries)", Api::kFetchIntoQ},
    {"attend", std::nullopt},
};

/// Budgets of 96 rows with 4 sinks (StreamingLLM: 4 + a window of 92; SnapKV: 64, obs_window 32;
/// the plain and coordinated squeeze subjects keep the 6 of their own configuration and coordinator): wide enough that a decode step
/// over the retained rows of B * H = 16 heads of D = 64 takes the parallel path
/// (kv_cache.hpp, kParallelWork). `key_bits` < 16: quantized rows in groups of 32 (the
/// in-register path of every kernel).
vc::KVCacheConfig wide_config(int key_bits, int value_bits) {
  vc::KVCacheConfig c = small_config();
  c.key_bits = key_bits;
  c.value_bits = value_bits;
  c.quant_group = 32;
  set_n_sinks(c, 4);
  c.set_budget(96);
  c.h2o_grace = 4;
  c.snap_budget = 64;
  c.snap_obs_window = 32;
  return c;
}

/// One call through `entry` on `s`: what it returned, comparable bitwise. k: [B, H, S, Dk],
/// v: [B, H, S, Dv], q: [B, G * H, S, Dk].
template <class T>
Returned call(Subject<T>& s, const EntryPoint& entry, const vc::Tensor4<T>& k,
              const vc::Tensor4<T>& v, const vc::Tensor4<float>& q, vc::KVPair<T>& into) {
  if (!entry.api) {
    const vc::Tensor4<float> out = s.cache->attend(q, k, v);
    Returned r;
    r.keys.resize(static_cast<std::size_t>(out.size()) * sizeof(float));
    if (!r.keys.empty()) std::memcpy(r.keys.data(), out.data(), r.keys.size());
    r.key_shape = shape_of(out);
    return r;
  }
  const bool queries = *entry.api == Api::kFetchQ || *entry.api == Api::kViewQ ||
                       *entry.api == Api::kFetchIntoQ;
  return queries ? invoke_with(*s.cache, *entry.api, k, v, q, into)
                 : invoke_without_queries(*s.cache, *entry.api, k, v, into);
}

/// Every policy, a serial cache and one whose heads run on 4 threads, fed the same calls, each
/// through the next entry point in turn (every entry point takes decode steps on every policy,
/// and the prefill rotates among them from policy to policy): a 150-token prefill (blocked paths
/// over the budget; SnapKV compresses it), decode steps, calls of 7 and 70 tokens; then reset()
/// and a 120-token prompt with decode steps. After every call the returns (attend: the output)
/// and everything observable but the heap agree bitwise. Not vacuous: the bounded policies hold
/// their budgets, and TOVA's heads decide differently.
template <class T>
void parallel_equals_serial(int key_bits, int value_bits) {
  const vc::KVCacheConfig config = wide_config(key_bits, value_bits);
  const Index B = 2, H = 8, G = 2, D = 64, Dv = 64;
  const std::vector<std::vector<Index>> rounds = {{150, 1, 1, 1, 1, 1, 1, 7, 1, 70, 1, 1, 1, 1},
                                                  {120, 1, 1}};
  const std::size_t n_entries = std::size(kEntryPoints);
  for (const Kind kind : kKinds) {
    Subject<T> serial = make_subject<T>(kind, config);
    Subject<T> parallel = make_subject<T>(kind, config);
    serial.cache->set_parallel_heads(false);
    enable_parallel_heads(*parallel.cache);
    ASSERT_TRUE(parallel.cache->parallel_heads());
    std::mt19937 rng(42u + kind_index(kind));
    vc::KVPair<T> into_a, into_b;
    std::size_t c = kind_index(kind);
    for (std::size_t round = 0; round < rounds.size(); ++round) {
      if (round > 0) {
        for (Subject<T>* s : {&serial, &parallel}) {
          if (s->coordinator) s->coordinator->reset();
          s->cache->reset();
        }
      }
      for (const Index S : rounds[round]) {
        const EntryPoint& entry = kEntryPoints[c++ % n_entries];
        const std::string ctx = std::string(kind_name(kind)) + ", " + entry.name + ", round " +
                                std::to_string(round) + ", S = " + std::to_string(S);
        const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
        const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, Dv);
        const vc::Tensor4<float> q = random_queries(rng, B, G * H, S, D);
        const Returned a = call(serial, entry, k, v, q, into_a);
        const Returned b = call(parallel, entry, k, v, q, into_b);
        ASSERT_TRUE(a == b) << ctx << ": returns differ";
        ASSERT_TRUE(logical_state(serial) == logical_state(parallel)) << ctx << ": state differs";
      }
      if (round == 0) {
        std::int64_t kept = 96;
        if (keeps_every_row(kind.method)) kept = 238;
        if (kind == Method::squeeze || kind == Kind::kSqueezeCoordinated) kept = 6;
        // SnapKV: the 70-token chunk cut it to 64; 4 decode steps.
        if (kind == Method::snapkv) kept = 64 + 4;
        EXPECT_EQ(serial.cache->tokens_kept(), kept) << kind_name(kind);
        if (kind == Method::tova) {
          EXPECT_NE(policy_positions(*serial.cache, 0, 0), policy_positions(*serial.cache, 1, 7))
              << "the heads decided alike";
        }
      }
    }
  }
}

TEST(ParallelHeadsTest, HalfIsBitIdenticalToSerialOnEveryPolicyAndEntryPoint) {
  parallel_equals_serial<Eigen::half>(16, 16);
}

TEST(ParallelHeadsTest, FloatIsBitIdenticalToSerialOnEveryPolicyAndEntryPoint) {
  parallel_equals_serial<float>(16, 16);
}

TEST(ParallelHeadsTest, QuantizedRowsAreBitIdenticalToSerialOnEveryPolicyAndEntryPoint) {
  parallel_equals_serial<Eigen::half>(8, 4);
}

template <class T>
class BlockedPrefillTest : public ::testing::Test {};
TYPED_TEST_SUITE(BlockedPrefillTest, StorageTypes);

TYPED_TEST(BlockedPrefillTest, BlockedPrefillMatchesTokenByTokenCalls) {
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
