/* llama2c_c_run: greedy generation with a llama2.c checkpoint (stories260K) in plain C99, whose
 * attention runs through veloxquant's C ABI (veloxquant.h). The forward pass is llama2.c's run.c
 * (rmsnorm, matmul, RoPE, SwiGLU) except attention: vq_attend over the engine's own token-major
 * q, k, v rows, RoPE at vq_offset(). The text equals `llama2c_generate --queries` byte for byte
 * (same prompt handling: one prefill call, then one call per new token; float cache rows).
 *
 *   llama2c_c_run [--model PATH] [--tokenizer PATH] [--method NAME] [--budget N] [--steps N]
 *                 [--prompt TEXT] [--set field=value]...
 *
 * The text goes to stdout, the statistics to stderr. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <veloxquant/veloxquant.h>

#ifndef VELOXQUANT_LLAMA2C_MODEL_DIR
#define VELOXQUANT_LLAMA2C_MODEL_DIR "."
#endif
#define BOS 1

/* ---- the model: llama2.c's legacy float32 checkpoint ----------------------------------------- */

typedef struct {
  int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
} Config;

typedef struct {
  Config c;
  float* data; /* every float of the file after the header */
  /* per-layer arrays are stacked along the layer axis; every matrix is [out, in], row-major */
  float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
} Model;

static int load_model(Model* m, const char* path) {
  FILE* f = fopen(path, "rb");
  int32_t h[7];
  if (f == NULL || fread(h, sizeof h, 1, f) != 1) {
    fprintf(stderr, "error: cannot read the checkpoint '%s'\n", path);
    if (f != NULL) fclose(f);
    return -1;
  }
  for (int i = 0; i < 7; ++i) {
    const long long v = i == 5 ? llabs(h[i]) : h[i]; /* vocab_size < 0: an own classifier */
    if (v < 1 || v > 1000000) {
      fprintf(stderr, "error: '%s': bad header value %d\n", path, (int)h[i]);
      fclose(f);
      return -1;
    }
  }
  Config* c = &m->c;
  c->dim = h[0], c->hidden_dim = h[1], c->n_layers = h[2], c->n_heads = h[3];
  c->n_kv_heads = h[4], c->vocab_size = abs(h[5]), c->seq_len = h[6];
  const int hd = c->dim / c->n_heads;
  const double dd = c->dim, dh = c->hidden_dim, dv = c->vocab_size, dkv = c->n_kv_heads * hd;
  if (c->dim % c->n_heads != 0 || c->n_heads % c->n_kv_heads != 0 || hd % 2 != 0 ||
      c->n_layers * (2 * dd * dd + 2 * dkv * dd + 3 * dh * dd) + 2 * dv * dd > 2.5e11) {
    fprintf(stderr, "error: '%s': bad header (head layout or size)\n", path);
    fclose(f);
    return -1;
  }
  const size_t D = (size_t)c->dim, H = (size_t)c->hidden_dim, L = (size_t)c->n_layers,
               KV = (size_t)(c->n_kv_heads * hd), V = (size_t)c->vocab_size;
  const size_t weights =
      V * D + L * (2 * D + 2 * D * D + 2 * KV * D + 3 * H * D) + D + (h[5] > 0 ? 0 : V * D);
  const size_t freq_cis = (size_t)c->seq_len * (size_t)hd; /* legacy cos/sin tables, skipped */
  m->data = malloc((weights + freq_cis + 1) * sizeof(float));
  const size_t n = m->data == NULL ? 0 : fread(m->data, 1, (weights + freq_cis) * 4 + 1, f);
  fclose(f);
  if (n != weights * 4 && n != (weights + freq_cis) * 4) {
    fprintf(stderr, "error: '%s': %zu bytes of weights match no layout for this header\n", path, n);
    return -1;
  }
  float* p = m->data;
  m->emb = p, p += V * D;
  m->rms_att = p, p += L * D;
  m->wq = p, p += L * D * D;
  m->wk = p, p += L * KV * D;
  m->wv = p, p += L * KV * D;
  m->wo = p, p += L * D * D;
  m->rms_ffn = p, p += L * D;
  m->w1 = p, p += L * H * D;
  m->w2 = p, p += L * D * H;
  m->w3 = p, p += L * H * D;
  m->rms_final = p, p += D;
  if (n != weights * 4) p += freq_cis;
  m->wcls = h[5] > 0 ? m->emb : p;
  return 0;
}

