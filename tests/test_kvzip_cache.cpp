// KVzipCache<T> and KVCacheBuilder::compress (SPEC 18, docs/design.md 6.1) against double-
// precision references written here: observe's scores (the most any observed query row gives a
// row in its softmax over the head's rows) over every storage type, quantized rows among them; the
// compress's selection (sinks, rows not yet observed, per-head floors, one threshold over the set)
// recomputed from the scores the cache showed; attention over the rows a compress kept; the rows
// that come after; refusals that change nothing; fork, checkpoint and rollback, prompt caches,
// parallel heads. The calls themselves (a kvzip cache keeps every row) run in the sweeps over
// every method (the contract suite, attend, bad inputs, parallel heads, prompt caches).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/oracle.hpp"
#include "support/prompt_cache_format.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;  // the double-precision attention weights (oracle.hpp)
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)
using Index = Eigen::Index;
template <class T>
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

vc::KVCacheConfig kvzip_config(int n_sink = 2, double floor = 0.2) {
  vc::KVCacheConfig c;
  c.method = "kvzip";
  c.kvzip_n_sink = n_sink;
  c.head_budget_floor = floor;
  return c;
}

/// Head (b, h)'s retained keys as the cache holds them (quantized rows dequantized), ascending
/// position.
template <class T>
Rows held_keys(vc::KVCache<T>& c, Index b, Index h) {
  const vc::KVPair<T> st = c.state();
  return rows_of(st.first, b, h);
}

/// The rows every head of `c` holds and their scores: a cache's observable state for "changes
/// nothing".
template <class T>
std::string snapshot(const vc::KVCache<T>& c) {
  std::ostringstream os;
  os << c.offset() << '/' << c.kept_bytes() << '/' << c.tokens_seen() << ':';
  for (Index b = 0; b < c.batch(); ++b) {
    for (Index h = 0; h < c.heads(); ++h) {
      for (const auto p : c.positions(b, h)) os << p << ',';
      os << '|';
      for (const float s : c.scores(b, h)) os << s << ',';
      os << ';';
    }
  }
  return os.str();
}
template <class T>
std::vector<std::string> snapshot(const Caches<T>& set) {
  std::vector<std::string> out;
  for (const auto& c : set) out.push_back(snapshot(*c));
  return out;
}

/// A set of `layers` kvzip caches, each fed the same-shaped prompt of S rows (its own draws), and
/// the prompts' keys and values (double) per layer.
template <class T>
struct PromptSet {
  Caches<T> caches;
  std::vector<vc::Tensor4<double>> keys, values;
};
template <class T>
PromptSet<T> prompt_set(const vc::KVCacheConfig& config, int layers, Index B, Index H, Index S,
                        Index D, std::mt19937& rng) {
  PromptSet<T> p;
  p.caches = vc::KVCacheBuilder::for_model<T>(layers, config);
  for (int l = 0; l < layers; ++l) {
    p.keys.push_back(random_doubles(rng, B, H, S, D));
    p.values.push_back(random_doubles(rng, B, H, S, D));
    (void)p.caches[static_cast<std::size_t>(l)]->update_and_view(p.keys.back(), p.values.back());
  }
  return p;
}

