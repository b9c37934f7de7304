// Shared between the CUDA translation units; not part of the kernel API.
#ifndef FUSEDMLP_CUDA_INTERNAL_H
#define FUSEDMLP_CUDA_INTERNAL_H

#include "fusedmlp/cuda.h"

// One cuBLASLt matmul, act(x @ w.T + bias) with act in {none, relu,
// gelu_tanh} in the epilogue; args->pre is ignored.
fmlp_status fmlp_cuda_lt_matmul(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *args);

// y = act(bias) (or act(0)) broadcast over rows, for K == 0.
fmlp_status fmlp_cuda_fill_empty_product(const fmlp_cuda_linear_args *args, cudaStream_t stream);

#endif  // FUSEDMLP_CUDA_INTERNAL_H
