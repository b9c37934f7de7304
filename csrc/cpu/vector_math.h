/* Vectorised activations for the SIMD float kernels (template over the
 * vreal operations of simd_<isa>.h, float only). Accuracy matches PyTorch's
 * own vectorised CPU code: exp is Cephes' expf (~1 ulp; without AVX-512's
 * vscalefps, from x = 88.37 to expf's overflow at 88.72 it returns
 * exp(88.37), up to 41% low, which only moves sigmoid-like results smaller
 * than 1e-36), erf is
 * Abramowitz-Stegun 7.1.26 with that exp (max abs error ~1.5e-7, like
 * PyTorch's Vectorized<float>::erf, and its operations); tanh-GELU goes
 * through sigmoid rather than tanh (see v_gelu_tanh). NaN propagates through
 * every function.
 *
 * Units whose storage is bfloat16 (STORE_ROUNDS_TO_BF16, set by
 * storage_bf16.h) round every result to 8 significant bits, so they take
 * cheaper forms whose error stays ~400 times inside half a bf16 ulp: exp's
 * polynomial is a degree-4 minimax one (max relative error 5.3e-6 instead of
 * ~1e-7), and erf-GELU is x Phi(x) with Phi(-|x|) = erfc(|x|/sqrt2)/2,
 * picked or subtracted from 1 by the sign of x: fewer operations than
 * 0.5 x (1 + erf) and no cancellation for negative x. That tail takes A-S's
 * t but a polynomial fitted for relative error (v_erfc_tail_poly). NaN,
 * +-inf and -0 come out as in the float units (tests/test_activation_bf16.py).
 * The float units keep the forms above. */
#include <math.h>

#include "fusedmlp/fusedmlp.h"

/* Past these, exp(x) is above float's largest value or below its smallest
 * normal one. */
#define EXP_OVERFLOWS_PAST 88.72283935546875f
#define EXP_UNDERFLOWS_BELOW -87.33654022216797f
/* v_exp_clamped's argument is at least this: 2^n stays a normal float */
#define EXP_CLAMP_BELOW -87.33f
/* 1.5 * 2^23 + 127. x log2e plus this, rounded once (a fused multiply-add),
 * is n + this for n the integer nearest the exact x log2e (|x log2e| < 2^22),
 * and its low mantissa bits are n + 127, 2^n's exponent field
 * (v_pow2_biased). Against rounding x log2e and converting n to an integer:
 * 2 operations (3 uops) fewer an exp on AVX2, 1 uop on AVX-512, and the
 * vector-extension units' 8-operation rounding gone. */
#define EXP_ROUNDING_SHIFT 12583039.0f

/* p 2^n = exp(x) for x already clamped to where 2^n is a float (or NaN):
 * v_one_plus_exp and v_exp_nonpositive differ only in the clamp and the
 * selects around this. */
