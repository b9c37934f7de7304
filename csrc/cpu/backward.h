/* Backward drivers (template: see real_template.h; include after
 * drivers.h): the pointwise passes through activations, and a whole chain's
 * gradients through the forward's GEMM core. */
#include <string.h>

#define POINTWISE_CHUNK ((int64_t)1 << 14)

/* ---- pointwise passes ---- */

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
    const REAL *grad = job->grad + start;
    if (job->grad_up != NULL) {
      /* grad_up = grad * act(gate); grad_gate = grad * up * act'(gate) */
      FN(gate_product_row)(job->pre + start, grad, len, job->activation, job->grad_up + start);
      for (int64_t i = 0; i < len; ++i) grad_pre[i] = grad[i] * job->up[start + i];
      grad = grad_pre;
    }
    FN(activation_grad_span)(grad_pre, grad, job->pre + start, len, job->activation);
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

/* ---- a chain's backward ---- */

static fmlp_input FN(transposed)(fmlp_input m) {
  return (fmlp_input){m.data, m.col_stride, m.row_stride};
}

/* c[rows, n] (contiguous) = x[rows, k] @ w[n, k].T, as a one-layer chain
 * without bias or activation: the forward's packing, micro-kernels and
 * threads, over whatever strides x and w have. */
static fmlp_status FN(product)(fmlp_input x, int64_t rows, fmlp_input w, int64_t n, int64_t k,
                               REAL *c, const fmlp_threading *threading) {
  const int64_t widths[2] = {k, n};
  const fmlp_cpu_chain_args args = {
      .rows = rows,
      .n_layers = 1,
      .widths = widths,
      .x = x,
      .weights = &w,
      .hidden_activation = FMLP_ACT_NONE,
      .final_activation = FMLP_ACT_NONE,
      .y = c,
      .y_row_stride = n,
  };
  return FN(fmlp_cpu_chain)(&args, threading);
}

/* One layer's grad_pre = grad * act'(pre) (pre NULL: grad_pre is grad
 * itself, nothing is written) and, when partial_sums is set, each chunk's
 * column sums of it. */
typedef struct {
  int64_t rows, width, chunk_rows;
  const REAL *grad, *pre;
  REAL *grad_pre;     /* may be grad itself; unused without pre */
  REAL *partial_sums; /* n_chunks x width, or NULL */
  fmlp_activation activation;
} FN(grad_pre_job);

static void FN(grad_pre_task)(void *context, int64_t begin, int64_t end) {
  const FN(grad_pre_job) *job = context;
  const int64_t width = job->width;
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t r0 = chunk * job->chunk_rows;
    const int64_t r1 = job->rows - r0 < job->chunk_rows ? job->rows : r0 + job->chunk_rows;
    REAL *sums = job->partial_sums != NULL ? job->partial_sums + chunk * width : NULL;
    if (sums != NULL) memset(sums, 0, (size_t)width * sizeof(REAL));
    for (int64_t r = r0; r < r1; ++r) {
      const REAL *grad_pre = job->grad + r * width;
      if (job->pre != NULL) {
        REAL *out = job->grad_pre + r * width;
        FN(activation_grad_span)(out, grad_pre, job->pre + r * width, width, job->activation);
        grad_pre = out;
      }
      if (sums != NULL) {
        for (int64_t j = 0; j < width; ++j) sums[j] += grad_pre[j];
      }
    }
  }
}

/* grad_pre (rows x width) and, when grad_bias is set, its column sums,
 * added up chunk by chunk in a fixed order so the result does not depend on
 * which thread ran which chunk. */
static fmlp_status FN(grad_pre_pass)(FN(grad_pre_job) job, REAL *grad_bias,
                                     const fmlp_threading *threading) {
  if (job.pre == NULL && grad_bias == NULL) return FMLP_OK;
  job.chunk_rows = job.width > 0 && job.width < POINTWISE_CHUNK ? POINTWISE_CHUNK / job.width : 1;
  const int64_t n_chunks = (job.rows + job.chunk_rows - 1) / job.chunk_rows;
  job.partial_sums = NULL;
  if (grad_bias != NULL) {
    job.partial_sums = fmlp_alloc_matrices(n_chunks, job.width, 1, sizeof(REAL));
    if (job.partial_sums == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  }
  FN(run_tasks)(FN(threading_for)(threading, job.rows * job.width, PARALLEL_MIN_ELEMENTS),
                n_chunks, &job, FN(grad_pre_task));
  if (grad_bias != NULL) {
    memset(grad_bias, 0, (size_t)job.width * sizeof(REAL));
    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
      const REAL *sums = job.partial_sums + chunk * job.width;
      for (int64_t j = 0; j < job.width; ++j) grad_bias[j] += sums[j];
    }
    free(job.partial_sums);
  }
  return FMLP_OK;
}

/* Per layer l, from the last: grad_pre = grad_h * act'(pre_l) with its
 * column sums (grad_bias), grad_W = grad_pre^T @ h_l, and grad_h for the
 * layer below = grad_pre @ W_l (grad_x below the first). The two products
 * read transposed views, which the packing routines copy a row at a time.
 * grad_h and grad_pre ping-pong through two rows x max-width scratch
 * matrices, grad_pre overwriting grad_h in place. */
