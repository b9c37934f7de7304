/* Backward drivers (template: see real_template.h; include after
 * drivers.h): the pointwise passes through activations, and a whole chain's
 * or gated block's gradients through the forward's GEMM core, each in one
 * parallel region: up to a few hundred rows split the products' columns
 * over the threads (few rows reading their operands in place, more packing
 * them a block at a time), more rows their rows. */
#include <string.h>

#define POINTWISE_CHUNK ((int64_t)1 << 14)

/* ---- pointwise passes ---- */

typedef struct {
  int64_t n;
  const STORE *grad, *pre, *up;
  STORE *grad_pre, *grad_up; /* grad_up != NULL: the gated backward */
  fmlp_activation activation;
} FN(pointwise_job);

/* For product = act(gate) * up, the gradients of gate and up from the
 * product's (grad; grad_gate may be grad) over n values: grad_up = grad *
 * act(gate) rounded once; grad_gate = (grad * up) * act'(gate), the product
 * rounded to storage first as eager's separate multiply stores it. */
#ifdef FMLP_SIMD_WIDTH
/* count vectors: grad_up = grad * act(gate); grad_gate = round(grad * up) *
 * act'(gate), act and act' from one exp (activation_grad_vectors) */
static FMLP_ALWAYS_INLINE void FN(gated_grads_vectors)(const vreal *grad, const vreal *gate,
                                                       const vreal *up, int count,
                                                       fmlp_activation activation,
                                                       vreal *grad_gate, vreal *grad_up) {
  vreal act[GRAD_SPAN_VECTORS];
  for (int i = 0; i < count; ++i) grad_gate[i] = vs_round(v_mul(grad[i], up[i]));
  FN(activation_grad_vectors)(grad_gate, gate, act, count, activation);
  for (int i = 0; i < count; ++i) grad_up[i] = v_mul(grad[i], act[i]);
}

/* One pass, GRAD_SPAN_VECTORS vectors at a time, then one. Its cost is the
 * math, not memory: three passes (act(gate) * grad, grad * up with scalar
 * conversions, its act') took as many samples, ~10% of a bfloat16 GeGLU
 * backward at 256 tokens (perf, one thread). */
static void FN(gated_grads_span)(const STORE *grad, const STORE *gate, const STORE *up,
                                 int64_t n, fmlp_activation activation, STORE *grad_gate,
                                 STORE *grad_up) {
  const int64_t step = GRAD_SPAN_VECTORS * FMLP_SIMD_WIDTH;
  vreal g[GRAD_SPAN_VECTORS], z[GRAD_SPAN_VECTORS], u[GRAD_SPAN_VECTORS];
  vreal gg[GRAD_SPAN_VECTORS], gu[GRAD_SPAN_VECTORS];
  int64_t i = 0;
  for (; i + step <= n; i += step) {
    for (int j = 0; j < GRAD_SPAN_VECTORS; ++j) {
      const int64_t at = i + j * FMLP_SIMD_WIDTH;
      g[j] = vs_load(grad + at);
      z[j] = vs_load(gate + at);
      u[j] = vs_load(up + at);
    }
    FN(gated_grads_vectors)(g, z, u, GRAD_SPAN_VECTORS, activation, gg, gu);
    for (int j = 0; j < GRAD_SPAN_VECTORS; ++j) {
      vs_store(grad_gate + i + j * FMLP_SIMD_WIDTH, gg[j]);
      vs_store(grad_up + i + j * FMLP_SIMD_WIDTH, gu[j]);
    }
  }
  for (; i + FMLP_SIMD_WIDTH <= n; i += FMLP_SIMD_WIDTH) {
    g[0] = vs_load(grad + i);
    z[0] = vs_load(gate + i);
    u[0] = vs_load(up + i);
    FN(gated_grads_vectors)(g, z, u, 1, activation, gg, gu);
    vs_store(grad_gate + i, gg[0]);
    vs_store(grad_up + i, gu[0]);
  }
  if (i < n) {
    const int64_t left = n - i;
    g[0] = vs_load_first(grad + i, left);
    z[0] = vs_load_first(gate + i, left);
    u[0] = vs_load_first(up + i, left);
    FN(gated_grads_vectors)(g, z, u, 1, activation, gg, gu);
    vs_store_first(grad_gate + i, gg[0], left);
    vs_store_first(grad_up + i, gu[0], left);
  }
}
#else
/* Units without vectors: the scalar span routines, pass after pass. */
static void FN(gated_grads_span)(const STORE *grad, const STORE *gate, const STORE *up,
                                 int64_t n, fmlp_activation activation, STORE *grad_gate,
                                 STORE *grad_up) {
  FN(gate_product_row)(gate, grad, n, activation, grad_up);
  for (int64_t i = 0; i < n; ++i) grad_gate[i] = to_store(to_real(grad[i]) * to_real(up[i]));
  FN(activation_grad_span)(grad_gate, grad_gate, gate, n, activation);
}
#endif

static void FN(pointwise_backward_task)(void *context, int64_t begin, int64_t end) {
  const FN(pointwise_job) *job = context;
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t start = chunk * POINTWISE_CHUNK;
    const int64_t len = job->n - start < POINTWISE_CHUNK ? job->n - start : POINTWISE_CHUNK;
    if (job->grad_up != NULL) {
      FN(gated_grads_span)(job->grad + start, job->pre + start, job->up + start, len,
                           job->activation, job->grad_pre + start, job->grad_up + start);
    } else {
      FN(activation_grad_span)(job->grad_pre + start, job->grad + start, job->pre + start, len,
                               job->activation);
    }
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

/* ---- many rows: every product split by rows, in one parallel region ----
 * (past BACKWARD_COLUMNS_MAX_ROWS; the helpers below serve both splits) */

/* What layer l's activation derivative reads: its saved pre-activation, or
 * where none was saved (a layer whose derivative reads its output:
 * fmlp_derivative_reads_output) its output, whose sign is ReLU's: the saved
 * hidden output, or the chain's y for the last layer. */
static const STORE *FN(derivative_input)(const fmlp_cpu_chain_backward_args *a, int64_t l) {
  if (a->saved_pre[l] != NULL) return a->saved_pre[l];
  return l + 1 < a->n_layers ? a->saved_hidden[l] : a->y;
}

static fmlp_input FN(transposed)(fmlp_input m) {
  return (fmlp_input){m.data, m.col_stride, m.row_stride};
}

/* grad_y (rows x cols, any strides) as the drivers read it, contiguous: the
 * caller's when it lies so, else a copy in *copy (the caller frees it); 0 when
 * memory runs out. A loss's sum() or mean() hands its gradient on expanded
 * (stride 0): a pass over it here is far cheaper than the torch layer's
 * contiguous() through the dispatcher, ~5% of a 16-row training step. */
static int FN(dense_grad_y)(fmlp_input *grad_y, int64_t rows, int64_t cols, STORE **copy) {
  *copy = NULL;
  const int empty = rows == 0 || cols == 0;
  if (empty || ((rows == 1 || grad_y->row_stride == cols) &&
                (cols == 1 || grad_y->col_stride == 1))) {
    *grad_y = (fmlp_input){grad_y->data, cols, 1};
    return 1;
  }
  *copy = fmlp_alloc_matrices(1, rows, cols, sizeof(STORE));
  if (*copy == NULL) return 0;
  const STORE *from = grad_y->data;
  for (int64_t i = 0; i < rows; ++i) {
    const STORE *row = from + i * grad_y->row_stride;
    STORE *to = *copy + i * cols;
    if (grad_y->col_stride == 0) { /* expanded along the row: a fill, which vectorizes */
      for (int64_t j = 0; j < cols; ++j) to[j] = row[0];
    } else {
      for (int64_t j = 0; j < cols; ++j) to[j] = row[j * grad_y->col_stride];
    }
  }
  *grad_y = (fmlp_input){*copy, cols, 1};
  return 1;
}

/* A backward's products c[rows, n] (contiguous) = x[rows, k] @ w[n, k].T run
 * through the forward's packing and micro-kernels (gemm_rows), but as stages
 * of one parallel region (run_column_stages) rather than a fork/join per
 * pack, pointwise pass and product: each task packs its share of the next
 * products' weight panels and multiplies its share of the rows, and the
 * pointwise work on a product's output follows on the rows its task just
 * wrote, while they are in cache. The weight (a transposed view: an
 * activation for dW, a weight for dX) is packed into the caller's buffer,
 * one pack serving every product that reads it (gate and up's dW share x's). */
typedef struct {
  fmlp_input x;
  int64_t rows;
  FN(packed_weight) w; /* data NULL: read in place, or nothing to pack */
  STORE *c;            /* NULL: the product is not wanted */
} FN(split_product);

static FN(split_product) FN(split_product_of)(fmlp_input x, int64_t rows, fmlp_input w,
                                              int64_t n, int64_t k, STORE *c, REAL *pack) {
  FN(split_product) p = {x, rows, {.data = NULL, .source = w, .n = n, .k = k}, c};
  if (c != NULL && n > 0 && k > 0 && !FN(weight_stays_unpacked)(w, rows)) p.w.data = pack;
  return p;
}

/* Task `task` of n_tasks packs its share of p's weight panels. */
static void FN(pack_share)(const FN(split_product) *p, int64_t task, int64_t n_tasks) {
  if (p->w.data == NULL) return;
  const int64_t n_panels = (p->w.n + GEMM_NR - 1) / GEMM_NR;
  int64_t first, count;
  FN(even_split)((n_panels + PACK_PANELS_PER_TASK - 1) / PACK_PANELS_PER_TASK, 1, n_tasks, task,
                 &first, &count);
  if (count > 0) FN(pack_weight_panels)((void *)&p->w, first, first + count);
}

/* Task `task` of n_tasks's rows [*r0, *r0 + *count) of p (whole MR-row
 * tiles), computed when p is wanted. Each element sums over K in the same
 * blocks however the rows are split: gradients do not depend on the thread
 * count. */
static void FN(product_share)(const FN(split_product) *p, int64_t task, int64_t n_tasks,
                              REAL *input_pack, int64_t *r0, int64_t *count) {
  FN(even_split)(p->rows, GEMM_MR, n_tasks, task, r0, count);
  if (p->c == NULL || *count == 0) return;
  const fmlp_input x = {(const STORE *)p->x.data + *r0 * p->x.row_stride, p->x.row_stride,
                        p->x.col_stride};
  FN(gemm_rows)(x, *count, &p->w, NULL, FMLP_ACT_NONE, p->c + *r0 * p->w.n, p->w.n, NULL, 0,
                input_pack);
}

/* Elements of one task's input pack for p; -1 on overflow. */
static int64_t FN(product_input_pack)(const FN(split_product) *p) {
  return p->c != NULL ? FN(input_pack_elems)(p->rows, p->w.k) : 0;
}

/* Bias gradients are column sums over rows, summed in REAL per chunk of
 * GEMM_MR rows (a task's rows are whole chunks, see product_share), then
 * over the chunks in order: the same sums at any thread count. */
#define SUM_CHUNK_ROWS GEMM_MR

static int64_t FN(sum_chunks)(int64_t rows) {
  return (rows + SUM_CHUNK_ROWS - 1) / SUM_CHUNK_ROWS;
}

/* partial[chunk * width + j] = sum of m[r, j] over the chunk's rows, for the
 * chunks of rows [r0, r0 + count); nothing for partial NULL. */
static void FN(chunk_sums)(const STORE *m, int64_t r0, int64_t count, int64_t width,
                           REAL *partial) {
  if (partial == NULL) return;
  for (int64_t c0 = r0; c0 < r0 + count; c0 += SUM_CHUNK_ROWS) {
    const int64_t end = r0 + count - c0 < SUM_CHUNK_ROWS ? r0 + count : c0 + SUM_CHUNK_ROWS;
    REAL *sums = partial + c0 / SUM_CHUNK_ROWS * width;
    memset(sums, 0, (size_t)width * sizeof(REAL));
    for (int64_t r = c0; r < end; ++r) {
      const STORE *row = m + r * width;
      for (int64_t j = 0; j < width; ++j) sums[j] += to_real(row[j]);
    }
  }
}

/* Task `task` of n_tasks's columns of sums = the chunks' partial sums added
 * in order, rounded once; nothing for sums NULL. */
static void FN(reduce_sums_share)(const REAL *partial, int64_t n_chunks, int64_t width,
                                  STORE *sums, int64_t task, int64_t n_tasks) {
  if (sums == NULL) return;
  int64_t j0, count;
  FN(even_split)(width, GEMM_NR, n_tasks, task, &j0, &count);
  for (int64_t j = j0; j < j0 + count; ++j) {
    REAL sum = 0;
    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) sum += partial[chunk * width + j];
    sums[j] = to_store(sum);
  }
}

