/* See fusedmlp/cuda_routing.h. No CUDA here: every function is a decision on sizes and addresses. */
#include "fusedmlp/cuda_routing.h"

#include <stdio.h>
#include <string.h>

/* The epilogue families of activations.def's CUBLASLT column. */
static int lt_epilogue_DEFAULT(int has_bias, int saves_pre, int64_t n,
                               fmlp_cuda_epilogue *epilogue) {
  (void)n; /* nothing to save: the output is the pre-activation */
  *epilogue = has_bias ? FMLP_CUDA_EPILOGUE_BIAS : FMLP_CUDA_EPILOGUE_DEFAULT;
  return !saves_pre;
}

static int lt_epilogue_GELU(int has_bias, int saves_pre, int64_t n,
                            fmlp_cuda_epilogue *epilogue) {
  if (!saves_pre) {
    *epilogue = has_bias ? FMLP_CUDA_EPILOGUE_GELU_BIAS : FMLP_CUDA_EPILOGUE_GELU;
    return 1;
  }
  /* the aux buffer is the saved pre-activation, leading dimension n */
  *epilogue = has_bias ? FMLP_CUDA_EPILOGUE_GELU_AUX_BIAS : FMLP_CUDA_EPILOGUE_GELU_AUX;
  return n % 8 == 0;
}

static int lt_epilogue_OWN(int has_bias, int saves_pre, int64_t n,
                           fmlp_cuda_epilogue *epilogue) {
  (void)has_bias, (void)saves_pre, (void)n, (void)epilogue;
  return 0;
}

int fmlp_cuda_epilogue_for(fmlp_activation activation, int has_bias, int saves_pre, int64_t n,
                           fmlp_cuda_epilogue *epilogue) {
  switch (activation) {
#define FMLP_ACTIVATION(id, name, cublaslt, derivative) \
  case FMLP_ACT_##id: return lt_epilogue_##cublaslt(has_bias, saves_pre, n, epilogue);
#include "fusedmlp/activations.def"
    case FMLP_ACT_COUNT: return 0;
  }
  return 0;
}

static int lt_dimension_ok(int64_t size) { return size > 1 && size < FMLP_CUDA_LT_MAX_DIM; }

fmlp_cuda_route fmlp_cuda_route_for(const fmlp_cuda_problem *p) {
  if (p->m == 0 || p->n == 0) return FMLP_CUDA_ROUTE_NOTHING;
  if (p->k == 0) return p->batch == 1 ? FMLP_CUDA_ROUTE_FILL : FMLP_CUDA_ROUTE_UNSUPPORTED;
  fmlp_cuda_epilogue epilogue;
  const int lt_ok = lt_dimension_ok(p->m) && lt_dimension_ok(p->n) && lt_dimension_ok(p->k);
  if (lt_ok && fmlp_cuda_epilogue_for(p->activation, p->has_bias, p->saves_pre, p->n,
                                      &epilogue)) {
    return FMLP_CUDA_ROUTE_LT_EPILOGUE;
  }
  if (p->batch != 1) return FMLP_CUDA_ROUTE_UNSUPPORTED;
  return lt_ok ? FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION : FMLP_CUDA_ROUTE_GEMM_THEN_ACTIVATION;
}

fmlp_status fmlp_cuda_check_limits(const fmlp_cuda_problem *p, int64_t x_row_stride,
                                   int64_t w_row_stride, int64_t y_row_stride) {
  const char *too_large = NULL;
  if (p->n > FMLP_CUDA_GEMM_MAX_DIM) too_large = "n (output features)";
  else if (p->k > FMLP_CUDA_GEMM_MAX_DIM) too_large = "k (input features)";
  else if (x_row_stride > FMLP_CUDA_GEMM_MAX_DIM) too_large = "the row stride of x";
  else if (w_row_stride > FMLP_CUDA_GEMM_MAX_DIM) too_large = "the row stride of the weight";
  else if (y_row_stride > FMLP_CUDA_GEMM_MAX_DIM) too_large = "the row stride of the output";
  if (too_large == NULL) return FMLP_OK;
  char status[160];
  snprintf(status, sizeof(status), "%s exceeds %lld, the largest size cuBLAS takes", too_large,
           (long long)FMLP_CUDA_GEMM_MAX_DIM);
  fmlp_cuda_record_failure("size check", status, p);
  return FMLP_ERR_UNSUPPORTED;
}

