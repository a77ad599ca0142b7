// Differential fuzzer of the kernels against their scalar references, on the Highway target the
// input picks: convert (ConvertRow, RowToF32, ScatterToCells, ViewToF32; quantize included), mask
// (BuildMask), rope (RopeShift) and attention (Attention vs the double AttentionRef).
// Byte 0 picks the target, byte 1 the kernel, the rest are shapes, parameters and raw data.
// Contracts checked: bit-exact for convert, mask and rope (kernels/*.h say so; NaN payloads may
// differ, NaN-ness may not); attention within the bound of tests/attention_test.cc.
// The targets include AVX3_DL, which every kernel unit compiles (kernels/highway_targets.h): the
// attention kernels' integer passes run only there.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fuzz_common.h"
#include "kernels/attention.h"
#include "kernels/convert.h"
#include "kernels/mask.h"
#include "kernels/rope.h"
#include "layouts/kv_layout.h"
#include "layouts/quant.h"

namespace {

using kv::DType;
using kv::TensorView;
using kvfuzz::Reader;

const DType kAll[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};
const DType kFloat[] = {DType::kF32, DType::kF16, DType::kBF16};

const char* g_target = "";

// A float from the input: mostly small values, sometimes raw bits (inf, NaN, subnormals).
float FuzzFloat(Reader& r, bool finite) {
  const uint8_t how = r.U8();
  if (how < 200) return static_cast<float>(static_cast<int8_t>(r.U8())) / 32.0f;
  if (how < 230) return static_cast<float>(static_cast<int16_t>(r.U16())) * 0.001f;
  float f = kv::F32FromBits(r.U32());
  if (finite && !std::isfinite(f)) f = 1.0f;
#ifdef KVFUZZ_SKIP_TINY
  // Build with -DKVFUZZ_SKIP_TINY to look past the known q8_0/q4_0 tiny-scale bug
  // (tests/fuzz_regressions_test.cc) while it is open.
  // (and of the huge-value one: amax / 127 beyond the f16 range stores an inf scale).
  if (finite && f != 0.0f && std::fabs(f) < 1e-30f) f = 0.0f;
  if (finite && std::fabs(f) > 1e6f) f = 1e6f;
#endif
  return f;
}

bool SameFloat(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// Elementwise equality of two buffers of `t` elements (bytes for quantized; NaN-aware for floats).
bool SameElems(const uint8_t* a, const uint8_t* b, size_t bytes, DType t) {
  if (kv::IsQuantized(t)) return std::memcmp(a, b, bytes) == 0;
  const size_t es = kv::BlockBytes(t);
  for (size_t i = 0; i + es <= bytes; i += es) {
    if (std::memcmp(a + i, b + i, es) == 0) continue;
    if (!SameFloat(kv::LoadAsF32(a + i, t, 0), kv::LoadAsF32(b + i, t, 0))) return false;
  }
  return true;
}

// A row of n elements of `t` with valid contents (quantized: quantized from fuzzed floats).
std::vector<uint8_t> FuzzRow(Reader& r, DType t, int64_t n, bool finite) {
  std::vector<float> f(static_cast<size_t>(n));
  for (float& x : f) x = FuzzFloat(r, finite || kv::IsQuantized(t));
  std::vector<uint8_t> out(kv::RowBytes(t, n) + 16);
  kv::StoreRowFromF32(f.data(), n, t, out.data());
  return out;
}

void FuzzConvertRow(Reader& r) {
  const DType src_t = r.Pick(kFloat), dst_t = r.Pick(kAll);
  const int64_t n = kv::IsQuantized(dst_t) ? 32 * r.Int(1, 6) : r.Int(0, 100);
  const bool quant = kv::IsQuantized(dst_t);
  std::vector<uint8_t> src = FuzzRow(r, src_t, n, quant);  // quantizing NaN/inf is unspecified
  std::vector<uint8_t> a(kv::RowBytes(dst_t, n) + 8, 0xAB), b = a;
  kv::kernels::ConvertRow(src.data(), src_t, a.data(), dst_t, n);
  kv::kernels::ConvertRowRef(src.data(), src_t, b.data(), dst_t, n);
  FUZZ_CHECK(SameElems(a.data(), b.data(), a.size() - 8, dst_t), "%s: ConvertRow %s->%s n=%lld",
             g_target, kv::DTypeName(src_t), kv::DTypeName(dst_t), (long long)n);
  FUZZ_CHECK(std::memcmp(a.data() + a.size() - 8, b.data() + b.size() - 8, 8) == 0,
             "%s: ConvertRow wrote past the row", g_target);
}

void FuzzRowToF32(Reader& r) {
  const DType t = r.Pick(kAll);
  const int64_t n = kv::IsQuantized(t) ? 32 * r.Int(1, 6) : r.Int(0, 100);
  // Raw bytes for quantized rows too: any scale (inf, NaN, subnormal) must dequantize alike.
  std::vector<uint8_t> src(kv::RowBytes(t, n) + 16);
  if (r.OneIn(2)) {
    for (uint8_t& x : src) x = r.U8();
  } else {
    src = FuzzRow(r, t, n, false);
  }
  std::vector<float> a(static_cast<size_t>(n) + 2, 7.0f), b = a;
  kv::kernels::RowToF32(src.data(), t, a.data(), n);
  kv::kernels::RowToF32Ref(src.data(), t, b.data(), n);
  for (size_t i = 0; i < a.size(); ++i) {
    FUZZ_CHECK(SameFloat(a[i], b[i]), "%s: RowToF32 %s n=%lld element %zu: %g vs ref %g", g_target,
               kv::DTypeName(t), (long long)n, i, a[i], b[i]);
  }
}

// A strided float view [ne0, ne1, ne2] over `buf` with gaps between elements/rows.
TensorView StridedView(Reader& r, DType t, int64_t ne0, int64_t ne1, int64_t ne2,
                       std::vector<uint8_t>* buf, bool finite) {
  const size_t es = kv::BlockBytes(t);
  TensorView v;
  v.dtype = t;
  v.ne[0] = ne0, v.ne[1] = ne1, v.ne[2] = ne2, v.ne[3] = 1;
  v.nb[0] = es * (r.OneIn(4) ? 2 : 1);
  v.nb[1] = v.nb[0] * ne0 + es * r.Int(0, 3);
  v.nb[2] = v.nb[1] * ne1 + es * r.Int(0, 3);
  v.nb[3] = v.nb[2] * ne2;
  if (r.OneIn(4)) {  // head-major: tokens adjacent, heads far apart
    v.nb[2] = v.nb[0] * ne0 + es * r.Int(0, 2);
    v.nb[1] = v.nb[2] * ne2 + es;
  }
  const size_t bytes = v.nb[1] * ne1 + v.nb[2] * ne2 + v.nb[0] * ne0 + 64;
  buf->assign(bytes, 0);
  for (size_t i = 0; i + es <= buf->size(); i += es)
    kv::StoreFromF32(buf->data() + i, t, 0, FuzzFloat(r, finite));
  v.data = buf->data();
  return v;
}

void FuzzScatter(Reader& r) {
  const DType dst_t = r.Pick(kAll), src_t = r.Pick(kFloat);
  const bool quant = kv::IsQuantized(dst_t);
  const int32_t head_dim = quant ? 32 * r.Int(1, 3) : r.Int(1, 70);
  const int32_t heads = r.Int(1, 4);
  const int32_t cells = r.Int(1, 40);
  const bool fastest = !quant && r.OneIn(3);
  const int32_t n = r.Int(0, cells);
  // n distinct cells in fuzzed order.
  std::vector<int32_t> all(cells);
  for (int32_t i = 0; i < cells; ++i) all[i] = i;
  for (int32_t i = cells - 1; i > 0; --i) std::swap(all[i], all[r.Int(0, i)]);
  std::vector<int32_t> targets(all.begin(), all.begin() + n);
  std::vector<uint8_t> buf;
  const TensorView src = StridedView(r, src_t, head_dim, heads, n, &buf, quant);
  const kv::CellBlockLayout layout =
      kv::MakeCellBlockLayout(dst_t, head_dim, heads, cells, fastest);
  std::vector<uint8_t> a(layout.bytes, 0x5C), b = a;
  kv::kernels::ScatterToCells(src, targets, layout, a.data());
  kv::kernels::ScatterToCellsRef(src, targets, layout, b.data());
  FUZZ_CHECK(SameElems(a.data(), b.data(), a.size(), dst_t),
             "%s: ScatterToCells %s->%s head_dim %d heads %d cells %d n %d fastest %d", g_target,
             kv::DTypeName(src_t), kv::DTypeName(dst_t), head_dim, heads, cells, n, fastest);
}

void FuzzViewToF32(Reader& r) {
  const DType t = r.Pick(kAll);
  const bool quant = kv::IsQuantized(t);
  const int64_t ne0 = quant ? 32 * r.Int(1, 2) : r.Int(1, 40);
  const int64_t ne1 = r.Int(1, 4), ne2 = r.Int(1, 6);
  std::vector<uint8_t> buf;
  TensorView v;
  if (quant) {
    v.dtype = t;
    v.ne[0] = ne0, v.ne[1] = ne1, v.ne[2] = ne2, v.ne[3] = 1;
    v.nb[0] = kv::BlockBytes(t);
    // Quantized blocks hold an f16 scale: rows stay 2-byte aligned (the caches' always are).
    v.nb[1] = kv::RowBytes(t, ne0) + 2 * r.Int(0, 2);
    v.nb[2] = v.nb[1] * ne1 + 2 * r.Int(0, 2);
    v.nb[3] = v.nb[2] * ne2;
    buf.resize(v.nb[3] + 64);
    for (uint8_t& x : buf) x = r.U8();
    v.data = buf.data();
  } else {
    v = StridedView(r, t, ne0, ne1, ne2, &buf, false);
  }
  const size_t n = static_cast<size_t>(kv::NumElements(v));
  std::vector<float> a(n + 1, 3.0f), b = a;
  kv::kernels::ViewToF32(v, a.data());
  kv::kernels::ViewToF32Ref(v, b.data());
  for (size_t i = 0; i < a.size(); ++i) {
    FUZZ_CHECK(SameFloat(a[i], b[i]), "%s: ViewToF32 %s [%lld %lld %lld] element %zu: %g vs %g",
               g_target, kv::DTypeName(t), (long long)ne0, (long long)ne1, (long long)ne2, i, a[i],
               b[i]);
  }
}

void FuzzMask(Reader& r) {
  const int32_t n = r.Int(0, 150);
  const int32_t b = r.Int(1, 12);
  const int max_seq = r.OneIn(4) ? r.Int(65, 130) : r.Int(1, 4);
  const size_t words = static_cast<size_t>((max_seq + 63) / 64);
  const int32_t specials[] = {0, 1, -1, INT32_MAX, INT32_MIN, 1 << 30, -(1 << 30), 100};
  auto fuzz_pos = [&]() { return r.OneIn(16) ? r.Pick(specials) : r.Int(-3, 40); };
  std::vector<int32_t> pos(n + 1);
  std::vector<uint64_t> bits(words * (n + 1), 0);
  for (int32_t j = 0; j < n; ++j) {
    pos[j] = fuzz_pos();
    const int holders = r.Int(0, 2);
    for (int h = 0; h < holders; ++h) {
      const int s = r.Int(0, max_seq - 1);
      bits[(s / 64) * static_cast<size_t>(n + 1) + j] |= uint64_t{1} << (s % 64);
    }
  }
  kv::kernels::MaskCells cells;
  cells.pos = pos.data();
  cells.seq_bits = bits.data();
  cells.seq_word_stride = static_cast<size_t>(n + 1);
  cells.n = n;
  std::vector<int32_t> tp(b), ts(b);
  std::vector<uint8_t> causal(b);
  for (int32_t i = 0; i < b; ++i) {
    tp[i] = fuzz_pos();
    ts[i] = r.Int(0, max_seq - 1);
    causal[i] = r.OneIn(4) ? 0 : 1;
  }
  kv::kernels::MaskTokens tokens;
  tokens.pos = tp;
  tokens.seq = ts;
  tokens.causal = causal;
  kv::kernels::MaskRules rules;
  const int32_t windows[] = {0, 1, 2, 3, 7, 100, INT32_MAX - 1, kv::kernels::kNoWindow};
  rules.window = r.OneIn(2) ? kv::kernels::kNoWindow : r.Pick(windows);
  rules.window_inclusive = r.OneIn(2);
  const int32_t chunks[] = {0, 0, 1, 2, 3, 5, 64, INT32_MAX};
  rules.chunk = r.Pick(chunks);
  const DType mdt = r.OneIn(2) ? DType::kF16 : DType::kF32;
  const size_t bytes = static_cast<size_t>(b) * n * kv::BlockBytes(mdt) + 8;
  std::vector<uint8_t> a(bytes, 0x77), c = a;
  kv::kernels::BuildMask(cells, tokens, rules, mdt, a.data());
  kv::kernels::BuildMaskRef(cells, tokens, rules, mdt, c.data());
  for (size_t i = 0; i < bytes; ++i) {
    FUZZ_CHECK(a[i] == c[i],
               "%s: BuildMask %s n=%d b=%d window %d%s chunk %d: byte %zu (token %zu)", g_target,
               kv::DTypeName(mdt), n, b, rules.window, rules.window_inclusive ? " inclusive" : "",
               rules.chunk, i, n ? i / kv::BlockBytes(mdt) / n : 0);
  }
}

void FuzzRope(Reader& r) {
  const DType t = r.Pick(kAll);
  const bool quant = kv::IsQuantized(t);
  const int32_t head_dim = quant ? 32 * r.Int(1, 3) : 2 * r.Int(1, 40);
  const int32_t heads = r.Int(1, 3), n = r.Int(1, 12);
  kv::kernels::RopeParams p;
  p.dims = r.OneIn(2) ? 0 : 2 * r.Int(1, head_dim / 2);
  const float bases[] = {10000.0f, 500000.0f, 1000000.0f, 1.0f, 2.5f};
  p.base = r.Pick(bases);
  const float scales[] = {1.0f, 0.25f, 0.5f, 4.0f, 1e-3f};
  p.freq_scale = r.Pick(scales);
  p.neox = r.OneIn(2);
  std::vector<int32_t> delta(n);
  const int32_t specials[] = {0, 1, -1, 1000000, -1000000, INT32_MAX, INT32_MIN + 1, 4096};
  for (int32_t& d : delta) d = r.OneIn(8) ? r.Pick(specials) : r.Int(-40, 40);
  // Rows packed along dim 0; head-major or cell-major, with fuzzed padding between rows.
  const size_t row = kv::RowBytes(t, head_dim);
  TensorView v;
  v.dtype = t;
  v.ne[0] = head_dim, v.ne[1] = heads, v.ne[2] = n, v.ne[3] = 1;
  v.nb[0] = kv::BlockBytes(t);
  const size_t pad = static_cast<size_t>(r.Int(0, 3)) * (quant ? 2 : kv::BlockBytes(t));
  if (r.OneIn(2)) {
    v.nb[2] = row + pad;
    v.nb[1] = v.nb[2] * n + pad;
  } else {
    v.nb[1] = row + pad;
    v.nb[2] = v.nb[1] * heads + pad;
  }
  v.nb[3] = v.nb[1] * heads + v.nb[2] * n;
  std::vector<uint8_t> a(v.nb[3] + 64, 0x3C);
  for (int32_t c = 0; c < n; ++c) {
    for (int32_t h = 0; h < heads; ++h) {
      const std::vector<uint8_t> rowdata = FuzzRow(r, t, head_dim, r.U8() < 240);
      std::memcpy(a.data() + c * v.nb[2] + h * v.nb[1], rowdata.data(), row);
    }
  }
  std::vector<uint8_t> b = a;
  v.data = a.data();
  kv::kernels::RopeShift(v, delta, p);
  v.data = b.data();
  kv::kernels::RopeShiftRef(v, delta, p);
  FUZZ_CHECK(SameElems(a.data(), b.data(), a.size(), t),
             "%s: RopeShift %s head_dim %d heads %d n %d dims %d base %g scale %g %s", g_target,
             kv::DTypeName(t), head_dim, heads, n, p.dims, p.base, p.freq_scale,
             p.neox ? "neox" : "normal");
}

void RunAll(void*, int64_t n, void (*task)(void*, int64_t), void* ctx) {
  for (int64_t i = n; i-- > 0;) task(ctx, i);  // reverse order: tasks must be independent
}

void FuzzAttention(Reader& r) {
  const DType t = r.Pick(kAll);
  const bool quant = kv::IsQuantized(t);
  const int64_t dims[] = {1, 2, 3, 4, 8, 16, 17, 32, 64, 128};
  const int64_t D = quant ? 32 * r.Int(1, 2) : r.Pick(dims);
  const int64_t Dv = quant ? 32 * r.Int(1, 2) : (r.OneIn(2) ? D : r.Pick(dims));
  const int64_t Hkv = r.Int(1, 2), G = r.Int(1, 3), Hq = Hkv * G;
  // B: decode's sizes, kAuto's choice between decode and prefill (8-20), and now and then more
  // rows than one decode plan serves (65-140: decode and kAuto run them in groups). L: now and
  // then past 512 cells, where decode on several threads cuts each head's cells into chunks
  // (prepares the heads' query rows once for them, and merges their partials).
  const int64_t L = r.OneIn(10) ? r.Int(513, 1500) : r.Int(1, 300);
  const int64_t B = r.OneIn(3) ? (r.OneIn(5) ? r.Int(65, 140) : r.Int(8, 20)) : r.Int(1, 7);
  const bool perm = !quant && r.OneIn(4);
  const bool head_major = r.OneIn(2);
  // K [D, Hkv, L] and V (plain [Dv, Hkv, L] or permuted [L, Dv, Hkv]) in storage dtype t.
  auto make_rows = [&](int64_t d, std::vector<uint8_t>* buf, TensorView* v) {
    const size_t row = kv::RowBytes(t, d);
    v->dtype = t;
    v->ne[0] = d, v->ne[1] = Hkv, v->ne[2] = L, v->ne[3] = 1;
    v->nb[0] = kv::BlockBytes(t);
    if (head_major) {
      v->nb[2] = row, v->nb[1] = row * L;
    } else {
      v->nb[1] = row, v->nb[2] = row * Hkv;
    }
    v->nb[3] = row * L * Hkv;
    buf->assign(v->nb[3] + 64, 0);
    const uint8_t seed = r.U8();
    std::vector<float> f(static_cast<size_t>(d));
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t c = 0; c < L; ++c) {
        for (int64_t e = 0; e < d; ++e)
          f[e] =
              static_cast<float>(static_cast<int>((seed + 37 * c + 11 * e + 5 * h) % 255) - 127) /
              127.0f;
        kv::StoreRowFromF32(f.data(), d, t, buf->data() + h * v->nb[1] + c * v->nb[2]);
      }
    v->data = buf->data();
  };
  std::vector<uint8_t> kbuf, vbuf;
  TensorView k, v;
  make_rows(D, &kbuf, &k);
  if (perm) {
    v.dtype = t;
    v.ne[0] = L, v.ne[1] = Dv, v.ne[2] = Hkv, v.ne[3] = 1;
    v.nb[0] = kv::BlockBytes(t);
    v.nb[1] = v.nb[0] * L + 8 * v.nb[0];
    v.nb[2] = v.nb[1] * Dv;
    v.nb[3] = v.nb[2] * Hkv;
    vbuf.assign(v.nb[3] + 64, 0);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t e = 0; e < Dv; ++e)
        for (int64_t c = 0; c < L; ++c)
          kv::StoreFromF32(vbuf.data() + h * v.nb[2] + e * v.nb[1] + c * v.nb[0], t, 0,
                           static_cast<float>((c * 7 + e * 3 + h) % 19) / 19.0f - 0.5f);
    v.data = vbuf.data();
  } else {
    make_rows(Dv, &vbuf, &v);
  }
  std::vector<float> q(static_cast<size_t>(D * B * Hq));
  const float qscale = r.OneIn(4) ? 8.0f : 1.0f;
  for (float& x : q) x = static_cast<float>(static_cast<int8_t>(r.U8())) / 128.0f * qscale;
  TensorView qv = kv::MakeView(q.data(), DType::kF32, {D, B, Hq});
  // Mask: none, or 0 / -inf with some finite values, whole rows hidden sometimes.
  const DType mdt = r.OneIn(2) ? DType::kF16 : DType::kF32;
  std::vector<uint8_t> mask;
  TensorView mv;
  const uint8_t mask_kind = r.U8() % 4;
  if (mask_kind != 0) {
    mask.assign(static_cast<size_t>(L * B) * kv::BlockBytes(mdt), 0);
    int64_t lo = 0, hi = 0;
    for (int64_t i = 0; i < B; ++i) {
      // Often the previous row's cells again: decode runs rows that see the same cells together.
      if (i == 0 || !r.OneIn(2)) {
        lo = r.Int(0, static_cast<int>(L));
        hi = r.Int(0, static_cast<int>(L));
      }
      for (int64_t j = 0; j < L; ++j) {
        float m = (j >= lo && j <= hi) ? 0.0f : -INFINITY;
        // Kind 3: finite values in every fifth visible cell; kind 2: in one of 61 and -0 in one
        // of 7 (prefill skips the mask in tiles of granules that hold only +-0).
        if (mask_kind == 3 && m == 0.0f && (j * 13 + i) % 5 == 0) m = -1.5f;
        if (mask_kind == 2 && m == 0.0f && (j * 13 + i) % 7 == 0) m = -0.0f;
        if (mask_kind == 2 && m == 0.0f && (j * 13 + i) % 61 == 0) m = -1.5f;
        kv::StoreFromF32(mask.data() + (i * L + j) * kv::BlockBytes(mdt), mdt, 0, m);
      }
    }
    mv = kv::MakeView(mask.data(), mdt, {L, B});
  }
  kv::kernels::AttentionKernelParams kp;
  kp.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float caps[] = {0.0f, 0.0f, 30.0f, 5.0f};
  kp.softcap = r.Pick(caps);
  std::vector<float> sinks(Hq);
  for (float& s : sinks) s = static_cast<float>(static_cast<int8_t>(r.U8())) / 64.0f;
  if (r.OneIn(3)) kp.sinks = sinks.data();
  kp.v_permuted = perm;
  const kv::kernels::AttentionMode modes[] = {kv::kernels::AttentionMode::kAuto,
                                              kv::kernels::AttentionMode::kDecode,
                                              kv::kernels::AttentionMode::kPrefill};
  kp.mode = r.Pick(modes);
  kv::kernels::ParallelForFn pf;
  if (r.OneIn(2)) {
    pf.run = RunAll;
    pf.num_threads = r.Int(2, 6);
  }
  kp.integer_v = r.OneIn(2);  // AVX3_DL decode over q8_0 / q4_0 plain V: int16 weights
  kp.integer_k = r.OneIn(2);  // AVX3_DL decode over q8_0 K: int16 query rows
  kp.float_k = r.OneIn(2);    // without integer_k: the f32 K pass instead of the 24-bit one
  // Decode's f32 V pass over q8_0 / q4_0: the block scale on the codes or (AVX-512) the weights.
  const kv::kernels::QuantVScaling scalings[] = {kv::kernels::QuantVScaling::kAuto,
                                                 kv::kernels::QuantVScaling::kCodes,
                                                 kv::kernels::QuantVScaling::kWeights};
  kp.quant_v_scaling = r.Pick(scalings);
  kp.rows_alone = r.OneIn(4);  // decode: each row walks its cells alone
  std::vector<float> out(static_cast<size_t>(Dv * B * Hq), 12345.0f), ref(out.size(), -1.0f);
  TensorView ov = kv::MakeView(out.data(), DType::kF32, {Dv, B, Hq});
  TensorView rv = kv::MakeView(ref.data(), DType::kF32, {Dv, B, Hq});
  kv::kernels::AttentionRef(qv, k, v, mv, kp, &rv);
  if (!kv::kernels::Attention(qv, k, v, mv, kp, pf, &ov))
    return;  // out of memory: nothing to check
  // The bound of tests/attention_test.cc: |out - ref| <= 2 dlogit + 2e-6 (|V| <= 1), dlogit =
  // 4 sqrt(D) 2^-24 S_max, S_max = scale * max sum |q k|; a little slack for the fuzzer.
  double smax = 0, ksum_max = 0, qmax = 0;
  for (float x : q) qmax = std::max(qmax, std::fabs(static_cast<double>(x)) * kp.scale);
  std::vector<float> krow(static_cast<size_t>(D));
  for (int64_t hq = 0; hq < Hq; ++hq) {
    for (int64_t j = 0; j < L; ++j) {
      kv::LoadRowAsF32(kv::RowPtr(k, hq / G, j), D, t, krow.data());
      double ks = 0;
      for (int64_t d = 0; d < D; ++d) ks += std::fabs(krow[d]);
      ksum_max = std::max(ksum_max, ks);
      for (int64_t b = 0; b < B; ++b) {
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += std::fabs(q[(hq * B + b) * D + d] * krow[d]);
        smax = std::max(smax, s * kp.scale);
      }
    }
  }
  // integer_v adds its rounding bound, 16 * 2^-16 * max|V|, and integer_k e^(2 delta) - 1 with
  // delta = max|q| * scale / 65534 * max sum|k| (kernels/attention_decode.cc); q8_0 K without
  // integer_k or float_k the same with 16711422 (the 24-bit query; every mode, as kAuto may
  // decode).
  const bool k24 = t == DType::kQ8_0 && !kp.integer_k && !kp.float_k;
  const double tol =
      2.0 * (2.0 * 4.0 * std::sqrt(static_cast<double>(D)) * std::ldexp(1.0, -24) * smax + 2e-6) +
      (kp.integer_v ? 16.0 / 65536.0 : 0.0) +
      (kp.integer_k ? std::expm1(2.0 * qmax / 65534.0 * ksum_max) : 0.0) +
      (k24 ? std::expm1(2.0 * qmax / 16711422.0 * ksum_max) : 0.0);
  for (size_t i = 0; i < out.size(); ++i) {
    FUZZ_CHECK(std::fabs(out[i] - ref[i]) <= tol || (std::isnan(out[i]) && std::isnan(ref[i])),
               "%s: Attention %s D %lld Dv %lld Hkv %lld G %lld L %lld B %lld perm %d mode %d "
               "softcap %g sinks %d mask %d threads %d int_v %d int_k %d float_k %d: out[%zu] = "
               "%g, ref %g, "
               "tol %g",
               g_target, kv::DTypeName(t), (long long)D, (long long)Dv, (long long)Hkv,
               (long long)G, (long long)L, (long long)B, perm, static_cast<int>(kp.mode),
               kp.softcap, kp.sinks != nullptr, mask_kind, pf.num_threads, kp.integer_v,
               kp.integer_k, kp.float_k, i, out[i], ref[i], tol);
  }
  // Half the masked calls again, given the mask's row bitmaps (what a cache's MaskIndex hands every
  // layer after the first of a pass): the scan reads them instead of the mask, and nothing else
  // changes, so the output must be the same bits.
  if (mv.data == nullptr || !r.OneIn(2)) return;
  std::vector<uint64_t> bits(static_cast<size_t>(B * kv::kernels::MaskBitsRowWords(L)));
  kv::kernels::MaskBits(mv, pf, bits.data());
  kp.mask_bits = bits.data();
  std::vector<float> again(out.size(), 12345.0f);
  TensorView av = kv::MakeView(again.data(), DType::kF32, {Dv, B, Hq});
  if (!kv::kernels::Attention(qv, k, v, mv, kp, pf, &av)) return;
  FUZZ_CHECK(std::memcmp(again.data(), out.data(), out.size() * sizeof(float)) == 0,
             "%s: Attention %s D %lld L %lld B %lld mode %d threads %d mask %d: the output "
             "differs when the mask's bits are given",
             g_target, kv::DTypeName(t), (long long)D, (long long)L, (long long)B,
             static_cast<int>(kp.mode), pf.num_threads, mask_kind);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r(data, size);
  g_target = kvfuzz::UseTarget(r.U8());
  switch (r.U8() % 7) {
    case 0:
      FuzzConvertRow(r);
      break;
    case 1:
      FuzzRowToF32(r);
      break;
    case 2:
      FuzzScatter(r);
      break;
    case 3:
      FuzzViewToF32(r);
      break;
    case 4:
      FuzzMask(r);
      break;
    case 5:
      FuzzRope(r);
      break;
    default:
      FuzzAttention(r);
      break;
  }
  hwy::SetSupportedTargetsForTest(0);
  return 0;
}
