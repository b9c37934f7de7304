/* Whole-op forward drivers over the GEMM core (template: see
 * real_template.h): layer chains (Linear, MLP) and the gated block. Work is
 * split into row blocks run through every layer, so intermediates stay per
 * block; threads take blocks from a queue, and a single block of up to a
 * few hundred rows splits its products' columns over the threads instead,
 * its weights read in place or packed just in time (GEMM_JIT_MAX_ROWS). */
#include <stdatomic.h>

#include "gemm.h"
#include "spin_wait.h"

/* Row blocks run through every layer while the weights stay in the L2, so a
 * block's activations never leave it either; larger weights get blocks of up
 * to a thread's share of the rows (HIDDEN_MOST_BLOCK_ROWS where there are
 * hidden outputs). Measured with one thread on Zen 4 (C
 * harness): 65536 x (64-128-128-64): 42.7 ms blocked vs 87.4 ms layer by
 * layer, flat for activation blocks of 32 KiB..1 MiB. Weights past the L2
 * come from L3 once per block: on the Xeon (2 MiB L2; C harness, one thread's
 * CPU time with the 2-thread row blocks, loaded machine, medians of 15) 2048
 * x (1024^4) GELU, 12 MiB of weights, ran 147 ms in 240-row blocks against
 * 171 ms in 48-row ones, and the forward of 256 x (512^3) ReLU saving for
 * backward, 3 MiB, 4.62 against 5.10 ms (on Zen 4, 16 MiB, 4096 x (1024^4)
 * had run 243 ms in small blocks, 255 ms layer by layer). A single layer has
 * no intermediates to keep (activation elems 0) and takes large blocks, which
 * re-read the weights less: 4096 x 1024 -> 4096 GELU ran 193 ms in 48-row
 * blocks, 184 ms in ~400-row ones. */
#define ACTIVATION_BLOCK_BYTES ((int64_t)256 << 10)
#define TASKS_PER_THREAD 4
/* A chain whose weights are past the L2 re-reads them for each block: its
 * blocks take at least CHAIN_LEAST_BLOCK_ROWS rows (where the threads' share
 * has them). 2048 x (768 -> 3072 -> 3072 -> 768) GELU, 54 MiB of float32
 * weights, 6 blocks of ~342 rows rather than 10 of ~205 for two threads (C
 * harness, scripts/simd_ab.py `mlp_layers`, one thread's CPU time, the
 * blocks run one after another, medians of 5-11 alternating rounds, loaded
 * machine): AVX-512 0.973-0.987x the time over five runs, AVX2 0.973 and
 * 0.979x; its 3072 -> 3072 layer alone 0.953 and 0.966x, 3072 -> 768 0.973
 * and 1.005x, 768 -> 3072 level. 8 blocks of ~96 or 48 rows ran the chain
 * 1.075x and 1.14x, 2 of 1024 rows 1.08x; at 4096 rows (480-row blocks)
 * 1008-row ones ran single layers level (0.98-1.02x) and the GeGLU block
 * 1.012x (it takes no least rows: unmeasured below 4096). Why the chain runs
 * ~12% below its three layers alone with the same blocks (`mlp_layers`:
 * 146 against 172, 161 and 194 GFLOP/s) is not settled: perf (cpu-clock)
 * puts 10% more micro-kernel samples a call in the chain and page zeroing
 * (clear_page_erms, fresh packed weights and scratch) at 4.8% against 1.4%.
 * On a Zen 4 VM (1 MiB L2, 32 MiB L3) the chain took 0.98-1.05x its layers'
 * time (6 runs) with no more micro-kernel samples (perf, 8 calls: 9683
 * against 9819), and keeping every scratch and packed-weight buffer between
 * calls (an experiment's process-wide cache) closed the gap: the chain 0.979x
 * and 0.986x the time (0.936x in a noisier run), its hidden scratch alone
 * 0.995x. Through torch on two threads there the chain took 0.96x its
 * layers' time (fusedmlp.linear each), clear_page_erms 7% of its
 * micro-kernel's samples.
 * Tried and dropped (same harness): the next weight block prefetched into
 * the L2 a share per tile 1.04x (and the layers alone 1.03-1.06x), the
 * chain run layer by layer through whole hidden buffers 1.017x, the input
 * block's rows split evenly (no short last block) level. */
#define CHAIN_LEAST_BLOCK_ROWS ((int64_t)384)
/* An op with hidden outputs (a chain of several layers, the gated block)
 * whose weights are past the L2 takes blocks of at most HIDDEN_MOST_BLOCK_ROWS
 * rows: one thread (no queue to balance) would otherwise take all its rows
 * as one block, whose hidden outputs leave the L3 and are fresh scratch pages
 * to fault in and zero every call (the study MLP's 2048 x 3072 float32,
 * twice: 48 MiB). On one thread (Zen 4 VM, 1 MiB L2, 32 MiB L3; C harness,
 * threading NULL, the two builds alternating, medians of 5-11) the study MLP
 * at 2048 rows ran in 5 blocks of ~410 rows 0.931x the time of one block at
 * AVX-512 (0.948x at 384, 0.872x at 768 and 0.953x at 1024 rows in noisier
 * runs; 480 against 768 directly 0.929x, against 384 level), 0.903x at AVX2
 * and 0.939x in bfloat16 (avx512_bf16), its time over its three layers
 * alone going from 1.17 / 1.12 / 1.09 to 1.00 / 1.01 / 1.02; the GeGLU block
 * 768 -> 3072 -> 768 at 2048 tokens 0.816x, 0.863x and 0.991x. Two threads
 * keep the study MLP's 342-row blocks at 2048 rows; at 4096 rows (512 ->
 * ~410-row blocks) it ran 1.045x and 0.965x (noise), the GeGLU block 1.003x; at
 * 8192 tokens (1024 -> ~456; bench study_gated) the GeGLU block 0.953x at
 * AVX-512, 0.962x at AVX2, level in bfloat16 (1.016x, 0.984x). Single
 * layers keep whole shares: they have no hidden outputs. */
#define HIDDEN_MOST_BLOCK_ROWS ((int64_t)480)
_Static_assert(HIDDEN_MOST_BLOCK_ROWS >= CHAIN_LEAST_BLOCK_ROWS, "a block range");
#define BLOCK_MIN_MULTIPLY_ADDS ((int64_t)1 << 20)

