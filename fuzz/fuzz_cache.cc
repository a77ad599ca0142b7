// Differential fuzzer of the Cache interface: the input is decoded into a cache kind (causal, SWA,
// SWA with memory, chunked, encoder, wrapper) and a sequence of API calls (SetConfig, Init with
// fuzzed sizes, StartForward with fuzzed batches including bad ones, SetLayer, Put with fuzzed
// shapes, dtypes and strides, Get, SetCausal, ReserveLayers, CopyPrefix, CanResume, Remove, Close,
// SetLayerType). Every call also runs on the plain model of fuzz/reference_model.h and must give
// the same status code; after every call Get() must show the same history cells, in the same
// order, with the same values (after storage rounding) and the same mask, CanResume must agree on
// a grid, CheckConsistency must pass, and a failing call must leave Get(), CanResume, NumCells and
// EncoderCached exactly as they were. ShiftFn calls (layer and per-row deltas) must match too.
//
// With bit 7 of the kind byte set, the same script runs through the C API (core/kvcache_c.h): the
// caches are made with kvc_*_new (the ShiftFn is a C callback, the wrapper's causal child is
// reached through kvc_wrapper_child), every call is its kvc_* function, Get and CanResume are read
// through kvc_get / kvc_can_resume, a failing call must leave a message in kvc_last_error(), and a
// few calls pass NULL arrays, which must be refused without a change.
//
// Input layout: byte 0 Highway target, byte 1 kind (bit 7: via the C API), then kind parameters,
// then ops until the input runs out.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/cache.h"
#include "core/kvcache_c.h"
#include "core/kvcache_c_interop.h"
#include "core/mask_index.h"
#include "fuzz_common.h"
#include "kernels/attention.h"
#include "kernels/convert.h"
#include "layouts/quant.h"
#include "reference_model.h"

namespace {

using kv::Code;
using kv::DType;
using kv::Status;
using kv::TensorView;
using kvref::ModelHistory;
using kvref::ModelShift;
using kvref::ModelTensor;
using kvref::Result;

constexpr int kMaxOps = 200;
constexpr int64_t kMaxCells = 768;

const char* ResultName(Result r) {
  switch (r) {
    case Result::kOk:
      return "ok";
    case Result::kCacheFull:
      return "cache full";
    case Result::kNotSupported:
      return "not supported";
    case Result::kInvalidArgument:
      return "invalid argument";
  }
  return "?";
}

Result ToResult(const Status& s) {
  switch (s.code()) {
    case Code::kOk:
      return Result::kOk;
    case Code::kCacheFull:
      return Result::kCacheFull;
    case Code::kNotSupported:
      return Result::kNotSupported;
    case Code::kInvalidArgument:
      return Result::kInvalidArgument;
    default:
      FUZZ_CHECK(false, "unexpected status %s: %s", kv::CodeName(s.code()), s.message());
  }
  return Result::kOk;
}

#define EXPECT_SAME_RESULT(op, model_r, status)                                          \
  FUZZ_CHECK((model_r) == ToResult(status), "%s: model says %s, cache says %s (%s)", op, \
             ResultName(model_r), kv::CodeName((status).code()), (status).message())

// What a real Get() showed, flattened like ModelHistory.
ModelHistory Observe(const kv::History& h) {
  ModelHistory o;
  if (h.k.data != nullptr) {
    FUZZ_CHECK(h.v.data != nullptr, "Get: K without V");
    o.has_kv = true;
    o.kv_dtype = h.k.dtype;
    o.v_dtype = h.v.dtype;
    for (int d = 0; d < 4; ++d) o.k_ne[d] = h.k.ne[d], o.v_ne[d] = h.v.ne[d];
    o.k.resize(static_cast<size_t>(kv::NumElements(h.k)));
    o.v.resize(static_cast<size_t>(kv::NumElements(h.v)));
    kv::kernels::ViewToF32Ref(h.k, o.k.data());
    kv::kernels::ViewToF32Ref(h.v, o.v.data());
  }
  if (h.mask.data != nullptr) {
    o.has_mask = true;
    o.mask_dtype = h.mask.dtype;
    o.mask_cols = h.mask.ne[0];
    o.mask_rows = h.mask.ne[1];
    for (int64_t i = 0; i < o.mask_rows; ++i) {
      for (int64_t j = 0; j < o.mask_cols; ++j) {
        const char* e = static_cast<const char*>(h.mask.data) + i * h.mask.nb[1] + j * h.mask.nb[0];
        uint32_t bits = 0;
        if (h.mask.dtype == DType::kF16) {
          uint16_t b16;
          std::memcpy(&b16, e, 2);
          FUZZ_CHECK(b16 == 0 || b16 == 0xFC00, "mask (%lld, %lld) is f16 0x%04x", (long long)i,
                     (long long)j, b16);
          bits = b16 == 0 ? 1 : 0;
        } else {
          float f;
          std::memcpy(&f, e, 4);
          FUZZ_CHECK(f == 0.0f || f == -INFINITY, "mask (%lld, %lld) is %g", (long long)i,
                     (long long)j, f);
          bits = f == 0.0f ? 1 : 0;
        }
        o.visible.push_back(static_cast<uint8_t>(bits));
      }
    }
    // The cache's memo of its mask (History::mask_index) must describe the mask as it is now: it
    // is filled here after every call, so a call that rewrote the mask without forgetting the
    // memo leaves stale bits for the next check. Its memory is sized for every batch and history
    // the cache can hold, so it always has the bits.
    if (h.mask_index != nullptr) {
      // Asked first for the last row alone, as by a runtime that splits its batch's rows over
      // several Attend calls: the cache names its whole mask, so the fill covers every row and
      // the whole mask's bits are held too (when the memo was already filled, the same holds).
      const uint64_t* last_bits =
          h.mask_index->BitsFor(kv::RowsView(h.mask, o.mask_rows - 1, o.mask_rows), {});
      const uint64_t* held = h.mask_index->BitsFor(h.mask, {});
      FUZZ_CHECK(held != nullptr, "mask index: no bits for a [%lld x %lld] mask",
                 (long long)o.mask_rows, (long long)o.mask_cols);
      FUZZ_CHECK(last_bits == held + (o.mask_rows - 1) * kv::kernels::MaskBitsRowWords(o.mask_cols),
                 "mask index: the last row's bits are not the whole mask's last row");
      std::vector<uint64_t> now(kv::MaskIndex::WordsFor(h.mask.ne[0], h.mask.ne[1]));
      kv::kernels::MaskBits(h.mask, {}, now.data());
      FUZZ_CHECK(std::memcmp(held, now.data(), now.size() * sizeof(uint64_t)) == 0,
                 "mask index: its bits are not the mask's");
    }
  }
  return o;
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b, size_t* where) {
  if (a.size() != b.size()) {
    *where = SIZE_MAX;
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) {
      *where = i;
      return false;
    }
  }
  return true;
}

