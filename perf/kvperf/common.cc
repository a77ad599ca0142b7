// kvperf: data generation, the read-bandwidth baseline, progress, the double references and the
// timed forward pass.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include "fma_peak.h"
#include "kernels/convert.h"
#include "kvperf/kvperf.h"
#include "read_bandwidth.h"

namespace kvperf {

void GenRow(Kind kind, int layer, int head, uint64_t token, int head_dim, int32_t rope_pos,
            float* out) {
  const uint64_t base =
      Mix(Mix(static_cast<uint64_t>(kind) << 56 ^ static_cast<uint64_t>(layer) << 40 ^
              static_cast<uint64_t>(head) << 24) ^
          token);
  for (int d = 0; d < head_dim; ++d) out[d] = Uniform(base + static_cast<uint64_t>(d));
  if (kind == Kind::kQuery) {
    for (int d = 0; d < head_dim; ++d) out[d] *= kQueryScale;
  }
  if (rope_pos >= 0) {
    for (int i = 0; i < head_dim / 2; ++i) {
      const double theta = std::pow(kRopeBase, -2.0 * i / head_dim);
      const double a = static_cast<double>(rope_pos) * theta;
      const double c = std::cos(a), s = std::sin(a);
      const double x0 = out[2 * i], x1 = out[2 * i + 1];
      out[2 * i] = static_cast<float>(x0 * c - x1 * s);
      out[2 * i + 1] = static_cast<float>(x0 * s + x1 * c);
    }
  }
}

// ---- machine baseline ------------------------------------------------------------------------

// The measurement itself is shared with the microbenchmarks (perf/read_bandwidth.h).
double MeasureReadBandwidth(kv::ThreadPool* pool) { return kvbench::MeasureReadBandwidth(pool); }
double MeasureFmaPeak(kv::ThreadPool* pool) { return kvbench::MeasureFmaPeak(*pool, 20); }

std::string CpuName() {
  // The model name alone does not tell the machines apart: the Zen 4 and Zen 5 VMs both say
  // "AMD EPYC", and their decode figures differ (README, Known gaps). Family and model do.
  std::ifstream f("/proc/cpuinfo");
  std::string line, name, family, model;
  while (std::getline(f, line) && (name.empty() || family.empty() || model.empty())) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos || colon == 0) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name") name = value;
    if (key == "cpu family") family = value;
    if (key == "model") model = value;
  }
  if (name.empty()) name = "unknown CPU";
  if (!family.empty() && !model.empty()) name += " (family " + family + ", model " + model + ")";
  return name;
}

// ---- progress ----------------------------------------------------------------------------------

namespace {
Clock::time_point g_progress_start = Clock::now();
bool g_progress_open = false;
}  // namespace

void Progress(const char* fmt, ...) {
  static const bool tty = isatty(2);
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const double t = Seconds(g_progress_start, Clock::now());
  if (tty) {
    std::fprintf(stderr, "\r\033[K[kvperf %5.1fs] %s", t, msg);
    g_progress_open = true;
  } else {
    std::fprintf(stderr, "[kvperf %5.1fs] %s\n", t, msg);
  }
  std::fflush(stderr);
}

void ProgressDone() {
  if (g_progress_open) std::fprintf(stderr, "\r\033[K");
  g_progress_open = false;
  std::fflush(stderr);
}

// ---- correctness -------------------------------------------------------------------------------

void CheckStats::Merge(const CheckStats& o) {
  samples += o.samples;
  rows += o.rows;
  kernel_err = std::max(kernel_err, o.kernel_err);
  storage_err = std::max(storage_err, o.storage_err);
  max_abs_out = std::max(max_abs_out, o.max_abs_out);
}

// Tolerances. Inputs: K, V in [-1, 1), Q in [-3, 3), D = 64, scale 1/8, so |logit| <= 24 and the
// outputs lie in [-1, 1].
//
// Kernel error (Attend against a double reference over the *same stored* K/V): the dtype enters
// only through the stored values, which the reference sees too, so one bound serves every dtype.
// The kernel forms each logit as an f32 dot product of 64 terms (error <= 64 * 2^-24 * 24 = 9e-5
// in the worst case, ~1e-5 typically), exponentiates with 1-ULP exp, and accumulates V over up to a
// few thousand cells in f32 (~sqrt(L) * 2^-24). A weight error of e changes the output by at most
// 2e * max|V|. 2e-4 is twice the worst-case logit bound; a real fault (a wrong cell, head or mask)
// moves outputs by ~1e-1.
double KernelTolerance(kv::DType dtype) {
  (void)dtype;
  return 2e-4;
}