/* *total += elems (both known not to have overflowed); -1 once either has. */
static void FN(add_elems)(int64_t *total, int64_t elems) {
  if (*total < 0 || elems < 0 || !fmlp_checked_add(*total, elems, total)) *total = -1;
}

/* *most = the larger of itself and elems; -1 once either is. */
static void FN(max_elems)(int64_t *most, int64_t elems) {
  if (*most >= 0) *most = elems < 0 ? -1 : elems > *most ? elems : *most;
}

/* The stages' split: threading's threads when the multiply-adds pay for a
 * fork (from `minimum` on), each with its own scratch of pack_elems (>= 0). */
static fmlp_status FN(backward_split)(const fmlp_threading *threading, int64_t multiply_adds,
                                      int64_t minimum, int64_t pack_elems,
                                      FN(column_split) *split) {
  if (pack_elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  const int use = threading != NULL && threading->n_threads > 1 && multiply_adds >= minimum;
  const int64_t n_tasks = use ? threading->n_threads : 1;
  *split = (FN(column_split)){use ? threading : NULL, NULL, pack_elems};
  split->packs = fmlp_alloc_matrices(n_tasks, 1, pack_elems, sizeof(REAL));
  return split->packs != NULL ? FMLP_OK : FMLP_ERR_OUT_OF_MEMORY;
}

/* Runs the stages (see run_column_stages) over `split`. */
static void FN(run_rows_stages)(const FN(column_split) *split, int64_t n_stages,
                                FN(stage_part_fn) part, const void *block) {
  FN(run_column_stages)(split, n_stages, part, block, split->packs);
}

#if FMLP_TRANSPOSED_KERNELS
/* ---- few rows: products reading b in place ---- */

/* Few rows make every backward product small in one dimension: dW = grad^T @ h
 * has K = rows, dX = grad @ W has `rows` rows. Both are c = a @ b with b's
 * rows contiguous (h's rows, W's rows), read in place; a is read a scalar at a
 * time (grad, or grad^T through its strides) and broadcast, so nothing is
 * packed or transposed (but for a's row tiles, converted to REAL where
 * storage is narrower: small_product_columns). Each output element sums over
 * K in order in one lane, whichever task computes it: gradients are
 * bit-identical at any thread count. */
#ifndef SMALL_PRODUCT_MR /* a unit's tile header may set its own */
#define SMALL_PRODUCT_MR 4
#define SMALL_PRODUCT_NV (FMLP_SIMD_REGISTERS >= 32 ? 4 : 2)
#endif

/* K blocks of SMALL_PRODUCT_KC keep b's block in the L2 while every row tile
 * passes over it: a 16-row dX over a 3072 x 768 weight would otherwise
 * stream the weight from memory once per row tile. A later block starts from
 * the stored partial sums, so each element still sums over K in order;
 * storage narrower than REAL would round them, so there K is one block. */
#define SMALL_PRODUCT_KC (STORE_IS_REAL ? (int64_t)256 : ((int64_t)1 << 40))
/* whether a's row tiles may be converted to REAL first (small_product_columns) */
#define SMALL_PRODUCT_CONVERTS (!STORE_IS_REAL)

/* Asks for the cache lines of `cols` STOREs of a row of b. b's rows lie a
 * row stride apart (a weight's rows for dX), each tile reading 256 bytes of
 * each: the hardware prefetchers leave the FMAs waiting for them. Only rows
 * inside the K block: a dW's K is the few rows (16 in bench train_small),
 * its b a few KiB in L1, and the prefetches past it took a third of the
 * tile's load slots (scripts/simd_ab.py backward, one thread, 31 rounds
 * alternating in one process: 16 x 256^3 ReLU backward 0.975x the time, its
 * dW alone 0.963x, its dX and the 256-row cases level). A prefetch past b's
 * end is a hint, never a read that can fault. */
static FMLP_ALWAYS_INLINE void FN(prefetch_store_row)(const STORE *row, int64_t cols) {
  for (int64_t at = 0; at < cols * (int64_t)sizeof(STORE); at += 64) {
    __builtin_prefetch((const char *)row + at, 0, 3);
  }
}

/* A few-row product's a: where it lies in storage (a[r * rs + kk * cs]), or
 * its row tile converted to REAL (converted[kk * SMALL_PRODUCT_MR + r]; see
 * small_product_columns) when that is set. */
typedef struct {
  const STORE *a;
  int64_t rs, cs;
  const REAL *converted;
} FN(small_product_a);

/* One row tile of c, `rows` rows (at most SMALL_PRODUCT_MR, a constant in
 * each caller) by up to SMALL_PRODUCT_NV vectors (cols), over kc values of
 * K: c = a @ b, or c += a @ b when accumulate; a read converted when
 * `converted` (also a constant in each caller). Whole vectors load and store
 * plainly, only the output's edge masked. */
static FMLP_ALWAYS_INLINE void FN(small_product_tile)(const int64_t rows, const int converted,
                                                      int64_t kc, FN(small_product_a) a,
                                                      const STORE *b, int64_t ldb, STORE *c,
                                                      int64_t ldc, int64_t cols, int accumulate) {
  const STORE *a_rows[SMALL_PRODUCT_MR];
  const REAL *converted_rows[SMALL_PRODUCT_MR];
  vreal acc[SMALL_PRODUCT_MR][SMALL_PRODUCT_NV];
  /* The row loops unrolled (here and at the store) keep acc in registers: GCC
   * kept it on the stack, 32 spills and reloads a tile, a fifth of a K = 16
   * dW's time (16 x 256^3 ReLU backward, scripts/simd_ab.py, one thread, 41
   * rounds: 0.853x, its dW 0.796x, dX 0.978x on a Zen 4; AVX2 level). */
#pragma GCC unroll 8
  for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
    if (r >= rows) break;
    a_rows[r] = a.a + r * a.rs;
    if (converted) converted_rows[r] = a.converted + r;
    const STORE *c_row = c + r * ldc;
    for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
      const int64_t left = cols - v * FMLP_SIMD_WIDTH;
      acc[r][v] = !accumulate || left <= 0         ? v_zero()
                  : left >= FMLP_SIMD_WIDTH ? vs_load(c_row + v * FMLP_SIMD_WIDTH)
                                            : vs_load_first(c_row + v * FMLP_SIMD_WIDTH, left);
    }
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    if (kk + PREFETCH_K_STEPS < kc) FN(prefetch_store_row)(b + (kk + PREFETCH_K_STEPS) * ldb, cols);
    vreal bv[SMALL_PRODUCT_NV];
    for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) {
      const int64_t left = cols - v * FMLP_SIMD_WIDTH;
      bv[v] = left >= FMLP_SIMD_WIDTH ? vs_load(b + kk * ldb + v * FMLP_SIMD_WIDTH)
              : left > 0              ? vs_load_first(b + kk * ldb + v * FMLP_SIMD_WIDTH, left)
                                      : v_zero();
    }
    for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
      if (r >= rows) break;
      const vreal av = v_set1(converted ? converted_rows[r][kk * SMALL_PRODUCT_MR]
                                        : to_real(a_rows[r][kk * a.cs]));
      for (int64_t v = 0; v < SMALL_PRODUCT_NV; ++v) acc[r][v] = v_fma(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < SMALL_PRODUCT_MR; ++r) {
    if (r >= rows) break;
    STORE *c_row = c + r * ldc;
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

/* Whole tiles (every row and vector inside c) and edge tiles as separate
 * copies of the tile, so the whole tiles' loops have constant bounds; the
 * edge tiles, a copy for each row count, out of line. */
static FMLP_ALWAYS_INLINE void FN(small_product_whole_tile)(const int converted, int64_t kc,
                                                            FN(small_product_a) a,
                                                            const STORE *b, int64_t ldb,
                                                            STORE *c, int64_t ldc,
                                                            int accumulate) {
  FN(small_product_tile)(SMALL_PRODUCT_MR, converted, kc, a, b, ldb, c, ldc,
                         SMALL_PRODUCT_NV * FMLP_SIMD_WIDTH, accumulate);
}

static __attribute__((noinline)) void FN(small_product_edge_tile)(int64_t tile_rows, int64_t kc,
                                                                  FN(small_product_a) a,
                                                                  const STORE *b, int64_t ldb,
                                                                  STORE *c, int64_t ldc,
                                                                  int64_t cols, int accumulate) {
  /* a copy of the tile for each row count, so that an edge of r rows costs r
   * rows' FMAs: with edges computing all SMALL_PRODUCT_MR rows, a 16-row dX
   * on the AVX2 unit (tiles of 6, 6, 4) took 1.08x the time
   * (scripts/simd_ab.py backward, Zen 3, one thread, 31 rounds) */
#pragma GCC unroll 16
  for (int64_t rows = 1; rows <= SMALL_PRODUCT_MR; ++rows) {
    if (rows != tile_rows) continue;
    if (SMALL_PRODUCT_CONVERTS && a.converted != NULL) {
      FN(small_product_tile)(rows, 1, kc, a, b, ldb, c, ldc, cols, accumulate);
    } else {
      FN(small_product_tile)(rows, 0, kc, a, b, ldb, c, ldc, cols, accumulate);
    }
  }
}

/* c[i, j] = sum over kk of a[i * a_rs + kk * a_cs] * b[kk * ldb + j] for i in
 * [0, m), j in [j0, j0 + count), c row-major with ldc. Per K block, the
 * columns go in chunks whose block of b (kc x chunk) takes at most a quarter
 * of the L2, and each row tile sweeps a chunk's columns before the next row
 * tile starts: a dW (K = rows, m = a layer's width) then writes each of its
 * rows as one run, where a sweep down 64-column strips wrote 256 bytes to
 * every row (a page apart at 1024 columns) per strip. Out of line, so that
 * the tile's K loop is allocated registers here alone: inlined into
 * product_columns, whose loops hold many values, GCC kept the AVX2 tile's
 * row pointers on the stack and reloaded one for every broadcast (perf
 * annotate; 16 x 256^3 ReLU backward 1.19x the time, its dW 1.13x, its dX
 * 1.28x, scripts/simd_ab.py backward, Zen 3, one thread, 31 rounds), and
 * the portable unit's loop spilled or not as unrelated code around it
 * changed. Where storage is narrower than REAL and a chunk holds several
 * column tiles, each row tile of a is first converted into a_pack
 * (few_rows_a_elems of K), once for all of them: the bfloat16 AVX2 tile had
 * converted every value it broadcast (a load, a shift, a move to a vector
 * register and a register broadcast each), and the 16 x 256^3 ReLU backward
 * took 280 -> 218 us on one thread (fusedmlp::chain_backward, the two builds
 * in alternating processes, 8 each, Zen 3). A chunk of one column tile (b's
 * chunk is a quarter of the L2: K past 2048 in bfloat16 on AVX2 with 512 KiB
 * of it) reads a in place: converting for one tile made a GeGLU block's
 * backward at 16 tokens (768 -> 3072 -> 768) take 1.05x the time. */
static __attribute__((noinline)) void FN(small_product_columns)(int64_t m, int64_t k,
                                                                const STORE *a, int64_t a_rs,
                                                                int64_t a_cs, const STORE *b,
                                                                int64_t ldb, STORE *c,
                                                                int64_t ldc, int64_t j0,
                                                                int64_t count, REAL *a_pack) {
  const int64_t tile_cols = SMALL_PRODUCT_NV * FMLP_SIMD_WIDTH;
  for (int64_t kb = 0; kb < k || kb == 0; kb += SMALL_PRODUCT_KC) {
    const int64_t kc = k - kb < SMALL_PRODUCT_KC ? k - kb : SMALL_PRODUCT_KC;
    const int64_t fit = fmlp_cpu_l2_bytes() / 4 / (int64_t)sizeof(STORE) / (kc > 0 ? kc : 1);
    const int64_t chunk = fit > tile_cols ? fit / tile_cols * tile_cols : tile_cols;
    for (int64_t jc = j0; jc < j0 + count; jc += chunk) {
      const int64_t chunk_end = j0 + count - jc < chunk ? j0 + count : jc + chunk;
      for (int64_t i = 0; i < m; i += SMALL_PRODUCT_MR) {
        const int64_t tile_rows = m - i < SMALL_PRODUCT_MR ? m - i : SMALL_PRODUCT_MR;
        FN(small_product_a) a_tile = {a + i * a_rs + kb * a_cs, a_rs, a_cs, NULL};
        if (SMALL_PRODUCT_CONVERTS && chunk_end - jc > tile_cols) {
          FN(pack_rows_k_major)(a_tile.a, a_rs, a_cs, tile_rows, SMALL_PRODUCT_MR, kc, a_pack);
          a_tile.converted = a_pack;
        }
        for (int64_t j = jc; j < chunk_end; j += tile_cols) {
          const int64_t cols = chunk_end - j < tile_cols ? chunk_end - j : tile_cols;
          STORE *c_tile = c + i * ldc + j;
          if (tile_rows < SMALL_PRODUCT_MR || cols < tile_cols) {
            FN(small_product_edge_tile)(tile_rows, kc, a_tile, b + kb * ldb + j, ldb, c_tile,
                                        ldc, cols, kb > 0);
          } else if (SMALL_PRODUCT_CONVERTS && a_tile.converted != NULL) {
            FN(small_product_whole_tile)(1, kc, a_tile, b + kb * ldb + j, ldb, c_tile, ldc,
                                         kb > 0);
          } else {
            FN(small_product_whole_tile)(0, kc, a_tile, b + kb * ldb + j, ldb, c_tile, ldc,
                                         kb > 0);
          }
        }
      }
    }
  }
}

/* Whether a chain's backward reads its products' b in place: few rows, x and
 * the weights with unit column stride. */
static int FN(few_rows_backward_fits)(const fmlp_cpu_chain_backward_args *a) {
  if (a->rows > GEMM_UNPACKED_MAX_ROWS || a->x.col_stride != 1) return 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    if (a->weights[l].col_stride != 1) return 0;
  }
  return 1;
}

