/* kvcache's C API: the caches, persistence and attention for runtimes written in C (or anything
 * with a C FFI). Consumers write #include <kvcache/kvcache_c.h> and link kvcache::kvcache (a C++
 * static library: link with the C++ driver, as CMake does for its imported targets).
 *
 * It is a thin layer over the C++ API in <kvcache/kvcache.h>: the same caches, the same rules
 * (SEMANTICS.md), the same guarantees. Every call that can fail returns a kvc_code; KVC_OK is 0.
 * A failing call leaves the cache as it was, with the C++ API's two documented limits (a wrapper's
 * Remove stops at the first child that fails, SEMANTICS.md section 10; a shift callback that fails
 * after earlier calls succeeded is undone by calling it again with the opposite deltas), and
 * kvc_last_error() then names what was wrong (a message kept per thread, overwritten by the next
 * failing call on that thread). No call
 * allocates in steady-state decode (kvc_start_forward, kvc_put, kvc_get, kvc_attend), as in C++.
 * Nothing here keeps global state besides that per-thread message.
 *
 * Handles are opaque and owned by the caller: free each with its _free function (NULL is
 * ignored). A handle is used by one thread at a time, with the C++ API's reader rules (README,
 * "Thread safety"): between two changes of a cache, kvc_attend on its histories, kvc_save and
 * kvc_can_resume may run concurrently.
 *
 * Tensors are views in ggml order: ne[0] is the fastest dimension, nb[] are byte strides
 * (kvc_make_tensor fills a contiguous one). Views returned by kvc_get / kvc_seq_update point into
 * the cache and stay valid until the next call that changes it (see core/cache.h). */
#ifndef KVCACHE_CORE_KVCACHE_C_H_
#define KVCACHE_CORE_KVCACHE_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Storage and tensor element types (values equal kv::DType's). */
typedef enum kvc_dtype {
  KVC_F32 = 0,
  KVC_F16 = 1,
  KVC_BF16 = 2,
  KVC_Q8_0 = 3, /* blocks of 32: one f16 scale + 32 int8 codes (34 bytes), as llama.cpp */
  KVC_Q4_0 = 4, /* blocks of 32: one f16 scale + 16 bytes of 4-bit codes (18 bytes) */
  /* Not types: they make every int32 a value of the enum, so that any value a C caller passes is
   * an error the library reports (KVC_INVALID_ARGUMENT), not undefined behaviour in its C++. */
  KVC_DTYPE_RANGE_MIN_ = INT32_MIN,
  KVC_DTYPE_RANGE_MAX_ = INT32_MAX
} kvc_dtype;

/* Results (values equal kv::Code's). */
typedef enum kvc_code {
  KVC_OK = 0,
  KVC_CACHE_FULL = 1,
  KVC_NOT_SUPPORTED = 2,
  KVC_INVALID_ARGUMENT = 3,
  KVC_OUT_OF_MEMORY = 4,
  KVC_CORRUPT = 5,
  KVC_CODE_RANGE_MIN_ = INT32_MIN, /* not codes: every int32 is a value (see kvc_dtype) */
  KVC_CODE_RANGE_MAX_ = INT32_MAX
} kvc_code;

#define KVC_POS_MAX INT32_MAX /* "to the end" in kvc_remove */

typedef struct kvc_tensor {
  void* data;
  kvc_dtype dtype;
  int64_t ne[4]; /* elements per dimension, ne[0] fastest */
  size_t nb[4];  /* byte stride per dimension (quantized: nb[0] is one block, nb[1] a row) */
} kvc_tensor;

/* A contiguous view of `dims` (1..4) dimensions; the others are 1. */
kvc_tensor kvc_make_tensor(void* data, kvc_dtype dtype, int dims, const int64_t* ne);

/* What kvc_get returns: K [k_head_dim, kv_heads, L], V [v_head_dim, kv_heads, L] (or
 * [L, v_head_dim, kv_heads] with permuted_v), mask [L, B] of 0 / -inf (data NULL: no mask). An
 * encoder returns its K / V as last Put, with data NULL while kvc_encoder_cached is 0.
 * mask_index: the cache's memo of the mask's visible cells (kv::History::mask_index), through
 * which kvc_attend reads the mask once per forward pass instead of once per layer. In a history
 * built by hand: NULL, or a kvc_mask_index of your own (below); set it to NULL when you replace
 * the mask of a kvc_get history with another. v_layout (kv::VLayout): which of V's layouts v is;
 * kvc_get sets KVC_V_PLAIN or KVC_V_PERMUTED. kvc_attend takes it when v's shape fits the layout
 * named, and otherwise (KVC_V_AUTO, any other value) tells by shape as core/attend.h says. */