uint32_t fmlp_cuda_alignment(uintptr_t address, int64_t batch_stride_bytes) {
  /* a batch stride of 0 (a shared matrix) or a single matrix constrains nothing */
  const uint64_t stride = batch_stride_bytes < 0 ? (uint64_t)(-batch_stride_bytes)
                                                 : (uint64_t)batch_stride_bytes;
  uint32_t bytes = 256;
  while (bytes > 1 && ((uint64_t)address % bytes != 0 || stride % bytes != 0)) bytes /= 2;
  return bytes;
}

int fmlp_cuda_gate_up_batchable(const fmlp_cuda_gate_up *g, int64_t *w_batch_stride,
                                int64_t *bias_batch_stride) {
  const fmlp_cuda_problem batched = {.m = g->rows,
                                     .n = g->hidden,
                                     .k = g->dim,
                                     .batch = 2,
                                     .activation = FMLP_ACT_NONE,
                                     .has_bias = g->bias_gate != 0};
  if (fmlp_cuda_route_for(&batched) != FMLP_CUDA_ROUTE_LT_EPILOGUE) return 0;
  if (g->w_gate_row_stride != g->w_up_row_stride) return 0;
  if ((g->bias_gate != 0) != (g->bias_up != 0)) return 0;
  if (g->w_up <= g->w_gate) return 0;
  const uintptr_t w_distance = g->w_up - g->w_gate;
  if (w_distance % 16 != 0 || w_distance % (uintptr_t)g->element_size != 0) return 0;
  /* rows, hidden < 65535 * 32 (the route above): no overflow */
  if ((g->rows * g->hidden * g->element_size) % 16 != 0) return 0;
  int64_t bias_stride = 0;
  if (g->bias_gate != 0) {
    if (g->bias_up <= g->bias_gate) return 0;
    const uintptr_t b_distance = g->bias_up - g->bias_gate;
    if (b_distance % 16 != 0 || b_distance % (uintptr_t)g->element_size != 0) return 0;
    bias_stride = (int64_t)(b_distance / (uintptr_t)g->element_size);
  }
  *w_batch_stride = (int64_t)(w_distance / (uintptr_t)g->element_size);
  *bias_batch_stride = bias_stride;
  return 1;
}

/* ---- failure detail ---- */

static _Thread_local char error_detail[512];

const char *fmlp_cuda_error_detail(void) { return error_detail; }

void fmlp_cuda_clear_error(void) { error_detail[0] = '\0'; }

void fmlp_cuda_record_failure(const char *call, const char *status,
                              const fmlp_cuda_problem *problem) {
  char shape[200] = "";
  if (problem != NULL) fmlp_cuda_describe_problem(problem, shape, sizeof(shape));
  snprintf(error_detail, sizeof(error_detail), "%s failed: %s%s%s", call, status,
           problem != NULL ? " for " : "", shape);
}

void fmlp_cuda_describe_problem(const fmlp_cuda_problem *p, char *buffer, size_t size) {
  snprintf(buffer, size, "m=%lld, n=%lld, k=%lld, batch=%lld, dtype=%s, activation=%s%s%s",
           (long long)p->m, (long long)p->n, (long long)p->k, (long long)p->batch,
           fmlp_cuda_dtype_name(p->dtype), fmlp_cuda_activation_name(p->activation),
           p->has_bias ? ", bias" : "", p->saves_pre ? ", saving the pre-activation" : "");
}

const char *fmlp_cuda_activation_name(fmlp_activation activation) {
  switch (activation) {
#define FMLP_ACTIVATION(id, name, cublaslt, derivative) \
  case FMLP_ACT_##id: return #name;
#include "fusedmlp/activations.def"
    case FMLP_ACT_COUNT: break;
  }
  return "unknown";
}

const char *fmlp_cuda_dtype_name(fmlp_dtype dtype) {
  switch (dtype) {
    case FMLP_F32: return "float32";
    case FMLP_F64: return "float64";
    case FMLP_BF16: return "bfloat16";
    case FMLP_F16: return "float16";
  }
  return "unknown";
}
