/* veloxquant — the C ABI (C99): KV-cache eviction for engines written in C, Rust, Go, Zig, Python
 * or C++ engines that would rather link than compile templates.
 *
 * Link veloxquant_c (static or shared; CMake target veloxquant::c, pkg-config veloxquant-c). The
 * library is the C++ one compiled once; docs/c_abi.md describes every function, and
 * docs/design.md I the decisions behind them.
 *
 *   vq_config* cfg = vq_config_new();
 *   vq_config_set(cfg, "method", "squeeze");
 *   vq_config_set(cfg, "budget", "256");
 *   vq_caches* caches = NULL;
 *   if (vq_caches_new(cfg, n_layers, VQ_HALF, &caches) != VQ_OK) fprintf(stderr, "%s\n",
 *       vq_last_error());
 *   // in layer l's attention, every call (RoPE at position vq_offset(caches, l)):
 *   vq_attend(caches, l, q, k, v, out, 1, n_heads, n_kv_heads, seq, head_dim, VQ_TOKEN_MAJOR);
 *
 * Rules every function keeps: no C++ exception crosses the ABI; a failing call returns a status
 * other than VQ_OK, changes nothing (one exception: VQ_ECALLBACK, below) and sets the message
 * vq_last_error() returns on this thread; a null handle or pointer is VQ_EINVAL, never a crash.
 * Handles are not thread-safe: one thread at a time per vq_caches (different handles are
 * independent). Every shape is [batch, heads, seq, dim] (VQ_HEAD_MAJOR) or [batch, seq, heads,
 * dim] (VQ_TOKEN_MAJOR), dense, dim varying fastest. */
#ifndef VELOXQUANT_VELOXQUANT_H
#define VELOXQUANT_VELOXQUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI's version: the major number changes when a function's meaning or a type's layout does
 * (a program built against another major must not load this library); the minor when functions
 * are added. vq_abi_version() returns the library's VQ_ABI_VERSION. */
#define VQ_ABI_VERSION_MAJOR 1
#define VQ_ABI_VERSION_MINOR 4
#define VQ_ABI_VERSION (VQ_ABI_VERSION_MAJOR * 1000 + VQ_ABI_VERSION_MINOR)

#if defined(_WIN32) && defined(VQ_BUILDING_SHARED)
#define VQ_API __declspec(dllexport)
#elif defined(_WIN32) && defined(VQ_SHARED)
#define VQ_API __declspec(dllimport)
#elif defined(__GNUC__) || defined(__clang__)
#define VQ_API __attribute__((visibility("default")))
#else
#define VQ_API
#endif

typedef struct vq_config vq_config; /* a KVCacheConfig */
typedef struct vq_caches vq_caches; /* one model's cache set, one cache per layer */
typedef struct vq_pool vq_pool;     /* one byte cap over many sets (MemoryPool) */

/* The enums are passed as ints: a C caller may pass any int where one is declared. C++ is told
 * their underlying type is int (VQ_INT_BASE: the size and passing of a C enum of these values),
 * so the library reads any value without undefined behaviour and refuses one outside its enum
 * with VQ_EINVAL, naming it; in C the macro is empty and the ABI is the same as without it. */
#if defined(__cplusplus) && (__cplusplus >= 201103L || defined(_MSC_VER))
#define VQ_INT_BASE : int
#else /* C, or C++98 (no enum base; the library itself is C++17) */
#define VQ_INT_BASE
#endif

typedef enum VQ_INT_BASE {
  VQ_OK = 0,
  VQ_EINVAL,   /* a bad argument: null, shape, field, value, layer; nothing changed */
  VQ_ENOMEM,   /* memory ran out; nothing changed */
  VQ_EIO,      /* a file could not be opened, read, written or renamed */
  VQ_EFORMAT,  /* a file that is empty, truncated, corrupt or not a prompt cache */
  VQ_ESTATE,   /* the set's state refuses the call (a rollback without a checkpoint) */
  VQ_ECALLBACK, /* the engine's parallel-for failed (vq_set_parallel_for): the layer was reset */
  VQ_ENOROOM    /* a memory pool's floors do not fit: queue the request; nothing changed (1.4) */
} vq_status;