/// Expects f to throw std::invalid_argument whose message holds `part`.
template <class F>
void expect_refused(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no exception; wanted: " << part;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// observe
// ---------------------------------------------------------------------------------------------

template <class T>
class KVzipObserve : public ::testing::Test {};
TYPED_TEST_SUITE(KVzipObserve, StorageTypes);

/// Every row's score is the most any observed query row of its group gives it in its softmax over
/// the head's rows (three blocks of queries, two observe calls: the most over both), for rows of
/// T, 8-bit token-axis rows and 4-bit channel-axis keys.
TYPED_TEST(KVzipObserve, ScoresAreTheMostAnyObservedQueryGives) {
  using T = TypeParam;
  constexpr Index B = 2, H = 2, G = 3, S = 40, D = 16;
  for (const int variant : {0, 1, 2}) {
    SCOPED_TRACE(variant);
    vc::KVCacheConfig config = kvzip_config();
    if (variant == 1) {
      config.key_bits = config.value_bits = 8;
      config.quant_group = 8;
    } else if (variant == 2) {
      config.key_bits = 4;
      config.key_axis = "channel";
      config.quant_block = 16;
    }
    std::mt19937 rng(7u + static_cast<unsigned>(variant));
    PromptSet<T> p = prompt_set<T>(config, 1, B, H, S, D, rng);
    vc::KVCache<T>& c = *p.caches[0];
    // 50 query tokens: blocks of 64 / G = 21 tokens, the last one short; then 9 more; then one
    // (a single token reads the stored rows unpacked).
    const vc::Tensor4<double> q1 = random_doubles(rng, B, H * G, 50, D);
    const vc::Tensor4<float> q2 = converted<float>(random_doubles(rng, B, H * G, 9, D));
    const vc::Tensor4<double> q3 = random_doubles(rng, B, H * G, 1, D);
    c.observe(q1);
    c.observe(vc::TensorRef<float>(q2));
    c.observe(q3);
    // Quantized rows: the reference reads them through state(), rounded to T (bfloat16 keeps 8
    // bits of mantissa) while the kernels read them in float32.
    const double tol = variant == 0 ? 1e-5 : std::is_same_v<T, Eigen::bfloat16> ? 3e-3 : 2e-4;
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const Rows keys = held_keys(c, b, h);
        std::vector<double> want(keys.size(), 0.0);
        for (const Index hq : {h * G, h * G + 1, h * G + 2}) {
          for (Index s = 0; s < 60; ++s) {
            const std::vector<double> q = s < 50   ? row_of(q1, b, hq, s)
                                          : s < 59 ? row_of(q2, b, hq, s - 50)
                                                   : row_of(q3, b, hq, 0);
            const std::vector<double> w = ref::proxy_softmax(keys, q);
            for (std::size_t j = 0; j < w.size(); ++j) want[j] = std::max(want[j], w[j]);
          }
        }
        const std::vector<float> got = c.scores(b, h);
        ASSERT_EQ(got.size(), want.size());
        for (std::size_t j = 0; j < got.size(); ++j) {
          EXPECT_NEAR(got[j], want[j], tol * std::max(1.0, 10 * want[j])) << b << h << ' ' << j;
        }
      }
    }
    EXPECT_EQ(c.offset(), S);
    EXPECT_EQ(c.tokens_kept(), S);
  }
}

/// With the re-read's own keys, each query's softmax also runs over them up to its own token
/// (causal), and only the prompt's rows are scored: against the double reference over 70 query
/// tokens (three blocks, the causal mask crossing each); keys of the wrong shape are refused.
TEST(KVzipObserveOwnKeys, TheRereadsKeysJoinEachSoftmaxUpToItsToken) {
  constexpr Index H = 2, G = 2, S = 40, R = 70, D = 16;
  std::mt19937 rng(21u);
  PromptSet<float> p = prompt_set<float>(kvzip_config(), 1, 1, H, S, D, rng);
  vc::KVCache<float>& c = *p.caches[0];
  const vc::Tensor4<double> q = random_doubles(rng, 1, H * G, R, D);
  const vc::Tensor4<double> k = random_doubles(rng, 1, H, R, D);
  const std::string before = snapshot(c);
  expect_refused([&] { c.observe(q, random_doubles(rng, 1, H, R - 1, D)); }, "keys must be");
  EXPECT_EQ(snapshot(c), before);
  c.observe(q, k);
  for (Index h = 0; h < H; ++h) {
    const Rows prompt_keys = held_keys(c, 0, h);
    std::vector<double> want(prompt_keys.size(), 0.0);
    for (Index g = 0; g < G; ++g) {
      for (Index s = 0; s < R; ++s) {
        Rows keys = prompt_keys;
        for (Index j = 0; j <= s; ++j) keys.push_back(row_of(k, 0, h, j));
        const std::vector<double> w = ref::proxy_softmax(keys, row_of(q, 0, h * G + g, s));
        for (std::size_t j = 0; j < want.size(); ++j) want[j] = std::max(want[j], w[j]);
      }
    }
    const std::vector<float> got = c.scores(0, h);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t j = 0; j < got.size(); ++j) EXPECT_NEAR(got[j], want[j], 1e-5) << h << ' ' << j;
  }
}

