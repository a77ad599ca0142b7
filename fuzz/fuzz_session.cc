// Fuzzer of the session loader (core/persistence.h): LoadCache / LoadSequenceCache on damaged
// streams. The input builds a small source cache (a causal-family cache, a wrapper of SWA +
// causal, a growing / rotating cache, or an encoder cache) from a few decoded calls, saves it
// (whole or one sequence), then damages the stream with fuzzed edits (byte flips, overwritten
// integers, truncation, extension) or replaces it with raw input bytes, and, when the input asks,
// repairs the total size and the CRC32C so the field-by-field validation behind the checksum is
// reached. Checked: no crash or sanitizer report whatever the bytes; a failing load leaves the
// target byte-for-byte as it was (its own saved stream, CheckConsistency); a successful load leaves
// a consistent cache that takes a further StartForward + Put + Get, and an undamaged whole-cache
// stream loads back to the identical stream.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/cache.h"
#include "core/kvcache_c.h"
#include "core/kvcache_c_interop.h"
#include "core/persistence.h"
#include "core/sequence_cache.h"
#include "fuzz_common.h"
#include "stream_edit.h"

namespace {

using kv::DType;
using kv::Status;
using kv::TensorView;
using kvfuzz::Reader;

const DType kDtypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

struct Shape {
  int family = 0;  // 0 causal, 1 SWA, 2 SWA with memory, 3 chunked
  int32_t window = 0, memory = 0, chunk = 0;
  DType dtype = DType::kF32;
  int seqs = 2, capacity = 16, batch = 4, padding = 1;
  int head_dim = 32, heads = 1, layers = 1;
};

std::unique_ptr<kv::CausalCache> MakeCausal(const Shape& s) {
  kv::ShiftFn none;
  switch (s.family) {
    case 1:
      return kv::NewSWACache(s.window, none);
    case 2:
      return kv::NewSWAMemCache(s.window, s.memory, none);
    case 3:
      return kv::NewChunkedAttentionCache(s.chunk, none);
    default:
      return kv::NewCausalCache(none);
  }
}

Status InitCache(kv::Cache* c, const Shape& s) {
  KV_RETURN_IF_ERROR(c->SetAllocator(kvfuzz::BudgetAllocator()));
  kv::CacheConfig cfg;
  cfg.padding = s.padding;
  KV_RETURN_IF_ERROR(c->SetConfig(cfg));
  return c->Init(s.dtype, s.seqs, s.capacity, s.batch);
}

// ---- the C API's side (inputs with bit 7 of the mode byte set) ----------------------------------
// The same target is built twice, through kvc_* (kvc_init, kvc_reserve_layers, kvc_save,
// kvc_load; for growing / rotating caches kvc_seq_update, kvc_seq_save, kvc_seq_load: FuzzSequence)
// and through C++, filled by the same calls, and the stream loaded into both: the C
// call must return the C++ call's code with kvc_last_error() naming the C++ message, and both
// targets must save to the same bytes before and after.

struct CacheFree {
  void operator()(kvc_cache* c) const { kvc_cache_free(c); }
};
using CHandle = std::unique_ptr<kvc_cache, CacheFree>;

kvc_cache* NewCausalC(const Shape& s) {
  switch (s.family) {
    case 1:
      return kvc_swa_new(s.window, nullptr);
    case 2:
      return kvc_swa_mem_new(s.window, s.memory, nullptr);
    case 3:
      return kvc_chunked_new(s.chunk, nullptr);
    default:
      return kvc_causal_new(nullptr);
  }
}

// kvc_set_config + kvc_init (the allocator through the C++ object: C has no setter).
kvc_code InitC(kvc_cache* c, const Shape& s) {
  FUZZ_CHECK(kv::CacheFromC(c)->SetAllocator(kvfuzz::BudgetAllocator()).ok(), "SetAllocator");
  kvc_config cfg = kvc_config_default();
  cfg.padding = s.padding;
  const kvc_code code = kvc_set_config(c, &cfg);
  if (code != KVC_OK) return code;
  return kvc_init(c, static_cast<kvc_dtype>(static_cast<int>(s.dtype)), s.seqs, s.capacity,
                  s.batch);
}

// A save through C: save(buf, capacity, &size) is kvc_save or kvc_seq_save on one cache. The size
// query first, then a buffer one byte short (refused, with the size reported), then the real one.
template <class SaveFn>
std::vector<uint8_t> SaveThroughC(const SaveFn& save) {
  size_t size = 0;
  FUZZ_CHECK(save(nullptr, 0, &size) == KVC_OK, "C save, size query: %s", kvc_last_error());
  std::vector<uint8_t> out(size);
  if (size > 0) {
    size_t short_size = 0;
    FUZZ_CHECK(
        save(out.data(), size - 1, &short_size) == KVC_INVALID_ARGUMENT && short_size == size,
        "C save into a short buffer");
  }
  size_t got = 0;
  FUZZ_CHECK(save(out.data(), size, &got) == KVC_OK && got == size, "C save: %s", kvc_last_error());
  return out;
}

// kvc_save of the whole cache.
std::vector<uint8_t> SaveC(const kvc_cache* c) {
  return SaveThroughC(
      [c](void* buf, size_t cap, size_t* size) { return kvc_save(c, -1, buf, cap, size); });
}

// A call's outcome through C against the same call through C++ (`what` names it): the same code,
// and on failure kvc_last_error() equal to the C++ message.
void CheckSameOutcome(const char* what, kvc_code c_code, const Status& cpp) {
  FUZZ_CHECK(static_cast<int>(c_code) == static_cast<int>(cpp.code()),
             "%s: C returned %s, C++ %s (%s)", what, kvc_code_name(c_code),
             kv::CodeName(cpp.code()), cpp.message());
  if (!cpp.ok()) {
    FUZZ_CHECK(std::strcmp(kvc_last_error(), cpp.message()) == 0,
               "%s: kvc_last_error() \"%s\" is not the C++ message \"%s\"", what, kvc_last_error(),
               cpp.message());
  }
}

// A few forward passes with Puts into every layer.
// strict: every Put must succeed (false after a load, whose layer shapes come from the stream).
void Fill(kv::Cache* c, const Shape& s, Reader& r, int passes, bool strict = true) {
  std::vector<int32_t> next(s.seqs, 0);
  for (int p = 0; p < passes; ++p) {
    const int b = r.Int(1, s.batch);
    std::vector<int32_t> pos(b), seq(b);
    for (int i = 0; i < b; ++i) {
      seq[i] = r.Int(0, s.seqs - 1);
      pos[i] = next[seq[i]]++;
    }
    kv::Batch batch;
    batch.positions = pos;
    batch.sequences = seq;
    if (!c->StartForward(batch, false).ok()) continue;
    std::vector<float> k(static_cast<size_t>(s.head_dim) * s.heads * b);
    for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 7 + p) % 23) - 11.0f;
    for (int l = 0; l < s.layers; ++l) {
      c->SetLayer(l);
      const TensorView v = kv::MakeView(k.data(), DType::kF32, {s.head_dim, s.heads, b});
      const Status st = c->Put(v, v);
      FUZZ_CHECK(st.ok() || (!strict && st.code() == kv::Code::kInvalidArgument),
                 "Fill: Put failed: %s", st.message());
    }
    if (r.OneIn(4)) (void)c->Remove(r.Int(0, s.seqs - 1), r.Int(0, 3), kv::kPosMax);
  }
}

