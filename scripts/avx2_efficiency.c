/* Where the AVX2 float32 kernels lose to the FMA peak (issue 18): one thread's
 * CPU time (so other processes on the cores cost it little), best of REPEATS,
 * for the GeGLU block's parts, from the micro-kernel alone to the whole call:
 *
 *   micro-kernel  the gated and the linear micro-kernel over the same
 *                 input and weight panels again and again (in L1 up to kc
 *                 256, in L2 beyond), GELU(tanh) epilogue included
 *   gated rows    gate and up of a row block (gemm_gated_rows: packing the
 *                 input, the cache blocks, the micro-kernel, the epilogue)
 *   down rows     the down projection of a row block (gemm_rows)
 *   whole         fmlp_cpu_gated_f32_avx2, its weights packed in the call
 *
 * The peak: 12 independent ymm FMA chains, timed before each run.
 *
 * Built by scripts/avx2_efficiency.py: this file includes the AVX2 float32
 * unit itself, for its static parts, and is compiled with its flags. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels_f32_avx2.c"

enum { REPEATS = 11, DIM = 768, HIDDEN = 3072 };

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float *filled(int64_t n, unsigned seed) {
  float *p = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
  }
  return p;
}

/* GFLOP/s of 12 independent ymm FMA chains for `iters` steps. */
static double peak_gflops(long iters) {
  __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f), a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps((float)i);
  const double t0 = cpu_now();
  for (long n = 0; n < iters; ++n) {
    __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]));
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  }
  const double gflops = iters * 12.0 * 16 / (cpu_now() - t0) / 1e9;
  float sum[8];
  _mm256_storeu_ps(sum, a[0]);
  return sum[0] == 1.25f ? gflops + 1e-9 : gflops;
}

typedef struct {
  double seconds, gflops, fraction; /* of the peak timed just before */
} timing;

/* The best of REPEATS runs of fn(context), each against the FMA peak timed
 * right before it: the core's clock moves with the other processes' load. */
static timing best_of(void (*fn)(void *), void *context, double flops) {
  timing best = {0, 0, 0};
  for (int r = 0; r < REPEATS; ++r) {
    const double peak = peak_gflops(1000000);
    const double t0 = cpu_now();
    fn(context);
    const double t = cpu_now() - t0, gflops = flops / t / 1e9;
    if (gflops / peak > best.fraction) best = (timing){t, gflops, gflops / peak};
  }
  return best;
}

/* ---- the micro-kernels over panels in L1 ---- */

typedef struct {
  int64_t kc, calls;
  float *a, *b_gate, *b_up, *gate, *up, *product;
} micro_job;

/* Through pointers, so the compiler compiles the kernels as the GEMM loops call them. */
static void (*volatile gated_kernel)(int64_t, const REAL *, const REAL *, const REAL *, int64_t,
                                     int64_t, const FN(gated_tile_epilogue) *) =
    FN(microkernel_gated);
static void (*volatile linear_kernel)(int64_t, const REAL *, const REAL *, STORE *, int64_t,
                                      int64_t, int64_t, const FN(tile_epilogue) *) =
    FN(microkernel_packed);

static void gated_l1(void *context) {
  const micro_job *j = context;
  const FN(gated_tile_epilogue) ep = {.gate = j->gate, .up = j->up, .gate_up_stride = GEMM_NR,
                                      .product = j->product, .product_stride = GEMM_NR,
                                      .activation = FMLP_ACT_GELU_TANH, .first_k_block = 1,
                                      .last_k_block = 1};
  for (int64_t n = 0; n < j->calls; ++n) {
    for (int64_t j0 = 0; j0 < GEMM_NR; j0 += GATED_NR) {
      gated_kernel(j->kc, j->a, j->b_gate + j0, j->b_up + j0, GATED_MR, GATED_NR, &ep);
    }
  }
}

static void linear_l1(void *context) {
  const micro_job *j = context;
  const FN(tile_epilogue) ep = {.activation = FMLP_ACT_GELU_TANH, .first_k_block = 1,
                                .last_k_block = 1};
  for (int64_t n = 0; n < j->calls; ++n) {
    linear_kernel(j->kc, j->a, j->b_gate, j->product, GEMM_NR, GEMM_MR, GEMM_NR, &ep);
  }
}

/* ---- a row block's products over packed weights ---- */

typedef struct {
  int64_t rows;
  const float *x;
  FN(packed_weight) gate, up, down;
  float *gate_out, *up_out, *product, *y, *input_pack;
} block_job;

static void gated_rows(void *context) {
  block_job *j = context;
  FN(gemm_gated_rows)((fmlp_input){j->x, DIM, 1}, j->rows, &j->gate, &j->up, NULL, NULL,
                      FMLP_ACT_GELU_TANH, j->gate_out, j->up_out, j->product, HIDDEN, 0,
                      j->input_pack);
}

static void down_rows(void *context) {
  block_job *j = context;
  FN(gemm_rows)((fmlp_input){j->product, HIDDEN, 1}, j->rows, &j->down, NULL, FMLP_ACT_NONE,
                j->y, DIM, NULL, 0, j->input_pack);
}

