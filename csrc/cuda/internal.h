// Shared between the CUDA translation units; not part of the kernel API.
#ifndef FUSEDMLP_CUDA_INTERNAL_H
#define FUSEDMLP_CUDA_INTERNAL_H

#include "fusedmlp/cuda.h"

// Every switch over fmlp_activation in csrc/cuda lists each case and has no default, so
// that an activation added to the enum fails to build here instead of running as the
// identity on the GPU.
static_assert(FMLP_ACT_COUNT == 5,
              "a new activation needs a case in every switch over fmlp_activation in csrc/cuda");

inline int64_t fmlp_cuda_element_size(fmlp_dtype dtype) {
  switch (dtype) {
    case FMLP_F32: return 4;
    case FMLP_F64: return 8;
    case FMLP_BF16:
    case FMLP_F16: return 2;
  }
  return 0;
}

// FMLP_F64 has no CUDA path (fmlp_cuda_linear refuses it before any use).
inline cudaDataType_t fmlp_cuda_data_type(fmlp_dtype dtype) {
  switch (dtype) {
    case FMLP_F32: return CUDA_R_32F;
    case FMLP_F64: return CUDA_R_64F;
    case FMLP_BF16: return CUDA_R_16BF;
    case FMLP_F16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// The problem a linear call describes, for routing and error details.
fmlp_cuda_problem fmlp_cuda_problem_of(const fmlp_cuda_linear_args *args);

// One cuBLASLt matmul with the epilogue fmlp_cuda_epilogue_for() gives (args->pre is
// the GELU aux buffer when saved). FMLP_ERR_UNSUPPORTED when the heuristic has no
// algorithm (remembered: later calls answer at once).
fmlp_status fmlp_cuda_lt_matmul(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *args);

// out = act(in) over m rows of n columns, rows at in_stride and out_stride elements
// (in == out allowed).
fmlp_status fmlp_cuda_activation_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *in,
                                      int64_t in_stride, fmlp_activation activation, void *out,
                                      int64_t out_stride, cudaStream_t stream);

// y[i, j] = act(bias[j]) (or act(0)) on m rows of n columns at row stride y_stride, and,
// when pre is not NULL, pre[i, j] = bias[j] (row stride n): an empty product (K == 0), or
// the bias a GEMM with beta = 1 adds to.
fmlp_status fmlp_cuda_fill_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *bias,
                                fmlp_activation activation, void *y, int64_t y_stride, void *pre,
                                cudaStream_t stream);

#endif  // FUSEDMLP_CUDA_INTERNAL_H
