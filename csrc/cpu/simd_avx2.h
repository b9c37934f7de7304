/* The vector operations the float kernels are written in, for AVX2 + FMA
 * (8 floats a register). Included by the AVX2 translation unit only, which is
 * compiled with -mavx2 -mfma. */
#ifndef FUSEDMLP_CPU_SIMD_AVX2_H
#define FUSEDMLP_CPU_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define FMLP_SIMD_WIDTH 8
#define FMLP_SIMD_REGISTERS 16

typedef __m256 vreal;
typedef __m256i vmask;

static inline vreal v_zero(void) { return _mm256_setzero_ps(); }
static inline vreal v_set1(float x) { return _mm256_set1_ps(x); }
static inline vreal v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vreal v) { _mm256_storeu_ps(p, v); }
/* The first n (0..8) lanes; masked lanes are never touched in memory. */
static inline vmask v_first_lanes(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), lane);
}
static inline vreal v_load_first(const float *p, int64_t n) {
  return _mm256_maskload_ps(p, v_first_lanes(n));
}
/* A whole vector takes a plain store: AMD's Zen 2 and 3 run vmaskmovps to
 * memory as microcode, about a dozen cycles each, and the weight panels'
 * packing stores whole vectors through this nearly always. */
static inline void v_store_first(float *p, vreal v, int64_t n) {
  if (n >= FMLP_SIMD_WIDTH) {
    _mm256_storeu_ps(p, v);
    return;
  }
  _mm256_maskstore_ps(p, v_first_lanes(n), v);
}
static inline vreal v_add(vreal a, vreal b) { return _mm256_add_ps(a, b); }
static inline vreal v_sub(vreal a, vreal b) { return _mm256_sub_ps(a, b); }
static inline vreal v_mul(vreal a, vreal b) { return _mm256_mul_ps(a, b); }
static inline vreal v_div(vreal a, vreal b) { return _mm256_div_ps(a, b); }
static inline vreal v_fma(vreal a, vreal b, vreal c) { return _mm256_fmadd_ps(a, b, c); }
/* c - a * b, rounded once */
static inline vreal v_fnma(vreal a, vreal b, vreal c) { return _mm256_fnmadd_ps(a, b, c); }
/* max/min return their second operand when either is NaN: pass the value
 * that must keep its NaN second. */
static inline vreal v_max(vreal a, vreal b) { return _mm256_max_ps(a, b); }
static inline vreal v_min(vreal a, vreal b) { return _mm256_min_ps(a, b); }
static inline vreal v_abs(vreal a) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
}
/* v with its sign flipped where sign_of's sign bit is set (-0 and NaN included) */
static inline vreal v_flip_sign(vreal v, vreal sign_of) {
  return _mm256_xor_ps(v, _mm256_and_ps(_mm256_set1_ps(-0.0f), sign_of));
}
/* 2^n as a float from `biased`, a float in [2^23, 2^24) whose low mantissa
 * bits hold n + 127 (n integral in [-126, 127]): those bits shifted into the
 * exponent field, the rest out of the word. */
static inline vreal v_pow2_biased(vreal biased) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(biased), 23));
}
/* where a > b (false for NaN): if_true, else otherwise. */
static inline vreal v_select_greater(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return _mm256_blendv_ps(otherwise, if_true, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
/* a <= b, false where either is NaN */
static inline vreal v_select_less_equal(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return _mm256_blendv_ps(otherwise, if_true, _mm256_cmp_ps(a, b, _CMP_LE_OQ));
}

/* bfloat16 (its 16 bits, as bf16.h stores it) to float and back, 8 at a time,
 * for the units with bfloat16 storage: widening is exact, narrowing rounds to
 * nearest even and turns NaN into 0x7FC0, as bf16.h does. AVX2 has no 16-bit
 * masked loads and stores: the first n go through a small buffer. */
static inline vreal v_from_bf16_bits(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* v's bits rounded to the nearest bfloat16 (ties to even): the upper halves. */
static inline __m256i v_rounded_bf16_bits(vreal v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
}
static inline __m128i v_bf16_bits(vreal v) {
  const __m256i high = _mm256_srli_epi32(v_rounded_bf16_bits(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}
static inline vreal v_load_bf16(const uint16_t *p) {
  return v_from_bf16_bits(_mm_loadu_si128((const __m128i *)p));
}
static inline vreal v_load_first_bf16(const uint16_t *p, int64_t n) {
  uint16_t lanes[8] = {0};
  memcpy(lanes, p, (size_t)(n < 8 ? n : 8) * sizeof(uint16_t));
  return v_load_bf16(lanes);
}
static inline void v_store_bf16(uint16_t *p, vreal v) {
  _mm_storeu_si128((__m128i *)p, v_bf16_bits(v));
}
static inline void v_store_first_bf16(uint16_t *p, vreal v, int64_t n) {
  uint16_t lanes[8];
  v_store_bf16(lanes, v);
  memcpy(p, lanes, (size_t)(n < 8 ? n : 8) * sizeof(uint16_t));
}
/* v rounded as a bfloat16 store would, kept as float */
static inline vreal v_round_bf16(vreal v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(v_rounded_bf16_bits(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline float v_sum(vreal a) {
  __m128 quad = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  quad = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  quad = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 0x55));
  return _mm_cvtss_f32(quad);
}

/* r[i][j] = r[j][i] for an 8 x 8 block held as 8 rows. */
static inline void v_transpose(vreal r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

#endif /* FUSEDMLP_CPU_SIMD_AVX2_H */
