/* The CUDA path's decisions that need no GPU (csrc/cuda/routing.c): routing of odd and
 * huge shapes, the epilogue per activation, the alignments cuBLASLt is told (the plan
 * cache keys on them), the batched gate/up decision, the size limits and the failure
 * text. Built and run by tests/test_cuda_routing.py on any machine; prints one line
 * per failed check and exits non-zero if any failed. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fusedmlp/cuda_routing.h"

static int failures = 0;

#define CHECK(condition)                                                 \
  do {                                                                   \
    if (!(condition)) {                                                  \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #condition); \
      ++failures;                                                        \
    }                                                                    \
  } while (0)

static fmlp_cuda_problem problem(int64_t m, int64_t n, int64_t k, fmlp_activation activation) {
  fmlp_cuda_problem p;
  memset(&p, 0, sizeof(p));
  p.dtype = FMLP_BF16;
  p.m = m;
  p.n = n;
  p.k = k;
  p.batch = 1;
  p.activation = activation;
  p.has_bias = 1;
  return p;
}

static fmlp_cuda_route route(int64_t m, int64_t n, int64_t k, fmlp_activation activation) {
  const fmlp_cuda_problem p = problem(m, n, k, activation);
  return fmlp_cuda_route_for(&p);
}

/* Finding 3: an empty output computes nothing, whatever the activation (a (rows, 0)
 * output used to be refused as "invalid argument" for gelu and silu). */
static void test_empty_outputs(void) {
  for (int a = 0; a < FMLP_ACT_COUNT; ++a) {
    CHECK(route(7, 0, 17, (fmlp_activation)a) == FMLP_CUDA_ROUTE_NOTHING);
    CHECK(route(0, 5, 17, (fmlp_activation)a) == FMLP_CUDA_ROUTE_NOTHING);
    CHECK(route(7, 0, 0, (fmlp_activation)a) == FMLP_CUDA_ROUTE_NOTHING);
    CHECK(route(7, 5, 0, (fmlp_activation)a) == FMLP_CUDA_ROUTE_FILL);
  }
  fmlp_cuda_problem batched = problem(7, 5, 0, FMLP_ACT_NONE);
  batched.batch = 2;
  CHECK(fmlp_cuda_route_for(&batched) == FMLP_CUDA_ROUTE_UNSUPPORTED);
}

/* Finding 4: a dimension of 1 (or of 65535 * 32 and more) stays off cuBLASLt, as
 * PyTorch's addmm keeps it: the classic GEMM, then our activation. */
static void test_odd_shapes_leave_cublaslt(void) {
  const int64_t big = FMLP_CUDA_LT_MAX_DIM;
  const int64_t shapes[][3] = {{1, 16, 24}, {15, 1, 3}, {26, 5, 1}, {big, 8, 8}, {8, big, 8},
                               {8, 8, big}};
  for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); ++s) {
    for (int a = 0; a < FMLP_ACT_COUNT; ++a) {
      CHECK(route(shapes[s][0], shapes[s][1], shapes[s][2], (fmlp_activation)a) ==
            FMLP_CUDA_ROUTE_GEMM_THEN_ACTIVATION);
    }
  }
  CHECK(route(2, 2, 2, FMLP_ACT_NONE) == FMLP_CUDA_ROUTE_LT_EPILOGUE);
  CHECK(route(big - 1, 2, 2, FMLP_ACT_NONE) == FMLP_CUDA_ROUTE_LT_EPILOGUE);
  fmlp_cuda_problem batched = problem(1, 16, 24, FMLP_ACT_NONE);
  batched.batch = 2;
  CHECK(fmlp_cuda_route_for(&batched) == FMLP_CUDA_ROUTE_UNSUPPORTED);
}

/* Finding 5 and the GELU_AUX cost item: only the identity and the tanh GELU go into
 * cuBLASLt's epilogue (its ReLU maps NaN to 0); the tanh GELU saves its input as aux when
 * the leading dimension allows. */
