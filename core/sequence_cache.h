// The growing and rotating caches (the seeds' imagegen Cache), [B, H, T, D] layout.
// Exact behaviour: SEMANTICS.md section 11.
#ifndef KVCACHE_CORE_SEQUENCE_CACHE_H_
#define KVCACHE_CORE_SEQUENCE_CACHE_H_

#include <memory>

#include "core/status.h"
#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

namespace kv {

class SequenceCache {
 public:
  virtual ~SequenceCache() = default;
  // Appends key/value ({D, n, H, B}; n == key.ne[1]); returns the full history views in temporal
  // order, in the storage dtype.
  virtual Status Update(const TensorView& key, const TensorView& value, int n, TensorView* keys_out,
                        TensorView* values_out) = 0;
  virtual int Offset() const = 0;  // tokens ever appended (the next token's position)
  virtual int Len() const = 0;     // tokens held now
  virtual void Reset() = 0;
};

std::unique_ptr<SequenceCache> NewKVCache(DType dtype = DType::kF32);  // grows in steps of 256
std::unique_ptr<SequenceCache> NewRotatingKVCache(int max_size, int keep = 0, DType dtype = DType::kF32);

}  // namespace kv

#endif  // KVCACHE_CORE_SEQUENCE_CACHE_H_