static inline vreal FN(v_exp_clamped)(vreal clamped) {
  const vreal shifted =
      v_fma(clamped, v_set1(1.44269504088896341f), v_set1(EXP_ROUNDING_SHIFT));
  const vreal n = v_sub(shifted, v_set1(EXP_ROUNDING_SHIFT));
  /* r = x - n ln2, with ln2 split in two so that r is exact */
  vreal r = v_fma(n, v_set1(-0.693359375f), clamped);
  r = v_fma(n, v_set1(2.12194440e-4f), r);
  /* exp(r) = 1 + r + r^2 p(r) for |r| <= ln2 / 2 */
#if STORE_ROUNDS_TO_BF16
  vreal p = v_set1(4.127736762e-2f);
  p = v_fma(p, r, v_set1(1.675360203e-1f));
  p = v_fma(p, r, v_set1(5.000512600e-1f));
#else
  vreal p = v_set1(1.9875691500e-4f);
  p = v_fma(p, r, v_set1(1.3981999507e-3f));
  p = v_fma(p, r, v_set1(8.3334519073e-3f));
  p = v_fma(p, r, v_set1(4.1665795894e-2f));
  p = v_fma(p, r, v_set1(1.6666665459e-1f));
  p = v_fma(p, r, v_set1(5.0000001201e-1f));
#endif
  p = v_fma(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
#if FMLP_SIMD_HAS_SCALE_POW2
  return v_scale_pow2(p, n);
#else
  return v_mul(p, v_pow2_biased(shifted));
#endif
}

/* exp(x) for the sigmoid forms (GELU(tanh), SiLU): past float's range it
 * overflows to inf, as expf does; below exp's underflow x is clamped, not
 * selected to 0: 1 + exp(-87.33) is 1, as 1 + 0 is (a compare and a blend
 * fewer). */
static inline vreal FN(v_exp_or_inf)(vreal x) {
  /* NaN stays NaN: x is the second operand of max/min. Where the SIMD header
   * scales by 2^n in one instruction (v_scale_pow2: AVX-512's vscalefps), x
   * is clamped past the overflow, which that scaling turns into inf: 2 to 5
   * operations fewer than 2^n built from its bits (v_pow2_int, n at most 127)
   * and a select; the GELU(tanh) epilogue of the AMX unit ran 30% faster with
   * this and the folded argument of v_gelu_tanh (a 32 x 32 tile in L1, one
   * thread's CPU time, min of 30, loaded machine: 399-411 ns against
   * 568-583), and exp from 88.37 to its overflow is no longer exp(88.37). */
#if FMLP_SIMD_HAS_SCALE_POW2
  return FN(v_exp_clamped)(v_min(v_set1(89.0f), v_max(v_set1(EXP_CLAMP_BELOW), x)));
#else
  const vreal clamped = v_min(v_set1(88.37f), v_max(v_set1(EXP_CLAMP_BELOW), x));
  return v_select_greater(x, v_set1(EXP_OVERFLOWS_PAST), v_set1(INFINITY),
                          FN(v_exp_clamped)(clamped));
#endif
}

/* 1 + exp(x), the denominator of the sigmoid forms */
static inline vreal FN(v_one_plus_exp)(vreal x) {
  return v_add(v_set1(1.0f), FN(v_exp_or_inf)(x));
}

/* exp(x) for x <= 0 or NaN (the normal density, exp(-2|u|) in the GELU(tanh)
 * slope): no overflow to clamp or select; below float's smallest normal it
 * is 0, as expf's underflow. */
static inline vreal FN(v_exp_nonpositive)(vreal x) {
  return v_select_greater(v_set1(EXP_UNDERFLOWS_BELOW), x, v_zero(),
                          FN(v_exp_clamped)(v_max(v_set1(EXP_CLAMP_BELOW), x)));
}

/* A-S 7.1.26: erfc(a) = t p(t) exp(-a^2) for a >= 0, with t from
 * v_erfc_t(a) and p(t) from v_erfc_poly. */
static inline vreal FN(v_erfc_t)(vreal a) {
  const vreal one = v_set1(1.0f);
  return v_div(one, v_fma(v_set1(0.3275911f), a, one));
}
static inline vreal FN(v_erfc_poly)(vreal t) {
  vreal r = v_set1(1.061405429f);
  r = v_fma(r, t, v_set1(-1.453152027f));
  r = v_fma(r, t, v_set1(1.421413741f));
  r = v_fma(r, t, v_set1(-0.284496736f));
  return v_fma(r, t, v_set1(0.254829592f));
}

/* erf(x) = 1 - erfc(|x|) with x's sign from e = exp(-x^2), in PyTorch's
 * operations: the ending 1 - p(t) (t e) rounds once, x's sign goes on by an
 * xor. */
static inline vreal FN(v_erf_given_exp)(vreal x, vreal e) {
  const vreal t = FN(v_erfc_t)(v_abs(x));
  return v_flip_sign(v_fnma(FN(v_erfc_poly)(t), v_mul(t, e), v_set1(1.0f)), x);
}

/* exp(-x^2) skips the underflow select: for |x| > 9.34 it is exp(-87.33)
 * ~ 1.2e-38 instead of 0, and 1 - erfc is 1 either way. */
static inline vreal FN(v_erf)(vreal x) {
  const vreal minus_x2 = v_fnma(x, x, v_zero());
  return FN(v_erf_given_exp)(x, FN(v_exp_clamped)(v_max(v_set1(EXP_CLAMP_BELOW), minus_x2)));
}
/* The same formulas as the scalar activate_row (activation.h) and PyTorch,
 * so NaN and +-inf come out the same. */
static inline vreal FN(v_relu)(vreal v) {
  return v_max(v_zero(), v); /* NaN is the second operand: it propagates */
}

#if STORE_ROUNDS_TO_BF16
/* erfc(a) = t q(t) exp(-a^2) for a >= 0 and t from v_erfc_t(a), with q of
 * degree 7 fitted for the least relative error over a in [0, 9.5]
 * (scripts/fit_erfc_tail.py): at most 1.8e-7, where A-S's p(t), fitted for
 * absolute error, is 9e-4 off at a = 3.2 and 4% at 9.5, whole bfloat16 ulps
 * of a tail that eager's GELU (ATen's AVX2 code) rounds right: GELU(-4.47)
 * rounded the other way (tests/test_activation_bf16.py on an AVX2-only AMD
 * Zen 3). Returns q(t) scale. */
static inline vreal FN(v_erfc_tail_poly)(vreal t, float scale) {
  static const float q[] = {1.850621998e-01f, 1.805943847e-01f, 2.067081183e-01f,
                            2.278902195e-02f, 4.581696093e-01f, -4.112206101e-01f,
                            4.997600615e-01f, -1.418626606e-01f};
  vreal r = v_set1(q[7] * scale);
  for (int i = 6; i >= 0; --i) r = v_fma(r, t, v_set1(q[i] * scale));
  return r;
}

/* exp(x) for x <= 0 or NaN down into float's subnormals, where
 * v_exp_nonpositive gives 0: exp(x + 24 ln2) 2^-24 (the shifted argument
 * stays far below the overflow). The normal tail needs them: GELU's slope
 * z phi(z) at z = -13.25 is a normal float while exp(-z^2 / 2) is not, and
 * came out 0, 217 bfloat16 ulps off; GELU(z) itself is a bfloat16 subnormal
 * down to z = -13.6. */
static inline vreal FN(v_exp_nonpositive_gradual)(vreal x) {
  const vreal shifted = v_add(x, v_set1(16.635532333438687f));
  return v_mul(FN(v_exp_nonpositive)(shifted), v_set1(0x1p-24f));
}

/* Phi(z), the standard normal's CDF, and (*e) exp(-z^2 / 2), the normal
 * density's exp, which it takes from the tail Phi(-|z|) = erfc(|z| / sqrt2)
 * / 2, kept or subtracted from 1 by the sign of z: 0.5 (1 + erf) cancels for
 * negative z (Phi(-5.7) comes out 6.5 bfloat16 ulps off in GELU's slope),
 * the tail does not. */
static inline vreal FN(v_normal_cdf_and_exp)(vreal z, vreal *e) {
  const vreal a = v_abs(v_mul(z, v_set1(0.70710678118654752f)));
  const vreal t = FN(v_erfc_t)(a);
  *e = FN(v_exp_nonpositive_gradual)(v_sub(v_zero(), v_mul(a, a)));
  const vreal tail = v_mul(v_mul(FN(v_erfc_tail_poly)(t, 0.5f), t), *e);
  return v_select_greater(z, v_zero(), v_sub(v_set1(1.0f), tail), tail);
}
#endif

static inline vreal FN(v_gelu)(vreal v) {
#if STORE_ROUNDS_TO_BF16
  vreal unused;
  return v_mul(v, FN(v_normal_cdf_and_exp)(v, &unused));
#else /* PyTorch's order of operations */
  const vreal cdf_doubled = v_add(v_set1(1.0f), FN(v_erf)(v_mul(v, v_set1(0.70710678118654752f))));
  return v_mul(v_mul(v_set1(0.5f), v), cdf_doubled);
#endif
}

/* -2u for GELU(tanh)'s u = c (z + kappa z^3): v (-2c - 2c kappa v^2), its
 * constants folded (3 operations, not 6), and no z^3 to overflow. */
static inline vreal FN(v_gelu_tanh_minus_2u)(vreal v) {
  return v_mul(v, v_fma(v_mul(v, v), v_set1(-2.0f * 0.79788456080286535588f * 0.044715f),
                        v_set1(-2.0f * 0.79788456080286535588f)));
}

/* 0.5 z (1 + tanh(u)) as z sigmoid(2u): the same value without 1 + tanh(u)
 * cancelling for negative z (max relative error 3.0e-4 -> 1.1e-6), and
 * the same NaN / -0 where z^3 overflows or z is infinite. */
static inline vreal FN(v_gelu_tanh)(vreal v) {
  return v_div(v, FN(v_one_plus_exp)(FN(v_gelu_tanh_minus_2u)(v)));
}

/* v / (1 + exp(-v)), as PyTorch's vectorised SiLU */
static inline vreal FN(v_silu)(vreal v) {
  return v_div(v, FN(v_one_plus_exp)(v_sub(v_zero(), v)));
}

/* Applies an activation to `count` vectors in place; the switch sits outside
 * the loop so each case is a straight run of vector code. */
static inline __attribute__((always_inline)) void FN(activate_vectors)(
    vreal *v, int count, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) v[i] = FN(v_relu)(v[i]);
      return;
    case FMLP_ACT_GELU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) v[i] = FN(v_gelu)(v[i]);
      return;
    case FMLP_ACT_GELU_TANH:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) v[i] = FN(v_gelu_tanh)(v[i]);
      return;
    case FMLP_ACT_SILU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) v[i] = FN(v_silu)(v[i]);
      return;
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT:
      return;
  }
}

