/* The portable units' register tiles (128-bit vector-extension float
 * accumulators, simd_vector.h), shared by every storage dtype's portable
 * unit. Tiled for 16 registers (x86-64's xmm file, and the least of the
 * vector CPUs) and no FMA (x86-64's baseline, SSE2): each multiply-add needs
 * one more register for the product. Include after simd_vector.h. */
#ifndef FUSEDMLP_CPU_TILE_PORTABLE_H
#define FUSEDMLP_CPU_TILE_PORTABLE_H

/* 6 x 2 accumulators, 2 loads of b, one broadcast of a and the product: all
 * 16 registers, the largest tile whose K loops have no stack access in GCC
 * 12's SSE2 code (4 x 3 spills; 5 x 2, 4 x 2, 3 x 3 fit with fewer
 * accumulators). */
#define GEMM_MR 6
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* gated: 6 x 1 of gate and of up, 2 loads, one broadcast, the product: 16 */
#define GATED_MR 6
#define GATED_NR FMLP_SIMD_WIDTH

#endif /* FUSEDMLP_CPU_TILE_PORTABLE_H */