typedef struct {
  fmlp_cpu_gated_args args;
} whole_job;

static void whole(void *context) {
  whole_job *j = context;
  if (FN(fmlp_cpu_gated)(&j->args, NULL) != FMLP_OK) exit(1);
}

static void report(const char *what, void (*fn)(void *), void *context, double flops) {
  const timing t = best_of(fn, context, flops);
  printf("%-34s %8.3f ms %7.1f GFLOP/s %5.1f%% of peak\n", what, t.seconds * 1e3, t.gflops,
         100 * t.fraction);
}

int main(int argc, char **argv) {
  const int64_t block = argc > 1 ? atoll(argv[1]) : 120, rows = argc > 2 ? atoll(argv[2]) : 1024;
  const char *parts = argc > 3 ? argv[3] : "micro,rows,whole"; /* which parts to time */
  printf("one thread, AVX2 FMA peak ~%.1f GFLOP/s; row block %lld, whole call %lld rows\n",
         peak_gflops(20000000), (long long)block, (long long)rows);

  static const int64_t kcs[] = {128, 256, 512, 768};
  for (size_t i = 0; i < sizeof kcs / sizeof kcs[0] && strstr(parts, "micro"); ++i) {
    const int64_t kc = kcs[i];
    micro_job m = {.kc = kc, .calls = 40000 * 128 / kc, .a = filled(GEMM_MR * kc, 1),
                   .b_gate = filled(GEMM_NR * kc, 2), .b_up = filled(GEMM_NR * kc, 3),
                   .gate = filled(GEMM_MR * GEMM_NR, 4), .up = filled(GEMM_MR * GEMM_NR, 5),
                   .product = filled(GEMM_MR * GEMM_NR, 6)};
    char what[64];
    snprintf(what, sizeof what, "gated micro-kernel, kc %lld", (long long)kc);
    report(what, gated_l1, &m, 2.0 * 2 * GEMM_MR * GEMM_NR * kc * m.calls);
    snprintf(what, sizeof what, "linear micro-kernel, kc %lld", (long long)kc);
    report(what, linear_l1, &m, 2.0 * GEMM_MR * GEMM_NR * kc * m.calls);
    free(m.a), free(m.b_gate), free(m.b_up), free(m.gate), free(m.up), free(m.product);
  }

  float *x = filled(rows * DIM, 7), *wg = filled(HIDDEN * DIM, 8), *wu = filled(HIDDEN * DIM, 9);
  float *wd = filled(DIM * HIDDEN, 10), *y = filled(rows * DIM, 11);
  block_job b = {.rows = block, .x = x, .gate_out = filled(block * HIDDEN, 12),
                 .up_out = filled(block * HIDDEN, 13), .product = filled(block * HIDDEN, 14),
                 .y = y, .input_pack = filled(FN(input_pack_elems)(block, HIDDEN), 15)};
  const int64_t packed = INT64_MAX; /* as for many rows: packed, not read in place */
  if (FN(pack_weight)((fmlp_input){wg, DIM, 1}, HIDDEN, DIM, packed, NULL, NULL, &b.gate) ||
      FN(pack_weight)((fmlp_input){wu, DIM, 1}, HIDDEN, DIM, packed, NULL, NULL, &b.up) ||
      FN(pack_weight)((fmlp_input){wd, HIDDEN, 1}, DIM, HIDDEN, packed, NULL, NULL, &b.down)) {
    return 1;
  }
  const FN(blocks) gated_blocks = FN(choose_blocks)(DIM, 2), down_blocks = FN(choose_blocks)(HIDDEN, 1);
  printf("blocks: gated kc %lld mc %lld nc %lld; down kc %lld mc %lld nc %lld\n",
         (long long)gated_blocks.kc, (long long)gated_blocks.mc, (long long)gated_blocks.nc,
         (long long)down_blocks.kc, (long long)down_blocks.mc, (long long)down_blocks.nc);
  const double gated_flops = 2.0 * 2 * block * DIM * HIDDEN, down_flops = 2.0 * block * DIM * HIDDEN;
  if (strstr(parts, "rows")) {
    report("gated rows (gemm_gated_rows)", gated_rows, &b, gated_flops);
    report("down rows (gemm_rows)", down_rows, &b, down_flops);
  }

  whole_job w = {.args = {.dtype = FMLP_F32, .rows = rows, .dim = DIM, .hidden = HIDDEN,
                          .out_dim = DIM, .x = {x, DIM, 1}, .w_gate = {wg, DIM, 1},
                          .w_up = {wu, DIM, 1}, .w_down = {wd, HIDDEN, 1},
                          .activation = FMLP_ACT_GELU_TANH, .y = y, .y_row_stride = DIM}};
  if (strstr(parts, "whole")) {
    report("whole gated call (1 thread)", whole, &w, 3.0 * 2 * rows * DIM * HIDDEN);
  }
  return 0;
}
