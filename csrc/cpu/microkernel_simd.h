/* The register-tiled SIMD micro-kernels (template: real_template.h plus the
 * vreal operations of simd_<isa>.h; see docs/kernels.md). An MR x NR tile of
 * accumulators, NR = NV vectors wide, lives in registers for the whole K loop: each step loads
 * NV vectors of the packed operand b and broadcasts MR scalars of a. The
 * accumulators start at the bias (or at the partial sums of earlier K
 * blocks), and the last K block activates them in registers before the one
 * store. Edge tiles use masked loads and stores: nothing outside the output
 * is read or written. */
#include "cache_sizes.h"
#include "tile.h"
#include "vector_math.h"

#if !defined(GEMM_MR) || !defined(GEMM_NR)
#error "a SIMD unit defines its tile, GEMM_MR x GEMM_NR (a multiple of FMLP_SIMD_WIDTH)"
#endif
#if GEMM_INPUT_COPIES != 1 && GEMM_INPUT_COPIES != FMLP_SIMD_WIDTH
#error "an input value is packed once or spread over a vector (tile.h's GEMM_INPUT_COPIES)"
#endif
/* Slots an MR-tall input panel takes per value of K: its L1 share counts them. */
#define GEMM_INPUT_PANEL_K_SLOTS (GEMM_MR * GEMM_INPUT_COPIES)
/* The largest K block: an MR-row input micro-panel in half the L1 data
 * cache, where it stays while the weight panels stream past it (gemm.h).
 * Partial sums between K blocks live in the output, which storage narrower
 * than REAL would round, so such a unit runs the whole K at once (the bf16
 * units). */
#define GEMM_KC                                                                            \
  (STORE_IS_REAL ? fmlp_cpu_l1_k_block(GEMM_INPUT_PANEL_K_SLOTS * (int64_t)sizeof(REAL)) \
                 : ((int64_t)1 << 40))
/* A product of one weight cuts K finer, so that the input micro-panel and
 * the weight panel streaming past it fit the L1 together (the gated
 * product's two weight panels would not, and keeps GEMM_KC: K blocks that
 * small cost it more in round trips of gate and up than they save). With
 * the input panel alone in half the L1, each call's weight panel pushed
 * it out and both came from L2: in one process, alternating per run (one
 * thread, loaded machine, medians of 15 pairs), 256 rows x 3072 -> 768 ran
 * 0.89-0.91x the time on AVX-512 (K blocks of 256, not 512) and 0.93-0.94x
 * on AVX2 (512, not 1024), 256 x 768 -> 3072 0.97x on AVX2 and the same on
 * AVX-512. */
static inline int64_t FN(linear_k_block)(void) {
  const int64_t both =
      fmlp_cpu_l1d_bytes() / ((GEMM_INPUT_PANEL_K_SLOTS + GEMM_NR) * (int64_t)sizeof(REAL));
  const int64_t most = GEMM_KC;
  return both < 64 ? 64 : both < most ? both : most;
}
#define GEMM_LINEAR_KC (STORE_IS_REAL ? FN(linear_k_block)() : GEMM_KC)
/* The gated product runs K in one block while its input micro-panel takes
 * at most 1 / GATED_ONE_BLOCK_L1_SHARE of the L1 (a unit's tile header may
 * say; 2, half as for GEMM_KC, unless it does): one block stores gate and up
 * once, on the last (inference not at all), where two make a round trip of
 * both through memory. */
#ifndef GATED_ONE_BLOCK_L1_SHARE
#define GATED_ONE_BLOCK_L1_SHARE 2
#endif
#define GEMM_GATED_ONE_BLOCK_K                                                           \
  (STORE_IS_REAL ? fmlp_cpu_l1d_bytes() / GATED_ONE_BLOCK_L1_SHARE /                     \
                       (GEMM_INPUT_PANEL_K_SLOTS * (int64_t)sizeof(REAL))                \
                 : GEMM_KC)
#define GEMM_MC (GEMM_MR * 4)
/* Up to this many rows the weight is read in place rather than packed
 * (chosen with `python -m fusedmlp.bench`: packing a weight costs about as
 * much as multiplying it by this many rows). */
#define GEMM_UNPACKED_MAX_ROWS ((int64_t)(2 * GEMM_NR))
#define GEMM_NV (GEMM_NR / FMLP_SIMD_WIDTH)
_Static_assert(GEMM_NR % FMLP_SIMD_WIDTH == 0, "GEMM_NR is whole vectors");
/* the MR x NV accumulators, NV loads of b and one broadcast of a stay in registers */
_Static_assert(GEMM_MR * GEMM_NV + GEMM_NV + 1 <= FMLP_SIMD_REGISTERS, "GEMM_MR x GEMM_NR spills");
/* This unit has the transposed few-row kernels (weights read in place, the
 * lanes layout) and the gate-and-up kernel; gemm.h and drivers.h use them. */