void CompareHistory(const ModelHistory& want, const ModelHistory& got, const char* when) {
  FUZZ_CHECK(want.has_mask == got.has_mask, "%s: mask present: model %d, cache %d", when,
             want.has_mask, got.has_mask);
  if (want.has_mask) {
    FUZZ_CHECK(want.mask_cols == got.mask_cols && want.mask_rows == got.mask_rows,
               "%s: mask [%lld x %lld], cache [%lld x %lld]", when, (long long)want.mask_rows,
               (long long)want.mask_cols, (long long)got.mask_rows, (long long)got.mask_cols);
    FUZZ_CHECK(want.mask_dtype == got.mask_dtype, "%s: mask dtype", when);
    for (size_t i = 0; i < want.visible.size(); ++i) {
      FUZZ_CHECK(want.visible[i] == got.visible[i],
                 "%s: mask token %lld cell %lld: model %s, cache %s", when,
                 (long long)(i / want.mask_cols), (long long)(i % want.mask_cols),
                 want.visible[i] ? "visible" : "hidden", got.visible[i] ? "visible" : "hidden");
    }
  }
  FUZZ_CHECK(want.has_kv == got.has_kv, "%s: K/V present: model %d, cache %d", when, want.has_kv,
             got.has_kv);
  if (!want.has_kv) return;
  FUZZ_CHECK(want.kv_dtype == got.kv_dtype && want.v_dtype == got.v_dtype, "%s: K/V dtype", when);
  for (int d = 0; d < 4; ++d) {
    FUZZ_CHECK(want.k_ne[d] == got.k_ne[d], "%s: K ne[%d] model %lld cache %lld", when, d,
               (long long)want.k_ne[d], (long long)got.k_ne[d]);
    FUZZ_CHECK(want.v_ne[d] == got.v_ne[d], "%s: V ne[%d] model %lld cache %lld", when, d,
               (long long)want.v_ne[d], (long long)got.v_ne[d]);
  }
  size_t at = 0;
  FUZZ_CHECK(SameFloats(want.k, got.k, &at), "%s: K element %zu: model %g, cache %g", when, at,
             at < want.k.size() ? want.k[at] : 0.0, at < got.k.size() ? got.k[at] : 0.0);
  FUZZ_CHECK(SameFloats(want.v, got.v, &at), "%s: V element %zu: model %g, cache %g", when, at,
             at < want.v.size() ? want.v[at] : 0.0, at < got.v.size() ? got.v[at] : 0.0);
}

// Everything observable that a failing call must leave alone.
struct Snapshot {
  ModelHistory hist;
  std::vector<uint8_t> resume;
  int32_t cells = 0;
  int encoder_cached = -1;
};

const int32_t kSpecialPos[] = {-1, -7, 1000, 1 << 30, INT32_MAX - 1, INT32_MAX, INT32_MIN, 31};

struct CHandleDeleter {
  void operator()(kvc_cache* c) const { kvc_cache_free(c); }
};

