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

void XsimdDecodeF16(const float* q, const uint8_t* k, const uint8_t* v, size_t head_stride,
                    size_t row_stride, int D, int Hkv, int G, int L, float scale, float* out) {
  constexpr int kBlock = 128;
  constexpr int kMaxG = 8;
  const int W = static_cast<int>(Batch::size);
  alignas(32) float s[kMaxG][kBlock];
  std::vector<float> qs(static_cast<size_t>(G) * D), acc(static_cast<size_t>(G) * D);
  for (int h = 0; h < Hkv; ++h) {
    for (int i = 0; i < G * D; ++i) qs[i] = q[static_cast<size_t>(h) * G * D + i] * scale;
    std::fill(acc.begin(), acc.end(), 0.0f);
    float m[kMaxG], l[kMaxG];
    for (int g = 0; g < G; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0;
    }
    const uint8_t* kh = k + static_cast<size_t>(h) * head_stride;
    const uint8_t* vh = v + static_cast<size_t>(h) * head_stride;
    for (int c0 = 0; c0 < L; c0 += kBlock) {
      const int n = std::min(kBlock, L - c0);
      for (int j = 0; j < n; ++j) {
        const uint16_t* kr =
            reinterpret_cast<const uint16_t*>(kh + static_cast<size_t>(c0 + j) * row_stride);
        Batch a[kMaxG];
        for (int g = 0; g < G; ++g) a[g] = Batch(0.0f);
        for (int i = 0; i < D; i += W) {
          const Batch kv = LoadF16(kr + i);
          for (int g = 0; g < G; ++g)
            a[g] = xsimd::fma(Batch::load_unaligned(&qs[g * D + i]), kv, a[g]);
        }
        for (int g = 0; g < G; ++g) s[g][j] = xsimd::hadd(a[g]);
      }
      for (int g = 0; g < G; ++g) {
        float mb = m[g];
        for (int j = 0; j < n; ++j) mb = std::max(mb, s[g][j]);
        const float alpha = std::exp(m[g] - mb);
        float sum = 0;
        for (int j = 0; j < n; ++j) sum += (s[g][j] = std::exp(s[g][j] - mb));
        l[g] = l[g] * alpha + sum;
        m[g] = mb;
        for (int i = 0; i < D; ++i) acc[g * D + i] *= alpha;
      }
      for (int i = 0; i < D; i += W) {
        Batch a[kMaxG];
        for (int g = 0; g < G; ++g) a[g] = Batch::load_unaligned(&acc[g * D + i]);
        for (int j = 0; j < n; ++j) {
          const Batch vv = LoadF16(
              reinterpret_cast<const uint16_t*>(vh + static_cast<size_t>(c0 + j) * row_stride) + i);
          for (int g = 0; g < G; ++g) a[g] = xsimd::fma(Batch(s[g][j]), vv, a[g]);
        }
        for (int g = 0; g < G; ++g) a[g].store_unaligned(&acc[g * D + i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < D; ++i)
        out[(static_cast<size_t>(h) * G + g) * D + i] = acc[g * D + i] / l[g];
    }
  }
}

}  // namespace kvbench
