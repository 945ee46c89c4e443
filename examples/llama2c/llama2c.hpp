// veloxquant example — a small, readable inference engine for llama2.c checkpoints (the legacy
// float32 format, e.g. stories260K) whose attention runs on veloxquant's KV caches.
//
//   Model      the checkpoint's weights as row-major Eigen matrices
//   Tokenizer  llama2.c's tokenizer.bin format: encode (BPE merges by score) and decode
//   Engine<T>  the forward pass; one KVCache<T> per layer, any policy the library offers
//
// Everything is float32 except the cached keys and values, which are stored as T.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

namespace veloxquant::llama2c {

/// Row-major float matrix; every weight matrix has shape [out, in], so y = x · W^T for rows x.
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

inline constexpr int kBos = 1;  ///< beginning of sequence; generation stops when it is produced

/// The seven int32 of the checkpoint header (vocab_size stored as its absolute value).
struct ModelConfig {
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0,
      seq_len = 0;
  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
};

/// The weights of one transformer layer.
struct LayerWeights {
  Eigen::VectorXf rms_att, rms_ffn;  // [dim]
  RowMatrix wq, wo;                  // [dim, dim]
  RowMatrix wk, wv;                  // [kv_dim, dim]
  RowMatrix w1, w3;                  // [hidden_dim, dim] (gate, up)
  RowMatrix w2;                      // [dim, hidden_dim] (down)
};

namespace detail {

/// The whole file; throws std::runtime_error naming `path` when it cannot be read.
inline std::vector<char> read_file(const std::string& path, const std::string& who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(who + ": cannot open '" + path + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(who + ": error while reading '" + path + "'");
  return bytes;
}

inline bool little_endian_host() {
  const std::uint32_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

/// Copies `count` little-endian values of type V from bytes[offset...] (caller checked the size).
template <class V>
void copy_out(const std::vector<char>& bytes, std::size_t offset, V* out, std::size_t count) {
  std::memcpy(out, bytes.data() + offset, count * sizeof(V));
}

}  // namespace detail

/// A llama2.c checkpoint held in memory.
class Model {
 public:
  /// Loads the legacy llama2.c format: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
  /// vocab_size, seq_len), then float32 arrays, with or without the legacy freq_cis block (which
  /// is skipped: RoPE is computed). A negative vocab_size means an own classifier follows at the
  /// end. Throws std::runtime_error naming the file and the problem.
  static Model load(const std::string& path) {
    const std::string who = "llama2c::Model::load";
    const auto fail = [&](const std::string& why) {
      return std::runtime_error(who + ": '" + path + "': " + why);
    };
    if (!detail::little_endian_host()) throw fail("big-endian hosts are not supported");
    const std::vector<char> bytes = detail::read_file(path, who);
    constexpr std::size_t kHeader = 7 * sizeof(std::int32_t);
    if (bytes.size() < kHeader) {
      throw fail("file is " + std::to_string(bytes.size()) + " bytes, shorter than the " +
                 std::to_string(kHeader) + "-byte header");
    }
    std::int32_t h[7];
    detail::copy_out(bytes, 0, h, 7);
    const char* names[7] = {"dim",        "hidden_dim", "n_layers", "n_heads",
                            "n_kv_heads", "vocab_size", "seq_len"};
    for (int i = 0; i < 7; ++i) {
      const std::int64_t v = i == 5 ? std::llabs(h[i]) : h[i];  // vocab_size may be negative
      if (v < 1 || v > 1000000) {
        throw fail("bad header: " + std::string(names[i]) + " = " + std::to_string(h[i]) +
                   (i == 5 ? " (|vocab_size| must be in [1, 1e6])" : " (must be in [1, 1e6])"));
      }
    }
    Model m;
    ModelConfig& c = m.config_;
    c = ModelConfig{h[0], h[1], h[2], h[3], h[4], static_cast<int>(std::llabs(h[5])), h[6]};
    m.shared_classifier_ = h[5] > 0;
    if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.head_dim() % 2 != 0) {
      throw fail("bad header: dim (" + std::to_string(c.dim) + ") must be a multiple of n_heads (" +
                 std::to_string(c.n_heads) + ") with an even head_dim, and n_heads a multiple of " +
                 "n_kv_heads (" + std::to_string(c.n_kv_heads) + ")");
    }

    // Float counts of the two layouts (double first, so an absurd header cannot overflow).
    const double d = c.dim, hd = c.hidden_dim, L = c.n_layers, kv = c.kv_dim(), V = c.vocab_size;
    const double weights_d = V * d + L * (2 * d + 2 * d * d + 2 * kv * d + 3 * hd * d) + d +
                             (m.shared_classifier_ ? 0.0 : V * d);
    if (4.0 * (weights_d + double(c.seq_len) * c.head_dim()) > 1e12) {
      throw fail("bad header: it describes " + std::to_string(weights_d) + " floats");
    }
    const auto weights = static_cast<std::size_t>(weights_d);
    const auto freq_cis =
        static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.head_dim());
    const std::size_t with_freq = kHeader + 4 * (weights + freq_cis);
    const std::size_t without_freq = kHeader + 4 * weights;
    if (bytes.size() != with_freq && bytes.size() != without_freq) {
      throw fail("size " + std::to_string(bytes.size()) + " bytes matches no layout for this " +
                 "header: expected " + std::to_string(with_freq) + " bytes (with the legacy " +
                 "freq_cis block) or " + std::to_string(without_freq) + " bytes (without it)");
    }

    // The arrays, in file order; per-layer arrays are stacked along the layer axis first.
    std::size_t offset = kHeader;
    const auto read = [&](auto& target, Eigen::Index rows, Eigen::Index cols) {
      target.resize(rows, cols);
      detail::copy_out(bytes, offset, target.data(), static_cast<std::size_t>(rows * cols));
      offset += 4 * static_cast<std::size_t>(rows * cols);
    };
    m.layers_.resize(static_cast<std::size_t>(c.n_layers));
    const Eigen::Index D = c.dim, H = c.hidden_dim, KV = c.kv_dim();
    read(m.token_embedding_, c.vocab_size, D);
    for (auto& l : m.layers_) read(l.rms_att, D, 1);
    for (auto& l : m.layers_) read(l.wq, D, D);
    for (auto& l : m.layers_) read(l.wk, KV, D);
    for (auto& l : m.layers_) read(l.wv, KV, D);
    for (auto& l : m.layers_) read(l.wo, D, D);
    for (auto& l : m.layers_) read(l.rms_ffn, D, 1);
    for (auto& l : m.layers_) read(l.w1, H, D);
    for (auto& l : m.layers_) read(l.w2, D, H);
    for (auto& l : m.layers_) read(l.w3, H, D);
    read(m.rms_final_, D, 1);
    if (bytes.size() == with_freq) offset += 4 * freq_cis;  // cos/sin tables: RoPE is computed
    if (!m.shared_classifier_) read(m.classifier_, c.vocab_size, D);
    return m;
  }