// A cache as made by Setup: a C++ object, or (via the C API) a C handle that owns it.
struct Made {
  std::unique_ptr<kv::Cache> cpp;
  kvc_cache* c = nullptr;
};

struct Harness {
  int kind = 0;
  // Via the C API (input byte 1, bit 7): every call goes through core/kvcache_c.h on `handle`
  // (and on the C handle of the causal cache for SetCausal / ReserveLayers); `cache`, `causal`,
  // `encoder` and `wrapper` then point at the objects behind the handles, for the checks only.
  bool via_c = false;
  std::unique_ptr<kvc_cache, CHandleDeleter> handle;
  kvc_cache* causal_handle = nullptr;
  std::unique_ptr<kv::Cache> owned;
  kv::Cache* cache = nullptr;
  kv::CausalCache* causal = nullptr;    // the (or the wrapper's second) causal-family cache
  kv::EncoderCache* encoder = nullptr;  // the (or the wrapper's first) encoder cache
  kv::WrapperCache* wrapper = nullptr;
  std::vector<std::unique_ptr<kvref::CacheModel>> models;  // owned; the last one is the top
  kvref::CacheModel* model = nullptr;
  kvref::CausalCacheModel* causal_model = nullptr;
  std::vector<kvref::CausalCacheModel*> causal_models;
  kvref::EncoderCacheModel* encoder_model = nullptr;
  kvref::WrapperCacheModel* wrapper_model = nullptr;
  kvref::ModelConfig config;  // last accepted
  std::vector<ModelShift> shifts_seen;
  int max_seq = 2, max_batch = 4;
  int32_t next_pos[8] = {};
  uint32_t value_seed = 1;
  DType storage = DType::kF32;
  const char* op = "";

  kv::ShiftFn MakeShiftFn() {
    return [this](int layer, TensorView key, std::span<const int32_t> delta) {
      FUZZ_CHECK(static_cast<int64_t>(delta.size()) == key.ne[2], "ShiftFn: %zu deltas, %lld rows",
                 delta.size(), (long long)key.ne[2]);
      FUZZ_CHECK(kv::HasPackedRows(key), "ShiftFn: rows not packed");
      std::vector<float> row(static_cast<size_t>(key.ne[0]));
      for (int64_t c = 0; c < key.ne[2]; ++c) {
        if (delta[c] == 0) continue;
        for (int64_t h = 0; h < key.ne[1]; ++h) {
          void* r = kv::RowPtr(key, h, c);
          kv::kernels::RowToF32Ref(r, key.dtype, row.data(), key.ne[0]);
          for (float& x : row) x += static_cast<float>(delta[c]);
          kv::kernels::ConvertRowRef(row.data(), DType::kF32, r, key.dtype, key.ne[0]);
        }
      }
      shifts_seen.push_back(ModelShift{layer, std::vector<int32_t>(delta.begin(), delta.end())});
      return Status::Ok();
    };
  }

  kv::ShiftFn cpp_shift_;  // what the C callback runs
  static kvc_code CShift(void* user, int layer, kvc_tensor key, const int32_t* shift, int64_t n) {
    auto* h = static_cast<Harness*>(user);
    const Status s = h->cpp_shift_(layer, kv::ViewFromC(key),
                                   std::span<const int32_t>(shift, static_cast<size_t>(n)));
    return static_cast<kvc_code>(s.code());
  }

  // Sets kvc_last_error() to a message none of this harness's calls can produce (it never calls
  // kvc_save), so that a failing call which left an earlier message in place shows.
  static std::string& Mark() {
    static std::string mark;
    return mark;
  }
  static void MarkLastError() {
    FUZZ_CHECK(kvc_save(nullptr, -1, nullptr, 0, nullptr) != KVC_OK, "kvc_save(NULL) succeeded");
    if (Mark().empty()) Mark() = kvc_last_error();
  }
  static bool IsMark(const char* message) { return Mark() == message; }

  // A C call's result as the Status the C++ call would give (its message from kvc_last_error,
  // which the call must have written).
  static Status FromC(const char* call, kvc_code code) {
    if (code == KVC_OK) return Status::Ok();
    const char* message = kvc_last_error();
    FUZZ_CHECK(message[0] != '\0', "%s: code %d without a message", call, code);
    FUZZ_CHECK(!IsMark(message), "%s: code %d left the previous message in place", call, code);
    const Status s = Status::Error(static_cast<Code>(code), "%s", message);
    MarkLastError();
    return s;
  }

  kv::History Get() {
    if (!via_c) return cache->Get();
    kvc_history h;
    FUZZ_CHECK(kvc_get(handle.get(), &h) == KVC_OK, "kvc_get failed: %s", kvc_last_error());
    return kv::HistoryFromC(h);
  }
  bool CanResume(int seq, int32_t p) {
    return via_c ? kvc_can_resume(handle.get(), seq, p) == 1 : cache->CanResume(seq, p);
  }

