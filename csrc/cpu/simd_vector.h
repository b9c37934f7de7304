/* The vector operations the float kernels are written in, for any CPU: GCC /
 * Clang vector extensions, 128 bits (4 floats) a vector, which the compiler
 * turns into NEON on aarch64, SSE2 on x86-64 and plain code where the target
 * has no vectors. Included by the vector-extension units (kernels_f32_portable.c,
 * kernels_bf16_portable.c,
 * kernels_f32_neon.c), which are built without ISA flags.
 *
 * The unit defines FMLP_VECTOR_REGISTERS first: the vector registers of the
 * CPU it is tiled for (16 on x86-64, 32 on aarch64), which the compiler
 * cannot tell us when the same source is built for another target.
 * FMLP_VECTOR_BYTES (16 unless defined) is the vector size: 32 builds the
 * same source for 256-bit vectors, as the speed proxy against the AVX2
 * kernels does (scripts/vector_proxy.py). */
#ifndef FUSEDMLP_CPU_SIMD_VECTOR_H
#define FUSEDMLP_CPU_SIMD_VECTOR_H

#include <stdint.h>
#include <string.h>
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
#include <arm_neon.h>
#endif

#ifndef FMLP_VECTOR_REGISTERS
#error "a vector-extension unit defines FMLP_VECTOR_REGISTERS (its target's vector registers)"
#endif
#ifndef FMLP_VECTOR_BYTES
#define FMLP_VECTOR_BYTES 16
#endif
#if FMLP_VECTOR_BYTES != 16 && FMLP_VECTOR_BYTES != 32
#error "FMLP_VECTOR_BYTES is 16 or 32 (v_transpose has those two)"
#endif
#define FMLP_SIMD_WIDTH (FMLP_VECTOR_BYTES / 4)
#define FMLP_SIMD_REGISTERS FMLP_VECTOR_REGISTERS

typedef float vreal __attribute__((vector_size(FMLP_VECTOR_BYTES)));
/* lanes all ones or all zeros */
typedef int32_t vmask __attribute__((vector_size(FMLP_VECTOR_BYTES)));

