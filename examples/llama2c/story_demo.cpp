// veloxquant — the demo: a real model (stories260K) tells a story with SqueezeAttention caches.
//
// The prompt goes through every layer's cache; each layer measures how concentrated its first
// squeeze_calibration_tokens keys are, the shared coordinator turns that into per-layer budgets,
// and generation continues one token per call within them, each layer's attention computed by its
// cache (attend) and scored by the model's real queries. The same story is generated with the full
// cache for comparison. With --token-at-a-time the prompt is also fed one token per call (as
// llama2.c's run.c does) and the per-layer budgets of both ways are printed side by side.
//
// The model and tokenizer ship in examples/llama2c/ (Andrej Karpathy's stories260K, MIT; see
// NOTICE there); --fixtures DIR reads DIR/model/ instead.
//
//   llama2c_story_demo [--fixtures DIR] [--prompt "text"] [--budget N] [--steps N] [--proxy]
//                      [--token-at-a-time] [--bits KEY/VALUE]
//
// Then the prompt's caches are saved to a file (save_prompt_cache), loaded into a fresh engine
// (load_prompt_cache) and the story continued from there: the same text, token for token.
//
// The caches hold 8-bit keys and 4-bit values by default (quantized storage, docs/design.md 2.9;
// the best per byte on this model, docs/fidelity.md); --bits 16/16 keeps half-precision rows. The
// demo prints what eviction and quantization save, apart and together.
#include <algorithm>
#include <chrono>
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
  std::string model_dir = VELOXQUANT_LLAMA2C_MODEL_DIR;  // the shipped model (examples/llama2c)
  std::string prompt = "Once upon a time, there was a little girl named Lily. She loved to play "
                       "outside in the park with her friends.";
  int budget = 48;  // average rows per KV head; the prompt alone is 36 tokens (BOS included)
  int key_bits = 8, value_bits = 4;
  int steps = 200;
  bool queries = true;
  bool token_at_a_time = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--fixtures" && has) {
      model_dir = std::string(argv[++i]) + "/model";
    } else if (a == "--token-at-a-time") {
      token_at_a_time = true;
    } else if (a == "--prompt" && has) {
      prompt = argv[++i];
    } else if (a == "--budget" && has) {
      budget = std::atoi(argv[++i]);
    } else if (a == "--steps" && has) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--bits" && has) {
      const std::string b = argv[++i];
      const std::size_t slash = b.find('/');
      if (slash == std::string::npos) {
        std::fprintf(stderr, "--bits: '%s' is not KEY/VALUE (16, 8 or 4 each)\n", b.c_str());
        return 1;
      }
      key_bits = std::atoi(b.substr(0, slash).c_str());
      value_bits = std::atoi(b.substr(slash + 1).c_str());
    } else if (a == "--proxy") {
      queries = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--fixtures DIR] [--prompt \"text\"] [--budget N] [--steps N] "
                   "[--proxy] [--token-at-a-time] [--bits KEY/VALUE]\n",
                   argv[0]);
      return 1;
    }
  }
  const std::string model_path = model_dir + "/stories260K.bin";
  const std::string tok_path = model_dir + "/tok512.bin";
  if (!std::filesystem::exists(model_path) || !std::filesystem::exists(tok_path)) {
    std::printf(
        "The real-model demo needs stories260K.bin and tok512.bin in %s.\n"
        "They ship in examples/llama2c/ (Andrej Karpathy's llama2.c checkpoint, MIT, from the\n"
        "Hugging Face repository karpathy/tinyllamas, folder stories260K).\n\n",
        model_dir.c_str());
    return 2;
  }
  try {
    const ll::Model model = ll::Model::load(model_path);
    const ll::Tokenizer tok = ll::Tokenizer::load(tok_path, model.config().vocab_size);
    const int n_layers = model.config().n_layers;
    const std::vector<int> ids = tok.encode(prompt, true);

    vc::KVCacheConfig cfg;  // method "squeeze"
    cfg.set_budget(budget);
    cfg.key_bits = key_bits;
    cfg.value_bits = value_bits;
    cfg.quant_group = 8;  // the model's head dim
    ll::Engine<Eigen::half> squeeze(model, vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, cfg),
                                    queries);
    const std::vector<int> story = ll::generate_greedy(squeeze, ids, steps);
    const auto layer = [](const ll::Engine<Eigen::half>& e, int l) -> const vc::SqueezeAttentionCache<Eigen::half>& {
      return dynamic_cast<const vc::SqueezeAttentionCache<Eigen::half>&>(*e.caches()[static_cast<std::size_t>(l)]);
    };

    vc::KVCacheConfig full_cfg;
    full_cfg.method = "standard";
    ll::Engine<Eigen::half> full(model,
                                 vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, full_cfg));
    const std::vector<int> reference = ll::generate_greedy(full, ids, steps);

    std::vector<int> all = ids;
    all.insert(all.end(), story.begin(), story.end());
    std::printf("stories260K (llama2.c, 5 layers, 8 query heads over 4 KV heads), SqueezeAttention "
                "caches, average budget %d rows per KV head, scored with %s; %s.\n\n",
                budget, queries ? "the model's real queries" : "the key-as-query proxy",
                key_bits == 16 && value_bits == 16
                    ? "half-precision rows"
                    : (std::to_string(key_bits) + "-bit keys and " + std::to_string(value_bits) +
                       "-bit values in groups of 8 (half scale and offset per group)")
                          .c_str());
    std::printf("%s\n\n", tok.decode(all).c_str());

    std::printf("Each layer measured its first %d keys (squeeze_calibration_tokens).\n",
                cfg.squeeze_calibration_tokens);
    std::printf("layer  concentration  budget  rows kept\n");
    for (int l = 0; l < n_layers; ++l) {
      const auto& c = layer(squeeze, l);
      std::printf("%5d  %13.4f  %6d  %9lld\n", l, c.concentration(), c.layer_budget(),
                  static_cast<long long>(c.tokens_kept()));
    }
    if (token_at_a_time) {
      // The same prompt, one token per call. Each layer measures its first 32 keys however they
      // arrive; the old rule (the first call only: one row, concentration 0) is shown beside.
      const auto budgets_by_token = [&](int calibration_tokens, std::vector<int>& story_out) {
        vc::KVCacheConfig c = cfg;
        c.squeeze_calibration_tokens = calibration_tokens;
        ll::Engine<Eigen::half> e(model, vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, c),
                                  queries);
        story_out = ll::generate_greedy(e, ids, steps, true);
        std::vector<int> out;
        for (int l = 0; l < n_layers; ++l) out.push_back(layer(e, l).layer_budget());
        return out;
      };
      std::vector<int> story2, story_old;
      const std::vector<int> by_token = budgets_by_token(cfg.squeeze_calibration_tokens, story2);
      const std::vector<int> old_rule = budgets_by_token(1, story_old);
      std::printf("\nThe prompt fed one token per call (as llama2.c's run.c does):\n");
      std::printf("layer  one prefill call  token at a time  token at a time, first call only\n");
      int worst = 0;
      for (int l = 0; l < n_layers; ++l) {
        const int a = layer(squeeze, l).layer_budget(), b = by_token[static_cast<std::size_t>(l)];
        worst = std::max(worst, std::abs(a - b));
        std::printf("%5d  %16d  %15d  %32d\n", l, a, b, old_rule[static_cast<std::size_t>(l)]);
      }
      // Layers past the first see keys computed from the previous layers' outputs, which a
      // prefill and one-row calls round differently (over quantized rows a code may flip too); a
      // budget may move by a row or a few.
      const bool all_average = std::all_of(old_rule.begin(), old_rule.end(),
                                           [&](int b) { return b == budget; });
      std::printf("Token at a time, the budgets agree with the prefill's within %d row%s (the text "
                  "is %s); measuring the first call only gives %s.\n",
                  worst, worst == 1 ? "" : "s", story2 == story ? "the same" : "different",
                  all_average ? "every layer the average" : "other budgets");
    }
    std::size_t same = 0;
    while (same < story.size() && same < reference.size() && story[same] == reference[same]) ++same;
    const double kept = static_cast<double>(squeeze.kept_bytes());
    const double whole = static_cast<double>(squeeze.full_seq_bytes());
    // The two levers apart: the rows eviction keeps, at half precision, against the full cache;
    // then what quantization makes of those rows.
    double evicted_only = 0;
    for (const auto& c : squeeze.caches()) {
      evicted_only += static_cast<double>(c->tokens_kept() * c->batch() * c->heads() *
                                          (c->key_dim() + c->value_dim())) *
                      sizeof(Eigen::half);
    }
    std::printf("\n%lld tokens in context; KV cache %.1f KiB instead of %.1f KiB with the full "
                "half-precision cache.\n",
                static_cast<long long>(squeeze.position()), kept / 1024.0, whole / 1024.0);
    std::printf("  eviction alone (SqueezeAttention's rows at half precision): %.1f KiB, %.0f%% "
                "saved\n",
                evicted_only / 1024.0, 100.0 * (1.0 - evicted_only / whole));
    std::printf("  quantization alone (every row, %d/%d bits): %.0f%% saved\n", key_bits, value_bits,
                100.0 * (1.0 - kept / evicted_only));
    std::printf("  both together: %.1f KiB, %.0f%% saved, %.2fx compression\n", kept / 1024.0,
                100.0 * (1.0 - kept / whole), whole / kept);
    std::printf("The full cache generates the same first %zu of %zu tokens (greedy decoding).\n",
                same, story.size());

    // A prompt cache (docs/design.md G): the caches saved to a file right after the prompt,
    // loaded into a fresh set of caches in a new engine (as a later request would), and the story
    // continued from the token the prompt predicted, saved with them as metadata.
    {
      ll::Engine<Eigen::half> first(
          model, vc::KVCacheBuilder::for_model<Eigen::half>(n_layers, cfg), queries);
      const int next = ll::predicted_token(first.forward(ids));
      const std::string path =
          (std::filesystem::temp_directory_path() / "veloxquant_story_prompt.vqkv").string();
      using Clock = std::chrono::steady_clock;
      const auto t0 = Clock::now();
      vc::save_prompt_cache(path, first.caches(),
                            {{"model", "stories260K"}, {"prompt", prompt},
                             {"next_token", std::to_string(next)}});
      const auto t1 = Clock::now();
      const auto bytes = std::filesystem::file_size(path);
      vc::PromptCache<Eigen::half> loaded = vc::load_prompt_cache<Eigen::half>(path);
      const auto t2 = Clock::now();
      std::filesystem::remove(path);
      const int resume_at = std::stoi(loaded.metadata.at("next_token"));
      ll::Engine<Eigen::half> resumed(model, std::move(loaded.caches), queries);
      const std::vector<int> continued = ll::generate_from(resumed, resume_at, steps);
      const auto ms = [](Clock::duration d) {
        return std::chrono::duration<double, std::milli>(d).count();
      };
      std::printf("\nPrompt cache: after the %zu-token prompt the %d caches (and the coordinator "
                  "they share) were saved to %s (%llu bytes, %.2f ms), loaded into a fresh engine "
                  "(%.2f ms), and the story continued from there: %s.\n",
                  ids.size(), n_layers, path.c_str(), static_cast<unsigned long long>(bytes),
                  ms(t1 - t0), ms(t2 - t1),
                  continued == story ? "the same story, token for token"
                                     : "a DIFFERENT story (this is a bug)");
      if (continued != story) return 3;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama2c_story: %s\n", e.what());
    return 1;
  }
  return 0;
}
