// veloxquant — the kernel bodies, written once against a vector layer (V, kLanes, vload, vmadd,
// vexp_flush, vreduce_*, ...) and compiled once per instruction set: simd_kernels.hpp includes
// this file inside namespace detail::scalar, detail::sse2, detail::avx2 and detail::avx512 on
// x86-64 (the last two in target regions), detail::scalar and detail::neon on aarch64
// (docs/design.md 7.2). No include guard, no includes: it is a fragment of those namespaces.
//
// Every result element is produced by one fixed sequence of operations that does not depend on
// where it sits (tails are padded, never handled by other code), so equal inputs give bit-equal
// outputs and the exact-tie rules hold (docs/design.md 4.2, 4.5, 6).

/// Elements of one row padded to whole vectors of this path.
inline Index padded_lanes(Index d) { return (d + kLanes - 1) / kLanes * kLanes; }

/// Converts one stored row to float32 into `out` ([padded_lanes(d)]; the padding is zero).
template <class T>
inline void load_padded_row(const T* row, Index d, float* out) {
  Index i = 0;
  for (; i + kLanes <= d; i += kLanes) vstore(out + i, vload_row(row + i));
  if (i < d) {
    T buf[kLanes];
    T* tail = opaque(buf);
    for (Index j = 0; j < kLanes; ++j) tail[j] = i + j < d ? row[i + j] : T(0.0f);
    vstore(out + i, vload_row(tail));
  }
}

/// logits for one query row when d is a whole number of vectors: keys are converted in registers,
/// eight at a time (independent multiply-add chains hide their latency). Each logit is the same
/// chain as in logits() below, so both give bit-identical results. Named accumulators, not
/// arrays: at -O2 compilers do not unroll small loops, and arrays would live in memory.
template <class T>
inline void logits_1x8(const float* q, const T* keys, Index key_stride, const std::int32_t* idx,
                       Index n, Index d, float scale, float* out) {
  for (Index j0 = 0; j0 < n; j0 += 8) {
    const Index nj = n - j0 < 8 ? n - j0 : 8;
    const auto row = [&](Index j) {
      const Index r = j < nj ? j0 + j : j0;
      return keys + (idx ? idx[r] : r) * key_stride;
    };
    const T *r0 = row(0), *r1 = row(1), *r2 = row(2), *r3 = row(3);
    const T *r4 = row(4), *r5 = row(5), *r6 = row(6), *r7 = row(7);
    V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    V a4 = vzero(), a5 = vzero(), a6 = vzero(), a7 = vzero();
    for (Index k = 0; k < d; k += kLanes) {
      const V x = vload(q + k);
      a0 = vmadd(x, vload_row(r0 + k), a0);
      a1 = vmadd(x, vload_row(r1 + k), a1);
      a2 = vmadd(x, vload_row(r2 + k), a2);
      a3 = vmadd(x, vload_row(r3 + k), a3);
      a4 = vmadd(x, vload_row(r4 + k), a4);
      a5 = vmadd(x, vload_row(r5 + k), a5);
      a6 = vmadd(x, vload_row(r6 + k), a6);
      a7 = vmadd(x, vload_row(r7 + k), a7);
    }
    float sums_buf[8];
    float* sums = opaque(sums_buf);
    vreduce_add4(a0, a1, a2, a3, sums);
    vreduce_add4(a4, a5, a6, a7, sums + 4);
    for (Index j = 0; j < nj; ++j) out[j0 + j] = sums[j] * scale;
  }
}

/// The same for two query rows, four keys at a time. out: [2, ldo]
template <class T>
inline void logits_2x4(const float* q, Index ldq, const T* keys, Index key_stride,
                       const std::int32_t* idx, Index n, Index d, float scale, float* out,
                       Index ldo) {
  for (Index j0 = 0; j0 < n; j0 += 4) {
    const Index nj = n - j0 < 4 ? n - j0 : 4;
    const auto row = [&](Index j) {
      const Index r = j < nj ? j0 + j : j0;
      return keys + (idx ? idx[r] : r) * key_stride;
    };
    const T *r0 = row(0), *r1 = row(1), *r2 = row(2), *r3 = row(3);
    V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    V b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
    for (Index k = 0; k < d; k += kLanes) {
      const V x = vload(q + k), y = vload(q + ldq + k);
      const V c0 = vload_row(r0 + k), c1 = vload_row(r1 + k);
      const V c2 = vload_row(r2 + k), c3 = vload_row(r3 + k);
      a0 = vmadd(x, c0, a0);
      a1 = vmadd(x, c1, a1);
      a2 = vmadd(x, c2, a2);
      a3 = vmadd(x, c3, a3);
      b0 = vmadd(y, c0, b0);
      b1 = vmadd(y, c1, b1);
      b2 = vmadd(y, c2, b2);
      b3 = vmadd(y, c3, b3);
    }
    float sums_buf[8];
    float* sums = opaque(sums_buf);
    vreduce_add4(a0, a1, a2, a3, sums);
    vreduce_add4(b0, b1, b2, b3, sums + 4);
    for (Index j = 0; j < nj; ++j) {
      out[j0 + j] = sums[j] * scale;
      out[ldo + j0 + j] = sums[4 + j] * scale;
    }
  }
}

/// The same for four query rows (a KV head's G = 4 query heads at decode), two keys at a time,
/// converted in registers and met by all four rows. out: [4, ldo]
template <class T>
inline void logits_4x2(const float* q, Index ldq, const T* keys, Index key_stride,
                       const std::int32_t* idx, Index n, Index d, float scale, float* out,
                       Index ldo) {
  const float* q0 = q;
  const float* q1 = q + ldq;
  const float* q2 = q + 2 * ldq;
  const float* q3 = q + 3 * ldq;
  for (Index j0 = 0; j0 < n; j0 += 2) {
    const Index nj = n - j0 < 2 ? n - j0 : 2;
    const T* r0 = keys + (idx ? idx[j0] : j0) * key_stride;
    const T* r1 = nj == 2 ? keys + (idx ? idx[j0 + 1] : j0 + 1) * key_stride : r0;
    V a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
    V c0 = vzero(), c1 = vzero(), e0 = vzero(), e1 = vzero();
    for (Index k = 0; k < d; k += kLanes) {
      V x = vload_row(r0 + k), y = vload_row(r1 + k);
      vpin(x);
      vpin(y);
      const V w0 = vload(q0 + k), w1 = vload(q1 + k), w2 = vload(q2 + k), w3 = vload(q3 + k);
      a0 = vmadd(w0, x, a0);
      a1 = vmadd(w0, y, a1);
      b0 = vmadd(w1, x, b0);
      b1 = vmadd(w1, y, b1);
      c0 = vmadd(w2, x, c0);
      c1 = vmadd(w2, y, c1);
      e0 = vmadd(w3, x, e0);
      e1 = vmadd(w3, y, e1);
    }
    float sums_buf[8];
    float* sums = opaque(sums_buf);
    vreduce_add4(a0, a1, b0, b1, sums);
    vreduce_add4(c0, c1, e0, e1, sums + 4);
    for (Index j = 0; j < nj; ++j) {
      out[j0 + j] = sums[j] * scale;
      out[ldo + j0 + j] = sums[2 + j] * scale;
      out[2 * ldo + j0 + j] = sums[4 + j] * scale;
      out[3 * ldo + j0 + j] = sums[6 + j] * scale;
    }
  }
}

