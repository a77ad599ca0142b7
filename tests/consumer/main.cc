// A consumer of the installed package: only <kvcache/kvcache.h> and kvcache::kvcache.
#include <kvcache/kvcache.h>

#include <cstdio>
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
  return h.k.ne[2] == 2 ? 0 : 4;
}
