/* Cache-blocked GEMM with a fused epilogue (template: see real_template.h;
 * SIMD translation units also include their simd_<isa>.h first).
 *
 * Goto/BLIS shape: the weight is packed into NR-wide column panels (in
 * parallel); for each NC x KC block of it, MC x KC blocks of the input are
 * packed into MR-tall row panels and a register-tiled micro-kernel updates an
 * MR x NR tile of the output. On the last K block the micro-kernel adds the
 * bias (started on the first), applies the activation and stores, so the
 * output is written once in its final form.
 *
 * Small row counts skip packing the weight (it would cost as much as the
 * product): the SIMD kernels then compute the transposed product, reading
 * weight rows in place. */
#include <stdatomic.h>
#include <string.h>

#include "activation.h"
#include "fusedmlp/cpu.h"
#include "memory.h"

#ifdef FMLP_SIMD_WIDTH
/* MR x NV accumulators, NV loads of b and one broadcast fill the register
 * file: 12 x 2 zmm (AVX-512), 6 x 2 ymm (AVX2). */
#if FMLP_SIMD_REGISTERS >= 32
#define GEMM_MR 12
#else
#define GEMM_MR 6
#endif
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* Long K blocks: one pass over K for most layers, so each tile is loaded and
 * stored once. Measured on Zen 4 (1024^3, one thread): KC 1024 x MC 48 ran
 * ~15% faster than the textbook KC 256 x MC 192 (KC x NR in L1); the
 * MC x KC input block (192 KiB) and the KC x NR weight panel both stay in L2,
 * which feeds the FMA units fast enough. */
#define GEMM_KC 1024
#define GEMM_MC (GEMM_MR * 4)
#define GEMM_NC 1024
/* Up to this many rows the weight is read in place rather than packed
 * (chosen with `python -m fusedmlp.bench`: packing a weight costs about as
 * much as multiplying it by this many rows). */
#define GEMM_UNPACKED_MAX_ROWS ((int64_t)(2 * GEMM_NR))
#else
#define GEMM_MR 4
#define GEMM_NR ((int64_t)(64 / sizeof(REAL))) /* one cache line of REAL */
#define GEMM_KC 256
#define GEMM_MC 64
#define GEMM_NC 1024
#define GEMM_UNPACKED_MAX_ROWS ((int64_t)0) /* the portable kernel always packs */
#endif

/* Weight panels packed per parallel task. */
#define PACK_PANELS_PER_TASK ((int64_t)8)

/* Fork/join costs a few microseconds on an idle 2-core machine and far more
 * on a busy one; below this many multiply-adds (~20 us on one core) the
 * calling thread does the work alone. */
#define PARALLEL_MIN_MULTIPLY_ADDS ((int64_t)1 << 21)
/* Elements a parallel weight pack or pointwise pass needs to be worth it. */
#define PARALLEL_MIN_ELEMENTS ((int64_t)1 << 18)

/* threading, or NULL (serial) when `work` is below `minimum`. */
static const fmlp_threading *FN(threading_for)(const fmlp_threading *threading, int64_t work,
                                               int64_t minimum) {
  return work >= minimum ? threading : NULL;
}

/* Tasks handed out one at a time from a shared counter: a thread slowed by
 * another process on its core (or a slower core) takes fewer of them, where
 * the pool's static split would make everyone wait for it. */
typedef struct {
  atomic_llong next;
  int64_t n_tasks;
  void *job;
  fmlp_task_fn fn;
} FN(task_queue);

static void FN(drain_task_queue)(void *context, int64_t begin, int64_t end) {
  FN(task_queue) *queue = context;
  (void)begin;
  (void)end;
  for (;;) {
    const int64_t task = (int64_t)atomic_fetch_add(&queue->next, 1);
    if (task >= queue->n_tasks) return;
    queue->fn(queue->job, task, task + 1);
  }
}

