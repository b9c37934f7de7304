/* The few-row path of the AMX unit (template: see docs/kernels.md; included
 * by microkernel_amx.h in place of few_rows_simd.h): up to
 * GEMM_UNPACKED_MAX_ROWS rows multiply a weight read in place, on AMX tiles,
 * transposed: A tiles are 16 weight rows x 32 values of K loaded straight
 * from the weight (a tile row is a weight row, the tile's stride the
 * weight's), B tiles are 16 K-pairs x 16 input rows (the input packed in
 * K-pairs, or handed on by the layer before), so a C tile holds 16 output
 * columns x 16 input rows, and the weight is neither packed nor converted.
 * Against the float kernels it replaces (dot products for up to 4 rows, else
 * the transposed FMA kernel, where converting and broadcasting each weight
 * value took most of the time), one thread's CPU time in a C harness
 * (medians, one run, loaded machine): 1 x 768 -> 3072 GELU 403 -> 252 us (a
 * plain read of its 4.7 MB of weights: 194 us), the GeGLU block at one
 * token 969 -> 681 us (read: 615), 16 x (256 -> 256 -> 256 -> 256) ReLU
 * 156 -> 11 us.
 *
 * The lanes layout of this unit (see lanes_width): K-pairs, the pair p of
 * the next layer's K (this layer's columns 2p, 2p + 1) for input row m in
 * the 32-bit slot 2p * width + m, the REAL lanes layout's row 2p (rows 2p + 1
 * unused), so that column j of a hand-off starts at j * width as the drivers
 * count it. Rows past `rows` are padding (computed, never stored elsewhere);
 * a pair past the layer's last column is zero. */

static int FN(lanes_possible)(int64_t rows) { return rows <= GEMM_NR; }

static int64_t FN(lanes_width)(int64_t rows) { return rows <= AMX_ROWS ? AMX_ROWS : GEMM_NR; }

/* The 16 weight rows (count of them, zero past) at K values [0, span) of w
 * (row stride ws) as an A tile's 16 rows of 32 values, zero past span. */
static void FN(pad_weight_tile)(const STORE *w, int64_t ws, int64_t count, int64_t span,
                                uint16_t pad[AMX_ROWS][AMX_K]) {
  const __mmask32 inside = (__mmask32)(~0ull >> (64 - span));
  for (int64_t i = 0; i < AMX_ROWS; ++i) {
    _mm512_store_si512(pad[i], i < count ? _mm512_maskz_loadu_epi16(inside, w + i * ws)
                                         : _mm512_setzero_si512());
  }
}

/* The first `pairs` K-pair rows of a B tile (16 slots each, b_stride apart),
 * zero past them. */
static void FN(pad_input_tile)(const uint32_t *b, int64_t b_stride, int64_t pairs,
                               uint32_t pad[AMX_ROWS][AMX_ROWS]) {
  for (int64_t p = 0; p < AMX_ROWS; ++p) {
    _mm512_store_si512(pad[p], p < pairs ? _mm512_loadu_si512(b + p * b_stride)
                                         : _mm512_setzero_si512());
  }
}

/* The C tiles of weight rows [0, n_rows) (n_rows <= 32: TILE_C00/C01 rows
 * 0-15, TILE_C10/C11 rows 16-31) times b's n_b (1 or 2) B tiles of 16 input
 * rows (TILE_C00/C10 the first), over all of K. b: K-pair rows b_stride
 * slots apart. Weight tiles past n_rows or K are zero-padded copies. */