#define FMLP_TRANSPOSED_KERNELS 1
#define FMLP_GATED_KERNEL 1
/* Weight panels (NR rows) and input panels (MR rows) are packed K-major,
 * transposed through registers, for the float micro-kernels below; a unit
 * whose micro-kernel header names its own packing and packed micro-kernels
 * first (microkernel_dpbf16.h) keeps those, and the rest of this file. */
#ifndef FMLP_MICROKERNEL
#define FMLP_PACK_WEIGHT_PANEL FN(pack_k_major)
#if GEMM_INPUT_COPIES == 1
#define FMLP_PACK_INPUT_PANEL FN(pack_k_major)
#else
#define FMLP_PACK_INPUT_PANEL FN(pack_input_spread)
#endif
#define FMLP_MICROKERNEL FN(microkernel_packed)
#define FMLP_MICROKERNEL_GATED FN(microkernel_gated)
#elif GEMM_INPUT_COPIES != 1
#error "GEMM_INPUT_COPIES is read by this header's micro-kernels only"
#endif

/* dst[c * dst_stride + r] = src[r * src_stride + c] for r < stored_rows and
 * c < cols, with rows at or past n_rows (<= stored_rows <= W) zero: W x W
 * blocks go through registers (a vector transpose moves ~8x more elements a
 * cycle than a scalar copy), the last cols % W columns element by element.
 * src has unit column stride. */
static void FN(pack_transposed_block)(const STORE *src, int64_t src_stride, int64_t n_rows,
                                      int64_t stored_rows, int64_t cols, REAL *dst,
                                      int64_t dst_stride) {
  int64_t c0 = 0;
  for (; c0 + FMLP_SIMD_WIDTH <= cols; c0 += FMLP_SIMD_WIDTH) {
    vreal block[FMLP_SIMD_WIDTH];
    for (int i = 0; i < FMLP_SIMD_WIDTH; ++i) {
      block[i] = i < n_rows ? vs_load(src + i * src_stride + c0) : v_zero();
    }
    v_transpose(block);
    for (int t = 0; t < FMLP_SIMD_WIDTH; ++t) {
      REAL *column = dst + (c0 + t) * dst_stride;
      /* Where this call fills whole column slots, a whole-vector store's
       * lanes past stored_rows land on later columns' slots, which later
       * stores overwrite: only stores that would reach past the last column
       * need the mask (microcode on AMD Zen 2 and 3: AVX2 input panels of 6
       * rows packed in ~0.4x the time, 256 x 512 -> 512, one thread, perf). */
      if (stored_rows == dst_stride && (cols - c0 - t) * dst_stride >= FMLP_SIMD_WIDTH) {
        v_store(column, block[t]);
      } else {
        v_store_first(column, block[t], stored_rows);
      }
    }
  }
  for (int64_t c = c0; c < cols; ++c) {
    for (int64_t i = 0; i < stored_rows; ++i) {
      dst[c * dst_stride + i] = i < n_rows ? to_real(src[i * src_stride + c]) : (REAL)0;
    }
  }
}
/* pack_rows_k_major for rows next to each other (rs == 1: the transposed
 * views the many-row backward multiplies), which are K-major already: each K
 * step's count values are copied and zero-padded a vector at a time. A
 * memcpy call per K step of 12 or 32 values was 11% of a 256 x 512^3 chain
 * backward's samples (perf, one thread), its packing 7% once inline.
 * In a panel without padding, a vector that reaches past the K step's
 * values but not past the panel's end (every K step's but the last) is
 * loaded and stored whole: its extra lanes read the source's next values,
 * which lie before the next K step's (cs >= W), and land on the next K
 * step's slots, which that step's own stores overwrite. A 6-row AVX2 input
 * panel (a dW product's dY^T) otherwise takes a masked load and a masked
 * store every K step, the store microcode on AMD's Zen 2 and 3: unmasked,
 * the dW of the 256 x 512^3 chain backward (K = 256) ran in 0.95x the time,
 * the whole backward 0.97x (Zen 3, scripts/simd_ab.py backward, one thread,
 * 11 rounds). */
static void FN(pack_adjacent_rows)(const STORE *src, int64_t cs, int64_t count, int64_t width,
                                   int64_t k, REAL *dst) {
  const int spill = count == width && cs >= FMLP_SIMD_WIDTH;
  for (int64_t kk = 0; kk < k; ++kk) {
    const STORE *in = src + kk * cs;
    REAL *out = dst + kk * width;
    for (int64_t i = 0; i < width; i += FMLP_SIMD_WIDTH) {
      const int64_t inside = count - i, room = width - i;
      if (spill && (kk + 1) * width + FMLP_SIMD_WIDTH - room <= k * width) {
        v_store(out + i, vs_load(in + i));
        continue;
      }
      const vreal v = inside >= FMLP_SIMD_WIDTH ? vs_load(in + i)
                      : inside > 0              ? vs_load_first(in + i, inside)
                                                : v_zero();
      if (room >= FMLP_SIMD_WIDTH) {
        v_store(out + i, v);
      } else {
        v_store_first(out + i, v, room);
      }
    }
  }
}

