/* The CUDA path's decisions that need no GPU: which engine runs a linear layer, the
 * alignments cuBLASLt is told, the size limits, whether gate and up run as one batched
 * GEMM, and the text of a failure. Plain C without CUDA headers (fusedmlp/cuda.h
 * includes it), so that tests/c/test_cuda_routing.c checks every decision on any
 * machine; implemented in csrc/cuda/routing.c. */
#ifndef FUSEDMLP_CUDA_ROUTING_H
#define FUSEDMLP_CUDA_ROUTING_H

#include <stddef.h>
#include <stdint.h>

#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One linear layer y = act(x @ w.T + bias) as the router sees it. */
typedef struct {
  fmlp_dtype dtype;
  int64_t m, n, k, batch;
  fmlp_activation activation;
  int has_bias;
  int saves_pre; /* the pre-activation also goes to an m x n buffer of row stride n */
} fmlp_cuda_problem;

typedef enum {
  FMLP_CUDA_ROUTE_NOTHING,        /* empty output (m or n is 0): nothing to compute */
  FMLP_CUDA_ROUTE_FILL,           /* k == 0: act(bias), or act(0), on every row */
  FMLP_CUDA_ROUTE_LT_EPILOGUE,    /* one cuBLASLt matmul, bias and activation in its epilogue */
  FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION,   /* cuBLASLt with the bias epilogue, then our
                                           activation kernel */
  FMLP_CUDA_ROUTE_GEMM_THEN_ACTIVATION, /* the bias broadcast into the output, a classic
                                           cuBLAS GEMM adding to it (beta = 1), then our
                                           activation kernel: PyTorch's addmm without Lt */
  FMLP_CUDA_ROUTE_UNSUPPORTED     /* a batched call the epilogue route cannot take */
} fmlp_cuda_route;

/* The cuBLASLt epilogues the LT_EPILOGUE route uses (mapped to cublasLtEpilogue_t in
 * csrc/cuda/plan_cache.cu). */
typedef enum {
  FMLP_CUDA_EPILOGUE_DEFAULT,
  FMLP_CUDA_EPILOGUE_BIAS,
  FMLP_CUDA_EPILOGUE_GELU,
  FMLP_CUDA_EPILOGUE_GELU_BIAS,
  FMLP_CUDA_EPILOGUE_GELU_AUX,     /* also stores the pre-activation (training) */
  FMLP_CUDA_EPILOGUE_GELU_AUX_BIAS
} fmlp_cuda_epilogue;

/* PyTorch (aten/src/ATen/native/cuda/Blas.cpp, isInputCompliesAddmmCudaLt) sends a GEMM
 * through cuBLASLt's bias epilogue only when every one of m, n, k is above 1 and below
 * 65535 * 32: the heuristic answers CUBLAS_STATUS_INVALID_VALUE for a single row or
 * column, and larger sizes exceed its grid. We route as it does. */
#define FMLP_CUDA_LT_MAX_DIM ((int64_t)65535 * 32)

/* The classic cuBLAS GEMM takes int sizes and leading dimensions. */
#define FMLP_CUDA_GEMM_MAX_DIM ((int64_t)INT32_MAX)

/* Whether cuBLASLt computes this activation (and saves its input) in an epilogue exactly
 * as PyTorch does; if so *epilogue is the one to use. Only the identity and the tanh GELU
 * qualify: cuBLASLt has no erf GELU or SiLU, and its ReLU maps NaN to 0 where torch.relu
 * keeps NaN. A saved pre-activation needs an aux leading dimension divisible by 8. */
int fmlp_cuda_epilogue_for(fmlp_activation activation, int has_bias, int saves_pre, int64_t n,
                           fmlp_cuda_epilogue *epilogue);

/* Which engine runs the problem (see fmlp_cuda_route). When a cuBLASLt route's
 * heuristic later finds no algorithm, a single (batch 1) problem falls back one route at
 * a time (LT_EPILOGUE, LT_THEN_ACTIVATION, GEMM_THEN_ACTIVATION); a batched one is
 * refused with FMLP_ERR_UNSUPPORTED. */
fmlp_cuda_route fmlp_cuda_route_for(const fmlp_cuda_problem *problem);

/* Sizes and strides the engines cannot take, checked before anything runs: n, k and every
 * row stride must fit the classic GEMM's int (m does not: the GEMM runs in row chunks of
 * at most FMLP_CUDA_GEMM_MAX_DIM). FMLP_ERR_UNSUPPORTED, with a detail, when they do not. */
fmlp_status fmlp_cuda_check_limits(const fmlp_cuda_problem *problem, int64_t x_row_stride,
                                   int64_t w_row_stride, int64_t y_row_stride);

/* The largest power of two, at most 256 (cuBLASLt's default and PyTorch's hint), that
 * divides the address and, for a batched operand, the byte distance between its
 * matrices: what every matrix of the operand may be assumed to be aligned to. */
uint32_t fmlp_cuda_alignment(uintptr_t address, int64_t batch_stride_bytes);

/* Gate and up of a gated block as the batched-GEMM decision sees them. */
typedef struct {
  uintptr_t w_gate, w_up, bias_gate, bias_up; /* bias addresses 0 when absent */
  int64_t w_gate_row_stride, w_up_row_stride;
  int64_t rows, hidden, dim;
  int64_t element_size;
} fmlp_cuda_gate_up;

/* Whether gate and up run as one strided-batched GEMM (batch 2) writing
 * [gate; up] into one 2 x rows x hidden buffer: both on the epilogue route, one row
 * stride, biases both present or both absent, up's weight (and bias) a fixed forward
 * distance from gate's, and that distance and the output's batch stride (rows x hidden
 * elements) multiples of 16 bytes. Sets the weight and bias batch strides in elements. */
int fmlp_cuda_gate_up_batchable(const fmlp_cuda_gate_up *gate_up, int64_t *w_batch_stride,
                                int64_t *bias_batch_stride);

/* The detail of the last failure recorded on this thread: the call, its status and the
 * problem. Empty when nothing was recorded since fmlp_cuda_clear_error(). */
const char *fmlp_cuda_error_detail(void);
void fmlp_cuda_clear_error(void);

/* Records "<call> failed: <status> for <problem>" (problem may be NULL). */
void fmlp_cuda_record_failure(const char *call, const char *status,
                              const fmlp_cuda_problem *problem);

/* "m=.., n=.., k=.., batch=.., dtype=.., activation=.." into buffer. */
void fmlp_cuda_describe_problem(const fmlp_cuda_problem *problem, char *buffer, size_t size);

/* Names as PyTorch spells them. */
const char *fmlp_cuda_activation_name(fmlp_activation activation);
const char *fmlp_cuda_dtype_name(fmlp_dtype dtype);

#ifdef __cplusplus
}
#endif

#endif /* FUSEDMLP_CUDA_ROUTING_H */
