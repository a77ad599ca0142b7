// A small deterministic decode driver shared by the persistence, allocation, OOM and concurrency
// tests: every cache kind of the causal family, K/V/Q values from a hash of (token, layer, element)
// so two caches fed the same steps must hold the same bytes.
#ifndef KVCACHE_TESTS_DECODE_DRIVER_H_
#define KVCACHE_TESTS_DECODE_DRIVER_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"

namespace kv::testing {

struct CacheKind {
  const char* name;
  std::function<std::unique_ptr<CausalCache>()> make;
};

inline std::vector<CacheKind> AllCacheKinds() {
  return {
      {"causal", [] { return NewCausalCache(); }},
      {"swa", [] { return NewSWACache(6); }},
      {"swamem", [] { return NewSWAMemCache(4, 8); }},
      {"chunked", [] { return NewChunkedAttentionCache(4); }},
  };
}

inline const DType kAllDTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                   DType::kQ4_0};

// A value in [-1, 1) from a hash of its coordinates.
inline float HashValue(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 0x85EBCA77C2B2AE63ull) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// Shapes of the model the driver decodes with. Buffers are sized once for max_batch tokens, so a
// step allocates nothing itself.
struct Driver {
  int layers = 2, dk = 32, dv = 64, kv_heads = 2, q_heads = 4, max_batch = 8;
  std::vector<float> k, v, q, out;
  std::vector<int32_t> pos, seq;
  int32_t value_seq = -1;  // >= 0: values are generated as if every token belonged to it

  Driver() { Resize(); }
  void Resize() {
    k.assign(static_cast<size_t>(dk) * kv_heads * max_batch, 0);
    v.assign(static_cast<size_t>(dv) * kv_heads * max_batch, 0);
    q.assign(static_cast<size_t>(dk) * max_batch * q_heads, 0);
    out.assign(static_cast<size_t>(dv) * max_batch * q_heads, 0);
    pos.assign(max_batch, 0);
    seq.assign(max_batch, 0);
  }

  // StartForward for the tokens (pos[i], seq[i]), i < n, then per layer Put (and, with attend,
  // Get + Attend into out_all[layer], which must hold layers * out.size() floats).
  Status Step(CausalCache* cache, int n, float* out_all = nullptr, ThreadPool* pool = nullptr) {
    Batch b;
    b.positions = std::span<const int32_t>(pos.data(), n);
    b.sequences = std::span<const int32_t>(seq.data(), n);
    KV_RETURN_IF_ERROR(cache->StartForward(b, false));
    for (int l = 0; l < layers; ++l) {
      for (int i = 0; i < n; ++i) {
        const int32_t vs = value_seq >= 0 ? value_seq : seq[i];
        const uint64_t tok = static_cast<uint64_t>(vs) << 32 | static_cast<uint32_t>(pos[i]);
        for (int h = 0; h < kv_heads; ++h) {
          for (int d = 0; d < dk; ++d)
            k[(static_cast<size_t>(i) * kv_heads + h) * dk + d] = HashValue(tok, l, h * 1000 + d);
          for (int d = 0; d < dv; ++d)
            v[(static_cast<size_t>(i) * kv_heads + h) * dv + d] =
                HashValue(tok, l + 100, h * 1000 + d);
        }
        for (int h = 0; h < q_heads; ++h) {
          for (int d = 0; d < dk; ++d)
            q[(static_cast<size_t>(h) * n + i) * dk + d] = HashValue(tok, l + 200, h * 1000 + d);
        }
      }
      cache->SetLayer(l);
      KV_RETURN_IF_ERROR(cache->Put(MakeView(k.data(), DType::kF32, {dk, kv_heads, n}),
                                    MakeView(v.data(), DType::kF32, {dv, kv_heads, n})));
      if (out_all != nullptr) {
        const History hist = cache->Get();
        TensorView qv = MakeView(q.data(), DType::kF32, {dk, n, q_heads});
        TensorView ov =
            MakeView(out_all + static_cast<size_t>(l) * out.size(), DType::kF32, {dv, n, q_heads});
        KV_RETURN_IF_ERROR(Attend(qv, hist, AttentionParams(), &ov, pool));
      }
    }
    return Status::Ok();
  }

  // One token per listed sequence at the given positions.
  Status Tokens(CausalCache* cache, std::initializer_list<std::pair<int32_t, int32_t>> seq_pos,
                float* out_all = nullptr) {
    int n = 0;
    for (auto [s, p] : seq_pos) {
      seq[n] = s;
      pos[n] = p;
      ++n;
    }
    return Step(cache, n, out_all);
  }

  // Sets tokens i < n to positions [from, from + n) of sequence s; returns them as a Batch.
  Batch SetRun(int32_t s, int32_t from, int n) {
    for (int i = 0; i < n; ++i) {
      seq[i] = s;
      pos[i] = from + i;
    }
    Batch b;
    b.positions = std::span<const int32_t>(pos.data(), n);
    b.sequences = std::span<const int32_t>(seq.data(), n);
    return b;
  }

  // A prefill of positions [from, from + n) of sequence s.
  Status Prefill(CausalCache* cache, int32_t s, int32_t from, int n, float* out_all = nullptr) {
    SetRun(s, from, n);
    return Step(cache, n, out_all);
  }
};

}  // namespace kv::testing

#endif  // KVCACHE_TESTS_DECODE_DRIVER_H_
