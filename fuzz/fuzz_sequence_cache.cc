// Differential fuzzer of the growing and rotating caches (core/sequence_cache.h, SEMANTICS.md §11)
// against the deque model of fuzz/reference_model.h: Update with fuzzed token counts, shapes,
// input dtypes and strides (bad ones included), Trim, SaveState / RestoreState with fuzzed
// mutations of the state, Reset. Every Update's returned views must hold exactly the model's tokens
// in temporal order (values after storage rounding); Offset and Len must agree after every call; a
// failing call must change nothing (Offset, Len and the saved state's bytes).
//
// Input layout: byte 0 target, byte 1.. cache configuration, then ops until the input runs out.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "core/sequence_cache.h"
#include "fuzz_common.h"
#include "kernels/convert.h"
#include "layouts/quant.h"
#include "reference_model.h"

namespace {

using kv::Code;
using kv::DType;
using kv::Status;
using kv::TensorView;
using kvfuzz::Reader;

constexpr int kMaxOps = 150;

// Exactly representable in f16 and bf16 (|x| <= 125 / 16).
float Val(int serial, int b, int h, int d, bool is_value) {
  const int x = (serial * 37 + b * 11 + h * 5 + d * 3 + (is_value ? 13 : 0)) % 251;
  return static_cast<float>(x - 125) / 16.0f;
}

struct Harness {
  std::unique_ptr<kv::SequenceCache> cache;
  kvref::SequenceModel model;
  DType storage = DType::kF32;
  bool rotating = false, config_ok = true;
  bool shaped = false;
  int dk = 0, dv = 0, heads = 0, batch = 0;
  int serial = 0;
  const char* op = "";

  void Setup(Reader& r) {
    const DType dtypes[] = {DType::kF32,  DType::kF16, DType::kBF16,         DType::kQ8_0,
                            DType::kQ4_0, DType::kF32, static_cast<DType>(7)};
    storage = r.Pick(dtypes);
    rotating = !r.OneIn(4);
    config_ok = kv::IsValidDType(storage);
    if (!rotating) {
      cache = kv::NewKVCache(storage);
      return;
    }
    const int sizes[] = {1, 2, 3, 4, 5, 8, 13, 300, 0, -1};
    const int max_size = r.Pick(sizes);
    const int keep = r.OneIn(8) ? -1 : r.Int(0, 4);
    const bool with_slack = r.OneIn(3);
    const int slack = with_slack ? r.Int(0, 3) * 100 : 1;
    cache = with_slack ? kv::NewRotatingKVCache(max_size, keep, storage, slack)
                       : kv::NewRotatingKVCache(max_size, keep, storage);
    config_ok = config_ok && max_size >= 1 && keep >= 0 && keep < max_size && slack >= 1;
    model.max_size = max_size;
    model.keep = keep;
  }

  // The expected rows of a view {D, L, H, B} holding `serials`, flattened like ViewToF32.
  std::vector<float> Expected(const std::vector<int>& serials, int d, bool is_value) const {
    std::vector<float> out;
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < heads; ++h)
        for (int s : serials) {
          std::vector<float> row(static_cast<size_t>(d));
          for (int e = 0; e < d; ++e) row[e] = Val(s, b, h, e, is_value);
          row = kvref::RoundRow(storage, row);
          out.insert(out.end(), row.begin(), row.end());
        }
    return out;
  }

  std::vector<int> HeldSerials() const {
    std::vector<int> s;
    for (const auto& e : model.held) s.push_back(e.second);
    return s;
  }