static void FN(run_tasks)(const fmlp_threading *threading, int64_t n_tasks, void *job,
                          fmlp_task_fn fn) {
  if (threading == NULL || threading->parallel_for == NULL || threading->n_threads <= 1 ||
      n_tasks <= 1) {
    fn(job, 0, n_tasks);
    return;
  }
  FN(task_queue) queue = {.n_tasks = n_tasks, .job = job, .fn = fn};
  atomic_init(&queue.next, 0);
  const int64_t workers = threading->n_threads < n_tasks ? threading->n_threads : n_tasks;
  threading->parallel_for(threading->pool, workers, &queue, FN(drain_task_queue));
}

/* A weight [n, k] packed into ceil(n / NR) panels of k rows by NR columns,
 * zero-padded past n: element (row j, col kk) of W lives at
 * data[(j / NR) * k * NR + kk * NR + j % NR]. data == NULL: not packed, the
 * kernels read `source` in place (unit column stride). */
typedef struct {
  REAL *data;
  fmlp_input source;
  int64_t n, k;
} FN(packed_weight);

#ifdef FMLP_SIMD_WIDTH
/* dst[c * dst_stride + r] = src[r * src_stride + c] for r < stored_rows and
 * c < cols, with rows at or past n_rows (<= stored_rows <= W) zero: W x W
 * blocks go through registers (a vector transpose moves ~8x more elements a
 * cycle than a scalar copy), the last cols % W columns element by element.
 * src has unit column stride. */
static void FN(pack_transposed_block)(const REAL *src, int64_t src_stride, int64_t n_rows,
                                      int64_t stored_rows, int64_t cols, REAL *dst,
                                      int64_t dst_stride) {
  int64_t c0 = 0;
  for (; c0 + FMLP_SIMD_WIDTH <= cols; c0 += FMLP_SIMD_WIDTH) {
    vreal block[FMLP_SIMD_WIDTH];
    for (int i = 0; i < FMLP_SIMD_WIDTH; ++i) {
      block[i] = i < n_rows ? v_load(src + i * src_stride + c0) : v_zero();
    }
    v_transpose(block);
    for (int t = 0; t < FMLP_SIMD_WIDTH; ++t) {
      v_store_first(dst + (c0 + t) * dst_stride, block[t], stored_rows);
    }
  }
  for (int64_t c = c0; c < cols; ++c) {
    for (int64_t i = 0; i < stored_rows; ++i) {
      dst[c * dst_stride + i] = i < n_rows ? src[i * src_stride + c] : (REAL)0;
    }
  }
}
#endif

/* dst[kk * width + i] = src[i * rs + kk * cs] for i < count and kk < k, zero
 * for count <= i < width: `width` rows of a strided matrix, K-major. Rows that
 * sit next to each other (rs == 1, the transposed views the backward passes)
 * are copied `count` values at a time. */
static void FN(pack_rows_k_major)(const REAL *src, int64_t rs, int64_t cs, int64_t count,
                                  int64_t width, int64_t k, REAL *dst) {
  for (int64_t kk = 0; kk < k; ++kk) {
    REAL *out = dst + kk * width;
    if (rs == 1) {
      memcpy(out, src + kk * cs, (size_t)count * sizeof(REAL));
    } else {
      for (int64_t i = 0; i < count; ++i) out[i] = src[i * rs + kk * cs];
    }
    for (int64_t i = count; i < width; ++i) out[i] = (REAL)0;
  }
}

/* pack_rows_k_major, with rows of unit column stride (the forward's operands)
 * transposed through registers, W x W at a time. */
static void FN(pack_k_major)(const REAL *src, int64_t rs, int64_t cs, int64_t count,
                             int64_t width, int64_t k, REAL *dst) {
#ifdef FMLP_SIMD_WIDTH
  if (cs == 1) {
    for (int64_t half = 0; half < width; half += FMLP_SIMD_WIDTH) {
      const int64_t stored = width - half < FMLP_SIMD_WIDTH ? width - half : FMLP_SIMD_WIDTH;
      const int64_t n_rows = count - half < 0 ? 0 : count - half < stored ? count - half : stored;
      FN(pack_transposed_block)(n_rows > 0 ? src + half * rs : src, rs, n_rows, stored, k,
                                dst + half, width);
    }
    return;
  }
#endif
  FN(pack_rows_k_major)(src, rs, cs, count, width, k, dst);
}

