/* The few-row path of the SIMD units (template: see docs/kernels.md;
 * included by microkernel_simd.h): up to GEMM_UNPACKED_MAX_ROWS rows multiply
 * a weight read in place, through the transposed micro-kernels or, for up to
 * DOT_MAX_ROWS rows, dot products. gemm.h and drivers.h call transposed_rows,
 * lanes_possible and lanes_width where the unit sets FMLP_TRANSPOSED_KERNELS. */

/* gemm_rows for up to DOT_MAX_ROWS unit-stride rows and a weight read in
 * place: dot products along K into a span of DOT_SPAN output columns, then
 * bias, pre-activation and activation over the span at once (per tile of
 * DOT_WEIGHT_ROWS columns, the epilogue's fixed cost showed: 1 x 768 -> 3072
 * tanh-GELU, one thread, 0.470 -> 0.450 ms CPU time, medians, noisy shared
 * cores). */
#define DOT_SPAN 64 /* a multiple of DOT_WEIGHT_ROWS */
static void FN(gemm_rows_dot)(fmlp_input x, int64_t rows, const FN(packed_weight) *w,
                              const STORE *bias, fmlp_activation activation, STORE *c,
                              int64_t ldc, STORE *pre, int64_t pre_stride) {
  const int64_t n = w->n, k = w->k;
  const STORE *x_data = x.data, *w_data = w->source.data;
  const STORE *x_rows[DOT_MAX_ROWS];
  for (int64_t r = 0; r < rows; ++r) x_rows[r] = x_data + r * x.row_stride;
  for (int64_t s0 = 0; s0 < n; s0 += DOT_SPAN) {
    const int64_t span = n - s0 < DOT_SPAN ? n - s0 : DOT_SPAN;
    REAL segments[DOT_MAX_ROWS][DOT_SPAN];
    for (int64_t j0 = s0; j0 < s0 + span; j0 += DOT_WEIGHT_ROWS) {
      const int64_t n_cols = s0 + span - j0 < DOT_WEIGHT_ROWS ? s0 + span - j0 : DOT_WEIGHT_ROWS;
      const STORE *w_rows[DOT_WEIGHT_ROWS];
      /* rows past the weight's end re-read its first row: in bounds, never stored */
      for (int64_t j = 0; j < DOT_WEIGHT_ROWS; ++j) {
        w_rows[j] = w_data + (j0 + (j < n_cols ? j : 0)) * w->source.row_stride;
      }
      REAL out[DOT_MAX_ROWS][DOT_WEIGHT_ROWS];
      FN(dot_tile)(rows, k, x_rows, w_rows, out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n_cols; ++j) segments[r][j0 - s0 + j] = out[r][j];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      REAL *segment = segments[r];
      for (int64_t j = 0; j < span; ++j) {
        segment[j] += bias != NULL ? to_real(bias[s0 + j]) : (REAL)0;
        if (pre != NULL) pre[r * pre_stride + s0 + j] = to_store(segment[j]);
      }
      FN(activate_span)(segment, span, activation);
      for (int64_t j = 0; j < span; ++j) c[r * ldc + s0 + j] = to_store(segment[j]);
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
                                const FN(packed_weight) *w, const STORE *bias,
                                fmlp_activation activation, FN(product_out) out,
                                REAL *scratch) {
  const int64_t n = w->n, k = w->k;
  const STORE *w_data = w->source.data;
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
      FN(pack_k_major)((const STORE *)x.data + m0 * x.row_stride, x.row_stride, x.col_stride,
                       count, width, k, scratch);
      b = scratch;
    }
    for (int64_t j0 = 0; j0 < n; j0 += GEMM_MR) {
      const int64_t n_rows = n - j0 < GEMM_MR ? n - j0 : GEMM_MR;
      const void *w_rows[GEMM_MR];
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
      const STORE *bias_tile = bias != NULL ? bias + j0 : NULL;
      if (narrow) {
        FN(microkernel_transposed_narrow)(k, w_rows, b, &tile, n_rows, count, bias_tile,
                                          activation);
      } else {
        FN(microkernel_transposed)(k, w_rows, b, &tile, n_rows, count, bias_tile, activation);
      }
    }
  }
}