  // A causal-family cache of `family` 0..3 with its model.
  Made MakeCausal(kvfuzz::Reader& r, int family) {
    const int32_t window = r.OneIn(16) ? -1 : r.Int(0, 9);
    const int32_t memory = r.OneIn(16) ? -1 : r.Int(0, 12);
    const int32_t chunk = r.OneIn(16) ? -1 : r.Int(1, 6);
    const bool with_shift = !r.OneIn(4);
    kv::ShiftFn fn = with_shift ? MakeShiftFn() : nullptr;
    if (via_c && with_shift) cpp_shift_ = fn;
    kvc_shift cs = {};
    cs.fn = CShift;
    cs.user = this;
    const kvc_shift* cshift = with_shift ? &cs : nullptr;
    Made made;
    std::unique_ptr<kv::CausalCache> c;
    int32_t w = 0, m = 0, ch = 0;
    switch (family) {
      case 0:
        if (via_c)
          made.c = kvc_causal_new(cshift);
        else
          c = kv::NewCausalCache(fn);
        break;
      case 1:
        w = window;
        if (via_c)
          made.c = kvc_swa_new(window, cshift);
        else
          c = kv::NewSWACache(window, fn);
        break;
      case 2:
        w = window;
        m = memory;
        if (via_c)
          made.c = kvc_swa_mem_new(window, memory, cshift);
        else
          c = kv::NewSWAMemCache(window, memory, fn);
        break;
      default:
        ch = chunk;
        if (via_c)
          made.c = kvc_chunked_new(chunk, cshift);
        else
          c = kv::NewChunkedAttentionCache(chunk, fn);
        break;
    }
    models.push_back(std::make_unique<kvref::CausalCacheModel>(w, m, ch, with_shift));
    causal_model = static_cast<kvref::CausalCacheModel*>(models.back().get());
    causal_models.push_back(causal_model);
    if (via_c) {
      FUZZ_CHECK(made.c != nullptr, "kvc_*_new returned NULL");
      causal = kv::CausalFromC(made.c);
      causal_handle = made.c;
    } else {
      causal = c.get();
      made.cpp = std::move(c);
    }
    return made;
  }

  Made MakeEncoder(bool per_sequence) {
    Made made;
    if (via_c) {
      made.c = kvc_encoder_new_per_sequence(per_sequence ? 1 : 0);
      encoder = kv::EncoderFromC(made.c);
    } else {
      kv::EncoderOptions o;
      o.per_sequence = per_sequence;
      auto e = kv::NewEncoderCache(o);
      encoder = e.get();
      made.cpp = std::move(e);
    }
    models.push_back(std::make_unique<kvref::EncoderCacheModel>(per_sequence));
    encoder_model = static_cast<kvref::EncoderCacheModel*>(models.back().get());
    return made;
  }

  void Adopt(Made made) {
    if (via_c) {
      handle.reset(made.c);
      cache = kv::CacheFromC(made.c);
    } else {
      owned = std::move(made.cpp);
      cache = owned.get();
    }
  }

  void Setup(kvfuzz::Reader& r) {
    const uint8_t kind_byte = r.U8();
    kind = (kind_byte & 0x7F) % 6;
    via_c = (kind_byte & 0x80) != 0;
    if (via_c) MarkLastError();
    if (kind < 4) {
      Adopt(MakeCausal(r, kind));
      model = causal_model;
    } else if (kind == 4) {
      Adopt(MakeEncoder(r.OneIn(2)));
      model = encoder_model;
    } else {
      std::vector<Made> children;
      std::vector<kvref::CacheModel*> child_models;
      const int first = r.U8() % 4;
      if (first < 2) {
        children.push_back(MakeEncoder(first == 1));
      } else {
        children.push_back(MakeCausal(r, first == 2 ? 1 : 3));
      }
      child_models.push_back(models.back().get());
      children.push_back(MakeCausal(r, r.OneIn(2) ? 0 : 2));  // SetCausal etc. go to this one
      child_models.push_back(models.back().get());
      if (via_c) {
        kvc_cache* hs[2] = {children[0].c, children[1].c};
        kvc_cache* w = kvc_wrapper_new(hs, 2);
        FUZZ_CHECK(w != nullptr, "kvc_wrapper_new returned NULL");
        FUZZ_CHECK(kvc_wrapper_child(w, 1) == hs[1], "kvc_wrapper_child(1) is not the child");
        wrapper = kv::WrapperFromC(w);
        handle.reset(w);
        cache = wrapper;
      } else {
        std::vector<std::unique_ptr<kv::Cache>> owned_children;
        for (Made& m : children) owned_children.push_back(std::move(m.cpp));
        auto w = kv::NewWrapperCache(std::move(owned_children));
        wrapper = w.get();
        cache = w.get();
        owned = std::move(w);
      }
      models.push_back(std::make_unique<kvref::WrapperCacheModel>(child_models));
      wrapper_model = static_cast<kvref::WrapperCacheModel*>(models.back().get());
      model = wrapper_model;
    }
  }

