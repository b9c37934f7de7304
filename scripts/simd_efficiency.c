/* Where a SIMD float32 unit (AVX2 or AVX-512) loses to the FMA peak and to
 * MKL (issues 12, 13, 18): one thread's CPU time (so other processes on the
 * cores cost it little), best of REPEATS, for the GeGLU block's parts, from
 * the micro-kernel alone to the whole call:
 *
 *   micro-kernel  the gated and the linear micro-kernel over the same
 *                 input and weight panels again and again (in L1 up to kc
 *                 256, in L2 beyond), with a GELU(tanh) epilogue and, for
 *                 the linear one, without any (the K loop alone)
 *   gated rows    gate and up of a row block (gemm_gated_rows: packing the
 *                 input, the cache blocks, the micro-kernel, the epilogue)
 *   up rows       one of them alone, no activation (gemm_rows), the shape
 *                 MKL is timed on
 *   down rows     the down projection of a row block (gemm_rows)
 *   mkl           MKL's sgemm on the up and down rows' shapes, its weight
 *                 packed once beforehand as ours is (cblas_sgemm_pack and
 *                 _compute), when the script hands over a library with MKL
 *   whole         fmlp_cpu_gated_f32_<isa>, its weights packed in the call
 *   strides       (when named) up, gated and down rows into outputs whose rows
 *                 lie HIDDEN (DIM) floats apart against STRIDE_PAD more,
 *                 alternating: at 3072 floats a tile's rows are 12 KiB apart,
 *                 a multiple of 4 KiB, so all of them map to the same cache
 *                 sets (issue 18's aliasing question)
 *
 * The peak: 12 independent FMA chains of the unit's vectors, timed before
 * each run.
 *
 * Built by scripts/simd_efficiency.py: this file includes the unit itself
 * (FMLP_UNIT_SOURCE), for its static parts, and is compiled with its flags. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef FMLP_UNIT_SOURCE
#error "compile with -DFMLP_UNIT_SOURCE='\"kernels_f32_<isa>.c\"'"
#endif
#include FMLP_UNIT_SOURCE
#include "harness.h"

enum { REPEATS = 11, DIM = 768, HIDDEN = 3072, PEAK_CHAINS = 12 };

/* GFLOP/s of PEAK_CHAINS independent vector FMA chains for `iters` steps. */
static __attribute__((noinline)) double peak_gflops(long iters) {
  vreal b = v_set1(1.0000001f), c = v_set1(1e-7f), a[PEAK_CHAINS];
  for (int i = 0; i < PEAK_CHAINS; ++i) a[i] = v_set1((float)i);
  const double t0 = cpu_now();
  for (long n = 0; n < iters; ++n) {
    /* every chain in the loop, each step: none computed outside the timing or dropped */
    __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]),
                     "+v"(a[5]));
    __asm__ volatile("" : "+v"(a[6]), "+v"(a[7]), "+v"(a[8]), "+v"(a[9]), "+v"(a[10]),
                     "+v"(a[11]));
#pragma GCC unroll 12
    for (int i = 0; i < PEAK_CHAINS; ++i) a[i] = v_fma(a[i], b, c);
  }
  const double gflops = iters * PEAK_CHAINS * 2.0 * FMLP_SIMD_WIDTH / (cpu_now() - t0) / 1e9;
  float sum[FMLP_SIMD_WIDTH];
  v_store(sum, a[0]);
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

static void report(const char *what, void (*fn)(void *), void *context, double flops) {
  const timing t = best_of(fn, context, flops);
  printf("%-36s %8.3f ms %7.1f GFLOP/s %5.1f%% of peak\n", what, t.seconds * 1e3, t.gflops,
         100 * t.fraction);
}

/* ---- the micro-kernels over panels in L1 ---- */

typedef struct {
  int64_t kc, calls;
  fmlp_activation activation;
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
                                      .activation = j->activation, .first_k_block = 1,
                                      .last_k_block = 1};
  for (int64_t n = 0; n < j->calls; ++n) {
    for (int64_t i0 = 0; i0 < GEMM_MR; i0 += GATED_MR) {
      for (int64_t j0 = 0; j0 < GEMM_NR; j0 += GATED_NR) {
        gated_kernel(j->kc, j->a + i0, j->b_gate + j0, j->b_up + j0, GATED_MR, GATED_NR, &ep);
      }
    }
  }
}

