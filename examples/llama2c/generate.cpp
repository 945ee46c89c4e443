/// llama2c_generate: greedy text generation with a llama2.c checkpoint (stories260K) whose KV
/// cache is any veloxquant policy.
///
///   llama2c_generate [--fixtures DIR] [--method standard|squeeze|h2o|pyramidkv|tova|
///                    streaming_llm|snapkv] [--budget N] [--queries [--view]] [--steps N]
///                    [--prompt "text"]
///
/// DIR holds model/stories260K.bin and model/tok512.bin (default: $VELOXQUANT_FIXTURES, else the
/// directory configured at build time). --budget sets the budget of every policy (the StreamingLLM
/// window); --queries passes the real queries to the caches (the cache then computes the attention,
/// attend; --view computes it in the engine over update_and_view instead); --steps is the number of
/// new tokens.
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
               "          [--budget N] [--queries [--view]] [--steps N] [--prompt \"text\"]\n",
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
