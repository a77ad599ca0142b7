// kvperf internals: the synthetic model, the timed forward pass over a cache, the double-precision
// references, the machine baseline, and the scenarios. main.cc parses flags and prints.
//
// What is timed ("the cache work"): per forward pass, StartForward once, then per layer SetLayer
// (and SetLayerType for wrapped caches), Put of the layer's K/V, Get, and Attend of the layer's Q
// over the history. Generating the pseudo-random K/V/Q, counting bytes and the correctness checks
// run outside the timed regions.
//
// How attention bytes are counted (decode): the attention kernel walks each KV head's K and V rows
// once per call for every cell that at least one batch token can see, and skips masked runs (see
// kernels/attention.h). So bytes = kv_heads * (K row bytes + V row bytes) * |cells visible to at
// least one token|, read from the mask that Get returns (a cell is visible when its mask entry is
// not -inf). Bytes of Q, the output and the mask are not counted (small next to the history).
#ifndef KVCACHE_PERF_KVPERF_KVPERF_H_
#define KVCACHE_PERF_KVPERF_KVPERF_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/thread_pool.h"
#include "layouts/dtype.h"

namespace kvperf {

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// ---- the model: a 1B-parameter Llama's attention shape, no weights -----------------------------
struct Shape {
  int layers = 16;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 64;
};

// Deterministic pseudo-random values: splitmix64 of a per-row key plus the element index. 24 bits
// of the hash give a value in [-1, 1) that f32 holds exactly.
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline float Uniform(uint64_t key) {
  return static_cast<float>(Mix(key) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

enum class Kind : uint64_t { kKey = 1, kValue = 2, kQuery = 3 };

// A token's identity: which stream of text it came from and its original position there. The
// shared system prompt is stream 0; sequence s's own tokens are stream s + 1 (other scenarios add
// streams). K/V/Q depend only on the identity (and, for RoPE'd keys, the current position).
inline uint64_t TokenId(uint32_t stream, int32_t pos) {
  return (uint64_t{stream} << 32) | static_cast<uint32_t>(pos);
}

// Q values are 3x wider than K/V so that the softmax is not flat: logits have a standard deviation
// near 1 (scale 1/8, 64 products of variance 1/3 * 3).
inline constexpr float kQueryScale = 3.0f;
inline constexpr double kRopeBase = 10000.0;

// One row (head_dim values) of K, V or Q as the model would Put it (f32). rope_pos >= 0 rotates a
// key by that position (normal style, pairs (2i, 2i + 1), theta_i = base^(-2i/D)), computed in
// double and rounded once.
void GenRow(Kind kind, int layer, int head, uint64_t token, int head_dim, int32_t rope_pos,
            float* out);

// ---- machine baseline ------------------------------------------------------------------------
// Best of 5 passes of a plain sum over a 256 MiB buffer, split over `pool` like Attend's work.
double MeasureReadBandwidth(kv::ThreadPool* pool);
// The FMA peak with the pool's threads (flop/s): the best of 20 runs of about 10 ms.
double MeasureFmaPeak(kv::ThreadPool* pool);
std::string CpuName();

// ---- progress on stderr ------------------------------------------------------------------------
// One line per phase with elapsed time; on a terminal the line is rewritten in place.
void Progress(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void ProgressDone();

// ---- correctness -------------------------------------------------------------------------------
struct CheckStats {
  int samples = 0;         // (step, layer) pairs checked
  int rows = 0;            // query rows x heads compared
  double kernel_err = 0;   // max |Attend - double reference over the same stored history|
  double storage_err = 0;  // max |Attend - double reference over the unrounded f32 K/V|
  double max_abs_out = 0;  // max |reference output| (scale of the errors)
  void Merge(const CheckStats& o);
};

// Tolerances (see kvperf_check.cc for the derivation).
double KernelTolerance(kv::DType dtype);
double StorageTolerance(kv::DType dtype);

// The reference model of which (token, position) a query sees: for query row (seq, pos) at layer
// `layer`, calls visit(token id, key position) for every visible key, in any order.
using VisitFn = std::function<void(uint64_t token, int32_t kpos)>;
using HistoryFn = std::function<void(int layer, int seq, int32_t qpos, const VisitFn& visit)>;

// Compares `out` (Attend's [D, B, Hq] output for q [D, B, Hq]) on the given batch rows with
//  (1) a double reference over `history` as stored (dequantized with kernels::ViewToF32), masked by
//      history.mask (null: all visible), and
//  (2) a double reference over the keys/values the model put, regenerated from their identities
//      (history_fn), K rotated by `rope` when true.
// k/v in `history` may be the caches' [D, Hkv, L] views or the swapped sequence views.
void CheckAttention(const Shape& shape, int layer, const kv::TensorView& q,
                    const kv::History& history, const kv::TensorView& out,
                    const std::vector<int>& rows, const std::vector<int>& row_seq,
                    const std::vector<int32_t>& row_pos, const HistoryFn& history_fn, bool rope,
                    CheckStats* stats);

// ---- the timed forward pass over a Cache -------------------------------------------------------
struct PhaseStats {
  int64_t tokens = 0;
  int64_t forwards = 0;
  double start_s = 0, put_s = 0, get_s = 0, attend_s = 0;
  double attn_bytes = 0;     // decode accounting, see the header comment
  double visible_pairs = 0;  // (query row, visible cell) pairs over all layers, x q_heads later
  double Total() const { return start_s + put_s + get_s + attend_s; }
  void Merge(const PhaseStats& o);
};

// One attention "site" per layer and forward: which cache child (SetLayerType) and whether the
// layer Puts (self-attention) or only reads (cross-attention over an encoder cache).
struct Site {
  int type = -1;      // SetLayerType argument; -1: not a wrapper
  bool put = true;    // false: read-only (encoder after the first pass)
  uint64_t salt = 0;  // nonzero: an encoder site; its frames are tokens of stream `salt`
};

struct Engine {
  Shape shape;
  kv::Cache* cache = nullptr;
  kv::WrapperCache* wrapper = nullptr;  // when set, SetLayerType is called per site
  kv::ThreadPool* pool = nullptr;
  // Per layer, the sites run in order (a plain model: one site per layer).
  std::function<std::vector<Site>(int layer)> sites;
  std::function<uint64_t(int seq, int32_t pos)> token_of;  // identity of the token being put
  bool rope = false;
  HistoryFn history_fn;        // for self-attention sites
  HistoryFn cross_history_fn;  // for read-only sites
  // Frames an encoder site Puts ([head_dim, kv_heads, frames]) when put == true.
  int encoder_frames = 0;

  // Runs one forward pass of the batch (seq[i], pos[i]) through every layer. check_layers: layers
  // to verify after Attend (rows: all when B <= 4, else 4 spread over the batch).
  kv::Status Forward(const std::vector<int>& seq, const std::vector<int32_t>& pos,
                     const std::vector<int32_t>& multimodal, const std::vector<int>& check_layers,
                     PhaseStats* stats, CheckStats* check);

 private:
  std::vector<float> k_, v_, q_, out_;
  std::vector<uint16_t> k16_, v16_;
};

// ---- scenarios
// -----------------------------------------------------------------------------------
struct Options {
  int threads = 0;
  std::vector<kv::DType> dtypes;
  int system_prompt = 1024;
  int context = 1024;  // each sequence's own prompt
  int sequences = 4;
  int decode_steps = 128;
  int batch = 512;
  int check_samples = 3;  // sampled decode steps (x 3 layers) and prefill batches checked
  Shape shape;
};

struct RunContext {
  Options opt;
  kv::ThreadPool* pool = nullptr;
  double read_bw = 0;   // bytes/s
  double fma_peak = 0;  // flop/s, measured beside read_bw (perf/fma_peak.h)
  Clock::time_point t0;
};

// Every scenario returns its figures as JSON (printed by main.cc) and appends any failure to
// `failures`. Keys: see main.cc's table printers.
nlohmann::json RunDefault(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures);
nlohmann::json RunInterleavedSWA(RunContext& ctx, kv::DType dtype,
                                 std::vector<std::string>* failures);
nlohmann::json RunChunked(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures);
nlohmann::json RunSWAMemResume(RunContext& ctx, kv::DType dtype,
                               std::vector<std::string>* failures);
nlohmann::json RunEncoderDecoder(RunContext& ctx, kv::DType dtype,
                                 std::vector<std::string>* failures);
nlohmann::json RunRotating(RunContext& ctx, kv::DType dtype, std::vector<std::string>* failures);
nlohmann::json RunContextShift(RunContext& ctx, kv::DType dtype,
                               std::vector<std::string>* failures);
nlohmann::json RunSweep(RunContext& ctx, kv::DType dtype, const std::vector<int>& contexts,
                        std::vector<std::string>* failures);

// Figures common to the phase summaries; read_bw and fma_peak are the run's baselines.
nlohmann::json PhaseJson(const PhaseStats& p, const Shape& shape, double read_bw, double fma_peak,
                         bool decode);
nlohmann::json CheckJson(const CheckStats& c, kv::DType dtype, const char* what,
                         std::vector<std::string>* failures);

}  // namespace kvperf

#endif  // KVCACHE_PERF_KVPERF_KVPERF_H_