  const ModelConfig& config() const { return config_; }
  const RowMatrix& token_embedding() const { return token_embedding_; }  // [vocab, dim]
  /// The output projection: the token embedding when shared, else the file's own. [vocab, dim]
  const RowMatrix& classifier() const {
    return shared_classifier_ ? token_embedding_ : classifier_;
  }
  bool shared_classifier() const { return shared_classifier_; }
  const LayerWeights& layer(int l) const { return layers_.at(static_cast<std::size_t>(l)); }
  const Eigen::VectorXf& rms_final() const { return rms_final_; }  // [dim]

 private:
  Model() = default;  // only load() makes one

  ModelConfig config_{};
  bool shared_classifier_ = true;
  RowMatrix token_embedding_, classifier_;
  std::vector<LayerWeights> layers_;
  Eigen::VectorXf rms_final_;
};

/// llama2.c's tokenizer: one (score, piece) record per id; byte fallback pieces <0x00>..<0xFF>.
class Tokenizer {
 public:
  /// Reads int32 max_token_length, then vocab_size records (float score, int32 len, len bytes).
  /// Throws std::invalid_argument for vocab_size < 1, std::runtime_error naming the file for a
  /// missing, truncated or malformed file.
  static Tokenizer load(const std::string& path, int vocab_size) {
    const std::string who = "llama2c::Tokenizer::load";
    if (vocab_size < 1) {
      throw std::invalid_argument(who + ": vocab_size (" + std::to_string(vocab_size) +
                                  ") must be >= 1");
    }
    const auto fail = [&](const std::string& why) {
      return std::runtime_error(who + ": '" + path + "': " + why);
    };
    const std::vector<char> bytes = detail::read_file(path, who);
    std::size_t offset = 0;
    const auto need = [&](std::size_t n, const std::string& what) {
      if (bytes.size() - offset < n) {
        throw fail("truncated: " + what + " needs " + std::to_string(n) + " bytes at offset " +
                   std::to_string(offset) + ", the file has " + std::to_string(bytes.size()));
      }
    };
    need(4, "the max_token_length header");
    std::int32_t max_len = 0;
    detail::copy_out(bytes, 0, &max_len, 1);
    offset = 4;
    if (max_len < 1 || max_len > 4096) {
      throw fail("bad max_token_length " + std::to_string(max_len) + " (must be in [1, 4096])");
    }
    Tokenizer t;
    for (int id = 0; id < vocab_size; ++id) {
      const std::string what = "the record of token " + std::to_string(id);
      need(8, what);
      float score = 0.0f;
      std::int32_t len = 0;
      detail::copy_out(bytes, offset, &score, 1);
      detail::copy_out(bytes, offset + 4, &len, 1);
      offset += 8;
      if (len < 1 || len > max_len || !std::isfinite(score)) {
        throw fail("bad record of token " + std::to_string(id) + ": length " + std::to_string(len) +
                   " (max_token_length " + std::to_string(max_len) + "), score " +
                   std::to_string(score));
      }
      need(static_cast<std::size_t>(len), what);
      t.pieces_.emplace_back(bytes.data() + offset, static_cast<std::size_t>(len));
      t.scores_.push_back(score);
      t.ids_.emplace(t.pieces_.back(), id);  // the first id wins for a duplicated piece
      offset += static_cast<std::size_t>(len);
    }
    return t;
  }