static void FN(pack_weight_panels)(void *context, int64_t begin, int64_t end) {
  const FN(packed_weight) *packed = context;
  const int64_t n = packed->n, k = packed->k, n_panels = (n + GEMM_NR - 1) / GEMM_NR;
  const REAL *src = packed->source.data;
  const int64_t rs = packed->source.row_stride, cs = packed->source.col_stride;
  const int64_t first = begin * PACK_PANELS_PER_TASK;
  const int64_t last = end * PACK_PANELS_PER_TASK < n_panels ? end * PACK_PANELS_PER_TASK
                                                             : n_panels;
  for (int64_t p = first; p < last; ++p) {
    const int64_t count = n - p * GEMM_NR < GEMM_NR ? n - p * GEMM_NR : GEMM_NR;
    FN(pack_k_major)(src + p * GEMM_NR * rs, rs, cs, count, GEMM_NR, k,
                     packed->data + p * k * GEMM_NR);
  }
}

/* Whether a weight multiplied into `rows` rows is read in place. */
static int FN(weight_stays_unpacked)(fmlp_input w, int64_t rows) {
  return rows <= GEMM_UNPACKED_MAX_ROWS && w.col_stride == 1;
}

static fmlp_status FN(pack_weight)(fmlp_input w, int64_t n, int64_t k, int64_t rows,
                                   const fmlp_threading *threading, FN(packed_weight) *packed) {
  *packed = (FN(packed_weight)){.data = NULL, .source = w, .n = n, .k = k};
  if (FN(weight_stays_unpacked)(w, rows) || n == 0 || k == 0) return FMLP_OK;
  const int64_t n_panels = (n + GEMM_NR - 1) / GEMM_NR;
  int64_t count;
  if (!fmlp_checked_mul(n_panels, k, &count) || !fmlp_checked_mul(count, GEMM_NR, &count)) {
    return FMLP_ERR_SIZE_OVERFLOW;
  }
  packed->data = fmlp_alloc_scratch(count, sizeof(REAL));
  if (packed->data == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  FN(run_tasks)(FN(threading_for)(threading, count, PARALLEL_MIN_ELEMENTS),
                (n_panels + PACK_PANELS_PER_TASK - 1) / PACK_PANELS_PER_TASK, packed,
                FN(pack_weight_panels));
  return FMLP_OK;
}

/* Rows [0, mc) and columns [pc, pc + kc) of x into MR-tall panels,
 * zero-padded past mc: element (i, kk) at dst[(i / MR) * kc * MR + kk * MR + i % MR]. */
static void FN(pack_input_block)(fmlp_input x, int64_t mc, int64_t pc, int64_t kc, REAL *dst) {
  const REAL *src = x.data;
  for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
    FN(pack_k_major)(src + ir * x.row_stride + pc * x.col_stride, x.row_stride, x.col_stride,
                     mc - ir < GEMM_MR ? mc - ir : GEMM_MR, GEMM_MR, kc,
                     dst + (ir / GEMM_MR) * kc * GEMM_MR);
  }
}

/* Where a product's outputs go: its activations into row-major c (row stride
 * ldc) or, when c_lanes is set, into the lanes layout (see lanes_width); its
 * pre-activations into row-major pre (row stride pre_stride) when set. */
typedef struct {
  REAL *c, *c_lanes, *pre;
  int64_t ldc, pre_stride;
} FN(product_out);

/* What a micro-kernel does with its tile after the K loop. */
typedef struct {
  const REAL *bias; /* at the tile's first column, or NULL */
  REAL *pre;        /* where the last K block stores the pre-activation, or NULL */
  int64_t pre_stride;
  fmlp_activation activation;
  int first_k_block; /* start from the bias rather than from c */
  int last_k_block;  /* finish: save the pre-activation, activate */
} FN(tile_epilogue);

#ifdef FMLP_SIMD_WIDTH
#include "vector_math.h"
#include "microkernel_simd.h"
#define FMLP_MICROKERNEL FN(microkernel_packed)
#else
static void FN(activate_span)(REAL *v, int64_t n, fmlp_activation activation) {
  FN(activate_row)(v, n, activation);
}