  Snapshot Take() {
    Snapshot s;
    s.hist = Observe(Get());
    for (int seq = -1; seq <= max_seq; ++seq) {
      for (int32_t p : {0, 1, 2, 5, 9, 17, 40}) s.resume.push_back(CanResume(seq, p));
      if (seq >= 0 && seq < 8) s.resume.push_back(CanResume(seq, next_pos[seq]));
    }
    if (causal != nullptr) s.cells = causal->NumCells();
    if (encoder != nullptr) s.encoder_cached = encoder->EncoderCached();
    return s;
  }

  void ExpectUnchanged(const Snapshot& before) {
    const Snapshot after = Take();
    std::string when = std::string("after failing ") + op + " (must change nothing)";
    CompareHistory(before.hist, after.hist, when.c_str());
    FUZZ_CHECK(before.resume == after.resume, "%s: CanResume answers changed", when.c_str());
    FUZZ_CHECK(before.cells == after.cells, "%s: NumCells changed", when.c_str());
    FUZZ_CHECK(before.encoder_cached == after.encoder_cached, "%s: EncoderCached changed",
               when.c_str());
  }

  // The checks after every call.
  void CheckAll() {
    const std::string when = std::string("after ") + op;
    CompareHistory(model->Get(), Observe(Get()), when.c_str());
    for (int seq = -1; seq <= max_seq; ++seq) {
      for (int32_t p : {0, 1, 2, 5, 9, 17, 40}) {
        FUZZ_CHECK(model->CanResume(seq, p) == CanResume(seq, p), "%s: CanResume(%d, %d): model %d",
                   when.c_str(), seq, p, model->CanResume(seq, p));
      }
    }
    if (causal != nullptr) {
      FUZZ_CHECK(causal->NumCells() == causal_model->NumCells(), "%s: NumCells %d, model %d",
                 when.c_str(), causal->NumCells(), causal_model->NumCells());
      if (causal_model->initialized()) {
        const Status s = causal->CheckConsistency();
        FUZZ_CHECK(s.ok(), "%s: CheckConsistency: %s", when.c_str(), s.message());
      }
    }
    if (encoder != nullptr) {
      FUZZ_CHECK(encoder->EncoderCached() == encoder_model->EncoderCached(),
                 "%s: EncoderCached %d, model %d", when.c_str(), encoder->EncoderCached(),
                 encoder_model->EncoderCached());
    }
  }

  // ---- ops ----

  void OpSetConfig(kvfuzz::Reader& r) {
    op = "SetConfig";
    kvref::ModelConfig c;
    c.padding = r.OneIn(8) ? r.Int(-1, 0) : (r.OneIn(2) ? 1 : r.Int(1, 8));
    c.permuted_v = r.OneIn(4);
    const DType masks[] = {DType::kF32, DType::kF32, DType::kF16, DType::kBF16};
    c.mask_dtype = r.Pick(masks);
    c.inclusive_window = r.OneIn(3);
    kv::CacheConfig cc;
    cc.padding = c.padding;
    cc.permuted_v = c.permuted_v;
    cc.mask_dtype = c.mask_dtype;
    cc.window_convention =
        c.inclusive_window ? kv::WindowConvention::kInclusive : kv::WindowConvention::kOllama;
    const Snapshot before = Take();
    const Result want = model->SetConfig(c);
    kvc_config ccfg = kvc_config_default();
    ccfg.padding = cc.padding;
    ccfg.permuted_v = cc.permuted_v ? 1 : 0;
    ccfg.mask_dtype = static_cast<kvc_dtype>(cc.mask_dtype);
    ccfg.window_inclusive = c.inclusive_window ? 1 : 0;
    const Status got =
        via_c ? FromC(op, kvc_set_config(handle.get(), &ccfg)) : cache->SetConfig(cc);
    EXPECT_SAME_RESULT(op, want, got);
    if (want == Result::kOk) config = c;
    if (!got.ok() && wrapper == nullptr) ExpectUnchanged(before);
  }

  void OpInit(kvfuzz::Reader& r) {
    op = "Init";
    const DType dtypes[] = {DType::kF32,  DType::kF16,  DType::kBF16,
                            DType::kQ8_0, DType::kQ4_0, static_cast<DType>(5)};
    const DType dtype = r.Pick(dtypes);
    const int seqs = r.OneIn(16) ? 0 : r.Int(1, 4);
    const int capacity = r.OneIn(16) ? (r.OneIn(2) ? 0 : 1 << 30) : r.Int(1, 40);
    const int batch = r.OneIn(16) ? 0 : r.Int(1, 8);
    // Skip sizes that would allocate a lot (the model is slow, not the cache).
    for (kvref::CausalCacheModel* cm : causal_models) {
      if (cm->PlannedCells(dtype, seqs, capacity, batch) > kMaxCells) return;
    }
    const Snapshot before = Take();
    const Result want = model->Init(dtype, seqs, capacity, batch);
    const Status got = via_c ? FromC(op, kvc_init(handle.get(), static_cast<kvc_dtype>(dtype), seqs,
                                                  capacity, batch))
                             : cache->Init(dtype, seqs, capacity, batch);
    EXPECT_SAME_RESULT(op, want, got);
    if (got.ok()) {
      max_seq = seqs;
      max_batch = batch;
      storage = dtype;
      for (int32_t& p : next_pos) p = 0;
    } else if (wrapper == nullptr) {
      ExpectUnchanged(before);
    }
  }

