// The C API (core/kvcache_c.h) over the C++ one. Each handle owns its C++ object and remembers
// which interface it has: the library is built without RTTI, so a handle cannot ask the object.
// Nothing here allocates on the decode path: tensors and batches are converted by value, and the
// per-thread error message is a fixed buffer.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/kvcache_c.h"
#include "core/kvcache_c_interop.h"
#include "core/mask_index.h"
#include "core/persistence.h"
#include "core/rope_shift.h"
#include "core/sequence_cache.h"
#include "core/status.h"
#include "core/thread_pool.h"

// The enums are the C++ ones, value for value.
static_assert(KVC_F32 == static_cast<int>(kv::DType::kF32));
static_assert(KVC_F16 == static_cast<int>(kv::DType::kF16));
static_assert(KVC_BF16 == static_cast<int>(kv::DType::kBF16));
static_assert(KVC_Q8_0 == static_cast<int>(kv::DType::kQ8_0));
static_assert(KVC_Q4_0 == static_cast<int>(kv::DType::kQ4_0));
static_assert(KVC_OK == static_cast<int>(kv::Code::kOk));
static_assert(KVC_CACHE_FULL == static_cast<int>(kv::Code::kCacheFull));
static_assert(KVC_NOT_SUPPORTED == static_cast<int>(kv::Code::kNotSupported));
static_assert(KVC_INVALID_ARGUMENT == static_cast<int>(kv::Code::kInvalidArgument));
static_assert(KVC_OUT_OF_MEMORY == static_cast<int>(kv::Code::kOutOfMemory));
static_assert(KVC_CORRUPT == static_cast<int>(kv::Code::kCorrupt));
static_assert(KVC_POS_MAX == kv::kPosMax);

struct kvc_cache {
  // Null in a wrapper's child handle: the wrapper owns the object, and its handle frees this one
  // (kvc_cache_free ignores a child handle).
  std::unique_ptr<kv::Cache> owned;
  kv::Cache* cache = nullptr;
  // The same object through its variant's interface, where it has one (else null).
  kv::CausalCache* causal = nullptr;
  kv::EncoderCache* encoder = nullptr;
  kv::WrapperCache* wrapper = nullptr;
  // A wrapper's handles of its children (kvc_wrapper_child), in child order.
  std::vector<std::unique_ptr<kvc_cache>> children;
};

struct kvc_seq_cache {
  std::unique_ptr<kv::SequenceCache> cache;
};

// The index first, so that the handle's address is the index's: kvc_history.mask_index carries it
// as void* and kv::HistoryFromC casts it back to kv::MaskIndex*.
// (A raw pointer: std::unique_ptr is not standard-layout.)
struct kvc_mask_index {
  kvc_mask_index() = default;
  kvc_mask_index(const kvc_mask_index&) = delete;
  kvc_mask_index& operator=(const kvc_mask_index&) = delete;
  ~kvc_mask_index() { delete[] words; }
  kv::MaskIndex index;
  uint64_t* words = nullptr;
};

static_assert(std::is_standard_layout_v<kvc_mask_index> && offsetof(kvc_mask_index, index) == 0);

struct kvc_thread_pool {
  explicit kvc_thread_pool(int threads) : pool(threads) {}
  kv::ThreadPool pool;
};

