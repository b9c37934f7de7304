/* Backward drivers (template: see real_template.h; include after
 * drivers.h): the pointwise passes through activations, and a whole chain's
 * gradients through the forward's GEMM core. */
#include <string.h>

#define POINTWISE_CHUNK ((int64_t)1 << 14)

/* ---- pointwise passes ---- */

typedef struct {
  int64_t n;
  const STORE *grad, *pre, *up;
  STORE *grad_pre, *grad_up; /* grad_up != NULL: the gated backward */
  fmlp_activation activation;
} FN(pointwise_job);

static void FN(pointwise_backward_task)(void *context, int64_t begin, int64_t end) {
  const FN(pointwise_job) *job = context;
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t start = chunk * POINTWISE_CHUNK;
    const int64_t len = job->n - start < POINTWISE_CHUNK ? job->n - start : POINTWISE_CHUNK;
    STORE *grad_pre = job->grad_pre + start;
    const STORE *grad = job->grad + start;
    if (job->grad_up != NULL) {
      /* grad_up = grad * act(gate); grad_gate = grad * up * act'(gate) */
      FN(gate_product_row)(job->pre + start, grad, len, job->activation, job->grad_up + start);
      for (int64_t i = 0; i < len; ++i) {
        grad_pre[i] = to_store(to_real(grad[i]) * to_real(job->up[start + i]));
      }
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
 * threads, over whatever strides x and w have. The weight is packed into
 * `pack` (packed_weight_elems(n, k) elements), one buffer for all of a
 * backward's products: fresh scratch for each put the kernel's clearing of
 * new pages at 7% of a 256-token gated backward's samples. */
static fmlp_status FN(product)(fmlp_input x, int64_t rows, fmlp_input w, int64_t n, int64_t k,
                               STORE *c, REAL *pack, const fmlp_threading *threading) {
  if (rows == 0) return FMLP_OK;
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
  FN(advise_output)(c, rows, n, n);
  FN(packed_weight) packed;
  const fmlp_status status = FN(pack_weight)(w, n, k, rows, threading, pack, &packed);
  return status == FMLP_OK ? FN(run_chain)(&args, &packed, threading) : status;
}

/* *most = the larger of itself and packed_weight_elems(n, k); -1 once any
 * of them overflows. */
static void FN(room_for_pack)(int64_t *most, int64_t n, int64_t k) {
  const int64_t elems = FN(packed_weight_elems)(n, k);
  if (*most >= 0) *most = elems < 0 ? -1 : elems > *most ? elems : *most;
}

/* Scratch for the packed weights of the products room_for_pack counted. */
static fmlp_status FN(alloc_pack)(int64_t elems, REAL **pack) {
  if (elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  *pack = fmlp_alloc_scratch(elems, sizeof(REAL));
  return *pack != NULL ? FMLP_OK : FMLP_ERR_OUT_OF_MEMORY;
}

/* One layer's grad_pre = grad * act'(pre) (pre NULL: grad_pre is grad
 * itself, nothing is written) and, when partial_sums is set, each chunk's
 * column sums of it. */
typedef struct {
  int64_t rows, width, chunk_rows;
  const STORE *grad, *pre;
  STORE *grad_pre;     /* may be grad itself; unused without pre */
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
      const STORE *grad_pre = job->grad + r * width;
      if (job->pre != NULL) {
        STORE *out = job->grad_pre + r * width;
        FN(activation_grad_span)(out, grad_pre, job->pre + r * width, width, job->activation);
        grad_pre = out;
      }
      if (sums != NULL) {
        for (int64_t j = 0; j < width; ++j) sums[j] += to_real(grad_pre[j]);
      }
    }
  }
}

/* grad_pre (rows x width) and, when grad_bias is set, its column sums,
 * added up chunk by chunk in a fixed order so the result does not depend on
 * which thread ran which chunk. */
static fmlp_status FN(grad_pre_pass)(FN(grad_pre_job) job, STORE *grad_bias,
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
    for (int64_t j = 0; j < job.width; ++j) {
      REAL sum = 0; /* in REAL, rounded once */
      for (int64_t chunk = 0; chunk < n_chunks; ++chunk) sum += job.partial_sums[chunk * job.width + j];
      grad_bias[j] = to_store(sum);
    }
    free(job.partial_sums);
  }
  return FMLP_OK;
}