/* The same for a gated block: few rows, x and its three weights with unit
 * column stride. */
static int FN(few_rows_gated_fits)(const fmlp_cpu_gated_block_backward_args *a) {
  return a->rows <= GEMM_UNPACKED_MAX_ROWS && a->x.col_stride == 1 &&
         a->w_gate.col_stride == 1 && a->w_up.col_stride == 1 && a->w_down.col_stride == 1;
}
#endif

/* ---- up to a few hundred rows: products split by columns ---- */

/* Up to BACKWARD_COLUMNS_MAX_ROWS rows a backward runs as the forward's single
 * row block does: stages of one parallel region, each splitting its products'
 * output columns over the threads, the pointwise work on a product's output
 * following on the columns its task just wrote. Few rows read b in place
 * (small_product_columns); more run the forward's packing and micro-kernels
 * with b's blocks packed just in time into each task's scratch (gemm.h's
 * weight_blocks): no weight-sized buffer, its page faults or its trip through
 * memory, where splitting rows (below) packs each transposed weight whole for
 * every task to read. The tasks pack each product's a (its input, in gemm.h's
 * terms) once between them (shared_a). Measured on the Xeon at 256 rows
 * against the row split (same process, alternating, backward only; machine
 * loaded, load average 3-5 on 2 cores), column split / row split, min: one
 * thread's CPU time, 512^3 ReLU chain 0.99 float32, 1.01 bfloat16, GeGLU 768
 * -> 3072 -> 768 0.98 and 1.02, its dX 0.92 and 0.98, its dW 1.01 and 0.98;
 * two threads' wall time, GeGLU 0.90 and 0.86 (the weight-sized packs' page
 * faults gone), the chain 0.85-0.94 float32 and 0.97-1.13 bfloat16 (two
 * threads' medians were scheduler quanta). Against the build before (one
 * process per build, alternating, one thread's CPU time, min over 3-5 rounds):
 * 512^3 chain 0.88-0.95 float32 with dX and without (each round 0.73-0.95),
 * 0.94-0.99 bfloat16 (0.69-1.20); GeGLU 0.95 bfloat16 but 1.04 float32 (each
 * round 1.04-1.16), the one case that lost, as each 512-row chunk of its
 * 3072-row dW repacked x's block. With a packed once (shared_a), float32
 * against the row split (C harness, both in one process alternating call by
 * call, 15 rounds, load average ~8 on 2 cores, median of the rounds' ratios):
 * one task, GeGLU 0.96, the chain 0.95; a 2-task split's work on one thread,
 * 0.99 and 0.98. The bound is the forward's; 0 here restores the row split
 * past few rows.
 *
 * Where bench train_step (256 x 512^3 ReLU, float32) stands, part by part
 * (issue 13; machine loaded, load 2-3 on 2 cores): on one thread our ops
 * against eager's op sequence, alternating in one process (thread CPU time,
 * min of 60-150 rounds), forward 1.05x, backward 1.02x, each of our products
 * as fast as the forward's (C harness, 256 x 512 x 512: forward 714 us, dW
 * 691, dX 695, min of 41) and 1.05-1.15x MKL's mm; packing ~8% of the
 * backward's samples, its pointwise work ~2% (perf). On two threads (wall,
 * min of 150-400 rounds) forward 1.16-1.22x, backward 1.16-1.20x: our ops
 * scale 1.62-1.65x from one thread to two, eager's 1.86-1.88x. Tried against
 * that and dropped: stages cut into 4 parts a thread, claimed as they come
 * so that a running thread takes on a preempted one's (8% more work: the
 * 2-task split run on one thread, 4.41 against 4.05 ms median for the
 * backward, GeGLU 54.3 against 49.9 ms), and the forward without a shared
 * input (each task packing its own: one 256 x 512 x 512 product 1.14-1.16x
 * MKL against 1.16-1.21x, the 3-layer forward level). */
#define BACKWARD_COLUMNS_MAX_ROWS GEMM_JIT_MAX_ROWS

/* Where a column-split backward's products find b: weight_block_at < 0, in
 * place (few rows); else packed a block at a time into each task's scratch,
 * weight_block_at elements in. */
static int64_t FN(column_unit)(int64_t weight_block_at) {
#if FMLP_TRANSPOSED_KERNELS
  if (weight_block_at < 0) return FMLP_SIMD_WIDTH;
#endif
  (void)weight_block_at;
  return GEMM_NR; /* whole panels of the packed b */
}

/* A packed product's a, packed whole once for the tasks that split its
 * columns: gemm.h's shared_input_elems layout, in a stage of its own before
 * the product (each task packing a share of its panels, shared_a_part),
 * where each task had packed all of a for its columns (2 threads packed it
 * twice). The whole of a then streams its panels past each weight block
 * (for_each_tile with packed_x), so a dW of thousands of rows (a layer's
 * width) packs each of b's blocks once: it had taken its rows in chunks of
 * 512, each one input block near the L2, and repacked b's block for every
 * chunk (6 times for a GeGLU's 3072-row dW). Measured on the Xeon against
 * that (C harness, both builds' float32 AVX-512 and bfloat16 AMX units in
 * one process, alternating call by call, 11-25 rounds, backward only at 256
 * rows; machine loaded, load average 4-8.5 on 2 cores), median of the
 * rounds' time ratios, one thread's CPU time: the two tasks of a 2-thread
 * split run one after the other (the split's total work), float32 512^3
 * ReLU chain 0.94-0.96, GeGLU 768 -> 3072 -> 768 0.95-0.96; bfloat16 0.94
 * and 0.91; one task alone, float32 1.00-1.01 and 0.95-0.98, bfloat16 0.98
 * and 0.98. Gradients bit-identical. Two threads' wall time was scheduler
 * noise at that load. */
typedef struct {
  fmlp_input a;
  int64_t m, k;
  REAL *packed; /* NULL: not wanted */
} FN(shared_a);

/* a (m x k) to pack at elements `at` of `base` when wanted (base NULL: no
 * product packs its a). */
static FN(shared_a) FN(shared_a_of)(fmlp_input a, int64_t m, int64_t k, int wanted, REAL *base,
                                    int64_t at) {
  return (FN(shared_a)){a, m, k, wanted && base != NULL ? base + at : NULL};
}

/* Elements of a's pack, whole cache lines so that the next pack starts on
 * one; -1 on overflow. */
static int64_t FN(shared_a_elems)(int64_t m, int64_t k) {
  int64_t elems = FN(shared_input_elems)(m, k, 1);
  if (elems < 0 || !fmlp_checked_add(elems, CACHE_LINE_REALS - 1, &elems)) return -1;
  return elems / CACHE_LINE_REALS * CACHE_LINE_REALS;
}

/* Task `task` of n_tasks's share of packing the wanted ones of n `packs`. */
static void FN(shared_a_part)(const FN(shared_a) *packs, int64_t n, int64_t task,
                              int64_t n_tasks) {
  for (int64_t i = 0; i < n; ++i) {
    const FN(shared_a) *p = &packs[i];
    if (p->packed != NULL) {
      FN(pack_shared_input_part)(p->a, p->m, p->k, 1, task, n_tasks, p->packed);
    }
  }
}

/* c[m, n] (row stride ldc) = a[m, k] @ b[k, n] for columns [j0, j0 + count),
 * b read in place (weight_block_at < 0, few rows) or packed a block at a
 * time, a then packed whole in packed_a (shared_a): each element sums over K
 * in the same blocks whichever task computes it, so gradients do not depend
 * on the thread count. */
static void FN(product_columns)(int64_t weight_block_at, int64_t m, int64_t k, fmlp_input a,
                                const REAL *packed_a, fmlp_input b, int64_t n, STORE *c,
                                int64_t ldc, int64_t j0, int64_t count, REAL *task_pack) {
#if FMLP_TRANSPOSED_KERNELS
  if (weight_block_at < 0) {
    FN(small_product_columns)(m, k, a.data, a.row_stride, a.col_stride, b.data, b.row_stride, c,
                              ldc, j0, count, task_pack);
    return;
  }
#endif
  const FN(packed_weight) w = {.data = NULL, .source = FN(transposed)(b), .n = n, .k = k};
  FN(gemm_rows_columns)(a, NULL, packed_a, m, &w, j0, count, NULL, FMLP_ACT_NONE,
                        (FN(product_out)){.c = c, .ldc = ldc}, task_pack,
                        FN(weight_block_in)(task_pack, weight_block_at));
}

/* A task's scratch for packed products: the largest input pack and weight
 * block of any of them (see product_columns). */
typedef struct {
  int64_t input, block;
  int64_t few_rows_a; /* few rows: a converted row tile (few_rows_a_elems) */
} FN(pack_need);

/* Elements of a few-row product's row tile of a over K = k converted to REAL
 * (small_product_columns), whole cache lines so that tasks' tiles never share
 * one; none where storage is REAL; -1 on overflow. */
