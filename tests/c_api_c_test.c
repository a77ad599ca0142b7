/* The C API used from C (compiled as C11, -Wall -Wextra -pedantic -Werror): the worked examples of
 * SEMANTICS.md, errors that change nothing, Remove through a C shift callback, attention against a
 * plain computation, a hand-built history's mask index, the rotating cache, save / load with a
 * damaged stream, the wrapper and the encoder. tests/c_api_test.cc checks that the C calls give
 * what the C++ calls give. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache_c.h"

static int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

#define CHECK_OK(call)                                                          \
  do {                                                                          \
    kvc_code code_ = (call);                                                    \
    if (code_ != KVC_OK) {                                                      \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
              kvc_code_name(code_), kvc_last_error());                          \
      ++g_failures;                                                             \
    }                                                                           \
  } while (0)

/* Element (j, i) of an f32 mask [L, B]: batch row i, cell j. 1 visible, 0 hidden. */
static int Visible(const kvc_history* h, int64_t i, int64_t j) {
  const float* row = (const float*)((const char*)h->mask.data + (size_t)i * h->mask.nb[1]);
  return row[j] == 0.0f;
}

/* The mask as rows of '0' / 'x', rows separated by '/': "0xxx/00xx". */
static void MaskString(const kvc_history* h, char* out) {
  for (int64_t i = 0; i < h->mask.ne[1]; ++i) {
    if (i > 0) *out++ = '/';
    for (int64_t j = 0; j < h->mask.ne[0]; ++j) *out++ = Visible(h, i, j) ? '0' : 'x';
  }
  *out = '\0';
}

/* K element 0 of cell j, head 0 (f32 storage). */
static float K0(const kvc_history* h, int64_t j) {
  return *(const float*)((const char*)h->k.data + (size_t)j * h->k.nb[2]);
}

/* Puts one f32 value per token into K and V ([1, 1, n]). */
static kvc_code PutValues(kvc_cache* c, float* values, int64_t n) {
  const int64_t ne[3] = {1, 1, n};
  const kvc_tensor t = kvc_make_tensor(values, KVC_F32, 3, ne);
  return kvc_put(c, &t, &t);
}

static kvc_code Forward(kvc_cache* c, const int32_t* pos, const int32_t* seq, int32_t n) {
  return kvc_start_forward(c, pos, seq, n, NULL, 0, 0);
}

static void TestNames(void) {
  CHECK(strcmp(kvc_code_name(KVC_OK), "ok") == 0);
  CHECK(strcmp(kvc_code_name(KVC_CACHE_FULL), "cache full") == 0);
  CHECK(strcmp(kvc_code_name(KVC_CORRUPT), "corrupt") == 0);
  CHECK(sizeof(kvc_dtype) == 4 && sizeof(kvc_code) == 4);
  CHECK(kvc_last_error() != NULL);
}

/* SEMANTICS.md section 4, SWA window 1: the mask and the recycled cells. */
static void TestSlidingWindowWorkedExample(void) {
  kvc_cache* c = kvc_swa_new(1, NULL);
  CHECK(c != NULL);
  CHECK_OK(kvc_init(c, KVC_F32, 1, 16, 16));
  const int32_t pos1[4] = {0, 1, 2, 3}, seq1[4] = {0, 0, 0, 0};
  float v1[4] = {1, 2, 3, 4};
  CHECK_OK(Forward(c, pos1, seq1, 4));
  kvc_set_layer(c, 0);
  CHECK_OK(PutValues(c, v1, 4));
  kvc_history h;
  char mask[64];
  CHECK_OK(kvc_get(c, &h));
  CHECK(h.k.ne[2] == 4 && h.mask.ne[0] == 4 && h.mask.ne[1] == 4);
  CHECK(h.v_layout == KVC_V_PLAIN);
  MaskString(&h, mask);
  CHECK(strcmp(mask, "0xxx/00xx/x00x/xx00") == 0);

  const int32_t pos2[2] = {4, 5}, seq2[2] = {0, 0};
  float v2[2] = {5, 6};
  CHECK_OK(Forward(c, pos2, seq2, 2));
  kvc_set_layer(c, 0);
  CHECK_OK(PutValues(c, v2, 2));
  CHECK_OK(kvc_get(c, &h));
  CHECK(h.k.ne[2] == 4);
  CHECK(K0(&h, 0) == 5 && K0(&h, 1) == 6 && K0(&h, 2) == 3 && K0(&h, 3) == 4);
  MaskString(&h, mask);
  CHECK(strcmp(mask, "0xx0/00xx") == 0);
  kvc_cache_free(c);
}