#if FMLP_TRANSPOSED_KERNELS
/* ---- a few-row chain's backward ---- */

/* Few rows make every backward product small in one dimension: dW = grad^T @ h
 * has K = rows, dX = grad @ W has `rows` rows. Both are c = a @ b with b's
 * rows contiguous (h's rows, W's rows), read in place; a is read a scalar at a
 * time (grad, or grad^T through its strides) and broadcast, so nothing is
 * packed or transposed. Each output element sums over K in order in one
 * lane, whichever task computes it: gradients are bit-identical at any
 * thread count. */
#define SMALL_PRODUCT_MR 4
#define SMALL_PRODUCT_NV (FMLP_SIMD_REGISTERS >= 32 ? 4 : 2)

/* K blocks of SMALL_PRODUCT_KC keep a block of b's tile columns in cache while
 * every row tile passes over it: a 16-row dX over a 3072 x 768 weight would
 * otherwise stream the weight from memory once per row tile. A later block
 * starts from the stored partial sums, so each element still sums over K in
 * order; storage narrower than REAL would round them, so there K is one block. */
#define SMALL_PRODUCT_KC (STORE_IS_REAL ? (int64_t)256 : ((int64_t)1 << 40))

/* Up to SMALL_PRODUCT_NV vectors (cols) of c's m rows, over kc values of K:
 * c = a @ b, or c += a @ b when accumulate. */
static void FN(small_product_tiles)(int64_t m, int64_t kc, const STORE *a, int64_t a_rs,
                                    int64_t a_cs, const STORE *b, int64_t ldb, STORE *c,
                                    int64_t ldc, int64_t cols, int accumulate) {
  const int64_t tile_cols = SMALL_PRODUCT_NV * FMLP_SIMD_WIDTH;
  for (int64_t i = 0; i < m; i += SMALL_PRODUCT_MR) {
    const int64_t tile_rows = m - i < SMALL_PRODUCT_MR ? m - i : SMALL_PRODUCT_MR;
    /* rows past m re-read row i: in bounds, never stored */
    const STORE *a_rows[SMALL_PRODUCT_MR];
    for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
      a_rows[r] = a + (i + (r < tile_rows ? r : 0)) * a_rs;
    }
    vreal acc[SMALL_PRODUCT_MR][SMALL_PRODUCT_NV];
    for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
      const STORE *c_row = c + (i + (r < tile_rows ? r : 0)) * ldc;
      for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
        const int64_t left = cols - v * FMLP_SIMD_WIDTH;
        acc[r][v] = accumulate && left > 0 ? vs_load_first(c_row + v * FMLP_SIMD_WIDTH, left)
                                           : v_zero();
      }
    }
    if (cols == tile_cols) {
      for (int64_t kk = 0; kk < kc; ++kk) {
        vreal bv[SMALL_PRODUCT_NV];
        for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
          bv[v] = vs_load(b + kk * ldb + v * FMLP_SIMD_WIDTH);
        }
        for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
          const vreal av = v_set1(to_real(a_rows[r][kk * a_cs]));
          for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) acc[r][v] = v_fma(av, bv[v], acc[r][v]);
        }
      }
    } else {
      for (int64_t kk = 0; kk < kc; ++kk) {
        vreal bv[SMALL_PRODUCT_NV];
        for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
          const int64_t left = cols - v * FMLP_SIMD_WIDTH;
          bv[v] = left > 0 ? vs_load_first(b + kk * ldb + v * FMLP_SIMD_WIDTH, left) : v_zero();
        }
        for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
          const vreal av = v_set1(to_real(a_rows[r][kk * a_cs]));
          for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) acc[r][v] = v_fma(av, bv[v], acc[r][v]);
        }
      }
    }
    for (int64_t r = 0; r < tile_rows; ++r) {
      STORE *c_row = c + (i + r) * ldc;
      for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
        const int64_t left = cols - v * FMLP_SIMD_WIDTH;
        if (left >= FMLP_SIMD_WIDTH) {
          vs_store(c_row + v * FMLP_SIMD_WIDTH, acc[r][v]);
        } else if (left > 0) {
          vs_store_first(c_row + v * FMLP_SIMD_WIDTH, acc[r][v], left);
        }
      }
    }
  }
}

