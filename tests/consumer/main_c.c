/* A C consumer of the installed package: only <kvcache/kvcache_c.h> and kvcache::kvcache. */
#include <kvcache/kvcache_c.h>
#include <stdio.h>

int main(void) {
  kvc_cache* cache = kvc_causal_new(NULL);
  if (cache == NULL || kvc_init(cache, KVC_Q8_0, 1, 16, 4) != KVC_OK) return 1;
  const int32_t positions[2] = {0, 1};
  const int32_t sequences[2] = {0, 0};
  if (kvc_start_forward(cache, positions, sequences, 2, NULL, 0, 0) != KVC_OK) return 2;
  float k[32 * 2 * 2], q[32 * 2 * 4], out[32 * 2 * 4];
  for (int i = 0; i < 32 * 2 * 2; ++i) k[i] = (float)(i % 7) - 3.0f;
  for (int i = 0; i < 32 * 2 * 4; ++i) q[i] = 0.1f;
  const int64_t kv_ne[3] = {32, 2, 2}, q_ne[3] = {32, 2, 4};
  const kvc_tensor kt = kvc_make_tensor(k, KVC_F32, 3, kv_ne);
  kvc_set_layer(cache, 0);
  if (kvc_put(cache, &kt, &kt) != KVC_OK) return 3;
  kvc_history h;
  if (kvc_get(cache, &h) != KVC_OK) return 4;
  const kvc_tensor qt = kvc_make_tensor(q, KVC_F32, 3, q_ne);
  kvc_tensor ot = kvc_make_tensor(out, KVC_F32, 3, q_ne);
  if (kvc_attend(&qt, &h, NULL, &ot, NULL) != KVC_OK) {
    printf("attend: %s\n", kvc_last_error());
    return 5;
  }
  printf("C: history cells %lld, out[0] %.4f\n", (long long)h.k.ne[2], out[0]);
  kvc_cache_free(cache);
  return h.k.ne[2] == 2 ? 0 : 6;
}
