/* Plain-C tests of the CPU kernel API against a naive double-precision
 * reference: every activation, bias on/off, strided and transposed operands,
 * sizes that hit every edge-tile case, K = 0, serial and chunked threading.
 * Built with -fsanitize=address,undefined by tests/test_c_kernels.py. */
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv, strdup */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cache_sizes.h"
#include "fusedmlp/cpu.h"
#include "memory.h"
#include "reference.h"

typedef struct {
  int passed, failed;
} tally;

/* A deterministic value in [-1, 1) for element i of a matrix seeded by seed. */
static double sample(uint64_t seed, int64_t i) {
  uint64_t h = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return (double)(h >> 11) / (double)(1ull << 52) - 1.0;
}

/* Runs tasks in reverse chunks of one, so blocks must be independent. */
static void reversed_parallel_for(void *pool, int64_t n_tasks, void *context, fmlp_task_fn fn) {
  (void)pool;
  for (int64_t t = n_tasks - 1; t >= 0; --t) fn(context, t, t + 1);
}

static size_t elem_size(fmlp_dtype dtype) {
  return dtype == FMLP_F64 ? sizeof(double) : dtype == FMLP_BF16 ? sizeof(fmlp_bf16) : sizeof(float);
}

/* A matrix of rows x cols in either layout, filled from seed. Returns the
 * buffer (caller frees) and the strides through *input. */
static void *make_matrix(fmlp_dtype dtype, int64_t rows, int64_t cols, int transposed,
                         uint64_t seed, fmlp_input *input) {
  const size_t elem = elem_size(dtype);
  void *data = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * elem);
  input->data = data;
  input->row_stride = transposed ? 1 : cols;
  input->col_stride = transposed ? rows : 1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = r * input->row_stride + c * input->col_stride;
      const double v = sample(seed, r * cols + c);
      if (dtype == FMLP_F64) ((double *)data)[at] = v;
      else if (dtype == FMLP_BF16) ((fmlp_bf16 *)data)[at] = fmlp_float_to_bf16((float)v);
      else ((float *)data)[at] = (float)v;
    }
  }
  return data;
}

static double element(fmlp_dtype dtype, const void *data, int64_t at) {
  switch (dtype) {
    case FMLP_F64: return ((const double *)data)[at];
    case FMLP_BF16: return fmlp_bf16_to_float(((const fmlp_bf16 *)data)[at]);
    default: return ((const float *)data)[at];
  }
}

/* bfloat16 rounds every stored value to 8 bits (2^-8 relative), and the
 * reference keeps the intermediates (hidden layers, gradients) it rounds:
 * errors grow as the square root of the terms summed. */
static double tolerance(fmlp_dtype dtype, int64_t k) {
  if (dtype == FMLP_BF16) return 8e-3 * sqrt((double)(k + 4));
  return (dtype == FMLP_F64 ? 1e-12 : 2e-6) * (double)(k + 4);
}

/* tolerance for a sum of terms whose magnitudes add up to `magnitude`: bfloat16
 * rounds each stored term (a gated block's product), so its error follows the
 * terms, not the sum, which may cancel. */
static double sum_tolerance(fmlp_dtype dtype, int64_t k, double want, double magnitude) {
  const double tol = tolerance(dtype, k);
  return dtype == FMLP_BF16 ? tol * (1 + magnitude) / (1 + fabs(want)) : tol;
}

static void check_close(tally *t, const char *what, double got, double want, double tol) {
  if (fabs(got - want) <= tol * (1 + fabs(want)) || (isnan(got) && isnan(want))) return;
  if (t->failed < 20) fprintf(stderr, "FAIL %s: got %.9g want %.9g\n", what, got, want);
  t->failed++;
}

/* One fused linear layer vs the reference. */
static void test_linear(tally *t, fmlp_dtype dtype, int64_t m, int64_t n, int64_t k,
                        fmlp_activation act, int with_bias, int transposed,
                        const fmlp_threading *threading) {
  fmlp_input x, w;
  void *x_data = make_matrix(dtype, m, k, transposed, 1, &x);
  void *w_data = make_matrix(dtype, n, k, !transposed, 2, &w);
  fmlp_input b_in;
  void *b_data = make_matrix(dtype, 1, n, 0, 3, &b_in);
  const size_t elem = elem_size(dtype);
  void *y = malloc((size_t)(m * n > 0 ? m * n : 1) * elem);
  void *pre = malloc((size_t)(m * n > 0 ? m * n : 1) * elem);
  const int64_t widths[2] = {k, n};
  const void *biases[1] = {with_bias ? b_data : NULL};
  void *saved_pre[1] = {pre};
  const fmlp_cpu_chain_args args = {
      .dtype = dtype, .rows = m, .n_layers = 1, .widths = widths, .x = x, .weights = &w,
      .biases = biases, .hidden_activation = act, .final_activation = act, .y = y,
      .y_row_stride = n, .saved_pre = saved_pre, .saved_hidden = NULL};
  const fmlp_status status = fmlp_cpu_chain(&args, threading);
  char what[160];
  snprintf(what, sizeof what, "linear dtype=%d m=%lld n=%lld k=%lld act=%d bias=%d t=%d", dtype,
           (long long)m, (long long)n, (long long)k, act, with_bias, transposed);
  if (status != FMLP_OK) {
    fprintf(stderr, "FAIL %s: status %s\n", what, fmlp_status_string(status));
    t->failed++;
  } else {
    const int before = t->failed;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double z = with_bias ? element(dtype, b_data, j) : 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          z += element(dtype, x_data, i * x.row_stride + kk * x.col_stride) *
               element(dtype, w_data, j * w.row_stride + kk * w.col_stride);
        }
        check_close(t, what, element(dtype, pre, i * n + j), z, tolerance(dtype, k));
        check_close(t, what, element(dtype, y, i * n + j), reference_activation(z, act),
                    tolerance(dtype, k));
      }
    }
    if (t->failed == before) t->passed++;
  }
  free(pre);
  free(y);
  free(b_data);
  free(w_data);
  free(x_data);
}

