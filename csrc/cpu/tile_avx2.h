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
 * than 2 x 16 (8 accumulators). The two 8-wide parts of the 6 x 16 tile
 * interleaved in K chunks of 64, so that the second finds the chunk's
 * weight lines in L1, ran 1.00-1.01x the time (scripts/simd_ab.py). */
#define GATED_MR 6
#define GATED_NR FMLP_SIMD_WIDTH
/* gate and up run K in one block up to GEMM_KC (the 6-row input panel in
 * half the L1, GATED_ONE_BLOCK_L1_SHARE's default: 1024 in 48 KiB); whole K
 * past it, 1536 and 2048 with the panel in the whole L1, took 1.02-1.03x the
 * time of two blocks (measured as in tile_avx512.h). */
/* Where the AVX2 kernels lose to the FMA peak (Sapphire Rapids-class Xeon,
 * scripts/simd_efficiency.py avx2: one thread's CPU time against the peak timed
 * before each run, machine loaded by other builds, so +-15% run to run):
 * perf puts 95% of a 1-thread GeGLU call (8192 x 768 -> 3072 -> 768) in the
 * two micro-kernels (63% gated, 32% the down projection's), packing ~1%,
 * page clearing 2%; the micro-kernels over panels already in L1 reach about
 * the same fraction of the peak (55-89%) as inside the whole call (46-75%).
 * So the cache blocks are not the loss: with base and variant built side by
 * side and alternating in one process, K blocks of 256 / 384 for the gated
 * products (each 8-wide part then finds the other's weight lines in L1) ran
 * 1.01-1.07x the time of 768, software prefetch of the weight panel 8 K
 * steps ahead 0.98-1.01x (16 steps ahead, timed in pairs within one
 * process, 0.95-0.98x: now PREFETCH_K_STEPS), and K blocks of 256-512 for
 * the down projection changed nothing beyond the noise (timed in pairs, 512
 * ran 0.93-0.94x the time of 1024: now GEMM_LINEAR_KC). MKL's AVX2 sgemm
 * (MKL_ENABLE_INSTRUCTIONS=AVX2, same process, same shapes) took 0.80-0.92x
 * our packed products' time. */

#endif /* FUSEDMLP_CPU_TILE_AVX2_H */