  int vocab_size() const { return static_cast<int>(pieces_.size()); }

  /// llama2.c encode: optional BOS, a dummy space before non-empty text, one id per UTF-8 code
  /// point (its bytes as ids b + 3 when it has no piece), then repeated merges of the adjacent
  /// pair with the highest-scoring concatenation (leftmost on ties).
  std::vector<int> encode(const std::string& text, bool bos) const {
    std::vector<int> out;
    if (bos) out.push_back(kBos);
    if (text.empty()) return out;
    const std::string s = " " + text;
    std::vector<int> ids;
    for (std::size_t i = 0; i < s.size();) {
      std::size_t j = i + 1;
      while (j < s.size() && j - i < 4 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) ++j;
      const auto it = ids_.find(s.substr(i, j - i));
      if (it != ids_.end()) {
        ids.push_back(it->second);
      } else {
        for (std::size_t b = i; b < j; ++b) {  // byte fallback; <unk> if the vocab lacks it
          const int byte_id = static_cast<unsigned char>(s[b]) + 3;
          ids.push_back(byte_id < vocab_size() ? byte_id : 0);
        }
      }
      i = j;
    }
    // merge[i]: the id of pieces ids[i] + ids[i + 1], or -1. Only the neighbours of a merge change.
    const auto merge_of = [&](std::size_t i) {
      const auto it = ids_.find(pieces_[static_cast<std::size_t>(ids[i])] +
                                pieces_[static_cast<std::size_t>(ids[i + 1])]);
      return it == ids_.end() ? -1 : it->second;
    };
    std::vector<int> merge(ids.size() - 1);
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) merge[i] = merge_of(i);
    for (;;) {
      float best_score = -std::numeric_limits<float>::infinity();
      std::size_t best = merge.size();
      for (std::size_t i = 0; i < merge.size(); ++i) {
        if (merge[i] >= 0 && scores_[static_cast<std::size_t>(merge[i])] > best_score) {
          best_score = scores_[static_cast<std::size_t>(merge[i])];
          best = i;
        }
      }
      if (best == merge.size()) break;
      ids[best] = merge[best];
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      merge.erase(merge.begin() + static_cast<std::ptrdiff_t>(best));
      if (best > 0) merge[best - 1] = merge_of(best - 1);
      if (best < merge.size()) merge[best] = merge_of(best);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }

