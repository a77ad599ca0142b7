// kvperf: placeholder main job until the full harness lands (issue 7): fills a causal cache with a
// short prefill and prints what it holds.
#include <kvcache/kvcache.h>

#include <cstdio>
#include <vector>

int main() {
  auto cache = kv::NewCausalCache();
  if (kv::Status s = cache->Init(kv::DType::kF16, 1, 64, 8); !s.ok()) {
    std::fprintf(stderr, "init: %s\n", s.message());
    return 1;
  }
  const int32_t positions[4] = {0, 1, 2, 3};
  const int32_t sequences[4] = {0, 0, 0, 0};
  kv::Batch batch{positions, sequences, {}};
  if (kv::Status s = cache->StartForward(batch, false); !s.ok()) {
    std::fprintf(stderr, "start: %s\n", s.message());
    return 1;
  }
  cache->SetLayer(0);
  std::vector<float> k(64 * 2 * 4, 0.5f), v(64 * 2 * 4, 0.25f);
  if (kv::Status s = cache->Put(kv::MakeView(k.data(), kv::DType::kF32, {64, 2, 4}),
                                kv::MakeView(v.data(), kv::DType::kF32, {64, 2, 4}));
      !s.ok()) {
    std::fprintf(stderr, "put: %s\n", s.message());
    return 1;
  }
  const kv::History h = cache->Get();
  std::printf("history: %lld cells, mask %lld x %lld\n", static_cast<long long>(h.k.ne[2]),
              static_cast<long long>(h.mask.ne[0]), static_cast<long long>(h.mask.ne[1]));
  return 0;
}
