/* veloxquant — the C ABI's test driver (include/veloxquant/veloxquant.h, SPEC 15, docs/c_abi.md).
 *
 * C99, no C++: every function of the header with good input and with every bad input the header
 * and SPEC 15 name. For each failure it checks the exact status, that vq_last_error() is
 * non-empty, was written by this very call (a different message is planted before it) and names
 * the problem, and that nothing changed: the set's counters, and the next good call's output,
 * which must be bit-identical to that of a twin set that never saw the bad call.
 *
 * Built twice (tests/c/CMakeLists.txt): against the shared libveloxquant_c and the static one.
 * Temporary files go to a directory of their own under $TMPDIR (or /tmp), removed at the end.
 * Exit status: 0 when every check passed, 1 otherwise; one summary line on stdout. */
#define _POSIX_C_SOURCE 200809L

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <veloxquant/veloxquant.h>

/* ---- checks ------------------------------------------------------------------------------------
 */

static long g_checks = 0;
static long g_failures = 0;
static const char* g_group = "";

/* Records one check; prints file:line, the group and the failing expression (the first 200). */
static int check_at(int ok, const char* expr, const char* file, int line) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    if (g_failures <= 200) {
      fprintf(stderr, "%s:%d: [%s] CHECK failed: %s\n", file, line, g_group, expr);
    } else if (g_failures == 201) {
      fprintf(stderr, "(further failures not printed)\n");
    }
  }
  return ok;
}
#define CHECK(expr) check_at((expr) ? 1 : 0, #expr, __FILE__, __LINE__)

/* vq_last_error() copied at once (it is valid until the thread's next vq_ call only). */
static void copy_last_error(char* buf, size_t size) {
  const char* m = vq_last_error();
  if (m == NULL) {
    snprintf(buf, size, "%s", "<vq_last_error() returned NULL>");
    return;
  }
  snprintf(buf, size, "%s", m);
}

static int check_status_at(vq_status got, vq_status want, const char* expr, const char* file,
                           int line) {
  char msg[1024];
  copy_last_error(msg, sizeof msg);
  if (!check_at(got == want, expr, file, line)) {
    fprintf(stderr, "    returned %s, expected %s (vq_last_error: \"%s\")\n", vq_status_name(got),
            vq_status_name(want), msg);
    return 0;
  }
  return 1;
}
#define CHECK_OK(call) check_status_at((call), VQ_OK, #call, __FILE__, __LINE__)

/* A message of its own is planted before each expected failure, so a stale message cannot pass
 * for the one the failing call must write. */
static vq_config* g_prime = NULL;
static const char* const kPrimeField = "zz_planted_field";

static void prime_error(void) {
  if (vq_config_set(g_prime, kPrimeField, "1") != VQ_EINVAL) {
    check_at(0, "planting a message: vq_config_set of an unknown field is VQ_EINVAL", __FILE__,
             __LINE__);
  }
}

/* The message of the failure just seen: not NULL, not empty, not the planted one, containing
 * `needle` (when not NULL). `msg` is the copy taken right after the call. */
static void check_message_at(const char* msg, const char* needle, const char* expr,
                             const char* file, int line) {
  char what[512];
  snprintf(what, sizeof what, "vq_last_error() after %s is non-empty", expr);
  if (!check_at(msg[0] != '\0', what, file, line)) return;
  snprintf(what, sizeof what, "vq_last_error() after %s is this call's (not the planted one)",
           expr);
  if (!check_at(strstr(msg, kPrimeField) == NULL, what, file, line)) return;
  if (needle != NULL) {
    snprintf(what, sizeof what, "vq_last_error() after %s contains \"%s\"", expr, needle);
    if (!check_at(strstr(msg, needle) != NULL, what, file, line)) {
      fprintf(stderr, "    message: \"%s\"\n", msg);
    }
  }
}

static void check_fail_at(vq_status got, vq_status want, const char* needle, const char* expr,
                          const char* file, int line) {
  char msg[1024];
  copy_last_error(msg, sizeof msg);
  if (!check_at(got == want, expr, file, line)) {
    fprintf(stderr, "    returned %s, expected %s (vq_last_error: \"%s\")\n", vq_status_name(got),
            vq_status_name(want), msg);
    return;
  }
  check_message_at(msg, needle, expr, file, line);
}
/* `call` must fail with status `want` and a message containing `needle`. */
#define CHECK_FAIL(call, want, needle)                                 \
  do {                                                                 \
    prime_error();                                                     \
    {                                                                  \
      const vq_status st_ = (call);                                    \
      check_fail_at(st_, (want), (needle), #call, __FILE__, __LINE__); \
    }                                                                  \
  } while (0)
/* For the functions that return a value: `cond` (which makes the call) must hold and the call
 * must have set a message containing `needle`. */
#define CHECK_FAIL_VALUE(cond, needle)                               \
  do {                                                               \
    prime_error();                                                   \
    {                                                                \
      char msg_[1024];                                               \
      const int ok_ = (cond) ? 1 : 0;                                \
      copy_last_error(msg_, sizeof msg_);                            \
      if (check_at(ok_, #cond, __FILE__, __LINE__)) {                \
        check_message_at(msg_, (needle), #cond, __FILE__, __LINE__); \
      }                                                              \
    }                                                                \
  } while (0)

/* A non-null pointer no call may keep: every failing call that has an `out` must set it to NULL. */
static int g_sentinel_object;
#define SENTINEL_CACHES ((vq_caches*)(void*)&g_sentinel_object)

/* ---- numbers ------------------------------------------------------------------------------------
 */

static uint32_t rng_next(uint32_t* state) {
  uint32_t x = *state;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  *state = x;
  return x;
}

static uint32_t seed_state(uint32_t seed) { return seed * 2654435761u + 0x9E3779B9u; }

/* Multiples of 1/64 in [-1, 1]: exact in half, bfloat16, float and double. */
static void fill_grid(float* x, size_t n, uint32_t seed) {
  uint32_t st = seed_state(seed);
  size_t i;
  for (i = 0; i < n; ++i) x[i] = (float)((int)(rng_next(&st) % 129u) - 64) / 64.0f;
}

/* Any float in [-2, 2) with 24 significant bits: rounds in half and bfloat16. */
static void fill_any(float* x, size_t n, uint32_t seed) {
  uint32_t st = seed_state(seed);
  size_t i;
  for (i = 0; i < n; ++i) x[i] = (float)(rng_next(&st) >> 8) / 4194304.0f - 2.0f;
}

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* float -> IEEE half, rounding to nearest even (as Eigen::half does). */
static uint16_t f32_to_f16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t fexp = (x >> 23) & 0xFFu;
  uint32_t mant = x & 0x7FFFFFu;
  int exp;
  if (fexp == 0xFFu) return (uint16_t)(sign | 0x7C00u | (mant != 0u ? 0x200u : 0u));
  exp = (int)fexp - 127 + 15;
  if (exp >= 31) return (uint16_t)(sign | 0x7C00u);
  if (exp <= 0) {
    uint32_t shift, h, rem, halfway;
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000u;
    shift = (uint32_t)(14 - exp);
    h = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u) != 0u)) ++h;
    return (uint16_t)(sign | h);
  }
  {
    uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0u)) ++h; /* a carry is still right */
    return (uint16_t)h;
  }
}

static float f16_to_f32(uint16_t h) {
  const uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  const uint32_t exp = ((uint32_t)h >> 10) & 0x1Fu;
  uint32_t mant = (uint32_t)h & 0x3FFu;
  if (exp == 0u) {
    float v;
    if (mant == 0u) return float_of(sign);
    v = (float)mant / 16777216.0f; /* mant * 2^-24 */
    return sign != 0u ? -v : v;
  }
  if (exp == 31u) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | ((exp - 15u + 127u) << 23) | (mant << 13));
}

/* float -> bfloat16, rounding to nearest even (as Eigen::bfloat16 does). */
static uint16_t f32_to_bf16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static float bf16_to_f32(uint16_t b) { return float_of((uint32_t)b << 16); }

/* ---- buffers and shapes
 * -------------------------------------------------------------------------- */

static void* xcalloc(size_t n, size_t size) {
  void* p = calloc(n == 0 ? 1 : n, size);
  if (p == NULL) {
    fprintf(stderr, "test_c_api: out of memory\n");
    exit(2);
  }
  return p;
}
static float* floats(size_t n) { return (float*)xcalloc(n, sizeof(float)); }

static size_t nelem(int a, int b, int c, int d) {
  return (size_t)a * (size_t)b * (size_t)c * (size_t)d;
}

/* Index of (b, h, s, d) in a dense [B, H, S, D] (head-major) or [B, S, H, D] (token-major) buffer.
 */
static size_t at4(vq_layout layout, int H, int S, int D, int b, int h, int s, int d) {
  if (layout == VQ_HEAD_MAJOR) {
    return (((size_t)b * (size_t)H + (size_t)h) * (size_t)S + (size_t)s) * (size_t)D + (size_t)d;
  }
  return (((size_t)b * (size_t)S + (size_t)s) * (size_t)H + (size_t)h) * (size_t)D + (size_t)d;
}

/* dst (in layout `to`) = src (in the other layout), both [B, H, S, D]. */
static void relayout(const float* src, float* dst, vq_layout to, int B, int H, int S, int D) {
  const vq_layout from = to == VQ_HEAD_MAJOR ? VQ_TOKEN_MAJOR : VQ_HEAD_MAJOR;
  int b, h, s, d;
  for (b = 0; b < B; ++b)
    for (h = 0; h < H; ++h)
      for (s = 0; s < S; ++s)
        for (d = 0; d < D; ++d)
          dst[at4(to, H, S, D, b, h, s, d)] = src[at4(from, H, S, D, b, h, s, d)];
}

typedef struct {
  int batch, q_heads, kv_heads, seq, dim, vdim;
} shape_t;

/* The shape most tests use: one sequence, 4 query heads over 2 KV heads, head dim 8. */
static shape_t shape_std(int seq) {
  shape_t s;
  s.batch = 1;
  s.q_heads = 4;
  s.kv_heads = 2;
  s.seq = seq;
  s.dim = 8;
  s.vdim = 8;
  return s;
}

static size_t q_count(shape_t s) { return nelem(s.batch, s.q_heads, s.seq, s.dim); }
static size_t k_count(shape_t s) { return nelem(s.batch, s.kv_heads, s.seq, s.dim); }
static size_t v_count(shape_t s) { return nelem(s.batch, s.kv_heads, s.seq, s.vdim); }
static size_t out_count(shape_t s) { return nelem(s.batch, s.q_heads, s.seq, s.vdim); }

/* One call's inputs (head-major, grid values) and an output buffer. */
typedef struct {
  shape_t sh;
  float* q;
  float* k;
  float* v;
  float* out;
} call_t;

static call_t call_new(shape_t sh, uint32_t seed) {
  call_t c;
  c.sh = sh;
  c.q = floats(q_count(sh));
  c.k = floats(k_count(sh));
  c.v = floats(v_count(sh));
  c.out = floats(out_count(sh));
  fill_grid(c.q, q_count(sh), seed * 3u + 1u);
  fill_grid(c.k, k_count(sh), seed * 3u + 2u);
  fill_grid(c.v, v_count(sh), seed * 3u + 3u);
  return c;
}

static void call_free(call_t* c) {
  free(c->q);
  free(c->k);
  free(c->v);
  free(c->out);
  c->q = c->k = c->v = c->out = NULL;
}

/* vq_attend of a head-major call into `out` (value dim = head dim). */
static vq_status attend_hm(vq_caches* s, int layer, const call_t* c, float* out) {
  return vq_attend(s, layer, c->q, c->k, c->v, out, c->sh.batch, c->sh.q_heads, c->sh.kv_heads,
                   c->sh.seq, c->sh.dim, VQ_HEAD_MAJOR);
}

static vq_tensor tensor_of(const void* data, vq_dtype dtype, int batch, int heads, int seq, int dim,
                           vq_layout layout) {
  vq_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.batch = batch;
  t.heads = heads;
  t.seq = seq;
  t.dim = dim;
  t.layout = layout;
  return t;
}

/* A generous buffer for the bad calls (the library must refuse them before reading anything, but
 * if it did read, it reads initialised memory of this size). */
#define JUNK_FLOATS 65536
static float g_junk[JUNK_FLOATS];
static float g_junk_out[JUNK_FLOATS];

/* ---- configurations and sets
 * --------------------------------------------------------------------- */

static vq_config* config_of(const char* method, int budget) {
  vq_config* c = vq_config_new();
  if (c == NULL) {
    fprintf(stderr, "test_c_api: vq_config_new returned NULL\n");
    exit(2);
  }
  CHECK_OK(vq_config_set(c, "method", method));
  if (budget > 0) {
    char text[32];
    snprintf(text, sizeof text, "%d", budget);
    CHECK_OK(vq_config_set(c, "budget", text));
  }
  if (strcmp(method, "squeeze") == 0) CHECK_OK(vq_config_set(c, "squeeze_calibration_tokens", "4"));
  return c;
}

static vq_caches* caches_of(const vq_config* c, int n_layers, vq_storage storage) {
  vq_caches* s = NULL;
  CHECK_OK(vq_caches_new(c, n_layers, storage, &s));
  if (s == NULL) {
    fprintf(stderr, "test_c_api: vq_caches_new failed: %s\n", vq_last_error());
    exit(2);
  }
  return s;
}

static vq_caches* new_set(const char* method, int budget, int n_layers, vq_storage storage) {
  vq_config* c = config_of(method, budget);
  vq_caches* s = caches_of(c, n_layers, storage);
  vq_config_free(c); /* the set does not need its config any more */
  return s;
}

/* What a set shows of its state without calls that change it. */
#define MAX_LAYERS 8
typedef struct {
  int layers;
  int64_t offset[MAX_LAYERS];
  int64_t rows[MAX_LAYERS];
  int budget[MAX_LAYERS];
  int64_t seen[MAX_LAYERS]; /* vq_layer_tokens_seen */
  size_t full[MAX_LAYERS];  /* vq_layer_full_seq_bytes */
  double concentration[MAX_LAYERS];
  size_t kept;
  int meta;
} snap_t;

static snap_t snap_of(const vq_caches* s) {
  snap_t r;
  int l;
  memset(&r, 0, sizeof r);
  r.layers = vq_layers(s);
  for (l = 0; l < r.layers && l < MAX_LAYERS; ++l) {
    r.offset[l] = vq_offset(s, l);
    r.rows[l] = vq_rows(s, l);
    r.budget[l] = vq_layer_budget(s, l);
    r.seen[l] = vq_layer_tokens_seen(s, l);
    r.full[l] = vq_layer_full_seq_bytes(s, l);
    r.concentration[l] = vq_layer_concentration(s, l);
  }
  r.kept = vq_kept_bytes(s);
  r.meta = vq_metadata_count(s);
  return r;
}

static int snap_same(const snap_t* x, const snap_t* y) {
  int l;
  if (x->layers != y->layers || x->kept != y->kept || x->meta != y->meta) return 0;
  for (l = 0; l < x->layers && l < MAX_LAYERS; ++l) {
    if (x->offset[l] != y->offset[l] || x->rows[l] != y->rows[l] || x->budget[l] != y->budget[l])
      return 0;
    if (x->seen[l] != y->seen[l] || x->full[l] != y->full[l]) return 0;
    if (memcmp(&x->concentration[l], &y->concentration[l], sizeof(double)) != 0) return 0;
  }
  return 1;
}

static void print_snap(const char* name, const snap_t* s) {
  int l;
  fprintf(stderr, "    %s: layers %d, kept %lu bytes, metadata %d;", name, s->layers,
          (unsigned long)s->kept, s->meta);
  for (l = 0; l < s->layers && l < MAX_LAYERS; ++l) {
    fprintf(stderr, " [%d: offset %lld rows %lld budget %d seen %lld full %lu concentration %.17g]",
            l, (long long)s->offset[l], (long long)s->rows[l], s->budget[l], (long long)s->seen[l],
            (unsigned long)s->full[l], s->concentration[l]);
  }
  fprintf(stderr, "\n");
}