/* Up to GEMM_JIT_MAX_ROWS rows (GEMM_JIT_LARGE_MAX_ROWS for an op of at
 * least GEMM_JIT_LARGE_MULTIPLY_ADDS multiply-adds a row) an op is one row
 * block whose products split their output columns over the threads, and
 * whose weights are not packed ahead: gemm.h packs each NC x KC block of
 * them into a small per-thread buffer right before its tiles (weight_blocks),
 * in place of packing each whole weight into a fresh buffer every call (at
 * 256 tokens, bfloat16 768 -> 3072 -> 768 GeGLU spent ~14% of its time in
 * that pack and ~12.5% faulting in its 3 x 4.7 MB of buffers; perf, one
 * thread). Measured on the Xeon against packing ahead (one process per
 * build, builds alternating, 3-9 rounds of 7-11 calls; machine loaded, load
 * average 2-6 on 2 cores), one thread's CPU time, min, just in time / ahead,
 * bfloat16 then float32: gated_mlp_train 768 -> 3072 -> 768 GELU(tanh) at
 * 256 rows 0.93 / 0.94 (8.08 -> 7.53 ms bfloat16, in the quietest rounds;
 * 0.74 / 0.86 in busier ones), 384 0.79 / 0.85, 512 0.83 / 0.88; mlp_train
 * 512^3 ReLU at 256 0.89 / 0.99, 512 0.93 / 0.92; linear 1024 -> 4096 GELU
 * at 256 0.81 / 0.83, 512 0.92 / 0.91. Two threads, quiet machine, `python
 * -m fusedmlp.bench` training cases (fused / eager in each process, 3
 * rounds, builds alternating), ahead -> just in time (that build also
 * overlapping the AMX linear tile's epilogue, microkernel_amx.h):
 * train_gated (GeGLU block 256 tokens, fwd + bwd) bfloat16 1.28-1.40x ->
 * 0.91-1.00x, float32 1.08-1.23x -> 0.96-1.02x; train_step (256 x 512^3)
 * bfloat16 0.99-1.05x -> 0.84-1.01x, float32 level (1.02-1.08x,
 * 1.01-1.12x). A stage of the column split waits for a preempted thread
 * where row blocks would not: on a loaded machine these times came in
 * scheduler quanta.
 *
 * Past 512 rows (the kernels called through ctypes, the two bounds' builds
 * alternating call by call in one process, 8-40 calls each, bound 512
 * against just in time at every row count; machine loaded, load average
 * 4.5-6.5 on 2 cores; just in time / ahead, min / median; with the input
 * packed once per product and shared, shares_input), one thread's CPU time,
 * bfloat16 (AMX) then float32: gated 768 -> 3072 -> 768 GELU(tanh) at 768
 * rows 0.83 / 0.84 and 0.92 / 0.91, 1024 0.91 / 0.97 and 0.95 / 0.96, 2048
 * 0.99 / 1.02 and 0.99 / 0.95 (SiLU, bfloat16, 1024: 0.95 / 0.97); 768 ->
 * 3072 -> 3072 -> 768 GELU at 768 0.81 / 0.81 and 0.89 / 0.85, 1024 (bfloat16)
 * 0.75 / 0.91; linear 1024 -> 4096 GELU at 1024 0.97 / 0.90 and 0.94 / 0.93,
 * 2048 0.88 / 0.92 and 0.98 / 0.98; but 512^3 ReLU at 768 0.99 / 0.96 and
 * 0.97 / 0.86, 1024 0.98 / 0.98 and 1.01 / 0.99, 2048 1.01 / 1.01 and 1.02 /
 * 1.06. Two threads, wall medians (process CPU medians): gated at 768 0.86
 * (0.86) and 0.97 (0.94), 1024 0.95 (0.90) and 0.93 (1.01), its training
 * twin at 1024 (bfloat16) 1.07 (0.97), 2048 0.94 (0.88) and 1.08 (0.98);
 * the 3-layer 3072-wide MLP at 1024 (bfloat16) 0.91 (0.88), 768 (float32)
 * 0.82 (0.81); linear at 1024 0.91 (0.85) and 0.86 (0.86), 2048 0.81 (0.87)
 * and 0.93 (0.93); but 512^3 at 768 0.81 (1.02) and 1.16 (1.12), 1024 (two
 * runs) 0.77 (1.04), 1.55 (1.07) and 1.11 (1.04), 1.73 (1.17), 2048 1.19
 * (1.20) and 1.21 (1.21). The noise: one run of two identical builds
 * (512^3 at 1024) read 0.87 (one thread) and 1.45 (two). So ops with
 * large weights (>= 4M multiply-adds a row here; 512^3 has 0.79M) gain up
 * to 1024 rows in both dtypes, 2048 is mixed, and a chain of small layers
 * loses past 512 on two threads (not explained; its row blocks keep a
 * block's hidden layers in cache, one block sends them through memory). A
 * unit header may set either bound before including this file; none does,
 * as the dtypes measured alike. */
#ifndef GEMM_JIT_MAX_ROWS
#define GEMM_JIT_MAX_ROWS ((int64_t)512)
#endif
#ifndef GEMM_JIT_LARGE_MAX_ROWS
#define GEMM_JIT_LARGE_MAX_ROWS ((int64_t)1024)
#endif
#define GEMM_JIT_LARGE_MULTIPLY_ADDS ((int64_t)1 << 21)
_Static_assert(GEMM_JIT_MAX_ROWS >= GEMM_UNPACKED_MAX_ROWS, "few rows are one row block too");
_Static_assert(GEMM_JIT_LARGE_MAX_ROWS >= GEMM_JIT_MAX_ROWS, "large ops at least as far");

/* Whether an op over `rows` rows of weight_elems multiply-adds a row packs
 * its weights just in time (as one row block). */
static int FN(packs_just_in_time)(int64_t rows, int64_t weight_elems) {
  return rows <= (weight_elems >= GEMM_JIT_LARGE_MULTIPLY_ADDS ? GEMM_JIT_LARGE_MAX_ROWS
                                                                 : GEMM_JIT_MAX_ROWS);
}

/* Whether `rows` rows cut into `threads` blocks of whole tiles leave each
 * past the few rows that read weights in place: the smallest block, of
 * tiles / threads tiles at least, is cut at rows when last. */
static int FN(rows_split_fits)(int64_t rows, int64_t threads) {
  return threads > 1 &&
         ((rows + GEMM_MR - 1) / GEMM_MR / threads - 1) * GEMM_MR >= GEMM_UNPACKED_MAX_ROWS;
}

/* Rows a block of an op that packs its weights just in time
 * (packs_just_in_time): all of them, its products' columns then split over
 * the threads in stages (splits_columns), unless its weights are small (under
 * GEMM_JIT_LARGE_MULTIPLY_ADDS a row) and each of `threads` blocks of whole
 * tiles would be past the few rows that read weights in place: then a
 * thread's share. Each thread then packs every weight block for its rows,
 * where the column split packs each once, but no stage waits for a thread
 * that another process holds up, no core reads the inputs another wrote, and
 * there is no stage packing them. Measured on a 2-vCPU Zen 4 VM (C harness,
 * split/blocks builds alternating call by call in one process, 2 OpenMP
 * threads, wall time; machine loaded, load average 2-4 on 2 cores): the
 * forward of bench train_step (256 x 512^3 ReLU saving for backward), median
 * of 300 rounds' ratios 0.90-0.92x over three runs, fastest call 2.2-2.4 ms
 * against 2.3-3.4; a probe of the split's fastest call had each stage's
 * product take 0.82-0.94 ms a thread, where a thread's share of one thread's
 * product is 0.74 ms (the blocks ran 0.74), and each input-packing stage
 * 0.04-0.13 ms. The few rows stay one block: the transposed kernel puts rows
 * in vector lanes, and splitting them would leave lanes empty. */
static int64_t FN(jit_block_rows)(int64_t rows, int64_t threads, int64_t weight_elems) {
  if (weight_elems >= GEMM_JIT_LARGE_MULTIPLY_ADDS || !FN(rows_split_fits)(rows, threads)) {
    return rows;
  }
  return ((rows + GEMM_MR - 1) / GEMM_MR + threads - 1) / threads * GEMM_MR;
}

/* A chain's multiply-adds a row: its layers' weights, widths[l + 1] x
 * widths[l] each; -1 past int64_t. */