/* SEMANTICS.md section 4, chunk 2. */
static void TestChunkedWorkedExample(void) {
  kvc_cache* c = kvc_chunked_new(2, NULL);
  CHECK_OK(kvc_init(c, KVC_F32, 1, 16, 16));
  const int32_t pos[4] = {0, 1, 2, 3}, seq[4] = {0, 0, 0, 0};
  CHECK_OK(Forward(c, pos, seq, 4));
  kvc_history h;
  char mask[64];
  CHECK_OK(kvc_get(c, &h));
  MaskString(&h, mask);
  CHECK(strcmp(mask, "0xxx/00xx/xx0x/xx00") == 0);
  kvc_cache_free(c);
}

/* A failing call returns its code and a message and changes nothing. */
static void TestErrorsChangeNothing(void) {
  kvc_cache* c = kvc_causal_new(NULL);
  kvc_config cfg = kvc_config_default();
  CHECK(cfg.padding == 1 && cfg.permuted_v == 0 && cfg.mask_dtype == KVC_F32);
  cfg.padding = 4;
  CHECK_OK(kvc_set_config(c, &cfg));
  CHECK_OK(kvc_init(c, KVC_F16, 2, 4, 2));  /* 8 cells */
  CHECK(kvc_set_config(c, &cfg) != KVC_OK); /* after Init */
  const int32_t pos[2] = {0, 1}, seq[2] = {0, 0};
  CHECK_OK(Forward(c, pos, seq, 2));
  kvc_history before, after;
  CHECK_OK(kvc_get(c, &before));

  const int32_t bad_seq[1] = {7}, one_pos[1] = {2};
  CHECK(Forward(c, one_pos, bad_seq, 1) == KVC_INVALID_ARGUMENT);
  CHECK(strlen(kvc_last_error()) > 0);
  CHECK(kvc_start_forward(c, NULL, NULL, 1, NULL, 0, 0) == KVC_INVALID_ARGUMENT);
  const int32_t pos3[3] = {2, 3, 4}, seq3[3] = {0, 0, 0};
  CHECK(Forward(c, pos3, seq3, 3) == KVC_INVALID_ARGUMENT); /* above max_batch */
  CHECK(kvc_set_layer_type(c, 0) == KVC_NOT_SUPPORTED);
  CHECK(kvc_encoder_cached(c) == -1);
  CHECK_OK(kvc_get(c, &after));
  CHECK(after.mask.ne[0] == before.mask.ne[0] && after.mask.ne[1] == before.mask.ne[1]);
  CHECK(after.mask.ne[0] == 4 && after.mask.ne[1] == 2); /* cells 0..1 padded to 0..3 */
  CHECK(after.k.data == NULL);                           /* no Put yet: no storage */
  CHECK(kvc_can_resume(c, 0, 2) == 1);

  /* Fill both sequences' worth of cells, then one more token than fits. */
  const int32_t p2[2] = {2, 3}, s0[2] = {0, 0}, p4[2] = {0, 1}, s1[2] = {1, 1};
  CHECK_OK(Forward(c, p2, s0, 2));
  CHECK_OK(Forward(c, p4, s1, 2));
  const int32_t p5[2] = {2, 3};
  CHECK_OK(Forward(c, p5, s1, 2));
  const int32_t p6[1] = {4};
  CHECK(Forward(c, p6, s1, 1) == KVC_CACHE_FULL);
  CHECK(strlen(kvc_last_error()) > 0);
  kvc_cache_free(c);

  kvc_cache* neg = kvc_swa_new(-1, NULL);
  CHECK(neg != NULL);
  CHECK(kvc_init(neg, KVC_F32, 1, 8, 1) == KVC_INVALID_ARGUMENT);
  kvc_cache_free(neg);
}

typedef struct ShiftLog {
  int calls;
  int64_t rows;
  int32_t deltas[16];
} ShiftLog;