/* pack_rows_k_major, with rows of unit column stride (the forward's operands)
 * transposed through registers, W x W at a time, and adjacent rows copied.
 * (unused where the unit names its own packing and few-row path) */
static __attribute__((unused)) void FN(pack_k_major)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                             int64_t width, int64_t k, REAL *dst) {
  if (rs == 1 && cs != 1) {
    FN(pack_adjacent_rows)(src, cs, count, width, k, dst);
    return;
  }
  if (cs == 1) {
    for (int64_t half = 0; half < width; half += FMLP_SIMD_WIDTH) {
      const int64_t stored = width - half < FMLP_SIMD_WIDTH ? width - half : FMLP_SIMD_WIDTH;
      const int64_t n_rows = count - half < 0 ? 0 : count - half < stored ? count - half : stored;
      FN(pack_transposed_block)(n_rows > 0 ? src + half * rs : src, rs, n_rows, stored, k,
                                dst + half, width);
    }
    return;
  }
  FN(pack_rows_k_major)(src, rs, cs, count, width, k, dst);
}

/* An input panel as pack_k_major packs it, each value then spread over a
 * vector's GEMM_INPUT_COPIES slots (tile.h): from the last value back, as
 * value n's slots start at n x GEMM_INPUT_COPIES, past every value before
 * it, which is still to be read. */
static __attribute__((unused)) void FN(pack_input_spread)(const STORE *src, int64_t rs,
                                                          int64_t cs, int64_t count,
                                                          int64_t width, int64_t k, REAL *dst) {
  FN(pack_k_major)(src, rs, cs, count, width, k, dst);
  for (int64_t at = width * k - 1; at >= 0; --at) {
    v_store(dst + at * GEMM_INPUT_COPIES, v_set1(dst[at]));
  }
}

/* The vector of a packed input value at p: loaded where the pack spread it
 * over one (GEMM_INPUT_COPIES), else broadcast. */
static inline vreal FN(input_vector)(const REAL *p) {
  return GEMM_INPUT_COPIES > 1 ? v_load(p) : v_set1(*p);
}


#define FMLP_ALWAYS_INLINE inline __attribute__((always_inline))

/* K steps ahead that the packed micro-kernels ask for the weight panel's
 * row: the panel streams from L2 past the input panel held in L1, and the
 * hardware prefetchers alone left the FMAs waiting for it. In one
 * process, alternating per run against the same kernels without it (one
 * thread, loaded machine, medians of 15 pairs, 256 rows): AVX-512 768 ->
 * 3072 0.92x the time, 3072 -> 768 0.91-0.95x, gate and up 0.94-0.97x, the
 * whole GeGLU call 0.96x; AVX2 0.95-0.98x each (8 steps ahead: 0.99-1.01x).
 * A prefetch past the panel's end is a hint, never a read that can fault. */
#define PREFETCH_K_STEPS 16

/* Asks for the cache lines of a packed panel's row `width` REALs wide. */
static FMLP_ALWAYS_INLINE void FN(prefetch_panel_row)(const REAL *row, int64_t width) {
#pragma GCC unroll 4
  for (int64_t at = 0; at < width; at += 64 / (int64_t)sizeof(REAL)) {
    __builtin_prefetch(row + at, 0, 3);
  }
}