static void test_epilogue_per_activation(void) {
  fmlp_cuda_epilogue e;
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_NONE, 1, 0, 16, &e) && e == FMLP_CUDA_EPILOGUE_BIAS);
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_NONE, 0, 0, 16, &e) && e == FMLP_CUDA_EPILOGUE_DEFAULT);
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_GELU_TANH, 1, 0, 3, &e) &&
        e == FMLP_CUDA_EPILOGUE_GELU_BIAS);
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_GELU_TANH, 0, 0, 3, &e) && e == FMLP_CUDA_EPILOGUE_GELU);
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_GELU_TANH, 1, 1, 16, &e) &&
        e == FMLP_CUDA_EPILOGUE_GELU_AUX_BIAS);
  CHECK(fmlp_cuda_epilogue_for(FMLP_ACT_GELU_TANH, 0, 1, 16, &e) &&
        e == FMLP_CUDA_EPILOGUE_GELU_AUX);
  CHECK(!fmlp_cuda_epilogue_for(FMLP_ACT_GELU_TANH, 1, 1, 12, &e)); /* aux ld % 8 */
  CHECK(!fmlp_cuda_epilogue_for(FMLP_ACT_RELU, 1, 0, 16, &e));
  CHECK(!fmlp_cuda_epilogue_for(FMLP_ACT_GELU, 1, 0, 16, &e));
  CHECK(!fmlp_cuda_epilogue_for(FMLP_ACT_SILU, 1, 0, 16, &e));
  CHECK(route(64, 64, 64, FMLP_ACT_RELU) == FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION);
  CHECK(route(64, 64, 64, FMLP_ACT_GELU) == FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION);
  CHECK(route(64, 64, 64, FMLP_ACT_SILU) == FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION);
  CHECK(route(64, 64, 64, FMLP_ACT_GELU_TANH) == FMLP_CUDA_ROUTE_LT_EPILOGUE);
  fmlp_cuda_problem saving = problem(64, 12, 64, FMLP_ACT_GELU_TANH);
  saving.saves_pre = 1;
  CHECK(fmlp_cuda_route_for(&saving) == FMLP_CUDA_ROUTE_LT_THEN_ACTIVATION);
  saving.n = 16;
  CHECK(fmlp_cuda_route_for(&saving) == FMLP_CUDA_ROUTE_LT_EPILOGUE);
}

/* Findings 1 and 2, and the 256-byte hint: the alignment of every matrix of an operand. */
static void test_alignment(void) {
  CHECK(fmlp_cuda_alignment(0x10000, 0) == 256);
  CHECK(fmlp_cuda_alignment(0x10000 + 2, 0) == 2); /* a bf16 bias view b[1:] */
  CHECK(fmlp_cuda_alignment(0x10000 + 4, 0) == 4); /* an fp32 bias view b[1:] */
  CHECK(fmlp_cuda_alignment(0x10000 + 128, 0) == 128);
  CHECK(fmlp_cuda_alignment(0x10001, 0) == 1);
  /* batched: hidden 3 x 15 rows in fp32 is 180 bytes apart: 4-byte aligned, not 16 */
  CHECK(fmlp_cuda_alignment(0x10000, 3 * 15 * 4) == 4);
  /* hidden 7 x 6 rows in fp32: 168 bytes */
  CHECK(fmlp_cuda_alignment(0x10000, 7 * 6 * 4) == 8);
  CHECK(fmlp_cuda_alignment(0x10000, 4096 * 64 * 2) == 256);
}

static fmlp_cuda_gate_up gate_up(int64_t rows, int64_t hidden, int64_t dim, int64_t size) {
  fmlp_cuda_gate_up g;
  memset(&g, 0, sizeof(g));
  g.w_gate = 0x100000;
  g.w_up = g.w_gate + (uintptr_t)(hidden * dim * size);
  g.w_gate_row_stride = g.w_up_row_stride = dim;
  g.rows = rows;
  g.hidden = hidden;
  g.dim = dim;
  g.element_size = size;
  return g;
}