/// observe spread over the engine's threads gives the serial scores bit for bit.
TEST(KVzipObserveParallel, ParallelHeadsGiveTheSerialScores) {
  std::mt19937 rng(3u);
  PromptSet<float> serial = prompt_set<float>(kvzip_config(), 1, 2, 4, 300, 32, rng);
  Caches<float> parallel = vc::KVCacheBuilder::fork(serial.caches);
  const vc::ParallelFor pool = thread_parallel_for(3);
  int runs = 0;
  parallel[0]->set_parallel_for(
      [&](int tasks, const std::function<void(int)>& task) {
        ++runs;
        pool(tasks, task);
      },
      3);
  const vc::Tensor4<double> q = random_doubles(rng, 2, 8, 200, 32);
  serial.caches[0]->observe(q);
  parallel[0]->observe(q);
  EXPECT_GT(runs, 0) << "the heads did not go to the parallel-for";
  EXPECT_EQ(snapshot(*serial.caches[0]), snapshot(*parallel[0]));
}

// ---------------------------------------------------------------------------------------------
// compress
// ---------------------------------------------------------------------------------------------

/// One row as the reference selection sees it.
struct Row {
  double score;
  std::int64_t pos;
  std::size_t layer, head;
};

/// The positions each (layer, head) keeps under SPEC 18's compress, from the scores and positions
/// the caches show: sinks and unobserved rows, then the head's best up to its floor, then the best
/// of the set up to ceil(keep x rows).
template <class T>
std::vector<std::vector<std::vector<std::int64_t>>> reference_keep(const Caches<T>& set,
                                                                   double keep, int n_sink,
                                                                   double floor) {
  std::vector<std::vector<std::vector<std::int64_t>>> out(set.size());
  std::vector<Row> rest;
  std::size_t held = 0, kept = 0;
  const auto better = [](const Row& a, const Row& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.pos != b.pos) return a.pos < b.pos;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.head < b.head;
  };
  for (std::size_t l = 0; l < set.size(); ++l) {
    const vc::KVCache<T>& c = *set[l];
    out[l].resize(static_cast<std::size_t>(c.batch() * c.heads()));
    for (Index i = 0; i < c.batch() * c.heads(); ++i) {
      const std::vector<std::int64_t> pos = c.positions(i / c.heads(), i % c.heads());
      const std::vector<float> score = c.scores(i / c.heads(), i % c.heads());
      auto& keep_h = out[l][static_cast<std::size_t>(i)];
      std::vector<Row> rows;
      for (std::size_t j = 0; j < pos.size(); ++j) {
        if (pos[j] < n_sink || score[j] < 0.0f) {
          keep_h.push_back(pos[j]);
        } else {
          rows.push_back(Row{score[j], pos[j], l, static_cast<std::size_t>(i)});
        }
      }
      held += pos.size();
      const double share = std::ceil(keep * static_cast<double>(pos.size()));
      const auto floor_rows =
          std::min(pos.size(), static_cast<std::size_t>(std::ceil(floor * share)));
      std::sort(rows.begin(), rows.end(), better);
      std::size_t j = 0;
      for (; keep_h.size() < floor_rows && j < rows.size(); ++j) keep_h.push_back(rows[j].pos);
      kept += keep_h.size();
      rest.insert(rest.end(), rows.begin() + static_cast<std::ptrdiff_t>(j), rows.end());
    }
  }
  const auto target = static_cast<std::size_t>(std::ceil(keep * static_cast<double>(held)));
  std::sort(rest.begin(), rest.end(), better);
  for (std::size_t j = 0; kept < target && j < rest.size(); ++j, ++kept) {
    out[rest[j].layer][rest[j].head].push_back(rest[j].pos);
  }
  for (auto& layer : out) {
    for (auto& head : layer) std::sort(head.begin(), head.end());
  }
  return out;
}

template <class T>
std::vector<std::vector<std::vector<std::int64_t>>> held_positions(const Caches<T>& set) {
  std::vector<std::vector<std::vector<std::int64_t>>> out;
  for (const auto& c : set) {
    out.emplace_back();
    for (Index i = 0; i < c->batch() * c->heads(); ++i) {
      out.back().push_back(c->positions(i / c->heads(), i % c->heads()));
    }
  }
  return out;
}

