// cuBLASLt matmuls with a fused epilogue, and the cache of the algorithms its heuristic
// chose. The descriptors are built for each call on the stack (cublasLt*Init, no
// allocation) with every attribute the heuristic reads, pointers included (it judges
// the bias and aux alignment from them), so the cache holds algorithms only and its lock
// covers a lookup or an insert, never a heuristic query or a launch.
#include <stdio.h>
#include <string.h>

#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

#include "internal.h"

namespace {

constexpr size_t kPlanCapacity = 1024;

// Everything the heuristic's choice depends on. Compared and hashed as bytes: built
// from a zeroed struct so that padding is zero too.
struct PlanKey {
  int32_t device, dtype, epilogue, compute;
  int64_t m, n, k, batch;
  int64_t x_row_stride, w_row_stride, y_row_stride, aux_ld;
  int64_t w_batch_stride, bias_batch_stride, y_batch_stride;
  int64_t workspace_bytes;
  uint32_t align_x, align_w, align_y, align_bias, align_aux, unused;
};

struct KeyHash {
  size_t operator()(const PlanKey &key) const {
    const unsigned char *bytes = reinterpret_cast<const unsigned char *>(&key);
    uint64_t hash = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < sizeof(key); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    return static_cast<size_t>(hash);
  }
};

struct KeyEqual {
  bool operator()(const PlanKey &a, const PlanKey &b) const {
    return memcmp(&a, &b, sizeof(a)) == 0;
  }
};

// found == false remembers that the heuristic had no algorithm for the key, so the
// caller's fallback runs at once on later calls instead of asking again.
struct Plan {
  bool found;
  cublasLtMatmulAlgo_t algo;
};

}  // namespace

struct fmlp_cuda_plan_cache {
  std::mutex lock;
  std::list<PlanKey> recency;  // most recently used first
  std::unordered_map<PlanKey, std::pair<Plan, std::list<PlanKey>::iterator>, KeyHash, KeyEqual>
      plans;

  bool find(const PlanKey &key, Plan *plan) {
    const std::lock_guard<std::mutex> guard(lock);
    const auto entry = plans.find(key);
    if (entry == plans.end()) return false;
    recency.splice(recency.begin(), recency, entry->second.second);
    *plan = entry->second.first;
    return true;
  }

  // Only plans the heuristic answered are inserted: a failed query evicts nothing. Out
  // of host memory the plan is simply not remembered.
  void insert(const PlanKey &key, const Plan &plan) noexcept {
    const std::lock_guard<std::mutex> guard(lock);
    if (plans.count(key) != 0) return;  // another thread asked first
    try {
      recency.push_front(key);
      try {
        plans.emplace(key, std::make_pair(plan, recency.begin()));
      } catch (const std::bad_alloc &) {
        recency.pop_front();
        return;
      }
    } catch (const std::bad_alloc &) {
      return;
    }
    if (plans.size() > kPlanCapacity) {
      plans.erase(recency.back());
      recency.pop_back();
    }
  }
};

