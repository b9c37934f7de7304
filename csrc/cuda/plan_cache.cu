// cuBLASLt matmul plans, cached by everything the heuristic depends on, and
// the matmul call that uses them. The cache is bounded; a full cache replaces
// its entries round-robin. One mutex guards lookup and launch, because the
// bias pointer is set on the shared descriptor for each call.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

namespace {

constexpr int kPlanCapacity = 64;

struct PlanKey {
  int device, dtype, epilogue, has_bias, allow_tf32;
  int64_t m, n, k, batch;
  int64_t x_row_stride, w_row_stride, y_row_stride;
  int64_t w_batch_stride, bias_batch_stride, y_batch_stride;
  int align_x, align_w, align_y, align_bias;
};

struct Plan {
  PlanKey key;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t w_layout, x_layout, y_layout;
  cublasLtMatmulAlgo_t algo;
  bool in_use;
};

}  // namespace

struct fmlp_cuda_plan_cache {
  pthread_mutex_t lock;
  Plan plans[kPlanCapacity];
  int next_victim;
};

namespace {

#define FMLP_LT_CHECK(call)                                   \
  do {                                                        \
    if ((call) != CUBLAS_STATUS_SUCCESS) return FMLP_ERR_BACKEND; \
  } while (0)

int alignment_of(const void *pointer) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if (address % bytes == 0) return bytes;
  }
  return 1;
}

cudaDataType_t cuda_type(fmlp_dtype dtype) {
  switch (dtype) {
    case FMLP_BF16: return CUDA_R_16BF;
    case FMLP_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

cublasLtEpilogue_t epilogue_for(fmlp_activation activation, bool has_bias) {
  switch (activation) {
    case FMLP_ACT_RELU: return has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case FMLP_ACT_GELU_TANH: return has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    default: return has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

PlanKey key_for(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a) {
  PlanKey key;
  memset(&key, 0, sizeof(key));  // padding too: keys are compared with memcmp
  key.device = env->device;
  key.dtype = a->dtype;
  key.has_bias = a->bias != nullptr;
  key.epilogue = epilogue_for(a->activation, key.has_bias);
  key.allow_tf32 = a->dtype == FMLP_F32 && env->allow_tf32;
  key.m = a->m;
  key.n = a->n;
  key.k = a->k;
  key.batch = a->batch;
  key.x_row_stride = a->x_row_stride;
  key.w_row_stride = a->w_row_stride;
  key.y_row_stride = a->y_row_stride;
  key.w_batch_stride = a->w_batch_stride;
  key.bias_batch_stride = a->bias_batch_stride;
  key.y_batch_stride = a->y_batch_stride;
  key.align_x = alignment_of(a->x);
  key.align_w = alignment_of(a->w);
  key.align_y = alignment_of(a->y);
  key.align_bias = key.has_bias ? alignment_of(a->bias) : 0;
  return key;
}

void release_plan(Plan *plan) {
  if (!plan->in_use) return;
  cublasLtMatrixLayoutDestroy(plan->y_layout);
  cublasLtMatrixLayoutDestroy(plan->x_layout);
  cublasLtMatrixLayoutDestroy(plan->w_layout);
  cublasLtMatmulDescDestroy(plan->op);
  plan->in_use = false;
}

fmlp_status set_batch(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride) {
  if (batch == 1) return FMLP_OK;
  const int32_t count = (int32_t)batch;
  FMLP_LT_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                 &count, sizeof(count)));
  FMLP_LT_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  return FMLP_OK;
}

// Row-major y[m, n] = x[m, k] @ w[n, k].T is, column-major,
// y.T[n, m] = op_T(w as a k x n matrix) @ (x as a k x m matrix).
fmlp_status describe(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a, const PlanKey &key,
                     Plan *plan) {
  const cudaDataType_t type = cuda_type(a->dtype);
  const cublasComputeType_t compute =
      key.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  FMLP_LT_CHECK(cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F));
  plan->in_use = true;  // from here release_plan frees what was created
  plan->w_layout = plan->x_layout = plan->y_layout = nullptr;
  const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
  FMLP_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                               sizeof(transpose)));
  FMLP_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB,
                                               &no_transpose, sizeof(no_transpose)));
  const cublasLtEpilogue_t epilogue = (cublasLtEpilogue_t)key.epilogue;
  FMLP_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                               sizeof(epilogue)));
  if (key.has_bias && a->batch > 1) {
    FMLP_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                 &a->bias_batch_stride,
                                                 sizeof(a->bias_batch_stride)));
  }
  FMLP_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->w_layout, type, a->k, a->n, a->w_row_stride));
  FMLP_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->x_layout, type, a->k, a->m, a->x_row_stride));
  FMLP_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->y_layout, type, a->n, a->m, a->y_row_stride));
  fmlp_status status = set_batch(plan->w_layout, a->batch, a->w_batch_stride);
  if (status == FMLP_OK) status = set_batch(plan->x_layout, a->batch, 0);
  if (status == FMLP_OK) status = set_batch(plan->y_layout, a->batch, a->y_batch_stride);
  if (status != FMLP_OK) return status;

  cublasLtMatmulPreference_t preference;
  FMLP_LT_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace = (uint64_t)env->workspace_bytes;
  const uint32_t align_w = key.align_w, align_x = key.align_x, align_y = key.align_y;
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  const bool ok =
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace, sizeof(workspace)) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                           &align_w, sizeof(align_w)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                           &align_x, sizeof(align_x)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                           &align_y, sizeof(align_y)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                           &align_y, sizeof(align_y)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(env->handle, plan->op, plan->w_layout, plan->x_layout,
                                     plan->y_layout, plan->y_layout, preference, 1, &result,
                                     &found) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreferenceDestroy(preference);
  if (!ok) return FMLP_ERR_BACKEND;
  if (found < 1) return FMLP_ERR_UNSUPPORTED;
  plan->algo = result.algo;
  plan->key = key;
  return FMLP_OK;
}