  void OpStartForward(kvfuzz::Reader& r) {
    op = "StartForward";
    const uint8_t shape = r.U8();
    int b = shape % 16 == 0 ? r.Int(0, max_batch + 1) : r.Int(1, std::max(1, max_batch));
    const bool one_seq = (shape >> 4) % 2 == 0;
    const int fixed_seq = r.Int(0, std::max(0, max_seq - 1));
    std::vector<int32_t> pos, seq, mm;
    for (int i = 0; i < b; ++i) {
      int32_t s = one_seq ? fixed_seq : r.Int(0, std::max(0, max_seq - 1));
      if (r.OneIn(32)) s = r.OneIn(2) ? -1 : max_seq;
      const uint8_t how = r.U8();
      int32_t p;
      const int slot = s >= 0 && s < 8 ? s : 0;
      if (next_pos[slot] > 100000) next_pos[slot] = 0;
      if (how < 200) {
        p = next_pos[slot]++;
      } else if (how < 240) {
        next_pos[slot] = std::max(0, next_pos[slot] - r.Int(1, 8));  // rewind
        p = next_pos[slot]++;
      } else {
        p = r.Pick(kSpecialPos);
      }
      pos.push_back(p);
      seq.push_back(s);
    }
    if ((shape >> 5) % 8 == 0 && !via_c) seq.push_back(0);  // sizes disagree (not in C)
    const int n_mm = (shape >> 6) % 3 == 0 ? r.Int(0, 2) : 0;
    for (int i = 0; i < n_mm; ++i) mm.push_back(r.Int(-1, b));
    const bool reserve = r.OneIn(8);
    kv::Batch batch;
    batch.positions = pos;
    batch.sequences = seq;
    batch.multimodal = mm;
    const Snapshot before = Take();
    if (via_c && !pos.empty() && r.OneIn(32)) {  // a NULL array: refused, nothing changes
      FUZZ_CHECK(kvc_start_forward(handle.get(), nullptr, seq.data(), static_cast<int32_t>(b),
                                   nullptr, 0, reserve) == KVC_INVALID_ARGUMENT,
                 "kvc_start_forward with NULL positions accepted");
      ExpectUnchanged(before);
      return;
    }
    const Result want = model->StartForward(pos, seq, mm, reserve);
    const Status got =
        via_c ? FromC(op, kvc_start_forward(handle.get(), pos.data(), seq.data(),
                                            static_cast<int32_t>(pos.size()), mm.data(),
                                            static_cast<int32_t>(mm.size()), reserve ? 1 : 0))
              : cache->StartForward(batch, reserve);
    EXPECT_SAME_RESULT(op, want, got);
    if (!got.ok() && wrapper == nullptr) ExpectUnchanged(before);
  }

  void OpSetLayer(kvfuzz::Reader& r) {
    op = "SetLayer";
    const int layer = r.OneIn(16) ? -1 : r.Int(0, 2);
    model->SetLayer(layer);
    if (via_c) {
      kvc_set_layer(handle.get(), layer);
    } else {
      cache->SetLayer(layer);
    }
  }

  void OpSetLayerType(kvfuzz::Reader& r) {
    op = "SetLayerType";
    if (wrapper == nullptr) return;
    const int type = r.OneIn(16) ? r.Int(-1, 2) : r.Int(0, 1);
    wrapper_model->SetLayerType(type);
    if (via_c) {
      FUZZ_CHECK(kvc_set_layer_type(handle.get(), type) == KVC_OK, "kvc_set_layer_type: %s",
                 kvc_last_error());
    } else {
      wrapper->SetLayerType(type);
    }
  }

