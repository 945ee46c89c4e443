/// llama2c_generate: greedy text generation with a llama2.c checkpoint (stories260K) whose KV
/// cache is any veloxquant policy.
///
///   llama2c_generate [--fixtures DIR] [--method standard|squeeze|h2o|pyramidkv|tova|
///                    streaming_llm|snapkv] [--budget N] [--queries [--view]] [--steps N]
///                    [--prompt "text"] [--samples N [--temperature T] [--seed S]]
///                    [--speculative K [--draft-window W] [--exact]]
///                    [--kvzip KEEP [--kvzip-cue "text"]]
///
/// DIR holds model/stories260K.bin and model/tok512.bin (default: $VELOXQUANT_FIXTURES, else the
/// directory configured at build time). --budget sets the budget of every policy (the StreamingLLM
/// window); --queries passes the real queries to the caches (the cache then computes the attention,
/// attend; --view computes it in the engine over update_and_view instead); --steps is the number of
/// new tokens.
/// --samples N prefills the prompt once and samples N continuations (temperature T, default 0.9;
/// seeds S, S + 1, ...) from forks of its caches (KVCacheBuilder::fork). --speculative K decodes
/// greedily with speculative decoding: a draft pass over the same model with a StreamingLLM cache
/// set of window W (default 32) proposes K tokens, the main set verifies them in one call between
/// KVCacheBuilder::checkpoint and rollback, then takes the accepted tokens in one call (--exact:
/// one call per token, the calls of plain greedy decoding, so the text is plain greedy's with
/// every policy); it prints the acceptance rate, tokens per second against plain greedy
/// decoding, and whether the two texts are the same.
/// --kvzip KEEP (method kvzip, SPEC 18) prefills the prompt, then runs KVzip's procedure
/// (llama2c::kvzip_compress: a fork re-reads the prompt teacher-forced in chunks of 64 tokens,
/// each after the cue's tokens if given, its queries observed on the prompt's caches, which then
/// keep KEEP of their rows) and generates from the compressed caches; it prints the time of the
/// procedure against the prefill's.
/// The text goes to stdout, the statistics to stderr.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "llama2c.hpp"

#ifndef VELOXQUANT_FIXTURES_DEFAULT
#define VELOXQUANT_FIXTURES_DEFAULT "fixtures"
#endif

namespace vc = veloxquant::cache;
namespace ll = veloxquant::llama2c;