static int64_t FN(chain_weight_elems)(const int64_t *widths, int64_t n_layers) {
  int64_t elems = 0, layer;
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!fmlp_checked_mul(widths[l + 1], widths[l], &layer) ||
        !fmlp_checked_add(elems, layer, &elems)) {
      return -1;
    }
  }
  return elems;
}

static int64_t FN(choose_block_rows)(int64_t rows, int64_t n_threads, int64_t weight_elems,
                                     int64_t activation_elems_per_row, int64_t least_rows) {
  const int64_t threads = n_threads > 0 ? n_threads : 1;
  if (FN(packs_just_in_time)(rows, weight_elems)) {
    return FN(jit_block_rows)(rows, threads, weight_elems);
  }
  const int64_t per_thread = (rows + threads - 1) / threads;
  /* Several blocks a thread, so the task queue can balance a slowed thread;
   * each block re-reads the weights, a few percent at these sizes. */
  const int64_t balanced = per_thread / TASKS_PER_THREAD / GEMM_MC * GEMM_MC;
  int64_t block = threads > 1 && balanced > GEMM_MC ? balanced : per_thread;
  const int past_l2 = weight_elems * (int64_t)sizeof(REAL) > fmlp_cpu_l2_bytes();
  if (past_l2 && block < least_rows) block = least_rows;
  if (past_l2 && activation_elems_per_row > 0 && block > HIDDEN_MOST_BLOCK_ROWS) {
    block = HIDDEN_MOST_BLOCK_ROWS;
  }
  if (activation_elems_per_row > 0 && !past_l2) {
    const int64_t fit =
        ACTIVATION_BLOCK_BYTES / (activation_elems_per_row * (int64_t)sizeof(REAL));
    const int64_t aligned = fit / GEMM_MC * GEMM_MC;
    block = aligned > GEMM_MC ? aligned : GEMM_MC;
  }
  /* Each block pays fixed costs (a queue pop, its loop and packing setup):
   * at least BLOCK_MIN_MULTIPLY_ADDS of work each. 1024 x 32 -> 64 on 2
   * threads ran 35 us in 12 blocks, 32.7 us in 2 (measured when every block
   * also allocated its own scratch). */
  if (weight_elems > 0 && block < BLOCK_MIN_MULTIPLY_ADDS / weight_elems) {
    block = BLOCK_MIN_MULTIPLY_ADDS / weight_elems;
  }
  if (block > per_thread) block = per_thread;
  return block > 0 ? block : 1;
}

/* Huge-page advice for an output of rows rows of `width` values `stride`
 * apart, before its first write (see fmlp_advise_huge_pages). */
static void FN(advise_output)(void *data, int64_t rows, int64_t width, int64_t stride) {
  int64_t elems;
  if (rows > 0 && fmlp_checked_mul(rows - 1, stride, &elems) &&
      fmlp_checked_add(elems, width, &elems) &&
      fmlp_checked_mul(elems, (int64_t)sizeof(STORE), &elems)) {
    fmlp_advise_huge_pages(data, elems);
  }
}

/* Frees what prepare_weight packed, not the caller's packed copy. */
static void FN(release_weight)(FN(packed_weight) *w, const void *prepacked) {
  if (w->data != prepacked) free(w->data);
}

/* w [n, k] for an op over `rows` rows: the caller's packed copy (prepacked,
 * fmlp_cpu_pack_weight's, or NULL) wherever the op would not read w in
 * place, whatever the rows; else packed ahead, or left where it is (read in
 * place, or packed just in time: packs_just_in_time's answer). */
static fmlp_status FN(prepare_weight)(fmlp_input w, int64_t n, int64_t k, int64_t rows,
                                      int just_in_time, const void *prepacked,
                                      const fmlp_threading *threading,
                                      FN(packed_weight) *packed) {
  if (prepacked != NULL && !FN(weight_stays_unpacked)(w, rows) && n > 0 && k > 0) {
    /* read only, as every packed weight is: the type has one pointer for both */
    *packed = (FN(packed_weight)){.data = (REAL *)prepacked, .source = w, .n = n, .k = k};
    return FMLP_OK;
  }
  if (just_in_time) {
    *packed = (FN(packed_weight)){.data = NULL, .source = w, .n = n, .k = k};
    return FMLP_OK;
  }
  return FN(pack_weight)(w, n, k, rows, threading, NULL, packed);
}

/* REALs in a cache line: task scratch starts on one. */
#define CACHE_LINE_REALS ((int64_t)(64 / sizeof(REAL)))

/* The larger of two element counts; -1 when either is (overflowed). */
static int64_t FN(larger_elems)(int64_t a, int64_t b) {
  return a < 0 || b < 0 ? -1 : a > b ? a : b;
}

/* Elements of the weight blocks of a product of `weights` weights like w
 * multiplied into `rows` rows, packed just in time; 0 for a weight packed
 * ahead, read in place or empty (nothing to pack). */
static int64_t FN(jit_block_elems)(const FN(packed_weight) *w, int64_t rows, int64_t weights) {
  if (w->n == 0 || w->k == 0 || w->data != NULL || FN(reads_weight_in_place)(w, rows)) return 0;
  return FN(weight_block_elems)(w->k, weights);
}

/* Elements of one task's scratch for products over up to `rows` rows and K
 * up to max_k (0: their inputs packed whole and shared, shares_input), with
 * weight blocks of up to block_elems elements (the largest jit_block_elems
 * of its products; 0: none packed just in time) starting *weight_block_at
 * elements in (-1: none); -1 on overflow. Whole cache lines, so that
 * tasks' scratch never shares one. */
static int64_t FN(task_pack_elems)(int64_t rows, int64_t max_k, int64_t block_elems,
                                   int64_t *weight_block_at) {
  int64_t at = FN(input_pack_elems)(rows, max_k), total;
  *weight_block_at = -1;
  if (block_elems == 0 || at < 0) return at; /* no weight packed just in time */
  const int64_t whole = FN(whole_input_pack_elems)(rows, max_k);
  if (whole < 0 || block_elems < 0) return -1;
  if (whole > at) at = whole;
  at = (at + CACHE_LINE_REALS - 1) / CACHE_LINE_REALS * CACHE_LINE_REALS;
  if (!fmlp_checked_add(at, block_elems + CACHE_LINE_REALS - 1, &total)) return -1;
  *weight_block_at = at;
  return total / CACHE_LINE_REALS * CACHE_LINE_REALS;
}

/* Where a task's weight blocks go in its scratch (NULL: weights packed ahead). */
static REAL *FN(weight_block_in)(REAL *task_pack, int64_t weight_block_at) {
  return weight_block_at >= 0 ? task_pack + weight_block_at : NULL;
}

static STORE *FN(rows_at)(void *base, int64_t row, int64_t stride) {
  return base == NULL ? NULL : (STORE *)base + row * stride;
}

/* ---- row blocks as tasks ---- */

/* An op's row blocks: each worker allocates its scratch once (an input pack
 * and scratch_matrices matrices of scratch_rows x scratch_cols elements of
 * scratch_elem_bytes each: STOREs, or REALs where a chain hands rows on in
 * lanes layout), then takes
 * blocks from next_block and runs them through run_block. */