  /// The text of `token` after `prev_token`: the leading space of the first piece after BOS is
  /// dropped, and a <0xHH> piece stands for the raw byte 0xHH. Throws std::invalid_argument for
  /// an id out of range.
  std::string decode(int prev_token, int token) const {
    if (token < 0 || token >= vocab_size()) {
      throw std::invalid_argument("llama2c::Tokenizer::decode: token id " + std::to_string(token) +
                                  " out of range [0, " + std::to_string(vocab_size()) + ")");
    }
    const std::string& piece = pieces_[static_cast<std::size_t>(token)];
    if (piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && piece[5] == '>') {
      char* end = nullptr;
      const std::string hex = piece.substr(3, 2);
      const long byte = std::strtol(hex.c_str(), &end, 16);
      if (end == hex.c_str() + 2) return std::string(1, static_cast<char>(byte));
    }
    if (prev_token == kBos && piece[0] == ' ') return piece.substr(1);
    return piece;
  }

  /// A whole sequence; decoded as if it followed BOS (a leading BOS is skipped).
  std::string decode(const std::vector<int>& ids) const {
    std::string out;
    int prev = kBos;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i == 0 && ids[i] == kBos) continue;
      out += decode(prev, ids[i]);
      prev = ids[i];
    }
    return out;
  }

 private:
  Tokenizer() = default;  // only load() makes one

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> ids_;
};

namespace detail {

/// Row-wise RMS norm (eps 1e-5) scaled by w. x: [S, dim], w: [dim]; returns [S, dim].
inline RowMatrix rmsnorm(const RowMatrix& x, const Eigen::VectorXf& w) {
  RowMatrix out(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const float ms = x.row(r).squaredNorm() / static_cast<float>(x.cols()) + 1e-5f;
    out.row(r) = (x.row(r) * (1.0f / std::sqrt(ms))).cwiseProduct(w.transpose());
  }
  return out;
}

/// RoPE in place: rotates the pairs (2i, 2i+1) of every head of row s by
/// (pos0 + s) · 10000^(-2i / head_dim). m: [S, n_heads · head_dim]
inline void apply_rope(RowMatrix& m, std::int64_t pos0, int head_dim) {
  for (Eigen::Index s = 0; s < m.rows(); ++s) {
    const auto pos = static_cast<float>(pos0 + s);
    for (int i = 0; i < head_dim; i += 2) {
      const float freq =
          1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(head_dim));
      const float cos_a = std::cos(pos * freq), sin_a = std::sin(pos * freq);
      for (Eigen::Index c = i; c < m.cols(); c += head_dim) {
        const float x0 = m(s, c), x1 = m(s, c + 1);
        m(s, c) = x0 * cos_a - x1 * sin_a;
        m(s, c + 1) = x0 * sin_a + x1 * cos_a;
      }
    }
  }
}

}  // namespace detail

/// How a layer's attention uses its cache.
enum class AttentionPath {
  fused,  ///< cache.attend(q, k, v, out): the cache absorbs the rows and computes the attention
  view,   ///< cache.update_and_view(k, v[, q]), then the engine's own attention over the view
};

/// The forward pass over one KVCache<T> per layer (T: float, Eigen::half or Eigen::bfloat16).
/// The model must outlive the engine.
template <class T = float>
class Engine {
 public:
  using Caches = std::vector<std::unique_ptr<cache::KVCache<T>>>;

  /// One cache per layer (else std::invalid_argument). pass_queries: give the caches the real
  /// queries so the scored policies rank rows by real attention; then `path` says whether the
  /// cache computes the attention too (attend, the default) or the engine does, over the view.
  /// Without queries the view path is used (attend needs the queries).
  Engine(const Model& model, Caches caches, bool pass_queries = false,
         AttentionPath path = AttentionPath::fused)
      : model_(&model), caches_(std::move(caches)), pass_queries_(pass_queries),
        path_(pass_queries ? path : AttentionPath::view) {
    const int n_layers = model.config().n_layers;
    if (caches_.size() != static_cast<std::size_t>(n_layers)) {
      throw std::invalid_argument("llama2c::Engine: " + std::to_string(caches_.size()) +
                                  " caches given for a model of " + std::to_string(n_layers) +
                                  " layers (one per layer needed)");
    }
    for (std::size_t l = 0; l < caches_.size(); ++l) {
      if (!caches_[l]) {
        throw std::invalid_argument("llama2c::Engine: the cache of layer " + std::to_string(l) +
                                    " is null");
      }
    }
  }

