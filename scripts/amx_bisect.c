/* Where the AMX tile loop loses time inside the op (issue 12): a bisection
 * from the 2 x 2 tile loop over packed panels in L2 to the unit's gemm_rows
 * over a row block (one thread, bfloat16, ROWS x K -> N, no bias or
 * activation unless a step says so), adding the op's features one at a time
 * in the op's order and with its buffers:
 *
 *   products     the tile loop alone: for each tile, the C tiles zeroed,
 *                then K / 32 steps of 2 A + 2 B tile loads and 4 products;
 *                A from one fixed input block (choose_blocks' mc rows,
 *                tile-ready), B from the first weight block (nc columns):
 *                both stay in L2. The op's loop order (ic, jc, ir, jr) and
 *                flop count.
 *   +C stores    the four C tiles stored to the pending tile (tilestored),
 *                as the micro-kernel does: once the next tile's first A and
 *                B tiles are loading
 *   +epilogue    the micro-kernel itself (microkernel_amx): the deferred
 *                epilogue (bfloat16 rounding) of the previous tile between
 *                this one's products, into a compact 32 x 32 output
 *   +output      the epilogue stores into the real ROWS x N output, rows N
 *                values apart (8 KiB: 4 KiB aliasing), each tile at its place
 *   +weight      B panels from the whole packed weight (8 MiB at 1024 x
 *                4096), a new weight block per jc (from L3 / memory)
 *   +input pack  A panels from the op's input pack, packed per input block
 *                from the input's rows (pack_input_block)
 *   gemm_rows    the unit's own gemm_rows over the same buffers (its tile
 *                function through a pointer, the epilogue struct per tile)
 * and, each against gemm_rows:
 *   4K weight    the packed weight on 4 KiB pages (MADV_NOHUGEPAGE)
 *   2M input     the input pack on a 2 MiB page too
 *   fresh out    the output's pages dropped before each call (madvise
 *                DONTNEED): page faults of a fresh output, as torch.empty
 *                of this size gives
 *   padded ldc   output rows N + 32 values apart (no 4 KiB aliasing)
 *   jit          the weight packed a block at a time (gemm_rows_shared with
 *                a weight block; the op's path up to 1024 rows)
 *   bias+GELU    gemm_rows with a bias and GELU (the bench's large_gemm)
 *   op           the whole op on one thread (the unit's fmlp_cpu_chain, bias
 *                and GELU): its weight packed ahead into fresh scratch (or
 *                just in time up to 1024 rows), its scratch allocated, the
 *                output advised to huge pages
 *
 * Each round runs every step once, in turn, so the load moves them alike;
 * a step's line is the min (and median) over the rounds of one thread's CPU
 * time, and its TFLOP/s at the min; first the hash of the op's output, to
 * compare two builds' results by. Built and run by scripts/amx_bisect.py
 * (see there). */
#define _DEFAULT_SOURCE /* madvise */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels_bf16_avx512_amx.c"
#include "harness.h"
#include "amx_harness.h"

/* the op's shape */
typedef struct {
  int64_t rows, k, n;
} shape;

/* What the steps share: the op's buffers. */
typedef struct {
  shape s;
  fmlp_input x;
  STORE *x_data, *bias, *out, *out_padded, *compact;
  FN(packed_weight) w, w_small_pages;
  REAL *fixed_a, *input_pack, *input_pack_huge, *weight_block;
} buffers;

/* Features of the hand-written tile loop (tile_loop). */
typedef struct {
  int store_c, epilogue, real_output, whole_weight, pack_input;
} features;

/* The op's loops (for_each_tile's) with the features f; no tile read in place. */
static void tile_loop(const buffers *b, features f) {
  const int64_t rows = b->s.rows, k = b->s.k, n = b->s.n;
  const FN(blocks) bl = FN(choose_blocks)(k, 1, 0);
  FN(pending_tile) pending;
  FN(begin_tiles)(&pending);
  for (int64_t ic = 0; ic < rows; ic += bl.mc) {
    const int64_t mc = rows - ic < bl.mc ? rows - ic : bl.mc;
    const REAL *panels = b->fixed_a;
    if (f.pack_input) {
      const fmlp_input block = {b->x_data + ic * k, k, 1};
      FN(pack_input_block)(block, mc, 0, k, 0, b->input_pack);
      panels = b->input_pack;
    }
    for (int64_t jc = 0; jc < n; jc += bl.nc) {
      const int64_t nc = n - jc < bl.nc ? n - jc : bl.nc;
      for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
        const REAL *a = panels + (ir / GEMM_MR) * FN(panel_rows)(k) * GEMM_MR;
        for (int64_t jr = 0; jr < nc; jr += GEMM_NR) {
          const REAL *bp =
              b->w.data + FN(weight_panel_at)(f.whole_weight ? jc + jr : jr, k, 0);
          if (f.epilogue) {
            const FN(tile_epilogue) ep = {.activation = FMLP_ACT_NONE, .state = &pending};
            STORE *c = f.real_output ? b->out + (ic + ir) * n + jc + jr : b->compact;
            FN(microkernel_amx)(k, a, bp, c, f.real_output ? n : GEMM_NR, GEMM_MR, GEMM_NR,
                                &ep);
            continue;
          }
          const uint32_t *slots = (const uint32_t *)bp;
          const uint32_t *const halves[2] = {slots, slots + AMX_ROWS};
          /* stored as the micro-kernel does, once the next tile's first
           * operands are loading; no epilogue (pending.rows stays 0) */
          FN(multiply_tiles)(k, FN(amx_input_at)(a, k, 0), halves, f.store_c ? &pending : NULL,
                             GEMM_MR);
          pending.in_tiles = f.store_c ? pending.t : NULL;
        }
      }
    }
  }
  FN(finish_tiles)(&pending);
}

