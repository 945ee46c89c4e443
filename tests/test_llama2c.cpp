// The llama2.c example engine (examples/llama2c) on the real stories260K model: end-to-end greedy
// decoding against llama2.c's published output, every eviction policy against the full cache,
// the tokenizer, the loaders' errors and the model's NLL on TinyStories text.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <set>
#include <string>
#include <vector>

#include "llama2c.hpp"

namespace {

namespace fs = std::filesystem;
namespace ll = veloxquant::llama2c;
namespace vc = veloxquant::cache;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The fixture files, loaded once; null when they are absent.
struct Fixtures {
  fs::path dir;
  ll::Model model;
  ll::Tokenizer tokenizer;
};

fs::path fixture_dir() { return ll::fixtures_dir(VELOXQUANT_FIXTURES_DEFAULT); }

const Fixtures* fixtures() {
  static const std::unique_ptr<const Fixtures> loaded = []() -> std::unique_ptr<const Fixtures> {
    const fs::path dir = fixture_dir();
    for (const char* f : {"model/stories260K.bin", "model/tok512.bin",
                          "model/greedy_reference_ids.txt", "model/greedy_reference.txt",
                          "text/tinystories_sample.txt", "text/tinystories_validation_head.txt"}) {
      if (!fs::exists(dir / f)) return nullptr;
    }
    ll::Model model = ll::Model::load((dir / "model/stories260K.bin").string());
    ll::Tokenizer tok =
        ll::Tokenizer::load((dir / "model/tok512.bin").string(), model.config().vocab_size);
    return std::make_unique<const Fixtures>(Fixtures{dir, std::move(model), std::move(tok)});
  }();
  return loaded.get();
}

class Llama2c : public ::testing::Test {
 protected:
  void SetUp() override {
    fx_ = fixtures();
    if (fx_ == nullptr) {
      GTEST_SKIP() << "stories260K fixtures not found in '" << fixture_dir().string()
                   << "' (set VELOXQUANT_FIXTURES). Get stories260K.bin and tok512.bin from "
                      "Hugging Face karpathy/tinyllamas (folder stories260K) into model/, and "
                      "the TinyStories text files into text/, as described in the fixtures' "
                      "README.md";
    }
  }

  const ll::Model& model() const { return fx_->model; }
  const ll::Tokenizer& tokenizer() const { return fx_->tokenizer; }
  std::string file(const char* name) const { return read_bytes(fx_->dir / name); }

  template <class T = float>
  ll::Engine<T> engine(const vc::KVCacheConfig& cfg, bool queries = false) const {
    return ll::Engine<T>(model(), vc::KVCacheBuilder::for_model<T>(model().config().n_layers, cfg),
                         queries);
  }
  static vc::KVCacheConfig standard() {
    vc::KVCacheConfig cfg;
    cfg.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
    cfg.method = "standard";
    return cfg;
  }

  /// The first n ids of the sample text (with BOS).
  std::vector<int> sample_ids(std::size_t n) const {
    std::vector<int> ids = tokenizer().encode(file("text/tinystories_sample.txt"), true);
    ids.resize(n);
    return ids;
  }

  const Fixtures* fx_ = nullptr;
};

constexpr std::size_t kPrefill = 40;  // teacher-forced runs: one prefill call of 40 tokens,
constexpr std::size_t kDecode = 30;   // then 30 one-token decode calls
constexpr std::size_t kLength = kPrefill + kDecode;

/// Teacher forcing: tokens[0, prefill) in one call, then one call per token. Returns each call's
/// logits ([S, vocab]); `after_call` runs after every call.
template <class T, class F>
std::vector<Eigen::MatrixXf> teacher_forced(ll::Engine<T>& engine, const std::vector<int>& tokens,
                                            std::size_t prefill, F after_call) {
  std::vector<Eigen::MatrixXf> out;
  out.push_back(engine.forward(
      std::vector<int>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(prefill))));
  after_call();
  for (std::size_t i = prefill; i < tokens.size(); ++i) {
    out.push_back(engine.forward({tokens[i]}));
    after_call();
  }
  return out;
}
template <class T>
std::vector<Eigen::MatrixXf> teacher_forced(ll::Engine<T>& engine, const std::vector<int>& tokens,
                                            std::size_t prefill) {
  return teacher_forced(engine, tokens, prefill, [] {});
}

/// This layer's budget for the policies that have one.
std::optional<int> layer_budget(const vc::KVCache<float>& c) {
  if (const auto* p = dynamic_cast<const vc::SqueezeAttentionCache<float>*>(&c))
    return p->layer_budget();
  if (const auto* p = dynamic_cast<const vc::H2OCache<float>*>(&c)) return p->layer_budget();
  if (const auto* p = dynamic_cast<const vc::PyramidKVCache<float>*>(&c)) return p->layer_budget();
  if (const auto* p = dynamic_cast<const vc::TOVACache<float>*>(&c)) return p->layer_budget();
  if (const auto* p = dynamic_cast<const vc::StreamingLLMCache<float>*>(&c))
    return p->layer_budget();
  if (const auto* p = dynamic_cast<const vc::SnapKVCache<float>*>(&c)) return p->layer_budget();
  return std::nullopt;
}

