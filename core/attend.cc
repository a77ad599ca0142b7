// Attend: validates q, the History and out, resolves the parameters, and runs kernels/attention.
#include "core/attend.h"

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/mask_index.h"
#include "kernels/attention.h"
#include "kernels/convert.h"
#include "kernels/grow_buffer.h"

namespace kv {
namespace {

Status Invalid(const char* what) {
  return Status::Error(Code::kInvalidArgument, "Attend: %s", what);
}

bool Is3D(const TensorView& t) { return t.ne[3] == 1; }

Status Validate(const TensorView& q, const History& h, const AttentionParams& params,
                const TensorView* out, bool* v_permuted) {
  const TensorView& k = h.k;
  const TensorView& v = h.v;
  const TensorView& mask = h.mask;
  if (out == nullptr) return Invalid("out is null");
  if (q.dtype != DType::kF32 || q.nb[0] != 4) return Invalid("q must be f32 with dim 0 packed");
  if (out->dtype != DType::kF32 || out->nb[0] != 4)
    return Invalid("out must be f32 with dim 0 packed");
  if (!Is3D(q) || !Is3D(k) || !Is3D(v) || !Is3D(*out)) return Invalid("views must have ne[3] == 1");
  if (!IsValidDType(k.dtype) || !IsValidDType(v.dtype)) return Invalid("invalid K/V dtype");
  const int64_t D = q.ne[0], B = q.ne[1], Hq = q.ne[2];
  const int64_t Hkv = k.ne[1], L = k.ne[2];
  if (D < 1 || B < 0 || Hq < 1) return Invalid("q shape must be [head_dim >= 1, B, n_heads >= 1]");
  if (k.ne[0] != D) {
    return Status::Error(Code::kInvalidArgument, "Attend: k head_dim %lld != q head_dim %lld",
                         static_cast<long long>(k.ne[0]), static_cast<long long>(D));
  }
  if (Hkv < 1 || L < 0) return Invalid("k shape must be [head_dim, kv_heads >= 1, L]");
  if (Hq % Hkv != 0) {
    return Status::Error(Code::kInvalidArgument,
                         "Attend: n_heads %lld not a multiple of kv_heads %lld",
                         static_cast<long long>(Hq), static_cast<long long>(Hkv));
  }
  if (!HasPackedRows(k)) return Invalid("k rows must be packed along dim 0");
  const bool fits_plain = v.ne[1] == Hkv && v.ne[2] == L;
  const bool fits_perm = v.ne[0] == L && v.ne[2] == Hkv;
  if (!fits_plain && !fits_perm) {
    return Invalid("v must be [v_head_dim, kv_heads, L] or permuted [L, v_head_dim, kv_heads]");
  }
  bool perm = !fits_plain;
  if (h.v_layout == VLayout::kPlain || h.v_layout == VLayout::kPermuted) {
    perm = h.v_layout == VLayout::kPermuted;
    if (perm ? !fits_perm : !fits_plain) {
      return Invalid(perm ? "v_layout says permuted: v must be [L, v_head_dim, kv_heads]"
                          : "v_layout says plain: v must be [v_head_dim, kv_heads, L]");
    }
  } else if (h.v_layout != VLayout::kAuto) {
    return Invalid("v_layout is not kAuto, kPlain or kPermuted");
  } else if (fits_plain && fits_perm) {
    perm = !(v.nb[1] == k.nb[1] && v.nb[2] == k.nb[2]);
  }
  const int64_t Dv = perm ? v.ne[1] : v.ne[0];
  if (Dv < 1) return Invalid("v_head_dim must be >= 1");
  if (perm && IsQuantized(v.dtype)) {
    return Status::Error(Code::kNotSupported, "Attend: permuted V must be f32, f16 or bf16");
  }
  if (v.nb[0] != BlockBytes(v.dtype)) return Invalid("v must be packed along dim 0");
  if (D > kernels::kAttentionMaxHeadDim || Dv > kernels::kAttentionMaxHeadDim) {
    return Status::Error(Code::kNotSupported, "Attend: head_dim above %lld",
                         static_cast<long long>(kernels::kAttentionMaxHeadDim));
  }
  if ((IsQuantized(k.dtype) && D % kQuantBlockElems != 0) ||
      (IsQuantized(v.dtype) && Dv % kQuantBlockElems != 0)) {
    return Invalid("quantized K/V need head dims that are multiples of 32");
  }
  if (out->ne[0] != Dv || out->ne[1] != B || out->ne[2] != Hq) {
    return Invalid("out must be [v_head_dim, B, n_heads]");
  }
  if (mask.data != nullptr) {
    if (mask.dtype != DType::kF32 && mask.dtype != DType::kF16)
      return Invalid("mask must be f32 or f16");
    if (mask.nb[0] != BlockBytes(mask.dtype)) return Invalid("mask must be packed along dim 0");
    if (mask.ne[0] != L || mask.ne[1] != B) return Invalid("mask must be [L, B]");
  }
  const bool empty = L == 0 || B == 0;
  if (B > 0 && (q.data == nullptr || out->data == nullptr)) return Invalid("q or out data is null");
  if (!empty && (k.data == nullptr || v.data == nullptr)) return Invalid("k or v data is null");
  if (!std::isfinite(params.scale)) return Invalid("scale must be finite");
  if (!std::isfinite(params.softcap) || params.softcap < 0) return Invalid("softcap must be >= 0");
  *v_permuted = perm;
  return Status::Ok();
}

// K and V stored in different dtypes (the encoder keeps what it is given) meet kernels that read
// one dtype for both: each of the two that is not f32 is widened to a contiguous f32 copy first.
// Widening is exact for every dtype and is how the kernels and the reference read the values
// anyway, so the result is the f32 kernel's over the same numbers. It costs one more pass over the
// converted views per call; the copy lives in a per-thread buffer that grows to the largest shape
// it has seen, so a steady state allocates nothing. Same-dtype histories never come here.
// k and v are replaced by views of the copy where they were widened. A buffer of its own, not one
// of the kernels' (attn::ThreadScratch): the kernels use those while they read this copy.
Status WidenMixedToF32(TensorView* k, TensorView* v) {
  thread_local kernels::GrowBuffer buf;
  // A history may broadcast (stride 0) and declare any length: its copy's size is counted with
  // checked products (ContiguousBytesFit). Each copy is bounded by a quarter of the address space,
  // so the padded sum and its bytes fit in size_t.
  const auto copy_bytes = [](const TensorView& t, size_t* bytes) {
    *bytes = 0;
    return t.dtype == DType::kF32 ||
           (ContiguousBytesFit(DType::kF32, t.ne, bytes) && *bytes <= SIZE_MAX / 4);
  };
  size_t k_bytes = 0, v_bytes = 0;
  if (!copy_bytes(*k, &k_bytes) || !copy_bytes(*v, &v_bytes)) {
    return Status::Error(Code::kOutOfMemory,
                         "Attend: the f32 copy of K / V of different dtypes exceeds the address "
                         "space");
  }
  const size_t k_floats = k_bytes / sizeof(float), v_floats = v_bytes / sizeof(float);
  // The K copy ends on a 64-byte boundary so that V's rows start aligned too.
  const size_t k_padded = (k_floats + 15) / 16 * 16;
  float* copy = buf.Reserve(k_padded + v_floats);
  if (copy == nullptr) {
    return Status::Error(Code::kOutOfMemory,
                         "Attend: no memory for the f32 copy of K / V of different dtypes");
  }
  // ViewToF32 keeps a view's dimension order: [Dv, Hkv, L] stays plain, [L, Dv, Hkv] permuted.
  const auto widen = [](TensorView* t, float* dst) {
    kernels::ViewToF32(*t, dst);
    *t = MakeView(dst, DType::kF32, {t->ne[0], t->ne[1], t->ne[2]});
  };
  if (k_floats > 0) widen(k, copy);
  if (v_floats > 0) widen(v, copy + k_padded);
  return Status::Ok();
}

}  // namespace

Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out, const ParallelFor& parallel) {
  bool perm = false;
  KV_RETURN_IF_ERROR(Validate(q, history, params, out, &perm));
  if (q.ne[1] == 0) return Status::Ok();
  kernels::AttentionKernelParams kp;
  kp.scale = params.scale != 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(q.ne[0]));
  kp.softcap = params.softcap;
  kp.sinks = params.sinks;
  kp.integer_v = params.integer_v;
  kp.integer_k = params.integer_k;
  kp.v_permuted = perm;
  kernels::ParallelForFn pf;
  pf.run = parallel.run;
  pf.user = parallel.user;
  pf.num_threads = parallel.num_threads;
  TensorView k = history.k, v = history.v;
  if (k.dtype != v.dtype && k.ne[2] > 0) KV_RETURN_IF_ERROR(WidenMixedToF32(&k, &v));
  // The mask's row bitmaps, computed once per forward pass for all the layers (the first call
  // computes them, reading the mask; later ones skip that read).
  if (history.mask_index != nullptr) kp.mask_bits = history.mask_index->BitsFor(history.mask, pf);
  if (!kernels::Attention(q, k, v, history.mask, kp, pf, out)) {
    return Status::Error(Code::kOutOfMemory, "Attend: no memory for the kernels' scratch buffers");
  }
  return Status::Ok();
}

Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out) {
  return Attend(q, history, params, out, ParallelFor{});
}

Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out, ThreadPool* pool) {
  if (pool == nullptr) return Attend(q, history, params, out, ParallelFor{});
  return Attend(q, history, params, out, pool->AsParallelFor());
}

}  // namespace kv