// Storage error (Attend against a double reference over the f32 K/V the model put, before the
// cache rounded them): the rounding of the storage dtype dominates.
//   f16: |dk|, |dv| <= 2^-12 for values below 1, so the logit error is <= scale * sum|q||dk| =
//        64 * 3 * 2^-12 / 8 = 5.9e-3 in the worst case, ~sqrt(64) * 1.5 * 1.2e-4 / 8 = 2e-4
//        typically; the output moves by about the logit error (softmax weights are relative) plus
//        |dv|. 2e-3: ten times the typical error, a third of the worst case.
//   bf16: 8 bits of mantissa instead of 11: 8x the f16 figure.
//   q8_0: |dx| <= max|block| / 127 / 2 = 3.9e-3 (plus the f16 scale's rounding), 16x f16's bound:
//        3e-2.
//   q4_0: |dx| <= max|block| / 8 / 2 = 6.3e-2, 256x f16: 0.5 (q4_0 is a lossy format; the check
//        then only catches gross faults).
//   f32: exact storage: the kernel tolerance.
double StorageTolerance(kv::DType dtype) {
  switch (dtype) {
    case kv::DType::kF32:
      return 2e-4;
    case kv::DType::kF16:
      return 2e-3;
    case kv::DType::kBF16:
      return 1.6e-2;
    case kv::DType::kQ8_0:
      return 3e-2;
    case kv::DType::kQ4_0:
      return 0.5;
  }
  return 0;
}

namespace {
// softmax(scale * q.k_j + mask_j) . v_j in double over the listed rows.
void RefAttend(const float* q, int D, const float* const* krows, const float* const* vrows,
               const double* bias, size_t n, double scale, double* out) {
  std::vector<double> logit(n);
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < n; ++j) {
    double s = 0;
    for (int d = 0; d < D; ++d) s += static_cast<double>(q[d]) * krows[j][d];
    logit[j] = s * scale + (bias ? bias[j] : 0.0);
    mx = std::max(mx, logit[j]);
  }
  for (int d = 0; d < D; ++d) out[d] = 0;
  if (n == 0) return;
  double sum = 0;
  for (size_t j = 0; j < n; ++j) {
    const double w = std::exp(logit[j] - mx);
    sum += w;
    for (int d = 0; d < D; ++d) out[d] += w * vrows[j][d];
  }
  for (int d = 0; d < D; ++d) out[d] /= sum;
}
}  // namespace

