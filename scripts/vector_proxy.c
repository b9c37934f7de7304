/* The speed proxy for the ARM kernels (issue 18): the vector-extension unit,
 * built for 256-bit vectors (scripts/vector_proxy.py builds this program), against
 * the hand-written AVX2 unit on the same tile, one thread, best of several
 * interleaved runs. Prints each kernel's GFLOP/s and vector / avx2. */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "fusedmlp/cpu.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float *filled(int64_t n, unsigned seed) {
  float *p = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
  }
  return p;
}

enum { DIM = 768, HIDDEN = 3072, REPEATS = 5 };

/* Seconds for one call: Linear + GELU(tanh), rows x DIM -> HIDDEN, or the GeGLU
 * block rows x DIM -> HIDDEN -> DIM. */
static double run_once(int gated, int64_t rows, const float *x, const float *w[3],
                       const float *b[3], float *y) {
  const double start = now();
  fmlp_status status;
  if (gated) {
    const fmlp_cpu_gated_args args = {
        .dtype = FMLP_F32, .rows = rows, .dim = DIM, .hidden = HIDDEN, .out_dim = DIM,
        .x = {x, DIM, 1}, .w_gate = {w[0], DIM, 1}, .w_up = {w[1], DIM, 1},
        .w_down = {w[2], HIDDEN, 1}, .bias_gate = b[0], .bias_up = b[1], .bias_down = b[2],
        .activation = FMLP_ACT_GELU_TANH, .y = y, .y_row_stride = DIM};
    status = fmlp_cpu_gated(&args, NULL);
  } else {
    const int64_t widths[2] = {DIM, HIDDEN};
    const fmlp_input weight = {w[0], DIM, 1};
    const void *bias = b[0];
    const fmlp_cpu_chain_args args = {
        .dtype = FMLP_F32, .rows = rows, .n_layers = 1, .widths = widths, .x = {x, DIM, 1},
        .weights = &weight, .biases = &bias, .hidden_activation = FMLP_ACT_GELU_TANH,
        .final_activation = FMLP_ACT_GELU_TANH, .y = y, .y_row_stride = HIDDEN};
    status = fmlp_cpu_chain(&args, NULL);
  }
  if (status != FMLP_OK) {
    fprintf(stderr, "kernel failed: %d\n", (int)status);
    exit(1);
  }
  return now() - start;
}

int main(void) {
  static const char *const isas[2] = {"avx2", "portable"};
  const int64_t rows = 1024;
  const float *x = filled(rows * DIM, 1);
  const float *w[3] = {filled(HIDDEN * DIM, 2), filled(HIDDEN * DIM, 3), filled(DIM * HIDDEN, 4)};
  const float *b[3] = {filled(HIDDEN, 5), filled(HIDDEN, 6), filled(DIM, 7)};
  float *y = malloc((size_t)(rows * HIDDEN) * sizeof(float));
  for (int gated = 0; gated < 2; ++gated) {
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < REPEATS; ++r) {
      for (int i = 0; i < 2; ++i) {
        setenv("FUSEDMLP_ISA", isas[i], 1);
        const double t = run_once(gated, rows, x, w, b, y);
        if (t < best[i]) best[i] = t;
      }
    }
    const double flops = 2.0 * (double)rows * DIM * HIDDEN * (gated ? 3 : 1);
    printf("%s %lld rows: avx2 %.1f GFLOP/s, portable (256-bit) %.1f GFLOP/s, portable / avx2 %.2f\n",
           gated ? "gated" : "linear", (long long)rows, flops / best[0] / 1e9,
           flops / best[1] / 1e9, best[0] / best[1]);
  }
  return 0;
}
