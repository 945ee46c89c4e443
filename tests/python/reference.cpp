// The reference numbers of tests/python/test_veloxquant.py, from the C++ library itself: each
// scenario builds a model's caches with KVCacheBuilder::for_model and runs a script of calls
// (update_and_fetch with or without queries, attend) and set operations (fork, checkpoint,
// rollback, reset, save_prompt_cache + load_prompt_cache) on inputs from a fixed LCG.
//
// veloxquant_py_reference <dir> writes
//   <dir>/trace.txt  one line per record (below), tokens separated by spaces
//   <dir>/data.bin   the inputs in the scenario's dtype and the outputs as float32, at the byte
//                    offsets trace.txt gives
//   <dir>/<scenario>.vqkv  the prompt caches the scenarios saved
// Records:
//   scenario <name> <storage> <input dtype> <n_layers>   then: config <field> <value> (every one)
//   build <set>
//   update <set> <layer> <B> <H> <Hq> <S> <Dk> <Dv> <k> <v> <q> <n> <K> <V>  (Hq 0, q -1: none)
//   attend <set> <layer> <B> <H> <Hq> <S> <Dk> <Dv> <q> <k> <v> <out>
//   fork <set> <new set> | checkpoint <set> | rollback <set> | reset <set>
//   saveload <set> <file>   (saved with metadata scenario=<name>, then replaced by the loaded set)
//   state <set> <layer> <offset> <layer_budget> <tokens_kept> <kept_bytes of the set>
//         <tokens_seen> <kept_bytes> <full_seq_bytes> <compression_ratio> <concentration>
//         <is_trimmable 0/1>   (the layer's; the doubles in %.17g, which reads back exactly;
//         concentration 0 for a layer not SqueezeAttention's)
//   end
// A state record follows every call (its layer) and every set operation (every layer).
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

namespace vc = veloxquant::cache;

namespace {

template <class T>
using Caches = std::vector<std::unique_ptr<vc::KVCache<T>>>;

enum class Op { attend, update_q, update };

struct Scenario {
  std::string name, storage, dtype;
  vc::KVCacheConfig config;
  int n_layers = 2, batch = 1, kv_heads = 2, group = 2, key_dim = 8, value_dim = 8;
  std::vector<Op> ops;              // layer l runs ops[l % ops.size()]
  std::vector<std::string> script;  // "call <set> <S>", "fork <set> <new>", "checkpoint <set>", ...
};

// Inputs in [-2, 2) from a 64-bit LCG (Knuth's MMIX constants).
struct Lcg {
  std::uint64_t state;
  double next() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 11) * 0x1.0p-53 * 4.0 - 2.0;
  }
};

template <class U>
U from_double(double x) {
  if constexpr (std::is_same_v<U, double>) {
    return x;
  } else if constexpr (std::is_same_v<U, float>) {
    return static_cast<float>(x);
  } else {
    return U(static_cast<float>(x));
  }
}

class Trace {
 public:
  explicit Trace(const std::string& dir)
      : txt_(dir + "/trace.txt"), bin_(dir + "/data.bin", std::ios::binary) {
    if (!txt_ || !bin_) throw std::runtime_error("cannot create the trace files in " + dir);
  }
  std::ostream& out() { return txt_; }
  // Appends the elements of t (as stored, or converted to float) and returns their byte offset.
  template <class U>
  std::int64_t put(const vc::Tensor4<U>& t) {
    const std::int64_t at = pos_;
    const auto bytes = static_cast<std::streamsize>(static_cast<std::size_t>(t.size()) * sizeof(U));
    bin_.write(reinterpret_cast<const char*>(t.data()), bytes);
    pos_ += bytes;
    return at;
  }
  template <class T>
  std::int64_t put_float(const vc::Tensor4<T>& t) {
    const vc::Tensor4<float> f = t.template cast<float>();
    return put(f);
  }
  void close() {
    txt_.close();
    bin_.close();
    if (!txt_ || !bin_) throw std::runtime_error("writing the trace failed");
  }

 private:
  std::ofstream txt_, bin_;
  std::int64_t pos_ = 0;
};

std::string text(const std::string& v) { return v; }
std::string text(int v) { return std::to_string(v); }
std::string text(bool v) { return v ? "true" : "false"; }
std::string text(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest text that reads back
  return std::string(buf, r.ptr);
}
std::string text(const std::optional<int>& v) { return v ? std::to_string(*v) : "none"; }

