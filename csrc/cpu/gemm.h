/* Cache-blocked GEMM with a fused epilogue (template: see real_template.h).
 *
 * Goto/BLIS shape: the whole weight is packed once into NR-wide column
 * panels; for each NC x KC block of it, MC x KC blocks of the input are packed
 * into MR-tall row panels and a register-tiled micro-kernel updates an
 * MR x NR tile of the output. On the last K block the micro-kernel adds the
 * bias (started on the first), applies the activation and stores, so the
 * output is written once in its final form. */
#include <string.h>

#include "activation.h"
#include "fusedmlp/cpu.h"
#include "memory.h"

#define GEMM_MR 4
#define GEMM_NR ((int64_t)(64 / sizeof(REAL))) /* one cache line of REAL */
#define GEMM_KC 256
#define GEMM_MC 64
#define GEMM_NC 1024

/* A weight [n, k] packed into ceil(n / NR) panels of k rows by NR columns,
 * zero-padded past n: element (row j, col kk) of W lives at
 * data[(j / NR) * k * NR + kk * NR + j % NR]. */
typedef struct {
  REAL *data;
  int64_t n, k;
} FN(packed_weight);

static fmlp_status FN(pack_weight)(fmlp_input w, int64_t n, int64_t k,
                                   FN(packed_weight) *packed) {
  const int64_t n_panels = (n + GEMM_NR - 1) / GEMM_NR;
  int64_t count;
  if (!fmlp_checked_mul(n_panels, k, &count) || !fmlp_checked_mul(count, GEMM_NR, &count)) {
    return FMLP_ERR_SIZE_OVERFLOW;
  }
  REAL *data = fmlp_alloc_scratch(count, sizeof(REAL));
  if (data == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  const REAL *src = w.data;
  for (int64_t p = 0; p < n_panels; ++p) {
    REAL *panel = data + p * k * GEMM_NR;
    for (int64_t jj = 0; jj < GEMM_NR; ++jj) {
      const int64_t j = p * GEMM_NR + jj;
      for (int64_t kk = 0; kk < k; ++kk) {
        panel[kk * GEMM_NR + jj] = j < n ? src[j * w.row_stride + kk * w.col_stride] : (REAL)0;
      }
    }
  }
  packed->data = data;
  packed->n = n;
  packed->k = k;
  return FMLP_OK;
}

/* Rows [0, mc) and columns [pc, pc + kc) of x into MR-tall panels,
 * zero-padded past mc: element (i, kk) at dst[(i / MR) * kc * MR + kk * MR + i % MR]. */
static void FN(pack_input_block)(fmlp_input x, int64_t mc, int64_t pc, int64_t kc, REAL *dst) {
  const REAL *src = x.data;
  for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
    REAL *panel = dst + (ir / GEMM_MR) * kc * GEMM_MR;
    for (int64_t ii = 0; ii < GEMM_MR; ++ii) {
      const int64_t i = ir + ii;
      for (int64_t kk = 0; kk < kc; ++kk) {
        panel[kk * GEMM_MR + ii] =
            i < mc ? src[i * x.row_stride + (pc + kk) * x.col_stride] : (REAL)0;
      }
    }
  }
}

/* What a micro-kernel does with its tile after the K loop. */
typedef struct {
  const REAL *bias; /* at the tile's first column, or NULL */
  REAL *pre;        /* where the last K block stores the pre-activation, or NULL */
  int64_t pre_stride;
  fmlp_activation activation;
  int first_k_block; /* start from the bias rather than from c */
  int last_k_block;  /* finish: save the pre-activation, activate */
} FN(tile_epilogue);

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

/* With K == 0 the product is empty: the output is act(bias), or act(0). */
static void FN(fill_empty_product)(int64_t rows, int64_t n, const REAL *bias,
                                   fmlp_activation activation, REAL *c, int64_t ldc, REAL *pre,
                                   int64_t pre_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    REAL *row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] = bias != NULL ? bias[j] : (REAL)0;
    if (pre != NULL) memcpy(pre + i * pre_stride, row, (size_t)n * sizeof(REAL));
    FN(activate_row)(row, n, activation);
  }
}

/* Scratch one thread needs for gemm_rows. */
static REAL *FN(alloc_input_pack)(void) {
  return fmlp_alloc_scratch((int64_t)GEMM_MC * GEMM_KC, sizeof(REAL));
}

/* c[rows, n] = act(x[rows, k] @ W.T + bias); pre (optional) gets the
 * pre-activation. Single-threaded; callers split rows across threads. */
static void FN(gemm_rows)(fmlp_input x, int64_t rows, const FN(packed_weight) *w,
                          const REAL *bias, fmlp_activation activation, REAL *c, int64_t ldc,
                          REAL *pre, int64_t pre_stride, REAL *input_pack) {
  const int64_t n = w->n, k = w->k;
  if (k == 0) {
    FN(fill_empty_product)(rows, n, bias, activation, c, ldc, pre, pre_stride);
    return;
  }
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
          const int64_t col = jc + jr;
          const int64_t cols = nc - jr < GEMM_NR ? nc - jr : GEMM_NR;
          const REAL *b_panel = w->data + (col / GEMM_NR) * k * GEMM_NR + pc * GEMM_NR;
          for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
            const int64_t row = ic + ir;
            const FN(tile_epilogue) ep = {
                .bias = bias != NULL ? bias + col : NULL,
                .pre = pre != NULL ? pre + row * pre_stride + col : NULL,
                .pre_stride = pre_stride,
                .activation = activation,
                .first_k_block = pc == 0,
                .last_k_block = pc + kc >= k,
            };
            FN(microkernel_portable)(kc, input_pack + (ir / GEMM_MR) * kc * GEMM_MR, b_panel,
                                     c + row * ldc + col, ldc,
                                     mc - ir < GEMM_MR ? mc - ir : GEMM_MR, cols, &ep);
          }
        }
      }
    }
  }
}
