// Highway RoPE re-rotation (kernels/rope.h): rows rotated in registers, one dispatch per call.
//
// Per distinct delta (consecutive rows usually share one) the cos/sin of delta * theta_i are
// computed in double exactly as RopeShiftRef does and rounded to f32, so both rotate with identical
// coefficients. Normal style keeps pairs (2i, 2i + 1) in place: with C = [c0 c0 c1 c1 ..] and
// S = [-s0 s0 -s1 s1 ..], out = x * C + swap_pairs(x) * S gives x0 c - x1 s and x1 c + x0 s per
// pair. NeoX pairs (i, i + dims/2) are two plain loads. f32 and bf16 rows (and f16 rows where the
// CPU converts f16 natively, AVX2/AVX-512 F16C) are converted in registers with the reference's
// rounding; quantized rows (and f16 on SSE4/scalar) go through an f32 stack buffer with
// kernels::RowToF32 / ConvertRow, which are bit-exact with the scalar reference. Quantized rows are
// re-quantized whole (as the reference does); float rows leave dims >= `dims` untouched.
//
// Error bound (f32): each output is a * b -/+ c * d with the reference's coefficients. Computed
// with two roundings of the products and one of the sum it equals the reference bit for bit; a
// compiler may contract one product into an FMA on FMA targets, which moves the result by at most
// 2^-23 * (|x0| + |x1|) (checked in tests/rope_test.cc with that bound). Stored f16/bf16/q8_0/q4_0
// then equal the reference whenever the f32 values do. NaN payloads may differ on F16C targets.
// armv7 NEON flushes subnormal inputs and results to zero, which moves such a value by < 2^-126.
//
// No heap: tables and the row buffer live on the stack for dims and head_dim up to kStackDims;
// wider heads use thread_local buffers that grow once.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/rope.cc"
#include "kernels/rope.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/convert.h"
#include "kernels/fp_barrier-inl.h"
#include "kernels/highway_targets.h"
#include "layouts/dtype.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int64_t kStackDims = 512;

// f16 <-> f32 in registers only where the hardware rounds as the reference does (F16C: round to
// nearest even, subnormals exact). Highway's SSE4 emulation truncates, so SSE4 uses the buffer
// path.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define KV_ROPE_NATIVE_F16 1
#else
#define KV_ROPE_NATIVE_F16 0
#endif

// Products go through KeepRounded (kernels/fp_barrier-inl.h) so they are not fused into FMAs.

// Element access for one storage type: vector load/store of N elements as f32, scalar get/put.
struct F32Io {
  using T = float;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const T* p) {
    return hn::LoadU(d, p);
  }
  template <class D>
  static HWY_INLINE void Store(D d, hn::Vec<D> v, T* p) {
    hn::StoreU(v, d, p);
  }
  static HWY_INLINE float Get(const T* p, int64_t i) { return p[i]; }
  static HWY_INLINE void Put(T* p, int64_t i, float v) { p[i] = v; }
};

struct BF16Io {
  using T = uint16_t;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const T* p) {
    const hn::RebindToUnsigned<D> du;
    const hn::Rebind<uint16_t, D> du16;
    return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(du16, p))));
  }
  // Round to nearest even as F32ToBF16 (Highway 1.0.3's DemoteTo truncates); NaN stays quiet NaN.
  template <class D>
  static HWY_INLINE void Store(D /* d */, hn::Vec<D> v, T* p) {
    const hn::RebindToUnsigned<D> du;
    const hn::RebindToSigned<D> di;
    const hn::Rebind<uint16_t, D> du16;
    const auto x = hn::BitCast(du, v);
    const auto hi = hn::ShiftRight<16>(x);
    const auto rounded =
        hn::ShiftRight<16>(hn::Add(x, hn::Add(hn::Set(du, 0x7FFFu), hn::And(hi, hn::Set(du, 1u)))));
    const auto is_nan =
        hn::Gt(hn::BitCast(di, hn::And(x, hn::Set(du, 0x7FFFFFFFu))), hn::Set(di, 0x7F800000));
    const auto bits =
        hn::IfThenElse(hn::RebindMask(du, is_nan), hn::Or(hi, hn::Set(du, 0x40u)), rounded);
    hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, bits)), du16, p);  // bits <= 0xFFFF: exact
  }
  static HWY_INLINE float Get(const T* p, int64_t i) { return BF16ToF32(p[i]); }
  static HWY_INLINE void Put(T* p, int64_t i, float v) { p[i] = F32ToBF16(v); }
};

