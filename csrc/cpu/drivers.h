/* Whole-op drivers over the GEMM core (template: see real_template.h):
 * layer chains (Linear, MLP), the gated block and the backward pointwise
 * passes. Work is split into row blocks run through every layer, so
 * intermediates stay per block; threads take whole blocks. */
#include <stdatomic.h>

#include "gemm.h"

/* Row blocks run through every layer while the weights stay in cache, so a
 * block's activations never leave L2; larger weights get one block per
 * thread (layer by layer). Measured with one thread on Zen 5 (C harness):
 * 65536 x (64-128-128-64): 42.7 ms blocked vs 87.4 ms layer by layer, flat
 * for activation blocks of 32 KiB..1 MiB; 4096 x (1024^4), 12 MiB of
 * weights: blocked 243 ms vs 255 ms, so weights up to an L3's share stay
 * blocked. */
#define CACHE_RESIDENT_WEIGHT_BYTES ((int64_t)16 << 20)
#define ACTIVATION_BLOCK_BYTES ((int64_t)256 << 10)
#define POINTWISE_CHUNK ((int64_t)1 << 14)
#define TASKS_PER_THREAD 4

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
  if (weight_elems * (int64_t)sizeof(REAL) <= CACHE_RESIDENT_WEIGHT_BYTES) {
    const int64_t row_bytes = activation_elems_per_row * (int64_t)sizeof(REAL);
    const int64_t fit = row_bytes > 0 ? ACTIVATION_BLOCK_BYTES / row_bytes : per_thread;
    const int64_t aligned = fit / GEMM_MC * GEMM_MC;
    block = aligned > GEMM_MC ? aligned : GEMM_MC;
  }
  if (block > per_thread) block = per_thread;
  return block > 0 ? block : 1;
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
  int64_t rows, block_rows, input_pack_elems, scratch_matrices, scratch_cols;
  void (*run_block)(const void *op, int64_t r0, int64_t rows, REAL *input_pack, REAL *scratch);
  const void *op;
  atomic_int status;
} FN(row_blocks);

static void FN(row_block_task)(void *context, int64_t begin, int64_t end) {
  FN(row_blocks) *blocks = context;
  REAL *input_pack = fmlp_alloc_scratch(blocks->input_pack_elems, sizeof(REAL));
  REAL *scratch = fmlp_alloc_matrices(blocks->scratch_matrices, blocks->block_rows,
                                      blocks->scratch_cols, sizeof(REAL));
  if (input_pack == NULL || scratch == NULL) {
    atomic_store(&blocks->status, FMLP_ERR_OUT_OF_MEMORY);
  } else {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t r0 = block * blocks->block_rows;
      const int64_t left = blocks->rows - r0;
      blocks->run_block(blocks->op, r0, left < blocks->block_rows ? left : blocks->block_rows,
                        input_pack, scratch);
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
                (blocks->rows + blocks->block_rows - 1) / blocks->block_rows, blocks,
                FN(row_block_task));
  return (fmlp_status)atomic_load(&blocks->status);
}

/* ---- layer chains: Linear (one layer) and MLP ---- */

typedef struct {
  const fmlp_cpu_chain_args *args;
  const FN(packed_weight) *packed;
  int64_t block_rows, max_hidden;
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
    FN(gemm_rows)(in, rows, &job->packed[l], a->biases != NULL ? a->biases[l] : NULL,
                  last ? a->final_activation : a->hidden_activation, out, ldc, pre, width,
                  input_pack);
    in = (fmlp_input){out, ldc, 1};
  }
}

