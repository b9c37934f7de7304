/* The packed micro-kernels of the AMX unit (template: see docs/kernels.md), on
 * Intel AMX tiles: _tile_dpbf16ps multiplies a 16-row x 32-bfloat16 A tile by
 * a B tile of 16 K-pairs x 16 columns into a 16 x 16 float C tile, 8192
 * multiply-adds an instruction. The weight panels are the K-pair panels of
 * pack_k_pairs.h (NR = 32 columns: two B tiles side by side, a K-pair row
 * 128 bytes); the A tiles are loaded from the input's rows where they lie
 * (reads_in_place) or from tile-ready panels (pack_tile_rows below). One K
 * block, as in every bfloat16 unit (GEMM_KC covers any K), so the tiles start
 * at zero and the epilogue (bias, pre-activation, activation, one rounding
 * to bfloat16) runs on the float tiles stored to a small scratch on the
 * stack. K past the last whole 32 (and odd K) goes through zero-padded copies
 * of the tail; rows and columns past the output are zero in the panels and
 * never stored.
 *
 * K in L1-sized blocks (256-768, the input panel in L1 while the weight
 * panels stream from L2; the float C tiles stored to and loaded from a
 * per-thread partial-sum scratch between blocks) was built and measured and
 * gained nothing on the Xeon (C harness, one thread's CPU time, medians of
 * 10-16 runs alternating in one process, loaded machine): tile loads from
 * L2 keep up (the micro-kernel over panels in L1 ran ~1.3 TFLOP/s at kc 1024,
 * ~1.2 at kc 384; with 16 weight panels swept from L2, 1.14 at kc 1024 with
 * the input panel in L2 too, 0.96 at kc 384 with it in L1); a 512-row block
 * of 1024 -> 4096 took 6.9 ms in K blocks of 352 against 7.2 whole (8.4
 * against 8.1 with GELU(tanh)), and gate and up 768 -> 3072 took 20.4 ms
 * against 14.1 (12 MiB of partial sums; mc and nc of that variant counted
 * in packed bytes). What limits these products is the epilogue (GELU's erf
 * over a 32 x 32 tile cost about what 1024 values of K of tile products
 * do; the linear tile's now runs between the next tile's products: see
 * pending_tile) and the weights streamed from L3 once per input block
 * (choose_blocks).
 *
 * Measured again with the epilogue deferred (C harness: gemm_rows of a
 * 512-row block, one thread's CPU time, variants as libraries alternating
 * in one process, min of 12-20 runs, load 3-5 on the 2 cores, outputs
 * bit-identical): K parts of 8-11 whole 32s run part by part over the up
 * to 8 tiles of one input panel (its part in L1 while the weight panels
 * stream from L2, partial sums 4 KiB a tile on the tile loop's stack, so
 * nothing like the 12 MiB above) took 1024 -> 4096 (no activation) 5.3-5.7
 * ms against 5.0 whole: each part's C tiles go through memory and back
 * (tilestored, then tileloadd and the products wait on them), which in an
 * isolated loop cost 8% at one round trip per 32 steps; the L1 saves less
 * (that loop over A and B panels swept from L2 ran 1.6-1.7 TFLOP/s against
 * 2.2-2.5 for the products alone). Neither are the weights from L3 what
 * limits it: input and weight blocks of half to twice choose_blocks' sizes
 * stayed within +-6%, the next weight block prefetched into L2 a share per
 * tile ran 6-10% slower, and a weight of one block (256 columns, always in
 * L2) ran no faster per flop. The op's tile loop runs at ~0.9-1.0 TFLOP/s
 * plain in this VM's quiet moments and ~3x slower when the other vCPU is
 * busy, the isolated loop with it (shared core resources), so
 * two-thread timings here are ratios at best.
 *
 * scripts/amx_bisect.py walks from that loop to the op (one thread's CPU time,
 * min of 30 rounds, every step once a round, loaded machine; after the C tiles'
 * deferred store, see pending_tile), 512 x 1024 -> 4096, ms: products over a
 * fixed input and weight block in L2 2.12-2.20 (1.95-2.02 TFLOP/s), + the C
 * tiles' stores and the deferred rounding epilogue into a 32 x 32 output
 * 2.22-2.35, + the real output (rows 8 KiB apart) 2.41-2.61, + the whole packed
 * weight (a new 512 KiB block per 256 columns) and the input packed per block:
 * gemm_rows 2.80-3.02 (1.42-1.53 TFLOP/s); then bias and GELU 3.60-3.75
 * (3.0-3.2 since finish_rows_to), the whole op (fmlp_cpu_chain: just in time
 * weight blocks, scratch) 4.25-4.45 (~1.0 TFLOP/s; 3.8-4.0 since). At 4096 rows
 * (32 MiB of output, the weight packed ahead) the real output costs 1.29x, the
 * whole weight 1.05x, a fresh output 1.18x, the op 1.04x over gemm_rows' bias
 * and GELU. gemm_rows (512 rows) against itself: output rows padded past 4 KiB
 * aliasing level, the input pack on a huge page level, the packed weight on 4
 * KiB pages 1.46x (fmlp_alloc_scratch advises 2 MiB ones), a fresh output (page
 * faults) 1.08x. GELU's epilogue in groups of 4 rows every 4 K steps cost ~0.37
 * us a tile whatever K (384, 512 or 1024), as much as alone: it did not overlap
 * the products; a row a step does (finish_rows_to). Tried and dropped, against
 * gemm_rows: the next weight panel prefetched into L2 during the first input
 * panel's tiles 1.02x, the next weight block a share per tile 1.04-1.07x, input
 * and weight blocks of 64-512 rows and columns level (64 x 4096 1.9x),
 * streaming stores for the output level (a fresh output 1.2x), PREFETCHW of a
 * tile's output rows a tile ahead level (0.85x in the loop over a fixed weight
 * block). Each memory stream (weight, output, input) costs a few percent and a
 * fix to one does not show: their sum seems what limits the loop. Unexplained:
 * the C tiles stored each tile with no epilogue reading them ran 1.24-1.33x the
 * products, slower than with the epilogue (1.03-1.10x); at 4096 rows the op
 * after the other steps ran up to 1.85x gemm_rows with bias and GELU, alone in
 * its process 1.1x.
 *
 * The packed path's tile is 32 x 32 (2 x 2 C tiles, 2 A and 2 B: all 8 tile
 * registers; the gated tile too, gate's then up's: see microkernel_gated_amx);
 * the few-row paths and everything else are microkernel_simd.h's
 * with the AVX-512 register tile (tile_avx512.h), so the unit includes that
 * first and then sets the packed tile for gemm.h and drivers.h. */