  /// Runs `tokens` through the model as one call per layer (a prefill when there are several, a
  /// decode step for one), at positions position() + i. Returns logits [tokens.size(), vocab]:
  /// row i predicts the token after tokens[i]. Throws std::invalid_argument (nothing changed) for
  /// an empty list, an id out of range or a sequence longer than seq_len.
  Eigen::MatrixXf forward(const std::vector<int>& tokens) {
    const ModelConfig& c = model_->config();
    if (tokens.empty()) throw std::invalid_argument("llama2c::Engine::forward: no tokens");
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
        throw std::invalid_argument("llama2c::Engine::forward: token id " +
                                    std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                    " out of range [0, " + std::to_string(c.vocab_size) + ")");
      }
    }
    const auto S = static_cast<Eigen::Index>(tokens.size());
    if (position() + S > c.seq_len) {
      throw std::invalid_argument("llama2c::Engine::forward: " + std::to_string(S) +
                                  " tokens at position " + std::to_string(position()) +
                                  " exceed seq_len " + std::to_string(c.seq_len));
    }
    RowMatrix x(S, c.dim);  // the residual stream: [S, dim]
    for (Eigen::Index s = 0; s < S; ++s)
      x.row(s) = model_->token_embedding().row(tokens[static_cast<std::size_t>(s)]);
    for (int l = 0; l < c.n_layers; ++l) {
      attention(l, x);
      feed_forward(model_->layer(l), x);
    }
    return detail::rmsnorm(x, model_->rms_final()) * model_->classifier().transpose();
  }

  /// Tokens absorbed since the last reset.
  std::int64_t position() const { return caches_.front()->offset(); }
  /// Starts a new sequence (resets the caches and any shared coordinator).
  void reset() { cache::KVCacheBuilder::reset(caches_); }
  /// An independent engine over a copy of the caches (KVCacheBuilder::fork): it continues
  /// exactly as this one would, and neither changes the other (N samples of one prompt).
  Engine fork() const {
    return Engine(*model_, cache::KVCacheBuilder::fork(caches_), pass_queries_, path_);
  }
  /// Marks the caches' state; rollback() returns to it (speculative decoding).
  void checkpoint() { cache::KVCacheBuilder::checkpoint(caches_); }
  void rollback() { cache::KVCacheBuilder::rollback(caches_); }
  /// KVzip's observer (SPEC 18): while set, every layer's queries of this engine's forward passes
  /// are also given to observe() of `target`'s cache of that layer (null: none). The target's
  /// caches must outlive the forward passes that observe into them.
  /// With `own_keys`, the layer's keys go with the queries (KVCache::observe(q, k): each query's
  /// softmax also runs over the re-read up to its token, KVzip's own normalisation).
  void observe_into(const Caches* target, bool own_keys = false) {
    observe_into_ = target;
    observe_keys_ = own_keys;
  }
  /// KVzip's compress of this engine's caches (KVCacheBuilder::compress).
  void compress(double keep) { cache::KVCacheBuilder::compress(caches_, keep); }
  const Caches& caches() const { return caches_; }
  const Model& model() const { return *model_; }

  std::size_t kept_bytes() const {
    std::size_t total = 0;
    for (const auto& c : caches_) total += c->kept_bytes();
    return total;
  }
  std::size_t full_seq_bytes() const {
    std::size_t total = 0;
    for (const auto& c : caches_) total += c->full_seq_bytes();
    return total;
  }

 private:
  /// x += wo · attention(rmsnorm(x)) for layer l. x: [S, dim]
  void attention(int l, RowMatrix& x) {
    const ModelConfig& c = model_->config();
    const LayerWeights& w = model_->layer(l);
    const int hd = c.head_dim(), group = c.n_heads / c.n_kv_heads;
    cache::KVCache<T>& kv_cache = *caches_[static_cast<std::size_t>(l)];

    const RowMatrix h = detail::rmsnorm(x, w.rms_att);
    RowMatrix q = h * w.wq.transpose();        // [S, n_heads · hd]
    RowMatrix k = h * w.wk.transpose();        // [S, n_kv_heads · hd]
    const RowMatrix v = h * w.wv.transpose();  // [S, n_kv_heads · hd]
    detail::apply_rope(q, kv_cache.offset(), hd);
    detail::apply_rope(k, kv_cache.offset(), hd);

    // q, k, v are the engine's token-major rows: [1, S, heads, hd], read in place by the cache.
    const Eigen::Index S = x.rows();
    const cache::TensorRef<float> qr(q.data(), 1, c.n_heads, S, hd, cache::Layout::token_major);
    const cache::TensorRef<float> kr(k.data(), 1, c.n_kv_heads, S, hd, cache::Layout::token_major);
    const cache::TensorRef<float> vr(v.data(), 1, c.n_kv_heads, S, hd, cache::Layout::token_major);
    if (observe_into_ != nullptr) {
      cache::KVCache<T>& target = *(*observe_into_)[static_cast<std::size_t>(l)];
      if (observe_keys_) {
        target.observe(qr, kr);
      } else {
        target.observe(qr);
      }
    }
    RowMatrix out(S, c.dim);  // the heads' outputs side by side: [S, n_heads · hd] = [1, S, n_heads, hd]
    if (path_ == AttentionPath::fused) {
      kv_cache.attend(qr, kr, vr, out.data(), cache::Layout::token_major);
    } else {
      // The rows retained before the call (any order), then this call's S rows: [rows, hd] each.
      // Each head has its own count: under adaptive head budgets (head_budgets = "adaptive")
      // heads hold different numbers of rows and view.rows() would throw.
      const cache::KVView<T> view =
          pass_queries_ ? kv_cache.update_and_view(kr, vr, qr) : kv_cache.update_and_view(kr, vr);
      const float sqrt_hd = std::sqrt(static_cast<float>(hd));
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const Eigen::Index n = view.rows(0, g);
        const RowMatrix K = view.keys(0, g).template cast<float>();    // [n, hd]
        const RowMatrix V = view.values(0, g).template cast<float>();  // [n, hd]
        for (int j = g * group; j < (g + 1) * group; ++j) {  // the query heads reading kv head g
          RowMatrix p = (q.middleCols(j * hd, hd) * K.transpose()) / sqrt_hd;  // [S, n]
          for (Eigen::Index s = 0; s < S; ++s) {
            const Eigen::Index visible = n - S + s + 1;  // causal mask aligned to the lower right
            auto row = p.row(s).head(visible);
            row = (row.array() - row.maxCoeff()).exp().matrix();
            row /= row.sum();
            p.row(s).tail(n - visible).setZero();
          }
          out.middleCols(j * hd, hd) = p * V;
        }
      }
    }
    x += out * w.wo.transpose();
  }

  /// x += w2 · (silu(w1 · h) ⊙ (w3 · h)), h = rmsnorm(x). x: [S, dim]
  static void feed_forward(const LayerWeights& w, RowMatrix& x) {
    const RowMatrix h = detail::rmsnorm(x, w.rms_ffn);
    RowMatrix gate = h * w.w1.transpose();      // [S, hidden_dim]
    const RowMatrix up = h * w.w3.transpose();  // [S, hidden_dim]
    gate.array() = gate.array() * (1.0f / (1.0f + (-gate.array()).exp())) * up.array();
    x += gate * w.w2.transpose();
  }

  const Model* model_;
  Caches caches_;
  bool pass_queries_;
  AttentionPath path_;
  const Caches* observe_into_ = nullptr;
  bool observe_keys_ = false;
};