static int64_t FN(few_rows_a_elems)(int64_t k) {
#if FMLP_TRANSPOSED_KERNELS && !STORE_IS_REAL
  int64_t elems;
  if (!fmlp_checked_mul(k, SMALL_PRODUCT_MR, &elems) ||
      !fmlp_checked_add(elems, CACHE_LINE_REALS - 1, &elems)) {
    return -1;
  }
  return elems / CACHE_LINE_REALS * CACHE_LINE_REALS;
#else
  (void)k;
  return 0;
#endif
}

/* A product of m rows over K = k: its a comes packed (shared_a) but where
 * b is read in place (m at most GEMM_UNPACKED_MAX_ROWS and b's rows
 * contiguous: gemm_rows_shared's transposed kernels), which packs a into
 * the task's scratch. */
static void FN(need_product)(FN(pack_need) *need, int64_t m, int64_t k) {
  FN(max_elems)(&need->input, m <= GEMM_UNPACKED_MAX_ROWS ? FN(input_pack_elems)(m, k) : 0);
  FN(max_elems)(&need->block, FN(weight_block_elems)(k, 1));
  FN(max_elems)(&need->few_rows_a, FN(few_rows_a_elems)(k));
}

/* Elements of a task's scratch for `need`, its weight block starting
 * *weight_block_at elements in; whole cache lines, so that tasks' scratch
 * never shares one; -1 on overflow. */
static int64_t FN(pack_need_elems)(const FN(pack_need) *need, int64_t *weight_block_at) {
  int64_t at, total;
  if (need->input < 0 || need->block < 0 ||
      !fmlp_checked_add(need->input, CACHE_LINE_REALS - 1, &at)) {
    return -1;
  }
  at = at / CACHE_LINE_REALS * CACHE_LINE_REALS;
  if (!fmlp_checked_add(at, need->block, &total) ||
      !fmlp_checked_add(total, CACHE_LINE_REALS - 1, &total)) {
    return -1;
  }
  *weight_block_at = at;
  return total / CACHE_LINE_REALS * CACHE_LINE_REALS;
}

/* A columns backward's split (backward_split) with each task's scratch for
 * `need`, and the input packs its tasks share (shared_elems); few rows pack
 * neither (b read in place; their scratch holds a converted row tile of a),
 * *shared then NULL. */
static fmlp_status FN(columns_split)(const fmlp_threading *threading, int64_t multiply_adds,
                                     int few_rows, const FN(pack_need) *need,
                                     int64_t shared_elems, int64_t *weight_block_at,
                                     REAL **shared, FN(column_split) *split) {
  *shared = NULL;
  const int64_t pack_elems =
      few_rows ? need->few_rows_a : FN(pack_need_elems)(need, weight_block_at);
  fmlp_status status = FN(backward_split)(threading, multiply_adds,
                                          COLUMN_SPLIT_MIN_MULTIPLY_ADDS, pack_elems, split);
  if (status == FMLP_OK && !few_rows) status = FN(alloc_shared_input)(1, shared_elems, shared);
  return status;
}

/* sums[j] = sum over rows of m[r, j] (row order, in REAL) for j in
 * [j0, j0 + count), m in any layout; nothing for sums NULL. */
#define COLUMN_SUMS_SPAN 64
static void FN(column_sums_slice)(fmlp_input m, int64_t rows, int64_t j0, int64_t count,
                                  STORE *sums) {
  if (sums == NULL) return;
  const int64_t cs = m.col_stride;
  for (int64_t s0 = j0; s0 < j0 + count; s0 += COLUMN_SUMS_SPAN) {
    const int64_t span = j0 + count - s0 < COLUMN_SUMS_SPAN ? j0 + count - s0 : COLUMN_SUMS_SPAN;
    REAL acc[COLUMN_SUMS_SPAN] = {0};
    for (int64_t r = 0; r < rows; ++r) {
      const STORE *row = (const STORE *)m.data + r * m.row_stride + s0 * cs;
      if (cs == 1) { /* the kernels' own matrices: a loop the compiler vectorizes */
        for (int64_t j = 0; j < span; ++j) acc[j] += to_real(row[j]);
      } else {
        for (int64_t j = 0; j < span; ++j) acc[j] += to_real(row[j * cs]);
      }
    }
    for (int64_t j = 0; j < span; ++j) sums[s0 + j] = to_store(acc[j]);
  }
}

typedef struct {
  int64_t rows, cols;
  fmlp_input m;
  STORE *sums;
} FN(column_sums_job);

static void FN(column_sums_task)(void *context, int64_t begin, int64_t end) {
  const FN(column_sums_job) *job = context;
  const int64_t j0 = begin * COLUMN_SUMS_SPAN;
  const int64_t j1 = end * COLUMN_SUMS_SPAN < job->cols ? end * COLUMN_SUMS_SPAN : job->cols;
  FN(column_sums_slice)(job->m, job->rows, j0, j1 - j0, job->sums);
}

/* The host GEMM path's bias gradients, split by column spans over the threads. */
fmlp_status FN(fmlp_cpu_column_sums)(int64_t rows, int64_t cols, fmlp_input m, void *sums,
                                     const fmlp_threading *threading) {
  const FN(column_sums_job) job = {rows, cols, m, sums};
  FN(run_tasks)(FN(threading_for)(threading, rows * cols, PARALLEL_MIN_ELEMENTS),
                (cols + COLUMN_SUMS_SPAN - 1) / COLUMN_SUMS_SPAN, (void *)&job,
                FN(column_sums_task));
  return FMLP_OK;
}

/* A column-split chain backward: grad_pre[l] is where layer l's grad *
 * act'(pre) lies (grad_y itself for a top layer without activation; else one
 * of two rows x max-width scratch matrices, alternating downwards). Packed
 * products (shared not NULL) take two stages a layer: one packing layer l's
 * a for dW_l (grad_pre_l^T) into shared and for dX (grad_pre_l) dx_at
 * elements in, one running both products. */
typedef struct {
  const fmlp_cpu_chain_backward_args *args;
  STORE *scratch;
  REAL *shared; /* NULL: few rows, b read in place and nothing packed */
  int64_t max_width, dx_at;
  int64_t weight_block_at; /* see column_unit */
} FN(columns_backward);

static STORE *FN(columns_grad_pre)(const FN(columns_backward) *bw, int64_t l) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t top = a->n_layers - 1;
  if (l == top && a->final_activation == FMLP_ACT_NONE) return (STORE *)a->grad_y.data;
  return bw->scratch + ((top - l) % 2) * a->rows * bw->max_width;
}

/* Where layer l's dX goes: the grad_pre of the layer below, or grad_x (NULL
 * when not wanted). */
static STORE *FN(columns_grad_below)(const FN(columns_backward) *bw, int64_t l) {
  return l > 0 ? FN(columns_grad_pre)(bw, l - 1) : bw->args->grad_x;
}

/* Layer l's products' a: dW_l's grad_pre_l^T, dX's grad_pre_l. */
static void FN(layer_packs)(const FN(columns_backward) *bw, int64_t l, FN(shared_a) packs[2]) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows, width = a->widths[l + 1];
  const fmlp_input grad_pre = {FN(columns_grad_pre)(bw, l), width, 1};
  packs[0] = FN(shared_a_of)(FN(transposed)(grad_pre), width, rows, a->grad_weights[l] != NULL,
                             bw->shared, 0);
  packs[1] = FN(shared_a_of)(grad_pre, rows, width, FN(columns_grad_below)(bw, l) != NULL,
                             bw->shared, bw->dx_at);
}

/* Columns [j0, j0 + count) of layer l's grad_pre, from its grad (in grad_pre
 * already, or grad_y for the top layer) and its bias gradient's columns:
 * sums over rows in row order. */
static void FN(finish_grad_pre_columns)(const FN(columns_backward) *bw, int64_t l,
                                        const STORE *grad, int64_t j0, int64_t count) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows, width = a->widths[l + 1];
  const fmlp_activation activation =
      l == a->n_layers - 1 ? a->final_activation : a->hidden_activation;
  STORE *grad_pre = FN(columns_grad_pre)(bw, l);
  if (activation != FMLP_ACT_NONE) {
    const STORE *pre = FN(derivative_input)(a, l);
    for (int64_t r = 0; r < rows; ++r) {
      FN(activation_grad_span)(grad_pre + r * width + j0, grad + r * width + j0,
                               pre + r * width + j0, count, activation);
    }
  }
  FN(column_sums_slice)((fmlp_input){grad_pre, width, 1}, rows, j0, count,
                        a->grad_biases != NULL ? a->grad_biases[l] : NULL);
}

/* Whether the top layer's grad_pre needs a stage of its own: only through an
 * activation, as the layers below read it whole. Without one, grad_pre is
 * grad_y and the top bias's sums ride along the top layer's first stage, a
 * barrier fewer. */
static int64_t FN(columns_top_stages)(const fmlp_cpu_chain_backward_args *a) {
  return a->final_activation != FMLP_ACT_NONE;
}

/* Stages a layer: its products, after a stage packing their a if packed. */
static int64_t FN(stages_per_layer)(const FN(columns_backward) *bw) {
  return bw->shared != NULL ? 2 : 1;
}

/* Which of a layer's wanted products (*dw, *dx) task `task` of n_tasks
 * computes, and its columns [*j0, *j0 + *count) of their width k. Where both
 * are wanted and the tasks pair up, half of them take dX and half dW, each
 * product's columns split over its half, so that a task runs one product
 * over twice the columns (one sweep of one b, where it had run two
 * half-width ones); otherwise every task takes its share of the columns of
 * both. Which thread takes which role changes from stage to stage (the
 * stages' tasks are claimed as they come). Against every task taking both (Zen 3,
 * 2 threads, fusedmlp::chain_backward alternating with the old split in one
 * process, 11-21 rounds, median time ratios): 16 x 256^3 ReLU 0.94-0.96
 * without grad_x, 0.93-0.94 with it (bench train_small's whole step
 * 0.97-0.98), 16 x 512^3 0.96 and 0.92, 64 x 256^3 0.84 and 0.80, 32 x 256^3
 * 0.98 and 0.96; 128 x 256^3, 128 x 768^3 and 256 x 512^3 level
 * (0.99-1.03). Gradients bit-identical: each element sums over K as before. */
static void FN(layer_share)(int64_t k, int64_t unit, int64_t task, int64_t n_tasks, int *dw,
                            int *dx, int64_t *j0, int64_t *count) {
  if (*dw && *dx && n_tasks % 2 == 0) {
    const int64_t half = n_tasks / 2;
    *dx = task < half;
    *dw = !*dx;
    FN(even_split)(k, unit, half, task % half, j0, count);
    return;
  }
  FN(even_split)(k, unit, n_tasks, task, j0, count);
}

/* Stage 0, with an activation on the top layer: its grad_pre. Then per layer
 * l from the top, the stage packing its products' a (if packed), and task
 * `task`'s part of its products (layer_share): dW_l's columns and dX's,
 * finished into the layer below's grad_pre; the top layer's first stage also
 * sums a share of its bias's columns when it had no stage 0. */
