// One linear layer on the GPU, on the route routing.c chooses: cuBLASLt with the bias
// and activation in its epilogue where it computes them as PyTorch does; cuBLASLt's bias
// epilogue and then our activation kernel for the other activations; and for sizes
// PyTorch keeps off cuBLASLt (a dimension of 1, or of 65535 * 32 and more) what its addmm
// does there: the bias broadcast, a classic cuBLAS GEMM adding to it, our activation.
#include <stdio.h>

#include "internal.h"

namespace {

bool valid_args(const fmlp_cuda_linear_args *a) {
  const bool dtype_ok = a->dtype == FMLP_F32 || a->dtype == FMLP_BF16 || a->dtype == FMLP_F16;
  const bool act_ok = a->activation >= FMLP_ACT_NONE && a->activation < FMLP_ACT_COUNT;
  const bool sizes_ok = a->m >= 0 && a->n >= 0 && a->k >= 0 && a->batch >= 1;
  if (!dtype_ok || !act_ok || !sizes_ok) return false;
  if (a->m == 0 || a->n == 0) return true;  // nothing is read or written
  // cuBLAS reads rows of unit column stride and a row stride of at least the row length.
  const bool strides_ok = a->y_row_stride >= a->n &&
                          (a->k == 0 || (a->x_row_stride >= a->k && a->w_row_stride >= a->k));
  const bool pointers_ok = a->y != nullptr && (a->k == 0 || (a->x != nullptr && a->w != nullptr));
  return strides_ok && pointers_ok && (a->pre == nullptr || a->batch == 1);
}

// z += x @ w.T (beta = 1) or z = x @ w.T (beta = 0), z of row stride z_stride, in row
// chunks cuBLAS's int sizes can take.
fmlp_status plain_gemm(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a, void *z,
                       int64_t z_stride, float beta, const fmlp_cuda_problem &problem) {
  const cudaDataType_t type = fmlp_cuda_data_type(a->dtype);
  const cublasComputeType_t compute = a->dtype == FMLP_F32 && env->allow_tf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  const int64_t size = fmlp_cuda_element_size(a->dtype);
  const float alpha = 1.f;
  for (int64_t row = 0; row < a->m; row += FMLP_CUDA_GEMM_MAX_DIM) {
    const int64_t rows = a->m - row < FMLP_CUDA_GEMM_MAX_DIM ? a->m - row : FMLP_CUDA_GEMM_MAX_DIM;
    const char *x = static_cast<const char *>(a->x) + row * a->x_row_stride * size;
    char *out = static_cast<char *>(z) + row * z_stride * size;
    const cublasStatus_t status = cublasGemmEx(
        env->blas_handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a->n),
        static_cast<int>(rows), static_cast<int>(a->k), &alpha, a->w, type,
        static_cast<int>(a->w_row_stride), x, type, static_cast<int>(a->x_row_stride), &beta,
        out, type, static_cast<int>(z_stride), compute, CUBLAS_GEMM_DEFAULT);
    if (status != CUBLAS_STATUS_SUCCESS) {
      char text[96];
      snprintf(text, sizeof(text), "%s (%d)", cublasGetStatusName(status),
               static_cast<int>(status));
      fmlp_cuda_record_failure("cublasGemmEx", text, &problem);
      return FMLP_ERR_BACKEND;
    }
  }
  return FMLP_OK;
}

// Where z = x @ w.T + bias goes before the activation: pre when it is saved, else y.
struct Preactivation {
  void *z;
  int64_t stride;
};

Preactivation preactivation_of(const fmlp_cuda_linear_args *a) {
  return a->pre != nullptr ? Preactivation{a->pre, a->n} : Preactivation{a->y, a->y_row_stride};
}

// y = act(z); nothing to do when z is y and the activation is the identity.
fmlp_status activate(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a,
                     Preactivation z) {
  if (z.z == a->y && a->activation == FMLP_ACT_NONE) return FMLP_OK;
  return fmlp_cuda_activation_rows(a->dtype, a->m, a->n, z.z, z.stride, a->activation, a->y,
                                   a->y_row_stride, env->stream);
}