enum {
  STEP_PRODUCTS,
  STEP_STORES,
  STEP_EPILOGUE,
  STEP_OUTPUT,
  STEP_WEIGHT,
  STEP_INPUT,
  STEP_GEMM_ROWS,
  STEP_SMALL_PAGES,
  STEP_HUGE_INPUT,
  STEP_FRESH_OUT,
  STEP_PADDED,
  STEP_JIT,
  STEP_GELU,
  STEP_OP,
  STEPS
};
static const char *const step_names[STEPS] = {
    "products", "+C stores", "+epilogue", "+output",   "+weight",     "+input pack",
    "gemm_rows", "4K weight", "2M input", "fresh out", "padded ldc", "jit",
    "bias+GELU", "op"};

static void run_step(const buffers *b, int step) {
  const shape s = b->s;
  switch (step) {
    case STEP_PRODUCTS:
    case STEP_STORES:
    case STEP_EPILOGUE:
    case STEP_OUTPUT:
    case STEP_WEIGHT:
    case STEP_INPUT:
      tile_loop(b, (features){.store_c = step >= STEP_STORES,
                              .epilogue = step >= STEP_EPILOGUE,
                              .real_output = step >= STEP_OUTPUT,
                              .whole_weight = step >= STEP_WEIGHT,
                              .pack_input = step >= STEP_INPUT});
      return;
    case STEP_GEMM_ROWS:
    case STEP_FRESH_OUT:
      FN(gemm_rows)(b->x, s.rows, &b->w, NULL, FMLP_ACT_NONE, b->out, s.n, NULL, 0,
                    b->input_pack);
      return;
    case STEP_SMALL_PAGES:
      FN(gemm_rows)(b->x, s.rows, &b->w_small_pages, NULL, FMLP_ACT_NONE, b->out, s.n, NULL, 0,
                    b->input_pack);
      return;
    case STEP_HUGE_INPUT:
      FN(gemm_rows)(b->x, s.rows, &b->w, NULL, FMLP_ACT_NONE, b->out, s.n, NULL, 0,
                    b->input_pack_huge);
      return;
    case STEP_PADDED:
      FN(gemm_rows)(b->x, s.rows, &b->w, NULL, FMLP_ACT_NONE, b->out_padded, s.n + GEMM_NR,
                    NULL, 0, b->input_pack);
      return;
    case STEP_JIT: {
      const FN(packed_weight) jit = {.data = NULL, .source = b->w.source, .n = s.n, .k = s.k};
      FN(gemm_rows_shared)(b->x, NULL, s.rows, &jit, NULL, FMLP_ACT_NONE, b->out, s.n, NULL, 0,
                           b->input_pack, b->weight_block);
      return;
    }
    case STEP_GELU:
      FN(gemm_rows)(b->x, s.rows, &b->w, b->bias, FMLP_ACT_GELU, b->out, s.n, NULL, 0,
                    b->input_pack);
      return;
    case STEP_OP: {
      const int64_t widths[2] = {s.k, s.n};
      const void *const biases[1] = {b->bias};
      const fmlp_cpu_chain_args args = {.dtype = FMLP_BF16,
                                        .rows = s.rows,
                                        .n_layers = 1,
                                        .widths = widths,
                                        .x = b->x,
                                        .weights = &b->w.source,
                                        .biases = biases,
                                        .hidden_activation = FMLP_ACT_NONE,
                                        .final_activation = FMLP_ACT_GELU,
                                        .y = b->out,
                                        .y_row_stride = s.n};
      if (FN(fmlp_cpu_chain)(&args, NULL) != FMLP_OK) exit(1);
      return;
    }
    default:
      return;
  }
}

/* count REALs on pages of 2 MiB (huge != 0: aligned and advised) or 4 KiB
 * (advised against huge pages), touched once. */