/// KVzip's whole procedure (SPEC 18, docs/design.md 6.1) on an engine whose kvzip caches hold a
/// prompt: a fork of them re-reads the prompt teacher-forced, `chunk` tokens at a time, each
/// chunk after the `cue` tokens in the same call (each from the prompt's own end: the fork rolls
/// back after each), and every layer's queries of that call are observed on the engine's own
/// caches (the cue's among them, so that with `own_keys` the cue's rows are in every softmax as
/// the re-read has them); then the engine's caches keep `keep` of their rows and the fork is
/// dropped. prompt: the tokens the caches hold.
/// `own_keys` (the default, measured better: docs/fidelity.md): each query's softmax also covers
/// the re-read's keys up to its token (KVzip's own normalisation); else the prompt's rows alone
/// (KVCache::observe, docs/design.md 6.1).
template <class T>
void kvzip_compress(Engine<T>& engine, const std::vector<int>& prompt, double keep,
                    const std::vector<int>& cue = {}, int chunk = 64, bool own_keys = true) {
  Engine<T> reread = engine.fork();
  reread.observe_into(&engine.caches(), own_keys);
  for (std::size_t at = 0; at < prompt.size(); at += static_cast<std::size_t>(chunk)) {
    const std::size_t end = std::min(prompt.size(), at + static_cast<std::size_t>(chunk));
    std::vector<int> tokens = cue;
    tokens.insert(tokens.end(), prompt.begin() + static_cast<std::ptrdiff_t>(at),
                  prompt.begin() + static_cast<std::ptrdiff_t>(end));
    reread.checkpoint();
    (void)reread.forward(tokens);
    reread.rollback();
  }
  reread.observe_into(nullptr);
  engine.compress(keep);
}

