/// llama2c_serve: N requests arriving over time under one memory cap (SPEC 19), served three ways
/// by the same engine (stories260K, teacher-forced windows of real text):
///   pool     every request's caches attached to one vc::MemoryPool of the cap: the pool shrinks
///            what sequences keep as requests arrive (the method's budget alone is no limit);
///   static   the cap split evenly: each request's policy budget is the rows its cap/N holds;
///   preempt  full caches (the standard method); a request that does not fit waits, and when a
///            step would go above the cap the latest-arrived running request is preempted (its
///            cache dropped) and recomputed from its tokens once room is back (vLLM's
///            recompute preemption).
/// Every step, each running request takes one token (its prompt in one call on admission). For
/// each way it prints the peak bytes held, every request's KL(full || served) of the next-token
/// distribution over its continuation (against the same request with a full cache, alone), the
/// preemptions, the tokens recomputed, the steps requests waited for the pool's floors (a request
/// whose floors do not fit beside the others' is queued, SPEC 19), and the time to finish every
/// request. --csv writes the bytes
/// each request holds after every step under the pool (scripts/serve_plot.py draws them).
///
///   llama2c_serve [--fixtures DIR] [--requests N] [--prompt P] [--length L] [--gap G]
///                 [--method M] [--budget B] [--cap-share F | --cap BYTES] [--range A:B]
///                 [--storage half|float] [--no-queries] [--csv PATH]
///
/// Requests: N windows of L tokens (P of prompt) of tinystories_validation_head.txt (bytes
/// [A, B), default 0:400000, the range fidelity decisions are made on), one arriving every G
/// steps. The cap defaults to F (0.3) of the peak bytes full caches would hold together.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "llama2c.hpp"

#ifndef VELOXQUANT_FIXTURES_DEFAULT
#define VELOXQUANT_FIXTURES_DEFAULT "fixtures"
#endif

namespace vc = veloxquant::cache;
namespace ll = veloxquant::llama2c;

namespace {

struct Options {
  std::string fixtures;
  int requests = 8, prompt = 160, length = 288, gap = 16;
  std::string method = "squeeze";
  int budget = 512;
  double cap_share = 0.3;
  std::size_t cap = 0;
  std::size_t range_from = 0, range_to = 400000;
  std::string storage = "half";
  bool queries = true;
  std::string csv;
  std::string rule = "fair_share";
};

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--fixtures DIR] [--requests N] [--prompt P] [--length L] [--gap G]\n"
               "          [--method M] [--budget B] [--cap-share F | --cap BYTES] [--range A:B]\n"
               "          [--storage half|float] [--no-queries] [--csv PATH]\n",
               argv0);
  return 2;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open '" + path + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// N windows of L tokens, their starts spread evenly over the text, each at a paragraph.
std::vector<std::vector<int>> windows(const Options& o, const ll::Tokenizer& tok) {
  std::string text = read_text(o.fixtures + "/text/tinystories_validation_head.txt");
  text = text.substr(o.range_from, o.range_to - o.range_from);
  std::vector<std::vector<int>> out;
  const auto L = static_cast<std::size_t>(o.length);
  for (int i = 0; static_cast<int>(out.size()) < o.requests; ++i) {
    std::size_t start = text.size() / static_cast<std::size_t>(o.requests + 1) *
                        static_cast<std::size_t>(i);
    if (i > 0) {
      const std::size_t para = text.find("\n\n", start);
      if (para == std::string::npos) throw std::runtime_error("the text holds too few windows");
      start = para + 2;
    }
    const std::vector<int> ids = tok.encode(text.substr(start, L * 3), true);
    if (ids.size() < L) throw std::runtime_error("a window is shorter than --length");
    out.emplace_back(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(L));
  }
  return out;
}

/// log-softmax of each row.
Eigen::MatrixXd log_softmax(const Eigen::MatrixXf& logits) {
  Eigen::MatrixXd out = logits.cast<double>();
  for (Eigen::Index r = 0; r < out.rows(); ++r) {
    const double m = out.row(r).maxCoeff();
    const double lse = m + std::log((out.row(r).array() - m).exp().sum());
    out.row(r).array() -= lse;
  }
  return out;
}

double kl(const Eigen::RowVectorXd& p, const Eigen::RowVectorXd& q) {
  double s = 0;
  for (Eigen::Index j = 0; j < p.size(); ++j) s += std::exp(p[j]) * (p[j] - q[j]);
  return std::max(s, 0.0);
}