/* ---- the tokenizer: llama2.c's tokenizer.bin ------------------------------------------------- */

typedef struct {
  const char* str;
  int id;
} TokenIndex;

typedef struct {
  char** pieces;
  float* scores;
  TokenIndex* sorted; /* by piece, then id: a duplicated piece finds its first id */
  int vocab_size, max_len;
} Tokenizer;

static int compare_tokens(const void* a, const void* b) {
  const TokenIndex *x = a, *y = b;
  const int c = strcmp(x->str, y->str);
  return c != 0 ? c : x->id - y->id;
}

static int load_tokenizer(Tokenizer* t, const char* path, int vocab_size) {
  FILE* f = fopen(path, "rb");
  int32_t max_len = 0;
  t->vocab_size = vocab_size;
  t->pieces = calloc((size_t)vocab_size, sizeof(char*));
  t->scores = malloc((size_t)vocab_size * sizeof(float));
  t->sorted = malloc((size_t)vocab_size * sizeof(TokenIndex));
  int ok = f != NULL && t->pieces != NULL && t->scores != NULL && t->sorted != NULL &&
           fread(&max_len, 4, 1, f) == 1 && max_len >= 1 && max_len <= 4096;
  for (int i = 0; ok && i < vocab_size; ++i) {
    int32_t len = 0;
    ok = fread(&t->scores[i], 4, 1, f) == 1 && fread(&len, 4, 1, f) == 1 && len >= 1 &&
         len <= max_len && isfinite(t->scores[i]) &&
         (t->pieces[i] = malloc((size_t)len + 1)) != NULL &&
         fread(t->pieces[i], 1, (size_t)len, f) == (size_t)len;
    if (ok) t->pieces[i][len] = '\0';
    t->sorted[i].str = t->pieces[i], t->sorted[i].id = i;
  }
  if (f != NULL) fclose(f);
  if (!ok) {
    fprintf(stderr, "error: cannot read the tokenizer '%s' (missing, truncated or malformed)\n",
            path);
    return -1;
  }
  t->max_len = max_len;
  qsort(t->sorted, (size_t)vocab_size, sizeof(TokenIndex), compare_tokens);
  return 0;
}