typedef enum kvc_v_layout { KVC_V_AUTO = 0, KVC_V_PLAIN = 1, KVC_V_PERMUTED = 2 } kvc_v_layout;
typedef struct kvc_history {
  kvc_tensor k, v, mask;
  void* mask_index;
  int32_t v_layout; /* a kvc_v_layout; an int, so that any value a caller leaves is one */
} kvc_history;

/* The message of the last failing call on this thread ("" if none yet). Never NULL. */
const char* kvc_last_error(void);
/* "ok", "cache full", ... */
const char* kvc_code_name(kvc_code code);

/* ---- the Cache interface ------------------------------------------------------------------- */

typedef struct kvc_cache kvc_cache; /* any cache: causal family, encoder or wrapper */

typedef struct kvc_config {
  int32_t padding;      /* history length and cell count are multiples of this (default 1) */
  int permuted_v;       /* nonzero: V stored and returned as [cells, v_head_dim, kv_heads] */
  kvc_dtype mask_dtype; /* KVC_F32 (default) or KVC_F16 */
  int window_inclusive; /* nonzero: a window of W shows W keys, the token included (llama.cpp);
                           0 (default, as Ollama): W + 1 keys */
} kvc_config;
kvc_config kvc_config_default(void);

/* Re-rotates keys after a context shift (kvc_remove): `key` holds the K rows of n cells of
 * `layer`, [k_head_dim, kv_heads, n] in the storage dtype; shift[i] is row i's position delta (0:
 * leave it). Modify in place; return KVC_OK, or an error that kvc_remove passes on. */
typedef kvc_code (*kvc_shift_fn)(void* user, int layer, kvc_tensor key, const int32_t* shift,
                                 int64_t n);

/* How a causal-family cache re-rotates keys. Pass NULL for none (kvc_remove that must shift then
 * returns KVC_NOT_SUPPORTED). Either a caller's function, or the library's RoPE kernel. */
typedef struct kvc_shift {
  kvc_shift_fn fn; /* called when set; the rope fields are then ignored */
  void* user;      /* passed to fn */
  /* fn == NULL: RoPE re-rotation, theta_i = rope_freq_scale * rope_base^(-2i / dims); rope_dims 0
   * rotates all of head_dim; rope_neox pairs (i, i + dims / 2) instead of (2i, 2i + 1). */
  float rope_base;
  float rope_freq_scale;
  int rope_dims;
  int rope_neox;
} kvc_shift;

/* Invalid sizes (a negative window, memory or chunk; 0 means unlimited) are reported by kvc_init,
 * as in C++. */
kvc_cache* kvc_causal_new(const kvc_shift* shift);
kvc_cache* kvc_swa_new(int32_t window, const kvc_shift* shift);
kvc_cache* kvc_swa_mem_new(int32_t window, int32_t memory, const kvc_shift* shift);
kvc_cache* kvc_chunked_new(int32_t chunk, const kvc_shift* shift);
kvc_cache* kvc_encoder_new(void); /* one encoder block for every sequence (as Ollama) */
/* per_sequence != 0: one encoder block per sequence (kv::EncoderOptions::per_sequence); 0: as
 * kvc_encoder_new. */
kvc_cache* kvc_encoder_new_per_sequence(int per_sequence);
/* Combines n >= 1 caches, child i being layer type i. On success the wrapper takes the children's
 * handles: each stays valid as kvc_wrapper_child(wrapper, i) (for the calls of its kind, such as
 * kvc_set_causal or kvc_reserve_layers on a causal child) until the wrapper is freed, which frees
 * them; kvc_cache_free on a child handle does nothing. NULL (children untouched) when n < 1, a
 * child is NULL, a wrapper or already a wrapper's child, or one appears twice. */