namespace {

thread_local char g_last_error[kv::Status::kMaxMessage] = "";

void SetLastError(const char* message) {
  std::strncpy(g_last_error, message, sizeof(g_last_error) - 1);
  g_last_error[sizeof(g_last_error) - 1] = '\0';
}

// Converts a Status, recording its message when it failed.
kvc_code Report(const kv::Status& s) {
  if (!s.ok()) SetLastError(s.message());
  return static_cast<kvc_code>(s.code());
}

kvc_code Fail(kvc_code code, const char* message) {
  SetLastError(message);
  return code;
}

using kv::DTypeFromC;
using kv::HistoryFromC;
using kv::ViewFromC;
using kv::ViewToC;

kv::ShiftFn ToShiftFn(const kvc_shift* shift) {
  if (shift == nullptr) return nullptr;
  if (shift->fn == nullptr) {
    return kv::RopeShiftFn(shift->rope_base, shift->rope_freq_scale, shift->rope_dims,
                           shift->rope_neox != 0);
  }
  const kvc_shift_fn fn = shift->fn;
  void* user = shift->user;
  return [fn, user](int layer, kv::TensorView key, std::span<const int32_t> delta) {
    const kvc_code code =
        fn(user, layer, ViewToC(key), delta.data(), static_cast<int64_t>(delta.size()));
    if (code == KVC_OK) return kv::Status::Ok();
    if (code < KVC_CACHE_FULL || code > KVC_CORRUPT) {
      return kv::Status::Error(kv::Code::kInvalidArgument,
                               "the shift callback returned an unknown code %d",
                               static_cast<int>(code));
    }
    return kv::Status::Error(static_cast<kv::Code>(code), "the shift callback returned %s",
                             kvc_code_name(code));
  };
}

kvc_cache* WrapCausal(std::unique_ptr<kv::CausalCache> c) {
  if (c == nullptr) return nullptr;
  auto* h = new kvc_cache;
  h->causal = c.get();
  h->cache = c.get();
  h->owned = std::move(c);
  return h;
}

// Serializes with `save` into the caller's buffer (see kvc_save).
template <class Save>
kvc_code SaveInto(const Save& save, void* buf, size_t capacity, size_t* size) {
  if (size == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_save: size is NULL");
  std::vector<uint8_t> bytes;
  const kv::Status s = save(&bytes);
  if (!s.ok()) return Report(s);
  *size = bytes.size();
  if (buf == nullptr) return KVC_OK;
  if (capacity < bytes.size()) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_save: the buffer is smaller than the stream");
  }
  std::memcpy(buf, bytes.data(), bytes.size());
  return KVC_OK;
}

kv::AttentionParams ToParams(const kvc_attention_params* params) {
  kv::AttentionParams p;
  if (params != nullptr) {
    p.scale = params->scale;
    p.softcap = params->softcap;
    p.sinks = params->sinks;
    p.integer_v = params->integer_v != 0;
    p.integer_k = params->integer_k != 0;
  }
  return p;
}

}  // namespace