/* How rows are stored; how a buffer is ordered; an input buffer's element type. */
typedef enum VQ_INT_BASE { VQ_HALF, VQ_BFLOAT16, VQ_FLOAT } vq_storage;
typedef enum VQ_INT_BASE { VQ_HEAD_MAJOR, VQ_TOKEN_MAJOR } vq_layout;
typedef enum VQ_INT_BASE { VQ_F16, VQ_BF16, VQ_F32, VQ_F64 } vq_dtype;
#undef VQ_INT_BASE

/* ---- version and errors ---------------------------------------------------------------------- */

VQ_API int vq_abi_version(void);             /* VQ_ABI_VERSION of the library */
VQ_API const char* vq_library_version(void); /* the C++ library's version, "0.1.0" */
/* This thread's message for its last failing vq_ call: "" before any failure, never NULL, valid
 * until the thread's next vq_ call. */
VQ_API const char* vq_last_error(void);
VQ_API const char* vq_status_name(vq_status s); /* "VQ_OK", "VQ_EINVAL", ...; "unknown" */

/* ---- configuration --------------------------------------------------------------------------- */

VQ_API vq_config* vq_config_new(void); /* the defaults (method "squeeze"); NULL if out of memory */
VQ_API void vq_config_free(vq_config* c);             /* NULL is fine */
VQ_API vq_config* vq_config_copy(const vq_config* c); /* NULL for NULL or out of memory */
/* Any KVCacheConfig field by its C++ name ("method", "squeeze_budget", "key_bits", ...), the value
 * as text in the C locale ("0.95", "1e-3"; booleans "true", "false", "1", "0"; an optional
 * budget "none" to unset it). "budget" sets every method's budget (KVCacheConfig::set_budget).
 * VQ_EINVAL for an unknown field or a value that does not parse or does not fit the field's type;
 * the values' meaning is checked when caches are built (vq_caches_new). */
VQ_API vq_status vq_config_set(vq_config* c, const char* field, const char* value);
/* The field's value as text, written NUL-terminated into buf (size bytes); *needed (if not NULL)
 * gets the bytes it takes, NUL included. VQ_EINVAL for an unknown field or a buf too small
 * (nothing written then). */
VQ_API vq_status vq_config_get(const vq_config* c, const char* field, char* buf, size_t size,
                               size_t* needed);
/* The i-th field's name (0 <= i < vq_config_field_count()), NULL past the end: every
 * KVCacheConfig field, each readable and settable ("budget", a setter of several, is not one). */
VQ_API int vq_config_field_count(void);
VQ_API const char* vq_config_field_name(int i);
/* VQ_OK when caches could be built from c; else VQ_EINVAL naming the first bad field. */
VQ_API vq_status vq_config_validate(const vq_config* c);

/* ---- a model's cache set --------------------------------------------------------------------- */

/* KVCacheBuilder::for_model(n_layers, config) storing rows as `storage`; validates the config.
 * On failure *out is NULL. */
VQ_API vq_status vq_caches_new(const vq_config* c, int n_layers, vq_storage storage,
                               vq_caches** out);
/* KVCacheBuilder::for_model(layer_head_dims, config): head_dims[i] is layer i's head dim, or 0 for
 * a layer without attention (it gets a standard cache; SqueezeAttention's coordinator and
 * PyramidKV's budgets count the attention layers only). The dims are checked now (1 to 65536,
 * divisible by quant_group when rows are quantized); as in C++, a layer's first call still sets
 * the dims its later calls must match. VQ_EINVAL for n_layers < 1, a negative or too large dim,
 * or a bad config. */
VQ_API vq_status vq_caches_new_dims(const vq_config* c, const int* head_dims, int n_layers,
                                    vq_storage storage, vq_caches** out);
VQ_API void vq_caches_free(vq_caches* s);                            /* NULL is fine */
VQ_API int vq_layers(const vq_caches* s);                            /* -1 for NULL */
VQ_API vq_status vq_storage_of(const vq_caches* s, vq_storage* out); /* VQ_EINVAL for NULL */