// Damages `bytes` as the input says; optionally repairs the total size and checksum.
void Damage(Reader& r, std::vector<uint8_t>* bytes) {
  const int edits = r.Int(0, 4);
  for (int e = 0; e < edits && !bytes->empty(); ++e) {
    const uint8_t how = r.U8() % 6;
    const size_t at = r.U16() % bytes->size();
    if (how <= 1) {
      (*bytes)[at] ^= static_cast<uint8_t>(1u << (r.U8() % 8));
    } else if (how == 2 && at + 4 <= bytes->size()) {  // an integer field set to an extreme
      const uint32_t vals[] = {0, 1, 0xFFFFFFFFu, 0x7FFFFFFFu, 0x80000000u, 64, 65};
      const uint32_t v = r.Pick(vals);
      std::memcpy(bytes->data() + at, &v, 4);
    } else if (how == 3) {
      bytes->resize(at);
    } else if (how == 4) {
      bytes->insert(bytes->begin() + static_cast<long>(at), r.Int(1, 40), r.U8());
    } else {
      (*bytes)[at] = r.U8();
    }
  }
  if (r.OneIn(2) && bytes->size() >= 28) kvfuzz::ResealStream(bytes);
}

void FuzzCausal(Reader& r, bool wrapper, bool via_c) {
  Shape s;
  s.family = r.U8() % 4;
  s.window = r.Int(1, 6);
  s.memory = r.Int(0, 8);
  s.chunk = r.Int(1, 5);
  s.dtype = r.Pick(kDtypes);
  s.seqs = r.Int(1, 3);
  s.capacity = r.Int(1, 24);
  s.batch = r.Int(1, 6);
  s.padding = r.OneIn(4) ? 4 : 1;
  s.head_dim = kv::IsQuantized(s.dtype) ? 32 : r.Int(1, 8);
  s.heads = r.Int(1, 2);
  s.layers = r.Int(1, 2);
  const int seq = r.OneIn(3) ? r.Int(0, s.seqs - 1) : -1;
  const int dst = seq < 0 ? -1 : r.Int(-1, s.seqs - 1);

  auto make = [&]() -> std::unique_ptr<kv::Cache> {
    if (!wrapper) return MakeCausal(s);
    std::vector<std::unique_ptr<kv::Cache>> children;
    Shape swa = s;
    swa.family = 1;
    children.push_back(MakeCausal(swa));
    Shape causal = s;
    causal.family = 0;
    children.push_back(MakeCausal(causal));
    return kv::NewWrapperCache(std::move(children));
  };
  auto save = [&](const kv::Cache& c, std::vector<uint8_t>* out, int which) {
    return wrapper ? kv::SaveCache(static_cast<const kv::WrapperCache&>(c), out, which)
                   : kv::SaveCache(c, out, which);
  };
  auto load = [&](std::span<const uint8_t> b, kv::Cache* c, int which) {
    return wrapper ? kv::LoadCache(b, static_cast<kv::WrapperCache*>(c), which)
                   : kv::LoadCache(b, c, which);
  };
  auto consistent = [&](kv::Cache* c) {
    if (wrapper) {
      auto* w = static_cast<kv::WrapperCache*>(c);
      for (int i = 0; i < w->NumChildren(); ++i) {
        const Status st = static_cast<kv::CausalCache*>(w->Child(i))->CheckConsistency();
        FUZZ_CHECK(st.ok(), "child %d: %s", i, st.message());
      }
    } else {
      const Status st = static_cast<kv::CausalCache*>(c)->CheckConsistency();
      FUZZ_CHECK(st.ok(), "%s", st.message());
    }
  };

  auto src = make();
  if (!InitCache(src.get(), s).ok()) return;
  Fill(src.get(), s, r, r.Int(0, 6));
  std::vector<uint8_t> stream;
  if (!save(*src, &stream, seq).ok()) return;
  const std::vector<uint8_t> pristine = stream;
  if (r.OneIn(8)) {  // raw input bytes after a valid header
    stream.resize(std::min<size_t>(stream.size(), 24));
    while (!r.empty() && stream.size() < 4096) stream.push_back(r.U8());
  }
  Damage(r, &stream);

  // Target: the same shape (sometimes a different dtype or sequence count), maybe holding tokens.
  Shape ts = s;
  if (r.OneIn(8)) ts.dtype = r.Pick(kDtypes), ts.head_dim = 32;
  if (r.OneIn(8)) ts.seqs = r.Int(1, 3);
  auto target = make();
  const bool init_ok = InitCache(target.get(), ts).ok();
  CHandle c_target;  // via_c: the same target through the C API
  if (via_c) {
    if (wrapper) {
      Shape swa = ts, causal = ts;
      swa.family = 1;
      causal.family = 0;
      kvc_cache* kids[2] = {NewCausalC(swa), NewCausalC(causal)};
      c_target.reset(kvc_wrapper_new(kids, 2));
      FUZZ_CHECK(c_target != nullptr, "kvc_wrapper_new failed");
    } else {
      c_target.reset(NewCausalC(ts));
    }
    const kvc_code code = InitC(c_target.get(), ts);
    FUZZ_CHECK((code == KVC_OK) == init_ok, "kvc_init: %s, C++ Init %s", kvc_code_name(code),
               init_ok ? "succeeded" : "failed");
  }
  if (!init_ok) return;
  if (wrapper) {
    // A failed wrapper load restores earlier children but keeps storage they allocated (zeroed,
    // documented in core/persistence.h): allocate every layer up front so that "unchanged" is
    // byte-exact.
    auto* w = static_cast<kv::WrapperCache*>(target.get());
    const int layers = std::max(s.layers, ts.layers);
    for (int i = 0; i < w->NumChildren(); ++i) {
      const Status rs = static_cast<kv::CausalCache*>(w->Child(i))
                            ->ReserveLayers(layers, ts.head_dim, ts.head_dim, ts.heads);
      if (via_c) {
        const kvc_code rc = kvc_reserve_layers(kvc_wrapper_child(c_target.get(), i), layers,
                                               ts.head_dim, ts.head_dim, ts.heads);
        FUZZ_CHECK(static_cast<int>(rc) == static_cast<int>(rs.code()), "kvc_reserve_layers");
      }
    }
  }
  const int target_passes = r.Int(0, 3);
  if (via_c) {
    Reader same = r;  // the same calls into the C target
    Fill(kv::CacheFromC(c_target.get()), ts, same, target_passes);
  }
  Fill(target.get(), ts, r, target_passes);
  std::vector<uint8_t> before;
  FUZZ_CHECK(save(*target, &before, -1).ok(), "SaveCache(target) failed");
  if (via_c) FUZZ_CHECK(SaveC(c_target.get()) == before, "C and C++ targets differ before load");
  const Status st = load(stream, target.get(), seq < 0 ? -1 : dst);
  consistent(target.get());
  std::vector<uint8_t> after;
  FUZZ_CHECK(save(*target, &after, -1).ok(), "SaveCache(target) after load failed");
  if (via_c) {
    const kvc_code code =
        kvc_load(c_target.get(), stream.data(), stream.size(), seq < 0 ? -1 : dst);
    CheckSameOutcome("load", code, st);
    FUZZ_CHECK(SaveC(c_target.get()) == after, "C and C++ targets differ after load");
  }
  if (!st.ok()) {
    FUZZ_CHECK(before == after, "failing LoadCache (%s: %s) changed the target",
               kv::CodeName(st.code()), st.message());
    return;
  }
  // (Layers the target held but the stream lacks stay allocated, zeroed: compare fresh targets.)
  if (stream == pristine && seq < 0 && ts.dtype == s.dtype && ts.seqs == s.seqs && !wrapper &&
      target_passes == 0) {
    FUZZ_CHECK(after == pristine, "whole-cache stream does not load back to itself");
  }
  // The loaded cache must keep working.
  Fill(target.get(), ts, r, 2, /*strict=*/false);
  consistent(target.get());
}