typedef struct {
  int64_t rows, n_blocks, block_rows; /* block_rows: the most rows one block holds */
  int64_t input_pack_elems, scratch_matrices, scratch_rows, scratch_cols, scratch_elem_bytes;
  void (*run_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack, void *scratch);
  const void *op;
  atomic_llong next_block;
  atomic_int status;
} FN(row_blocks);

/* Blocks of whole MR-row tiles, about target_rows each, as even as they can
 * be and as many as a multiple of the threads, so threads taking blocks in
 * turn finish together: 256 rows on 2 threads as 48-row blocks would leave
 * one thread 144 rows and the other 112 (measured 0.735 vs 0.697 ms for a
 * 512 -> 512 layer). */
static void FN(partition_rows)(FN(row_blocks) *blocks, int64_t weight_elems,
                               int64_t activation_elems_per_row, int64_t least_rows,
                               const fmlp_threading *threading) {
  const int64_t n_threads = threading != NULL ? threading->n_threads : 1;
  const int64_t rows = blocks->rows, tiles = (rows + GEMM_MR - 1) / GEMM_MR;
  const int64_t target_rows =
      FN(choose_block_rows)(rows, n_threads, weight_elems, activation_elems_per_row,
                            least_rows);
  int64_t n = (rows + target_rows - 1) / target_rows;
  if (n > 1 && n_threads > 1) n = (n + n_threads - 1) / n_threads * n_threads;
  if (n > tiles) n = tiles;
  blocks->n_blocks = n > 0 ? n : 1;
  const int64_t most = (tiles + blocks->n_blocks - 1) / blocks->n_blocks * GEMM_MR;
  blocks->block_rows = n <= 1 || most > rows ? rows : most;
  blocks->scratch_rows = blocks->block_rows;
}

/* Part `part` of `parts` near-equal slices of [0, total) made of whole units
 * (the last one may be cut at total): units [part * q + min(part, r), ...)
 * for q, r = units / parts, units % parts. */
static void FN(even_split)(int64_t total, int64_t unit, int64_t parts, int64_t part,
                           int64_t *start, int64_t *count) {
  const int64_t units = (total + unit - 1) / unit;
  const int64_t q = units / parts, r = units % parts;
  const int64_t first = part * q + (part < r ? part : r), size = q + (part < r ? 1 : 0);
  const int64_t begin = first * unit, end = (first + size) * unit;
  *start = begin < total ? begin : total;
  *count = (end < total ? end : total) - *start;
}

static void FN(row_block_worker)(void *context, int64_t begin, int64_t end) {
  FN(row_blocks) *blocks = context;
  (void)begin; /* workers are interchangeable: blocks come from next_block */
  (void)end;
  REAL *input_pack = fmlp_alloc_scratch(blocks->input_pack_elems, sizeof(REAL));
  void *scratch = fmlp_alloc_matrices(blocks->scratch_matrices, blocks->scratch_rows,
                                      blocks->scratch_cols, blocks->scratch_elem_bytes);
  if (input_pack == NULL || scratch == NULL) {
    atomic_store(&blocks->status, FMLP_ERR_OUT_OF_MEMORY);
  } else {
    for (;;) {
      const int64_t block = (int64_t)atomic_fetch_add(&blocks->next_block, 1);
      if (block >= blocks->n_blocks) break;
      int64_t r0, count;
      FN(even_split)(blocks->rows, GEMM_MR, blocks->n_blocks, block, &r0, &count);
      blocks->run_block(blocks->op, r0, count, input_pack, scratch);
    }
  }
  free(scratch);
  free(input_pack);
}