namespace {

fmlp_status lt_failure(const char *call, cublasStatus_t status, const fmlp_cuda_problem &problem,
                       fmlp_cuda_epilogue epilogue) {
  char text[128];
  snprintf(text, sizeof(text), "%s (%d), epilogue %d", cublasLtGetStatusName(status),
           static_cast<int>(status), static_cast<int>(epilogue));
  fmlp_cuda_record_failure(call, text, &problem);
  return FMLP_ERR_BACKEND;
}

#define FMLP_LT_CHECK(name, call)                                               \
  do {                                                                          \
    const cublasStatus_t lt_status = (call);                                    \
    if (lt_status != CUBLAS_STATUS_SUCCESS) {                                   \
      return lt_failure(name, lt_status, problem, epilogue);                    \
    }                                                                           \
  } while (0)

cublasLtEpilogue_t lt_epilogue(fmlp_cuda_epilogue epilogue) {
  switch (epilogue) {
    case FMLP_CUDA_EPILOGUE_DEFAULT: return CUBLASLT_EPILOGUE_DEFAULT;
    case FMLP_CUDA_EPILOGUE_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case FMLP_CUDA_EPILOGUE_GELU: return CUBLASLT_EPILOGUE_GELU;
    case FMLP_CUDA_EPILOGUE_GELU_BIAS: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case FMLP_CUDA_EPILOGUE_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX;
    case FMLP_CUDA_EPILOGUE_GELU_AUX_BIAS: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Row-major y[m, n] = x[m, k] @ w[n, k].T is, column-major,
// y.T[n, m] = op_T(w as a k x n matrix) @ (x as a k x m matrix).
struct Descriptors {
  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatrixLayoutOpaque_t w_storage, x_storage, y_storage;
  cublasLtMatmulDesc_t op = &op_storage;
  cublasLtMatrixLayout_t w = &w_storage, x = &x_storage, y = &y_storage;
};

fmlp_status set_batch(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride,
                      const fmlp_cuda_problem &problem, fmlp_cuda_epilogue epilogue) {
  if (batch == 1) return FMLP_OK;
  const int32_t count = static_cast<int32_t>(batch);
  FMLP_LT_CHECK("cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)",
                cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                 &count, sizeof(count)));
  FMLP_LT_CHECK("cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)",
                cublasLtMatrixLayoutSetAttribute(
                    layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                    sizeof(stride)));
  return FMLP_OK;
}

fmlp_status describe(const fmlp_cuda_linear_args *a, cublasComputeType_t compute,
                     const fmlp_cuda_problem &problem, fmlp_cuda_epilogue epilogue,
                     Descriptors *d) {
  const cudaDataType_t type = fmlp_cuda_data_type(a->dtype);
  FMLP_LT_CHECK("cublasLtMatmulDescInit", cublasLtMatmulDescInit(d->op, compute, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
  FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(TRANSA)",
                cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                               sizeof(transpose)));
  FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(TRANSB)",
                cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose,
                                               sizeof(no_transpose)));
  const cublasLtEpilogue_t lt = lt_epilogue(epilogue);
  FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE)",
                cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt,
                                               sizeof(lt)));
  if (a->bias != nullptr) {
    FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
                  cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &a->bias, sizeof(a->bias)));
    if (a->batch > 1) {
      FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(BIAS_BATCH_STRIDE)",
                    cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                   &a->bias_batch_stride,
                                                   sizeof(a->bias_batch_stride)));
    }
  }
  if (a->pre != nullptr) {  // GELU_AUX(_BIAS): the pre-activation, row-major m x n
    const int64_t aux_ld = a->n;
    FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)",
                  cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                 &a->pre, sizeof(a->pre)));
    FMLP_LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)",
                  cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                 &aux_ld, sizeof(aux_ld)));
  }
  FMLP_LT_CHECK("cublasLtMatrixLayoutInit(w)",
                cublasLtMatrixLayoutInit(d->w, type, a->k, a->n, a->w_row_stride));
  FMLP_LT_CHECK("cublasLtMatrixLayoutInit(x)",
                cublasLtMatrixLayoutInit(d->x, type, a->k, a->m, a->x_row_stride));
  FMLP_LT_CHECK("cublasLtMatrixLayoutInit(y)",
                cublasLtMatrixLayoutInit(d->y, type, a->n, a->m, a->y_row_stride));
  fmlp_status status = set_batch(d->w, a->batch, a->w_batch_stride, problem, epilogue);
  if (status == FMLP_OK) status = set_batch(d->x, a->batch, 0, problem, epilogue);
  if (status == FMLP_OK) status = set_batch(d->y, a->batch, a->y_batch_stride, problem, epilogue);
  return status;
}

PlanKey key_for(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a,
                cublasComputeType_t compute, fmlp_cuda_epilogue epilogue) {
  PlanKey key;
  memset(&key, 0, sizeof(key));
  const int64_t size = fmlp_cuda_element_size(a->dtype);
  const bool batched = a->batch > 1;
  key.device = env->device;
  key.dtype = a->dtype;
  key.epilogue = epilogue;
  key.compute = compute;
  key.m = a->m;
  key.n = a->n;
  key.k = a->k;
  key.batch = a->batch;
  key.x_row_stride = a->x_row_stride;
  key.w_row_stride = a->w_row_stride;
  key.y_row_stride = a->y_row_stride;
  key.aux_ld = a->pre != nullptr ? a->n : 0;
  key.w_batch_stride = batched ? a->w_batch_stride : 0;
  key.bias_batch_stride = batched ? a->bias_batch_stride : 0;
  key.y_batch_stride = batched ? a->y_batch_stride : 0;
  key.workspace_bytes = env->workspace_bytes;
  key.align_x = fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(a->x), 0);
  key.align_w = fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(a->w), key.w_batch_stride * size);
  key.align_y = fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(a->y), key.y_batch_stride * size);
  key.align_bias = a->bias == nullptr ? 0
                                      : fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(a->bias),
                                                            key.bias_batch_stride * size);
  key.align_aux = a->pre == nullptr ? 0 : fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(a->pre), 0);
  return key;
}