/// The token the last row of `logits` predicts: its first maximum, like llama2.c. logits: [n, vocab]
inline int predicted_token(const Eigen::MatrixXf& logits) {
  Eigen::Index next = 0;
  logits.row(logits.rows() - 1).maxCoeff(&next);
  return static_cast<int>(next);
}

/// Greedy decoding from `next`, the token the engine's last call predicted: `next`, then one
/// decode step per generated token, until `max_new` tokens, a BOS (not returned) or the end of
/// the context. Returns the new ids. (An engine whose caches were loaded from a prompt cache
/// continues here from the token saved with them.)
template <class T>
std::vector<int> generate_from(Engine<T>& engine, int next, int max_new) {
  std::vector<int> out;
  const int seq_len = engine.model().config().seq_len;
  while (max_new > 0 && next != kBos) {
    out.push_back(next);
    if (static_cast<int>(out.size()) == max_new || engine.position() >= seq_len) break;
    next = predicted_token(engine.forward({next}));
  }
  return out;
}

/// Greedy decoding: `prompt` as one prefill (or, with `token_at_a_time`, one call per prompt
/// token, as llama2.c's run.c feeds it), then generate_from the token it predicts.
template <class T>
std::vector<int> generate_greedy(Engine<T>& engine, const std::vector<int>& prompt, int max_new,
                                 bool token_at_a_time = false) {
  if (prompt.empty()) throw std::invalid_argument("llama2c::generate_greedy: empty prompt");
  if (max_new <= 0) return {};
  Eigen::MatrixXf logits;
  if (token_at_a_time) {
    for (const int id : prompt) logits = engine.forward({id});
  } else {
    logits = engine.forward(prompt);
  }
  return generate_from(engine, predicted_token(logits), max_new);
}

/// Sampling with a temperature from a seeded generator (xorshift64*, as llama2.c's run.c): the
/// same seed and logits give the same tokens on every platform.
class Sampler {
 public:
  Sampler(float temperature, std::uint64_t seed) : temperature_(temperature), state_(seed | 1u) {}
  /// A token drawn from softmax(logits / temperature) of the last row of `logits` ([n, vocab]);
  /// temperature 0: the greedy token.
  int sample(const Eigen::MatrixXf& logits) {
    if (temperature_ <= 0.0f) return predicted_token(logits);
    const Eigen::VectorXf row = logits.row(logits.rows() - 1).transpose() / temperature_;
    const Eigen::VectorXf p = (row.array() - row.maxCoeff()).exp().matrix();
    const float r = next_float() * p.sum();
    float acc = 0.0f;
    for (Eigen::Index i = 0; i < p.size(); ++i) {
      acc += p(i);
      if (r < acc) return static_cast<int>(i);
    }
    return static_cast<int>(p.size() - 1);  // rounding: the last token
  }