/// The general logits: four keys at a time are converted to float32 by load(row, dst) (row: the
/// key's index, dst: [padded_lanes(d)], zero-padded) into kbuf ([4, padded_lanes(d)]) and met by
/// every query row, two rows at a time. idx, n, d, q, out as in logits().
template <class Load>
inline void logits_buffered(const float* q, Index m, Index ldq, const std::int32_t* idx, Index n,
                            Index d, float scale, float* out, Index ldo, float* kbuf, Load load) {
  const Index dp = padded_lanes(d);
  for (Index j0 = 0; j0 < n; j0 += 4) {
    const Index nj = n - j0 < 4 ? n - j0 : 4;
    for (Index j = 0; j < 4; ++j) {
      float* dst = kbuf + j * dp;
      if (j < nj) {
        load(idx ? idx[j0 + j] : j0 + j, dst);
      } else {
        for (Index k = 0; k < dp; k += kLanes) vstore(dst + k, vzero());
      }
    }
    const float* k0 = kbuf;
    const float* k1 = kbuf + dp;
    const float* k2 = kbuf + 2 * dp;
    const float* k3 = kbuf + 3 * dp;
    float sums_buf[8];
    float* sums = opaque(sums_buf);
    Index i = 0;
    for (; i + 2 <= m; i += 2) {
      const float* qa = q + i * ldq;
      const float* qb = qa + ldq;
      V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      V b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
      for (Index k = 0; k < dp; k += kLanes) {
        const V x = vload(qa + k), y = vload(qb + k);
        const V c0 = vload(k0 + k), c1 = vload(k1 + k), c2 = vload(k2 + k), c3 = vload(k3 + k);
        a0 = vmadd(x, c0, a0);
        a1 = vmadd(x, c1, a1);
        a2 = vmadd(x, c2, a2);
        a3 = vmadd(x, c3, a3);
        b0 = vmadd(y, c0, b0);
        b1 = vmadd(y, c1, b1);
        b2 = vmadd(y, c2, b2);
        b3 = vmadd(y, c3, b3);
      }
      vreduce_add4(a0, a1, a2, a3, sums);
      vreduce_add4(b0, b1, b2, b3, sums + 4);
      float* oa = out + i * ldo + j0;
      float* ob = oa + ldo;
      for (Index j = 0; j < nj; ++j) {
        oa[j] = sums[j] * scale;
        ob[j] = sums[4 + j] * scale;
      }
    }
    if (i < m) {
      const float* qa = q + i * ldq;
      V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      for (Index k = 0; k < dp; k += kLanes) {
        const V x = vload(qa + k);
        a0 = vmadd(x, vload(k0 + k), a0);
        a1 = vmadd(x, vload(k1 + k), a1);
        a2 = vmadd(x, vload(k2 + k), a2);
        a3 = vmadd(x, vload(k3 + k), a3);
      }
      vreduce_add4(a0, a1, a2, a3, sums);
      float* oa = out + i * ldo + j0;
      for (Index j = 0; j < nj; ++j) oa[j] = sums[j] * scale;
    }
  }
}

/// logits[i][j] = scale * (q_i . k_j) for i < m, j < n: the scaled dot products of m float32
/// query rows with n stored key rows. Key row j lives at keys + (idx ? idx[j] : j) * key_stride.
/// When d is a whole number of vectors, one, two or four query rows go to logits_1x8, logits_2x4
/// or logits_4x2 (keys converted in registers); otherwise four keys at a time are converted to
/// float32 (kbuf: [4, padded_lanes(d)]) and met by every query row, two rows at a time
/// (logits_buffered). Either way each logit is one chain of multiply-adds over the padded row in
/// ascending order, reduced by the path's fixed tree. q: [m, ldq] (row i at q + i * ldq, zero from
/// d to padded_lanes(d)); out: [m, ldo].
template <class T>
inline void logits(const float* q, Index m, Index ldq, const T* keys, Index key_stride,
                   const std::int32_t* idx, Index n, Index d, float scale, float* out, Index ldo,
                   float* kbuf) {
  if (d % kLanes == 0 && m == 1) return logits_1x8(q, keys, key_stride, idx, n, d, scale, out);
  if (d % kLanes == 0 && m == 4) {
    return logits_4x2(q, ldq, keys, key_stride, idx, n, d, scale, out, ldo);
  }
  if (d % kLanes == 0 && m == 2) {
    return logits_2x4(q, ldq, keys, key_stride, idx, n, d, scale, out, ldo);
  }
  logits_buffered(q, m, ldq, idx, n, d, scale, out, ldo, kbuf,
                  [&](Index row, float* dst) { load_padded_row(keys + row * key_stride, d, dst); });
}

/// Loads x[i, i + kLanes) where fewer than kLanes remain before n: the rest is `pad`.
inline V load_tail(const float* x, Index count, float pad) {
  float buf[kLanes];
  float* t = opaque(buf);
  for (Index j = 0; j < kLanes; ++j) t[j] = j < count ? x[j] : pad;
  return vload(t);
}
inline void store_tail(float* x, Index count, V v) {
  float buf[kLanes];
  float* t = opaque(buf);
  vstore(t, v);
  for (Index j = 0; j < count; ++j) x[j] = t[j];
}

/// Stores key rows [j0, j1) (row j at keys + j * key_stride, [d] of T) as float32 in the tiles
/// logits_packed reads: keys in groups of 2 * kLanes, each group a contiguous [d, 2 * kLanes]
/// block (element k of key j at kt[(j / W) * d * W + k * W + j % W], W = 2 * kLanes).
/// buf: [padded_lanes(d)]
template <class T>
inline void pack_keys(const T* keys, Index key_stride, Index j0, Index j1, Index d, float* kt,
                      float* buf) {
  constexpr Index kW = 2 * kLanes;
  for (Index j = j0; j < j1; ++j) {
    load_padded_row(keys + j * key_stride, d, buf);
    float* col = kt + (j / kW) * d * kW + j % kW;
    for (Index k = 0; k < d; ++k) col[k * kW] = buf[k];
  }
}

/// logits for many query rows (a prefill block) against keys packed by pack_keys: out[i][j] =
/// scale * (q_i . k_j), i < m, j < n. Keys sit across the lanes, so no horizontal reduction is
/// needed: a tile of four query rows x one group of 2 * kLanes keys accumulates q[i][k] *
/// key_j[k] over k = 0 .. d-1, one multiply-add chain per logit in ascending k (the same chain
/// for every position of the tile). The four rows are first interleaved into qbuf ([d, 4]), so
/// the loop walks two pointers. kt: the groups of pack_keys, covering n keys; q: [m, ldq];
/// out: [m, ldo]; qbuf: [4 * d] scratch.
inline void logits_packed(const float* q, Index m, Index ldq, const float* kt, Index n, Index d,
                          float scale, float* out, Index ldo, float* qbuf) {
  constexpr Index kW = 2 * kLanes;
  const V vs = vset(scale);
  for (Index i = 0; i < m; i += 4) {
    const Index nr = m - i < 4 ? m - i : 4;
    for (Index r = 0; r < 4; ++r) {
      const float* row = q + (i + (r < nr ? r : 0)) * ldq;
      for (Index k = 0; k < d; ++k) qbuf[k * 4 + r] = row[k];
    }
    for (Index j0 = 0; j0 < n; j0 += kW) {
      const Index nj = n - j0 < kW ? n - j0 : kW;
      V a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
      V c0 = vzero(), c1 = vzero(), e0 = vzero(), e1 = vzero();
      const float* col = kt + (j0 / kW) * d * kW;
      const float* qk = qbuf;
      for (Index k = 0; k < d; ++k, col += kW, qk += 4) {
        V x = vload(col), y = vload(col + kLanes);
        vpin(x);
        vpin(y);
        const V w0 = vset(qk[0]), w1 = vset(qk[1]), w2 = vset(qk[2]), w3 = vset(qk[3]);
        a0 = vmadd(w0, x, a0);
        a1 = vmadd(w0, y, a1);
        b0 = vmadd(w1, x, b0);
        b1 = vmadd(w1, y, b1);
        c0 = vmadd(w2, x, c0);
        c1 = vmadd(w2, y, c1);
        e0 = vmadd(w3, x, e0);
        e1 = vmadd(w3, y, e1);
      }
      const auto put = [&](Index r, V lo, V hi) {
        if (r >= nr) return;
        float* o = out + (i + r) * ldo + j0;
        if (nj == kW) {
          vstore(o, vmul(lo, vs));
          vstore(o + kLanes, vmul(hi, vs));
        } else if (nj > kLanes) {
          vstore(o, vmul(lo, vs));
          store_tail(o + kLanes, nj - kLanes, vmul(hi, vs));
        } else if (nj == kLanes) {
          vstore(o, vmul(lo, vs));
        } else {
          store_tail(o, nj, vmul(lo, vs));
        }
      };
      put(0, a0, a1);
      put(1, b0, b1);
      put(2, c0, c1);
      put(3, e0, e1);
    }
  }
}