extern "C" {

const char* kvc_last_error(void) { return g_last_error; }

const char* kvc_code_name(kvc_code code) {
  if (code < KVC_OK || code > KVC_CORRUPT) return "unknown";
  return kv::CodeName(static_cast<kv::Code>(code));
}

kvc_tensor kvc_make_tensor(void* data, kvc_dtype dtype, int dims, const int64_t* ne) {
  kvc_tensor t;
  std::memset(&t, 0, sizeof(t));
  t.data = data;
  t.dtype = dtype;
  for (int i = 0; i < 4; ++i) t.ne[i] = 1;
  for (int i = 0; i < dims && i < 4 && ne != nullptr; ++i) t.ne[i] = ne[i];
  if (!kv::IsValidDType(DTypeFromC(dtype))) return t;  // strides 0: every consumer rejects it
  const kv::TensorView v =
      kv::MakeView(data, DTypeFromC(dtype), {t.ne[0], t.ne[1], t.ne[2], t.ne[3]});
  std::memcpy(t.nb, v.nb, sizeof(t.nb));
  return t;
}

kvc_config kvc_config_default(void) {
  const kv::CacheConfig d;
  kvc_config c;
  c.padding = d.padding;
  c.permuted_v = d.permuted_v ? 1 : 0;
  c.mask_dtype = static_cast<kvc_dtype>(d.mask_dtype);
  c.window_inclusive = d.window_convention == kv::WindowConvention::kInclusive ? 1 : 0;
  return c;
}

kvc_cache* kvc_causal_new(const kvc_shift* shift) {
  return WrapCausal(kv::NewCausalCache(ToShiftFn(shift)));
}
kvc_cache* kvc_swa_new(int32_t window, const kvc_shift* shift) {
  return WrapCausal(kv::NewSWACache(window, ToShiftFn(shift)));
}
kvc_cache* kvc_swa_mem_new(int32_t window, int32_t memory, const kvc_shift* shift) {
  return WrapCausal(kv::NewSWAMemCache(window, memory, ToShiftFn(shift)));
}
kvc_cache* kvc_chunked_new(int32_t chunk, const kvc_shift* shift) {
  return WrapCausal(kv::NewChunkedAttentionCache(chunk, ToShiftFn(shift)));
}

kvc_cache* kvc_encoder_new(void) { return kvc_encoder_new_per_sequence(0); }

kvc_cache* kvc_encoder_new_per_sequence(int per_sequence) {
  kv::EncoderOptions options;
  options.per_sequence = per_sequence != 0;
  std::unique_ptr<kv::EncoderCache> c = kv::NewEncoderCache(options);
  if (c == nullptr) return nullptr;
  auto* h = new kvc_cache;
  h->encoder = c.get();
  h->cache = c.get();
  h->owned = std::move(c);
  return h;
}

kvc_cache* kvc_wrapper_new(kvc_cache** children, int n) {
  if (children == nullptr || n < 1) return nullptr;
  for (int i = 0; i < n; ++i) {
    if (children[i] == nullptr || children[i]->wrapper != nullptr ||
        children[i]->owned == nullptr) {
      return nullptr;
    }
    for (int j = 0; j < i; ++j) {
      if (children[j] == children[i]) return nullptr;
    }
  }
  std::vector<std::unique_ptr<kv::Cache>> owned;
  owned.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) owned.push_back(std::move(children[i]->owned));
  std::unique_ptr<kv::WrapperCache> w = kv::NewWrapperCache(std::move(owned));
  if (w == nullptr) std::abort();  // cannot fail: n >= 1 children, each owning its cache
  auto* h = new kvc_cache;
  h->wrapper = w.get();
  h->cache = w.get();
  h->owned = std::move(w);
  h->children.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) h->children.emplace_back(children[i]);
  return h;
}

kvc_cache* kvc_wrapper_child(kvc_cache* wrapper, int i) {
  if (wrapper == nullptr || i < 0 || static_cast<size_t>(i) >= wrapper->children.size()) {
    return nullptr;
  }
  return wrapper->children[static_cast<size_t>(i)].get();
}

void kvc_cache_free(kvc_cache* cache) {
  if (cache != nullptr && cache->owned != nullptr) delete cache;
}

kvc_code kvc_set_config(kvc_cache* cache, const kvc_config* config) {
  if (cache == nullptr || config == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_set_config: NULL argument");
  }
  kv::CacheConfig c;
  c.padding = config->padding;
  c.permuted_v = config->permuted_v != 0;
  c.mask_dtype = DTypeFromC(config->mask_dtype);
  c.window_convention = config->window_inclusive != 0 ? kv::WindowConvention::kInclusive
                                                      : kv::WindowConvention::kOllama;
  return Report(cache->cache->SetConfig(c));
}

kvc_code kvc_init(kvc_cache* cache, kvc_dtype dtype, int max_sequences, int capacity,
                  int max_batch) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_init: NULL cache");
  return Report(cache->cache->Init(DTypeFromC(dtype), max_sequences, capacity, max_batch));
}

kvc_code kvc_start_forward(kvc_cache* cache, const int32_t* positions, const int32_t* sequences,
                           int32_t n, const int32_t* multimodal, int32_t n_multimodal,
                           int reserve) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_start_forward: NULL cache");
  if (n < 0 || n_multimodal < 0 || (n > 0 && (positions == nullptr || sequences == nullptr)) ||
      (n_multimodal > 0 && multimodal == nullptr)) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_start_forward: negative count or NULL array");
  }
  kv::Batch batch;
  batch.positions = std::span<const int32_t>(positions, static_cast<size_t>(n));
  batch.sequences = std::span<const int32_t>(sequences, static_cast<size_t>(n));
  batch.multimodal = std::span<const int32_t>(multimodal, static_cast<size_t>(n_multimodal));
  return Report(cache->cache->StartForward(batch, reserve != 0));
}