/* A three-layer chain equals three single layers run one after another. */
static void test_chain_matches_layers(tally *t, fmlp_dtype dtype, int64_t m,
                                      const int64_t widths[4], const fmlp_threading *threading) {
  fmlp_input x, w[3];
  void *x_data = make_matrix(dtype, m, widths[0], 0, 10, &x);
  void *w_data[3];
  for (int l = 0; l < 3; ++l) w_data[l] = make_matrix(dtype, widths[l + 1], widths[l], 0, 20 + l, &w[l]);
  const size_t elem = elem_size(dtype);
  void *y = calloc((size_t)(m * widths[3] + 1), elem);
  void *step[3];
  for (int l = 0; l < 3; ++l) step[l] = calloc((size_t)(m * widths[l + 1] + 1), elem);
  const void *no_bias[3] = {NULL, NULL, NULL};
  const fmlp_cpu_chain_args chain = {
      .dtype = dtype, .rows = m, .n_layers = 3, .widths = widths, .x = x, .weights = w,
      .biases = no_bias, .hidden_activation = FMLP_ACT_GELU, .final_activation = FMLP_ACT_NONE,
      .y = y, .y_row_stride = widths[3]};
  fmlp_status status = fmlp_cpu_chain(&chain, threading);
  fmlp_input in = x;
  for (int l = 0; l < 3 && status == FMLP_OK; ++l) {
    const fmlp_cpu_chain_args one = {
        .dtype = dtype, .rows = m, .n_layers = 1, .widths = widths + l, .x = in,
        .weights = &w[l], .biases = no_bias,
        .hidden_activation = FMLP_ACT_NONE,
        .final_activation = l < 2 ? FMLP_ACT_GELU : FMLP_ACT_NONE,
        .y = step[l], .y_row_stride = widths[l + 1]};
    status = fmlp_cpu_chain(&one, NULL);
    in = (fmlp_input){step[l], widths[l + 1], 1};
  }
  const int before = t->failed;
  if (status != FMLP_OK) t->failed++;
  for (int64_t i = 0; i < m * widths[3] && status == FMLP_OK; ++i) {
    check_close(t, "chain vs layers", element(dtype, y, i), element(dtype, step[2], i),
                tolerance(dtype, 64));
  }
  if (t->failed == before) t->passed++;
  for (int l = 0; l < 3; ++l) free(step[l]), free(w_data[l]);
  free(y);
  free(x_data);
}

/* The gated block against its definition, and its saved tensors. */
static void test_gated(tally *t, fmlp_dtype dtype, int64_t m, int64_t dim, int64_t hidden,
                       fmlp_activation act, const fmlp_threading *threading) {
  fmlp_input x, wg, wu, wd, bias;
  void *x_data = make_matrix(dtype, m, dim, 0, 30, &x);
  void *wg_data = make_matrix(dtype, hidden, dim, 0, 31, &wg);
  void *wu_data = make_matrix(dtype, hidden, dim, 1, 32, &wu);
  void *wd_data = make_matrix(dtype, dim, hidden, 0, 33, &wd);
  void *b_data = make_matrix(dtype, 1, hidden, 0, 34, &bias);
  const size_t elem = elem_size(dtype);
  void *y = calloc((size_t)(m * dim + 1), elem);
  void *saved = calloc((size_t)(3 * m * hidden + 1), elem);
  const fmlp_cpu_gated_args args = {
      .dtype = dtype, .rows = m, .dim = dim, .hidden = hidden, .out_dim = dim, .x = x,
      .w_gate = wg, .w_up = wu, .w_down = wd, .bias_gate = b_data, .bias_up = NULL,
      .bias_down = NULL, .activation = act, .y = y, .y_row_stride = dim,
      .saved_gate = saved, .saved_up = (char *)saved + m * hidden * elem,
      .saved_product = (char *)saved + 2 * m * hidden * elem};
  const fmlp_status status = fmlp_cpu_gated(&args, threading);
  const int before = t->failed;
  if (status != FMLP_OK) t->failed++;
  double *product = calloc((size_t)(hidden + 1), sizeof(double));
  char what[96];
  snprintf(what, sizeof what, "gated output dtype=%d m=%lld dim=%lld hidden=%lld act=%d", dtype,
           (long long)m, (long long)dim, (long long)hidden, act);
  for (int64_t i = 0; i < m && status == FMLP_OK; ++i) {
    for (int64_t h = 0; h < hidden; ++h) {
      double g = element(dtype, b_data, h), u = 0;
      for (int64_t kk = 0; kk < dim; ++kk) {
        const double xv = element(dtype, x_data, i * dim + kk);
        g += xv * element(dtype, wg_data, h * wg.row_stride + kk * wg.col_stride);
        u += xv * element(dtype, wu_data, h * wu.row_stride + kk * wu.col_stride);
      }
      product[h] = reference_activation(g, act) * u;
      check_close(t, "gated saved gate", element(dtype, saved, i * hidden + h), g,
                  tolerance(dtype, dim));
    }
    for (int64_t j = 0; j < dim; ++j) {
      double z = 0, magnitude = 0;
      for (int64_t h = 0; h < hidden; ++h) {
        const double term = product[h] * element(dtype, wd_data, j * hidden + h);
        z += term;
        magnitude += fabs(term);
      }
      check_close(t, what, element(dtype, y, i * dim + j), z,
                  sum_tolerance(dtype, dim + hidden, z, magnitude));
    }
  }
  if (t->failed == before) t->passed++;
  free(product);
  free(saved);
  free(y);
  free(b_data), free(wd_data), free(wu_data), free(wg_data), free(x_data);
}

/* With no down projection (out_dim 0) the gated call stops at the product, which
 * must equal the product a full call saves. */
static void test_gated_product_stage(tally *t, int64_t m, const fmlp_threading *threading) {
  /* gate and up weights past the cache-resident limit: one block per thread */
  const int64_t dim = 1024, hidden = 2100;
  fmlp_input x, wg, wu, wd;
  void *x_data = make_matrix(FMLP_F32, m, dim, 0, 50, &x);
  void *wg_data = make_matrix(FMLP_F32, hidden, dim, 0, 51, &wg);
  void *wu_data = make_matrix(FMLP_F32, hidden, dim, 0, 52, &wu);
  void *wd_data = make_matrix(FMLP_F32, dim, hidden, 0, 53, &wd);
  float *y = calloc((size_t)(m * dim + 1), sizeof(float));
  float *full = calloc((size_t)(m * hidden + 1), sizeof(float));
  float *staged = calloc((size_t)(m * hidden + 1), sizeof(float));
  fmlp_cpu_gated_args args = {
      .dtype = FMLP_F32, .rows = m, .dim = dim, .hidden = hidden, .out_dim = dim, .x = x,
      .w_gate = wg, .w_up = wu, .w_down = wd, .activation = FMLP_ACT_SILU, .y = y,
      .y_row_stride = dim, .saved_product = full};
  fmlp_status status = fmlp_cpu_gated(&args, threading);
  args.out_dim = 0;
  args.w_down = (fmlp_input){NULL, 0, 1};
  args.y = NULL;
  args.saved_product = staged;
  if (status == FMLP_OK) status = fmlp_cpu_gated(&args, threading);
  const int before = t->failed;
  if (status != FMLP_OK) t->failed++;
  for (int64_t i = 0; i < m * hidden && status == FMLP_OK; ++i) {
    check_close(t, "gated product stage", staged[i], full[i], 0);
  }
  if (t->failed == before) t->passed++;
  free(staged), free(full), free(y);
  free(wd_data), free(wu_data), free(wg_data), free(x_data);
}