/* c[i, j] = sum over kk of a[i * a_rs + kk * a_cs] * b[kk * ldb + j] for i in
 * [0, m), j in [j0, j0 + count), c row-major with ldc. */
static void FN(small_product_columns)(int64_t m, int64_t k, const STORE *a, int64_t a_rs,
                                      int64_t a_cs, const STORE *b, int64_t ldb, STORE *c,
                                      int64_t ldc, int64_t j0, int64_t count) {
  const int64_t tile_cols = SMALL_PRODUCT_NV * FMLP_SIMD_WIDTH;
  for (int64_t j = j0; j < j0 + count; j += tile_cols) {
    const int64_t cols = j0 + count - j < tile_cols ? j0 + count - j : tile_cols;
    for (int64_t kb = 0; kb < k || kb == 0; kb += SMALL_PRODUCT_KC) {
      const int64_t kc = k - kb < SMALL_PRODUCT_KC ? k - kb : SMALL_PRODUCT_KC;
      FN(small_product_tiles)(m, kc, a + kb * a_cs, a_rs, a_cs, b + kb * ldb + j, ldb,
                              c + j, ldc, cols, kb > 0);
    }
  }
}

/* sums[j] = sum over rows of m[r, j] (row order, in REAL) for j in
 * [j0, j0 + count), m rows x width contiguous; nothing for sums NULL. */
#define COLUMN_SUMS_SPAN 64
static void FN(column_sums_slice)(const STORE *m, int64_t rows, int64_t width, int64_t j0,
                                  int64_t count, STORE *sums) {
  if (sums == NULL) return;
  for (int64_t s0 = j0; s0 < j0 + count; s0 += COLUMN_SUMS_SPAN) {
    const int64_t span = j0 + count - s0 < COLUMN_SUMS_SPAN ? j0 + count - s0 : COLUMN_SUMS_SPAN;
    REAL acc[COLUMN_SUMS_SPAN] = {0};
    for (int64_t r = 0; r < rows; ++r) {
      const STORE *row = m + r * width + s0;
      for (int64_t j = 0; j < span; ++j) acc[j] += to_real(row[j]);
    }
    for (int64_t j = 0; j < span; ++j) sums[s0 + j] = to_store(acc[j]);
  }
}

/* A few-row chain's backward: grad_pre[l] is where layer l's grad * act'(pre)
 * lies (grad_y itself for a top layer without activation; else one of two
 * rows x max-width scratch matrices, alternating downwards). */
typedef struct {
  const fmlp_cpu_chain_backward_args *args;
  STORE *scratch;
  int64_t max_width;
} FN(few_rows_backward);

static STORE *FN(few_rows_grad_pre)(const FN(few_rows_backward) *bw, int64_t l) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t top = a->n_layers - 1;
  if (l == top && a->final_activation == FMLP_ACT_NONE) return (STORE *)a->grad_y;
  return bw->scratch + ((top - l) % 2) * a->rows * bw->max_width;
}

/* Columns [j0, j0 + count) of layer l's grad_pre, from its grad (in grad_pre
 * already, or grad_y for the top layer) and its bias gradient's columns:
 * sums over rows in row order. */