static void FN(columns_backward_part)(const void *block, int64_t stage, int64_t task,
                                      int64_t n_tasks, REAL *task_pack) {
  const FN(columns_backward) *bw = block;
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows, top = a->n_layers - 1, top_stages = FN(columns_top_stages)(a);
  const int64_t unit = FN(column_unit)(bw->weight_block_at);
  int64_t j0, count;
  if (stage == 0) {
    FN(even_split)(a->widths[top + 1], unit, n_tasks, task, &j0, &count);
    if (count > 0) FN(finish_grad_pre_columns)(bw, top, a->grad_y.data, j0, count);
    if (top_stages > 0) return;
  }
  const int64_t per_layer = FN(stages_per_layer)(bw), layer_stage = stage - top_stages;
  const int64_t l = top - layer_stage / per_layer, width = a->widths[l + 1], k = a->widths[l];
  FN(shared_a) packs[2];
  FN(layer_packs)(bw, l, packs);
  if (layer_stage % per_layer == 0 && per_layer == 2) {
    FN(shared_a_part)(packs, 2, task, n_tasks);
    return;
  }
  STORE *grad_below = FN(columns_grad_below)(bw, l);
  int dw = a->grad_weights[l] != NULL, dx = grad_below != NULL;
  FN(layer_share)(k, unit, task, n_tasks, &dw, &dx, &j0, &count);
  if (count == 0) return;
  const fmlp_input grad_pre = {FN(columns_grad_pre)(bw, l), width, 1};
  if (dw) {
    const fmlp_input input = l == 0 ? a->x : (fmlp_input){a->saved_hidden[l - 1], k, 1};
    FN(product_columns)(bw->weight_block_at, width, rows, FN(transposed)(grad_pre),
                        packs[0].packed, input, k, a->grad_weights[l], k, j0, count, task_pack);
  }
  if (!dx) return;
  FN(product_columns)(bw->weight_block_at, rows, width, grad_pre, packs[1].packed,
                      a->weights[l], k, grad_below, k, j0, count, task_pack);
  if (l > 0) FN(finish_grad_pre_columns)(bw, l - 1, grad_below, j0, count);
}

/* A chain's backward over up to BACKWARD_COLUMNS_MAX_ROWS rows; few_rows:
 * its products read b in place (few_rows_backward_fits). */
static fmlp_status FN(chain_backward_columns)(const fmlp_cpu_chain_backward_args *a,
                                              int few_rows, const fmlp_threading *threading) {
  const int64_t rows = a->rows;
  FN(columns_backward) bw = {.args = a, .weight_block_at = -1};
  FN(pack_need) need = {0, 0, 0};
  int64_t dx_elems = 0; /* the largest dX's a packed; dx_at: dW's */
  /* multiply-adds, saturating: they only choose whether to split */
  int64_t multiply_adds = 0;
  for (int64_t l = 0; l < a->n_layers; ++l) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    if (width > bw.max_width) bw.max_width = width;
    int64_t layer;
    if (!fmlp_checked_mul(2 * rows * k, width, &layer) ||
        !fmlp_checked_add(multiply_adds, layer, &multiply_adds)) {
      multiply_adds = INT64_MAX;
    }
    FN(need_product)(&need, width, rows); /* dW */
    FN(need_product)(&need, rows, width); /* dX */
    FN(max_elems)(&bw.dx_at, FN(shared_a_elems)(width, rows));
    FN(max_elems)(&dx_elems, FN(shared_a_elems)(rows, width));
    if (a->grad_weights[l] != NULL) FN(advise_output)(a->grad_weights[l], width, k, k);
  }
  int64_t shared_elems = bw.dx_at;
  FN(add_elems)(&shared_elems, dx_elems);
  FN(column_split) split = {NULL, NULL, 0};
  fmlp_status status = FN(columns_split)(threading, multiply_adds, few_rows, &need, shared_elems,
                                         &bw.weight_block_at, &bw.shared, &split);
  bw.scratch = fmlp_alloc_matrices(2, rows, bw.max_width, sizeof(STORE));
  if (status == FMLP_OK && bw.scratch == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
  if (status == FMLP_OK) {
    FN(run_column_stages)(&split,
                          FN(columns_top_stages)(a) + a->n_layers * FN(stages_per_layer)(&bw),
                          FN(columns_backward_part), &bw, split.packs);
  }
  free(bw.scratch);
  free(bw.shared);
  free(split.packs);
  return status;
}

/* A chain whose forward runs a block of rows a thread (drivers.h's
 * jit_block_rows: small weights, each thread's rows past the few) runs its
 * backward in two stages, where the column split takes two a layer. Stage 0,
 * each task's rows through every layer from the top: grad_pre's rows, dX =
 * grad_pre @ W into the layer below's grad_pre, through its activation; no
 * row needs another task's, as no output row sums over rows. Stage 1, each
 * task's share of every layer's grad_pre columns: the rows of dW = grad_pre^T
 * @ h they make, and the bias sums over them (column_sums_slice, as the
 * column split sums). Each task packs its own a and every block of b (W for
 * dX, h for dW) just in time, as the forward's row blocks pack every weight:
 * no stage packs a shared input, and only stage 1 reads what another core
 * wrote. Every element sums over K in the same blocks as the column split's
 * (the same kernels over the same K), so gradients stay those of one thread.
 * grad_pre_l lies in layer l's rows x max_width matrix of scratch (grad_y
 * itself for a top layer without activation), every layer's kept for
 * stage 1. */
typedef struct {
  const fmlp_cpu_chain_backward_args *args;
  STORE *scratch;
  int64_t max_width;
  int64_t weight_block_at; /* in each task's scratch (pack_need_elems) */
} FN(rows_then_weights);

static STORE *FN(layer_grad_pre)(const FN(rows_then_weights) *bw, int64_t l) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  if (l == a->n_layers - 1 && a->final_activation == FMLP_ACT_NONE) return (STORE *)a->grad_y.data;
  return bw->scratch + l * a->rows * bw->max_width;
}

/* Whether a chain's backward over up to BACKWARD_COLUMNS_MAX_ROWS rows (past
 * the few) runs as rows_then_weights on threading: where its forward runs a
 * row block a thread, and the column split would split (columns_split). */
static int FN(splits_rows_then_weights)(const fmlp_cpu_chain_backward_args *a,
                                        const fmlp_threading *threading) {
  if (threading == NULL || threading->n_threads < 2) return 0;
  const int64_t weight_elems = FN(chain_weight_elems)(a->widths, a->n_layers);
  int64_t multiply_adds;
  /* past int64_t: weights far past GEMM_JIT_LARGE_MULTIPLY_ADDS, never split by rows */
  if (weight_elems < 0 || !fmlp_checked_mul(2 * a->rows, weight_elems, &multiply_adds)) return 0;
  return multiply_adds >= COLUMN_SPLIT_MIN_MULTIPLY_ADDS &&
         FN(jit_block_rows)(a->rows, threading->n_threads, weight_elems) < a->rows;
}

/* *need grows to a product of m rows over K = k packing its a (whole, as
 * b's blocks are packed just in time) and b's blocks, for each task's share
 * of m_total rows split over n_tasks. */
static void FN(need_task_products)(FN(pack_need) *need, int64_t m_total, int64_t k,
                                   int64_t n_tasks) {
  for (int64_t task = 0; task < n_tasks; ++task) {
    int64_t first, m;
    FN(even_split)(m_total, GEMM_MR, n_tasks, task, &first, &m);
    FN(max_elems)(&need->input, FN(larger_elems)(FN(input_pack_elems)(m, k),
                                                 FN(whole_input_pack_elems)(m, k)));
  }
  FN(max_elems)(&need->block, FN(weight_block_elems)(k, 1));
}

/* Rows [first, first + count) of c (m x n, contiguous) = a (m x k) @ b, b
 * given as its transpose b_t (n x k) and packed a block at a time just in
 * time, a packed by the task: see rows_then_weights. */
static void FN(rows_product)(fmlp_input a, int64_t first, int64_t count, fmlp_input b_t,
                             int64_t n, int64_t k, STORE *c, REAL *task_pack,
                             REAL *weight_block) {
  const FN(packed_weight) w = {.data = NULL, .source = b_t, .n = n, .k = k};
  const fmlp_input rows = {(const STORE *)a.data + first * a.row_stride, a.row_stride,
                           a.col_stride};
  FN(gemm_rows_columns)(rows, NULL, NULL, count, &w, 0, n, NULL, FMLP_ACT_NONE,
                        (FN(product_out)){.c = c + first * n, .ldc = n}, task_pack,
                        weight_block);
}

/* Stage 0 (task `task` of n_tasks's rows) or 1 (its share of each layer's
 * grad_pre columns, the rows of dW). */
static void FN(rows_then_weights_part)(const void *block, int64_t stage, int64_t task,
                                       int64_t n_tasks, REAL *task_pack) {
  const FN(rows_then_weights) *bw = block;
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t rows = a->rows, top = a->n_layers - 1;
  REAL *weight_block = FN(weight_block_in)(task_pack, bw->weight_block_at);
  int64_t first, count;
  if (stage == 1) {
    for (int64_t l = 0; l <= top; ++l) {
      const int64_t width = a->widths[l + 1], k = a->widths[l];
      const STORE *grad_pre = FN(layer_grad_pre)(bw, l);
      FN(even_split)(width, GEMM_MR, n_tasks, task, &first, &count);
      if (count == 0) continue;
      FN(column_sums_slice)((fmlp_input){grad_pre, width, 1}, rows, first, count,
                            a->grad_biases != NULL ? a->grad_biases[l] : NULL);
      if (a->grad_weights[l] == NULL) continue;
      const fmlp_input input = l == 0 ? a->x : (fmlp_input){a->saved_hidden[l - 1], k, 1};
      FN(rows_product)((fmlp_input){grad_pre, 1, width}, first, count, FN(transposed)(input), k,
                       rows, a->grad_weights[l], task_pack, weight_block);
    }
    return;
  }
  FN(even_split)(rows, GEMM_MR, n_tasks, task, &first, &count);
  if (count == 0) return;
  const int64_t top_width = a->widths[top + 1];
  if (a->final_activation != FMLP_ACT_NONE) {
    const STORE *grad_y = a->grad_y.data, *pre = FN(derivative_input)(a, top);
    const int64_t at = first * top_width; /* the task's rows lie next to each other */
    FN(activation_grad_span)(FN(layer_grad_pre)(bw, top) + at, grad_y + at, pre + at,
                             count * top_width, a->final_activation);
  }
  for (int64_t l = top; l >= 0; --l) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    STORE *below = l > 0 ? FN(layer_grad_pre)(bw, l - 1) : a->grad_x;
    if (below == NULL) continue;
    FN(rows_product)((fmlp_input){FN(layer_grad_pre)(bw, l), width, 1}, first, count,
                     FN(transposed)(a->weights[l]), k, width, below, task_pack, weight_block);
    if (l == 0 || a->hidden_activation == FMLP_ACT_NONE) continue;
    const STORE *pre = FN(derivative_input)(a, l - 1);
    const int64_t at = first * k;
    FN(activation_grad_span)(below + at, below + at, pre + at, count * k, a->hidden_activation);
  }
}

static fmlp_status FN(chain_backward_rows_then_weights)(const fmlp_cpu_chain_backward_args *a,
                                                        const fmlp_threading *threading) {
  const int64_t rows = a->rows, n_tasks = threading->n_threads;
  FN(rows_then_weights) bw = {.args = a};
  FN(pack_need) need = {0, 0, 0};
  for (int64_t l = 0; l < a->n_layers; ++l) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    if (width > bw.max_width) bw.max_width = width;
    FN(need_task_products)(&need, rows, width, n_tasks); /* dX */
    FN(need_task_products)(&need, width, rows, n_tasks); /* dW */
    if (a->grad_weights[l] != NULL) FN(advise_output)(a->grad_weights[l], width, k, k);
  }
  FN(column_split) split = {NULL, NULL, 0};
  /* multiply-adds past any minimum: splits_rows_then_weights chose to split */
  fmlp_status status = FN(backward_split)(threading, INT64_MAX, 0,
                                          FN(pack_need_elems)(&need, &bw.weight_block_at), &split);
  bw.scratch = fmlp_alloc_matrices(a->n_layers, rows, bw.max_width, sizeof(STORE));
  if (status == FMLP_OK && bw.scratch == NULL) status = FMLP_ERR_OUT_OF_MEMORY;
  if (status == FMLP_OK) {
    FN(run_column_stages)(&split, 2, FN(rows_then_weights_part), &bw, split.packs);
  }
  free(bw.scratch);
  free(split.packs);
  return status;
}