/* act'(z) from the backward kernel vs a central difference of the reference. */
static void test_activation_backward(tally *t, fmlp_dtype dtype, fmlp_activation act) {
  enum { n = 4099 };
  double pre[n], grad[n], out[n];
  for (int i = 0; i < n; ++i) pre[i] = 8.0 * sample(40, i), grad[i] = sample(41, i);
  if (dtype != FMLP_F64) return;
  const fmlp_threading serial = {NULL, NULL, 1};
  const fmlp_status status = fmlp_cpu_activation_backward(dtype, n, grad, pre, act, out, &serial);
  const int before = t->failed;
  if (status != FMLP_OK) t->failed++;
  for (int i = 0; i < n && status == FMLP_OK; ++i) {
    const double h = 1e-6;
    const double slope = act == FMLP_ACT_RELU
                             ? (pre[i] > 0 ? 1.0 : 0.0)
                             : (reference_activation(pre[i] + h, act) -
                                reference_activation(pre[i] - h, act)) / (2 * h);
    check_close(t, "activation backward", out[i], grad[i] * slope, 1e-7);
  }
  if (t->failed == before) t->passed++;
}

/* A copy of n values of dtype (caller frees). */
static void *copy_of(fmlp_dtype dtype, const void *data, int64_t n) {
  void *copy = malloc((size_t)n * elem_size(dtype));
  memcpy(copy, data, (size_t)n * elem_size(dtype));
  return copy;
}

/* The passes around a host GEMM, against the reference, split into tasks (past the
 * passes' parallel threshold) whose chunks end inside rows, with a ragged last chunk:
 * rows copied from the bias (row stride 0) and from a column-major matrix; act(pre)
 * out of place, leaving pre as it was, and in place; act(gate) * up out of place, then
 * over gate. */
static void test_epilogue_passes(tally *t, fmlp_dtype dtype, fmlp_activation act,
                                 const fmlp_threading *threading) {
  enum { rows = 3, cols = 87383, n = rows * cols };
  fmlp_input unused;
  void *pre_data = make_matrix(dtype, rows, cols, 0, 50, &unused);
  void *up_data = make_matrix(dtype, rows, cols, 0, 51, &unused);
  void *bias = make_matrix(dtype, 1, cols, 0, 52, &unused);
  fmlp_input column_major;
  void *columns = make_matrix(dtype, rows, cols, 1, 53, &column_major);
  void *pre = copy_of(dtype, pre_data, n), *in_place = copy_of(dtype, pre_data, n);
  void *gate = copy_of(dtype, pre_data, n), *over_gate = copy_of(dtype, pre_data, n);
  void *up = copy_of(dtype, up_data, n), *biased = copy_of(dtype, pre_data, n);
  void *out = malloc(n * elem_size(dtype)), *product = malloc(n * elem_size(dtype));
  void *copied = malloc(n * elem_size(dtype));
  const int before = t->failed;
  if (fmlp_cpu_copy_rows(dtype, rows, cols, (fmlp_input){bias, 0, 1}, biased, threading) !=
          FMLP_OK ||
      fmlp_cpu_copy_rows(dtype, rows, cols, column_major, copied, threading) != FMLP_OK ||
      fmlp_cpu_activation_forward(dtype, n, pre, act, out, threading) != FMLP_OK ||
      fmlp_cpu_activation_forward(dtype, n, in_place, act, in_place, threading) != FMLP_OK ||
      fmlp_cpu_gated_product(dtype, n, gate, up, act, product, threading) != FMLP_OK ||
      fmlp_cpu_gated_product(dtype, n, over_gate, up, act, over_gate, threading) != FMLP_OK) {
    t->failed++;
  }
  /* one rounding of each stored value: bfloat16's is 2^-9 relative */
  const double tol = dtype == FMLP_F64 ? 1e-12 : dtype == FMLP_BF16 ? 4e-3 : 1e-6;
  for (int64_t i = 0; i < n && t->failed == before; ++i) {
    const double z = element(dtype, pre_data, i), u = element(dtype, up_data, i);
    const double want = reference_activation(z, act);
    check_close(t, "bias rows", element(dtype, biased, i), element(dtype, bias, i % cols), 0);
    check_close(t, "rows copied", element(dtype, copied, i),
                element(dtype, columns, i / cols + i % cols * rows), 0);
    check_close(t, "activation forward", element(dtype, out, i), want, tol);
    check_close(t, "activation forward: pre as it was", element(dtype, pre, i), z, 0);
    check_close(t, "activation forward in place", element(dtype, in_place, i), want, tol);
    check_close(t, "gated product", element(dtype, product, i), want * u, tol);
    check_close(t, "gated product: gate as it was", element(dtype, gate, i), z, 0);
    check_close(t, "gated product: up as it was", element(dtype, up, i), u, 0);
    check_close(t, "gated product over gate", element(dtype, over_gate, i), want * u, tol);
  }
  if (t->failed == before) t->passed++;
  void *buffers[] = {pre_data, up_data, bias, columns, pre, in_place, gate, over_gate, up,
                     biased, copied, out, product};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; ++i) free(buffers[i]);
}

/* The bias gradients' column sums over a matrix in each layout and expanded from one
 * value (strides 0), split into tasks (past the parallel threshold) with a ragged last
 * column span, against sums in double. */
static void test_column_sums(tally *t, fmlp_dtype dtype, const fmlp_threading *threading) {
  enum { rows = 37, cols = 7100 };
  const double tol = dtype == FMLP_F64 ? 1e-12 : dtype == FMLP_BF16 ? 1e-2 : 1e-5;
  const int before = t->failed;
  for (int layout = 0; layout < 3; ++layout) {
    fmlp_input m;
    void *data = make_matrix(dtype, rows, cols, layout == 1, 60, &m);
    if (layout == 2) m.row_stride = m.col_stride = 0;
    void *sums = malloc(cols * elem_size(dtype));
    if (fmlp_cpu_column_sums(dtype, rows, cols, m, sums, threading) != FMLP_OK) {
      t->failed++;
      free(sums), free(data);
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) {
      double want = 0;
      for (int64_t i = 0; i < rows; ++i) {
        want += element(dtype, data, i * m.row_stride + j * m.col_stride);
      }
      check_close(t, "column sums", element(dtype, sums, j), want, tol);
    }
    free(sums), free(data);
  }
  if (t->failed == before) t->passed++;
}

/* Where GEMMs run: by default our kernels only for a dtype whose unit is at a level measured
 * to beat eager (float32 and bfloat16 on x86 with AVX2), never for float64 (portable only);
 * FUSEDMLP_CPU_GEMM=aten picks ATen's GEMM, FUSEDMLP_ISA our kernels, unless
 * FUSEDMLP_CPU_GEMM=auto makes it a limit only. On the ATen path by default, an inference
 * call of up to 4 rows runs our kernels where the unit reads every weight in place. */