static void FN(finish_grad_pre_columns)(const FN(few_rows_backward) *bw, int64_t l,
                                        const STORE *grad, int64_t j0, int64_t count) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows, width = a->widths[l + 1];
  const fmlp_activation activation =
      l == a->n_layers - 1 ? a->final_activation : a->hidden_activation;
  STORE *grad_pre = FN(few_rows_grad_pre)(bw, l);
  if (activation != FMLP_ACT_NONE) {
    const STORE *pre = a->saved_pre[l];
    for (int64_t r = 0; r < rows; ++r) {
      FN(activation_grad_span)(grad_pre + r * width + j0, grad + r * width + j0,
                               pre + r * width + j0, count, activation);
    }
  }
  FN(column_sums_slice)(grad_pre, rows, width, j0, count,
                        a->grad_biases != NULL ? a->grad_biases[l] : NULL);
}

/* Stage 0: the top layer's grad_pre. Stage s > 0: layer l = n_layers - s,
 * task `task`'s columns [j0, j0 + count) of its input width: dW_l's columns,
 * then dX's, finished into the layer below's grad_pre. */
static void FN(few_rows_backward_part)(const void *block, int64_t stage, int64_t task,
                                       int64_t n_tasks, REAL *unused) {
  (void)unused;
  const FN(few_rows_backward) *bw = block;
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows;
  int64_t j0, count;
  if (stage == 0) {
    const int64_t top = a->n_layers - 1;
    FN(even_split)(a->widths[top + 1], FMLP_SIMD_WIDTH, n_tasks, task, &j0, &count);
    if (count > 0) FN(finish_grad_pre_columns)(bw, top, a->grad_y, j0, count);
    return;
  }
  const int64_t l = a->n_layers - stage, width = a->widths[l + 1], k = a->widths[l];
  FN(even_split)(k, FMLP_SIMD_WIDTH, n_tasks, task, &j0, &count);
  if (count == 0) return;
  const STORE *grad_pre = FN(few_rows_grad_pre)(bw, l);
  if (a->grad_weights[l] != NULL) {
    const STORE *input = l == 0 ? a->x.data : a->saved_hidden[l - 1];
    const int64_t input_stride = l == 0 ? a->x.row_stride : k;
    FN(small_product_columns)(width, rows, grad_pre, 1, width, input, input_stride,
                              a->grad_weights[l], k, j0, count);
  }
  STORE *grad_below = l > 0 ? FN(few_rows_grad_pre)(bw, l - 1) : a->grad_x;
  if (grad_below == NULL) return;
  FN(small_product_columns)(rows, width, grad_pre, width, 1, a->weights[l].data,
                            a->weights[l].row_stride, grad_below, k, j0, count);
  if (l > 0) FN(finish_grad_pre_columns)(bw, l - 1, grad_below, j0, count);
}

/* Whether the few-row backward takes this chain: few rows, and x and the
 * weights with unit column stride (read in place). */
static int FN(few_rows_backward_fits)(const fmlp_cpu_chain_backward_args *a) {
  if (a->rows > GEMM_UNPACKED_MAX_ROWS || a->x.col_stride != 1) return 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    if (a->weights[l].col_stride != 1) return 0;
  }
  return 1;
}

static fmlp_status FN(chain_backward_few_rows)(const fmlp_cpu_chain_backward_args *a,
                                               const fmlp_threading *threading) {
  FN(few_rows_backward) bw = {.args = a};
  /* multiply-adds, saturating: they only choose whether to split */
  int64_t multiply_adds = 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    if (a->widths[l + 1] > bw.max_width) bw.max_width = a->widths[l + 1];
    int64_t layer;
    if (!fmlp_checked_mul(2 * a->rows * a->widths[l], a->widths[l + 1], &layer) ||
        !fmlp_checked_add(multiply_adds, layer, &multiply_adds)) {
      multiply_adds = INT64_MAX;
    }
  }
  bw.scratch = fmlp_alloc_matrices(2, a->rows, bw.max_width, sizeof(STORE));
  if (bw.scratch == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  /* the column split's one parallel region, as the forward's few rows */
  REAL no_pack[1];
  const int split = threading != NULL && threading->n_threads > 1 &&
                    multiply_adds >= COLUMN_SPLIT_MIN_MULTIPLY_ADDS;
  const FN(column_split) columns = {split ? threading : NULL, no_pack, 0};
  FN(run_column_stages)(&columns, a->n_layers + 1, FN(few_rows_backward_part), &bw, no_pack);
  free(bw.scratch);
  return FMLP_OK;
}

