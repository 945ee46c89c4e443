// veloxquant — eviction-fidelity harness on a real model (stories260K, llama2.c format).
//
// For windows of real text, teacher-forced: the first P tokens go through every layer's cache as
// one prefill call, the rest one token per call. Each method x budget x scoring (key proxy or the
// model's real queries) is compared with the full cache on the same window: per-token NLL and
// perplexity of the real next token, KL(full || evicted) of the next-token distribution, top-1
// agreement, kept bytes, compression ratio and decode speed. Writes a table (stdout), a CSV and an
// SVG plot of KL against the memory budget. Deterministic given its arguments.
//
//   llama2c_fidelity [--fixtures DIR] [--text sample|validation|PATH] [--windows N]
//                    [--length L] [--prompt P] [--budgets 32,64,128,256]
//                    [--methods squeeze,squeeze_uniform,h2o,pyramidkv,tova,streaming_llm,snapkv]
//                    [--scoring proxy,queries] [--widths 16/16,8/8,8/4,4/4] [--group G]
//                    [--range FROM:TO] [--set FIELD=VALUE,...] [--heads uniform,adaptive:F,...]
//                    [--storage float|half] [--csv FILE] [--svg FILE]
//                    [--compress-once] [--kvzip-cue none|bos] [--kvzip-norm prompt|reread]
//
// --widths gives key/value bits per row (quantized storage, docs/design.md 2.9), --group the
// quantization group (default 8: the model's head dim), --range the bytes of the text windows may
// come from (docs/fidelity.md: decisions use 0:400000 only), --set overrides any KVCacheConfig
// field by name in every evicting run (e.g. --set squeeze_decay=0.95,squeeze_recent_ratio=0.75).
// --heads runs each method that has per-head budgets (squeeze, squeeze_uniform, h2o, pyramidkv;
// SPEC 14, docs/design.md 4.9) once per entry: `uniform`, `adaptive` (the floor of the config,
// head_budget_floor, after --set) or `adaptive:F` (floor F). Adaptive runs are their own series:
// method `squeeze_adaptive0.2` etc. in the table, CSV and plot. Without --heads the config decides
// (so --set head_budgets=adaptive still works, and is labelled the same way). --storage picks the
// caches' row type (default float); with half, the reference is the full cache of half rows and
// kept_bytes / full_bytes is the fraction of the full fp16 cache (docs/fidelity.md).
// Method kvzip (SPEC 18) compresses the prompt once after its prefill to budget / P of its rows
// (llama2c::kvzip_compress: a fork re-reads the prompt in chunks of 64 tokens, each after the
// cue: none, or the BOS token with --kvzip-cue bos; --kvzip-norm reread, the default: each
// observed query's softmax also covers the re-read's own keys, KVzip's normalisation; prompt: the
// prompt's rows alone); method keydiff is H2O ranking by KeyDiff
// (proxy_scoring keydiff). --compress-once compares methods at the rows they hold at the end of
// the window: the methods that evict while decoding (all but kvzip and snapkv, which cut the
// prompt to the budget and then append) get budget + L - P rows.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "llama2c.hpp"

namespace vc = veloxquant::cache;
namespace ll = veloxquant::llama2c;