static void test_gemm_path(tally *t) {
  const char *isa = getenv("FUSEDMLP_ISA"), *gemm = getenv("FUSEDMLP_CPU_GEMM");
  char *saved_isa = isa != NULL ? strdup(isa) : NULL;
  char *saved_gemm = gemm != NULL ? strdup(gemm) : NULL;
#if defined(__x86_64__) || defined(__i386__)
  const fmlp_cpu_gemm by_default =
      fmlp_cpu_isa_supported(FMLP_ISA_AVX2) ? FMLP_GEMM_KERNELS : FMLP_GEMM_HOST;
#else
  const fmlp_cpu_gemm by_default = FMLP_GEMM_HOST;
#endif
  unsetenv("FUSEDMLP_ISA");
  unsetenv("FUSEDMLP_CPU_GEMM");
  int ok = fmlp_cpu_gemm_in_use(FMLP_F32) == by_default &&
           fmlp_cpu_gemm_in_use(FMLP_BF16) == by_default &&
           fmlp_cpu_gemm_in_use(FMLP_F64) == FMLP_GEMM_HOST &&
           fmlp_cpu_unit_isa(FMLP_F64) == FMLP_ISA_PORTABLE &&
           fmlp_cpu_unit_isa(FMLP_F16) == FMLP_ISA_COUNT &&
           fmlp_cpu_gemm_in_use(FMLP_F16) == FMLP_GEMM_HOST;
  setenv("FUSEDMLP_ISA", "portable", 1);
  ok = ok && fmlp_cpu_gemm_in_use(FMLP_F32) == FMLP_GEMM_KERNELS &&
       fmlp_cpu_gemm_in_use(FMLP_F64) == FMLP_GEMM_KERNELS &&
       fmlp_cpu_unit_isa(FMLP_F32) == FMLP_ISA_PORTABLE;
  setenv("FUSEDMLP_CPU_GEMM", "auto", 1);
  static const float values[2] = {0};
  const fmlp_input rows_w[2] = {{values, 2, 1}, {values, 2, 1}}, columns_w = {values, 1, 2};
  ok = ok && fmlp_cpu_gemm_in_use(FMLP_F32) == FMLP_GEMM_HOST &&
       fmlp_cpu_inference_gemm(FMLP_F32, 1, 2, rows_w) == FMLP_GEMM_KERNELS &&
       fmlp_cpu_inference_gemm(FMLP_BF16, 4, 2, rows_w) == FMLP_GEMM_KERNELS &&
       fmlp_cpu_inference_gemm(FMLP_F32, 5, 2, rows_w) == FMLP_GEMM_HOST &&
       fmlp_cpu_inference_gemm(FMLP_F32, 1, 1, &columns_w) == FMLP_GEMM_HOST &&
       fmlp_cpu_inference_gemm(FMLP_F64, 1, 2, rows_w) == FMLP_GEMM_HOST;
  setenv("FUSEDMLP_CPU_GEMM", "aten", 1);
  ok = ok && fmlp_cpu_gemm_in_use(FMLP_F32) == FMLP_GEMM_HOST &&
       fmlp_cpu_inference_gemm(FMLP_F32, 1, 2, rows_w) == FMLP_GEMM_HOST;
  saved_isa != NULL ? setenv("FUSEDMLP_ISA", saved_isa, 1) : unsetenv("FUSEDMLP_ISA");
  saved_gemm != NULL ? setenv("FUSEDMLP_CPU_GEMM", saved_gemm, 1) : unsetenv("FUSEDMLP_CPU_GEMM");
  free(saved_isa);
  free(saved_gemm);
  ok ? t->passed++ : t->failed++;
  if (!ok) fprintf(stderr, "FAIL the default GEMM path or its overrides\n");
}

/* A two-layer chain's gradients: a training fmlp_cpu_chain, then
 * fmlp_cpu_chain_backward, against the chain rule in double. */
static void test_chain_backward(tally *t, fmlp_dtype dtype, int64_t m, const int64_t widths[3],
                                fmlp_activation hidden, fmlp_activation final, int transposed,
                                const fmlp_threading *threading) {
  const size_t elem = elem_size(dtype);
  fmlp_input x, w[2], b[2], gy;
  void *x_data = make_matrix(dtype, m, widths[0], transposed, 20, &x);
  void *gy_data = make_matrix(dtype, m, widths[2], transposed, 21, &gy);
  void *w_data[2], *b_data[2], *pre[2], *grad_w[2], *grad_b[2];
  for (int l = 0; l < 2; ++l) {
    w_data[l] = make_matrix(dtype, widths[l + 1], widths[l], transposed, 22 + l, &w[l]);
    b_data[l] = make_matrix(dtype, 1, widths[l + 1], 0, 24 + l, &b[l]);
    pre[l] = malloc((size_t)(m * widths[l + 1] + 1) * elem);
    grad_w[l] = malloc((size_t)(widths[l + 1] * widths[l] + 1) * elem);
    grad_b[l] = malloc((size_t)(widths[l + 1] + 1) * elem);
  }
  void *h = malloc((size_t)(m * widths[1] + 1) * elem);
  void *y = malloc((size_t)(m * widths[2] + 1) * elem);
  void *grad_x = malloc((size_t)(m * widths[0] + 1) * elem);
  const void *biases[2] = {b_data[0], b_data[1]};
  /* saved_hidden has no entry for the last layer (cpu.h): ASan sees a read past it */
  void *saved_pre[2] = {pre[0], pre[1]}, *saved_hidden[1] = {h};
  const fmlp_cpu_chain_args forward = {
      .dtype = dtype, .rows = m, .n_layers = 2, .widths = widths, .x = x, .weights = w,
      .biases = biases, .hidden_activation = hidden, .final_activation = final, .y = y,
      .y_row_stride = widths[2], .saved_pre = saved_pre, .saved_hidden = saved_hidden};
  /* transposed: the forward's own pre-activations; else as the torch layer passes
   * them, none for a layer whose derivative reads its output (h or y serves) */
  const int h_serves = !transposed && fmlp_derivative_reads_output(hidden);
  const int y_serves = !transposed && fmlp_derivative_reads_output(final);
  const void *const pre_in[2] = {h_serves ? NULL : pre[0], y_serves ? NULL : pre[1]},
                    *const hidden_in[2] = {h, NULL};
  const fmlp_cpu_chain_backward_args backward = {
      .dtype = dtype, .rows = m, .n_layers = 2, .widths = widths, .x = x, .weights = w,
      .hidden_activation = hidden, .final_activation = final, .saved_pre = pre_in,
      .saved_hidden = hidden_in, .y = y_serves ? y : NULL, .grad_y = gy,
      .grad_x = grad_x, .grad_weights = grad_w, .grad_biases = grad_b};
  fmlp_status status = fmlp_cpu_chain(&forward, threading);
  if (status == FMLP_OK) status = fmlp_cpu_chain_backward(&backward, threading);
  char what[160];
  snprintf(what, sizeof what, "chain backward dtype=%d m=%lld widths=%lld,%lld,%lld act=%d,%d t=%d",
           dtype, (long long)m, (long long)widths[0], (long long)widths[1],
           (long long)widths[2], hidden, final, transposed);
  if (status != FMLP_OK) {
    fprintf(stderr, "FAIL %s: status %s\n", what, fmlp_status_string(status));
    t->failed++;
  } else {
    /* the reference, from the tensors the forward saved (a backward's inputs: a
     * bfloat16 ReLU's mask may differ from double's where the pre-activation is
     * within rounding of 0), then grad_pre per layer from the top, in double */
    const int64_t n0 = widths[0], n1 = widths[1], n2 = widths[2];
    double *pre1 = calloc((size_t)(m * n1 + 1), sizeof(double));
    double *gp2 = calloc((size_t)(m * n2 + 1), sizeof(double));
    double *gp1 = calloc((size_t)(m * n1 + 1), sizeof(double));
#define X(i, kk) element(dtype, x_data, (i) * x.row_stride + (kk) * x.col_stride)
#define W(l, j, kk) element(dtype, w_data[l], (j) * w[l].row_stride + (kk) * w[l].col_stride)
#define GY(i, j) element(dtype, gy_data, (i) * gy.row_stride + (j) * gy.col_stride)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n1; ++j) {
        double z = element(dtype, b_data[0], j);
        for (int64_t kk = 0; kk < n0; ++kk) z += X(i, kk) * W(0, j, kk);
        check_close(t, what, element(dtype, pre[0], i * n1 + j), z, tolerance(dtype, n0));
        pre1[i * n1 + j] = element(dtype, pre[0], i * n1 + j);
      }
      for (int64_t j = 0; j < n2; ++j) {
        double z = element(dtype, b_data[1], j);
        for (int64_t kk = 0; kk < n1; ++kk) z += element(dtype, h, i * n1 + kk) * W(1, j, kk);
        check_close(t, what, element(dtype, pre[1], i * n2 + j), z, tolerance(dtype, n1));
        z = element(dtype, pre[1], i * n2 + j);
        gp2[i * n2 + j] = GY(i, j) * reference_activation_grad(z, final);
      }
      for (int64_t j = 0; j < n1; ++j) {
        double g = 0;
        for (int64_t c = 0; c < n2; ++c) g += gp2[i * n2 + c] * W(1, c, j);
        gp1[i * n1 + j] = g * reference_activation_grad(pre1[i * n1 + j], hidden);
      }
    }
    const double tol = tolerance(dtype, m + n0 + n1 + n2);
    const int before = t->failed;
    const double *gp[2] = {gp1, gp2};
    for (int l = 0; l < 2; ++l) {
      for (int64_t j = 0; j < widths[l + 1]; ++j) {
        double db = 0;
        for (int64_t i = 0; i < m; ++i) db += gp[l][i * widths[l + 1] + j];
        check_close(t, what, element(dtype, grad_b[l], j), db, tol);
        for (int64_t kk = 0; kk < widths[l]; ++kk) {
          double dw = 0;
          for (int64_t i = 0; i < m; ++i) {
            const double below = l == 0 ? X(i, kk) : element(dtype, h, i * n1 + kk);
            dw += gp[l][i * widths[l + 1] + j] * below;
          }
          check_close(t, what, element(dtype, grad_w[l], j * widths[l] + kk), dw, tol);
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t kk = 0; kk < n0; ++kk) {
        double gx = 0;
        for (int64_t j = 0; j < n1; ++j) gx += gp1[i * n1 + j] * W(0, j, kk);
        check_close(t, what, element(dtype, grad_x, i * n0 + kk), gx, tol);
      }
    }
#undef X
#undef W
#undef GY
    if (t->failed == before) t->passed++;
    free(gp1);
    free(gp2);
    free(pre1);
  }
  for (int l = 0; l < 2; ++l) {
    free(w_data[l]);
    free(b_data[l]);
    free(pre[l]);
    free(grad_w[l]);
    free(grad_b[l]);
  }
  free(grad_x);
  free(y);
  free(h);
  free(gy_data);
  free(x_data);
}