static int lookup(const Tokenizer* t, const char* s) { /* the first id of piece s, or -1 */
  int lo = 0, hi = t->vocab_size;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (strcmp(t->sorted[mid].str, s) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < t->vocab_size && strcmp(t->sorted[lo].str, s) == 0 ? t->sorted[lo].id : -1;
}

/* BOS, then " " + text as one id per UTF-8 code point (byte fallback: id byte + 3), then merges of
 * the adjacent pair whose concatenation scores highest (leftmost on ties). ids: strlen(text) + 2
 * slots. Returns the count, or -1 when out of memory. */
static int encode(const Tokenizer* t, const char* text, int* ids) {
  int n = 0;
  ids[n++] = BOS;
  if (*text == '\0') return n;
  const size_t len = strlen(text) + 1;
  char* s = malloc(len + 1);
  char* pair = malloc(2 * (size_t)t->max_len + 1);
  if (s == NULL || pair == NULL) {
    free(s), free(pair);
    return -1;
  }
  s[0] = ' ';
  memcpy(s + 1, text, len);
  for (size_t i = 0, j; i < len; i = j) {
    for (j = i + 1; j < len && j - i < 4 && ((unsigned char)s[j] & 0xC0) == 0x80; ++j) {
    }
    char cp[5] = {0};
    memcpy(cp, s + i, j - i);
    const int id = lookup(t, cp);
    for (size_t b = i; id < 0 && b < j; ++b) {
      const int byte_id = (unsigned char)s[b] + 3;
      ids[n++] = byte_id < t->vocab_size ? byte_id : 0;
    }
    if (id >= 0) ids[n++] = id;
  }
  for (;;) { /* merges, over the text's ids only (not BOS) */
    int best = -1, best_id = -1;
    float best_score = 0.0f;
    for (int i = 1; i + 1 < n; ++i) {
      strcpy(pair, t->pieces[ids[i]]);
      strcat(pair, t->pieces[ids[i + 1]]);
      const int id = lookup(t, pair);
      if (id >= 0 && (best < 0 || t->scores[id] > best_score)) {
        best = i, best_id = id, best_score = t->scores[id];
      }
    }
    if (best < 0) break;
    ids[best] = best_id;
    memmove(ids + best + 1, ids + best + 2, (size_t)(n - best - 2) * sizeof(int));
    --n;
  }
  free(s), free(pair);
  return n;
}

/* The text of token after prev: a <0xHH> piece is the byte 0xHH; after BOS a leading space goes. */
static const char* decode(const Tokenizer* t, int prev, int token, char byte[2]) {
  const char* piece = t->pieces[token];
  if (strlen(piece) == 6 && strncmp(piece, "<0x", 3) == 0 && piece[5] == '>') {
    char hex[3] = {piece[3], piece[4], '\0'}, *end = NULL;
    const long b = strtol(hex, &end, 16);
    if (end == hex + 2) {
      byte[0] = (char)b, byte[1] = '\0';
      return byte;
    }
  }
  return prev == BOS && piece[0] == ' ' ? piece + 1 : piece;
}

/* ---- the forward pass ------------------------------------------------------------------------ */

typedef struct {
  float *x, *xb, *xb2, *q, *k, *v, *hb, *hb2, *logits; /* x..v: [S, width], hb*: [S, hidden] */
} RunState;

static void rmsnorm(float* o, const float* x, const float* w, int rows, int n) {
  for (int r = 0; r < rows; ++r, o += n, x += n) {
    float ss = 0.0f;
    for (int j = 0; j < n; ++j) ss += x[j] * x[j];
    const float inv = 1.0f / sqrtf(ss / (float)n + 1e-5f);
    for (int j = 0; j < n; ++j) o[j] = x[j] * inv * w[j];
  }
}

/* out[r] = W x[r] for each of `rows` rows; W: [d, n] */
static void matmul(float* out, const float* x, const float* w, int rows, int n, int d) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < d; ++i) {
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += w[(size_t)i * (size_t)n + (size_t)j] * x[r * n + j];
      out[r * d + i] = sum;
    }
  }
}

/* RoPE: rotates the pairs (i, i + 1) of every head of row s by (pos0 + s) * 10000^(-i / hd). */
static void rope(float* m, int rows, int width, int64_t pos0, int hd) {
  for (int s = 0; s < rows; ++s) {
    const float pos = (float)(pos0 + s);
    for (int i = 0; i < hd; i += 2) {
      const float freq = 1.0f / powf(10000.0f, (float)i / (float)hd);
      const float cos_a = cosf(pos * freq), sin_a = sinf(pos * freq);
      for (float* p = m + s * width + i; p < m + (s + 1) * width; p += hd) {
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * cos_a - x1 * sin_a;
        p[1] = x0 * sin_a + x1 * cos_a;
      }
    }
  }
}

static int check(vq_status status) { /* 0 for VQ_OK, else -1 and the library's message */
  if (status != VQ_OK) fprintf(stderr, "error: %s: %s\n", vq_status_name(status), vq_last_error());
  return status == VQ_OK ? 0 : -1;
}

