/* Compile-time probe (scripts/compile_time.sh): the same engine work as builder.cpp through the C
 * ABI, a C99 TU (veloxquant/veloxquant.h), compiled with the C compiler. */
#include <stdio.h>
#include <veloxquant/veloxquant.h>

enum { kHq = 16, kH = 8, kS = 16, kD = 64 };

int main(void) {
  static float q[kHq * kS * kD], k[kH * kS * kD], v[kH * kS * kD], out[kHq * kS * kD];
  vq_config* cfg = vq_config_new();
  vq_caches* caches = NULL;
  int i, layer;
  for (i = 0; i < kHq * kS * kD; ++i) q[i] = 0.1f;
  for (i = 0; i < kH * kS * kD; ++i) {
    k[i] = 0.5f;
    v[i] = 0.25f;
  }
  if (vq_config_set(cfg, "budget", "64") != VQ_OK ||
      vq_caches_new(cfg, 4, VQ_HALF, &caches) != VQ_OK) {
    fprintf(stderr, "%s\n", vq_last_error());
    return 1;
  }
  for (layer = 0; layer < 4; ++layer) {
    if (vq_attend(caches, layer, q, k, v, out, 1, kHq, kH, kS, kD, VQ_HEAD_MAJOR) != VQ_OK) {
      fprintf(stderr, "%s\n", vq_last_error());
      return 1;
    }
  }
  printf("%lld %g\n", (long long)vq_offset(caches, 0), (double)out[0]);
  vq_reset(caches);
  vq_caches_free(caches);
  vq_config_free(cfg);
  return 0;
}