/* A column-split gated block's backward, in steps: 0, over out_dim columns,
 * grad_b_down's; over hidden columns, grad_W_down's and grad_product's,
 * turned into grad_gate and grad_up with their bias sums. Then over dim
 * columns, 1: grad_W_gate's and grad_x's (grad_gate @ W_gate); 2: grad_W_up's
 * and from_up's (grad_up @ W_up), added into grad_x. Packed products (shared
 * not NULL) run each step after a stage packing its products' a (the
 * dW's at shared, the dX's dx_at elements in): gate's and up's in turn, so
 * that shared holds two of the four rows x hidden packs, not four (6 MiB
 * at 256 tokens of 768 -> 3072 -> 768 float32); few rows run steps 1 and 2
 * as one stage. */
typedef struct {
  const fmlp_cpu_gated_block_backward_args *args;
  STORE *grad_gate, *grad_up, *from_up;
  REAL *shared; /* NULL: few rows, b read in place and nothing packed */
  int64_t dx_at;
  int64_t weight_block_at; /* see column_unit */
} FN(columns_gated_backward);

/* Step `step`'s products' a: 0, grad_W_down's grad_y^T and grad_product's
 * grad_y; 1, grad_W_gate's grad_gate^T and grad_x's grad_gate; 2, up's. */
static void FN(gated_packs)(const FN(columns_gated_backward) *bw, int64_t step,
                            FN(shared_a) packs[2]) {
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t rows = a->rows, h = a->hidden, out = a->out_dim;
  if (step == 0) {
    const fmlp_input grad_y = a->grad_y;
    packs[0] = FN(shared_a_of)(FN(transposed)(grad_y), out, rows, a->grad_w_down != NULL,
                               bw->shared, 0);
    packs[1] = FN(shared_a_of)(grad_y, rows, out, 1, bw->shared, bw->dx_at);
    return;
  }
  const fmlp_input grad = {step == 1 ? bw->grad_gate : bw->grad_up, h, 1};
  const void *grad_w = step == 1 ? a->grad_w_gate : a->grad_w_up;
  packs[0] = FN(shared_a_of)(FN(transposed)(grad), h, rows, grad_w != NULL, bw->shared, 0);
  packs[1] = FN(shared_a_of)(grad, rows, h, a->grad_x != NULL, bw->shared, bw->dx_at);
}

/* Step 0: task `task` of n_tasks's columns. */
static void FN(gated_down_columns)(const FN(columns_gated_backward) *bw,
                                   const FN(shared_a) packs[2], int64_t task, int64_t n_tasks,
                                   REAL *task_pack) {
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t rows = a->rows, h = a->hidden, out = a->out_dim;
  const int64_t at = bw->weight_block_at, unit = FN(column_unit)(at);
  int64_t j0, count;
  FN(even_split)(out, unit, n_tasks, task, &j0, &count);
  FN(column_sums_slice)(a->grad_y, rows, j0, count, a->grad_bias_down);
  FN(even_split)(h, unit, n_tasks, task, &j0, &count);
  if (count == 0) return;
  const fmlp_input grad_y = a->grad_y;
  if (a->grad_w_down != NULL) {
    FN(product_columns)(at, out, rows, FN(transposed)(grad_y), packs[0].packed,
                        (fmlp_input){a->saved_product, h, 1}, h, a->grad_w_down, h, j0, count,
                        task_pack);
  }
  FN(product_columns)(at, rows, out, grad_y, packs[1].packed, a->w_down, h, bw->grad_gate, h,
                      j0, count, task_pack);
  const STORE *gate = a->saved_gate, *up = a->saved_up;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r * h + j0;
    FN(gated_grads_span)(bw->grad_gate + i, gate + i, up + i, count, a->activation,
                         bw->grad_gate + i, bw->grad_up + i);
  }
  FN(column_sums_slice)((fmlp_input){bw->grad_gate, h, 1}, rows, j0, count, a->grad_bias_gate);
  FN(column_sums_slice)((fmlp_input){bw->grad_up, h, 1}, rows, j0, count, a->grad_bias_up);
}

/* Step 1 (gate) or 2 (up): columns [j0, j0 + count) of dim. */
static void FN(gated_input_columns)(const FN(columns_gated_backward) *bw, int64_t step,
                                    const FN(shared_a) packs[2], int64_t j0, int64_t count,
                                    REAL *task_pack) {
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t rows = a->rows, h = a->hidden, dim = a->dim, at = bw->weight_block_at;
  const fmlp_input grad = {step == 1 ? bw->grad_gate : bw->grad_up, h, 1};
  void *grad_w = step == 1 ? a->grad_w_gate : a->grad_w_up;
  if (grad_w != NULL) {
    FN(product_columns)(at, h, rows, FN(transposed)(grad), packs[0].packed, a->x, dim, grad_w,
                        dim, j0, count, task_pack);
  }
  if (a->grad_x == NULL) return;
  STORE *grad_x = a->grad_x;
  FN(product_columns)(at, rows, h, grad, packs[1].packed, step == 1 ? a->w_gate : a->w_up, dim,
                      step == 1 ? grad_x : bw->from_up, dim, j0, count, task_pack);
  if (step == 1) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = j0; j < j0 + count; ++j) {
      grad_x[r * dim + j] =
          to_store(to_real(grad_x[r * dim + j]) + to_real(bw->from_up[r * dim + j]));
    }
  }
}

static void FN(columns_gated_part)(const void *block, int64_t stage, int64_t task,
                                   int64_t n_tasks, REAL *task_pack) {
  const FN(columns_gated_backward) *bw = block;
  const int packed = bw->shared != NULL;
  const int64_t step = packed ? stage / 2 : stage;
  FN(shared_a) packs[2] = {{.packed = NULL}, {.packed = NULL}};
  if (packed) {
    FN(gated_packs)(bw, step, packs);
    if (stage % 2 == 0) {
      FN(shared_a_part)(packs, 2, task, n_tasks);
      return;
    }
  }
  if (step == 0) {
    FN(gated_down_columns)(bw, packs, task, n_tasks, task_pack);
    return;
  }
  int64_t j0, count;
  FN(even_split)(bw->args->dim, FN(column_unit)(bw->weight_block_at), n_tasks, task, &j0, &count);
  if (count == 0) return;
  FN(gated_input_columns)(bw, step, packs, j0, count, task_pack);
  if (!packed) FN(gated_input_columns)(bw, 2, packs, j0, count, task_pack);
}

/* Huge-page advice for a gated block's three weight gradients, before their
 * first write. */
static void FN(advise_gated_weight_grads)(const fmlp_cpu_gated_block_backward_args *a) {
  FN(advise_output)(a->grad_w_gate, a->hidden, a->dim, a->dim);
  FN(advise_output)(a->grad_w_up, a->hidden, a->dim, a->dim);
  FN(advise_output)(a->grad_w_down, a->out_dim, a->hidden, a->hidden);
}

/* A gated backward's scratch: grad_gate and grad_up (rows x hidden each, one
 * allocation, freed through *grad_gate) and from_up (rows x dim). 0 where an
 * allocation failed; free both pointers either way. */
static int FN(alloc_gated_scratch)(const fmlp_cpu_gated_block_backward_args *a,
                                   STORE **grad_gate, STORE **grad_up, STORE **from_up) {
  *grad_gate = fmlp_alloc_matrices(2, a->rows, a->hidden, sizeof(STORE));
  *from_up = fmlp_alloc_matrices(1, a->rows, a->dim, sizeof(STORE));
  if (*grad_gate == NULL || *from_up == NULL) return 0;
  *grad_up = *grad_gate + a->rows * a->hidden;
  return 1;
}

/* A gated block's backward over up to BACKWARD_COLUMNS_MAX_ROWS rows;
 * few_rows: its products read b in place (few_rows_gated_fits). */
static fmlp_status FN(gated_backward_columns)(const fmlp_cpu_gated_block_backward_args *a,
                                              int few_rows, const fmlp_threading *threading) {
  const int64_t rows = a->rows, h = a->hidden, dim = a->dim, out = a->out_dim;
  FN(columns_gated_backward) bw = {.args = a, .weight_block_at = -1};
  FN(pack_need) need = {0, 0, 0};
  FN(need_product)(&need, out, rows); /* grad_W_down */
  FN(need_product)(&need, rows, out); /* grad_product */
  FN(need_product)(&need, h, rows);   /* grad_W_gate, grad_W_up */
  FN(need_product)(&need, rows, h);   /* grad_x, from_up */
  int64_t dx_elems = FN(larger_elems)(FN(shared_a_elems)(rows, out), FN(shared_a_elems)(rows, h));
  bw.dx_at = FN(larger_elems)(FN(shared_a_elems)(out, rows), FN(shared_a_elems)(h, rows));
  int64_t shared_elems = bw.dx_at, multiply_adds;
  FN(add_elems)(&shared_elems, dx_elems);
  if (!fmlp_checked_mul(2 * rows * h, 2 * dim + out, &multiply_adds)) multiply_adds = INT64_MAX;
  FN(advise_gated_weight_grads)(a);
  FN(column_split) split = {NULL, NULL, 0};
  fmlp_status status = FN(columns_split)(threading, multiply_adds, few_rows, &need, shared_elems,
                                         &bw.weight_block_at, &bw.shared, &split);
  const int scratch = FN(alloc_gated_scratch)(a, &bw.grad_gate, &bw.grad_up, &bw.from_up);
  if (status == FMLP_OK && !scratch) status = FMLP_ERR_OUT_OF_MEMORY;
  if (status == FMLP_OK) {
    FN(run_column_stages)(&split, few_rows ? 2 : 6, FN(columns_gated_part), &bw, split.packs);
  }
  free(bw.from_up);
  free(bw.grad_gate);
  free(bw.shared);
  free(split.packs);
  return status;
}

/* A gated block's backward in two stages, as a chain's rows_then_weights:
 * stage 0, each task's rows: grad_product = grad_y @ W_down into grad_gate,
 * turned into grad_gate and grad_up, then grad_x = grad_gate @ W_gate plus
 * from_up = grad_up @ W_up; stage 1, each task's share of out_dim's and
 * hidden's columns of grad_y, grad_gate and grad_up: the rows of grad_W_down,
 * grad_W_gate and grad_W_up they make, and the bias sums over them. One
 * barrier where the column split has five, and no shared packing stage; each
 * thread packs all of W_down (and W_gate and W_up for grad_x) for its rows.
 * Measured against the column split (C harness as rows_then_weights', 2
 * threads, wall time, median of per-round ratios, 60-100 rounds, load
 * average 2.5-4.5 on 2 cores): bench train_gated's backward (256 tokens, 768
 * -> 3072 -> 768 float32, no grad_x) 0.98, 0.93, 0.92 (AVX-512), 0.95
 * (AVX2); total work (both tasks on one thread) 0.94 and 0.80; the forward
 * and backward together level (1.00, 1.01). */
typedef struct {
  const fmlp_cpu_gated_block_backward_args *args;
  STORE *grad_gate, *grad_up, *from_up;
  int64_t weight_block_at; /* in each task's scratch (pack_need_elems) */
} FN(gated_rows_then_weights);