/* Vectors activate_span activates at a time: independent chains that the
 * core overlaps, where a vector at a time left the pass waiting on one
 * chain's latency (exact GELU, 64 Ki floats, one thread, loaded machine,
 * alternating in one process, medians of 41 rounds: 4 at a time 0.857x the
 * time of 1 on AVX2, 0.963x on AVX-512, same bits). */
#define ACTIVATE_SPAN_VECTORS 4
/* The same for the backward's spans (activation_grad_span, the gated
 * backward's gated_grads_span) */
#define GRAD_SPAN_VECTORS 4

/* v[0, n) = act(v[0, n)), ACTIVATE_SPAN_VECTORS vectors at a time, then one;
 * the tail is masked, never read or written past n. */
static void FN(activate_span)(REAL *v, int64_t n, fmlp_activation activation) {
  if (activation == FMLP_ACT_NONE) return;
  const int64_t step = ACTIVATE_SPAN_VECTORS * FMLP_SIMD_WIDTH;
  int64_t i = 0;
  for (; i + step <= n; i += step) {
    vreal chunk[ACTIVATE_SPAN_VECTORS];
    for (int j = 0; j < ACTIVATE_SPAN_VECTORS; ++j) chunk[j] = v_load(v + i + j * FMLP_SIMD_WIDTH);
    FN(activate_vectors)(chunk, ACTIVATE_SPAN_VECTORS, activation);
    for (int j = 0; j < ACTIVATE_SPAN_VECTORS; ++j) v_store(v + i + j * FMLP_SIMD_WIDTH, chunk[j]);
  }
  for (; i + FMLP_SIMD_WIDTH <= n; i += FMLP_SIMD_WIDTH) {
    vreal chunk = v_load(v + i);
    FN(activate_vectors)(&chunk, 1, activation);
    v_store(v + i, chunk);
  }
  if (i < n) {
    vreal tail = v_load_first(v + i, n - i);
    FN(activate_vectors)(&tail, 1, activation);
    v_store_first(v + i, tail, n - i);
  }
}