  // A fuzzed input tensor (dims, dtype, strides with garbage in the gaps) and its model.
  struct Input {
    ModelTensor m;
    std::vector<uint8_t> buf;
    TensorView view;
  };
  Input MakeInput(kvfuzz::Reader& r, int64_t batch, int64_t heads, bool encoder_shape) {
    Input in;
    const DType types[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kF32, DType::kQ8_0};
    in.m.dtype = r.OneIn(16) ? DType::kQ8_0 : r.Pick(types);
    const int64_t dims[] = {1, 2, 3, 4, 5, 8, 32, 32, 64, 16};
    in.m.ne[0] = r.OneIn(32) ? 0 : r.Pick(dims);
    in.m.ne[1] = heads;
    in.m.ne[2] = r.OneIn(16) ? r.Int(0, 9) : batch;
    in.m.ne[3] = r.OneIn(16) ? 2 : 1;
    if (encoder_shape) in.m.ne[2] = r.Int(1, 6);  // image tokens: any count
    const bool quant = kv::IsQuantized(in.m.dtype);
    const size_t es = quant ? 4 : kv::BlockBytes(in.m.dtype);
    size_t gap[4];
    for (size_t& g : gap) g = r.OneIn(4) ? r.Int(1, 3) : 0;
    int64_t ne[4];
    for (int d = 0; d < 4; ++d) ne[d] = std::max<int64_t>(in.m.ne[d], 1);
    TensorView& v = in.view;
    v.dtype = in.m.dtype;
    for (int d = 0; d < 4; ++d) v.ne[d] = in.m.ne[d];
    v.nb[0] = quant ? kv::BlockBytes(in.m.dtype) : es * (1 + gap[0]);
    v.nb[1] = quant ? kv::RowBytes(in.m.dtype, 32 * ((ne[0] + 31) / 32)) + gap[1] * 2
                    : v.nb[0] * ne[0] + es * gap[1];
    v.nb[2] = v.nb[1] * ne[1] + es * gap[2];
    v.nb[3] = v.nb[2] * ne[2] + es * gap[3];
    in.buf.assign(v.nb[3] * ne[3] + 64, 0xFF);  // gaps read as NaN
    v.data = in.buf.data();
    const size_t n = static_cast<size_t>(ne[0] * ne[1] * ne[2] * ne[3]);
    in.m.data.resize(n);
    if (quant) return in;  // rejected before any element is read
    size_t idx = 0;
    for (int64_t i3 = 0; i3 < ne[3]; ++i3)
      for (int64_t i2 = 0; i2 < ne[2]; ++i2)
        for (int64_t i1 = 0; i1 < ne[1]; ++i1)
          for (int64_t i0 = 0; i0 < ne[0]; ++i0, ++idx) {
            // Small integers: exact in every float input dtype.
            const float x = static_cast<float>(static_cast<int>((value_seed + idx * 7) % 61) - 30);
            char* e = static_cast<char*>(v.data) + i0 * v.nb[0] + i1 * v.nb[1] + i2 * v.nb[2] +
                      i3 * v.nb[3];
            kv::StoreFromF32(e, in.m.dtype, 0, x);
            in.m.data[idx] = kv::LoadAsF32(e, in.m.dtype, 0);
          }
    value_seed = value_seed * 1103515245u + 12345u;
    return in;
  }

  void OpPut(kvfuzz::Reader& r) {
    op = "Put";
    const ModelHistory mh = model->Get();
    const int64_t b = mh.has_mask ? mh.mask_rows : r.Int(1, 4);
    const bool enc = kind == 4 || (wrapper != nullptr && encoder != nullptr && r.OneIn(2));
    const int64_t heads = r.OneIn(16) ? 0 : r.Int(1, 3);
    Input k = MakeInput(r, b, heads, enc);
    Input v = MakeInput(r, b, r.OneIn(16) ? heads + 1 : heads, enc);
    const Snapshot before = Take();
    const kvc_tensor kc = kv::ViewToC(k.view), vc = kv::ViewToC(v.view);
    if (via_c && r.OneIn(32)) {  // a NULL tensor: refused, nothing changes
      FUZZ_CHECK(kvc_put(handle.get(), &kc, nullptr) == KVC_INVALID_ARGUMENT,
                 "kvc_put with a NULL value accepted");
      ExpectUnchanged(before);
      return;
    }
    const Result want = model->Put(k.m, v.m);
    const Status got =
        via_c ? FromC(op, kvc_put(handle.get(), &kc, &vc)) : cache->Put(k.view, v.view);
    EXPECT_SAME_RESULT(op, want, got);
    if (!got.ok()) ExpectUnchanged(before);
  }

  void OpSetCausal(kvfuzz::Reader& r) {
    op = "SetCausal";
    if (causal == nullptr) return;
    std::vector<int32_t> except;
    const int n = r.Int(0, 4);
    for (int i = 0; i < n; ++i) except.push_back(r.Int(-1, max_batch));
    causal_model->SetCausal(except);
    if (via_c) {
      FUZZ_CHECK(kvc_set_causal(causal_handle, except.data(),
                                static_cast<int32_t>(except.size())) == KVC_OK,
                 "kvc_set_causal: %s", kvc_last_error());
    } else {
      causal->SetCausal(except);
    }
  }