/* Runs S tokens as one call per layer; returns the last token's logits, or NULL on failure. */
static const float* forward(const Model* m, RunState* st, vq_caches* caches, const int* tokens,
                            int S) {
  const Config* c = &m->c;
  const int dim = c->dim, hd = dim / c->n_heads, kv_dim = c->n_kv_heads * hd, hid = c->hidden_dim;
  for (int s = 0; s < S; ++s) memcpy(st->x + s * dim, m->emb + tokens[s] * dim, (size_t)dim * 4);
  for (int l = 0; l < c->n_layers; ++l) {
    const size_t ld = (size_t)l * (size_t)dim; /* layer l's matrices start at ld * rows */
    const float *wq = m->wq + ld * (size_t)dim, *wk = m->wk + ld * (size_t)kv_dim,
                *wv = m->wv + ld * (size_t)kv_dim, *wo = m->wo + ld * (size_t)dim,
                *w1 = m->w1 + ld * (size_t)hid, *w2 = m->w2 + ld * (size_t)hid,
                *w3 = m->w3 + ld * (size_t)hid;
    /* attention: x += wo @ attend(q, k, v), q k v = wq wk wv @ rmsnorm(x), RoPE on q and k */
    rmsnorm(st->xb, st->x, m->rms_att + l * dim, S, dim);
    matmul(st->q, st->xb, wq, S, dim, dim);
    matmul(st->k, st->xb, wk, S, dim, kv_dim);
    matmul(st->v, st->xb, wv, S, dim, kv_dim);
    const int64_t pos0 = vq_offset(caches, l);
    if (pos0 < 0) {
      fprintf(stderr, "error: vq_offset: %s\n", vq_last_error());
      return NULL;
    }
    rope(st->q, S, dim, pos0, hd);
    rope(st->k, S, kv_dim, pos0, hd);
    if (check(vq_attend(caches, l, st->q, st->k, st->v, st->xb2, 1, c->n_heads, c->n_kv_heads, S,
                        hd, VQ_TOKEN_MAJOR)) != 0) {
      return NULL;
    }
    matmul(st->xb, st->xb2, wo, S, dim, dim);
    for (int i = 0; i < S * dim; ++i) st->x[i] += st->xb[i];
    /* feed-forward: x += w2 @ (silu(w1 @ h) * (w3 @ h)), h = rmsnorm(x) */
    rmsnorm(st->xb, st->x, m->rms_ffn + l * dim, S, dim);
    matmul(st->hb, st->xb, w1, S, dim, hid);
    matmul(st->hb2, st->xb, w3, S, dim, hid);
    for (int i = 0; i < S * hid; ++i) {
      const float g = st->hb[i];
      st->hb[i] = g * (1.0f / (1.0f + expf(-g))) * st->hb2[i];
    }
    matmul(st->xb, st->hb, w2, S, hid, dim);
    for (int i = 0; i < S * dim; ++i) st->x[i] += st->xb[i];
  }
  rmsnorm(st->xb, st->x + (S - 1) * dim, m->rms_final, 1, dim);
  matmul(st->logits, st->xb, m->wcls, 1, dim, c->vocab_size);
  return st->logits;
}

