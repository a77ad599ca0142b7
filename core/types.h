// The plain types of the Cache interface: Batch, CacheConfig, History, ShiftFn.
#ifndef KVCACHE_CORE_TYPES_H_
#define KVCACHE_CORE_TYPES_H_

#include <cstdint>
#include <functional>
#include <span>

#include "core/status.h"
#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

namespace kv {

inline constexpr int32_t kPosMax = INT32_MAX;  // "to the end" in Remove

// One forward pass's tokens. The spans are borrowed for the duration of the call.
struct Batch {
  std::span<const int32_t> positions;  // one per token: its position inside its own sequence
  std::span<const int32_t> sequences;  // one per token: sequence id in [0, max_sequences)
  std::span<const int32_t>
      multimodal;  // batch indices of tokens that carry encoder input; may be empty
};

// How many keys a sliding window of W shows (SEMANTICS.md section 4).
enum class WindowConvention : uint8_t {
  kOllama,     // default: hidden when p < P - W, so W + 1 keys (the token and the W before it)
  kInclusive,  // llama.cpp / Hugging Face: hidden when p <= P - W, so W keys, the token included
};

struct CacheConfig {
  int32_t padding = 1;             // history length and cell count are multiples of this
  bool permuted_v = false;         // V stored and returned as [cells, v_head_dim, kv_heads]
  DType mask_dtype = DType::kF32;  // kF32 or kF16
  // Beyond Ollama:
  WindowConvention window_convention = WindowConvention::kOllama;
};

class MaskIndex;  // core/mask_index.h

// Which of History::v's two layouts it is (beyond Ollama). kAuto: Attend tells by shape (plain
// [v_head_dim, kv_heads, L] when v.ne[2] == k.ne[2], permuted [L, v_head_dim, kv_heads] when
// v.ne[0] == k.ne[2]), which cannot decide when v_head_dim == kv_heads == L (core/attend.h has
// the tie rule). The caches' Get says which, so their histories are never misread.
enum class VLayout : uint8_t { kAuto, kPlain, kPermuted };

// What Get returns. mask.data == nullptr: no mask.
struct History {
  TensorView k, v, mask;
  // Beyond Ollama: the cache's memo of `mask`'s visible cells (core/mask_index.h), or null. Attend
  // fills it on the first call of a forward pass and reuses it in every later layer instead of
  // reading the whole mask again. A History built by hand leaves it null or points it at a
  // MaskIndex of its own (core/mask_index.h says how); one that takes Get's K and V with a mask
  // of its own (or changes Get's mask) sets it to null or to its own index.
  MaskIndex* mask_index = nullptr;
  VLayout v_layout = VLayout::kAuto;  // the caches' Get sets kPlain or kPermuted
};

// Re-rotates keys after a context shift. `key` holds the K rows of n cells of layer `layer`,
// shape [k_head_dim, kv_heads, n], in the storage dtype; shift[i] is the position delta of row i
// (0: leave it). Modify in place.
using ShiftFn = std::function<Status(int layer, TensorView key, std::span<const int32_t> shift)>;

}  // namespace kv

#endif  // KVCACHE_CORE_TYPES_H_
