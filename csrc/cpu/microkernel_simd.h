/* The register-tiled SIMD micro-kernels (template: real_template.h plus the
 * vreal operations of simd_<isa>.h). An MR x NR tile of accumulators, NR =
 * NV vectors wide, lives in registers for the whole K loop: each step loads
 * NV vectors of the packed operand b and broadcasts MR scalars of a. The
 * accumulators start at the bias (or at the partial sums of earlier K
 * blocks), and the last K block activates them in registers before the one
 * store. Edge tiles use masked loads and stores: nothing outside the output
 * is read or written. */
#define GEMM_NV (GEMM_NR / FMLP_SIMD_WIDTH)

#define FMLP_ALWAYS_INLINE inline __attribute__((always_inline))

/* acc[i][v] += sum_kk a_rows[i][kk * a_k_stride] * b[kk * NR + v * W] */
static FMLP_ALWAYS_INLINE void FN(accumulate_tile)(vreal acc[GEMM_MR][GEMM_NV], int64_t kc,
                                                   const REAL *const a_rows[GEMM_MR],
                                                   int64_t a_k_stride, const REAL *restrict b) {
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    vreal b_k[GEMM_NV];
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) b_k[v] = v_load(b + kk * GEMM_NR + v * FMLP_SIMD_WIDTH);
#pragma GCC unroll 16
    for (int i = 0; i < GEMM_MR; ++i) {
      const vreal a_ik = v_set1(a_rows[i][kk * a_k_stride]);
#pragma GCC unroll 8
      for (int v = 0; v < GEMM_NV; ++v) acc[i][v] = v_fma(a_ik, b_k[v], acc[i][v]);
    }
  }
}

/* Lanes of vector v that lie inside a tile `cols` wide. */
static FMLP_ALWAYS_INLINE int64_t FN(lanes_inside)(int64_t cols, int v) {
  const int64_t left = cols - (int64_t)v * FMLP_SIMD_WIDTH;
  return left < 0 ? 0 : left;
}

/* The rows x cols part of the tile into row-major c. */
static FMLP_ALWAYS_INLINE void FN(store_tile)(vreal acc[GEMM_MR][GEMM_NV], REAL *c, int64_t ldc,
                                              int64_t rows, int64_t cols) {
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      v_store_first(c + i * ldc + v * FMLP_SIMD_WIDTH, acc[i][v], FN(lanes_inside)(cols, v));
    }
  }
}

/* Packed a (an MR-tall panel, element (i, kk) at a[kk * MR + i]) times the
 * packed b panel, into the row-major tile c (rows x cols of it inside). */
static void FN(microkernel_packed)(int64_t kc, const REAL *restrict a, const REAL *restrict b,
                                   REAL *c, int64_t ldc, int64_t rows, int64_t cols,
                                   const FN(tile_epilogue) *ep) {
  vreal acc[GEMM_MR][GEMM_NV];
  vreal start[GEMM_NV];
#pragma GCC unroll 8
  for (int v = 0; v < GEMM_NV; ++v) {
    start[v] = ep->first_k_block && ep->bias != NULL
                   ? v_load_first(ep->bias + v * FMLP_SIMD_WIDTH, FN(lanes_inside)(cols, v))
                   : v_zero();
  }
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      acc[i][v] = !ep->first_k_block && i < rows
                      ? v_load_first(c + i * ldc + v * FMLP_SIMD_WIDTH, FN(lanes_inside)(cols, v))
                      : start[v];
    }
  }
  const REAL *a_rows[GEMM_MR];
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) a_rows[i] = a + i;
  FN(accumulate_tile)(acc, kc, a_rows, GEMM_MR, b);
  if (ep->last_k_block) {
    if (ep->pre != NULL) FN(store_tile)(acc, ep->pre, ep->pre_stride, rows, cols);
    FN(activate_vectors)(&acc[0][0], GEMM_MR * GEMM_NV, ep->activation);
  }
  FN(store_tile)(acc, c, ldc, rows, cols);
}

/* The transposed product for small row counts, which skips packing the
 * weight: the tile's MR rows are weight rows read in place (w_rows[i], unit
 * stride along K), its NR columns are input rows packed K-major in b. So
 * tile element (i, m) is output (row m, column i): bias is per tile row, and
 * the store transposes through a small buffer. Always the whole K at once. */
static void FN(microkernel_transposed)(int64_t k, const REAL *const w_rows[GEMM_MR],
                                       const REAL *restrict b, REAL *c, int64_t ldc,
                                       int64_t n_weight_rows, int64_t n_input_rows,
                                       const REAL *bias, REAL *pre, int64_t pre_stride,
                                       fmlp_activation activation) {
  vreal acc[GEMM_MR][GEMM_NV];
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
    const vreal start = bias != NULL && i < n_weight_rows ? v_set1(bias[i]) : v_zero();
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) acc[i][v] = start;
  }
  FN(accumulate_tile)(acc, k, w_rows, 1, b);
  REAL tile[GEMM_MR][GEMM_NR] __attribute__((aligned(64)));
  if (pre != NULL) {
#pragma GCC unroll 16
    for (int i = 0; i < GEMM_MR; ++i) {
#pragma GCC unroll 8
      for (int v = 0; v < GEMM_NV; ++v) v_store(&tile[i][v * FMLP_SIMD_WIDTH], acc[i][v]);
    }
    for (int64_t m = 0; m < n_input_rows; ++m) {
      for (int64_t i = 0; i < n_weight_rows; ++i) pre[m * pre_stride + i] = tile[i][m];
    }
  }
  FN(activate_vectors)(&acc[0][0], GEMM_MR * GEMM_NV, activation);
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) v_store(&tile[i][v * FMLP_SIMD_WIDTH], acc[i][v]);
  }
  for (int64_t m = 0; m < n_input_rows; ++m) {
    for (int64_t i = 0; i < n_weight_rows; ++i) c[m * ldc + i] = tile[i][m];
  }
}
