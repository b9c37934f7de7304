/* The activations and their derivatives in double precision: the reference
 * both C test programs (test_kernels.c, fuzz_kernels.c) check the kernels
 * against. The switches name every activation and have no default, so the
 * -Wall -Werror test build fails on one added to the registry but not here. */
#ifndef FUSEDMLP_TESTS_C_REFERENCE_H
#define FUSEDMLP_TESTS_C_REFERENCE_H

#include <math.h>

#include "fusedmlp/fusedmlp.h"

static inline double reference_activation(double z, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU: return z < 0 ? 0 : z; /* keeps NaN, like torch.relu */
    case FMLP_ACT_GELU: return 0.5 * z * (1 + erf(z / sqrt(2.0)));
    case FMLP_ACT_GELU_TANH:
      return 0.5 * z * (1 + tanh(0.79788456080286535588 * (z + 0.044715 * z * z * z)));
    case FMLP_ACT_SILU: return z / (1 + exp(-z));
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT: break;
  }
  return z;
}

/* act'(z); ReLU's passes a NaN z through, like torch's threshold_backward. */
static inline double reference_activation_grad(double z, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU: return z <= 0 ? 0 : 1;
    case FMLP_ACT_GELU:
      return 0.5 * (1 + erf(z / sqrt(2.0))) + z * exp(-0.5 * z * z) * 0.39894228040143267794;
    case FMLP_ACT_GELU_TANH: {
      const double k = 0.79788456080286535588, t = tanh(k * (z + 0.044715 * z * z * z));
      return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z);
    }
    case FMLP_ACT_SILU: {
      const double s = 1 / (1 + exp(-z));
      return s * (1 + z * (1 - s));
    }
    case FMLP_ACT_NONE:
    case FMLP_ACT_COUNT: break;
  }
  return 1;
}

#endif /* FUSEDMLP_TESTS_C_REFERENCE_H */
