// The wrapper cache (SEMANTICS.md section 10): several child caches behind one Cache, e.g. encoder
// + causal (cross-attention models) or SWA + causal (interleaved sliding-window models). The model
// picks the child for each layer with SetLayerType; everything else fans out to every child.
//
// Choices beyond Ollama's wrapper.go:
// - SetConfig and Init first ask every child whether it accepts the arguments (CheckConfig,
//   CheckInit), so an argument error changes no child. An Init that still fails (a later child
//   out of memory) closes every child: on a first Init that is the state before the call; on a
//   re-Init the earlier children have already dropped their tokens, and closed children at least
//   agree (Ollama leaves the earlier children initialized).
// - StartForward first asks every child whether it accepts the batch (CheckStartForward), so a
//   batch that a later child refuses (kCacheFull, a bad batch) changes no child. Ollama's wrapper
//   runs the earlier children first and then unwinds them by Remove (SEMANTICS.md §10), which
//   cannot give back the cells a window child trimmed: the child then resumes from fewer
//   positions. That unwind remains for a child that fails after the check (out of memory, or a
//   child of the caller's own that does not check ahead).
// - StartForward with reserve = true does not unwind on a child's failure: a reserve pass changes
//   no metadata, and removing the batch's positions would delete real tokens.
// - CopyPrefix refuses with kNotSupported before touching any child when one child can never copy
//   (a single-sequence encoder; Ollama panics there after the earlier children have copied).
//   Otherwise every child is called in order and the first error is returned; argument errors are
//   the same for every child (they share max_sequences), so the first child reports them before
//   anything changes.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "core/cache.h"

namespace kv {
namespace {

class WrapperCacheImpl final : public WrapperCache {
 public:
  explicit WrapperCacheImpl(std::vector<std::unique_ptr<Cache>> caches)
      : caches_(std::move(caches)) {}

  Status CheckConfig(const CacheConfig& config) const override {
    for (const auto& c : caches_) KV_RETURN_IF_ERROR(c->CheckConfig(config));
    return Status::Ok();
  }

  Status SetConfig(const CacheConfig& config) override {
    KV_RETURN_IF_ERROR(CheckConfig(config));
    for (auto& c : caches_) KV_RETURN_IF_ERROR(c->SetConfig(config));
    return Status::Ok();
  }

  Status CheckInit(DType dtype, int max_sequences, int capacity, int max_batch) const override {
    for (const auto& c : caches_) {
      KV_RETURN_IF_ERROR(c->CheckInit(dtype, max_sequences, capacity, max_batch));
    }
    return Status::Ok();
  }

  Status Init(DType dtype, int max_sequences, int capacity, int max_batch) override {
    KV_RETURN_IF_ERROR(CheckInit(dtype, max_sequences, capacity, max_batch));
    for (auto& c : caches_) {
      Status s = c->Init(dtype, max_sequences, capacity, max_batch);
      if (s.ok()) continue;
      // Out of memory after the earlier children re-initialized: close them all rather than
      // leave children that disagree about what they hold.
      for (auto& d : caches_) d->Close();
      return s;
    }
    return Status::Ok();
  }

  Status CheckStartForward(const Batch& batch, bool reserve) override {
    for (auto& c : caches_) KV_RETURN_IF_ERROR(c->CheckStartForward(batch, reserve));
    return Status::Ok();
  }

  Status StartForward(const Batch& batch, bool reserve) override {
    // A child that would refuse the batch refuses it before any child has changed.
    KV_RETURN_IF_ERROR(CheckStartForward(batch, reserve));
    for (size_t i = 0; i < caches_.size(); ++i) {
      Status s = caches_[i]->StartForward(batch, reserve);
      if (s.ok()) continue;
      if (!reserve) {
        // Unwind so no child keeps half a batch (a child that ran out of memory, or one that
        // cannot check ahead). Remove to the end never shifts; its result is ignored as in
        // Ollama (a child that accepted the batch accepts its sequences).
        const size_t n = std::min(batch.positions.size(), batch.sequences.size());
        for (size_t j = i; j-- > 0;) {
          for (size_t k = 0; k < n; ++k) {
            (void)caches_[j]->Remove(batch.sequences[k], batch.positions[k], kPosMax);
          }
        }
      }
      return s;
    }
    type_ = 0;
    return Status::Ok();
  }

  void SetLayer(int layer) override {
    for (auto& c : caches_) c->SetLayer(layer);
  }

  void SetLayerType(int type) override { type_ = type; }

  Cache* UnderlyingCache() override { return Child(type_); }

  Status Put(const TensorView& key, const TensorView& value) override {
    Cache* c = Child(type_);
    if (c == nullptr) {
      return Status::Error(Code::kInvalidArgument, "wrapper: layer type %d out of [0, %zu)", type_,
                           caches_.size());
    }
    return c->Put(key, value);
  }

  History Get() override {
    Cache* c = Child(type_);
    return c == nullptr ? History{} : c->Get();
  }

  bool SupportsCopyPrefix() const override {
    for (const auto& c : caches_) {
      if (!c->SupportsCopyPrefix()) return false;
    }
    return true;
  }

  Status CopyPrefix(int src_seq, int dst_seq, int32_t len) override {
    if (!SupportsCopyPrefix()) {
      return Status::Error(Code::kNotSupported,
                           "wrapper: a child cannot copy prefixes (single-sequence encoder?)");
    }
    for (auto& c : caches_) KV_RETURN_IF_ERROR(c->CopyPrefix(src_seq, dst_seq, len));
    return Status::Ok();
  }

  bool CanResume(int seq, int32_t pos) const override {
    for (const auto& c : caches_) {
      if (!c->CanResume(seq, pos)) return false;
    }
    return true;
  }

  Status Remove(int seq, int32_t begin, int32_t end) override {
    // On an error the caller may retry with end = kPosMax, which does not fail (as Ollama).
    for (auto& c : caches_) KV_RETURN_IF_ERROR(c->Remove(seq, begin, end));
    return Status::Ok();
  }

  // Every child in order; stops at the first error (a child that holds storage refuses).
  Status SetAllocator(const ArenaAllocator& allocator) override {
    for (auto& c : caches_) KV_RETURN_IF_ERROR(c->SetAllocator(allocator));
    return Status::Ok();
  }

  void Close() override {
    for (auto& c : caches_) c->Close();
  }

  size_t MemoryBytes() const override {
    size_t total = 0;
    for (const auto& c : caches_) total += c->MemoryBytes();
    return total;
  }

  int NumChildren() const override { return static_cast<int>(caches_.size()); }

  Cache* Child(int i) override {
    return i >= 0 && static_cast<size_t>(i) < caches_.size() ? caches_[i].get() : nullptr;
  }

  std::vector<size_t> ChildMemoryBytes() const override {
    std::vector<size_t> out;
    out.reserve(caches_.size());
    for (const auto& c : caches_) out.push_back(c->MemoryBytes());
    return out;
  }

 private:
  std::vector<std::unique_ptr<Cache>> caches_;
  int type_ = 0;
};

}  // namespace

std::unique_ptr<WrapperCache> NewWrapperCache(std::vector<std::unique_ptr<Cache>> caches) {
  // Precondition: at least one child, none null.
  if (caches.empty()) return nullptr;
  for (const auto& c : caches) {
    if (c == nullptr) return nullptr;
  }
  return std::make_unique<WrapperCacheImpl>(std::move(caches));
}

}  // namespace kv