/* The gated block's gradients: a training fmlp_cpu_gated, then
 * fmlp_cpu_gated_block_backward, against the chain rule in double. */
static void test_gated_block_backward(tally *t, fmlp_dtype dtype, int64_t m, int64_t dim,
                                      int64_t hidden, int64_t out_dim, fmlp_activation act,
                                      int transposed, const fmlp_threading *threading) {
  const size_t elem = elem_size(dtype);
  fmlp_input x, w[3], b[3], gy; /* w, b: gate, up, down */
  const int64_t w_rows[3] = {hidden, hidden, out_dim}, w_cols[3] = {dim, dim, hidden};
  void *x_data = make_matrix(dtype, m, dim, transposed, 40, &x);
  void *gy_data = make_matrix(dtype, m, out_dim, transposed, 41, &gy);
  void *w_data[3], *b_data[3], *grad_w[3], *grad_b[3];
  for (int p = 0; p < 3; ++p) {
    w_data[p] = make_matrix(dtype, w_rows[p], w_cols[p], transposed ^ (p == 1), 42 + p, &w[p]);
    b_data[p] = make_matrix(dtype, 1, w_rows[p], 0, 45 + p, &b[p]);
    grad_w[p] = malloc((size_t)(w_rows[p] * w_cols[p] + 1) * elem);
    grad_b[p] = malloc((size_t)(w_rows[p] + 1) * elem);
  }
  void *saved = malloc((size_t)(3 * m * hidden + 1) * elem);
  void *y = malloc((size_t)(m * out_dim + 1) * elem);
  void *grad_x = malloc((size_t)(m * dim + 1) * elem);
  void *gate = saved, *up = (char *)saved + m * hidden * elem;
  void *product = (char *)saved + 2 * m * hidden * elem;
  const fmlp_cpu_gated_args forward = {
      .dtype = dtype, .rows = m, .dim = dim, .hidden = hidden, .out_dim = out_dim, .x = x,
      .w_gate = w[0], .w_up = w[1], .w_down = w[2], .bias_gate = b_data[0],
      .bias_up = b_data[1], .bias_down = b_data[2], .activation = act, .y = y,
      .y_row_stride = out_dim, .saved_gate = gate, .saved_up = up, .saved_product = product};
  const fmlp_cpu_gated_block_backward_args backward = {
      .dtype = dtype, .rows = m, .dim = dim, .hidden = hidden, .out_dim = out_dim, .x = x,
      .w_gate = w[0], .w_up = w[1], .w_down = w[2], .activation = act, .saved_gate = gate,
      .saved_up = up, .saved_product = product, .grad_y = gy, .grad_x = grad_x,
      .grad_w_gate = grad_w[0], .grad_w_up = grad_w[1], .grad_w_down = grad_w[2],
      .grad_bias_gate = grad_b[0], .grad_bias_up = grad_b[1], .grad_bias_down = grad_b[2]};
  fmlp_status status = fmlp_cpu_gated(&forward, threading);
  if (status == FMLP_OK) status = fmlp_cpu_gated_block_backward(&backward, threading);
  char what[160];
  snprintf(what, sizeof what,
           "gated backward dtype=%d m=%lld dim=%lld hidden=%lld out=%lld act=%d", dtype,
           (long long)m, (long long)dim, (long long)hidden, (long long)out_dim, act);
  if (status != FMLP_OK) {
    fprintf(stderr, "FAIL %s: status %s\n", what, fmlp_status_string(status));
    t->failed++;
  } else {
#define X(i, kk) element(dtype, x_data, (i) * x.row_stride + (kk) * x.col_stride)
#define W(p, j, kk) element(dtype, w_data[p], (j) * w[p].row_stride + (kk) * w[p].col_stride)
#define GY(i, j) element(dtype, gy_data, (i) * gy.row_stride + (j) * gy.col_stride)
    /* grads[0], grads[1]: of the gate and up pre-activations; p_ref: the product */
    double *grads[2], *p_ref = calloc((size_t)(m * hidden + 1), sizeof(double));
    for (int p = 0; p < 2; ++p) grads[p] = calloc((size_t)(m * hidden + 1), sizeof(double));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t h = 0; h < hidden; ++h) {
        double g = element(dtype, b_data[0], h), u = element(dtype, b_data[1], h), gp = 0;
        for (int64_t kk = 0; kk < dim; ++kk) g += X(i, kk) * W(0, h, kk);
        for (int64_t kk = 0; kk < dim; ++kk) u += X(i, kk) * W(1, h, kk);
        for (int64_t j = 0; j < out_dim; ++j) {
          gp += GY(i, j) * W(2, j, h);
        }
        /* from here on the saved tensors, as the backward reads them (see
         * test_chain_backward) */
        const int64_t at = i * hidden + h;
        check_close(t, what, element(dtype, gate, at), g, tolerance(dtype, dim));
        check_close(t, what, element(dtype, up, at), u, tolerance(dtype, dim));
        g = element(dtype, gate, at);
        u = element(dtype, up, at);
        check_close(t, what, element(dtype, product, at), reference_activation(g, act) * u,
                    tolerance(dtype, 1));
        p_ref[at] = element(dtype, product, at);
        grads[0][i * hidden + h] = gp * u * reference_activation_grad(g, act);
        grads[1][i * hidden + h] = gp * reference_activation(g, act);
      }
    }
    const double tol = tolerance(dtype, m + dim + hidden + out_dim);
    const int before = t->failed;
    for (int p = 0; p < 3; ++p) {
      for (int64_t j = 0; j < w_rows[p]; ++j) {
        double db = 0;
        for (int64_t i = 0; i < m; ++i) {
          db += p < 2 ? grads[p][i * hidden + j] : GY(i, j);
        }
        check_close(t, what, element(dtype, grad_b[p], j), db, tol);
        for (int64_t kk = 0; kk < w_cols[p]; ++kk) {
          double dw = 0, magnitude = 0;
          for (int64_t i = 0; i < m; ++i) {
            const double term =
                p < 2 ? grads[p][i * hidden + j] * X(i, kk)
                      : GY(i, j) * p_ref[i * hidden + kk];
            dw += term;
            magnitude += fabs(term);
          }
          check_close(t, what, element(dtype, grad_w[p], j * w_cols[p] + kk), dw,
                      sum_tolerance(dtype, m + dim + hidden + out_dim, dw, magnitude));
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t kk = 0; kk < dim; ++kk) {
        double gx = 0, magnitude = 0;
        for (int64_t h = 0; h < hidden; ++h) {
          const double from_gate = grads[0][i * hidden + h] * W(0, h, kk);
          const double from_up = grads[1][i * hidden + h] * W(1, h, kk);
          gx += from_gate + from_up;
          magnitude += fabs(from_gate) + fabs(from_up);
        }
        check_close(t, what, element(dtype, grad_x, i * dim + kk), gx,
                    sum_tolerance(dtype, m + dim + hidden + out_dim, gx, magnitude));
      }
    }
#undef X
#undef W
#undef GY
    if (t->failed == before) t->passed++;
    free(grads[0]);
    free(grads[1]);
    free(p_ref);
  }
  for (int p = 0; p < 3; ++p) {
    free(w_data[p]);
    free(b_data[p]);
    free(grad_w[p]);
    free(grad_b[p]);
  }
  free(grad_x);
  free(y);
  free(saved);
  free(gy_data);
  free(x_data);
}