/// Mean negative log-likelihood of tokens[i + 1] under logits row i. logits: [n, vocab]
double mean_nll(const Eigen::MatrixXf& logits, const std::vector<int>& tokens) {
  double total = 0.0;
  for (Eigen::Index i = 0; i + 1 < static_cast<Eigen::Index>(tokens.size()); ++i) {
    const Eigen::ArrayXd row = logits.row(i).transpose().cast<double>().array();
    const double lse = row.maxCoeff() + std::log((row - row.maxCoeff()).exp().sum());
    total += lse - row(tokens[static_cast<std::size_t>(i) + 1]);
  }
  return total / static_cast<double>(tokens.size() - 1);
}

// --- 1. End to end: llama2.c's greedy output -------------------------------------------------

TEST_F(Llama2c, GreedyDecodingFromBosReproducesLlama2cOutput) {
  // The ids file: 256 whitespace-separated ids, the argmax at positions 0..255 (BOS not included).
  std::vector<int> reference;
  std::istringstream ids_text(file("model/greedy_reference_ids.txt"));
  for (int id = 0; ids_text >> id;) reference.push_back(id);
  ASSERT_EQ(reference.size(), 256u);
  ASSERT_EQ(std::vector<int>(reference.begin(), reference.begin() + 4),
            (std::vector<int>{403, 407, 261, 378}));

  ll::Engine<float> e = engine(standard());
  const std::vector<int> generated = ll::generate_greedy(e, {ll::kBos}, 256);
  EXPECT_EQ(generated, reference);
  EXPECT_EQ(e.position(), 256);  // BOS and 255 generated tokens were fed; the last is not

  // The text file is llama2.c's printout: the decoded tokens and a final newline.
  const std::string text = file("model/greedy_reference.txt");
  ASSERT_FALSE(text.empty());
  ASSERT_EQ(text.back(), '\n');
  EXPECT_EQ(tokenizer().decode(generated), text.substr(0, text.size() - 1));
}

TEST_F(Llama2c, ResetStartsANewSequence) {
  vc::KVCacheConfig cfg;  // squeeze: the coordinator must be reset too
  cfg.squeeze_calibration_tokens = 1;  // report on the first call (docs/design.md 5.4)
  cfg.squeeze_budget = 24;
  ll::Engine<float> e = engine(cfg, true);
  const std::vector<int> first = ll::generate_greedy(e, sample_ids(20), 40);
  EXPECT_EQ(e.position(), 20 + 40 - 1);
  e.reset();
  EXPECT_EQ(e.position(), 0);
  EXPECT_EQ(ll::generate_greedy(e, sample_ids(20), 40), first);
}

// --- 2. Every policy with room for the whole sequence equals the full cache -------------------

TEST_F(Llama2c, EveryPolicyWithBudgetAtLeastTheLengthMatchesTheFullCacheExactly) {
  const std::vector<int> tokens = sample_ids(kLength);
  ll::Engine<float> full = engine(standard());
  const std::vector<Eigen::MatrixXf> reference = teacher_forced(full, tokens, kPrefill);
  // With real queries the engine's attention goes through attend (the cache computes it): the
  // reference is then the full cache through attend too (it ignores the queries' scoring).
  ll::Engine<float> full_attend = engine(standard(), true);
  const std::vector<Eigen::MatrixXf> reference_attend = teacher_forced(full_attend, tokens, kPrefill);
  EXPECT_EQ(full.kept_bytes(), full.full_seq_bytes());
  // 5 layers x 4 KV heads x 70 positions x (8 + 8) floats
  EXPECT_EQ(full.full_seq_bytes(), 5u * 4u * kLength * 16u * sizeof(float));

  constexpr int L = static_cast<int>(kLength);
  std::vector<vc::KVCacheConfig> configs(6);
  configs[0].method = "squeeze";  // average 512; the test checks every layer got >= L
  configs[0].squeeze_budget = 512;
  configs[1].method = "h2o";
  configs[1].h2o_budget = L;
  configs[2].method = "pyramidkv";  // a gentle taper, so the smallest layer still has >= L
  configs[2].pyramid_budget = 256;
  configs[2].pyramid_beta = 1.5;
  configs[3].method = "tova";
  configs[3].tova_budget = L;
  configs[4].method = "streaming_llm";
  configs[4].stream_window_size = L;
  configs[5].method = "snapkv";
  configs[5].snap_budget = L;

  for (const vc::KVCacheConfig& cfg : configs) {
    for (const bool queries : {false, true}) {
      SCOPED_TRACE(cfg.method + (queries ? " with real queries" : " with the key proxy"));
      ll::Engine<float> e = engine(cfg, queries);
      const std::vector<Eigen::MatrixXf> got = teacher_forced(e, tokens, kPrefill, [&] {
        for (const auto& c : e.caches()) ASSERT_EQ(c->tokens_kept(), e.position());  // no eviction
      });
      const std::vector<Eigen::MatrixXf>& want = queries ? reference_attend : reference;
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t call = 0; call < got.size(); ++call) {
        EXPECT_TRUE(got[call] == want[call])
            << "call " << call << ": max |diff| " << (got[call] - want[call]).cwiseAbs().maxCoeff();
      }
      for (const auto& c : e.caches()) {
        const std::optional<int> budget = layer_budget(*c);
        ASSERT_TRUE(budget.has_value());
        EXPECT_GE(*budget, L) << "the configuration does not leave room for the whole sequence";
      }
      EXPECT_EQ(e.kept_bytes(), full.kept_bytes());
      EXPECT_EQ(e.full_seq_bytes(), full.full_seq_bytes());
    }
  }
}