static inline vreal v_zero(void) { return (vreal){0.0f}; }
/* spelled out: a loop over the lanes went through the stack (GCC 12) */
static inline vreal v_set1(float x) {
#if FMLP_SIMD_WIDTH == 8
  return (vreal){x, x, x, x, x, x, x, x};
#else
  return (vreal){x, x, x, x};
#endif
}
/* memcpy: unaligned, and no aliasing question; compilers emit one load. */
static inline vreal v_load(const float *p) {
  vreal v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void v_store(float *p, vreal v) { memcpy(p, &v, sizeof v); }
/* The first n (0..4) lanes, the rest zero; nothing past n is read. */
static inline vreal v_load_first(const float *p, int64_t n) {
  if (n >= FMLP_SIMD_WIDTH) return v_load(p); /* whole tiles: one load, not a lane loop */
  vreal v = v_zero();
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
static inline void v_store_first(float *p, vreal v, int64_t n) {
  if (n >= FMLP_SIMD_WIDTH) {
    v_store(p, v);
    return;
  }
  for (int64_t i = 0; i < n; ++i) p[i] = v[i];
}
static inline vreal v_add(vreal a, vreal b) { return a + b; }
static inline vreal v_sub(vreal a, vreal b) { return a - b; }
static inline vreal v_mul(vreal a, vreal b) { return a * b; }
static inline vreal v_div(vreal a, vreal b) { return a / b; }
/* a * b + c: NEON's fused multiply-add where the target has it (the C11
 * build does not contract a * b + c by itself), else a multiply and an add. */
static inline vreal v_fma(vreal a, vreal b, vreal c) {
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
  return vfmaq_f32(c, a, b);
#else
  return a * b + c;
#endif
}
/* c - a * b: fused where v_fma is */
static inline vreal v_fnma(vreal a, vreal b, vreal c) {
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
  return vfmsq_f32(c, a, b);
#else
  return c - a * b;
#endif
}

/* Bitwise view of the lanes, for selects and sign tricks. */
static inline vmask v_bits(vreal a) { return (vmask)a; }
static inline vreal v_from_bits(vmask m) { return (vreal)m; }
/* where mask: if_true, else otherwise */
static inline vreal v_select(vmask mask, vreal if_true, vreal otherwise) {
  return v_from_bits((mask & v_bits(if_true)) | (~mask & v_bits(otherwise)));
}
/* max/min return their second operand when either is NaN (ordered compares
 * are false): pass the value that must keep its NaN second. */
static inline vreal v_max(vreal a, vreal b) { return v_select(a > b, a, b); }
static inline vreal v_min(vreal a, vreal b) { return v_select(a < b, a, b); }
static inline vreal v_abs(vreal a) { return v_from_bits(v_bits(a) & 0x7fffffff); }
/* v with its sign flipped where sign_of's sign bit is set (-0 and NaN included) */
static inline vreal v_flip_sign(vreal v, vreal sign_of) {
  return v_from_bits(v_bits(v) ^ (v_bits(sign_of) & INT32_MIN));
}
/* 2^n as a float from `biased`, a float in [2^23, 2^24) whose low mantissa
 * bits hold n + 127 (n integral in [-126, 127]): those bits shifted into the
 * exponent field, the rest out of the word (unsigned: no signed overflow). */
static inline vreal v_pow2_biased(vreal biased) {
  typedef uint32_t vword __attribute__((vector_size(FMLP_VECTOR_BYTES)));
  return (vreal)((vword)biased << 23);
}
/* where a > b (false for NaN): if_true, else otherwise. */
static inline vreal v_select_greater(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return v_select(a > b, if_true, otherwise);
}
/* a <= b, false where either is NaN */
static inline vreal v_select_less_equal(vreal a, vreal b, vreal if_true, vreal otherwise) {
  return v_select(a <= b, if_true, otherwise);
}

/* bfloat16 (its 16 bits, as bf16.h stores it) to float and back, a vector
 * at a time, for the units with bfloat16 storage: widening is exact,
 * narrowing rounds to nearest even and turns NaN into 0x7FC0, as bf16.h
 * does. The first n go through a small buffer. */
typedef uint16_t vbf16 __attribute__((vector_size(FMLP_VECTOR_BYTES / 2)));
typedef uint32_t vbits __attribute__((vector_size(FMLP_VECTOR_BYTES)));
static inline vreal v_load_bf16(const uint16_t *p) {
  vbf16 h;
  memcpy(&h, p, sizeof h);
  return (vreal)(__builtin_convertvector(h, vbits) << 16);
}
/* v's bits rounded to the nearest bfloat16 (ties to even): the upper halves. */
static inline vbits v_rounded_bf16_bits(vreal v) {
  const vbits bits = (vbits)v;
  const vbits rounded = bits + (((bits >> 16) & 1u) + 0x7FFFu);
  const vbits number = (vbits)(v == v); /* all ones where v is not NaN */
  return (rounded & number) | (0x7FC00000u & ~number);
}
static inline void v_store_bf16(uint16_t *p, vreal v) {
  const vbf16 h = __builtin_convertvector(v_rounded_bf16_bits(v) >> 16, vbf16);
  memcpy(p, &h, sizeof h);
}
static inline vreal v_load_first_bf16(const uint16_t *p, int64_t n) {
  uint16_t lanes[FMLP_SIMD_WIDTH] = {0};
  memcpy(lanes, p, (size_t)(n < FMLP_SIMD_WIDTH ? n : FMLP_SIMD_WIDTH) * sizeof(uint16_t));
  return v_load_bf16(lanes);
}
static inline void v_store_first_bf16(uint16_t *p, vreal v, int64_t n) {
  uint16_t lanes[FMLP_SIMD_WIDTH];
  v_store_bf16(lanes, v);
  memcpy(p, lanes, (size_t)(n < FMLP_SIMD_WIDTH ? n : FMLP_SIMD_WIDTH) * sizeof(uint16_t));
}
/* v rounded as a bfloat16 store would, kept as float */
static inline vreal v_round_bf16(vreal v) { return (vreal)(v_rounded_bf16_bits(v) & 0xFFFF0000u); }

static inline float v_sum(vreal a) {
#if FMLP_SIMD_WIDTH == 8
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
#else
  return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

#if FMLP_SIMD_WIDTH == 8
/* r[i][j] = r[j][i] for an 8 x 8 block held as 8 rows: pairs of rows
 * interleaved, then pairs of pairs, then halves. */
static inline void v_transpose(vreal r[8]) {
  vreal t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      const vreal a = t[4 * i + j], b = t[4 * i + j + 2];
      u[4 * i + 2 * j] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * i + 2 * j + 1] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = __builtin_shufflevector(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[c + 4] = __builtin_shufflevector(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}
#else
/* r[i][j] = r[j][i] for a 4 x 4 block held as 4 rows. */
static inline void v_transpose(vreal r[4]) {
  const vreal t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
  const vreal t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
  const vreal t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
  const vreal t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
  r[0] = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
  r[1] = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
  r[2] = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
  r[3] = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
}
#endif

#endif /* FUSEDMLP_CPU_SIMD_VECTOR_H */