/* ---- slopes: each act'(z) with act(z) (*act) from the same exp and
 * denominator, *act in the bits the forward's v_<act> gives (the gated
 * backward's grad_up takes both; where *act goes unused the compiler drops
 * what only it needed). The formulas are the scalar activation_grad_row's
 * (activation.h) and PyTorch's, so NaN and +-inf come out as theirs. ---- */

/* Phi(z) + z phi(z), the normal density phi from the exp inside Phi's erf /
 * erfc: exp(-(z / sqrt2)^2) for exp(-z^2 / 2), one exp where two were. */
static inline vreal FN(v_gelu_and_grad)(vreal z, vreal *act) {
  vreal e, cdf;
#if STORE_ROUNDS_TO_BF16
  cdf = FN(v_normal_cdf_and_exp)(z, &e);
  *act = v_mul(z, cdf);
#else
  const vreal x = v_mul(z, v_set1(0.70710678118654752f));
  /* with the underflow select, unlike v_erf's exp: phi(+-inf) is 0 and the
   * slope at an infinite z NaN, as PyTorch's; erf's 1 - t p e is 1 either way */
  e = FN(v_exp_nonpositive)(v_fnma(x, x, v_zero()));
  const vreal cdf_doubled = v_add(v_set1(1.0f), FN(v_erf_given_exp)(x, e));
  *act = v_mul(v_mul(v_set1(0.5f), z), cdf_doubled);
  cdf = v_mul(v_set1(0.5f), cdf_doubled);
#endif
  return v_fma(z, v_mul(v_set1(0.39894228040143267794f), e), cdf);
}

/* 0.5 (1 + t) + 0.5 z (1 - t^2) u' for t = tanh(u), written with
 * h = 0.5 (1 + t) = sigmoid(2u) = 1 / d and r = 1 - h = sigmoid(-2u), from
 * the forward's e = exp(-2u) and d = 1 + e, as h + 2 z h r u': r is e h for
 * u >= 0 (e <= 1) and 1 - h for u < 0 (h <= 1/2), so 1 + t and
 * 1 - t^2 = 4 h r never cancel (|t| near 1) and e = inf (u < -44) gives no
 * inf * 0. e is 0 past its underflow, so an infinite z, or one whose z^2
 * overflows, gives NaN as torch's gelu_backward does. */