// --- 3. A small budget evicts, stays within budget and changes the logits ---------------------

TEST_F(Llama2c, SmallBudgetsStayWithinBudgetAndDifferFromTheFullCache) {
  const std::vector<int> tokens = sample_ids(kLength);
  ll::Engine<float> full = engine(standard());
  const std::vector<Eigen::MatrixXf> reference = teacher_forced(full, tokens, kPrefill);
  ll::Engine<float> full_attend = engine(standard(), true);  // the same attention path (attend)
  const std::vector<Eigen::MatrixXf> reference_attend = teacher_forced(full_attend, tokens, kPrefill);

  std::vector<vc::KVCacheConfig> configs(5);
  configs[0].method = "h2o";
  configs[0].h2o_budget = 16;
  configs[1].method = "squeeze";
  configs[1].squeeze_budget = 16;
  configs[2].method = "pyramidkv";
  configs[2].pyramid_budget = 16;
  configs[3].method = "tova";
  configs[3].tova_budget = 16;
  configs[4].method = "streaming_llm";
  configs[4].stream_window_size = 12;  // + 4 sinks

  for (const vc::KVCacheConfig& cfg : configs) {
    for (const bool queries : {false, true}) {
      SCOPED_TRACE(cfg.method + (queries ? " with real queries" : " with the key proxy"));
      ll::Engine<float> e = engine(cfg, queries);
      const std::vector<Eigen::MatrixXf> got = teacher_forced(e, tokens, kPrefill, [&] {
        for (const auto& c : e.caches()) {
          const std::optional<int> budget = layer_budget(*c);
          ASSERT_TRUE(budget.has_value());
          EXPECT_LE(c->tokens_kept(), *budget);
        }
      });
      for (const Eigen::MatrixXf& logits : got) EXPECT_TRUE(logits.allFinite());
      // The prefill attends over the whole prompt whatever the budget; decode steps after
      // eviction see fewer rows, so their logits differ.
      const std::vector<Eigen::MatrixXf>& want = queries ? reference_attend : reference;
      EXPECT_TRUE(got.front() == want.front());
      EXPECT_FALSE(got.back() == want.back());
      EXPECT_LT(e.kept_bytes(), e.full_seq_bytes() / 2);
    }
  }

  // SnapKV compresses the first call longer than its budget; decode steps then append.
  vc::KVCacheConfig snap;
  snap.method = "snapkv";
  snap.snap_budget = 16;
  ll::Engine<float> e = engine(snap, true);
  e.forward(
      std::vector<int>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(kPrefill)));
  for (const auto& c : e.caches()) EXPECT_EQ(c->tokens_kept(), 16);
  Eigen::MatrixXf last;
  for (std::size_t i = kPrefill; i < kLength; ++i) last = e.forward({tokens[i]});
  for (const auto& c : e.caches()) EXPECT_EQ(c->tokens_kept(), 16 + static_cast<int>(kDecode));
  EXPECT_TRUE(last.allFinite());
  EXPECT_FALSE(last == reference.back());
}

TEST_F(Llama2c, HalfAndBfloat16StorageStayCloseToFloat) {
  const std::vector<int> tokens = sample_ids(200);
  const Eigen::MatrixXf ref = engine(standard()).forward(tokens);
  const Eigen::MatrixXf half = engine<Eigen::half>(standard()).forward(tokens);
  const Eigen::MatrixXf bf16 = engine<Eigen::bfloat16>(standard()).forward(tokens);
  int agree_half = 0, agree_bf16 = 0;
  for (Eigen::Index i = 0; i < ref.rows(); ++i) {
    Eigen::Index a = 0, b = 0, c = 0;
    ref.row(i).maxCoeff(&a);
    half.row(i).maxCoeff(&b);
    bf16.row(i).maxCoeff(&c);
    agree_half += a == b;
    agree_bf16 += a == c;
  }
  EXPECT_GE(agree_half, 196);  // top-1 agreement >= 98%
  EXPECT_GE(agree_bf16, 190);  // >= 95%
  EXPECT_LT((half - ref).cwiseAbs().maxCoeff(), 0.25f);
  EXPECT_LT((bf16 - ref).cwiseAbs().maxCoeff(), 1.0f);
}