/* w packed by the caller for dtype's unit in use (fmlp_cpu_pack_weight), or NULL
 * where an op over `rows` rows takes none (it reads w in place). */
static void *prepack(fmlp_dtype dtype, int64_t rows, fmlp_input w, int64_t n, int64_t k,
                     const fmlp_threading *threading) {
  const fmlp_cpu_isa unit = fmlp_cpu_unit_isa(dtype);
  int64_t bytes = -1;
  if (fmlp_cpu_packed_weight_bytes(dtype, unit, rows, w, n, k, &bytes) != FMLP_OK || bytes <= 0) {
    return NULL;
  }
  void *packed = fmlp_cpu_alloc_packed_weight(bytes);
  if (packed != NULL && fmlp_cpu_pack_weight(dtype, unit, w, n, k, packed, threading) != FMLP_OK) {
    free(packed);
    return NULL;
  }
  return packed;
}

/* A chain (a transposed weight among its) and a gated block give the same bits with
 * weights packed once by the caller as with their own packing: few rows (packed weights
 * unused), one row block packing just in time, row blocks over weights packed ahead. */
static void test_prepacked(tally *t, fmlp_dtype dtype, int64_t m, const fmlp_threading *threading) {
  const int64_t widths[3] = {70, 45, 33}, dim = 70, hidden = 37;
  const size_t elem = elem_size(dtype);
  fmlp_input x, w[2], g[3];
  void *x_data = make_matrix(dtype, m, dim, 0, 40, &x);
  void *w_data[2], *g_data[3], *packed_w[2], *packed_g[3];
  for (int l = 0; l < 2; ++l) {
    w_data[l] = make_matrix(dtype, widths[l + 1], widths[l], l, 41 + l, &w[l]);
    packed_w[l] = prepack(dtype, m, w[l], widths[l + 1], widths[l], threading);
  }
  const int64_t g_rows[3] = {hidden, hidden, dim}, g_cols[3] = {dim, dim, hidden};
  for (int p = 0; p < 3; ++p) {
    g_data[p] = make_matrix(dtype, g_rows[p], g_cols[p], p == 1, 43 + p, &g[p]);
    packed_g[p] = prepack(dtype, m, g[p], g_rows[p], g_cols[p], threading);
  }
  if ((packed_g[0] == NULL) != (packed_g[1] == NULL)) { /* gate and up: both or neither */
    free(packed_g[0]), free(packed_g[1]);
    packed_g[0] = packed_g[1] = NULL;
  }
  void *y[4];
  for (int i = 0; i < 4; ++i) y[i] = calloc((size_t)(m * dim + 1), elem);
  const void *no_bias[2] = {NULL, NULL}, *const packed_layers[2] = {packed_w[0], packed_w[1]};
  fmlp_cpu_chain_args chain = {
      .dtype = dtype, .rows = m, .n_layers = 2, .widths = widths, .x = x, .weights = w,
      .biases = no_bias, .hidden_activation = FMLP_ACT_GELU, .final_activation = FMLP_ACT_SILU,
      .y = y[0], .y_row_stride = widths[2]};
  fmlp_status status = fmlp_cpu_chain(&chain, threading);
  chain.y = y[1];
  chain.packed_weights = packed_layers;
  chain.packed_unit = fmlp_cpu_unit_isa(dtype);
  if (status == FMLP_OK) status = fmlp_cpu_chain(&chain, threading);
  fmlp_cpu_gated_args gated = {
      .dtype = dtype, .rows = m, .dim = dim, .hidden = hidden, .out_dim = dim, .x = x,
      .w_gate = g[0], .w_up = g[1], .w_down = g[2], .activation = FMLP_ACT_GELU_TANH,
      .y = y[2], .y_row_stride = dim};
  if (status == FMLP_OK) status = fmlp_cpu_gated(&gated, threading);
  gated.y = y[3];
  gated.packed_gate = packed_g[0];
  gated.packed_up = packed_g[1];
  gated.packed_down = packed_g[2];
  gated.packed_unit = fmlp_cpu_unit_isa(dtype);
  if (status == FMLP_OK) status = fmlp_cpu_gated(&gated, threading);
  /* past any unit's few rows every weight packs; a transposed one packs at any rows */
  int ok = status == FMLP_OK && packed_w[1] != NULL &&
           (m <= 64 || (packed_w[0] != NULL && packed_g[0] != NULL)) &&
           memcmp(y[0], y[1], (size_t)(m * widths[2]) * elem) == 0 &&
           memcmp(y[2], y[3], (size_t)(m * dim) * elem) == 0;
  /* gate and up are read together: both packed or neither; a unit this CPU lacks */
  gated.packed_up = NULL;
  ok = ok && (packed_g[0] == NULL ||
              fmlp_cpu_gated(&gated, threading) == FMLP_ERR_INVALID_ARGUMENT);
  chain.packed_unit = FMLP_ISA_COUNT;
  ok = ok && fmlp_cpu_chain(&chain, threading) == FMLP_ERR_INVALID_ARGUMENT;
  ok ? t->passed++ : t->failed++;
  if (!ok) {
    fprintf(stderr, "FAIL prepacked weights, dtype %d, %lld rows\n", (int)dtype, (long long)m);
  }
  for (int i = 0; i < 4; ++i) free(y[i]);
  for (int l = 0; l < 2; ++l) free(w_data[l]), free(packed_w[l]);
  for (int p = 0; p < 3; ++p) free(g_data[p]), free(packed_g[p]);
  free(x_data);
}