struct SeqFree {
  void operator()(kvc_seq_cache* c) const { kvc_seq_cache_free(c); }
};
using CSeqHandle = std::unique_ptr<kvc_seq_cache, SeqFree>;

// kvc_seq_save of a growing / rotating cache.
std::vector<uint8_t> SeqSaveC(const kvc_seq_cache* c) {
  return SaveThroughC(
      [c](void* buf, size_t cap, size_t* size) { return kvc_seq_save(c, buf, cap, size); });
}

// A growing or rotating cache. Inputs with bit 7 of the mode byte also build each cache through
// the C API (kvc_kv_cache_new / kvc_rotating_cache_new) and make every call on both: kvc_seq_update
// must return Update's code and message and views of the same shape, kvc_seq_save the same bytes,
// kvc_seq_load LoadSequenceCache's code and message, and kvc_seq_offset / kvc_seq_len agree.
void FuzzSequence(Reader& r, bool via_c) {
  const DType dtype = r.Pick(kDtypes);
  const int max_size = r.OneIn(3) ? 0 : r.Int(1, 9);
  const int keep = max_size ? r.Int(0, max_size - 1) : 0;
  auto make = [&]() {
    return max_size ? kv::NewRotatingKVCache(max_size, keep, dtype) : kv::NewKVCache(dtype);
  };
  auto make_c = [&]() {
    if (!via_c) return CSeqHandle();
    const auto cdt = static_cast<kvc_dtype>(static_cast<int>(dtype));
    CSeqHandle c(max_size ? kvc_rotating_cache_new(max_size, keep, cdt) : kvc_kv_cache_new(cdt));
    FUZZ_CHECK(c != nullptr, "kvc sequence cache constructor returned NULL");
    return c;
  };
  // Both caches (twin: the C one, or null) hold the same bytes and count the same tokens.
  auto same = [&](const kv::SequenceCache& c, const kvc_seq_cache* twin, const char* when) {
    if (twin == nullptr) return;
    std::vector<uint8_t> bytes;
    FUZZ_CHECK(kv::SaveSequenceCache(c, &bytes).ok(), "SaveSequenceCache (%s)", when);
    FUZZ_CHECK(SeqSaveC(twin) == bytes, "C and C++ sequence caches differ %s", when);
    FUZZ_CHECK(kvc_seq_offset(twin) == c.Offset() && kvc_seq_len(twin) == c.Len(),
               "kvc_seq_offset / kvc_seq_len differ %s", when);
  };
  // strict: every Update must succeed. After a load it may not: the stream's shapes or offset
  // (a resealed stream may hold any offset, e.g. INT32_MAX - 1) can refuse more tokens, which
  // must then be kInvalidArgument with the cache unchanged.
  auto fill = [&](Reader& rd, kv::SequenceCache* c, kvc_seq_cache* twin, int updates,
                  bool strict = true) {
    const int d = kv::IsQuantized(dtype) ? 32 : 4;
    for (int u = 0; u < updates; ++u) {
      const int n = rd.Int(1, 6);
      std::vector<float> k(static_cast<size_t>(d) * n * 2);
      for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 5 + u) % 17) - 8.0f;
      const TensorView v = kv::MakeView(k.data(), DType::kF32, {d, n, 2, 1});
      TensorView ko, vo;
      std::vector<uint8_t> pre;
      if (!strict) FUZZ_CHECK(kv::SaveSequenceCache(*c, &pre).ok(), "save before Update");
      const Status us = c->Update(v, v, n, &ko, &vo);
      if (twin != nullptr) {
        const kvc_tensor kc = kv::ViewToC(v);
        kvc_tensor kco{}, vco{};
        CheckSameOutcome("update", kvc_seq_update(twin, &kc, &kc, n, &kco, &vco), us);
        FUZZ_CHECK(!us.ok() || (std::memcmp(kco.ne, ko.ne, sizeof(kco.ne)) == 0 &&
                                std::memcmp(vco.ne, vo.ne, sizeof(vco.ne)) == 0),
                   "kvc_seq_update's views differ from Update's");
      }
      if (us.ok()) continue;
      FUZZ_CHECK(!strict, "Update failed: %s", us.message());
      FUZZ_CHECK(us.code() == kv::Code::kInvalidArgument, "Update after a load: %s", us.message());
      std::vector<uint8_t> post;
      FUZZ_CHECK(kv::SaveSequenceCache(*c, &post).ok() && post == pre,
                 "failing Update (%s) changed the cache", us.message());
      same(*c, twin, "after a failing update");
      return;
    }
  };
  auto src = make();
  CSeqHandle c_src = make_c();
  fill(r, src.get(), c_src.get(), r.Int(0, 5));
  same(*src, c_src.get(), "after filling the source");
  std::vector<uint8_t> stream;
  FUZZ_CHECK(kv::SaveSequenceCache(*src, &stream).ok(), "SaveSequenceCache failed");
  const std::vector<uint8_t> pristine = stream;
  Damage(r, &stream);
  auto target = make();
  CSeqHandle c_target = make_c();
  fill(r, target.get(), c_target.get(), r.Int(0, 3));
  same(*target, c_target.get(), "before load");
  std::vector<uint8_t> before, after;
  FUZZ_CHECK(kv::SaveSequenceCache(*target, &before).ok(), "save target");
  const Status st = kv::LoadSequenceCache(stream, target.get());
  FUZZ_CHECK(kv::SaveSequenceCache(*target, &after).ok(), "save target after load");
  if (via_c) {
    CheckSameOutcome("load", kvc_seq_load(c_target.get(), stream.data(), stream.size()), st);
    same(*target, c_target.get(), "after load");
  }
  if (!st.ok()) {
    FUZZ_CHECK(before == after, "failing LoadSequenceCache (%s) changed the target", st.message());
    return;
  }
  if (stream == pristine) FUZZ_CHECK(after == pristine, "sequence stream does not round-trip");
  fill(r, target.get(), c_target.get(), 2, /*strict=*/false);
  same(*target, c_target.get(), "after more updates");
}

