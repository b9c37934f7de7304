/* The vector operations the float kernels are written in, for AVX-512
 * (16 floats a register). Included by the AVX-512 translation unit only,
 * which is compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma. */
#ifndef FUSEDMLP_CPU_SIMD_AVX512_H
#define FUSEDMLP_CPU_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define FMLP_SIMD_WIDTH 16
#define FMLP_SIMD_REGISTERS 32

typedef __m512 vreal;
typedef __mmask16 vmask;

static inline vreal v_zero(void) { return _mm512_setzero_ps(); }
static inline vreal v_set1(float x) { return _mm512_set1_ps(x); }
static inline vreal v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vreal v) { _mm512_storeu_ps(p, v); }
/* The first n (0..16) lanes; the rest are zero and never touched in memory. */
static inline vmask v_first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}
static inline vreal v_load_first(const float *p, int64_t n) {
  return _mm512_maskz_loadu_ps(v_first_lanes(n), p);
}
static inline void v_store_first(float *p, vreal v, int64_t n) {
  _mm512_mask_storeu_ps(p, v_first_lanes(n), v);
}
static inline vreal v_add(vreal a, vreal b) { return _mm512_add_ps(a, b); }
static inline vreal v_sub(vreal a, vreal b) { return _mm512_sub_ps(a, b); }
static inline vreal v_mul(vreal a, vreal b) { return _mm512_mul_ps(a, b); }
static inline vreal v_div(vreal a, vreal b) { return _mm512_div_ps(a, b); }
static inline vreal v_fma(vreal a, vreal b, vreal c) { return _mm512_fmadd_ps(a, b, c); }
/* c - a * b, rounded once */
static inline vreal v_fnma(vreal a, vreal b, vreal c) { return _mm512_fnmadd_ps(a, b, c); }
/* max/min return their second operand when either is NaN: pass the value
 * that must keep its NaN second. */
static inline vreal v_max(vreal a, vreal b) { return _mm512_max_ps(a, b); }
static inline vreal v_min(vreal a, vreal b) { return _mm512_min_ps(a, b); }
static inline vreal v_abs(vreal a) { return _mm512_abs_ps(a); }
/* v with its sign flipped where sign_of's sign bit is set (-0 and NaN included) */
static inline vreal v_flip_sign(vreal v, vreal sign_of) {
  const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
  return _mm512_castsi512_ps(_mm512_xor_si512(
      _mm512_castps_si512(v), _mm512_and_si512(sign_bit, _mm512_castps_si512(sign_of))));
}
/* p 2^n for integral n, in one rounding (vscalefps): past float's range it
 * overflows to inf or underflows through the subnormals to 0. */
#define FMLP_SIMD_HAS_SCALE_POW2 1
static inline vreal v_scale_pow2(vreal p, vreal n) { return _mm512_scalef_ps(p, n); }
/* where a > b (false for NaN): if_true, else otherwise. */
static inline vreal v_select_greater(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), otherwise, if_true);
}
/* a <= b, false where either is NaN */
static inline vreal v_select_less_equal(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), otherwise, if_true);
}

/* bfloat16 (its 16 bits, as bf16.h stores it) to float and back, 16 at a
 * time, for the units with bfloat16 storage: widening is exact, narrowing
 * rounds to nearest even and turns NaN into 0x7FC0, as bf16.h does. */
static inline vreal v_from_bf16_bits(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* v's bits rounded to the nearest bfloat16 (ties to even): the upper halves. */
static inline __m512i v_rounded_bf16_bits(vreal v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC00000));
}
static inline __m256i v_bf16_bits(vreal v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v_rounded_bf16_bits(v), 16));
}
static inline vreal v_load_bf16(const uint16_t *p) {
  return v_from_bf16_bits(_mm256_loadu_si256((const __m256i *)p));
}
static inline vreal v_load_first_bf16(const uint16_t *p, int64_t n) {
  return v_from_bf16_bits(_mm256_maskz_loadu_epi16(v_first_lanes(n), p));
}
static inline void v_store_bf16(uint16_t *p, vreal v) {
  _mm256_storeu_si256((__m256i *)p, v_bf16_bits(v));
}
static inline void v_store_first_bf16(uint16_t *p, vreal v, int64_t n) {
  _mm256_mask_storeu_epi16(p, v_first_lanes(n), v_bf16_bits(v));
}
/* v rounded as a bfloat16 store would, kept as float */
static inline vreal v_round_bf16(vreal v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(v_rounded_bf16_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline float v_sum(vreal a) { return _mm512_reduce_add_ps(a); }

/* r[i][j] = r[j][i] for a 16 x 16 block held as 16 rows: unpacks within
 * 128-bit lanes, then 128-bit lane shuffles across registers. */
static inline void v_transpose(vreal r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

#endif /* FUSEDMLP_CPU_SIMD_AVX512_H */