/* Runs every block, on threads when rows x weight_elems multiply-adds pay for it. */
static fmlp_status FN(run_row_blocks)(FN(row_blocks) *blocks, int64_t weight_elems,
                                      const fmlp_threading *threading) {
  if (blocks->input_pack_elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  atomic_init(&blocks->next_block, 0);
  atomic_init(&blocks->status, FMLP_OK);
  int64_t multiply_adds = INT64_MAX;
  if (!fmlp_checked_mul(blocks->rows, weight_elems, &multiply_adds)) multiply_adds = INT64_MAX;
  const fmlp_threading *workers =
      FN(threading_for)(threading, multiply_adds, PARALLEL_MIN_MULTIPLY_ADDS);
  const int64_t n_workers = workers != NULL && workers->n_threads < blocks->n_blocks
                                ? workers->n_threads
                                : blocks->n_blocks;
  FN(run_tasks)(workers, n_workers, blocks, FN(row_block_worker));
  return (fmlp_status)atomic_load(&blocks->status);
}

/* ---- one row block: products split by columns ---- */

/* An op's products are split by columns from this many multiply-adds (~10 us
 * on one core) on. Measured, 16 x (256 -> 256 -> 256 -> 256) ReLU on 2
 * threads: 86 us serial, 58 us split (both through torch.ops). */
#define COLUMN_SPLIT_MIN_MULTIPLY_ADDS ((int64_t)1 << 19)

/* Up to GEMM_JIT_MAX_ROWS rows make one row block, which one thread would
 * run alone; its products then run as stages whose output columns are split
 * over `threading`'s threads instead, task t packing its inputs (and its
 * weight blocks, see task_pack_elems) into packs + t * pack_elems.
 * threading NULL: never split. */
typedef struct {
  const fmlp_threading *threading;
  REAL *packs;
  int64_t pack_elems;
} FN(column_split);

/* Whether an op partitioned into `blocks` with weight_elems multiply-adds a
 * row splits its one row block's products by columns over threading. */
static int FN(splits_columns)(const FN(row_blocks) *blocks, int64_t weight_elems,
                              const fmlp_threading *threading) {
  int64_t multiply_adds;
  if (!fmlp_checked_mul(blocks->rows, weight_elems, &multiply_adds)) multiply_adds = INT64_MAX;
  return blocks->n_blocks == 1 && FN(packs_just_in_time)(blocks->rows, weight_elems) &&
         threading != NULL && threading->n_threads > 1 &&
         multiply_adds >= COLUMN_SPLIT_MIN_MULTIPLY_ADDS;
}

/* Whether a row block of `rows` rows whose products are split by columns
 * (`split`) packs each product's input once, shared by the tasks: each task
 * packs its share of the input's panels in a stage of its own before the
 * product (shared_input), where otherwise every task packs the whole input
 * for its columns (2 threads pack it twice; 256 x 3072 bfloat16 is 1.5 MB).
 * Few rows read their weights in place and pack no input. */
static int FN(shares_input)(int split, int64_t rows) {
  return split && rows > GEMM_UNPACKED_MAX_ROWS;
}

/* Allocates a shared input of `elems` elements for an op whose inputs are
 * shared (shares_input), else sets *shared NULL. */
static fmlp_status FN(alloc_shared_input)(int share, int64_t elems, REAL **shared) {
  *shared = NULL;
  if (!share) return FMLP_OK;
  if (elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  *shared = fmlp_alloc_scratch(elems, sizeof(REAL));
  return *shared != NULL ? FMLP_OK : FMLP_ERR_OUT_OF_MEMORY;
}

/* Task `task` of n_tasks's share of the panels of `in` packed whole for a
 * product of `weights` weights over K = k (shared_input_elems) into shared. */
static void FN(pack_shared_input_part)(fmlp_input in, int64_t rows, int64_t k, int64_t weights,
                                       int64_t task, int64_t n_tasks, REAL *shared) {
  int64_t first, count;
  FN(even_split)(FN(shared_input_units)(rows, k, weights), 1, n_tasks, task, &first, &count);
  for (int64_t unit = first; unit < first + count; ++unit) {
    FN(pack_shared_input_panel)(in, rows, k, weights, unit, shared);
  }
}

/* The split for an op partitioned into `blocks` (input_pack_elems set) with
 * weight_elems multiply-adds a row (see splits_columns). Split, its tasks
 * pack into the split's scratch, so the row block takes none
 * (blocks->input_pack_elems 0). */
static fmlp_status FN(column_split_for)(FN(row_blocks) *blocks, int64_t weight_elems,
                                        const fmlp_threading *threading,
                                        FN(column_split) *split) {
  *split = (FN(column_split)){NULL, NULL, 0};
  if (blocks->input_pack_elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  if (!FN(splits_columns)(blocks, weight_elems, threading)) return FMLP_OK;
  split->pack_elems = blocks->input_pack_elems;
  split->packs = fmlp_alloc_matrices(threading->n_threads, 1, split->pack_elems, sizeof(REAL));
  if (split->packs == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  split->threading = threading;
  blocks->input_pack_elems = 0;
  return FMLP_OK;
}

/* Task `task` of n_tasks's share [*j0, *j0 + *count) of w's n output
 * columns multiplied into `rows` rows: whole slices of MR weight rows where
 * the weight is read in place (the transposed kernels' tile), else of NR
 * (whole panels). */
static void FN(column_part)(const FN(packed_weight) *w, int64_t rows, int64_t task,
                            int64_t n_tasks, int64_t *j0, int64_t *count) {
  FN(even_split)(w->n, FN(reads_weight_in_place)(w, rows) ? GEMM_MR : GEMM_NR, n_tasks, task,
                 j0, count);
}

/* gemm_rows_shared for output columns [j0, j0 + count) (see column_part),
 * from `in` or, when set, from in_lanes (see lanes_width); packed_x: `in`
 * packed whole (gemm_rows_shared) or NULL. */
static void FN(gemm_rows_columns)(fmlp_input in, const REAL *in_lanes, const REAL *packed_x,
                                  int64_t rows, const FN(packed_weight) *w, int64_t j0,
                                  int64_t count, const STORE *bias, fmlp_activation activation,
                                  FN(product_out) out, REAL *input_pack, REAL *weight_block) {
  if (count == 0) return;
  const FN(packed_weight) part = FN(weight_columns)(w, j0, count);
  const STORE *part_bias = bias != NULL ? bias + j0 : NULL;
  STORE *part_pre = out.pre != NULL ? out.pre + j0 : NULL;
#if FMLP_TRANSPOSED_KERNELS
  if (in_lanes != NULL || out.c_lanes != NULL) {
    const FN(product_out) part_out = {
        .c = out.c != NULL ? out.c + j0 : NULL,
        .c_lanes = out.c_lanes != NULL ? out.c_lanes + j0 * FN(lanes_width)(rows) : NULL,
        .pre = part_pre,
        .ldc = out.ldc,
        .pre_stride = out.pre_stride};
    FN(transposed_rows)(in, in_lanes, rows, &part, part_bias, activation, part_out, input_pack);
    return;
  }
#else
  (void)in_lanes; /* lanes only come with the SIMD kernels */
#endif
  FN(gemm_rows_shared)(in, packed_x, rows, &part, part_bias, activation, out.c + j0, out.ldc,
                       part_pre, out.pre_stride, input_pack, weight_block);
}

/* gemm_rows_columns for task `task` of n_tasks's share of the output columns. */
static void FN(gemm_rows_part)(fmlp_input in, const REAL *in_lanes, const REAL *packed_x,
                               int64_t rows, const FN(packed_weight) *w, const STORE *bias,
                               fmlp_activation activation, FN(product_out) out, int64_t task,
                               int64_t n_tasks, REAL *input_pack, REAL *weight_block) {
  int64_t j0, count;
  FN(column_part)(w, rows, task, n_tasks, &j0, &count);
  FN(gemm_rows_columns)(in, in_lanes, packed_x, rows, w, j0, count, bias, activation, out,
                        input_pack, weight_block);
}

/* Part `task` of n_tasks of stage `stage` of a row block's products. */
typedef void (*FN(stage_part_fn))(const void *block, int64_t stage, int64_t task,
                                  int64_t n_tasks, REAL *input_pack);

/* Stages as tasks numbered stage by stage, claimed in that order from the
 * task queue; a task starts once every task of the stages before it is done.
 * A waiting thread so only ever waits for tasks that running threads have
 * claimed: one thread alone, or threads that start late, still finish. */
typedef struct {
  const FN(column_split) *split;
  FN(stage_part_fn) part;
  const void *block;
  int64_t n_tasks; /* a stage */
  atomic_llong done;
} FN(column_stages);

static void FN(column_stage_task)(void *context, int64_t begin, int64_t end) {
  FN(column_stages) *stages = context;
  const int64_t n = stages->n_tasks;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t stage = task / n, part = task % n;
    for (int64_t spin = 0; atomic_load_explicit(&stages->done, memory_order_acquire) < stage * n;
         ++spin) {
      fmlp_spin_wait_step(spin);
    }
    stages->part(stages->block, stage, part, n,
                 stages->split->packs + part * stages->split->pack_elems);
    atomic_fetch_add_explicit(&stages->done, 1, memory_order_release);
  }
}

/* Stage after stage of a row block's products: with `split`, in one parallel
 * region, as a fork/join costs ~1.5 us against the ~9 us that splitting a
 * 16 x 256 -> 256 product over 2 threads saves (16 x 256^4 ReLU, below
 * autograd: 47.3 us with a fork/join per product, 46.0 us in one region);
 * otherwise serially, packing into input_pack. */
static void FN(run_column_stages)(const FN(column_split) *split, int64_t n_stages,
                                  FN(stage_part_fn) part, const void *block,
                                  REAL *input_pack) {
  if (split->threading == NULL) {
    for (int64_t stage = 0; stage < n_stages; ++stage) part(block, stage, 0, 1, input_pack);
    return;
  }
  FN(column_stages) stages = {
      .split = split, .part = part, .block = block, .n_tasks = split->threading->n_threads};
  atomic_init(&stages.done, 0);
  FN(run_tasks)(split->threading, n_stages * stages.n_tasks, &stages, FN(column_stage_task));
}

/* ---- layer chains: Linear (one layer) and MLP ---- */

typedef struct {
  const fmlp_cpu_chain_args *args;
  const FN(packed_weight) *packed;
  int64_t scratch_rows, max_hidden, scratch_elem_bytes;
  int64_t weight_block_at; /* in a task's input pack (task_pack_elems) */
  FN(column_split) split;
  REAL *shared_input; /* each layer's input packed whole (shares_input), or NULL */
} FN(chain_job);

/* One row block of a chain: its rows and where each layer's output goes. */
typedef struct {
  const FN(chain_job) *job;
  int64_t r0, rows;
  /* scratch_rows x max_hidden elements each (chain_scratch_elem_bytes), for
   * hidden outputs not saved: row-major STOREs, or REALs in lanes layout */
  void *ping_pong[2];
} FN(chain_rows);

/* Whether layer l leaves its output to layer l + 1 in lanes layout: both
 * read their weights in place (few rows) and nobody needs it row-major. */
static int FN(hands_off_lanes)(const FN(chain_rows) *b, int64_t l) {
#if FMLP_TRANSPOSED_KERNELS
  const fmlp_cpu_chain_args *a = b->job->args;
  const FN(packed_weight) *packed = b->job->packed;
  if (l + 1 >= a->n_layers || !FN(lanes_possible)(b->rows)) return 0;
  if (a->saved_hidden != NULL && a->saved_hidden[l] != NULL) return 0;
  return FN(reads_weight_in_place)(&packed[l], b->rows) &&
         FN(reads_weight_in_place)(&packed[l + 1], b->rows) && a->widths[l] > 0 &&
         a->widths[l + 1] > 0 && a->widths[l + 2] > 0;
#else
  (void)b;
  (void)l;
  return 0;
#endif
}

/* Layer l's row-major output for the block, and its row stride. */
static STORE *FN(chain_output)(const FN(chain_rows) *b, int64_t l, int64_t *ldc) {
  const fmlp_cpu_chain_args *a = b->job->args;
  *ldc = a->widths[l + 1];
  if (l == a->n_layers - 1) {
    *ldc = a->y_row_stride;
    return FN(rows_at)(a->y, b->r0, a->y_row_stride);
  }
  if (a->saved_hidden != NULL && a->saved_hidden[l] != NULL) {
    return FN(rows_at)(a->saved_hidden[l], b->r0, *ldc);
  }
  return b->ping_pong[l % 2];
}

/* Stage l: task `task`'s columns of layer l; with a shared input, stage 2l
 * its share of packing layer l's input and stage 2l + 1 its columns. */
static void FN(chain_layer_part)(const void *block, int64_t stage, int64_t task,
                                 int64_t n_tasks, REAL *input_pack) {
  const FN(chain_rows) *b = block;
  const fmlp_cpu_chain_args *a = b->job->args;
  REAL *shared = b->job->shared_input;
  const int64_t l = shared != NULL ? stage / 2 : stage, width = a->widths[l + 1];
  fmlp_input in = {(const STORE *)a->x.data + b->r0 * a->x.row_stride, a->x.row_stride,
                   a->x.col_stride};
  const REAL *in_lanes = NULL;
  if (l > 0 && FN(hands_off_lanes)(b, l - 1)) {
    in_lanes = b->ping_pong[(l - 1) % 2];
  } else if (l > 0) {
    int64_t in_stride;
    in = (fmlp_input){FN(chain_output)(b, l - 1, &in_stride), in_stride, 1};
  }
  if (shared != NULL && stage % 2 == 0) {
    FN(pack_shared_input_part)(in, b->rows, a->widths[l], 1, task, n_tasks, shared);
    return;
  }
  FN(product_out) out = {
      .pre = a->saved_pre != NULL ? FN(rows_at)(a->saved_pre[l], b->r0, width) : NULL,
      .pre_stride = width};
  if (FN(hands_off_lanes)(b, l)) {
    out.c_lanes = b->ping_pong[l % 2];
  } else {
    out.c = FN(chain_output)(b, l, &out.ldc);
  }
  FN(gemm_rows_part)(in, in_lanes, shared, b->rows, &b->job->packed[l],
                     a->biases != NULL ? a->biases[l] : NULL,
                     l == a->n_layers - 1 ? a->final_activation : a->hidden_activation, out,
                     task, n_tasks, input_pack,
                     FN(weight_block_in)(input_pack, b->job->weight_block_at));
}

/* scratch: two scratch_rows x max_hidden matrices the hidden layers ping-pong through */
static void FN(chain_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack,
                            void *scratch) {
  const FN(chain_job) *job = op;
  const int64_t matrix_bytes = job->scratch_rows * job->max_hidden * job->scratch_elem_bytes;
  const FN(chain_rows) block = {job, r0, rows, {scratch, (char *)scratch + matrix_bytes}};
  FN(run_column_stages)(&job->split, job->args->n_layers * (job->shared_input != NULL ? 2 : 1),
                        FN(chain_layer_part), &block, input_pack);
}

/* Bytes of an element of a chain's hidden scratch: a REAL where some row
 * block may hand its hidden outputs on in lanes layout (hands_off_lanes),
 * else a STORE (half a REAL's bytes in bfloat16: the row-major outputs of
 * many rows never need more). */
static int64_t FN(chain_scratch_elem_bytes)(const FN(row_blocks) *blocks) {
#if FMLP_TRANSPOSED_KERNELS
  for (int64_t block = 0; block < blocks->n_blocks; ++block) {
    int64_t r0, count;
    FN(even_split)(blocks->rows, GEMM_MR, blocks->n_blocks, block, &r0, &count);
    if (FN(lanes_possible)(count)) return (int64_t)sizeof(REAL);
  }
#else
  (void)blocks; /* lanes only come with the SIMD kernels */
#endif
  return (int64_t)sizeof(STORE);
}

/* A chain's row blocks, its weights (weight_elems multiply-adds a row)
 * packed (or read in place) in packed[l]. */
static fmlp_status FN(run_chain)(const fmlp_cpu_chain_args *a, const FN(packed_weight) *packed,
                                 int64_t weight_elems, const fmlp_threading *threading) {
  int64_t max_hidden = 0, max_k = 0, row_elems = a->widths[0];
  int64_t block_elems = 0, shared_elems = 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    row_elems += a->widths[l + 1];
    if (l + 1 < a->n_layers && a->widths[l + 1] > max_hidden) max_hidden = a->widths[l + 1];
    if (a->widths[l] > max_k) max_k = a->widths[l];
    block_elems = FN(larger_elems)(block_elems, FN(jit_block_elems)(&packed[l], a->rows, 1));
    shared_elems =
        FN(larger_elems)(shared_elems, FN(shared_input_elems)(a->rows, a->widths[l], 1));
  }
  FN(row_blocks) blocks = {.rows = a->rows, .scratch_matrices = 2, .scratch_cols = max_hidden,
                           .run_block = FN(chain_block)};
  FN(partition_rows)(&blocks, weight_elems, a->n_layers > 1 ? row_elems : 0,
                     CHAIN_LEAST_BLOCK_ROWS, threading);
  /* room for a few rows' hidden outputs in lanes layout, NR wide */
  if (blocks.scratch_rows < GEMM_NR) blocks.scratch_rows = GEMM_NR;
  blocks.scratch_elem_bytes = FN(chain_scratch_elem_bytes)(&blocks);
  FN(chain_job) job = {.args = a, .packed = packed, .scratch_rows = blocks.scratch_rows,
                       .max_hidden = max_hidden, .scratch_elem_bytes = blocks.scratch_elem_bytes};
  const int share =
      FN(shares_input)(FN(splits_columns)(&blocks, weight_elems, threading), a->rows);
  blocks.input_pack_elems = FN(task_pack_elems)(blocks.block_rows, share ? 0 : max_k,
                                                block_elems, &job.weight_block_at);
  blocks.op = &job;
  fmlp_status status = FN(alloc_shared_input)(share, shared_elems, &job.shared_input);
  if (status == FMLP_OK) {
    status = FN(column_split_for)(&blocks, weight_elems, threading, &job.split);
  }
  if (status == FMLP_OK) status = FN(run_row_blocks)(&blocks, weight_elems, threading);
  free(job.split.packs);
  free(job.shared_input);
  return status;
}

/* Layer l's weight as the caller packed it, or NULL. */
static const void *FN(layer_prepacked)(const fmlp_cpu_chain_args *a, int64_t l) {
  return a->packed_weights != NULL ? a->packed_weights[l] : NULL;
}

fmlp_status FN(fmlp_cpu_chain)(const fmlp_cpu_chain_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
  FN(advise_output)(a->y, a->rows, a->widths[a->n_layers], a->y_row_stride);
  for (int64_t l = 0; l < a->n_layers; ++l) {
    const int64_t width = a->widths[l + 1];
    if (a->saved_pre != NULL) FN(advise_output)(a->saved_pre[l], a->rows, width, width);
    /* saved_hidden has no entry for the last layer */
    if (a->saved_hidden != NULL && l + 1 < a->n_layers) {
      FN(advise_output)(a->saved_hidden[l], a->rows, width, width);
    }
  }
  const int64_t weight_elems = FN(chain_weight_elems)(a->widths, a->n_layers);
  if (weight_elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  const int just_in_time = FN(packs_just_in_time)(a->rows, weight_elems);
  FN(packed_weight) *packed = calloc((size_t)a->n_layers, sizeof(*packed));
  if (packed == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  fmlp_status status = FMLP_OK;
  for (int64_t l = 0; l < a->n_layers && status == FMLP_OK; ++l) {
    status = FN(prepare_weight)(a->weights[l], a->widths[l + 1], a->widths[l], a->rows,
                                just_in_time, FN(layer_prepacked)(a, l), threading, &packed[l]);
  }
  if (status == FMLP_OK) status = FN(run_chain)(a, packed, weight_elems, threading);
  for (int64_t l = 0; l < a->n_layers; ++l) {
    FN(release_weight)(&packed[l], FN(layer_prepacked)(a, l));
  }
  free(packed);
  return status;
}

/* ---- the gated block ---- */

typedef struct {
  const fmlp_cpu_gated_args *args;
  FN(packed_weight) gate, up, down;
  int64_t block_rows;
  int gate_up_in_scratch; /* see gate_up_in_scratch */
  int64_t weight_block_at; /* in a task's input pack (task_pack_elems) */
  FN(column_split) split;
  REAL *shared_input; /* x, then product, packed whole (shares_input), or NULL */
} FN(gated_job);

/* product = act(gate) * up, one row of n values, formed in REAL a span at a
 * time and rounded once */
#define GATE_PRODUCT_SPAN 256
static void FN(gate_product_row)(const STORE *gate, const STORE *up, int64_t n,
                                 fmlp_activation activation, STORE *product) {
  for (int64_t j0 = 0; j0 < n; j0 += GATE_PRODUCT_SPAN) {
    const int64_t count = n - j0 < GATE_PRODUCT_SPAN ? n - j0 : GATE_PRODUCT_SPAN;
    REAL span[GATE_PRODUCT_SPAN];
    for (int64_t j = 0; j < count; ++j) span[j] = to_real(gate[j0 + j]);
    FN(activate_span)(span, count, activation);
    for (int64_t j = 0; j < count; ++j) {
      product[j0 + j] = to_store(span[j] * to_real(up[j0 + j]));
    }
  }
}

/* One row block of the gated block: its input and its gate, up and product. */
typedef struct {
  const FN(gated_job) *job;
  int64_t r0, rows;
  fmlp_input in;
  STORE *gate, *up, *product; /* rows x hidden, row stride hidden */
} FN(gated_rows);

/* Whether gate and up multiply `rows` rows as one product of 2 weights
 * (the gated micro-kernel, where neither is read in place), else one
 * weight at a time. */
static int FN(gate_up_together)(const FN(gated_job) *job, int64_t rows) {
#if FMLP_GATED_KERNEL
  return !FN(reads_weight_in_place)(&job->gate, rows) &&
         !FN(reads_weight_in_place)(&job->up, rows) && job->args->dim > 0;
#else
  (void)job;
  (void)rows;
  return 0;
#endif
}

/* Stage 0, task `task`'s columns of the product (gate_up_together or one
 * weight at a time); stage 1, of the down projection. With a shared input,
 * each is the odd stage after one packing its share of the product's input
 * (stages 0 and 2). */
static void FN(gated_part)(const void *block, int64_t stage, int64_t task, int64_t n_tasks,
                           REAL *input_pack) {
  const FN(gated_rows) *b = block;
  const FN(gated_job) *job = b->job;
  const fmlp_cpu_gated_args *a = job->args;
  const int64_t h = a->hidden;
  const fmlp_input product = {b->product, h, 1};
  REAL *weight_block = FN(weight_block_in)(input_pack, job->weight_block_at);
  REAL *shared = job->shared_input;
  if (shared != NULL && stage == 0) {
    FN(pack_shared_input_part)(b->in, b->rows, a->dim,
                               FN(gate_up_together)(job, b->rows) ? 2 : 1, task, n_tasks,
                               shared);
    return;
  }
  if (shared != NULL && stage == 2) {
    FN(pack_shared_input_part)(product, b->rows, h, 1, task, n_tasks, shared);
    return;
  }
  if (shared != NULL) stage /= 2;
  if (stage == 1) {
    const FN(product_out) out = {.c = FN(rows_at)(a->y, b->r0, a->y_row_stride),
                                 .ldc = a->y_row_stride};
    FN(gemm_rows_part)(product, NULL, shared, b->rows, &job->down, a->bias_down, FMLP_ACT_NONE,
                       out, task, n_tasks, input_pack, weight_block);
    return;
  }
  /* gate and up cut alike, so the task's product columns need only its own */
  int64_t j0, count;
  FN(column_part)(&job->gate, b->rows, task, n_tasks, &j0, &count);
#if FMLP_GATED_KERNEL
  if (FN(gate_up_together)(job, b->rows)) {
    if (count == 0) return;
    const FN(packed_weight) gate = FN(weight_columns)(&job->gate, j0, count),
                            up = FN(weight_columns)(&job->up, j0, count);
    const STORE *bias_gate = a->bias_gate, *bias_up = a->bias_up;
    const int save = a->saved_gate != NULL || a->saved_up != NULL;
    FN(gemm_gated_rows)(b->in, shared, b->rows, &gate, &up,
                        bias_gate != NULL ? bias_gate + j0 : NULL,
                        bias_up != NULL ? bias_up + j0 : NULL, a->activation, b->gate + j0,
                        b->up + j0, b->product + j0, h, save, input_pack, weight_block);
    return;
  }
#endif
  FN(gemm_rows_columns)(b->in, NULL, shared, b->rows, &job->gate, j0, count, a->bias_gate,
                        FMLP_ACT_NONE, (FN(product_out)){.c = b->gate, .ldc = h}, input_pack,
                        weight_block);
  FN(gemm_rows_columns)(b->in, NULL, shared, b->rows, &job->up, j0, count, a->bias_up,
                        FMLP_ACT_NONE, (FN(product_out)){.c = b->up, .ldc = h}, input_pack,
                        weight_block);
  for (int64_t i = 0; i < b->rows && count > 0; ++i) {
    FN(gate_product_row)(b->gate + i * h + j0, b->up + i * h + j0, count, a->activation,
                         b->product + i * h + j0);
  }
}

/* Whether the blocks' gate and up go through their scratch: where neither is
 * saved and the gated micro-kernel forms the product in its registers over
 * one K block (every block at least least_rows rows), nothing ever writes
 * them, and a block's scratch is its product alone. Allocated anyway, the
 * two unused matrices made the scratch large enough to be advised huge pages
 * (memory.h): at 256 tokens, bfloat16 768 -> 3072 -> 768 GeGLU on two
 * threads, 4.5 MiB of them zeroed every call (perf: clear_page_erms 7% of
 * the samples, the other thread spinning at the stage's end another 6%), and
 * in about half the processes the call's median read 1.3-1.6x the training
 * twin's, which writes more. */
static int FN(gate_up_in_scratch)(const FN(gated_job) *job, int64_t least_rows) {
  const fmlp_cpu_gated_args *a = job->args;
  if (a->saved_gate != NULL || a->saved_up != NULL) {
    return a->saved_gate == NULL || a->saved_up == NULL;
  }
  return !FN(gate_up_together)(job, least_rows) || FN(choose_blocks)(a->dim, 2, 0).kc < a->dim;
}

/* scratch: block_rows x hidden matrices, the product's and, where
 * gate_up_in_scratch, gate's and up's (those saved are written in place) */
static void FN(gated_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack,
                            void *scratch) {
  const FN(gated_job) *job = op;
  const fmlp_cpu_gated_args *a = job->args;
  const int64_t h = a->hidden, stride = job->block_rows * h;
  STORE *const product = a->saved_product != NULL ? FN(rows_at)(a->saved_product, r0, h)
                                                  : scratch;
  /* unused where not in scratch: they never hold anything then */
  STORE *const gate = job->gate_up_in_scratch ? (STORE *)scratch + stride : product;
  STORE *const up = job->gate_up_in_scratch ? (STORE *)scratch + 2 * stride : product;
  const FN(gated_rows) block = {
      .job = job,
      .r0 = r0,
      .rows = rows,
      .in = {(const STORE *)a->x.data + r0 * a->x.row_stride, a->x.row_stride,
             a->x.col_stride},
      .gate = a->saved_gate != NULL ? FN(rows_at)(a->saved_gate, r0, h) : gate,
      .up = a->saved_up != NULL ? FN(rows_at)(a->saved_up, r0, h) : up,
      .product = product};
  FN(run_column_stages)(&job->split, job->shared_input != NULL ? 4 : 2, FN(gated_part), &block,
                        input_pack);
}

fmlp_status FN(fmlp_cpu_gated)(const fmlp_cpu_gated_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
  FN(advise_output)(a->y, a->rows, a->out_dim, a->y_row_stride);
  FN(advise_output)(a->saved_gate, a->rows, a->hidden, a->hidden);
  FN(advise_output)(a->saved_up, a->rows, a->hidden, a->hidden);
  FN(advise_output)(a->saved_product, a->rows, a->hidden, a->hidden);
  FN(gated_job) job = {.args = a};
  const int64_t weight_elems = a->hidden * (2 * a->dim + a->out_dim);
  const int jit = FN(packs_just_in_time)(a->rows, weight_elems);
  fmlp_status status = FN(prepare_weight)(a->w_gate, a->hidden, a->dim, a->rows, jit,
                                          a->packed_gate, threading, &job.gate);
  if (status == FMLP_OK) {
    status = FN(prepare_weight)(a->w_up, a->hidden, a->dim, a->rows, jit, a->packed_up,
                                threading, &job.up);
  }
  if (status == FMLP_OK) {
    status = FN(prepare_weight)(a->w_down, a->out_dim, a->hidden, a->rows, jit,
                                a->packed_down, threading, &job.down);
  }
  if (status == FMLP_OK) {
    FN(row_blocks) blocks = {.rows = a->rows, .scratch_cols = a->hidden,
                             .scratch_elem_bytes = (int64_t)sizeof(STORE),
                             .run_block = FN(gated_block), .op = &job};
    FN(partition_rows)(&blocks, weight_elems, a->dim + 3 * a->hidden + a->out_dim, 0,
                       threading);
    job.block_rows = blocks.block_rows;
    int64_t unused, least_rows; /* the last block's, the smallest (even_split) */
    FN(even_split)(a->rows, GEMM_MR, blocks.n_blocks, blocks.n_blocks - 1, &unused, &least_rows);
    job.gate_up_in_scratch = FN(gate_up_in_scratch)(&job, least_rows);
    blocks.scratch_matrices = job.gate_up_in_scratch ? 3 : 1;
    /* gate and up as one product of 2 weights or, without the gated
     * kernel (or with one weight read in place), one weight at a time */
    int64_t block_elems = FN(jit_block_elems)(&job.gate, a->rows, 2);
    block_elems = FN(larger_elems)(block_elems, FN(jit_block_elems)(&job.gate, a->rows, 1));
    block_elems = FN(larger_elems)(block_elems, FN(jit_block_elems)(&job.up, a->rows, 1));
    block_elems = FN(larger_elems)(block_elems, FN(jit_block_elems)(&job.down, a->rows, 1));
    const int share =
        FN(shares_input)(FN(splits_columns)(&blocks, weight_elems, threading), a->rows);
    const int64_t max_k = a->dim > a->hidden ? a->dim : a->hidden;
    blocks.input_pack_elems = FN(task_pack_elems)(blocks.block_rows, share ? 0 : max_k,
                                                  block_elems, &job.weight_block_at);
    const int64_t shared_elems = FN(larger_elems)(
        FN(shared_input_elems)(a->rows, a->dim, FN(gate_up_together)(&job, a->rows) ? 2 : 1),
        FN(shared_input_elems)(a->rows, a->hidden, 1));
    status = FN(alloc_shared_input)(share, shared_elems, &job.shared_input);
    if (status == FMLP_OK) {
      status = FN(column_split_for)(&blocks, weight_elems, threading, &job.split);
    }
    if (status == FMLP_OK) status = FN(run_row_blocks)(&blocks, weight_elems, threading);
    free(job.split.packs);
    free(job.shared_input);
  }
  FN(release_weight)(&job.gate, a->packed_gate);
  FN(release_weight)(&job.up, a->packed_up);
  FN(release_weight)(&job.down, a->packed_down);
  return status;
}

/* ---- weights packed once, by the caller (cpu.h's fmlp_cpu_pack_weight) ---- */

int64_t FN(fmlp_cpu_packed_weight_bytes)(int64_t rows, fmlp_input w, int64_t n, int64_t k) {
  if (FN(weight_stays_unpacked)(w, rows) || n == 0 || k == 0) return 0;
  const int64_t elems = FN(packed_weight_elems)(n, k);
  int64_t bytes;
  return elems >= 0 && fmlp_checked_mul(elems, (int64_t)sizeof(REAL), &bytes) ? bytes : -1;
}

/* The layout prepare_weight packs ahead, which an op of any rows past the
 * few reads alike (weight_panel_at). */
fmlp_status FN(fmlp_cpu_pack_weight)(fmlp_input w, int64_t n, int64_t k, void *packed,
                                     const fmlp_threading *threading) {
  FN(packed_weight) unused;
  return FN(pack_weight)(w, n, k, INT64_MAX, threading, packed, &unused);
}

/* the epilogue passes alone, after a host GEMM (over gate_product_row above) */
#include "epilogue_pass.h"