  void CheckView(const TensorView& v, const std::vector<int>& serials, int d, bool is_value) {
    FUZZ_CHECK(v.dtype == storage, "%s: view dtype %s", op, kv::DTypeName(v.dtype));
    FUZZ_CHECK(v.ne[0] == d && v.ne[1] == static_cast<int64_t>(serials.size()) &&
                   v.ne[2] == heads && v.ne[3] == batch,
               "%s: %s view {%lld, %lld, %lld, %lld}, model {%d, %zu, %d, %d}", op,
               is_value ? "value" : "key", (long long)v.ne[0], (long long)v.ne[1],
               (long long)v.ne[2], (long long)v.ne[3], d, serials.size(), heads, batch);
    std::vector<float> got(static_cast<size_t>(kv::NumElements(v)));
    kv::kernels::ViewToF32Ref(v, got.data());
    const std::vector<float> want = Expected(serials, d, is_value);
    for (size_t i = 0; i < got.size(); ++i) {
      FUZZ_CHECK(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i])),
                 "%s: %s element %zu (token %zu of %zu): %g, model %g", op,
                 is_value ? "value" : "key", i, (i / d) % serials.size(), serials.size(), got[i],
                 want[i]);
    }
  }

  // The saved state must hold the model's tokens (keys/values packed [B][H][len][row]).
  void CheckSavedState(const kv::SequenceCacheState& st) {
    FUZZ_CHECK(st.offset == model.offset && st.len == static_cast<int>(model.held.size()),
               "%s: state offset %d len %d, model %d %zu", op, st.offset, st.len, model.offset,
               model.held.size());
    if (st.offset == 0 || !shaped) return;
    const std::vector<int> serials = HeldSerials();
    for (int pass = 0; pass < 2; ++pass) {
      const int d = pass == 0 ? dk : dv;
      const std::vector<uint8_t>& bytes = pass == 0 ? st.keys : st.values;
      const size_t row = kv::RowBytes(storage, d);
      FUZZ_CHECK(bytes.size() == row * serials.size() * heads * batch, "%s: state bytes", op);
      const std::vector<float> want = Expected(serials, d, pass == 1);
      std::vector<float> got(static_cast<size_t>(d));
      for (size_t r = 0; r * row < bytes.size(); ++r) {
        kv::LoadRowAsF32(bytes.data() + r * row, d, storage, got.data());
        for (int e = 0; e < d; ++e) {
          const float w = want[r * d + e];
          FUZZ_CHECK(got[e] == w || (std::isnan(got[e]) && std::isnan(w)),
                     "%s: saved %s row %zu element %d: %g, model %g", op, pass ? "value" : "key", r,
                     e, got[e], w);
        }
      }
    }
  }

  struct Snap {
    int offset, len;
    kv::SequenceCacheState state;
  };
  Snap Take() {
    Snap s{cache->Offset(), cache->Len(), {}};
    const Status st = cache->SaveState(&s.state);
    FUZZ_CHECK(st.ok(), "SaveState: %s", st.message());
    return s;
  }
  void ExpectUnchanged(const Snap& before, const Status& why) {
    const Snap after = Take();
    FUZZ_CHECK(
        before.offset == after.offset && before.len == after.len &&
            before.state.keys == after.state.keys && before.state.values == after.state.values &&
            before.state.key_dim == after.state.key_dim && before.state.heads == after.state.heads,
        "failing %s (%s) changed the cache", op, why.message());
  }

  void OpUpdate(Reader& r) {
    op = "Update";
    const uint8_t how = r.U8();
    int n = how < 150 ? 1 : r.Int(2, std::max(2, 2 * model.max_size + 3));
    if (how >= 250) n = r.Int(-1, 0);
    int k_d = dk, v_d = dv, h = heads, b = batch;
    if (!shaped || r.OneIn(16)) {
      const int dims[] = {1, 2, 3, 4, 8, 32, 32, 64};
      k_d = r.Pick(dims);
      v_d = r.OneIn(3) ? r.Pick(dims) : k_d;
      h = r.Int(1, 3);
      b = r.Int(1, 2);
      if (r.OneIn(16)) h = 0;
    }
    const DType in_types[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kF32, DType::kQ8_0};
    const DType in_t = r.OneIn(16) ? DType::kQ8_0 : r.Pick(in_types);
    const int k_tokens = r.OneIn(32) ? n + 1 : n;
    const int v_heads = r.OneIn(32) ? h + 1 : h;
    // Inputs {D, n, H, B} with fuzzed gaps (NaN garbage) between elements and rows.
    auto build = [&](int d, int tokens, int hh, bool is_value, std::vector<uint8_t>* buf) {
      TensorView v;
      v.dtype = in_t;
      v.ne[0] = d, v.ne[1] = tokens, v.ne[2] = hh, v.ne[3] = b;
      const size_t es = kv::IsQuantized(in_t) ? 4 : kv::BlockBytes(in_t);
      const int64_t ne1 = std::max(tokens, 1), ne2 = std::max(hh, 1);
      v.nb[0] = es * (r.OneIn(4) ? 2 : 1);
      v.nb[1] = v.nb[0] * d + es * r.Int(0, 2);
      v.nb[2] = v.nb[1] * ne1 + es * r.Int(0, 2);
      v.nb[3] = v.nb[2] * ne2;
      buf->assign(v.nb[3] * b + 64, 0xFF);
      v.data = buf->data();
      if (kv::IsQuantized(in_t)) return v;
      for (int bb = 0; bb < b; ++bb)
        for (int hd = 0; hd < hh; ++hd)
          for (int t = 0; t < tokens; ++t)
            for (int e = 0; e < d; ++e)
              kv::StoreFromF32(
                  buf->data() + e * v.nb[0] + t * v.nb[1] + hd * v.nb[2] + bb * v.nb[3], in_t, 0,
                  Val(serial + t, bb, hd, e, is_value));
      return v;
    };
    std::vector<uint8_t> kb, vb;
    const TensorView key = build(k_d, k_tokens, h, false, &kb);
    const TensorView value = build(v_d, n, v_heads, true, &vb);
    // The model's rules (core/sequence_cache.h): validate everything, then append.
    bool valid = config_ok && n > 0 && kv::IsFloatDType(in_t) && k_tokens == n && v_heads == h &&
                 k_d >= 1 && v_d >= 1 && h >= 1 && b >= 1;
    if (valid && kv::IsQuantized(storage) && (k_d % 32 != 0 || v_d % 32 != 0)) valid = false;
    if (valid && shaped && (k_d != dk || v_d != dv || h != heads || b != batch)) valid = false;
    if (valid && model.offset > INT32_MAX - n) valid = false;
    const Snap before = Take();
    TensorView ko, vo;
    const Status st = cache->Update(key, value, n, &ko, &vo);
    FUZZ_CHECK(st.ok() == valid, "Update(n %d, Dk %d Dv %d H %d B %d, %s): model says %s, cache %s",
               n, k_d, v_d, h, b, kv::DTypeName(in_t), valid ? "ok" : "invalid", st.message());
    if (!st.ok()) {
      FUZZ_CHECK(st.code() == Code::kInvalidArgument, "Update: %s", st.message());
      ExpectUnchanged(before, st);
      return;
    }
    shaped = true;
    dk = k_d, dv = v_d, heads = h, batch = b;
    const std::vector<int> want = model.Update(serial, n);
    serial += n;
    CheckView(ko, want, dk, false);
    CheckView(vo, want, dv, true);
  }

  void OpTrim(Reader& r) {
    op = "Trim";
    const int n = r.OneIn(8) ? r.Int(-2, 0) : r.Int(0, std::max(1, model.max_size + 3));
    const Snap before = Take();
    kvref::SequenceModel m2 = model;
    const bool want = config_ok && m2.Trim(n);
    const Status st = cache->Trim(n);
    FUZZ_CHECK(st.ok() == want, "Trim(%d) with offset %d len %zu: model says %d, cache %s", n,
               model.offset, model.held.size(), want, st.message());
    if (st.ok()) {
      model = m2;
    } else {
      FUZZ_CHECK(st.code() == Code::kInvalidArgument, "Trim: %s", st.message());
      ExpectUnchanged(before, st);
    }
  }

  void OpSaveRestore(Reader& r) {
    op = "RestoreState";
    const Snap before = Take();
    kv::SequenceCacheState s = before.state;
    CheckSavedState(s);
    const std::vector<int> serials = HeldSerials();
    const uint8_t which = r.U8() % 16;
    switch (which) {
      case 0:
        s.offset = static_cast<int32_t>(
            std::clamp<int64_t>(int64_t{s.offset} + r.Int(-3, 3), INT32_MIN, INT32_MAX));
        break;
      case 1:
        s.len = static_cast<int32_t>(
            std::clamp<int64_t>(int64_t{s.len} + r.Int(-2, 2), INT32_MIN, INT32_MAX));
        break;
      case 2:
        s.key_dim += r.Int(-1, 1);
        break;
      case 3:
        s.heads += r.Int(-1, 1);
        break;
      case 4:
        if (!s.keys.empty()) s.keys.resize(s.keys.size() - 1);
        break;
      case 5:
        s.values.push_back(0);
        break;
      case 6:
        s.keep += 1;
        break;
      case 7:
        s.dtype = s.dtype == DType::kF32 ? DType::kF16 : DType::kF32;
        break;
      case 8:
        s.offset = r.OneIn(2) ? INT32_MAX - 1 : -1;
        break;
      case 9:
        s.batch = r.Int(-1, 0);
        break;
      default:
        break;  // unchanged: must restore exactly
    }
    // The model's rules for a state (core/sequence_cache.h RestoreState).
    Code want = Code::kOk;
    const bool rot = model.max_size > 0 || rotating;
    if (!config_ok || s.dtype != storage || s.max_size != (rotating ? model.max_size : 0) ||
        s.keep != (rotating ? model.keep : 0)) {
      want = Code::kInvalidArgument;
    } else if (s.offset < 0 || s.len < 0 || s.len > s.offset) {
      want = Code::kInvalidArgument;
    } else if (s.offset == 0) {
      want = (!s.keys.empty() || !s.values.empty()) ? Code::kCorrupt : Code::kOk;
    } else {
      const int sinks = std::min(rotating ? model.keep : 0, s.offset);
      const size_t rows = static_cast<size_t>(s.len) * std::max(s.heads, 0) * std::max(s.batch, 0);
      if (s.len < sinks || (rot && s.len > model.max_size) || (!rot && s.len != s.offset)) {
        want = Code::kInvalidArgument;
      } else if (s.key_dim < 1 || s.value_dim < 1 || s.heads < 1 || s.batch < 1 ||
                 (kv::IsQuantized(storage) && (s.key_dim % 32 != 0 || s.value_dim % 32 != 0))) {
        want = Code::kInvalidArgument;
      } else if (s.keys.size() != rows * kv::RowBytes(storage, s.key_dim) ||
                 s.values.size() != rows * kv::RowBytes(storage, s.value_dim)) {
        want = Code::kCorrupt;
      }
    }
    const Status st = cache->RestoreState(s);
    FUZZ_CHECK(st.code() == want,
               "RestoreState (mutation %d, offset %d len %d): model %s, cache %s", which, s.offset,
               s.len, kv::CodeName(want), st.message());
    if (!st.ok()) {
      ExpectUnchanged(before, st);
      return;
    }
    if (s.offset == 0) {
      model.Reset();
      shaped = false;
      return;
    }
    // Rows keep their order: the first min(keep, offset) are the sinks, the rest the newest.
    const int sinks = std::min(rotating ? model.keep : 0, s.offset);
    model.held.clear();
    for (int i = 0; i < s.len; ++i)
      model.held.emplace_back(i < sinks ? i : s.offset - s.len + i, serials[i]);
    model.offset = s.offset;
    shaped = true;
    dk = s.key_dim, dv = s.value_dim, heads = s.heads, batch = s.batch;
    kv::SequenceCacheState again;
    FUZZ_CHECK(cache->SaveState(&again).ok(), "SaveState after restore");
    FUZZ_CHECK(again.keys == s.keys && again.values == s.values,
               "SaveState after RestoreState differs from the state restored");
  }

  void Run(Reader& r) {
    Setup(r);
    for (int step = 0; step < kMaxOps && !r.empty(); ++step) {
      const uint8_t o = r.U8() % 16;
      if (o < 9) {
        OpUpdate(r);
      } else if (o < 12) {
        OpTrim(r);
      } else if (o < 15) {
        OpSaveRestore(r);
      } else {
        op = "Reset";
        cache->Reset();
        model.Reset();
        shaped = false;
      }
      FUZZ_CHECK(cache->Offset() == model.offset, "after %s: Offset %d, model %d", op,
                 cache->Offset(), model.offset);
      FUZZ_CHECK(cache->Len() == static_cast<int>(model.held.size()), "after %s: Len %d, model %zu",
                 op, cache->Len(), model.held.size());
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r(data, size);
  kvfuzz::UseTarget(r.U8());
  Harness h;
  h.Run(r);
  hwy::SetSupportedTargetsForTest(0);
  return 0;
}