/* The fused attention call of layer `layer` (KVCache::attend): absorbs this call's keys and values
 * (kv_heads heads) and writes softmax(q K^T / sqrt(head_dim)) V for every query head (q_heads, a
 * multiple of kv_heads; query head j uses KV head j / (q_heads / kv_heads)) and token, each token
 * seeing the rows kept before the call and the call's rows up to itself. `layout` applies to q,
 * k, v and out. seq = 0 changes nothing and is VQ_OK. */
VQ_API vq_status vq_attend(vq_caches* s, int layer, const float* q, const float* k, const float* v,
                           float* out, int batch, int q_heads, int kv_heads, int seq, int head_dim,
                           vq_layout layout);

/* An input buffer of any element type: data holds batch x heads x seq x dim elements in layout. */
typedef struct vq_tensor {
  const void* data;
  vq_dtype dtype;
  int batch, heads, seq, dim;
  vq_layout layout;
} vq_tensor;

/* vq_attend for inputs of any element type and value rows of their own width (v->dim): out is
 * float, [batch, q->heads, seq, v->dim] in out_layout. */
VQ_API vq_status vq_attend_ex(vq_caches* s, int layer, const vq_tensor* q, const vq_tensor* k,
                              const vq_tensor* v, float* out, vq_layout out_layout);

/* Absorbs a call without attending (KVCache::update_and_view; q may be NULL: the policy's
 * query-free scoring). *rows gets the rows per head of the returned window (the rows kept before
 * the call plus seq), which vq_fetch copies out until the layer's next call. With adaptive head
 * budgets (field "head_budgets", docs/design.md 4.9) or after vq_compress, heads may hold
 * different numbers of rows: *rows is then the longest head's, and vq_fetch refuses (VQ_EINVAL):
 * use vq_attend. */
VQ_API vq_status vq_update(vq_caches* s, int layer, const vq_tensor* k, const vq_tensor* v,
                           const vq_tensor* q, int64_t* rows);
/* Copies the returned window of layer's last vq_update as float: keys [batch, kv_heads, rows,
 * head_dim] and values [..., value_dim] in `layout` (either pointer may be NULL to skip it), each
 * head's rows in ascending position as update_and_fetch returns them (the call's own rows last).
 * VQ_ESTATE when the layer has had no vq_update since the set was built, reset, loaded, forked or
 * rolled back, or after a later vq_attend. */
VQ_API vq_status vq_fetch(const vq_caches* s, int layer, float* keys, float* values,
                          vq_layout layout);

/* The true position of the layer's next token (its RoPE position); -1 for NULL or a bad layer. */
VQ_API int64_t vq_offset(const vq_caches* s, int layer);
/* Rows per KV head the layer keeps after a call (its budget; SqueezeAttention: the coordinator's
 * decision once made); -1 for NULL, a bad layer, or a cache without a budget (standard). */
VQ_API int vq_layer_budget(const vq_caches* s, int layer);
/* Rows per KV head the layer holds now (0 before its first call); with adaptive head budgets, the
 * most any head holds; -1 for NULL or a bad layer. */
VQ_API int64_t vq_rows(const vq_caches* s, int layer);
/* Rows head (b, h) of the layer holds now (adaptive heads differ; 0 before the layer's first
 * call); -1 for NULL, a bad layer, or a head outside the layer's [0, batch) x [0, kv_heads). */
VQ_API int64_t vq_head_rows(const vq_caches* s, int layer, int b, int h);
/* Bytes of rows the whole set holds (KVCache::kept_bytes summed); 0 for NULL. */
VQ_API size_t vq_kept_bytes(const vq_caches* s);
/* Bytes of rows one layer holds (KVCache::kept_bytes; the reference's squeeze_kept_bytes); 0 for
 * NULL or a bad layer. */
VQ_API size_t vq_layer_kept_bytes(const vq_caches* s, int layer);

/* A layer's diagnostics, as the reference names them (KVCache's accounting, docs/design.md 2.2).
 * Bytes the layer would hold if every token were kept: batch x kv_heads x offset x (key dim +
 * value dim) x sizeof the storage type (KVCache::full_seq_bytes); 0 for NULL or a bad layer. */