namespace {

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--fixtures DIR] [--method standard|squeeze|h2o|pyramidkv|tova|"
               "streaming_llm|snapkv]\n"
               "          [--budget N] [--queries [--view]] [--steps N] [--prompt \"text\"]\n"
               "          [--samples N [--temperature T] [--seed S]] [--speculative K "
               "[--draft-window W] [--exact]]\n"
               "          [--kvzip KEEP [--kvzip-cue \"text\"]]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ll::fixtures_dir(VELOXQUANT_FIXTURES_DEFAULT);
  std::string prompt;
  vc::KVCacheConfig cfg;
  cfg.method = "standard";
  bool queries = false;
  bool view = false;
  int steps = 256;
  int samples = 0, speculative = 0, draft_window = 32;
  bool exact = false;
  float temperature = 0.9f;
  double kvzip_keep = 0.0;
  std::string kvzip_cue;
  unsigned long long seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--queries") {
      queries = true;
    } else if (arg == "--view") {
      view = true;
    } else if (arg == "--fixtures" && has_value) {
      dir = argv[++i];
    } else if (arg == "--method" && has_value) {
      cfg.method = argv[++i];
    } else if (arg == "--budget" && has_value) {
      cfg.set_budget(std::atoi(argv[++i]));  // every method's budget
    } else if (arg == "--steps" && has_value) {
      steps = std::atoi(argv[++i]);
    } else if (arg == "--prompt" && has_value) {
      prompt = argv[++i];
    } else if (arg == "--samples" && has_value) {
      samples = std::atoi(argv[++i]);
    } else if (arg == "--temperature" && has_value) {
      temperature = static_cast<float>(std::atof(argv[++i]));
    } else if (arg == "--seed" && has_value) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--speculative" && has_value) {
      speculative = std::atoi(argv[++i]);
    } else if (arg == "--exact") {
      exact = true;
    } else if (arg == "--kvzip" && has_value) {
      kvzip_keep = std::atof(argv[++i]);
      cfg.method = "kvzip";
    } else if (arg == "--kvzip-cue" && has_value) {
      kvzip_cue = argv[++i];
    } else if (arg == "--draft-window" && has_value) {
      draft_window = std::atoi(argv[++i]);
    } else {
      return usage(argv[0]);
    }
  }

  try {
    const ll::Model model = ll::Model::load(dir + "/model/stories260K.bin");
    const ll::Tokenizer tokenizer =
        ll::Tokenizer::load(dir + "/model/tok512.bin", model.config().vocab_size);
    ll::Engine<float> engine(
        model, vc::KVCacheBuilder::for_model<float>(model.config().n_layers, cfg), queries,
        view ? ll::AttentionPath::view : ll::AttentionPath::fused);

    const std::vector<int> ids = tokenizer.encode(prompt, true);
    const auto text = [&](const std::vector<int>& generated) {
      std::vector<int> all = ids;
      all.insert(all.end(), generated.begin(), generated.end());
      return tokenizer.decode(all);
    };
    if (samples > 0) {
      // One prefill, then one fork of the prefilled caches per sample.
      const Eigen::MatrixXf logits = engine.forward(ids);
      for (int n = 0; n < samples; ++n) {
        ll::Engine<float> fork = engine.fork();
        ll::Sampler sampler(temperature, seed + static_cast<unsigned long long>(n));
        const std::vector<int> generated =
            ll::sample_from(fork, sampler.sample(logits), steps, sampler);
        std::printf("[sample %d, seed %llu] %s\n", n, seed + static_cast<unsigned long long>(n),
                    text(generated).c_str());
      }
      return 0;
    }
    if (speculative > 0) {
      vc::KVCacheConfig draft_cfg;
      draft_cfg.method = "streaming_llm";
      draft_cfg.set_budget(draft_window);
      const int n_layers = model.config().n_layers;
      ll::Engine<float> draft(model, vc::KVCacheBuilder::for_model<float>(n_layers, draft_cfg),
                              true);
      ll::Engine<float> plain(model, vc::KVCacheBuilder::for_model<float>(n_layers, cfg), queries,
                              view ? ll::AttentionPath::view : ll::AttentionPath::fused);
      auto t0 = std::chrono::steady_clock::now();
      const std::vector<int> greedy = ll::generate_greedy(plain, ids, steps);
      const std::chrono::duration<double> plain_s = std::chrono::steady_clock::now() - t0;
      t0 = std::chrono::steady_clock::now();
      const int next = ll::predicted_token(engine.forward(ids));
      (void)draft.forward(ids);
      const ll::SpeculativeRun run =
          ll::speculative_from(engine, draft, next, steps, speculative,
                               exact ? ll::Accept::token_by_token : ll::Accept::one_call);
      const std::chrono::duration<double> spec_s = std::chrono::steady_clock::now() - t0;
      std::printf("%s\n", text(run.tokens).c_str());
      std::fprintf(stderr,
                   "speculative decoding, k = %d, StreamingLLM draft window %d: %zu tokens in "
                   "%lld rounds; %lld of %lld draft tokens accepted (%.1f%%); %.1f tok/s against "
                   "%.1f tok/s plain greedy (%.2fx); same text as plain greedy: %s\n",
                   speculative, draft_window, run.tokens.size(), static_cast<long long>(run.rounds),
                   static_cast<long long>(run.accepted), static_cast<long long>(run.proposed),
                   run.proposed ? 100.0 * static_cast<double>(run.accepted) /
                                      static_cast<double>(run.proposed)
                                : 0.0,
                   static_cast<double>(ids.size() + run.tokens.size()) / spec_s.count(),
                   static_cast<double>(ids.size() + greedy.size()) / plain_s.count(),
                   plain_s.count() / spec_s.count(), run.tokens == greedy ? "yes" : "no");
      return 0;
    }
    if (kvzip_keep > 0.0) {
      // Prefill, then KVzip's procedure on the prefilled caches, each timed.
      auto t0 = std::chrono::steady_clock::now();
      const Eigen::MatrixXf logits = engine.forward(ids);
      const std::chrono::duration<double> prefill_s = std::chrono::steady_clock::now() - t0;
      const std::size_t before = engine.kept_bytes();
      const std::vector<int> cue =
          kvzip_cue.empty() ? std::vector<int>{} : tokenizer.encode(kvzip_cue, false);
      t0 = std::chrono::steady_clock::now();
      ll::kvzip_compress(engine, ids, kvzip_keep, cue);
      const std::chrono::duration<double> kvzip_s = std::chrono::steady_clock::now() - t0;
      const std::size_t after = engine.kept_bytes();
      const std::vector<int> generated =
          ll::generate_from(engine, ll::predicted_token(logits), steps);
      std::printf("%s\n", text(generated).c_str());
      std::fprintf(stderr,
                   "kvzip, keep %.3f%s: prompt %zu tokens, KV bytes %zu -> %zu after the "
                   "compress (%zu at the end); prefill %.2f ms, re-read + observe + compress "
                   "%.2f ms (%.2fx the prefill)\n",
                   kvzip_keep, cue.empty() ? "" : " (with a cue)", ids.size(), before,
                   after, engine.kept_bytes(), 1e3 * prefill_s.count(),
                   1e3 * kvzip_s.count(), kvzip_s.count() / prefill_s.count());
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int> generated = ll::generate_greedy(engine, ids, steps);
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;

    std::vector<int> all = ids;
    all.insert(all.end(), generated.begin(), generated.end());
    std::printf("%s\n", tokenizer.decode(all).c_str());

    std::int64_t kept = 0;
    for (const auto& c : engine.caches()) kept += c->tokens_kept();
    std::fprintf(stderr,
                 "method %s%s: %zu prompt + %zu generated tokens, %.1f tok/s; rows kept per "
                 "head (mean over layers) %.1f of %lld; KV bytes kept %zu of %zu\n",
                 cfg.method.c_str(), queries ? " (real queries)" : "", ids.size(), generated.size(),
                 static_cast<double>(ids.size() + generated.size()) / seconds.count(),
                 static_cast<double>(kept) / static_cast<double>(engine.caches().size()),
                 static_cast<long long>(engine.position()), engine.kept_bytes(),
                 engine.full_seq_bytes());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