/// w[0, n) = the mean over `rows` rows (row r at x + r * ldx) of softmax(row[0, n)), each softmax
/// max-subtracted, weights below kSoftmaxMinWeight exactly 0 (a -inf logit, a masked column,
/// gets 0). The rows are overwritten with their exp values, and inv[r] (when inv is not null)
/// receives row r's normaliser, so that row r's softmax is x[r][c] * inv[r] (the attention output
/// reuses them: weighted_rows). With w null only the rows and inv are written. A row whose
/// logits are all -inf contributes nothing (inv 0).
inline void softmax_mean(float* x, Index rows, Index ldx, Index n, float* w, float* inv_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const Index body = n / kLanes * kLanes;
  for (Index r = 0; r < rows; ++r) {
    float* row = x + r * ldx;
    V mv = vset(neg_inf);
    for (Index i = 0; i < body; i += kLanes) mv = vmax(vload(row + i), mv);
    if (body < n) mv = vmax(load_tail(row + body, n - body, neg_inf), mv);
    const float m = vreduce_max(mv);
    const bool empty = !(m > neg_inf);
    const V vm = vset(empty ? 0.0f : m);
    V sv = vzero();
    for (Index i = 0; i < body; i += kLanes) {
      const V e = vexp_flush(vsub(vload(row + i), vm));
      vstore(row + i, e);
      sv = vadd(sv, e);
    }
    if (body < n) {
      const V e = vexp_flush(vsub(load_tail(row + body, n - body, neg_inf), vm));
      store_tail(row + body, n - body, e);
      sv = vadd(sv, e);
    }
    const float sum = vreduce_add(sv);
    const float inv_r = empty ? 0.0f : 1.0f / sum;
    if (inv_out) inv_out[r] = inv_r;
    if (!w) continue;
    const V inv = vset(inv_r);
    if (r == 0) {
      for (Index i = 0; i < body; i += kLanes) vstore(w + i, vmul(vload(row + i), inv));
      if (body < n)
        store_tail(w + body, n - body, vmul(load_tail(row + body, n - body, 0.0f), inv));
    } else {
      for (Index i = 0; i < body; i += kLanes) {
        vstore(w + i, vmadd(vload(row + i), inv, vload(w + i)));
      }
      if (body < n) {
        store_tail(
            w + body, n - body,
            vmadd(load_tail(row + body, n - body, 0.0f), inv, load_tail(w + body, n - body, 0.0f)));
      }
    }
  }
  if (rows > 1 && w) {
    const V inv_rows = vset(1.0f / static_cast<float>(rows));
    for (Index i = 0; i < body; i += kLanes) vstore(w + i, vmul(vload(w + i), inv_rows));
    if (body < n)
      store_tail(w + body, n - body, vmul(load_tail(w + body, n - body, 0.0f), inv_rows));
  }
}

/// w[c] = max(w[c], max over `rows` rows (row r at x + r * ldx) of softmax(row[0, n))[c]) for
/// c < n: KVzip's observed score (docs/design.md 6.1). Each softmax is softmax_mean's: the rows
/// are overwritten with their exp values and inv ([rows], scratch) with their normalisers. A row
/// whose logits are all -inf contributes nothing.
inline void softmax_max(float* x, Index rows, Index ldx, Index n, float* w, float* inv) {
  softmax_mean(x, rows, ldx, n, nullptr, inv);
  const Index body = n / kLanes * kLanes;
  for (Index r = 0; r < rows; ++r) {
    const float* row = x + r * ldx;
    const V vi = vset(inv[r]);
    for (Index i = 0; i < body; i += kLanes) {
      vstore(w + i, vmax(vmul(vload(row + i), vi), vload(w + i)));
    }
    if (body < n) {
      store_tail(w + body, n - body,
                 vmax(vmul(load_tail(row + body, n - body, 0.0f), vi),
                      load_tail(w + body, n - body, 0.0f)));
    }
  }
}

/// One stored value row's elements [k, k + count) as float32 (count < kLanes; the rest 0).
template <class T>
inline V load_row_tail(const T* row, Index count) {
  T buf[kLanes];
  T* t = opaque(buf);
  for (Index j = 0; j < kLanes; ++j) t[j] = j < count ? row[j] : T(0.0f);
  return vload_row(t);
}

/// Writes the R rows of a weighted-rows tile (weighted_slice, qweighted_slice): row r, its
/// accumulators (a, b, c, d for r = 0..3; the second vector only at W = 2) scaled by its
/// normaliser inv[r], to out + r * ldo + k.
template <int R, int W>
inline void put_weighted_rows(const float* inv, float* out, Index ldo, Index k, Index width, V a0,
                              V a1, V b0, V b1, V c0, V c1, V d0, V d1) {
  const auto put = [&](Index r, V lo, V hi) {
    float* o = out + r * ldo + k;
    const V s = vset(inv[r]);
    if constexpr (W == 0) {
      store_tail(o, width, vmul(lo, s));
    } else {
      vstore(o, vmul(lo, s));
      if constexpr (W == 2) vstore(o + kLanes, vmul(hi, s));
    }
  };
  put(0, a0, a1);
  if constexpr (R >= 2) put(1, b0, b1);
  if constexpr (R >= 4) {
    put(2, c0, c1);
    put(3, d0, d1);
  }
}

/// R (1, 2 or 4) rows of the attention output over the elements [k, k + width) of the value rows:
/// W = 2 (two vectors), 1 (one vector) or 0 (a tail of width < kLanes elements). out_r = inv[r] *
/// sum_{c < n} e[r][c] * v_c, one multiply-add chain per element in ascending c. Named
/// accumulators, two vectors per row (eight registers at R = 4); R and W are template parameters
/// so that the loop over the rows carries no branch.
template <int R, int W, class T>
inline void weighted_slice(const float* e, Index lde, const float* inv, const T* values, Index dv,
                           Index n, Index k, Index width, float* out, Index ldo) {
  V a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
  V c0 = vzero(), c1 = vzero(), d0 = vzero(), d1 = vzero();
  const float* e0 = e;
  const float* e1 = e + lde;
  const float* e2 = e + 2 * lde;
  const float* e3 = e + 3 * lde;
  const T* row = values + k;
  for (Index c = 0; c < n; ++c, row += dv) {
    V x0, x1 = vzero();
    if constexpr (W == 0) {
      x0 = load_row_tail(row, width);
    } else {
      x0 = vload_row(row);
    }
    if constexpr (W == 2) x1 = vload_row(row + kLanes);
    const V w0 = vset(e0[c]);
    a0 = vmadd(w0, x0, a0);
    if constexpr (W == 2) a1 = vmadd(w0, x1, a1);
    if constexpr (R >= 2) {
      const V w1 = vset(e1[c]);
      b0 = vmadd(w1, x0, b0);
      if constexpr (W == 2) b1 = vmadd(w1, x1, b1);
    }
    if constexpr (R >= 4) {
      const V w2 = vset(e2[c]), w3 = vset(e3[c]);
      c0 = vmadd(w2, x0, c0);
      d0 = vmadd(w3, x0, d0);
      if constexpr (W == 2) {
        c1 = vmadd(w2, x1, c1);
        d1 = vmadd(w3, x1, d1);
      }
    }
  }
  put_weighted_rows<R, W>(inv, out, ldo, k, width, a0, a1, b0, b1, c0, c1, d0, d1);
}

template <int R, class T>
inline void weighted_group(const float* e, Index lde, const float* inv, const T* values, Index dv,
                           Index n, float* out, Index ldo) {
  Index k = 0;
  for (; k + 2 * kLanes <= dv; k += 2 * kLanes) {
    weighted_slice<R, 2>(e, lde, inv, values, dv, n, k, 2 * kLanes, out, ldo);
  }
  if (k + kLanes <= dv) {
    weighted_slice<R, 1>(e, lde, inv, values, dv, n, k, kLanes, out, ldo);
    k += kLanes;
  }
  if (k < dv) weighted_slice<R, 0>(e, lde, inv, values, dv, n, k, dv - k, out, ldo);
}

/// The attention output of `rows` softmax rows over the first n stored value rows: out[r][0, dv)
/// = inv[r] * sum_{c < n} e[r][c] * values[c][0, dv). e: [rows, lde] (exp values, as softmax_mean
/// leaves them), inv: [rows], values: [n, dv] of T, out: row r at out + r * ldo ([dv] float32).
/// Rows go four, two or one at a time; every element is the same chain whatever the grouping.
template <class T>
inline void weighted_rows(const float* e, Index lde, const float* inv, Index rows, const T* values,
                          Index dv, Index n, float* out, Index ldo) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    weighted_group<4>(e + r * lde, lde, inv + r, values, dv, n, out + r * ldo, ldo);
  }
  if (r + 2 <= rows) {
    weighted_group<2>(e + r * lde, lde, inv + r, values, dv, n, out + r * ldo, ldo);
    r += 2;
  }
  if (r < rows) weighted_group<1>(e + r * lde, lde, inv + r, values, dv, n, out + r * ldo, ldo);
}

