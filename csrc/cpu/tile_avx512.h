/* The AVX-512 units' register tiles (float accumulators in 32 zmm
 * registers), shared by every storage dtype's AVX-512 unit. Include after
 * simd_avx512.h. */
#ifndef FUSEDMLP_CPU_TILE_AVX512_H
#define FUSEDMLP_CPU_TILE_AVX512_H

/* 12 x 2 zmm accumulators, 2 loads of b and one broadcast of a: 27 of the 32
 * registers. */
#define GEMM_MR 12
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* gated: 6 x 2 zmm of gate and of up, 4 loads, one broadcast: 29 of 32 */
#define GATED_MR 6
#define GATED_NR GEMM_NR

#endif /* FUSEDMLP_CPU_TILE_AVX512_H */