/// One way of serving, its results.
struct Outcome {
  std::string name;
  std::size_t peak = 0;
  std::vector<double> kl;  ///< per request: mean KL over its continuation
  int preemptions = 0;
  int waits = 0;  ///< steps a request waited because the pool's floors were full
  long recomputed = 0;
  double seconds = 0;
  int steps = 0;
  std::vector<std::vector<std::size_t>> bytes;  ///< per step, per request
};

template <class T>
class Server {
 public:
  using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

  Server(const ll::Model& model, const Options& o, const std::vector<std::vector<int>>& reqs,
         const std::vector<Eigen::MatrixXd>& full)
      : model_(model), o_(o), reqs_(reqs), full_(full) {}

  /// `make(i)`: request i's caches. `cap`: admit, and preempt, by full caches' bytes under it
  /// (0: admit every request on arrival, never preempt).
  template <class Make>
  Outcome run(const std::string& name, const Make& make, std::size_t cap) {
    Outcome out;
    out.name = name;
    const int N = o_.requests;
    std::vector<std::unique_ptr<ll::Engine<T>>> eng(static_cast<std::size_t>(N));
    std::vector<int> done(static_cast<std::size_t>(N), 0);  // tokens absorbed
    std::vector<double> kl_sum(static_cast<std::size_t>(N), 0.0);
    std::vector<int> finished(static_cast<std::size_t>(N), 0);
    std::vector<int> order;  // running requests, by arrival
    const auto t0 = std::chrono::steady_clock::now();
    int left = N;
    const auto held = [&] {
      std::size_t b = 0;
      for (const auto& e : eng) b += e ? e->kept_bytes() : 0;
      return b;
    };
    for (int t = 0; left > 0; ++t) {
      // Admission, earliest arrival first (a preempted request comes back before later ones).
      for (int i = 0; i < N; ++i) {
        const auto u = static_cast<std::size_t>(i);
        if (eng[u] || finished[u] || t < i * o_.gap) continue;
        const int n = std::max(done[u], o_.prompt);  // its prompt, or all it had absorbed
        if (cap > 0 && held() + full_bytes(n + 1) > cap) break;  // waits, and the later ones too
        const std::vector<int> toks(reqs_[u].begin(), reqs_[u].begin() + n);
        Eigen::MatrixXf lg;
        try {
          eng[u] = std::make_unique<ll::Engine<T>>(model_, make(i), o_.queries);
          lg = eng[u]->forward(toks);
        } catch (const std::length_error&) {
          // The pool's floors are full (SPEC 19): the request waits, and the later ones too.
          eng[u].reset();
          ++out.waits;
          break;
        }
        if (done[u] > 0) out.recomputed += n;
        if (done[u] == 0) score(u, o_.prompt - 1, lg.row(lg.rows() - 1), kl_sum);
        done[u] = n;
        order.push_back(i);
        out.peak = std::max(out.peak, held());
      }
      // One token for every running request admitted before this step.
      for (std::size_t k = 0; k < order.size(); ++k) {
        const auto u = static_cast<std::size_t>(order[k]);
        if (done[u] >= o_.length) continue;
        if (cap > 0 && held() + full_bytes(1) > cap) {
          // Preempt the latest-arrived running request other than this one.
          for (std::size_t j = order.size(); j-- > 0;) {
            if (j == k) continue;
            eng[static_cast<std::size_t>(order[j])].reset();
            order.erase(order.begin() + static_cast<std::ptrdiff_t>(j));
            ++out.preemptions;
            if (j < k) --k;
            if (held() + full_bytes(1) <= cap) break;
          }
        }
        const Eigen::MatrixXf lg = eng[u]->forward({reqs_[u][static_cast<std::size_t>(done[u])]});
        ++done[u];
        if (done[u] < o_.length) score(u, done[u] - 1, lg.row(0), kl_sum);
        out.peak = std::max(out.peak, held());
      }
      // Finished requests leave.
      for (std::size_t k = 0; k < order.size();) {
        const auto u = static_cast<std::size_t>(order[k]);
        if (done[u] >= o_.length) {
          eng[u].reset();
          finished[u] = 1;
          --left;
          order.erase(order.begin() + static_cast<std::ptrdiff_t>(k));
        } else {
          ++k;
        }
      }
      std::vector<std::size_t> now(static_cast<std::size_t>(N), 0);
      for (int i : order) now[static_cast<std::size_t>(i)] = eng[static_cast<std::size_t>(i)]->kept_bytes();
      out.bytes.push_back(std::move(now));
      out.steps = t + 1;
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double positions = o_.length - o_.prompt;
    for (int i = 0; i < N; ++i) out.kl.push_back(kl_sum[static_cast<std::size_t>(i)] / positions);
    return out;
  }

  /// Bytes of a full cache of n tokens over every layer.
  std::size_t full_bytes(int n) const {
    const ll::ModelConfig& c = model_.config();
    return static_cast<std::size_t>(c.n_layers) * static_cast<std::size_t>(c.n_kv_heads) *
           static_cast<std::size_t>(n) * 2 * static_cast<std::size_t>(c.head_dim()) * sizeof(T);
  }

 private:
  // KL at the prediction from position `pos` (of token pos + 1), continuation positions only.
  void score(std::size_t u, int pos, const Eigen::RowVectorXf& logits,
             std::vector<double>& kl_sum) const {
    if (pos < o_.prompt - 1 || pos >= o_.length - 1) return;
    const Eigen::MatrixXd lq = log_softmax(logits);
    kl_sum[u] += kl(full_[u].row(pos - (o_.prompt - 1)), lq.row(0));
  }

  const ll::Model& model_;
  const Options& o_;
  const std::vector<std::vector<int>>& reqs_;
  const std::vector<Eigen::MatrixXd>& full_;
};

vc::KVCacheConfig config_of(const std::string& method, int budget) {
  vc::KVCacheConfig c;
  c.method = method;
  c.set_budget(budget);
  return c;
}

template <class T>
int serve(const Options& o) {
  const ll::Model model = ll::Model::load(o.fixtures + "/model/stories260K.bin");
  const ll::Tokenizer tok =
      ll::Tokenizer::load(o.fixtures + "/model/tok512.bin", model.config().vocab_size);
  const int n_layers = model.config().n_layers;
  const std::vector<std::vector<int>> reqs = windows(o, tok);
  // The reference: each request alone with a full cache.
  std::vector<Eigen::MatrixXd> full;
  for (const auto& r : reqs) {
    ll::Engine<T> e(model, vc::KVCacheBuilder::for_model<T>(n_layers, config_of("standard", 512)));
    const Eigen::MatrixXf lg = e.forward(r);
    full.push_back(log_softmax(lg.middleRows(o.prompt - 1, o.length - o.prompt)));
  }
  Server<T> server(model, o, reqs, full);
  // The peak full caches would hold together (every request's, as they overlap in time).
  std::size_t demand = 0;
  for (int t = 0; t < (o.requests - 1) * o.gap + o.length; ++t) {
    std::size_t at = 0;
    for (int i = 0; i < o.requests; ++i) {
      const int n = t - i * o.gap + o.prompt;
      if (t >= i * o.gap && n <= o.length) at += server.full_bytes(n);
    }
    demand = std::max(demand, at);
  }
  const std::size_t cap =
      o.cap > 0 ? o.cap : static_cast<std::size_t>(o.cap_share * static_cast<double>(demand));
  const std::size_t row_set = server.full_bytes(1);  // one row a head over every layer
  const int split_rows = static_cast<int>(cap / static_cast<std::size_t>(o.requests) / row_set);
  std::printf(
      "llama2c_serve: stories260K, %d requests of %d tokens (%d of prompt), one every %d steps;\n"
      "method %s%s, storage %s; cap %zu bytes (%.0f%% of the %zu bytes full caches would peak "
      "at; %d rows a head per request under a static split)\n\n",
      o.requests, o.length, o.prompt, o.gap, o.method.c_str(), o.queries ? " with queries" : "",
      o.storage.c_str(), cap, 100.0 * static_cast<double>(cap) / static_cast<double>(demand),
      demand, split_rows);

  std::vector<Outcome> outcomes;
  {
    vc::MemoryPool pool(cap, o.rule == "scores" ? vc::MemoryPool::Rule::scores
                                                : vc::MemoryPool::Rule::fair_share);
    const vc::KVCacheConfig cfg = config_of(o.method, o.budget);
    outcomes.push_back(server.run(
        "pool", [&](int) { return vc::KVCacheBuilder::for_model<T>(n_layers, cfg, pool); }, 0));
    if (outcomes.back().peak > cap) {
      std::fprintf(stderr, "llama2c_serve: the pool held %zu bytes, above its cap\n",
                   outcomes.back().peak);
      return 1;
    }
  }
  {
    // SnapKV bounds the prompt alone (decode steps never evict): its split leaves the
    // continuation room.
    const int growth = o.method == "snapkv" ? o.length - o.prompt : 0;
    const vc::KVCacheConfig cfg = config_of(o.method, std::max(split_rows - growth, 8));
    outcomes.push_back(server.run(
        "static split", [&](int) { return vc::KVCacheBuilder::for_model<T>(n_layers, cfg); }, 0));
  }
  {
    const vc::KVCacheConfig cfg = config_of("standard", 512);
    outcomes.push_back(server.run(
        "preempt", [&](int) { return vc::KVCacheBuilder::for_model<T>(n_layers, cfg); }, cap));
  }
  std::printf("%-13s %12s %9s %9s %9s %8s %10s %6s %8s %9s\n", "way", "peak bytes", "peak/cap",
              "mean KL", "max KL", "preempt", "recomputed", "waits", "steps", "seconds");
  for (const Outcome& r : outcomes) {
    double mean = 0, mx = 0;
    for (double k : r.kl) {
      mean += k;
      mx = std::max(mx, k);
    }
    mean /= static_cast<double>(r.kl.size());
    std::printf("%-13s %12zu %9.3f %9.5f %9.5f %8d %10ld %6d %8d %9.3f\n", r.name.c_str(), r.peak,
                static_cast<double>(r.peak) / static_cast<double>(cap), mean, mx, r.preemptions,
                r.recomputed, r.waits, r.steps, r.seconds);
  }
  std::printf("\nKL per request (pool / static split):");
  for (std::size_t i = 0; i < outcomes[0].kl.size(); ++i) {
    std::printf(" %.4f/%.4f", outcomes[0].kl[i], outcomes[1].kl[i]);
  }
  std::printf("\n");
  if (!o.csv.empty()) {
    std::ofstream csv(o.csv);
    csv << "way,step";
    for (int i = 0; i < o.requests; ++i) csv << ",request" << i;
    csv << ",cap\n";
    for (const Outcome& r : outcomes) {
      for (std::size_t t = 0; t < r.bytes.size(); ++t) {
        csv << r.name << ',' << t;
        for (std::size_t b : r.bytes[t]) csv << ',' << b;
        csv << ',' << cap << '\n';
      }
    }
    if (!csv) throw std::runtime_error("cannot write '" + o.csv + "'");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.fixtures = ll::fixtures_dir(VELOXQUANT_FIXTURES_DEFAULT);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool v = i + 1 < argc;
    if (a == "--fixtures" && v) o.fixtures = argv[++i];
    else if (a == "--requests" && v) o.requests = std::atoi(argv[++i]);
    else if (a == "--prompt" && v) o.prompt = std::atoi(argv[++i]);
    else if (a == "--length" && v) o.length = std::atoi(argv[++i]);
    else if (a == "--gap" && v) o.gap = std::atoi(argv[++i]);
    else if (a == "--method" && v) o.method = argv[++i];
    else if (a == "--budget" && v) o.budget = std::atoi(argv[++i]);
    else if (a == "--cap-share" && v) o.cap_share = std::atof(argv[++i]);
    else if (a == "--cap" && v) o.cap = static_cast<std::size_t>(std::atoll(argv[++i]));
    else if (a == "--storage" && v) o.storage = argv[++i];
    else if (a == "--no-queries") o.queries = false;
    else if (a == "--csv" && v) o.csv = argv[++i];
    else if (a == "--rule" && v) o.rule = argv[++i];
    else if (a == "--range" && v) {
      const std::string r = argv[++i];
      const std::size_t colon = r.find(':');
      if (colon == std::string::npos) return usage(argv[0]);
      o.range_from = std::stoul(r.substr(0, colon));
      o.range_to = std::stoul(r.substr(colon + 1));
    } else {
      return usage(argv[0]);
    }
  }
  if (o.requests < 1 || o.prompt < 1 || o.length <= o.prompt || o.gap < 0) return usage(argv[0]);
  if (o.method == "kvzip" || o.method == "standard") {
    std::fprintf(stderr, "llama2c_serve: --method %s is not served here (standard does not evict; "
                         "kvzip compresses through its re-read, llama2c_generate --kvzip)\n",
                 o.method.c_str());
    return 2;
  }
  try {
    return o.storage == "float" ? serve<float>(o) : serve<Eigen::half>(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama2c_serve: %s\n", e.what());
    return 1;
  }
}