/// The engine's attention through attend (the cache computes it, fused with its scoring) and
/// through update_and_view plus the engine's own Eigen attention give the same logits, for every
/// method with a budget that evicts, in float and half storage (docs/design.md 2.8).
TEST_F(Llama2c, FusedAttendAndTheViewPathGiveTheSameLogits) {
  const std::vector<int> tokens = sample_ids(kLength);
  for (const vc::detail::MethodSpec& m : vc::detail::kMethodTable) {  // every method
    const char* method = m.name;
    vc::KVCacheConfig cfg;
    cfg.method = method;
    cfg.set_budget(24);
    const auto run = [&](auto storage, ll::AttentionPath path) {
      using T = decltype(storage);
      ll::Engine<T> e(model(), vc::KVCacheBuilder::for_model<T>(model().config().n_layers, cfg), true, path);
      return teacher_forced(e, tokens, kPrefill);
    };
    // Relative to the call's largest logit (|logit| reaches ~15): the two paths round differently
    // (another exp, another summation order), nothing else.
    const auto worst_relative = [&](const auto& a, const auto& b) {
      float worst = 0.0f;
      for (std::size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, (a[i] - b[i]).cwiseAbs().maxCoeff() / std::max(1.0f, b[i].cwiseAbs().maxCoeff()));
      }
      return worst;
    };
    const auto fused = run(0.0f, ll::AttentionPath::fused), view = run(0.0f, ll::AttentionPath::view);
    ASSERT_EQ(fused.size(), view.size());
    EXPECT_LE(worst_relative(fused, view), 1e-5f) << method << ", float";
    // In half storage a rounding difference of 1e-7 in a layer's output can move a key of the next
    // layer by one half ulp (1e-3 relative), so the paths agree less closely, but on every argmax
    // (checked for the flagship method: each run costs seconds under the sanitizers).
    if (std::string(method) != "squeeze") continue;
    const auto fused_h = run(Eigen::half(0), ll::AttentionPath::fused);
    const auto view_h = run(Eigen::half(0), ll::AttentionPath::view);
    EXPECT_LE(worst_relative(fused_h, view_h), 2e-3f) << method << ", half";
    for (std::size_t i = 0; i < fused_h.size(); ++i) {
      for (Eigen::Index r = 0; r < fused_h[i].rows(); ++r) {
        Eigen::Index a = 0, b = 0;
        fused_h[i].row(r).maxCoeff(&a);
        view_h[i].row(r).maxCoeff(&b);
        EXPECT_EQ(a, b) << method << ", half, call " << i << ", row " << r;
      }
    }
  }
}

/// Adaptive head budgets (SPEC 14) leave the heads of a layer with different numbers of rows; the
/// engine serves them through attend and through the view path (per-head rows, KVView::rows(b, h)),
/// never update_and_fetch. Both paths agree, the layer's pool holds what uniform heads hold, and
/// with queries floor 1 is uniform heads exactly.
TEST_F(Llama2c, AdaptiveHeadsRunOnBothAttentionPaths) {
  const std::vector<int> tokens = sample_ids(kLength);
  for (const char* method : {"squeeze", "h2o", "pyramidkv"}) {
    SCOPED_TRACE(method);
    vc::KVCacheConfig uniform;
    uniform.method = method;
    uniform.set_budget(24);
    vc::KVCacheConfig adaptive = uniform;
    adaptive.head_budgets = "adaptive";
    const auto run = [&](const vc::KVCacheConfig& cfg, bool queries, ll::AttentionPath path,
                         bool* ragged = nullptr, std::size_t* kept = nullptr) {
      ll::Engine<float> e(model(),
                          vc::KVCacheBuilder::for_model<float>(model().config().n_layers, cfg),
                          queries, path);
      auto out = teacher_forced(e, tokens, kPrefill);
      if (ragged != nullptr) {
        *ragged = false;
        for (const auto& c : e.caches()) {
          for (int h = 1; h < model().config().n_kv_heads; ++h)
            *ragged = *ragged || c->positions(0, h).size() != c->positions(0, 0).size();
        }
      }
      if (kept != nullptr) *kept = e.kept_bytes();
      return out;
    };
    const auto worst_relative = [&](const auto& a, const auto& b) {
      float worst = 0.0f;
      for (std::size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, (a[i] - b[i]).cwiseAbs().maxCoeff() /
                                    std::max(1.0f, b[i].cwiseAbs().maxCoeff()));
      }
      return worst;
    };
    bool ragged_fused = false, ragged_proxy = false;
    std::size_t kept_adaptive = 0, kept_uniform = 0, kept_proxy = 0;
    const auto fused = run(adaptive, true, ll::AttentionPath::fused, &ragged_fused, &kept_adaptive);
    const auto view = run(adaptive, true, ll::AttentionPath::view);
    EXPECT_TRUE(ragged_fused)
        << "the heads never differed: the test does not exercise ragged heads";
    EXPECT_LE(worst_relative(fused, view), 1e-5f);
    const auto uniform_fused = run(uniform, true, ll::AttentionPath::fused, nullptr, &kept_uniform);
    EXPECT_EQ(kept_adaptive, kept_uniform);  // the pool: H x b rows per layer, as uniform heads
    EXPECT_FALSE(fused.back() == uniform_fused.back());
    // Without queries the engine takes the view path (attend needs the queries).
    const auto proxy = run(adaptive, false, ll::AttentionPath::view, &ragged_proxy, &kept_proxy);
    EXPECT_TRUE(ragged_proxy);
    EXPECT_EQ(kept_proxy, kept_uniform);
    for (const Eigen::MatrixXf& logits : proxy) EXPECT_TRUE(logits.allFinite());
    // Floor 1: every head keeps exactly b, so with queries adaptive heads are uniform ones.
    vc::KVCacheConfig floor1 = adaptive;
    floor1.head_budget_floor = 1.0;
    const auto at_floor1 = run(floor1, true, ll::AttentionPath::fused);
    ASSERT_EQ(at_floor1.size(), uniform_fused.size());
    for (std::size_t i = 0; i < at_floor1.size(); ++i)
      EXPECT_TRUE(at_floor1[i] == uniform_fused[i]) << "call " << i;
  }
}

