/* The portable units' register tiles (128-bit vector-extension float
 * accumulators, simd_vector.h), shared by every storage dtype's portable
 * unit. Tiled for 16 registers (x86-64's xmm file, and the least of the
 * vector CPUs) and no FMA (x86-64's baseline, SSE2): each multiply-add needs
 * one more register for the product. Include after simd_vector.h and the
 * storage header (storage_real.h, storage_bf16.h). */
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

/* SSE2 has no load-and-broadcast: a broadcast of a packed input value was a
 * scalar load and a shuffle, so each K step ran 6 shuffles and 6 register
 * copies beside its 12 multiplies and 12 adds (perf annotate, AMD Zen 3:
 * 1024 -> 1024 at 512 rows ran at 58% of the SSE2 peak on one thread).
 * Input panels packed with each value spread over a vector (tile.h's
 * GEMM_INPUT_COPIES) turn each broadcast into a plain load: over panels in
 * L1 the 6 x 8 tile's K loop ran 45.5 GFLOP/s against 32.7 (a stand-alone C
 * loop, one thread), whole products 1.11-1.21x as fast (scripts/simd_ab.py
 * f32_portable, one thread: linear, the study MLP, GeGLU). Targets with a
 * broadcast load (NEON's ld1r, AVX) keep 1, and so do units that run K
 * whole (storage narrower than REAL, microkernel_simd.h's GEMM_KC), whose
 * input panels do not stay in L1 either way: four times the bytes, the
 * bfloat16 unit's 512 x 3072 -> 768 took 1.43x the time (and 768 -> 3072
 * 0.80x; scripts/simd_ab.py bf16_portable, one thread). */
#if defined(__x86_64__) && !defined(__AVX__) && STORE_IS_REAL
#define GEMM_INPUT_COPIES FMLP_SIMD_WIDTH
#endif

#endif /* FUSEDMLP_CPU_TILE_PORTABLE_H */