/// s[i] = s[i] * decay + w[i] for i < n (one rounding per element on FMA paths).
inline void decay_accumulate(float* s, const float* w, Index n, float decay) {
  const V dv = vset(decay);
  const Index body = n / kLanes * kLanes;
  for (Index i = 0; i < body; i += kLanes) vstore(s + i, vmadd(vload(s + i), dv, vload(w + i)));
  if (body < n) {
    store_tail(s + body, n - body,
               vmadd(load_tail(s + body, n - body, 0.0f), dv, load_tail(w + body, n - body, 0.0f)));
  }
}

/// The index of the lowest of x[0, n) (n >= 1): the first one among equals, or the last when
/// `last`; *hits is how many elements hold that value (counted up to 2). -1 when some x[i] is NaN
/// (the caller decides then).
inline Index argmin(const float* x, Index n, bool last, int* hits) {
  const float inf = std::numeric_limits<float>::infinity();
  const Index body = n / kLanes * kLanes;
  V mv = vset(inf);
  unsigned ordered = (1u << kLanes) - 1u;  // lanes that never saw a NaN
  for (Index i = 0; i < body; i += kLanes) {
    const V v = vload(x + i);
    mv = vmin(v, mv);
    ordered &= vmask_eq(v, v);
  }
  if (body < n) {
    const V v = load_tail(x + body, n - body, inf);
    mv = vmin(v, mv);
    ordered &= vmask_eq(v, v);
  }
  if (ordered != (1u << kLanes) - 1u) return -1;
  float m = inf;
  {
    float buf[kLanes];
    float* t = opaque(buf);
    vstore(t, mv);
    for (Index j = 0; j < kLanes; ++j) m = t[j] < m ? t[j] : m;
  }
  const V target = vset(m);
  const Index chunks = (n + kLanes - 1) / kLanes;
  Index found = -1;
  int count = 0;
  for (Index c = 0; c < chunks && count < 2; ++c) {
    const Index i = (last ? chunks - 1 - c : c) * kLanes;
    const V v = i + kLanes <= n ? vload(x + i) : load_tail(x + i, n - i, inf);
    unsigned hit = vmask_eq(v, target);
    if (i + kLanes > n) hit &= (1u << (n - i)) - 1u;
    if (hit == 0) continue;
    if (found < 0) found = i + (last ? last_bit(hit) : first_bit(hit));
    count += (hit & (hit - 1u)) ? 2 : 1;
  }
  *hits = count < 2 ? count : 2;
  return found >= 0 ? found : (last ? n - 1 : 0);  // every value +inf
}

