// kvperf scenarios: the default run (shared system prompt, per-sequence prompts, batched decode)
// and the named scenarios behind flags. Each returns its figures as JSON; main.cc prints the
// tables.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/rope_shift.h"
#include "core/sequence_cache.h"
#include "hwy/aligned_allocator.h"
#include "kvperf/kvperf.h"

namespace kvperf {
namespace {

using nlohmann::json;

#define KVPERF_CHECK_OK(expr, what)                                 \
  do {                                                              \
    const kv::Status _s = (expr);                                   \
    if (!_s.ok()) {                                                 \
      failures->push_back(std::string(what) + ": " + _s.message()); \
      return out;                                                   \
    }                                                               \
  } while (0)

// Bytes of K+V per token over every layer.
double TokenBytes(const Shape& s, kv::DType dtype) {
  return static_cast<double>(s.layers) * s.kv_heads * 2.0 *
         static_cast<double>(kv::RowBytes(dtype, s.head_dim));
}

std::vector<int> SampleIndices(int n, int samples) {
  std::vector<int> idx;
  if (n <= 0 || samples <= 0) return idx;
  if (samples == 1) return {n - 1};
  for (int i = 0; i < samples; ++i) {
    const int v = static_cast<int>(static_cast<int64_t>(i) * (n - 1) / (samples - 1));
    if (idx.empty() || idx.back() != v) idx.push_back(v);
  }
  return idx;
}

// The batch of one decode step: sequences 0..S-1, every one at position `pos`.
void DecodeBatch(int S, int32_t pos, std::vector<int>* sq, std::vector<int32_t>* ps) {
  sq->resize(static_cast<size_t>(S));
  ps->assign(static_cast<size_t>(S), pos);
  for (int s = 0; s < S; ++s) (*sq)[static_cast<size_t>(s)] = s;
}

bool Contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The traffic of the default run: S sequences share a P-token system prompt (prefilled once into
// sequence 0 and shared with CopyPrefix), each prefills its own C-token prompt in `batch`-token
// batches, then T decode steps run the S sequences in one batch. `visible(layer, qpos, kpos)`
// is the model's attention rule (causal, window, chunk).
struct Workload {
  int S = 4, P = 1024, C = 1024, T = 128, batch = 512;
  std::vector<int> check_layers = {0, 7, 15};
  int check_samples = 3;
  std::function<bool(int layer, int32_t qpos, int32_t kpos)> visible;
};

struct WorkloadResult {
  PhaseStats prefill, decode;
  CheckStats prefill_check, decode_check;
  double copy_prefix_s = 0;
  size_t mem_before_copy = 0, mem_after_copy = 0;
};

// Token identity in the default traffic: the system prompt is stream 0, sequence s's own tokens
// stream s + 1.
uint64_t DefaultToken(const Workload& w, int seq, int32_t pos) {
  return pos < w.P ? TokenId(0, pos) : TokenId(static_cast<uint32_t>(seq + 1), pos);
}

void SetupEngine(Engine* e, const RunContext& ctx, const Workload& w) {
  e->shape = ctx.opt.shape;
  e->pool = ctx.pool;
  e->token_of = [&w](int seq, int32_t pos) { return DefaultToken(w, seq, pos); };
  e->history_fn = [&w](int layer, int seq, int32_t qpos, const VisitFn& visit) {
    for (int32_t p = 0; p <= qpos; ++p) {
      if (w.visible(layer, qpos, p)) visit(DefaultToken(w, seq, p), p);
    }
  };
}

// Prefills positions [from, to) of `seq` in batches; checks the sampled batches.
kv::Status Prefill(Engine& e, const Workload& w, int seq, int32_t from, int32_t to,
                   const std::vector<int>& check_batches, int* batch_counter, PhaseStats* stats,
                   CheckStats* check, const char* label) {
  for (int32_t p0 = from; p0 < to; p0 += w.batch) {
    const int n = std::min<int32_t>(w.batch, to - p0);
    std::vector<int> sq(n, seq);
    std::vector<int32_t> ps(n);
    for (int i = 0; i < n; ++i) ps[i] = p0 + i;
    const bool chk = Contains(check_batches, *batch_counter);
    Progress("%s: prefill seq %d positions %d..%d", label, seq, p0, p0 + n - 1);
    KV_RETURN_IF_ERROR(e.Forward(sq, ps, {}, chk ? w.check_layers : std::vector<int>{}, stats,
                                 chk ? check : nullptr));
    ++*batch_counter;
  }
  return kv::Status::Ok();
}

kv::Status RunWorkload(Engine& e, const Workload& w, WorkloadResult* r, const char* label) {
  const int per_seq_batches = (w.C + w.batch - 1) / w.batch;
  const int total_batches = (w.P + w.batch - 1) / w.batch + w.S * per_seq_batches;
  const std::vector<int> check_batches = SampleIndices(total_batches, w.check_samples);
  int counter = 0;
  if (w.P > 0) {
    KV_RETURN_IF_ERROR(
        Prefill(e, w, 0, 0, w.P, check_batches, &counter, &r->prefill, &r->prefill_check, label));
    r->mem_before_copy = e.cache->MemoryBytes();
    const auto t0 = Clock::now();
    for (int s = 1; s < w.S; ++s) KV_RETURN_IF_ERROR(e.cache->CopyPrefix(0, s, w.P));
    r->copy_prefix_s = Seconds(t0, Clock::now());
    r->mem_after_copy = e.cache->MemoryBytes();
  }
  for (int s = 0; s < w.S; ++s) {
    KV_RETURN_IF_ERROR(Prefill(e, w, s, w.P, w.P + w.C, check_batches, &counter, &r->prefill,
                               &r->prefill_check, label));
  }
  const std::vector<int> check_steps = SampleIndices(w.T, w.check_samples);
  for (int t = 0; t < w.T; ++t) {
    std::vector<int> sq;
    std::vector<int32_t> ps;
    DecodeBatch(w.S, w.P + w.C + t, &sq, &ps);
    const bool chk = Contains(check_steps, t);
    if (t % 16 == 0) Progress("%s: decode step %d/%d", label, t, w.T);
    KV_RETURN_IF_ERROR(e.Forward(sq, ps, {}, chk ? w.check_layers : std::vector<int>{}, &r->decode,
                                 chk ? &r->decode_check : nullptr));
  }
  return kv::Status::Ok();
}

Workload DefaultWorkload(const RunContext& ctx) {
  Workload w;
  w.S = ctx.opt.sequences;
  w.P = ctx.opt.system_prompt;
  w.C = ctx.opt.context;
  w.T = ctx.opt.decode_steps;
  w.batch = ctx.opt.batch;
  w.check_samples = ctx.opt.check_samples;
  const int L = ctx.opt.shape.layers;
  w.check_layers = {0, L / 2 - 1, L - 1};
  w.visible = [](int, int32_t qpos, int32_t kpos) { return kpos <= qpos; };
  return w;
}

json WorkloadJson(const RunContext& ctx, const Workload& w, const WorkloadResult& r,
                  kv::DType dtype, std::vector<std::string>* failures, const char* what) {
  json out;
  out["sequences"] = w.S;
  out["system_prompt"] = w.P;
  out["prompt"] = w.C;
  out["decode_steps"] = w.T;
  out["prefill_batch"] = w.batch;
  out["prefill"] = PhaseJson(r.prefill, ctx.opt.shape, ctx.read_bw, ctx.fma_peak, false);
  out["decode"] = PhaseJson(r.decode, ctx.opt.shape, ctx.read_bw, ctx.fma_peak, true);
  CheckStats all = r.prefill_check;
  all.Merge(r.decode_check);
  out["check"] = CheckJson(all, dtype, what, failures);
  out["check"]["prefill_samples"] = r.prefill_check.samples;
  out["check"]["decode_samples"] = r.decode_check.samples;
  out["copy_prefix_seconds"] = r.copy_prefix_s;
  return out;
}

// What every default-traffic scenario does once its cache is made: runs `w` through `e` (set up
// by the caller) and returns WorkloadJson with the scenario's name and dtype. On failure records
// "<name>: run: <message>" and returns a null json, which the caller returns as it is.
json RunNamedWorkload(const RunContext& ctx, Engine& e, const Workload& w, kv::DType dtype,
                      const std::string& name, WorkloadResult* r,
                      std::vector<std::string>* failures) {
  json out;
  const std::string label = name + " " + kv::DTypeName(dtype);
  KVPERF_CHECK_OK(RunWorkload(e, w, r, label.c_str()), name + ": run");
  out = WorkloadJson(ctx, w, *r, dtype, failures, name.c_str());
  out["scenario"] = name;
  out["dtype"] = kv::DTypeName(dtype);
  return out;
}

// The interleaved scenarios (swa, chunked): a wrapper of {local, plain causal}; the layers where
// global(layer) attend through the causal child (type 1), the others through `local` (type 0).
// Runs the default traffic `w` and adds the wrapper's bytes: cache_bytes_allocated, the local
// child's under `local_key`, the causal child's under cache_bytes_global_layers.
json RunInterleaved(RunContext& ctx, kv::DType dtype, const std::string& name,
                    std::unique_ptr<kv::Cache> local, const std::function<bool(int)>& global,
                    const Workload& w, const char* local_key, std::vector<std::string>* failures) {
  json out;
  std::vector<std::unique_ptr<kv::Cache>> children;
  children.push_back(std::move(local));
  children.push_back(kv::NewCausalCache());
  auto cache = kv::NewWrapperCache(std::move(children));
  KVPERF_CHECK_OK(cache->Init(dtype, w.S, w.P + w.C + w.T, w.batch), name + ": Init");
  Engine e;
  SetupEngine(&e, ctx, w);
  e.cache = cache.get();
  e.wrapper = cache.get();
  e.sites = [global](int layer) { return std::vector<Site>{Site{global(layer) ? 1 : 0, true, 0}}; };
  WorkloadResult r;
  out = RunNamedWorkload(ctx, e, w, dtype, name, &r, failures);
  if (out.is_null()) return out;
  const std::vector<size_t> child = cache->ChildMemoryBytes();
  out["cache_bytes_allocated"] = cache->MemoryBytes();
  out[local_key] = child[0];
  out["cache_bytes_global_layers"] = child[1];
  return out;
}

}  // namespace

// ---- default
// -------------------------------------------------------------------------------------

json RunDefault(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  Workload w = DefaultWorkload(ctx);
  auto cache = kv::NewCausalCache();
  KVPERF_CHECK_OK(cache->Init(dtype, w.S, w.P + w.C + w.T, w.batch), "default: Init");
  KVPERF_CHECK_OK(cache->ReserveLayers(sh.layers, sh.head_dim, sh.head_dim, sh.kv_heads),
                  "default: ReserveLayers");
  Engine e;
  SetupEngine(&e, ctx, w);
  e.cache = cache.get();
  WorkloadResult r;
  out = RunNamedWorkload(ctx, e, w, dtype, "default", &r, failures);
  if (out.is_null()) return out;
  const double tb = TokenBytes(sh, dtype);
  const double unique_tokens = w.P + static_cast<double>(w.S) * (w.C + w.T);
  out["cache_cells"] = cache->NumCells();
  out["cache_bytes_allocated"] = cache->MemoryBytes();
  out["cache_bytes_in_use"] = unique_tokens * tb;
  out["bytes_per_token"] = tb;
  out["bytes_saved_by_sharing"] = static_cast<double>(w.S - 1) * w.P * tb;
  out["copy_prefix_bytes_allocated"] =
      static_cast<double>(r.mem_after_copy) - static_cast<double>(r.mem_before_copy);
  if (r.mem_after_copy != r.mem_before_copy) {
    failures->push_back("default: CopyPrefix changed MemoryBytes");
  }
  return out;
}

// ---- interleaved sliding window --------------------------------------------------------------

json RunInterleavedSWA(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  constexpr int kWindow = 1024;
  Workload w = DefaultWorkload(ctx);
  // 5 sliding-window layers, then 1 global (Gemma 3's pattern): layer % 6 == 5 is global.
  auto global = [](int layer) { return layer % 6 == 5; };
  w.visible = [global](int layer, int32_t qpos, int32_t kpos) {
    return kpos <= qpos && (global(layer) || kpos >= qpos - kWindow);  // Ollama: W + 1 keys
  };
  w.check_layers = {0, 5, sh.layers - 1};
  out = RunInterleaved(ctx, dtype, "swa", kv::NewSWACache(kWindow), global, w,
                       "cache_bytes_swa_layers", failures);
  if (out.is_null()) return out;
  out["window"] = kWindow;
  out["pattern"] = "5 sliding-window layers : 1 global";
  // What the same layers would hold as full-context caches.
  const double per_layer_token = sh.kv_heads * 2.0 * kv::RowBytes(dtype, sh.head_dim);
  int swa_layers = 0;
  for (int l = 0; l < sh.layers; ++l) swa_layers += !global(l);
  out["swa_layers"] = swa_layers;
  out["cache_bytes_if_all_global"] =
      static_cast<double>(w.S) * (w.P + w.C + w.T) * per_layer_token * sh.layers;
  return out;
}

// ---- chunked attention
// ---------------------------------------------------------------------------

json RunChunked(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  constexpr int kChunk = 1024;
  Workload w = DefaultWorkload(ctx);
  // Llama 4's pattern: 3 chunked layers, then 1 global.
  auto global = [](int layer) { return layer % 4 == 3; };
  w.visible = [global](int layer, int32_t qpos, int32_t kpos) {
    return kpos <= qpos && (global(layer) || kpos >= qpos - qpos % kChunk);
  };
  w.check_layers = {0, 3, sh.layers - 2};
  out = RunInterleaved(ctx, dtype, "chunked", kv::NewChunkedAttentionCache(kChunk), global, w,
                       "cache_bytes_chunked_layers", failures);
  if (out.is_null()) return out;
  out["chunk"] = kChunk;
  out["pattern"] = "3 chunked layers : 1 global";
  return out;
}

// ---- sliding window with memory, resume from a prefix ----------------------------------------

json RunSWAMemResume(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  constexpr int kWindow = 1024, kMemory = 1536, kRewind = 64;
  Workload w = DefaultWorkload(ctx);
  w.visible = [](int, int32_t qpos, int32_t kpos) {
    return kpos <= qpos && kpos >= qpos - kWindow;
  };
  auto cache = kv::NewSWAMemCache(kWindow, kMemory);
  KVPERF_CHECK_OK(cache->Init(dtype, w.S, w.P + w.C + w.T, w.batch), "swa-mem: Init");
  KVPERF_CHECK_OK(cache->ReserveLayers(sh.layers, sh.head_dim, sh.head_dim, sh.kv_heads),
                  "swa-mem: ReserveLayers");
  Engine e;
  SetupEngine(&e, ctx, w);
  e.cache = cache.get();
  WorkloadResult r;
  const std::string label = std::string("swa-mem ") + kv::DTypeName(dtype);
  KVPERF_CHECK_OK(RunWorkload(e, w, &r, label.c_str()), "swa-mem: run");

  // Resume: every sequence goes back kRewind tokens (a client that edits its last turn), drops the
  // tokens from there on, and decodes a different continuation (streams S + 1 + s).
  const int32_t end = w.P + w.C + w.T;  // next position of every sequence
  const int32_t resume = end - kRewind;
  json resume_json;
  bool can_resume = true, can_resume_far = false;
  for (int s = 0; s < w.S; ++s) {
    can_resume = can_resume && cache->CanResume(s, resume);
    can_resume_far = can_resume_far || cache->CanResume(s, 0);
  }
  resume_json["rewind_tokens"] = kRewind;
  resume_json["resume_position"] = resume;
  resume_json["can_resume"] = can_resume;
  resume_json["can_resume_position_0"] = can_resume_far;
  // Memory at or above the capacity is unlimited (SEMANTICS.md section 1): nothing is trimmed and
  // every position can be resumed. Otherwise position 0 has left the memory by now.
  const bool unlimited = kMemory >= w.P + w.C + w.T;
  resume_json["memory_unlimited"] = unlimited;
  if (!can_resume) failures->push_back("swa-mem: CanResume refused a position inside the memory");
  if (can_resume_far != unlimited) {
    failures->push_back(unlimited ? "swa-mem: CanResume refused position 0 with unlimited memory"
                                  : "swa-mem: CanResume accepted position 0 after trimming");
  }
  auto t0 = Clock::now();
  for (int s = 0; s < w.S; ++s) KVPERF_CHECK_OK(cache->Remove(s, resume, kv::kPosMax), "Remove");
  resume_json["remove_seconds"] = Seconds(t0, Clock::now());
  const int S = w.S, P = w.P;
  e.token_of = [S, P, resume](int seq, int32_t pos) {
    if (pos >= resume) return TokenId(static_cast<uint32_t>(S + 1 + seq), pos);
    return pos < P ? TokenId(0, pos) : TokenId(static_cast<uint32_t>(seq + 1), pos);
  };
  e.history_fn = [&e, &w](int layer, int seq, int32_t qpos, const VisitFn& visit) {
    for (int32_t p = 0; p <= qpos; ++p) {
      if (w.visible(layer, qpos, p)) visit(e.token_of(seq, p), p);
    }
  };
  PhaseStats resumed;
  CheckStats resumed_check;
  for (int t = 0; t < kRewind; ++t) {
    std::vector<int> sq;
    std::vector<int32_t> ps;
    DecodeBatch(w.S, resume + t, &sq, &ps);
    const bool chk = t == 0 || t == kRewind - 1;
    KVPERF_CHECK_OK(e.Forward(sq, ps, {}, chk ? w.check_layers : std::vector<int>{}, &resumed,
                              chk ? &resumed_check : nullptr),
                    "swa-mem: resumed decode");
  }
  out = WorkloadJson(ctx, w, r, dtype, failures, "swa-mem");
  resume_json["decode"] = PhaseJson(resumed, sh, ctx.read_bw, ctx.fma_peak, true);
  resume_json["check"] = CheckJson(resumed_check, dtype, "swa-mem resume", failures);
  out["resume"] = resume_json;
  out["scenario"] = "swa-mem";
  out["dtype"] = kv::DTypeName(dtype);
  out["window"] = kWindow;
  out["memory"] = kMemory;
  out["cache_cells"] = cache->NumCells();
  out["cache_bytes_allocated"] = cache->MemoryBytes();
  out["cache_bytes_if_unlimited"] =
      static_cast<double>(w.S) * (w.P + w.C + w.T) * TokenBytes(sh, dtype);
  return out;
}

// ---- context shift
// -------------------------------------------------------------------------------

json RunContextShift(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  // S sequences with their own prompts (no shared prefix: shifting a cell that another sequence
  // also holds is kNotSupported by design), RoPE'd keys; when the context is full, Remove drops the
  // older half of every sequence and re-rotates the kept keys, then decoding continues.
  Workload w = DefaultWorkload(ctx);
  w.P = 0;
  w.C = ctx.opt.system_prompt + ctx.opt.context;
  const int32_t half = w.C / 2;
  auto cache = kv::NewCausalCache(kv::RopeShiftFn(static_cast<float>(kRopeBase)));
  KVPERF_CHECK_OK(cache->Init(dtype, w.S, w.C + w.T, w.batch), "shift: Init");
  KVPERF_CHECK_OK(cache->ReserveLayers(sh.layers, sh.head_dim, sh.head_dim, sh.kv_heads),
                  "shift: ReserveLayers");
  Engine e;
  SetupEngine(&e, ctx, w);
  e.cache = cache.get();
  e.rope = true;
  // Before the shift, token (s, p) is stream s + 1 at position p; after it, the token now at
  // position p was put at p + half (or is new).
  int32_t shifted = 0;
  e.token_of = [&shifted](int seq, int32_t pos) {
    return TokenId(static_cast<uint32_t>(seq + 1), pos + shifted);
  };
  e.history_fn = [&e](int, int seq, int32_t qpos, const VisitFn& visit) {
    for (int32_t p = 0; p <= qpos; ++p) visit(e.token_of(seq, p), p);
  };
  WorkloadResult r;
  const std::string label = std::string("shift ") + kv::DTypeName(dtype);
  w.T = 0;
  KVPERF_CHECK_OK(RunWorkload(e, w, &r, label.c_str()), "shift: prefill");
  Progress("%s: Remove [0, %d) with re-rotation", label.c_str(), half);
  const auto t0 = Clock::now();
  for (int s = 0; s < w.S; ++s) KVPERF_CHECK_OK(cache->Remove(s, 0, half), "shift: Remove");
  const double remove_s = Seconds(t0, Clock::now());
  shifted = half;
  PhaseStats dec;
  CheckStats dec_check;
  const int T = ctx.opt.decode_steps;
  const std::vector<int> check_steps = SampleIndices(T, w.check_samples);
  for (int t = 0; t < T; ++t) {
    std::vector<int> sq;
    std::vector<int32_t> ps;
    DecodeBatch(w.S, w.C - half + t, &sq, &ps);
    const bool chk = Contains(check_steps, t);
    if (t % 16 == 0) Progress("%s: decode step %d/%d after the shift", label.c_str(), t, T);
    KVPERF_CHECK_OK(e.Forward(sq, ps, {}, chk ? w.check_layers : std::vector<int>{}, &dec,
                              chk ? &dec_check : nullptr),
                    "shift: decode");
  }
  out["scenario"] = "shift";
  out["dtype"] = kv::DTypeName(dtype);
  out["sequences"] = w.S;
  out["prompt"] = w.C;
  out["removed_per_sequence"] = half;
  out["prefill"] = PhaseJson(r.prefill, sh, ctx.read_bw, ctx.fma_peak, false);
  out["prefill_check"] = CheckJson(r.prefill_check, dtype, "shift prefill", failures);
  out["remove_seconds"] = remove_s;
  const double rotated = static_cast<double>(w.S) * (w.C - half) * sh.layers;
  out["keys_rerotated"] = rotated;  // token rows x layers (each kv_heads rows)
  out["rerotated_key_rows_per_s"] = remove_s > 0 ? rotated * sh.kv_heads / remove_s : 0;
  // K bytes the shift reads and writes back.
  const double kbytes = rotated * sh.kv_heads * kv::RowBytes(dtype, sh.head_dim);
  out["remove_bytes_read_and_written"] = 2 * kbytes;
  out["remove_fraction_of_read_bw"] =
      remove_s > 0 && ctx.read_bw > 0 ? 2 * kbytes / remove_s / ctx.read_bw : 0;
  out["decode"] = PhaseJson(dec, sh, ctx.read_bw, ctx.fma_peak, true);
  out["decode_check"] = CheckJson(dec_check, dtype, "shift decode (re-rotated keys)", failures);
  out["cache_bytes_allocated"] = cache->MemoryBytes();
  return out;
}

// ---- encoder-decoder
// -----------------------------------------------------------------------------

json RunEncoderDecoder(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  constexpr int kFrames = 1500;  // 30 s of audio in Whisper's encoder
  constexpr uint32_t kEncoderStream = 0xE0;
  constexpr int kPrompt = 32;
  const int S = ctx.opt.sequences, T = ctx.opt.decode_steps;
  // The encoder cache stores K/V as given: the runtime hands it f16 (quantized input is not
  // accepted), so cross-attention reads f16 whatever the self-attention storage is.
  std::vector<std::unique_ptr<kv::Cache>> children;
  children.push_back(kv::NewEncoderCache());
  children.push_back(kv::NewCausalCache());
  auto cache = kv::NewWrapperCache(std::move(children));
  KVPERF_CHECK_OK(cache->Init(dtype, S, kPrompt + T, S * kPrompt), "encdec: Init");
  Engine e;
  e.shape = sh;
  e.pool = ctx.pool;
  e.cache = cache.get();
  e.wrapper = cache.get();
  e.encoder_frames = kFrames;
  bool first = true;
  e.sites = [&first](int) {
    return std::vector<Site>{Site{0, first, kEncoderStream}, Site{1, true, 0}};
  };
  e.token_of = [](int seq, int32_t pos) { return TokenId(static_cast<uint32_t>(seq + 1), pos); };
  e.history_fn = [](int, int seq, int32_t qpos, const VisitFn& visit) {
    for (int32_t p = 0; p <= qpos; ++p) visit(TokenId(static_cast<uint32_t>(seq + 1), p), p);
  };
  e.cross_history_fn = [](int, int, int32_t, const VisitFn& visit) {
    for (int32_t f = 0; f < kFrames; ++f) visit(TokenId(kEncoderStream, f), f);
  };
  PhaseStats prefill, dec;
  CheckStats check;
  {
    std::vector<int> sq;
    std::vector<int32_t> ps;
    for (int s = 0; s < S; ++s) {
      for (int p = 0; p < kPrompt; ++p) {
        sq.push_back(s);
        ps.push_back(p);
      }
    }
    Progress("encdec %s: prompt + encoder output", kv::DTypeName(dtype));
    KVPERF_CHECK_OK(e.Forward(sq, ps, {0}, {0, sh.layers - 1}, &prefill, &check), "encdec: prompt");
  }
  first = false;
  const std::vector<int> check_steps = SampleIndices(T, ctx.opt.check_samples);
  for (int t = 0; t < T; ++t) {
    std::vector<int> sq;
    std::vector<int32_t> ps;
    DecodeBatch(S, kPrompt + t, &sq, &ps);
    const bool chk = Contains(check_steps, t);
    if (t % 16 == 0) Progress("encdec %s: decode step %d/%d", kv::DTypeName(dtype), t, T);
    KVPERF_CHECK_OK(
        e.Forward(sq, ps, {}, chk ? std::vector<int>{0, sh.layers - 1} : std::vector<int>{}, &dec,
                  chk ? &check : nullptr),
        "encdec: decode");
  }
  out["scenario"] = "encdec";
  out["dtype"] = kv::DTypeName(dtype);
  out["encoder_frames"] = kFrames;
  out["encoder_dtype"] = "f16 (stored as given)";
  out["sequences"] = S;
  out["prompt"] = kPrompt;
  out["prefill"] = PhaseJson(prefill, sh, ctx.read_bw, ctx.fma_peak, false);
  out["decode"] = PhaseJson(dec, sh, ctx.read_bw, ctx.fma_peak, true);
  out["check"] = CheckJson(check, dtype, "encdec", failures);
  const std::vector<size_t> child = cache->ChildMemoryBytes();
  out["cache_bytes_encoder"] = child[0];
  out["cache_bytes_decoder"] = child[1];
  return out;
}

// ---- rotating cache with sinks -----------------------------------------------------------------

json RunRotating(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures) {
  json out;
  const Shape& sh = ctx.opt.shape;
  constexpr int kWindow = 4096, kSinks = 4, kTokens = 20000, kAttendEvery = 500;
  const int D = sh.head_dim, H = sh.kv_heads, Hq = sh.q_heads;
  // One sequence streams kTokens tokens one at a time through 16 per-layer rotating caches. Every
  // token is appended to every layer (timed); Attend over the window runs on every
  // kAttendEvery-th token (timed separately: attending to all 20000 would take minutes on 2 cores
  // and measure the same kernel as the default run).
  std::vector<std::unique_ptr<kv::SequenceCache>> caches;
  for (int l = 0; l < sh.layers; ++l)
    caches.push_back(kv::NewRotatingKVCache(kWindow, kSinks, dtype));
  std::vector<float> k(static_cast<size_t>(D) * H), v(k.size()), q(static_cast<size_t>(D) * Hq),
      o(q.size());
  const kv::TensorView qv = kv::MakeView(q.data(), kv::DType::kF32, {D, 1, Hq});
  kv::TensorView ov = kv::MakeView(o.data(), kv::DType::kF32, {D, 1, Hq});
  double update_s = 0, attend_s = 0, attn_bytes = 0;
  int attended = 0;
  CheckStats check;
  for (int t = 0; t < kTokens; ++t) {
    const bool attend = (t + 1) % kAttendEvery == 0;
    const bool chk = attend && ((t + 1) % (kAttendEvery * 10) == 0 || t + 1 == kTokens);
    if (t % 2000 == 0) Progress("rotating %s: token %d/%d", kv::DTypeName(dtype), t, kTokens);
    for (int l = 0; l < sh.layers; ++l) {
      const uint64_t id = TokenId(1, t);
      for (int h = 0; h < H; ++h) {
        GenRow(Kind::kKey, l, h, id, D, -1, &k[static_cast<size_t>(h) * D]);
        GenRow(Kind::kValue, l, h, id, D, -1, &v[static_cast<size_t>(h) * D]);
      }
      // [D, n, H, B] = [D, 1, H, 1]: token stride and head stride of a [H][D] buffer.
      kv::TensorView kin = kv::MakeView(k.data(), kv::DType::kF32, {D, 1, H, 1});
      kv::TensorView vin = kv::MakeView(v.data(), kv::DType::kF32, {D, 1, H, 1});
      kin.nb[2] = vin.nb[2] = static_cast<size_t>(D) * 4;
      kv::TensorView ko, vo;
      auto t0 = Clock::now();
      KVPERF_CHECK_OK(caches[l]->Update(kin, vin, 1, &ko, &vo), "rotating: Update");
      update_s += Seconds(t0, Clock::now());
      if (!attend) continue;
      for (int h = 0; h < Hq; ++h)
        GenRow(Kind::kQuery, l, h, id, D, -1, &q[static_cast<size_t>(h) * D]);
      // Attend takes [D, H, L] per batch entry: swap the token and head dims of the view.
      kv::History hist;
      hist.k = ko;
      hist.v = vo;
      for (kv::TensorView* x : {&hist.k, &hist.v}) {
        std::swap(x->ne[1], x->ne[2]);
        std::swap(x->nb[1], x->nb[2]);
        x->ne[3] = 1;
      }
      t0 = Clock::now();
      KVPERF_CHECK_OK(kv::Attend(qv, hist, kv::AttentionParams{}, &ov, ctx.pool),
                      "rotating: Attend");
      attend_s += Seconds(t0, Clock::now());
      attn_bytes +=
          static_cast<double>(H) * hist.k.ne[2] * (kv::RowBytes(dtype, D) + kv::RowBytes(dtype, D));
      if (chk) {
        const int held = static_cast<int>(hist.k.ne[2]);
        CheckAttention(
            sh, l, qv, hist, ov, {0}, {0}, {t},
            [held, t](int, int, int32_t, const VisitFn& visit) {
              // The sinks, then the newest held - kSinks tokens.
              for (int p = 0; p < kSinks; ++p) visit(TokenId(1, p), p);
              for (int p = t - (held - kSinks) + 1; p <= t; ++p) visit(TokenId(1, p), p);
            },
            false, &check);
      }
    }
    if (attend) ++attended;
  }
  kv::SequenceCacheStats st = caches[0]->Stats();
  out["scenario"] = "rotating";
  out["dtype"] = kv::DTypeName(dtype);
  out["window"] = kWindow;
  out["sinks"] = kSinks;
  out["tokens_streamed"] = kTokens;
  out["update_seconds"] = update_s;
  out["update_tokens_per_s"] = update_s > 0 ? kTokens / update_s : 0;  // all layers per token
  out["attended_tokens"] = attended;
  out["attend_every"] = kAttendEvery;
  out["attend_seconds"] = attend_s;
  out["attend_tokens_per_s"] = attend_s > 0 ? attended / attend_s : 0;
  const double bw = attend_s > 0 ? attn_bytes / attend_s : 0;
  out["attention_bytes_per_s"] = bw;
  out["attention_fraction_of_read_bw"] = ctx.read_bw > 0 ? bw / ctx.read_bw : 0;
  out["held_tokens"] = caches[0]->Len();
  out["offset"] = caches[0]->Offset();
  out["layer0_bytes_written"] = st.bytes_written;
  out["layer0_bytes_moved"] = st.bytes_moved;
  out["layer0_bytes_moved_per_token"] = static_cast<double>(st.bytes_moved) / kTokens;
  out["layer0_allocations"] = st.allocations;
  out["cache_bytes_allocated"] =
      static_cast<double>(st.capacity) * H * sh.layers * 2.0 * kv::RowBytes(dtype, D);
  out["check"] = CheckJson(check, dtype, "rotating", failures);
  return out;
}

// ---- decode attention against context length (the chart) -------------------------------------

json RunSweep(RunContext& ctx, kv::DType dtype, const std::vector<int>& contexts,
              std::vector<std::string>* failures) {
  json out = json::array();
  const Shape& sh = ctx.opt.shape;
  const int D = sh.head_dim, H = sh.kv_heads, Hq = sh.q_heads;
  // One sequence of `context` tokens in all 16 layers (so the history is 16x the last-level cache
  // at long contexts, as in a real model), then decode steps of batch 1 timing Attend only. K/V
  // content does not matter for timing: every prefill batch puts the same pseudo-random rows.
  const int kBatch = 512;
  std::vector<float> kb(static_cast<size_t>(D) * H * kBatch), vb(kb.size());
  for (size_t i = 0; i < kb.size(); ++i) {
    kb[i] = Uniform(i);
    vb[i] = Uniform(i + (uint64_t{1} << 40));
  }
  std::vector<float> q(static_cast<size_t>(D) * Hq), o(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = kQueryScale * Uniform(i + (uint64_t{2} << 40));
  const kv::TensorView qv = kv::MakeView(q.data(), kv::DType::kF32, {D, 1, Hq});
  kv::TensorView ov = kv::MakeView(o.data(), kv::DType::kF32, {D, 1, Hq});
  for (int ctxlen : contexts) {
    Progress("sweep %s: context %d", kv::DTypeName(dtype), ctxlen);
    // Steps: enough to read ~1 GiB in all, at least 4.
    const double step_bytes = static_cast<double>(ctxlen) * TokenBytes(sh, dtype);
    const int steps = std::max(4, std::min(64, static_cast<int>((1 << 30) / step_bytes)));
    auto cache = kv::NewCausalCache();
    KVPERF_CHECK_OK(cache->Init(dtype, 1, ctxlen + steps, kBatch), "sweep: Init");
    KVPERF_CHECK_OK(cache->ReserveLayers(sh.layers, D, D, H), "sweep: ReserveLayers");
    for (int p0 = 0; p0 < ctxlen; p0 += kBatch) {
      const int n = std::min(kBatch, ctxlen - p0);
      std::vector<int32_t> ps(n), sq(n, 0);
      for (int i = 0; i < n; ++i) ps[i] = p0 + i;
      KVPERF_CHECK_OK(cache->StartForward(kv::Batch{ps, sq, {}}, false), "sweep: StartForward");
      for (int l = 0; l < sh.layers; ++l) {
        cache->SetLayer(l);
        KVPERF_CHECK_OK(cache->Put(kv::MakeView(kb.data(), kv::DType::kF32, {D, H, n}),
                                   kv::MakeView(vb.data(), kv::DType::kF32, {D, H, n})),
                        "sweep: Put");
      }
    }
    double attend_s = 0, step_s = 0, bytes = 0;
    CheckStats check;
    for (int t = 0; t < steps; ++t) {
      const int32_t ps[1] = {ctxlen + t}, sq[1] = {0};
      const auto t0 = Clock::now();
      KVPERF_CHECK_OK(cache->StartForward(kv::Batch{ps, sq, {}}, false), "sweep: StartForward");
      step_s += Seconds(t0, Clock::now());
      for (int l = 0; l < sh.layers; ++l) {
        const auto t1 = Clock::now();
        cache->SetLayer(l);
        KVPERF_CHECK_OK(cache->Put(kv::MakeView(kb.data(), kv::DType::kF32, {D, H, 1}),
                                   kv::MakeView(vb.data(), kv::DType::kF32, {D, H, 1})),
                        "sweep: Put");
        const kv::History hist = cache->Get();
        const auto t2 = Clock::now();
        KVPERF_CHECK_OK(kv::Attend(qv, hist, kv::AttentionParams{}, &ov, ctx.pool),
                        "sweep: Attend");
        const auto t3 = Clock::now();
        attend_s += Seconds(t2, t3);
        step_s += Seconds(t1, t3);
        // One sequence: every cell of the history is visible.
        bytes += static_cast<double>(H) * hist.k.ne[2] * 2.0 * kv::RowBytes(dtype, D);
        if (t == steps - 1 && l == sh.layers - 1) {
          // Kernel check only (the history is not the model's tokens here).
          CheckAttention(
              sh, l, qv, hist, ov, {0}, {0}, {ctxlen + t}, [](int, int, int32_t, const VisitFn&) {},
              false, &check);
          check.storage_err = 0;
        }
      }
    }
    json p;
    p["context"] = ctxlen;
    p["steps"] = steps;
    p["attend_seconds"] = attend_s;
    p["decode_tokens_per_s"] = step_s > 0 ? steps / step_s : 0;
    const double bw = attend_s > 0 ? bytes / attend_s : 0;
    p["attention_bytes_per_s"] = bw;
    p["attention_fraction_of_read_bw"] = ctx.read_bw > 0 ? bw / ctx.read_bw : 0;
    p["kernel_max_abs_err"] = check.kernel_err;
    if (check.kernel_err > KernelTolerance(dtype)) {
      failures->push_back("sweep: kernel error " + std::to_string(check.kernel_err) +
                          " at context " + std::to_string(ctxlen));
    }
    out.push_back(p);
  }
  return out;
}

}  // namespace kvperf
