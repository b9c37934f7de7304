/* CUDA kernels: cuBLASLt GEMMs with fused epilogues plus our own pointwise
 * kernels. Plain C interface; every call is asynchronous on the given stream. */
#ifndef FUSEDMLP_CUDA_H
#define FUSEDMLP_CUDA_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "fusedmlp/cuda_routing.h"
#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cuBLASLt algorithms chosen by its heuristic, keyed by everything the choice depends
 * on (shape, strides, dtype, epilogue, compute type, operand alignments, workspace),
 * including the epilogues it found no algorithm for. Bounded (least recently used goes
 * first) and safe to share between threads; a lookup holds its lock only to read or
 * insert one entry, never across a heuristic query or a launch. */
typedef struct fmlp_cuda_plan_cache fmlp_cuda_plan_cache;
fmlp_status fmlp_cuda_plan_cache_create(fmlp_cuda_plan_cache **cache);
void fmlp_cuda_plan_cache_destroy(fmlp_cuda_plan_cache *cache);

/* Where and how a GEMM runs. The handles, stream and workspace belong to the caller
 * (PyTorch's, in the torch layer), the workspace to this stream. */
typedef struct {
  cublasLtHandle_t handle;
  cublasHandle_t blas_handle; /* for the GEMM without epilogue, bound to stream */
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

/* y = act(x @ w.T + bias). The identity and the tanh GELU (also when saving the
 * pre-activation, as GELU_AUX) run in cuBLASLt's epilogue when every size is above 1
 * and below 65535 * 32, as PyTorch routes its own; everything else (ReLU, which must
 * keep NaN, exact GELU, SiLU, size-1 or huge dimensions, an epilogue the heuristic has
 * no algorithm for) is a plain GEMM followed by our bias + activation kernel. A batched
 * call (batch > 1) takes only the epilogue route: FMLP_ERR_UNSUPPORTED otherwise, and
 * the caller runs its matrices one by one. Every failure records a detail
 * (fmlp_cuda_error_detail in fusedmlp/cuda_routing.h). */
fmlp_status fmlp_cuda_linear(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *args);

/* grad_pre = grad_out * act'(pre), n contiguous elements. */
fmlp_status fmlp_cuda_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                          const void *pre, fmlp_activation activation,
                                          void *grad_pre, cudaStream_t stream);

/* product = act(gate) * up, n contiguous elements; product may be gate (in place). */
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
