/* What the C timing harnesses (simd_efficiency.c, simd_ab.c, the AMX ones)
 * share: the calling thread's CPU time, and buffers of reproducible values
 * in float and bfloat16. */
#ifndef FUSEDMLP_SCRIPTS_HARNESS_H
#define FUSEDMLP_SCRIPTS_HARNESS_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "bf16.h"

/* The calling thread's CPU time in seconds: another process on the core
 * does not count, as wall time would. */
static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* n floats in [-0.5, 0.5) from a linear congruential sequence started at
 * seed, 64-byte aligned; exits when out of memory. */
static float *filled(int64_t n, unsigned seed) {
  float *p = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
  if (p == NULL) exit(1);
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
  }
  return p;
}

/* qsort's ascending order of doubles. */
static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* n bfloat16 values of reproducible noise (filled's, rounded to nearest even). */
static fmlp_bf16 *filled_bf16(int64_t n, unsigned seed) {
  float *f = filled(n, seed);
  fmlp_bf16 *out = aligned_alloc(64, (size_t)((n * 2 + 63) / 64 * 64));
  if (out == NULL) exit(1);
  for (int64_t i = 0; i < n; ++i) out[i] = fmlp_float_to_bf16(f[i]);
  free(f);
  return out;
}

#endif
