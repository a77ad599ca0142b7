// A tiny transformer for end-to-end cache tests: random weights, RMSNorm, RoPE (normal style),
// GQA, a SiLU MLP and an output projection. Two forward paths share the weights:
//
// - TinyModel::ForwardBatch (f32): what a runtime does. Per self-attention layer it hands the
//   batch's RoPE'd K, V and Q to an AttentionBackend, which stores them in a cache and runs
//   kv::Attend over what the cache returns (tests/end_to_end_test.cc has one backend per cache).
// - Reference (double): recomputes attention for every token over the whole token sequence from
//   the rule alone (which positions a query may see), with no cache, no eviction and no storage
//   rounding. It keeps each token's per-layer hidden state (the unrotated K/V projections of it)
//   because a token's hidden state never changes once computed: that is what a cache holds and
//   what a context shift must not recompute (Ollama and llama.cpp re-rotate stored keys, they do
//   not re-run the earlier tokens). RoPE is applied at every use, at the key's *current* position,
//   so after a shift the reference rotates the remaining keys at their renumbered positions.
//
// Shapes (ggml order, dim 0 fastest), as the caches take them:
//   K, V for a batch of n tokens: [head_dim, kv_heads, n] f32;  Q and the attention output:
//   [head_dim, n, n_heads] f32. Query head h reads KV head h / (n_heads / kv_heads).
#ifndef KVCACHE_TESTS_TINY_TRANSFORMER_H_
#define KVCACHE_TESTS_TINY_TRANSFORMER_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "core/status.h"
#include "kernels/convert.h"
#include "layouts/dtype.h"

namespace kv::tiny {

struct TinyConfig {
  int vocab = 64;
  int d_model = 64;
  int n_heads = 4;
  int kv_heads = 2;
  int head_dim = 32;  // q8_0 / q4_0 storage needs head_dim % 32 == 0
  int d_ff = 128;
  int enc_tokens = 7;  // rows of the fixed "encoder output" read by cross-attention layers
  double rope_base = 10000.0;
  double norm_eps = 1e-5;
};

// Which cached positions p a query at position P may see (SEMANTICS.md sections 4 and 11).
struct Visibility {
  enum Kind { kCausal, kWindow, kChunked, kSinks } kind = kCausal;
  int32_t window = 0;    // kWindow: Ollama's convention, P - W <= p <= P (W + 1 keys)
  int32_t chunk = 0;     // kChunked: same chunk (p >= P - P mod C) and p <= P
  int32_t max_size = 0;  // kSinks: the first `keep` positions plus the newest max_size - keep
  int32_t keep = 0;

  bool Visible(int32_t p, int32_t P) const {
    if (p > P) return false;
    switch (kind) {
      case kCausal:
        return true;
      case kWindow:
        return p >= P - window;
      case kChunked:
        return p >= P - P % chunk;
      case kSinks:
        return p < keep || p > P - (max_size - keep);
    }
    return false;
  }
};

struct LayerSpec {
  bool cross = false;  // cross-attention over the encoder output (no RoPE, no mask)
  Visibility vis;      // self-attention layers
  int cache_type = 0;  // the wrapper child this layer's Put/Get go to (SetLayerType)
};

// Stores and attends for the f32 path. k, v: [head_dim, kv_heads, n]; q, out: [head_dim, n,
// n_heads]; pos: the n positions. Cross layers get the encoder K/V ([head_dim, kv_heads,
// enc_tokens]) instead of the batch's, and must store them only when `store_encoder` is set.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual Status SelfAttention(int layer, int n, std::span<const int32_t> pos, const float* k,
                               const float* v, const float* q, float* out) = 0;
  virtual Status CrossAttention(int layer, int n, bool store_encoder, const float* enc_k,
                                const float* enc_v, const float* q, float* out) = 0;
};