/* What the K loop compiles to (GCC, objdump of both float units): per K step
 * NV loads of b, MR broadcasts of a straight from memory and MR x NV FMAs,
 * no spill, no other address arithmetic than two pointer bumps per two K
 * steps; llvm-mca (Sapphire Rapids) puts the 12 x 32 loop at 92% of the FMA
 * ports' throughput. So the loop is not where the float GEMM loses to MKL
 * (scripts/simd_efficiency.py, one thread, loaded machine): over panels in
 * L1 it ran at 66-80% of the peak timed just before it (the peak itself
 * moved 160-210 GFLOP/s with the load), the GELU(tanh) epilogue cost 28% of
 * the time at kc 128 and 9% at kc 512; in the whole product the weight
 * panel's trips from L2 cost more (GEMM_LINEAR_KC, PREFETCH_K_STEPS).
 * microkernel_packed over panels in L1 runs at the rate of a hand-written
 * assembly loop of the same shape over the same panels (0.95-1.00x,
 * alternating in one process) and at MKL's whole-product rate (the harness'
 * paired part: 0.93-1.03x MKL's time a flop), while our whole products take
 * 1.10-1.30x MKL's time a flop; perf (cpu-clock: this VM has no hardware
 * counters) puts 94% of the micro-kernel's samples in the K loop, packing
 * ~3% of the product. What was tried against that and lost (AVX-512 unit
 * built twice into one process, alternating per round, medians of 31-61
 * rounds of 256 rows x 768 -> 3072, 3072 -> 768 and gate + up, loaded
 * machine: time against this code): the weight panel held in L1 while the
 * input panels stream past it, as MKL's kernel does (tiles in jr-outer
 * order: 1.04-1.11x; prefetching the input panel instead of the weight
 * 1.05-1.14x), MKL's 8 x 48 tile that way (1.02-1.08x), a 14 x 32 tile (no
 * gain, gated slower), weight blocks of a quarter or an eighth of the L2
 * (no gain), K blocks of 384 or 768 for one weight (1.00x, 1.03-1.04x), the
 * next tile's output rows prefetched (1.00x), the weight panel prefetched 8,
 * 24 or 32 K steps ahead rather than 16 (0.99-1.02x, AVX2 and AVX-512).
 * Later, with both builds in one process (scripts/simd_ab.py: whole ops,
 * one thread, medians of 11-21 alternating rounds, load 4-6 on 2 cores; B's
 * time over A's): earlier K blocks' partial sums added to the tile after the
 * K loop rather than loaded before it (0.97-1.01x linear, level), the next
 * weight block asked into the L2 across the current block's tiles (0.99-1.02x),
 * b loaded a K step ahead into registers (1.00-1.01x), the activation run over
 * the stored tile a row at a time (0.99-1.00x); and output rows a multiple of
 * 4 KiB apart cost nothing (simd_efficiency.py's strides part: 0.98-1.00x
 * the time with rows 16 floats farther apart). Where the whole product's
 * time goes instead (AVX-512, 504 x 768 -> 3072, the micro-kernel over the
 * same 42 x 32 tiles of one K block, GFLOP/s against panels in L1, four
 * runs, medians of 21-41 alternating rounds): input and weight panels
 * streaming from L2 0.92-1.01, the tile at its place in the output with
 * earlier sums reloaded 0.92-0.96, weight blocks changing as the product's do
 * (from L3) 0.88, the whole product 0.87-0.92; perf puts 94% of it in the
 * micro-kernel, its samples spread evenly over the K loop: small losses at
 * each step, no one place. Then, aimed at those steps (simd_ab.py, AVX-512
 * unless said, one thread, medians of 15-31 alternating rounds, load 4-9.5
 * on 2 cores; linear: its three shapes at 512 rows, GeGLU: 256 and 1024
 * tokens; B's time over A's, whose quartiles spanned +-2-5%: 0.98-1.02 is
 * level), all level or slower, none kept: the tile's own output rows (24
 * lines; the gated kernel's product rows, and gate's and up's when stored)
 * asked for 32 K steps before its end, as MKL's kernels do, so that its
 * stores find their lines: prefetcht0 linear 0.98-1.01, GeGLU 0.99-1.01;
 * prefetchw (-mprfchw) linear 0.97-1.02 over two runs, GeGLU 0.99-1.00,
 * at 1024 rows 0.98-1.00, AVX2 linear 1.00-1.01, GeGLU 1.00-1.01; 96 steps
 * before its end linear 1.00-1.02, GeGLU 0.99-1.00; the next input panel
 * asked for a line each K step in every tile 1.03-1.04 linear, 1.00-1.02
 * GeGLU; the weight panel 8, 24 or 32 K steps ahead 1.00-1.02 (as before);
 * the weight block (choose_blocks' nc) at 3/4 of the L2 rather than half
 * 1.01-1.04, at 3/8 0.96-1.00 in one run, 0.99-1.03 in a second of 31
 * rounds, 1.00-1.03 at 1024 rows, AVX2 0.99-1.01, at 1/4 at 1024 rows
 * 0.99-1.03; the input block (mc, where weights are packed ahead: the study
 * MLP at 2048 rows) at 1/2 or 1/8 of the L2 rather than 1/4, 1.005 and 0.994;
 * a just-in-time weight block's panels packed one at a time as the first
 * input panel's tiles reach them (in L1 when first multiplied) rather than
 * the whole block before its tiles, linear 1.00-1.03 (1024 rows 1.00-1.06),
 * GeGLU 1.01, AVX2 1.00-1.01; the K loops unrolled 4 rather than 2 0.98-1.01;
 * MKL's 8 x 48 tile (perf annotate of mkl_blas_avx512_sgemm_kernel_0: b a
 * K step ahead, both streams prefetched, prefetchw of C) in our tile order,
 * gated 4 x 48, linear 0.98-1.02, GeGLU 1.02-1.03 (slower; it moves K splits).
 * With MKL as the control (simd_efficiency.py paired, 504 rows, three runs
 * of each build interleaved, MKL's time a flop): this code up 1.07-1.11,
 * down 1.09-1.10, gated 1.05-1.09; C's rows by prefetchw 1.08-1.14, 1.11,
 * 1.06-1.20; the weight block at 3/8 of the L2 1.06-1.08, 1.09-1.16,
 * 1.07-1.12.
 * So neither the output tile's lines, the next input panel, the weight
 * block's first pass nor the block sizes hold the few percent.
 *
 * acc[i][v] += sum_kk a_rows[i][kk * a_k_stride] * b[kk * nv * W + v * W] for
 * i < mr, v < nv: mr and nv are constants in each caller, so the tile stays in
 * registers. a_rows point at REALs (a packed panel) or, with a_stored, at
 * storage (weight rows read in place), also a constant in each caller. */