static void linear_l1(void *context) {
  const micro_job *j = context;
  const FN(tile_epilogue) ep = {.activation = j->activation, .first_k_block = 1,
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
  int64_t pad;     /* floats past HIDDEN (DIM for y) in each output row's stride */
  int save_gate_up; /* gated rows store gate and up too, as a training call does */
  float *jit_input_pack, *weight_block; /* for up_rows_jit */
} block_job;

static void gated_rows(void *context) {
  block_job *j = context;
  FN(gemm_gated_rows)((fmlp_input){j->x, DIM, 1}, NULL, j->rows, &j->gate, &j->up, NULL, NULL,
                      FMLP_ACT_GELU_TANH, j->gate_out, j->up_out, j->product, HIDDEN + j->pad,
                      j->save_gate_up, j->input_pack, NULL);
}

static void up_rows(void *context) {
  block_job *j = context;
  FN(gemm_rows)((fmlp_input){j->x, DIM, 1}, j->rows, &j->up, NULL, FMLP_ACT_NONE, j->up_out,
                HIDDEN + j->pad, NULL, 0, j->input_pack);
}

static void down_rows(void *context) {
  block_job *j = context;
  FN(gemm_rows)((fmlp_input){j->product, HIDDEN, 1}, j->rows, &j->down, NULL, FMLP_ACT_NONE,
                j->y, DIM + j->pad, NULL, 0, j->input_pack);
}

/* ---- MKL's sgemm on the same shapes (its CBLAS, LP64, from the library the
 * script names: torch's libtorch_cpu.so carries it; one thread, as the
 * script sets MKL_NUM_THREADS) ---- */

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112, CBLAS_PACKED = 151,
       CBLAS_B_MATRIX = 162 };
typedef size_t (*pack_get_size_fn)(int, int, int, int);
typedef void (*pack_fn)(int, int, int, int, int, int, float, const float *, int, float *);
typedef void (*compute_fn)(int, int, int, int, int, int, const float *, int, const float *, int,
                           float, float *, int);

typedef struct {
  compute_fn compute;
  int m, n, k;
  const float *a;
  float *packed_b, *c;
} mkl_job;

static void mkl_rows(void *context) {
  const mkl_job *j = context;
  j->compute(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, j->m, j->n, j->k, j->a, j->k,
             j->packed_b, j->n, 0.0f, j->c, j->n);
}

/* MKL's job for c[m, n] = a[m, k] @ w[n, k].T, w packed here (free
 * packed_b after); compute NULL where the library has no packed sgemm. */
static mkl_job mkl_prepare(void *library, int m, int n, int k, const float *a, const float *w,
                           float *c) {
  const pack_get_size_fn get_size = (pack_get_size_fn)dlsym(library, "cblas_sgemm_pack_get_size");
  const pack_fn pack = (pack_fn)dlsym(library, "cblas_sgemm_pack");
  const compute_fn compute = (compute_fn)dlsym(library, "cblas_sgemm_compute");
  if (get_size == NULL || pack == NULL || compute == NULL) return (mkl_job){.compute = NULL};
  float *packed = aligned_alloc(64, (get_size(CBLAS_B_MATRIX, m, n, k) + 63) / 64 * 64);
  pack(CBLAS_ROW_MAJOR, CBLAS_B_MATRIX, CBLAS_TRANS, m, n, k, 1.0f, w, k, packed);
  return (mkl_job){compute, m, n, k, a, packed, c};
}

static void report_mkl(const char *what, void *library, int m, int n, int k, const float *a,
                       const float *w, float *c) {
  const mkl_job j = mkl_prepare(library, m, n, k, a, w, c);
  if (j.compute == NULL) {
    printf("%-36s (no MKL packed sgemm in the library)\n", what);
    return;
  }
  report(what, mkl_rows, (void *)&j, 2.0 * m * n * k);
  free(j.packed_b);
}

/* ---- paired: ours and MKL on the same shape, alternating within each
 * round, so both see the same moment's load; the median of the rounds'
 * time ratios is what compares two builds of ours (MKL the control) ---- */

enum { PAIRED_ROUNDS = 21 };

static double median(double *values, int n) {
  qsort(values, (size_t)n, sizeof *values, by_value);
  return values[n / 2];
}

static double seconds_of(void (*fn)(void *), void *context) {
  const double t0 = cpu_now();
  fn(context);
  return cpu_now() - t0;
}

/* ours (flops in a call) against MKL's product: the ratio of time per flop */
static void report_paired(const char *what, void (*ours)(void *), void *ours_context,
                          double flops, const mkl_job *mkl) {
  const double mkl_flops = 2.0 * mkl->m * mkl->n * mkl->k;
  double ratio[PAIRED_ROUNDS], ours_t[PAIRED_ROUNDS], mkl_t[PAIRED_ROUNDS];
  ours(ours_context), mkl_rows((void *)mkl); /* warm */
  for (int r = 0; r < PAIRED_ROUNDS; ++r) {
    ours_t[r] = seconds_of(ours, ours_context);
    mkl_t[r] = seconds_of(mkl_rows, (void *)mkl);
    ratio[r] = ours_t[r] / flops / (mkl_t[r] / mkl_flops);
  }
  const double r = median(ratio, PAIRED_ROUNDS), low = ratio[PAIRED_ROUNDS / 4],
               high = ratio[PAIRED_ROUNDS - 1 - PAIRED_ROUNDS / 4];
  printf("%-36s ours/MKL time a flop %.3f (quartiles %.3f-%.3f); median %.1f against %.1f "
         "GFLOP/s\n",
         what, r, low, high, flops / median(ours_t, PAIRED_ROUNDS) / 1e9,
         mkl_flops / median(mkl_t, PAIRED_ROUNDS) / 1e9);
}

