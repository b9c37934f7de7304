/* Whole-op forward drivers over the GEMM core (template: see
 * real_template.h): layer chains (Linear, MLP) and the gated block. Work is
 * split into row blocks run through every layer, so intermediates stay per
 * block; threads take whole blocks. */
#include <stdatomic.h>

#include "gemm.h"

/* Row blocks run through every layer while the weights stay in cache, so a
 * block's activations never leave L2; larger weights get one block per
 * thread (layer by layer). Measured with one thread on Zen 4 (C harness):
 * 65536 x (64-128-128-64): 42.7 ms blocked vs 87.4 ms layer by layer, flat
 * for activation blocks of 32 KiB..1 MiB; 4096 x (1024^4), 12 MiB of
 * weights: blocked 243 ms vs 255 ms, so weights up to an L3's share stay
 * blocked. A single layer has no intermediates to keep (activation elems 0)
 * and takes large blocks, which re-read the weights less: 4096 x 1024 ->
 * 4096 GELU ran 193 ms in 48-row blocks, 184 ms in ~400-row ones. */
#define CACHE_RESIDENT_WEIGHT_BYTES ((int64_t)16 << 20)
#define ACTIVATION_BLOCK_BYTES ((int64_t)256 << 10)
#define TASKS_PER_THREAD 4
#define BLOCK_MIN_MULTIPLY_ADDS ((int64_t)1 << 20)

static int64_t FN(choose_block_rows)(int64_t rows, int64_t n_threads, int64_t weight_elems,
                                     int64_t activation_elems_per_row) {
  const int64_t threads = n_threads > 0 ? n_threads : 1;
  /* Weights read in place (few rows): one block, as the transposed kernel
   * puts rows in vector lanes and splitting them would leave lanes empty. */
  if (rows <= GEMM_UNPACKED_MAX_ROWS) return rows;
  const int64_t per_thread = (rows + threads - 1) / threads;
  /* Several blocks a thread, so the task queue can balance a slowed thread;
   * each block re-reads the weights, a few percent at these sizes. */
  const int64_t balanced = per_thread / TASKS_PER_THREAD / GEMM_MC * GEMM_MC;
  int64_t block = threads > 1 && balanced > GEMM_MC ? balanced : per_thread;
  if (activation_elems_per_row > 0 &&
      weight_elems * (int64_t)sizeof(REAL) <= CACHE_RESIDENT_WEIGHT_BYTES) {
    const int64_t fit =
        ACTIVATION_BLOCK_BYTES / (activation_elems_per_row * (int64_t)sizeof(REAL));
    const int64_t aligned = fit / GEMM_MC * GEMM_MC;
    block = aligned > GEMM_MC ? aligned : GEMM_MC;
  }
  /* Each block pays a task's fixed costs (its scratch, a queue pop): at
   * least BLOCK_MIN_MULTIPLY_ADDS of work each. 1024 x 32 -> 64 on 2 threads
   * ran 35 us in 12 blocks, 32.7 us in 2. */
  if (weight_elems > 0 && block < BLOCK_MIN_MULTIPLY_ADDS / weight_elems) {
    block = BLOCK_MIN_MULTIPLY_ADDS / weight_elems;
  }
  if (block > per_thread) block = per_thread;
  return block > 0 ? block : 1;
}

/* Huge-page advice for an output of rows rows `stride` apart, before its
 * first write (see fmlp_advise_huge_pages). */
static void FN(advise_output)(void *data, int64_t rows, int64_t stride) {
  int64_t bytes;
  if (fmlp_checked_mul(rows, stride, &bytes) &&
      fmlp_checked_mul(bytes, (int64_t)sizeof(REAL), &bytes)) {
    fmlp_advise_huge_pages(data, bytes);
  }
}

static void FN(free_packed)(FN(packed_weight) *packed, int64_t count) {
  for (int64_t i = 0; i < count; ++i) free(packed[i].data);
}