void CheckAttention(const Shape& shape, int layer, const kv::TensorView& q,
                    const kv::History& history, const kv::TensorView& out,
                    const std::vector<int>& rows, const std::vector<int>& row_seq,
                    const std::vector<int32_t>& row_pos, const HistoryFn& history_fn, bool rope,
                    CheckStats* stats) {
  const int D = static_cast<int>(history.k.ne[0]);
  const int hkv = static_cast<int>(history.k.ne[1]);
  const int64_t L = history.k.ne[2];
  const int hq = static_cast<int>(q.ne[2]);
  const int group = hq / hkv;
  const int B = static_cast<int>(q.ne[1]);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  (void)shape;

  std::vector<float> kf(static_cast<size_t>(D) * hkv * L), vf(kf.size());
  if (L > 0) {
    kv::kernels::ViewToF32(history.k, kf.data());
    kv::kernels::ViewToF32(history.v, vf.data());
  }
  std::vector<float> mask;
  if (history.mask.data != nullptr) {
    mask.resize(static_cast<size_t>(L) * B);
    kv::kernels::ViewToF32(history.mask, mask.data());
  }

  std::vector<const float*> kr, vr;
  std::vector<double> bias, ref(D);
  std::vector<float> gk, gv;
  std::vector<std::pair<uint64_t, int32_t>> toks;
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const int b = rows[ri];
    // (1) over the stored history
    kr.clear();
    vr.clear();
    bias.clear();
    for (int64_t j = 0; j < L; ++j) {
      const float m = mask.empty() ? 0.0f : mask[static_cast<size_t>(b) * L + j];
      if (std::isinf(m) && m < 0) continue;
      kr.push_back(nullptr);
      vr.push_back(nullptr);
      bias.push_back(m);
    }
    // (2) over the regenerated history
    toks.clear();
    history_fn(layer, row_seq[ri], row_pos[ri],
               [&](uint64_t token, int32_t kpos) { toks.emplace_back(token, kpos); });
    const size_t n2 = toks.size();
    gk.resize(n2 * D);
    gv.resize(n2 * D);
    std::vector<const float*> gkr(n2), gvr(n2);
    for (int h = 0; h < hkv; ++h) {
      size_t idx = 0;
      for (int64_t j = 0; j < L; ++j) {
        const float m = mask.empty() ? 0.0f : mask[static_cast<size_t>(b) * L + j];
        if (std::isinf(m) && m < 0) continue;
        kr[idx] = &kf[(static_cast<size_t>(j) * hkv + h) * D];
        vr[idx] = &vf[(static_cast<size_t>(j) * hkv + h) * D];
        ++idx;
      }
      for (size_t t = 0; t < n2; ++t) {
        GenRow(Kind::kKey, layer, h, toks[t].first, D, rope ? toks[t].second : -1, &gk[t * D]);
        GenRow(Kind::kValue, layer, h, toks[t].first, D, -1, &gv[t * D]);
        gkr[t] = &gk[t * D];
        gvr[t] = &gv[t * D];
      }
      for (int g = 0; g < group; ++g) {
        const int qh = h * group + g;
        const float* qrow = reinterpret_cast<const float*>(kv::RowPtr(q, b, qh));
        const float* orow = reinterpret_cast<const float*>(kv::RowPtr(out, b, qh));
        RefAttend(qrow, D, kr.data(), vr.data(), bias.data(), kr.size(), scale, ref.data());
        for (int d = 0; d < D; ++d) {
          stats->kernel_err = std::max(stats->kernel_err, std::fabs(ref[d] - orow[d]));
          stats->max_abs_out = std::max(stats->max_abs_out, std::fabs(ref[d]));
        }
        RefAttend(qrow, D, gkr.data(), gvr.data(), nullptr, n2, scale, ref.data());
        for (int d = 0; d < D; ++d) {
          stats->storage_err = std::max(stats->storage_err, std::fabs(ref[d] - orow[d]));
        }
        ++stats->rows;
      }
    }
  }
  ++stats->samples;
}

// ---- the timed forward pass --------------------------------------------------------------------

void PhaseStats::Merge(const PhaseStats& o) {
  tokens += o.tokens;
  forwards += o.forwards;
  start_s += o.start_s;
  put_s += o.put_s;
  get_s += o.get_s;
  attend_s += o.attend_s;
  attn_bytes += o.attn_bytes;
  visible_pairs += o.visible_pairs;
}

