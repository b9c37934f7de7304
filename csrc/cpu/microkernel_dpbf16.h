/* The packed micro-kernels of the AVX512-BF16 unit (template: see
 * docs/kernels.md), on _mm512_dpbf16_ps: each instruction multiplies 16 pairs
 * of bfloat16 by 16 pairs and adds both products to 16 float accumulators,
 * twice the multiply-adds of a float FMA. Weight and input panels are packed
 * in K-pairs, the layout the instruction wants: slot (p, i) of a panel
 * `width` rows wide holds row i's values 2p and 2p + 1 (the first in the low
 * half), zero past the rows or past K. A slot is 32 bits, the size of a REAL,
 * so the packs keep gemm.h's REAL layout: a panel of k rows uses ceil(k / 2)
 * of the k * width slots gemm.h gives it (one K block: the unit's storage is
 * bfloat16, so GEMM_KC covers any K and no offset into a panel is ever taken).
 * The tile is the float unit's, MR x NR accumulators started at the bias,
 * activated in registers and rounded once at the store. Everything else (the
 * few-row paths, activations, packing for them) is microkernel_simd.h's, with
 * bfloat16 loads (storage_bf16.h). */
#include <stdint.h>
#include <string.h>

#define FMLP_PACK_WEIGHT_PANEL FN(pack_k_pairs)
#define FMLP_PACK_INPUT_PANEL FN(pack_k_pairs)
#define FMLP_MICROKERNEL FN(microkernel_dpbf16)
#define FMLP_MICROKERNEL_GATED FN(microkernel_gated_dpbf16)
#include "microkernel_simd.h"

_Static_assert(!STORE_IS_REAL, "the K-pair panels hold bfloat16 storage");
_Static_assert(FMLP_SIMD_WIDTH == 16, "a K-pair vector is 16 slots of a zmm register");

/* Row i's values 2p and 2p + 1 as one slot (zero past k). */
static inline uint32_t FN(k_pair)(const STORE *row, int64_t cs, int64_t p, int64_t k) {
  const uint32_t low = row[2 * p * cs];
  const uint32_t high = 2 * p + 1 < k ? row[(2 * p + 1) * cs] : 0;
  return low | high << 16;
}

/* A `width`-row K-pair panel of `count` rows of src (row stride rs, column
 * stride cs), zero past count; dst as REAL slots (see above). Rows of unit
 * column stride are already slots in a row: 16 x 16 blocks of them go through
 * the float transpose, the odd pair at the end and other strides one slot at
 * a time. */
static void FN(pack_k_pairs)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                             int64_t width, int64_t k, REAL *dst) {
  uint32_t *slots = (uint32_t *)dst;
  const int64_t pairs = (k + 1) / 2, whole_pairs = cs == 1 ? k / 2 : 0;
  int64_t p0 = 0;
  for (; p0 + FMLP_SIMD_WIDTH <= whole_pairs; p0 += FMLP_SIMD_WIDTH) {
    for (int64_t i0 = 0; i0 < width; i0 += FMLP_SIMD_WIDTH) {
      const int64_t stored = width - i0 < FMLP_SIMD_WIDTH ? width - i0 : FMLP_SIMD_WIDTH;
      vreal block[FMLP_SIMD_WIDTH];
      for (int i = 0; i < FMLP_SIMD_WIDTH; ++i) {
        block[i] = i0 + i < count ? _mm512_castsi512_ps(_mm512_loadu_si512(
                                        src + (i0 + i) * rs + 2 * p0))
                                  : v_zero();
      }
      v_transpose(block);
      for (int t = 0; t < FMLP_SIMD_WIDTH; ++t) {
        v_store_first((float *)(slots + (p0 + t) * width + i0), block[t], stored);
      }
    }
  }
  for (int64_t p = p0; p < pairs; ++p) {
    for (int64_t i = 0; i < width; ++i) {
      slots[p * width + i] = i < count ? FN(k_pair)(src + i * rs, cs, p, k) : 0;
    }
  }
}

static FMLP_ALWAYS_INLINE __m512bh FN(bf16_pairs)(__m512i v) { return (__m512bh)v; }

/* The bias (or zero) in every row of a tile's accumulators. */
static FMLP_ALWAYS_INLINE void FN(start_at_bias)(const int mr, vreal acc[GEMM_MR][GEMM_NV],
                                                 const STORE *bias, int64_t cols) {
#pragma GCC unroll 8
  for (int v = 0; v < GEMM_NV; ++v) {
    const vreal start =
        bias != NULL ? vs_load_first(bias + v * FMLP_SIMD_WIDTH, FN(lanes_inside)(cols, v))
                     : v_zero();
#pragma GCC unroll 16
    for (int i = 0; i < mr; ++i) acc[i][v] = start;
  }
}