static void FN(activation_grad_span)(REAL *out, const REAL *grad, const REAL *pre, int64_t n,
                                     fmlp_activation activation) {
  FN(activation_grad_row)(out, grad, pre, n, activation);
}

static void FN(finish_tile)(REAL acc[GEMM_MR][GEMM_NR], int64_t rows, int64_t cols, REAL *c,
                            int64_t ldc, const FN(tile_epilogue) *ep) {
  for (int64_t i = 0; i < rows; ++i) {
    REAL *row = acc[i];
    REAL *c_row = c + i * ldc;
    if (!ep->first_k_block) {
      for (int64_t j = 0; j < cols; ++j) row[j] += c_row[j];
    } else if (ep->bias != NULL) {
      for (int64_t j = 0; j < cols; ++j) row[j] += ep->bias[j];
    }
    if (ep->last_k_block) {
      if (ep->pre != NULL) memcpy(ep->pre + i * ep->pre_stride, row, (size_t)cols * sizeof(REAL));
      FN(activate_row)(row, cols, ep->activation);
    }
    memcpy(c_row, row, (size_t)cols * sizeof(REAL));
  }
}

/* The portable micro-kernel: rank-1 updates of an MR x NR tile held in a
 * local array the compiler keeps in vector registers. rows <= MR and
 * cols <= NR say how much of the tile is inside the output. */
static void FN(microkernel_portable)(int64_t kc, const REAL *restrict a, const REAL *restrict b,
                                     REAL *c, int64_t ldc, int64_t rows, int64_t cols,
                                     const FN(tile_epilogue) *ep) {
  REAL acc[GEMM_MR][GEMM_NR] = {{0}};
  for (int64_t kk = 0; kk < kc; ++kk) {
    const REAL *a_k = a + kk * GEMM_MR;
    const REAL *b_k = b + kk * GEMM_NR;
    for (int64_t i = 0; i < GEMM_MR; ++i) {
      for (int64_t j = 0; j < GEMM_NR; ++j) acc[i][j] += a_k[i] * b_k[j];
    }
  }
  FN(finish_tile)(acc, rows, cols, c, ldc, ep);
}
#define FMLP_MICROKERNEL FN(microkernel_portable)
#endif

/* With K == 0 the product is empty: the output is act(bias), or act(0). */
static void FN(fill_empty_product)(int64_t rows, int64_t n, const REAL *bias,
                                   fmlp_activation activation, REAL *c, int64_t ldc, REAL *pre,
                                   int64_t pre_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    REAL *row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] = bias != NULL ? bias[j] : (REAL)0;
    if (pre != NULL) memcpy(pre + i * pre_stride, row, (size_t)n * sizeof(REAL));
    FN(activate_span)(row, n, activation);
  }
}

/* Elements of scratch one thread needs for gemm_rows over up to `rows` rows
 * with K up to max_k; -1 on overflow. Sized to the problem, not to the cache
 * blocks: a small call then gets a small buffer from the allocator's free
 * lists, not a fresh mmap with page faults. */
static int64_t FN(input_pack_elems)(int64_t rows, int64_t max_k) {
  int64_t unpacked = 0, packed;
  if (rows <= GEMM_UNPACKED_MAX_ROWS && !fmlp_checked_mul(max_k, GEMM_NR, &unpacked)) return -1;
  const int64_t mc = rows < GEMM_MC ? (rows + GEMM_MR - 1) / GEMM_MR * GEMM_MR : GEMM_MC;
  if (!fmlp_checked_mul(mc, max_k < GEMM_KC ? max_k : GEMM_KC, &packed)) return -1;
  return unpacked > packed ? unpacked : packed;
}

#ifdef FMLP_SIMD_WIDTH
/* gemm_rows for up to DOT_MAX_ROWS unit-stride rows and a weight read in
 * place: dot products along K, then bias, pre-activation and activation per
 * output row segment. */