/* A few-row gated block's backward in one column-split region. Stage 0,
 * over hidden columns: grad_W_down's and grad_product's, turned into
 * grad_gate and grad_up with their bias sums. Stage 1, over dim columns:
 * grad_W_gate's, grad_W_up's and grad_x's (from_up: grad_up @ W_up, added). */
typedef struct {
  const fmlp_cpu_gated_block_backward_args *args;
  STORE *grad_gate, *grad_up, *from_up;
} FN(few_rows_gated_backward);

static void FN(few_rows_gated_part)(const void *block, int64_t stage, int64_t task,
                                    int64_t n_tasks, REAL *unused) {
  (void)unused;
  const FN(few_rows_gated_backward) *bw = block;
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t rows = a->rows, h = a->hidden, dim = a->dim, out = a->out_dim;
  int64_t j0, count;
  FN(even_split)(stage == 0 ? h : dim, FMLP_SIMD_WIDTH, n_tasks, task, &j0, &count);
  if (count == 0) return;
  if (stage == 0) {
    if (a->grad_w_down != NULL) {
      FN(small_product_columns)(out, rows, a->grad_y, 1, out, a->saved_product, h,
                                a->grad_w_down, h, j0, count);
    }
    FN(small_product_columns)(rows, out, a->grad_y, out, 1, a->w_down.data,
                              a->w_down.row_stride, bw->grad_gate, h, j0, count);
    const STORE *gate = a->saved_gate, *up = a->saved_up;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * h + j0;
      STORE *grad = bw->grad_gate + at;
      /* grad_up = grad * act(gate); grad_gate = grad * up * act'(gate) */
      FN(gate_product_row)(gate + at, grad, count, a->activation, bw->grad_up + at);
      for (int64_t j = 0; j < count; ++j) grad[j] = to_store(to_real(grad[j]) * to_real(up[at + j]));
      FN(activation_grad_span)(grad, grad, gate + at, count, a->activation);
    }
    FN(column_sums_slice)(bw->grad_gate, rows, h, j0, count, a->grad_bias_gate);
    FN(column_sums_slice)(bw->grad_up, rows, h, j0, count, a->grad_bias_up);
    return;
  }
  const STORE *x = a->x.data;
  if (a->grad_w_gate != NULL) {
    FN(small_product_columns)(h, rows, bw->grad_gate, 1, h, x, a->x.row_stride,
                              a->grad_w_gate, dim, j0, count);
  }
  if (a->grad_w_up != NULL) {
    FN(small_product_columns)(h, rows, bw->grad_up, 1, h, x, a->x.row_stride, a->grad_w_up,
                              dim, j0, count);
  }
  if (a->grad_x == NULL) return;
  STORE *grad_x = a->grad_x;
  FN(small_product_columns)(rows, h, bw->grad_gate, h, 1, a->w_gate.data,
                            a->w_gate.row_stride, grad_x, dim, j0, count);
  FN(small_product_columns)(rows, h, bw->grad_up, h, 1, a->w_up.data, a->w_up.row_stride,
                            bw->from_up, dim, j0, count);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = j0; j < j0 + count; ++j) {
      grad_x[r * dim + j] = to_store(to_real(grad_x[r * dim + j]) + to_real(bw->from_up[r * dim + j]));
    }
  }
}

static int FN(few_rows_gated_fits)(const fmlp_cpu_gated_block_backward_args *a) {
  return a->rows <= GEMM_UNPACKED_MAX_ROWS && a->x.col_stride == 1 &&
         a->w_gate.col_stride == 1 && a->w_up.col_stride == 1 && a->w_down.col_stride == 1;
}

