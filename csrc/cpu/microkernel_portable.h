/* The portable micro-kernel unit (template: see real_template.h and
 * docs/kernels.md): plain C for any CPU and any REAL, with scalar activations
 * (activation.h). It has neither the transposed few-row kernels nor the
 * gate-and-up kernel: gemm.h and drivers.h then pack every weight and run
 * gate and up as two products. */
#include "activation.h"
#include "tile.h"

#if !defined(GEMM_MR) || !defined(GEMM_NR)
#error "a portable unit defines its tile, GEMM_MR x GEMM_NR"
#endif
/* The largest K block; storage narrower than REAL would round the partial
 * sums kept in the output between K blocks, so there K is one block. */
#define GEMM_KC (STORE_IS_REAL ? 256 : ((int64_t)1 << 40))
#define GEMM_MC 64
#define GEMM_UNPACKED_MAX_ROWS ((int64_t)0) /* the portable kernel always packs */
#define FMLP_TRANSPOSED_KERNELS 0
#define FMLP_GATED_KERNEL 0

/* Weight panels (NR rows) and input panels (MR rows) are packed K-major,
 * element by element. */
#define FMLP_PACK_WEIGHT_PANEL FN(pack_rows_k_major)
#define FMLP_PACK_INPUT_PANEL FN(pack_rows_k_major)

static void FN(activate_span)(REAL *v, int64_t n, fmlp_activation activation) {
  FN(activate_row)(v, n, activation);
}

/* out[0, n) = grad * act'(pre) over storage, in REAL a span at a time; out
 * may be grad. */
#define GRAD_SPAN 64
static void FN(activation_grad_span)(STORE *out, const STORE *grad, const STORE *pre, int64_t n,
                                     fmlp_activation activation) {
  for (int64_t i0 = 0; i0 < n; i0 += GRAD_SPAN) {
    const int64_t count = n - i0 < GRAD_SPAN ? n - i0 : GRAD_SPAN;
    REAL g[GRAD_SPAN], z[GRAD_SPAN];
    for (int64_t i = 0; i < count; ++i) {
      g[i] = to_real(grad[i0 + i]);
      z[i] = to_real(pre[i0 + i]);
    }
    FN(activation_grad_row)(g, g, z, count, activation);
    for (int64_t i = 0; i < count; ++i) out[i0 + i] = to_store(g[i]);
  }
}

static void FN(finish_tile)(REAL acc[GEMM_MR][GEMM_NR], int64_t rows, int64_t cols, STORE *c,
                            int64_t ldc, const FN(tile_epilogue) *ep) {
  for (int64_t i = 0; i < rows; ++i) {
    REAL *row = acc[i];
    STORE *c_row = c + i * ldc;
    if (!ep->first_k_block) {
      for (int64_t j = 0; j < cols; ++j) row[j] += to_real(c_row[j]);
    } else if (ep->bias != NULL) {
      for (int64_t j = 0; j < cols; ++j) row[j] += to_real(ep->bias[j]);
    }
    if (ep->last_k_block) {
      STORE *pre = ep->pre != NULL ? ep->pre + i * ep->pre_stride : NULL;
      for (int64_t j = 0; j < cols && pre != NULL; ++j) pre[j] = to_store(row[j]);
      FN(activate_row)(row, cols, ep->activation);
    }
    for (int64_t j = 0; j < cols; ++j) c_row[j] = to_store(row[j]);
  }
}

/* The portable micro-kernel: rank-1 updates of an MR x NR tile held in a
 * local array the compiler keeps in vector registers. rows <= MR and
 * cols <= NR say how much of the tile is inside the output. */
static void FN(microkernel_portable)(int64_t kc, const REAL *restrict a, const REAL *restrict b,
                                     STORE *c, int64_t ldc, int64_t rows, int64_t cols,
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
