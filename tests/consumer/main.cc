// A consumer of the installed package: only <kvcache/kvcache.h> and kvcache::kvcache.
#include <kvcache/kvcache.h>

#include <cstdio>
#include <limits>
#include <vector>

int main() {
  std::unique_ptr<kv::CausalCache> cache = kv::NewCausalCache();
  if (!cache->Init(kv::DType::kF16, 1, 16, 4).ok()) return 1;
  const int32_t positions[2] = {0, 1};
  const int32_t sequences[2] = {0, 0};
  kv::Batch batch;
  batch.positions = positions;
  batch.sequences = sequences;
  if (!cache->StartForward(batch, false).ok()) return 2;
  cache->SetLayer(0);
  std::vector<float> k(8 * 2 * 2, 1.0f), v(8 * 2 * 2, 2.0f);
  const kv::Status put = cache->Put(kv::MakeView(k.data(), kv::DType::kF32, {8, 2, 2}),
                                    kv::MakeView(v.data(), kv::DType::kF32, {8, 2, 2}));
  if (!put.ok()) return 3;
  const kv::History h = cache->Get();
  std::printf("history cells %lld, mask %lldx%lld\n", static_cast<long long>(h.k.ne[2]),
              static_cast<long long>(h.mask.ne[0]), static_cast<long long>(h.mask.ne[1]));
  if (h.k.ne[2] != 2) return 4;
  // A history of the cache's K / V with a mask and a mask index of the caller's own: the first
  // Attend computes the index's bits.
  // [2 cells, 1 row]: the second cell hidden.
  std::vector<float> mask = {0.0f, -std::numeric_limits<float>::infinity()};
  std::vector<uint64_t> words(kv::MaskIndex::WordsFor(2, 1));
  kv::MaskIndex index;
  index.Attach(words.data(), words.size());
  const kv::History own{h.k, h.v, kv::MakeView(mask.data(), kv::DType::kF32, {2, 1}), &index};
  std::vector<float> q(8 * 2, 0.5f), out(8 * 2, 0.0f);
  kv::TensorView ov = kv::MakeView(out.data(), kv::DType::kF32, {8, 1, 2});
  const kv::TensorView qv = kv::MakeView(q.data(), kv::DType::kF32, {8, 1, 2});
  if (!kv::Attend(qv, own, kv::AttentionParams{}, &ov).ok()) return 5;
  if (index.fills() != 1 || out[0] != 2.0f) return 6;
  // A consumer built with RTTI downcasts the wrapper's child, as the seeds' type assertion does.
  std::vector<std::unique_ptr<kv::Cache>> children;
  children.push_back(kv::NewEncoderCache());
  children.push_back(kv::NewCausalCache());
  std::unique_ptr<kv::WrapperCache> wrapper = kv::NewWrapperCache(std::move(children));
  wrapper->SetLayerType(0);
  auto* encoder = dynamic_cast<kv::EncoderCache*>(wrapper->UnderlyingCache());
  if (encoder == nullptr || encoder->EncoderCached()) return 7;
  wrapper->SetLayerType(1);
  return dynamic_cast<kv::CausalCache*>(wrapper->UnderlyingCache()) != nullptr ? 0 : 8;
}