#if KV_ROPE_NATIVE_F16
struct F16Io {
  using T = uint16_t;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const T* p) {
    const hn::Rebind<hwy::float16_t, D> df16;
    return hn::PromoteTo(d, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(p)));
  }
  template <class D>
  static HWY_INLINE void Store(D d, hn::Vec<D> v, T* p) {
    (void)d;
    const hn::Rebind<hwy::float16_t, D> df16;
    hn::StoreU(hn::DemoteTo(df16, v), df16, reinterpret_cast<hwy::float16_t*>(p));
  }
  static HWY_INLINE float Get(const T* p, int64_t i) { return F16ToF32(p[i]); }
  static HWY_INLINE void Put(T* p, int64_t i, float v) { p[i] = F32ToF16(v); }
};
#endif

// Normal style on dims elements of row. C, S: dims entries (interleaved, S signed as above).
template <class Io>
HWY_INLINE void RotateNormal(typename Io::T* HWY_RESTRICT row, const float* HWY_RESTRICT C,
                             const float* HWY_RESTRICT S, int64_t dims) {
  int64_t j = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));  // even, so vectors hold whole pairs
  for (; j + N <= dims; j += N) {
    const auto x = Io::Load(d, row + j);
    const auto r = hn::Add(KeepRounded(hn::Mul(x, hn::LoadU(d, C + j))),
                           KeepRounded(hn::Mul(hn::Shuffle2301(x), hn::LoadU(d, S + j))));
    Io::Store(d, r, row + j);
  }
#endif
  for (; j < dims; j += 2) {  // the reference's expressions
    const float x0 = Io::Get(row, j);
    const float x1 = Io::Get(row, j + 1);
    const float c = C[j];
    const float s = S[j + 1];
    Io::Put(row, j, KeepRoundedScalar(x0 * c) - KeepRoundedScalar(x1 * s));
    Io::Put(row, j + 1, KeepRoundedScalar(x0 * s) + KeepRoundedScalar(x1 * c));
  }
}

// NeoX style: pairs (k, k + half). C, S: half entries.
template <class Io>
HWY_INLINE void RotateNeox(typename Io::T* HWY_RESTRICT row, const float* HWY_RESTRICT C,
                           const float* HWY_RESTRICT S, int64_t half) {
  typename Io::T* HWY_RESTRICT hi = row + half;
  int64_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (; k + N <= half; k += N) {
    const auto x0 = Io::Load(d, row + k);
    const auto x1 = Io::Load(d, hi + k);
    const auto c = hn::LoadU(d, C + k);
    const auto s = hn::LoadU(d, S + k);
    Io::Store(d, hn::Sub(KeepRounded(hn::Mul(x0, c)), KeepRounded(hn::Mul(x1, s))), row + k);
    Io::Store(d, hn::Add(KeepRounded(hn::Mul(x0, s)), KeepRounded(hn::Mul(x1, c))), hi + k);
  }
#endif
  for (; k < half; ++k) {
    const float x0 = Io::Get(row, k);
    const float x1 = Io::Get(hi, k);
    Io::Put(row, k, KeepRoundedScalar(x0 * C[k]) - KeepRoundedScalar(x1 * S[k]));
    Io::Put(hi, k, KeepRoundedScalar(x0 * S[k]) + KeepRoundedScalar(x1 * C[k]));
  }
}

