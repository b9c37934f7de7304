/* Activations and their derivatives, elementwise over a row, for the
 * portable unit (template: see real_template.h; the SIMD units use
 * vector_math.h). The switch sits outside the loops so each loop is a
 * plain vectorisable pass. */
#include <math.h>
#include <string.h>
#include <tgmath.h>

#include "fusedmlp/fusedmlp.h"

#define FMLP_SQRT_2_OVER_PI 0.79788456080286535588
#define FMLP_INV_SQRT_2 0.70710678118654752440
#define FMLP_INV_SQRT_2PI 0.39894228040143267794
#define FMLP_GELU_TANH_KAPPA 0.044715

static inline REAL FN(gelu_tanh_inner)(REAL z) {
  return (REAL)FMLP_SQRT_2_OVER_PI * (z + (REAL)FMLP_GELU_TANH_KAPPA * z * z * z);
}

static inline REAL FN(sigmoid)(REAL z) { return (REAL)1 / ((REAL)1 + exp(-z)); }

static void FN(activate_row)(REAL *v, int64_t n, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU:
      /* `v < 0 ? 0 : v` keeps NaN, as torch.relu does. */
      for (int64_t i = 0; i < n; ++i) v[i] = v[i] < 0 ? (REAL)0 : v[i];
      return;
    case FMLP_ACT_GELU:
      for (int64_t i = 0; i < n; ++i) {
        v[i] = (REAL)0.5 * v[i] * ((REAL)1 + erf(v[i] * (REAL)FMLP_INV_SQRT_2));
      }
      return;
    case FMLP_ACT_GELU_TANH:
      for (int64_t i = 0; i < n; ++i) {
        v[i] = (REAL)0.5 * v[i] * ((REAL)1 + tanh(FN(gelu_tanh_inner)(v[i])));
      }
      return;
    case FMLP_ACT_SILU:
      for (int64_t i = 0; i < n; ++i) v[i] = v[i] * FN(sigmoid)(v[i]);
      return;
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT:
      return;
  }
}

/* out[i] = grad[i] * act'(pre[i]); out may be grad */
static void FN(activation_grad_row)(REAL *out, const REAL *grad, const REAL *pre,
                                    int64_t n, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU:
      /* as torch's threshold_backward: a NaN pre-activation passes the gradient */
      for (int64_t i = 0; i < n; ++i) out[i] = pre[i] <= 0 ? (REAL)0 : grad[i];
      return;
    case FMLP_ACT_GELU:
      for (int64_t i = 0; i < n; ++i) {
        const REAL z = pre[i];
        const REAL cdf = (REAL)0.5 * ((REAL)1 + erf(z * (REAL)FMLP_INV_SQRT_2));
        const REAL pdf = (REAL)FMLP_INV_SQRT_2PI * exp((REAL)-0.5 * z * z);
        out[i] = grad[i] * (cdf + z * pdf);
      }
      return;
    case FMLP_ACT_GELU_TANH:
      for (int64_t i = 0; i < n; ++i) {
        const REAL z = pre[i];
        const REAL t = tanh(FN(gelu_tanh_inner)(z));
        const REAL inner_grad =
            (REAL)FMLP_SQRT_2_OVER_PI * ((REAL)1 + (REAL)(3 * FMLP_GELU_TANH_KAPPA) * z * z);
        out[i] = grad[i] * ((REAL)0.5 * ((REAL)1 + t) +
                            (REAL)0.5 * z * ((REAL)1 - t * t) * inner_grad);
      }
      return;
    case FMLP_ACT_SILU:
      for (int64_t i = 0; i < n; ++i) {
        const REAL s = FN(sigmoid)(pre[i]);
        out[i] = grad[i] * s * ((REAL)1 + pre[i] * ((REAL)1 - s));
      }
      return;
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT:
      if (out != grad) memcpy(out, grad, (size_t)n * sizeof(REAL));
      return;
  }
}