/// dst[i] = src[i] converted to T (round to nearest even), i < n; U and T are half, bfloat16 or
/// float (a double input is converted by the caller).
template <class U, class T>
inline void convert_row(const U* src, T* dst, Index n) {
  Index i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore_row(dst + i, vload_row(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
}

// ---- Quantized rows (docs/design.md 7.4) --------------------------------------------------------
// Every read of a quantized element is offset + code * scale through the path's multiply-add, in
// registers; the kernels below then run the very chains of their float32 counterparts, so a
// quantized cache scores and attends exactly as a float32 cache holding the dequantized rows.

/// True when every vector of kLanes elements of a row lies in one group (and in one half of a
/// 4-bit group): the kernels then take a group's scale and offset once per row and group.
inline bool q_in_lanes(const RowFormat& f) {
  if (f.bits == 8) return f.group % kLanes == 0;
  return f.bits == 4 && f.group % 2 == 0 && f.group_bytes() % kLanes == 0;
}

/// Dequantized elements [k, k + kLanes) of a quantized row in any format, lane by lane (the
/// general path); lanes at or beyond f.dim are 0.
inline V qload_lanes(const std::uint8_t* row, const RowFormat& f, Index k) {
  float cbuf[kLanes], sbuf[kLanes], obuf[kLanes];
  float* c = opaque(cbuf);
  float* s = opaque(sbuf);
  float* o = opaque(obuf);
  const Index gb = f.group_bytes();
  Index g = k / f.group, e = k % f.group;
  float sg = 0.0f, og = 0.0f;
  if (k < f.dim) group_scale_offset(row, f, g, sg, og);
  for (Index j = 0; j < kLanes; ++j) {
    c[j] = s[j] = o[j] = 0.0f;
    if (k + j >= f.dim) continue;
    if (e == f.group) {
      e = 0;
      group_scale_offset(row, f, ++g, sg, og);
    }
    c[j] = static_cast<float>(span_code(row + g * gb, e, f.group, f.bits));
    s[j] = sg;
    o[j] = og;
    ++e;
  }
  return vmadd(vload(c), vload(s), vload(o));
}

/// Walks the vectors of a row of a q_in_lanes format in ascending element order: on_group(g) at
/// the start of group g, then on_vec(k, c, hi) per vector: its first element k, the offset c of
/// its code bytes in the row and hi (std::true_type: high nibbles) as a type.
template <int B, class OnGroup, class OnVec>
inline void q_walk(const RowFormat& f, OnGroup on_group, OnVec on_vec) {
  const Index gb = f.group_bytes(), groups = f.groups();
  for (Index g = 0; g < groups; ++g) {
    on_group(g);
    const Index k0 = g * f.group, c0 = g * gb;
    for (Index e = 0; e < gb; e += kLanes) on_vec(k0 + e, c0 + e, std::false_type{});
    if constexpr (B == 4) {
      for (Index e = 0; e < gb; e += kLanes) on_vec(k0 + gb + e, c0 + e, std::true_type{});
    }
  }
}

/// Row j of `rows` dequantized to float32 into out ([padded_lanes(d)], zero-padded).
inline void qload_padded_row(const QuantRows& rows, Index j, float* out) {
  const RowFormat& f = rows.fmt;
  const std::uint8_t* row = rows.row(j);
  if (!q_in_lanes(f)) {
    for (Index k = 0; k < f.dim; k += kLanes) vstore(out + k, qload_lanes(row, f, k));
    return;
  }
  V s = vzero(), o = vzero();
  const auto group = [&](Index g) { vmeta(row + f.code_bytes() + 4 * g, s, o); };
  if (f.bits == 8) {
    q_walk<8>(f, group,
              [&](Index k, Index c, auto) { vstore(out + k, vmadd(vcodes<8>(row + c), s, o)); });
  } else {
    q_walk<4>(f, group, [&](Index k, Index c, auto hi) {
      vstore(out + k, vmadd(vcodes<4, decltype(hi)::value>(row + c), s, o));
    });
  }
}

/// logits over quantized keys for R (1, 2 or 4) query rows, K (4 or 2) keys at a time: each key
/// vector is dequantized once in registers and met by the R rows. Chains as logits_1x8. q: [R,
/// ldq]; out: [R, ldo].
template <int R, int K, int B>
inline void qlogits_tile(const float* q, Index ldq, const QuantRows& keys, const std::int32_t* idx,
                         Index n, float scale, float* out, Index ldo) {
  static_assert(R * K == 4 || R * K == 8 || R * K == 16, "tiles of 4, 8 or 16 logits");
  const RowFormat& f = keys.fmt;
  for (Index j0 = 0; j0 < n; j0 += K) {
    const Index nj = n - j0 < K ? n - j0 : K;
    const std::uint8_t* r[K];
    VELOXQUANT_DETAIL_UNROLL
    for (int j = 0; j < K; ++j) {
      const Index at = j < nj ? j0 + j : j0;
      r[j] = keys.row(idx ? idx[at] : at);
    }
    V acc[R * K], s[K], o[K];
    VELOXQUANT_DETAIL_UNROLL
    for (int a = 0; a < R * K; ++a) acc[a] = vzero();
    // The K keys' dequantized vectors x at element k, met by the R query rows.
    const auto meet = [&](Index k, V* x) {
      VELOXQUANT_DETAIL_UNROLL
      for (int j = 0; j < K; ++j) vpin(x[j]);
      VELOXQUANT_DETAIL_UNROLL
      for (int i = 0; i < R; ++i) {
        const V w = vload(q + i * ldq + k);
        VELOXQUANT_DETAIL_UNROLL
        for (int j = 0; j < K; ++j) acc[i * K + j] = vmadd(w, x[j], acc[i * K + j]);
      }
    };
    // One vector of each key at code offset c (nibbles: Hi), met at element k.
    const auto step = [&](Index k, Index c, auto hi) {
      V x[K];
      VELOXQUANT_DETAIL_UNROLL
      for (int j = 0; j < K; ++j)
        x[j] = vmadd(vcodes<B, decltype(hi)::value>(r[j] + c), s[j], o[j]);
      meet(k, x);
    };
    const Index gb = f.group_bytes(), groups = f.groups();
    for (Index g = 0; g < groups; ++g) {
      VELOXQUANT_DETAIL_UNROLL
      for (int j = 0; j < K; ++j) vmeta(r[j] + f.code_bytes() + 4 * g, s[j], o[j]);
      const Index k0 = g * f.group, c0 = g * gb;
      if (B == 4 && gb == kLanes) {
        // One vector per half of the group: both from one load of its bytes, in element order.
        V lo[K], hi[K];
        VELOXQUANT_DETAIL_UNROLL
        for (int j = 0; j < K; ++j) {
          vcodes4x2(r[j] + c0, lo[j], hi[j]);
          lo[j] = vmadd(lo[j], s[j], o[j]);
          hi[j] = vmadd(hi[j], s[j], o[j]);
        }
        meet(k0, lo);
        meet(k0 + gb, hi);
        continue;
      }
      for (Index e = 0; e < gb; e += kLanes) step(k0 + e, c0 + e, std::false_type{});
      if constexpr (B == 4) {
        for (Index e = 0; e < gb; e += kLanes) step(k0 + gb + e, c0 + e, std::true_type{});
      }
    }
    float sums_buf[16];
    float* sums = opaque(sums_buf);
    vreduce_add4(acc[0], acc[1], acc[2], acc[3], sums);
    if constexpr (R * K >= 8) vreduce_add4(acc[4], acc[5], acc[6], acc[7], sums + 4);
    if constexpr (R * K == 16) {
      vreduce_add4(acc[8], acc[9], acc[10], acc[11], sums + 8);
      vreduce_add4(acc[12], acc[13], acc[14], acc[15], sums + 12);
    }
    for (int i = 0; i < R; ++i) {
      for (Index j = 0; j < nj; ++j) out[i * ldo + j0 + j] = sums[i * K + j] * scale;
    }
  }
}

/// logits (above) over quantized keys: out[i * ldo + j] = scale * (q_i . k_j) with k_j row
/// (idx ? idx[j] : j) of `keys` dequantized. The same value as logits() over the dequantized
/// rows as float32, whichever kernel runs. kbuf: [4, padded_lanes(d)].
inline void qlogits(const float* q, Index m, Index ldq, const QuantRows& keys,
                    const std::int32_t* idx, Index n, float scale, float* out, Index ldo,
                    float* kbuf) {
  const RowFormat& f = keys.fmt;
  if (q_in_lanes(f) && (m == 1 || m == 2 || m == 4)) {
    const bool b8 = f.bits == 8;
    if (m == 1) {
      return b8 ? qlogits_tile<1, 4, 8>(q, ldq, keys, idx, n, scale, out, ldo)
                : qlogits_tile<1, 4, 4>(q, ldq, keys, idx, n, scale, out, ldo);
    }
    if (m == 2) {
      return b8 ? qlogits_tile<2, 2, 8>(q, ldq, keys, idx, n, scale, out, ldo)
                : qlogits_tile<2, 2, 4>(q, ldq, keys, idx, n, scale, out, ldo);
    }
    // Four keys a tile where the registers allow it (32 vector registers: AVX-512).
    constexpr int K4 = kLanes == 16 ? 4 : 2;
    return b8 ? qlogits_tile<4, K4, 8>(q, ldq, keys, idx, n, scale, out, ldo)
              : qlogits_tile<4, K4, 4>(q, ldq, keys, idx, n, scale, out, ldo);
  }
  logits_buffered(q, m, ldq, idx, n, f.dim, scale, out, ldo, kbuf,
                  [&](Index row, float* dst) { qload_padded_row(keys, row, dst); });
}

/// pack_keys over quantized keys: rows [j0, j1) dequantized into the tiles of logits_packed.
/// buf: [padded_lanes(d)]
inline void qpack_keys(const QuantRows& keys, Index j0, Index j1, float* kt, float* buf) {
  constexpr Index kW = 2 * kLanes;
  const Index d = keys.fmt.dim;
  for (Index j = j0; j < j1; ++j) {
    qload_padded_row(keys, j, buf);
    float* col = kt + (j / kW) * d * kW + j % kW;
    for (Index k = 0; k < d; ++k) col[k * kW] = buf[k];
  }
}

/// Where vector [k, k + kLanes) of a quantized row sits (q_in_lanes formats): its group, the
/// offset of its code bytes, and whether it is a group's high nibbles.
struct QVec {
  Index group = 0, code = 0;
  bool hi = false;
};
inline QVec q_vec_at(const RowFormat& f, Index k) {
  QVec v;
  v.group = k / f.group;
  const Index e = k % f.group, gb = f.group_bytes();
  v.hi = f.bits == 4 && e >= gb;
  v.code = v.group * gb + (v.hi ? e - gb : e);
  return v;
}
/// One vector of a quantized row at v, dequantized with the group's scale s and offset o.
template <int B>
inline V qvec_load(const std::uint8_t* row, const QVec& v, V s, V o) {
  if constexpr (B == 8) {
    return vmadd(vcodes<8>(row + v.code), s, o);
  } else {
    return vmadd(v.hi ? vcodes<4, true>(row + v.code) : vcodes<4, false>(row + v.code), s, o);
  }
}

/// weighted_slice over quantized value rows: B = 8 or 4 for q_in_lanes formats (a vector's
/// scale and offset once per row), 0 for any format (lane by lane). Chains as weighted_slice.
template <int R, int W, int B>
inline void qweighted_slice(const float* e, Index lde, const float* inv, const QuantRows& values,
                            Index n, Index k, Index width, float* out, Index ldo) {
  const RowFormat& f = values.fmt;
  V a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
  V c0 = vzero(), c1 = vzero(), d0 = vzero(), d1 = vzero();
  const float* e0 = e;
  const float* e1 = e + lde;
  const float* e2 = e + 2 * lde;
  const float* e3 = e + 3 * lde;
  QVec v0, v1;
  if constexpr (B != 0) {
    v0 = q_vec_at(f, k);
    if constexpr (W == 2) v1 = q_vec_at(f, k + kLanes);
  }
  // The slice is exactly the low and high halves of one 4-bit group.
  const bool pair =
      B == 4 && W == 2 && v0.group == v1.group && !v0.hi && v1.hi && v0.code == v1.code;
  const std::uint8_t* row = values.data;
  for (Index c = 0; c < n; ++c, row += values.stride) {
    V x0, x1 = vzero();
    if constexpr (B == 0) {
      x0 = qload_lanes(row, f, k);
      if constexpr (W == 2) x1 = qload_lanes(row, f, k + kLanes);
    } else {
      V s, o;
      vmeta(row + f.code_bytes() + 4 * v0.group, s, o);
      if (pair) {
        // The two halves of one group: both vectors from one load of its bytes.
        vcodes4x2(row + v0.code, x0, x1);
        x0 = vmadd(x0, s, o);
        x1 = vmadd(x1, s, o);
      } else {
        x0 = qvec_load<B>(row, v0, s, o);
        if constexpr (W == 2) {
          if (v1.group != v0.group) vmeta(row + f.code_bytes() + 4 * v1.group, s, o);
          x1 = qvec_load<B>(row, v1, s, o);
        }
      }
    }
    const V w0 = vset(e0[c]);
    a0 = vmadd(w0, x0, a0);
    if constexpr (W == 2) a1 = vmadd(w0, x1, a1);
    if constexpr (R >= 2) {
      const V w1 = vset(e1[c]);
      b0 = vmadd(w1, x0, b0);
      if constexpr (W == 2) b1 = vmadd(w1, x1, b1);
    }
    if constexpr (R >= 4) {
      const V w2 = vset(e2[c]), w3 = vset(e3[c]);
      c0 = vmadd(w2, x0, c0);
      d0 = vmadd(w3, x0, d0);
      if constexpr (W == 2) {
        c1 = vmadd(w2, x1, c1);
        d1 = vmadd(w3, x1, d1);
      }
    }
  }
  put_weighted_rows<R, W>(inv, out, ldo, k, width, a0, a1, b0, b1, c0, c1, d0, d1);
}

template <int R, int B>
inline void qweighted_group(const float* e, Index lde, const float* inv, const QuantRows& values,
                            Index n, float* out, Index ldo) {
  const Index dv = values.fmt.dim;
  Index k = 0;
  for (; k + 2 * kLanes <= dv; k += 2 * kLanes) {
    qweighted_slice<R, 2, B>(e, lde, inv, values, n, k, 2 * kLanes, out, ldo);
  }
  if (k + kLanes <= dv) {
    qweighted_slice<R, 1, B>(e, lde, inv, values, n, k, kLanes, out, ldo);
    k += kLanes;
  }
  if (k < dv) qweighted_slice<R, 0, 0>(e, lde, inv, values, n, k, dv - k, out, ldo);
}

template <int B>
inline void qweighted_rows_b(const float* e, Index lde, const float* inv, Index rows,
                             const QuantRows& values, Index n, float* out, Index ldo) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    qweighted_group<4, B>(e + r * lde, lde, inv + r, values, n, out + r * ldo, ldo);
  }
  if (r + 2 <= rows) {
    qweighted_group<2, B>(e + r * lde, lde, inv + r, values, n, out + r * ldo, ldo);
    r += 2;
  }
  if (r < rows) qweighted_group<1, B>(e + r * lde, lde, inv + r, values, n, out + r * ldo, ldo);
}