template <class T, class U>
class Runner {
 public:
  Runner(const Scenario& sc, Trace& trace, std::string dir)
      : sc_(sc), tr_(trace), dir_(std::move(dir)), rng_{0x5eed0000ULL + sc.name.size()} {}

  void run() {
    tr_.out() << "scenario " << sc_.name << ' ' << sc_.storage << ' ' << sc_.dtype << ' '
              << sc_.n_layers << '\n';
    vc::KVCacheConfig copy = sc_.config;
    vc::detail::for_each_config_field(copy, [&](const char* field, auto& member) {
      tr_.out() << "config " << field << ' ' << text(member) << '\n';
    });
    sets_[0] = vc::KVCacheBuilder::for_model<T>(sc_.n_layers, sc_.config);
    tr_.out() << "build 0\n";
    state(0);
    for (const std::string& line : sc_.script) command(line);
    tr_.out() << "end\n";
  }

 private:
  // [B, heads, seq, dim] from the LCG, plus `lean` times +-1 alternating along D: keys that lean
  // one way (deeper layers lean more) are concentrated, so squeeze layers get different budgets.
  vc::Tensor4<U> input(int heads, int seq, int dim, double lean = 0.0) {
    vc::Tensor4<U> t(sc_.batch, heads, seq, dim);
    for (Eigen::Index i = 0; i < t.size(); ++i) {
      t.data()[i] = from_double<U>(rng_.next() + (i % 2 == 0 ? lean : -lean));
    }
    return t;
  }

  void state(int s, int layer) {
    const Caches<T>& set = sets_.at(s);
    std::size_t kept = 0;
    for (const auto& c : set) kept += c->kept_bytes();
    const vc::KVCache<T>& c = *set[static_cast<std::size_t>(layer)];
    const auto* squeeze = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&c);
    char ratio[32], concentration[32];
    std::snprintf(ratio, sizeof ratio, "%.17g", c.compression_ratio());
    std::snprintf(concentration, sizeof concentration, "%.17g",
                  squeeze == nullptr ? 0.0 : squeeze->concentration());
    tr_.out() << "state " << s << ' ' << layer << ' ' << c.offset() << ' ' << c.layer_budget()
              << ' ' << c.tokens_kept() << ' ' << kept << ' ' << c.tokens_seen() << ' '
              << c.kept_bytes() << ' ' << c.full_seq_bytes() << ' ' << ratio << ' ' << concentration
              << ' ' << (c.is_trimmable() ? 1 : 0) << '\n';
  }
  void state(int s) {
    for (int l = 0; l < sc_.n_layers; ++l) state(s, l);
  }

  void call(int s, int seq) {
    const int B = sc_.batch, H = sc_.kv_heads, Hq = H * sc_.group;
    const int Dk = sc_.key_dim, Dv = sc_.value_dim;
    for (int l = 0; l < sc_.n_layers; ++l) {
      vc::KVCache<T>& cache = *sets_.at(s)[static_cast<std::size_t>(l)];
      const Op op = sc_.ops[static_cast<std::size_t>(l) % sc_.ops.size()];
      const vc::Tensor4<U> k = input(H, seq, Dk, 0.75 * l), v = input(H, seq, Dv);
      const vc::Tensor4<U> q = op == Op::update ? vc::Tensor4<U>() : input(Hq, seq, Dk);
      std::ostream& o = tr_.out();
      if (op == Op::attend) {
        const vc::Tensor4<float> out = cache.attend(q, k, v);
        o << "attend " << s << ' ' << l << ' ' << B << ' ' << H << ' ' << Hq << ' ' << seq << ' '
          << Dk << ' ' << Dv << ' ' << tr_.put(q) << ' ' << tr_.put(k) << ' ' << tr_.put(v) << ' '
          << tr_.put(out) << '\n';
      } else {
        const std::int64_t ko = tr_.put(k), vo = tr_.put(v);
        const std::int64_t qo = op == Op::update ? -1 : tr_.put(q);
        const vc::KVPair<T> kv =
            op == Op::update ? cache.update_and_fetch(k, v) : cache.update_and_fetch(k, v, q);
        o << "update " << s << ' ' << l << ' ' << B << ' ' << H << ' '
          << (op == Op::update ? 0 : Hq) << ' ' << seq << ' ' << Dk << ' ' << Dv << ' ' << ko << ' '
          << vo << ' ' << qo << ' ' << kv.first.dimension(2) << ' ' << tr_.put_float(kv.first)
          << ' ' << tr_.put_float(kv.second) << '\n';
      }
      state(s, l);
    }
  }

  void command(const std::string& line) {
    std::istringstream in(line);
    std::string what;
    int s = 0, arg = 0;
    in >> what >> s;
    if (what == "call") {
      in >> arg;
      call(s, arg);
      return;
    }
    if (what == "fork") {
      in >> arg;
      sets_[arg] = vc::KVCacheBuilder::fork(sets_.at(s));
      tr_.out() << "fork " << s << ' ' << arg << '\n';
      state(arg);
      return;
    }
    if (what == "checkpoint") {
      vc::KVCacheBuilder::checkpoint(sets_.at(s));
    } else if (what == "rollback") {
      vc::KVCacheBuilder::rollback(sets_.at(s));
    } else if (what == "reset") {
      vc::KVCacheBuilder::reset(sets_.at(s));
    } else if (what == "saveload") {
      const std::string file = sc_.name + ".vqkv";
      vc::save_prompt_cache(dir_ + "/" + file, sets_.at(s), {{"scenario", sc_.name}});
      vc::PromptCache<T> pc = vc::load_prompt_cache<T>(dir_ + "/" + file);
      if (pc.metadata.at("scenario") != sc_.name) throw std::runtime_error("metadata lost");
      sets_[s] = std::move(pc.caches);
      tr_.out() << "saveload " << s << ' ' << file << '\n';
      state(s);
      return;
    } else {
      throw std::runtime_error("unknown script command: " + line);
    }
    tr_.out() << what << ' ' << s << '\n';
    state(s);
  }

  const Scenario& sc_;
  Trace& tr_;
  std::string dir_;
  Lcg rng_;
  std::map<int, Caches<T>> sets_;
};