 private:
  float next_float() {  // uniform in [0, 1)
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<float>((state_ * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f;
  }
  float temperature_;
  std::uint64_t state_;
};

/// Sampling from `next`, the token the engine's last call predicted or drew: `next`, then one
/// decode step per token drawn by `sampler`, as generate_from does greedily.
template <class T>
std::vector<int> sample_from(Engine<T>& engine, int next, int max_new, Sampler& sampler) {
  std::vector<int> out;
  const int seq_len = engine.model().config().seq_len;
  while (max_new > 0 && next != kBos) {
    out.push_back(next);
    if (static_cast<int>(out.size()) == max_new || engine.position() >= seq_len) break;
    next = sampler.sample(engine.forward({next}));
  }
  return out;
}

/// What speculative decoding did: the tokens, the draft tokens proposed and accepted, the
/// verifying calls.
struct SpeculativeRun {
  std::vector<int> tokens;
  std::int64_t proposed = 0, accepted = 0, rounds = 0;
};

/// How the main set takes the accepted tokens after the rollback.
enum class Accept {
  one_call,        ///< one call with them all (SPEC 13.2's engine; an evicting set then evicts
                   ///< once where one-token calls evict per token, so the text may differ)
  token_by_token,  ///< one call per token, each the set's own prediction: exactly the calls of
                   ///< plain greedy decoding, so the text is plain greedy's with every policy
};

/// Greedy speculative decoding (docs/design.md 10.2): `draft` (a cheap cache set over the same
/// model) proposes up to k tokens one step at a time; `main` verifies them in one call between
/// checkpoint and rollback, then takes the accepted ones (and the token that followed) as
/// `accept` says. Both engines must have absorbed the same prompt, and `next` be main's
/// prediction after it. The draft is rolled back the same way to the accepted tokens. Stops as
/// generate_from does.
template <class T, class U>
SpeculativeRun speculative_from(Engine<T>& main, Engine<U>& draft, int next, int max_new, int k,
                                Accept accept = Accept::one_call) {
  SpeculativeRun run;
  const int seq_len = main.model().config().seq_len;
  while (max_new > 0 && next != kBos) {
    run.tokens.push_back(next);
    const auto left =
        static_cast<std::int64_t>(max_new) - static_cast<std::int64_t>(run.tokens.size());
    if (left <= 0 || main.position() + 1 >= seq_len) break;
    const int kk = static_cast<int>(std::min<std::int64_t>(
        {static_cast<std::int64_t>(k), left, seq_len - main.position() - 1}));
    // The draft proposes kk tokens after `next`, one decode step each, from a checkpoint.
    draft.checkpoint();
    std::vector<int> fed = {next};  // what main verifies: next, then the first kk - 1 proposals
    std::vector<int> proposal;
    int d = next;
    for (int i = 0; i < kk; ++i) {
      d = predicted_token(draft.forward({d}));
      proposal.push_back(d);
      if (i + 1 < kk) fed.push_back(d);
    }
    draft.rollback();
    // Main verifies them in one call: row i predicts the token after fed[i].
    main.checkpoint();
    const Eigen::MatrixXf logits = main.forward(fed);
    main.rollback();
    int n = 0;      // accepted proposals
    int after = 0;  // main's own token after the accepted ones
    for (; n < kk; ++n) {
      Eigen::Index y = 0;
      logits.row(n).maxCoeff(&y);
      after = static_cast<int>(y);
      if (after != proposal[static_cast<std::size_t>(n)] || after == kBos) break;
    }
    ++run.rounds;
    run.proposed += kk;
    run.accepted += n;
    // Next and the accepted tokens; main's prediction after them follows.
    std::vector<int> take = {next};
    take.insert(take.end(), proposal.begin(), proposal.begin() + n);
    if (n == kk) take.pop_back();  // every proposal accepted: the last one is the next `next`
    if (accept == Accept::one_call) {
      const Eigen::MatrixXf out = main.forward(take);
      next = n == kk ? proposal.back() : predicted_token(out);
    } else {
      // One call per token; a prediction that disagrees with the verifying call's (the two
      // calls' arithmetic differs) ends the round early: this call's prediction rules.
      std::size_t taken = 0;
      while (taken < take.size()) {
        next = predicted_token(main.forward({take[taken]}));
        ++taken;
        if (taken < take.size() && next != take[taken]) break;
      }
      take.resize(taken);
    }
    (void)draft.forward(take);
    for (std::size_t i = 1; i < take.size(); ++i) run.tokens.push_back(take[i]);
    if (static_cast<std::int64_t>(run.tokens.size()) >= max_new) {
      run.tokens.resize(static_cast<std::size_t>(max_new));
      break;
    }
  }
  return run;
}

/// The fixture directory: $VELOXQUANT_FIXTURES when set and non-empty, else `fallback`.
inline std::string fixtures_dir(const std::string& fallback) {
  const char* env = std::getenv("VELOXQUANT_FIXTURES");
  return env != nullptr && *env != '\0' ? std::string(env) : fallback;
}

}  // namespace veloxquant::llama2c