/// weighted_rows over the first n quantized value rows (the same values as weighted_rows over
/// them dequantized to float32). e: [rows, lde], inv: [rows], out: row r at out + r * ldo.
inline void qweighted_rows(const float* e, Index lde, const float* inv, Index rows,
                           const QuantRows& values, Index n, float* out, Index ldo) {
  const RowFormat& f = values.fmt;
  if (!q_in_lanes(f)) return qweighted_rows_b<0>(e, lde, inv, rows, values, n, out, ldo);
  if (f.bits == 8) return qweighted_rows_b<8>(e, lde, inv, rows, values, n, out, ldo);
  qweighted_rows_b<4>(e, lde, inv, rows, values, n, out, ldo);
}

// ---- Channel-axis rows (docs/design.md 7.5) -----------------------------------------------------
// Read back, a row's element c is offset_c + code_c * scale_c through the path's multiply-add,
// with its block's scale and offset of channel c (a pending row: its value as T, exactly): the
// rows fetch, state() and the key-as-query row return, and the packed prefill keys. The decode
// logits and attention output fold the scales instead (below).

/// True when a row's 4-bit codes are read a whole vector at a time: d a multiple of 2 * kLanes,
/// the low nibbles holding channels [0, d/2), the high ones [d/2, d) (span_code's layout).
inline bool nibble_halves(int bits, Index d) { return bits == 4 && d % (2 * kLanes) == 0; }

/// The codes of vector [k, k + kLanes) of a channel-axis row as float32 (0 at or beyond d).
inline V channel_codes(const std::uint8_t* codes, Index k, Index d, int bits) {
  if (bits == 8 && k + kLanes <= d) return vcodes<8>(codes + k);
  if (nibble_halves(bits, d)) {
    const Index h = d / 2;
    return k < h ? vcodes<4, false>(codes + k) : vcodes<4, true>(codes + k - h);
  }
  float buf[kLanes];
  float* c = opaque(buf);
  for (Index i = 0; i < kLanes; ++i) {
    c[i] = k + i < d ? static_cast<float>(span_code(codes, k + i, d, bits)) : 0.0f;
  }
  return vload(c);
}

/// Vector [k, k + kLanes) of half bit patterns t[0, d) as float32 (0 at or beyond d), converted
/// as the path converts half rows (exact on every path).
inline V channel_halves(const std::uint16_t* t, Index k, Index d) {
  const auto* h = reinterpret_cast<const Eigen::half*>(t) + k;
  return k + kLanes <= d ? vload_row(h) : load_row_tail(h, d - k);
}

/// Reads channel-axis rows: finds a row's block from its position (the last block looked up
/// first: rows of a block mostly follow each other) and keeps that block's scales and offsets as
/// float32 in so ([2, padded_lanes(d)], lanes beyond d zero).
class ChannelCursor {
 public:
  ChannelCursor(const ChannelRows& rows, float* so)
      : r_(rows), so_(so), d_(rows.fmt.dim), dp_(padded_lanes(rows.fmt.dim)) {}

  /// Row j dequantized into dst ([padded_lanes(d)], zero-padded).
  void load(Index j, float* dst) {
    const std::int64_t p = r_.pos[j];
    if (p >= r_.pending_start) return load_padded_row(pending_row(p), d_, dst);
    select(p);
    const std::uint8_t* codes = r_.row_bytes(j);
    for (Index k = 0; k < dp_; k += kLanes) {
      vstore(dst + k, vmadd(channel_codes(codes, k, d_, r_.fmt.bits), vload(so_ + k),
                                 vload(so_ + dp_ + k)));
    }
  }

 private:
  const float* pending_row(std::int64_t p) const { return r_.pending + (p - r_.pending_start) * d_; }

  void select(std::int64_t p) {
    if (cur_ >= 0 && p >= r_.starts[cur_] && (cur_ + 1 == r_.blocks || p < r_.starts[cur_ + 1])) {
      return;
    }
    const Index b = block_at(r_.starts, r_.blocks, p);
    const std::uint16_t* t = r_.tables + b * 2 * d_;
    for (Index k = 0; k < dp_; k += kLanes) {
      vstore(so_ + k, channel_halves(t, k, d_));
      vstore(so_ + dp_ + k, channel_halves(t + d_, k, d_));
    }
    cur_ = b;
  }

  const ChannelRows& r_;
  float* so_;
  Index d_, dp_;
  Index cur_ = -1;
};

/// pack_keys over channel-axis keys [j0, j1): the rows read back. buf: [padded_lanes(d)]; so:
/// [2, padded_lanes(d)].
inline void cpack_keys(const ChannelRows& keys, Index j0, Index j1, float* kt, float* buf,
                       float* so) {
  constexpr Index kW = 2 * kLanes;
  const Index d = keys.fmt.dim;
  ChannelCursor cur(keys, so);
  for (Index j = j0; j < j1; ++j) {
    cur.load(j, buf);
    float* col = kt + (j / kW) * d * kW + j % kW;
    for (Index k = 0; k < d; ++k) col[k * kW] = buf[k];
  }
}

/// Row j of channel-axis rows as float32 into out ([padded_lanes(d)], zero-padded).
inline void cload_padded_row(const ChannelRows& rows, Index j, float* out, float* so) {
  ChannelCursor(rows, so).load(j, out);
}

// ---- Channel-axis attention with the scales folded (docs/design.md 7.5) ------------------------
// For a sealed block, q . (o + s * c) = (q * s) . c + q . o: the query rows times the block's
// scales (once per block and call) meet each row's codes directly, and the offsets add one
// constant per block and query row. The output likewise: sum_j e_j (o + s * c_j) = o * E +
// s * sum_j e_j c_j over the rows of each block (walked block by block: ChannelFold's counting
// sort). A pending row is read at T. Every path runs the same operations in the same order: the
// paths with a fused multiply-add and the same reduction tree (scalar, AVX2, NEON) give the same
// bits; the values differ from those over the dequantized rows by rounding only.

/// Up to four dot products of float rows r[u] (u < count) with x over dp (whole vectors): one
/// chain each, reduced by the path's tree, into out[u].
inline void dots4(const float* const* r, Index count, const float* x, Index dp, float* out) {
  V s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
  for (Index k = 0; k < dp; k += kLanes) {
    const V c = vload(x + k);
    s0 = vmadd(vload(r[0] + k), c, s0);
    if (count > 1) s1 = vmadd(vload(r[1] + k), c, s1);
    if (count > 2) s2 = vmadd(vload(r[2] + k), c, s2);
    if (count > 3) s3 = vmadd(vload(r[3] + k), c, s3);
  }
  float sums_buf[4];
  float* sums = opaque(sums_buf);
  vreduce_add4(s0, s1, s2, s3, sums);
  for (Index u = 0; u < count; ++u) out[u] = sums[u];
}