void kvc_set_layer(kvc_cache* cache, int layer) {
  if (cache != nullptr) cache->cache->SetLayer(layer);
}

kvc_code kvc_put(kvc_cache* cache, const kvc_tensor* key, const kvc_tensor* value) {
  if (cache == nullptr || key == nullptr || value == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_put: NULL argument");
  }
  return Report(cache->cache->Put(ViewFromC(*key), ViewFromC(*value)));
}

kvc_code kvc_get(kvc_cache* cache, kvc_history* out) {
  if (cache == nullptr || out == nullptr)
    return Fail(KVC_INVALID_ARGUMENT, "kvc_get: NULL argument");
  *out = kv::HistoryToC(cache->cache->Get());
  return KVC_OK;
}

kvc_code kvc_copy_prefix(kvc_cache* cache, int src_seq, int dst_seq, int32_t len) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_copy_prefix: NULL cache");
  return Report(cache->cache->CopyPrefix(src_seq, dst_seq, len));
}

int kvc_can_resume(const kvc_cache* cache, int seq, int32_t pos) {
  return cache != nullptr && cache->cache->CanResume(seq, pos) ? 1 : 0;
}

kvc_code kvc_remove(kvc_cache* cache, int seq, int32_t begin, int32_t end) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_remove: NULL cache");
  return Report(cache->cache->Remove(seq, begin, end));
}

void kvc_close(kvc_cache* cache) {
  if (cache != nullptr) cache->cache->Close();
}

kvc_code kvc_set_causal(kvc_cache* cache, const int32_t* except, int32_t n) {
  if (cache == nullptr || n < 0 || (n > 0 && except == nullptr)) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_set_causal: NULL cache, negative count or NULL array");
  }
  if (cache->causal == nullptr) {
    return Fail(KVC_NOT_SUPPORTED, "kvc_set_causal: not a causal-family cache");
  }
  cache->causal->SetCausal(std::span<const int32_t>(except, static_cast<size_t>(n)));
  return KVC_OK;
}

kvc_code kvc_set_layer_type(kvc_cache* cache, int type) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_set_layer_type: NULL cache");
  if (cache->wrapper == nullptr)
    return Fail(KVC_NOT_SUPPORTED, "kvc_set_layer_type: not a wrapper");
  cache->wrapper->SetLayerType(type);
  return KVC_OK;
}

int kvc_encoder_cached(const kvc_cache* cache) {
  if (cache == nullptr || cache->encoder == nullptr) return -1;
  return cache->encoder->EncoderCached() ? 1 : 0;
}

kvc_code kvc_reserve_layers(kvc_cache* cache, int layers, int k_head_dim, int v_head_dim,
                            int kv_heads) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_reserve_layers: NULL cache");
  if (cache->causal == nullptr) {
    return Fail(KVC_NOT_SUPPORTED, "kvc_reserve_layers: not a causal-family cache");
  }
  return Report(cache->causal->ReserveLayers(layers, k_head_dim, v_head_dim, kv_heads));
}

size_t kvc_memory_bytes(const kvc_cache* cache) {
  return cache != nullptr ? cache->cache->MemoryBytes() : 0;
}

kvc_code kvc_save(const kvc_cache* cache, int seq, void* buf, size_t capacity, size_t* size) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_save: NULL cache");
  return SaveInto(
      [&](std::vector<uint8_t>* out) {
        return cache->wrapper != nullptr ? kv::SaveCache(*cache->wrapper, out, seq)
                                         : kv::SaveCache(*cache->cache, out, seq);
      },
      buf, capacity, size);
}

kvc_code kvc_load(kvc_cache* cache, const void* bytes, size_t size, int seq) {
  if (cache == nullptr || (bytes == nullptr && size > 0)) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_load: NULL argument");
  }
  const std::span<const uint8_t> in(static_cast<const uint8_t*>(bytes), size);
  return Report(cache->wrapper != nullptr ? kv::LoadCache(in, cache->wrapper, seq)
                                          : kv::LoadCache(in, cache->cache, seq));
}