VQ_API size_t vq_layer_full_seq_bytes(const vq_caches* s, int layer);
/* vq_layer_full_seq_bytes / vq_layer_kept_bytes (> 1: memory saved), 1.0 while the layer holds
 * nothing (KVCache::compression_ratio); -1.0 for NULL or a bad layer. */
VQ_API double vq_layer_compression_ratio(const vq_caches* s, int layer);
/* batch x kv_heads x seq summed over the layer's calls since the set was built or reset
 * (KVCache::tokens_seen); -1 for NULL or a bad layer. */
VQ_API int64_t vq_layer_tokens_seen(const vq_caches* s, int layer);
/* Rows head (0, 0) of the layer holds (KVCache::tokens_kept; vq_rows is the most any head
 * holds, the same unless adaptive heads differ); -1 for NULL or a bad layer. */
VQ_API int64_t vq_layer_tokens_kept(const vq_caches* s, int layer);
/* 1 when KVCache::trim could roll the layer back (only a standard cache: method "standard", or a
 * layer without attention), else 0; -1 for NULL or a bad layer. */
VQ_API int vq_layer_is_trimmable(const vq_caches* s, int layer);
/* A SqueezeAttention layer's measured concentration (SqueezeAttentionCache::concentration: the
 * mean over heads of the keys' mean pairwise cosine similarity, frozen once calibrated; 0.0
 * before its first call); 0.0 for a layer of any other method, which measures none. NaN for NULL
 * or a bad layer (a concentration lies in [-1, 1] and is never NaN). */
VQ_API double vq_layer_concentration(const vq_caches* s, int layer);

VQ_API void vq_reset(vq_caches* s); /* every layer back to empty (before an unrelated sequence) */

/* ---- many sequences (docs/design.md 10) ------------------------------------------------------ */

/* A copy of the set (KVCacheBuilder::fork): both continue independently; metadata copied. */
VQ_API vq_status vq_fork(const vq_caches* s, vq_caches** out);
/* Marks the set's state (KVCacheBuilder::checkpoint); a later checkpoint replaces it. */
VQ_API vq_status vq_checkpoint(vq_caches* s);
/* Returns the set to its checkpoint (KVCacheBuilder::rollback); VQ_ESTATE without one. */
VQ_API vq_status vq_rollback(vq_caches* s);

/* ---- compress once from observed queries (KVzip, SPEC 18, docs/design.md 6.1) --------------- */

/* Scores every row layer keeps by the attention queries q ([batch, q_heads, seq, head_dim], q_heads
 * a multiple of the layer's KV heads, RoPE applied) give it: the most any query and query head of
 * its group gives it (KVCache::observe). Only "kvzip" layers take it; changes no row. Drops the
 * layer's vq_fetch window. */
VQ_API vq_status vq_observe(vq_caches* s, int layer, const vq_tensor* q);
/* vq_observe with the re-read's own keys k ([batch, kv_heads, seq, head_dim], RoPE applied): each
 * query's softmax then also runs over them up to its own token, KVzip's own normalisation
 * (KVCache::observe(q, k)); only the layer's rows are scored. */
VQ_API vq_status vq_observe_keys(vq_caches* s, int layer, const vq_tensor* q, const vq_tensor* k);
/* Keeps ceil(keep x the rows held) rows of the set's kvzip layers, the best-observed over all of
 * their heads with one threshold, every head its floor (KVCacheBuilder::compress); keep in (0, 1].
 * VQ_EINVAL, the set unchanged, for keep outside (0, 1], a layer of another method (standard
 * layers are left alone) or a kvzip layer not observed since its reset. Heads then hold their own
 * numbers of rows (vq_fetch refuses: use vq_attend); drops every vq_fetch window. */
VQ_API vq_status vq_compress(vq_caches* s, double keep);

/* ---- one memory cap over many sequences (MemoryPool, SPEC 19, docs/design.md 10.5) ----------- */

/* A pool of max_bytes bytes (fair shares). Thread-safe: calls on different sets attached to it may
 * run on different threads. */