#include <stdint.h>
#include <string.h>

#include "pack_k_pairs.h"

#define FMLP_PACK_WEIGHT_PANEL FN(pack_k_pairs)
#define FMLP_PACK_WEIGHT_PANELS FN(pack_k_pair_panels)
#define FMLP_PACK_INPUT_PANEL FN(pack_tile_rows)
#define FMLP_MICROKERNEL FN(microkernel_amx)
#define FMLP_MICROKERNEL_GATED FN(microkernel_gated_amx)
#define FMLP_MICROKERNEL_STATE FN(pending_tile)
#define FMLP_MICROKERNEL_BEGIN FN(begin_tiles)
#define FMLP_MICROKERNEL_END FN(finish_tiles)
#define FMLP_OWN_FEW_ROWS 1 /* few_rows_amx.h, at the end */
/* The input block keeps a quarter of the L2, the blocks measured above; the
 * whole L2 that gemm.h gives the other bfloat16 units has not run on an AMX
 * CPU. */
#define GEMM_INPUT_L2_SHARE 4
#include "microkernel_simd.h"

/* The packed tile, for gemm.h and drivers.h (included after this header);
 * the SIMD kernels above were expanded with tile_avx512.h's. Gated: the
 * whole 32 x 32 tile, gate's product then up's (microkernel_gated_amx). */
#undef GEMM_MR
#undef GATED_MR
#undef GATED_NR
#define GEMM_MR 32
#define GATED_MR 32
#define GATED_NR 32

#define AMX_ROWS 16  /* rows of a tile */
#define AMX_K 32     /* bfloat16 values along K in a row of an A tile */
#define AMX_BYTES 64 /* bytes in a row of any tile */
_Static_assert(GEMM_NR == 2 * AMX_ROWS && GEMM_MR == 2 * AMX_ROWS, "2 x 2 C tiles");
_Static_assert(GATED_NR == GEMM_NR, "the gated tile takes whole weight panels");

/* Vectors the epilogue activates together: the activations' polynomials are
 * chains of dependent FMAs, and a row's 2 vectors (1 in the gated tile) left
 * the FMA ports idle. 8 (4 rows of the linear tile) ran the GELU epilogue
 * ~1.4x faster than 2 (the linear micro-kernel over panels in L1 at kc 128,
 * where the epilogue is most of the time: 274-294 ms against 392-449; 16 no
 * faster than 8; C harness, one thread's CPU time, best of 3, loaded
 * machine); the gated tile takes 8 rows alike. */
#define EPILOGUE_VECTORS 8
_Static_assert(GEMM_MR % (EPILOGUE_VECTORS / GEMM_NV) == 0,
               "epilogue groups of whole rows inside the tile");

/* The 16 tile rows of block[] (16 vectors of K-pair slots, one per pair
 * p, 16 rows each) stored as A tile rows AMX_K values apart: the first
 * `stored` of them, from out. */
static FMLP_ALWAYS_INLINE void FN(store_tile_rows)(vreal block[AMX_ROWS], int64_t stored,
                                                   STORE *out) {
  v_transpose(block);
  for (int64_t t = 0; t < stored; ++t) v_store((float *)(out + t * AMX_K), block[t]);
}

/* pack_tile_rows for rows next to each other (rs == 1: the transposed grad_pre
 * a many-row backward's dW multiplies, where each tile row is a strided
 * column): per 32 rows and whole 32 of K, the rows' 16 K-pairs
 * (adjacent_k_pairs_32: two vectors of 16 rows) go through the 32-bit
 * transpose into 2 x 16 tile rows of 16 pairs; a last 16 rows through
 * adjacent_k_pairs; the K tail one value at a time. Element by element, the
 * whole-32 blocks were 15% of a 256 x 512^3 bfloat16 training step's kernel
 * samples (perf, one thread). */
