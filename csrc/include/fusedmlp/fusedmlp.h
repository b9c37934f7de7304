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

typedef enum {
  FMLP_ACT_NONE = 0,
  FMLP_ACT_RELU = 1,
  FMLP_ACT_GELU = 2,      /* exact, erf based: nn.GELU() */
  FMLP_ACT_GELU_TANH = 3, /* nn.GELU(approximate="tanh") */
  FMLP_ACT_SILU = 4,
  FMLP_ACT_COUNT = 5
} fmlp_activation;

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

/* A strided 2-D view: element (r, c) lives at data[r * row_stride + c * col_stride]. */
typedef struct {
  void *data;
  int64_t rows, cols;
  int64_t row_stride, col_stride;
} fmlp_matrix;

#ifdef __cplusplus
}
#endif

#endif /* FUSEDMLP_FUSEDMLP_H */
