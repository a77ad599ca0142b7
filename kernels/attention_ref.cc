// Scalar double-precision reference for kernels/attention.h: the definition, written plainly.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "layouts/quant.h"

namespace kv::kernels {
namespace {

float MaskAt(const TensorView& mask, int64_t i, int64_t j) {
  return mask.data == nullptr ? 0.0f : ElementAsF32(mask, j, i);
}

}  // namespace

void AttentionRef(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& mask, const AttentionKernelParams& params, TensorView* out) {
  const int64_t D = k.ne[0];
  const int64_t Hkv = k.ne[1];
  const int64_t L = k.ne[2];
  const int64_t B = q.ne[1];
  const int64_t Hq = q.ne[2];
  const int64_t Dv = params.v_permuted ? v.ne[1] : v.ne[0];
  const int64_t group = Hq / Hkv;
  const double neg_inf = -std::numeric_limits<double>::infinity();

  // Dequantize the whole history once (the reference may allocate; the kernel never does this).
  std::vector<float> kf(static_cast<size_t>(Hkv * L * D));
  std::vector<float> vf(static_cast<size_t>(Hkv * L * Dv));
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t j = 0; j < L; ++j) {
      LoadRowAsF32(RowPtr(k, h, j), D, k.dtype, &kf[static_cast<size_t>((h * L + j) * D)]);
      float* vrow = &vf[static_cast<size_t>((h * L + j) * Dv)];
      if (params.v_permuted) {
        for (int64_t d = 0; d < Dv; ++d) {
          const char* p = static_cast<const char*>(v.data) + static_cast<size_t>(h) * v.nb[2] +
                          static_cast<size_t>(d) * v.nb[1] + static_cast<size_t>(j) * v.nb[0];
          vrow[d] = LoadAsF32(p, v.dtype, 0);
        }
      } else {
        LoadRowAsF32(RowPtr(v, h, j), Dv, v.dtype, vrow);
      }
    }
  }

  // Logits s[g][j] of the group's query heads g for one batch row. Each is the same sum, in the
  // same order, as a loop over one head would form; computing four heads' sums side by side only
  // keeps four independent chains of additions in flight. The tests call this reference on every
  // Highway target: one chain at a time, it took 44% of the longest attention test (release).
  std::vector<double> s(static_cast<size_t>(group * L));
  std::vector<bool> poisoned(static_cast<size_t>(group));
  std::vector<double> m(static_cast<size_t>(group));
  std::vector<double> acc(static_cast<size_t>(Dv));
  const bool has_sink = params.sinks != nullptr;
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t b = 0; b < B; ++b) {
      const auto qrow = [&](int64_t g) {
        return static_cast<const float*>(RowPtr(q, b, h * group + g));
      };
      for (int64_t g = 0; g < group; ++g) {
        m[g] = neg_inf;
        // A NaN or +inf logit (inf or NaN in Q or K) makes the row's output NaN: the softmax has
        // no finite value there (+inf - +inf), and a NaN row shows it instead of hiding it.
        poisoned[g] = false;
      }
      for (int64_t j = 0; j < L; ++j) {
        const float mv = MaskAt(mask, b, j);
        if (std::isinf(mv) && mv < 0) {
          for (int64_t g = 0; g < group; ++g) s[g * L + j] = neg_inf;
          continue;
        }
        const float* krow = &kf[static_cast<size_t>((h * L + j) * D)];
        const auto finish = [&](int64_t g, double dot) {
          double logit = params.scale * dot;
          if (params.softcap != 0) logit = params.softcap * std::tanh(logit / params.softcap);
          const double sj = logit + mv;
          s[g * L + j] = sj;
          poisoned[g] = poisoned[g] || !(sj < std::numeric_limits<double>::infinity());
          m[g] = std::max(m[g], sj);
        };
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) {
          const float *q0 = qrow(g), *q1 = qrow(g + 1), *q2 = qrow(g + 2), *q3 = qrow(g + 3);
          double d0 = 0, d1 = 0, d2 = 0, d3 = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double kd = krow[d];
            d0 += static_cast<double>(q0[d]) * kd;
            d1 += static_cast<double>(q1[d]) * kd;
            d2 += static_cast<double>(q2[d]) * kd;
            d3 += static_cast<double>(q3[d]) * kd;
          }
          finish(g, d0);
          finish(g + 1, d1);
          finish(g + 2, d2);
          finish(g + 3, d3);
        }
        for (; g < group; ++g) {
          const float* q0 = qrow(g);
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q0[d]) * krow[d];
          finish(g, dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        const double* sg = &s[static_cast<size_t>(g * L)];
        double mg = m[g];
        if (has_sink) mg = std::max(mg, static_cast<double>(params.sinks[hq]));
        float* orow = static_cast<float*>(RowPtr(*out, b, hq));
        if (poisoned[g]) {
          for (int64_t d = 0; d < Dv; ++d) orow[d] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (mg == neg_inf) {  // nothing visible and no sink
          for (int64_t d = 0; d < Dv; ++d) orow[d] = 0.0f;
          continue;
        }
        double denom = has_sink ? std::exp(params.sinks[hq] - mg) : 0.0;
        for (double& a : acc) a = 0;
        for (int64_t j = 0; j < L; ++j) {
          if (sg[j] == neg_inf) continue;
          const double p = std::exp(sg[j] - mg);
          denom += p;
          const float* vrow = &vf[static_cast<size_t>((h * L + j) * Dv)];
          for (int64_t d = 0; d < Dv; ++d) acc[d] += p * vrow[d];
        }
        for (int64_t d = 0; d < Dv; ++d)
          orow[d] = denom > 0 ? static_cast<float>(acc[d] / denom) : 0.0f;
      }
    }
  }
}

}  // namespace kv::kernels