// `times` copies of `line`.
std::vector<std::string> repeat(const std::string& line, int times) {
  return std::vector<std::string>(static_cast<std::size_t>(times), line);
}
std::vector<std::string> concat(std::initializer_list<std::vector<std::string>> parts) {
  std::vector<std::string> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<Scenario> scenarios() {
  std::vector<Scenario> out;
  const std::vector<Op> mixed = {Op::attend, Op::update_q, Op::update};
  {  // SqueezeAttention with real queries, a small budget, budgets decided mid-decode
    Scenario s{"squeeze_half", "half", "float32", {}, 3, 1, 2, 2, 8, 8, mixed, {}};
    s.config.set_budget(12);
    s.config.squeeze_n_sink = 2;
    s.config.squeeze_calibration_tokens = 16;
    // The checkpoint is taken before the coordinator decides (offset 16), the rollback after.
    s.script = concat({{"call 0 10", "call 0 4", "call 0 1", "checkpoint 0"},
                       repeat("call 0 1", 3),
                       {"rollback 0"},
                       repeat("call 0 1", 6)});
    out.push_back(s);
  }
  {  // float rows, double inputs, values narrower than keys, a save/load in the middle
    Scenario s{"squeeze_float_f64",        "float", "float64", {}, 2, 2, 2, 1, 8, 4,
               {Op::update_q, Op::attend}, {}};
    s.config.set_budget(10);
    s.config.squeeze_n_sink = 0;
    s.config.squeeze_decay = 0.95;
    s.config.value_norm_power = 2.0;
    s.script = concat(
        {{"call 0 12", "call 0 8"}, repeat("call 0 1", 8), {"saveload 0"}, repeat("call 0 1", 8)});
    out.push_back(s);
  }
  {  // query-free SqueezeAttention (keydiff), deferred eviction
    Scenario s{"squeeze_keydiff_defer", "half", "float32", {}, 3, 1, 2, 1, 8, 8, {Op::update}, {}};
    s.config.set_budget(8);
    s.config.squeeze_n_sink = 1;
    s.config.squeeze_defer = true;
    s.config.squeeze_calibration_tokens = 8;
    s.config.proxy_scoring = "keydiff";
    s.script = concat({{"call 0 6"}, repeat("call 0 1", 6)});
    out.push_back(s);
  }
  {  // H2O, half inputs, four query heads per KV head, a fork continued beside its source
    Scenario s{
        "h2o_half_f16", "half", "float16", {}, 2, 1, 1, 4, 16, 16, {Op::attend, Op::update_q}, {}};
    s.config.method = "h2o";
    s.config.set_budget(10);
    s.config.h2o_grace = 2;
    s.config.h2o_n_sink = 1;
    s.script = concat({{"call 0 16"}, repeat("call 0 1", 4), {"fork 0 1"}});
    for (int i = 0; i < 4; ++i) s.script.insert(s.script.end(), {"call 0 1", "call 1 1"});
    s.script.push_back("call 1 3");
    out.push_back(s);
  }
  {  // SnapKV: two prompt chunks past the budget, then decode steps that only append
    Scenario s{
        "snapkv_float", "float", "float32", {}, 2, 1, 2, 2, 8, 8, {Op::update_q, Op::attend}, {}};
    s.config.method = "snapkv";
    s.config.set_budget(12);
    s.config.snap_obs_window = 4;
    s.config.snap_n_sink = 2;
    s.script = concat({{"call 0 20", "call 0 10"}, repeat("call 0 1", 6)});
    out.push_back(s);
  }
  {  // the standard cache keeps everything; a reset starts over
    Scenario s{"standard_half",          "half", "float32", {}, 2, 1, 2, 1, 4, 4,
               {Op::update, Op::attend}, {}};
    s.config.method = "standard";
    s.script = concat(
        {{"call 0 6"}, repeat("call 0 1", 4), {"reset 0", "call 0 5"}, repeat("call 0 1", 2)});
    out.push_back(s);
  }
  {  // TOVA on bfloat16 rows from bfloat16 inputs
    Scenario s{"tova_bf16", "bfloat16", "bfloat16", {}, 2, 1, 2, 2, 8, 8, mixed, {}};
    s.config.method = "tova";
    s.config.set_budget(8);
    s.config.tova_n_sink = 1;
    s.script = concat({{"call 0 10"}, repeat("call 0 1", 6)});
    out.push_back(s);
  }
  {  // PyramidKV over four layers
    Scenario s{"pyramidkv_float", "float", "float32", {}, 4, 1, 1, 2, 8, 8, mixed, {}};
    s.config.method = "pyramidkv";
    s.config.set_budget(10);
    s.config.pyramid_n_sink = 1;
    s.script = concat({{"call 0 16"}, repeat("call 0 1", 5)});
    out.push_back(s);
  }
  {  // StreamingLLM from double inputs
    Scenario s{"streaming_half_f64",     "half", "float64", {}, 2, 1, 2, 1, 8, 8,
               {Op::update, Op::attend}, {}};
    s.config.method = "streaming_llm";
    s.config.stream_n_sink = 2;
    s.config.set_budget(8);
    s.script = concat({{"call 0 12"}, repeat("call 0 1", 4)});
    out.push_back(s);
  }
  return out;
}

// The (storage, input dtype) pairs the scenarios use, each instantiated once.
void run(const Scenario& sc, Trace& trace, const std::string& dir) {
  const std::string pair = sc.storage + "/" + sc.dtype;
  if (pair == "half/float32") {
    Runner<Eigen::half, float>(sc, trace, dir).run();
  } else if (pair == "half/float16") {
    Runner<Eigen::half, Eigen::half>(sc, trace, dir).run();
  } else if (pair == "half/float64") {
    Runner<Eigen::half, double>(sc, trace, dir).run();
  } else if (pair == "bfloat16/bfloat16") {
    Runner<Eigen::bfloat16, Eigen::bfloat16>(sc, trace, dir).run();
  } else if (pair == "float/float32") {
    Runner<float, float>(sc, trace, dir).run();
  } else if (pair == "float/float64") {
    Runner<float, double>(sc, trace, dir).run();
  } else {
    throw std::runtime_error("no instantiation for " + pair);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " <output directory>\n";
    return 2;
  }
  try {
    const std::string dir = argv[1];
    Trace trace(dir);
    for (const Scenario& sc : scenarios()) run(sc, trace, dir);
    trace.close();
  } catch (const std::exception& e) {
    std::cerr << "veloxquant_py_reference: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