// The encoder cache: images of fuzzed shapes and input dtypes in one or more sequences (shared or
// per sequence, plain or permuted V, some from a reserve pass), saved whole or for one sequence.
void FuzzEncoder(Reader& r, bool via_c) {
  const DType in_dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  kv::EncoderOptions opt;
  opt.per_sequence = r.OneIn(2);
  kv::CacheConfig cfg;
  cfg.permuted_v = r.OneIn(2);
  const DType dtype = r.Pick(kDtypes);
  const int seqs = r.Int(1, 3);
  auto make = [&](const kv::EncoderOptions& o, const kv::CacheConfig& c, DType dt, int n) {
    auto e = kv::NewEncoderCache(o);
    FUZZ_CHECK(e->SetConfig(c).ok() && e->Init(dt, n, 16, 4).ok(), "encoder Init failed");
    return e;
  };
  auto fill = [&](Reader& rd, kv::EncoderCache* c, int n_seqs, int passes) {
    for (int p = 0; p < passes; ++p) {
      const int32_t pos[1] = {rd.Int(0, 20)}, seq[1] = {rd.Int(0, n_seqs - 1)}, mm[1] = {0};
      kv::Batch b;
      b.positions = pos;
      b.sequences = seq;
      if (rd.OneIn(2)) b.multimodal = mm;
      if (!c->StartForward(b, rd.OneIn(5)).ok()) continue;
      const DType in = rd.Pick(in_dtypes);
      const int d = rd.Int(1, 8), h = rd.Int(1, 2), t = rd.Int(1, 5);
      std::vector<uint16_t> buf(static_cast<size_t>(d) * h * t * 2);  // f32 needs 2 per element
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint16_t>(0x3C00 + i % 64);
      const int layers = rd.Int(1, 3);
      for (int l = 0; l < layers; ++l) {
        c->SetLayer(l);
        const TensorView v = kv::MakeView(buf.data(), in, {d, h, t});
        const Status st = c->Put(v, v);
        FUZZ_CHECK(st.ok(), "encoder Put failed: %s", st.message());
      }
      if (rd.OneIn(4)) (void)c->Remove(rd.Int(0, n_seqs - 1), rd.Int(0, 10), kv::kPosMax);
    }
  };
  auto src = make(opt, cfg, dtype, seqs);
  fill(r, src.get(), seqs, r.Int(0, 5));
  const int seq = r.OneIn(3) ? r.Int(0, seqs - 1) : -1;
  std::vector<uint8_t> stream;
  FUZZ_CHECK(kv::SaveCache(*src, &stream, seq).ok(), "encoder SaveCache failed");
  const std::vector<uint8_t> pristine = stream;
  if (r.OneIn(8)) {
    stream.resize(std::min<size_t>(stream.size(), 24));
    while (!r.empty() && stream.size() < 4096) stream.push_back(r.U8());
  }
  Damage(r, &stream);

  kv::EncoderOptions topt = opt;
  kv::CacheConfig tcfg = cfg;
  DType tdtype = dtype;
  int tseqs = seqs;
  if (r.OneIn(8)) topt.per_sequence = !topt.per_sequence;
  if (r.OneIn(8)) tcfg.permuted_v = !tcfg.permuted_v;
  if (r.OneIn(8)) tdtype = r.Pick(kDtypes);
  if (r.OneIn(8)) tseqs = r.Int(1, 3);
  auto target = make(topt, tcfg, tdtype, tseqs);
  CHandle c_target;  // via_c: the same target through the C API
  if (via_c) {
    c_target.reset(kvc_encoder_new_per_sequence(topt.per_sequence ? 1 : 0));
    kvc_config ccfg = kvc_config_default();
    ccfg.permuted_v = tcfg.permuted_v ? 1 : 0;
    FUZZ_CHECK(kvc_set_config(c_target.get(), &ccfg) == KVC_OK &&
                   kvc_init(c_target.get(), static_cast<kvc_dtype>(static_cast<int>(tdtype)), tseqs,
                            16, 4) == KVC_OK,
               "encoder kvc_init failed: %s", kvc_last_error());
  }
  const int target_passes = r.Int(0, 3);
  if (via_c) {
    Reader same = r;  // a copy: the C target gets the same calls as the C++ one below
    auto* e = kv::EncoderFromC(c_target.get());
    FUZZ_CHECK(e != nullptr, "EncoderFromC");
    fill(same, e, tseqs, target_passes);
  }
  fill(r, target.get(), tseqs, target_passes);
  std::vector<uint8_t> before, after;
  FUZZ_CHECK(kv::SaveCache(*target, &before).ok(), "save encoder target");
  if (via_c) FUZZ_CHECK(SaveC(c_target.get()) == before, "C and C++ encoders differ before load");
  const size_t mem_before = target->MemoryBytes();
  const int dst = seq < 0 ? -1 : r.Int(-1, tseqs - 1);
  const Status st = kv::LoadCache(stream, target.get(), dst);
  FUZZ_CHECK(kv::SaveCache(*target, &after).ok(), "save encoder target after load");
  if (via_c) {
    CheckSameOutcome("load", kvc_load(c_target.get(), stream.data(), stream.size(), dst), st);
    FUZZ_CHECK(SaveC(c_target.get()) == after, "C and C++ encoders differ after load");
    FUZZ_CHECK(kvc_memory_bytes(c_target.get()) == target->MemoryBytes(), "memory bytes differ");
  }
  if (!st.ok()) {
    FUZZ_CHECK(before == after && target->MemoryBytes() == mem_before,
               "failing encoder LoadCache (%s: %s) changed the target", kv::CodeName(st.code()),
               st.message());
    return;
  }
  if (stream == pristine && seq < 0) {
    FUZZ_CHECK(after == pristine, "whole encoder stream does not load back to itself");
  }
  // The loaded cache keeps working, and its views stay inside its storage.
  for (int s = 0; s < tseqs; ++s) {
    const int32_t pos[1] = {0}, sq[1] = {s};
    kv::Batch b;
    b.positions = pos;
    b.sequences = sq;
    FUZZ_CHECK(target->StartForward(b, false).ok(), "StartForward after load");
    for (int l = 0; l < 3; ++l) {
      target->SetLayer(l);
      const kv::History h = target->Get();
      if (h.k.data == nullptr) continue;
      volatile uint8_t sink = 0;
      const uint8_t* kp = static_cast<const uint8_t*>(h.k.data);
      const uint8_t* vp = static_cast<const uint8_t*>(h.v.data);
      sink = sink + kp[static_cast<size_t>(kv::NumElements(h.k)) * kv::BlockBytes(h.k.dtype) - 1];
      sink = sink + vp[static_cast<size_t>(kv::NumElements(h.v)) * kv::BlockBytes(h.v.dtype) - 1];
    }
  }
  fill(r, target.get(), tseqs, 2);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r(data, size);
  kvfuzz::UseTarget(r.U8());
  const uint8_t mode = r.U8();
  const bool via_c = (mode & 0x80) != 0;  // also through the C API
  switch (mode % 4) {
    case 0:
      FuzzCausal(r, false, via_c);
      break;
    case 1:
      FuzzCausal(r, true, via_c);
      break;
    case 2:
      FuzzSequence(r, via_c);
      break;
    default:
      FuzzEncoder(r, via_c);
      break;
  }
  hwy::SetSupportedTargetsForTest(0);
  return 0;
}
