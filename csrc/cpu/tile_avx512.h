/* The AVX-512 units' register tiles (float accumulators in 32 zmm
 * registers), shared by every storage dtype's AVX-512 unit. Include after
 * simd_avx512.h. */
#ifndef FUSEDMLP_CPU_TILE_AVX512_H
#define FUSEDMLP_CPU_TILE_AVX512_H

/* 12 x 2 zmm accumulators, 2 loads of b and one broadcast of a: 27 of the 32
 * registers. */
#define GEMM_MR 12
#define GEMM_NR ((int64_t)(2 * FMLP_SIMD_WIDTH))
/* gated: 6 x 2 zmm of gate and of up, 4 loads, one broadcast: 29 of 32.
 * Against it (scripts/simd_ab.py, GeGLU 768 -> 3072 -> 768 at 256 and 1024
 * tokens, one thread, loaded machine): 12 x 1 zmm, which loads half the
 * weight bytes a multiply-add, 1.03x the time; the two 6-row parts
 * interleaved in K chunks of 64 or 128 so that the second finds the
 * chunk's weight lines in L1, 1.00-1.01x: the weight panels' trips from L2
 * are not what bounds it. */
#define GATED_MR 6
#define GATED_NR GEMM_NR
/* gate and up run K in one block while the 12-row input micro-panel fits
 * the whole L1 (K up to 1024 in a 48 KiB L1): 256 rows x 768 -> 3072 gate
 * and up took 0.95-0.96x the time of two K blocks of 384, 1024 -> 3072 0.96x
 * of two of 512; at K 1536 and 2048 blocks of 384-1024 ran alike and whole K
 * 1.03-1.09x (one thread, the unit built twice into one process, alternating,
 * medians of 21-41 rounds, loaded machine). */
#define GATED_ONE_BLOCK_L1_SHARE 1

#endif /* FUSEDMLP_CPU_TILE_AVX512_H */