static kvc_code RecordShift(void* user, int layer, kvc_tensor key, const int32_t* shift,
                            int64_t n) {
  ShiftLog* log = (ShiftLog*)user;
  (void)layer;
  ++log->calls;
  if (key.ne[2] != n) return KVC_INVALID_ARGUMENT;
  for (int64_t i = 0; i < n && log->rows < 16; ++i) log->deltas[log->rows++] = shift[i];
  return KVC_OK;
}

static kvc_code RefuseShift(void* user, int layer, kvc_tensor key, const int32_t* shift,
                            int64_t n) {
  (void)user, (void)layer, (void)key, (void)shift, (void)n;
  return KVC_NOT_SUPPORTED;
}

static kvc_code StrangeShift(void* user, int layer, kvc_tensor key, const int32_t* shift,
                             int64_t n) {
  (void)user, (void)layer, (void)key, (void)shift, (void)n;
  return (kvc_code)42;
}

/* A causal cache with `shift` holding positions 0..5 of sequence 0 (values 10..15). */
static kvc_cache* NewCausalWithSixTokens(const kvc_shift* shift) {
  const int32_t pos[6] = {0, 1, 2, 3, 4, 5}, seq[6] = {0, 0, 0, 0, 0, 0};
  float vals[6] = {10, 11, 12, 13, 14, 15};
  kvc_cache* c = kvc_causal_new(shift);
  CHECK_OK(kvc_init(c, KVC_F32, 1, 16, 8));
  CHECK_OK(Forward(c, pos, seq, 6));
  kvc_set_layer(c, 0);
  CHECK_OK(PutValues(c, vals, 6));
  return c;
}

/* SEMANTICS.md section 8 through a C callback: later tokens move down, deltas reported. */
static void TestRemoveShiftsThroughTheCallback(void) {
  ShiftLog log;
  memset(&log, 0, sizeof(log));
  kvc_shift shift;
  memset(&shift, 0, sizeof(shift));
  shift.fn = RecordShift;
  shift.user = &log;
  kvc_cache* c = NewCausalWithSixTokens(&shift);
  CHECK_OK(kvc_remove(c, 0, 1, 3));
  CHECK(log.calls == 1);
  /* Cells 3, 4, 5 (positions 3..5) each move by -2; rows of cells that stay keep delta 0 or are
   * not passed at all. */
  int moved = 0;
  for (int64_t i = 0; i < log.rows; ++i) moved += log.deltas[i] == -2;
  CHECK(moved == 3);
  CHECK(kvc_can_resume(c, 0, 4) == 1);

  /* A failing callback: kvc_remove returns its code and nothing changes. */
  shift.fn = RefuseShift;
  kvc_cache* r = NewCausalWithSixTokens(&shift);
  CHECK(kvc_remove(r, 0, 1, 3) == KVC_NOT_SUPPORTED);
  CHECK(strstr(kvc_last_error(), "callback") != NULL);
  /* A code the library does not know: an invalid argument, said so. */
  shift.fn = StrangeShift;
  kvc_cache* s = NewCausalWithSixTokens(&shift);
  CHECK(kvc_remove(s, 0, 1, 3) == KVC_INVALID_ARGUMENT);
  CHECK(strstr(kvc_last_error(), "unknown code 42") != NULL);
  CHECK(strcmp(kvc_code_name((kvc_code)42), "unknown") == 0);
  kvc_cache_free(s);

  /* No shift at all: a remove that must shift is not supported. */
  kvc_cache* n = NewCausalWithSixTokens(NULL);
  CHECK(kvc_remove(n, 0, 1, 3) == KVC_NOT_SUPPORTED);
  CHECK_OK(kvc_remove(n, 0, 4, KVC_POS_MAX)); /* to the end: no shift */
  CHECK(kvc_can_resume(n, 0, 4) == 1);
  kvc_cache_free(c);
  kvc_cache_free(r);
  kvc_cache_free(n);
}