static int argmax(const float* v, int n) { /* the first maximum */
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

/* ---- the program ----------------------------------------------------------------------------- */

static int usage(const char* argv0) {
  fprintf(stderr,
          "usage: %s [--model PATH] [--tokenizer PATH] [--method NAME] [--budget N]\n"
          "          [--steps N] [--prompt TEXT] [--set field=value]...\n",
          argv0);
  return 2;
}

int main(int argc, char** argv) {
  const char *model_path = VELOXQUANT_LLAMA2C_MODEL_DIR "/stories260K.bin",
             *tok_path = VELOXQUANT_LLAMA2C_MODEL_DIR "/tok512.bin", *prompt = "",
             *method = "standard"; /* llama2c_generate's default */
  int steps = 256, rc = 1, n_ids = 0;
  Model m = {0};
  Tokenizer t = {0};
  RunState st = {0};
  vq_caches* caches = NULL;
  int* ids = NULL;
  char* text = NULL;
  vq_config* cfg = vq_config_new();
  if (cfg == NULL || check(vq_config_set(cfg, "method", method)) != 0) goto done;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
    if (value == NULL) {
      rc = usage(argv[0]);
      goto done;
    }
    ++i;
    if (strcmp(a, "--model") == 0) {
      model_path = value;
    } else if (strcmp(a, "--tokenizer") == 0) {
      tok_path = value;
    } else if (strcmp(a, "--prompt") == 0) {
      prompt = value;
    } else if (strcmp(a, "--steps") == 0) {
      steps = atoi(value);
    } else if (strcmp(a, "--method") == 0) {
      method = value;
      if (check(vq_config_set(cfg, "method", value)) != 0) goto done;
    } else if (strcmp(a, "--budget") == 0) { /* every method's budget */
      if (check(vq_config_set(cfg, "budget", value)) != 0) goto done;
    } else if (strcmp(a, "--set") == 0) {
      char field[128];
      const char* eq = strchr(value, '=');
      if (eq == NULL || (size_t)(eq - value) >= sizeof field) {
        fprintf(stderr, "error: --set '%s' is not field=value\n", value);
        goto done;
      }
      memcpy(field, value, (size_t)(eq - value));
      field[eq - value] = '\0';
      if (check(vq_config_set(cfg, field, eq + 1)) != 0) goto done;
    } else {
      rc = usage(argv[0]);
      goto done;
    }
  }

  if (load_model(&m, model_path) != 0 || load_tokenizer(&t, tok_path, m.c.vocab_size) != 0 ||
      check(vq_caches_new(cfg, m.c.n_layers, VQ_FLOAT, &caches)) != 0) {
    goto done;
  }
  const Config* c = &m.c;
  const size_t S = (size_t)c->seq_len, hid = (size_t)c->hidden_dim, dim = (size_t)c->dim;
  st.x = malloc(S * dim * 4), st.xb = malloc(S * dim * 4), st.xb2 = malloc(S * dim * 4);
  st.q = malloc(S * dim * 4), st.k = malloc(S * dim * 4), st.v = malloc(S * dim * 4);
  st.hb = malloc(S * hid * 4), st.hb2 = malloc(S * hid * 4);
  st.logits = malloc((size_t)c->vocab_size * 4);
  const int room = steps < 0 ? 0 : steps > c->seq_len ? c->seq_len : steps; /* new tokens */
  ids = malloc((strlen(prompt) + 2 + (size_t)room) * sizeof(int));
  if (!st.x || !st.xb || !st.xb2 || !st.q || !st.k || !st.v || !st.hb || !st.hb2 || !st.logits ||
      !ids || (n_ids = encode(&t, prompt, ids)) < 0) {
    fprintf(stderr, "error: out of memory\n");
    goto done;
  }
  const int n_prompt = n_ids;
  if (steps > 0 && n_prompt > c->seq_len) {
    fprintf(stderr, "error: %d prompt tokens exceed seq_len %d\n", n_prompt, c->seq_len);
    goto done;
  }

  /* Greedy: the prompt as one call, then one call per new token, until steps tokens, a BOS or
   * the end of the context. */
  const clock_t start = clock();
  if (steps > 0) {
    const float* logits = forward(&m, &st, caches, ids, n_prompt);
    if (logits == NULL) goto done;
    int next = argmax(logits, c->vocab_size);
    while (next != BOS) {
      ids[n_ids++] = next;
      if (n_ids - n_prompt == steps || vq_offset(caches, 0) >= c->seq_len) break;
      if ((logits = forward(&m, &st, caches, &next, 1)) == NULL) goto done;
      next = argmax(logits, c->vocab_size);
    }
  }
  const double seconds = (double)(clock() - start) / (double)CLOCKS_PER_SEC;

  /* The text, decoded as llama2c_generate does (after BOS; the prompt's BOS skipped; printed
   * with %s, so it ends at a <0x00> byte). */
  text = malloc((size_t)n_ids * (size_t)t.max_len + 1);
  if (text == NULL) goto done;
  text[0] = '\0';
  for (int i = 1, prev = BOS; i < n_ids; prev = ids[i++]) {
    char byte[2];
    const char* piece = decode(&t, prev, ids[i], byte);
    if (piece == byte && byte[0] == '\0') break;
    strcat(text, piece);
  }
  printf("%s\n", text);

  double kept = 0.0;
  for (int l = 0; l < c->n_layers; ++l) kept += (double)vq_rows(caches, l);
  fprintf(stderr,
          "method %s through the C ABI: %d prompt + %d generated tokens, %.1f tok/s (CPU); "
          "rows kept per head (mean over layers) %.1f of %lld; KV bytes kept %zu\n",
          method, n_prompt, n_ids - n_prompt, seconds > 0 ? (double)n_ids / seconds : 0.0,
          kept / c->n_layers, (long long)vq_offset(caches, 0), vq_kept_bytes(caches));
  rc = 0;
done:
  for (int i = 0; t.pieces != NULL && i < t.vocab_size; ++i) free(t.pieces[i]);
  free(t.pieces), free(t.scores), free(t.sorted), free(m.data), free(ids), free(text);
  free(st.x), free(st.xb), free(st.xb2), free(st.q), free(st.k), free(st.v), free(st.hb);
  free(st.hb2), free(st.logits);
  vq_caches_free(caches);
  vq_config_free(cfg);
  return rc;
}