fmlp_status FN(fmlp_cpu_chain_backward)(const fmlp_cpu_chain_backward_args *a,
                                        const fmlp_threading *threading) {
  const int64_t rows = a->rows;
  int64_t max_width = 0;
  for (int64_t l = 1; l <= a->n_layers; ++l) {
    if (a->widths[l] > max_width) max_width = a->widths[l];
  }
  REAL *scratch = fmlp_alloc_matrices(2, rows, max_width, sizeof(REAL));
  if (scratch == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  REAL *ping_pong[2] = {scratch, scratch + rows * max_width};
  const REAL *grad = a->grad_y;
  fmlp_status status = FMLP_OK;
  for (int64_t l = a->n_layers - 1, side = 0; l >= 0 && status == FMLP_OK; --l, side ^= 1) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    const fmlp_activation activation =
        l == a->n_layers - 1 ? a->final_activation : a->hidden_activation;
    const REAL *pre = activation == FMLP_ACT_NONE ? NULL : a->saved_pre[l];
    const FN(grad_pre_job) job = {.rows = rows, .width = width, .grad = grad, .pre = pre,
                                  .grad_pre = ping_pong[side], .activation = activation};
    const REAL *grad_pre = pre != NULL ? ping_pong[side] : grad;
    status = FN(grad_pre_pass)(job, a->grad_biases != NULL ? a->grad_biases[l] : NULL,
                               threading);
    const fmlp_input grad_pre_rows = {grad_pre, width, 1};
    const fmlp_input layer_input = l == 0 ? a->x : (fmlp_input){a->saved_hidden[l - 1], k, 1};
    if (status == FMLP_OK && a->grad_weights[l] != NULL) {
      status = FN(product)(FN(transposed)(grad_pre_rows), width, FN(transposed)(layer_input), k,
                           rows, a->grad_weights[l], threading);
    }
    REAL *grad_below = l > 0 ? ping_pong[side ^ 1] : a->grad_x;
    if (status == FMLP_OK && grad_below != NULL) {
      status = FN(product)(grad_pre_rows, rows, FN(transposed)(a->weights[l]), k, width,
                           grad_below, threading);
    }
    grad = grad_below;
  }
  free(scratch);
  return status;
}

/* ---- the gated block's backward ---- */

/* sums[j] = sum over rows of m[r, j], m contiguous; no-op for sums NULL. */
static fmlp_status FN(column_sums)(const REAL *m, int64_t rows, int64_t width, REAL *sums,
                                   const fmlp_threading *threading) {
  const FN(grad_pre_job) job = {.rows = rows, .width = width, .grad = m};
  return FN(grad_pre_pass)(job, sums, threading);
}

/* From the top: grad_b_down = colsum(grad_y), grad_W_down = grad_y^T @
 * product, grad_product = grad_y @ W_down; the pointwise pass turns
 * grad_product (in place) into grad_gate and fills grad_up; then their
 * column sums, grad_W_gate = grad_gate^T @ x, grad_W_up = grad_up^T @ x and
 * grad_x = grad_gate @ W_gate + grad_up @ W_up (the second product into
 * scratch, then added). */
fmlp_status FN(fmlp_cpu_gated_block_backward)(const fmlp_cpu_gated_block_backward_args *a,
                                              const fmlp_threading *threading) {
  const int64_t rows = a->rows, h = a->hidden;
  REAL *grad_gate = fmlp_alloc_matrices(2, rows, h, sizeof(REAL));
  if (grad_gate == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  REAL *grad_up = grad_gate + rows * h;
  const fmlp_input grad_y = {a->grad_y, a->out_dim, 1};
  const fmlp_input grad_gate_rows = {grad_gate, h, 1}, grad_up_rows = {grad_up, h, 1};
  fmlp_status status = FN(column_sums)(a->grad_y, rows, a->out_dim, a->grad_bias_down, threading);
  if (status == FMLP_OK && a->grad_w_down != NULL) {
    const fmlp_input product = {a->saved_product, h, 1};
    status = FN(product)(FN(transposed)(grad_y), a->out_dim, FN(transposed)(product), h, rows,
                         a->grad_w_down, threading);
  }
  if (status == FMLP_OK) {
    status = FN(product)(grad_y, rows, FN(transposed)(a->w_down), h, a->out_dim, grad_gate,
                         threading);
  }
  if (status == FMLP_OK) {
    const FN(pointwise_job) job = {rows * h, grad_gate, a->saved_gate, a->saved_up,
                                   grad_gate, grad_up, a->activation};
    FN(run_pointwise)(&job, threading);
    status = FN(column_sums)(grad_gate, rows, h, a->grad_bias_gate, threading);
  }
  if (status == FMLP_OK) status = FN(column_sums)(grad_up, rows, h, a->grad_bias_up, threading);
  if (status == FMLP_OK && a->grad_w_gate != NULL) {
    status = FN(product)(FN(transposed)(grad_gate_rows), h, FN(transposed)(a->x), a->dim, rows,
                         a->grad_w_gate, threading);
  }
  if (status == FMLP_OK && a->grad_w_up != NULL) {
    status = FN(product)(FN(transposed)(grad_up_rows), h, FN(transposed)(a->x), a->dim, rows,
                         a->grad_w_up, threading);
  }
  if (status == FMLP_OK && a->grad_x != NULL) {
    status = FN(product)(grad_gate_rows, rows, FN(transposed)(a->w_gate), a->dim, h, a->grad_x,
                         threading);
    REAL *from_up = status == FMLP_OK ? fmlp_alloc_matrices(1, rows, a->dim, sizeof(REAL)) : NULL;
    if (status == FMLP_OK && from_up == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
    if (status == FMLP_OK) {
      status = FN(product)(grad_up_rows, rows, FN(transposed)(a->w_up), a->dim, h, from_up,
                           threading);
    }
    if (status == FMLP_OK) {
      REAL *grad_x = a->grad_x;
      for (int64_t i = 0; i < rows * a->dim; ++i) grad_x[i] += from_up[i];
    }
    free(from_up);
  }
  free(grad_gate);
  return status;
}