static FMLP_ALWAYS_INLINE void FN(accumulate_tile)(const int mr, const int nv,
                                                   vreal acc[GEMM_MR][GEMM_NV], int64_t kc,
                                                   const void *const *a_rows, const int a_stored,
                                                   int64_t a_k_stride, const REAL *restrict b) {
  const int64_t b_width = (int64_t)nv * FMLP_SIMD_WIDTH;
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    if (!a_stored) FN(prefetch_panel_row)(b + (kk + PREFETCH_K_STEPS) * b_width, b_width);
    vreal b_k[GEMM_NV];
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) b_k[v] = v_load(b + kk * b_width + v * FMLP_SIMD_WIDTH);
#pragma GCC unroll 16
    for (int i = 0; i < mr; ++i) {
      const int64_t at = kk * a_k_stride;
      const vreal a_ik = a_stored ? v_set1(to_real(((const STORE *)a_rows[i])[at]))
                                  : FN(input_vector)((const REAL *)a_rows[i] + at);
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v) acc[i][v] = v_fma(a_ik, b_k[v], acc[i][v]);
    }
  }
}

/* Lanes of vector v that lie inside a tile `cols` wide. */
static FMLP_ALWAYS_INLINE int64_t FN(lanes_inside)(int64_t cols, int v) {
  const int64_t left = cols - (int64_t)v * FMLP_SIMD_WIDTH;
  return left < 0 ? 0 : left;
}

/* Vector v of a tile row `cols` wide, at p: a whole vector loads and stores
 * plainly, only the edge's is masked. AVX2's masked stores are slow (AMD
 * Zen microcodes vmaskmovps; the bf16 units' go through a buffer), and every
 * tile stores its accumulators once per K block. */
static FMLP_ALWAYS_INLINE vreal FN(load_tile_vector)(const STORE *p, int64_t cols, int v) {
  const int64_t lanes = FN(lanes_inside)(cols, v);
  return lanes >= FMLP_SIMD_WIDTH ? vs_load(p) : vs_load_first(p, lanes);
}

static FMLP_ALWAYS_INLINE void FN(store_tile_vector)(STORE *p, vreal x, int64_t cols, int v) {
  const int64_t lanes = FN(lanes_inside)(cols, v);
  if (lanes >= FMLP_SIMD_WIDTH) {
    vs_store(p, x);
  } else {
    vs_store_first(p, x, lanes);
  }
}

/* The rows x cols part of the tile into row-major c. */
static FMLP_ALWAYS_INLINE void FN(store_tile)(vreal acc[GEMM_MR][GEMM_NV], STORE *c, int64_t ldc,
                                              int64_t rows, int64_t cols) {
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      FN(store_tile_vector)(c + i * ldc + v * FMLP_SIMD_WIDTH, acc[i][v], cols, v);
    }
  }
}

/* A unit's tile header may keep the packed micro-kernels out of line
 * (FMLP_PACKED_KERNELS_OUT_OF_LINE): inlined into gemm.h's block loops,
 * their K loop is register-allocated with everything the loops keep live,
 * and where registers are few that can put its counter on the stack
 * (tile_avx2.h). (unused where the unit names its own packed micro-kernels) */
#ifdef FMLP_PACKED_KERNELS_OUT_OF_LINE
#define PACKED_KERNEL_ATTRIBUTES __attribute__((unused, noinline))
#else
#define PACKED_KERNEL_ATTRIBUTES __attribute__((unused))
#endif

/* Packed a (an MR-tall panel, element (i, kk) at
 * a[(kk * MR + i) * GEMM_INPUT_COPIES]) times the packed b panel, into the
 * row-major tile c (rows x cols of it inside). */
static PACKED_KERNEL_ATTRIBUTES void FN(microkernel_packed)(int64_t kc, const REAL *restrict a,
                                   const REAL *restrict b, STORE *c, int64_t ldc, int64_t rows, int64_t cols,
                                   const FN(tile_epilogue) *ep) {
  vreal acc[GEMM_MR][GEMM_NV];
  vreal start[GEMM_NV];
#pragma GCC unroll 8
  for (int v = 0; v < GEMM_NV; ++v) {
    start[v] = ep->first_k_block && ep->bias != NULL
                   ? FN(load_tile_vector)(ep->bias + v * FMLP_SIMD_WIDTH, cols, v)
                   : v_zero();
  }
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < GEMM_NV; ++v) {
      acc[i][v] = !ep->first_k_block && i < rows
                      ? FN(load_tile_vector)(c + i * ldc + v * FMLP_SIMD_WIDTH, cols, v)
                      : start[v];
    }
  }
  const void *a_rows[GEMM_MR];