/// llama2.c's run.c feeds the prompt one token per call. With the calibration window
/// (squeeze_calibration_tokens, default 32) every layer gets the budget it gets when the same
/// prompt comes as one prefill call, on the real model: and the budgets are not all the average.
/// (A 32-token prompt: both ways measure the same 32 keys. A longer prefill call is measured
/// whole, docs/design.md 5.2.)
TEST_F(Llama2c, TokenAtATimePromptGetsThePrefillBudgets) {
  const std::vector<int> prompt = sample_ids(32);
  vc::KVCacheConfig cfg;  // squeeze, calibration over 32 tokens
  cfg.set_budget(24);
  ll::Engine<float> prefill = engine(cfg, true), by_token = engine(cfg, true);
  (void)prefill.forward(prompt);
  for (const int id : prompt) (void)by_token.forward({id});
  std::set<int> budgets;
  for (int l = 0; l < model().config().n_layers; ++l) {
    const auto& a = dynamic_cast<const vc::SqueezeAttentionCache<float>&>(*prefill.caches()[static_cast<std::size_t>(l)]);
    const auto& b = dynamic_cast<const vc::SqueezeAttentionCache<float>&>(*by_token.caches()[static_cast<std::size_t>(l)]);
    EXPECT_TRUE(a.calibrated() && b.calibrated()) << l;
    // Layer 1's keys come from layer 0's outputs, computed by a prefill GEMM in one engine and by
    // one-row products in the other: float rounding apart, nothing more.
    EXPECT_NEAR(a.concentration(), b.concentration(), 1e-3) << l;
    EXPECT_EQ(a.layer_budget(), b.layer_budget()) << l;
    budgets.insert(b.layer_budget());
  }
  // The last layer's report completed the set; the others adopt at their next call.
  (void)prefill.forward({prompt.back()});
  (void)by_token.forward({prompt.back()});
  for (const auto* e : {&prefill, &by_token}) {
    for (const auto& c : e->caches()) {
      EXPECT_TRUE(dynamic_cast<const vc::SqueezeAttentionCache<float>&>(*c).budget_adopted());
    }
  }
  EXPECT_GT(budgets.size(), 1u) << "every layer got the same budget";
}

/// A prompt cache on the real model (docs/design.md G): the caches saved right after the prompt
/// and loaded into a fresh engine go on with bitwise the logits of the engine never saved, step
/// after step (quantized rows, real queries, fused attention), so greedy decoding tells the same
/// story.
TEST_F(Llama2c, APromptCacheContinuesWithBitIdenticalLogits) {
  const std::vector<int> prompt = sample_ids(40);
  for (const char* method : {"squeeze", "h2o", "snapkv", "streaming_llm"}) {
    vc::KVCacheConfig cfg;
    cfg.method = method;
    cfg.set_budget(24);
    cfg.key_bits = 8;
    cfg.value_bits = 4;
    cfg.quant_group = 8;
    ll::Engine<Eigen::half> kept = engine<Eigen::half>(cfg, true);
    ll::Engine<Eigen::half> saved = engine<Eigen::half>(cfg, true);
    const Eigen::MatrixXf first = kept.forward(prompt);
    (void)saved.forward(prompt);
    std::ostringstream out;
    vc::save_prompt_cache(out, saved.caches(), {{"method", method}});
    std::istringstream in(out.str());
    vc::PromptCache<Eigen::half> loaded = vc::load_prompt_cache<Eigen::half>(in);
    ll::Engine<Eigen::half> resumed(model(), std::move(loaded.caches), true);
    int next = ll::predicted_token(first);
    for (int step = 0; step < 40; ++step) {
      const Eigen::MatrixXf a = kept.forward({next}), b = resumed.forward({next});
      ASSERT_EQ(a.size(), b.size());
      ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())), 0)
          << method << ": logits differ at step " << step;
      next = ll::predicted_token(a);
    }
    EXPECT_EQ(resumed.position(), kept.position());
  }
}

// --- Serving: samples from forks, speculative decoding (docs/design.md 10) ---------------------

/// N continuations of one prompt from forks of its prefilled caches: each sampled continuation is
/// token for token the one a fresh engine gives after its own prefill with the same sampler seed,
/// under policies that evict (quantized rows too); the samples differ from one another.
TEST_F(Llama2c, SamplesFromForksOfAPrefilledPromptEqualFreshRuns) {
  const std::vector<int> prompt = sample_ids(40);
  for (const char* method : {"squeeze", "h2o", "snapkv", "standard"}) {
    vc::KVCacheConfig cfg;
    cfg.method = method;
    cfg.set_budget(24);
    cfg.key_bits = 8;
    cfg.quant_group = 8;
    ll::Engine<Eigen::half> prefilled = engine<Eigen::half>(cfg, true);
    const Eigen::MatrixXf logits = prefilled.forward(prompt);
    std::vector<std::vector<int>> samples;
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      ll::Engine<Eigen::half> forked = prefilled.fork();
      ll::Sampler sampler(0.9f, seed);
      const std::vector<int> got = ll::sample_from(forked, sampler.sample(logits), 60, sampler);
      ll::Engine<Eigen::half> fresh = engine<Eigen::half>(cfg, true);
      ll::Sampler again(0.9f, seed);
      const Eigen::MatrixXf fresh_logits = fresh.forward(prompt);
      const std::vector<int> want = ll::sample_from(fresh, again.sample(fresh_logits), 60, again);
      EXPECT_EQ(got, want) << method << ", seed " << seed;
      EXPECT_GT(got.size(), 20u) << method;
      samples.push_back(got);
    }
    EXPECT_NE(samples[0], samples[1]) << method << ": the samples are all alike";
    EXPECT_EQ(prefilled.position(), static_cast<std::int64_t>(prompt.size()))
        << method << ": sampling the forks moved the source";
  }
}