template <class Io>
HWY_INLINE void Rotate(bool neox, void* row, const float* C, const float* S, int64_t dims) {
  auto* r = static_cast<typename Io::T*>(row);
  if (neox) {
    RotateNeox<Io>(r, C, S, dims / 2);
  } else {
    RotateNormal<Io>(r, C, S, dims);
  }
}

// Stack storage for small heads, a thread_local vector (grown once) for wide ones.
HWY_INLINE float* Scratch(float* stack, int64_t need, std::vector<float>& wide) {
  if (need <= kStackDims) return stack;
  if (wide.size() < static_cast<size_t>(need)) wide.resize(static_cast<size_t>(need));
  return wide.data();
}

void RopeShiftImpl(const TensorView& key, std::span<const int32_t> delta,
                   const RopeParams& params) {
  const int64_t head_dim = key.ne[0];
  const int64_t dims = params.dims > 0 ? params.dims : head_dim;
  const int64_t half = dims / 2;
  if (half <= 0) return;
  thread_local std::vector<float> wide_c, wide_s, wide_row;
  HWY_ALIGN float stack_c[kStackDims];
  HWY_ALIGN float stack_s[kStackDims];
  HWY_ALIGN float stack_row[kStackDims];
  float* C = Scratch(stack_c, dims, wide_c);
  float* S = Scratch(stack_s, dims, wide_s);

  const DType t = key.dtype;
  const bool buffered = IsQuantized(t) || (t == DType::kF16 && !KV_ROPE_NATIVE_F16);
  float* buf = buffered ? Scratch(stack_row, head_dim, wide_row) : nullptr;
  // Quantized rows are re-quantized whole like the reference; float rows only where rotated.
  const int64_t buf_len = IsQuantized(t) ? head_dim : dims;

  bool have_table = false;
  int32_t table_delta = 0;
  for (int64_t i = 0; i < key.ne[2]; ++i) {
    const int32_t dl = delta[static_cast<size_t>(i)];
    if (dl == 0) continue;
    if (!have_table || dl != table_delta) {
      for (int64_t k = 0; k < half; ++k) {  // the reference's expression, term for term
        const double theta =
            static_cast<double>(params.freq_scale) *
            std::pow(static_cast<double>(params.base), -2.0 * static_cast<double>(k) / dims);
        const double angle = static_cast<double>(dl) * theta;
        const float c = static_cast<float>(std::cos(angle));
        const float s = static_cast<float>(std::sin(angle));
        if (params.neox) {
          C[k] = c;
          S[k] = s;
        } else {
          C[2 * k] = c;
          C[2 * k + 1] = c;
          S[2 * k] = -s;
          S[2 * k + 1] = s;
        }
      }
      have_table = true;
      table_delta = dl;
    }
    for (int64_t h = 0; h < key.ne[1]; ++h) {
      void* row = RowPtr(key, h, i);
      if (buffered) {
        RowToF32(row, t, buf, buf_len);
        Rotate<F32Io>(params.neox, buf, C, S, dims);
        ConvertRow(buf, DType::kF32, row, t, buf_len);
        continue;
      }
      switch (t) {
        case DType::kF32:
          Rotate<F32Io>(params.neox, row, C, S, dims);
          break;
        case DType::kBF16:
          Rotate<BF16Io>(params.neox, row, C, S, dims);
          break;
#if KV_ROPE_NATIVE_F16
        case DType::kF16:
          Rotate<F16Io>(params.neox, row, C, S, dims);
          break;
#endif
        default:
          break;
      }
    }
  }
}

#undef KV_ROPE_NATIVE_F16

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {
HWY_EXPORT(RopeShiftImpl);

void RopeShift(const TensorView& key, std::span<const int32_t> delta, const RopeParams& params) {
  if (key.ne[2] <= 0 || key.ne[1] <= 0) return;
  HWY_DYNAMIC_DISPATCH(RopeShiftImpl)(key, delta, params);
}
}  // namespace kv::kernels
#endif  // HWY_ONCE