class TinyModel {
 public:
  TinyModel(const TinyConfig& c, std::vector<LayerSpec> layers, uint32_t seed = 1234)
      : c_(c), layers_(std::move(layers)) {
    std::mt19937 rng(seed);
    const int d = c.d_model, qd = c.n_heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
    auto fill = [&rng](std::vector<float>& w, size_t n, double std, double mean = 0) {
      std::normal_distribution<double> dist(mean, std);
      w.resize(n);
      for (float& x : w) x = static_cast<float>(dist(rng));
    };
    fill(embed_, static_cast<size_t>(c.vocab) * d, 1.0);
    L_.resize(layers_.size());
    for (Layer& l : L_) {
      fill(l.attn_norm, d, 0.1, 1.0);
      // Wq scaled up a little: sharper attention makes a wrong visible set show in the logits.
      fill(l.wq, static_cast<size_t>(qd) * d, 2.0 / std::sqrt(d));
      fill(l.wk, static_cast<size_t>(kvd) * d, 1.0 / std::sqrt(d));
      fill(l.wv, static_cast<size_t>(kvd) * d, 1.0 / std::sqrt(d));
      fill(l.wo, static_cast<size_t>(d) * qd, 1.0 / std::sqrt(qd));
      fill(l.mlp_norm, d, 0.1, 1.0);
      fill(l.w1, static_cast<size_t>(c.d_ff) * d, 1.0 / std::sqrt(d));
      fill(l.w2, static_cast<size_t>(d) * c.d_ff, 1.0 / std::sqrt(c.d_ff));
    }
    fill(final_norm_, d, 0.1, 1.0);
    fill(wout_, static_cast<size_t>(c.vocab) * d, 2.0 / std::sqrt(d));
    fill(enc_out_, static_cast<size_t>(c.enc_tokens) * d, 1.0);
    // Encoder K/V per cross layer, in f32 (what the f32 path Puts once).
    enc_k_.resize(layers_.size());
    enc_v_.resize(layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!layers_[l].cross) continue;
      enc_k_[l].resize(static_cast<size_t>(c.enc_tokens) * kvd);
      enc_v_[l].resize(static_cast<size_t>(c.enc_tokens) * kvd);
      for (int e = 0; e < c.enc_tokens; ++e) {
        MatVec(L_[l].wk.data(), &enc_out_[static_cast<size_t>(e) * d], kvd, d,
               &enc_k_[l][static_cast<size_t>(e) * kvd]);
        MatVec(L_[l].wv.data(), &enc_out_[static_cast<size_t>(e) * d], kvd, d,
               &enc_v_[l][static_cast<size_t>(e) * kvd]);
      }
    }
  }

  const TinyConfig& config() const { return c_; }
  const std::vector<LayerSpec>& layers() const { return layers_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }

  // f32 forward of n tokens at `pos`; logits: [n][vocab]. The encoder is stored by cross layers
  // when store_encoder is set (the batch that carries the image).
  Status ForwardBatch(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                      bool store_encoder, AttentionBackend* be, std::vector<float>* logits) const {
    const int n = static_cast<int>(tokens.size());
    const int d = c_.d_model, hd = c_.head_dim, nh = c_.n_heads, kvh = c_.kv_heads;
    const int qd = nh * hd, kvd = kvh * hd;
    std::vector<float> x(static_cast<size_t>(n) * d), h(d), q(static_cast<size_t>(n) * qd),
        k(static_cast<size_t>(n) * kvd), v(static_cast<size_t>(n) * kvd), tmp(qd),
        att(static_cast<size_t>(n) * qd), ff(c_.d_ff), o(d);
    for (int i = 0; i < n; ++i)
      std::copy_n(&embed_[static_cast<size_t>(tokens[i]) * d], d, &x[static_cast<size_t>(i) * d]);
    for (int l = 0; l < num_layers(); ++l) {
      const Layer& w = L_[l];
      const bool cross = layers_[l].cross;
      for (int i = 0; i < n; ++i) {
        RmsNorm(&x[static_cast<size_t>(i) * d], w.attn_norm.data(), h.data());
        MatVec(w.wq.data(), h.data(), qd, d, tmp.data());
        if (!cross) {
          for (int hh = 0; hh < nh; ++hh) Rope(&tmp[static_cast<size_t>(hh) * hd], pos[i]);
          MatVec(w.wk.data(), h.data(), kvd, d, &k[static_cast<size_t>(i) * kvd]);
          MatVec(w.wv.data(), h.data(), kvd, d, &v[static_cast<size_t>(i) * kvd]);
          for (int hh = 0; hh < kvh; ++hh)
            Rope(&k[static_cast<size_t>(i) * kvd + static_cast<size_t>(hh) * hd], pos[i]);
        }
        // [head_dim, n, n_heads]: head-major, then token.
        for (int hh = 0; hh < nh; ++hh)
          std::copy_n(&tmp[static_cast<size_t>(hh) * hd], hd,
                      &q[(static_cast<size_t>(hh) * n + i) * hd]);
      }
      if (cross) {
        KV_RETURN_IF_ERROR(be->CrossAttention(l, n, store_encoder, enc_k_[l].data(),
                                              enc_v_[l].data(), q.data(), att.data()));
      } else {
        KV_RETURN_IF_ERROR(be->SelfAttention(l, n, pos, k.data(), v.data(), q.data(), att.data()));
      }
      for (int i = 0; i < n; ++i) {
        float* xi = &x[static_cast<size_t>(i) * d];
        for (int hh = 0; hh < nh; ++hh)
          std::copy_n(&att[(static_cast<size_t>(hh) * n + i) * hd], hd,
                      &tmp[static_cast<size_t>(hh) * hd]);
        MatVec(w.wo.data(), tmp.data(), d, qd, o.data());
        for (int j = 0; j < d; ++j) xi[j] += o[j];
        Mlp(w, xi, h.data(), ff.data(), o.data());
      }
    }
    logits->resize(static_cast<size_t>(n) * c_.vocab);
    for (int i = 0; i < n; ++i) {
      RmsNorm(&x[static_cast<size_t>(i) * d], final_norm_.data(), h.data());
      MatVec(wout_.data(), h.data(), c_.vocab, d, &(*logits)[static_cast<size_t>(i) * c_.vocab]);
    }
    return Status::Ok();
  }

  // The double-precision reference (see the file comment). Tokens are processed in order; a
  // context shift before token `shift_at` removes positions [shift_begin, shift_end) and renumbers
  // the later ones down, as Cache::Remove does.
  struct Shift {
    int at = -1;  // token index before which the shift happens; -1: none
    int32_t begin = 0, end = 0;
  };
  struct RefResult {
    std::vector<int32_t> tokens;              // prompt + generated
    std::vector<int32_t> positions;           // position of each token when it was processed
    std::vector<std::vector<double>> logits;  // per token, [vocab]
  };

  // Processes the prompt and n_gen greedy tokens; tokens gets one more (the argmax of the last).
  //
  // With `storage` set the reference also emulates what a cache of that dtype stores (the
  // "stored-value" reference): each K row is rotated at the token's position and rounded through
  // the storage dtype (scalar reference converters), V likewise, float-typed encoder K/V too; a
  // shift dequantizes, rotates by the delta and rounds again, as the RoPE shift kernel does. It
  // tells the rounding of the storage dtype apart from everything else a cache could get wrong.
  // `forced` (prompt + n_gen + 1 tokens) replaces the greedy choice, so two references (or a
  // reference and a cache) follow one token sequence.
  RefResult Reference(std::span<const int32_t> prompt, int n_gen, const Shift& shift,
                      std::optional<DType> storage = std::nullopt,
                      const std::vector<int32_t>* forced = nullptr) const {
    const int d = c_.d_model, hd = c_.head_dim, nh = c_.n_heads, kvh = c_.kv_heads;
    const int qd = nh * hd, kvd = kvh * hd, group = nh / kvh;
    const int T = static_cast<int>(prompt.size()) + n_gen;  // tokens processed
    RefResult r;
    if (forced != nullptr) {
      r.tokens = *forced;
    } else {
      r.tokens.assign(prompt.begin(), prompt.end());
    }
    r.positions.resize(T);
    r.logits.resize(T);
    std::vector<int32_t> pos_now(T, -1);  // current position of each processed token; -1 removed
    // Per layer, per token: the unrotated K and the V projections of its hidden state.
    std::vector<std::vector<double>> kraw(layers_.size()), vv(layers_.size()), kst(layers_.size());
    for (auto& a : kraw) a.resize(static_cast<size_t>(T) * kvd);
    if (storage) {
      for (auto& a : kst) a.resize(static_cast<size_t>(T) * kvd);
    }
    for (auto& a : vv) a.resize(static_cast<size_t>(T) * kvd);
    std::vector<std::vector<double>> enc_k(layers_.size()), enc_v(layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!layers_[l].cross) continue;
      enc_k[l].resize(static_cast<size_t>(c_.enc_tokens) * kvd);
      enc_v[l].resize(static_cast<size_t>(c_.enc_tokens) * kvd);
      for (int e = 0; e < c_.enc_tokens; ++e) {
        MatVecD(L_[l].wk.data(), &enc_out_[static_cast<size_t>(e) * d], kvd, d,
                &enc_k[l][static_cast<size_t>(e) * kvd]);
        MatVecD(L_[l].wv.data(), &enc_out_[static_cast<size_t>(e) * d], kvd, d,
                &enc_v[l][static_cast<size_t>(e) * kvd]);
      }
      if (storage && !IsQuantized(*storage)) {  // the backend hands quantized storage f32
        for (int r = 0; r < c_.enc_tokens * kvh; ++r) {
          RoundTrip(&enc_k[l][static_cast<size_t>(r) * hd], hd, *storage);
          RoundTrip(&enc_v[l][static_cast<size_t>(r) * hd], hd, *storage);
        }
      }
    }
    std::vector<double> x(d), h(d), q(qd), att(qd), o(d), ff(c_.d_ff), kr(hd), scores;
    int32_t next_pos = 0;
    for (int t = 0; t < T; ++t) {
      if (t == shift.at) {
        const int32_t delta = shift.end - shift.begin;
        for (int j = 0; j < t; ++j) {
          if (pos_now[j] < 0) continue;
          if (pos_now[j] >= shift.begin && pos_now[j] < shift.end) {
            pos_now[j] = -1;
          } else if (pos_now[j] >= shift.end) {
            pos_now[j] -= delta;
            for (size_t l = 0; storage && l < layers_.size(); ++l) {
              if (layers_[l].cross) continue;
              for (int hh = 0; hh < kvh; ++hh) {
                double* row = &kst[l][static_cast<size_t>(j) * kvd + hh * hd];
                ShiftRowF(row, -delta);
                RoundTrip(row, hd, *storage);
              }
            }
          }
        }
        next_pos -= delta;
      }
      const int32_t P = next_pos++;
      pos_now[t] = P;
      r.positions[t] = P;
      for (int j = 0; j < d; ++j) x[j] = embed_[static_cast<size_t>(r.tokens[t]) * d + j];
      for (int l = 0; l < num_layers(); ++l) {
        const Layer& w = L_[l];
        const LayerSpec& spec = layers_[l];
        RmsNormD(x.data(), w.attn_norm.data(), h.data());
        MatVecD(w.wq.data(), h.data(), qd, d, q.data());
        const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
        if (spec.cross) {
          for (int hh = 0; hh < nh; ++hh) {
            const int kh = hh / group;
            scores.assign(c_.enc_tokens, 0);
            for (int e = 0; e < c_.enc_tokens; ++e) {
              double s = 0;
              for (int i = 0; i < hd; ++i)
                s += q[hh * hd + i] * enc_k[l][static_cast<size_t>(e) * kvd + kh * hd + i];
              scores[e] = s * scale;
            }
            SoftmaxInPlace(&scores);
            for (int i = 0; i < hd; ++i) {
              double a = 0;
              for (int e = 0; e < c_.enc_tokens; ++e)
                a += scores[e] * enc_v[l][static_cast<size_t>(e) * kvd + kh * hd + i];
              att[hh * hd + i] = a;
            }
          }
        } else {
          MatVecD(w.wk.data(), h.data(), kvd, d, &kraw[l][static_cast<size_t>(t) * kvd]);
          MatVecD(w.wv.data(), h.data(), kvd, d, &vv[l][static_cast<size_t>(t) * kvd]);
          for (int hh = 0; storage && hh < kvh; ++hh) {
            const size_t o = static_cast<size_t>(t) * kvd + hh * hd;
            std::copy_n(&kraw[l][o], hd, &kst[l][o]);
            RopeD(&kst[l][o], P);
            RoundTrip(&kst[l][o], hd, *storage);
            RoundTrip(&vv[l][o], hd, *storage);
          }
          for (int hh = 0; hh < nh; ++hh) RopeD(&q[hh * hd], P);
          std::vector<int> visible;
          for (int j = 0; j <= t; ++j)
            if (pos_now[j] >= 0 && spec.vis.Visible(pos_now[j], P)) visible.push_back(j);
          for (int hh = 0; hh < nh; ++hh) {
            const int kh = hh / group;
            scores.assign(visible.size(), 0);
            for (size_t m = 0; m < visible.size(); ++m) {
              const int j = visible[m];
              if (storage) {
                std::copy_n(&kst[l][static_cast<size_t>(j) * kvd + kh * hd], hd, kr.data());
              } else {
                std::copy_n(&kraw[l][static_cast<size_t>(j) * kvd + kh * hd], hd, kr.data());
                RopeD(kr.data(), pos_now[j]);
              }
              double s = 0;
              for (int i = 0; i < hd; ++i) s += q[hh * hd + i] * kr[i];
              scores[m] = s * scale;
            }
            SoftmaxInPlace(&scores);
            for (int i = 0; i < hd; ++i) {
              double a = 0;
              for (size_t m = 0; m < visible.size(); ++m)
                a += scores[m] * vv[l][static_cast<size_t>(visible[m]) * kvd + kh * hd + i];
              att[hh * hd + i] = a;
            }
          }
        }
        MatVecD(w.wo.data(), att.data(), d, qd, o.data());
        for (int j = 0; j < d; ++j) x[j] += o[j];
        MlpD(w, x.data(), h.data(), ff.data(), o.data());
      }
      RmsNormD(x.data(), final_norm_.data(), h.data());
      r.logits[t].resize(c_.vocab);
      MatVecD(wout_.data(), h.data(), c_.vocab, d, r.logits[t].data());
      if (forced == nullptr && t + 1 >= static_cast<int>(prompt.size())) {
        r.tokens.push_back(static_cast<int32_t>(
            std::max_element(r.logits[t].begin(), r.logits[t].end()) - r.logits[t].begin()));
      }
    }
    return r;
  }

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, mlp_norm, w1, w2;
  };

  // y[r] = sum_c W[r][c] x[c], W row-major [rows][cols].
  static void MatVec(const float* W, const float* x, int rows, int cols, float* y) {
    for (int r = 0; r < rows; ++r) {
      float s = 0;
      for (int c = 0; c < cols; ++c) s += W[static_cast<size_t>(r) * cols + c] * x[c];
      y[r] = s;
    }
  }
  template <typename X>
  static void MatVecD(const float* W, const X* x, int rows, int cols, double* y) {
    for (int r = 0; r < rows; ++r) {
      double s = 0;
      for (int c = 0; c < cols; ++c)
        s += static_cast<double>(W[static_cast<size_t>(r) * cols + c]) * x[c];
      y[r] = s;
    }
  }
  void RmsNorm(const float* x, const float* g, float* y) const {
    float ss = 0;
    for (int i = 0; i < c_.d_model; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / c_.d_model + static_cast<float>(c_.norm_eps));
    for (int i = 0; i < c_.d_model; ++i) y[i] = x[i] * inv * g[i];
  }
  void RmsNormD(const double* x, const float* g, double* y) const {
    double ss = 0;
    for (int i = 0; i < c_.d_model; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / c_.d_model + c_.norm_eps);
    for (int i = 0; i < c_.d_model; ++i) y[i] = x[i] * inv * g[i];
  }
  // Normal-style RoPE over the whole head: pairs (2i, 2i + 1), theta_i = base^(-2i / head_dim).
  // The f32 path takes cos/sin of the angle in double and rounds them, as the shift kernel does.
  void Rope(float* v, int32_t p) const {
    for (int i = 0; i < c_.head_dim / 2; ++i) {
      const double theta = std::pow(c_.rope_base, -2.0 * i / c_.head_dim);
      const float cs = static_cast<float>(std::cos(p * theta));
      const float sn = static_cast<float>(std::sin(p * theta));
      const float a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = a * cs - b * sn;
      v[2 * i + 1] = a * sn + b * cs;
    }
  }
  // The stored-value reference's shift: the stored (f32-representable) row rotated in f32 with
  // cos/sin rounded from double, the arithmetic the shift kernel documents (kernels/rope.h), so a
  // rounding decision of the re-quantization sees the same value as in the cache.
  void ShiftRowF(double* v, int32_t delta) const {
    for (int i = 0; i < c_.head_dim / 2; ++i) {
      const double theta = std::pow(c_.rope_base, -2.0 * i / c_.head_dim);
      const float cs = static_cast<float>(std::cos(delta * theta));
      const float sn = static_cast<float>(std::sin(delta * theta));
      const float a = static_cast<float>(v[2 * i]), b = static_cast<float>(v[2 * i + 1]);
      v[2 * i] = a * cs - b * sn;
      v[2 * i + 1] = a * sn + b * cs;
    }
  }
  void RopeD(double* v, int32_t p) const {
    for (int i = 0; i < c_.head_dim / 2; ++i) {
      const double theta = std::pow(c_.rope_base, -2.0 * i / c_.head_dim);
      const double cs = std::cos(p * theta), sn = std::sin(p * theta);
      const double a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = a * cs - b * sn;
      v[2 * i + 1] = a * sn + b * cs;
    }
  }
  // Rounds a row to what storage of dtype t holds (through f32, as a Put of f32 input does).
  static void RoundTrip(double* row, int n, DType t) {
    std::vector<float> f(row, row + n);
    std::vector<uint8_t> bytes(static_cast<size_t>(n) * 4);
    kernels::ConvertRowRef(f.data(), DType::kF32, bytes.data(), t, n);
    kernels::RowToF32Ref(bytes.data(), t, f.data(), n);
    std::copy(f.begin(), f.end(), row);
  }
  static void SoftmaxInPlace(std::vector<double>* s) {
    if (s->empty()) return;
    const double m = *std::max_element(s->begin(), s->end());
    double sum = 0;
    for (double& x : *s) sum += (x = std::exp(x - m));
    for (double& x : *s) x /= sum;
  }
  // x += W2 silu(W1 rmsnorm(x)); h, ff, o: scratch.
  void Mlp(const Layer& w, float* x, float* h, float* ff, float* o) const {
    RmsNorm(x, w.mlp_norm.data(), h);
    MatVec(w.w1.data(), h, c_.d_ff, c_.d_model, ff);
    for (int i = 0; i < c_.d_ff; ++i) ff[i] = ff[i] / (1.0f + std::exp(-ff[i]));
    MatVec(w.w2.data(), ff, c_.d_model, c_.d_ff, o);
    for (int i = 0; i < c_.d_model; ++i) x[i] += o[i];
  }
  void MlpD(const Layer& w, double* x, double* h, double* ff, double* o) const {
    RmsNormD(x, w.mlp_norm.data(), h);
    MatVecD(w.w1.data(), h, c_.d_ff, c_.d_model, ff);
    for (int i = 0; i < c_.d_ff; ++i) ff[i] = ff[i] / (1.0 + std::exp(-ff[i]));
    MatVecD(w.w2.data(), ff, c_.d_model, c_.d_ff, o);
    for (int i = 0; i < c_.d_model; ++i) x[i] += o[i];
  }

  TinyConfig c_;
  std::vector<LayerSpec> layers_;
  std::vector<float> embed_, final_norm_, wout_, enc_out_;
  std::vector<Layer> L_;
  std::vector<std::vector<float>> enc_k_, enc_v_;  // per cross layer: [enc_tokens][kv_heads * hd]
};

}  // namespace kv::tiny

#endif  // KVCACHE_TESTS_TINY_TRANSFORMER_H_
