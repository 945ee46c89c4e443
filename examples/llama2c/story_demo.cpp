// veloxquant — the demo: a real model (stories260K) tells a story with SqueezeAttention caches.
//
// The prompt goes through every layer's cache as one prefill call; each layer reports how
// concentrated its prompt keys are, the shared coordinator turns that into per-layer budgets, and
// generation continues one token per call within them, scored by the model's real queries. The
// same story is generated with the full cache for comparison. Without the fixture files it says
// where to get them and exits with status 2 (scripts/demo.sh then runs the synthetic demo).
//
//   llama2c_story_demo [--fixtures DIR] [--prompt "text"] [--budget N] [--steps N] [--proxy]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include <veloxquant/cache.hpp>

#include "llama2c.hpp"

namespace vc = veloxquant::cache;
namespace ll = veloxquant::llama2c;

int main(int argc, char** argv) {
  std::string dir = ll::fixtures_dir(VELOXQUANT_FIXTURES_DEFAULT);
  std::string prompt = "Once upon a time, there was a little girl named Lily. She loved to play "
                       "outside in the park with her friends.";
  int budget = 48;  // average rows per KV head; the prompt alone is ~30 tokens
  int steps = 200;
  bool queries = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--fixtures" && has) {
      dir = argv[++i];
    } else if (a == "--prompt" && has) {
      prompt = argv[++i];
    } else if (a == "--budget" && has) {
      budget = std::atoi(argv[++i]);
    } else if (a == "--steps" && has) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--proxy") {
      queries = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--fixtures DIR] [--prompt \"text\"] [--budget N] [--steps N] "
                   "[--proxy]\n",
                   argv[0]);
      return 1;
    }
  }
  const std::string model_path = dir + "/model/stories260K.bin";
  const std::string tok_path = dir + "/model/tok512.bin";
  if (!std::filesystem::exists(model_path) || !std::filesystem::exists(tok_path)) {
    std::printf(
        "The real-model demo needs model/stories260K.bin and model/tok512.bin under %s.\n"
        "Point --fixtures or VELOXQUANT_FIXTURES at a directory that has them: stories260K is\n"
        "Andrej Karpathy's llama2.c checkpoint (MIT), from the Hugging Face repository\n"
        "karpathy/tinyllamas, folder stories260K (see ../shared/fixtures/README.md).\n\n",
        dir.c_str());
    return 2;
  }
  try {
    const ll::Model model = ll::Model::load(model_path);
    const ll::Tokenizer tok = ll::Tokenizer::load(tok_path, model.config().vocab_size);
    const int n_layers = model.config().n_layers;
    const std::vector<int> ids = tok.encode(prompt, true);

    vc::KVCacheConfig cfg;  // method "squeeze"
    cfg.squeeze_budget = budget;
    ll::Engine<Eigen::half> squeeze(model, vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, cfg),
                                    queries);
    const std::vector<int> story = ll::generate_greedy(squeeze, ids, steps);

    vc::KVCacheConfig full_cfg;
    full_cfg.method = "standard";
    ll::Engine<Eigen::half> full(model,
                                 vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, full_cfg));
    const std::vector<int> reference = ll::generate_greedy(full, ids, steps);

    std::vector<int> all = ids;
    all.insert(all.end(), story.begin(), story.end());
    std::printf("stories260K (llama2.c, 5 layers, 8 query heads over 4 KV heads), SqueezeAttention "
                "caches in half precision, average budget %d rows per KV head, scored with %s.\n\n",
                budget, queries ? "the model's real queries" : "the key-as-query proxy");
    std::printf("%s\n\n", tok.decode(all).c_str());

    std::printf("layer  concentration  budget  rows kept\n");
    for (int l = 0; l < n_layers; ++l) {
      const auto& c =
          dynamic_cast<const vc::SqueezeAttentionCache<Eigen::half>&>(*squeeze.caches()[static_cast<std::size_t>(l)]);
      std::printf("%5d  %13.4f  %6d  %9lld\n", l, c.concentration(), c.layer_budget(),
                  static_cast<long long>(c.tokens_kept()));
    }
    std::size_t same = 0;
    while (same < story.size() && same < reference.size() && story[same] == reference[same]) ++same;
    const double kept = static_cast<double>(squeeze.kept_bytes());
    const double whole = static_cast<double>(squeeze.full_seq_bytes());
    std::printf("\n%lld tokens in context; KV cache %.1f KiB instead of %.1f KiB with the full cache "
                "(%.0f%% saved, %.2fx compression).\n",
                static_cast<long long>(squeeze.position()), kept / 1024.0, whole / 1024.0,
                100.0 * (1.0 - kept / whole), whole / kept);
    std::printf("The full cache generates the same first %zu of %zu tokens (greedy decoding).\n",
                same, story.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama2c_story: %s\n", e.what());
    return 1;
  }
  return 0;
}