// z = bias broadcast, z += x @ w.T, y = act(z): PyTorch's addmm when its Lt path does not
// apply (size-1 or huge dimensions), rounding z once.
fmlp_status gemm_then_activation(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a,
                                 const fmlp_cuda_problem &problem) {
  fmlp_status status =
      fmlp_cuda_check_limits(&problem, a->x_row_stride, a->w_row_stride, a->y_row_stride);
  if (status != FMLP_OK) return status;
  const Preactivation z = preactivation_of(a);
  if (a->bias != nullptr) {
    status = fmlp_cuda_fill_rows(a->dtype, a->m, a->n, a->bias, FMLP_ACT_NONE, z.z, z.stride,
                                 nullptr, env->stream);
    if (status != FMLP_OK) return status;
  }
  status = plain_gemm(env, a, z.z, z.stride, a->bias != nullptr ? 1.f : 0.f, problem);
  return status == FMLP_OK ? activate(env, a, z) : status;
}

// z = x @ w.T + bias by cuBLASLt's BIAS epilogue, then y = act(z) by our kernel.
fmlp_status lt_then_activation(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a) {
  const Preactivation z = preactivation_of(a);
  fmlp_cuda_linear_args bias_only = *a;
  bias_only.activation = FMLP_ACT_NONE;
  bias_only.pre = nullptr;
  bias_only.y = z.z;
  bias_only.y_row_stride = z.stride;
  const fmlp_status status = fmlp_cuda_lt_matmul(env, &bias_only);
  return status == FMLP_OK ? activate(env, a, z) : status;
}

}  // namespace

fmlp_cuda_problem fmlp_cuda_problem_of(const fmlp_cuda_linear_args *a) {
  fmlp_cuda_problem problem = {};
  problem.dtype = a->dtype;
  problem.m = a->m;
  problem.n = a->n;
  problem.k = a->k;
  problem.batch = a->batch;
  problem.activation = a->activation;
  problem.has_bias = a->bias != nullptr;
  problem.saves_pre = a->pre != nullptr;
  return problem;
}

extern "C" fmlp_status fmlp_cuda_linear(const fmlp_cuda_env *env,
                                        const fmlp_cuda_linear_args *args) {
  fmlp_cuda_clear_error();
  const fmlp_cuda_problem problem = fmlp_cuda_problem_of(args);
  if (!valid_args(args)) {
    fmlp_cuda_record_failure("fmlp_cuda_linear", "invalid arguments", &problem);
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  const fmlp_cuda_route route = fmlp_cuda_route_for(&problem);
  switch (route) {
    case FMLP_CUDA_ROUTE_NOTHING: return FMLP_OK;
    case FMLP_CUDA_ROUTE_FILL:
      return fmlp_cuda_fill_rows(args->dtype, args->m, args->n, args->bias, args->activation,
                                 args->y, args->y_row_stride, args->pre, env->stream);
    // When the heuristic has no algorithm (remembered by the plan cache), a single GEMM
    // falls back a route: the fused epilogue to the bias epilogue plus our activation (an
    // aux buffer, say, that its algorithms cannot take), that to the classic GEMM. A
    // batched one is left to the caller.
    case FMLP_CUDA_ROUTE_LT_EPILOGUE: {
      const fmlp_status status = fmlp_cuda_lt_matmul(env, args);
      if (status != FMLP_ERR_UNSUPPORTED || args->batch != 1) return status;
      fmlp_cuda_clear_error();
    }
      [[fallthrough]];
    case FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION: {
      const fmlp_status status = lt_then_activation(env, args);
      if (status != FMLP_ERR_UNSUPPORTED) return status;
      fmlp_cuda_clear_error();
      return gemm_then_activation(env, args, problem);
    }
    case FMLP_CUDA_ROUTE_GEMM_THEN_ACTIVATION: return gemm_then_activation(env, args, problem);
    case FMLP_CUDA_ROUTE_UNSUPPORTED:
      fmlp_cuda_record_failure("fmlp_cuda_linear",
                               "a batched GEMM needs the epilogue route, which these sizes or "
                               "this activation do not take",
                               &problem);
      return FMLP_ERR_UNSUPPORTED;
  }
  return FMLP_ERR_INVALID_ARGUMENT;
}