/* ---- strides: the same product into output rows HIDDEN (DIM) floats
 * apart and STRIDE_PAD floats more, alternating within each round: at a
 * multiple of 4 KiB every row of a tile maps to the same L1 and L2 sets ---- */

enum { STRIDE_PAD = 16 };

/* the median over PAIRED_ROUNDS of fn's time on b over its time on a */
static void report_padded(const char *what, void (*fn)(void *), void *a, void *b) {
  double ratio[PAIRED_ROUNDS];
  fn(a), fn(b); /* warm */
  for (int r = 0; r < PAIRED_ROUNDS; ++r) {
    const double ta = seconds_of(fn, a);
    ratio[r] = seconds_of(fn, b) / ta;
  }
  const double m = median(ratio, PAIRED_ROUNDS);
  printf("%-36s padded/plain time %.3f (quartiles %.3f-%.3f)\n", what, m,
         ratio[PAIRED_ROUNDS / 4], ratio[PAIRED_ROUNDS - 1 - PAIRED_ROUNDS / 4]);
}

/* up rows with the weight packed a block at a time, as an op of up to
 * GEMM_JIT_MAX_ROWS rows does it */
static void up_rows_jit(void *context) {
  block_job *j = context;
  const FN(packed_weight) w = {.data = NULL, .source = j->up.source, .n = HIDDEN, .k = DIM};
  FN(gemm_rows_shared)((fmlp_input){j->x, DIM, 1}, NULL, j->rows, &w, NULL, FMLP_ACT_NONE,
                       j->up_out, HIDDEN + j->pad, NULL, 0, j->jit_input_pack, j->weight_block);
}

typedef struct {
  fmlp_cpu_gated_args args;
} whole_job;

static void whole(void *context) {
  whole_job *j = context;
  if (FN(fmlp_cpu_gated)(&j->args, NULL) != FMLP_OK) exit(1);
}