#pragma GCC unroll 16
  for (int i = 0; i < GEMM_MR; ++i) a_rows[i] = a + i * GEMM_INPUT_COPIES;
  FN(accumulate_tile)(GEMM_MR, GEMM_NV, acc, kc, a_rows, 0, GEMM_INPUT_PANEL_K_SLOTS, b);
  if (ep->last_k_block) {
    if (ep->pre != NULL) FN(store_tile)(acc, ep->pre, ep->pre_stride, rows, cols);
    FN(activate_vectors)(&acc[0][0], GEMM_MR * GEMM_NV, ep->activation);
  }
  FN(store_tile)(acc, c, ldc, rows, cols);
}

/* The few-row kernels, unless the unit's micro-kernel header brings its own
 * few-row path (FMLP_OWN_FEW_ROWS: the AMX unit's few_rows_amx.h). */
#ifndef FMLP_OWN_FEW_ROWS
/* The transposed product for small row counts, which skips packing the
 * weight: the tile's rows are weight rows read in place (w_rows[i], unit
 * stride along K), its columns are input rows packed K-major in b (nv
 * vectors wide). So tile element (i, m) is output (row m, column i): bias is
 * per tile row, and the store transposes in registers. Always the
 * whole K at once. mr and nv are constants in each caller, so the tile lives
 * in registers. */
/* out[m * stride + i] = lane m % W of acc[i][m / W] for i < n_weight_rows and
 * m < n_input_rows: W x W blocks transposed in registers (a scalar copy of a
 * 12 x 16 tile took 6% of a 16 x 256 -> 256 product). */
static FMLP_ALWAYS_INLINE void FN(store_transposed)(vreal acc[GEMM_MR][GEMM_NV],
                                                    const int mr, const int nv, STORE *out,
                                                    int64_t stride, int64_t n_weight_rows,
                                                    int64_t n_input_rows) {
#pragma GCC unroll 4
  for (int i0 = 0; i0 < mr; i0 += FMLP_SIMD_WIDTH) {
    if (i0 >= n_weight_rows) break;
    const int64_t cols =
        n_weight_rows - i0 < FMLP_SIMD_WIDTH ? n_weight_rows - i0 : FMLP_SIMD_WIDTH;
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) {
      const int64_t m0 = (int64_t)v * FMLP_SIMD_WIDTH;
      if (m0 >= n_input_rows) break;
      vreal block[FMLP_SIMD_WIDTH];
#pragma GCC unroll 16
      for (int t = 0; t < FMLP_SIMD_WIDTH; ++t) block[t] = i0 + t < mr ? acc[i0 + t][v] : v_zero();
      v_transpose(block);
      for (int64_t t = 0; t < FMLP_SIMD_WIDTH && m0 + t < n_input_rows; ++t) {
        vs_store_first(out + (m0 + t) * stride + i0, block[t], cols);
      }
    }
  }
}

static FMLP_ALWAYS_INLINE void FN(transposed_tile)(const int mr, const int nv, int64_t k,
                                                   const void *const *w_rows,
                                                   const REAL *restrict b,
                                                   const FN(product_out) *out,
                                                   int64_t n_weight_rows, int64_t n_input_rows,
                                                   const STORE *bias,
                                                   fmlp_activation activation) {
  vreal acc[GEMM_MR][GEMM_NV];
  const int64_t b_width = (int64_t)nv * FMLP_SIMD_WIDTH;
#pragma GCC unroll 32
  for (int i = 0; i < mr; ++i) {
    const vreal start = bias != NULL && i < n_weight_rows ? v_set1(to_real(bias[i])) : v_zero();
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) acc[i][v] = start;
  }
  FN(accumulate_tile)(mr, nv, acc, k, w_rows, 1, 1, b);
  if (out->pre != NULL) {
    FN(store_transposed)(acc, mr, nv, out->pre, out->pre_stride, n_weight_rows, n_input_rows);
  }
#pragma GCC unroll 32
  for (int i = 0; i < mr; ++i) FN(activate_vectors)(acc[i], nv, activation);
  if (out->c_lanes == NULL) {
    FN(store_transposed)(acc, mr, nv, out->c, out->ldc, n_weight_rows, n_input_rows);
    return;
  }
#pragma GCC unroll 32
  for (int i = 0; i < mr; ++i) {
    if (i >= n_weight_rows) break;
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) {
      v_store(out->c_lanes + i * b_width + v * FMLP_SIMD_WIDTH, vs_round(acc[i][v]));
    }
  }
}

/* MR weight rows x NR input rows. */
static void FN(microkernel_transposed)(int64_t k, const void *const *w_rows,
                                       const REAL *restrict b, const FN(product_out) *out,
                                       int64_t n_weight_rows, int64_t n_input_rows,
                                       const STORE *bias, fmlp_activation activation) {
  FN(transposed_tile)(GEMM_MR, GEMM_NV, k, w_rows, b, out, n_weight_rows, n_input_rows, bias,
                      activation);
}

/* MR weight rows x one vector of input rows: for up to W input rows, where
 * the NR-wide tile would leave half its lanes empty (16 rows x 256 -> 256:
 * 1.6x faster than the NR-wide tile). */