static void FN(gated_rows_then_weights_part)(const void *block, int64_t stage, int64_t task,
                                             int64_t n_tasks, REAL *task_pack) {
  const FN(gated_rows_then_weights) *bw = block;
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t rows = a->rows, h = a->hidden, dim = a->dim, out = a->out_dim;
  REAL *wb = FN(weight_block_in)(task_pack, bw->weight_block_at);
  int64_t first, count;
  if (stage == 1) {
    FN(even_split)(out, GEMM_MR, n_tasks, task, &first, &count);
    FN(column_sums_slice)(a->grad_y, rows, first, count, a->grad_bias_down);
    if (a->grad_w_down != NULL && count > 0) {
      FN(rows_product)(FN(transposed)(a->grad_y), first, count,
                       FN(transposed)((fmlp_input){a->saved_product, h, 1}), h, rows,
                       a->grad_w_down, task_pack, wb);
    }
    FN(even_split)(h, GEMM_MR, n_tasks, task, &first, &count);
    if (count == 0) return;
    FN(column_sums_slice)((fmlp_input){bw->grad_gate, h, 1}, rows, first, count, a->grad_bias_gate);
    FN(column_sums_slice)((fmlp_input){bw->grad_up, h, 1}, rows, first, count, a->grad_bias_up);
    if (a->grad_w_gate != NULL) {
      FN(rows_product)((fmlp_input){bw->grad_gate, 1, h}, first, count, FN(transposed)(a->x),
                       dim, rows, a->grad_w_gate, task_pack, wb);
    }
    if (a->grad_w_up != NULL) {
      FN(rows_product)((fmlp_input){bw->grad_up, 1, h}, first, count, FN(transposed)(a->x), dim,
                       rows, a->grad_w_up, task_pack, wb);
    }
    return;
  }
  FN(even_split)(rows, GEMM_MR, n_tasks, task, &first, &count);
  if (count == 0) return;
  FN(rows_product)(a->grad_y, first, count, FN(transposed)(a->w_down), h, out, bw->grad_gate,
                   task_pack, wb);
  const int64_t at = first * h;
  FN(gated_grads_span)(bw->grad_gate + at, (const STORE *)a->saved_gate + at,
                       (const STORE *)a->saved_up + at, count * h, a->activation,
                       bw->grad_gate + at, bw->grad_up + at);
  if (a->grad_x == NULL) return;
  STORE *grad_x = a->grad_x;
  FN(rows_product)((fmlp_input){bw->grad_gate, h, 1}, first, count, FN(transposed)(a->w_gate),
                   dim, h, grad_x, task_pack, wb);
  FN(rows_product)((fmlp_input){bw->grad_up, h, 1}, first, count, FN(transposed)(a->w_up), dim,
                   h, bw->from_up, task_pack, wb);
  for (int64_t i = first * dim; i < (first + count) * dim; ++i) {
    grad_x[i] = to_store(to_real(grad_x[i]) + to_real(bw->from_up[i]));
  }
}

/* Whether a gated block's backward over up to BACKWARD_COLUMNS_MAX_ROWS
 * rows (past the few) runs as gated_rows_then_weights on threading: each
 * thread's rows past the few, and the multiply-adds worth a split. Unlike a
 * chain's, whatever its weights: GeGLU 768 -> 3072 -> 768 at 256 tokens,
 * where each thread packs every block of its 7M weights for its rows
 * (gated_rows_then_weights), ran faster. */
static int FN(splits_gated_rows_then_weights)(const fmlp_cpu_gated_block_backward_args *a,
                                              const fmlp_threading *threading) {
  int64_t multiply_adds;
  if (threading == NULL || !FN(rows_split_fits)(a->rows, threading->n_threads)) return 0;
  if (!fmlp_checked_mul(2 * a->rows * a->hidden, 2 * a->dim + a->out_dim, &multiply_adds)) {
    multiply_adds = INT64_MAX;
  }
  return multiply_adds >= COLUMN_SPLIT_MIN_MULTIPLY_ADDS;
}

static fmlp_status FN(gated_backward_rows_then_weights)(
    const fmlp_cpu_gated_block_backward_args *a, const fmlp_threading *threading) {
  const int64_t rows = a->rows, h = a->hidden, out = a->out_dim;
  const int64_t n_tasks = threading->n_threads;
  FN(gated_rows_then_weights) bw = {.args = a};
  FN(pack_need) need = {0, 0, 0};
  FN(need_task_products)(&need, rows, out, n_tasks); /* grad_product */
  FN(need_task_products)(&need, rows, h, n_tasks);   /* grad_x, from_up */
  FN(need_task_products)(&need, out, rows, n_tasks); /* grad_W_down */
  FN(need_task_products)(&need, h, rows, n_tasks);   /* grad_W_gate, grad_W_up */
  FN(advise_gated_weight_grads)(a);
  FN(column_split) split = {NULL, NULL, 0};
  fmlp_status status = FN(backward_split)(threading, INT64_MAX, 0,
                                          FN(pack_need_elems)(&need, &bw.weight_block_at), &split);
  const int scratch = FN(alloc_gated_scratch)(a, &bw.grad_gate, &bw.grad_up, &bw.from_up);
  if (status == FMLP_OK && !scratch) status = FMLP_ERR_OUT_OF_MEMORY;
  if (status == FMLP_OK) {
    FN(run_column_stages)(&split, 2, FN(gated_rows_then_weights_part), &bw, split.packs);
  }
  free(bw.from_up);
  free(bw.grad_gate);
  free(split.packs);
  return status;
}

/* ---- a chain's backward ---- */

/* A chain's backward over many rows. Per layer l, from the last: grad_pre_l
 * = grad_h * act'(pre_l) with its column sums (grad_bias_l), dW_l =
 * grad_pre_l^T @ h_l and grad_h below = grad_pre_l @ W_l (grad_x below the
 * first), both products reading transposed views packed by plain copies.
 * Each stage packs the weight the next stage multiplies, so a pack is read
 * soon after it is written, much of it still in the L2 (a 512-wide layer at
 * 256 rows packs 1.5 MiB for its two products): stage 0, grad_pre of the top
 * layer and dW's pack; then per layer l, from the top, one stage of dW_l's
 * rows and dX_l's pack, one of dX_l's rows, grad_pre of the layer below on
 * those rows (in place) and the next dW pack; last, the bias sums. grad_pre
 * ping-pongs through two rows x max-width matrices. */
typedef struct {
  const fmlp_cpu_chain_backward_args *args;
  FN(split_product) *dw, *dx; /* per layer */
  STORE *scratch;
  REAL *partial; /* per layer sum_chunks(rows) x max_width, or NULL */
  int64_t max_width;
} FN(rows_backward);

static STORE *FN(rows_grad_pre)(const FN(rows_backward) *bw, int64_t l) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t top = a->n_layers - 1;
  if (l == top && a->final_activation == FMLP_ACT_NONE) return (STORE *)a->grad_y.data;
  return bw->scratch + ((top - l) % 2) * a->rows * bw->max_width;
}

static REAL *FN(rows_partial)(const FN(rows_backward) *bw, int64_t l) {
  if (bw->partial == NULL) return NULL;
  return bw->partial + l * FN(sum_chunks)(bw->args->rows) * bw->max_width;
}

/* Rows [r0, r0 + count) of layer l's grad_pre from its grad (grad_y, or its
 * own grad_pre buffer), and their chunks' column sums. */
static void FN(finish_grad_pre_rows)(const FN(rows_backward) *bw, int64_t l, const STORE *grad,
                                     int64_t r0, int64_t count) {
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t width = a->widths[l + 1];
  const fmlp_activation activation =
      l == a->n_layers - 1 ? a->final_activation : a->hidden_activation;
  STORE *grad_pre = FN(rows_grad_pre)(bw, l);
  if (activation != FMLP_ACT_NONE) {
    const STORE *pre = FN(derivative_input)(a, l);
    for (int64_t r = r0; r < r0 + count; ++r) {
      FN(activation_grad_span)(grad_pre + r * width, grad + r * width, pre + r * width, width,
                               activation);
    }
  }
  FN(chunk_sums)(grad_pre, r0, count, width, FN(rows_partial)(bw, l));
}

static void FN(rows_backward_part)(const void *block, int64_t stage, int64_t task,
                                   int64_t n_tasks, REAL *input_pack) {
  const FN(rows_backward) *bw = block;
  const fmlp_cpu_chain_backward_args *a = bw->args;
  const int64_t n_layers = a->n_layers, top = n_layers - 1;
  int64_t r0, count;
  if (stage == 2 * n_layers + 1) {
    for (int64_t l = 0; l < n_layers && a->grad_biases != NULL; ++l) {
      FN(reduce_sums_share)(FN(rows_partial)(bw, l), FN(sum_chunks)(a->rows), a->widths[l + 1],
                            a->grad_biases[l], task, n_tasks);
    }
    return;
  }
  if (stage == 0) {
    FN(even_split)(a->rows, SUM_CHUNK_ROWS, n_tasks, task, &r0, &count);
    FN(finish_grad_pre_rows)(bw, top, a->grad_y.data, r0, count);
    FN(pack_share)(&bw->dw[top], task, n_tasks);
    return;
  }
  const int64_t l = n_layers - (stage + 1) / 2;
  if (stage % 2 == 1) {
    FN(product_share)(&bw->dw[l], task, n_tasks, input_pack, &r0, &count);
    FN(pack_share)(&bw->dx[l], task, n_tasks);
    return;
  }
  FN(product_share)(&bw->dx[l], task, n_tasks, input_pack, &r0, &count);
  if (l == 0) return;
  FN(finish_grad_pre_rows)(bw, l - 1, bw->dx[l].c, r0, count);
  FN(pack_share)(&bw->dw[l - 1], task, n_tasks);
}

static fmlp_status FN(chain_backward_rows)(const fmlp_cpu_chain_backward_args *a,
                                           const fmlp_threading *threading) {
  const int64_t rows = a->rows, n_layers = a->n_layers;
  FN(rows_backward) bw = {.args = a};
  int64_t dw_pack = 0, dx_pack = 0, input_pack = 0, multiply_adds = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t width = a->widths[l + 1], k = a->widths[l];
    if (width > bw.max_width) bw.max_width = width;
    FN(max_elems)(&dw_pack, FN(packed_weight_elems)(k, rows));
    FN(max_elems)(&dx_pack, FN(packed_weight_elems)(k, width));
    int64_t layer;
    if (!fmlp_checked_mul(2 * rows * k, width, &layer)) layer = -1;
    FN(add_elems)(&multiply_adds, layer);
  }
  if (multiply_adds < 0) multiply_adds = INT64_MAX; /* saturated: it only chooses the split */
  int64_t pack_elems = dw_pack;
  FN(add_elems)(&pack_elems, dx_pack);
  if (pack_elems < 0) return FMLP_ERR_SIZE_OVERFLOW;
  bw.dw = calloc((size_t)(2 * n_layers), sizeof(*bw.dw));
  REAL *packs = fmlp_alloc_scratch(pack_elems, sizeof(REAL));
  bw.scratch = fmlp_alloc_matrices(2, rows, bw.max_width, sizeof(STORE));
  if (a->grad_biases != NULL) {
    bw.partial = fmlp_alloc_matrices(n_layers * FN(sum_chunks)(rows), 1, bw.max_width,
                                     sizeof(REAL));
  }
  fmlp_status status = FMLP_OK;
  if (bw.dw == NULL || packs == NULL || bw.scratch == NULL ||
      (a->grad_biases != NULL && bw.partial == NULL)) {
    status = FMLP_ERR_OUT_OF_MEMORY;
  }
  FN(column_split) split = {NULL, NULL, 0};
  if (status == FMLP_OK) {
    bw.dx = bw.dw + n_layers;
    for (int64_t l = 0; l < n_layers; ++l) {
      const int64_t width = a->widths[l + 1], k = a->widths[l];
      const fmlp_input grad_pre = {FN(rows_grad_pre)(&bw, l), width, 1};
      const fmlp_input input = l == 0 ? a->x : (fmlp_input){a->saved_hidden[l - 1], k, 1};
      STORE *grad_below = l > 0 ? FN(rows_grad_pre)(&bw, l - 1) : a->grad_x;
      bw.dw[l] = FN(split_product_of)(FN(transposed)(grad_pre), width, FN(transposed)(input), k,
                                      rows, a->grad_weights[l], packs);
      bw.dx[l] = FN(split_product_of)(grad_pre, rows, FN(transposed)(a->weights[l]), k, width,
                                      grad_below, packs + dw_pack);
      if (bw.dw[l].c != NULL) FN(advise_output)(bw.dw[l].c, width, k, k);
      FN(max_elems)(&input_pack, FN(product_input_pack)(&bw.dw[l]));
      FN(max_elems)(&input_pack, FN(product_input_pack)(&bw.dx[l]));
    }
    status = FN(backward_split)(threading, multiply_adds, PARALLEL_MIN_MULTIPLY_ADDS, input_pack,
                                 &split);
  }
  if (status == FMLP_OK) {
    FN(run_rows_stages)(&split, 2 * n_layers + 2, FN(rows_backward_part), &bw);
  }
  free(split.packs);
  free(bw.partial);
  free(bw.scratch);
  free(packs);
  free(bw.dw);
  return status;
}