// Asks the heuristic for the best algorithm; plan->found == false when it has none.
fmlp_status choose(const fmlp_cuda_env *env, const PlanKey &key, const Descriptors &d,
                   const fmlp_cuda_problem &problem, fmlp_cuda_epilogue epilogue, Plan *plan) {
  cublasLtMatmulPreferenceOpaque_t preference_storage;
  const cublasLtMatmulPreference_t preference = &preference_storage;
  FMLP_LT_CHECK("cublasLtMatmulPreferenceInit", cublasLtMatmulPreferenceInit(preference));
  const uint64_t workspace = static_cast<uint64_t>(env->workspace_bytes);
  const struct {
    cublasLtMatmulPreferenceAttributes_t attribute;
    uint32_t bytes;
  } alignments[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_w},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_x},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_y},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_y}};
  FMLP_LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
                cublasLtMatmulPreferenceSetAttribute(preference,
                                                     CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &workspace, sizeof(workspace)));
  for (const auto &alignment : alignments) {
    FMLP_LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)",
                  cublasLtMatmulPreferenceSetAttribute(preference, alignment.attribute,
                                                       &alignment.bytes,
                                                       sizeof(alignment.bytes)));
  }
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      env->handle, d.op, d.w, d.x, d.y, d.y, preference, 1, &result, &found);
  // NOT_SUPPORTED: "no heuristic function available for current configuration";
  // INVALID_VALUE: what PyTorch saw for shapes its Lt path now avoids (Blas.cpp), as our
  // routing does. Either way the caller's fallback computes the same result.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
      (status == CUBLAS_STATUS_SUCCESS && found < 1)) {
    plan->found = false;
    return FMLP_OK;
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    return lt_failure("cublasLtMatmulAlgoGetHeuristic", status, problem, epilogue);
  }
  plan->found = true;
  plan->algo = result.algo;
  return FMLP_OK;
}

}  // namespace

fmlp_status fmlp_cuda_lt_matmul(const fmlp_cuda_env *env, const fmlp_cuda_linear_args *a) {
  const fmlp_cuda_problem problem = fmlp_cuda_problem_of(a);
  fmlp_cuda_epilogue epilogue;
  if (!fmlp_cuda_epilogue_for(a->activation, a->bias != nullptr, a->pre != nullptr, a->n,
                              &epilogue)) {
    fmlp_cuda_record_failure("fmlp_cuda_lt_matmul", "no cuBLASLt epilogue for this activation",
                             &problem);
    return FMLP_ERR_UNSUPPORTED;
  }
  const cublasComputeType_t compute = a->dtype == FMLP_F32 && env->allow_tf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  Descriptors d;
  fmlp_status status = describe(a, compute, problem, epilogue, &d);
  if (status != FMLP_OK) return status;
  const PlanKey key = key_for(env, a, compute, epilogue);
  Plan plan;
  if (!env->plans->find(key, &plan)) {
    status = choose(env, key, d, problem, epilogue, &plan);
    if (status != FMLP_OK) return status;
    env->plans->insert(key, plan);
  }
  if (!plan.found) {
    fmlp_cuda_record_failure("cublasLtMatmulAlgoGetHeuristic", "no algorithm", &problem);
    return FMLP_ERR_UNSUPPORTED;
  }
  const float alpha = 1.f, beta = 0.f;
  FMLP_LT_CHECK("cublasLtMatmul",
                cublasLtMatmul(env->handle, d.op, &alpha, a->w, d.w, a->x, d.x, &beta, a->y, d.y,
                               a->y, d.y, &plan.algo, env->workspace,
                               static_cast<size_t>(env->workspace_bytes), env->stream));
  return FMLP_OK;
}

extern "C" {

fmlp_status fmlp_cuda_plan_cache_create(fmlp_cuda_plan_cache **cache) {
  fmlp_cuda_plan_cache *created = new (std::nothrow) fmlp_cuda_plan_cache();
  if (created == nullptr) return FMLP_ERR_OUT_OF_MEMORY;
  *cache = created;
  return FMLP_OK;
}

void fmlp_cuda_plan_cache_destroy(fmlp_cuda_plan_cache *cache) { delete cache; }

}  // extern "C"
