/* CUDA kernels: cuBLASLt GEMMs with fused epilogues plus our own pointwise
 * kernels. Plain C interface; every call is asynchronous on the given stream. */
#ifndef FUSEDMLP_CUDA_H
#define FUSEDMLP_CUDA_H

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Matmul plans (descriptors plus the heuristic's algorithm) keyed by shape,
 * dtype and epilogue; bounded in size and safe to share between threads. */
typedef struct fmlp_cuda_plan_cache fmlp_cuda_plan_cache;
fmlp_status fmlp_cuda_plan_cache_create(fmlp_cuda_plan_cache **cache);
void fmlp_cuda_plan_cache_destroy(fmlp_cuda_plan_cache *cache);

/* Workspace cuBLASLt gets: 32 MiB on Hopper and newer, 4 MiB before. */
int64_t fmlp_cuda_workspace_bytes(int compute_capability_major);

/* Where and how a GEMM runs. */
typedef struct {
  cublasLtHandle_t handle;
  cudaStream_t stream;
  int device;
  void *workspace;
  int64_t workspace_bytes;
  fmlp_cuda_plan_cache *plans;
  int allow_tf32; /* float32 GEMMs may use TF32 tensor cores */
} fmlp_cuda_env;

/* Every matrix has unit column stride. For batch > 1, matrix b of a batched
 * operand starts batch_stride elements after matrix b - 1 (0 = shared). */
typedef struct {
  fmlp_dtype dtype; /* FMLP_F32, FMLP_BF16 or FMLP_F16, every operand */
  int64_t m, n, k, batch;
  const void *x; /* m x k */
  int64_t x_row_stride;
  const void *w; /* n x k */
  int64_t w_row_stride, w_batch_stride;
  const void *bias; /* n, contiguous, or NULL */
  int64_t bias_batch_stride;
  void *y; /* m x n */
  int64_t y_row_stride, y_batch_stride;
  fmlp_activation activation; /* act(x @ w.T + bias) */
  void *pre; /* optional m x n (row stride n) pre-activation, batch 1 only */
} fmlp_cuda_linear_args;

/* y = act(x @ w.T + bias). Activations cuBLASLt computes exactly (ReLU, the
 * tanh GELU) run in its epilogue; exact GELU and SiLU, and any call that
 * saves the pre-activation, run our pointwise kernel after a BIAS epilogue. */
fmlp_status fmlp_cuda_linear(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *args);

/* out = act(in), n contiguous elements (in == out allowed). */
fmlp_status fmlp_cuda_activation(fmlp_dtype dtype, int64_t n, const void *in,
                                 fmlp_activation activation, void *out, cudaStream_t stream);

/* grad_pre = grad_out * act'(pre), n contiguous elements. */
fmlp_status fmlp_cuda_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                          const void *pre, fmlp_activation activation,
                                          void *grad_pre, cudaStream_t stream);

/* product = act(gate) * up, n contiguous elements. */
fmlp_status fmlp_cuda_gate_product(fmlp_dtype dtype, int64_t n, const void *gate, const void *up,
                                   fmlp_activation activation, void *product,
                                   cudaStream_t stream);

/* grad_gate = grad_product * up * act'(gate), grad_up = grad_product * act(gate). */
fmlp_status fmlp_cuda_gated_backward(fmlp_dtype dtype, int64_t n, const void *grad_product,
                                     const void *gate, const void *up,
                                     fmlp_activation activation, void *grad_gate, void *grad_up,
                                     cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* FUSEDMLP_CUDA_H */
