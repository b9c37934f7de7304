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
/* A few-row backward product's tile (backward.h): the same 6 x 2 ymm. The
 * 4 x 2 of units without a tile of their own (8 accumulators, as many as 2
 * pipes of 4-cycle FMAs keep busy) took 1.11x the time (scripts/simd_ab.py
 * backward, Zen 3, one thread, 31 rounds alternating in one process: 16 x
 * 256^3 ReLU backward, its dW and its dX alike). */
#define SMALL_PRODUCT_MR 6
#define SMALL_PRODUCT_NV 2
/* The float unit's packed micro-kernels stay out of line (microkernel_simd.h).
 * Inlined into gemm.h's block loops, the K loop's register allocation moves
 * with any change to those loops: a choose_blocks with one more argument put
 * the loop counter on the stack (an add to memory and a reload every two K
 * steps; perf annotate) and cost 5-7% in every linear product, even those
 * whose blocks it left alone (simd_ab.py). Out of line the loop keeps all in
 * registers; against the inlined loop as it was (bound compared in memory):
 * linear 1024 x (768 -> 3072, 3072 -> 768, 1024 -> 4096) and the ksweep
 * products 0.98-0.99x the time, study MLP 0.99, GeGLU level (its kernel was
 * already out of line). The AVX-512 unit's 32 registers leave its loop
 * clean; out of line it ran level (linear 0.99-1.01) or slower (study MLP
 * 1.02-1.03), so it stays inlined. bfloat16's AVX2 unit was not measured.
 *
 * With weights packed ahead, the float unit's input block takes half the L2
 * and the weight block a quarter (gemm.h: a quarter and half elsewhere): at
 * kc 384-512 a quarter held 252-336 rows, under the row block's 504 (4096
 * rows as for two threads), so each weight block came from L3 twice. One
 * thread, medians of 9 alternating rounds, load ~2.6 (simd_ab.py, both
 * builds out of line), time against the old shares: 4096 x (768, 1024,
 * 3072) -> 3072 GELU 0.973, 0.977, 0.944, study MLP 0.978, GeGLU at 4096
 * tokens 1.007, just-in-time products unchanged (0.99-1.00). The AVX-512
 * unit (kc 256: a quarter holds 512 rows already) ran level or slower
 * (0.99-1.02), and keeps them. Row blocks of 2 a thread rather than 4 (the
 * study MLP's 240 rows to 504) gained a little more there (0.970) but were
 * left: fewer blocks balance a thread slowed by another process worse. */
#if STORE_IS_REAL
#define FMLP_PACKED_KERNELS_OUT_OF_LINE 1
#define GEMM_INPUT_L2_SHARE 2
#define GEMM_AHEAD_WEIGHT_L2_SHARE 4
#endif
/* gate and up run K in one block while the 6-row input micro-panel fits the
 * whole L1 (K up to 1365 in 32 KiB, 2048 in 48 KiB), as in tile_avx512.h. On
 * Zen 3 (32 KiB) the GeGLU block at 256, 1024 and 4096 tokens, dim 768
 * (whole K against two blocks of 384), took 0.93-0.95x the time; at dim
 * 1024 and 1280 (two of 512, 640) 0.94-0.97x (scripts/simd_ab.py gated,
 * one thread, 9 rounds); in the bench (2 threads, builds alternating, 3
 * runs each, medians and means) study_gated and gated_1024 took 0.94-0.95x
 * and 0.89-0.91x the time, at 84-87% of the FMA peak where they had read
 * 76-84%. On Zen 4 (48 KiB, AVX2 forced) whole K at 1536 and 2048 had taken
 * 1.02-1.03x the time of two blocks, measured as in tile_avx512.h; AVX2-only
 * CPUs are where this unit runs by default. */
#define GATED_ONE_BLOCK_L1_SHARE 1
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
 * our packed products' time. Issue 18's sweep had the cases with K >= 1024
 * (study_mlp, gated_1024, large_gemm) at 61-64% of the peak and those with
 * K = 768 at 83-84%; K was not it: one thread, the ksweep products (rows x K
 * -> 3072 GELU, K 768 / 1024 / 3072) ran 105-116 GFLOP/s at every K and
 * either row count, the whole cases 90-108 GFLOP/s a CPU-second alike
 * (scripts/cpu_share.py, 2 threads). Their wall rate is the load's: on
 * a machine shared with builds, those three read 1.04-1.23 CPU-seconds a
 * second (one core's worth) while study_linear and study_gated, run in
 * turn with them, read 1.81-1.91; idle, all five ran at 1.97-2.01, 203-216
 * GFLOP/s, 79-84% of the 2-thread peak (258).
 * On Zen 4 (AVX2 forced, float32, 2 threads) the GeGLU cases read 63-78% of
 * the peak from run to run, the AVX-512 unit's 76-81%. On one quiet thread
 * the gap is small (scripts/simd_efficiency.py avx2 against avx512, a few
 * runs each): the whole gated call at 70-81% against 81-83%, the
 * micro-kernels at kc 512-768 at 87-100% of the FMA peak. A 4 x 3 ymm tile
 * (3 loads, 4 broadcasts a K step) ran level with 6 x 2 (linear 512 x 768 ->
 * 3072, 3072 -> 768, 1024 -> 4096 GELU, B/A 1.005-1.010, scripts/simd_ab.py,
 * 9 rounds). */

#endif /* FUSEDMLP_CPU_TILE_AVX2_H */
