// veloxquant — attention-proxy kernels (docs/design.md 3): float32 logits of one proxy query
// against rows stored in T, and a max-subtracted softmax.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include <Eigen/Core>

#include "head_store.hpp"

namespace veloxquant::cache::detail {

/// Converts one stored row to float32. out: [D]
template <class T>
inline void load_row(const T* row, Index d, float* out) {
  for (Index j = 0; j < d; ++j) out[j] = static_cast<float>(row[j]);
}

/// Dot product of a stored row (T) with a float32 vector, accumulated in float32. row, q: [D]
template <class T>
inline float dot_row(const T* row, const float* q, Index d) {
  if constexpr (std::is_same_v<T, float>) {
    return Eigen::Map<const Eigen::VectorXf>(row, d).dot(Eigen::Map<const Eigen::VectorXf>(q, d));
  } else {
    float acc = 0.0f;
    for (Index j = 0; j < d; ++j) acc += static_cast<float>(row[j]) * q[j];
    return acc;
  }
}

/// Weights below exp(-87) (the bottom of float32's normal range, where Eigen's vectorised exp
/// clamps to ~1.2e-38 instead of underflowing) are taken as exactly 0. Otherwise rows that receive
/// no attention would collect a tiny, age-dependent score and turn the exact-tie rules of
/// docs/design.md 4.2/4.5 around.
inline constexpr float kSoftmaxMinWeight = 1.6458115e-38f;  // exp(-87)

/// Elements per chunk of the elementwise kernels below: a multiple of every SIMD width, so each
/// element goes through the same packet code. (Eigen treats the tail of a dynamic-size array with
/// half packets or scalars, whose exp and fused multiply-add round differently; equal inputs could
/// then give unequal outputs and break the exact-tie rules.)
inline constexpr Index kChunk = 16;
using Chunk = Eigen::Array<float, kChunk, 1>;

/// Applies `op` (Chunk -> Chunk) to x[0..n) in chunks of kChunk; the tail is padded with `pad`.
template <class Op>
inline void chunked_apply(float* x, Index n, float pad, Op op) {
  Index i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    Eigen::Map<Chunk> c(x + i);
    c = op(Chunk(c), i);
  }
  if (i < n) {
    const auto tail = sizeof(float) * static_cast<std::size_t>(n - i);
    Chunk c = Chunk::Constant(pad);
    std::memcpy(c.data(), x + i, tail);
    c = op(c, i);
    std::memcpy(x + i, c.data(), tail);
  }
}

/// In-place max-subtracted softmax of x[0..n); weights that underflow are exactly 0. Equal inputs
/// give bit-equal weights wherever they sit.
inline void softmax_inplace(float* x, Index n) {
  if (n <= 0) return;
  Eigen::Map<Eigen::ArrayXf> a(x, n);
  const float m = a.maxCoeff();
  chunked_apply(x, n, m, [m](const Chunk& c, Index) -> Chunk {
    const Chunk e = (c - m).exp();
    return (e < kSoftmaxMinWeight).select(Chunk::Zero(), e);
  });
  a /= a.sum();
}

/// scores[i] = scores[i] * decay + w[i] for i < n, chunked like softmax_inplace so equal inputs
/// give bit-equal outputs. scores, w: [n]
inline void decay_accumulate(float* scores, const float* w, Index n, float decay) {
  Index i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    Eigen::Map<Chunk> c(scores + i);
    c = c * decay + Eigen::Map<const Chunk>(w + i);
  }
  if (i < n) {
    const auto tail = sizeof(float) * static_cast<std::size_t>(n - i);
    Chunk c = Chunk::Zero(), a = Chunk::Zero();
    std::memcpy(c.data(), scores + i, tail);
    std::memcpy(a.data(), w + i, tail);
    c = c * decay + a;
    std::memcpy(scores + i, c.data(), tail);
  }
}

/// out[c] = mean over the `n` rows of x (row r at x + r * stride) of x[r][c], for c < cols: the
/// mean attention over a token's G query heads. Row by row, so every column sums in the same order.
/// x: [n, stride], out: [cols]
inline void mean_of_rows(const float* x, Index n, Index stride, Index cols, float* out) {
  Eigen::Map<Eigen::ArrayXf> mean(out, cols);
  mean = Eigen::Map<const Eigen::ArrayXf>(x, cols);
  for (Index r = 1; r < n; ++r) mean += Eigen::Map<const Eigen::ArrayXf>(x + r * stride, cols);
  mean /= static_cast<float>(n);
}

/// Proxy attention weights of query `q` over the slots `slots` of `head`:
/// out[i] = softmax_i(dot(K[slots[i]], q) / sqrt(Dk)). q: [Dk], out: [slots.size()]
template <class T>
inline void proxy_attention(const HeadStore<T>& head, const Slot* slots, Index n, const float* q,
                            float* out) {
  const Index d = head.key_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (Index i = 0; i < n; ++i) out[i] = dot_row(head.key_ptr(slots[i]), q, d) * scale;
  softmax_inplace(out, n);
}

/// Proxy attention of the key in slot `s` over the live rows of `head` (ascending position), into
/// scratch `weights` (resized to live()); `query` is scratch for the float32 query ([Dk]).
template <class T>
inline float* live_weights(const HeadStore<T>& head, Slot s, std::vector<float>& query,
                           std::vector<float>& weights) {
  const Index d = head.key_dim();
  query.resize(static_cast<std::size_t>(d));
  weights.resize(static_cast<std::size_t>(head.live()));
  load_row(head.key_ptr(s), d, query.data());
  proxy_attention(head, head.order().data(), head.live(), query.data(), weights.data());
  return weights.data();
}

}  // namespace veloxquant::cache::detail