kvc_cache* kvc_wrapper_new(kvc_cache** children, int n);
/* Child i of a wrapper (the handle passed to kvc_wrapper_new); NULL when i is out of range or
 * wrapper is not one. */
kvc_cache* kvc_wrapper_child(kvc_cache* wrapper, int i);
void kvc_cache_free(kvc_cache* cache);

kvc_code kvc_set_config(kvc_cache* cache, const kvc_config* config); /* before kvc_init only */
kvc_code kvc_init(kvc_cache* cache, kvc_dtype dtype, int max_sequences, int capacity,
                  int max_batch);
/* n tokens: positions[i] in sequence sequences[i]; multimodal: batch indices of tokens that
 * carry encoder input (may be NULL with n_multimodal 0). */
kvc_code kvc_start_forward(kvc_cache* cache, const int32_t* positions, const int32_t* sequences,
                           int32_t n, const int32_t* multimodal, int32_t n_multimodal, int reserve);
void kvc_set_layer(kvc_cache* cache, int layer);
/* key [k_head_dim, kv_heads, batch], value [v_head_dim, kv_heads, batch]; f32, f16 or bf16. */
kvc_code kvc_put(kvc_cache* cache, const kvc_tensor* key, const kvc_tensor* value);
kvc_code kvc_get(kvc_cache* cache, kvc_history* out);
kvc_code kvc_copy_prefix(kvc_cache* cache, int src_seq, int dst_seq, int32_t len);
int kvc_can_resume(const kvc_cache* cache, int seq, int32_t pos); /* 1 or 0 */
kvc_code kvc_remove(kvc_cache* cache, int seq, int32_t begin, int32_t end);
void kvc_close(kvc_cache* cache);

/* Variant-specific calls: KVC_NOT_SUPPORTED on a cache of another kind. */
kvc_code kvc_set_causal(kvc_cache* cache, const int32_t* except, int32_t n); /* causal family */
kvc_code kvc_set_layer_type(kvc_cache* cache, int type);                     /* wrapper */
/* Encoder: 1 when cached, 0 when not; -1 for other kinds. */
int kvc_encoder_cached(const kvc_cache* cache);
/* Causal family: storage for layers [0, layers) in one allocation, so no Put allocates. */
kvc_code kvc_reserve_layers(kvc_cache* cache, int layers, int k_head_dim, int v_head_dim,
                            int kv_heads);
size_t kvc_memory_bytes(const kvc_cache* cache); /* bytes held now (Cache::MemoryBytes) */

/* ---- persistence (core/persistence.h has the stream format) --------------------------------- */

/* seq -1: the whole cache; else that sequence only. kvc_save writes the stream to buf when
 * capacity >= its size; *size receives the size whenever the cache can be saved (untouched when
 * the save itself fails, e.g. before init). buf NULL: size query (KVC_OK); capacity too small:
 * KVC_INVALID_ARGUMENT, nothing written. A failing load leaves the cache unchanged; the one
 * exception is a wrapper that runs out of memory partway, whose children are restored but lose
 * their current forward pass (core/persistence.h). */
kvc_code kvc_save(const kvc_cache* cache, int seq, void* buf, size_t capacity, size_t* size);
kvc_code kvc_load(kvc_cache* cache, const void* bytes, size_t size, int seq);
/* Files are written to a temporary name and renamed into place. */
kvc_code kvc_save_file(const kvc_cache* cache, const char* path, int seq);
kvc_code kvc_load_file(kvc_cache* cache, const char* path, int seq);

/* ---- growing and rotating caches ([B, H, T, D]: ne = {D, T, H, B}) ------------------------- */

typedef struct kvc_seq_cache kvc_seq_cache;
/* As in C++, a bad configuration (an invalid dtype; max_size < 1, keep < 0 or keep >= max_size)
 * still gives a cache, whose kvc_seq_update returns KVC_INVALID_ARGUMENT saying why. */
kvc_seq_cache* kvc_kv_cache_new(kvc_dtype dtype); /* grows in steps of 256 */
/* Holds at most max_size tokens, the first `keep` (attention sinks) never evicted. */
kvc_seq_cache* kvc_rotating_cache_new(int max_size, int keep, kvc_dtype dtype);
void kvc_seq_cache_free(kvc_seq_cache* cache);
/* Appends n tokens (key / value {D, n, H, B}); *keys_out / *values_out receive the history in
 * temporal order, in the storage dtype. */