template <class T>
class KVzipCompress : public ::testing::Test {};
TYPED_TEST_SUITE(KVzipCompress, StorageTypes);

/// A compress keeps exactly the reference's rows over three layers of four heads (one threshold
/// across them, and across the two sequences of a batch; floors that bind in heads whose rows are
/// scored low), frees the memory of the rest, and leaves ragged heads.
TYPED_TEST(KVzipCompress, KeepsTheSetsBestObservedRowsAndFreesTheRest) {
  using T = TypeParam;
  for (const double keep : {0.3, 0.08}) {
    for (const double floor : {0.2, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "keep " << keep << " floor " << floor);
      std::mt19937 rng(11u);
      const Index B = keep < 0.1 ? 2 : 1;
      const double R = 3.0 * static_cast<double>(B) * 4 * 50;  // rows held
      PromptSet<T> p = prompt_set<T>(kvzip_config(2, floor), 3, B, 4, 50, 16, rng);
      for (std::size_t l = 0; l < 3; ++l) {
        // Sharper queries in the later layers: their scores stand out across the set.
        vc::Tensor4<double> q = random_doubles(rng, B, 8, 30, 16);
        q = q * (1.0 + static_cast<double>(l));
        p.caches[l]->observe(q);
      }
      const auto want = reference_keep(p.caches, keep, 2, floor);
      std::size_t kept_bytes = 0, heap = 0, full = 0;
      for (const auto& c : p.caches) {
        kept_bytes += c->kept_bytes();
        heap += c->heap_bytes();
        full += c->full_seq_bytes();
      }
      vc::KVCacheBuilder::compress(p.caches, keep);
      EXPECT_EQ(held_positions(p.caches), want);
      std::size_t rows = 0, kept_after = 0, heap_after = 0;
      bool ragged = false;
      for (const auto& c : p.caches) {
        for (Index b = 0; b < B; ++b) {
          for (Index h = 0; h < 4; ++h) rows += static_cast<std::size_t>(c->head_rows(b, h));
        }
        kept_after += c->kept_bytes();
        heap_after += c->heap_bytes();
        ragged = ragged || c->ragged_heads();
        EXPECT_TRUE(dynamic_cast<vc::KVzipCache<T>&>(*c).compressed());
        EXPECT_EQ(c->full_seq_bytes() * 3, full);
      }
      if (floor < 1.0) {
        EXPECT_EQ(rows, static_cast<std::size_t>(std::ceil(keep * R)));
        EXPECT_TRUE(ragged);
      } else {
        EXPECT_GE(rows, static_cast<std::size_t>(std::ceil(keep * R)));  // floors win
      }
      // Rows of T: the bytes follow the rows.
      EXPECT_EQ(kept_after * static_cast<std::size_t>(R), kept_bytes * rows);
      EXPECT_LT(static_cast<double>(heap_after), 0.6 * static_cast<double>(heap));
    }
  }
}

/// Attention after a compress is attention over the rows it kept (and the call's own): a decode
/// step's attend against a double-precision reference built from the prompt's rows at the kept
/// positions; the new rows are kept unobserved (-1), and a second compress without observe keeps
/// them while it cuts the observed ones.
TEST(KVzipCompressAttend, AttendUsesTheKeptRowsAndNewRowsWaitUnobserved) {
  constexpr Index H = 2, G = 2, S = 64, D = 16;
  std::mt19937 rng(5u);
  PromptSet<float> p = prompt_set<float>(kvzip_config(1), 1, 1, H, S, D, rng);
  vc::KVCache<float>& c = *p.caches[0];
  c.observe(random_doubles(rng, 1, H * G, 20, D));
  vc::KVCacheBuilder::compress(p.caches, 0.25);
  const vc::Tensor4<double> k = random_doubles(rng, 1, H, 1, D),
                            v = random_doubles(rng, 1, H, 1, D);
  const vc::Tensor4<double> q = random_doubles(rng, 1, H * G, 1, D);
  const vc::Tensor4<float> out = c.attend(q, k, v);
  for (Index h = 0; h < H; ++h) {
    const std::vector<std::int64_t> pos = c.positions(0, h);
    ASSERT_EQ(pos.back(), S);
    Rows keys, values;
    for (const std::int64_t x : pos) {
      keys.push_back(x < S ? row_of(p.keys[0], 0, h, x) : row_of(k, 0, h, 0));
      values.push_back(x < S ? row_of(p.values[0], 0, h, x) : row_of(v, 0, h, 0));
    }
    for (Index g = 0; g < G; ++g) {
      const std::vector<double> w = ref::proxy_softmax(keys, row_of(q, 0, h * G + g, 0));
      for (Index d = 0; d < D; ++d) {
        double want = 0.0;
        for (std::size_t j = 0; j < w.size(); ++j)
          want += w[j] * values[j][static_cast<std::size_t>(d)];
        EXPECT_NEAR(out(0, h * G + g, 0, d), want, 1e-5);
      }
    }
    EXPECT_EQ(c.scores(0, h).back(), -1.0f);
  }
  // A second compress: the unobserved row stays in every head.
  const std::int64_t before = c.head_rows(0, 0) + c.head_rows(0, 1);
  vc::KVCacheBuilder::compress(p.caches, 0.5);
  EXPECT_EQ(c.head_rows(0, 0) + c.head_rows(0, 1),
            static_cast<std::int64_t>(std::ceil(0.5 * static_cast<double>(before))));
  for (Index h = 0; h < H; ++h) EXPECT_EQ(c.positions(0, h).back(), S);
}