/* Attention over a causal history against a plain softmax, and on two threads. */
static void TestAttention(void) {
  enum { kD = 32, kHeads = 2, kTokens = 5 };
  kvc_cache* c = kvc_causal_new(NULL);
  CHECK_OK(kvc_init(c, KVC_F32, 1, 16, 8));
  int32_t pos[kTokens], seq[kTokens];
  float k[kTokens * kHeads * kD], v[kTokens * kHeads * kD];
  for (int i = 0; i < kTokens; ++i) pos[i] = i, seq[i] = 0;
  for (int i = 0; i < kTokens * kHeads * kD; ++i) {
    k[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    v[i] = (float)((i * 11) % 13) / 13.0f - 0.5f;
  }
  CHECK_OK(Forward(c, pos, seq, kTokens));
  kvc_set_layer(c, 0);
  const int64_t kv_ne[3] = {kD, kHeads, kTokens};
  const kvc_tensor kt = kvc_make_tensor(k, KVC_F32, 3, kv_ne);
  const kvc_tensor vt = kvc_make_tensor(v, KVC_F32, 3, kv_ne);
  CHECK_OK(kvc_put(c, &kt, &vt));
  kvc_history h;
  CHECK_OK(kvc_get(c, &h));

  float q[kD * kTokens * kHeads], out[kD * kTokens * kHeads], out2[kD * kTokens * kHeads];
  for (int i = 0; i < kD * kTokens * kHeads; ++i) q[i] = (float)((i * 5) % 7) / 7.0f - 0.4f;
  const int64_t q_ne[3] = {kD, kTokens, kHeads};
  const kvc_tensor qt = kvc_make_tensor(q, KVC_F32, 3, q_ne);
  kvc_tensor ot = kvc_make_tensor(out, KVC_F32, 3, q_ne);
  CHECK_OK(kvc_attend(&qt, &h, NULL, &ot, NULL));

  /* Reference: token i (position i) sees tokens 0..i of its head. */
  double worst = 0;
  for (int hd = 0; hd < kHeads; ++hd) {
    for (int i = 0; i < kTokens; ++i) {
      const float* qi = q + (hd * kTokens + i) * kD;
      double logits[kTokens], m = -1e300, l = 0;
      for (int j = 0; j <= i; ++j) {
        double dot = 0;
        for (int d = 0; d < kD; ++d) dot += (double)qi[d] * k[(j * kHeads + hd) * kD + d];
        logits[j] = dot / sqrt((double)kD);
        if (logits[j] > m) m = logits[j];
      }
      for (int j = 0; j <= i; ++j) l += exp(logits[j] - m);
      for (int d = 0; d < kD; ++d) {
        double o = 0;
        for (int j = 0; j <= i; ++j) o += exp(logits[j] - m) / l * v[(j * kHeads + hd) * kD + d];
        const double err = fabs(o - out[(hd * kTokens + i) * kD + d]);
        if (err > worst) worst = err;
      }
    }
  }
  CHECK(worst < 1e-5);

  kvc_thread_pool* pool = kvc_thread_pool_new(2);
  kvc_tensor ot2 = kvc_make_tensor(out2, KVC_F32, 3, q_ne);
  kvc_attention_params p = kvc_attention_params_default();
  CHECK(p.scale == 0 && p.softcap == 0 && p.sinks == NULL && p.integer_v == 0 && p.integer_k == 0);
  CHECK_OK(kvc_attend(&qt, &h, &p, &ot2, pool));
  CHECK(memcmp(out, out2, sizeof(out)) == 0);
  kvc_thread_pool_free(pool);

  /* A query of the wrong head_dim is rejected. */
  const int64_t bad_ne[3] = {kD - 1, kTokens, kHeads};
  const kvc_tensor bad = kvc_make_tensor(q, KVC_F32, 3, bad_ne);
  CHECK(kvc_attend(&bad, &h, NULL, &ot, NULL) == KVC_INVALID_ARGUMENT);
  kvc_cache_free(c);
}

/* A history built by hand with a kvc_mask_index of its own: the same output as without one, in
 * every layer of a pass, and after the mask is rewritten in place and the index invalidated, the
 * output of the new mask. */
static void TestHandBuiltMaskIndex(void) {
  enum { kD = 32, kHeads = 2, kCells = 150, kRows = 3 };
  static float k[kCells * kHeads * kD], v[kCells * kHeads * kD], mask[kCells * kRows];
  static float q[kD * kRows * kHeads], plain[kD * kRows * kHeads], indexed[kD * kRows * kHeads];
  static float first[kD * kRows * kHeads];
  for (int i = 0; i < kCells * kHeads * kD; ++i) {
    k[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    v[i] = (float)((i * 11) % 13) / 13.0f - 0.5f;
  }
  for (int i = 0; i < kD * kRows * kHeads; ++i) q[i] = (float)((i * 5) % 7) / 7.0f - 0.4f;
  /* Row b sees the cells j with (j + b) % 3 != 0. */
  for (int i = 0; i < kCells * kRows; ++i)
    mask[i] = (i % kCells + i / kCells) % 3 == 0 ? -INFINITY : 0;
  const int64_t kv_ne[3] = {kD, kHeads, kCells}, mask_ne[2] = {kCells, kRows};
  const int64_t q_ne[3] = {kD, kRows, kHeads};
  kvc_history h;
  h.k = kvc_make_tensor(k, KVC_F32, 3, kv_ne);
  h.v = kvc_make_tensor(v, KVC_F32, 3, kv_ne);
  h.mask = kvc_make_tensor(mask, KVC_F32, 2, mask_ne);
  h.mask_index = NULL;
  h.v_layout = KVC_V_AUTO;
  kvc_history hi = h;
  kvc_mask_index* index = kvc_mask_index_new(kCells, kRows);
  CHECK(index != NULL);
  hi.mask_index = index;
  const kvc_tensor qt = kvc_make_tensor(q, KVC_F32, 3, q_ne);
  kvc_tensor pt = kvc_make_tensor(plain, KVC_F32, 3, q_ne);
  kvc_tensor it = kvc_make_tensor(indexed, KVC_F32, 3, q_ne);
  CHECK_OK(kvc_attend(&qt, &h, NULL, &pt, NULL));
  memcpy(first, plain, sizeof(first));
  /* Code written before v_layout existed leaves it indeterminate: a value that is not a layout,
   * or a layout v's shape does not fit ([kD, kHeads, kCells] is not [L, Dv, Hkv]), reads as
   * KVC_V_AUTO. */
  for (int value = 0; value < 3; ++value) {
    kvc_history stale = h;
    stale.v_layout = value == 0 ? 77 : value == 1 ? KVC_V_PERMUTED : KVC_V_PLAIN;
    memset(indexed, 0, sizeof(indexed));
    kvc_tensor st = kvc_make_tensor(indexed, KVC_F32, 3, q_ne);
    CHECK_OK(kvc_attend(&qt, &stale, NULL, &st, NULL));
    CHECK(memcmp(indexed, plain, sizeof(plain)) == 0);
  }
  for (int layer = 0; layer < 3; ++layer) {
    memset(indexed, 0, sizeof(indexed));
    CHECK_OK(kvc_attend(&qt, &hi, NULL, &it, NULL));
    CHECK(memcmp(indexed, plain, sizeof(plain)) == 0);
  }
  /* The same buffer, another mask (salt 1): once invalidated, the index describes it. */
  for (int i = 0; i < kCells * kRows; ++i) {
    mask[i] = (i % kCells + i / kCells + 1) % 3 == 0 ? -INFINITY : 0;
  }
  kvc_mask_index_invalidate(index, NULL);
  CHECK_OK(kvc_attend(&qt, &h, NULL, &pt, NULL));
  CHECK(memcmp(first, plain, sizeof(plain)) != 0);
  CHECK_OK(kvc_attend(&qt, &hi, NULL, &it, NULL));
  CHECK(memcmp(indexed, plain, sizeof(plain)) == 0);
  /* Naming the whole mask, then the rows in two calls (row 0, rows 1-2): the same rows out. */
  kvc_mask_index_invalidate(index, &h.mask);
  memset(indexed, 0, sizeof(indexed));
  for (int part = 0; part < 2; ++part) {
    const int64_t r0 = part == 0 ? 0 : 1, n = part == 0 ? 1 : kRows - 1;
    kvc_history rows = hi;
    rows.mask.data = mask + r0 * kCells;
    rows.mask.ne[1] = n;
    kvc_tensor qr = qt, orows = it;
    qr.data = q + r0 * kD;
    orows.data = indexed + r0 * kD;
    qr.ne[1] = orows.ne[1] = n;
    CHECK_OK(kvc_attend(&qr, &rows, NULL, &orows, NULL));
  }
  CHECK(memcmp(indexed, plain, sizeof(plain)) == 0);
  kvc_mask_index_free(index);

  CHECK(kvc_mask_index_new(0, 1) == NULL && strlen(kvc_last_error()) > 0);
  CHECK(kvc_mask_index_new(1, -1) == NULL);
  CHECK(kvc_mask_index_new(INT64_MAX, INT64_MAX) == NULL);
  CHECK(kvc_mask_index_new((int64_t)1 << 40, (int64_t)1 << 20) == NULL);
  kvc_mask_index_invalidate(NULL, NULL);
  kvc_mask_index_free(NULL);
}

/* The rotating cache keeps its sink and the newest tokens, in temporal order. */
static void TestRotatingCache(void) {
  kvc_seq_cache* c = kvc_rotating_cache_new(4, 1, KVC_F32);
  CHECK(c != NULL);
  for (int t = 0; t < 6; ++t) {
    float x = (float)t;
    const int64_t ne[4] = {1, 1, 1, 1};
    const kvc_tensor in = kvc_make_tensor(&x, KVC_F32, 4, ne);
    kvc_tensor ko, vo;
    CHECK_OK(kvc_seq_update(c, &in, &in, 1, &ko, &vo));
    if (t == 5) {
      CHECK(ko.ne[1] == 4);
      const float expect[4] = {0, 3, 4, 5};
      for (int i = 0; i < 4; ++i) {
        CHECK(*(const float*)((const char*)ko.data + (size_t)i * ko.nb[1]) == expect[i]);
      }
    }
  }
  CHECK(kvc_seq_offset(c) == 6 && kvc_seq_len(c) == 4);

  size_t size = 0;
  CHECK_OK(kvc_seq_save(c, NULL, 0, &size));
  unsigned char* bytes = (unsigned char*)malloc(size);
  CHECK_OK(kvc_seq_save(c, bytes, size, &size));
  kvc_seq_cache* d = kvc_rotating_cache_new(4, 1, KVC_F32);
  CHECK_OK(kvc_seq_load(d, bytes, size));
  CHECK(kvc_seq_offset(d) == 6 && kvc_seq_len(d) == 4);
  free(bytes);
  kvc_seq_reset(c);
  CHECK(kvc_seq_offset(c) == 0 && kvc_seq_len(c) == 0);

  kvc_seq_cache* bad = kvc_rotating_cache_new(2, 2, KVC_F32); /* nothing could be evicted */
  float x = 1;
  const int64_t ne[4] = {1, 1, 1, 1};
  const kvc_tensor in = kvc_make_tensor(&x, KVC_F32, 4, ne);
  kvc_tensor ko, vo;
  CHECK(kvc_seq_update(bad, &in, &in, 1, &ko, &vo) == KVC_INVALID_ARGUMENT);
  kvc_seq_cache_free(bad);
  kvc_seq_cache_free(c);
  kvc_seq_cache_free(d);
}

/* Save, load into a fresh cache, compare; a damaged stream is refused and changes nothing. */
static void TestSaveLoad(void) {
  kvc_cache* c = kvc_causal_new(NULL);
  CHECK_OK(kvc_init(c, KVC_Q8_0, 2, 8, 4));
  const int32_t pos[3] = {0, 1, 0}, seq[3] = {0, 0, 1};
  float k[3 * 32];
  for (int i = 0; i < 3 * 32; ++i) k[i] = (float)(i % 9) - 4.0f;
  CHECK_OK(Forward(c, pos, seq, 3));
  kvc_set_layer(c, 0);
  const int64_t ne[3] = {32, 1, 3};
  const kvc_tensor t = kvc_make_tensor(k, KVC_F32, 3, ne);
  CHECK_OK(kvc_put(c, &t, &t));

  size_t size = 0;
  CHECK_OK(kvc_save(c, -1, NULL, 0, &size));
  CHECK(size > 0);
  unsigned char* bytes = (unsigned char*)malloc(size);
  size_t small = 0;
  CHECK(kvc_save(c, -1, bytes, size - 1, &small) == KVC_INVALID_ARGUMENT && small == size);
  CHECK_OK(kvc_save(c, -1, bytes, size, &size));

  kvc_cache* d = kvc_causal_new(NULL);
  CHECK_OK(kvc_init(d, KVC_Q8_0, 2, 8, 4));
  CHECK_OK(kvc_load(d, bytes, size, -1));
  CHECK(kvc_can_resume(d, 1, 1) == 1);
  const int32_t next_pos[1] = {2}, next_seq[1] = {0};
  CHECK_OK(Forward(c, next_pos, next_seq, 1));
  CHECK_OK(Forward(d, next_pos, next_seq, 1));
  kvc_history hc, hd;
  kvc_set_layer(c, 0);
  kvc_set_layer(d, 0);
  CHECK_OK(kvc_get(c, &hc));
  CHECK_OK(kvc_get(d, &hd));
  CHECK(hc.k.ne[2] == hd.k.ne[2] && hc.k.ne[2] == 4);
  for (int64_t j = 0; j < 3; ++j) { /* the three stored rows, byte for byte */
    CHECK(memcmp((const char*)hc.k.data + (size_t)j * hc.k.nb[2],
                 (const char*)hd.k.data + (size_t)j * hd.k.nb[2], 34) == 0);
  }

  /* One flipped byte: kCorrupt, and the target's stream is what it was. */
  kvc_cache* e = kvc_causal_new(NULL);
  CHECK_OK(kvc_init(e, KVC_Q8_0, 2, 8, 4));
  size_t empty_size = 0;
  CHECK_OK(kvc_save(e, -1, NULL, 0, &empty_size));
  unsigned char* empty_before = (unsigned char*)malloc(empty_size);
  CHECK_OK(kvc_save(e, -1, empty_before, empty_size, &empty_size));
  bytes[size / 2] ^= 0x10;
  CHECK(kvc_load(e, bytes, size, -1) == KVC_CORRUPT);
  CHECK(strlen(kvc_last_error()) > 0);
  size_t after_size = 0;
  CHECK_OK(kvc_save(e, -1, NULL, 0, &after_size));
  CHECK(after_size == empty_size);
  unsigned char* empty_after = (unsigned char*)malloc(after_size);
  CHECK_OK(kvc_save(e, -1, empty_after, after_size, &after_size));
  CHECK(memcmp(empty_before, empty_after, empty_size) == 0);
  free(empty_before);
  free(empty_after);
  free(bytes);
  kvc_cache_free(c);
  kvc_cache_free(d);
  kvc_cache_free(e);
}

/* A wrapper of SWA + causal, and an encoder. */
static void TestWrapperAndEncoder(void) {
  kvc_cache* children[2] = {kvc_swa_new(2, NULL), kvc_causal_new(NULL)};
  kvc_cache* with_null[2] = {children[0], NULL};
  CHECK(kvc_wrapper_new(with_null, 2) == NULL); /* children untouched */
  kvc_cache* twice[2] = {children[0], children[0]};
  CHECK(kvc_wrapper_new(twice, 2) == NULL);
  kvc_cache* w = kvc_wrapper_new(children, 2);
  CHECK(w != NULL);
  CHECK_OK(kvc_init(w, KVC_F32, 1, 16, 8));
  const int32_t pos[6] = {0, 1, 2, 3, 4, 5}, seq[6] = {0, 0, 0, 0, 0, 0};
  float vals[6] = {1, 2, 3, 4, 5, 6};
  CHECK_OK(Forward(w, pos, seq, 6));
  kvc_history h;
  for (int type = 0; type < 2; ++type) {
    CHECK_OK(kvc_set_layer_type(w, type));
    kvc_set_layer(w, 0);
    CHECK_OK(PutValues(w, vals, 6));
    CHECK_OK(kvc_get(w, &h));
    /* The last token sees 3 keys through the window of 2 (as Ollama), all 6 without it. */
    int visible = 0;
    for (int64_t j = 0; j < h.mask.ne[0]; ++j) visible += Visible(&h, 5, j);
    CHECK(visible == (type == 0 ? 3 : 6));
  }
  CHECK(kvc_set_causal(w, NULL, 0) == KVC_NOT_SUPPORTED);
  CHECK(kvc_memory_bytes(w) > 0);
  /* The children's handles stay valid inside the wrapper, for the calls of their kind. */
  CHECK(kvc_wrapper_child(w, 0) == children[0]);
  CHECK(kvc_wrapper_child(w, 1) == children[1]);
  CHECK(kvc_wrapper_child(w, 2) == NULL);
  CHECK(kvc_wrapper_child(w, -1) == NULL);
  CHECK(kvc_wrapper_child(children[1], 0) == NULL);
  kvc_cache* rewrap[1] = {children[1]};
  CHECK(kvc_wrapper_new(rewrap, 1) == NULL); /* already a wrapper's child */
  kvc_cache_free(children[1]);               /* ignored: the wrapper frees it */
  /* SetCausal on the causal child: batch row 2 (position 2) now sees positions 3..5 too. */
  const int32_t except[1] = {2};
  CHECK_OK(kvc_set_causal(children[1], except, 1));
  CHECK_OK(kvc_set_layer_type(w, 1));
  CHECK_OK(kvc_get(w, &h));
  int row2 = 0;
  for (int64_t j = 0; j < h.mask.ne[0]; ++j) row2 += Visible(&h, 2, j);
  CHECK(row2 == 6);
  CHECK_OK(kvc_get(children[1], &h)); /* the same history through the child */
  row2 = 0;
  for (int64_t j = 0; j < h.mask.ne[0]; ++j) row2 += Visible(&h, 2, j);
  CHECK(row2 == 6);
  CHECK(kvc_reserve_layers(children[1], 2, 1, 1, 1) == KVC_OK);
  kvc_cache_free(w);

  kvc_cache* e = kvc_encoder_new();
  CHECK_OK(kvc_init(e, KVC_F32, 1, 16, 4));
  CHECK(kvc_encoder_cached(e) == 0);
  const int32_t mm[1] = {0}, epos[1] = {3}, eseq[1] = {0};
  CHECK_OK(kvc_start_forward(e, epos, eseq, 1, mm, 1, 0));
  kvc_set_layer(e, 0);
  float enc[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const int64_t ne[3] = {4, 1, 2};
  const kvc_tensor t = kvc_make_tensor(enc, KVC_F32, 3, ne);
  CHECK_OK(kvc_put(e, &t, &t));
  CHECK(kvc_encoder_cached(e) == 1);
  CHECK(kvc_copy_prefix(e, 0, 0, 1) == KVC_NOT_SUPPORTED);
  CHECK_OK(kvc_remove(e, 0, 3, KVC_POS_MAX));
  CHECK(kvc_encoder_cached(e) == 0);
  kvc_cache_free(e);

  /* Per sequence: a batch mixing two sequences is refused; each sequence has its own block. */
  kvc_cache* ps = kvc_encoder_new_per_sequence(1);
  CHECK_OK(kvc_init(ps, KVC_F32, 2, 16, 4));
  const int32_t two_pos[2] = {0, 0}, two_seq[2] = {0, 1};
  CHECK(kvc_start_forward(ps, two_pos, two_seq, 2, NULL, 0, 0) == KVC_INVALID_ARGUMENT);
  CHECK_OK(kvc_start_forward(ps, epos, eseq, 1, mm, 1, 0));
  kvc_set_layer(ps, 0);
  CHECK_OK(kvc_put(ps, &t, &t));
  CHECK(kvc_encoder_cached(ps) == 1);
  const int32_t seq1[1] = {1};
  CHECK_OK(kvc_start_forward(ps, epos, seq1, 1, NULL, 0, 0));
  CHECK(kvc_encoder_cached(ps) == 0); /* sequence 1 has none yet */
  kvc_cache_free(ps);
}

int main(void) {
  TestNames();
  TestSlidingWindowWorkedExample();
  TestChunkedWorkedExample();
  TestErrorsChangeNothing();
  TestRemoveShiftsThroughTheCallback();
  TestAttention();
  TestHandBuiltMaskIndex();
  TestRotatingCache();
  TestSaveLoad();
  TestWrapperAndEncoder();
  kvc_cache_free(NULL);
  kvc_seq_cache_free(NULL);
  kvc_thread_pool_free(NULL);
  if (g_failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("c_api_c_test: all checks passed\n");
  return 0;
}