/* Finding 2: the output's batch stride must be 16-byte aligned too. */
static void test_gate_up_batching(void) {
  int64_t w_stride = -1, b_stride = -1;
  fmlp_cuda_gate_up g = gate_up(64, 32, 16, 4);
  CHECK(fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  CHECK(w_stride == 32 * 16 && b_stride == 0);
  g = gate_up(15, 3, 16, 4); /* output batch stride 180 bytes */
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  g = gate_up(6, 7, 16, 4); /* 168 bytes */
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  g = gate_up(64, 32, 16, 2);
  g.bias_gate = 0x200000;
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride)); /* one bias only */
  g.bias_up = g.bias_gate + 32 * 2;
  CHECK(fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride) && b_stride == 32);
  g.bias_up = g.bias_gate + 34; /* not a multiple of 16 bytes */
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  g = gate_up(64, 32, 16, 4);
  g.w_up = g.w_gate - 32 * 16 * 4; /* up before gate */
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  g = gate_up(64, 32, 16, 4);
  g.w_up_row_stride = 32;
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
  g = gate_up(1, 32, 16, 4); /* one row: off cuBLASLt, so two GEMMs */
  CHECK(!fmlp_cuda_gate_up_batchable(&g, &w_stride, &b_stride));
}

/* Finding 8: sizes beyond cuBLAS's int are a clear error naming what is too large. */
static void test_limits(void) {
  const fmlp_cuda_problem ok = problem((int64_t)1 << 40, 8, 8, FMLP_ACT_NONE);
  CHECK(fmlp_cuda_check_limits(&ok, 8, 8, 8) == FMLP_OK); /* rows run in chunks */
  const fmlp_cuda_problem wide = problem(4, (int64_t)INT32_MAX + 1, 8, FMLP_ACT_NONE);
  fmlp_cuda_clear_error();
  CHECK(fmlp_cuda_check_limits(&wide, 8, 8, (int64_t)INT32_MAX + 1) == FMLP_ERR_UNSUPPORTED);
  CHECK(strstr(fmlp_cuda_error_detail(), "n (output features) exceeds 2147483647") != NULL);
  const fmlp_cuda_problem deep = problem(4, 8, (int64_t)INT32_MAX + 1, FMLP_ACT_NONE);
  CHECK(fmlp_cuda_check_limits(&deep, (int64_t)INT32_MAX + 1, (int64_t)INT32_MAX + 1, 8) ==
        FMLP_ERR_UNSUPPORTED);
  CHECK(strstr(fmlp_cuda_error_detail(), "k (input features)") != NULL);
  CHECK(fmlp_cuda_check_limits(&ok, (int64_t)INT32_MAX + 1, 8, 8) == FMLP_ERR_UNSUPPORTED);
  CHECK(strstr(fmlp_cuda_error_detail(), "the row stride of x") != NULL);
}

/* Finding 6: a failure names the call, the status and the shapes. */
static void test_failure_text(void) {
  fmlp_cuda_problem p = problem(15, 3, 24, FMLP_ACT_GELU_TANH);
  p.batch = 2;
  fmlp_cuda_clear_error();
  CHECK(strcmp(fmlp_cuda_error_detail(), "") == 0);
  fmlp_cuda_record_failure("cublasLtMatmul", "CUBLAS_STATUS_NOT_SUPPORTED (15)", &p);
  CHECK(strcmp(fmlp_cuda_error_detail(),
               "cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED (15) for m=15, n=3, k=24, "
               "batch=2, dtype=bfloat16, activation=gelu_tanh, bias") == 0);
  fmlp_cuda_record_failure("launch of the gate product kernel on 12 float32 elements",
                           "cudaErrorInvalidValue (invalid argument)", NULL);
  CHECK(strcmp(fmlp_cuda_error_detail(),
               "launch of the gate product kernel on 12 float32 elements failed: "
               "cudaErrorInvalidValue (invalid argument)") == 0);
  for (int a = 0; a < FMLP_ACT_COUNT; ++a) {
    CHECK(strcmp(fmlp_cuda_activation_name((fmlp_activation)a), "unknown") != 0);
  }
}

int main(void) {
  test_empty_outputs();
  test_odd_shapes_leave_cublaslt();
  test_epilogue_per_activation();
  test_alignment();
  test_gate_up_batching();
  test_limits();
  test_failure_text();
  printf("test_cuda_routing: %d failed checks\n", failures);
  return failures == 0 ? 0 : 1;
}