/* The chain's backward for a contiguous grad_y. */
static fmlp_status FN(chain_backward_dense)(const fmlp_cpu_chain_backward_args *a,
                                            const fmlp_threading *threading) {
#if FMLP_TRANSPOSED_KERNELS
  if (FN(few_rows_backward_fits)(a)) return FN(chain_backward_columns)(a, 1, threading);
#endif
  if (a->rows > BACKWARD_COLUMNS_MAX_ROWS) return FN(chain_backward_rows)(a, threading);
  if (FN(splits_rows_then_weights)(a, threading)) {
    return FN(chain_backward_rows_then_weights)(a, threading);
  }
  return FN(chain_backward_columns)(a, 0, threading);
}

fmlp_status FN(fmlp_cpu_chain_backward)(const fmlp_cpu_chain_backward_args *args,
                                        const fmlp_threading *threading) {
  fmlp_cpu_chain_backward_args a = *args;
  STORE *copy;
  if (!FN(dense_grad_y)(&a.grad_y, a.rows, a.widths[a.n_layers], &copy)) {
    return FMLP_ERR_OUT_OF_MEMORY;
  }
  const fmlp_status status = FN(chain_backward_dense)(&a, threading);
  free(copy);
  return status;
}

/* ---- the gated block's backward ---- */

/* A gated block's backward over many rows, as stages (see split_product)
 * that alternate between packing one weight and the products that read it:
 *  0: colsum(grad_y) chunks (grad_b_down); pack product^T.
 *  1: grad_W_down = grad_y^T @ product.            2: pack W_down^T.
 *  3: grad_product = grad_y @ W_down (into grad_gate), turned on each task's
 *     rows into grad_gate (in place) and grad_up, with their sums' chunks.
 *  4: pack x^T.   5: grad_W_gate = grad_gate^T @ x, grad_W_up = grad_up^T @ x.
 *  6: pack W_gate^T.   7: grad_x = grad_gate @ W_gate.   8: pack W_up^T.
 *  9: from_up = grad_up @ W_up, added into grad_x on each task's rows; the
 *     bias sums.
 * One pack buffer, the largest pack's size, serves them all: packing the next
 * weight while a product runs would need two, and scratch this large comes
 * back as fresh pages the kernel clears on every call (at 256 tokens, 768 ->
 * 3072 -> 768 float32, two buffers, 12.6 MiB against 9.4, doubled the page
 * clearing to ~9% of the micro-kernel's samples). */
typedef struct {
  const fmlp_cpu_gated_block_backward_args *args;
  FN(split_product) w_down, product, w_gate, w_up, gate_x, up_x;
  STORE *grad_gate, *grad_up, *from_up;
  REAL *partial; /* chunks x (hidden, hidden, out_dim): gate, up, down */
} FN(rows_gated_backward);

static REAL *FN(rows_gated_partial)(const FN(rows_gated_backward) *bw, int64_t which) {
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t chunks = FN(sum_chunks)(a->rows);
  return bw->partial + chunks * a->hidden * (which < 2 ? which : 2);
}

static void FN(rows_gated_part)(const void *block, int64_t stage, int64_t task, int64_t n_tasks,
                                REAL *input_pack) {
  const FN(rows_gated_backward) *bw = block;
  const fmlp_cpu_gated_block_backward_args *a = bw->args;
  const int64_t h = a->hidden, dim = a->dim, chunks = FN(sum_chunks)(a->rows);
  int64_t r0, count;
  switch (stage) {
    case 0:
      FN(even_split)(a->rows, SUM_CHUNK_ROWS, n_tasks, task, &r0, &count);
      if (a->grad_bias_down != NULL) {
        FN(chunk_sums)(a->grad_y.data, r0, count, a->out_dim, FN(rows_gated_partial)(bw, 2));
      }
      FN(pack_share)(&bw->w_down, task, n_tasks);
      return;
    case 1:
      FN(product_share)(&bw->w_down, task, n_tasks, input_pack, &r0, &count);
      return;
    case 2:
      FN(pack_share)(&bw->product, task, n_tasks);
      return;
    case 3: {
      FN(product_share)(&bw->product, task, n_tasks, input_pack, &r0, &count);
      const int64_t at = r0 * h;
      const STORE *gate = a->saved_gate, *up = a->saved_up;
      FN(gated_grads_span)(bw->grad_gate + at, gate + at, up + at, count * h, a->activation,
                           bw->grad_gate + at, bw->grad_up + at);
      if (a->grad_bias_gate != NULL) {
        FN(chunk_sums)(bw->grad_gate, r0, count, h, FN(rows_gated_partial)(bw, 0));
      }
      if (a->grad_bias_up != NULL) {
        FN(chunk_sums)(bw->grad_up, r0, count, h, FN(rows_gated_partial)(bw, 1));
      }
      return;
    }
    case 4:
      /* one pack of x^T for both products */
      FN(pack_share)(bw->gate_x.c != NULL ? &bw->gate_x : &bw->up_x, task, n_tasks);
      return;
    case 5:
      FN(product_share)(&bw->gate_x, task, n_tasks, input_pack, &r0, &count);
      FN(product_share)(&bw->up_x, task, n_tasks, input_pack, &r0, &count);
      return;
    case 6:
      FN(pack_share)(&bw->w_gate, task, n_tasks);
      return;
    case 7:
      FN(product_share)(&bw->w_gate, task, n_tasks, input_pack, &r0, &count);
      return;
    case 8:
      FN(pack_share)(&bw->w_up, task, n_tasks);
      return;
    default:
      FN(product_share)(&bw->w_up, task, n_tasks, input_pack, &r0, &count);
      if (bw->w_up.c != NULL) {
        STORE *grad_x = a->grad_x;
        for (int64_t i = r0 * dim; i < (r0 + count) * dim; ++i) {
          grad_x[i] = to_store(to_real(grad_x[i]) + to_real(bw->from_up[i]));
        }
      }
      FN(reduce_sums_share)(FN(rows_gated_partial)(bw, 0), chunks, h, a->grad_bias_gate, task,
                            n_tasks);
      FN(reduce_sums_share)(FN(rows_gated_partial)(bw, 1), chunks, h, a->grad_bias_up, task,
                            n_tasks);
      FN(reduce_sums_share)(FN(rows_gated_partial)(bw, 2), chunks, a->out_dim, a->grad_bias_down,
                            task, n_tasks);
  }
}

static fmlp_status FN(gated_backward_rows)(const fmlp_cpu_gated_block_backward_args *a,
                                           const fmlp_threading *threading) {
  const int64_t rows = a->rows, h = a->hidden, dim = a->dim, out = a->out_dim;
  int64_t pack_elems = FN(packed_weight_elems)(h, rows), partial_cols = 2 * h, multiply_adds;
  FN(max_elems)(&pack_elems, FN(packed_weight_elems)(h, out));
  FN(max_elems)(&pack_elems, FN(packed_weight_elems)(dim, rows));
  FN(max_elems)(&pack_elems, FN(packed_weight_elems)(dim, h));
  FN(add_elems)(&partial_cols, out);
  if (pack_elems < 0 || partial_cols < 0) return FMLP_ERR_SIZE_OVERFLOW;
  if (!fmlp_checked_mul(2 * rows * h, 2 * dim + out, &multiply_adds)) multiply_adds = INT64_MAX;
  FN(rows_gated_backward) bw = {.args = a};
  REAL *packs = fmlp_alloc_scratch(pack_elems, sizeof(REAL));
  const int scratch = FN(alloc_gated_scratch)(a, &bw.grad_gate, &bw.grad_up, &bw.from_up);
  bw.partial = fmlp_alloc_matrices(FN(sum_chunks)(rows), 1, partial_cols, sizeof(REAL));
  fmlp_status status = FMLP_OK;
  FN(column_split) split = {NULL, NULL, 0};
  if (packs == NULL || !scratch || bw.partial == NULL) {
    status = FMLP_ERR_OUT_OF_MEMORY;
  } else {
    const fmlp_input grad_y = a->grad_y, product = {a->saved_product, h, 1};
    const fmlp_input grad_gate = {bw.grad_gate, h, 1}, grad_up = {bw.grad_up, h, 1};
    bw.w_down = FN(split_product_of)(FN(transposed)(grad_y), out, FN(transposed)(product), h,
                                     rows, a->grad_w_down, packs);
    bw.product = FN(split_product_of)(grad_y, rows, FN(transposed)(a->w_down), h, out,
                                      bw.grad_gate, packs);
    bw.gate_x = FN(split_product_of)(FN(transposed)(grad_gate), h, FN(transposed)(a->x), dim,
                                     rows, a->grad_w_gate, packs);
    bw.up_x = FN(split_product_of)(FN(transposed)(grad_up), h, FN(transposed)(a->x), dim, rows,
                                   a->grad_w_up, packs);
    bw.w_gate = FN(split_product_of)(grad_gate, rows, FN(transposed)(a->w_gate), dim, h,
                                     a->grad_x, packs);
    bw.w_up = FN(split_product_of)(grad_up, rows, FN(transposed)(a->w_up), dim, h,
                                   a->grad_x != NULL ? bw.from_up : NULL, packs);
    FN(advise_gated_weight_grads)(a);
    int64_t input_pack = 0;
    const FN(split_product) *products[] = {&bw.w_down, &bw.product, &bw.gate_x,
                                           &bw.up_x,   &bw.w_gate,  &bw.w_up};
    for (size_t p = 0; p < sizeof(products) / sizeof(*products); ++p) {
      FN(max_elems)(&input_pack, FN(product_input_pack)(products[p]));
    }
    status = FN(backward_split)(threading, multiply_adds, PARALLEL_MIN_MULTIPLY_ADDS, input_pack,
                                 &split);
  }
  if (status == FMLP_OK) FN(run_rows_stages)(&split, 10, FN(rows_gated_part), &bw);
  free(split.packs);
  free(bw.partial);
  free(bw.from_up);
  free(bw.grad_gate);
  free(packs);
  return status;
}

/* The gated block's backward for a contiguous grad_y. */
static fmlp_status FN(gated_block_backward_dense)(const fmlp_cpu_gated_block_backward_args *a,
                                                  const fmlp_threading *threading) {
#if FMLP_TRANSPOSED_KERNELS
  if (FN(few_rows_gated_fits)(a)) return FN(gated_backward_columns)(a, 1, threading);
#endif
  if (a->rows > BACKWARD_COLUMNS_MAX_ROWS) return FN(gated_backward_rows)(a, threading);
  if (FN(splits_gated_rows_then_weights)(a, threading)) {
    return FN(gated_backward_rows_then_weights)(a, threading);
  }
  return FN(gated_backward_columns)(a, 0, threading);
}

fmlp_status FN(fmlp_cpu_gated_block_backward)(const fmlp_cpu_gated_block_backward_args *args,
                                              const fmlp_threading *threading) {
  fmlp_cpu_gated_block_backward_args a = *args;
  STORE *copy;
  if (!FN(dense_grad_y)(&a.grad_y, a.rows, a.out_dim, &copy)) return FMLP_ERR_OUT_OF_MEMORY;
  const fmlp_status status = FN(gated_block_backward_dense)(&a, threading);
  free(copy);
  return status;
}