/// Greedy speculative decoding: a StreamingLLM draft set over the same model proposes k tokens,
/// the main set verifies them in one call between checkpoint and rollback and then takes the
/// accepted ones in one call. With a main set that keeps every row the text is token for token
/// plain greedy decoding's; the draft is right often enough that rounds are fewer than tokens.
/// (Evicting main sets: the next test.)
TEST_F(Llama2c, SpeculativeDecodingGivesPlainGreedyText) {
  const std::vector<int> prompt = sample_ids(24);
  vc::KVCacheConfig draft_cfg;
  draft_cfg.method = "streaming_llm";
  draft_cfg.set_budget(16);
  for (const char* method : {"standard", "squeeze"}) {
    vc::KVCacheConfig cfg;
    cfg.method = method;
    cfg.set_budget(512);  // never reached: the policy keeps every row
    ll::Engine<float> plain = engine<float>(cfg, true);
    const std::vector<int> want = ll::generate_greedy(plain, prompt, 120);
    for (const int k : {1, 3, 6}) {
      ll::Engine<float> main = engine<float>(cfg, true);
      ll::Engine<float> draft = engine<float>(draft_cfg, true);
      const int next = ll::predicted_token(main.forward(prompt));
      (void)draft.forward(prompt);
      const ll::SpeculativeRun run = ll::speculative_from(main, draft, next, 120, k);
      EXPECT_EQ(run.tokens, want) << method << ", k = " << k;
      EXPECT_GT(run.accepted, 0) << method << ", k = " << k;
      if (k > 1) {
        EXPECT_LT(run.rounds, static_cast<std::int64_t>(want.size())) << method << ", k = " << k;
      }
    }
  }
}

/// With a main set that evicts (squeeze, h2o, tova and snapkv at budget 24 with real queries,
/// half rows, a prompt of 40 tokens), the accepted tokens taken one call each
/// (Accept::token_by_token) make exactly the calls of plain greedy decoding after the rollback,
/// so the text is plain greedy's with every policy and k; the rollbacks are what make that
/// possible (the verifying call evicted).
TEST_F(Llama2c, SpeculativeDecodingTokenByTokenGivesPlainGreedyTextWithEvictingSets) {
  const std::vector<int> prompt = sample_ids(40);
  vc::KVCacheConfig draft_cfg;
  draft_cfg.method = "streaming_llm";
  draft_cfg.set_budget(16);
  for (const char* method : {"squeeze", "h2o", "tova", "snapkv"}) {
    vc::KVCacheConfig cfg;
    cfg.method = method;
    cfg.set_budget(24);
    using H = Eigen::half;
    ll::Engine<H> plain = engine<H>(cfg, true);
    const std::vector<int> want = ll::generate_greedy(plain, prompt, 100);
    for (const int k : {2, 5}) {
      ll::Engine<H> main = engine<H>(cfg, true);
      ll::Engine<float> draft = engine<float>(draft_cfg, true);
      const int next = ll::predicted_token(main.forward(prompt));
      (void)draft.forward(prompt);
      const ll::SpeculativeRun run =
          ll::speculative_from(main, draft, next, 100, k, ll::Accept::token_by_token);
      EXPECT_EQ(run.tokens, want) << method << ", k = " << k;
      EXPECT_GT(run.accepted, 0) << method << ", k = " << k;
      EXPECT_LT(main.caches().front()->tokens_kept(), main.position()) << method << ": no eviction";
    }
  }
}

// --- 4. Tokenizer -----------------------------------------------------------------------------

TEST_F(Llama2c, TokenizerEncodesLikeLlama2c) {
  const ll::Tokenizer& tok = tokenizer();
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.encode("Once upon a time", true), (std::vector<int>{1, 403, 407, 261, 378}));
  EXPECT_EQ(tok.encode("Once upon a time", false), (std::vector<int>{403, 407, 261, 378}));
  EXPECT_EQ(tok.encode("", true), std::vector<int>{1});
  EXPECT_TRUE(tok.encode("", false).empty());
  // A newline has no piece: byte fallback 0x0A + 3.
  const std::vector<int> nl = tok.encode("a\nb", false);
  EXPECT_NE(std::find(nl.begin(), nl.end(), 0x0A + 3), nl.end());
  // The typographic quotes are single pieces.
  EXPECT_EQ(tok.decode(0, 465), "\xE2\x80\x9C");
  EXPECT_EQ(tok.decode(0, 466), "\xE2\x80\x9D");
}

TEST_F(Llama2c, TokenizerDecodesPieces) {
  const ll::Tokenizer& tok = tokenizer();
  EXPECT_EQ(tok.decode(ll::kBos, 403), "Once");  // the leading space of the first piece is dropped
  EXPECT_EQ(tok.decode(403, 407), " upon");
  EXPECT_EQ(tok.decode(403, 0x0A + 3), "\n");  // <0x0A>
  EXPECT_EQ(tok.decode(403, 0xE2 + 3), "\xE2");
  EXPECT_EQ(tok.decode({1, 403, 407, 261, 378}), "Once upon a time");
  EXPECT_EQ(tok.decode({403, 407, 261, 378}), "Once upon a time");
  EXPECT_THROW(tok.decode(1, 512), std::invalid_argument);
  EXPECT_THROW(tok.decode(1, -1), std::invalid_argument);
}