  void OpReserveLayers(kvfuzz::Reader& r) {
    op = "ReserveLayers";
    if (causal == nullptr) return;
    const int layers = r.OneIn(16) ? 0 : r.Int(1, 3);
    const int dims[] = {1, 2, 4, 8, 32, 64, 0};
    const int kd = r.Pick(dims), vd = r.OneIn(4) ? r.Pick(dims) : kd;
    const int heads = r.Int(0, 3);
    const Snapshot before = Take();
    const Result want = causal_model->ReserveLayers(layers, kd, vd, heads);
    const Status got = via_c ? FromC(op, kvc_reserve_layers(causal_handle, layers, kd, vd, heads))
                             : causal->ReserveLayers(layers, kd, vd, heads);
    EXPECT_SAME_RESULT(op, want, got);
    if (!got.ok()) ExpectUnchanged(before);
  }

  int32_t FuzzPos(kvfuzz::Reader& r) { return r.OneIn(8) ? r.Pick(kSpecialPos) : r.Int(0, 40); }

  void OpCopyPrefix(kvfuzz::Reader& r) {
    op = "CopyPrefix";
    const int src = r.Int(-1, max_seq), dst = r.Int(-1, max_seq);
    const int32_t len = FuzzPos(r);
    const Snapshot before = Take();
    const Result want = model->CopyPrefix(src, dst, len);
    const Status got = via_c ? FromC(op, kvc_copy_prefix(handle.get(), src, dst, len))
                             : cache->CopyPrefix(src, dst, len);
    EXPECT_SAME_RESULT(op, want, got);
    // A wrapper whose Init failed half-way may have children in different states (§10).
    if (!got.ok() && wrapper == nullptr) ExpectUnchanged(before);
    if (got.ok() && src != dst && dst >= 0 && dst < 8)
      next_pos[dst] = std::clamp<int32_t>(len, 0, 1000);
  }

  void OpCanResume(kvfuzz::Reader& r) {
    op = "CanResume";
    const int seq = r.Int(-1, max_seq);
    const int32_t p = FuzzPos(r);
    FUZZ_CHECK(model->CanResume(seq, p) == CanResume(seq, p), "CanResume(%d, %d): model %d", seq, p,
               model->CanResume(seq, p));
  }

  void OpRemove(kvfuzz::Reader& r) {
    op = "Remove";
    const int seq = r.Int(-1, max_seq);
    const int32_t begin = r.OneIn(8) ? r.Pick(kSpecialPos) : r.Int(0, 30);
    int32_t end;
    const uint8_t how = r.U8() % 8;
    if (how < 4) {
      end = static_cast<int32_t>(std::min<int64_t>(int64_t{begin} + r.Int(0, 8), INT32_MAX - 1));
    } else if (how < 6) {
      end = kv::kPosMax;
    } else {
      end = FuzzPos(r);
    }
    const Snapshot before = Take();
    std::vector<ModelShift> want_shifts;
    shifts_seen.clear();
    const Result want = model->Remove(seq, begin, end, &want_shifts);
    const Status got = via_c ? FromC(op, kvc_remove(handle.get(), seq, begin, end))
                             : cache->Remove(seq, begin, end);
    EXPECT_SAME_RESULT(op, want, got);
    if (!got.ok() && wrapper == nullptr) ExpectUnchanged(before);
    FUZZ_CHECK(want_shifts.size() == shifts_seen.size(),
               "Remove(%d, %d, %d): %zu ShiftFn calls, "
               "model %zu",
               seq, begin, end, shifts_seen.size(), want_shifts.size());
    for (size_t i = 0; i < want_shifts.size(); ++i) {
      FUZZ_CHECK(want_shifts[i] == shifts_seen[i], "Remove: ShiftFn call %zu differs (layer %d/%d)",
                 i, shifts_seen[i].layer, want_shifts[i].layer);
    }
  }

  void OpClose() {
    op = "Close";
    model->Close();
    if (via_c) {
      kvc_close(handle.get());
    } else {
      cache->Close();
    }
  }

  void Run(kvfuzz::Reader& r) {
    Setup(r);
    for (int step = 0; step < kMaxOps && !r.empty(); ++step) {
      const uint8_t o = r.U8() % 16;
      switch (o) {
        case 0:
          OpSetConfig(r);
          break;
        case 1:
          OpInit(r);
          break;
        case 2:
        case 3:
        case 4:
          OpStartForward(r);
          break;
        case 5:
          OpSetLayer(r);
          break;
        case 6:
        case 7:
        case 8:
          OpPut(r);
          break;
        case 9:
          OpSetCausal(r);
          break;
        case 10:
          OpCopyPrefix(r);
          break;
        case 11:
          OpCanResume(r);
          break;
        case 12:
          OpRemove(r);
          break;
        case 13:
          if (r.OneIn(4)) {
            OpClose();
          } else {
            OpReserveLayers(r);
          }
          break;
        case 14:
          OpSetLayerType(r);
          break;
        default:
          op = "Get";
          break;
      }
      CheckAll();
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvfuzz::Reader r(data, size);
  // Kernel dispatch (mask, scatter) runs on the target the input picks.
  kvfuzz::UseTarget(r.U8());
  Harness h;
  h.Run(r);
  hwy::SetSupportedTargetsForTest(0);
  return 0;
}