kv::Status Engine::Forward(const std::vector<int>& seq, const std::vector<int32_t>& pos,
                           const std::vector<int32_t>& multimodal,
                           const std::vector<int>& check_layers, PhaseStats* stats,
                           CheckStats* check) {
  const int B = static_cast<int>(seq.size());
  const int D = shape.head_dim, hkv = shape.kv_heads, hq = shape.q_heads;
  std::vector<int32_t> seq32(seq.begin(), seq.end());
  kv::Batch batch{pos, seq32, multimodal};
  std::vector<uint64_t> tok(B);
  for (int b = 0; b < B; ++b) tok[b] = token_of(seq[b], pos[b]);

  auto t0 = Clock::now();
  KV_RETURN_IF_ERROR(cache->StartForward(batch, false));
  stats->start_s += Seconds(t0, Clock::now());
  stats->tokens += B;
  stats->forwards += 1;

  q_.resize(static_cast<size_t>(D) * B * hq);
  out_.resize(q_.size());
  const kv::TensorView qv = kv::MakeView(q_.data(), kv::DType::kF32, {D, B, hq});
  kv::TensorView ov = kv::MakeView(out_.data(), kv::DType::kF32, {D, B, hq});

  // Visible-cell counts depend only on the mask, which a cache shares across its layers.
  const void* counted_mask = nullptr;
  int64_t counted_union = 0;
  double counted_pairs = 0;

  for (int layer = 0; layer < shape.layers; ++layer) {
    const std::vector<Site> layer_sites = sites ? sites(layer) : std::vector<Site>{Site{}};
    for (size_t si = 0; si < layer_sites.size(); ++si) {
      const Site& site = layer_sites[si];
      const bool encoder = site.salt != 0;
      if (site.put) {
        const int n = encoder ? encoder_frames : B;
        k_.resize(static_cast<size_t>(D) * hkv * n);
        v_.resize(k_.size());
        for (int t = 0; t < n; ++t) {
          const uint64_t id = encoder ? TokenId(static_cast<uint32_t>(site.salt), t) : tok[t];
          for (int h = 0; h < hkv; ++h) {
            float* kr = &k_[(static_cast<size_t>(t) * hkv + h) * D];
            GenRow(Kind::kKey, layer, h, id, D, rope && !encoder ? pos[t] : -1, kr);
            GenRow(Kind::kValue, layer, h, id, D, -1, &v_[(static_cast<size_t>(t) * hkv + h) * D]);
          }
        }
      }
      if (site.put && encoder) {
        k16_.resize(k_.size());
        v16_.resize(v_.size());
        for (size_t i = 0; i < k_.size(); ++i) {
          k16_[i] = kv::F32ToF16(k_[i]);
          v16_[i] = kv::F32ToF16(v_[i]);
        }
      }
      // Q: the cross-attention site of a layer uses other query weights than its self-attention.
      const int q_layer = layer * 4 + static_cast<int>(si);
      for (int h = 0; h < hq; ++h) {
        for (int b = 0; b < B; ++b) {
          GenRow(Kind::kQuery, q_layer, h, tok[b], D, -1,
                 &q_[(static_cast<size_t>(h) * B + b) * D]);
        }
      }

      t0 = Clock::now();
      if (wrapper != nullptr) wrapper->SetLayerType(site.type);
      cache->SetLayer(layer);
      if (site.put && encoder) {
        // An encoder cache stores K/V as given; the runtime hands it f16 (it cannot take q8_0).
        const int n = encoder_frames;
        KV_RETURN_IF_ERROR(cache->Put(kv::MakeView(k16_.data(), kv::DType::kF16, {D, hkv, n}),
                                      kv::MakeView(v16_.data(), kv::DType::kF16, {D, hkv, n})));
      } else if (site.put) {
        KV_RETURN_IF_ERROR(cache->Put(kv::MakeView(k_.data(), kv::DType::kF32, {D, hkv, B}),
                                      kv::MakeView(v_.data(), kv::DType::kF32, {D, hkv, B})));
      }
      auto t1 = Clock::now();
      const kv::History hist = cache->Get();
      auto t2 = Clock::now();
      KV_RETURN_IF_ERROR(kv::Attend(qv, hist, kv::AttentionParams{}, &ov, pool));
      auto t3 = Clock::now();
      stats->put_s += Seconds(t0, t1);
      stats->get_s += Seconds(t1, t2);
      stats->attend_s += Seconds(t2, t3);

      // Bytes and visible pairs (untimed).
      const int64_t L = hist.k.ne[2];
      int64_t uni = 0;
      double pairs = 0;
      if (hist.mask.data == nullptr) {
        uni = L;
        pairs = static_cast<double>(L) * B;
      } else if (hist.mask.data == counted_mask && L == hist.mask.ne[0]) {
        uni = counted_union;
        pairs = counted_pairs;
      } else {
        std::vector<float> m(static_cast<size_t>(L) * B);
        kv::kernels::ViewToF32(hist.mask, m.data());
        std::vector<uint8_t> vis(L, 0);
        for (int b = 0; b < B; ++b) {
          const float* row = &m[static_cast<size_t>(b) * L];
          for (int64_t j = 0; j < L; ++j) {
            const bool visible = !(std::isinf(row[j]) && row[j] < 0);
            vis[j] |= visible;
            pairs += visible;
          }
        }
        for (int64_t j = 0; j < L; ++j) uni += vis[j];
        counted_mask = hist.mask.data;
        counted_union = uni;
        counted_pairs = pairs;
      }
      const double row_bytes = static_cast<double>(kv::RowBytes(hist.k.dtype, D)) +
                               static_cast<double>(kv::RowBytes(hist.v.dtype, D));
      stats->attn_bytes += static_cast<double>(hkv) * row_bytes * static_cast<double>(uni);
      stats->visible_pairs += pairs;

      if (check != nullptr &&
          std::find(check_layers.begin(), check_layers.end(), layer) != check_layers.end()) {
        std::vector<int> rows, rseq;
        std::vector<int32_t> rpos;
        // Up to 4 rows (a decode batch is 4 rows; a prefill batch of 512 is sampled: the double
        // references cost ~0.1 s per row and layer), spread over the batch and ending at its last
        // token (the longest history).
        const int nrows = std::min(B, 4);
        for (int i = 0; i < nrows; ++i) {
          const int b = B <= 4 ? i : (i + 1) * (B / nrows) - 1;
          rows.push_back(b);
          rseq.push_back(seq[b]);
          rpos.push_back(pos[b]);
        }
        CheckAttention(shape, layer, qv, hist, ov, rows, rseq, rpos,
                       encoder ? cross_history_fn : history_fn, rope && !encoder, check);
      }
    }
  }
  return kv::Status::Ok();
}