static void FN(microkernel_transposed_narrow)(int64_t k, const void *const *w_rows,
                                              const REAL *restrict b,
                                              const FN(product_out) *out,
                                              int64_t n_weight_rows, int64_t n_input_rows,
                                              const STORE *bias, fmlp_activation activation) {
  FN(transposed_tile)(GEMM_MR, 1, k, w_rows, b, out, n_weight_rows, n_input_rows,
                      bias, activation);
}

/* For a handful of input rows (single-token inference) every output is a
 * dot product along K of an input row and a weight row, both read in place
 * with unit stride: vectors run along K, so no lane is wasted, and the
 * weight streams through once. out[r][j] = x_rows[r] . w_rows[j]. */
#define DOT_MAX_ROWS 4
#define DOT_WEIGHT_ROWS 4
/* On AVX2 the 3- and 4-row tiles hold more accumulators than its 16
 * registers and spill some to the stack every K step (objdump), yet they
 * stream the weight once: sent to the transposed tiles instead (DOT_MAX_ROWS
 * 2), 3 and 4 rows x 768 -> 3072 GELU took 1.80x and 1.31x the time
 * (scripts/simd_ab.py few, Zen 3, one thread, 21 rounds). */

/* dot_tile for n_x input rows, a constant in each caller: one token reads
 * its one row, not DOT_MAX_ROWS copies of it (4x the FMAs, which bound the
 * AVX2 unit). 1 x 768 -> 3072 tanh-GELU, one thread, CPU time, medians on
 * noisy shared cores: AVX2 0.710 -> 0.561 ms, AVX-512 0.508 -> 0.485 ms;
 * the GeGLU block at one token, AVX2 1.85 -> 1.48 ms. Software prefetch of
 * the next weight rows and 8 weight rows a tile gained nothing over it. */
static FMLP_ALWAYS_INLINE void FN(dot_tile_rows)(const int n_x, int64_t k,
                                                 const STORE *const x_rows[DOT_MAX_ROWS],
                                                 const STORE *const w_rows[DOT_WEIGHT_ROWS],
                                                 REAL out[DOT_MAX_ROWS][DOT_WEIGHT_ROWS]) {
  vreal acc[DOT_MAX_ROWS][DOT_WEIGHT_ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < n_x; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < DOT_WEIGHT_ROWS; ++j) acc[r][j] = v_zero();
  }
  for (int64_t kk = 0; kk < k; kk += FMLP_SIMD_WIDTH) {
    const int64_t lanes = k - kk; /* the last step is masked: nothing read past K */
    vreal w[DOT_WEIGHT_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < DOT_WEIGHT_ROWS; ++j) {
      w[j] = lanes >= FMLP_SIMD_WIDTH ? vs_load(w_rows[j] + kk)
                                      : vs_load_first(w_rows[j] + kk, lanes);
    }
#pragma GCC unroll 4
    for (int r = 0; r < n_x; ++r) {
      const vreal x = lanes >= FMLP_SIMD_WIDTH ? vs_load(x_rows[r] + kk)
                                               : vs_load_first(x_rows[r] + kk, lanes);
#pragma GCC unroll 4
      for (int j = 0; j < DOT_WEIGHT_ROWS; ++j) acc[r][j] = v_fma(x, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < n_x; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < DOT_WEIGHT_ROWS; ++j) out[r][j] = v_sum(acc[r][j]);
  }
}

/* out[r][j] for r < rows (1 to DOT_MAX_ROWS) */
static void FN(dot_tile)(int64_t rows, int64_t k, const STORE *const x_rows[DOT_MAX_ROWS],
                         const STORE *const w_rows[DOT_WEIGHT_ROWS],
                         REAL out[DOT_MAX_ROWS][DOT_WEIGHT_ROWS]) {
  switch (rows) {
    case 1: FN(dot_tile_rows)(1, k, x_rows, w_rows, out); break;
    case 2: FN(dot_tile_rows)(2, k, x_rows, w_rows, out); break;
    case 3: FN(dot_tile_rows)(3, k, x_rows, w_rows, out); break;
    default: FN(dot_tile_rows)(DOT_MAX_ROWS, k, x_rows, w_rows, out); break;
  }
}

#endif /* FMLP_OWN_FEW_ROWS */

/* ---- the gated micro-kernel: act(x @ Wg.T + bg) * (x @ Wu.T + bu) ---- */

/* The unit's gated tile, GATED_MR input rows x GATED_NR weight columns, a
 * part of the MR x NR tile whose packed panels it reads: gate and up
 * accumulators, GATED_NV loads of each weight and one broadcast of the input
 * stay in registers. */
#if !defined(GATED_MR) || !defined(GATED_NR)
#error "a SIMD unit defines its gated tile, GATED_MR x GATED_NR (parts of GEMM_MR x GEMM_NR)"
#endif
#define GATED_NV (GATED_NR / FMLP_SIMD_WIDTH)
_Static_assert(GEMM_MR % GATED_MR == 0 && GEMM_NR % GATED_NR == 0 &&
                   GATED_NR % FMLP_SIMD_WIDTH == 0,
               "the gated tile is whole vectors and divides the MR x NR tile");