static void FN(few_rows_tiles)(int64_t k, const STORE *w, int64_t ws, int64_t n_rows,
                               const uint32_t *b, int64_t b_stride, int n_b) {
  _Alignas(64) uint16_t pad_a[2][AMX_ROWS][AMX_K];
  _Alignas(64) uint32_t pad_b[2][AMX_ROWS][AMX_ROWS];
  const int two_a = n_rows > AMX_ROWS;
  const int whole_a0 = n_rows >= AMX_ROWS, whole_a1 = n_rows >= 2 * AMX_ROWS;
  const int64_t a_bytes = ws * (int64_t)sizeof(STORE), b_bytes = b_stride * 4;
  const STORE *w1 = two_a ? w + AMX_ROWS * ws : w;
  _tile_zero(TILE_C00);
  _tile_zero(TILE_C01);
  _tile_zero(TILE_C10);
  _tile_zero(TILE_C11);
  for (int64_t k0 = 0; k0 < k; k0 += AMX_K) {
    const int64_t span = k - k0 < AMX_K ? k - k0 : AMX_K;
    const uint32_t *b_q = b + k0 / 2 * b_stride;
    const void *a0 = w + k0, *a1 = w1 + k0, *b0 = b_q, *b1 = n_b == 2 ? b_q + AMX_ROWS : b_q;
    int64_t a0_bytes = a_bytes, a1_bytes = a_bytes, bs = b_bytes;
    if (span < AMX_K || !whole_a0) {
      FN(pad_weight_tile)(w + k0, ws, n_rows, span, pad_a[0]);
      a0 = pad_a[0];
      a0_bytes = AMX_BYTES;
    }
    if (two_a && (span < AMX_K || !whole_a1)) {
      FN(pad_weight_tile)(w1 + k0, ws, n_rows - AMX_ROWS, span, pad_a[1]);
      a1 = pad_a[1];
      a1_bytes = AMX_BYTES;
    }
    if (span < AMX_K) {
      for (int t = 0; t < n_b; ++t) {
        FN(pad_input_tile)(b_q + t * AMX_ROWS, b_stride, (span + 1) / 2, pad_b[t]);
      }
      b0 = pad_b[0];
      b1 = pad_b[1];
      bs = AMX_BYTES;
    }
    TILE_READS_MEMORY();
    _tile_loadd(TILE_B0, b0, bs);
    _tile_loadd(TILE_A0, a0, a0_bytes);
    _tile_dpbf16ps(TILE_C00, TILE_A0, TILE_B0);
    if (n_b == 2) {
      _tile_loadd(TILE_B1, b1, bs);
      _tile_dpbf16ps(TILE_C01, TILE_A0, TILE_B1);
    }
    if (two_a) {
      _tile_loadd(TILE_A1, a1, a1_bytes);
      _tile_dpbf16ps(TILE_C10, TILE_A1, TILE_B0);
      if (n_b == 2) _tile_dpbf16ps(TILE_C11, TILE_A1, TILE_B1);
    }
  }
}

/* One 16 x 16 block of float results, t[i][m] for output column i (count
 * n_cols) and input row m (n_in of them): bias, pre-activation, activation,
 * one rounding, into row-major out.c (rows m, columns i) or into the lanes
 * layout (out.c_lanes at the block's first column, `width` wide). */
static void FN(few_rows_finish)(const REAL *t, int64_t t_stride, int64_t n_cols, int64_t n_in,
                                const STORE *bias, fmlp_activation activation,
                                const FN(product_out) *out, int64_t width) {
  vreal v[AMX_ROWS];
  for (int i = 0; i < AMX_ROWS; ++i) v[i] = v_load(t + i * t_stride);
  if (out->c_lanes == NULL) {
    /* transposed, a vector is an output row's 16 columns */
    v_transpose(v);
    const vreal start = bias != NULL ? vs_load_first(bias, n_cols) : v_zero();
    for (int64_t m = 0; m < n_in; ++m) {
      vreal z = v_add(v[m], start);
      if (out->pre != NULL) vs_store_first(out->pre + m * out->pre_stride, z, n_cols);
      FN(activate_vectors)(&z, 1, activation);
      vs_store_first(out->c + m * out->ldc, z, n_cols);
    }
    return;
  }
  for (int64_t i = 0; i < n_cols; ++i) {
    if (bias != NULL) v[i] = v_add(v[i], v_set1(to_real(bias[i])));
  }
  if (out->pre != NULL) {
    vreal rows[AMX_ROWS];
    memcpy(rows, v, sizeof rows);
    v_transpose(rows);
    for (int64_t m = 0; m < n_in; ++m) {
      vs_store_first(out->pre + m * out->pre_stride, rows[m], n_cols);
    }
  }
  FN(activate_vectors)(v, AMX_ROWS, activation);
  /* pairs of columns as K-pairs of bfloat16: 2p in the low half, 2p + 1 high */
  for (int64_t i = 0; i < n_cols; i += 2) {
    const __m512i low = _mm512_srli_epi32(v_rounded_bf16_bits(v[i]), 16);
    const __m512i high = i + 1 < n_cols ? v_rounded_bf16_bits(v[i + 1]) : _mm512_setzero_si512();
    _mm512_storeu_si512(out->c_lanes + i * width,
                        _mm512_mask_blend_epi16((__mmask32)0xAAAAAAAAu, low, high));
  }
}

