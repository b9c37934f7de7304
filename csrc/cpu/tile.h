/* The layouts and types the micro-kernels and the GEMM loops share
 * (template: see real_template.h and docs/kernels.md): a packed weight, where
 * a product's outputs go, what a micro-kernel does with its tile after the K
 * loop, and K-major packing element by element. Each micro-kernel header
 * includes it first and gemm.h builds on both, so neither of those two
 * depends on the other. */
#include <string.h>

#include "fusedmlp/cpu.h"

/* A weight [n, k] packed into ceil(n / NR) panels of k rows by NR columns,
 * zero-padded past n: element (row j, col kk) of W lives at
 * data[(j / NR) * k * NR + kk * NR + j % NR]. data == NULL: not packed, the
 * kernels read `source` in place (unit column stride). */
typedef struct {
  REAL *data;
  fmlp_input source;
  int64_t n, k;
} FN(packed_weight);

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