/// keep = 1 keeps every row; the standard caches of non-attention layers are left alone.
TEST(KVzipCompressSet, KeepOneKeepsEverythingAndStandardLayersAreLeftAlone) {
  std::mt19937 rng(2u);
  Caches<float> set = vc::KVCacheBuilder::for_model<float>({8, std::nullopt, 8}, kvzip_config());
  for (auto& c : set)
    (void)c->update_and_view(random_doubles(rng, 1, 2, 10, 8), random_doubles(rng, 1, 2, 10, 8));
  set[0]->observe(random_doubles(rng, 1, 2, 4, 8));
  set[2]->observe(random_doubles(rng, 1, 2, 4, 8));
  vc::KVCacheBuilder::compress(set, 1.0);
  for (const auto& c : set) EXPECT_EQ(c->max_head_rows(), 10);
  vc::KVCacheBuilder::compress(set, 0.5);
  EXPECT_EQ(set[1]->tokens_kept(), 10);
  EXPECT_EQ(set[0]->head_rows(0, 0) + set[0]->head_rows(0, 1) + set[2]->head_rows(0, 0) +
                set[2]->head_rows(0, 1),
            20);
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

/// Every refusal of SPEC 18 throws std::invalid_argument naming what is wrong and changes nothing.
TEST(KVzipRefusals, BadKeepUnobservedCachesOtherMethodsAndBadQueriesChangeNothing) {
  std::mt19937 rng(9u);
  PromptSet<Eigen::half> p = prompt_set<Eigen::half>(kvzip_config(), 2, 1, 2, 12, 8, rng);
  p.caches[0]->observe(random_doubles(rng, 1, 4, 3, 8));
  const std::vector<std::string> before = snapshot(p.caches);
  for (const double keep : {0.0, -0.5, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    expect_refused([&] { vc::KVCacheBuilder::compress(p.caches, keep); }, "must be in (0, 1]");
  }
  expect_refused([&] { vc::KVCacheBuilder::compress(p.caches, 0.5); },
                 "cache 1 has not been observed");
  auto& c = *p.caches[1];
  expect_refused([&] { c.observe(random_doubles(rng, 2, 4, 3, 8)); }, "batch size B");
  expect_refused([&] { c.observe(random_doubles(rng, 1, 3, 3, 8)); }, "multiple of the KV heads");
  expect_refused([&] { c.observe(random_doubles(rng, 1, 4, 3, 4)); }, "head dim D");
  vc::Tensor4<float> nan_q = converted<float>(random_doubles(rng, 1, 4, 3, 8));
  nan_q(0, 3, 2, 5) = std::numeric_limits<float>::quiet_NaN();
  expect_refused([&] { c.observe(nan_q); }, "non-finite query");
  vc::Tensor4<float> big_k = converted<float>(random_doubles(rng, 1, 2, 3, 8));
  big_k(0, 1, 2, 3) = 0x1p60f;
  expect_refused([&] { c.observe(converted<float>(random_doubles(rng, 1, 4, 3, 8)), big_k); },
                 "key");
  EXPECT_EQ(snapshot(p.caches), before);

  // A cache of another method in the set, observe on it, observe before any row.
  Caches<Eigen::half> mixed = vc::KVCacheBuilder::fork(p.caches);
  vc::KVCacheConfig h2o;
  h2o.method = "h2o";
  mixed.push_back(vc::KVCacheFactory::create<Eigen::half>(h2o));
  (void)mixed.back()->update_and_view(random_doubles(rng, 1, 2, 3, 8),
                                      random_doubles(rng, 1, 2, 3, 8));
  mixed[1]->observe(random_doubles(rng, 1, 2, 3, 8));
  const std::vector<std::string> mixed_before = snapshot(mixed);
  expect_refused([&] { vc::KVCacheBuilder::compress(mixed, 0.5); }, "cache 2 is a 'h2o' cache");
  expect_refused([&] { mixed.back()->observe(random_doubles(rng, 1, 2, 3, 8)); },
                 "observed scores are KVzip's");
  EXPECT_EQ(snapshot(mixed), mixed_before);
  vc::KVzipCache<float> fresh(kvzip_config());
  expect_refused([&] { fresh.observe(random_doubles(rng, 1, 2, 3, 8)); }, "holds no rows yet");
  EXPECT_FALSE(fresh.observed());
  mixed.push_back(nullptr);
  expect_refused([&] { vc::KVCacheBuilder::compress(mixed, 0.5); }, "cache 3 is null");
}

// ---------------------------------------------------------------------------------------------
// Fork, checkpoint and rollback, prompt caches
// ---------------------------------------------------------------------------------------------

/// The decode steps after a compress, as attend outputs.
template <class T>
std::vector<vc::Tensor4<float>> decode(Caches<T>& set, int steps, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<vc::Tensor4<float>> out;
  for (int s = 0; s < steps; ++s) {
    for (auto& c : set) {
      const Index H = c->heads(), D = c->key_dim();
      out.push_back(c->attend(random_doubles(rng, 1, 2 * H, 1, D), random_doubles(rng, 1, H, 1, D),
                              random_doubles(rng, 1, H, 1, D)));
    }
  }
  return out;
}

template <class T>
bool same_outputs(const std::vector<vc::Tensor4<float>>& a,
                  const std::vector<vc::Tensor4<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!bitwise_equal(a[i], b[i])) return false;
  }
  return true;
}