static void FN(pack_adjacent_tile_rows)(const STORE *src, int64_t cs, int64_t count,
                                        int64_t width, int64_t kc, REAL *dst) {
  STORE *out = (STORE *)dst;
  const int64_t whole = kc / AMX_K * AMX_K, tail = kc - whole;
  for (int64_t k0 = 0; k0 < whole; k0 += AMX_K) {
    STORE *block_out = out + k0 * width;
    int64_t i0 = 0;
    for (; i0 + 2 * AMX_ROWS <= width; i0 += 2 * AMX_ROWS) {
      vreal first[AMX_ROWS], second[AMX_ROWS];
      const __mmask32 rows = FN(first_of_32)(count - i0);
      for (int p = 0; p < AMX_ROWS; ++p) {
        const STORE *low = src + (k0 + 2 * p) * cs + i0;
        __m512i lower, upper;
        FN(adjacent_k_pairs_32)(_mm512_maskz_loadu_epi16(rows, low),
                                _mm512_maskz_loadu_epi16(rows, low + cs), &lower, &upper);
        first[p] = _mm512_castsi512_ps(lower);
        second[p] = _mm512_castsi512_ps(upper);
      }
      FN(store_tile_rows)(first, AMX_ROWS, block_out + i0 * AMX_K);
      FN(store_tile_rows)(second, AMX_ROWS, block_out + (i0 + AMX_ROWS) * AMX_K);
    }
    for (; i0 < width; i0 += AMX_ROWS) {
      vreal block[AMX_ROWS];
      for (int p = 0; p < AMX_ROWS; ++p) {
        const STORE *low = src + (k0 + 2 * p) * cs + i0;
        block[p] = _mm512_castsi512_ps(FN(adjacent_k_pairs)(low, low + cs, count - i0));
      }
      const int64_t stored = width - i0 < AMX_ROWS ? width - i0 : AMX_ROWS;
      FN(store_tile_rows)(block, stored, block_out + i0 * AMX_K);
    }
  }
  for (int64_t i = 0; i < width && tail > 0; ++i) {
    STORE *to = out + whole * width + i * tail;
    for (int64_t kk = 0; kk < tail; ++kk) to[kk] = i < count ? src[i + (whole + kk) * cs] : 0;
  }
}

/* An input panel of `width` (MR) rows over kc values of K, tile-ready: for
 * each whole 32 of K, a block of width rows x 32 values (an A tile's rows,
 * 64 bytes each, next to each other); then the last kc % 32 values of each
 * row, kc % 32 apart. Zero rows past count. As REAL slots it takes
 * ceil(kc / 2) x width (gemm.h's panel_rows). Rows next to each other
 * (rs == 1) are packed by pack_adjacent_tile_rows above. */
static void FN(pack_tile_rows)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                               int64_t width, int64_t kc, REAL *dst) {
  if (rs == 1 && cs != 1) {
    FN(pack_adjacent_tile_rows)(src, cs, count, width, kc, dst);
    return;
  }
  STORE *out = (STORE *)dst;
  const int64_t whole = kc / AMX_K * AMX_K, tail = kc - whole;
  for (int64_t i = 0; i < width; ++i) {
    const STORE *row = src + i * rs;
    for (int64_t k0 = 0; k0 < kc; k0 += AMX_K) {
      const int64_t span = k0 < whole ? AMX_K : tail;
      STORE *to = out + k0 * width + i * span;
      if (i >= count) {
        memset(to, 0, (size_t)span * sizeof(STORE));
      } else if (cs == 1) {
        _mm512_mask_storeu_epi16(to, (__mmask32)(~0ull >> (64 - span)),
                                 _mm512_maskz_loadu_epi16((__mmask32)(~0ull >> (64 - span)),
                                                          row + k0));
      } else {
        for (int64_t kk = 0; kk < span; ++kk) to[kk] = row[(k0 + kk) * cs];
      }
    }
  }
}

/* gemm.h: whole 32-row panels of an input of unit column stride are read in
 * place (an A tile takes any row stride), not copied into a tile-ready
 * panel, where the panel's rows over K take at most a third of the L1: they
 * then stay there while the panel's column tiles read them. Rows whose start
 * is not a whole REAL slot (odd strides) are packed. 65536 x (64 -> 128 ->
 * 128 -> 64) ReLU spent a quarter of its samples in that copy (perf, one
 * thread). Read in place against packed (C harness, one thread's CPU time,
 * medians of 7-21 runs alternating in one process, loaded machine): 8192 x
 * (64 -> 128 -> 128 -> 64) ReLU 0.73 ms against 1.03, 4096 x 192 -> 768
 * 2.77 against 3.01, 256 -> 1024 2.86 against 2.89; past the third, strided
 * rows from the L2 cost more than the copy: 384 -> 1024 4.89 against 4.45,
 * 512 -> 1024 7.16 against 6.05, 2048 x 1024 -> 4096 26.9 against 20.7. */
static int FN(reads_in_place)(fmlp_input x, int64_t kc) {
  return x.col_stride == 1 && x.row_stride > 0 && x.row_stride % 2 == 0 &&
         (uintptr_t)x.data % sizeof(REAL) == 0 &&
         GEMM_MR * kc * (int64_t)sizeof(STORE) <= fmlp_cpu_l1d_bytes() / 3;
}
#define FMLP_INPUT_IN_PLACE(x, kc) FN(reads_in_place)(x, kc)
_Static_assert(GATED_MR == GEMM_MR, "the gated tile reads the whole panel, in place or packed");

/* The tile registers: 4 C tiles (rows 0-15 and 16-31 of two 16-column
 * halves), 2 A tiles (rows 0-15, 16-31), 2 B tiles (columns 0-15, 16-31 of
 * the linear tile; gate and up in the gated one), all 16 rows x 64 bytes.
 * Numbers, not an enum: the intrinsics paste them into the instruction. */
#define TILE_C00 0
#define TILE_C01 1
#define TILE_C10 2
#define TILE_C11 3
#define TILE_A0 4
#define TILE_A1 5
#define TILE_B0 6
#define TILE_B1 7
#define AMX_TILES 8

/* GCC 12's _tile_loadd and _tile_loadconfig do not tell the compiler that
 * they read memory (their asm takes the address in a register, or the first
 * 8 bytes), so stores into a buffer only they read could be dropped: a
 * barrier between the stores and the loads keeps them. */
#define TILE_READS_MEMORY() __asm__ volatile("" ::: "memory")

