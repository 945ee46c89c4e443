/* C consumer of the packaging tests (in tests/cmake): the C ABI (veloxquant/veloxquant.h) the
 * way a C engine uses it: a two-layer SqueezeAttention set, a prefill and a decode step through
 * vq_attend, and one refused call. Exits nonzero on any mismatch. */
#include <stdio.h>
#include <string.h>
#include <veloxquant/veloxquant.h>

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "consumer.c:%d: %s (%s)\n", __LINE__, #cond, vq_last_error()); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

enum { kLayers = 2, kHq = 4, kH = 2, kS = 8, kD = 8, kN = kHq * kS * kD };

int main(void) {
  static float q[kN], k[kN / 2], v[kN / 2], out[kN];
  vq_config* cfg = vq_config_new();
  vq_caches* set = NULL;
  int i, layer;
  for (i = 0; i < kN; ++i) q[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
  for (i = 0; i < kN / 2; ++i) {
    k[i] = (float)((i * 5) % 11) / 11.0f - 0.5f;
    v[i] = (float)((i * 3) % 7) / 7.0f;
  }
  CHECK(vq_abi_version() / 1000 == VQ_ABI_VERSION_MAJOR);
  CHECK(cfg != NULL);
  CHECK(vq_config_set(cfg, "budget", "6") == VQ_OK);
  CHECK(vq_config_set(cfg, "squeeze_n_sink", "1") == VQ_OK);
  CHECK(vq_config_set(cfg, "no_such_field", "1") == VQ_EINVAL);
  CHECK(strstr(vq_last_error(), "no_such_field") != NULL);
  CHECK(vq_caches_new(cfg, kLayers, VQ_HALF, &set) == VQ_OK);
  for (layer = 0; layer < kLayers; ++layer) {
    CHECK(vq_attend(set, layer, q, k, v, out, 1, kHq, kH, kS, kD, VQ_TOKEN_MAJOR) == VQ_OK);
    CHECK(vq_attend(set, layer, q, k, v, out, 1, kHq, kH, 1, kD, VQ_TOKEN_MAJOR) == VQ_OK);
    CHECK(vq_offset(set, layer) == kS + 1);
    CHECK(vq_rows(set, layer) <= kS + 1);
  }
  CHECK(vq_attend(set, kLayers, q, k, v, out, 1, kHq, kH, 1, kD, VQ_TOKEN_MAJOR) == VQ_EINVAL);
  CHECK(vq_kept_bytes(set) > 0);
  vq_caches_free(set);
  vq_config_free(cfg);
  printf("veloxquant C consumer: ok (ABI %d)\n", vq_abi_version());
  return 0;
}