static fmlp_status FN(gated_backward_few_rows)(const fmlp_cpu_gated_block_backward_args *a,
                                               const fmlp_threading *threading) {
  const int64_t rows = a->rows, h = a->hidden;
  fmlp_status status = FMLP_OK;
  FN(column_sums_slice)(a->grad_y, rows, a->out_dim, 0, a->out_dim, a->grad_bias_down);
  FN(few_rows_gated_backward) bw = {.args = a};
  bw.grad_gate = fmlp_alloc_matrices(2, rows, h, sizeof(STORE));
  bw.from_up = fmlp_alloc_matrices(1, rows, a->dim, sizeof(STORE));
  if (bw.grad_gate != NULL && bw.from_up != NULL) {
    bw.grad_up = bw.grad_gate + rows * h;
    int64_t multiply_adds;
    if (!fmlp_checked_mul(2 * rows * h, 2 * a->dim + a->out_dim, &multiply_adds)) {
      multiply_adds = INT64_MAX;
    }
    REAL no_pack[1];
    const int split = threading != NULL && threading->n_threads > 1 &&
                      multiply_adds >= COLUMN_SPLIT_MIN_MULTIPLY_ADDS;
    const FN(column_split) columns = {split ? threading : NULL, no_pack, 0};
    FN(run_column_stages)(&columns, 2, FN(few_rows_gated_part), &bw, no_pack);
  } else {
    status = FMLP_ERR_OUT_OF_MEMORY;
  }
  free(bw.grad_gate);
  free(bw.from_up);
  return status;
}
#endif

/* Per layer l, from the last: grad_pre = grad_h * act'(pre_l) with its
 * column sums (grad_bias), grad_W = grad_pre^T @ h_l, and grad_h for the
 * layer below = grad_pre @ W_l (grad_x below the first). The two products
 * read transposed views, whose rows lie next to each other (packed K-major
 * by plain copies). grad_h and grad_pre ping-pong through two rows x
 * max-width scratch matrices, grad_pre overwriting grad_h in place. */
fmlp_status FN(fmlp_cpu_chain_backward)(const fmlp_cpu_chain_backward_args *a,
                                        const fmlp_threading *threading) {
#if FMLP_TRANSPOSED_KERNELS
  if (FN(few_rows_backward_fits)(a)) return FN(chain_backward_few_rows)(a, threading);
#endif
  const int64_t rows = a->rows;
  int64_t max_width = 0, pack_elems = 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    if (a->widths[l + 1] > max_width) max_width = a->widths[l + 1];
    FN(room_for_pack)(&pack_elems, a->widths[l], rows);              /* dW */
    FN(room_for_pack)(&pack_elems, a->widths[l], a->widths[l + 1]); /* dX */
  }
  REAL *pack = NULL;
  fmlp_status status = FN(alloc_pack)(pack_elems, &pack);
  STORE *scratch = fmlp_alloc_matrices(2, rows, max_width, sizeof(STORE));
  if (status == FMLP_OK && scratch == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
  STORE *ping_pong[2] = {scratch, scratch != NULL ? scratch + rows * max_width : NULL};
  const STORE *grad = a->grad_y;
  for (int64_t l = a->n_layers - 1, side = 0; l >= 0 && status == FMLP_OK; --l, side ^= 1) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    const fmlp_activation activation =
        l == a->n_layers - 1 ? a->final_activation : a->hidden_activation;
    const STORE *pre = activation == FMLP_ACT_NONE ? NULL : a->saved_pre[l];
    const FN(grad_pre_job) job = {.rows = rows, .width = width, .grad = grad, .pre = pre,
                                  .grad_pre = ping_pong[side], .activation = activation};
    const STORE *grad_pre = pre != NULL ? ping_pong[side] : grad;
    status = FN(grad_pre_pass)(job, a->grad_biases != NULL ? a->grad_biases[l] : NULL,
                               threading);
    const fmlp_input grad_pre_rows = {grad_pre, width, 1};
    const fmlp_input layer_input = l == 0 ? a->x : (fmlp_input){a->saved_hidden[l - 1], k, 1};
    if (status == FMLP_OK && a->grad_weights[l] != NULL) {
      status = FN(product)(FN(transposed)(grad_pre_rows), width, FN(transposed)(layer_input), k,
                           rows, a->grad_weights[l], pack, threading);
    }
    STORE *grad_below = l > 0 ? ping_pong[side ^ 1] : a->grad_x;
    if (status == FMLP_OK && grad_below != NULL) {
      status = FN(product)(grad_pre_rows, rows, FN(transposed)(a->weights[l]), k, width,
                           grad_below, pack, threading);
    }
    grad = grad_below;
  }
  free(scratch);
  free(pack);
  return status;
}