fmlp_status FN(fmlp_cpu_chain)(const fmlp_cpu_chain_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
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
    const int64_t block_rows = FN(choose_block_rows)(
        a->rows, threading ? threading->n_threads : 1, weight_elems, row_elems);
    const FN(chain_job) job = {a, packed, block_rows, max_hidden};
    FN(row_blocks) blocks = {
        .rows = a->rows, .block_rows = block_rows,
        .input_pack_elems = FN(input_pack_elems)(block_rows, max_k),
        .scratch_matrices = 2, .scratch_cols = max_hidden,
        .run_block = FN(chain_block), .op = &job};
    status = FN(run_row_blocks)(&blocks, weight_elems, threading);
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
    FN(gemm_rows)(in, rows, &job->gate, a->bias_gate, FMLP_ACT_NONE, gate, h, NULL, 0,
                  input_pack);
    FN(gemm_rows)(in, rows, &job->up, a->bias_up, FMLP_ACT_NONE, up, h, NULL, 0, input_pack);
    for (int64_t i = 0; i < rows; ++i) {
      FN(gate_product_row)(gate + i * h, up + i * h, h, a->activation, product + i * h);
    }
  }
  FN(gemm_rows)((fmlp_input){product, h, 1}, rows, &job->down, a->bias_down, FMLP_ACT_NONE,
                FN(rows_at)(a->y, r0, a->y_row_stride), a->y_row_stride, NULL, 0, input_pack);
}

fmlp_status FN(fmlp_cpu_gated)(const fmlp_cpu_gated_args *a, const fmlp_threading *threading) {
  if (a->rows == 0) return FMLP_OK;
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
    job.block_rows = FN(choose_block_rows)(a->rows, threading ? threading->n_threads : 1,
                                           weight_elems, a->dim + 3 * a->hidden + a->out_dim);
    FN(row_blocks) blocks = {
        .rows = a->rows, .block_rows = job.block_rows,
        .input_pack_elems =
            FN(input_pack_elems)(job.block_rows, a->dim > a->hidden ? a->dim : a->hidden),
        .scratch_matrices = 3, .scratch_cols = a->hidden,
        .run_block = FN(gated_block), .op = &job};
    status = FN(run_row_blocks)(&blocks, weight_elems, threading);
  }
  free(job.gate.data);
  free(job.up.data);
  free(job.down.data);
  return status;
}

/* ---- backward pointwise passes ---- */

typedef struct {
  int64_t n;
  const REAL *grad, *pre, *up;
  REAL *grad_pre, *grad_up; /* grad_up != NULL: the gated backward */
  fmlp_activation activation;
} FN(pointwise_job);

static void FN(pointwise_backward_task)(void *context, int64_t begin, int64_t end) {
  const FN(pointwise_job) *job = context;
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t start = chunk * POINTWISE_CHUNK;
    const int64_t len = job->n - start < POINTWISE_CHUNK ? job->n - start : POINTWISE_CHUNK;
    REAL *grad_pre = job->grad_pre + start;
    if (job->grad_up == NULL) {
      memcpy(grad_pre, job->grad + start, (size_t)len * sizeof(REAL));
    } else {
      /* grad_up = grad * act(gate); grad_gate = grad * up * act'(gate) */
      REAL *grad_up = job->grad_up + start;
      memcpy(grad_up, job->pre + start, (size_t)len * sizeof(REAL));
      FN(activate_span)(grad_up, len, job->activation);
      for (int64_t i = 0; i < len; ++i) {
        grad_up[i] *= job->grad[start + i];
        grad_pre[i] = job->grad[start + i] * job->up[start + i];
      }
    }
    FN(activation_grad_row)(grad_pre, job->pre + start, len, job->activation);
  }
}

static void FN(run_pointwise)(const FN(pointwise_job) *job, const fmlp_threading *threading) {
  FN(run_tasks)(FN(threading_for)(threading, job->n, PARALLEL_MIN_ELEMENTS),
                (job->n + POINTWISE_CHUNK - 1) / POINTWISE_CHUNK, (void *)job,
                FN(pointwise_backward_task));
}

fmlp_status FN(fmlp_cpu_activation_backward)(int64_t n, const void *grad_out, const void *pre,
                                             fmlp_activation activation, void *grad_pre,
                                             const fmlp_threading *threading) {
  const FN(pointwise_job) job = {n, grad_out, pre, NULL, grad_pre, NULL, activation};
  FN(run_pointwise)(&job, threading);
  return FMLP_OK;
}

fmlp_status FN(fmlp_cpu_gated_backward)(int64_t n, const void *grad_product, const void *gate,
                                        const void *up, fmlp_activation activation,
                                        void *grad_gate, void *grad_up,
                                        const fmlp_threading *threading) {
  const FN(pointwise_job) job = {n, grad_product, gate, up, grad_gate, grad_up, activation};
  FN(run_pointwise)(&job, threading);
  return FMLP_OK;
}
