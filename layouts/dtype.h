// DType: the element types a cache stores, and their exact scalar conversions.
//
// f16 and bf16 conversions round to nearest, ties to even, and keep inf/NaN (a NaN stays a quiet
// NaN). These scalar functions are the reference that every SIMD kernel is tested against.
#ifndef KVCACHE_LAYOUTS_DTYPE_H_
#define KVCACHE_LAYOUTS_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

// Every float operation of this library rounds to IEEE single precision as it goes: the quantizers
// are bit-exact with llama.cpp's, the kernels with these references, and SoftmaxExp
// (kernels/attention_load-inl.h) rounds to an integer by adding 1.5 * 2^23. 32-bit x86 compilers
// default to the x87 unit, which keeps 64-bit mantissas until a value is stored (FLT_EVAL_METHOD
// 2): built that way, the scalar quantizers picked other codes than the vector kernels, and
// Highway's scalar target computed attention wrong by up to the outputs' size (73 of 384 tests
// failed, session 43). The CMake build adds the flags below on 32-bit x86 (and gives them to
// consumers of kvcache::kvcache); any other build must too. Every x86 CPU since the Pentium 4 and
// the Athlon 64 has SSE2; x87-only ones (Quark, Vortex86) are not supported.
#if (defined(__i386__) && !defined(__SSE2_MATH__)) || \
    (defined(_M_IX86) && !(defined(_M_IX86_FP) && _M_IX86_FP >= 2))
#error \
    "kvcache on 32-bit x86 needs single-precision SSE arithmetic: compile with -msse2 -mfpmath=sse"
#endif

namespace kv {

// kQ8_0 / kQ4_0: blocks of 32 elements along dim 0 with one f16 scale per block (34 and 18 bytes a
// block), the formats of llama.cpp's and Ollama's KV caches. See layouts/quant.h.
enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_0 };

inline constexpr int kNumDTypes = 5;
inline constexpr int kQuantBlockElems = 32;

constexpr bool IsValidDType(DType t) { return static_cast<int>(t) < kNumDTypes; }
constexpr bool IsQuantized(DType t) { return t == DType::kQ8_0 || t == DType::kQ4_0; }
// Element types a caller may hand to Put/Update (quantized input is not accepted).
constexpr bool IsFloatDType(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kQ8_0:
      return "q8_0";
    case DType::kQ4_0:
      return "q4_0";
  }
  return "invalid";
}

// Elements per storage block: 32 for quantized types, else 1.
constexpr int64_t BlockElems(DType t) { return IsQuantized(t) ? kQuantBlockElems : 1; }

// Bytes per storage block (for float types: per element).
constexpr size_t BlockBytes(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kQ8_0:
      return 34;
    case DType::kQ4_0:
      return 18;
  }
  return 0;
}

// Bytes of a row of n elements. Precondition: n % BlockElems(t) == 0.
constexpr size_t RowBytes(DType t, int64_t n) {
  return static_cast<size_t>(n / BlockElems(t)) * BlockBytes(t);
}

// ---- scalar conversions (the reference) --------------------------------------------------------

inline uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float F32FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16, round to nearest even; overflow gives inf; subnormals exact.
inline uint16_t F32ToF16(float f) {
  const uint32_t x = F32Bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal f16 (2^-14): subnormal or zero
    // Scale so the f16 subnormal unit (2^-24) becomes 1, then round to nearest even.
    const uint32_t exp = abs >> 23;
    if (exp < 102) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24 bits dropped
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  uint32_t r = abs - 0x38000000u;
  r += 0xFFFu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in f32.
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return F32FromBits(sign | 0x7F800000u | (mant << 13));
  return F32FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

// bfloat16, round to nearest even (Highway 1.0.3's DemoteTo truncates; kernels must not use it).
inline uint16_t F32ToBF16(float f) {
  const uint32_t x = F32Bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline float BF16ToF32(uint16_t b) { return F32FromBits(static_cast<uint32_t>(b) << 16); }

// Reads element i of a contiguous float-typed row (f32, f16 or bf16) as f32.
inline float LoadAsF32(const void* row, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(row)[i];
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(row)[i]);
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(row)[i]);
    default:
      return 0.0f;  // quantized rows are read block-wise (layouts/quant.h)
  }
}

// Writes element i of a contiguous float-typed row from f32 (rounding to nearest even).
inline void StoreFromF32(void* row, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(row)[i] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(row)[i] = F32ToF16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(row)[i] = F32ToBF16(v);
      break;
    default:
      break;
  }
}

}  // namespace kv

#endif  // KVCACHE_LAYOUTS_DTYPE_H_