/* Sets this thread's tile configuration (palette 1). The packed products set
 * it before their first tile and release the tiles after their last
 * (FMLP_MICROKERNEL_BEGIN / END, gemm.h's for_each_tile), the few-row path
 * around each product: nothing else on the thread (another library's AMX
 * code) sees or disturbs our tiles between calls. Set per micro-kernel call,
 * LDTILECFG took 13% of 65536 x (64 -> 128 -> 128 -> 64)'s samples. */
static void FN(configure_tiles)(void) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < AMX_TILES; ++t) {
    config.colsb[t] = AMX_BYTES;
    config.rows[t] = AMX_ROWS;
  }
  _Static_assert(sizeof config == 64, "LDTILECFG reads 64 bytes");
  TILE_READS_MEMORY();
  _tile_loadconfig(&config);
}

/* Where the A tiles come from: a tile-ready input panel (pack_tile_rows:
 * each whole 32 of K a block of MR rows AMX_K apart, then the tail's rows
 * kc % 32 apart) or, read in place, the input's own rows (a_row_stride
 * apart, each whole 32 of K the next 64 bytes of them). In STOREs. */
typedef struct {
  const STORE *first;
  int64_t row, block, tail_at, tail_row;
} FN(amx_input);

static FN(amx_input) FN(amx_input_at)(const REAL *a, int64_t kc, int64_t a_row_stride) {
  const STORE *first = (const STORE *)a;
  const int64_t whole = kc / AMX_K * AMX_K;
  if (a_row_stride != 0) return (FN(amx_input)){first, a_row_stride, AMX_K, whole, a_row_stride};
  return (FN(amx_input)){first, AMX_K, GEMM_MR * AMX_K, whole * GEMM_MR, kc - whole};
}

/* The K tail of the input's MR rows (kc % 32 values a row at a.tail_at, rows
 * a.tail_row apart) and of the two B operands, zero-padded to whole tiles:
 * A rows 64 bytes apart, B K-pair rows (tail_pairs of them, 16 slots each,
 * NR slots apart in the panel) 64 bytes apart. */
typedef struct {
  uint16_t a[GEMM_MR][AMX_K];
  uint32_t b[2][AMX_ROWS][AMX_ROWS];
} FN(amx_tail);

static void FN(copy_tail)(FN(amx_input) a, int64_t tail, const uint32_t *const b[2],
                          int64_t tail_pairs, FN(amx_tail) *out) {
  memset(out, 0, sizeof *out);
  for (int64_t i = 0; i < GEMM_MR; ++i) {
    memcpy(out->a[i], a.first + a.tail_at + i * a.tail_row, (size_t)tail * sizeof(STORE));
  }
  for (int t = 0; t < 2; ++t) {
    for (int64_t p = 0; p < tail_pairs; ++p) {
      memcpy(out->b[t][p], b[t] + p * GEMM_NR, AMX_ROWS * sizeof(uint32_t));
    }
  }
}

/* NaN (quiet or signalling) or subnormal: vfpclassps' classes 0, 7 and 5. */
#define FPCLASS_NAN_OR_SUBNORMAL 0xA1

/* The first `cols` values of a tile row's nv (1 or 2) float vectors rounded
 * to bfloat16 and stored. VCVTNE2PS2BF16 rounds to nearest even as PyTorch
 * does, two vectors in one instruction, but reads subnormal floats as zero
 * and keeps a NaN's payload: rows holding either (one vfpclassps a vector)
 * take the integer rounding of the SIMD header (vs_store_first), which
 * matches PyTorch bit for bit. That rounding takes ~8 instructions a
 * vector: the micro-kernel alone at kc 64 with ReLU (panels in L1) ran 43 ms
 * against 66, 65536 x (64 -> 128 -> 128 -> 64) ReLU 16.3-16.7 against
 * 16.8-17.2 (C harness as above). */