/// A fork carries the observed scores (its compress leaves the source as it was); a rollback to
/// a checkpoint taken before a compress returns the rows and scores, and compressing again gives
/// the same set; a prompt cache saved after a compress loads the very set (observed, compressed,
/// ragged) and continues bit for bit, for 16-bit rows and 4-bit channel-axis keys.
TYPED_TEST(KVzipCompress, ForkRollbackAndPromptCachesCarryIt) {
  using T = TypeParam;
  for (const bool quantized : {false, true}) {
    SCOPED_TRACE(quantized);
    vc::KVCacheConfig config = kvzip_config();
    if (quantized) {
      config.key_bits = 4;
      config.key_axis = "channel";
      config.quant_block = 8;
    }
    std::mt19937 rng(13u);
    PromptSet<T> p = prompt_set<T>(config, 2, 1, 2, 40, 16, rng);
    // A checkpoint before observe: the rollback takes the scores and the flag back.
    const std::vector<std::string> unobserved = snapshot(p.caches);
    vc::KVCacheBuilder::checkpoint(p.caches);
    for (auto& c : p.caches) c->observe(random_doubles(rng, 1, 4, 10, 16));
    vc::KVCacheBuilder::rollback(p.caches);
    EXPECT_EQ(snapshot(p.caches), unobserved);
    EXPECT_THROW(vc::KVCacheBuilder::compress(p.caches, 0.5), std::invalid_argument);
    for (auto& c : p.caches) c->observe(random_doubles(rng, 1, 4, 10, 16));
    const std::vector<std::string> observed = snapshot(p.caches);

    Caches<T> fork = vc::KVCacheBuilder::fork(p.caches);
    EXPECT_EQ(snapshot(fork), observed);
    vc::KVCacheBuilder::compress(fork, 0.25);
    EXPECT_EQ(snapshot(p.caches), observed);

    vc::KVCacheBuilder::checkpoint(p.caches);
    vc::KVCacheBuilder::compress(p.caches, 0.25);
    EXPECT_EQ(snapshot(p.caches), snapshot(fork));
    (void)decode(p.caches, 3, 1u);
    vc::KVCacheBuilder::rollback(p.caches);
    EXPECT_EQ(snapshot(p.caches), observed);
    vc::KVCacheBuilder::compress(p.caches, 0.25);
    EXPECT_EQ(snapshot(p.caches), snapshot(fork));

    std::stringstream file;
    vc::save_prompt_cache(file, p.caches, {{"kvzip", "yes"}});
    vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
    EXPECT_EQ(snapshot(loaded.caches), snapshot(p.caches));
    for (const auto& c : loaded.caches) {
      const auto& z = dynamic_cast<const vc::KVzipCache<T>&>(*c);
      EXPECT_TRUE(z.observed());
      EXPECT_TRUE(z.compressed());
      EXPECT_TRUE(z.ragged_heads());
    }
    // The loaded set, the saved one and the fork compressed alike continue alike.
    const std::vector<vc::Tensor4<float>> from_loaded = decode(loaded.caches, 4, 2u);
    EXPECT_TRUE(same_outputs<T>(from_loaded, decode(p.caches, 4, 2u)));
    EXPECT_TRUE(same_outputs<T>(from_loaded, decode(fork, 4, 2u)));
  }
}

