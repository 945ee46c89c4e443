// Replays every input of the fuzzer's seed corpus (fuzz/corpus/) and every saved regression
// (fuzz/regressions/) through the fuzz harness (fuzz/fuzz_ops.hpp), built with the project's
// compiler and warning flags, so a violation found once by `bash scripts/fuzz.sh` stays fixed.
// Each input drives one cache through a sequence of calls, resets, trims and bad inputs, checked
// against the naive oracles of tests/reference/ and the invariants of docs/design.md (see
// fuzz_ops.hpp).
//
// The directories are found from this file's path (__FILE__ is absolute under CMake); the
// environment variable VELOXQUANT_FUZZ_DIR overrides it (the directory holding corpus/ and
// regressions/).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../fuzz/fuzz_load.hpp"
#include "../fuzz/fuzz_ops.hpp"
#include "../fuzz/fuzz_pool.hpp"

namespace {

namespace fs = std::filesystem;
namespace fz = veloxquant::fuzz;

fs::path fuzz_dir() {
  if (const char* env = std::getenv("VELOXQUANT_FUZZ_DIR")) return fs::path(env);
  return fs::path(__FILE__).parent_path().parent_path() / "fuzz";
}

/// The regular files of `dir` (sorted), without README files; none if it does not exist.
std::vector<fs::path> inputs_in(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    if (e.path().filename().string().rfind("README", 0) == 0) continue;
    out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<std::uint8_t>((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
}

/// Replays every input of `dir`; returns the number replayed. Counters go to `stats`.
std::size_t replay(const fs::path& dir, fz::Stats& stats) {
  fz::Options options;
  options.stats = &stats;
  std::size_t n = 0;
  for (const fs::path& p : inputs_in(dir)) {
    const std::vector<std::uint8_t> data = read_bytes(p);
    const std::string violation = fz::run_ops(data.data(), data.size(), options);
    EXPECT_EQ(violation, "") << "input " << p.string();
    ++n;
  }
  return n;
}

TEST(FuzzRegressions, SeedCorpusReplaysCleanAndReachesEveryPolicy) {
  const fs::path dir = fuzz_dir() / "corpus";
  ASSERT_TRUE(fs::is_directory(dir)) << "no corpus at " << dir.string();
  fz::Stats stats;
  const std::size_t n = replay(dir, stats);
  ASSERT_GE(n, 10u) << "the seed corpus at " << dir.string() << " looks incomplete";
  // The corpus really exercises what it is meant to: a harness that silently did nothing would
  // pass the loop above, so check the counters too.
  for (int r = 0; r < fz::detail::kRunCount; ++r)
    EXPECT_GT(stats.method_runs[r], 0u) << fz::detail::run_name(r) << " not reached";
  EXPECT_GT(stats.invalid_configs, 0u);
  EXPECT_GT(stats.rejected, 10u);
  EXPECT_GT(stats.query_calls, 10u);
  EXPECT_GT(stats.resets, 0u);
  EXPECT_GT(stats.trims, 0u);
  EXPECT_GT(stats.decisions, 100u);
  EXPECT_GT(stats.tokens, 300u);
  EXPECT_GT(stats.reloads, 0u);
  EXPECT_GT(stats.forks, 0u);
  EXPECT_GT(stats.rollbacks, 0u);
  // Adaptive head budgets (SPEC 14): heads that turned ragged, fetches refused on them, and pooled
  // evictions decided by the harness's pool oracle.
  EXPECT_GT(stats.adaptive_runs, 0u);
  EXPECT_GT(stats.ragged_calls, 0u);
  EXPECT_GT(stats.ragged_refusals, 0u);
  EXPECT_GT(stats.pool_decisions, 10u);
}

// The loader's fuzz corpus (fuzz/corpus_load/): real files of the current format version saved
// from every policy, storage type and width (fuzz/fuzz_load.hpp), and the files of the same sets
// in the older versions (v1-seed-*, written before proxy_scoring; v2-seed-*, before
// value_norm_power; v3-seed-*, before head_budgets; v4-seed-*, before key_axis, value_axis and
// quant_block; v5-seed-*, before kvzip_n_sink; v6-seed-*, before pool_floor_rows). Each one loads
// (with its checksums verified), saves back to its own bytes and goes on with valid calls; an older
// file loads the fields it predates at their defaults; and this build still writes exactly the
// current files' bytes, so the format cannot drift without a new version (docs/design.md G).
TEST(FuzzRegressions, LoadCorpusLoadsGoesOnAndIsWhatThisBuildWrites) {
  const fs::path dir = fuzz_dir() / "corpus_load";
  const std::vector<fs::path> files = inputs_in(dir);
  ASSERT_GE(files.size(), 10u) << "the loader's corpus at " << dir.string() << " looks incomplete";
  const std::map<std::string, std::string> seeds = veloxquant::fuzz::make_seeds();
  std::size_t compared = 0, version1 = 0, version2 = 0, version3 = 0, version4 = 0, version5 = 0,
              version6 = 0;
  for (const fs::path& p : files) {
    const std::vector<std::uint8_t> data = read_bytes(p);
    ASSERT_FALSE(data.empty()) << p.string();
    EXPECT_EQ(veloxquant::fuzz::run_load(data.data(), data.size()), "") << p.string();
    const std::string name = p.stem().string();
    const bool v1 = name.rfind("v1-seed-", 0) == 0, v2 = name.rfind("v2-seed-", 0) == 0;
    const bool v3 = name.rfind("v3-seed-", 0) == 0, v4 = name.rfind("v4-seed-", 0) == 0;
    const bool v5 = name.rfind("v5-seed-", 0) == 0, v6 = name.rfind("v6-seed-", 0) == 0;
    if (v1 || v2 || v3 || v4 || v5 || v6) {
      // Version 1 (before proxy_scoring) loads with the key-as-query proxy, versions 1 and 2
      // (before value_norm_power) rank by score alone, versions 1 to 3 (before head_budgets)
      // with uniform heads (and, above, save in the current version and go on).
      const auto configs = [&](auto tag) {
        using T = decltype(tag);
        std::istringstream in(std::string(data.begin() + 1, data.end()));
        std::vector<veloxquant::cache::KVCacheConfig> out;
        for (const auto& c : veloxquant::cache::load_prompt_cache<T>(in).caches) {
          out.push_back(c->config());
        }
        return out;
      };
      const std::vector<veloxquant::cache::KVCacheConfig> got =
          data[0] % 3 == 0   ? configs(Eigen::half{})
          : data[0] % 3 == 1 ? configs(Eigen::bfloat16{})
                             : configs(float{});
      for (const auto& c : got) {
        if (v1) {
          EXPECT_EQ(c.proxy_scoring, "key_as_query") << name;
        }
        if (v1 || v2) {
          EXPECT_EQ(c.value_norm_power, 0.0) << name;
        }
        if (!v4 && !v5 && !v6) {
          EXPECT_EQ(c.head_budgets, "uniform") << name;
        }
        if (!v5 && !v6) {
          EXPECT_EQ(c.key_axis, "token") << name;
          EXPECT_EQ(c.value_axis, "token") << name;
          EXPECT_EQ(c.quant_block, 32) << name;
        }
        if (!v6) {
          EXPECT_EQ(c.kvzip_n_sink, 4) << name;  // versions 1 to 5 predate it
        }
        EXPECT_EQ(c.pool_floor_rows, 16) << name;       // every older version predates it
      }
      ++(v1 ? version1 : v2 ? version2 : v3 ? version3 : v4 ? version4 : v5 ? version5 : version6);
      continue;
    }
    if (name.rfind("seed-", 0) != 0) continue;
    ASSERT_EQ(data[0] / 3 % 2, 0) << "a seed is loaded with its checksums verified";
    const auto it = seeds.find(name);
    ASSERT_NE(it, seeds.end()) << "no generator for " << name;
    EXPECT_TRUE(std::string(data.begin(), data.end()) == it->second)
        << name << ": this build writes other bytes (format drift, docs/design.md G)";
    ++compared;
  }
  EXPECT_EQ(compared, seeds.size());
  EXPECT_GE(version1, 15u) << "the version-1 files of fuzz/corpus_load (v1-seed-*) are missing";
  EXPECT_GE(version2, 17u) << "the version-2 files of fuzz/corpus_load (v2-seed-*) are missing";
  EXPECT_GE(version3, 17u) << "the version-3 files of fuzz/corpus_load (v3-seed-*) are missing";
  EXPECT_GE(version4, 19u) << "the version-4 files of fuzz/corpus_load (v4-seed-*) are missing";
  EXPECT_GE(version5, 20u) << "the version-5 files of fuzz/corpus_load (v5-seed-*) are missing";
  EXPECT_GE(version6, 22u) << "the version-6 files of fuzz/corpus_load (v6-seed-*) are missing";
}

TEST(FuzzRegressions, LoadHarnessRefusesGarbageAndShortInputs) {
  const std::uint8_t none[1] = {0};
  EXPECT_EQ(veloxquant::fuzz::run_load(none, 0), "");
  for (int b = 0; b < 256; b += 17) {
    const std::uint8_t one[2] = {static_cast<std::uint8_t>(b), static_cast<std::uint8_t>(b * 7)};
    EXPECT_EQ(veloxquant::fuzz::run_load(one, 2), "");
  }
}

TEST(FuzzRegressions, SavedRegressionsReplayClean) {
  const fs::path dir = fuzz_dir() / "regressions";
  ASSERT_TRUE(fs::is_directory(dir)) << "no regressions directory at " << dir.string();
  fz::Stats stats;
  const std::size_t n = replay(dir, stats);
  EXPECT_EQ(stats.runs, n);
  // The load target's (fuzz/fuzz_load.hpp).
  const fs::path load_dir = fuzz_dir() / "regressions_load";
  ASSERT_TRUE(fs::is_directory(load_dir)) << "no regressions directory at " << load_dir.string();
  for (const fs::path& p : inputs_in(load_dir)) {
    const std::vector<std::uint8_t> data = read_bytes(p);
    EXPECT_EQ(veloxquant::fuzz::run_load(data.data(), data.size()), "") << p.string();
  }
}

// Target `pool` (fuzz/fuzz_pool.hpp): its seed corpus (fuzz/corpus_pool/) and saved regressions
// (fuzz/regressions_pool/) replay clean, and the corpus reaches what the target is for: every
// evicting method under both rules, every storage type, rows taken from idle sets under both
// rules, refused calls, floors refused, and every set operation.
TEST(FuzzRegressions, PoolCorpusReplaysCleanAndReachesEveryRuleAndOperation) {
  fz::PoolStats stats;
  std::size_t n = 0;
  for (const char* sub : {"corpus_pool", "regressions_pool"}) {
    const fs::path dir = fuzz_dir() / sub;
    ASSERT_TRUE(fs::is_directory(dir)) << "no directory at " << dir.string();
    for (const fs::path& p : inputs_in(dir)) {
      const std::vector<std::uint8_t> data = read_bytes(p);
      EXPECT_EQ(fz::run_pool(data.data(), data.size(), &stats), "") << p.string();
      ++n;
    }
  }
  EXPECT_EQ(stats.runs, n);
  const auto reached = [&](const std::string& prefix) {
    const auto it = stats.reached.lower_bound(prefix);
    return it != stats.reached.end() && it->compare(0, prefix.size(), prefix) == 0;
  };
  for (const char* method : fz::pool_detail::kPoolMethods) {
    for (const char* rule : {" fair", " scores"}) {
      EXPECT_TRUE(reached(std::string(method) + rule)) << method << rule << " not reached";
    }
  }
  for (const char* kind :
       {"float", "half", "bfloat16", "take fair", "take scores", "refused call", "refused new set",
        "refused first call", "refused fork", "fork", "release", "rollback", "reset", "load"}) {
    EXPECT_TRUE(reached(kind)) << kind << " not reached";
  }
  EXPECT_GT(stats.calls, 100u);
  EXPECT_GT(stats.takes, 10u);
}

TEST(FuzzRegressions, RunsAreDeterministic) {
  // The same input gives the same run (the harness and the corpus replay rely on it).
  const std::vector<fs::path> files = inputs_in(fuzz_dir() / "corpus");
  ASSERT_FALSE(files.empty());
  for (std::size_t i = 0; i < files.size(); i += 5) {
    const std::vector<std::uint8_t> data = read_bytes(files[i]);
    fz::Stats a, b;
    fz::Options oa, ob;
    oa.stats = &a;
    ob.stats = &b;
    EXPECT_EQ(fz::run_ops(data.data(), data.size(), oa), "");
    EXPECT_EQ(fz::run_ops(data.data(), data.size(), ob), "");
    EXPECT_EQ(a.calls, b.calls) << files[i].string();
    EXPECT_EQ(a.decisions, b.decisions) << files[i].string();
    EXPECT_EQ(a.tokens, b.tokens) << files[i].string();
  }
}

TEST(FuzzRegressions, ShortAndEmptyInputsAreValidRuns) {
  // Every byte string is a valid run (missing bytes read as 0).
  const std::uint8_t none[1] = {0};
  EXPECT_EQ(fz::run_ops(none, 0), "");
  for (int b = 0; b < 256; b += 17) {
    const std::uint8_t one[1] = {static_cast<std::uint8_t>(b)};
    EXPECT_EQ(fz::run_ops(one, 1), "");
  }
}

TEST(FuzzRegressions, NearTieRuleExcusesOnlyCloseScoresAndCoincidentalTies) {
  using fz::detail::Candidate;
  using fz::detail::near_tie;
  const std::set<std::int64_t> evict_3{3};
  // Ties exact by construction are decided by the tie rule: never ambiguous. Both scores 0 ...
  EXPECT_FALSE(near_tie({{0.0, 3}, {0.0, 4}, {0.9, 5}}, evict_3));
  // ... or identical keys in one softmax (TOVA, SnapKV).
  const auto same = [](std::int64_t, std::int64_t) { return true; };
  const auto differ = [](std::int64_t, std::int64_t) { return false; };
  EXPECT_FALSE(near_tie({{0.5, 3}, {0.5, 4}, {0.9, 5}}, evict_3, same));
  // Equal doubles from different computations: float32 may split them.
  EXPECT_TRUE(near_tie({{0.5, 3}, {0.5, 4}, {0.9, 5}}, evict_3, differ));
  EXPECT_TRUE(near_tie({{0.5, 3}, {0.5, 4}, {0.9, 5}}, evict_3));
  // ... unless the scores are one softmax row (TOVA with one query head).
  EXPECT_FALSE(near_tie({{0.5, 3}, {0.5, 4}, {0.9, 5}}, evict_3, differ, true));
  // Different by 1e-6 relative: float32 may order them either way.
  EXPECT_TRUE(near_tie({{0.5, 3}, {0.5 * (1 + 1e-6), 4}, {0.9, 5}}, evict_3));
  // Different by 1e-3 relative: a real decision.
  EXPECT_FALSE(near_tie({{0.5, 3}, {0.5 * (1 + 1e-3), 4}, {0.9, 5}}, evict_3));
  // Decayed scores within 1e-42 of each other (float32 holds them as subnormals or 0): even a
  // score against an exact 0 is ambiguous ...
  EXPECT_TRUE(near_tie({{0.0, 3}, {2e-47, 4}, {0.9, 5}}, evict_3));
  EXPECT_TRUE(near_tie({{5e-43, 3}, {0.0, 4}, {0.9, 5}}, evict_3));
  // ... but subnormals float32 can tell apart, or a subnormal against a normal score, are a real
  // decision, and so is a kept tiny score against an evicted normal one.
  EXPECT_FALSE(near_tie({{1e-40, 3}, {3e-39, 4}, {0.9, 5}}, evict_3));
  EXPECT_FALSE(near_tie({{0.0, 3}, {2e-37, 4}, {0.9, 5}}, evict_3));
  EXPECT_FALSE(near_tie({{0.9, 3}, {1e-45, 4}, {0.95, 5}}, evict_3));
  // Only evicted-vs-kept pairs count.
  EXPECT_FALSE(near_tie({{0.5, 3}, {0.5 * (1 + 1e-6), 4}}, {3, 4}));
  EXPECT_FALSE(near_tie({{0.5, 3}, {0.7, 4}}, {}));
}

}  // namespace