static FMLP_ALWAYS_INLINE void FN(store_row_bf16)(STORE *dst, const vreal *v, int nv,
                                                  int64_t cols) {
  __mmask16 special = 0;
  for (int i = 0; i < nv; ++i) special |= _mm512_fpclass_ps_mask(v[i], FPCLASS_NAN_OR_SUBNORMAL);
  if (special != 0) {
    for (int i = 0; i < nv; ++i) {
      vs_store_first(dst + i * FMLP_SIMD_WIDTH, v[i], FN(lanes_inside)(cols, i));
    }
    return;
  }
  const __mmask32 inside = (__mmask32)(cols >= 32 ? ~0u : (1u << cols) - 1);
  if (nv == 2) {
    _mm512_mask_storeu_epi16(dst, inside, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
  } else {
    _mm256_mask_storeu_epi16(dst, (__mmask16)inside, (__m256i)_mm512_cvtneps_pbh(v[0]));
  }
}

/* The bias (or zero) of the `nv` vectors of a tile row, cols of them inside. */
static FMLP_ALWAYS_INLINE void FN(bias_vectors)(const STORE *bias, int nv, int64_t cols,
                                                vreal *start) {
  for (int v = 0; v < nv; ++v) {
    start[v] = bias != NULL
                   ? vs_load_first(bias + v * FMLP_SIMD_WIDTH, FN(lanes_inside)(cols, v))
                   : v_zero();
  }
}

/* A linear tile whose epilogue is still to run: microkernel_amx returns with
 * its float C tiles still in the tile registers; the next call stores them
 * here once its first A and B tiles are loading (store_pending), then runs
 * this epilogue a group of rows at a time between its own tile products,
 * and FMLP_MICROKERNEL_END (finish_tiles) stores and finishes the last one,
 * so the tile multiplier and the vector units work at the same time. The C
 * tiles stored at the end of their own call, the tile loop drained there:
 * the stores waited for the last products, the next tile's loads for the
 * stores (AMX tiles are not renamed). Stored after the next tile's first
 * loads, a 512-row block of 1024 -> 4096 (gemm_rows) took 2.87-3.03 ms
 * against 3.09-3.14, with bias and GELU 3.61-3.69 against 3.70-3.91
 * (scripts/amx_bisect.py, one thread's CPU time, min of 25 rounds, the
 * builds alternating over 4 processes each, loaded machine); the tile loop
 * over a fixed block in L2 with the epilogue into a 32 x 32 output lost
 * 3-6% to its products alone, against 12%. Run after its own products,
 * the epilogue added ~40% to a tile's time at K = 1024 with GELU(tanh);
 * overlapped, a tile took 1.93-1.96 us against 2.14-2.16 (GELU: 2.09 against 2.27; a
 * plain product 1.47 against 1.46: the unit's micro-kernel over 8 x 8 tiles
 * of panels from L2 between BEGIN and END, one thread's CPU time, best 3 of
 * 15-25 alternating runs, loaded machine; gemm_rows over 1024 rows, one
 * thread, best 3 of 10-12: 1024 -> 4096 GELU(tanh) 9.7-9.9 ms against
 * 10.5, 768 -> 3072 6.0 against 6.4, 3072 -> 768 without activation 5.3-5.5
 * against 5.3-5.4). The gated tile is deferred alike since its C tiles
 * are (see microkernel_gated_amx); before that, deferring its epilogue ran
 * 2% slower (3.83-3.85 us against 3.74-3.75 for gate and up 1024 -> 32
 * columns, the 32 x 16 tile), and in the 32 x 32 tile gate's bias,
 * pre-activation and activation between up's products (4 rows at a time)
 * measured level (512 rows x 768 -> 3072 GELU(tanh) 6.1-6.7 ms against
 * 6.1-6.6, 1024 -> 4096 GELU 10.9-12.8 against 10.6-10.9; C harness as in
 * the header). gemm.h's tile loop keeps one on its stack
 * (FMLP_MICROKERNEL_STATE) from FMLP_MICROKERNEL_BEGIN to END and hands it
 * to every tile (the epilogue's `state`). */
typedef struct {
  _Alignas(64) REAL t[GEMM_MR][GEMM_NR]; /* the linear tile's C tiles; the gated one's up */
  _Alignas(64) REAL gate[2][GATED_MR][GATED_NR]; /* the gated tiles' gate: the pending
                                                    one's (gate_buffer) and the next's */
  int gate_buffer;
  int64_t rows, cols;            /* rows 0: none pending */
  int64_t done;                  /* its rows finished */
  REAL (*in_tiles)[GEMM_NR];     /* where the C tiles still in the tile registers go
                                    (t or gate), or NULL */
  int gated;                     /* the epilogue is gated_ep's, else ep's */
  STORE *c;
  int64_t ldc;
  FN(tile_epilogue) ep;
  FN(gated_tile_epilogue) gated_ep;
} FN(pending_tile);

/* Rows one call of finish_rows takes: EPILOGUE_VECTORS vectors. */
enum { GROUP_ROWS = EPILOGUE_VECTORS / GEMM_NV };

/* Rows [i0, i0 + group) of the pending gated tile (see finish_group): the
 * biases, gate and up saved (save_gate_up), act(gate) * up formed in float
 * and rounded once at its store. */
static FMLP_ALWAYS_INLINE void FN(finish_gated_group)(const FN(pending_tile) *p, int64_t i0,
                                                      int group) {
  const FN(gated_tile_epilogue) *ep = &p->gated_ep;
  const int64_t here = p->rows - i0 < group ? p->rows - i0 : group;
  vreal gate_start[GEMM_NV], up_start[GEMM_NV];
  FN(bias_vectors)(ep->bias_gate, GEMM_NV, p->cols, gate_start);
  FN(bias_vectors)(ep->bias_up, GEMM_NV, p->cols, up_start);
  vreal g[GROUP_ROWS][GEMM_NV], u[GROUP_ROWS][GEMM_NV];
  for (int i = 0; i < group; ++i) {
    for (int v = 0; v < GEMM_NV; ++v) {
      g[i][v] = v_add(v_load(&p->gate[p->gate_buffer][i0 + i][v * FMLP_SIMD_WIDTH]),
                      gate_start[v]);
      u[i][v] = v_add(v_load(&p->t[i0 + i][v * FMLP_SIMD_WIDTH]), up_start[v]);
    }
  }
  for (int i = 0; i < group; ++i) {
    if (i < here && ep->save_gate_up) {
      FN(store_row_bf16)(ep->gate + (i0 + i) * ep->gate_up_stride, g[i], GEMM_NV, p->cols);
      FN(store_row_bf16)(ep->up + (i0 + i) * ep->gate_up_stride, u[i], GEMM_NV, p->cols);
    }
  }
  FN(activate_vectors)(&g[0][0], group * GEMM_NV, ep->activation);
  for (int i = 0; i < group; ++i) {
    vreal product[GEMM_NV];
    for (int v = 0; v < GEMM_NV; ++v) product[v] = v_mul(g[i][v], u[i][v]);
    if (i < here) {
      FN(store_row_bf16)(ep->product + (i0 + i) * ep->product_stride, product, GEMM_NV,
                         p->cols);
    }
  }
}

/* Rows [i0, i0 + group) of the pending tile (group at most GROUP_ROWS, a
 * constant where inlined): bias, pre-activation, activation and the
 * rounding store (the gated tile's: finish_gated_group). */
static FMLP_ALWAYS_INLINE void FN(finish_group)(const FN(pending_tile) *p, int64_t i0,
                                                int group) {
  if (p->gated) {
    FN(finish_gated_group)(p, i0, group);
    return;
  }
  const FN(tile_epilogue) *ep = &p->ep;
  const int64_t here = p->rows - i0 < group ? p->rows - i0 : group;
  STORE *c = p->c + i0 * p->ldc;
  /* a plain product (the backward's dW and dX: no bias, pre-activation or
   * activation) is only rounded and stored: through the grouped epilogue
   * below, its epilogue took 3.6-4.4 M samples of a bfloat16 GeGLU backward
   * at 256 tokens (K = 256 in three of its four products), this way 2.8-2.9
   * (perf, one thread, C harness, loaded machine) */
  if (ep->bias == NULL && ep->pre == NULL && ep->activation == FMLP_ACT_NONE) {
    for (int64_t i = 0; i < here; ++i) {
      vreal row[GEMM_NV];
      for (int v = 0; v < GEMM_NV; ++v) row[v] = v_load(&p->t[i0 + i][v * FMLP_SIMD_WIDTH]);
      FN(store_row_bf16)(c + i * p->ldc, row, GEMM_NV, p->cols);
    }
    return;
  }
  /* the epilogue in one pass over the float tile, EPILOGUE_VECTORS at a
   * time (with three passes, bias and pre-activation, activation, rounding
   * store, and the tile configuration set per call, 65536 x (64 -> 128 ->
   * 128 -> 64) ReLU took 25.5 ms against 17.3: C harness, one thread's CPU
   * time, medians, loaded machine) */
  vreal start[GEMM_NV];
  FN(bias_vectors)(ep->bias, GEMM_NV, p->cols, start);
  vreal r[GROUP_ROWS][GEMM_NV];
  for (int i = 0; i < group; ++i) {
    for (int v = 0; v < GEMM_NV; ++v) {
      r[i][v] = v_add(v_load(&p->t[i0 + i][v * FMLP_SIMD_WIDTH]), start[v]);
    }
  }
  /* loops over the whole group, rows past `here` skipped inside: the
   * vectors then stay in registers (a loop to `here` kept them on the
   * stack: the micro-kernel alone at kc 64 with ReLU 41.5 ms against 49.7,
   * 65536 x (64 -> 128 -> 128 -> 64) ReLU 7.7-12.9 against 8.5-14.7: C
   * harness, medians of 21 alternating runs, loaded machine) */
  for (int i = 0; i < group; ++i) {
    if (i < here && ep->pre != NULL) {
      FN(store_row_bf16)(ep->pre + (i0 + i) * ep->pre_stride, r[i], GEMM_NV, p->cols);
    }
  }
  FN(activate_vectors)(&r[0][0], group * GEMM_NV, ep->activation);
  for (int i = 0; i < group; ++i) {
    if (i < here) FN(store_row_bf16)(c + i * p->ldc, r[i], GEMM_NV, p->cols);
  }
}

/* finish_group of GROUP_ROWS rows from i0. */
static void FN(finish_rows)(const FN(pending_tile) *p, int64_t i0) {
  FN(finish_group)(p, i0, GROUP_ROWS);
}

/* finish_group of row i0 alone. */
static void FN(finish_row)(const FN(pending_tile) *p, int64_t i0) { FN(finish_group)(p, i0, 1); }

/* The pending tile finished from row i0 up to row `due` (none when i0 >=
 * due): whole groups while GROUP_ROWS are due, then a row at a time;
 * returns the row it stopped at. Between the tile products a row (2
 * vectors) a K step overlaps them, where a group of 4 rows every 4 steps
 * did not at all: with GELU it added ~0.37 us a tile whatever K, as much as
 * that epilogue alone took (0.35). A row a step against that (scripts/
 * amx_bisect.py with the activation varied, one thread's CPU time, min of
 * 15-20 rounds, 2-3 processes of each build alternating, loaded machine,
 * outputs bit-identical), ms: gemm_rows of 512 rows x 1024 -> 4096, bias
 * and GELU, 3.01-3.22 against 3.45-3.86, the whole op 3.76-3.97 against
 * 4.08-4.45; 768 -> 3072 GELU(tanh) 1.76-1.86 against 2.05-2.15; 512 ->
 * 2048 GELU 0.99-1.04 against 1.08-1.11; 1024 rows x 384 -> 1536 level;
 * plain products level. Groups of 2 rows every 2 steps ran between (1024
 * -> 4096 GELU 3.31-3.46). A short K (up to 8 steps) keeps a group a
 * step, the rest after the products, as before: alone, larger groups run
 * faster (see finish_group); 4096 x 128 -> 512 ReLU still ran 2-3% slower
 * at the min (medians level), 64 -> 128 level. The rows go evenly over the
 * steps (multiply_tiles: 768 -> 3072's 32 rows over 24 steps 1 or 2 a
 * step, the gated tile's 16 over 32 one every other step), not a whole
 * number a step then none: 768 -> 3072 bias and GELU 1.95-2.01 against
 * 1.99-2.11 (amx_bisect, min of 12 rounds, 3 processes each alternating),
 * the gated tile's 1024 -> 4096 GELU 8.37-8.50 against 9.01-9.31
 * (amx_gated, as in microkernel_gated_amx). */
static FMLP_ALWAYS_INLINE int64_t FN(finish_rows_to)(const FN(pending_tile) *p, int64_t i0,
                                                    int64_t due) {
  for (; due - i0 >= GROUP_ROWS; i0 += GROUP_ROWS) FN(finish_rows)(p, i0);
  for (; i0 < due; ++i0) FN(finish_row)(p, i0);
  return i0;
}

/* The C tiles still in the tile registers (pending NULL or in_tiles NULL:
 * none) to where in_tiles says. */
static FMLP_ALWAYS_INLINE void FN(store_pending)(FN(pending_tile) *p) {
  if (p == NULL || p->in_tiles == NULL) return;
  REAL (*to)[GEMM_NR] = p->in_tiles;
  const int64_t t_stride = GEMM_NR * (int64_t)sizeof(REAL);
  _tile_stored(TILE_C00, &to[0][0], t_stride);
  _tile_stored(TILE_C01, &to[0][AMX_ROWS], t_stride);
  _tile_stored(TILE_C10, &to[AMX_ROWS][0], t_stride);
  _tile_stored(TILE_C11, &to[AMX_ROWS][AMX_ROWS], t_stride);
  p->in_tiles = NULL;
  TILE_READS_MEMORY(); /* the epilogue's vector loads read what the tiles stored */
}

/* The pending tile's rows from p->done up to `until`; from its last rows on
 * (until at least rows) nothing is pending after. */
static void FN(finish_pending)(FN(pending_tile) *p, int64_t until) {
  if (until < p->rows) {
    p->done = FN(finish_rows_to)(p, p->done, until);
    return;
  }
  for (int64_t i0 = p->done; i0 < p->rows; i0 += GROUP_ROWS) FN(finish_rows)(p, i0);
  p->rows = 0;
  p->done = 0;
}

/* FMLP_MICROKERNEL_BEGIN: no tile pending yet, and the tile configuration. */
static void FN(begin_tiles)(void *state) {
  ((FN(pending_tile) *)state)->rows = 0;
  ((FN(pending_tile) *)state)->done = 0;
  ((FN(pending_tile) *)state)->gate_buffer = 0;
  ((FN(pending_tile) *)state)->in_tiles = NULL;
  FN(configure_tiles)();
}

/* FMLP_MICROKERNEL_END: the last tile's epilogue, then the tiles released. */
static void FN(finish_tiles)(void *state) {
  FN(store_pending)(state);
  FN(finish_pending)(state, GEMM_MR);
  _tile_release();
}

/* Step q's A tiles (from a, see amx_input) and B tiles (b[0], b[1]). */
static FMLP_ALWAYS_INLINE void FN(load_step)(FN(amx_input) a, const uint32_t *const b[2],
                                             int64_t q) {
  const int64_t a_stride = a.row * (int64_t)sizeof(STORE);
  const int64_t b_stride = GEMM_NR * (int64_t)sizeof(uint32_t);
  const STORE *a_q = a.first + q * a.block;
  _tile_loadd(TILE_A0, a_q, a_stride);
  _tile_loadd(TILE_A1, a_q + AMX_ROWS * a.row, a_stride);
  _tile_loadd(TILE_B0, b[0] + q * AMX_ROWS * GEMM_NR, b_stride);
  _tile_loadd(TILE_B1, b[1] + q * AMX_ROWS * GEMM_NR, b_stride);
}

/* The four C tiles over all of kc: A tiles from a (see amx_input), B tiles
 * b[0], b[1] (K-pair slots, rows NR slots apart); TILE_C00/TILE_C01 take
 * rows 0-15 times b[0]/b[1], TILE_C10/TILE_C11 rows 16-31. Inlined: called,
 * a passed through the stack and read back as one 32-byte load from two
 * 8-byte stores, a store-forwarding stall on a quarter of the micro-kernel's
 * samples (65536 x (64 -> 128 -> 128 -> 64) ReLU 14.8-14.9 ms against
 * 16.0: C harness, one thread's CPU time, medians of 21 alternating runs,
 * loaded machine). The C tiles still in the tile registers (pending NULL:
 * none) are stored once the first step's A and B tiles are loading; the
 * pending tile's rows up to `until` then run spread over the whole 32s of
 * K (finish_rows_to), done by the time the C tiles are. */
static FMLP_ALWAYS_INLINE void FN(multiply_tiles)(int64_t kc, FN(amx_input) a,
                                                  const uint32_t *const b[2],
                                                  FN(pending_tile) *pending, int64_t until) {
  const int64_t whole = kc / AMX_K;
  /* the pending tile's rows [first, last) spread evenly over the whole 32s
   * of K (by step q, the first (q + 1) / whole of them, rounded up), at
   * most a group a step (the rest after them) */
  const int64_t first = pending != NULL ? pending->done : 0;
  const int64_t last = pending == NULL ? 0 : until < pending->rows ? until : pending->rows;
  int64_t next_row = first;
  TILE_READS_MEMORY(); /* the packs, which the caller may have just written */
  if (whole > 0) FN(load_step)(a, b, 0);
  FN(store_pending)(pending);
  _tile_zero(TILE_C00);
  _tile_zero(TILE_C01);
  _tile_zero(TILE_C10);
  _tile_zero(TILE_C11);
  for (int64_t q = 0; q < whole; ++q) {
    if (q > 0) FN(load_step)(a, b, q);
    _tile_dpbf16ps(TILE_C00, TILE_A0, TILE_B0);
    _tile_dpbf16ps(TILE_C01, TILE_A0, TILE_B1);
    _tile_dpbf16ps(TILE_C10, TILE_A1, TILE_B0);
    _tile_dpbf16ps(TILE_C11, TILE_A1, TILE_B1);
    if (next_row < last) {
      const int64_t even = first + ((q + 1) * (last - first) + whole - 1) / whole;
      next_row = FN(finish_rows_to)(pending, next_row,
                                    even < next_row + GROUP_ROWS ? even : next_row + GROUP_ROWS);
    }
  }
  if (pending != NULL) {
    pending->done = next_row;
    FN(finish_pending)(pending, until);
  }
  const int64_t tail = kc - whole * AMX_K;
  if (tail == 0) return;
  const uint32_t *b_tail[2] = {b[0] + whole * AMX_ROWS * GEMM_NR,
                               b[1] + whole * AMX_ROWS * GEMM_NR};
  FN(amx_tail) padded;
  FN(copy_tail)(a, tail, b_tail, (tail + 1) / 2, &padded);
  TILE_READS_MEMORY();
  _tile_loadd(TILE_A0, padded.a[0], AMX_BYTES);
  _tile_loadd(TILE_A1, padded.a[AMX_ROWS], AMX_BYTES);
  _tile_loadd(TILE_B0, padded.b[0], AMX_BYTES);
  _tile_loadd(TILE_B1, padded.b[1], AMX_BYTES);
  _tile_dpbf16ps(TILE_C00, TILE_A0, TILE_B0);
  _tile_dpbf16ps(TILE_C01, TILE_A0, TILE_B1);
  _tile_dpbf16ps(TILE_C10, TILE_A1, TILE_B0);
  _tile_dpbf16ps(TILE_C11, TILE_A1, TILE_B1);
}

/* The input's MR rows a (a tile-ready panel, or in place: see amx_input)
 * times the K-pair weight panel b (NR columns) over all of K, into the
 * row-major tile c (rows x cols of it), its C tiles and epilogue left
 * pending. */
static void FN(microkernel_amx)(int64_t kc, const REAL *restrict a, const REAL *restrict b,
                                STORE *c, int64_t ldc, int64_t rows, int64_t cols,
                                const FN(tile_epilogue) *ep) {
  const uint32_t *b_slots = (const uint32_t *)b;
  const uint32_t *const halves[2] = {b_slots, b_slots + AMX_ROWS};
  FN(pending_tile) *p = ep->state;
  FN(multiply_tiles)(kc, FN(amx_input_at)(a, kc, ep->a_row_stride), halves, p, GEMM_MR);
  p->in_tiles = p->t;
  p->gated = 0;
  p->rows = rows;
  p->cols = cols;
  p->c = c;
  p->ldc = ldc;
  p->ep = *ep;
}

/* Gate and up over the input's MR rows (as in microkernel_amx) and GATED_NR
 * columns (b_gate, b_up: the K-pair weight panels), each as the linear
 * tile's 2 x 2 C tiles, one weight after the other: a B tile then reads
 * whole 64-byte lines of its panel, and the input panel is read twice a
 * 32 x 32 tile, as before. The 32 x 16 gated tile before it (gate and up C
 * tiles of 16 columns side by side, one pass over K) read every other line
 * of both panels, the tile's other half the rest in its own call: gate and
 * up 512 rows x 768 -> 3072 GELU(tanh) took 6.1-7.0 ms against 7.2-7.8 in
 * quiet moments, 16.0-16.5 against 17.1-17.5 under load, 1024 -> 4096 GELU
 * 12.7 against 13.3 (C harness as in the header, same outputs; 512 -> 2048
 * ReLU level). act(gate) * up is formed in float and rounded once at its
 * store (finish_gated_group).
 *
 * The tile loop does not drain between gate and up nor between tiles, as in
 * the linear tile (pending_tile): gate's C tiles are stored (into the gate
 * buffer the pending tile does not read) once up's first A and B tiles are
 * loading, up's once the next tile's gate's are, and the epilogue runs half
 * its rows between the next tile's gate products, half between its up
 * products. Both C tiles stored at the end of their own products, the
 * epilogue after them: gemm_gated_rows of 512 rows (scripts/amx_gated.py,
 * one thread's CPU time, min of 20 rounds, 3 processes of each build
 * alternating, loaded machine, outputs bit-identical), ms: 768 -> 3072
 * GELU(tanh) 4.7-5.1 against 6.2-6.5, 1024 -> 4096 GELU 8.3-9.0 against
 * 10.3-11.2 (before the even spread of finish_rows_to; with it 4.5-5.1
 * against 6.3-6.7 and 7.6-8.6 against 10.8-11.1); the epilogue all between
 * the next tile's gate products 5.3-5.4 and 9.0, all between its up
 * products 5.6-6.0 and 9.9-10.4. With gate and up saved (3 rows stored a
 * row, not 1) the spread epilogue ran 5-15% slower than the base (1024 ->
 * 4096 GELU 13.1-15.4 against 12.2-12.9; evenly spread, 14.4-15.0 against
 * 12.9-13.8 at the end of its call), so that tile runs its epilogue at the
 * end of its own call, after its C tiles (gate's still stored behind up's
 * first loads): 11.8-12.6 against the base's 12.5-13.7. */
static void FN(microkernel_gated_amx)(int64_t kc, const REAL *restrict a,
                                      const REAL *restrict b_gate, const REAL *restrict b_up,
                                      int64_t rows, int64_t cols,
                                      const FN(gated_tile_epilogue) *ep) {
  const uint32_t *gate_slots = (const uint32_t *)b_gate, *up_slots = (const uint32_t *)b_up;
  const uint32_t *const gate_halves[2] = {gate_slots, gate_slots + AMX_ROWS};
  const uint32_t *const up_halves[2] = {up_slots, up_slots + AMX_ROWS};
  const FN(amx_input) input = FN(amx_input_at)(a, kc, ep->a_row_stride);
  FN(pending_tile) *p = ep->state;
  const int next = !p->gate_buffer;
  FN(multiply_tiles)(kc, input, gate_halves, p, p->rows / 2);
  p->in_tiles = p->gate[next];
  FN(multiply_tiles)(kc, input, up_halves, p, GATED_MR);
  p->in_tiles = p->t;
  p->gated = 1;
  p->gate_buffer = next;
  p->rows = rows;
  p->cols = cols;
  p->gated_ep = *ep;
  if (ep->save_gate_up) {
    FN(store_pending)(p);
    FN(finish_pending)(p, GATED_MR);
  }
}

#include "few_rows_amx.h"