VQ_API vq_status vq_pool_new(size_t max_bytes, vq_pool** out);
/* Frees the handle; sets still attached stay capped (the pool's state lives while they do). */
VQ_API void vq_pool_free(vq_pool* p);                    /* NULL is fine */
VQ_API size_t vq_pool_max_bytes(const vq_pool* p);       /* 0 for NULL */
VQ_API size_t vq_pool_used_bytes(const vq_pool* p);      /* the attached sets' kept bytes; 0 */
VQ_API size_t vq_pool_floor_bytes(const vq_pool* p);     /* what their floors claim; 0 */
VQ_API int vq_pool_sequences(const vq_pool* p);          /* attached sets; -1 for NULL */
/* vq_caches_new with the set attached to pool: after every call on it, the pool holds at most
 * its cap, taking rows from its sets (every head keeps pool_floor_rows plus its sinks). A layer's
 * first call claims its heads' floors: VQ_ENOROOM, nothing changed, when they do not fit (queue
 * the request). VQ_EINVAL for method "standard" (it never evicts). */
VQ_API vq_status vq_caches_new_pooled(const vq_config* c, int n_layers, vq_storage storage,
                                      vq_pool* pool, vq_caches** out);
/* vq_fork with the copy attached to pool (vq_fork of an attached set joins its pool by itself);
 * VQ_ENOROOM, nothing made, when its floors do not fit. */
VQ_API vq_status vq_fork_pooled(const vq_caches* s, vq_pool* pool, vq_caches** out);
/* vq_load with the loaded set attached to pool; VQ_ENOROOM when its floors do not fit. */
VQ_API vq_status vq_load_pooled(const char* path, vq_pool* pool, vq_caches** out);
/* Detaches s from its pool, if any: its bytes and floors return to the pool; s works on,
 * limited by its policy alone. */
VQ_API vq_status vq_pool_release(vq_caches* s);

/* ---- threads --------------------------------------------------------------------------------- */

/* The engine's thread pool: run task(task_ctx, i) once for every i in [0, tasks), on any threads,
 * and return when all have run. */
typedef void (*vq_task_fn)(void* task_ctx, int task);
typedef void (*vq_parallel_for_fn)(void* pool_ctx, int tasks, vq_task_fn task, void* task_ctx);
/* Lends the pool to every layer (KVCache::set_parallel_for; workers >= 1 threads it runs on);
 * fn NULL returns to serial. Results are bit-identical to serial ones. A pool that skips or
 * repeats a task, or a task that fails, makes the call fail with VQ_ECALLBACK and reset that
 * layer. vq_fork's copy uses the same pool. */
VQ_API vq_status vq_set_parallel_for(vq_caches* s, vq_parallel_for_fn fn, void* pool_ctx,
                                     int workers);

/* ---- prompt caches on disk (docs/design.md G) ------------------------------------------------ */

/* String metadata saved with the set: set (value NULL erases the key), read by key (*value NULL
 * when absent; valid until the set's metadata changes) and enumerated in key order. */
VQ_API vq_status vq_metadata_set(vq_caches* s, const char* key, const char* value);
VQ_API vq_status vq_metadata_get(const vq_caches* s, const char* key, const char** value);
VQ_API int vq_metadata_count(const vq_caches* s); /* -1 for NULL */
VQ_API vq_status vq_metadata_at(const vq_caches* s, int i, const char** key, const char** value);

/* Writes the set and its metadata to path, replaced atomically (an earlier file survives any
 * failure): VQ_EIO when it cannot be written, VQ_EINVAL for a set the format cannot hold (more
 * than 2^32 - 1 metadata entries). */
VQ_API vq_status vq_save(const vq_caches* s, const char* path);
/* A new set from a file vq_save (or save_prompt_cache) wrote, in the file's storage type; it
 * continues exactly where the saved one stood. VQ_EIO for a file that cannot be opened or read,
 * VQ_EFORMAT for one that is empty, truncated, corrupt or foreign. On failure *out is NULL. */
VQ_API vq_status vq_load(const char* path, vq_caches** out);

#ifdef __cplusplus
}
#endif

#endif /* VELOXQUANT_VELOXQUANT_H */
