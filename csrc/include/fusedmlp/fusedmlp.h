/* fusedmlp kernel API: plain C, no torch types.
 *
 * Every routine computes on row-major matrices given by pointer plus strides
 * (in elements). A "linear" is y[m, n] = act(sum_k x[m, k] * w[n, k] + bias[n]).
 */
#ifndef FUSEDMLP_FUSEDMLP_H
#define FUSEDMLP_FUSEDMLP_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FMLP_ACT_<ID> for each activation of the registry fusedmlp/activations.def. */
typedef enum {
#define FMLP_ACTIVATION(id, name, cublaslt, derivative) FMLP_ACT_##id,
#include "fusedmlp/activations.def"
  FMLP_ACT_COUNT
} fmlp_activation;

#define FMLP_DERIVATIVE_PRE 0
#define FMLP_DERIVATIVE_OUTPUT 1

/* 1 where the activation's derivative is a function of its output
 * (activations.def's DERIVATIVE column), so that a chain's backward can read
 * a layer's output (a hidden layer's saved output, the last layer's y) in
 * place of its pre-activation; else 0. */
static inline int fmlp_derivative_reads_output(fmlp_activation activation) {
  switch (activation) {
#define FMLP_ACTIVATION(id, name, cublaslt, derivative) \
  case FMLP_ACT_##id: return FMLP_DERIVATIVE_##derivative;
#include "fusedmlp/activations.def"
    case FMLP_ACT_COUNT: break;
  }
  return 0;
}

/* Whether a training chain saves a layer's pre-activation: where it has an
 * activation whose derivative reads it (elsewhere the layer's output serves). */
static inline int fmlp_chain_saves_pre(fmlp_activation activation) {
  return activation != FMLP_ACT_NONE && !fmlp_derivative_reads_output(activation);
}

/* Storage type of a tensor. float32 and bfloat16 compute in float,
 * float64 in double; float16 is CUDA only. */
typedef enum {
  FMLP_F32 = 0,
  FMLP_F64 = 1,
  FMLP_BF16 = 2,
  FMLP_F16 = 3
} fmlp_dtype;

typedef enum {
  FMLP_OK = 0,
  FMLP_ERR_INVALID_ARGUMENT = 1,
  FMLP_ERR_SIZE_OVERFLOW = 2,
  FMLP_ERR_OUT_OF_MEMORY = 3,
  FMLP_ERR_UNSUPPORTED = 4,
  FMLP_ERR_BACKEND = 5
} fmlp_status;

/* A human-readable name for a status, for error messages. */
const char *fmlp_status_string(fmlp_status status);

#ifdef __cplusplus
}
#endif

#endif /* FUSEDMLP_FUSEDMLP_H */