static void FN(gemm_rows_dot)(fmlp_input x, int64_t rows, const FN(packed_weight) *w,
                              const REAL *bias, fmlp_activation activation, REAL *c,
                              int64_t ldc, REAL *pre, int64_t pre_stride) {
  const int64_t n = w->n, k = w->k;
  const REAL *x_data = x.data, *w_data = w->source.data;
  const REAL *x_rows[DOT_MAX_ROWS];
  /* rows past the input's end re-read its first row: in bounds, never stored */
  for (int64_t r = 0; r < DOT_MAX_ROWS; ++r) {
    x_rows[r] = x_data + (r < rows ? r : 0) * x.row_stride;
  }
  for (int64_t j0 = 0; j0 < n; j0 += DOT_WEIGHT_ROWS) {
    const int64_t n_cols = n - j0 < DOT_WEIGHT_ROWS ? n - j0 : DOT_WEIGHT_ROWS;
    const REAL *w_rows[DOT_WEIGHT_ROWS];
    for (int64_t j = 0; j < DOT_WEIGHT_ROWS; ++j) {
      w_rows[j] = w_data + (j0 + (j < n_cols ? j : 0)) * w->source.row_stride;
    }
    REAL out[DOT_MAX_ROWS][DOT_WEIGHT_ROWS];
    FN(dot_tile)(k, x_rows, w_rows, out);
    for (int64_t r = 0; r < rows; ++r) {
      REAL *segment = out[r];
      for (int64_t j = 0; j < n_cols; ++j) segment[j] += bias != NULL ? bias[j0 + j] : (REAL)0;
      if (pre != NULL) memcpy(pre + r * pre_stride + j0, segment, (size_t)n_cols * sizeof(REAL));
      FN(activate_span)(segment, n_cols, activation);
      memcpy(c + r * ldc + j0, segment, (size_t)n_cols * sizeof(REAL));
    }
  }
}

/* Few rows in the transposed kernels' own layout, "lanes": K-major and
 * lanes_width(rows) wide, element (r, c) at data[c * width + r], lanes past
 * `rows` padding (computed, never stored elsewhere). A hidden layer of a
 * few-row chain leaves its output so for the next layer, which then packs
 * nothing, and neither transposes its tiles. Up to NR rows (one slice).
 * 16 x (256 -> 256 -> 256 -> 256) ReLU in the C harness: 62.6 -> 60.9 us
 * on one thread, 35.0 -> 32.6 us on two (the next layer's packing read the
 * other thread's columns through a transpose). */
static int FN(lanes_possible)(int64_t rows) { return rows > DOT_MAX_ROWS && rows <= GEMM_NR; }

static int64_t FN(lanes_width)(int64_t rows) {
  return rows <= FMLP_SIMD_WIDTH ? FMLP_SIMD_WIDTH : GEMM_NR;
}

/* act(x @ W.T + bias) for a weight read in place: the transposed
 * micro-kernels over slices of NR input rows (or one vector's worth, where
 * that is all there is) and MR weight rows. The input is x, packed here a
 * slice at a time, or x_lanes; out.c_lanes and x_lanes need
 * lanes_possible(rows). */