static void check_snap_at(const snap_t* want, const snap_t* got, const char* expr, const char* file,
                          int line) {
  if (!check_at(snap_same(want, got), expr, file, line)) {
    print_snap("expected", want);
    print_snap("got", got);
  }
}
/* The set `s` shows exactly the state `before` (a snap_t). */
#define CHECK_UNCHANGED(before, s)                                                    \
  do {                                                                                \
    const snap_t now_ = snap_of(s);                                                   \
    check_snap_at(&(before), &now_, "state of " #s " unchanged", __FILE__, __LINE__); \
  } while (0)
/* Two sets show the same state. */
#define CHECK_SAME_STATE(x, y)                                                   \
  do {                                                                           \
    const snap_t sx_ = snap_of(x), sy_ = snap_of(y);                             \
    check_snap_at(&sy_, &sx_, "same state: " #x " and " #y, __FILE__, __LINE__); \
  } while (0)

/* Two sets built alike and fed alike; bad calls go to `a` only. */
typedef struct {
  vq_caches* a;
  vq_caches* b;
  uint32_t seed;
  shape_t (*shape)(int seq);
} twin_t;

static twin_t twin_new(const char* method, int budget, int n_layers, vq_storage storage) {
  twin_t t;
  vq_config* c = config_of(method, budget);
  t.a = caches_of(c, n_layers, storage);
  t.b = caches_of(c, n_layers, storage);
  t.seed = 1000u;
  t.shape = shape_std;
  vq_config_free(c);
  return t;
}

static void twin_free(twin_t* t) {
  vq_caches_free(t->a);
  vq_caches_free(t->b);
  t->a = t->b = NULL;
}

/* The same good vq_attend on both sets: both succeed, outputs bit-identical, same state. */
static void twin_step_at(twin_t* t, int layer, int seq, const char* file, int line) {
  call_t c = call_new(t->shape(seq), t->seed++);
  float* out_b = floats(out_count(c.sh));
  const vq_status sa = attend_hm(t->a, layer, &c, c.out);
  const vq_status sb = attend_hm(t->b, layer, &c, out_b);
  check_status_at(sa, VQ_OK, "twin step: vq_attend on the set that saw the bad calls", file, line);
  check_status_at(sb, VQ_OK, "twin step: vq_attend on the twin", file, line);
  check_at(memcmp(c.out, out_b, out_count(c.sh) * sizeof(float)) == 0,
           "twin step: outputs bit-identical to the twin's", file, line);
  {
    const snap_t sa_ = snap_of(t->a), sb_ = snap_of(t->b);
    check_snap_at(&sb_, &sa_, "twin step: same state as the twin", file, line);
  }
  free(out_b);
  call_free(&c);
}
#define TWIN_STEP(t, layer, seq) twin_step_at(&(t), (layer), (seq), __FILE__, __LINE__)
/* Same state now, and the next decode step on `layer` gives bit-identical outputs. */
#define CHECK_TWIN(t, layer)        \
  do {                              \
    CHECK_SAME_STATE((t).a, (t).b); \
    TWIN_STEP(t, layer, 1);         \
  } while (0)

/* ---- files --------------------------------------------------------------------------------------
 */

static char g_dir[1024];
static int g_dir_made = 0;

static void path_in_dir(char* buf, size_t size, const char* name) {
  snprintf(buf, size, "%s/%s", g_dir, name);
}

static unsigned char* read_all(const char* path, size_t* n) {
  FILE* f = fopen(path, "rb");
  unsigned char* data;
  long size;
  *n = 0;
  if (f == NULL) return NULL;
  if (fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fclose(f);
    return NULL;
  }
  data = (unsigned char*)xcalloc((size_t)size, 1);
  if (fread(data, 1, (size_t)size, f) != (size_t)size) {
    fclose(f);
    free(data);
    return NULL;
  }
  fclose(f);
  *n = (size_t)size;
  return data;
}

static int write_all(const char* path, const void* data, size_t n) {
  FILE* f = fopen(path, "wb");
  int ok;
  if (f == NULL) return 0;
  ok = fwrite(data, 1, n, f) == n;
  ok = fclose(f) == 0 && ok;
  return ok;
}

static int file_exists(const char* path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* ---- 1. version, status names, the message before any failure ----------------------------------
 */

static void test_abi_and_errors(void) {
  /* First of all: no vq_ call has failed on this thread yet. */
  const char* first = vq_last_error();
  CHECK(first != NULL);
  CHECK(first != NULL && first[0] == '\0');

  CHECK(vq_abi_version() == VQ_ABI_VERSION);
  CHECK(VQ_ABI_VERSION == VQ_ABI_VERSION_MAJOR * 1000 + VQ_ABI_VERSION_MINOR);
  CHECK(vq_abi_version() / 1000 == VQ_ABI_VERSION_MAJOR);
  CHECK(vq_library_version() != NULL);
  CHECK(vq_library_version() != NULL && strcmp(vq_library_version(), "0.1.0") == 0);

  CHECK(strcmp(vq_status_name(VQ_OK), "VQ_OK") == 0);
  CHECK(strcmp(vq_status_name(VQ_EINVAL), "VQ_EINVAL") == 0);
  CHECK(strcmp(vq_status_name(VQ_ENOMEM), "VQ_ENOMEM") == 0);
  CHECK(strcmp(vq_status_name(VQ_EIO), "VQ_EIO") == 0);
  CHECK(strcmp(vq_status_name(VQ_EFORMAT), "VQ_EFORMAT") == 0);
  CHECK(strcmp(vq_status_name(VQ_ESTATE), "VQ_ESTATE") == 0);
  CHECK(strcmp(vq_status_name(VQ_ECALLBACK), "VQ_ECALLBACK") == 0);
  CHECK(strcmp(vq_status_name(VQ_ENOROOM), "VQ_ENOROOM") == 0);
  CHECK(strcmp(vq_status_name((vq_status)99), "unknown") == 0);
  CHECK(strcmp(vq_status_name((vq_status)-1), "unknown") == 0);
  CHECK(strcmp(vq_status_name((vq_status)INT_MIN), "unknown") == 0);
  CHECK(VQ_OK == 0);

  /* Successful calls leave the message alone: still "" after all of the above. */
  CHECK(vq_last_error() != NULL && vq_last_error()[0] == '\0');
}

/* ---- 2. configuration: the field list, get/set round trips, "budget" ---------------------------
 */

/* Every field's value, "name=value;..." (the config's whole visible state). */
static void config_dump(const vq_config* c, char* buf, size_t size) {
  const int n = vq_config_field_count();
  int i;
  size_t used = 0;
  buf[0] = '\0';
  for (i = 0; i < n; ++i) {
    const char* name = vq_config_field_name(i);
    char value[256];
    if (name == NULL || strcmp(name, "budget") == 0) continue;
    if (vq_config_get(c, name, value, sizeof value, NULL) != VQ_OK) {
      snprintf(value, sizeof value, "<%s>", "get failed");
    }
    used += (size_t)snprintf(buf + used, used < size ? size - used : 0, "%s=%s;", name, value);
    if (used >= size) break;
  }
}

static int config_field_is(const vq_config* c, const char* field, const char* want) {
  char value[256];
  if (vq_config_get(c, field, value, sizeof value, NULL) != VQ_OK) return 0;
  return strcmp(value, want) == 0;
}

static void test_config_fields(void) {
  vq_config* c = vq_config_new();
  vq_config* copy;
  const int n = vq_config_field_count();
  int i, j;
  int seen_method = 0, seen_squeeze_budget = 0, seen_key_bits = 0, seen_budget = 0;
  char before[8192], after[8192];

  CHECK(c != NULL);
  CHECK(n > 0);
  CHECK(vq_config_field_name(n) == NULL);
  CHECK(vq_config_field_name(-1) == NULL);
  CHECK(vq_config_field_name(INT_MAX) == NULL);
  for (i = 0; i < n; ++i) {
    const char* name = vq_config_field_name(i);
    CHECK(name != NULL && name[0] != '\0');
    if (name == NULL) continue;
    for (j = 0; j < i; ++j) {
      const char* other = vq_config_field_name(j);
      CHECK(other == NULL || strcmp(other, name) != 0); /* listed once */
    }
    seen_method |= strcmp(name, "method") == 0;
    seen_squeeze_budget |= strcmp(name, "squeeze_budget") == 0;
    seen_key_bits |= strcmp(name, "key_bits") == 0;
    seen_budget |= strcmp(name, "budget") == 0;
  }
  CHECK(seen_method && seen_squeeze_budget && seen_key_bits);
  CHECK(!seen_budget); /* a setter over several fields, not a field: not listed (header) */

  /* The defaults (KVCacheConfig's). */
  CHECK(config_field_is(c, "method", "squeeze"));
  CHECK(config_field_is(c, "squeeze_budget", "512"));
  CHECK(config_field_is(c, "key_bits", "16"));
  CHECK(config_field_is(c, "squeeze_defer", "false"));
  CHECK(config_field_is(c, "squeeze_resolved_budget", "none"));
  CHECK(config_field_is(c, "squeeze_decay", "0.98"));
  CHECK(config_field_is(c, "proxy_scoring", "key_as_query"));

  /* Every field read back and set to its own value: accepted, and nothing changes. */
  config_dump(c, before, sizeof before);
  for (i = 0; i < n; ++i) {
    const char* name = vq_config_field_name(i);
    char value[256], again[256];
    size_t needed = 0, needed_again = 0;
    vq_status st;
    if (name == NULL) continue;
    /* The size first (buf NULL, size 0): VQ_EINVAL, but *needed says how much. */
    prime_error();
    st = vq_config_get(c, name, NULL, 0, &needed);
    CHECK(st == VQ_EINVAL);
    CHECK(needed >= 1 && needed <= sizeof value);
    CHECK_OK(vq_config_get(c, name, value, sizeof value, &needed_again));
    CHECK(needed_again == needed && strlen(value) + 1 == needed);
    if (needed > 1) {
      /* One byte short: refused, nothing written. */
      char small[256];
      memset(small, 'X', sizeof small);
      CHECK_FAIL(vq_config_get(c, name, small, needed - 1, NULL), VQ_EINVAL, name);
      CHECK(small[0] == 'X' && small[needed - 2] == 'X');
    }
    CHECK_OK(vq_config_set(c, name, value));
    CHECK_OK(vq_config_get(c, name, again, sizeof again, NULL));
    CHECK(strcmp(value, again) == 0);
  }
  config_dump(c, after, sizeof after);
  CHECK(strcmp(before, after) == 0);

  /* "budget" cannot be read back: VQ_EINVAL naming it, nothing written. */
  {
    char value[64];
    memset(value, 'X', sizeof value);
    CHECK_FAIL(vq_config_get(c, "budget", value, sizeof value, NULL), VQ_EINVAL, "budget");
    CHECK(value[0] == 'X');
  }

  /* "budget" sets every method's budget (set_budget; StreamingLLM: window = rows - sinks). */
  CHECK_OK(vq_config_set(c, "budget", "8"));
  CHECK(config_field_is(c, "squeeze_budget", "8"));
  CHECK(config_field_is(c, "h2o_budget", "8"));
  CHECK(config_field_is(c, "pyramid_budget", "8"));
  CHECK(config_field_is(c, "tova_budget", "8"));
  CHECK(config_field_is(c, "snap_budget", "8"));
  CHECK(config_field_is(c, "stream_window_size", "4"));
  CHECK(config_field_is(c, "squeeze_n_sink", "4")); /* sinks untouched */

  /* Values in the C locale and the accepted spellings. */
  CHECK_OK(vq_config_set(c, "squeeze_decay", "1e-3"));
  {
    char value[64];
    CHECK_OK(vq_config_get(c, "squeeze_decay", value, sizeof value, NULL));
    CHECK(strtod(value, NULL) == 1e-3);
  }
  CHECK_OK(vq_config_set(c, "squeeze_decay", "0.95"));
  CHECK(config_field_is(c, "squeeze_decay", "0.95"));
  CHECK_OK(vq_config_set(c, "squeeze_defer", "1"));
  CHECK(config_field_is(c, "squeeze_defer", "true"));
  CHECK_OK(vq_config_set(c, "squeeze_defer", "0"));
  CHECK(config_field_is(c, "squeeze_defer", "false"));
  CHECK_OK(vq_config_set(c, "squeeze_defer", "true"));
  CHECK(config_field_is(c, "squeeze_defer", "true"));
  CHECK_OK(vq_config_set(c, "squeeze_defer", "false"));
  CHECK(config_field_is(c, "squeeze_defer", "false"));
  CHECK_OK(vq_config_set(c, "squeeze_resolved_budget", "6"));
  CHECK(config_field_is(c, "squeeze_resolved_budget", "6"));
  CHECK_OK(vq_config_set(c, "squeeze_resolved_budget", "none"));
  CHECK(config_field_is(c, "squeeze_resolved_budget", "none"));
  CHECK_OK(vq_config_set(c, "pyramid_resolved_budget", "none"));
  CHECK(config_field_is(c, "pyramid_resolved_budget", "none"));
  CHECK_OK(vq_config_set(c, "method", "h2o"));
  CHECK(config_field_is(c, "method", "h2o"));
  CHECK_OK(vq_config_set(c, "squeeze_budget", "-5")); /* parses; its meaning is checked later */
  CHECK(config_field_is(c, "squeeze_budget", "-5"));
  CHECK_OK(vq_config_set(c, "squeeze_budget", "8"));

  /* vq_config_copy: the same values, independent afterwards. */
  copy = vq_config_copy(c);
  CHECK(copy != NULL);
  if (copy != NULL) {
    config_dump(c, before, sizeof before);
    config_dump(copy, after, sizeof after);
    CHECK(strcmp(before, after) == 0);
    CHECK_OK(vq_config_set(copy, "h2o_budget", "99"));
    CHECK(config_field_is(copy, "h2o_budget", "99"));
    CHECK(config_field_is(c, "h2o_budget", "8"));
    vq_config_free(copy);
  }
  vq_config_free(c);
}

/* ---- 3. configuration: bad values, nulls, validation
 * --------------------------------------------- */

typedef struct {
  const char* field;
  const char* value;
  const char* needle;
} bad_value_t;

static void test_config_bad_values(void) {
  static const bad_value_t bad[] = {
      {"no_such_field", "1", "no_such_field"},
      {"", "1", "field"},
      {"Method", "h2o", "Method"},
      {"squeeze_budget", "abc", "squeeze_budget"},
      {"squeeze_budget", "1.5", "squeeze_budget"},
      {"squeeze_budget", "99999999999", "squeeze_budget"},
      {"squeeze_budget", "-99999999999", "squeeze_budget"},
      {"squeeze_budget", "", "squeeze_budget"},
      {"squeeze_budget", " 8", "squeeze_budget"},
      {"squeeze_budget", "8 ", "squeeze_budget"},
      {"squeeze_budget", "0x10", "squeeze_budget"},
      {"squeeze_budget", "none", "squeeze_budget"},
      {"h2o_grace", "1e3", "h2o_grace"},
      {"squeeze_defer", "tru", "squeeze_defer"},
      {"squeeze_defer", "yes", "squeeze_defer"},
      {"squeeze_defer", "2", "squeeze_defer"},
      {"squeeze_defer", "", "squeeze_defer"},
      {"squeeze_decay", "abc", "squeeze_decay"},
      {"squeeze_decay", "0,95", "squeeze_decay"},
      {"squeeze_decay", "1e999", "squeeze_decay"},
      {"squeeze_decay", "", "squeeze_decay"},
      {"squeeze_decay", "0.95x", "squeeze_decay"},
      {"squeeze_resolved_budget", "abc", "squeeze_resolved_budget"},
      {"squeeze_resolved_budget", "1.5", "squeeze_resolved_budget"},
      {"squeeze_resolved_budget", "99999999999", "squeeze_resolved_budget"},
      {"squeeze_resolved_budget", "None", "squeeze_resolved_budget"},
      {"pyramid_resolved_budget", "", "pyramid_resolved_budget"},
      {"budget", "abc", "budget"},
      {"budget", "1.5", "budget"},
      {"budget", "99999999999", "budget"},
      {"budget", "none", "budget"},
      {"budget", "", "budget"},
  };
  vq_config* c = vq_config_new();
  char before[8192], after[8192];
  size_t i;
  CHECK(c != NULL);
  CHECK_OK(vq_config_set(c, "budget", "24"));
  config_dump(c, before, sizeof before);
  for (i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    char expr[256];
    prime_error();
    {
      const vq_status st = vq_config_set(c, bad[i].field, bad[i].value);
      char msg[1024];
      copy_last_error(msg, sizeof msg);
      snprintf(expr, sizeof expr, "vq_config_set(c, \"%s\", \"%s\") == VQ_EINVAL", bad[i].field,
               bad[i].value);
      if (check_at(st == VQ_EINVAL, expr, __FILE__, __LINE__)) {
        check_message_at(msg, bad[i].needle, expr, __FILE__, __LINE__);
      } else {
        fprintf(stderr, "    returned %s\n", vq_status_name(st));
      }
    }
    config_dump(c, after, sizeof after);
    snprintf(expr, sizeof expr, "config unchanged by vq_config_set(\"%s\", \"%s\")", bad[i].field,
             bad[i].value);
    check_at(strcmp(before, after) == 0, expr, __FILE__, __LINE__);
  }

  /* Null handle, field, value; unknown fields for get. */
  CHECK_FAIL(vq_config_set(NULL, "method", "h2o"), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_config_set(c, NULL, "h2o"), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_config_set(c, "method", NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_config_set(c, "budget", NULL), VQ_EINVAL, "NULL");
  {
    char buf[64];
    size_t needed = 12345;
    memset(buf, 'X', sizeof buf);
    CHECK_FAIL(vq_config_get(NULL, "method", buf, sizeof buf, NULL), VQ_EINVAL, "NULL");
    CHECK_FAIL(vq_config_get(c, NULL, buf, sizeof buf, NULL), VQ_EINVAL, "NULL");
    CHECK_FAIL(vq_config_get(c, "no_such_field", buf, sizeof buf, &needed), VQ_EINVAL,
               "no_such_field");
    CHECK(buf[0] == 'X');
    CHECK_FAIL(vq_config_get(c, "method", buf, 0, NULL), VQ_EINVAL, "method");
    CHECK(buf[0] == 'X');
    CHECK_FAIL(vq_config_get(c, "method", NULL, 64, NULL), VQ_EINVAL, "method");
  }
  config_dump(c, after, sizeof after);
  CHECK(strcmp(before, after) == 0);
  CHECK(vq_config_copy(NULL) == NULL);
  vq_config_free(NULL); /* fine */
  vq_config_free(c);
}

static void test_config_validate(void) {
  static const bad_value_t bad[] = {
      /* field, value that parses but is out of range, the field the message names */
      {"squeeze_budget", "0", "squeeze_budget"},
      {"squeeze_decay", "2", "squeeze_decay"},
      {"squeeze_strength", "1.5", "squeeze_strength"},
      {"key_bits", "5", "key_bits"},
      {"value_bits", "12", "value_bits"},
      {"quant_group", "4", "quant_group"},
      {"method", "bogus", "method"},
      {"proxy_scoring", "bogus", "proxy_scoring"},
      {"key_axis", "channels", "key_axis"},
      {"value_axis", "", "value_axis"},
      {"quant_block", "4", "quant_block"},
  };
  size_t i;
  vq_config* good = vq_config_new();
  CHECK_OK(vq_config_validate(good));
  CHECK_FAIL(vq_config_validate(NULL), VQ_EINVAL, "NULL");
  for (i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    vq_config* c = vq_config_copy(good);
    vq_caches* s = SENTINEL_CACHES;
    char expr[256];
    CHECK(c != NULL);
    if (c == NULL) continue;
    CHECK_OK(vq_config_set(c, bad[i].field, bad[i].value)); /* it parses */
    snprintf(expr, sizeof expr, "vq_config_validate with %s = %s", bad[i].field, bad[i].value);
    prime_error();
    {
      const vq_status st = vq_config_validate(c);
      char msg[1024];
      copy_last_error(msg, sizeof msg);
      if (check_at(st == VQ_EINVAL, expr, __FILE__, __LINE__)) {
        check_message_at(msg, bad[i].needle, expr, __FILE__, __LINE__);
      }
    }
    snprintf(expr, sizeof expr, "vq_caches_new with %s = %s", bad[i].field, bad[i].value);
    prime_error();
    {
      const vq_status st = vq_caches_new(c, 2, VQ_HALF, &s);
      char msg[1024];
      copy_last_error(msg, sizeof msg);
      if (check_at(st == VQ_EINVAL, expr, __FILE__, __LINE__)) {
        check_message_at(msg, bad[i].needle, expr, __FILE__, __LINE__);
      }
      check_at(s == NULL, "vq_caches_new sets *out to NULL on failure", __FILE__, __LINE__);
    }
    if (s != NULL && s != SENTINEL_CACHES) vq_caches_free(s);
    vq_config_free(c);
  }
  /* The method's own fields only: a bad StreamingLLM window does not stop a squeeze config. */
  {
    vq_config* c = vq_config_copy(good);
    CHECK_OK(vq_config_set(c, "stream_window_size", "0"));
    CHECK_OK(vq_config_validate(c));
    CHECK_OK(vq_config_set(c, "method", "streaming_llm"));
    CHECK_FAIL(vq_config_validate(c), VQ_EINVAL, "stream_window_size");
    vq_config_free(c);
  }
  vq_config_free(good);
}

/* ---- 4. building sets --------------------------------------------------------------------------
 */

static void test_caches_new(void) {
  vq_config* c = config_of("h2o", 8);
  vq_caches* s = SENTINEL_CACHES;
  vq_storage st = VQ_BFLOAT16;
  static const vq_storage storages[3] = {VQ_HALF, VQ_BFLOAT16, VQ_FLOAT};
  int i;

  CHECK_FAIL(vq_caches_new(NULL, 2, VQ_HALF, &s), VQ_EINVAL, "NULL");
  CHECK(s == NULL);
  CHECK_FAIL(vq_caches_new(c, 2, VQ_HALF, NULL), VQ_EINVAL, "NULL");
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, 0, VQ_HALF, &s), VQ_EINVAL, "n_layers");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, -3, VQ_HALF, &s), VQ_EINVAL, "n_layers");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, INT_MIN, VQ_HALF, &s), VQ_EINVAL, "n_layers");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  /* Any int may come where a vq_storage is declared: the library reads it as an int (C++ gives the
   * enum a fixed underlying type, so no value is undefined behaviour) and names it. */
  CHECK_FAIL(vq_caches_new(c, 2, (vq_storage)7, &s), VQ_EINVAL, "storage 7");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, 2, (vq_storage)-1, &s), VQ_EINVAL, "storage -1");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, 2, (vq_storage)INT_MAX, &s), VQ_EINVAL, "storage 2147483647");
  CHECK(s == NULL);
  s = SENTINEL_CACHES;
  CHECK_FAIL(vq_caches_new(c, 2, (vq_storage)INT_MIN, &s), VQ_EINVAL, "storage -2147483648");
  CHECK(s == NULL);

  for (i = 0; i < 3; ++i) {
    s = NULL;
    CHECK_OK(vq_caches_new(c, 3, storages[i], &s));
    CHECK(s != NULL);
    if (s == NULL) continue;
    CHECK(vq_layers(s) == 3);
    CHECK_OK(vq_storage_of(s, &st));
    CHECK(st == storages[i]);
    CHECK(vq_offset(s, 0) == 0 && vq_offset(s, 2) == 0);
    CHECK(vq_rows(s, 0) == 0 && vq_rows(s, 2) == 0);
    CHECK(vq_layer_budget(s, 0) == 8 && vq_layer_budget(s, 2) == 8);
    CHECK(vq_kept_bytes(s) == 0);
    CHECK(vq_metadata_count(s) == 0);
    vq_caches_free(s);
  }

  /* The set owns its config: freeing the config first changes nothing. */
  {
    vq_config* c2 = config_of("h2o", 6);
    vq_caches* s2 = caches_of(c2, 1, VQ_HALF);
    call_t call = call_new(shape_std(3), 7u);
    vq_config_free(c2);
    CHECK_OK(attend_hm(s2, 0, &call, call.out));
    CHECK(vq_offset(s2, 0) == 3);
    call_free(&call);
    vq_caches_free(s2);
  }

  CHECK_FAIL_VALUE(vq_layers(NULL) == -1, "NULL");
  CHECK_FAIL(vq_storage_of(NULL, &st), VQ_EINVAL, "NULL");
  s = new_set("h2o", 8, 1, VQ_HALF);
  CHECK_FAIL(vq_storage_of(s, NULL), VQ_EINVAL, "NULL");
  vq_caches_free(s);
  vq_caches_free(NULL); /* fine */
  vq_config_free(c);
}

/* ---- 5. null handles and null pointers, for every function that takes one -----------------------
 */

static void noop_pool(void* pool_ctx, int tasks, vq_task_fn task, void* task_ctx) {
  int i;
  (void)pool_ctx;
  for (i = 0; i < tasks; ++i) task(task_ctx, i);
}