static REAL *FN(rows_at)(void *base, int64_t row, int64_t stride) {
  return base == NULL ? NULL : (REAL *)base + row * stride;
}

/* ---- row blocks as tasks ---- */

/* An op's row blocks: each task allocates its scratch once (an input pack and
 * scratch_matrices matrices of block_rows x scratch_cols) and runs its blocks
 * through run_block. */
typedef struct {
  int64_t rows, n_blocks, block_rows; /* block_rows: the most rows one block holds */
  int64_t input_pack_elems, scratch_matrices, scratch_cols;
  void (*run_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack, REAL *scratch);
  const void *op;
  atomic_int status;
} FN(row_blocks);

/* Blocks of whole MR-row tiles, about target_rows each, as even as they can
 * be and as many as a multiple of the threads, so threads taking blocks in
 * turn finish together: 256 rows on 2 threads as 48-row blocks would leave
 * one thread 144 rows and the other 112 (measured 0.735 vs 0.697 ms for a
 * 512 -> 512 layer). */
static void FN(partition_rows)(FN(row_blocks) *blocks, int64_t weight_elems,
                               int64_t activation_elems_per_row,
                               const fmlp_threading *threading) {
  const int64_t n_threads = threading != NULL ? threading->n_threads : 1;
  const int64_t rows = blocks->rows, tiles = (rows + GEMM_MR - 1) / GEMM_MR;
  const int64_t target_rows =
      FN(choose_block_rows)(rows, n_threads, weight_elems, activation_elems_per_row);
  int64_t n = (rows + target_rows - 1) / target_rows;
  if (n > 1 && n_threads > 1) n = (n + n_threads - 1) / n_threads * n_threads;
  if (n > tiles) n = tiles;
  blocks->n_blocks = n > 0 ? n : 1;
  const int64_t most = (tiles + blocks->n_blocks - 1) / blocks->n_blocks * GEMM_MR;
  blocks->block_rows = n <= 1 || most > rows ? rows : most;
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

static void FN(row_block_task)(void *context, int64_t begin, int64_t end) {
  FN(row_blocks) *blocks = context;
  REAL *input_pack = fmlp_alloc_scratch(blocks->input_pack_elems, sizeof(REAL));
  REAL *scratch = fmlp_alloc_matrices(blocks->scratch_matrices, blocks->block_rows,
                                      blocks->scratch_cols, sizeof(REAL));
  if (input_pack == NULL || scratch == NULL) {
    atomic_store(&blocks->status, FMLP_ERR_OUT_OF_MEMORY);
  } else {
    for (int64_t block = begin; block < end; ++block) {
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
  atomic_init(&blocks->status, FMLP_OK);
  int64_t multiply_adds = INT64_MAX;
  if (!fmlp_checked_mul(blocks->rows, weight_elems, &multiply_adds)) multiply_adds = INT64_MAX;
  FN(run_tasks)(FN(threading_for)(threading, multiply_adds, PARALLEL_MIN_MULTIPLY_ADDS),
                blocks->n_blocks, blocks, FN(row_block_task));
  return (fmlp_status)atomic_load(&blocks->status);
}

/* ---- few rows: products split by columns ---- */

/* A product's columns are split from this many multiply-adds (~10 us on one
 * core) on: one fork/join per product, against a row block's one per op.
 * Measured, 16 x (256 -> 256 -> 256 -> 256) ReLU on 2 threads: 86 us serial,
 * 58 us split. */
#define COLUMN_SPLIT_MIN_MULTIPLY_ADDS ((int64_t)1 << 19)

/* Few rows make one row block, which one thread would run alone; a product
 * whose weight is read in place (unpacked) then has its output columns split
 * over `threading`'s threads instead, task t packing its input into
 * packs + t * pack_elems. threading NULL: never split. */
typedef struct {
  const fmlp_threading *threading;
  REAL *packs;
  int64_t pack_elems;
} FN(column_split);

/* The split for an op partitioned into `blocks` (input_pack_elems set). */
static fmlp_status FN(column_split_for)(const FN(row_blocks) *blocks,
                                        const fmlp_threading *threading,
                                        FN(column_split) *split) {
  *split = (FN(column_split)){NULL, NULL, 0};
  if (blocks->n_blocks != 1 || blocks->rows > GEMM_UNPACKED_MAX_ROWS || threading == NULL ||
      threading->n_threads <= 1) {
    return FMLP_OK;
  }
  split->pack_elems = blocks->input_pack_elems;
  split->packs = fmlp_alloc_matrices(threading->n_threads, 1, split->pack_elems, sizeof(REAL));
  if (split->packs == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  split->threading = threading;
  return FMLP_OK;
}

/* One product, its output columns cut into n_tasks slices. */
typedef struct {
  const FN(column_split) *split;
  fmlp_input in;
  int64_t rows, n_tasks, ldc, pre_stride;
  const FN(packed_weight) *w; /* read in place */
  const REAL *bias;
  fmlp_activation activation;
  REAL *out, *pre;
} FN(column_slices);

static void FN(column_slices_task)(void *context, int64_t begin, int64_t end) {
  const FN(column_slices) *job = context;
  const FN(packed_weight) *w = job->w;
  for (int64_t task = begin; task < end; ++task) {
    int64_t j0, count;
    FN(even_split)(w->n, GEMM_MR, job->n_tasks, task, &j0, &count);
    if (count == 0) continue;
    const FN(packed_weight) slice = {
        NULL,
        {(const REAL *)w->source.data + j0 * w->source.row_stride, w->source.row_stride,
         w->source.col_stride},
        count,
        w->k};
    FN(gemm_rows)(job->in, job->rows, &slice, job->bias != NULL ? job->bias + j0 : NULL,
                  job->activation, job->out + j0, job->ldc,
                  job->pre != NULL ? job->pre + j0 : NULL, job->pre_stride,
                  job->split->packs + task * job->split->pack_elems);
  }
}

/* gemm_rows, with its columns split over threads when `split` allows, the
 * weight is read in place and the product is worth it. */
static void FN(split_gemm_rows)(const FN(column_split) *split, fmlp_input in, int64_t rows,
                                const FN(packed_weight) *w, const REAL *bias,
                                fmlp_activation activation, REAL *c, int64_t ldc, REAL *pre,
                                int64_t pre_stride, REAL *input_pack) {
  int64_t multiply_adds = 0;
  if (!fmlp_checked_mul(rows, w->n * w->k, &multiply_adds)) multiply_adds = INT64_MAX;
  const fmlp_threading *threading =
      FN(threading_for)(split->threading, multiply_adds, COLUMN_SPLIT_MIN_MULTIPLY_ADDS);
  if (threading == NULL || w->data != NULL) {
    FN(gemm_rows)(in, rows, w, bias, activation, c, ldc, pre, pre_stride, input_pack);
    return;
  }
  const FN(column_slices) slices = {
      .split = split, .in = in, .rows = rows, .n_tasks = threading->n_threads, .ldc = ldc,
      .pre_stride = pre_stride, .w = w, .bias = bias, .activation = activation, .out = c,
      .pre = pre};
  FN(run_tasks)(threading, slices.n_tasks, (void *)&slices, FN(column_slices_task));
}

/* ---- layer chains: Linear (one layer) and MLP ---- */

typedef struct {
  const fmlp_cpu_chain_args *args;
  const FN(packed_weight) *packed;
  int64_t block_rows, max_hidden;
  FN(column_split) split;
} FN(chain_job);

/* scratch: two block_rows x max_hidden matrices the hidden layers ping-pong through */
static void FN(chain_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack,
                            REAL *scratch) {
  const FN(chain_job) *job = op;
  const fmlp_cpu_chain_args *a = job->args;
  REAL *ping_pong[2] = {scratch, scratch + job->block_rows * job->max_hidden};
  fmlp_input in = {(const REAL *)a->x.data + r0 * a->x.row_stride, a->x.row_stride,
                   a->x.col_stride};
  for (int64_t l = 0; l < a->n_layers; ++l) {
    const int64_t width = a->widths[l + 1];
    const int last = l == a->n_layers - 1;
    REAL *out;
    int64_t ldc = width;
    if (last) {
      out = FN(rows_at)(a->y, r0, a->y_row_stride);
      ldc = a->y_row_stride;
    } else if (a->saved_hidden != NULL && a->saved_hidden[l] != NULL) {
      out = FN(rows_at)(a->saved_hidden[l], r0, width);
    } else {
      out = ping_pong[l % 2];
    }
    REAL *pre = a->saved_pre != NULL ? FN(rows_at)(a->saved_pre[l], r0, width) : NULL;
    FN(split_gemm_rows)(&job->split, in, rows, &job->packed[l],
                        a->biases != NULL ? a->biases[l] : NULL,
                        last ? a->final_activation : a->hidden_activation, out, ldc, pre, width,
                        input_pack);
    in = (fmlp_input){out, ldc, 1};
  }
}

fmlp_status FN(fmlp_cpu_chain)(const fmlp_cpu_chain_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
  FN(advise_output)(a->y, a->rows, a->y_row_stride);
  for (int64_t l = 0; l < a->n_layers; ++l) {
    if (a->saved_pre != NULL) FN(advise_output)(a->saved_pre[l], a->rows, a->widths[l + 1]);
    if (a->saved_hidden != NULL) {
      FN(advise_output)(a->saved_hidden[l], a->rows, a->widths[l + 1]);
    }
  }
  FN(packed_weight) *packed = calloc((size_t)a->n_layers, sizeof(*packed));
  if (packed == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  fmlp_status status = FMLP_OK;
  int64_t weight_elems = 0, max_hidden = 0, max_k = 0, row_elems = a->widths[0];
  for (int64_t l = 0; l < a->n_layers && status == FMLP_OK; ++l) {
    status = FN(pack_weight)(a->weights[l], a->widths[l + 1], a->widths[l], a->rows, threading,
                             &packed[l]);
    weight_elems += a->widths[l + 1] * a->widths[l];
    row_elems += a->widths[l + 1];
    if (l + 1 < a->n_layers && a->widths[l + 1] > max_hidden) max_hidden = a->widths[l + 1];
    if (a->widths[l] > max_k) max_k = a->widths[l];
  }
  if (status == FMLP_OK) {
    FN(row_blocks) blocks = {.rows = a->rows, .scratch_matrices = 2, .scratch_cols = max_hidden,
                             .run_block = FN(chain_block)};
    FN(partition_rows)(&blocks, weight_elems, a->n_layers > 1 ? row_elems : 0, threading);
    FN(chain_job) job = {.args = a, .packed = packed, .block_rows = blocks.block_rows,
                         .max_hidden = max_hidden};
    blocks.input_pack_elems = FN(input_pack_elems)(blocks.block_rows, max_k);
    blocks.op = &job;
    status = FN(column_split_for)(&blocks, threading, &job.split);
    if (status == FMLP_OK) status = FN(run_row_blocks)(&blocks, weight_elems, threading);
    free(job.split.packs);
  }
  FN(free_packed)(packed, a->n_layers);
  free(packed);
  return status;
}

/* ---- the gated block ---- */

typedef struct {
  const fmlp_cpu_gated_args *args;
  FN(packed_weight) gate, up, down;
  int64_t block_rows;
  FN(column_split) split;
} FN(gated_job);

/* product = act(gate) * up, one row of n values */
static void FN(gate_product_row)(const REAL *gate, const REAL *up, int64_t n,
                                 fmlp_activation activation, REAL *product) {
  memcpy(product, gate, (size_t)n * sizeof(REAL));
  FN(activate_span)(product, n, activation);
  for (int64_t j = 0; j < n; ++j) product[j] *= up[j];
}

/* scratch: three block_rows x hidden matrices (gate, up, product) unless saved */
static void FN(gated_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack,
                            REAL *scratch) {
  const FN(gated_job) *job = op;
  const fmlp_cpu_gated_args *a = job->args;
  const int64_t h = a->hidden, stride = job->block_rows * h;
  REAL *gate = a->saved_gate != NULL ? FN(rows_at)(a->saved_gate, r0, h) : scratch;
  REAL *up = a->saved_up != NULL ? FN(rows_at)(a->saved_up, r0, h) : scratch + stride;
  REAL *product =
      a->saved_product != NULL ? FN(rows_at)(a->saved_product, r0, h) : scratch + 2 * stride;
  const fmlp_input in = {(const REAL *)a->x.data + r0 * a->x.row_stride, a->x.row_stride,
                         a->x.col_stride};
#ifdef FMLP_SIMD_WIDTH
  if (job->gate.data != NULL && job->up.data != NULL && a->dim > 0) {
    const int save = a->saved_gate != NULL || a->saved_up != NULL;
    FN(gemm_gated_rows)(in, rows, &job->gate, &job->up, a->bias_gate, a->bias_up, a->activation,
                        gate, up, product, h, save, input_pack);
  } else
#endif
  {
    FN(split_gemm_rows)(&job->split, in, rows, &job->gate, a->bias_gate, FMLP_ACT_NONE, gate,
                        h, NULL, 0, input_pack);
    FN(split_gemm_rows)(&job->split, in, rows, &job->up, a->bias_up, FMLP_ACT_NONE, up, h, NULL,
                        0, input_pack);
    for (int64_t i = 0; i < rows; ++i) {
      FN(gate_product_row)(gate + i * h, up + i * h, h, a->activation, product + i * h);
    }
  }
  FN(split_gemm_rows)(&job->split, (fmlp_input){product, h, 1}, rows, &job->down, a->bias_down,
                      FMLP_ACT_NONE, FN(rows_at)(a->y, r0, a->y_row_stride), a->y_row_stride,
                      NULL, 0, input_pack);
}

fmlp_status FN(fmlp_cpu_gated)(const fmlp_cpu_gated_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
  FN(advise_output)(a->y, a->rows, a->y_row_stride);
  FN(advise_output)(a->saved_gate, a->rows, a->hidden);
  FN(advise_output)(a->saved_up, a->rows, a->hidden);
  FN(advise_output)(a->saved_product, a->rows, a->hidden);
  FN(gated_job) job = {.args = a};
  fmlp_status status =
      FN(pack_weight)(a->w_gate, a->hidden, a->dim, a->rows, threading, &job.gate);
  if (status == FMLP_OK) {
    status = FN(pack_weight)(a->w_up, a->hidden, a->dim, a->rows, threading, &job.up);
  }
  if (status == FMLP_OK) {
    status = FN(pack_weight)(a->w_down, a->out_dim, a->hidden, a->rows, threading, &job.down);
  }
  const int64_t weight_elems = a->hidden * (2 * a->dim + a->out_dim);
  if (status == FMLP_OK) {
    FN(row_blocks) blocks = {.rows = a->rows, .scratch_matrices = 3, .scratch_cols = a->hidden,
                             .run_block = FN(gated_block), .op = &job};
    FN(partition_rows)(&blocks, weight_elems, a->dim + 3 * a->hidden + a->out_dim, threading);
    job.block_rows = blocks.block_rows;
    blocks.input_pack_elems =
        FN(input_pack_elems)(blocks.block_rows, a->dim > a->hidden ? a->dim : a->hidden);
    status = FN(column_split_for)(&blocks, threading, &job.split);
    if (status == FMLP_OK) status = FN(run_row_blocks)(&blocks, weight_elems, threading);
    free(job.split.packs);
  }
  free(job.gate.data);
  free(job.up.data);
  free(job.down.data);
  return status;
}