static void FN(transposed_rows)(fmlp_input x, const REAL *x_lanes, int64_t rows,
                                const FN(packed_weight) *w, const REAL *bias,
                                fmlp_activation activation, FN(product_out) out,
                                REAL *scratch) {
  const int64_t n = w->n, k = w->k;
  const REAL *w_data = w->source.data;
  if (x_lanes == NULL && out.c_lanes == NULL && rows <= DOT_MAX_ROWS && x.col_stride == 1) {
    FN(gemm_rows_dot)(x, rows, w, bias, activation, out.c, out.ldc, out.pre, out.pre_stride);
    return;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += GEMM_NR) {
    const int64_t count = rows - m0 < GEMM_NR ? rows - m0 : GEMM_NR;
    const int narrow = count <= FMLP_SIMD_WIDTH;
    const int64_t width = FN(lanes_width)(count);
    const REAL *b = x_lanes;
    if (b == NULL) {
      FN(pack_k_major)((const REAL *)x.data + m0 * x.row_stride, x.row_stride, x.col_stride,
                       count, width, k, scratch);
      b = scratch;
    }
    for (int64_t j0 = 0; j0 < n; j0 += GEMM_MR) {
      const int64_t n_rows = n - j0 < GEMM_MR ? n - j0 : GEMM_MR;
      const REAL *w_rows[GEMM_MR];
      /* rows past the weight's end re-read its first row: in bounds, never stored */
      for (int64_t i = 0; i < GEMM_MR; ++i) {
        w_rows[i] = w_data + (j0 + (i < n_rows ? i : 0)) * w->source.row_stride;
      }
      const FN(product_out) tile = {
          .c = out.c_lanes == NULL ? out.c + m0 * out.ldc + j0 : NULL,
          .c_lanes = out.c_lanes != NULL ? out.c_lanes + j0 * width : NULL,
          .pre = out.pre != NULL ? out.pre + m0 * out.pre_stride + j0 : NULL,
          .ldc = out.ldc,
          .pre_stride = out.pre_stride};
      const REAL *bias_tile = bias != NULL ? bias + j0 : NULL;
      if (narrow) {
        FN(microkernel_transposed_narrow)(k, w_rows, b, &tile, n_rows, count, bias_tile,
                                          activation);
      } else {
        FN(microkernel_transposed)(k, w_rows, b, &tile, n_rows, count, bias_tile, activation);
      }
    }
  }
}
#endif

/* The Goto/BLIS loops over a packed weight of n columns and K = k: for each
 * NC x KC weight block and MC x KC input block (packed here into
 * input_pack), every MR x NR tile goes to tile_fn with its packed input
 * panel, its first row and column, and its K block. */
typedef void (*FN(tile_fn))(const void *context, const REAL *a_panel, int64_t row, int64_t col,
                            int64_t pc, int64_t kc, int64_t rows, int64_t cols);

static void FN(for_each_tile)(fmlp_input x, int64_t rows, int64_t n, int64_t k,
                              REAL *input_pack, FN(tile_fn) tile_fn, const void *context) {
  const REAL *x_data = x.data;
  for (int64_t jc = 0; jc < n; jc += GEMM_NC) {
    const int64_t nc = n - jc < GEMM_NC ? n - jc : GEMM_NC;
    for (int64_t pc = 0; pc < k; pc += GEMM_KC) {
      const int64_t kc = k - pc < GEMM_KC ? k - pc : GEMM_KC;
      for (int64_t ic = 0; ic < rows; ic += GEMM_MC) {
        const int64_t mc = rows - ic < GEMM_MC ? rows - ic : GEMM_MC;
        const fmlp_input block = {x_data + ic * x.row_stride, x.row_stride, x.col_stride};
        FN(pack_input_block)(block, mc, pc, kc, input_pack);
        for (int64_t jr = 0; jr < nc; jr += GEMM_NR) {
          const int64_t cols = nc - jr < GEMM_NR ? nc - jr : GEMM_NR;
          for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
            tile_fn(context, input_pack + (ir / GEMM_MR) * kc * GEMM_MR, ic + ir, jc + jr, pc,
                    kc, mc - ir < GEMM_MR ? mc - ir : GEMM_MR, cols);
          }
        }
      }
    }
  }
}

typedef struct {
  const FN(packed_weight) *w;
  const REAL *bias;
  fmlp_activation activation;
  REAL *c, *pre;
  int64_t ldc, pre_stride;
} FN(linear_tiles);

static void FN(linear_tile)(const void *context, const REAL *a_panel, int64_t row, int64_t col,
                            int64_t pc, int64_t kc, int64_t rows, int64_t cols) {
  const FN(linear_tiles) *t = context;
  const int64_t k = t->w->k;
  const FN(tile_epilogue) ep = {
      .bias = t->bias != NULL ? t->bias + col : NULL,
      .pre = t->pre != NULL ? t->pre + row * t->pre_stride + col : NULL,
      .pre_stride = t->pre_stride,
      .activation = t->activation,
      .first_k_block = pc == 0,
      .last_k_block = pc + kc >= k,
  };
  const REAL *b_panel = t->w->data + (col / GEMM_NR) * k * GEMM_NR + pc * GEMM_NR;
  FMLP_MICROKERNEL(kc, a_panel, b_panel, t->c + row * t->ldc + col, t->ldc, rows, cols, &ep);
}

