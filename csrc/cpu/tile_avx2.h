/* The AVX2 units' register tiles (float accumulators in 16 ymm registers),
 * shared by every storage dtype's AVX2 unit. Include after simd_avx2.h. */
#ifndef FUSEDMLP_CPU_TILE_AVX2_H
#define FUSEDMLP_CPU_TILE_AVX2_H

/* 6 x 2 ymm accumulators, 2 loads of b and one broadcast of a: 15 of the 16
 * registers. */
#define GEMM_MR 6
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* gated: 6 x 1 ymm of gate and of up, 2 loads, one broadcast: 15 of 16.
 * Measured against the other tiles that fit (one thread, gate + up + down,
 * 1024 and 8192 x 768 -> 3072 -> 768 GELU(tanh), noisy shared cores): 6 x 8
 * ran 1.2-1.5x faster than 3 x 16 (17 registers: one accumulator lived on
 * the stack, a store-to-load round trip every K step) and 1.0-1.1x faster
 * than 2 x 16 (8 accumulators). */
#define GATED_MR 6
#define GATED_NR FMLP_SIMD_WIDTH

#endif /* FUSEDMLP_CPU_TILE_AVX2_H */