kvc_code kvc_save_file(const kvc_cache* cache, const char* path, int seq) {
  if (cache == nullptr || path == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_save_file: NULL argument");
  }
  return Report(cache->wrapper != nullptr ? kv::SaveCacheFile(*cache->wrapper, path, seq)
                                          : kv::SaveCacheFile(*cache->cache, path, seq));
}

kvc_code kvc_load_file(kvc_cache* cache, const char* path, int seq) {
  if (cache == nullptr || path == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_load_file: NULL argument");
  }
  return Report(cache->wrapper != nullptr ? kv::LoadCacheFile(path, cache->wrapper, seq)
                                          : kv::LoadCacheFile(path, cache->cache, seq));
}

kvc_seq_cache* kvc_kv_cache_new(kvc_dtype dtype) {
  std::unique_ptr<kv::SequenceCache> c = kv::NewKVCache(DTypeFromC(dtype));
  if (c == nullptr) return nullptr;
  auto* h = new kvc_seq_cache;
  h->cache = std::move(c);
  return h;
}

kvc_seq_cache* kvc_rotating_cache_new(int max_size, int keep, kvc_dtype dtype) {
  std::unique_ptr<kv::SequenceCache> c = kv::NewRotatingKVCache(max_size, keep, DTypeFromC(dtype));
  if (c == nullptr) return nullptr;
  auto* h = new kvc_seq_cache;
  h->cache = std::move(c);
  return h;
}

void kvc_seq_cache_free(kvc_seq_cache* cache) { delete cache; }

kvc_code kvc_seq_update(kvc_seq_cache* cache, const kvc_tensor* key, const kvc_tensor* value, int n,
                        kvc_tensor* keys_out, kvc_tensor* values_out) {
  if (cache == nullptr || key == nullptr || value == nullptr || keys_out == nullptr ||
      values_out == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_seq_update: NULL argument");
  }
  kv::TensorView k, v;
  const kv::Status s = cache->cache->Update(ViewFromC(*key), ViewFromC(*value), n, &k, &v);
  if (!s.ok()) return Report(s);
  *keys_out = ViewToC(k);
  *values_out = ViewToC(v);
  return KVC_OK;
}

int kvc_seq_offset(const kvc_seq_cache* cache) {
  return cache != nullptr ? cache->cache->Offset() : 0;
}
int kvc_seq_len(const kvc_seq_cache* cache) { return cache != nullptr ? cache->cache->Len() : 0; }
void kvc_seq_reset(kvc_seq_cache* cache) {
  if (cache != nullptr) cache->cache->Reset();
}

kvc_code kvc_seq_save(const kvc_seq_cache* cache, void* buf, size_t capacity, size_t* size) {
  if (cache == nullptr) return Fail(KVC_INVALID_ARGUMENT, "kvc_seq_save: NULL cache");
  return SaveInto(
      [&](std::vector<uint8_t>* out) { return kv::SaveSequenceCache(*cache->cache, out); }, buf,
      capacity, size);
}

kvc_code kvc_seq_save_file(const kvc_seq_cache* cache, const char* path) {
  if (cache == nullptr || path == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_seq_save_file: NULL argument");
  }
  return Report(kv::SaveSequenceCacheFile(*cache->cache, path));
}

kvc_code kvc_seq_load_file(kvc_seq_cache* cache, const char* path) {
  if (cache == nullptr || path == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_seq_load_file: NULL argument");
  }
  return Report(kv::LoadSequenceCacheFile(path, cache->cache.get()));
}

kvc_code kvc_seq_load(kvc_seq_cache* cache, const void* bytes, size_t size) {
  if (cache == nullptr || (bytes == nullptr && size > 0)) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_seq_load: NULL argument");
  }
  return Report(kv::LoadSequenceCache(
      std::span<const uint8_t>(static_cast<const uint8_t*>(bytes), size), cache->cache.get()));
}