/* Large scratch is huge-page aligned; advising keeps contents and accepts any range. */
static void test_huge_page_advice(tally *t) {
  const int64_t count = 3 * FMLP_HUGE_PAGE_BYTES / (int64_t)sizeof(float) + 5;
  float *scratch = fmlp_alloc_scratch(count, sizeof(float));
  int ok = scratch != NULL && (uintptr_t)scratch % (uintptr_t)FMLP_HUGE_PAGE_BYTES == 0;
  for (int64_t i = 0; ok && i < count; ++i) scratch[i] = (float)(i % 1000);
  fmlp_advise_huge_pages(scratch + 3, (count - 3) * (int64_t)sizeof(float));
  fmlp_advise_huge_pages(NULL, 1 << 30);
  fmlp_advise_huge_pages(scratch, 100);
  for (int64_t i = 0; ok && i < count; ++i) ok = scratch[i] == (float)(i % 1000);
  free(scratch);
  ok ? t->passed++ : t->failed++;
  if (!ok) fprintf(stderr, "FAIL huge-page scratch alignment or contents\n");
}

static void test_invalid_arguments(tally *t) {
  const int64_t widths[2] = {3, 4};
  const fmlp_cpu_chain_args bad_activation = {
      .dtype = FMLP_F32, .rows = 0, .n_layers = 1, .widths = widths,
      .hidden_activation = (fmlp_activation)99, .final_activation = FMLP_ACT_NONE};
  const int64_t huge[2] = {INT64_MAX / 2, 4};
  fmlp_input w = {"", 1, 1};
  const fmlp_cpu_chain_args overflow = {
      .dtype = FMLP_F32, .rows = 3, .n_layers = 1, .widths = huge, .x = {"", 1, 1},
      .weights = &w, .final_activation = FMLP_ACT_NONE, .y = (void *)""};
  const int ok = fmlp_cpu_chain(&bad_activation, NULL) == FMLP_ERR_INVALID_ARGUMENT &&
                 fmlp_cpu_chain(&overflow, NULL) == FMLP_ERR_SIZE_OVERFLOW &&
                 fmlp_cpu_chain(NULL, NULL) == FMLP_ERR_INVALID_ARGUMENT;
  ok ? t->passed++ : t->failed++;
  if (!ok) fprintf(stderr, "FAIL invalid arguments not rejected\n");
}

/* test_kernels [f32]: with "f32", float only (the emulated aarch64 run, ~30x slower, where
 * double and bfloat16 run the portable C that the native run checks, and the fuzzer covers
 * it). */
/* K just below, at and past the largest K block (GEMM_KC) of the float units,
 * from the L1 for the SIMD tiles' input panels (6 and 12 rows of float: AVX2
 * and AVX-512) and 256 for the scalar one (float64); K over several blocks with bias
 * and activation (applied once, on the last block) and rows past one input
 * block; the gated kernel and the backward's products (dW has K = rows) past
 * one block (the gated kernel's may hold twice GEMM_KC: also past that).
 * bfloat16 runs the whole K at once. */
static void test_k_blocks(tally *t, fmlp_dtype dtype, const fmlp_threading *threading) {
  const int64_t limits[] = {256, fmlp_cpu_l1_k_block(6 * (int64_t)sizeof(float)),
                            fmlp_cpu_l1_k_block(12 * (int64_t)sizeof(float))};
  const int64_t widths[3] = {19, 37, 23};
  for (size_t i = 0; i < sizeof limits / sizeof limits[0]; ++i) {
    const int64_t k = limits[i];
    for (int64_t d = -1; d <= 1; ++d) {
      test_linear(t, dtype, 70, 40, k + d, (fmlp_activation)((i + d + 2) % FMLP_ACT_COUNT), 1,
                  (int)(i % 2), threading);
    }
    test_linear(t, dtype, 400, 40, 3 * k + 1, FMLP_ACT_GELU, 1, 0, threading);
    test_gated(t, dtype, 70, k + 1, 37, FMLP_ACT_SILU, threading);
    /* past the gated product's one block (GEMM_GATED_ONE_BLOCK_K: up to 2 k) */
    test_gated(t, dtype, 70, 2 * k + 1, 37, FMLP_ACT_GELU_TANH, threading);
    test_chain_backward(t, dtype, k + 1, widths, FMLP_ACT_RELU, FMLP_ACT_GELU, 0, threading);
  }
}