TEST_F(Llama2c, TokenizerRoundTripsTheSampleText) {
  const ll::Tokenizer& tok = tokenizer();
  // Starts with an empty line, has <|endoftext|> lines and typographic quotes.
  const std::string text = file("text/tinystories_sample.txt");
  const std::vector<int> ids = tok.encode(text, true);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 465), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), 466), ids.end());
  EXPECT_LT(ids.size(), text.size() * 2 / 3);  // merges happened

  // Code points without a piece go through byte fallback and come back intact.
  const std::string rare = "na\xC3\xAFve caf\xC3\xA9 \xF0\x9F\x99\x82 \xE2\x80\x94 end";
  const std::vector<int> rare_ids = tok.encode(rare, true);
  EXPECT_NE(std::find(rare_ids.begin(), rare_ids.end(), 0xF0 + 3), rare_ids.end());
  EXPECT_EQ(tok.decode(rare_ids), rare);
}

TEST_F(Llama2c, TokenizerReencodesTheGreedyReference) {
  std::vector<int> reference{ll::kBos};
  std::istringstream ids_text(file("model/greedy_reference_ids.txt"));
  for (int id = 0; ids_text >> id;) reference.push_back(id);
  EXPECT_EQ(tokenizer().encode(tokenizer().decode(reference), true), reference);
}

// --- 5. Errors --------------------------------------------------------------------------------

/// A fresh directory under the system temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("veloxquant_llama2c_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

/// Runs f, expecting an exception E whose message contains every one of `parts`.
template <class E, class F>
void expect_error(F f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception thrown";
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
    }
  }
}

/// The checkpoint with header field i (0..6) replaced.
std::string with_header_field(std::string bytes, int i, std::int32_t value) {
  std::memcpy(&bytes[static_cast<std::size_t>(i) * 4], &value, 4);
  return bytes;
}

TEST_F(Llama2c, ModelLoaderRejectsBadFilesNamingTheProblem) {
  const TempDir tmp;
  const std::string original = file("model/stories260K.bin");
  const auto load_bytes = [&](const std::string& name, const std::string& bytes) {
    write_bytes(tmp / name, bytes);
    return [path = (tmp / name).string()] { ll::Model::load(path); };
  };
  const std::string missing = (tmp / "missing.bin").string();
  expect_error<std::runtime_error>([&] { ll::Model::load(missing); }, {missing, "cannot open"});
  expect_error<std::runtime_error>(load_bytes("short.bin", original.substr(0, 10)),
                                   {"short.bin", "shorter than the 28-byte header"});
  expect_error<std::runtime_error>(
      load_bytes("truncated.bin", original.substr(0, 500000)),
      {"truncated.bin", "500000 bytes", "expected 1056540 bytes", "or 1040156 bytes"});
  expect_error<std::runtime_error>(load_bytes("long.bin", original + "abcd"),
                                   {"long.bin", "1056544 bytes", "expected 1056540"});
  expect_error<std::runtime_error>(load_bytes("dim.bin", with_header_field(original, 0, 63)),
                                   {"dim.bin", "dim (63)", "n_heads (8)"});
  expect_error<std::runtime_error>(load_bytes("kv.bin", with_header_field(original, 4, 3)),
                                   {"kv.bin", "n_kv_heads (3)"});
  expect_error<std::runtime_error>(load_bytes("layers.bin", with_header_field(original, 2, 0)),
                                   {"layers.bin", "n_layers = 0"});
  expect_error<std::runtime_error>(load_bytes("huge.bin", with_header_field(original, 1, 2000000)),
                                   {"huge.bin", "hidden_dim = 2000000"});
  expect_error<std::runtime_error>(load_bytes("big.bin", with_header_field(original, 6, 1000000)),
                                   {"big.bin", "matches no layout"});
  expect_error<std::runtime_error>(load_bytes("garbage.bin", std::string(4096, '\x7f')),
                                   {"garbage.bin", "bad header"});
}

TEST_F(Llama2c, ModelLoaderAcceptsTheOtherLayouts) {
  const TempDir tmp;
  const std::string original = file("model/stories260K.bin");
  const std::vector<int> tokens = sample_ids(30);
  const Eigen::MatrixXf reference = engine(standard()).forward(tokens);
  const auto logits_of = [&](const ll::Model& m) {
    ll::Engine<float> e(m, vc::KVCacheBuilder::for_model<float>(m.config().n_layers, standard()));
    return e.forward(tokens);
  };
  constexpr std::size_t kFreqCis = 1040156;  // byte offset of the legacy freq_cis block

  // Without the freq_cis block.
  write_bytes(tmp / "nofreq.bin", original.substr(0, kFreqCis));
  const ll::Model nofreq = ll::Model::load((tmp / "nofreq.bin").string());
  EXPECT_TRUE(logits_of(nofreq) == reference);

  // A negative vocab_size: an own classifier follows; here twice the embedding, so the logits
  // double exactly.
  std::string embedding = original.substr(28, 512 * 64 * 4);
  for (std::size_t i = 0; i < embedding.size(); i += 4) {
    float f = 0.0f;
    std::memcpy(&f, &embedding[i], 4);
    f *= 2.0f;
    std::memcpy(&embedding[i], &f, 4);
  }
  write_bytes(tmp / "wcls.bin", with_header_field(original, 5, -512) + embedding);
  const ll::Model own = ll::Model::load((tmp / "wcls.bin").string());
  EXPECT_FALSE(own.shared_classifier());
  EXPECT_EQ(own.config().vocab_size, 512);
  EXPECT_TRUE(logits_of(own) == (2.0f * reference).eval());
  // ... and without it the size is wrong.
  write_bytes(tmp / "nowcls.bin", with_header_field(original, 5, -512));
  expect_error<std::runtime_error>([&] { ll::Model::load((tmp / "nowcls.bin").string()); },
                                   {"nowcls.bin", "matches no layout"});
}

