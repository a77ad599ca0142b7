// The q8_0 and q4_0 block formats and their scalar reference (de)quantizers.
//
// Bit-exact with llama.cpp's reference quantizers (ggml-quants.c, quantize_row_q8_0_ref and
// quantize_row_q4_0_ref), which Ollama's KV caches also use:
//   q8_0: d = amax / 127, q = roundf(x / d) (round half away from zero), x' = d * q.
//   q4_0: d = m / -8 where m is the element of largest magnitude (sign kept), q = min(15,
//         trunc(x / d + 8.5)), element j in the low nibble of byte j and element j + 16 in the high
//         nibble, x' = d * (q - 8).
// The scale is computed and applied in f32 from 1/d, but stored as f16; dequantization uses the
// stored f16 scale, exactly as ggml does. Error bound per element: |x - x'| <= d/2 plus the f16
// rounding of d (relative 2^-11), i.e. about amax/254 for q8_0 and amax/16 for q4_0.
#ifndef KVCACHE_LAYOUTS_QUANT_H_
#define KVCACHE_LAYOUTS_QUANT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "layouts/dtype.h"

namespace kv {

// The block layouts, for documentation and sizes. Code addresses blocks as bytes through the
// accessors below: a block may start at any address (rows of 34-byte blocks inside a caller's
// buffer), and reading a struct member through a misaligned pointer is undefined behaviour.
struct BlockQ8_0 {
  uint16_t d;     // f16 scale
  int8_t qs[32];  // codes
};
struct BlockQ4_0 {
  uint16_t d;      // f16 scale
  uint8_t qs[16];  // element j: low nibble of qs[j]; element j + 16: high nibble of qs[j]
};
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block is 34 bytes");
static_assert(sizeof(BlockQ4_0) == 18, "q4_0 block is 18 bytes");
inline constexpr size_t kQuantScaleBytes = 2;  // the f16 scale leads every block

inline uint16_t BlockScale(const void* block) {
  uint16_t d;
  std::memcpy(&d, block, kQuantScaleBytes);
  return d;
}
inline void SetBlockScale(void* block, uint16_t d) { std::memcpy(block, &d, kQuantScaleBytes); }
inline const int8_t* Q8Codes(const void* block) {
  return reinterpret_cast<const int8_t*>(static_cast<const unsigned char*>(block) +
                                         kQuantScaleBytes);
}
inline int8_t* Q8Codes(void* block) {
  return reinterpret_cast<int8_t*>(static_cast<unsigned char*>(block) + kQuantScaleBytes);
}
inline const uint8_t* Q4Codes(const void* block) {
  return static_cast<const uint8_t*>(block) + kQuantScaleBytes;
}
inline uint8_t* Q4Codes(void* block) { return static_cast<uint8_t*>(block) + kQuantScaleBytes; }

// 1/d for a block scale d, and whether x * (1/d) may be used. llama.cpp multiplies by 1/d; when d
// is subnormal (block maximum below ~3.7e-37 for q8_0) 1/d overflows to inf and its int8 cast of
// inf or NaN is undefined behaviour. There, and only there, we divide by d instead: x / d is exact
// within [-127, 127] (q8_0) or [-8, 8] (q4_0), and the stored f16 scale is 0 either way.
inline bool ScaleInverseIsFinite(float d, float* id) {
  *id = d != 0.0f ? 1.0f / d : 0.0f;
  return std::isfinite(*id);
}

// The scaled value x * id, made safe to convert: NaN becomes 0 and the value is clamped to [lo,
// hi]. For finite input the products already lie within the code range (up to an ulp that rounding
// absorbs), so this changes nothing there and blocks stay bit-exact with llama.cpp. For non-finite
// input (NaN, inf, or a row whose f16 scale overflowed and is being re-quantized) llama.cpp's int8
// cast is undefined behaviour; here the codes are defined: NaN -> 0, beyond the range -> the end.
inline float SafeScaled(float p, float lo, float hi) {
  if (!(p == p)) return 0.0f;
  return p < lo ? lo : (p > hi ? hi : p);
}

// Quantizes 32 floats into one block.
inline void QuantizeBlockQ8_0(const float* x, void* block) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  float id;
  const bool multiply = ScaleInverseIsFinite(d, &id);
  SetBlockScale(block, F32ToF16(d));
  int8_t* qs = Q8Codes(block);
  for (int j = 0; j < 32; ++j) {
    const float scaled = SafeScaled(multiply ? x[j] * id : x[j] / d, -127.0f, 127.0f);
    qs[j] = static_cast<int8_t>(std::roundf(scaled));
  }
}

inline void DequantizeBlockQ8_0(const void* block, float* out) {
  const float d = F16ToF32(BlockScale(block));
  const int8_t* qs = Q8Codes(block);
  for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(qs[j]);
}

inline void QuantizeBlockQ4_0(const float* x, void* block) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  float id;
  const bool multiply = ScaleInverseIsFinite(d, &id);
  SetBlockScale(block, F32ToF16(d));
  uint8_t* qs = Q4Codes(block);
  for (int j = 0; j < 16; ++j) {
    const float x0 = SafeScaled(multiply ? x[j] * id : x[j] / d, -8.5f, 8.0f);
    const float x1 = SafeScaled(multiply ? x[16 + j] * id : x[16 + j] / d, -8.5f, 8.0f);
    const int q0 = static_cast<int8_t>(x0 + 8.5f) < 15 ? static_cast<int8_t>(x0 + 8.5f) : 15;
    const int q1 = static_cast<int8_t>(x1 + 8.5f) < 15 ? static_cast<int8_t>(x1 + 8.5f) : 15;
    qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
}

inline void DequantizeBlockQ4_0(const void* block, float* out) {
  const float d = F16ToF32(BlockScale(block));
  const uint8_t* qs = Q4Codes(block);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
    out[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

// Converts a contiguous f32 row of n elements to `dst` in any storage dtype (scalar reference).
// Precondition: n % BlockElems(t) == 0.
inline void StoreRowFromF32(const float* src, int64_t n, DType t, void* dst) {
  if (t == DType::kQ8_0) {
    for (int64_t b = 0; b < n / 32; ++b)
      QuantizeBlockQ8_0(src + 32 * b, static_cast<char*>(dst) + sizeof(BlockQ8_0) * b);
  } else if (t == DType::kQ4_0) {
    for (int64_t b = 0; b < n / 32; ++b)
      QuantizeBlockQ4_0(src + 32 * b, static_cast<char*>(dst) + sizeof(BlockQ4_0) * b);
  } else {
    for (int64_t i = 0; i < n; ++i) StoreFromF32(dst, t, i, src[i]);
  }
}

// Reads a contiguous row of n elements in any storage dtype as f32 (scalar reference).
inline void LoadRowAsF32(const void* src, int64_t n, DType t, float* dst) {
  if (t == DType::kQ8_0) {
    for (int64_t b = 0; b < n / 32; ++b)
      DequantizeBlockQ8_0(static_cast<const char*>(src) + sizeof(BlockQ8_0) * b, dst + 32 * b);
  } else if (t == DType::kQ4_0) {
    for (int64_t b = 0; b < n / 32; ++b)
      DequantizeBlockQ4_0(static_cast<const char*>(src) + sizeof(BlockQ4_0) * b, dst + 32 * b);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = LoadAsF32(src, t, i);
  }
}

}  // namespace kv

#endif  // KVCACHE_LAYOUTS_QUANT_H_