kvc_code kvc_seq_update(kvc_seq_cache* cache, const kvc_tensor* key, const kvc_tensor* value, int n,
                        kvc_tensor* keys_out, kvc_tensor* values_out);
int kvc_seq_offset(const kvc_seq_cache* cache); /* tokens ever appended */
int kvc_seq_len(const kvc_seq_cache* cache);    /* tokens held now */
void kvc_seq_reset(kvc_seq_cache* cache);
kvc_code kvc_seq_save(const kvc_seq_cache* cache, void* buf, size_t capacity, size_t* size);
kvc_code kvc_seq_load(kvc_seq_cache* cache, const void* bytes, size_t size);
kvc_code kvc_seq_save_file(const kvc_seq_cache* cache, const char* path);
kvc_code kvc_seq_load_file(kvc_seq_cache* cache, const char* path);

/* ---- attention ------------------------------------------------------------------------------ */

typedef struct kvc_attention_params {
  float scale;        /* 0: 1 / sqrt(head_dim) */
  float softcap;      /* 0: none; else logits = softcap * tanh(logits / softcap) */
  const float* sinks; /* optional per-query-head sink logit, added to the softmax denominator */
  int integer_v;      /* q8_0 / q4_0 decode: int16 V pass where AVX512_VNNI (core/attend.h) */
  int integer_k;      /* q8_0 decode: 16-bit query in the integer K pass (core/attend.h) */
} kvc_attention_params;
kvc_attention_params kvc_attention_params_default(void);

/* The library's persistent worker threads (threads counts the caller; < 1 means 1). */
typedef struct kvc_thread_pool kvc_thread_pool;
kvc_thread_pool* kvc_thread_pool_new(int threads);
void kvc_thread_pool_free(kvc_thread_pool* pool);

/* A runtime's own pool: run(user, n, task, ctx) calls task(ctx, i) for every i in [0, n) and
 * returns when all are done. */
typedef struct kvc_parallel_for {
  void (*run)(void* user, int64_t n, void (*task)(void* ctx, int64_t i), void* ctx);
  void* user;
  int num_threads;
} kvc_parallel_for;

/* The mask index of a history built by hand (kv::MaskIndex): with it, the layers of a forward pass
 * that share your mask read it once, not once per kvc_attend (the caches keep their own). Put it in
 * kvc_history.mask_index. It has room for 2 bits per element of a mask of up to max_cells x
 * max_rows. The first kvc_attend after kvc_mask_index_new or _invalidate computes the bits of its
 * mask; later calls with that mask (or some of its rows) reuse them, and a call with another mask
 * (or a larger one) reads it directly. The index cannot see writes into the mask: call
 * kvc_mask_index_invalidate after changing the mask's values and before the next kvc_attend, or
 * calls get the old mask's visible cells. _invalidate and _free not concurrently with a kvc_attend
 * over a history that holds the index. _new returns NULL when a size is below 1 or too large, or
 * memory is short (kvc_last_error says which). */
typedef struct kvc_mask_index kvc_mask_index;
kvc_mask_index* kvc_mask_index_new(int64_t max_cells, int64_t max_rows);
/* whole: the whole mask your histories take rows of (NULL: the mask each call is given). With it,
 * the first kvc_attend for some of its rows computes the bits of all of them, so that calls that
 * each take some rows of one batch share the computation. */
void kvc_mask_index_invalidate(kvc_mask_index* index, const kvc_tensor* whole);
void kvc_mask_index_free(kvc_mask_index* index);

/* q [head_dim, B, n_heads] f32 over a history (kvc_get's, or views of a kvc_seq_cache's);
 * out [v_head_dim, B, n_heads] f32. params NULL: defaults. pool NULL: the calling thread. */
kvc_code kvc_attend(const kvc_tensor* q, const kvc_history* history,
                    const kvc_attention_params* params, kvc_tensor* out, kvc_thread_pool* pool);
kvc_code kvc_attend_parallel(const kvc_tensor* q, const kvc_history* history,
                             const kvc_attention_params* params, kvc_tensor* out,
                             const kvc_parallel_for* parallel);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVCACHE_CORE_KVCACHE_C_H_ */
