// The decode inner loop written with xsimd for one fixed architecture (AVX2 + FMA + F16C, chosen at
// compile time as a distro build would), for bench_attention's side-by-side with the Highway
// kernel, which picks AVX-512 at run time where the CPU has it. Same algorithm as the kernel's
// decode path: blocks of 128 cells, each K row converted once for all G heads, one online-softmax
// update per block, V accumulated with the heads' accumulators. B = 1, no mask, f16 K/V, D % 8 ==
// 0.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "xsimd/xsimd.hpp"

namespace kvbench {

using Batch = xsimd::batch<float, xsimd::avx2>;

static inline Batch LoadF16(const uint16_t* p) {
  return Batch(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// kG query heads per KV head, fixed at compile time (the register arrays stay in registers).
template <int kG>
void DecodeGroup(const float* q, const uint8_t* kh, const uint8_t* vh, size_t row_stride, int D,
                 int L, float scale, float* out) {
  constexpr int kBlock = 128;
  constexpr int W = static_cast<int>(Batch::size);
  constexpr int kMaxD = 256;
  alignas(32) float s[kG][kBlock];
  alignas(32) float qs[kG][kMaxD];
  alignas(32) float acc[kG][kMaxD];
  float m[kG], l[kG];
  for (int g = 0; g < kG; ++g) {
    for (int i = 0; i < D; ++i) {
      qs[g][i] = q[g * D + i] * scale;
      acc[g][i] = 0.0f;
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0;
  }
  const size_t row_bytes = static_cast<size_t>(D) * 2;
  for (int c0 = 0; c0 < L; c0 += kBlock) {
    const int n = std::min(kBlock, L - c0);
    for (int j = 0; j < n; ++j) {
      // The same software prefetch as the Highway kernel: K 8 rows ahead, this block's V rows.
      const uint8_t* ka = kh + static_cast<size_t>(c0 + j + 8) * row_stride;
      const uint8_t* va = vh + static_cast<size_t>(c0 + j) * row_stride;
      for (size_t o = 0; o < row_bytes; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ka + o), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(va + o), _MM_HINT_T0);
      }
      const uint16_t* kr =
          reinterpret_cast<const uint16_t*>(kh + static_cast<size_t>(c0 + j) * row_stride);
      Batch a[kG];
      for (int g = 0; g < kG; ++g) a[g] = Batch(0.0f);
      for (int i = 0; i < D; i += W) {
        const Batch kv = LoadF16(kr + i);
        for (int g = 0; g < kG; ++g) a[g] = xsimd::fma(Batch::load_aligned(&qs[g][i]), kv, a[g]);
      }
      for (int g = 0; g < kG; ++g) s[g][j] = xsimd::hadd(a[g]);
    }
    for (int g = 0; g < kG; ++g) {
      float mb = m[g];
      for (int j = 0; j < n; ++j) mb = std::max(mb, s[g][j]);
      const float alpha = std::exp(m[g] - mb);
      float sum = 0;
      int j = 0;
      for (; j + W <= n; j += W) {
        const Batch e = xsimd::exp(Batch::load_aligned(&s[g][j]) - Batch(mb));
        e.store_aligned(&s[g][j]);
        sum += xsimd::hadd(e);
      }
      for (; j < n; ++j) sum += (s[g][j] = std::exp(s[g][j] - mb));
      l[g] = l[g] * alpha + sum;
      m[g] = mb;
      for (int i = 0; i < D; ++i) acc[g][i] *= alpha;
    }
    for (int i = 0; i < D; i += 2 * W) {
      Batch a0[kG], a1[kG];
      for (int g = 0; g < kG; ++g) {
        a0[g] = Batch::load_aligned(&acc[g][i]);
        a1[g] = Batch::load_aligned(&acc[g][i + W]);
      }
      for (int j = 0; j < n; ++j) {
        const uint16_t* vr =
            reinterpret_cast<const uint16_t*>(vh + static_cast<size_t>(c0 + j) * row_stride);
        const Batch v0 = LoadF16(vr + i), v1 = LoadF16(vr + i + W);
        for (int g = 0; g < kG; ++g) {
          const Batch pg(s[g][j]);
          a0[g] = xsimd::fma(pg, v0, a0[g]);
          a1[g] = xsimd::fma(pg, v1, a1[g]);
        }
      }
      for (int g = 0; g < kG; ++g) {
        a0[g].store_aligned(&acc[g][i]);
        a1[g].store_aligned(&acc[g][i + W]);
      }
    }
  }
  for (int g = 0; g < kG; ++g) {
    for (int i = 0; i < D; ++i) out[g * D + i] = acc[g][i] / l[g];
  }
}

// B = 1, no mask, G == 4, D % 16 == 0 and D <= 256 (the benchmark's shape).
void XsimdDecodeF16(const float* q, const uint8_t* k, const uint8_t* v, size_t head_stride,
                    size_t row_stride, int D, int Hkv, int G, int L, float scale, float* out) {
  if (G != 4 || D % 16 != 0 || D > 256) return;
  for (int h = 0; h < Hkv; ++h) {
    DecodeGroup<4>(q + static_cast<size_t>(h) * G * D, k + static_cast<size_t>(h) * head_stride,
                   v + static_cast<size_t>(h) * head_stride, row_stride, D, L, scale,
                   out + static_cast<size_t>(h) * G * D);
  }
}

}  // namespace kvbench
