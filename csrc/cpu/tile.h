/* The layouts and types the micro-kernels and the GEMM loops share
 * (template: see real_template.h and docs/kernels.md): a packed weight, where
 * a product's outputs go, what a micro-kernel does with its tile after the K
 * loop, and K-major packing element by element. Each micro-kernel header
 * includes it first and gemm.h builds on both, so neither of those two
 * depends on the other. */
#include <string.h>

#include "fusedmlp/cpu.h"

/* Slots a value of a packed input panel takes (a unit's tile header may
 * set it): 1, or FMLP_SIMD_WIDTH where the value is stored spread over a
 * whole vector, so that the micro-kernels load it where they would broadcast
 * it (tile_portable.h says where that pays). Element (i, kk) of an MR-tall
 * panel then lies at a[(kk * MR + i) * GEMM_INPUT_COPIES]. */
#ifndef GEMM_INPUT_COPIES
#define GEMM_INPUT_COPIES 1
#endif

/* A weight [n, k] (storage) packed into ceil(n / NR) panels of k rows by NR columns,
 * zero-padded past n: element (row j, col kk) of W lives at
 * data[(j / NR) * k * NR + kk * NR + j % NR]. data == NULL: not packed, the
 * kernels read `source` in place (unit column stride). */
typedef struct {
  REAL *data;
  fmlp_input source;
  int64_t n, k;
} FN(packed_weight);

/* Where a product's outputs go: its activations into row-major c (row stride
 * ldc) or, when c_lanes is set, into the lanes layout (see lanes_width; REAL,
 * holding values rounded as storage would keep them); its pre-activations
 * into row-major pre (row stride pre_stride) when set. */
typedef struct {
  STORE *c, *pre;
  REAL *c_lanes;
  int64_t ldc, pre_stride;
} FN(product_out);

/* What a micro-kernel does with its tile after the K loop, and where its
 * input rows are when they were not packed. */
typedef struct {
  const STORE *bias; /* at the tile's first column, or NULL */
  STORE *pre;        /* where the last K block stores the pre-activation, or NULL */
  int64_t pre_stride;
  fmlp_activation activation;
  int first_k_block; /* start from the bias rather than from c */
  int last_k_block;  /* finish: save the pre-activation, activate */
  int64_t a_row_stride; /* 0: the input panel is packed; else the input's rows
                           read in place, this many STOREs apart (gemm.h's
                           FMLP_INPUT_IN_PLACE) */
  void *state; /* the tile loop's FMLP_MICROKERNEL_STATE (gemm.h), or NULL */
} FN(tile_epilogue);

/* dst[kk * width + i] = src[i * rs + kk * cs] for i < count and kk < k, zero
 * for count <= i < width: `width` rows of a strided matrix, K-major, converted
 * from storage. Rows that sit next to each other (rs == 1, the transposed
 * views the backward passes) are a contiguous loop the compiler vectorizes. */
static void FN(pack_rows_k_major)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                                  int64_t width, int64_t k, REAL *dst) {
  for (int64_t kk = 0; kk < k; ++kk) {
    REAL *out = dst + kk * width;
    if (rs == 1) {
      const STORE *column = src + kk * cs;
      for (int64_t i = 0; i < count; ++i) out[i] = to_real(column[i]);
    } else {
      for (int64_t i = 0; i < count; ++i) out[i] = to_real(src[i * rs + kk * cs]);
    }
    for (int64_t i = count; i < width; ++i) out[i] = (REAL)0;
  }
}
