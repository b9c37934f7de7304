/* K-pair panels of bfloat16 storage, the layout the bfloat16 dot-product
 * instructions want (vdpbf16ps' second operand, an AMX tile's B operand):
 * slot (p, i) of a panel `width` rows wide holds row i's values 2p and
 * 2p + 1 (the first in the low half), zero past the rows or past K. A slot is
 * 32 bits, the size of a REAL, so the packs keep gemm.h's REAL layout: a
 * panel over k values of K is ceil(k / 2) rows of width slots
 * (GEMM_PACKED_K_PER_SLOT).
 * Include after the AVX-512 SIMD and storage headers. */
#include <stdint.h>

_Static_assert(!STORE_IS_REAL, "the K-pair panels hold bfloat16 storage");

/* For gemm.h: a slot holds two values of K. */
#define GEMM_PACKED_K_PER_SLOT 2
_Static_assert(FMLP_SIMD_WIDTH == 16, "a K-pair vector is 16 slots of a zmm register");

/* Row i's values 2p and 2p + 1 as one slot (zero past k). */
static inline uint32_t FN(k_pair)(const STORE *row, int64_t cs, int64_t p, int64_t k) {
  const uint32_t low = row[2 * p * cs];
  const uint32_t high = 2 * p + 1 < k ? row[(2 * p + 1) * cs] : 0;
  return low | high << 16;
}

/* The K-pair slots of 16 rows next to each other (unit row stride, as in the
 * transposed views the many-row backward multiplies): `low` holds the rows'
 * values at K = 2p, `high` those at 2p + 1 (NULL past K); rows from `valid`
 * on are zero (masked lanes are not read). */
static inline __m512i FN(adjacent_k_pairs)(const STORE *low, const STORE *high, int64_t valid) {
  const __mmask16 rows =
      (__mmask16)(valid >= FMLP_SIMD_WIDTH ? 0xFFFFu : valid > 0 ? (1u << valid) - 1 : 0u);
  const __m512i even = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rows, low));
  if (high == NULL) return even;
  const __m512i odd = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rows, high));
  return _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
}

/* The K-pair slots of 32 rows next to each other: `low` and `high` hold the
 * rows' 32 values at K = 2p and 2p + 1, as loaded; *first gets rows 0-15's
 * slots, *second rows 16-31's. unpacklo/hi interleave the values within
 * each 128-bit lane (rows 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, ...), one
 * lane permute each puts them in row order: 4 shuffles for 32 slots, where
 * adjacent_k_pairs takes 4 widening shuffles, 2 shifts and 2 ors. */
static inline void FN(adjacent_k_pairs_32)(__m512i low, __m512i high, __m512i *first,
                                           __m512i *second) {
  const __m512i quads_low = _mm512_unpacklo_epi16(low, high);
  const __m512i quads_high = _mm512_unpackhi_epi16(low, high);
  *first = _mm512_permutex2var_epi64(quads_low, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                                     quads_high);
  *second = _mm512_permutex2var_epi64(
      quads_low, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), quads_high);
}

/* The first `valid` of 32 lanes (none for valid <= 0). */
static inline __mmask32 FN(first_of_32)(int64_t valid) {
  return valid >= 32 ? ~(__mmask32)0 : valid > 0 ? (__mmask32)((1u << valid) - 1) : 0;
}

/* pack_k_pairs for rows next to each other (rs == 1), `panels` panels of
 * `width` rows one after another (ceil(k / 2) x width slots each): each
 * K-pair row interleaves two source rows, 32 slots at a time
 * (adjacent_k_pairs_32; a last 16 through adjacent_k_pairs), every panel's
 * row p before row p + 1, so the source rows are read in runs of `panels`
 * lines, not a line per row and panel (see pack_k_pair_panels). One slot at
 * a time (two strided 16-bit loads each) was 14% of a 256 x 512^3 bfloat16
 * training step's kernel samples (perf, one thread). */
static void FN(pack_adjacent_k_pairs)(const STORE *src, int64_t cs, int64_t count,
                                      int64_t width, int64_t panels, int64_t k, REAL *dst) {
  uint32_t *slots = (uint32_t *)dst;
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const STORE *low = src + 2 * p * cs, *high = 2 * p + 1 < k ? low + cs : NULL;
    for (int64_t panel = 0; panel < panels; ++panel) {
      const int64_t j0 = panel * width;
      uint32_t *out = slots + (panel * pairs + p) * width;
      int64_t i0 = 0;
      for (; i0 + 2 * FMLP_SIMD_WIDTH <= width; i0 += 2 * FMLP_SIMD_WIDTH) {
        const __mmask32 rows = FN(first_of_32)(count - j0 - i0);
        const __m512i even = _mm512_maskz_loadu_epi16(rows, low + j0 + i0);
        const __m512i odd = high != NULL ? _mm512_maskz_loadu_epi16(rows, high + j0 + i0)
                                         : _mm512_setzero_si512();
        __m512i first, second;
        FN(adjacent_k_pairs_32)(even, odd, &first, &second);
        _mm512_storeu_si512(out + i0, first);
        _mm512_storeu_si512(out + i0 + FMLP_SIMD_WIDTH, second);
      }
      for (; i0 < width; i0 += FMLP_SIMD_WIDTH) {
        const int64_t stored = width - i0 < FMLP_SIMD_WIDTH ? width - i0 : FMLP_SIMD_WIDTH;
        const __m512i pair_slots = FN(adjacent_k_pairs)(
            low + j0 + i0, high != NULL ? high + j0 + i0 : NULL, count - j0 - i0);
        _mm512_mask_storeu_epi32(out + i0, (__mmask16)((1u << stored) - 1), pair_slots);
      }
    }
  }
}