// ---- JSON summaries ----------------------------------------------------------------------------

nlohmann::json PhaseJson(const PhaseStats& p, const Shape& shape, double read_bw, double fma_peak,
                         bool decode) {
  nlohmann::json j;
  const double total = p.Total();
  j["tokens"] = p.tokens;
  j["forward_passes"] = p.forwards;
  j["seconds"] = total;
  j["tokens_per_s"] = total > 0 ? p.tokens / total : 0;
  j["seconds_start_forward"] = p.start_s;
  j["seconds_put"] = p.put_s;
  j["seconds_get"] = p.get_s;
  j["seconds_attend"] = p.attend_s;
  j["attend_share"] = total > 0 ? p.attend_s / total : 0;
  const double flops = p.visible_pairs * shape.q_heads * 4.0 * shape.head_dim;
  j["attention_gflop"] = flops * 1e-9;
  j["attention_gflop_per_s"] = p.attend_s > 0 ? flops / p.attend_s * 1e-9 : 0;
  // Against the FMA peak measured beside the run: how close attention runs to its arithmetic
  // limit (f16 and q8_0 do these flops in FMAs or in integer dots that issue on the same pipes).
  j["attention_fraction_of_fma_peak"] =
      p.attend_s > 0 && fma_peak > 0 ? flops / p.attend_s / fma_peak : 0;
  if (decode) {
    const double bw = p.attend_s > 0 ? p.attn_bytes / p.attend_s : 0;
    j["attention_bytes"] = p.attn_bytes;
    j["attention_bytes_per_s"] = bw;
    j["attention_fraction_of_read_bw"] = read_bw > 0 ? bw / read_bw : 0;
    const double step_bw = total > 0 ? p.attn_bytes / total : 0;
    j["step_fraction_of_read_bw"] = read_bw > 0 ? step_bw / read_bw : 0;
  }
  return j;
}

nlohmann::json CheckJson(const CheckStats& c, kv::DType dtype, const char* what,
                         std::vector<std::string>* failures) {
  nlohmann::json j;
  j["samples"] = c.samples;
  j["rows_x_heads"] = c.rows;
  j["kernel_max_abs_err"] = c.kernel_err;
  j["kernel_tolerance"] = KernelTolerance(dtype);
  j["storage_max_abs_err"] = c.storage_err;
  j["storage_tolerance"] = StorageTolerance(dtype);
  j["max_abs_output"] = c.max_abs_out;
  const bool ok = c.samples > 0 && c.kernel_err <= KernelTolerance(dtype) &&
                  c.storage_err <= StorageTolerance(dtype);
  j["ok"] = ok;
  if (!ok) {
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "%s (%s): kernel error %.3g (tolerance %.3g), storage error %.3g (tolerance %.3g), "
        "%d samples",
        what, kv::DTypeName(dtype), c.kernel_err, KernelTolerance(dtype), c.storage_err,
        StorageTolerance(dtype), c.samples);
    failures->push_back(buf);
  }
  return j;
}

}  // namespace kvperf