static REAL *paged(int64_t count, int huge) {
  const size_t bytes =
      ((size_t)count * sizeof(REAL) + FMLP_HUGE_PAGE_BYTES - 1) / FMLP_HUGE_PAGE_BYTES *
      FMLP_HUGE_PAGE_BYTES;
  REAL *p = aligned_alloc(FMLP_HUGE_PAGE_BYTES, bytes);
  if (p == NULL) exit(1);
  (void)madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 0, bytes);
  return p;
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 20;
  const shape s = {argc > 2 ? atoll(argv[2]) : 512, argc > 3 ? atoll(argv[3]) : 1024,
                   argc > 4 ? atoll(argv[4]) : 4096};
  /* whole tiles (tile_loop has no edges), rows enough for a packed weight */
  if (rounds < 1 || s.rows <= GEMM_UNPACKED_MAX_ROWS || s.k < AMX_K || s.n < GEMM_NR ||
      s.rows % GEMM_MR != 0 || s.n % GEMM_NR != 0 || s.k % AMX_K != 0) {
    fprintf(stderr, "usage: %s [ROUNDS [ROWS K N]] (ROWS > 64, whole 32s of all three)\n",
            argv[0]);
    return 2;
  }
  request_amx_tiles();
  buffers b = {.s = s};
  b.x_data = filled_bf16(s.rows * s.k, 1);
  b.x = (fmlp_input){b.x_data, s.k, 1};
  STORE *w_data = filled_bf16(s.n * s.k, 2);
  b.bias = filled_bf16(s.n, 3);
  const fmlp_input w_source = {w_data, s.k, 1};
  const int64_t packed_elems = FN(packed_weight_elems)(s.n, s.k);
  if (FN(pack_weight)(w_source, s.n, s.k, s.rows, NULL,
                      fmlp_alloc_scratch(packed_elems, sizeof(REAL)), &b.w) != FMLP_OK ||
      FN(pack_weight)(w_source, s.n, s.k, s.rows, NULL, paged(packed_elems, 0),
                      &b.w_small_pages) != FMLP_OK) {
    return 1;
  }
  const int64_t pack_elems = FN(input_pack_elems)(s.rows, s.k);
  const int64_t whole_elems = FN(whole_input_pack_elems)(s.rows, s.k);
  const int64_t input_elems = pack_elems > whole_elems ? pack_elems : whole_elems;
  b.input_pack = fmlp_alloc_scratch(input_elems, sizeof(REAL));
  b.input_pack_huge = paged(input_elems, 1);
  b.fixed_a = fmlp_alloc_scratch(input_elems, sizeof(REAL));
  b.weight_block = fmlp_alloc_scratch(FN(weight_block_elems)(s.k, 1), sizeof(REAL));
  const int64_t out_elems = s.rows * (s.n + GEMM_NR);
  b.out = fmlp_alloc_scratch(out_elems, sizeof(STORE));
  b.out_padded = fmlp_alloc_scratch(out_elems, sizeof(STORE));
  b.compact = fmlp_alloc_scratch(GEMM_MR * GEMM_NR, sizeof(STORE));
  if (b.input_pack == NULL || b.fixed_a == NULL || b.weight_block == NULL || b.out == NULL ||
      b.out_padded == NULL || b.compact == NULL) {
    return 1;
  }
  const FN(blocks) bl = FN(choose_blocks)(s.k, 1, 0);
  FN(pack_input_block)(b.x, bl.mc < s.rows ? bl.mc : s.rows, 0, s.k, 0, b.fixed_a);
  printf("%lld x %lld -> %lld, one thread; mc %lld nc %lld kc %lld; %d rounds\n",
         (long long)s.rows, (long long)s.k, (long long)s.n, (long long)bl.mc, (long long)bl.nc,
         (long long)bl.kc, rounds);

  double *times = malloc(sizeof(double) * (size_t)(STEPS * rounds));
  if (times == NULL) return 1;
  const size_t out_bytes = (size_t)(s.rows * s.n) * sizeof(STORE);
  /* warm-up, every page touched; the op's output's hash, to compare builds by */
  for (int step = 0; step < STEPS; ++step) run_step(&b, step);
  const uint64_t hash = hash_bf16(FNV_START, b.out, s.rows * s.n);
  printf("output hash %016llx\n", (unsigned long long)hash);
  for (int r = 0; r < rounds; ++r) {
    for (int step = 0; step < STEPS; ++step) {
      if (step == STEP_FRESH_OUT) (void)madvise(b.out, out_bytes / 4096 * 4096, MADV_DONTNEED);
      const double t0 = cpu_now();
      run_step(&b, step);
      times[step * rounds + r] = cpu_now() - t0;
    }
  }
  const double flops = 2.0 * (double)s.rows * (double)s.k * (double)s.n;
  printf("%-12s %9s %9s %8s %8s\n", "step", "min ms", "med ms", "TFLOP/s", "ratio");
  for (int step = 0; step < STEPS; ++step) {
    double *t = times + step * rounds;
    qsort(t, (size_t)rounds, sizeof(double), by_value);
    /* the bisection against the step before; the rest against gemm_rows,
     * the op against gemm_rows with its bias and GELU */
    const int prev = step <= STEP_GEMM_ROWS ? step - 1
                     : step == STEP_OP      ? STEP_GELU
                                            : STEP_GEMM_ROWS;
    const double vs = step > 0 ? t[0] / times[prev * rounds] : 1.0;
    printf("%-12s %9.3f %9.3f %8.3f %8.3f\n", step_names[step], t[0] * 1e3,
           t[rounds / 2] * 1e3, flops / t[0] / 1e12, vs);
  }
  return 0;
}
