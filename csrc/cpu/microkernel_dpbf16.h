/* The packed micro-kernels of the AVX512-BF16 unit (template: see
 * docs/kernels.md), on _mm512_dpbf16_ps: each instruction multiplies 16 pairs
 * of bfloat16 by 16 pairs and adds both products to 16 float accumulators,
 * twice the multiply-adds of a float FMA. Weight and input panels are packed
 * in K-pairs, the layout the instruction wants (pack_k_pairs.h; one K block:
 * the unit's storage is bfloat16, so GEMM_KC covers any K and no offset into
 * a panel is ever taken). Input panels are packed even where a row-major
 * input's rows already are K-pair slots: read in place instead (as the AMX
 * unit does, FMLP_INPUT_IN_PLACE, for even K under a third of the L1), the
 * copy left the samples (9% of 65536 x (64 -> 128 -> 128 -> 64) ReLU's,
 * perf) but the micro-kernel's share grew by ~5 points, its 12 broadcasts a
 * K-pair now from 12 rows: that case took 0.97x the time, and 4096 x 256 ->
 * 1024, 4096 x 384 -> 1536, 2048 x 128 -> 4096 GELU and a 1024-token 384
 * -> 1536 -> 384 GeGLU ran level (Zen 4, two threads, builds alternating in
 * processes, three rounds), so the copy stays.
 * The tile is the float unit's, MR x NR accumulators started at the bias,
 * activated in registers and rounded once at the store. Everything else (the
 * few-row paths, activations, packing for them) is microkernel_simd.h's, with
 * bfloat16 loads (storage_bf16.h). */
#include "pack_k_pairs.h"

#define FMLP_PACK_WEIGHT_PANEL FN(pack_k_pairs)
#define FMLP_PACK_WEIGHT_PANELS FN(pack_k_pair_panels)
#define FMLP_PACK_INPUT_PANEL FN(pack_k_pairs)
#define FMLP_MICROKERNEL FN(microkernel_dpbf16)
#define FMLP_MICROKERNEL_GATED FN(microkernel_gated_dpbf16)
#include "microkernel_simd.h"

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