_Static_assert(2 * GATED_MR * GATED_NV + 2 * GATED_NV + 1 <= FMLP_SIMD_REGISTERS,
               "GATED_MR x GATED_NR spills");

typedef struct {
  const STORE *bias_gate, *bias_up; /* at the tile's first column, or NULL */
  STORE *gate, *up;                 /* partial sums between K blocks; the
                                       pre-activations when save_gate_up */
  int64_t gate_up_stride;
  STORE *product; /* act(gate) * up, formed in REAL, written on the last K block */
  int64_t product_stride;
  fmlp_activation activation;
  int first_k_block, last_k_block, save_gate_up;
  int64_t a_row_stride; /* as in tile_epilogue */
  void *state;          /* as in tile_epilogue */
} FN(gated_tile_epilogue);

static FMLP_ALWAYS_INLINE void FN(load_gated_start)(vreal acc[GATED_MR][GATED_NV],
                                                    const STORE *bias, const STORE *partial,
                                                    int64_t stride, int first_k_block,
                                                    int64_t rows, int64_t cols) {
#pragma GCC unroll 16
  for (int i = 0; i < GATED_MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < GATED_NV; ++v) {
      if (!first_k_block) {
        acc[i][v] = i < rows ? FN(load_tile_vector)(partial + i * stride + v * FMLP_SIMD_WIDTH,
                                                    cols, v)
                             : v_zero();
      } else {
        acc[i][v] = bias != NULL ? FN(load_tile_vector)(bias + v * FMLP_SIMD_WIDTH, cols, v)
                                 : v_zero();
      }
    }
  }
}

/* a: the first of GATED_MR rows in a packed MR-tall input panel (element
 * (i, kk) at a[(kk * MR + i) * GEMM_INPUT_COPIES]); b_gate, b_up: the first
 * of GATED_NR columns in the matching packed NR-wide weight panels. Gate
 * and up accumulate in one pass over K, so the input is read once and
 * act(gate) * up is stored without a round trip through memory. */
static PACKED_KERNEL_ATTRIBUTES void FN(microkernel_gated)(int64_t kc, const REAL *restrict a,
                                                          const REAL *restrict b_gate,
                                                          const REAL *restrict b_up,
                                                          int64_t rows, int64_t cols,
                                  const FN(gated_tile_epilogue) *ep) {
  vreal gate[GATED_MR][GATED_NV], up[GATED_MR][GATED_NV];
  FN(load_gated_start)(gate, ep->bias_gate, ep->gate, ep->gate_up_stride, ep->first_k_block,
                       rows, cols);
  FN(load_gated_start)(up, ep->bias_up, ep->up, ep->gate_up_stride, ep->first_k_block, rows,
                       cols);
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    FN(prefetch_panel_row)(b_gate + (kk + PREFETCH_K_STEPS) * GEMM_NR, GATED_NR);
    FN(prefetch_panel_row)(b_up + (kk + PREFETCH_K_STEPS) * GEMM_NR, GATED_NR);
    vreal bg[GATED_NV], bu[GATED_NV];
#pragma GCC unroll 8
    for (int v = 0; v < GATED_NV; ++v) {
      bg[v] = v_load(b_gate + kk * GEMM_NR + v * FMLP_SIMD_WIDTH);
      bu[v] = v_load(b_up + kk * GEMM_NR + v * FMLP_SIMD_WIDTH);
    }
#pragma GCC unroll 16
    for (int i = 0; i < GATED_MR; ++i) {
      const vreal a_ik = FN(input_vector)(a + (kk * GEMM_MR + i) * GEMM_INPUT_COPIES);
#pragma GCC unroll 8
      for (int v = 0; v < GATED_NV; ++v) {
        gate[i][v] = v_fma(a_ik, bg[v], gate[i][v]);
        up[i][v] = v_fma(a_ik, bu[v], up[i][v]);
      }
    }
  }
  if (!ep->last_k_block || ep->save_gate_up) {
#pragma GCC unroll 16
    for (int i = 0; i < GATED_MR; ++i) {
      if (i >= rows) break;
#pragma GCC unroll 8
      for (int v = 0; v < GATED_NV; ++v) {
        const int64_t at = i * ep->gate_up_stride + v * FMLP_SIMD_WIDTH;
        FN(store_tile_vector)(ep->gate + at, gate[i][v], cols, v);
        FN(store_tile_vector)(ep->up + at, up[i][v], cols, v);
      }
    }
  }
  if (!ep->last_k_block) return;
  FN(activate_vectors)(&gate[0][0], GATED_MR * GATED_NV, ep->activation);
#pragma GCC unroll 16
  for (int i = 0; i < GATED_MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 8
    for (int v = 0; v < GATED_NV; ++v) {
      FN(store_tile_vector)(ep->product + i * ep->product_stride + v * FMLP_SIMD_WIDTH,
                            v_mul(gate[i][v], up[i][v]), cols, v);
    }
  }
}

#ifndef FMLP_OWN_FEW_ROWS
#include "few_rows_simd.h"
#endif