/// The dot products of up to four float rows r0[u] (u < count, over dp: whole vectors) with the
/// codes of channel-axis row c0, and of r1[u] with the codes of row c1 (c1 null: one row), each
/// one chain in ascending order reduced by the path's tree (so a logit does not depend on its
/// pairing): out0[u], out1[u].
inline void code_dots(const float* const* r0, const float* const* r1, Index count,
                      const std::uint8_t* c0, const std::uint8_t* c1, Index d, int bits, Index dp,
                      float* out0, float* out1) {
  V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  V b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  for (Index k = 0; k < dp; k += kLanes) {
    const V x = channel_codes(c0, k, d, bits);
    const V y = c1 ? channel_codes(c1, k, d, bits) : vzero();
    a0 = vmadd(vload(r0[0] + k), x, a0);
    b0 = vmadd(vload(r1[0] + k), y, b0);
    if (count > 1) {
      a1 = vmadd(vload(r0[1] + k), x, a1);
      b1 = vmadd(vload(r1[1] + k), y, b1);
    }
    if (count > 2) {
      a2 = vmadd(vload(r0[2] + k), x, a2);
      b2 = vmadd(vload(r1[2] + k), y, b2);
    }
    if (count > 3) {
      a3 = vmadd(vload(r0[3] + k), x, a3);
      b3 = vmadd(vload(r1[3] + k), y, b3);
    }
  }
  float sums_buf[8];
  float* sums = opaque(sums_buf);
  vreduce_add4(a0, a1, a2, a3, sums);
  vreduce_add4(b0, b1, b2, b3, sums + 4);
  for (Index u = 0; u < count; ++u) {
    out0[u] = sums[u];
    out1[u] = sums[4 + u];
  }
}

/// code_dots for four query rows and two rows, the decode step's usual case (G = 4), with the
/// codes' layout known: Bits 4 (nibble_halves) or 8 (d a multiple of kLanes). The same chains in
/// the same order as code_dots, so the same bits, without its per-vector tests. Shared: both rows
/// are in one block (r1 is r0), so each folded query vector is loaded once for the two rows, as
/// logits_4x2 loads its query once per key pair (most pairs: a block holds 32 neighbours).
template <int Bits, bool Shared>
inline void code_dots_4x2(const float* const* r0, const float* const* r1, const std::uint8_t* c0,
                          const std::uint8_t* c1, Index d, float* out0, float* out1) {
  V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  V b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  const auto step = [&](Index k, V x, V y) {
    const V q0 = vload(r0[0] + k), q1 = vload(r0[1] + k);
    const V q2 = vload(r0[2] + k), q3 = vload(r0[3] + k);
    a0 = vmadd(q0, x, a0);
    b0 = vmadd(Shared ? q0 : vload(r1[0] + k), y, b0);
    a1 = vmadd(q1, x, a1);
    b1 = vmadd(Shared ? q1 : vload(r1[1] + k), y, b1);
    a2 = vmadd(q2, x, a2);
    b2 = vmadd(Shared ? q2 : vload(r1[2] + k), y, b2);
    a3 = vmadd(q3, x, a3);
    b3 = vmadd(Shared ? q3 : vload(r1[3] + k), y, b3);
  };
  if constexpr (Bits == 8) {
    for (Index k = 0; k < d; k += kLanes) step(k, vcodes<8>(c0 + k), vcodes<8>(c1 + k));
  } else {
    const Index h = d / 2;
    for (Index k = 0; k < h; k += kLanes) {
      step(k, vcodes<4, false>(c0 + k), vcodes<4, false>(c1 + k));
    }
    for (Index k = h; k < d; k += kLanes) {
      step(k, vcodes<4, true>(c0 + k - h), vcodes<4, true>(c1 + k - h));
    }
  }
  float sums_buf[8];
  float* sums = opaque(sums_buf);
  vreduce_add4(a0, a1, a2, a3, sums);
  vreduce_add4(b0, b1, b2, b3, sums + 4);
  for (Index u = 0; u < 4; ++u) {
    out0[u] = sums[u];
    out1[u] = sums[4 + u];
  }
}

/// Makes block b's folded query rows ready: qs = q_i * scales, cst[i] = q_i . offsets (f.row
/// holds the offsets meanwhile, then the scales: each table converted once, not per query row).
inline void fold_block(const float* q, Index m, Index ldq, const ChannelRows& keys, Index b,
                       const ChannelFold& f) {
  const Index d = keys.fmt.dim, dp = padded_lanes(d);
  float* qs = f.qs + b * m * dp;
  float* cst = f.cst + b * m;
  const std::uint16_t* t = keys.tables + b * 2 * d;
  float* scales = f.row + dp;
  for (Index k = 0; k < dp; k += kLanes) {
    vstore(f.row + k, channel_halves(t + d, k, d));
    vstore(scales + k, channel_halves(t, k, d));
  }
  for (Index i = 0; i < m; ++i) {
    for (Index k = 0; k < dp; k += kLanes) {
      vstore(qs + i * dp + k, vmul(vload(q + i * ldq + k), vload(scales + k)));
    }
  }
  const float* r[4];
  for (Index i = 0; i < m; i += 4) {
    const Index c = m - i < 4 ? m - i : 4;
    for (Index u = 0; u < c; ++u) r[u] = q + (i + u) * ldq;
    dots4(r, c, f.row, dp, cst + i);
  }
  f.ready[b] = 1;
}

/// logits over channel-axis keys with the scales folded: out[i * ldo + j] = scale * (q_i . k_j),
/// k_j row (idx ? idx[j] : j), i < m. f.block[j]: row j's block (keys.blocks: pending). Sealed
/// rows go two at a time, each against its own block's folded rows.
inline void cfold_logits(const float* q, Index m, Index ldq, const ChannelRows& keys,
                         const std::int32_t* idx, Index n, float scale, float* out, Index ldo,
                         const ChannelFold& f) {
  const Index d = keys.fmt.dim, dp = padded_lanes(d);
  const int bits = keys.fmt.bits;
  // The layouts code_dots_4x2 takes (0: none).
  const int fast = nibble_halves(bits, d) ? 4 : bits == 8 && d % kLanes == 0 ? 8 : 0;
  for (Index b = 0; b < keys.blocks; ++b) f.ready[b] = 0;
  float s0[4], s1[4];
  const float* r0[4];
  const float* r1[4];
  for (Index j = 0; j < n;) {
    const Index row = idx ? idx[j] : j;
    const Index b = f.block[j];
    if (b == keys.blocks) {  // pending: the row at T against the query rows
      load_padded_row(keys.pending + (keys.pos[row] - keys.pending_start) * d, d, f.row);
      for (Index i = 0; i < m; i += 4) {
        const Index c = m - i < 4 ? m - i : 4;
        for (Index u = 0; u < c; ++u) r0[u] = q + (i + u) * ldq;
        dots4(r0, c, f.row, dp, s0);
        for (Index u = 0; u < c; ++u) out[(i + u) * ldo + j] = s0[u] * scale;
      }
      ++j;
      continue;
    }
    if (!f.ready[b]) fold_block(q, m, ldq, keys, b, f);
    // The next row joins when it is sealed too (its block made ready first).
    const Index b1 = j + 1 < n ? f.block[j + 1] : keys.blocks;
    const bool pair = b1 != keys.blocks;
    if (pair && !f.ready[b1]) fold_block(q, m, ldq, keys, b1, f);
    const std::uint8_t* c0 = keys.row_bytes(row);
    const std::uint8_t* c1 = pair ? keys.row_bytes(idx ? idx[j + 1] : j + 1) : nullptr;
    const float* qs0 = f.qs + b * m * dp;
    const float* qs1 = f.qs + (pair ? b1 : b) * m * dp;
    const float* cst0 = f.cst + b * m;
    const float* cst1 = f.cst + (pair ? b1 : b) * m;
    for (Index i = 0; i < m; i += 4) {
      const Index c = m - i < 4 ? m - i : 4;
      for (Index u = 0; u < c; ++u) {
        r0[u] = qs0 + (i + u) * dp;
        r1[u] = qs1 + (i + u) * dp;
      }
      if (pair && c == 4 && fast == 4) {
        b1 == b ? code_dots_4x2<4, true>(r0, r1, c0, c1, d, s0, s1)
                : code_dots_4x2<4, false>(r0, r1, c0, c1, d, s0, s1);
      } else if (pair && c == 4 && fast == 8) {
        b1 == b ? code_dots_4x2<8, true>(r0, r1, c0, c1, d, s0, s1)
                : code_dots_4x2<8, false>(r0, r1, c0, c1, d, s0, s1);
      } else {
        code_dots(r0, r1, c, c0, c1, d, bits, dp, s0, s1);
      }
      for (Index u = 0; u < c; ++u) {
        out[(i + u) * ldo + j] = (s0[u] + cst0[i + u]) * scale;
        if (pair) out[(i + u) * ldo + j + 1] = (s1[u] + cst1[i + u]) * scale;
      }
    }
    j += pair ? 2 : 1;
  }
}