/// The loader refuses kvzip states no cache can reach (docs/design.md G, 6.1), naming the rule:
/// files saved from a compressed set (and from one never observed), one field patched by the
/// independent format walker and the checksums sealed again.
TEST(KVzipPromptCache, TheLoaderRefusesStatesNoKVzipCacheReaches) {
  namespace fmt = veloxquant::test::format;
  std::mt19937 rng(31u);
  PromptSet<float> p = prompt_set<float>(kvzip_config(1), 1, 1, 2, 12, 8, rng);
  const auto save = [&] {
    std::ostringstream out;
    vc::save_prompt_cache(out, p.caches, {});
    return out.str();
  };
  const std::string fresh = save();  // not observed
  p.caches[0]->observe(random_doubles(rng, 1, 4, 4, 8));
  vc::KVCacheBuilder::compress(p.caches, 0.5);
  const std::string compressed = save();
  const auto refused = [](const std::string& bytes, const std::string& part) {
    std::istringstream in(bytes);
    try {
      (void)vc::load_prompt_cache<float>(in);
      ADD_FAILURE() << "loaded; wanted: " << part;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const auto patched = [](std::string bytes, const std::string& field, auto value) {
    const fmt::FileMap map = fmt::walk<float>(bytes);
    fmt::patch(bytes, map.at(field), value);
    fmt::reseal(bytes, map);
    return bytes;
  };
  // Flags: not compressed, though its heads were cut. (Compressed without being observed is a
  // state a memory pool's cut reaches, SPEC 19: test_memory_pool.cpp saves and loads one.)
  refused(patched(compressed, "cache0.flags", std::uint8_t{1 | 8}),
          "has not compressed holds every row");
  // A score that is no softmax weight; an observed score in a cache never observed (the first
  // score of a head, patched).
  const auto first_score = [](std::string bytes, const std::string& head, float x) {
    const fmt::FileMap map = fmt::walk<float>(bytes);
    fmt::patch(bytes, fmt::Field{map.at("cache0." + head + ".scores").offset, 4}, x);
    fmt::reseal(bytes, map);
    return bytes;
  };
  refused(first_score(compressed, "head0", 2.0f), "neither a softmax weight nor -1");
  refused(first_score(fresh, "head1", 0.5f), "never observed holds an observed score");
  // Heads of an uncompressed cache hold every row.
  refused(patched(fresh, "cache0.head1.rows", std::int64_t{11}), "holds every row");
  // A version-5 file (kvzip_n_sink taken out, as a writer of version 5 would) cannot name the
  // method.
  refused(fmt::as_version<float>(compressed, 5, vc::detail::config_field_since),
          "method 'kvzip' is not in format version 5");
}

}  // namespace