// The cached plan for key, or a new one (under the cache lock).
fmlp_status find_plan(fmlp_cuda_plan_cache *cache, const fmlp_cuda_env *env,
                      const fmlp_cuda_linear_args *a, const PlanKey &key, Plan **found) {
  for (Plan &plan : cache->plans) {
    if (plan.in_use && memcmp(&plan.key, &key, sizeof(key)) == 0) {
      *found = &plan;
      return FMLP_OK;
    }
  }
  Plan *slot = &cache->plans[cache->next_victim];
  cache->next_victim = (cache->next_victim + 1) % kPlanCapacity;
  release_plan(slot);
  const fmlp_status status = describe(env, a, key, slot);
  if (status != FMLP_OK) {
    release_plan(slot);
    return status;
  }
  *found = slot;
  return FMLP_OK;
}

fmlp_status run_plan(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a, Plan *plan) {
  if (plan->key.has_bias) {
    FMLP_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &a->bias, sizeof(a->bias)));
  }
  const float alpha = 1.f, beta = 0.f;
  FMLP_LT_CHECK(cublasLtMatmul(env->handle, plan->op, &alpha, a->w, plan->w_layout, a->x,
                               plan->x_layout, &beta, a->y, plan->y_layout, a->y, plan->y_layout,
                               &plan->algo, env->workspace, (size_t)env->workspace_bytes,
                               env->stream));
  return FMLP_OK;
}

}  // namespace

fmlp_status fmlp_cuda_lt_matmul(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a) {
  if (a->m == 0 || a->n == 0) return FMLP_OK;
  const PlanKey key = key_for(env, a);
  fmlp_cuda_plan_cache *cache = env->plans;
  if (pthread_mutex_lock(&cache->lock) != 0) return FMLP_ERR_BACKEND;
  Plan *plan = nullptr;
  fmlp_status status = find_plan(cache, env, a, key, &plan);
  if (status == FMLP_OK) status = run_plan(env, a, plan);
  pthread_mutex_unlock(&cache->lock);
  return status;
}

extern "C" {

fmlp_status fmlp_cuda_plan_cache_create(fmlp_cuda_plan_cache **cache) {
  fmlp_cuda_plan_cache *created =
      static_cast<fmlp_cuda_plan_cache *>(calloc(1, sizeof(fmlp_cuda_plan_cache)));
  if (created == nullptr) return FMLP_ERR_OUT_OF_MEMORY;
  if (pthread_mutex_init(&created->lock, nullptr) != 0) {
    free(created);
    return FMLP_ERR_BACKEND;
  }
  *cache = created;
  return FMLP_OK;
}

void fmlp_cuda_plan_cache_destroy(fmlp_cuda_plan_cache *cache) {
  if (cache == nullptr) return;
  for (Plan &plan : cache->plans) release_plan(&plan);
  pthread_mutex_destroy(&cache->lock);
  free(cache);
}

int64_t fmlp_cuda_workspace_bytes(int compute_capability_major) {
  return compute_capability_major >= 9 ? (int64_t)32 << 20 : (int64_t)4 << 20;
}

}  // extern "C"