namespace {

struct Options {
  std::string fixtures;
  std::string text = "sample";
  int windows = 0;  // 0: as many as the text holds (sample) or 16 (validation)
  int length = 384;
  int prompt = 64;
  std::vector<int> budgets{32, 64, 128, 256};
  std::vector<std::string> methods{"squeeze", "squeeze_uniform", "h2o",   "pyramidkv",
                                   "tova",    "streaming_llm",   "snapkv"};
  std::vector<std::string> scorings{"proxy", "queries"};
  std::vector<std::pair<int, int>> widths{{16, 16}};  // key bits, value bits
  int group = 8;
  std::size_t range_from = 0, range_to = std::string::npos;  // bytes of the text
  std::string csv = "fidelity.csv";
  std::string svg = "fidelity.svg";
  std::vector<std::pair<std::string, std::string>> set;  // KVCacheConfig field = value, every run
  // Head budgets per run: "" (as the config says), "uniform", "adaptive" or "adaptive:F".
  std::vector<std::string> heads{""};
  std::string storage = "float";  // the caches' row type: float or half
  bool compress_once = false;     // online methods get budget + L - P rows (see above)
  std::vector<int> kvzip_cue;     // tokens before each re-read chunk
  bool kvzip_own_keys = true;     // observe with the re-read's keys (KVzip's normalisation)
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int to_int(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  int x = 0;
  try {
    x = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size()) throw std::invalid_argument(flag + ": '" + v + "' is not an integer");
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  o.fixtures = ll::fixtures_dir(VELOXQUANT_FIXTURES_DEFAULT);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--fixtures") {
      o.fixtures = value();
    } else if (a == "--text") {
      o.text = value();
    } else if (a == "--windows") {
      o.windows = to_int(a, value());
    } else if (a == "--length") {
      o.length = to_int(a, value());
    } else if (a == "--prompt") {
      o.prompt = to_int(a, value());
    } else if (a == "--budgets") {
      o.budgets.clear();
      for (const auto& b : split(value(), ',')) o.budgets.push_back(to_int(a, b));
    } else if (a == "--methods") {
      o.methods = split(value(), ',');
    } else if (a == "--scoring") {
      o.scorings = split(value(), ',');
    } else if (a == "--widths") {
      o.widths.clear();
      for (const auto& w : split(value(), ',')) {
        const auto kv = split(w, '/');
        if (kv.size() != 2) throw std::invalid_argument("--widths: '" + w + "' is not KEY/VALUE");
        o.widths.emplace_back(to_int(a, kv[0]), to_int(a, kv[1]));
      }
    } else if (a == "--group") {
      o.group = to_int(a, value());
    } else if (a == "--range") {
      const std::string r = value();
      const std::size_t colon = r.find(':');
      if (colon == std::string::npos)
        throw std::invalid_argument("--range: '" + r + "' is not FROM:TO");
      o.range_from = static_cast<std::size_t>(to_int(a, r.substr(0, colon)));
      if (colon + 1 < r.size())
        o.range_to = static_cast<std::size_t>(to_int(a, r.substr(colon + 1)));
    } else if (a == "--set") {
      for (const auto& kv : split(value(), ',')) {
        const std::size_t eq = kv.find('=');
        if (eq == std::string::npos)
          throw std::invalid_argument("--set: '" + kv + "' is not FIELD=VALUE");
        o.set.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      }
    } else if (a == "--storage") {
      o.storage = value();
      if (o.storage != "float" && o.storage != "half") {
        throw std::invalid_argument("--storage: '" + o.storage + "' is not float or half");
      }
    } else if (a == "--heads") {
      o.heads = split(value(), ',');
      for (const auto& h : o.heads) {
        bool ok = h == "uniform" || h == "adaptive";
        if (h.rfind("adaptive:", 0) == 0) {
          std::size_t used = 0;
          try {
            (void)std::stod(h.substr(9), &used);
          } catch (const std::exception&) {
            used = 0;
          }
          ok = used > 0 && used == h.size() - 9;
        }
        if (!ok) {
          throw std::invalid_argument("--heads: '" + h +
                                      "' is not uniform, adaptive or adaptive:FLOOR");
        }
      }
      if (o.heads.empty()) throw std::invalid_argument("--heads needs a value");
    } else if (a == "--compress-once") {
      o.compress_once = true;
    } else if (a == "--kvzip-cue") {
      const std::string cue = value();
      if (cue != "none" && cue != "bos") throw std::invalid_argument("--kvzip-cue: none or bos");
      o.kvzip_cue = cue == "bos" ? std::vector<int>{1} : std::vector<int>{};
    } else if (a == "--kvzip-norm") {
      const std::string norm = value();
      if (norm != "prompt" && norm != "reread") {
        throw std::invalid_argument("--kvzip-norm: prompt or reread");
      }
      o.kvzip_own_keys = norm == "reread";
    } else if (a == "--csv") {
      o.csv = value();
    } else if (a == "--svg") {
      o.svg = value();
    } else if (a == "--help" || a == "-h") {
      std::cout << "usage: llama2c_fidelity [--fixtures DIR] [--text sample|validation|PATH]\n"
                   "  [--windows N] [--length L] [--prompt P] [--budgets 32,64,128,256]\n"
                   "  [--methods squeeze,squeeze_uniform,h2o,pyramidkv,tova,streaming_llm,snapkv]\n"
                   "  [--scoring proxy,queries] [--widths 16/16,8/8,8/4,4/4] [--group G]\n"
                   "  [--range FROM:TO] [--set FIELD=VALUE,...] [--heads uniform,adaptive:F,...]\n"
                   "  [--csv FILE] [--svg FILE]\n";
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument '" + a + "' (see --help)");
    }
  }
  if (o.prompt < 1 || o.length <= o.prompt) {
    throw std::invalid_argument("need 1 <= --prompt < --length");
  }
  for (const auto& s : o.scorings) {
    if (s != "proxy" && s != "queries") {
      throw std::invalid_argument("--scoring: '" + s + "' is neither proxy nor queries");
    }
  }
  return o;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Windows of `length` tokens (each starting with BOS). The sample text (five stories, end markers
// dropped) is cut into consecutive windows; a longer text gets `n` windows whose starts are spread
// evenly over the file and moved forward to the next paragraph.
std::vector<std::vector<int>> make_windows(const Options& o, const ll::Tokenizer& tok,
                                           std::string* description) {
  std::string path = o.text;
  if (o.text == "sample") path = o.fixtures + "/text/tinystories_sample.txt";
  if (o.text == "validation") path = o.fixtures + "/text/tinystories_validation_head.txt";
  std::string text = read_file(path);
  if (o.range_from > 0 || o.range_to != std::string::npos) {
    if (o.range_from >= text.size()) throw std::invalid_argument("--range starts past the text");
    text = text.substr(o.range_from, o.range_to == std::string::npos ? std::string::npos
                                                                     : o.range_to - o.range_from);
  }
  std::vector<std::vector<int>> out;
  const auto L = static_cast<std::size_t>(o.length);
  if (text.size() < 20000) {
    std::string clean;  // drop the <|endoftext|> lines
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      if (line != "<|endoftext|>") clean += line + "\n";
    }
    const std::vector<int> all = tok.encode(clean, true);
    for (std::size_t start = 0; start + L <= all.size(); start += L) {
      std::vector<int> w(all.begin() + static_cast<std::ptrdiff_t>(start),
                         all.begin() + static_cast<std::ptrdiff_t>(start + L));
      w[0] = 1;  // every window starts a sequence
      out.push_back(std::move(w));
      if (o.windows > 0 && static_cast<int>(out.size()) == o.windows) break;
    }
  } else {
    const int n = o.windows > 0 ? o.windows : 16;
    for (int i = 0; i < n; ++i) {
      std::size_t start = text.size() / static_cast<std::size_t>(n) * static_cast<std::size_t>(i);
      if (i > 0) {
        const std::size_t para = text.find("\n\n", start);
        if (para == std::string::npos) break;
        start = para + 2;
      }
      // About 2 characters per token; take enough text and cut at L tokens.
      const std::vector<int> ids = tok.encode(text.substr(start, L * 3), true);
      if (ids.size() < L) break;
      out.emplace_back(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(L));
    }
  }
  if (out.empty())
    throw std::runtime_error(path + " holds no window of " + std::to_string(L) + " tokens");
  std::ostringstream d;
  d << out.size() << " window(s) of " << L << " tokens of "
    << std::filesystem::path(path).filename().string();
  if (o.range_from > 0 || o.range_to != std::string::npos) {
    d << " (bytes " << o.range_from << ".."
      << (o.range_to == std::string::npos ? std::string("end") : std::to_string(o.range_to)) << ")";
  }
  *description = d.str();
  return out;
}

// Sets KVCacheConfig field `name` of `c` from text (any field, through for_each_config_field).
void set_field(vc::KVCacheConfig& c, const std::string& name, const std::string& text) {
  bool found = false;
  vc::detail::for_each_config_field(c, [&](const char* field, auto& v) {
    using V = std::decay_t<decltype(v)>;
    if (found || name != field) return;
    found = true;
    if constexpr (std::is_same_v<V, int>) {
      v = to_int("--set " + name, text);
    } else if constexpr (std::is_same_v<V, double>) {
      v = std::stod(text);
    } else if constexpr (std::is_same_v<V, bool>) {
      v = text == "1" || text == "true";
    } else if constexpr (std::is_same_v<V, std::string>) {
      v = text;
    } else {
      v = text.empty() || text == "none" ? std::nullopt : std::optional<int>(to_int(name, text));
    }
  });
  if (!found) throw std::invalid_argument("--set: no KVCacheConfig field '" + name + "'");
}

// Whether `method` (a harness method name) has per-head budgets (SPEC 14).
bool has_head_budgets(const std::string& method) {
  return method == "squeeze" || method == "squeeze_uniform" || method == "h2o" ||
         method == "pyramidkv";
}

// "squeeze_uniform" is SqueezeAttention with strength 0: every layer gets the average budget, so
// comparing it with "squeeze" isolates the data-driven per-layer budget. `set`: field overrides;
// `heads` (see Options::heads), applied after them.
vc::KVCacheConfig config_for(const std::string& method, int budget, std::pair<int, int> widths,
                             int group,
                             const std::vector<std::pair<std::string, std::string>>& set = {},
                             const std::string& heads = "") {
  vc::KVCacheConfig c;
  c.key_bits = widths.first;
  c.value_bits = widths.second;
  c.quant_group = group;
  c.method = method == "squeeze_uniform" ? "squeeze" : method == "keydiff" ? "h2o" : method;
  if (method == "squeeze_uniform") c.squeeze_strength = 0.0;
  if (method == "keydiff") c.proxy_scoring = "keydiff";
  c.squeeze_budget = c.h2o_budget = c.pyramid_budget = c.tova_budget = c.snap_budget = budget;
  c.stream_window_size = budget - c.stream_n_sink;
  c.snap_obs_window = std::min(c.snap_obs_window, budget);
  for (const auto& [name, value] : set) set_field(c, name, value);
  if (!heads.empty()) c.head_budgets = heads.substr(0, heads.find(':'));
  if (heads.rfind("adaptive:", 0) == 0) set_field(c, "head_budget_floor", heads.substr(9));
  c.validate();
  return c;
}

// The series a run belongs to: the method, and for adaptive heads `_adaptive` and the floor
// (`squeeze_adaptive0.2`).
std::string series_name(const std::string& method, const vc::KVCacheConfig& c) {
  if (!has_head_budgets(method) || c.head_budgets != "adaptive") return method;
  std::ostringstream s;
  s << method << "_adaptive" << c.head_budget_floor;
  return s.str();
}

// log-softmax of a logit row, in double. logits: [V]
std::vector<double> log_softmax(const Eigen::Ref<const Eigen::RowVectorXf>& logits) {
  const double m = static_cast<double>(logits.maxCoeff());
  double sum = 0.0;
  for (Eigen::Index j = 0; j < logits.size(); ++j)
    sum += std::exp(static_cast<double>(logits[j]) - m);
  const double lse = m + std::log(sum);
  std::vector<double> out(static_cast<std::size_t>(logits.size()));
  for (Eigen::Index j = 0; j < logits.size(); ++j) {
    out[static_cast<std::size_t>(j)] = static_cast<double>(logits[j]) - lse;
  }
  return out;
}

// Next-token logits of a teacher-forced window: the prompt as one call, then one call per token.
// Rows i = 0 .. L - P - 1 predict token P + i. Returns [L - P, V]; `decode_seconds` gets the
// time of the one-token calls.
// kvzip_keep > 0: KVzip's procedure compresses the prompt's caches after its prefill (cue: the
// tokens before each re-read chunk).
template <class T>
Eigen::MatrixXf run_window(ll::Engine<T>& engine, const std::vector<int>& w, int prompt,
                           double* decode_seconds, double kvzip_keep = 0.0,
                           const std::vector<int>& cue = {}, bool own_keys = false) {
  engine.reset();
  const auto P = static_cast<std::size_t>(prompt);
  const Eigen::Index n_eval = static_cast<Eigen::Index>(w.size() - P);
  Eigen::MatrixXf out;
  const std::vector<int> head(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(P));
  const Eigen::MatrixXf first = engine.forward(head);
  if (kvzip_keep > 0.0) ll::kvzip_compress(engine, head, kvzip_keep, cue, 64, own_keys);
  out.resize(n_eval, first.cols());
  out.row(0) = first.row(first.rows() - 1);
  const auto t0 = std::chrono::steady_clock::now();
  for (Eigen::Index i = 1; i < n_eval; ++i) {
    out.row(i) = engine.forward({w[P + static_cast<std::size_t>(i) - 1]}).row(0);
  }
  *decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

struct WindowResult {
  double nll = 0, kl = 0, top1 = 0, kept = 0, full = 0, tok_s = 0;
};

struct Run {
  std::string method, scoring;
  int budget = 0;  // 0: the full cache
  std::pair<int, int> widths{16, 16};
  std::string heads;   // Options::heads entry ("" for the full cache)
  std::string series;  // the name shown: method, or e.g. squeeze_adaptive0.2
  std::string width_name() const {
    return std::to_string(widths.first) + "/" + std::to_string(widths.second);
  }
  std::vector<WindowResult> windows;

  double mean(double WindowResult::*f) const {
    double s = 0;
    for (const auto& w : windows) s += w.*f;
    return s / static_cast<double>(windows.size());
  }
  double stdev(double WindowResult::*f) const {
    const double m = mean(f);
    double s = 0;
    for (const auto& w : windows) s += (w.*f - m) * (w.*f - m);
    return windows.size() > 1 ? std::sqrt(s / static_cast<double>(windows.size() - 1)) : 0.0;
  }
  /// The q-quantile over windows (0 <= q <= 1), interpolated linearly between order statistics.
  double quantile(double WindowResult::*f, double q) const {
    std::vector<double> v;
    v.reserve(windows.size());
    for (const auto& w : windows) v.push_back(w.*f);
    std::sort(v.begin(), v.end());
    const double at = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(at);
    const std::size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (at - static_cast<double>(lo)) * (v[hi] - v[lo]);
  }
};

WindowResult compare(const Eigen::MatrixXf& full, const Eigen::MatrixXf& got,
                     const std::vector<int>& w, int prompt) {
  WindowResult r;
  const Eigen::Index n = full.rows();
  for (Eigen::Index i = 0; i < n; ++i) {
    const std::vector<double> lp = log_softmax(full.row(i));
    const std::vector<double> lq = log_softmax(got.row(i));
    const auto next = static_cast<std::size_t>(w[static_cast<std::size_t>(prompt + i)]);
    r.nll -= lq[next];
    double kl = 0;
    for (std::size_t j = 0; j < lp.size(); ++j) kl += std::exp(lp[j]) * (lp[j] - lq[j]);
    r.kl += std::max(kl, 0.0);
    Eigen::Index a = 0, b = 0;
    full.row(i).maxCoeff(&a);
    got.row(i).maxCoeff(&b);
    r.top1 += a == b ? 1.0 : 0.0;
  }
  r.nll /= static_cast<double>(n);
  r.kl /= static_cast<double>(n);
  r.top1 /= static_cast<double>(n);
  return r;
}

// ---- SVG: mean KL (log scale) against the memory kept (share of the full cache, log2 scale), one
// line per method x scoring (dashed: key proxy). Memory rather than the nominal budget, so SnapKV
// (which compresses only the prompt) sits where its bytes put it.

double kept_share(const Run& r) {
  return r.mean(&WindowResult::kept) / std::max(r.mean(&WindowResult::full), 1.0);
}

std::string svg_plot(const std::vector<Run>& runs, const std::string& subtitle) {
  const double W = 780, H = 490, left = 70, right = 240, top = 50, bottom = 60;
  const double pw = W - left - right, ph = H - top - bottom;
  double kmin = 1e300, kmax = 0;
  for (const auto& r : runs) {
    if (r.budget == 0) continue;
    const double k = r.mean(&WindowResult::kl);
    if (k > 0) kmin = std::min(kmin, k), kmax = std::max(kmax, k);
  }
  if (kmax <= 0) kmin = 1e-4, kmax = 1e-1;
  const double ylo = std::floor(std::log10(kmin)), yhi = std::ceil(std::log10(kmax));
  double smin = 1.0;
  for (const auto& r : runs) {
    if (r.budget != 0) smin = std::min(smin, kept_share(r));
  }
  const double xlo = std::floor(std::log2(std::max(smin, 1e-3))), xhi = 0.0;
  const auto X = [&](double share) {
    return left + (std::log2(std::max(share, std::pow(2.0, xlo))) - xlo) / (xhi - xlo) * pw;
  };
  const auto Y = [&](double k) {
    const double l = std::log10(std::max(k, std::pow(10.0, ylo)));
    return top + (yhi - l) / (yhi - ylo) * ph;
  };
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << left << "\" y=\"18\" font-size=\"14\">stories260K: KL to the full cache vs "
    << "KV memory kept (dashed: key proxy)</text>\n"
    << "<text x=\"" << left << "\" y=\"34\" font-size=\"11\">" << subtitle << "</text>\n";
  for (double e = ylo; e <= yhi + 1e-9; e += 1) {
    const double y = Y(std::pow(10.0, e));
    s << "<line x1=\"" << left << "\" x2=\"" << left + pw << "\" y1=\"" << y << "\" y2=\"" << y
      << "\" stroke=\"#ddd\"/><text x=\"" << left - 8 << "\" y=\"" << y + 4
      << "\" text-anchor=\"end\">1e" << e << "</text>\n";
  }
  for (double e = xlo; e <= xhi + 1e-9; e += 1) {
    const double x = X(std::pow(2.0, e));
    s << "<line x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << top << "\" y2=\"" << top + ph
      << "\" stroke=\"#eee\"/><text x=\"" << x << "\" y=\"" << top + ph + 18
      << "\" text-anchor=\"middle\">"
      << (e == 0 ? std::string("1") : "1/" + std::to_string(static_cast<int>(std::pow(2.0, -e))))
      << "</text>\n";
  }
  s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"black\"/>\n"
    << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 15
    << "\" text-anchor=\"middle\">KV memory kept (share of the full cache, end of window)</text>\n"
    << "<text transform=\"translate(18," << top + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">mean KL(full || evicted), nats</text>\n";
  // Eight colours, then twelve more for runs with many series (e.g. --heads with several floors).
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                          "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
                          "#393b79", "#ff9896", "#98df8a", "#c5b0d5", "#ffbb78",
                          "#c49c94", "#f7b6d2", "#9edae5", "#637939", "#aec7e8"};
  constexpr int n_colors = static_cast<int>(sizeof colors / sizeof colors[0]);
  std::map<std::string, std::vector<const Run*>> lines;  // "method (scoring)" -> runs by budget
  std::vector<std::string> order;
  for (const auto& r : runs) {
    if (r.budget == 0) continue;
    const std::string key =
        r.series + " (" + r.scoring +
        (r.widths == std::make_pair(16, 16) ? std::string() : ", " + r.width_name()) + ")";
    if (!lines.count(key)) order.push_back(key);
    lines[key].push_back(&r);
  }
  std::map<std::string, int> color_of;
  int legend = 0;
  for (const auto& key : order) {
    const std::string method = key.substr(0, key.find(' '));
    if (!color_of.count(method)) color_of[method] = static_cast<int>(color_of.size()) % n_colors;
    const bool dashed = key.find("(proxy") != std::string::npos;
    const char* color = colors[color_of[method]];
    s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (dashed ? " stroke-dasharray=\"6,4\"" : "") << " points=\"";
    for (const Run* r : lines[key])
      s << X(kept_share(*r)) << ',' << Y(r->mean(&WindowResult::kl)) << ' ';
    s << "\"/>\n";
    for (const Run* r : lines[key]) {
      s << "<circle cx=\"" << X(kept_share(*r)) << "\" cy=\"" << Y(r->mean(&WindowResult::kl))
        << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    }
    const double ly = top + 10 + 18 * legend++;
    s << "<line x1=\"" << left + pw + 15 << "\" x2=\"" << left + pw + 45 << "\" y1=\"" << ly
      << "\" y2=\"" << ly << "\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (dashed ? " stroke-dasharray=\"6,4\"" : "") << "/><text x=\"" << left + pw + 50
      << "\" y=\"" << ly + 4 << "\">" << key << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const ll::Model model = ll::Model::load(o.fixtures + "/model/stories260K.bin");
    const ll::Tokenizer tok =
        ll::Tokenizer::load(o.fixtures + "/model/tok512.bin", model.config().vocab_size);
    if (o.length > model.config().seq_len) {
      throw std::invalid_argument("--length exceeds the model's context (" +
                                  std::to_string(model.config().seq_len) + ")");
    }
    std::string text_desc;
    const auto windows = make_windows(o, tok, &text_desc);
    const int n_layers = model.config().n_layers;

    // Every run: the full cache first, then method x budget x scoring.
    std::vector<Run> runs;
    runs.push_back(Run{"full", "-", 0, {16, 16}, "", "full", {}});
    for (const auto& wd : o.widths) {
      for (const auto& m : o.methods) {
        for (std::size_t hi = 0; hi < o.heads.size(); ++hi) {
          // Methods without per-head budgets run once (they ignore the field).
          if (hi > 0 && !has_head_budgets(m)) break;
          const std::string& heads = o.heads[hi];
          for (int b : o.budgets) {
            for (const auto& sc : o.scorings) {
              // StreamingLLM does not score rows; KeyDiff and KVzip score without the call's
              // queries (KVzip's come from its re-read): each runs once, whatever --scoring says.
              if ((m == "streaming_llm" || m == "keydiff" || m == "kvzip") &&
                  sc != o.scorings.front()) {
                continue;
              }
              const std::string series =
                  series_name(m, config_for(m, b, wd, o.group, o.set, heads));
              const std::string scoring = m == "streaming_llm" || m == "kvzip" ? "-"
                                          : m == "keydiff"                     ? "proxy"
                                                                               : sc;
              runs.push_back(Run{m, scoring, b, wd, heads, series, {}});
            }
          }
        }
      }
    }
    const auto t_start = std::chrono::steady_clock::now();
    for (std::size_t wi = 0; wi < windows.size(); ++wi) {
      const auto& w = windows[wi];
      Eigen::MatrixXf full;
      for (std::size_t ri = 0; ri < runs.size(); ++ri) {
        Run& run = runs[ri];
        std::fprintf(
            stderr, "\r[window %zu/%zu] %-14s %-8s %-5s budget %-4d (%zu/%zu) %6.1f s", wi + 1,
            windows.size(), run.series.c_str(), run.scoring.c_str(), run.width_name().c_str(),
            run.budget, ri + 1, runs.size(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
        // --compress-once: the methods that evict while decoding hold budget + L - P rows.
        const bool once = run.method == "kvzip" || run.method == "snapkv";
        const int rows = o.compress_once && !once ? run.budget + o.length - o.prompt : run.budget;
        const vc::KVCacheConfig cfg =
            run.budget == 0 ? config_for("standard", 512, {16, 16}, o.group)
                            : config_for(run.method, rows, run.widths, o.group, o.set, run.heads);
        const double keep =
            run.method == "kvzip" ? std::min(1.0, static_cast<double>(run.budget) / o.prompt) : 0.0;
        double secs = 0, kept = 0, full_bytes = 0;
        const auto run_as = [&](auto tag) {
          using T = decltype(tag);
          ll::Engine<T> engine(model, vc::KVCacheBuilder::for_model<T>(n_layers, cfg),
                               run.scoring == "queries");
          Eigen::MatrixXf lg =
              run_window(engine, w, o.prompt, &secs, keep, o.kvzip_cue, o.kvzip_own_keys);
          kept = static_cast<double>(engine.kept_bytes());
          full_bytes = static_cast<double>(engine.full_seq_bytes());
          return lg;
        };
        const Eigen::MatrixXf logits =
            o.storage == "half" ? run_as(Eigen::half{}) : run_as(float{});
        if (run.budget == 0) full = logits;
        WindowResult r = compare(full, logits, w, o.prompt);
        r.kept = kept;
        r.full = full_bytes;
        r.tok_s = static_cast<double>(logits.rows() - 1) / std::max(secs, 1e-9);
        run.windows.push_back(r);
      }
    }
    std::fprintf(stderr, "\n");

    // Table.
    std::printf(
        "Eviction fidelity on stories260K: %s; prompt %d tokens as one call, then %d "
        "one-token calls; means over windows (KL spread over windows: std, and the\n"
        "10th, 50th and 90th percentiles).\n\n",
        text_desc.c_str(), o.prompt, o.length - o.prompt);
    int name_width = 14;  // the method column: as wide as the longest series name
    for (const auto& r : runs) name_width = std::max(name_width, static_cast<int>(r.series.size()));
    std::printf("%-*s %-8s %5s %6s %7s %6s %9s %9s %22s %7s %9s %6s %9s\n", name_width, "method",
                "scoring", "bits", "budget", "NLL", "PPL", "KL", "KL std", "KL p10/p50/p90",
                "top-1", "kept KiB", "ratio", "tok/s");
    for (const auto& r : runs) {
      char range[64];
      std::snprintf(range, sizeof range, "%.4f/%.4f/%.4f", r.quantile(&WindowResult::kl, 0.1),
                    r.quantile(&WindowResult::kl, 0.5), r.quantile(&WindowResult::kl, 0.9));
      std::printf("%-*s %-8s %5s %6s %7.4f %6.3f %9.5f %9.5f %22s %6.1f%% %9.1f %6.2f %9.0f\n",
                  name_width, r.series.c_str(), r.scoring.c_str(), r.width_name().c_str(),
                  r.budget ? std::to_string(r.budget).c_str() : "full", r.mean(&WindowResult::nll),
                  std::exp(r.mean(&WindowResult::nll)), r.mean(&WindowResult::kl),
                  r.stdev(&WindowResult::kl), range, 100.0 * r.mean(&WindowResult::top1),
                  r.mean(&WindowResult::kept) / 1024.0,
                  r.mean(&WindowResult::full) / std::max(r.mean(&WindowResult::kept), 1.0),
                  r.mean(&WindowResult::tok_s));
    }

    // CSV: one row per window and run, then one summary row per run (window = "mean").
    std::ofstream csv(o.csv);
    if (!csv) throw std::runtime_error("cannot write " + o.csv);
    csv << "method,scoring,key_bits,value_bits,budget,window,nll,ppl,kl,top1,kept_bytes,"
           "full_bytes,compression,tokens_per_s\n";
    for (const auto& r : runs) {
      const auto row = [&](const std::string& win, const WindowResult& x) {
        csv << r.series << ',' << r.scoring << ',' << r.widths.first << ',' << r.widths.second
            << ',' << (r.budget ? std::to_string(r.budget) : "full") << ',' << win << ',' << x.nll
            << ',' << std::exp(x.nll) << ',' << x.kl << ',' << x.top1 << ',' << x.kept << ','
            << x.full << ',' << x.full / std::max(x.kept, 1.0) << ',' << x.tok_s << '\n';
      };
      for (std::size_t i = 0; i < r.windows.size(); ++i) row(std::to_string(i), r.windows[i]);
      WindowResult m;
      m.nll = r.mean(&WindowResult::nll);
      m.kl = r.mean(&WindowResult::kl);
      m.top1 = r.mean(&WindowResult::top1);
      m.kept = r.mean(&WindowResult::kept);
      m.full = r.mean(&WindowResult::full);
      m.tok_s = r.mean(&WindowResult::tok_s);
      row("mean", m);
    }
    std::ofstream svg(o.svg);
    if (!svg) throw std::runtime_error("cannot write " + o.svg);
    svg << svg_plot(runs, text_desc + ", prompt " + std::to_string(o.prompt) + " tokens");
    std::printf("\nwrote %s and %s\n", o.csv.c_str(), o.svg.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama2c_fidelity: %s\n", e.what());
    return 1;
  }
}