int main(int argc, char **argv) {
  const int64_t block = argc > 1 ? atoll(argv[1]) : 120, rows = argc > 2 ? atoll(argv[2]) : 1024;
  /* which parts to time (paired only when named) */
  const char *parts = argc > 3 ? argv[3] : "micro,rows,mkl,whole";
  void *mkl = argc > 4 ? dlopen(argv[4], RTLD_NOW | RTLD_GLOBAL) : NULL;
  printf("one thread, %d-float vectors, FMA peak ~%.1f GFLOP/s; tile %dx%lld, gated %dx%lld; "
         "row block %lld, whole call %lld rows\n",
         FMLP_SIMD_WIDTH, peak_gflops(20000000), GEMM_MR, (long long)GEMM_NR, GATED_MR,
         (long long)GATED_NR, (long long)block, (long long)rows);

  static const int64_t kcs[] = {128, 256, 512, 768};
  for (size_t i = 0; i < sizeof kcs / sizeof kcs[0] && strstr(parts, "micro"); ++i) {
    const int64_t kc = kcs[i];
    micro_job m = {.kc = kc, .calls = 40000 * 128 / kc, .activation = FMLP_ACT_GELU_TANH,
                   .a = filled(GEMM_MR * kc, 1), .b_gate = filled(GEMM_NR * kc, 2),
                   .b_up = filled(GEMM_NR * kc, 3), .gate = filled(GEMM_MR * GEMM_NR, 4),
                   .up = filled(GEMM_MR * GEMM_NR, 5), .product = filled(GEMM_MR * GEMM_NR, 6)};
    /* as many multiply-adds per call at every width: 40000 6 x 16 tiles' worth at kc 128 */
    m.calls = m.calls * 6 * 16 / (GEMM_MR * GEMM_NR);
    char what[64];
    snprintf(what, sizeof what, "gated micro-kernel, kc %lld", (long long)kc);
    report(what, gated_l1, &m, 2.0 * 2 * GEMM_MR * GEMM_NR * kc * m.calls);
    snprintf(what, sizeof what, "linear micro-kernel, kc %lld", (long long)kc);
    report(what, linear_l1, &m, 2.0 * GEMM_MR * GEMM_NR * kc * m.calls);
    m.activation = FMLP_ACT_NONE;
    snprintf(what, sizeof what, "linear, no activation, kc %lld", (long long)kc);
    report(what, linear_l1, &m, 2.0 * GEMM_MR * GEMM_NR * kc * m.calls);
    free(m.a), free(m.b_gate), free(m.b_up), free(m.gate), free(m.up), free(m.product);
  }

  float *x = filled(rows * DIM, 7), *wg = filled(HIDDEN * DIM, 8), *wu = filled(HIDDEN * DIM, 9);
  float *wd = filled(DIM * HIDDEN, 10), *y = filled(rows * DIM, 11);
  float *y_padded = filled(rows * (DIM + STRIDE_PAD), 11);
  block_job b = {.rows = block, .x = x,
                 .gate_out = filled(block * (HIDDEN + STRIDE_PAD), 12),
                 .up_out = filled(block * (HIDDEN + STRIDE_PAD), 13),
                 .product = filled(block * (HIDDEN + STRIDE_PAD), 14), .y = y,
                 .input_pack = filled(FN(input_pack_elems)(block, HIDDEN), 15),
                 .jit_input_pack = filled(FN(whole_input_pack_elems)(block, HIDDEN), 16),
                 .weight_block = filled(FN(weight_block_elems)(DIM, 1), 17)};
  const int64_t packed = INT64_MAX; /* as for many rows: packed, not read in place */
  if (FN(pack_weight)((fmlp_input){wg, DIM, 1}, HIDDEN, DIM, packed, NULL, NULL, &b.gate) ||
      FN(pack_weight)((fmlp_input){wu, DIM, 1}, HIDDEN, DIM, packed, NULL, NULL, &b.up) ||
      FN(pack_weight)((fmlp_input){wd, HIDDEN, 1}, DIM, HIDDEN, packed, NULL, NULL, &b.down)) {
    return 1;
  }
  const FN(blocks) gated_blocks = FN(choose_blocks)(DIM, 2, 0);
  const FN(blocks) down_blocks = FN(choose_blocks)(HIDDEN, 1, 0);
  printf("blocks: gated kc %lld mc %lld nc %lld; down kc %lld mc %lld nc %lld\n",
         (long long)gated_blocks.kc, (long long)gated_blocks.mc, (long long)gated_blocks.nc,
         (long long)down_blocks.kc, (long long)down_blocks.mc, (long long)down_blocks.nc);
  const double one_flops = 2.0 * block * DIM * HIDDEN;
  if (strstr(parts, "rows")) {
    report("gated rows (gemm_gated_rows)", gated_rows, &b, 2 * one_flops);
    report("up rows (gemm_rows, no activation)", up_rows, &b, one_flops);
    report("down rows (gemm_rows)", down_rows, &b, one_flops);
  }
  if (strstr(parts, "mkl") && mkl != NULL) {
    report_mkl("MKL up rows (packed sgemm)", mkl, (int)block, HIDDEN, DIM, x, wu, b.up_out);
    report_mkl("MKL down rows (packed sgemm)", mkl, (int)block, DIM, HIDDEN, b.product, wd, y);
  }
  if (strstr(parts, "paired") && mkl != NULL) {
    const mkl_job up = mkl_prepare(mkl, (int)block, HIDDEN, DIM, x, wu, b.up_out);
    const mkl_job down = mkl_prepare(mkl, (int)block, DIM, HIDDEN, b.product, wd, y);
    if (up.compute != NULL && down.compute != NULL) {
      report_paired("paired up rows", up_rows, &b, one_flops, &up);
      report_paired("paired down rows", down_rows, &b, one_flops, &down);
      report_paired("paired gated rows (MKL: up rows)", gated_rows, &b, 2 * one_flops, &up);
      /* the K loop alone, its panels in L1 */
      micro_job m = {.kc = 256, .calls = 20000, .activation = FMLP_ACT_NONE,
                     .a = filled(GEMM_MR * 256, 1), .b_gate = filled(GEMM_NR * 256, 2),
                     .product = filled(GEMM_MR * GEMM_NR, 6)};
      report_paired("paired linear micro-kernel kc 256", linear_l1, &m,
                    2.0 * GEMM_MR * GEMM_NR * 256 * m.calls, &up);
      free(m.a), free(m.b_gate), free(m.product);
    }
    free(up.packed_b), free(down.packed_b);
  }

  if (strstr(parts, "strides")) {
    block_job padded = b;
    padded.pad = STRIDE_PAD;
    padded.y = y_padded;
    report_padded("strides: up rows", up_rows, &b, &padded);
    report_padded("strides: up rows, packed just in time", up_rows_jit, &b, &padded);
    report_padded("strides: gated rows", gated_rows, &b, &padded);
    block_job saving = b, saving_padded = padded;
    saving.save_gate_up = saving_padded.save_gate_up = 1;
    report_padded("strides: gated rows saving gate, up", gated_rows, &saving, &saving_padded);
    report_padded("strides: down rows", down_rows, &b, &padded);
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