/* K-pair panels a (MR slots a pair) and b (NR slots a pair) over all of K,
 * into the row-major tile c (rows x cols of it inside). */
static void FN(microkernel_dpbf16)(int64_t kc, const REAL *restrict a, const REAL *restrict b,
                                   STORE *c, int64_t ldc, int64_t rows, int64_t cols,
                                   const FN(tile_epilogue) *ep) {
  const uint32_t *a_slots = (const uint32_t *)a, *b_slots = (const uint32_t *)b;
  vreal acc[GEMM_MR][GEMM_NV];
  FN(start_at_bias)(GEMM_MR, acc, ep->bias, cols);
  const int64_t pairs = (kc + 1) / 2;
#pragma GCC unroll 2
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b_p[GEMM_NV];
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      b_p[v] = FN(bf16_pairs)(_mm512_loadu_si512(b_slots + p * GEMM_NR + v * FMLP_SIMD_WIDTH));
    }
#pragma GCC unroll 16
    for (int i = 0; i < GEMM_MR; ++i) {
      const __m512bh a_ip = FN(bf16_pairs)(_mm512_set1_epi32((int)a_slots[p * GEMM_MR + i]));
#pragma GCC unroll 8
      for (int v = 0; v < GEMM_NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a_ip, b_p[v]);
    }
  }
  if (ep->pre != NULL) FN(store_tile)(acc, ep->pre, ep->pre_stride, rows, cols);
  FN(activate_vectors)(&acc[0][0], GEMM_MR * GEMM_NV, ep->activation);
  FN(store_tile)(acc, c, ldc, rows, cols);
}

/* Gate and up over the same GATED_MR rows of an input K-pair panel (a: the
 * first of them), in one pass over K; act(gate) * up formed in float and
 * rounded once at its store. */
static void FN(microkernel_gated_dpbf16)(int64_t kc, const REAL *restrict a,
                                         const REAL *restrict b_gate, const REAL *restrict b_up,
                                         int64_t rows, int64_t cols,
                                         const FN(gated_tile_epilogue) *ep) {
  const uint32_t *a_slots = (const uint32_t *)a;
  const uint32_t *g_slots = (const uint32_t *)b_gate, *u_slots = (const uint32_t *)b_up;
  vreal gate[GEMM_MR][GEMM_NV], up[GEMM_MR][GEMM_NV];
  FN(start_at_bias)(GATED_MR, gate, ep->bias_gate, cols);
  FN(start_at_bias)(GATED_MR, up, ep->bias_up, cols);
  const int64_t pairs = (kc + 1) / 2;
#pragma GCC unroll 2
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bg[GEMM_NV], bu[GEMM_NV];
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      bg[v] = FN(bf16_pairs)(_mm512_loadu_si512(g_slots + p * GEMM_NR + v * FMLP_SIMD_WIDTH));
      bu[v] = FN(bf16_pairs)(_mm512_loadu_si512(u_slots + p * GEMM_NR + v * FMLP_SIMD_WIDTH));
    }
#pragma GCC unroll 16
    for (int i = 0; i < GATED_MR; ++i) {
      const __m512bh a_ip = FN(bf16_pairs)(_mm512_set1_epi32((int)a_slots[p * GEMM_MR + i]));
#pragma GCC unroll 8
      for (int v = 0; v < GEMM_NV; ++v) {
        gate[i][v] = _mm512_dpbf16_ps(gate[i][v], a_ip, bg[v]);
        up[i][v] = _mm512_dpbf16_ps(up[i][v], a_ip, bu[v]);
      }
    }
  }
  if (ep->save_gate_up) {
    FN(store_tile)(gate, ep->gate, ep->gate_up_stride, rows, cols);
    FN(store_tile)(up, ep->up, ep->gate_up_stride, rows, cols);
  }
  FN(activate_vectors)(&gate[0][0], GATED_MR * GEMM_NV, ep->activation);
#pragma GCC unroll 16
  for (int i = 0; i < GATED_MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) gate[i][v] = v_mul(gate[i][v], up[i][v]);
  }
  FN(store_tile)(gate, ep->product, ep->product_stride, rows, cols);
}