/* act(x @ W.T + bias) for a weight read in place, x (or x_lanes) up to
 * GEMM_UNPACKED_MAX_ROWS rows: slices of up to NR input rows (packed here in
 * K-pairs, lanes_width wide) times groups of 32 weight rows; out.c_lanes
 * and x_lanes need lanes_possible(rows). */
static void FN(transposed_rows)(fmlp_input x, const REAL *x_lanes, int64_t rows,
                                const FN(packed_weight) *w, const STORE *bias,
                                fmlp_activation activation, FN(product_out) out,
                                REAL *scratch) {
  const int64_t n = w->n, k = w->k, ws = w->source.row_stride;
  const STORE *w_data = w->source.data;
  _Alignas(64) REAL t[2 * AMX_ROWS][2 * AMX_ROWS];
  const int64_t t_stride = 2 * AMX_ROWS * (int64_t)sizeof(REAL);
  FN(configure_tiles)();
  for (int64_t m0 = 0; m0 < rows; m0 += GEMM_NR) {
    const int64_t count = rows - m0 < GEMM_NR ? rows - m0 : GEMM_NR;
    const int64_t width = FN(lanes_width)(count);
    const int n_b = (int)(width / AMX_ROWS);
    const uint32_t *b = (const uint32_t *)x_lanes;
    int64_t b_stride = 2 * width; /* lanes: pair p at row 2p */
    if (b == NULL) {
      FN(pack_k_pairs)((const STORE *)x.data + m0 * x.row_stride, x.row_stride, x.col_stride,
                       count, width, k, scratch);
      b = (const uint32_t *)scratch;
      b_stride = width;
    }
    for (int64_t j0 = 0; j0 < n; j0 += 2 * AMX_ROWS) {
      const int64_t n_rows = n - j0 < 2 * AMX_ROWS ? n - j0 : 2 * AMX_ROWS;
      FN(few_rows_tiles)(k, w_data + j0 * ws, ws, n_rows, b, b_stride, n_b);
      _tile_stored(TILE_C00, &t[0][0], t_stride);
      _tile_stored(TILE_C01, &t[0][AMX_ROWS], t_stride);
      _tile_stored(TILE_C10, &t[AMX_ROWS][0], t_stride);
      _tile_stored(TILE_C11, &t[AMX_ROWS][AMX_ROWS], t_stride);
      for (int64_t i0 = 0; i0 < n_rows; i0 += AMX_ROWS) {
        for (int64_t r0 = 0; r0 < count; r0 += AMX_ROWS) {
          const int64_t j = j0 + i0, m = m0 + r0;
          const FN(product_out) block = {
              .c = out.c != NULL ? out.c + m * out.ldc + j : NULL,
              .c_lanes = out.c_lanes != NULL ? out.c_lanes + j * width + r0 : NULL,
              .pre = out.pre != NULL ? out.pre + m * out.pre_stride + j : NULL,
              .ldc = out.ldc,
              .pre_stride = out.pre_stride};
          FN(few_rows_finish)(&t[i0][r0], 2 * AMX_ROWS,
                              n_rows - i0 < AMX_ROWS ? n_rows - i0 : AMX_ROWS,
                              count - r0 < AMX_ROWS ? count - r0 : AMX_ROWS,
                              bias != NULL ? bias + j : NULL, activation, &block, width);
        }
      }
    }
  }
  _tile_release();
}