kvc_attention_params kvc_attention_params_default(void) {
  const kv::AttentionParams d;
  kvc_attention_params p;
  p.scale = d.scale;
  p.softcap = d.softcap;
  p.sinks = d.sinks;
  p.integer_v = d.integer_v ? 1 : 0;
  p.integer_k = d.integer_k ? 1 : 0;
  return p;
}

kvc_mask_index* kvc_mask_index_new(int64_t max_cells, int64_t max_rows) {
  if (max_cells < 1 || max_rows < 1) {
    Fail(KVC_INVALID_ARGUMENT, "kvc_mask_index_new: max_cells and max_rows must be >= 1");
    return nullptr;
  }
  // At most 2^40 words (8 TiB): the count, and its bytes, then fit in size_t.
  constexpr int64_t kMaxWords = int64_t{1} << 40;
  const int64_t row_words = kv::kernels::MaskBitsRowWords(std::min(max_cells, kMaxWords * 64));
  int64_t words = 0;
  if (__builtin_mul_overflow(row_words, max_rows, &words) || words > kMaxWords) {
    Fail(KVC_INVALID_ARGUMENT, "kvc_mask_index_new: max_cells x max_rows is too large");
    return nullptr;
  }
  auto index = std::unique_ptr<kvc_mask_index>(new (std::nothrow) kvc_mask_index);
  if (index != nullptr) {
    index->words = new (std::nothrow) uint64_t[static_cast<size_t>(words)];
  }
  if (index == nullptr || index->words == nullptr) {
    Fail(KVC_OUT_OF_MEMORY, "kvc_mask_index_new: out of memory");
    return nullptr;
  }
  index->index.Attach(index->words, static_cast<size_t>(words));
  return index.release();
}

void kvc_mask_index_invalidate(kvc_mask_index* index, const kvc_tensor* whole) {
  if (index == nullptr) return;
  index->index.Invalidate(whole != nullptr ? ViewFromC(*whole) : kv::TensorView{});
}

void kvc_mask_index_free(kvc_mask_index* index) { delete index; }

kvc_thread_pool* kvc_thread_pool_new(int threads) { return new kvc_thread_pool(threads); }
void kvc_thread_pool_free(kvc_thread_pool* pool) { delete pool; }

kvc_code kvc_attend(const kvc_tensor* q, const kvc_history* history,
                    const kvc_attention_params* params, kvc_tensor* out, kvc_thread_pool* pool) {
  if (q == nullptr || history == nullptr || out == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_attend: NULL argument");
  }
  kv::TensorView o = ViewFromC(*out);
  return Report(kv::Attend(ViewFromC(*q), HistoryFromC(*history), ToParams(params), &o,
                           pool != nullptr ? &pool->pool : nullptr));
}

kvc_code kvc_attend_parallel(const kvc_tensor* q, const kvc_history* history,
                             const kvc_attention_params* params, kvc_tensor* out,
                             const kvc_parallel_for* parallel) {
  if (q == nullptr || history == nullptr || out == nullptr || parallel == nullptr) {
    return Fail(KVC_INVALID_ARGUMENT, "kvc_attend_parallel: NULL argument");
  }
  kv::ParallelFor pf;
  pf.run = parallel->run;
  pf.user = parallel->user;
  pf.num_threads = parallel->num_threads;
  kv::TensorView o = ViewFromC(*out);
  return Report(kv::Attend(ViewFromC(*q), HistoryFromC(*history), ToParams(params), &o, pf));
}

}  // extern "C"

namespace kv {

Cache* CacheFromC(kvc_cache* cache) { return cache != nullptr ? cache->cache : nullptr; }
CausalCache* CausalFromC(kvc_cache* cache) { return cache != nullptr ? cache->causal : nullptr; }
EncoderCache* EncoderFromC(kvc_cache* cache) { return cache != nullptr ? cache->encoder : nullptr; }
WrapperCache* WrapperFromC(kvc_cache* cache) { return cache != nullptr ? cache->wrapper : nullptr; }

}  // namespace kv