/* ---- the gated block's backward ---- */

/* sums[j] = sum over rows of m[r, j], m contiguous; no-op for sums NULL. */
static fmlp_status FN(column_sums)(const STORE *m, int64_t rows, int64_t width, STORE *sums,
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
#if FMLP_TRANSPOSED_KERNELS
  if (FN(few_rows_gated_fits)(a)) return FN(gated_backward_few_rows)(a, threading);
#endif
  const int64_t rows = a->rows, h = a->hidden;
  int64_t pack_elems = 0;
  FN(room_for_pack)(&pack_elems, h, rows);         /* grad_W_down */
  FN(room_for_pack)(&pack_elems, h, a->out_dim);   /* grad_product */
  FN(room_for_pack)(&pack_elems, a->dim, rows);    /* grad_W_gate, grad_W_up */
  FN(room_for_pack)(&pack_elems, a->dim, h);       /* grad_x */
  REAL *pack = NULL;
  fmlp_status status = FN(alloc_pack)(pack_elems, &pack);
  STORE *grad_gate = status == FMLP_OK ? fmlp_alloc_matrices(2, rows, h, sizeof(STORE)) : NULL;
  if (status == FMLP_OK && grad_gate == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
  if (status != FMLP_OK) {
    free(pack);
    return status;
  }
  STORE *grad_up = grad_gate + rows * h;
  const fmlp_input grad_y = {a->grad_y, a->out_dim, 1};
  const fmlp_input grad_gate_rows = {grad_gate, h, 1}, grad_up_rows = {grad_up, h, 1};
  status = FN(column_sums)(a->grad_y, rows, a->out_dim, a->grad_bias_down, threading);
  if (status == FMLP_OK && a->grad_w_down != NULL) {
    const fmlp_input product = {a->saved_product, h, 1};
    status = FN(product)(FN(transposed)(grad_y), a->out_dim, FN(transposed)(product), h, rows,
                         a->grad_w_down, pack, threading);
  }
  if (status == FMLP_OK) {
    status = FN(product)(grad_y, rows, FN(transposed)(a->w_down), h, a->out_dim, grad_gate,
                         pack, threading);
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
                         a->grad_w_gate, pack, threading);
  }
  if (status == FMLP_OK && a->grad_w_up != NULL) {
    status = FN(product)(FN(transposed)(grad_up_rows), h, FN(transposed)(a->x), a->dim, rows,
                         a->grad_w_up, pack, threading);
  }
  if (status == FMLP_OK && a->grad_x != NULL) {
    status = FN(product)(grad_gate_rows, rows, FN(transposed)(a->w_gate), a->dim, h, a->grad_x,
                         pack, threading);
    STORE *from_up = status == FMLP_OK ? fmlp_alloc_matrices(1, rows, a->dim, sizeof(STORE)) : NULL;
    if (status == FMLP_OK && from_up == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
    if (status == FMLP_OK) {
      status = FN(product)(grad_up_rows, rows, FN(transposed)(a->w_up), a->dim, h, from_up,
                           pack, threading);
    }
    if (status == FMLP_OK) {
      STORE *grad_x = a->grad_x;
      for (int64_t i = 0; i < rows * a->dim; ++i) {
        grad_x[i] = to_store(to_real(grad_x[i]) + to_real(from_up[i]));
      }
    }
    free(from_up);
  }
  free(grad_gate);
  free(pack);
  return status;
}