/* c[rows, n] = act(x[rows, k] @ W.T + bias); pre (optional) gets the
 * pre-activation. Single-threaded; callers split rows across threads.
 * input_pack holds input_pack_elems(rows, k) elements. */
static void FN(gemm_rows)(fmlp_input x, int64_t rows, const FN(packed_weight) *w,
                          const REAL *bias, fmlp_activation activation, REAL *c, int64_t ldc,
                          REAL *pre, int64_t pre_stride, REAL *input_pack) {
  const int64_t n = w->n, k = w->k;
  if (n == 0 || rows == 0) return; /* an empty weight is never packed: nothing to read */
  if (k == 0) {
    FN(fill_empty_product)(rows, n, bias, activation, c, ldc, pre, pre_stride);
    return;
  }
  if (w->data == NULL) {
#ifdef FMLP_SIMD_WIDTH
    const FN(product_out) out = {.c = c, .pre = pre, .ldc = ldc, .pre_stride = pre_stride};
    FN(transposed_rows)(x, NULL, rows, w, bias, activation, out, input_pack);
#endif
    return;
  }
  const FN(linear_tiles) tiles = {w, bias, activation, c, pre, ldc, pre_stride};
  FN(for_each_tile)(x, rows, n, k, input_pack, FN(linear_tile), &tiles);
}

#ifdef FMLP_SIMD_WIDTH
/* ---- gate and up together ---- */

typedef struct {
  const FN(packed_weight) *gate_w, *up_w;
  const REAL *bias_gate, *bias_up;
  fmlp_activation activation;
  REAL *gate, *up, *product;
  int64_t stride; /* of gate, up and product */
  int save_gate_up;
} FN(gated_tiles);

static void FN(gated_tile)(const void *context, const REAL *a_panel, int64_t row, int64_t col,
                           int64_t pc, int64_t kc, int64_t rows, int64_t cols) {
  const FN(gated_tiles) *t = context;
  const int64_t k = t->gate_w->k, panel_at = (col / GEMM_NR) * k * GEMM_NR + pc * GEMM_NR;
  for (int64_t half = 0; half < GEMM_MR && half < rows; half += GATED_MR) {
    const int64_t at = (row + half) * t->stride + col;
    const FN(gated_tile_epilogue) ep = {
        .bias_gate = t->bias_gate != NULL ? t->bias_gate + col : NULL,
        .bias_up = t->bias_up != NULL ? t->bias_up + col : NULL,
        .gate = t->gate + at,
        .up = t->up + at,
        .gate_up_stride = t->stride,
        .product = t->product + at,
        .product_stride = t->stride,
        .activation = t->activation,
        .first_k_block = pc == 0,
        .last_k_block = pc + kc >= k,
        .save_gate_up = t->save_gate_up,
    };
    const int64_t half_rows = rows - half < GATED_MR ? rows - half : GATED_MR;
    FN(microkernel_gated)(kc, a_panel + half, t->gate_w->data + panel_at,
                          t->up_w->data + panel_at, half_rows, cols, &ep);
  }
}

/* product[rows, h] = act(x @ Wg.T + bg) * (x @ Wu.T + bu) with both weights
 * packed, in one pass over x; gate and up (rows x h, same stride) receive the
 * pre-activations when save_gate_up, and serve as scratch between K blocks. */
static void FN(gemm_gated_rows)(fmlp_input x, int64_t rows, const FN(packed_weight) *gate_w,
                                const FN(packed_weight) *up_w, const REAL *bias_gate,
                                const REAL *bias_up, fmlp_activation activation, REAL *gate,
                                REAL *up, REAL *product, int64_t stride, int save_gate_up,
                                REAL *input_pack) {
  const FN(gated_tiles) tiles = {gate_w, up_w, bias_gate, bias_up, activation,
                                 gate,   up,   product,   stride,  save_gate_up};
  FN(for_each_tile)(x, rows, gate_w->n, gate_w->k, input_pack, FN(gated_tile), &tiles);
}
#endif