int main(int argc, char **argv) {
  tally t = {0, 0};
  const int last_dtype = argc > 1 && strcmp(argv[1], "f32") == 0 ? FMLP_F32 : FMLP_BF16;
  /* The harness checks that FUSEDMLP_ISA took effect. */
  printf("isa %s\n", fmlp_cpu_isa_name(fmlp_cpu_isa_in_use()));
  const fmlp_threading serial = {NULL, NULL, 1};
  const fmlp_threading chunked = {reversed_parallel_for, NULL, 4};
  const int64_t edge_sizes[] = {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33};
  const size_t n_edge = sizeof edge_sizes / sizeof edge_sizes[0];
  for (int dtype = FMLP_F32; dtype <= last_dtype; ++dtype) {
    for (size_t a = 0; a < n_edge; ++a) {
      for (size_t b = 0; b < n_edge; b += 2) {
        const int64_t m = edge_sizes[a], n = edge_sizes[b], k = edge_sizes[(a + b) % n_edge];
        const fmlp_activation act = (fmlp_activation)((a + b) % FMLP_ACT_COUNT);
        test_linear(&t, (fmlp_dtype)dtype, m, n, k, act, (int)(a % 2), (int)(b % 4 == 0),
                    a % 3 ? &serial : &chunked);
      }
    }
    for (int act = 0; act < FMLP_ACT_COUNT; ++act) {
      test_linear(&t, (fmlp_dtype)dtype, 131, 1031, 263, (fmlp_activation)act, act % 2, act % 3 == 0, &chunked);
      test_linear(&t, (fmlp_dtype)dtype, 9, 13, 0, (fmlp_activation)act, act % 2, 0, &serial);
      /* K past 1024, in place (<= 64 rows, row-major weight) and packed */
      test_linear(&t, (fmlp_dtype)dtype, 64, 37, 1100, (fmlp_activation)act, 1, 1, &serial);
      test_linear(&t, (fmlp_dtype)dtype, 100, 45, 1031, (fmlp_activation)act, act % 2, act % 2,
                  &chunked);
      /* few rows, a row-major weight read in place and >= 2^19 multiply-adds: the columns
       * are split over the threads (the transposed kernel, then dot products) */
      test_linear(&t, (fmlp_dtype)dtype, 40, 301, 600, (fmlp_activation)act, 1, 1, &chunked);
      test_linear(&t, (fmlp_dtype)dtype, 3, 1500, 400, (fmlp_activation)act, 0, 1, &chunked);
      test_gated(&t, (fmlp_dtype)dtype, 67, 29, 41, (fmlp_activation)act, &chunked);
      test_gated(&t, (fmlp_dtype)dtype, 5, 200, 700, (fmlp_activation)act, &chunked);
      /* packed, K past one cache block (partial sums between K blocks), a hidden width
       * that ends inside a gated tile part */
      test_gated(&t, (fmlp_dtype)dtype, 70, 1100, 37, (fmlp_activation)act, &serial);
      test_activation_backward(&t, (fmlp_dtype)dtype, (fmlp_activation)act);
      test_epilogue_passes(&t, (fmlp_dtype)dtype, (fmlp_activation)act, &chunked);
    }
    test_linear(&t, (fmlp_dtype)dtype, 0, 5, 7, FMLP_ACT_RELU, 1, 0, &serial);
    test_column_sums(&t, (fmlp_dtype)dtype, &chunked);
    const int64_t narrow_widths[4] = {19, 37, 5, 23};
    test_chain_matches_layers(&t, (fmlp_dtype)dtype, 300, narrow_widths, &chunked);
    /* few rows past 2^19 multiply-adds: layers as column-split stages, hidden outputs
     * handed over in the transposed kernels' lanes layout */
    const int64_t wide_widths[4] = {300, 301, 250, 37};
    for (int64_t m = 5; m <= 40; m += 7) {
      test_chain_matches_layers(&t, (fmlp_dtype)dtype, m, wide_widths, &chunked);
    }
    const int64_t backward_widths[][3] = {{19, 37, 23}, {64, 33, 1}, {5, 70, 48}, {1, 1, 1}};
    const int64_t backward_rows[] = {1, 13, 64, 65, 300};
    for (size_t s = 0; s < sizeof backward_rows / sizeof backward_rows[0]; ++s) {
      for (size_t v = 0; v < sizeof backward_widths / sizeof backward_widths[0]; ++v) {
        const int act = (int)((s + v) % FMLP_ACT_COUNT);
        test_chain_backward(&t, (fmlp_dtype)dtype, backward_rows[s], backward_widths[v],
                            (fmlp_activation)act, (fmlp_activation)((act + 2) % FMLP_ACT_COUNT),
                            (int)(s % 2), s % 2 ? &serial : &chunked);
      }
    }
    for (int act = 0; act < FMLP_ACT_COUNT; ++act) {
      test_gated_block_backward(&t, (fmlp_dtype)dtype, act == 0 ? 0 : 13 * act, 7 + act,
                                9 * act + 1, 5, (fmlp_activation)act, act % 2,
                                act % 2 ? &serial : &chunked);
    }
    test_gated_block_backward(&t, (fmlp_dtype)dtype, 70, 33, 40, 17, FMLP_ACT_SILU, 0, &chunked);
    /* past the parallel thresholds: the many-row region's later row tasks and the few-row
     * one's later column tasks, each from its own offset into the saved gate and up (bfloat16
     * sums over 130 rows cancel: the gradients' tolerance follows their terms) */
    test_gated_block_backward(&t, (fmlp_dtype)dtype, 130, 64, 96, 40, FMLP_ACT_GELU_TANH, 1,
                              &chunked);
    test_gated_block_backward(&t, (fmlp_dtype)dtype, 20, 64, 96, 40, FMLP_ACT_GELU, 0, &chunked);
    test_k_blocks(&t, (fmlp_dtype)dtype, &chunked);
    for (int64_t m = 5; m <= 605; m += 300) test_prepacked(&t, (fmlp_dtype)dtype, m, &chunked);
    /* a few-row dX whose columns run past one L2-sized column chunk of its K blocks
     * (backward.h's small_product_columns: a quarter of the L2 over K 256 in float, over
     * the whole K 257 in bfloat16), just past and well past */
    for (int64_t extra = 5; extra <= 600; extra += 595) {
      const int64_t chunked_columns[3] = {fmlp_cpu_l2_bytes() / 1024 + extra, 257, 3};
      test_chain_backward(&t, (fmlp_dtype)dtype, 16, chunked_columns, FMLP_ACT_RELU,
                          FMLP_ACT_NONE, 0, &serial);
    }
    /* past the column split's rows: the row split's grad_pre passes, ReLU's from h
     * and y; then the column split's with a final ReLU's from y */
    const int64_t row_split_widths[3] = {19, 37, 23};
    test_chain_backward(&t, (fmlp_dtype)dtype, 700, row_split_widths, FMLP_ACT_RELU,
                        FMLP_ACT_RELU, 0, &chunked);
    test_chain_backward(&t, (fmlp_dtype)dtype, 33, row_split_widths, FMLP_ACT_GELU,
                        FMLP_ACT_RELU, 0, &chunked);
    const int64_t empty_rows_widths[3] = {3, 4, 2};
    test_chain_backward(&t, (fmlp_dtype)dtype, 0, empty_rows_widths, FMLP_ACT_GELU,
                        FMLP_ACT_NONE, 0, &serial);
  }
  for (int64_t rows = 1; rows <= 65; rows += 64) test_gated_product_stage(&t, rows, &serial);
  test_invalid_arguments(&t);
  test_huge_page_advice(&t);
  test_gemm_path(&t);
  printf("%d passed, %d failed\n", t.passed, t.failed);
  return t.failed == 0 ? 0 : 1;
}