/// R (1 or 4) output rows over the value elements [k, k + width), the rows walked block by block:
/// f.perm[f.run[b], f.run[b + 1]) are block b's rows, block f.blocks the pending ones. W = 2: two
/// whole vectors; W = 1: one vector, whole or a tail (width < kLanes; the reads give 0 beyond d).
/// (Two instances fewer per R than weighted_slice's three: compile time, docs/testing.md.)
template <int R, int W>
inline void cfold_weighted_slice(const float* e, Index lde, const float* inv,
                                 const ChannelRows& v, const ChannelFold& f, Index k,
                                 Index width, float* out, Index ldo) {
  const Index d = v.fmt.dim;
  const int bits = v.fmt.bits;
  // channel_codes' layout tests, made once for the slice: whole vectors of 8-bit codes, or the
  // low or high nibbles (the slice within one half of d) read as bit fields (vcodes_field) from
  // `at`; otherwise (fast false) channel_codes per vector.
  const Index h = d / 2, end = k + (W == 2 ? 2 : 1) * kLanes;
  const bool split = nibble_halves(bits, d);
  const bool whole = bits == 8 && end <= d, low = split && end <= h, high = split && k >= h;
  const bool fast = whole || low || high;
  const int shift = high ? 4 : 0, mask = whole ? 0xFF : 0x0F;
  const Index at = high ? k - h : k;
  V t0 = vzero(), t1 = vzero(), u0 = vzero(), u1 = vzero();  // totals of rows 0, 1
  V w0 = vzero(), w1 = vzero(), z0 = vzero(), z1 = vzero();  // rows 2, 3
  for (Index b = 0; b <= v.blocks; ++b) {
    const Index first = f.run[b], last = f.run[b + 1];
    if (first == last) continue;
    V a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
    V c0 = vzero(), c1 = vzero(), d0 = vzero(), d1 = vzero();
    const float* E = f.esum + b * 4;
    // The block's rows, each read by load(j, x0, x1) (one loop per kind of read: no test per row).
    const auto walk = [&](auto load) {
      for (Index i = first; i < last; ++i) {
        const Index j = f.perm[i];
        V x0, x1 = vzero();
        load(j, x0, x1);
        const float e0 = e[j];
        a0 = vmadd(vset(e0), x0, a0);
        if constexpr (W == 2) a1 = vmadd(vset(e0), x1, a1);
        if constexpr (R >= 2) {
          const float e1 = e[lde + j];
          b0 = vmadd(vset(e1), x0, b0);
          if constexpr (W == 2) b1 = vmadd(vset(e1), x1, b1);
        }
        if constexpr (R >= 4) {
          const float e2 = e[2 * lde + j], e3 = e[3 * lde + j];
          c0 = vmadd(vset(e2), x0, c0);
          d0 = vmadd(vset(e3), x0, d0);
          if constexpr (W == 2) {
            c1 = vmadd(vset(e2), x1, c1);
            d1 = vmadd(vset(e3), x1, d1);
          }
        }
      }
    };
    if (b == v.blocks) {
      walk([&](Index j, V& x0, V& x1) {
        const float* row = v.pending + (v.pos[j] - v.pending_start) * d + k;
        x0 = k + kLanes <= d ? vload_row(row) : load_row_tail(row, d - k);
        if constexpr (W == 2) {
          x1 = k + 2 * kLanes <= d ? vload_row(row + kLanes)
                                   : load_row_tail(row + kLanes, d - k - kLanes);
        }
      });
      t0 = vadd(t0, a0), t1 = vadd(t1, a1), u0 = vadd(u0, b0), u1 = vadd(u1, b1);
      w0 = vadd(w0, c0), w1 = vadd(w1, c1), z0 = vadd(z0, d0), z1 = vadd(z1, d1);
      continue;
    }
    if (fast) {
      walk([&](Index j, V& x0, V& x1) {
        const std::uint8_t* codes = v.row_bytes(j) + at;
        x0 = vcodes_field(codes, shift, mask);
        if constexpr (W == 2) x1 = vcodes_field(codes + kLanes, shift, mask);
      });
    } else {
      walk([&](Index j, V& x0, V& x1) {
        const std::uint8_t* codes = v.row_bytes(j);
        x0 = channel_codes(codes, k, d, bits);
        if constexpr (W == 2) x1 = channel_codes(codes, k + kLanes, d, bits);
      });
    }
    const std::uint16_t* tab = v.tables + b * 2 * d;
    const V s0 = channel_halves(tab, k, d), o0 = channel_halves(tab + d, k, d);
    V s1 = vzero(), o1 = vzero();
    if constexpr (W == 2) {
      s1 = channel_halves(tab, k + kLanes, d);
      o1 = channel_halves(tab + d, k + kLanes, d);
    }
    const auto fold = [&](V& tot0, V& tot1, V acc0, V acc1, float sum) {
      tot0 = vmadd(o0, vset(sum), vmadd(s0, acc0, tot0));
      if constexpr (W == 2) tot1 = vmadd(o1, vset(sum), vmadd(s1, acc1, tot1));
    };
    fold(t0, t1, a0, a1, E[0]);
    if constexpr (R >= 2) fold(u0, u1, b0, b1, E[1]);
    if constexpr (R >= 4) {
      fold(w0, w1, c0, c1, E[2]);
      fold(z0, z1, d0, d1, E[3]);
    }
  }
  if (W == 1 && width < kLanes) {
    put_weighted_rows<R, 0>(inv, out, ldo, k, width, t0, t1, u0, u1, w0, w1, z0, z1);
  } else {
    put_weighted_rows<R, W>(inv, out, ldo, k, width, t0, t1, u0, u1, w0, w1, z0, z1);
  }
}

template <int R>
inline void cfold_weighted_group(const float* e, Index lde, const float* inv,
                                 const ChannelRows& v, const ChannelFold& f, float* out,
                                 Index ldo) {
  const Index dv = v.fmt.dim;
  // Each block's sum of e per output row, in the walk's order (f.esum [blocks + 1, 4]).
  for (Index b = 0; b <= v.blocks; ++b) {
    for (Index r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (Index at = f.run[b]; at < f.run[b + 1]; ++at) sum += e[r * lde + f.perm[at]];
      f.esum[b * 4 + r] = sum;
    }
  }
  Index k = 0;
  for (; k + 2 * kLanes <= dv; k += 2 * kLanes) {
    cfold_weighted_slice<R, 2>(e, lde, inv, v, f, k, 2 * kLanes, out, ldo);
  }
  for (; k < dv; k += kLanes) {
    cfold_weighted_slice<R, 1>(e, lde, inv, v, f, k, std::min<Index>(kLanes, dv - k), out, ldo);
  }
}

/// weighted_rows over the first n channel-axis value rows with the scales folded (f: the rows'
/// counting sort by block, ChannelFold).
inline void cfold_weighted_rows(const float* e, Index lde, const float* inv, Index rows,
                                const ChannelRows& values, float* out, Index ldo,
                                const ChannelFold& f) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    cfold_weighted_group<4>(e + r * lde, lde, inv + r, values, f, out + r * ldo, ldo);
  }
  for (; r < rows; ++r) {
    cfold_weighted_group<1>(e + r * lde, lde, inv + r, values, f, out + r * ldo, ldo);
  }
}