TEST_F(Llama2c, TokenizerLoaderRejectsBadFiles) {
  const TempDir tmp;
  const std::string original = file("model/tok512.bin");
  const auto load_bytes = [&](const std::string& name, const std::string& bytes, int vocab) {
    write_bytes(tmp / name, bytes);
    return [path = (tmp / name).string(), vocab] { ll::Tokenizer::load(path, vocab); };
  };
  const std::string missing = (tmp / "missing.bin").string();
  expect_error<std::runtime_error>([&] { ll::Tokenizer::load(missing, 512); },
                                   {missing, "cannot open"});
  expect_error<std::runtime_error>(load_bytes("empty.bin", "", 512), {"empty.bin", "truncated"});
  expect_error<std::runtime_error>(load_bytes("cut.bin", original.substr(0, 3000), 512),
                                   {"cut.bin", "truncated"});
  expect_error<std::runtime_error>(load_bytes("more.bin", original, 600),
                                   {"more.bin", "truncated", "token 512"});
  std::string bad_len = original;
  const std::int32_t huge = 1 << 20;
  std::memcpy(&bad_len[4 + 4], &huge, 4);  // the length of token 0
  expect_error<std::runtime_error>(load_bytes("len.bin", bad_len, 512),
                                   {"len.bin", "token 0", "length 1048576"});
  expect_error<std::runtime_error>(load_bytes("max.bin", std::string(8, '\0'), 512),
                                   {"max.bin", "max_token_length 0"});
  EXPECT_THROW(ll::Tokenizer::load((tmp / "more.bin").string(), 0), std::invalid_argument);
  // A smaller vocabulary reads a prefix of the records.
  write_bytes(tmp / "ok.bin", original);
  EXPECT_EQ(ll::Tokenizer::load((tmp / "ok.bin").string(), 300).vocab_size(), 300);
}

TEST_F(Llama2c, EngineRejectsBadArgumentsWithoutChangingState) {
  const int n_layers = model().config().n_layers;
  expect_error<std::invalid_argument>(
      [&] {
        ll::Engine<float> e(model(),
                            vc::KVCacheBuilder::for_model<float>(n_layers - 1, standard()));
      },
      {"4 caches", "5 layers"});
  expect_error<std::invalid_argument>(
      [&] {
        auto caches = vc::KVCacheBuilder::for_model<float>(n_layers, standard());
        caches[2].reset();
        ll::Engine<float> e(model(), std::move(caches));
      },
      {"layer 2", "null"});

  ll::Engine<float> e = engine(standard());
  e.forward({1, 403, 407});
  expect_error<std::invalid_argument>([&] { e.forward({}); }, {"no tokens"});
  expect_error<std::invalid_argument>([&] { e.forward({261, 512}); }, {"token id 512", "index 1"});
  expect_error<std::invalid_argument>([&] { e.forward({-1}); }, {"token id -1"});
  expect_error<std::invalid_argument>([&] { e.forward(std::vector<int>(510, 261)); },
                                      {"510 tokens at position 3", "seq_len 512"});
  EXPECT_EQ(e.position(), 3);
  for (const auto& c : e.caches()) EXPECT_EQ(c->offset(), 3);
  // Exactly up to seq_len is fine; one more is not.
  e.forward(std::vector<int>(509, 261));
  EXPECT_EQ(e.position(), 512);
  EXPECT_THROW(e.forward({261}), std::invalid_argument);
  EXPECT_THROW(ll::generate_greedy(e, {}, 4), std::invalid_argument);
  e.reset();
  EXPECT_TRUE(ll::generate_greedy(e, {1}, 0).empty());
  // Generation stops at the end of the context.
  EXPECT_EQ(ll::generate_greedy(e, sample_ids(500), 100).size(), 13u);
  EXPECT_EQ(e.position(), 512);
}

// --- 6. NLL on TinyStories validation text ----------------------------------------------------

TEST_F(Llama2c, MeanNllOnValidationTextMatchesTheFixtureReadme) {
  // The first ~2,000 tokens of the text are encoded; merges are local, so their first 300 ids are
  // those of the whole file.
  const std::string text = file("text/tinystories_validation_head.txt").substr(0, 4000);

  // The README's figure (1.336 nats, perplexity 3.80 on the first 299 tokens) is reproduced by
  // the text's first 300 ids without BOS: 299 next-token predictions.
  std::vector<int> ids = tokenizer().encode(text, false);
  ids.resize(300);
  const double nll = mean_nll(engine(standard()).forward(ids), ids);
  EXPECT_NEAR(nll, 1.336, 0.01);

  // With BOS in front (BOS + the first 299 ids, 299 predictions) this engine measures 1.3725:
  // the text starts mid-sentence, which costs more after a BOS.
  std::vector<int> with_bos = tokenizer().encode(text, true);
  with_bos.resize(300);
  const double nll_bos = mean_nll(engine(standard()).forward(with_bos), with_bos);
  EXPECT_NEAR(nll_bos, 1.3725, 0.01);
}

}  // namespace