static void test_null_arguments(void) {
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  call_t c = call_new(shape_std(2), 42u);
  const shape_t sh = c.sh;
  vq_tensor q = tensor_of(c.q, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor v = tensor_of(c.v, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor nodata;
  int64_t rows = -7;
  float keys[256], values[256];
  const char* value = "sentinel";
  const char* key = "sentinel";
  vq_caches* out = SENTINEL_CACHES;
  vq_storage st;
  char path[1200];
  path_in_dir(path, sizeof path, "null_args.vqkv");

  TWIN_STEP(t, 0, 5);
  TWIN_STEP(t, 1, 5);
  CHECK_OK(vq_metadata_set(t.a, "k", "v"));
  CHECK_OK(vq_metadata_set(t.b, "k", "v"));

  /* vq_attend: the handle, then each buffer. */
  CHECK_FAIL(vq_attend(NULL, 0, c.q, c.k, c.v, c.out, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
             "NULL");
  CHECK_FAIL(vq_attend(t.a, 0, NULL, c.k, c.v, c.out, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
             "NULL");
  CHECK_FAIL(vq_attend(t.a, 0, c.q, NULL, c.v, c.out, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
             "NULL");
  CHECK_FAIL(vq_attend(t.a, 0, c.q, c.k, NULL, c.out, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
             "NULL");
  CHECK_FAIL(vq_attend(t.a, 0, c.q, c.k, c.v, NULL, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
             "NULL");
  CHECK_TWIN(t, 0);

  /* vq_attend_ex: the handle, each descriptor, each descriptor's data, out. */
  CHECK_FAIL(vq_attend_ex(NULL, 0, &q, &k, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_attend_ex(t.a, 0, NULL, &k, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_attend_ex(t.a, 0, &q, NULL, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &k, NULL, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &k, &v, NULL, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  nodata = q;
  nodata.data = NULL;
  CHECK_FAIL(vq_attend_ex(t.a, 0, &nodata, &k, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  nodata = k;
  nodata.data = NULL;
  CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &nodata, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  nodata = v;
  nodata.data = NULL;
  CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &k, &nodata, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_TWIN(t, 0);

  /* vq_update: the handle, k, v, rows, and data (q NULL is allowed, a q with NULL data is not). */
  CHECK_FAIL(vq_update(NULL, 0, &k, &v, NULL, &rows), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_update(t.a, 0, NULL, &v, NULL, &rows), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_update(t.a, 0, &k, NULL, NULL, &rows), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_update(t.a, 0, &k, &v, NULL, NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_update(t.a, 0, &k, &v, &q, NULL), VQ_EINVAL, "NULL");
  nodata = k;
  nodata.data = NULL;
  CHECK_FAIL(vq_update(t.a, 0, &nodata, &v, NULL, &rows), VQ_EINVAL, "NULL");
  nodata = v;
  nodata.data = NULL;
  CHECK_FAIL(vq_update(t.a, 0, &k, &nodata, NULL, &rows), VQ_EINVAL, "NULL");
  nodata = q;
  nodata.data = NULL;
  CHECK_FAIL(vq_update(t.a, 0, &k, &v, &nodata, &rows), VQ_EINVAL, "NULL");
  CHECK(rows == -7); /* not written by a failing call */
  CHECK_TWIN(t, 1);

  /* vq_fetch, the counters, reset, free. */
  CHECK_FAIL(vq_fetch(NULL, 0, keys, values, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  CHECK_FAIL_VALUE(vq_offset(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_rows(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_layer_budget(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_head_rows(NULL, 0, 0, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_kept_bytes(NULL) == 0, "NULL");
  CHECK_FAIL_VALUE(vq_layer_kept_bytes(NULL, 0) == 0, "NULL");
  CHECK_FAIL_VALUE(vq_layer_full_seq_bytes(NULL, 0) == 0, "NULL");
  CHECK_FAIL_VALUE(vq_layer_compression_ratio(NULL, 0) == -1.0, "NULL");
  CHECK_FAIL_VALUE(vq_layer_tokens_seen(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_layer_tokens_kept(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_layer_is_trimmable(NULL, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(isnan(vq_layer_concentration(NULL, 0)), "NULL");
  CHECK_FAIL_VALUE(vq_layers(NULL) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_metadata_count(NULL) == -1, "NULL");
  CHECK_FAIL(vq_storage_of(NULL, &st), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_storage_of(t.a, NULL), VQ_EINVAL, "NULL");
  vq_reset(NULL);
  vq_caches_free(NULL);
  vq_config_free(NULL);

  /* fork, checkpoint, rollback, parallel-for. */
  CHECK_FAIL(vq_fork(NULL, &out), VQ_EINVAL, "NULL");
  CHECK(out == NULL);
  CHECK_FAIL(vq_fork(t.a, NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_checkpoint(NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_rollback(NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_set_parallel_for(NULL, noop_pool, NULL, 2), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_set_parallel_for(NULL, NULL, NULL, 1), VQ_EINVAL, "NULL");

  /* metadata. */
  CHECK_FAIL(vq_metadata_set(NULL, "k", "v2"), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_set(t.a, NULL, "v2"), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_set(t.a, NULL, NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_get(NULL, "k", &value), VQ_EINVAL, "NULL");
  CHECK(value == NULL);
  CHECK_FAIL(vq_metadata_get(t.a, NULL, &value), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_get(t.a, "k", NULL), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_at(NULL, 0, &key, &value), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_at(t.a, 0, NULL, &value), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_metadata_at(t.a, 0, &key, NULL), VQ_EINVAL, "NULL");
  CHECK_OK(vq_metadata_get(t.a, "k", &value));
  CHECK(value != NULL && strcmp(value, "v") == 0);

  /* save and load. */
  CHECK_FAIL(vq_save(NULL, path), VQ_EINVAL, "NULL");
  CHECK_FAIL(vq_save(t.a, NULL), VQ_EINVAL, "NULL");
  CHECK(!file_exists(path));
  out = SENTINEL_CACHES;
  CHECK_FAIL(vq_load(NULL, &out), VQ_EINVAL, "NULL");
  CHECK(out == NULL);
  CHECK_OK(vq_save(t.b, path));
  CHECK_FAIL(vq_load(path, NULL), VQ_EINVAL, "NULL");
  CHECK(remove(path) == 0);

  CHECK_TWIN(t, 0);
  CHECK_TWIN(t, 1);
  call_free(&c);
  twin_free(&t);
}

/* ---- 6. layers out of range -------------------------------------------------------------------
 */

static void test_layer_range(void) {
  static const int bad_layers[4] = {-1, 2, INT_MIN, INT_MAX};
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  call_t c = call_new(shape_std(2), 43u);
  const shape_t sh = c.sh;
  vq_tensor q = tensor_of(c.q, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor v = tensor_of(c.v, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  int64_t rows = -7;
  float keys[256], values[256];
  int i;

  TWIN_STEP(t, 0, 5);
  TWIN_STEP(t, 1, 5);
  CHECK_OK(vq_update(t.a, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_update(t.b, 0, &k, &v, NULL, &rows));
  for (i = 0; i < 4; ++i) {
    const int layer = bad_layers[i];
    CHECK_FAIL(vq_attend(t.a, layer, c.q, c.k, c.v, c.out, 1, 4, 2, 2, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
               "layer");
    CHECK_FAIL(vq_attend(t.a, layer, c.q, c.k, c.v, c.out, 1, 4, 2, 0, 8, VQ_HEAD_MAJOR), VQ_EINVAL,
               "layer"); /* seq 0 is no excuse */
    CHECK_FAIL(vq_attend_ex(t.a, layer, &q, &k, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "layer");
    CHECK_FAIL(vq_update(t.a, layer, &k, &v, &q, &rows), VQ_EINVAL, "layer");
    CHECK_FAIL(vq_fetch(t.a, layer, keys, values, VQ_HEAD_MAJOR), VQ_EINVAL, "layer");
    CHECK_FAIL_VALUE(vq_offset(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(vq_rows(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(vq_layer_budget(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(vq_head_rows(t.a, layer, 0, 0) == -1, "layer");
    CHECK_FAIL_VALUE(vq_layer_kept_bytes(t.a, layer) == 0, "layer");
    CHECK_FAIL_VALUE(vq_layer_full_seq_bytes(t.a, layer) == 0, "layer");
    CHECK_FAIL_VALUE(vq_layer_compression_ratio(t.a, layer) == -1.0, "layer");
    CHECK_FAIL_VALUE(vq_layer_tokens_seen(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(vq_layer_tokens_kept(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(vq_layer_is_trimmable(t.a, layer) == -1, "layer");
    CHECK_FAIL_VALUE(isnan(vq_layer_concentration(t.a, layer)), "layer");
  }
  CHECK_TWIN(t, 0);
  CHECK_TWIN(t, 1);
  call_free(&c);
  twin_free(&t);
}

/* ---- 7. vq_attend: bad shapes, layouts, values
 * ---------------------------------------------------- */

typedef struct {
  const char* what;
  int batch, q_heads, kv_heads, seq, dim;
  int layout;
  int poison; /* 0: none; 1: a NaN key; 2: an infinite query; 3: a huge key */
  const char* needle;
} bad_attend_t;

static const bad_attend_t kBadAttend[] = {
    {"negative batch", -1, 4, 2, 2, 8, VQ_HEAD_MAJOR, 0, "negative"},
    {"negative q_heads", 1, -4, 2, 2, 8, VQ_HEAD_MAJOR, 0, "negative"},
    {"negative kv_heads", 1, 4, -2, 2, 8, VQ_HEAD_MAJOR, 0, "negative"},
    {"negative seq", 1, 4, 2, -1, 8, VQ_HEAD_MAJOR, 0, "negative"},
    {"negative head_dim", 1, 4, 2, 2, -8, VQ_HEAD_MAJOR, 0, "negative"},
    {"batch 0", 0, 4, 2, 2, 8, VQ_HEAD_MAJOR, 0, ">= 1"},
    {"kv_heads 0", 1, 4, 0, 2, 8, VQ_HEAD_MAJOR, 0, ">= 1"},
    {"head_dim 0", 1, 4, 2, 2, 0, VQ_HEAD_MAJOR, 0, "head dim"},
    {"q_heads 3 over 2 KV heads", 1, 3, 2, 2, 8, VQ_HEAD_MAJOR, 0, "multiple"},
    {"q_heads 5 over 2 KV heads", 1, 5, 2, 2, 8, VQ_HEAD_MAJOR, 0, "multiple"},
    {"q_heads 0", 1, 0, 2, 2, 8, VQ_HEAD_MAJOR, 0, "multiple"},
    {"layout 9", 1, 4, 2, 2, 8, 9, 0, "layout 9"},
    {"layout -1", 1, 4, 2, 2, 8, -1, 0, "layout -1"},
    {"layout INT_MIN", 1, 4, 2, 2, 8, INT_MIN, 0, "layout -2147483648"},
    {"a NaN key", 1, 4, 2, 2, 8, VQ_HEAD_MAJOR, 1, "non-finite"},
    {"an infinite query", 1, 4, 2, 2, 8, VQ_HEAD_MAJOR, 2, "query"},
    {"a key beyond the storage type", 1, 4, 2, 2, 8, VQ_HEAD_MAJOR, 3, "key"},
};

/* Differ from the layer's first call (1 x 2 KV heads x D 8). */
static const bad_attend_t kBadAttendLater[] = {
    {"batch 2 after batch 1", 2, 4, 2, 2, 8, VQ_HEAD_MAJOR, 0, "differ"},
    {"4 KV heads after 2", 1, 4, 4, 2, 8, VQ_HEAD_MAJOR, 0, "differ"},
    {"1 KV head after 2", 1, 4, 1, 2, 8, VQ_HEAD_MAJOR, 0, "differ"},
    {"head_dim 16 after 8", 1, 4, 2, 2, 16, VQ_HEAD_MAJOR, 0, "differ"},
    {"head_dim 4 after 8", 1, 4, 2, 2, 4, VQ_HEAD_MAJOR, 0, "differ"},
};

static void inject_bad_attend(vq_caches* s, int layer, const bad_attend_t* b, const char* file,
                              int line) {
  char expr[256];
  float* q = g_junk;
  float* v = g_junk + JUNK_FLOATS / 4; /* each region holds any of these calls */
  float* k = g_junk + JUNK_FLOATS / 2;
  size_t i;
  for (i = 0; i < JUNK_FLOATS; ++i) g_junk[i] = 0.25f;
  if (b->poison == 1) k[3] = NAN;
  if (b->poison == 2) q[5] = INFINITY;
  if (b->poison == 3) k[1] = 1e30f;
  snprintf(expr, sizeof expr, "vq_attend with %s", b->what);
  prime_error();
  {
    const vq_status st = vq_attend(s, layer, q, k, v, g_junk_out, b->batch, b->q_heads, b->kv_heads,
                                   b->seq, b->dim, (vq_layout)b->layout);
    check_fail_at(st, VQ_EINVAL, b->needle, expr, file, line);
  }
}

static void test_attend_bad_shapes(void) {
  size_t i;
  /* Before any call (the layer's dims still free), then after its first call. */
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  for (i = 0; i < sizeof kBadAttend / sizeof kBadAttend[0]; ++i) {
    inject_bad_attend(t.a, 0, &kBadAttend[i], __FILE__, __LINE__);
    CHECK_SAME_STATE(t.a, t.b);
  }
  {
    /* A head dim beyond the library's limit (65,536), over buffers as large as the shape says. */
    float* big = floats(4u * 70000u);
    float* big_out = floats(4u * 70000u);
    CHECK_FAIL(vq_attend(t.a, 0, big, big, big, big_out, 1, 2, 1, 1, 70000, VQ_HEAD_MAJOR),
               VQ_EINVAL, "head dim");
    CHECK_SAME_STATE(t.a, t.b);
    free(big);
    free(big_out);
  }
  CHECK(vq_offset(t.a, 0) == 0 && vq_rows(t.a, 0) == 0 && vq_kept_bytes(t.a) == 0);
  TWIN_STEP(t, 0, 5);
  TWIN_STEP(t, 1, 5);
  for (i = 0; i < 4; ++i) TWIN_STEP(t, (int)(i % 2u), 1); /* both layers at their budget */
  for (i = 0; i < sizeof kBadAttend / sizeof kBadAttend[0]; ++i) {
    const int layer = (int)(i % 2u);
    inject_bad_attend(t.a, layer, &kBadAttend[i], __FILE__, __LINE__);
    CHECK_TWIN(t, layer);
  }
  for (i = 0; i < sizeof kBadAttendLater / sizeof kBadAttendLater[0]; ++i) {
    const int layer = (int)(i % 2u);
    inject_bad_attend(t.a, layer, &kBadAttendLater[i], __FILE__, __LINE__);
    CHECK_TWIN(t, layer);
  }
  twin_free(&t);

  /* The same in SqueezeAttention (layers share a coordinator: a refused call reports nothing). */
  t = twin_new("squeeze", 6, 2, VQ_FLOAT);
  TWIN_STEP(t, 0, 3);
  for (i = 0; i < sizeof kBadAttendLater / sizeof kBadAttendLater[0]; ++i) {
    inject_bad_attend(t.a, 0, &kBadAttendLater[i], __FILE__, __LINE__);
    inject_bad_attend(t.a, 1, &kBadAttend[i], __FILE__, __LINE__);
    CHECK_TWIN(t, 0);
  }
  TWIN_STEP(t, 1, 3);
  TWIN_STEP(t, 0, 2);
  TWIN_STEP(t, 1, 2);
  CHECK_TWIN(t, 1);
  twin_free(&t);
}

/* ---- 8. vq_attend_ex: bad descriptors
 * ------------------------------------------------------------ */

typedef struct {
  const char* what;
  int which; /* 0 q, 1 k, 2 v */
  int field; /* 0 dtype, 1 layout, 2 batch, 3 heads, 4 seq, 5 dim */
  int value;
  const char* needle;
} bad_tensor_t;

static const bad_tensor_t kBadTensors[] = {
    {"q dtype 12", 0, 0, 12, "dtype 12"},
    {"k dtype 12", 1, 0, 12, "dtype 12"},
    {"v dtype -1", 2, 0, -1, "dtype -1"},
    {"k dtype INT_MAX", 1, 0, INT_MAX, "dtype 2147483647"},
    {"q layout 9", 0, 1, 9, "layout 9"},
    {"k layout 9", 1, 1, 9, "layout 9"},
    {"v layout -1", 2, 1, -1, "layout -1"},
    {"q layout INT_MAX", 0, 1, INT_MAX, "layout 2147483647"},
    {"k batch -1", 1, 2, -1, "negative"},
    {"q heads -4", 0, 3, -4, "negative"},
    {"v seq -1", 2, 4, -1, "negative"},
    {"k dim -8", 1, 5, -8, "negative"},
    {"v seq 3, k seq 2", 2, 4, 3, "share"},
    {"v heads 1, k heads 2", 2, 3, 1, "share"},
    {"k batch 2 after batch 1", 1, 2, 2, "share"},
    {"q batch 2", 0, 2, 2, "batch"},
    {"q heads 3 over 2 KV heads", 0, 3, 3, "multiple"},
    {"q seq 3, k seq 2", 0, 4, 3, "sequence"},
    {"q dim 4, k dim 8", 0, 5, 4, "head dim"},
    {"k and v dim 16 after 8", 1, 5, 16, "differ"},
    {"v dim 4 after 8", 2, 5, 4, "differ"},
};

static void set_tensor_field(vq_tensor* t, int field, int value) {
  switch (field) {
    case 0:
      t->dtype = (vq_dtype)value;
      break;
    case 1:
      t->layout = (vq_layout)value;
      break;
    case 2:
      t->batch = value;
      break;
    case 3:
      t->heads = value;
      break;
    case 4:
      t->seq = value;
      break;
    default:
      t->dim = value;
      break;
  }
}

static void test_attend_ex_bad_inputs(void) {
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  size_t i;
  double k64[64];
  for (i = 0; i < JUNK_FLOATS; ++i) g_junk[i] = 0.25f;
  for (i = 0; i < 64; ++i) k64[i] = 0.5;
  TWIN_STEP(t, 0, 5);
  TWIN_STEP(t, 1, 5);
  for (i = 0; i < sizeof kBadTensors / sizeof kBadTensors[0]; ++i) {
    const bad_tensor_t* b = &kBadTensors[i];
    vq_tensor ts[3];
    char expr[256];
    const int layer = (int)(i % 2u);
    ts[0] = tensor_of(g_junk, VQ_F32, 1, 4, 2, 8, VQ_HEAD_MAJOR);
    ts[1] = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    ts[2] = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    set_tensor_field(&ts[b->which], b->field, b->value);
    if (strcmp(b->what, "k and v dim 16 after 8") == 0) ts[2].dim = 16;
    snprintf(expr, sizeof expr, "vq_attend_ex with %s", b->what);
    prime_error();
    check_fail_at(vq_attend_ex(t.a, layer, &ts[0], &ts[1], &ts[2], g_junk_out, VQ_HEAD_MAJOR),
                  VQ_EINVAL, b->needle, expr, __FILE__, __LINE__);
    CHECK_TWIN(t, layer);
  }
  {
    vq_tensor q = tensor_of(g_junk, VQ_F32, 1, 4, 2, 8, VQ_HEAD_MAJOR);
    vq_tensor k = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    vq_tensor v = tensor_of(k64, VQ_F64, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    uint16_t half_keys[32];
    vq_tensor hk = tensor_of(half_keys, VQ_F16, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    vq_tensor hv = tensor_of(half_keys, VQ_F16, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    /* keys and values of different dtypes */
    CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &k, &v, g_junk_out, VQ_HEAD_MAJOR), VQ_EINVAL, "dtype");
    CHECK_TWIN(t, 0);
    /* out_layout out of range */
    CHECK_FAIL(vq_attend_ex(t.a, 1, &q, &k, &k, g_junk_out, (vq_layout)9), VQ_EINVAL, "layout 9");
    CHECK_TWIN(t, 1);
    /* a NaN key in half precision (0x7E00) */
    for (i = 0; i < 32; ++i) half_keys[i] = f32_to_f16(0.5f);
    half_keys[7] = 0x7E00u;
    CHECK_FAIL(vq_attend_ex(t.a, 0, &q, &hk, &hv, g_junk_out, VQ_HEAD_MAJOR), VQ_EINVAL,
               "non-finite");
    CHECK_TWIN(t, 0);
    /* an infinite query in double */
    {
      double q64[64];
      vq_tensor qd = tensor_of(q64, VQ_F64, 1, 4, 2, 8, VQ_HEAD_MAJOR);
      for (i = 0; i < 64; ++i) q64[i] = 0.25;
      q64[10] = (double)INFINITY;
      CHECK_FAIL(vq_attend_ex(t.a, 1, &qd, &k, &k, g_junk_out, VQ_HEAD_MAJOR), VQ_EINVAL, "query");
      CHECK_TWIN(t, 1);
    }
  }
  twin_free(&t);
}

/* ---- 9. vq_update: bad inputs
 * -------------------------------------------------------------------- */

/* vq_update of the same good call on both sets of a twin: same rows, bit-identical windows. */
static void twin_update_at(twin_t* t, int layer, int seq, const char* file, int line) {
  call_t c = call_new(t->shape(seq), t->seed++);
  const shape_t sh = c.sh;
  vq_tensor q = tensor_of(c.q, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor v = tensor_of(c.v, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.vdim, VQ_HEAD_MAJOR);
  int64_t ra = -1, rb = -2;
  check_status_at(vq_update(t->a, layer, &k, &v, &q, &ra), VQ_OK, "twin update (a)", file, line);
  check_status_at(vq_update(t->b, layer, &k, &v, &q, &rb), VQ_OK, "twin update (b)", file, line);
  check_at(ra == rb && ra > 0, "twin update: same rows", file, line);
  if (ra == rb && ra > 0) {
    const size_t nk = nelem(sh.batch, sh.kv_heads, (int)ra, sh.dim);
    const size_t nv = nelem(sh.batch, sh.kv_heads, (int)ra, sh.vdim);
    float* ka = floats(nk);
    float* kb = floats(nk);
    float* va = floats(nv);
    float* vb = floats(nv);
    check_status_at(vq_fetch(t->a, layer, ka, va, VQ_HEAD_MAJOR), VQ_OK, "twin fetch (a)", file,
                    line);
    check_status_at(vq_fetch(t->b, layer, kb, vb, VQ_HEAD_MAJOR), VQ_OK, "twin fetch (b)", file,
                    line);
    check_at(memcmp(ka, kb, nk * sizeof(float)) == 0 && memcmp(va, vb, nv * sizeof(float)) == 0,
             "twin update: windows bit-identical", file, line);
    free(ka);
    free(kb);
    free(va);
    free(vb);
  }
  {
    const snap_t sa_ = snap_of(t->a), sb_ = snap_of(t->b);
    check_snap_at(&sb_, &sa_, "twin update: same state as the twin", file, line);
  }
  call_free(&c);
}
#define TWIN_UPDATE(t, layer, seq) twin_update_at(&(t), (layer), (seq), __FILE__, __LINE__)

static void test_update_bad_inputs(void) {
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  size_t i;
  int64_t rows = -7;
  for (i = 0; i < JUNK_FLOATS; ++i) g_junk[i] = 0.25f;
  TWIN_UPDATE(t, 0, 5);
  TWIN_UPDATE(t, 1, 5);
  TWIN_UPDATE(t, 0, 1);
  for (i = 0; i < sizeof kBadTensors / sizeof kBadTensors[0]; ++i) {
    const bad_tensor_t* b = &kBadTensors[i];
    vq_tensor ts[3];
    char expr[256];
    const int layer = (int)(i % 2u);
    ts[0] = tensor_of(g_junk, VQ_F32, 1, 4, 2, 8, VQ_HEAD_MAJOR);
    ts[1] = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    ts[2] = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    set_tensor_field(&ts[b->which], b->field, b->value);
    if (strcmp(b->what, "k and v dim 16 after 8") == 0) ts[2].dim = 16;
    snprintf(expr, sizeof expr, "vq_update with %s", b->what);
    prime_error();
    check_fail_at(vq_update(t.a, layer, &ts[1], &ts[2], &ts[0], &rows), VQ_EINVAL, b->needle, expr,
                  __FILE__, __LINE__);
    CHECK(rows == -7);
    CHECK_TWIN(t, layer);
    TWIN_UPDATE(t, layer, 1);
  }
  {
    double v64[32];
    vq_tensor k = tensor_of(g_junk, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    vq_tensor v = tensor_of(v64, VQ_F64, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    vq_tensor knan;
    float nan_keys[32];
    for (i = 0; i < 32; ++i) v64[i] = 0.5;
    for (i = 0; i < 32; ++i) nan_keys[i] = 0.5f;
    nan_keys[30] = NAN;
    knan = tensor_of(nan_keys, VQ_F32, 1, 2, 2, 8, VQ_HEAD_MAJOR);
    CHECK_FAIL(vq_update(t.a, 0, &k, &v, NULL, &rows), VQ_EINVAL, "dtype");
    CHECK_TWIN(t, 0);
    CHECK_FAIL(vq_update(t.a, 1, &knan, &k, NULL, &rows), VQ_EINVAL, "non-finite");
    CHECK_TWIN(t, 1);
    CHECK(rows == -7);
  }
  twin_free(&t);
}

/* ---- 10. seq = 0
 * ---------------------------------------------------------------------------------- */

static void test_seq_zero(void) {
  twin_t t = twin_new("h2o", 6, 2, VQ_HALF);
  float q[64], k[64], v[64], out[64];
  int i;
  int64_t rows = -1;
  vq_tensor tq = tensor_of(q, VQ_F32, 1, 4, 0, 8, VQ_HEAD_MAJOR);
  vq_tensor tk = tensor_of(k, VQ_F32, 1, 2, 0, 8, VQ_HEAD_MAJOR);
  vq_tensor tv = tensor_of(v, VQ_F32, 1, 2, 0, 8, VQ_HEAD_MAJOR);
  for (i = 0; i < 64; ++i) q[i] = k[i] = v[i] = 0.5f;
  for (i = 0; i < 64; ++i) out[i] = 123.0f;

  /* A seq-0 vq_update with the largest batch and head counts holds no row: the fetch of its
   * window copies nothing (and returns at once, whatever B and H say). */
  {
    vq_caches* s = new_set("h2o", 6, 1, VQ_FLOAT);
    vq_tensor hk = tensor_of(k, VQ_F32, INT_MAX, INT_MAX, 0, 1, VQ_HEAD_MAJOR);
    vq_tensor hv = tensor_of(v, VQ_F32, INT_MAX, INT_MAX, 0, 1, VQ_HEAD_MAJOR);
    int64_t n = -1;
    CHECK_OK(vq_update(s, 0, &hk, &hv, NULL, &n));
    CHECK(n == 0);
    CHECK_OK(vq_fetch(s, 0, out, out, VQ_HEAD_MAJOR));
    CHECK(out[0] == 123.0f); /* nothing written */
    vq_caches_free(s);
  }

  /* On a fresh set: nothing happens, the first real call still sets the dims. */
  CHECK_OK(vq_attend(t.a, 0, q, k, v, out, 1, 4, 2, 0, 8, VQ_HEAD_MAJOR));
  CHECK_OK(vq_attend(t.a, 0, q, k, v, out, 1, 4, 2, 0, 8, VQ_TOKEN_MAJOR));
  CHECK_OK(vq_attend_ex(t.a, 1, &tq, &tk, &tv, out, VQ_HEAD_MAJOR));
  CHECK(out[0] == 123.0f);
  CHECK_SAME_STATE(t.a, t.b);
  CHECK(vq_offset(t.a, 0) == 0 && vq_rows(t.a, 0) == 0 && vq_kept_bytes(t.a) == 0);
  TWIN_STEP(t, 0, 5);
  TWIN_STEP(t, 1, 5);
  TWIN_STEP(t, 0, 1);
  TWIN_STEP(t, 0, 1);

  /* After calls: VQ_OK, nothing changes, out untouched, the next call bit-identical. */
  CHECK_OK(vq_attend(t.a, 0, q, k, v, out, 1, 4, 2, 0, 8, VQ_HEAD_MAJOR));
  CHECK_OK(vq_attend(t.a, 1, q, k, v, out, 1, 4, 2, 0, 8, VQ_TOKEN_MAJOR));
  CHECK_OK(vq_attend_ex(t.a, 0, &tq, &tk, &tv, out, VQ_TOKEN_MAJOR));
  CHECK(out[0] == 123.0f);
  CHECK_TWIN(t, 0);
  CHECK_TWIN(t, 1);

  /* seq 0 does not excuse a bad argument. */
  CHECK_FAIL(vq_attend(t.a, 0, q, k, v, out, -1, 4, 2, 0, 8, VQ_HEAD_MAJOR), VQ_EINVAL, "negative");
  CHECK_FAIL(vq_attend(t.a, 0, q, k, v, out, 1, 4, 2, 0, -8, VQ_HEAD_MAJOR), VQ_EINVAL, "negative");
  CHECK_FAIL(vq_attend(t.a, 0, q, k, v, out, 1, 4, 2, 0, 8, (vq_layout)9), VQ_EINVAL, "layout 9");
  CHECK_FAIL(vq_attend(t.a, 0, NULL, k, v, out, 1, 4, 2, 0, 8, VQ_HEAD_MAJOR), VQ_EINVAL, "NULL");
  {
    vq_tensor bad = tq;
    bad.dtype = (vq_dtype)12;
    CHECK_FAIL(vq_attend_ex(t.a, 0, &bad, &tk, &tv, out, VQ_HEAD_MAJOR), VQ_EINVAL, "dtype");
    bad = tk;
    bad.batch = -1;
    CHECK_FAIL(vq_attend_ex(t.a, 0, &tq, &bad, &tv, out, VQ_HEAD_MAJOR), VQ_EINVAL, "negative");
  }
  CHECK_TWIN(t, 0);

  /* vq_update with seq 0: the rows kept so far, nothing changes. */
  {
    const snap_t before = snap_of(t.a);
    CHECK_OK(vq_update(t.a, 0, &tk, &tv, NULL, &rows));
    CHECK(rows == vq_rows(t.a, 0));
    CHECK_UNCHANGED(before, t.a);
    CHECK_OK(vq_update(t.a, 1, &tk, &tv, &tq, &rows));
    CHECK(rows == vq_rows(t.a, 1));
    CHECK_UNCHANGED(before, t.a);
  }
  CHECK_TWIN(t, 0);
  CHECK_TWIN(t, 1);
  twin_free(&t);
}

/* ---- 11. both layouts give the same numbers ----------------------------------------------------
 */

static void test_attend_layouts(void) {
  static const int seqs[7] = {5, 1, 1, 3, 1, 1, 2};
  static const vq_storage storages[2] = {VQ_HALF, VQ_FLOAT};
  int si, i;
  for (si = 0; si < 2; ++si) {
    vq_caches* hm = new_set("h2o", 6, 1, storages[si]);
    vq_caches* tm = new_set("h2o", 6, 1, storages[si]);
    for (i = 0; i < 7; ++i) {
      shape_t sh = shape_std(seqs[i]);
      call_t c;
      float *qt, *kt, *vt, *out_t, *out_back;
      sh.batch = 2;
      c = call_new(sh, 300u + (uint32_t)i);
      qt = floats(q_count(sh));
      kt = floats(k_count(sh));
      vt = floats(v_count(sh));
      out_t = floats(out_count(sh));
      out_back = floats(out_count(sh));
      relayout(c.q, qt, VQ_TOKEN_MAJOR, sh.batch, sh.q_heads, sh.seq, sh.dim);
      relayout(c.k, kt, VQ_TOKEN_MAJOR, sh.batch, sh.kv_heads, sh.seq, sh.dim);
      relayout(c.v, vt, VQ_TOKEN_MAJOR, sh.batch, sh.kv_heads, sh.seq, sh.dim);
      CHECK_OK(attend_hm(hm, 0, &c, c.out));
      CHECK_OK(vq_attend(tm, 0, qt, kt, vt, out_t, sh.batch, sh.q_heads, sh.kv_heads, sh.seq,
                         sh.dim, VQ_TOKEN_MAJOR));
      relayout(out_t, out_back, VQ_HEAD_MAJOR, sh.batch, sh.q_heads, sh.seq, sh.dim);
      CHECK(memcmp(c.out, out_back, out_count(sh) * sizeof(float)) == 0);
      CHECK_SAME_STATE(hm, tm);
      free(qt);
      free(kt);
      free(vt);
      free(out_t);
      free(out_back);
      call_free(&c);
    }
    CHECK(vq_rows(hm, 0) == 6 && vq_offset(hm, 0) == 14);
    vq_caches_free(hm);
    vq_caches_free(tm);
  }
  /* vq_attend_ex: each buffer in its own layout, the output in a third. */
  for (si = 0; si < 2; ++si) {
    vq_caches* hm = new_set("h2o", 6, 1, storages[si]);
    vq_caches* mixed = new_set("h2o", 6, 1, storages[si]);
    for (i = 0; i < 7; ++i) {
      shape_t sh = shape_std(seqs[i]);
      call_t c;
      float *qt, *vt, *out_t, *out_back;
      vq_tensor q, k, v;
      sh.batch = 2;
      c = call_new(sh, 400u + (uint32_t)i);
      qt = floats(q_count(sh));
      vt = floats(v_count(sh));
      out_t = floats(out_count(sh));
      out_back = floats(out_count(sh));
      relayout(c.q, qt, VQ_TOKEN_MAJOR, sh.batch, sh.q_heads, sh.seq, sh.dim);
      relayout(c.v, vt, VQ_TOKEN_MAJOR, sh.batch, sh.kv_heads, sh.seq, sh.vdim);
      q = tensor_of(qt, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_TOKEN_MAJOR);
      k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
      v = tensor_of(vt, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.vdim, VQ_TOKEN_MAJOR);
      CHECK_OK(attend_hm(hm, 0, &c, c.out));
      CHECK_OK(vq_attend_ex(mixed, 0, &q, &k, &v, out_t, VQ_TOKEN_MAJOR));
      relayout(out_t, out_back, VQ_HEAD_MAJOR, sh.batch, sh.q_heads, sh.seq, sh.vdim);
      CHECK(memcmp(c.out, out_back, out_count(sh) * sizeof(float)) == 0);
      CHECK_SAME_STATE(hm, mixed);
      free(qt);
      free(vt);
      free(out_t);
      free(out_back);
      call_free(&c);
    }
    vq_caches_free(hm);
    vq_caches_free(mixed);
  }
}

/* ---- 12. the numbers themselves: softmax(q K^T / sqrt(D)) V against a reference in double -------
 */

typedef struct {
  int B, H, Hq, D, Dv, cap, n;
  double* k; /* [B, H, cap, D] */
  double* v; /* [B, H, cap, Dv] */
} ref_t;

static ref_t ref_new(int B, int H, int Hq, int D, int Dv, int cap) {
  ref_t r;
  r.B = B;
  r.H = H;
  r.Hq = Hq;
  r.D = D;
  r.Dv = Dv;
  r.cap = cap;
  r.n = 0;
  r.k = (double*)xcalloc(nelem(B, H, cap, D), sizeof(double));
  r.v = (double*)xcalloc(nelem(B, H, cap, Dv), sizeof(double));
  return r;
}

static void ref_free(ref_t* r) {
  free(r->k);
  free(r->v);
}

/* Appends a call's keys [B, H, S, D] and values [B, H, S, Dv] (head-major). */
static void ref_append(ref_t* r, const float* k, const float* v, int S) {
  int b, h, s, d;
  for (b = 0; b < r->B; ++b)
    for (h = 0; h < r->H; ++h)
      for (s = 0; s < S; ++s) {
        for (d = 0; d < r->D; ++d)
          r->k[at4(VQ_HEAD_MAJOR, r->H, r->cap, r->D, b, h, r->n + s, d)] =
              (double)k[at4(VQ_HEAD_MAJOR, r->H, S, r->D, b, h, s, d)];
        for (d = 0; d < r->Dv; ++d)
          r->v[at4(VQ_HEAD_MAJOR, r->H, r->cap, r->Dv, b, h, r->n + s, d)] =
              (double)v[at4(VQ_HEAD_MAJOR, r->H, S, r->Dv, b, h, s, d)];
      }
  r->n += S;
}

/* The attention of the call of S tokens just appended: out [B, Hq, S, Dv] head-major. */
static void ref_attend(const ref_t* r, const float* q, int S, double* out) {
  const int G = r->Hq / r->H;
  const int before = r->n - S;
  double* w = (double*)xcalloc((size_t)r->n, sizeof(double));
  int b, j, s, t, d;
  for (b = 0; b < r->B; ++b)
    for (j = 0; j < r->Hq; ++j)
      for (s = 0; s < S; ++s) {
        const int h = j / G;
        const int n = before + s + 1;
        double mx = -(double)INFINITY, sum = 0.0;
        for (t = 0; t < n; ++t) {
          double dot = 0.0;
          for (d = 0; d < r->D; ++d)
            dot += (double)q[at4(VQ_HEAD_MAJOR, r->Hq, S, r->D, b, j, s, d)] *
                   r->k[at4(VQ_HEAD_MAJOR, r->H, r->cap, r->D, b, h, t, d)];
          w[t] = dot / sqrt((double)r->D);
          if (w[t] > mx) mx = w[t];
        }
        for (t = 0; t < n; ++t) {
          w[t] = exp(w[t] - mx);
          sum += w[t];
        }
        for (d = 0; d < r->Dv; ++d) {
          double acc = 0.0;
          for (t = 0; t < n; ++t)
            acc += w[t] * r->v[at4(VQ_HEAD_MAJOR, r->H, r->cap, r->Dv, b, h, t, d)];
          out[at4(VQ_HEAD_MAJOR, r->Hq, S, r->Dv, b, j, s, d)] = acc / sum;
        }
      }
  free(w);
}

/* got (in `layout`) against want (head-major), [B, H, S, D]. */
static int close_to(const float* got, vq_layout layout, const double* want, int B, int H, int S,
                    int D) {
  int b, h, s, d;
  for (b = 0; b < B; ++b)
    for (h = 0; h < H; ++h)
      for (s = 0; s < S; ++s)
        for (d = 0; d < D; ++d) {
          const double g = (double)got[at4(layout, H, S, D, b, h, s, d)];
          const double w = want[at4(VQ_HEAD_MAJOR, H, S, D, b, h, s, d)];
          if (!(fabs(g - w) <= 2e-5 + 2e-5 * fabs(w))) {
            fprintf(stderr, "    (%d, %d, %d, %d): got %.9g, reference %.9g\n", b, h, s, d, g, w);
            return 0;
          }
        }
  return 1;
}

static void test_attend_reference(void) {
  static const int seqs[5] = {5, 1, 1, 3, 1};
  /* The standard cache keeps every row; float storage keeps them exactly. */
  vq_caches* s = new_set("standard", 0, 1, VQ_FLOAT);
  vq_caches* sx =
      new_set("standard", 0, 1, VQ_FLOAT); /* vq_attend_ex, value dim 4, token-major out */
  ref_t r = ref_new(2, 2, 4, 8, 8, 16);
  ref_t rx = ref_new(2, 2, 4, 8, 4, 16);
  int i;
  CHECK(vq_layer_budget(s, 0) == -1); /* the standard cache has no budget */
  for (i = 0; i < 5; ++i) {
    shape_t sh = shape_std(seqs[i]);
    shape_t shx;
    call_t c, cx;
    double* want;
    double* wantx;
    vq_tensor q, k, v;
    sh.batch = 2;
    shx = sh;
    shx.vdim = 4;
    c = call_new(sh, 500u + (uint32_t)i);
    cx = call_new(shx, 600u + (uint32_t)i);
    want = (double*)xcalloc(out_count(sh), sizeof(double));
    wantx = (double*)xcalloc(out_count(shx), sizeof(double));
    CHECK_OK(attend_hm(s, 0, &c, c.out));
    ref_append(&r, c.k, c.v, sh.seq);
    ref_attend(&r, c.q, sh.seq, want);
    CHECK(close_to(c.out, VQ_HEAD_MAJOR, want, sh.batch, sh.q_heads, sh.seq, sh.vdim));

    q = tensor_of(cx.q, VQ_F32, shx.batch, shx.q_heads, shx.seq, shx.dim, VQ_HEAD_MAJOR);
    k = tensor_of(cx.k, VQ_F32, shx.batch, shx.kv_heads, shx.seq, shx.dim, VQ_HEAD_MAJOR);
    v = tensor_of(cx.v, VQ_F32, shx.batch, shx.kv_heads, shx.seq, shx.vdim, VQ_HEAD_MAJOR);
    CHECK_OK(vq_attend_ex(sx, 0, &q, &k, &v, cx.out, VQ_TOKEN_MAJOR));
    ref_append(&rx, cx.k, cx.v, shx.seq);
    ref_attend(&rx, cx.q, shx.seq, wantx);
    CHECK(close_to(cx.out, VQ_TOKEN_MAJOR, wantx, shx.batch, shx.q_heads, shx.seq, shx.vdim));
    free(want);
    free(wantx);
    call_free(&c);
    call_free(&cx);
  }
  CHECK(vq_rows(s, 0) == 11 && vq_offset(s, 0) == 11 && vq_layer_budget(s, 0) == -1);
  CHECK(vq_kept_bytes(s) == (size_t)(2 * 2 * 11 * (8 + 8)) * sizeof(float));
  CHECK(vq_kept_bytes(sx) == (size_t)(2 * 2 * 11 * (8 + 4)) * sizeof(float));
  ref_free(&r);
  ref_free(&rx);
  vq_caches_free(s);
  vq_caches_free(sx);
}

/* ---- 13. vq_attend_ex with half, bfloat16 and double inputs -------------------------------------
 */

static void test_attend_ex_dtypes(void) {
  static const int seqs[6] = {5, 1, 1, 2, 1, 1};
  static const vq_dtype dtypes[4] = {VQ_F32, VQ_F16, VQ_BF16, VQ_F64};
  vq_caches* sets[5];
  int d, i;
  size_t j;

  /* The conversion helpers themselves. */
  CHECK(f32_to_f16(1.0f) == 0x3C00u && f32_to_f16(-2.0f) == 0xC000u && f32_to_f16(0.5f) == 0x3800u);
  CHECK(f32_to_f16(65504.0f) == 0x7BFFu && f32_to_f16(1e6f) == 0x7C00u && f32_to_f16(0.0f) == 0u);
  CHECK(f32_to_f16(5.9604645e-8f) == 0x0001u); /* the smallest subnormal */
  CHECK(f32_to_f16(1.0009765625f) == 0x3C01u &&
        f32_to_f16(1.00048828125f) == 0x3C00u); /* ties even */
  CHECK(f16_to_f32(0x3C00u) == 1.0f && f16_to_f32(0xC000u) == -2.0f &&
        f16_to_f32(0x0001u) == 5.9604645e-8f);
  CHECK(f32_to_bf16(1.0f) == 0x3F80u && f32_to_bf16(-2.0f) == 0xC000u &&
        bf16_to_f32(0x3F80u) == 1.0f);
  CHECK(f32_to_bf16(1.00390625f) == 0x3F80u && f32_to_bf16(1.01171875f) == 0x3F82u); /* ties even */
  for (i = 0; i < 200; ++i) {
    float x;
    fill_any(&x, 1, (uint32_t)i + 77u);
    CHECK(f16_to_f32(f32_to_f16(f16_to_f32(f32_to_f16(x)))) == f16_to_f32(f32_to_f16(x)));
    CHECK(fabsf(f16_to_f32(f32_to_f16(x)) - x) <= fabsf(x) / 2048.0f + 3e-8f);
  }

  /* One set per input dtype (all inputs of that dtype) and one with half queries over double keys
   * and values: the grid values are exact in every dtype, so the outputs are bit-identical. */
  for (d = 0; d < 5; ++d) sets[d] = new_set("h2o", 6, 1, VQ_HALF);
  for (i = 0; i < 6; ++i) {
    const shape_t sh = shape_std(seqs[i]);
    call_t c = call_new(sh, 700u + (uint32_t)i);
    const size_t nq = q_count(sh), nk = k_count(sh), nv = v_count(sh), no = out_count(sh);
    uint16_t* h16[3];
    uint16_t* b16[3];
    double* f64[3];
    float* outs[5];
    const float* src[3];
    src[0] = c.q;
    src[1] = c.k;
    src[2] = c.v;
    for (j = 0; j < 3; ++j) {
      const size_t n = j == 0 ? nq : j == 1 ? nk : nv;
      size_t e;
      h16[j] = (uint16_t*)xcalloc(n, sizeof(uint16_t));
      b16[j] = (uint16_t*)xcalloc(n, sizeof(uint16_t));
      f64[j] = (double*)xcalloc(n, sizeof(double));
      for (e = 0; e < n; ++e) {
        h16[j][e] = f32_to_f16(src[j][e]);
        b16[j][e] = f32_to_bf16(src[j][e]);
        f64[j][e] = (double)src[j][e];
      }
    }
    for (d = 0; d < 5; ++d) {
      const void* data[3];
      vq_dtype dt[3];
      vq_tensor q, k, v;
      outs[d] = floats(no);
      for (j = 0; j < 3; ++j) {
        const vq_dtype want = d < 4 ? dtypes[d] : (j == 0 ? VQ_F16 : VQ_F64);
        dt[j] = want;
        data[j] = want == VQ_F32    ? (const void*)src[j]
                  : want == VQ_F16  ? (const void*)h16[j]
                  : want == VQ_BF16 ? (const void*)b16[j]
                                    : (const void*)f64[j];
      }
      q = tensor_of(data[0], dt[0], sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
      k = tensor_of(data[1], dt[1], sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
      v = tensor_of(data[2], dt[2], sh.batch, sh.kv_heads, sh.seq, sh.vdim, VQ_HEAD_MAJOR);
      CHECK_OK(vq_attend_ex(sets[d], 0, &q, &k, &v, outs[d], VQ_HEAD_MAJOR));
    }
    for (d = 1; d < 5; ++d) {
      char what[128];
      snprintf(what, sizeof what, "vq_attend_ex input set %d bit-identical to F32 inputs", d);
      check_at(memcmp(outs[0], outs[d], no * sizeof(float)) == 0, what, __FILE__, __LINE__);
      CHECK_SAME_STATE(sets[d], sets[0]);
    }
    for (j = 0; j < 3; ++j) {
      free(h16[j]);
      free(b16[j]);
      free(f64[j]);
    }
    for (d = 0; d < 5; ++d) free(outs[d]);
    call_free(&c);
  }
  for (d = 0; d < 5; ++d) vq_caches_free(sets[d]);

  /* vq_attend and vq_attend_ex of F32 are the same call. */
  {
    vq_caches* a = new_set("h2o", 6, 1, VQ_BFLOAT16);
    vq_caches* b = new_set("h2o", 6, 1, VQ_BFLOAT16);
    for (i = 0; i < 6; ++i) {
      const shape_t sh = shape_std(seqs[i]);
      call_t c = call_new(sh, 800u + (uint32_t)i);
      float* out_b = floats(out_count(sh));
      vq_tensor q = tensor_of(c.q, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
      vq_tensor k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
      vq_tensor v = tensor_of(c.v, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.vdim, VQ_HEAD_MAJOR);
      CHECK_OK(attend_hm(a, 0, &c, c.out));
      CHECK_OK(vq_attend_ex(b, 0, &q, &k, &v, out_b, VQ_HEAD_MAJOR));
      CHECK(memcmp(c.out, out_b, out_count(sh) * sizeof(float)) == 0);
      free(out_b);
      call_free(&c);
    }
    vq_caches_free(a);
    vq_caches_free(b);
  }
}

/* ---- 14. vq_update + vq_fetch
 * ---------------------------------------------------------------------- */

typedef float (*round_fn)(float);
static float round_float(float x) { return x; }
static float round_half(float x) { return f16_to_f32(f32_to_f16(x)); }
static float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static void test_update_fetch(void) {
  static const vq_storage storages[3] = {VQ_FLOAT, VQ_HALF, VQ_BFLOAT16};
  static const round_fn rounders[3] = {round_float, round_half, round_bf16};
  enum { B = 2, H = 2, HQ = 4, D = 8, DV = 4, S1 = 5, S2 = 3, N = S1 + S2 };
  float k1[B * H * S1 * D], v1[B * H * S1 * DV], k2[B * H * S2 * D], v2[B * H * S2 * DV];
  float q2[B * HQ * S2 * D];
  float keys[B * H * N * D], values[B * H * N * DV], keys_t[B * H * N * D],
      values_t[B * H * N * DV];
  int si;
  fill_any(k1, sizeof k1 / sizeof k1[0], 11u);
  fill_any(v1, sizeof v1 / sizeof v1[0], 12u);
  fill_any(k2, sizeof k2 / sizeof k2[0], 13u);
  fill_any(v2, sizeof v2 / sizeof v2[0], 14u);
  fill_any(q2, sizeof q2 / sizeof q2[0], 15u);

  for (si = 0; si < 3; ++si) {
    /* A budget above every row: the window is every row, in arrival order. */
    vq_caches* s = new_set("h2o", 64, 1, storages[si]);
    vq_tensor tk1 = tensor_of(k1, VQ_F32, B, H, S1, D, VQ_HEAD_MAJOR);
    vq_tensor tv1 = tensor_of(v1, VQ_F32, B, H, S1, DV, VQ_HEAD_MAJOR);
    vq_tensor tk2 = tensor_of(k2, VQ_F32, B, H, S2, D, VQ_HEAD_MAJOR);
    vq_tensor tv2 = tensor_of(v2, VQ_F32, B, H, S2, DV, VQ_HEAD_MAJOR);
    vq_tensor tq2 = tensor_of(q2, VQ_F32, B, HQ, S2, D, VQ_HEAD_MAJOR);
    int64_t rows = -1;
    int b, h, r, d, exact = 1, exact_t = 1;
    CHECK_FAIL(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
    CHECK_OK(vq_update(s, 0, &tk1, &tv1, NULL, &rows));
    CHECK(rows == S1);
    CHECK(vq_rows(s, 0) == S1 && vq_offset(s, 0) == S1);
    CHECK_OK(vq_update(s, 0, &tk2, &tv2, &tq2, &rows)); /* with queries */
    CHECK(rows == N);
    CHECK(vq_rows(s, 0) == N && vq_offset(s, 0) == N);
    memset(keys, 0, sizeof keys);
    memset(values, 0, sizeof values);
    CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));
    CHECK_OK(vq_fetch(s, 0, keys_t, values_t, VQ_TOKEN_MAJOR));
    for (b = 0; b < B; ++b)
      for (h = 0; h < H; ++h)
        for (r = 0; r < N; ++r) {
          for (d = 0; d < D; ++d) {
            const float in = r < S1 ? k1[at4(VQ_HEAD_MAJOR, H, S1, D, b, h, r, d)]
                                    : k2[at4(VQ_HEAD_MAJOR, H, S2, D, b, h, r - S1, d)];
            exact &= keys[at4(VQ_HEAD_MAJOR, H, N, D, b, h, r, d)] == rounders[si](in);
            exact_t &= keys_t[at4(VQ_TOKEN_MAJOR, H, N, D, b, h, r, d)] ==
                       keys[at4(VQ_HEAD_MAJOR, H, N, D, b, h, r, d)];
          }
          for (d = 0; d < DV; ++d) {
            const float in = r < S1 ? v1[at4(VQ_HEAD_MAJOR, H, S1, DV, b, h, r, d)]
                                    : v2[at4(VQ_HEAD_MAJOR, H, S2, DV, b, h, r - S1, d)];
            exact &= values[at4(VQ_HEAD_MAJOR, H, N, DV, b, h, r, d)] == rounders[si](in);
            exact_t &= values_t[at4(VQ_TOKEN_MAJOR, H, N, DV, b, h, r, d)] ==
                       values[at4(VQ_HEAD_MAJOR, H, N, DV, b, h, r, d)];
          }
        }
    CHECK(exact);   /* the inputs converted to the storage type */
    CHECK(exact_t); /* token-major: the same numbers transposed */
    /* Either pointer may be NULL. */
    memset(keys_t, 0, sizeof keys_t);
    CHECK_OK(vq_fetch(s, 0, keys_t, NULL, VQ_HEAD_MAJOR));
    CHECK(memcmp(keys_t, keys, sizeof keys) == 0);
    memset(values_t, 0, sizeof values_t);
    CHECK_OK(vq_fetch(s, 0, NULL, values_t, VQ_HEAD_MAJOR));
    CHECK(memcmp(values_t, values, sizeof values) == 0);
    CHECK_OK(vq_fetch(s, 0, NULL, NULL, VQ_HEAD_MAJOR));
    CHECK_FAIL(vq_fetch(s, 0, keys, values, (vq_layout)9), VQ_EINVAL, "layout 9");
    CHECK(vq_kept_bytes(s) ==
          (size_t)(B * H * N * (D + DV)) * (storages[si] == VQ_FLOAT ? 4u : 2u));
    vq_caches_free(s);
  }

  /* Inputs in half precision stored as half: fetched exactly. */
  {
    vq_caches* s = new_set("h2o", 64, 1, VQ_HALF);
    uint16_t hk[B * H * S1 * D], hv[B * H * S1 * DV];
    size_t e;
    int ok = 1;
    int64_t rows = -1;
    vq_tensor tk, tv;
    for (e = 0; e < sizeof hk / sizeof hk[0]; ++e) hk[e] = f32_to_f16(k1[e]);
    for (e = 0; e < sizeof hv / sizeof hv[0]; ++e) hv[e] = f32_to_f16(v1[e]);
    tk = tensor_of(hk, VQ_F16, B, H, S1, D, VQ_HEAD_MAJOR);
    tv = tensor_of(hv, VQ_F16, B, H, S1, DV, VQ_HEAD_MAJOR);
    CHECK_OK(vq_update(s, 0, &tk, &tv, NULL, &rows));
    CHECK(rows == S1);
    CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));
    for (e = 0; e < sizeof hk / sizeof hk[0]; ++e) ok &= keys[e] == f16_to_f32(hk[e]);
    for (e = 0; e < sizeof hv / sizeof hv[0]; ++e) ok &= values[e] == f16_to_f32(hv[e]);
    CHECK(ok);
    vq_caches_free(s);
  }

  /* With eviction: H2O, budget 8, 20 tokens in one call. The window holds all 20; 8 stay. Then
   * one token: the 8 kept before, in ascending position, and the new one last. */
  {
    enum { T = 20, BUD = 8 };
    vq_caches* s = new_set("h2o", BUD, 1, VQ_FLOAT);
    float k[H * T * D], v[H * T * D], kn[H * D], vn[H * D];
    float fk[H * (BUD + 1) * D], fv[H * (BUD + 1) * D];
    vq_tensor tk, tv, tkn, tvn;
    int64_t rows = -1;
    int h, r, d, all_found = 1, sinks = 1, last = 1, ordered = 1;
    fill_any(k, sizeof k / sizeof k[0], 21u);
    fill_any(v, sizeof v / sizeof v[0], 22u);
    fill_any(kn, sizeof kn / sizeof kn[0], 23u);
    fill_any(vn, sizeof vn / sizeof vn[0], 24u);
    tk = tensor_of(k, VQ_F32, 1, H, T, D, VQ_HEAD_MAJOR);
    tv = tensor_of(v, VQ_F32, 1, H, T, D, VQ_HEAD_MAJOR);
    tkn = tensor_of(kn, VQ_F32, 1, H, 1, D, VQ_HEAD_MAJOR);
    tvn = tensor_of(vn, VQ_F32, 1, H, 1, D, VQ_HEAD_MAJOR);
    CHECK_OK(vq_update(s, 0, &tk, &tv, NULL, &rows));
    CHECK(rows == T);
    CHECK(vq_rows(s, 0) == BUD && vq_offset(s, 0) == T && vq_layer_budget(s, 0) == BUD);
    {
      float* wk = floats((size_t)(H * T * D));
      CHECK_OK(vq_fetch(s, 0, wk, NULL, VQ_HEAD_MAJOR));
      CHECK(memcmp(wk, k, sizeof k) == 0); /* the call's rows, in arrival order */
      free(wk);
    }
    CHECK_OK(vq_update(s, 0, &tkn, &tvn, NULL, &rows));
    CHECK(rows == BUD + 1);
    CHECK(vq_rows(s, 0) == BUD && vq_offset(s, 0) == T + 1);
    CHECK_OK(vq_fetch(s, 0, fk, fv, VQ_HEAD_MAJOR));
    for (h = 0; h < H; ++h) {
      int sink_seen[4] = {0, 0, 0, 0}, previous = -1;
      for (r = 0; r < BUD; ++r) {
        /* each kept row is one of the 20 inputs, key and value together */
        int t, found = 0;
        for (t = 0; t < T && !found; ++t) {
          if (memcmp(&fk[at4(VQ_HEAD_MAJOR, H, BUD + 1, D, 0, h, r, 0)],
                     &k[at4(VQ_HEAD_MAJOR, H, T, D, 0, h, t, 0)], D * sizeof(float)) == 0 &&
              memcmp(&fv[at4(VQ_HEAD_MAJOR, H, BUD + 1, D, 0, h, r, 0)],
                     &v[at4(VQ_HEAD_MAJOR, H, T, D, 0, h, t, 0)], D * sizeof(float)) == 0) {
            found = 1;
            if (t < 4) sink_seen[t] = 1;
            ordered &= t > previous; /* position t: ascending */
            previous = t;
          }
        }
        all_found &= found;
      }
      sinks &= sink_seen[0] && sink_seen[1] && sink_seen[2] && sink_seen[3]; /* 4 sinks kept */
      for (d = 0; d < D; ++d) {
        last &= fk[at4(VQ_HEAD_MAJOR, H, BUD + 1, D, 0, h, BUD, d)] == kn[h * D + d];
        last &= fv[at4(VQ_HEAD_MAJOR, H, BUD + 1, D, 0, h, BUD, d)] == vn[h * D + d];
      }
    }
    CHECK(all_found);
    CHECK(ordered);
    CHECK(sinks);
    CHECK(last);
    vq_caches_free(s);
  }
}

/* ---- 15. when vq_fetch has a window, and failing calls keep it ---------------------------------
 */

static void test_fetch_state(void) {
  vq_caches* s = new_set("h2o", 6, 2, VQ_HALF);
  call_t c = call_new(shape_std(3), 900u);
  const shape_t sh = c.sh;
  vq_tensor q = tensor_of(c.q, VQ_F32, sh.batch, sh.q_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor k = tensor_of(c.k, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.dim, VQ_HEAD_MAJOR);
  vq_tensor v = tensor_of(c.v, VQ_F32, sh.batch, sh.kv_heads, sh.seq, sh.vdim, VQ_HEAD_MAJOR);
  /* batch 2 after batch 1, over a buffer large enough for what the shape claims */
  vq_tensor badk = tensor_of(g_junk, VQ_F32, 2, 2, 3, 8, VQ_HEAD_MAJOR);
  vq_tensor badv = tensor_of(g_junk, VQ_F32, 2, 2, 3, 8, VQ_HEAD_MAJOR);
  float keys[1024], values[1024], keys2[1024], values2[1024];
  int64_t rows = -1;
  vq_caches* other = NULL;
  char path[1200];
  path_in_dir(path, sizeof path, "fetch_state.vqkv");
  memset(g_junk, 0, sizeof g_junk);

  CHECK_FAIL(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
  CHECK_OK(vq_update(s, 0, &k, &v, &q, &rows));
  CHECK_FAIL(vq_fetch(s, 1, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer"); /* other layer */
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK(rows == 6);
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));

  /* A failing call changes nothing, the window included (header: "changes nothing"). */
  CHECK_FAIL(vq_update(s, 0, &badk, &badv, NULL, &rows), VQ_EINVAL, "differ");
  memset(keys2, 0, sizeof keys2);
  CHECK(vq_fetch(s, 0, keys2, values2, VQ_HEAD_MAJOR) == VQ_OK);
  CHECK(memcmp(keys, keys2, (size_t)rows * 16u * sizeof(float)) == 0);
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));
  CHECK_FAIL(vq_attend(s, 0, g_junk, g_junk, g_junk, g_junk_out, 2, 4, 2, 3, 8, VQ_HEAD_MAJOR),
             VQ_EINVAL, "differ");
  memset(keys2, 0, sizeof keys2);
  CHECK(vq_fetch(s, 0, keys2, values2, VQ_HEAD_MAJOR) == VQ_OK);
  CHECK(memcmp(keys, keys2, (size_t)rows * 16u * sizeof(float)) == 0);
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));
  CHECK_FAIL(vq_attend_ex(s, 0, &q, &badk, &v, c.out, VQ_HEAD_MAJOR), VQ_EINVAL, "share");
  memset(keys2, 0, sizeof keys2);
  CHECK(vq_fetch(s, 0, keys2, values2, VQ_HEAD_MAJOR) == VQ_OK);
  CHECK(memcmp(keys, keys2, (size_t)rows * 16u * sizeof(float)) == 0);

  /* A checkpoint leaves the window; a (successful) vq_attend ends it. */
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR));
  CHECK_OK(vq_checkpoint(s));
  CHECK_OK(vq_fetch(s, 0, keys2, values2, VQ_HEAD_MAJOR));
  CHECK(memcmp(keys, keys2, (size_t)rows * 16u * sizeof(float)) == 0);
  CHECK_OK(attend_hm(s, 0, &c, c.out));
  CHECK_FAIL(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");

  /* Rolled back, forked, loaded, reset: no window. */
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_rollback(s));
  CHECK_FAIL(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
  CHECK_OK(vq_update(s, 0, &k, &v, NULL, &rows));
  CHECK_OK(vq_fork(s, &other));
  CHECK_FAIL(vq_fetch(other, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR)); /* the source keeps its own */
  vq_caches_free(other);
  other = NULL;
  CHECK_OK(vq_save(s, path));
  CHECK_OK(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR)); /* saving changes nothing */
  CHECK_OK(vq_load(path, &other));
  CHECK_FAIL(vq_fetch(other, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
  vq_caches_free(other);
  CHECK(remove(path) == 0);
  vq_reset(s);
  CHECK_FAIL(vq_fetch(s, 0, keys, values, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
  call_free(&c);
  vq_caches_free(s);
}

/* ---- 16. counters: offset, rows, budget, kept bytes ---------------------------------------------
 */

/* vq_caches_new_dims: head dims declared per layer, 0 for a layer without attention; and
 * vq_layer_kept_bytes. */
static void test_caches_new_dims(void) {
  vq_config* c = vq_config_new();
  vq_caches* s = NULL;
  const int dims[3] = {8, 0, 8};
  CHECK_OK(vq_config_set(c, "method", "h2o"));
  CHECK_OK(vq_config_set(c, "budget", "8"));
  CHECK_OK(vq_caches_new_dims(c, dims, 3, VQ_HALF, &s));
  CHECK(s != NULL && vq_layers(s) == 3);
  if (s != NULL) {
    call_t wide = call_new(shape_std(20), 3100u);
    shape_t sh16 = shape_std(1);
    call_t d16;
    sh16.dim = 16;
    sh16.vdim = 16;
    d16 = call_new(sh16, 3101u);
    CHECK(vq_layer_budget(s, 0) == 8 && vq_layer_budget(s, 2) == 8);
    CHECK(vq_layer_budget(s, 1) == -1); /* no attention: a standard cache */
    CHECK_OK(attend_hm(s, 0, &wide, wide.out));
    /* Later calls must match the first call's dims (the declared ones only size the checks). */
    CHECK_FAIL(attend_hm(s, 0, &d16, d16.out), VQ_EINVAL, "differ");
    CHECK(vq_offset(s, 0) == 20);
    CHECK_OK(attend_hm(s, 1, &wide, wide.out)); /* the standard layer keeps every row */
    CHECK(vq_rows(s, 0) == 8 && vq_rows(s, 1) == 20 && vq_rows(s, 2) == 0);
    /* 1 sequence x 2 KV heads x rows x (8 + 8) elements x 2 bytes */
    CHECK(vq_layer_kept_bytes(s, 0) == 512u && vq_layer_kept_bytes(s, 1) == 1280u);
    CHECK(vq_layer_kept_bytes(s, 2) == 0u);
    CHECK(vq_kept_bytes(s) == 512u + 1280u);
    CHECK_FAIL_VALUE(vq_layer_kept_bytes(s, 3) == 0u, "layer");
    CHECK_FAIL_VALUE(vq_layer_kept_bytes(s, -1) == 0u, "layer");
    CHECK_FAIL_VALUE(vq_layer_kept_bytes(NULL, 0) == 0u, "NULL");
    call_free(&wide);
    call_free(&d16);
    vq_caches_free(s);
  }
  /* Bad input: *out is NULL afterwards, the message names the problem. */
  {
    const int negative[2] = {8, -1}, huge[1] = {70000}, eight[1] = {8};
    s = (vq_caches*)&s; /* not NULL: the call must clear it */
    CHECK_FAIL(vq_caches_new_dims(c, NULL, 2, VQ_HALF, &s), VQ_EINVAL, "head_dims");
    CHECK(s == NULL);
    CHECK_FAIL(vq_caches_new_dims(c, negative, 2, VQ_HALF, &s), VQ_EINVAL, "head_dims[1]");
    CHECK(s == NULL);
    CHECK_FAIL(vq_caches_new_dims(c, huge, 1, VQ_HALF, &s), VQ_EINVAL, "70000");
    CHECK_FAIL(vq_caches_new_dims(c, eight, 0, VQ_HALF, &s), VQ_EINVAL, "n_layers");
    CHECK_FAIL(vq_caches_new_dims(c, eight, 1, (vq_storage)7, &s), VQ_EINVAL, "storage 7");
    CHECK_FAIL(vq_caches_new_dims(NULL, eight, 1, VQ_HALF, &s), VQ_EINVAL, "config");
    CHECK_FAIL(vq_caches_new_dims(c, eight, 1, VQ_HALF, NULL), VQ_EINVAL, "out");
    /* Quantized rows: the group must divide the declared dim, checked now. */
    CHECK_OK(vq_config_set(c, "key_bits", "8"));
    CHECK_FAIL(vq_caches_new_dims(c, eight, 1, VQ_HALF, &s), VQ_EINVAL, "quant_group");
    CHECK(s == NULL);
  }
  vq_config_free(c);
}

static void test_counters(void) {
  int i;
  /* H2O budget 8, 20 tokens one at a time on layer 0 only. */
  {
    vq_caches* s = new_set("h2o", 8, 2, VQ_HALF);
    for (i = 0; i < 20; ++i) {
      call_t c = call_new(shape_std(1), 1100u + (uint32_t)i);
      CHECK_OK(attend_hm(s, 0, &c, c.out));
      CHECK(vq_offset(s, 0) == i + 1);
      CHECK(vq_rows(s, 0) == (i + 1 < 8 ? i + 1 : 8));
      call_free(&c);
    }
    CHECK(vq_rows(s, 0) == 8 && vq_offset(s, 0) == 20);
    CHECK(vq_rows(s, 1) == 0 && vq_offset(s, 1) == 0);
    CHECK(vq_layer_budget(s, 0) == 8 && vq_layer_budget(s, 1) == 8);
    /* 1 sequence x 2 KV heads x 8 rows x (8 + 8) elements x 2 bytes */
    CHECK(vq_kept_bytes(s) == 512u);
    vq_caches_free(s);
  }
  /* The same as one 20-token call, in float. */
  {
    vq_caches* s = new_set("h2o", 8, 2, VQ_FLOAT);
    call_t c = call_new(shape_std(20), 1200u);
    CHECK_OK(attend_hm(s, 1, &c, c.out));
    CHECK(vq_rows(s, 1) == 8 && vq_offset(s, 1) == 20);
    CHECK(vq_kept_bytes(s) == 1024u);
    call_free(&c);
    vq_caches_free(s);
  }
  /* The standard cache: every row, no budget. */
  {
    vq_caches* s = new_set("standard", 0, 1, VQ_BFLOAT16);
    call_t c = call_new(shape_std(20), 1300u);
    CHECK(vq_layer_budget(s, 0) == -1);
    CHECK_OK(attend_hm(s, 0, &c, c.out));
    CHECK(vq_rows(s, 0) == 20 && vq_offset(s, 0) == 20 && vq_layer_budget(s, 0) == -1);
    CHECK(vq_kept_bytes(s) == (size_t)(2 * 20 * 16 * 2));
    call_free(&c);
    vq_caches_free(s);
  }
  /* SqueezeAttention: the fallback budget before the coordinator decides. */
  {
    vq_caches* s = new_set("squeeze", 8, 3, VQ_HALF);
    CHECK(vq_layer_budget(s, 0) == 8 && vq_layer_budget(s, 2) == 8);
    vq_caches_free(s);
  }
}

/* ---- the reference's diagnostics: tokens seen and kept, bytes, ratio, trimmable, concentration --
 */

/* The concentration of a layer whose keys were these [B, H, S, D] (head-major, exact in the
 * storage type), computed here in double: per head the mean over ordered pairs i != j of the
 * cosine similarity of rows i and j, then the mean over the B x H heads (docs/design.md 5.2). */
static double concentration_of_keys(const float* k, int B, int H, int S, int D) {
  double total = 0.0;
  int b, h, i, j, d;
  for (b = 0; b < B; ++b) {
    for (h = 0; h < H; ++h) {
      double sum = 0.0;
      for (i = 0; i < S; ++i) {
        for (j = 0; j < S; ++j) {
          double dot = 0.0, ni = 0.0, nj = 0.0;
          if (i == j) continue;
          for (d = 0; d < D; ++d) {
            const double x = k[at4(VQ_HEAD_MAJOR, H, S, D, b, h, i, d)];
            const double y = k[at4(VQ_HEAD_MAJOR, H, S, D, b, h, j, d)];
            dot += x * y;
            ni += x * x;
            nj += y * y;
          }
          sum += dot / (sqrt(ni) * sqrt(nj));
        }
      }
      total += S < 2 ? 0.0 : sum / ((double)S * (double)(S - 1));
    }
  }
  return total / ((double)B * (double)H);
}

/* Layer `l`'s bytes and ratio agree: full = B x H x offset x (D + Dv) x `elem` bytes, kept = B x
 * H x rows x (D + Dv) x `elem` (unquantized, every head alike), ratio = full / kept exactly. */
static void check_bytes_at(const vq_caches* s, int l, int B, int H, int D, int Dv, size_t elem,
                           const char* file, int line) {
  const size_t full = vq_layer_full_seq_bytes(s, l), kept = vq_layer_kept_bytes(s, l);
  const size_t row = (size_t)B * (size_t)H * (size_t)(D + Dv) * elem;
  check_at(full == row * (size_t)vq_offset(s, l), "full_seq_bytes = B H offset (D + Dv) bytes",
           file, line);
  check_at(kept == row * (size_t)vq_rows(s, l), "kept_bytes = B H rows (D + Dv) bytes", file, line);
  check_at(vq_layer_compression_ratio(s, l) == (kept == 0 ? 1.0 : (double)full / (double)kept),
           "compression_ratio = full_seq_bytes / kept_bytes (1.0 while nothing is kept)", file,
           line);
}
#define CHECK_BYTES(s, l, B, H, D, Dv, elem) \
  check_bytes_at((s), (l), (B), (H), (D), (Dv), (elem), __FILE__, __LINE__)

static void test_diagnostics(void) {
  int i, l;
  /* SqueezeAttention over 2 layers, budget 8, calibrated over 4 tokens (config_of): before any
   * call, nothing seen or kept, ratio 1.0, concentration 0.0 ("0.0 before prefill"). */
  {
    vq_caches* s = new_set("squeeze", 8, 2, VQ_HALF);
    call_t prompt = call_new(shape_std(20), 4100u);
    double want;
    for (l = 0; l < 2; ++l) {
      CHECK(vq_layer_tokens_seen(s, l) == 0 && vq_layer_tokens_kept(s, l) == 0);
      CHECK(vq_layer_full_seq_bytes(s, l) == 0 && vq_layer_kept_bytes(s, l) == 0);
      CHECK(vq_layer_compression_ratio(s, l) == 1.0);
      CHECK(vq_layer_concentration(s, l) == 0.0);
      CHECK(vq_layer_is_trimmable(s, l) == 0);
    }
    /* A 20-token prompt on layer 0: 1 x 2 heads x 20 tokens seen; the fallback budget (8) kept,
     * 2 x 8 x 16 elements x 2 bytes = 512 of 1280 bytes, ratio 2.5. */
    CHECK_OK(attend_hm(s, 0, &prompt, prompt.out));
    CHECK(vq_layer_tokens_seen(s, 0) == 40 && vq_layer_tokens_kept(s, 0) == 8);
    CHECK(vq_layer_full_seq_bytes(s, 0) == 1280u && vq_layer_kept_bytes(s, 0) == 512u);
    CHECK(vq_layer_compression_ratio(s, 0) == 2.5);
    CHECK_BYTES(s, 0, 1, 2, 8, 8, 2);
    CHECK(vq_layer_tokens_seen(s, 1) == 0 && vq_layer_compression_ratio(s, 1) == 1.0);
    /* The concentration of the prompt's keys (grid values, exact in half), within rounding. */
    want = concentration_of_keys(prompt.k, 1, 2, 20, 8);
    CHECK(want != 0.0);
    CHECK(fabs(vq_layer_concentration(s, 0) - want) <= 1e-9);
    CHECK(vq_layer_concentration(s, 1) == 0.0);
    /* Decode steps: seen grows by 2 a token, the concentration is frozen (calibrated). */
    want = vq_layer_concentration(s, 0);
    for (i = 0; i < 5; ++i) {
      call_t c = call_new(shape_std(1), 4200u + (uint32_t)i);
      CHECK_OK(attend_hm(s, 0, &c, c.out));
      CHECK(vq_layer_tokens_seen(s, 0) == 40 + 2 * (i + 1));
      CHECK(vq_layer_tokens_kept(s, 0) == 8);
      CHECK_BYTES(s, 0, 1, 2, 8, 8, 2);
      CHECK(vq_layer_concentration(s, 0) == want);
      call_free(&c);
    }
    CHECK(vq_layer_full_seq_bytes(s, 0) == 1600u && vq_layer_compression_ratio(s, 0) == 3.125);
    /* Layer 1's prompt: its own concentration; the coordinator then sets both budgets. */
    {
      call_t p1 = call_new(shape_std(12), 4300u);
      CHECK_OK(attend_hm(s, 1, &p1, p1.out));
      CHECK(vq_layer_tokens_seen(s, 1) == 24);
      CHECK(fabs(vq_layer_concentration(s, 1) - concentration_of_keys(p1.k, 1, 2, 12, 8)) <= 1e-9);
      CHECK(vq_layer_tokens_kept(s, 1) == vq_rows(s, 1));
      CHECK(vq_layer_tokens_kept(s, 1) <= vq_layer_budget(s, 1));
      CHECK_BYTES(s, 1, 1, 2, 8, 8, 2);
      call_free(&p1);
    }
    /* A fork and a saved copy show the same diagnostics; a reset clears them. */
    {
      vq_caches* f = NULL;
      vq_caches* loaded = NULL;
      char path[1200];
      path_in_dir(path, sizeof path, "diagnostics.vqkv");
      CHECK_OK(vq_fork(s, &f));
      CHECK_SAME_STATE(f, s);
      CHECK_OK(vq_save(s, path));
      CHECK_OK(vq_load(path, &loaded));
      CHECK_SAME_STATE(loaded, s);
      for (l = 0; l < 2; ++l) {
        CHECK(vq_layer_tokens_kept(loaded, l) == vq_layer_tokens_kept(s, l));
        CHECK(vq_layer_compression_ratio(loaded, l) == vq_layer_compression_ratio(s, l));
      }
      CHECK(remove(path) == 0);
      vq_reset(f);
      for (l = 0; l < 2; ++l) {
        CHECK(vq_layer_tokens_seen(f, l) == 0 && vq_layer_full_seq_bytes(f, l) == 0);
        CHECK(vq_layer_compression_ratio(f, l) == 1.0 && vq_layer_concentration(f, l) == 0.0);
      }
      CHECK(vq_layer_tokens_seen(s, 0) == 50); /* the fork's reset is its own */
      vq_caches_free(loaded);
      vq_caches_free(f);
    }
    call_free(&prompt);
    vq_caches_free(s);
  }
  /* Two sequences: seen counts B x H x S (2 x 2 x 6 a call); H2O measures no concentration. */
  {
    vq_caches* s = new_set("h2o", 6, 1, VQ_FLOAT);
    shape_t sh = shape_std(6);
    sh.batch = 2;
    for (i = 0; i < 3; ++i) {
      call_t c = call_new(sh, 4400u + (uint32_t)i);
      CHECK_OK(attend_hm(s, 0, &c, c.out));
      CHECK(vq_layer_tokens_seen(s, 0) == 2 * 2 * 6 * (i + 1));
      CHECK(vq_layer_tokens_kept(s, 0) == 6);
      CHECK_BYTES(s, 0, 2, 2, 8, 8, 4);
      call_free(&c);
    }
    CHECK(vq_layer_compression_ratio(s, 0) == 3.0); /* 18 tokens in 6 rows */
    CHECK(vq_layer_concentration(s, 0) == 0.0);
    CHECK(vq_layer_is_trimmable(s, 0) == 0);
    vq_caches_free(s);
  }
  /* The standard cache keeps every row (ratio 1.0) and is the one a trim could roll back; so is a
   * layer without attention. */
  {
    vq_caches* s = new_set("standard", 0, 1, VQ_BFLOAT16);
    call_t c = call_new(shape_std(9), 4500u);
    CHECK(vq_layer_is_trimmable(s, 0) == 1);
    CHECK_OK(attend_hm(s, 0, &c, c.out));
    CHECK(vq_layer_tokens_seen(s, 0) == 18 && vq_layer_tokens_kept(s, 0) == 9);
    CHECK(vq_layer_compression_ratio(s, 0) == 1.0);
    CHECK_BYTES(s, 0, 1, 2, 8, 8, 2);
    call_free(&c);
    vq_caches_free(s);
  }
  {
    vq_config* c = config_of("pyramidkv", 8);
    vq_caches* s = NULL;
    const int dims[2] = {0, 8};
    CHECK_OK(vq_caches_new_dims(c, dims, 2, VQ_HALF, &s));
    if (s != NULL) {
      CHECK(vq_layer_is_trimmable(s, 0) == 1 && vq_layer_is_trimmable(s, 1) == 0);
      CHECK(vq_layer_concentration(s, 0) == 0.0 && vq_layer_concentration(s, 1) == 0.0);
    }
    vq_caches_free(s);
    vq_config_free(c);
  }
  /* Quantized rows: kept bytes hold codes and scales, the ratio is still full / kept. */
  {
    vq_config* c = config_of("h2o", 8);
    vq_caches* s;
    call_t p = call_new(shape_std(20), 4600u);
    CHECK_OK(vq_config_set(c, "key_bits", "4"));
    CHECK_OK(vq_config_set(c, "value_bits", "4"));
    CHECK_OK(vq_config_set(c, "quant_group", "8"));
    s = caches_of(c, 1, VQ_HALF);
    CHECK_OK(attend_hm(s, 0, &p, p.out));
    CHECK(vq_layer_full_seq_bytes(s, 0) == 1280u);
    CHECK(vq_layer_kept_bytes(s, 0) > 0u && vq_layer_kept_bytes(s, 0) < 512u);
    CHECK(vq_layer_compression_ratio(s, 0) ==
          (double)vq_layer_full_seq_bytes(s, 0) / (double)vq_layer_kept_bytes(s, 0));
    CHECK(vq_layer_compression_ratio(s, 0) > 2.5);
    call_free(&p);
    vq_caches_free(s);
    vq_config_free(c);
  }
}

/* ---- 17. vq_reset
 * ---------------------------------------------------------------------------------- */

static void test_reset(void) {
  static const char* const methods[3] = {"h2o", "squeeze", "tova"};
  int m, i, l;
  for (m = 0; m < 3; ++m) {
    vq_caches* s = new_set(methods[m], 6, 3, VQ_HALF);
    vq_caches* fresh = new_set(methods[m], 6, 3, VQ_HALF);
    const snap_t empty = snap_of(fresh);
    for (i = 0; i < 4; ++i)
      for (l = 0; l < 3; ++l) {
        call_t c = call_new(shape_std(i == 0 ? 5 : 1), 1400u + (uint32_t)(i * 3 + l));
        CHECK_OK(attend_hm(s, l, &c, c.out));
        call_free(&c);
      }
    CHECK(vq_kept_bytes(s) > 0);
    vq_reset(s);
    CHECK_UNCHANGED(empty, s);
    CHECK(vq_offset(s, 0) == 0 && vq_rows(s, 2) == 0 && vq_kept_bytes(s) == 0);
    /* A new sequence goes exactly as in a fresh set. */
    for (i = 0; i < 4; ++i)
      for (l = 0; l < 3; ++l) {
        call_t c = call_new(shape_std(i == 0 ? 5 : 1), 1500u + (uint32_t)(i * 3 + l));
        float* out2 = floats(out_count(c.sh));
        CHECK_OK(attend_hm(s, l, &c, c.out));
        CHECK_OK(attend_hm(fresh, l, &c, out2));
        CHECK(memcmp(c.out, out2, out_count(c.sh) * sizeof(float)) == 0);
        free(out2);
        call_free(&c);
      }
    CHECK_SAME_STATE(s, fresh);
    vq_caches_free(s);
    vq_caches_free(fresh);
  }
}

/* ---- 18. vq_fork
 * ------------------------------------------------------------------------------------ */

/* The same good call on two sets: outputs bit-identical. */
static void same_step_at(vq_caches* a, vq_caches* b, int layer, int seq, uint32_t seed,
                         const char* file, int line) {
  call_t c = call_new(shape_std(seq), seed);
  float* out_b = floats(out_count(c.sh));
  check_status_at(attend_hm(a, layer, &c, c.out), VQ_OK, "same step (first set)", file, line);
  check_status_at(attend_hm(b, layer, &c, out_b), VQ_OK, "same step (second set)", file, line);
  check_at(memcmp(c.out, out_b, out_count(c.sh) * sizeof(float)) == 0,
           "same step: outputs bit-identical", file, line);
  {
    const snap_t sa_ = snap_of(a), sb_ = snap_of(b);
    check_snap_at(&sb_, &sa_, "same step: same state", file, line);
  }
  free(out_b);
  call_free(&c);
}
#define SAME_STEP(a, b, layer, seq, seed) \
  same_step_at((a), (b), (layer), (seq), (seed), __FILE__, __LINE__)

static void feed(vq_caches* s, int n_layers, int rounds, uint32_t seed) {
  int i, l;
  for (i = 0; i < rounds; ++i)
    for (l = 0; l < n_layers; ++l) {
      call_t c = call_new(shape_std(i == 0 ? 6 : 1), seed + (uint32_t)(i * n_layers + l));
      CHECK_OK(attend_hm(s, l, &c, c.out));
      call_free(&c);
    }
}

/* KVzip (SPEC 18): vq_observe scores a layer, vq_compress keeps ceil(keep x rows) of the set over
 * every head; refusals (keep, a layer not observed, another method) leave the set unchanged. */
static void test_kvzip(void) {
  vq_caches* s = new_set("kvzip", 0, 2, VQ_FLOAT);
  vq_caches* h2o = new_set("h2o", 8, 1, VQ_FLOAT);
  call_t c = call_new(shape_std(20), 3300u);
  call_t r = call_new(shape_std(6), 3301u); /* r.q: the observed queries */
  const vq_tensor q = tensor_of(r.q, VQ_F32, 1, 4, 6, 8, VQ_HEAD_MAJOR);
  int l;
  int64_t rows = 0;
  for (l = 0; l < 2; ++l) CHECK_OK(attend_hm(s, l, &c, c.out));
  CHECK_OK(attend_hm(h2o, 0, &c, c.out));
  CHECK_OK(vq_observe(s, 0, &q));
  {
    const snap_t before = snap_of(s);
    CHECK_FAIL(vq_compress(s, 0.25), VQ_EINVAL, "cache 1 has not been observed");
    CHECK_FAIL(vq_compress(s, 0.0), VQ_EINVAL, "must be in (0, 1]");
    CHECK_FAIL(vq_observe(s, 2, &q), VQ_EINVAL, "layer");
    CHECK_FAIL(vq_observe(h2o, 0, &q), VQ_EINVAL, "observed scores are KVzip's");
    CHECK_FAIL(vq_compress(h2o, 0.5), VQ_EINVAL, "compress keeps the rows of kvzip caches");
    CHECK_UNCHANGED(before, s);
  }
  {
    const vq_tensor k = tensor_of(r.k, VQ_F32, 1, 2, 6, 8, VQ_HEAD_MAJOR);
    const vq_tensor short_k = tensor_of(r.k, VQ_F32, 1, 2, 5, 8, VQ_HEAD_MAJOR);
    CHECK_FAIL(vq_observe_keys(s, 1, &q, &short_k), VQ_EINVAL, "keys must be");
    CHECK_OK(vq_observe_keys(s, 1, &q, &k));
  }
  CHECK_OK(vq_compress(s, 0.25));
  for (l = 0; l < 2; ++l) rows += vq_head_rows(s, l, 0, 0) + vq_head_rows(s, l, 0, 1);
  CHECK(rows == 20); /* ceil(0.25 x 80) */
  CHECK(vq_kept_bytes(s) == 20 * 2 * 8 * sizeof(float));
  CHECK_OK(attend_hm(s, 0, &r, r.out));
  call_free(&r);
  call_free(&c);
  vq_caches_free(h2o);
  vq_caches_free(s);
}

static void test_fork(void) {
  vq_caches* a = new_set("squeeze", 8, 3, VQ_HALF);
  vq_caches* f = SENTINEL_CACHES;
  const char* value = NULL;
  vq_storage st = VQ_FLOAT;
  int i, l;
  CHECK_OK(vq_metadata_set(a, "model", "stories260K"));
  feed(a, 3, 5, 1600u);
  CHECK_OK(vq_fork(a, &f));
  CHECK(f != NULL && f != SENTINEL_CACHES);
  if (f == NULL || f == SENTINEL_CACHES) {
    vq_caches_free(a);
    return;
  }
  CHECK(vq_layers(f) == 3);
  CHECK_OK(vq_storage_of(f, &st));
  CHECK(st == VQ_HALF);
  CHECK_SAME_STATE(f, a);
  CHECK(vq_metadata_count(f) == 1);
  CHECK_OK(vq_metadata_get(f, "model", &value));
  CHECK(value != NULL && strcmp(value, "stories260K") == 0);
  /* Both continue identically. */
  for (i = 0; i < 6; ++i)
    for (l = 0; l < 3; ++l) SAME_STEP(a, f, l, i == 3 ? 2 : 1, 1700u + (uint32_t)(i * 3 + l));
  /* Independent: calls and metadata on the fork leave the source alone, and the reverse. */
  {
    const snap_t before_a = snap_of(a);
    call_t c = call_new(shape_std(1), 1800u);
    CHECK_OK(attend_hm(f, 0, &c, c.out));
    CHECK_OK(vq_metadata_set(f, "model", "other"));
    CHECK_OK(vq_metadata_set(f, "extra", "1"));
    CHECK_UNCHANGED(before_a, a);
    CHECK_OK(vq_metadata_get(a, "model", &value));
    CHECK(value != NULL && strcmp(value, "stories260K") == 0);
    vq_reset(a);
    CHECK(vq_offset(f, 0) > 0 && vq_rows(f, 1) > 0);
    call_free(&c);
  }
  vq_caches_free(f);
  vq_caches_free(a);
}

/* One memory cap over many sequences (SPEC 19): sets attached at creation, by a fork and by a load
 * stay under the cap after every call; floors that do not fit are VQ_ENOROOM and change nothing;
 * the standard method cannot join; release and free return the bytes. Rows: 2 KV heads of dim 8
 * in half, 32 bytes a row. */
static void test_memory_pool(void) {
  const size_t row = 2 * 8 * 2, floor = 2 /* layers */ * 2 /* heads */ * 20 * row;
  vq_pool* p = NULL;
  vq_config* c = config_of("h2o", 64);
  vq_config* std_c = config_of("standard", 64);
  vq_caches *a = NULL, *b = NULL, *f = NULL, *l = NULL, *none = SENTINEL_CACHES;
  char path[1200];
  int i;
  CHECK_FAIL(vq_pool_new(1000, NULL), VQ_EINVAL, "out");
  CHECK_OK(vq_pool_new(2 * floor + floor / 2, &p));
  CHECK(vq_pool_max_bytes(p) == 2 * floor + floor / 2 && vq_pool_sequences(p) == 0);
  CHECK(vq_pool_max_bytes(NULL) == 0 && vq_pool_used_bytes(NULL) == 0 &&
        vq_pool_sequences(NULL) == -1);
  CHECK_FAIL(vq_caches_new_pooled(std_c, 2, VQ_HALF, p, &none), VQ_EINVAL, "standard");
  CHECK(none == NULL);
  CHECK_FAIL(vq_caches_new_pooled(c, 2, VQ_HALF, NULL, &none), VQ_EINVAL, "pool");
  CHECK_OK(vq_caches_new_pooled(c, 2, VQ_HALF, p, &a));
  CHECK_OK(vq_caches_new_pooled(c, 2, VQ_HALF, p, &b));
  CHECK(vq_pool_sequences(p) == 2);
  for (i = 0; i < 30; ++i) {
    int layer;
    for (layer = 0; layer < 2; ++layer) {
      call_t ca = call_new(shape_std(i == 0 ? 40 : 1), 4000u + (uint32_t)(i * 2 + layer));
      call_t cb = call_new(shape_std(i == 0 ? 40 : 1), 5000u + (uint32_t)(i * 2 + layer));
      CHECK_OK(attend_hm(a, layer, &ca, ca.out));
      CHECK(vq_pool_used_bytes(p) <= vq_pool_max_bytes(p));
      CHECK_OK(attend_hm(b, layer, &cb, cb.out));
      CHECK(vq_pool_used_bytes(p) <= vq_pool_max_bytes(p));
      call_free(&ca);
      call_free(&cb);
    }
  }
  CHECK(vq_pool_used_bytes(p) == vq_kept_bytes(a) + vq_kept_bytes(b));
  CHECK(vq_pool_floor_bytes(p) == 2 * floor);
  CHECK(vq_head_rows(a, 0, 0, 0) >= 20 && vq_head_rows(b, 1, 0, 1) >= 20);
  /* A fork would claim a third floor: VQ_ENOROOM, nothing made; also through vq_fork, which
   * joins the source's pool. */
  CHECK_FAIL(vq_fork_pooled(a, p, &f), VQ_ENOROOM, "floors");
  CHECK(f == NULL);
  CHECK_FAIL(vq_fork(a, &f), VQ_ENOROOM, "floors");
  CHECK(vq_pool_sequences(p) == 2);
  path_in_dir(path, sizeof path, "pool.vqkv");
  CHECK_OK(vq_save(a, path));
  CHECK_FAIL(vq_load_pooled(path, p, &l), VQ_ENOROOM, "floors");
  CHECK(l == NULL);
  /* A fresh set's first call claims its floors: VQ_ENOROOM, the set unchanged. */
  {
    vq_caches* d = NULL;
    call_t cd = call_new(shape_std(4), 6000u);
    CHECK_OK(vq_caches_new_pooled(c, 2, VQ_HALF, p, &d));
    CHECK_FAIL(attend_hm(d, 0, &cd, cd.out), VQ_ENOROOM, "floors");
    CHECK(vq_offset(d, 0) == 0 && vq_kept_bytes(d) == 0);
    vq_caches_free(d);
    call_free(&cd);
  }
  /* Released, b works on unlimited; its bytes left the pool, so a load fits now. */
  CHECK_OK(vq_pool_release(b));
  CHECK(vq_pool_sequences(p) == 1 && vq_pool_used_bytes(p) == vq_kept_bytes(a));
  CHECK_OK(vq_load_pooled(path, p, &l));
  CHECK(vq_pool_sequences(p) == 2 && vq_pool_used_bytes(p) <= vq_pool_max_bytes(p));
  /* The handle may go first: the sets stay capped. */
  vq_pool_free(p);
  feed(l, 2, 3, 7000u);
  vq_caches_free(l);
  vq_caches_free(b);
  vq_caches_free(a);
  remove(path);
  vq_config_free(c);
  vq_config_free(std_c);
}

/* ---- 19. vq_checkpoint / vq_rollback
 * -------------------------------------------------------------- */

static void test_checkpoint_rollback(void) {
  static const char* const methods[3] = {"squeeze", "h2o", "snapkv"};
  int m, i, l;
  for (m = 0; m < 3; ++m) {
    vq_caches* a = new_set(methods[m], 8, 3, VQ_HALF);
    vq_caches* twin = new_set(methods[m], 8, 3, VQ_HALF);
    vq_caches* f = NULL;
    snap_t at_checkpoint;
    CHECK_FAIL(vq_rollback(a), VQ_ESTATE, "checkpoint");
    feed(a, 3, 4, 1900u);
    feed(twin, 3, 4, 1900u);
    CHECK_FAIL(vq_rollback(a), VQ_ESTATE, "checkpoint");
    CHECK_SAME_STATE(a, twin);
    CHECK_OK(vq_checkpoint(a));
    at_checkpoint = snap_of(a);
    /* Speculative calls, only on a. */
    for (i = 0; i < 3; ++i)
      for (l = 0; l < 3; ++l) {
        call_t c = call_new(shape_std(i == 1 ? 3 : 1), 2000u + (uint32_t)(i * 3 + l));
        CHECK_OK(attend_hm(a, l, &c, c.out));
        call_free(&c);
      }
    CHECK(vq_offset(a, 0) != vq_offset(twin, 0));
    CHECK_OK(vq_rollback(a));
    CHECK_UNCHANGED(at_checkpoint, a);
    CHECK_SAME_STATE(a, twin);
    for (i = 0; i < 4; ++i)
      for (l = 0; l < 3; ++l) SAME_STEP(a, twin, l, 1, 2100u + (uint32_t)(i * 3 + l));
    /* The checkpoint was consumed. */
    CHECK_FAIL(vq_rollback(a), VQ_ESTATE, "checkpoint");
    CHECK_SAME_STATE(a, twin);

    /* A later checkpoint replaces the earlier one. */
    CHECK_OK(vq_checkpoint(a));
    feed(a, 3, 2, 2200u);
    feed(twin, 3, 2, 2200u);
    CHECK_OK(vq_checkpoint(a));
    feed(a, 3, 2, 2300u);
    CHECK_OK(vq_rollback(a));
    CHECK_SAME_STATE(a, twin);
    SAME_STEP(a, twin, 0, 1, 2400u);

    /* A fork holds no checkpoint; its source keeps its own. Reset drops it. */
    CHECK_OK(vq_checkpoint(a));
    CHECK_OK(vq_checkpoint(twin));
    CHECK_OK(vq_fork(a, &f));
    CHECK_FAIL(vq_rollback(f), VQ_ESTATE, "checkpoint");
    feed(a, 3, 1, 2500u);
    CHECK_OK(vq_rollback(a));
    CHECK_SAME_STATE(a, twin);
    CHECK_OK(vq_checkpoint(a));
    vq_reset(a);
    CHECK_FAIL(vq_rollback(a), VQ_ESTATE, "checkpoint");
    CHECK(vq_offset(a, 0) == 0);
    vq_caches_free(f);
    vq_caches_free(a);
    vq_caches_free(twin);
  }
}

/* ---- 20. vq_set_parallel_for -------------------------------------------------------------------
 */

enum { POOL_ALL = 0, POOL_REVERSE = 1, POOL_SKIP_LAST = 2, POOL_REPEAT_FIRST = 3, POOL_LATE = 4 };
typedef struct {
  int mode;
  int calls;
  long tasks_run;
  vq_task_fn late_task; /* POOL_LATE: the task kept back */
  void* late_ctx;
  int late_index;
} pool_t;

/* A serial "thread pool": runs the tasks on this thread (all in order, in reverse, or wrongly). */
static void test_pool(void* pool_ctx, int tasks, vq_task_fn task, void* task_ctx) {
  pool_t* p = (pool_t*)pool_ctx;
  int i;
  ++p->calls;
  for (i = 0; i < tasks; ++i) {
    const int t = p->mode == POOL_REVERSE ? tasks - 1 - i : i;
    if (p->mode == POOL_SKIP_LAST && t == tasks - 1) continue;
    if (p->mode == POOL_LATE && t == tasks - 1) { /* kept, to be run after the pool returned */
      p->late_task = task;
      p->late_ctx = task_ctx;
      p->late_index = t;
      continue;
    }
    task(task_ctx, t);
    ++p->tasks_run;
    if (p->mode == POOL_REPEAT_FIRST && t == 0) task(task_ctx, 0);
  }
}

/* Calls large enough to be split: 4 KV heads, 8 query heads, head dim 32. */
static shape_t shape_big(int seq) {
  shape_t s;
  s.batch = 1;
  s.q_heads = 8;
  s.kv_heads = 4;
  s.seq = seq;
  s.dim = 32;
  s.vdim = 32;
  return s;
}

/* A real thread pool: each call starts `workers` POSIX threads; thread w runs the tasks
 * w, w + workers, ... and the pool returns once all have joined. */
enum { THREAD_POOL_MAX = 4 };
typedef struct {
  int workers;
  int calls;
} thread_pool_t;
typedef struct {
  vq_task_fn task;
  void* task_ctx;
  int first, step, tasks;
} thread_part_t;

static void* thread_pool_part(void* arg) {
  const thread_part_t* part = (const thread_part_t*)arg;
  int i;
  for (i = part->first; i < part->tasks; i += part->step) part->task(part->task_ctx, i);
  return NULL;
}

static void thread_pool(void* pool_ctx, int tasks, vq_task_fn task, void* task_ctx) {
  thread_pool_t* p = (thread_pool_t*)pool_ctx;
  pthread_t threads[THREAD_POOL_MAX];
  thread_part_t parts[THREAD_POOL_MAX];
  int w, started = 0;
  ++p->calls;
  for (w = 0; w < p->workers; ++w) {
    parts[w].task = task;
    parts[w].task_ctx = task_ctx;
    parts[w].first = w;
    parts[w].step = p->workers;
    parts[w].tasks = tasks;
    if (pthread_create(&threads[w], NULL, thread_pool_part, &parts[w]) != 0) break;
    ++started;
  }
  for (w = started; w < p->workers; ++w) (void)thread_pool_part(&parts[w]); /* no thread: here */
  for (w = 0; w < started; ++w) pthread_join(threads[w], NULL);
}

static void test_parallel_for(void) {
  pool_t pool = {POOL_ALL, 0, 0, NULL, NULL, 0};
  pool_t reverse = {POOL_REVERSE, 0, 0, NULL, NULL, 0};
  twin_t t = twin_new("h2o", 32, 2, VQ_HALF);
  int i;
  t.shape = shape_big;

  CHECK_FAIL(vq_set_parallel_for(t.a, test_pool, &pool, 0), VQ_EINVAL, "workers");
  CHECK_FAIL(vq_set_parallel_for(t.a, test_pool, &pool, -2), VQ_EINVAL, "workers");
  CHECK_OK(vq_set_parallel_for(t.a, test_pool, &pool, 4));
  /* Results bit-identical to serial ones (b has no pool). */
  TWIN_STEP(t, 0, 64);
  TWIN_STEP(t, 1, 64);
  CHECK(pool.calls > 0 && pool.tasks_run >= 2L * pool.calls); /* the pool did run the heads */
  for (i = 0; i < 4; ++i) TWIN_STEP(t, i % 2, 1);
  TWIN_STEP(t, 0, 48);
  CHECK_OK(vq_set_parallel_for(t.a, test_pool, &reverse, 3)); /* any order is fine */
  TWIN_STEP(t, 1, 48);
  CHECK(reverse.calls > 0);
  {
    /* Threads for real: still bit-identical to the serial twin. */
    thread_pool_t threaded = {THREAD_POOL_MAX, 0};
    CHECK_OK(vq_set_parallel_for(t.a, thread_pool, &threaded, THREAD_POOL_MAX));
    TWIN_STEP(t, 0, 64);
    for (i = 0; i < 3; ++i) TWIN_STEP(t, i % 2, 1);
    TWIN_STEP(t, 1, 32);
    CHECK(threaded.calls > 0);
    CHECK_OK(vq_set_parallel_for(t.a, test_pool, &reverse, 3));
  }
  TWIN_UPDATE(t, 0, 40);

  /* A pool that skips a task: VQ_ECALLBACK, and — the one failure that changes something, per
   * the header — the layer is reset (its heads took the call only in part). */
  {
    const int64_t offset1 = vq_offset(t.a, 1), rows1 = vq_rows(t.a, 1);
    call_t c = call_new(shape_big(64), 2600u);
    pool.mode = POOL_SKIP_LAST;
    pool.calls = 0;
    CHECK_OK(vq_set_parallel_for(t.a, test_pool, &pool, 4));
    CHECK_FAIL(attend_hm(t.a, 0, &c, c.out), VQ_ECALLBACK, "parallel");
    CHECK(pool.calls == 1);
    CHECK(vq_rows(t.a, 0) == 0 && vq_offset(t.a, 0) == 0);           /* layer 0 reset */
    CHECK(vq_offset(t.a, 1) == offset1 && vq_rows(t.a, 1) == rows1); /* layer 1 untouched */
    /* The same through vq_update: reset, and no window to fetch. */
    {
      vq_tensor k = tensor_of(c.k, VQ_F32, 1, 4, 64, 32, VQ_HEAD_MAJOR);
      vq_tensor v = tensor_of(c.v, VQ_F32, 1, 4, 64, 32, VQ_HEAD_MAJOR);
      vq_tensor q = tensor_of(c.q, VQ_F32, 1, 8, 64, 32, VQ_HEAD_MAJOR);
      int64_t rows = -7;
      float* keys = floats(k_count(shape_big(200)));
      CHECK_FAIL(vq_update(t.a, 1, &k, &v, &q, &rows), VQ_ECALLBACK, "parallel");
      CHECK(vq_rows(t.a, 1) == 0 && vq_offset(t.a, 1) == 0);
      CHECK_FAIL(vq_fetch(t.a, 1, keys, NULL, VQ_HEAD_MAJOR), VQ_ESTATE, "layer");
      free(keys);
    }
    /* A pool that runs a task twice: the same. */
    pool.mode = POOL_REPEAT_FIRST;
    CHECK_FAIL(attend_hm(t.a, 1, &c, c.out), VQ_ECALLBACK, "parallel");
    CHECK(vq_rows(t.a, 1) == 0 && vq_offset(t.a, 1) == 0);
    /* A pool that runs its last task after returning: the call failed (the task had not run);
     * the late task then does nothing (it must not touch the finished call), and the layer
     * takes the next call. */
    pool.mode = POOL_LATE;
    pool.late_task = NULL;
    CHECK_FAIL(attend_hm(t.a, 1, &c, c.out), VQ_ECALLBACK, "parallel");
    CHECK(pool.late_task != NULL);
    if (pool.late_task != NULL) pool.late_task(pool.late_ctx, pool.late_index);
    CHECK(vq_rows(t.a, 1) == 0 && vq_offset(t.a, 1) == 0);
    pool.mode = POOL_ALL;
    CHECK_OK(attend_hm(t.a, 1, &c, c.out));
    CHECK(vq_offset(t.a, 1) == 64);
    call_free(&c);
  }

  /* A fork keeps the pool it was lent (KVCacheBuilder::fork copies the parallel-for): a pool that
   * then skips a task fails the fork's call with VQ_ECALLBACK and resets the fork's layer, and
   * leaves the source alone. */
  {
    pool_t lent = {POOL_ALL, 0, 0, NULL, NULL, 0};
    vq_caches* src = new_set("h2o", 32, 1, VQ_HALF);
    vq_caches* fork = NULL;
    call_t c = call_new(shape_big(64), 2650u);
    call_t c2 = call_new(shape_big(64), 2651u);
    CHECK_OK(vq_set_parallel_for(src, test_pool, &lent, 4));
    CHECK_OK(attend_hm(src, 0, &c, c.out));
    CHECK(lent.calls == 1);
    CHECK_OK(vq_fork(src, &fork));
    if (fork != NULL) {
      const int64_t src_offset = vq_offset(src, 0), src_rows = vq_rows(src, 0);
      CHECK_OK(attend_hm(fork, 0, &c2, c2.out));
      CHECK(lent.calls == 2); /* the fork runs on the pool too */
      lent.mode = POOL_SKIP_LAST;
      CHECK_FAIL(attend_hm(fork, 0, &c, c.out), VQ_ECALLBACK, "parallel");
      CHECK(vq_rows(fork, 0) == 0 && vq_offset(fork, 0) == 0);
      CHECK(vq_offset(src, 0) == src_offset && vq_rows(src, 0) == src_rows);
      /* and the source's own failure is reported as its own */
      CHECK_FAIL(attend_hm(src, 0, &c2, c2.out), VQ_ECALLBACK, "parallel");
      CHECK(vq_rows(src, 0) == 0 && vq_offset(src, 0) == 0);
      vq_caches_free(fork);
    }
    call_free(&c);
    call_free(&c2);
    vq_caches_free(src);
  }

  /* fn NULL: serial again (workers then unused); the pool is never called. The set, both layers
   * reset, now goes exactly as a fresh one. */
  {
    vq_caches* fresh = new_set("h2o", 32, 2, VQ_HALF);
    const int calls = pool.calls;
    CHECK_OK(vq_set_parallel_for(t.a, NULL, NULL, 0));
    vq_reset(t.a);
    for (i = 0; i < 3; ++i) {
      call_t c = call_new(shape_big(i == 0 ? 64 : 1), 2700u + (uint32_t)i);
      float* out2 = floats(out_count(c.sh));
      CHECK_OK(attend_hm(t.a, 0, &c, c.out));
      CHECK_OK(attend_hm(fresh, 0, &c, out2));
      CHECK(memcmp(c.out, out2, out_count(c.sh) * sizeof(float)) == 0);
      free(out2);
      call_free(&c);
    }
    CHECK(pool.calls == calls);
    vq_caches_free(fresh);
  }
  twin_free(&t);
}

/* ---- 21. metadata
 * ----------------------------------------------------------------------------------- */

static void test_metadata(void) {
  vq_caches* s = new_set("h2o", 8, 1, VQ_HALF);
  vq_caches* loaded = NULL;
  const char* key = NULL;
  const char* value = "sentinel";
  char path[1200];
  path_in_dir(path, sizeof path, "metadata.vqkv");

  CHECK(vq_metadata_count(s) == 0);
  CHECK_OK(vq_metadata_get(s, "absent", &value));
  CHECK(value == NULL);
  CHECK_FAIL(vq_metadata_at(s, 0, &key, &value), VQ_EINVAL, "range");
  CHECK_OK(vq_metadata_set(s, "b", "2"));
  CHECK_OK(vq_metadata_set(s, "a", "1"));
  CHECK_OK(vq_metadata_set(s, "c", "three\nlines\tand \xC3\xA9"));
  CHECK_OK(vq_metadata_set(s, "empty", ""));
  CHECK(vq_metadata_count(s) == 4);
  /* In key order. */
  CHECK_OK(vq_metadata_at(s, 0, &key, &value));
  CHECK(key != NULL && value != NULL && strcmp(key, "a") == 0 && strcmp(value, "1") == 0);
  CHECK_OK(vq_metadata_at(s, 1, &key, &value));
  CHECK(key != NULL && value != NULL && strcmp(key, "b") == 0 && strcmp(value, "2") == 0);
  CHECK_OK(vq_metadata_at(s, 3, &key, &value));
  CHECK(key != NULL && value != NULL && strcmp(key, "empty") == 0 && value[0] == '\0');
  CHECK_FAIL(vq_metadata_at(s, 4, &key, &value), VQ_EINVAL, "range");
  CHECK_FAIL(vq_metadata_at(s, -1, &key, &value), VQ_EINVAL, "range");
  CHECK_OK(vq_metadata_get(s, "b", &value));
  CHECK(value != NULL && strcmp(value, "2") == 0);
  /* Replace, erase (value NULL), erase of an absent key. */
  CHECK_OK(vq_metadata_set(s, "b", "22"));
  CHECK_OK(vq_metadata_get(s, "b", &value));
  CHECK(value != NULL && strcmp(value, "22") == 0);
  CHECK(vq_metadata_count(s) == 4);
  CHECK_OK(vq_metadata_set(s, "a", NULL));
  CHECK(vq_metadata_count(s) == 3);
  CHECK_OK(vq_metadata_get(s, "a", &value));
  CHECK(value == NULL);
  CHECK_OK(vq_metadata_set(s, "never-set", NULL));
  CHECK(vq_metadata_count(s) == 3);
  CHECK_OK(vq_metadata_at(s, 0, &key, &value));
  CHECK(key != NULL && strcmp(key, "b") == 0);

  /* Saved and loaded with the set. */
  feed(s, 1, 3, 2800u);
  CHECK_OK(vq_save(s, path));
  CHECK_OK(vq_load(path, &loaded));
  CHECK(loaded != NULL);
  if (loaded != NULL) {
    int i;
    CHECK(vq_metadata_count(loaded) == 3);
    for (i = 0; i < 3; ++i) {
      const char *k1 = NULL, *v1 = NULL, *k2 = NULL, *v2 = NULL;
      CHECK_OK(vq_metadata_at(s, i, &k1, &v1));
      CHECK_OK(vq_metadata_at(loaded, i, &k2, &v2));
      CHECK(k1 != NULL && k2 != NULL && v1 != NULL && v2 != NULL && strcmp(k1, k2) == 0 &&
            strcmp(v1, v2) == 0);
    }
    CHECK_OK(vq_metadata_get(loaded, "c", &value));
    CHECK(value != NULL && strcmp(value, "three\nlines\tand \xC3\xA9") == 0);
    vq_caches_free(loaded);
  }
  CHECK(remove(path) == 0);
  vq_caches_free(s);
}

/* ---- 22. save and load: every storage type continues bit for bit
 * --------------------------------- */

static void save_load_round_trip(const char* method, vq_storage storage, const char* key_bits,
                                 const char* value_bits, int rounds) {
  vq_config* c = config_of(method, 8);
  vq_caches* a;
  vq_caches* loaded = SENTINEL_CACHES;
  vq_caches* again = NULL;
  vq_storage st = (vq_storage)99;
  char path[1200], path2[1200], name[128];
  int i, l;
  if (key_bits != NULL) {
    CHECK_OK(vq_config_set(c, "key_bits", key_bits));
    CHECK_OK(vq_config_set(c, "value_bits", value_bits));
    CHECK_OK(vq_config_set(c, "quant_group", "8"));
  }
  a = caches_of(c, 3, storage);
  vq_config_free(c);
  snprintf(name, sizeof name, "round_trip_%s_%d.vqkv", method, (int)storage);
  path_in_dir(path, sizeof path, name);
  snprintf(name, sizeof name, "round_trip_%s_%d_again.vqkv", method, (int)storage);
  path_in_dir(path2, sizeof path2, name);

  CHECK_OK(vq_metadata_set(a, "prompt", "Once upon a time"));
  if (rounds > 0) feed(a, 3, rounds, 2900u);
  CHECK_OK(vq_save(a, path));
  CHECK(file_exists(path));
  CHECK_OK(vq_save(a, path)); /* replaces the file */
  CHECK_OK(vq_load(path, &loaded));
  CHECK(loaded != NULL && loaded != SENTINEL_CACHES);
  if (loaded == NULL || loaded == SENTINEL_CACHES) {
    vq_caches_free(a);
    remove(path);
    return;
  }
  CHECK_OK(vq_storage_of(loaded, &st));
  CHECK(st == storage);
  CHECK(vq_layers(loaded) == 3);
  CHECK_SAME_STATE(loaded, a);
  /* Saving what was loaded gives the same bytes (the format is canonical). */
  CHECK_OK(vq_save(loaded, path2));
  {
    size_t n1 = 0, n2 = 0;
    unsigned char* b1 = read_all(path, &n1);
    unsigned char* b2 = read_all(path2, &n2);
    CHECK(b1 != NULL && b2 != NULL && n1 == n2 && n1 > 0 && memcmp(b1, b2, n1) == 0);
    free(b1);
    free(b2);
  }
  /* Both continue exactly alike. */
  for (i = 0; i < 5; ++i)
    for (l = 0; l < 3; ++l) SAME_STEP(a, loaded, l, i == 2 ? 3 : 1, 3000u + (uint32_t)(i * 3 + l));
  if (rounds == 0) {
    for (l = 0; l < 3; ++l) SAME_STEP(a, loaded, l, 6, 3100u + (uint32_t)l);
  }
  /* And a second load of the same file is the same again. */
  CHECK_OK(vq_load(path2, &again));
  if (again != NULL) {
    CHECK_OK(vq_storage_of(again, &st));
    CHECK(st == storage);
    vq_caches_free(again);
  }
  CHECK(remove(path) == 0);
  CHECK(remove(path2) == 0);
  vq_caches_free(loaded);
  vq_caches_free(a);
}

static void test_save_load(void) {
  static const vq_storage storages[3] = {VQ_HALF, VQ_BFLOAT16, VQ_FLOAT};
  int i;
  for (i = 0; i < 3; ++i) {
    save_load_round_trip("squeeze", storages[i], NULL, NULL, 5);
    save_load_round_trip("h2o", storages[i], NULL, NULL, 4);
    save_load_round_trip("squeeze", storages[i], NULL, NULL, 0); /* before any call */
  }
  save_load_round_trip("pyramidkv", VQ_HALF, NULL, NULL, 4);
  save_load_round_trip("streaming_llm", VQ_BFLOAT16, NULL, NULL, 4);
  save_load_round_trip("h2o", VQ_HALF, "8", "4", 4); /* quantized rows */
}

/* ---- 23. load: missing, unreadable, empty, truncated, corrupt, foreign files --------------------
 */

static void expect_load_fails_at(const char* path, vq_status want, const char* needle,
                                 const char* what, const char* file, int line) {
  vq_caches* out = SENTINEL_CACHES;
  prime_error();
  {
    const vq_status st = vq_load(path, &out);
    check_fail_at(st, want, needle, what, file, line);
    check_at(out == NULL, "vq_load sets *out to NULL on failure", file, line);
    if (out != NULL && out != SENTINEL_CACHES) vq_caches_free(out);
  }
}
#define EXPECT_LOAD_FAILS(path, want, needle, what) \
  expect_load_fails_at((path), (want), (needle), (what), __FILE__, __LINE__)

/* Every prefix and every byte flipped of a real file: VQ_EFORMAT. */
static void corrupt_file_cases(const char* method, vq_storage storage, const char* tag) {
  vq_caches* s = new_set(method, 6, 2, storage);
  char path[1200], bad[1200], name[128], what[256];
  unsigned char* bytes;
  unsigned char* copy;
  size_t n = 0, len, off;
  snprintf(name, sizeof name, "good_%s.vqkv", tag);
  path_in_dir(path, sizeof path, name);
  snprintf(name, sizeof name, "bad_%s.vqkv", tag);
  path_in_dir(bad, sizeof bad, name);
  CHECK_OK(vq_metadata_set(s, "k", "v"));
  feed(s, 2, 3, 3200u);
  CHECK_OK(vq_save(s, path));
  bytes = read_all(path, &n);
  CHECK(bytes != NULL && n > 64);
  if (bytes == NULL) {
    vq_caches_free(s);
    return;
  }
  {
    vq_caches* loaded = NULL;
    CHECK_OK(vq_load(path, &loaded)); /* the file itself is good */
    vq_caches_free(loaded);
  }
  /* Truncated: every prefix (0 is the empty file). */
  for (len = 0; len < n; ++len) {
    CHECK(write_all(bad, bytes, len));
    snprintf(what, sizeof what, "vq_load of the first %lu of %lu bytes (%s)", (unsigned long)len,
             (unsigned long)n, tag);
    EXPECT_LOAD_FAILS(bad, VQ_EFORMAT, NULL, what);
  }
  /* Corrupt: every byte inverted, and one bit of every 7th byte. */
  copy = (unsigned char*)xcalloc(n, 1);
  for (off = 0; off < n; ++off) {
    memcpy(copy, bytes, n);
    copy[off] = (unsigned char)(copy[off] ^ 0xFFu);
    CHECK(write_all(bad, copy, n));
    snprintf(what, sizeof what, "vq_load with byte %lu of %lu inverted (%s)", (unsigned long)off,
             (unsigned long)n, tag);
    EXPECT_LOAD_FAILS(bad, VQ_EFORMAT, NULL, what);
    if (off % 7u == 3u) {
      copy[off] = (unsigned char)(bytes[off] ^ 0x01u);
      CHECK(write_all(bad, copy, n));
      snprintf(what, sizeof what, "vq_load with bit 0 of byte %lu flipped (%s)", (unsigned long)off,
               tag);
      EXPECT_LOAD_FAILS(bad, VQ_EFORMAT, NULL, what);
    }
  }
  /* More data after the file. */
  free(copy);
  copy = (unsigned char*)xcalloc(n + 1, 1);
  memcpy(copy, bytes, n);
  copy[n] = 'x';
  CHECK(write_all(bad, copy, n + 1));
  EXPECT_LOAD_FAILS(bad, VQ_EFORMAT, NULL, "vq_load of a good file followed by one more byte");
  /* Two copies back to back. */
  free(copy);
  copy = (unsigned char*)xcalloc(2 * n, 1);
  memcpy(copy, bytes, n);
  memcpy(copy + n, bytes, n);
  CHECK(write_all(bad, copy, 2 * n));
  EXPECT_LOAD_FAILS(bad, VQ_EFORMAT, NULL, "vq_load of a file written twice");
  free(copy);
  free(bytes);
  CHECK(remove(bad) == 0);
  CHECK(remove(path) == 0);
  vq_caches_free(s);
}

static void test_load_bad_files(void) {
  char path[1200], dir[1200];
  static const char text[] = "This is not a prompt cache. Once upon a time there was a cat.\n";

  path_in_dir(path, sizeof path, "does_not_exist.vqkv");
  EXPECT_LOAD_FAILS(path, VQ_EIO, "does_not_exist.vqkv", "vq_load of a missing file");
  EXPECT_LOAD_FAILS("", VQ_EIO, NULL, "vq_load of the path \"\"");

  /* A directory: opening it may succeed, reading it fails: a file that cannot be read (VQ_EIO). */
  path_in_dir(dir, sizeof dir, "a_directory");
  CHECK(mkdir(dir, 0700) == 0);
  EXPECT_LOAD_FAILS(dir, VQ_EIO, "a_directory", "vq_load of a directory");
  CHECK(rmdir(dir) == 0);

  path_in_dir(path, sizeof path, "empty.vqkv");
  CHECK(write_all(path, "", 0));
  EXPECT_LOAD_FAILS(path, VQ_EFORMAT, NULL, "vq_load of an empty file");
  CHECK(remove(path) == 0);

  path_in_dir(path, sizeof path, "foreign.txt");
  CHECK(write_all(path, text, sizeof text - 1));
  EXPECT_LOAD_FAILS(path, VQ_EFORMAT, NULL, "vq_load of a text file");
  CHECK(write_all(path, "VQKV", 4));
  EXPECT_LOAD_FAILS(path, VQ_EFORMAT, NULL, "vq_load of a 4-byte text file");
  {
    /* The magic, then a version from the future. */
    static const unsigned char future[24] = {0x89, 'V', 'Q', 'K', 'V', 0x0D, 0x0A, 0x1A,
                                             99,   0,   0,   0,   1,   0,    0,    0};
    CHECK(write_all(path, future, sizeof future));
    EXPECT_LOAD_FAILS(path, VQ_EFORMAT, NULL, "vq_load of a newer version's file");
  }
  CHECK(remove(path) == 0);

  corrupt_file_cases("squeeze", VQ_HALF, "squeeze_half");
  corrupt_file_cases("h2o", VQ_FLOAT, "h2o_float");
}

/* ---- 24. save: paths that cannot be written
 * -------------------------------------------------------- */

static void test_save_bad_paths(void) {
  vq_caches* s = new_set("h2o", 8, 2, VQ_HALF);
  snap_t before;
  char path[1200], dir[1200];
  feed(s, 2, 3, 3300u);
  before = snap_of(s);
  path_in_dir(path, sizeof path, "no_such_directory/x.vqkv");
  CHECK_FAIL(vq_save(s, path), VQ_EIO, "no_such_directory");
  CHECK(!file_exists(path));
  CHECK_FAIL(vq_save(s, ""), VQ_EIO, NULL);

  /* An existing directory at the path: cannot be replaced; it survives, nothing is left behind
   * (the final rmdir of the work directory checks no temporary file stayed). */
  path_in_dir(dir, sizeof dir, "save_target_directory");
  CHECK(mkdir(dir, 0700) == 0);
  CHECK_FAIL(vq_save(s, dir), VQ_EIO, "save_target_directory");
  CHECK(rmdir(dir) == 0);
  CHECK_UNCHANGED(before, s);

  /* A file at the path is left as it was by a failed save that names it as a directory
   * ("<file>/": nothing can be created under a file). */
  path_in_dir(path, sizeof path, "survivor.vqkv");
  CHECK_OK(vq_save(s, path));
  {
    size_t n1 = 0, n2 = 0;
    unsigned char* b1 = read_all(path, &n1);
    unsigned char* b2;
    char slash[1300];
    snprintf(slash, sizeof slash, "%s/", path);
    CHECK_FAIL(vq_save(s, slash), VQ_EIO, NULL);
    b2 = read_all(path, &n2);
    CHECK(b1 != NULL && b2 != NULL && n1 == n2 && memcmp(b1, b2, n1) == 0);
    free(b1);
    free(b2);
  }
  CHECK(remove(path) == 0);
  vq_caches_free(s);
}

/* ---- 25. the message: kept after successes, never NULL ------------------------------------------
 */

/* ---- adaptive head budgets (docs/design.md 4.9)
 * ------------------------------------------------------------------ */

/* The rows every head of layer 0 holds, summed, and whether two heads differ. */
static int64_t held_rows(const vq_caches* s, int heads, int* ragged) {
  int64_t sum = 0;
  int h;
  *ragged = 0;
  for (h = 0; h < heads; ++h) {
    const int64_t n = vq_head_rows(s, 0, 0, h);
    sum += n;
    if (n != vq_head_rows(s, 0, 0, 0)) *ragged = 1;
  }
  return sum;
}

/* A call of random rows (grid rows give both heads the same attention) to both sets of a twin:
 * outputs bit-identical. */
static void random_twin_step(twin_t* t, int seq) {
  call_t c = call_new(shape_std(seq), t->seed);
  float* out_b = floats(out_count(c.sh));
  fill_any(c.q, q_count(c.sh), t->seed * 3u + 1u);
  fill_any(c.k, k_count(c.sh), t->seed * 3u + 2u);
  fill_any(c.v, v_count(c.sh), t->seed * 3u + 3u);
  ++t->seed;
  CHECK_OK(attend_hm(t->a, 0, &c, c.out));
  CHECK_OK(attend_hm(t->b, 0, &c, out_b));
  CHECK(memcmp(c.out, out_b, out_count(c.sh) * sizeof(float)) == 0);
  free(out_b);
  call_free(&c);
}

static void test_adaptive_heads(void) {
  enum { BUDGET = 8, H = 2, STEPS = 24 };
  vq_config* c = config_of("h2o", BUDGET);
  vq_config* bad;
  twin_t t;
  int step, ragged = 0, h;
  int64_t rows = -1, most = 0;
  char path[1200];
  vq_caches* loaded = NULL;
  float junk[64];

  /* The fields by name: bad values are refused when the set is built, naming the field. */
  bad = vq_config_copy(c);
  CHECK_OK(vq_config_set(bad, "head_budgets", "per_head"));
  CHECK_FAIL(vq_config_validate(bad), VQ_EINVAL, "head_budgets");
  CHECK_OK(vq_config_set(bad, "head_budgets", "adaptive"));
  CHECK_OK(vq_config_validate(bad));
  CHECK_OK(vq_config_set(bad, "head_budget_floor", "0"));
  CHECK_FAIL(vq_config_validate(bad), VQ_EINVAL, "head_budget_floor");
  CHECK_OK(vq_config_set(bad, "head_budget_floor", "1.5"));
  CHECK_FAIL(vq_config_validate(bad), VQ_EINVAL, "head_budget_floor");
  {
    vq_caches* none = (vq_caches*)&junk;
    CHECK_FAIL(vq_caches_new(bad, 1, VQ_FLOAT, &none), VQ_EINVAL, "head_budget_floor");
    CHECK(none == NULL);
  }
  vq_config_free(bad);

  CHECK_OK(vq_config_set(c, "head_budgets", "adaptive"));
  CHECK_OK(vq_config_set(c, "head_budget_floor", "0.25"));
  CHECK_OK(vq_config_set(c, "h2o_grace", "1"));
  t.a = caches_of(c, 1, VQ_FLOAT);
  t.b = caches_of(c, 1, VQ_FLOAT);
  t.seed = 7000u;
  t.shape = shape_std;
  vq_config_free(c);

  CHECK(vq_head_rows(t.a, 0, 0, 0) == 0); /* before the layer's first call, as vq_rows */
  CHECK(vq_head_rows(t.a, 0, 3, 7) == 0);
  /* A prompt, then decode steps: each sequence's heads share 2 x 8 rows, each keeps 2 at least. */
  random_twin_step(&t, 12);
  for (step = 0; step < STEPS; ++step) {
    int now_ragged = 0;
    random_twin_step(&t, 1);
    CHECK(held_rows(t.a, H, &now_ragged) == H * BUDGET);
    for (h = 0; h < H; ++h) CHECK(vq_head_rows(t.a, 0, 0, h) >= 2);
    ragged |= now_ragged;
  }
  CHECK(ragged); /* random rows do make the heads differ (else nothing below is tested) */
  for (h = 0; h < H; ++h) {
    if (vq_head_rows(t.a, 0, 0, h) > most) most = vq_head_rows(t.a, 0, 0, h);
  }
  CHECK(vq_rows(t.a, 0) == most);
  /* tokens_kept is head (0, 0)'s, as the reference counts it; vq_rows the most any head holds. */
  CHECK(vq_layer_tokens_kept(t.a, 0) == vq_head_rows(t.a, 0, 0, 0));
  CHECK(vq_layer_kept_bytes(t.a, 0) == (size_t)(H * BUDGET) * (8 + 8) * sizeof(float));

  /* vq_head_rows: bad handles and heads. */
  CHECK_FAIL_VALUE(vq_head_rows(NULL, 0, 0, 0) == -1, "NULL");
  CHECK_FAIL_VALUE(vq_head_rows(t.a, 1, 0, 0) == -1, "layer");
  CHECK_FAIL_VALUE(vq_head_rows(t.a, 0, 1, 0) == -1, "head (1, 0)");
  CHECK_FAIL_VALUE(vq_head_rows(t.a, 0, 0, H) == -1, "head (0, 2)");
  CHECK_FAIL_VALUE(vq_head_rows(t.a, 0, -1, 0) == -1, "head (-1, 0)");

  /* vq_update works on ragged heads (the longest head's rows); vq_fetch refuses, changing nothing
   * (the same call went to the twin through vq_update as well). */
  {
    call_t u = call_new(shape_std(1), 7777u);
    fill_any(u.q, q_count(u.sh), 7778u);
    fill_any(u.k, k_count(u.sh), 7779u);
    vq_tensor tk = tensor_of(u.k, VQ_F32, 1, 2, 1, 8, VQ_HEAD_MAJOR);
    vq_tensor tv = tensor_of(u.v, VQ_F32, 1, 2, 1, 8, VQ_HEAD_MAJOR);
    vq_tensor tq = tensor_of(u.q, VQ_F32, 1, 4, 1, 8, VQ_HEAD_MAJOR);
    int64_t rows_b = -1;
    int64_t longest = 0;
    /* The window's longest head: its rows before the call plus the call's one. */
    for (h = 0; h < H; ++h) {
      if (vq_head_rows(t.a, 0, 0, h) > longest) longest = vq_head_rows(t.a, 0, 0, h);
    }
    CHECK_OK(vq_update(t.a, 0, &tk, &tv, &tq, &rows));
    CHECK(rows == longest + 1);
    CHECK_OK(vq_update(t.b, 0, &tk, &tv, &tq, &rows_b));
    CHECK(rows == rows_b);
    (void)held_rows(t.a, H, &ragged);
    CHECK(ragged);
    {
      const snap_t before = snap_of(t.a);
      CHECK_FAIL(vq_fetch(t.a, 0, g_junk_out, g_junk_out, VQ_HEAD_MAJOR), VQ_EINVAL,
                 "different numbers of rows");
      CHECK_UNCHANGED(before, t.a);
    }
    call_free(&u);
  }
  CHECK_TWIN(t, 0);

  /* Saved and loaded: the same heads, and the next steps bit-identical to the set saved. */
  path_in_dir(path, sizeof path, "adaptive.vqkv");
  CHECK_OK(vq_save(t.a, path));
  CHECK_OK(vq_load(path, &loaded));
  for (h = 0; h < H; ++h) CHECK(vq_head_rows(loaded, 0, 0, h) == vq_head_rows(t.a, 0, 0, h));
  CHECK_SAME_STATE(loaded, t.a);
  vq_caches_free(t.b);
  t.b = loaded;
  CHECK_TWIN(t, 0);
  CHECK_TWIN(t, 0);
  remove(path);
  twin_free(&t);
}

static void test_last_error_rules(void) {
  vq_config* c = vq_config_new();
  char first[1024], later[1024];
  CHECK(vq_config_set(c, "no_such_field_for_the_message", "1") == VQ_EINVAL);
  copy_last_error(first, sizeof first);
  CHECK(strstr(first, "no_such_field_for_the_message") != NULL);
  /* Successful calls do not touch it: it is the message of the last *failing* call. */
  CHECK_OK(vq_config_set(c, "method", "h2o"));
  CHECK_OK(vq_config_validate(c));
  CHECK(vq_abi_version() == VQ_ABI_VERSION);
  copy_last_error(later, sizeof later);
  CHECK(strcmp(first, later) == 0);
  /* The next failure replaces it. */
  CHECK(vq_config_validate(NULL) == VQ_EINVAL);
  copy_last_error(later, sizeof later);
  CHECK(strcmp(first, later) != 0 && strstr(later, "NULL") != NULL);
  CHECK(vq_last_error() != NULL);
  vq_config_free(c);
}

/* ---- main
 * ------------------------------------------------------------------------------------------ */

typedef struct {
  const char* name;
  void (*run)(void);
} group_t;

int main(void) {
  static const group_t groups[] = {
      {"abi_and_errors", test_abi_and_errors},
      {"config_fields", test_config_fields},
      {"config_bad_values", test_config_bad_values},
      {"config_validate", test_config_validate},
      {"caches_new", test_caches_new},
      {"null_arguments", test_null_arguments},
      {"layer_range", test_layer_range},
      {"attend_bad_shapes", test_attend_bad_shapes},
      {"attend_ex_bad_inputs", test_attend_ex_bad_inputs},
      {"update_bad_inputs", test_update_bad_inputs},
      {"seq_zero", test_seq_zero},
      {"attend_layouts", test_attend_layouts},
      {"attend_reference", test_attend_reference},
      {"attend_ex_dtypes", test_attend_ex_dtypes},
      {"update_fetch", test_update_fetch},
      {"fetch_state", test_fetch_state},
      {"counters", test_counters},
      {"diagnostics", test_diagnostics},
      {"caches_new_dims", test_caches_new_dims},
      {"reset", test_reset},
      {"fork", test_fork},
      {"kvzip", test_kvzip},
      {"memory_pool", test_memory_pool},
      {"checkpoint_rollback", test_checkpoint_rollback},
      {"parallel_for", test_parallel_for},
      {"metadata", test_metadata},
      {"save_load", test_save_load},
      {"load_bad_files", test_load_bad_files},
      {"save_bad_paths", test_save_bad_paths},
      {"adaptive_heads", test_adaptive_heads},
      {"last_error_rules", test_last_error_rules},
  };
  const size_t n_groups = sizeof groups / sizeof groups[0];
  const char* tmp = getenv("TMPDIR");
  const int verbose = getenv("VQ_TEST_VERBOSE") != NULL;
  size_t i;
  int failed_groups = 0;

  /* The first group checks vq_last_error() before any vq_ call has failed: run it first. */
  g_group = groups[0].name;
  groups[0].run();
  if (verbose || g_failures != 0) {
    fprintf(stderr, "  %-22s %6ld checks, %ld failed\n", groups[0].name, g_checks, g_failures);
  }
  if (g_failures != 0) ++failed_groups;

  g_prime = vq_config_new();
  if (g_prime == NULL) {
    fprintf(stderr, "test_c_api: vq_config_new returned NULL\n");
    return 2;
  }
  if (tmp == NULL || tmp[0] == '\0') tmp = "/tmp";
  snprintf(g_dir, sizeof g_dir, "%s/vq_c_api_%ld_%ld", tmp, (long)getpid(), (long)time(NULL));
  if (mkdir(g_dir, 0700) != 0) {
    fprintf(stderr, "test_c_api: cannot create %s\n", g_dir);
    return 2;
  }
  g_dir_made = 1;

  for (i = 1; i < n_groups; ++i) {
    const long failures = g_failures, checks = g_checks;
    g_group = groups[i].name;
    groups[i].run();
    if (g_failures != failures) ++failed_groups;
    if (verbose || g_failures != failures) {
      fprintf(stderr, "  %-22s %6ld checks, %ld failed\n", groups[i].name, g_checks - checks,
              g_failures - failures);
    }
  }
  g_group = "cleanup";
  /* Every file a test made is gone (nor did a failed save leave a temporary file): rmdir works. */
  if (g_dir_made) CHECK(rmdir(g_dir) == 0);
  vq_config_free(g_prime);

  printf("test_c_api: %ld checks in %lu groups, %ld failed (%d groups with failures)\n", g_checks,
         (unsigned long)n_groups, g_failures, failed_groups);
  return g_failures == 0 ? 0 : 1;
}