static inline vreal FN(v_gelu_tanh_and_grad)(vreal z, vreal *act) {
  const vreal one = v_set1(1.0f);
  const vreal minus_2u = FN(v_gelu_tanh_minus_2u)(z);
  const vreal e = FN(v_exp_or_inf)(minus_2u);
  const vreal d = v_add(one, e);
  *act = v_div(z, d);
  const vreal h = v_div(one, d);
  const vreal e_or_0 = v_select_greater(v_set1(EXP_UNDERFLOWS_BELOW), minus_2u, v_zero(), e);
  const vreal r = v_select_greater(minus_2u, v_zero(), v_sub(one, h), v_mul(e_or_0, h));
  const vreal du =
      v_mul(v_set1(0.79788456080286535588f), v_fma(v_set1(3 * 0.044715f), v_mul(z, z), one));
  return v_fma(v_mul(v_add(z, z), v_mul(h, r)), du, h);
}

/* s (1 + z (1 - s)) for s = sigmoid(z) = 1 / d, d the forward's 1 + exp(-z) */
static inline vreal FN(v_silu_and_grad)(vreal z, vreal *act) {
  const vreal one = v_set1(1.0f);
  const vreal d = FN(v_one_plus_exp)(v_sub(v_zero(), z));
  *act = v_div(z, d);
  const vreal s = v_div(one, d);
  return v_mul(s, v_fma(z, v_sub(one, s), one));
}

/* grad[i] *= act'(pre[i]) over count vectors, and act[i] = act(pre[i]) where
 * act is not NULL (a constant after inlining); the switch sits outside the
 * loops, as in activate_vectors. ReLU's slope is a select, as torch's
 * threshold_backward: a NaN pre-activation passes the gradient. */
static inline __attribute__((always_inline)) void FN(activation_grad_vectors)(
    vreal *grad, const vreal *pre, vreal *act, int count, fmlp_activation activation) {
  vreal value[GRAD_SPAN_VECTORS];
  switch (activation) {
    case FMLP_ACT_RELU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) {
        value[i] = FN(v_relu)(pre[i]);
        grad[i] = v_select_less_equal(pre[i], v_zero(), v_zero(), grad[i]);
      }
      break;
    case FMLP_ACT_GELU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) grad[i] = v_mul(grad[i], FN(v_gelu_and_grad)(pre[i], &value[i]));
      break;
    case FMLP_ACT_GELU_TANH:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) {
        grad[i] = v_mul(grad[i], FN(v_gelu_tanh_and_grad)(pre[i], &value[i]));
      }
      break;
    case FMLP_ACT_SILU:
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) grad[i] = v_mul(grad[i], FN(v_silu_and_grad)(pre[i], &value[i]));
      break;
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT:
    default: /* the API checked activation: the default tells GCC value is always set */
#pragma GCC unroll 64
      for (int i = 0; i < count; ++i) value[i] = pre[i];
      break;
  }
  if (act != NULL) {
#pragma GCC unroll 64
    for (int i = 0; i < count; ++i) act[i] = value[i];
  }
}

/* out[0, n) = grad * act'(pre) over storage, GRAD_SPAN_VECTORS vectors at a
 * time in REAL, then one; the tail is masked. out may be grad. */
static void FN(activation_grad_span)(STORE *out, const STORE *grad, const STORE *pre, int64_t n,
                                     fmlp_activation activation) {
  const int64_t step = GRAD_SPAN_VECTORS * FMLP_SIMD_WIDTH;
  int64_t i = 0;
  for (; i + step <= n; i += step) {
    vreal g[GRAD_SPAN_VECTORS], z[GRAD_SPAN_VECTORS];
    for (int j = 0; j < GRAD_SPAN_VECTORS; ++j) {
      g[j] = vs_load(grad + i + j * FMLP_SIMD_WIDTH);
      z[j] = vs_load(pre + i + j * FMLP_SIMD_WIDTH);
    }
    FN(activation_grad_vectors)(g, z, NULL, GRAD_SPAN_VECTORS, activation);
    for (int j = 0; j < GRAD_SPAN_VECTORS; ++j) vs_store(out + i + j * FMLP_SIMD_WIDTH, g[j]);
  }
  for (; i + FMLP_SIMD_WIDTH <= n; i += FMLP_SIMD_WIDTH) {
    vreal g = vs_load(grad + i);
    const vreal z = vs_load(pre + i);
    FN(activation_grad_vectors)(&g, &z, NULL, 1, activation);
    vs_store(out + i, g);
  }
  if (i < n) {
    vreal g = vs_load_first(grad + i, n - i);
    const vreal z = vs_load_first(pre + i, n - i);
    FN(activation_grad_vectors)(&g, &z, NULL, 1, activation);
    vs_store_first(out + i, g, n - i);
  }
}