/* A `width`-row K-pair panel of `count` rows of src (row stride rs, column
 * stride cs), zero past count; dst as REAL slots (see above). Rows of unit
 * column stride are already slots in a row: 16 x 16 blocks of them go through
 * the float transpose, the odd pair at the end and other strides one slot at
 * a time; rows next to each other interleave a vector at a time. The blocks go
 * along K for 16 rows before the next 16 (as pack_k_major's do): 16 source
 * rows stream at a time, where K block by K block a 32-row panel had 32 in
 * flight and its loads waited on L3 (perf: the loads' successors held ~58% of
 * the pack's samples). 512 x 512 bfloat16 (pack harness, one thread, medians
 * of 41) 0.81x the time from L2, 0.81-0.86x from L3; in bench train_step's
 * forward with grad (the threads pack every weight just in time) the pack's
 * share of samples 4.9% -> 2.4%, and fused/eager 1.043 -> 0.964 (medians of
 * 5 processes each, builds alternating, Zen 4); bench bfloat16, 3 runs each,
 * alternating: gated_1024 0.99-1.03x eager -> 0.89-0.94x, large_gemm
 * 0.82-0.85x -> 0.77-0.82x, train_gated 0.94-0.99x -> 0.91-0.96x. */
static void FN(pack_k_pairs)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                             int64_t width, int64_t k, REAL *dst) {
  if (rs == 1 && cs != 1) {
    FN(pack_adjacent_k_pairs)(src, cs, count, width, 1, k, dst);
    return;
  }
  uint32_t *slots = (uint32_t *)dst;
  const int64_t pairs = (k + 1) / 2, whole_pairs = cs == 1 ? k / 2 : 0;
  const int64_t p_end = whole_pairs / FMLP_SIMD_WIDTH * FMLP_SIMD_WIDTH;
  for (int64_t i0 = 0; i0 < width; i0 += FMLP_SIMD_WIDTH) {
    const int64_t stored = width - i0 < FMLP_SIMD_WIDTH ? width - i0 : FMLP_SIMD_WIDTH;
    for (int64_t p0 = 0; p0 < p_end; p0 += FMLP_SIMD_WIDTH) {
      vreal block[FMLP_SIMD_WIDTH];
      for (int i = 0; i < FMLP_SIMD_WIDTH; ++i) {
        block[i] = i0 + i < count ? _mm512_castsi512_ps(_mm512_loadu_si512(
                                        src + (i0 + i) * rs + 2 * p0))
                                  : v_zero();
      }
      v_transpose(block);
      for (int t = 0; t < FMLP_SIMD_WIDTH; ++t) {
        v_store_first((float *)(slots + (p0 + t) * width + i0), block[t], stored);
      }
    }
  }
  for (int64_t p = p_end; p < pairs; ++p) {
    for (int64_t i = 0; i < width; ++i) {
      slots[p * width + i] = i < count ? FN(k_pair)(src + i * rs, cs, p, k) : 0;
    }
  }
}


/* Panels the adjacent pack reads a K-pair row of together: 4 of GEMM_NR
 * rows, 256 bytes of each source row. */
#define ADJACENT_PANELS 4

/* FMLP_PACK_WEIGHT_PANELS (gemm.h): `panels` GEMM_NR-row K-pair panels of
 * `count` rows of src (zero past count) one after another, ceil(k / 2) x
 * GEMM_NR slots each. Rows next to each other (the backward's transposed
 * weights) go ADJACENT_PANELS panels at a time, K-pair row by K-pair row:
 * a panel at a time, each K-pair row read a new line of two source rows
 * (2 KiB and more apart), which the hardware prefetchers follow poorly
 * (pack harness, both builds in one process, alternating, one thread's CPU
 * time, median of 11 rounds, loaded machine, same bytes: 512 x 512 0.72x the
 * time, 3072 x 768 0.73x, 768 x 3072 0.76x, 512 x 256 0.74x; 512 x 512 now
 * takes 17 us, a memcpy of its bytes 18.5). Other layouts panel by panel. */
static void FN(pack_k_pair_panels)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                                   int64_t panels, int64_t k, REAL *dst) {
  const int64_t panel_slots = (k + 1) / 2 * GEMM_NR;
  const int64_t group = rs == 1 && cs != 1 ? ADJACENT_PANELS : 1;
  for (int64_t first = 0; first < panels; first += group) {
    const int64_t here = panels - first < group ? panels - first : group;
    const STORE *from = src + first * GEMM_NR * rs;
    const int64_t left = count - first * GEMM_NR;
    REAL *to = dst + first * panel_slots;
    if (group > 1) {
      FN(pack_adjacent_k_pairs)(from, cs, left, GEMM_NR, here, k, to);
    } else {
      FN(pack_k_pairs)(from, rs, cs, left, GEMM_NR, k, to);
    }
  }
}
