/* Randomized fuzzing of the CPU kernel API (fusedmlp/cpu.h) against a naive
 * double-precision reference, meant to run under -fsanitize=address,undefined.
 *
 *   fuzz_kernels SECONDS [SEED]
 *
 * Each iteration draws an operation (layer chain, gated block, their
 * backwards, activation backward, gated backward), a dtype (float, double,
 * bfloat16), sizes biased towards the GEMM's tile and block edges (MR, NR, MC,
 * KC, NC) and, for the backwards, towards the few rows whose products read the
 * weights in place, operand layouts (row-major with padding, column-major,
 * sliced, broadcast rows with stride 0), bias and saved-activation buffers on
 * or off, which gradients are wanted, and a threading mode (none, serial,
 * shuffled chunks, real pthreads). Every buffer is allocated to its exact
 * extent so the sanitizer sees any overread, and padding in the output rows
 * holds a canary that must survive. It also feeds invalid arguments (NULL
 * pointers, negative and overflowing sizes, unknown enums) and checks that
 * they are rejected with a status, not a crash. Prints one summary line and
 * exits non-zero on any mismatch. Built and run by tests/test_fuzz_c.py. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "fusedmlp/cpu.h"
#include "reference.h"

/* ---- random numbers (splitmix64: reproducible from the seed) ---- */

static uint64_t rng_state;

static uint64_t next_u64(void) {
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* uniform in [0, n) */
static int64_t below(int64_t n) { return n <= 0 ? 0 : (int64_t)(next_u64() % (uint64_t)n); }

/* uniform in [-1, 1) */
static double uniform(void) { return (double)(next_u64() >> 11) / (double)(1ull << 52) - 1.0; }

/* A size: mostly small, often just around a tile/block edge of the GEMM. */
static int64_t draw_size(int64_t max_large) {
  static const int64_t edges[] = {4, 8, 16, 64, 256, 1024};
  switch (below(6)) {
    case 0: return below(3); /* 0, 1, 2 */
    case 1:
    case 2: return 1 + below(24);
    case 3: {
      const int64_t edge = edges[below(6)];
      const int64_t size = edge - 1 + below(3);
      return size <= max_large ? size : 1 + below(max_large);
    }
    case 4: return 1 + below(80);
    default: return 1 + below(max_large);
  }
}

/* ---- strided operands ---- */

typedef struct {
  fmlp_dtype dtype;
  int64_t rows, cols;
  int64_t row_stride, col_stride;
  void *data; /* exactly as many elements as the strides reach */
} operand;

static size_t elem_size(fmlp_dtype dtype) {
  return dtype == FMLP_F64    ? sizeof(double)
         : dtype == FMLP_BF16 ? sizeof(fmlp_bf16)
                              : sizeof(float);
}

static double get(const void *data, fmlp_dtype dtype, int64_t i) {
  switch (dtype) {
    case FMLP_F64: return ((const double *)data)[i];
    case FMLP_BF16: return fmlp_bf16_to_float(((const fmlp_bf16 *)data)[i]);
    default: return ((const float *)data)[i];
  }
}

static void set(void *data, fmlp_dtype dtype, int64_t i, double v) {
  switch (dtype) {
    case FMLP_F64: ((double *)data)[i] = v; break;
    case FMLP_BF16: ((fmlp_bf16 *)data)[i] = fmlp_float_to_bf16((float)v); break;
    default: ((float *)data)[i] = (float)v; break;
  }
}

/* v as the kernels store it in dtype (pre-activations, hidden outputs, the backward's
 * intermediate gradients) */
static double stored(fmlp_dtype dtype, double v) {
  switch (dtype) {
    case FMLP_F64: return v;
    case FMLP_BF16: return fmlp_bf16_to_float(fmlp_float_to_bf16((float)v));
    default: return (float)v;
  }
}

/* An exact-size allocation (at least one byte so malloc never returns NULL legitimately). */
static void *alloc_elems(fmlp_dtype dtype, int64_t count) {
  void *p = malloc((size_t)(count > 0 ? count : 1) * elem_size(dtype));
  if (p == NULL) {
    fprintf(stderr, "fuzz: out of memory\n");
    exit(2);
  }
  return p;
}

/* A random rows x cols operand with values scale * U(-1, 1), sometimes a NaN or Inf. */
static operand make_operand(fmlp_dtype dtype, int64_t rows, int64_t cols, double scale,
                            int allow_special) {
  operand m = {dtype, rows, cols, 0, 0, NULL};
  const int64_t pad = below(3);
  switch (below(5)) {
    case 0: m.row_stride = cols + pad; m.col_stride = 1; break;           /* row-major */
    case 1: m.row_stride = 1; m.col_stride = rows + pad; break;           /* transposed */
    case 2: m.row_stride = 2 * cols + pad; m.col_stride = 2; break;       /* sliced */
    case 3: m.row_stride = 0; m.col_stride = 1; break;                    /* broadcast rows */
    default: m.row_stride = cols; m.col_stride = 1; break;                /* contiguous */
  }
  int64_t extent = 0;
  if (rows > 0 && cols > 0) extent = (rows - 1) * m.row_stride + (cols - 1) * m.col_stride + 1;
  m.data = alloc_elems(dtype, extent);
  for (int64_t i = 0; i < extent; ++i) set(m.data, dtype, i, scale * uniform());
  if (allow_special && extent > 0 && below(8) == 0) {
    const double specials[] = {NAN, INFINITY, -INFINITY, 0.0};
    set(m.data, dtype, below(extent), specials[below(4)]);
  }
  return m;
}

static double at(const operand *m, int64_t r, int64_t c) {
  return get(m->data, m->dtype, r * m->row_stride + c * m->col_stride);
}

static fmlp_input input_of(const operand *m) { return (fmlp_input){m->data, m->row_stride, m->col_stride}; }

/* ---- comparisons ---- */

typedef struct {
  int64_t checks, failures;
  const char *what; /* the current case, for messages */
  fmlp_dtype dtype; /* the current case's, for expect_gradient */
} tally;

/* actual ~ expected within rtol/atol, where NaN matches NaN and Inf matches an Inf of the same sign. */
static void expect_close(tally *t, double actual, double expected, double rtol, double atol,
                         const char *name, int64_t index) {
  ++t->checks;
  int ok;
  if (isnan(expected) || isnan(actual)) ok = isnan(expected) && isnan(actual);
  else if (isinf(expected) || isinf(actual)) ok = actual == expected;
  else ok = fabs(actual - expected) <= atol + rtol * fabs(expected);
  if (!ok) {
    if (t->failures < 20) {
      fprintf(stderr, "MISMATCH %s: %s[%lld] = %.9g, expected %.9g\n", t->what, name,
              (long long)index, actual, expected);
    }
    ++t->failures;
  }
}

static void expect_status(tally *t, fmlp_status actual, fmlp_status expected, const char *what) {
  ++t->checks;
  if (actual != expected) {
    fprintf(stderr, "STATUS %s: got %d (%s), expected %d\n", what, (int)actual,
            fmlp_status_string(actual), (int)expected);
    ++t->failures;
  }
}

/* ---- threading modes ---- */

/* Runs the task range in chunks of random size, in reverse order: blocks must be independent. */
static void shuffled_parallel_for(void *pool, int64_t n_tasks, void *context, fmlp_task_fn fn) {
  (void)pool;
  int64_t end = n_tasks;
  while (end > 0) {
    const int64_t begin = end - 1 - below(end < 3 ? end : 3);
    fn(context, begin, end);
    end = begin;
  }
}

typedef struct {
  void *context;
  fmlp_task_fn fn;
  int64_t begin, end;
} thread_job;

static void *run_thread_job(void *arg) {
  thread_job *job = arg;
  job->fn(job->context, job->begin, job->end);
  return NULL;
}

/* Real concurrency: two or three threads, each a contiguous share of the tasks. */
static void pthread_parallel_for(void *pool, int64_t n_tasks, void *context, fmlp_task_fn fn) {
  const int64_t n_threads = *(const int64_t *)pool;
  pthread_t threads[4];
  thread_job jobs[4];
  for (int64_t i = 0; i < n_threads; ++i) {
    jobs[i] = (thread_job){context, fn, n_tasks * i / n_threads, n_tasks * (i + 1) / n_threads};
    if (pthread_create(&threads[i], NULL, run_thread_job, &jobs[i]) != 0) {
      fprintf(stderr, "fuzz: pthread_create failed\n");
      exit(2);
    }
  }
  for (int64_t i = 0; i < n_threads; ++i) pthread_join(threads[i], NULL);
}

static int64_t pthread_count;

/* NULL (serial), or one of the threading modes. */
static const fmlp_threading *draw_threading(fmlp_threading *storage) {
  switch (below(4)) {
    case 0: return NULL;
    case 1: *storage = (fmlp_threading){NULL, NULL, 1}; return storage;
    case 2: *storage = (fmlp_threading){shuffled_parallel_for, NULL, 2 + below(7)}; return storage;
    default:
      pthread_count = 2 + below(2);
      *storage = (fmlp_threading){pthread_parallel_for, &pthread_count, pthread_count};
      return storage;
  }
}

/* An output buffer of rows x cols with row stride >= cols; padding holds a canary. */
typedef struct {
  void *data;
  int64_t rows, cols, row_stride, count;
} output;

static const double CANARY = 12345.5;

static output make_output(fmlp_dtype dtype, int64_t rows, int64_t cols) {
  output o = {NULL, rows, cols, cols + below(3), 0};
  o.count = rows > 0 ? (rows - 1) * o.row_stride + cols : 0;
  o.data = alloc_elems(dtype, o.count);
  for (int64_t i = 0; i < o.count; ++i) set(o.data, dtype, i, CANARY);
  return o;
}

static void expect_canaries(tally *t, const output *o, fmlp_dtype dtype) {
  for (int64_t r = 0; r < o->rows; ++r) {
    for (int64_t c = o->cols; c < o->row_stride && r * o->row_stride + c < o->count; ++c) {
      expect_close(t, get(o->data, dtype, r * o->row_stride + c), stored(dtype, CANARY), 0, 0,
                   "y padding", r * o->row_stride + c);
    }
  }
}

/* bfloat16 stores 8 significant bits: each stored value is off by up to 2^-8 relative, and
 * a hidden value rounded the other way than the reference's moves the next layer by up to 2^-7
 * of its term */
static double rtol_of(fmlp_dtype dtype) {
  return dtype == FMLP_F64 ? 1e-10 : dtype == FMLP_BF16 ? 8e-3 : 2e-4;
}
static double atol_of(fmlp_dtype dtype) { return rtol_of(dtype); }

/* ---- one random case per operation ---- */

#define MAX_LAYERS 4

static void fuzz_chain(tally *t, fmlp_dtype dtype) {
  const int64_t n_layers = 1 + below(MAX_LAYERS);
  int64_t widths[MAX_LAYERS + 1];
  for (int64_t l = 0; l <= n_layers; ++l) widths[l] = draw_size(n_layers > 2 ? 96 : 300);
  const int64_t rows = draw_size(200);
  const fmlp_activation hidden = (fmlp_activation)below(FMLP_ACT_COUNT);
  const fmlp_activation final_activation = (fmlp_activation)below(FMLP_ACT_COUNT);
  const int special = below(10) == 0;

  operand x = make_operand(dtype, rows, widths[0], 1.0, special);
  operand w[MAX_LAYERS];
  fmlp_input w_inputs[MAX_LAYERS];
  void *b[MAX_LAYERS];
  const void *b_const[MAX_LAYERS];
  void *pre[MAX_LAYERS], *hid[MAX_LAYERS];
  const int with_bias = below(2), save_pre = below(2), save_hidden = below(2);
  for (int64_t l = 0; l < n_layers; ++l) {
    const double scale = 1.0 / sqrt((double)(widths[l] > 0 ? widths[l] : 1));
    w[l] = make_operand(dtype, widths[l + 1], widths[l], scale, special);
    w_inputs[l] = input_of(&w[l]);
    b[l] = NULL;
    if (with_bias && below(4) != 0) {
      b[l] = alloc_elems(dtype, widths[l + 1]);
      for (int64_t j = 0; j < widths[l + 1]; ++j) set(b[l], dtype, j, uniform());
    }
    b_const[l] = b[l];
    pre[l] = save_pre && below(4) != 0 ? alloc_elems(dtype, rows * widths[l + 1]) : NULL;
    hid[l] = save_hidden && l + 1 < n_layers && below(4) != 0
                 ? alloc_elems(dtype, rows * widths[l + 1])
                 : NULL;
  }
  output y = make_output(dtype, rows, widths[n_layers]);
  const fmlp_cpu_chain_args args = {
      .dtype = dtype,
      .rows = rows,
      .n_layers = n_layers,
      .widths = widths,
      .x = input_of(&x),
      .weights = w_inputs,
      .biases = with_bias ? b_const : NULL,
      .hidden_activation = hidden,
      .final_activation = final_activation,
      .y = y.data,
      .y_row_stride = y.row_stride,
      .saved_pre = save_pre ? pre : NULL,
      .saved_hidden = save_hidden ? hid : NULL,
  };
  fmlp_threading storage;
  char what[256];
  snprintf(what, sizeof what,
           "chain dtype=%d rows=%lld layers=%lld widths=%lld,%lld.. act=%d/%d bias=%d", dtype,
           (long long)rows, (long long)n_layers, (long long)widths[0], (long long)widths[1],
           hidden, final_activation, with_bias);
  t->what = what;
  expect_status(t, fmlp_cpu_chain(&args, draw_threading(&storage)), FMLP_OK, what);

  /* reference, row by row, in double */
  double *h = malloc(sizeof(double) * 1024), *next = malloc(sizeof(double) * 1024);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < widths[0]; ++c) h[c] = at(&x, r, c);
    for (int64_t l = 0; l < n_layers; ++l) {
      const int last = l + 1 == n_layers;
      const fmlp_activation act = last ? final_activation : hidden;
      for (int64_t j = 0; j < widths[l + 1]; ++j) {
        double z = with_bias && b[l] != NULL ? get(b[l], dtype, j) : 0.0;
        for (int64_t k = 0; k < widths[l]; ++k) z += h[k] * at(&w[l], j, k);
        /* the kernel rounds pre-activations and hidden outputs to its dtype */
        z = stored(dtype, z);
        if (save_pre && pre[l] != NULL) {
          expect_close(t, get(pre[l], dtype, r * widths[l + 1] + j), z, rtol_of(dtype),
                       atol_of(dtype), "saved_pre", l);
        }
        next[j] = stored(dtype, reference_activation(z, act));
        if (last) {
          expect_close(t, get(y.data, dtype, r * y.row_stride + j), next[j], rtol_of(dtype),
                       atol_of(dtype), "y", r * y.row_stride + j);
        } else if (save_hidden && hid[l] != NULL) {
          expect_close(t, get(hid[l], dtype, r * widths[l + 1] + j), next[j], rtol_of(dtype),
                       atol_of(dtype), "saved_hidden", l);
        }
      }
      double *swap = h;
      h = next;
      next = swap;
    }
  }
  expect_canaries(t, &y, dtype);
  free(h);
  free(next);
  free(x.data);
  free(y.data);
  for (int64_t l = 0; l < n_layers; ++l) {
    free(w[l].data);
    free(b[l]);
    free(pre[l]);
    free(hid[l]);
  }
}

static void fuzz_gated(tally *t, fmlp_dtype dtype) {
  const int64_t rows = draw_size(160), dim = draw_size(300), hidden = draw_size(300),
                out_dim = draw_size(160);
  const fmlp_activation activation = (fmlp_activation)below(FMLP_ACT_COUNT);
  const int special = below(10) == 0, save = below(2);
  operand x = make_operand(dtype, rows, dim, 1.0, special);
  const double in_scale = 1.0 / sqrt((double)(dim > 0 ? dim : 1));
  operand wg = make_operand(dtype, hidden, dim, in_scale, special);
  operand wu = make_operand(dtype, hidden, dim, in_scale, special);
  operand wd = make_operand(dtype, out_dim, hidden, 1.0 / sqrt((double)(hidden > 0 ? hidden : 1)),
                            special);
  void *bias[3] = {NULL, NULL, NULL};
  const int64_t bias_len[3] = {hidden, hidden, out_dim};
  for (int i = 0; i < 3; ++i) {
    if (below(2)) {
      bias[i] = alloc_elems(dtype, bias_len[i]);
      for (int64_t j = 0; j < bias_len[i]; ++j) set(bias[i], dtype, j, uniform());
    }
  }
  void *saved[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3 && save; ++i) saved[i] = below(4) ? alloc_elems(dtype, rows * hidden) : NULL;
  output y = make_output(dtype, rows, out_dim);
  const fmlp_cpu_gated_args args = {
      .dtype = dtype,
      .rows = rows,
      .dim = dim,
      .hidden = hidden,
      .out_dim = out_dim,
      .x = input_of(&x),
      .w_gate = input_of(&wg),
      .w_up = input_of(&wu),
      .w_down = input_of(&wd),
      .bias_gate = bias[0],
      .bias_up = bias[1],
      .bias_down = bias[2],
      .activation = activation,
      .y = y.data,
      .y_row_stride = y.row_stride,
      .saved_gate = saved[0],
      .saved_up = saved[1],
      .saved_product = saved[2],
  };
  fmlp_threading storage;
  char what[256];
  snprintf(what, sizeof what, "gated dtype=%d rows=%lld dim=%lld hidden=%lld out=%lld act=%d",
           dtype, (long long)rows, (long long)dim, (long long)hidden, (long long)out_dim,
           activation);
  t->what = what;
  expect_status(t, fmlp_cpu_gated(&args, draw_threading(&storage)), FMLP_OK, what);

  double *product = malloc(sizeof(double) * (size_t)(hidden > 0 ? hidden : 1));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hidden; ++j) {
      double g = bias[0] != NULL ? get(bias[0], dtype, j) : 0.0;
      double u = bias[1] != NULL ? get(bias[1], dtype, j) : 0.0;
      for (int64_t k = 0; k < dim; ++k) {
        g += at(&x, r, k) * at(&wg, j, k);
        u += at(&x, r, k) * at(&wu, j, k);
      }
      /* bfloat16 forms the product from the unrounded gate and up, float32 from its
       * rounded ones (each within 2^-8): the two products, each rounded again, may differ by
       * up to 2^-6 relative */
      g = stored(dtype, g);
      u = stored(dtype, u);
      product[j] = stored(dtype, reference_activation(g, activation) * u);
      const double tol = rtol_of(dtype), atol = atol_of(dtype);
      if (saved[0] != NULL) expect_close(t, get(saved[0], dtype, r * hidden + j), g, tol, atol, "saved_gate", j);
      if (saved[1] != NULL) expect_close(t, get(saved[1], dtype, r * hidden + j), u, tol, atol, "saved_up", j);
      if (saved[2] != NULL) {
        expect_close(t, get(saved[2], dtype, r * hidden + j), product[j], tol, atol,
                     "saved_product", j);
      }
    }
    for (int64_t o = 0; o < out_dim; ++o) {
      double z = bias[2] != NULL ? get(bias[2], dtype, o) : 0.0;
      double magnitude = fabs(z);
      for (int64_t j = 0; j < hidden; ++j) {
        z += product[j] * at(&wd, o, j);
        magnitude += fabs(product[j] * at(&wd, o, j));
      }
      /* so the sum may differ by 2^-6 of its terms' magnitude, more than rtol where the
       * terms cancel */
      const double atol = atol_of(dtype) + (dtype == FMLP_BF16 ? 0x1p-6 * magnitude : 0.0);
      expect_close(t, get(y.data, dtype, r * y.row_stride + o), z, rtol_of(dtype), atol, "y",
                   r * y.row_stride + o);
    }
  }
  expect_canaries(t, &y, dtype);
  free(product);
  free(x.data);
  free(wg.data);
  free(wu.data);
  free(wd.data);
  free(y.data);
  for (int i = 0; i < 3; ++i) {
    free(bias[i]);
    free(saved[i]);
  }
}

/* ---- the backwards of chains and gated blocks ---- */

/* A computed gradient against the reference's sum of `terms` products whose magnitudes
 * add up to `magnitude` (through every layer above: an intermediate gradient's error follows
 * its own terms, which may have cancelled, not its value). The kernels accumulate in float
 * (double for float64); bfloat16 also rounds the result and the intermediate gradients it
 * stores (each up to 2^-8 relative, in random directions over the terms), which the reference
 * rounds too (stored) but may round the other way where its sum lies within float's error
 * of a rounding edge. An element wrong by a term, a row or a tile is off by ~magnitude /
 * sqrt(terms) or more.
 * `rounded`: the size of partial results the kernel rounds to its dtype on the way (a gated
 * block's two halves of grad_x), each of which may round the other way. */
static void expect_gradient(tally *t, double actual, double expected, double magnitude,
                            int64_t terms, double rounded, const char *name, int64_t index) {
  double rtol, atol;
  switch (t->dtype) {
    case FMLP_F64: rtol = 1e-12, atol = 1e-12 * magnitude; break;
    case FMLP_BF16:
      rtol = 0x1p-7;
      atol = 0x1p-7 * magnitude / sqrt((double)(terms > 0 ? terms : 1)) + 1e-5 * magnitude +
             0x1p-8 * rounded;
      break;
    default: rtol = 1e-6, atol = 4e-6 * magnitude; break;
  }
  expect_close(t, actual, expected, rtol, atol + 1e-30, name, index);
}

/* rows x cols of random values, contiguous, exactly sized (as the backward's saved
 * tensors and gradients are) */
static void *random_matrix(fmlp_dtype dtype, int64_t rows, int64_t cols) {
  void *m = alloc_elems(dtype, rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) set(m, dtype, i, uniform());
  return m;
}

/* A gradient buffer of n elements, or NULL (not wanted) one time in four. */
static void *maybe_gradient(fmlp_dtype dtype, int64_t n) {
  return below(4) == 0 ? NULL : alloc_elems(dtype, n);
}

/* m's values as rows x cols contiguous doubles (one spare, so never a zero-size malloc) */
static double *doubles_of(const operand *m) {
  double *d = malloc(sizeof(double) * (size_t)(m->rows * m->cols + 1));
  for (int64_t r = 0; r < m->rows; ++r) {
    for (int64_t c = 0; c < m->cols; ++c) d[r * m->cols + c] = at(m, r, c);
  }
  return d;
}

/* An output's gradient: any operand layout, or one value expanded over every element
 * (both strides 0, as a loss's sum() hands it on) one time in five. */
static operand make_gradient(fmlp_dtype dtype, int64_t rows, int64_t cols) {
  operand g = make_operand(dtype, rows, cols, 1.0, 0);
  if (below(5) == 0) g.row_stride = g.col_stride = 0;
  return g;
}

/* A contiguous rows x cols matrix of dtype (a saved tensor) as an operand. */
static operand contiguous(fmlp_dtype dtype, void *data, int64_t rows, int64_t cols) {
  return (operand){dtype, rows, cols, cols, 1, data};
}

/* out = a @ w (a: rows x n, w: n x k, doubles) and out_magnitude = a_magnitude @ |w|, the
 * magnitude each element's error follows. */
static void times(const double *a, const double *a_magnitude, const double *w, int64_t rows,
                  int64_t n, int64_t k, double *out, double *out_magnitude) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      double sum = 0, size = 0;
      for (int64_t j = 0; j < n; ++j) {
        sum += a[r * n + j] * w[j * k + c];
        size += a_magnitude[r * n + j] * fabs(w[j * k + c]);
      }
      out[r * k + c] = sum;
      out_magnitude[r * k + c] = size;
    }
  }
}

/* A layer's weight gradient grad^T @ input (n x k) and bias gradient (grad's column sums),
 * each unless NULL, against grad (rows x n, its magnitudes grad_magnitude) and input
 * (rows x k) in double. */
static void expect_layer_gradients(tally *t, const void *grad_w, const void *grad_b,
                                   const double *grad, const double *grad_magnitude,
                                   const double *input, int64_t rows, int64_t n, int64_t k) {
  for (int64_t j = 0; j < n; ++j) {
    double sum = 0, size = 0;
    for (int64_t r = 0; r < rows; ++r) sum += grad[r * n + j], size += grad_magnitude[r * n + j];
    if (grad_b != NULL) {
      expect_gradient(t, get(grad_b, t->dtype, j), sum, size, rows, 0, "grad_b", j);
    }
    for (int64_t c = 0; c < k && grad_w != NULL; ++c) {
      sum = 0, size = 0;
      for (int64_t r = 0; r < rows; ++r) {
        sum += grad[r * n + j] * input[r * k + c];
        size += grad_magnitude[r * n + j] * fabs(input[r * k + c]);
      }
      expect_gradient(t, get(grad_w, t->dtype, j * k + c), sum, size, rows, 0, "grad_w",
                      j * k + c);
    }
  }
}

/* grad_x (rows x k, unless NULL) against want and its terms' magnitudes, sums of `terms`,
 * with partial results of the sizes `rounded` (or none: NULL) rounded on the way. */
static void expect_input_gradient(tally *t, const void *grad_x, const double *want,
                                  const double *magnitude, const double *rounded, int64_t rows,
                                  int64_t k, int64_t terms) {
  for (int64_t i = 0; i < rows * k && grad_x != NULL; ++i) {
    expect_gradient(t, get(grad_x, t->dtype, i), want[i], magnitude[i], terms,
                    rounded != NULL ? rounded[i] : 0, "grad_x", i);
  }
}

/* An activation's value or slope computed in float is off by up to ~7e-7 absolute, also
 * where it crosses 0 (the float slopes over z in [-8, 8], AVX2 and portable units: GELU's
 * 2.9e-7 near 0, SiLU's 6.6e-7 near 8): the magnitude it passes on to the gradients, whose
 * float tolerance is 4e-6 of it. */
static double activation_magnitude(double value) { return fabs(value) + 0.25; }

/* Rows for a backward: often the few rows whose products read b in place (up to 64). */
static int64_t draw_backward_rows(void) { return below(2) ? 1 + below(70) : draw_size(160); }

static void fuzz_chain_backward(tally *t, fmlp_dtype dtype) {
  const int64_t n_layers = 1 + below(MAX_LAYERS);
  int64_t widths[MAX_LAYERS + 1], widest = 1;
  for (int64_t l = 0; l <= n_layers; ++l) {
    widths[l] = draw_size(n_layers > 2 ? 96 : 300);
    widest = widths[l] > widest ? widths[l] : widest;
  }
  const int64_t rows = draw_backward_rows(), top = n_layers - 1;
  const fmlp_activation hidden = (fmlp_activation)below(FMLP_ACT_COUNT);
  const fmlp_activation final_activation = (fmlp_activation)below(FMLP_ACT_COUNT);
  operand x = make_operand(dtype, rows, widths[0], 1.0, 0);
  operand w[MAX_LAYERS];
  fmlp_input w_inputs[MAX_LAYERS];
  /* what the training forward saved: pre-activations where there is an activation
   * (a layer whose derivative reads its output may go without: its output, hidden
   * or y, serves, as the torch layer passes it), every hidden output; random, as
   * the backward takes them as given */
  void *pre[MAX_LAYERS], *hid[MAX_LAYERS], *grad_w[MAX_LAYERS], *grad_b[MAX_LAYERS];
  const void *pre_in[MAX_LAYERS], *hid_in[MAX_LAYERS];
  const int with_bias_grads = below(2);
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t n = widths[l + 1], k = widths[l];
    w[l] = make_operand(dtype, n, k, 1.0 / sqrt((double)(k > 0 ? k : 1)), 0);
    w_inputs[l] = input_of(&w[l]);
    const fmlp_activation act = l == top ? final_activation : hidden;
    const int output_serves = fmlp_derivative_reads_output(act) && below(2);
    pre_in[l] = pre[l] =
        act != FMLP_ACT_NONE && !output_serves ? random_matrix(dtype, rows, n) : NULL;
    /* the top layer's output, y, is random too; it is handed in only where it serves */
    hid_in[l] = hid[l] = l < top || output_serves ? random_matrix(dtype, rows, n) : NULL;
    grad_w[l] = maybe_gradient(dtype, n * k);
    grad_b[l] = with_bias_grads ? maybe_gradient(dtype, n) : NULL;
  }
  operand grad_y = make_gradient(dtype, rows, widths[n_layers]);
  void *grad_x = maybe_gradient(dtype, rows * widths[0]);
  const fmlp_cpu_chain_backward_args args = {
      .dtype = dtype,
      .rows = rows,
      .n_layers = n_layers,
      .widths = widths,
      .x = input_of(&x),
      .weights = w_inputs,
      .hidden_activation = hidden,
      .final_activation = final_activation,
      .saved_pre = pre_in,
      .saved_hidden = hid_in,
      .y = hid[top],
      .grad_y = input_of(&grad_y),
      .grad_x = grad_x,
      .grad_weights = grad_w,
      .grad_biases = with_bias_grads ? grad_b : NULL,
  };
  fmlp_threading storage;
  char what[256];
  snprintf(what, sizeof what,
           "chain_backward dtype=%d rows=%lld layers=%lld widths=%lld,%lld.. act=%d/%d", dtype,
           (long long)rows, (long long)n_layers, (long long)widths[0], (long long)widths[1],
           hidden, final_activation);
  t->what = what;
  t->dtype = dtype;
  expect_status(t, fmlp_cpu_chain_backward(&args, draw_threading(&storage)), FMLP_OK, what);

  /* the reference from the top layer down: grad_pre = grad * act'(pre), the layer's
   * gradients from it, grad = grad_pre @ W for the layer below, each intermediate
   * rounded as the kernel stores it */
  const size_t cells = (size_t)(rows * widest + 1);
  double *grad = malloc(sizeof(double) * cells), *below_grad = malloc(sizeof(double) * cells);
  double *magnitude = malloc(sizeof(double) * cells);
  double *below_magnitude = malloc(sizeof(double) * cells);
  double *grad_y_values = doubles_of(&grad_y);
  for (int64_t i = 0; i < rows * widths[n_layers]; ++i) {
    grad[i] = grad_y_values[i];
    magnitude[i] = fabs(grad[i]);
  }
  free(grad_y_values);
  for (int64_t l = top; l >= 0; --l) {
    const int64_t n = widths[l + 1], k = widths[l];
    const fmlp_activation act = l == top ? final_activation : hidden;
    for (int64_t i = 0; i < rows * n && act != FMLP_ACT_NONE; ++i) {
      const void *derivative_input = pre[l] != NULL ? pre[l] : hid[l];
      const double slope = reference_activation_grad(get(derivative_input, dtype, i), act);
      grad[i] = stored(dtype, grad[i] * slope);
      magnitude[i] *= activation_magnitude(slope);
    }
    operand below_input = l == 0 ? x : contiguous(dtype, hid[l - 1], rows, k);
    double *input = doubles_of(&below_input), *weight = doubles_of(&w[l]);
    expect_layer_gradients(t, grad_w[l], grad_b[l], grad, magnitude, input, rows, n, k);
    times(grad, magnitude, weight, rows, n, k, below_grad, below_magnitude);
    if (l == 0) expect_input_gradient(t, grad_x, below_grad, below_magnitude, NULL, rows, k, n);
    for (int64_t i = 0; i < rows * k; ++i) below_grad[i] = stored(dtype, below_grad[i]);
    double *swap = grad;
    grad = below_grad;
    below_grad = swap;
    swap = magnitude;
    magnitude = below_magnitude;
    below_magnitude = swap;
    free(input);
    free(weight);
  }
  free(grad);
  free(below_grad);
  free(magnitude);
  free(below_magnitude);
  free(grad_y.data);
  free(grad_x);
  free(x.data);
  for (int64_t l = 0; l < n_layers; ++l) {
    free(w[l].data);
    free(pre[l]);
    free(hid[l]);
    free(grad_w[l]);
    free(grad_b[l]);
  }
}

static void fuzz_gated_block_backward(tally *t, fmlp_dtype dtype) {
  const int64_t rows = draw_backward_rows(), dim = draw_size(300), hidden = draw_size(300),
                out_dim = draw_size(160);
  const fmlp_activation activation = (fmlp_activation)below(FMLP_ACT_COUNT);
  const double in_scale = 1.0 / sqrt((double)(dim > 0 ? dim : 1));
  const double down_scale = 1.0 / sqrt((double)(hidden > 0 ? hidden : 1));
  operand x = make_operand(dtype, rows, dim, 1.0, 0);
  operand wg = make_operand(dtype, hidden, dim, in_scale, 0);
  operand wu = make_operand(dtype, hidden, dim, in_scale, 0);
  operand wd = make_operand(dtype, out_dim, hidden, down_scale, 0);
  /* the saved gate, up and product (random: the backward takes them as given), grad_y,
   * and the gradients: weights gate, up, down, then biases gate, up, down */
  void *gate = random_matrix(dtype, rows, hidden), *up = random_matrix(dtype, rows, hidden);
  void *product = random_matrix(dtype, rows, hidden);
  operand grad_y = make_gradient(dtype, rows, out_dim);
  void *grad_x = maybe_gradient(dtype, rows * dim);
  const int64_t grad_sizes[6] = {hidden * dim, hidden * dim, out_dim * hidden,
                                 hidden,       hidden,       out_dim};
  void *grads[6];
  for (int i = 0; i < 6; ++i) grads[i] = maybe_gradient(dtype, grad_sizes[i]);
  const fmlp_cpu_gated_block_backward_args args = {
      .dtype = dtype,
      .rows = rows,
      .dim = dim,
      .hidden = hidden,
      .out_dim = out_dim,
      .x = input_of(&x),
      .w_gate = input_of(&wg),
      .w_up = input_of(&wu),
      .w_down = input_of(&wd),
      .activation = activation,
      .saved_gate = gate,
      .saved_up = up,
      .saved_product = product,
      .grad_y = input_of(&grad_y),
      .grad_x = grad_x,
      .grad_w_gate = grads[0],
      .grad_w_up = grads[1],
      .grad_w_down = grads[2],
      .grad_bias_gate = grads[3],
      .grad_bias_up = grads[4],
      .grad_bias_down = grads[5],
  };
  fmlp_threading storage;
  char what[256];
  snprintf(what, sizeof what,
           "gated_block_backward dtype=%d rows=%lld dim=%lld hidden=%lld out=%lld act=%d", dtype,
           (long long)rows, (long long)dim, (long long)hidden, (long long)out_dim, activation);
  t->what = what;
  t->dtype = dtype;
  expect_status(t, fmlp_cpu_gated_block_backward(&args, draw_threading(&storage)), FMLP_OK,
                what);

  /* the reference: grad_product = grad_y @ W_down, then the gate's and up's gradients
   * from it and the saved gate and up, each rounded as the kernel stores it */
  operand saved_product = contiguous(dtype, product, rows, hidden);
  double *xd = doubles_of(&x), *wgd = doubles_of(&wg), *wud = doubles_of(&wu);
  double *wdd = doubles_of(&wd), *gy = doubles_of(&grad_y);
  double *pd = doubles_of(&saved_product);
  const size_t cells = (size_t)(rows * (hidden > dim ? hidden : dim) + 1);
  double *grad_gate = malloc(sizeof(double) * cells), *grad_up = malloc(sizeof(double) * cells);
  double *gy_magnitude = malloc(sizeof(double) * (size_t)(rows * out_dim + 1));
  for (int64_t i = 0; i < rows * out_dim; ++i) gy_magnitude[i] = fabs(gy[i]);
  double *want_x = malloc(sizeof(double) * cells), *from_up = malloc(sizeof(double) * cells);
  double *gate_magnitude = malloc(sizeof(double) * cells);
  double *up_magnitude = malloc(sizeof(double) * cells);
  double *x_magnitude = malloc(sizeof(double) * cells);
  double *from_up_magnitude = malloc(sizeof(double) * cells);
  times(gy, gy_magnitude, wdd, rows, out_dim, hidden, grad_up, up_magnitude); /* grad_product */
  for (int64_t i = 0; i < rows * hidden; ++i) {
    const double grad_product = stored(dtype, grad_up[i]), product_magnitude = up_magnitude[i];
    const double g = get(gate, dtype, i), u = get(up, dtype, i);
    const double slope = reference_activation_grad(g, activation);
    const double activated = reference_activation(g, activation);
    grad_gate[i] = stored(dtype, stored(dtype, grad_product * u) * slope); /* as eager rounds */
    gate_magnitude[i] = product_magnitude * fabs(u) * activation_magnitude(slope);
    grad_up[i] = stored(dtype, grad_product * activated);
    up_magnitude[i] = product_magnitude * activation_magnitude(activated);
  }
  expect_layer_gradients(t, grads[0], grads[3], grad_gate, gate_magnitude, xd, rows, hidden, dim);
  expect_layer_gradients(t, grads[1], grads[4], grad_up, up_magnitude, xd, rows, hidden, dim);
  expect_layer_gradients(t, grads[2], grads[5], gy, gy_magnitude, pd, rows, out_dim, hidden);
  /* grad_x = grad_gate @ W_gate + grad_up @ W_up, each half rounded, then their sum */
  times(grad_up, up_magnitude, wud, rows, hidden, dim, from_up, from_up_magnitude);
  times(grad_gate, gate_magnitude, wgd, rows, hidden, dim, want_x, x_magnitude);
  for (int64_t i = 0; i < rows * dim; ++i) {
    const double halves = fabs(want_x[i]) + fabs(from_up[i]);
    want_x[i] = stored(dtype, stored(dtype, want_x[i]) + stored(dtype, from_up[i]));
    x_magnitude[i] += from_up_magnitude[i];
    from_up[i] = halves;
  }
  expect_input_gradient(t, grad_x, want_x, x_magnitude, from_up, rows, dim, 2 * hidden);
  double *scratch[] = {xd,      wgd,          wud,    wdd,     gy,
                       pd,      gy_magnitude, want_x, from_up, gate_magnitude,
                       grad_up, up_magnitude, x_magnitude, from_up_magnitude, grad_gate};
  for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; ++i) free(scratch[i]);
  void *buffers[] = {x.data, wg.data, wu.data, wd.data, gate, up, product, grad_y.data, grad_x};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; ++i) free(buffers[i]);
  for (int i = 0; i < 6; ++i) free(grads[i]);
}

/* n values: mostly U(-4, 4), some exact zeros and large magnitudes. */
static void *random_vector(fmlp_dtype dtype, int64_t n) {
  void *v = alloc_elems(dtype, n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t kind = below(16);
    set(v, dtype, i, kind == 0 ? 0.0 : kind == 1 ? 30.0 * uniform() : 4.0 * uniform());
  }
  return v;
}

static void fuzz_backward(tally *t, fmlp_dtype dtype, int gated) {
  /* the pointwise passes work in chunks of 2^14: cross a chunk edge sometimes */
  const int64_t n = below(4) == 0 ? (1 << 14) - 2 + below(40000) : draw_size(3000);
  const fmlp_activation activation = (fmlp_activation)below(FMLP_ACT_COUNT);
  void *grad = random_vector(dtype, n), *pre = random_vector(dtype, n);
  void *up = gated ? random_vector(dtype, n) : NULL;
  void *out = alloc_elems(dtype, n), *out_up = gated ? alloc_elems(dtype, n) : NULL;
  /* half the plain calls in place (out = grad), as the host-GEMM path's chain
   * backward makes them */
  const int in_place = !gated && below(2) == 0;
  if (in_place) memcpy(out, grad, (size_t)n * elem_size(dtype));
  fmlp_threading storage;
  char what[128];
  snprintf(what, sizeof what, "%s dtype=%d n=%lld act=%d in_place=%d",
           gated ? "gated_backward" : "activation_backward", dtype, (long long)n, activation,
           in_place);
  t->what = what;
  const fmlp_threading *threading = draw_threading(&storage);
  const fmlp_status status =
      gated ? fmlp_cpu_gated_backward(dtype, n, grad, pre, up, activation, out, out_up, threading)
            : fmlp_cpu_activation_backward(dtype, n, in_place ? out : grad, pre, activation, out,
                                           threading);
  expect_status(t, status, FMLP_OK, what);
  /* one rounding of the result: 2^-8 relative in bfloat16 */
  const double rtol = dtype == FMLP_F64 ? 1e-10 : dtype == FMLP_BF16 ? 4e-3 : 1e-5;
  const double atol = dtype == FMLP_F64 ? 1e-12 : dtype == FMLP_BF16 ? 1e-4 : 1e-6;
  for (int64_t i = 0; i < n; ++i) {
    const double g = get(grad, dtype, i), z = get(pre, dtype, i);
    if (gated) {
      const double u = get(up, dtype, i);
      /* grad * up rounded first, as eager's separate ops round it */
      const double product = stored(dtype, g * u);
      expect_close(t, get(out, dtype, i), product * reference_activation_grad(z, activation),
                   rtol, atol * (1 + fabs(product)), "grad_gate", i);
      expect_close(t, get(out_up, dtype, i), g * reference_activation(z, activation), rtol,
                   atol * (1 + fabs(g * z)), "grad_up", i);
    } else {
      expect_close(t, get(out, dtype, i), g * reference_activation_grad(z, activation), rtol,
                   atol * (1 + fabs(g)), "grad_pre", i);
    }
  }
  free(grad);
  free(pre);
  free(up);
  free(out);
  free(out_up);
}

/* ---- invalid arguments: a status, never a crash ---- */

static void fuzz_invalid(tally *t) {
  float x_data[4] = {0}, w_data[4] = {0}, y_data[4] = {0};
  int64_t widths[2] = {2, 2};
  fmlp_input w = {w_data, 2, 1};
  fmlp_cpu_chain_args ok = {
      .dtype = FMLP_F32,
      .rows = 2,
      .n_layers = 1,
      .widths = widths,
      .x = {x_data, 2, 1},
      .weights = &w,
      .y = y_data,
      .y_row_stride = 2,
  };
  t->what = "invalid arguments";
  expect_status(t, fmlp_cpu_chain(&ok, NULL), FMLP_OK, "valid chain");
  expect_status(t, fmlp_cpu_chain(NULL, NULL), FMLP_ERR_INVALID_ARGUMENT, "NULL args");
  fmlp_cpu_chain_args bad = ok;
  bad.dtype = FMLP_F16;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "f16 dtype on CPU");
  bad = ok;
  bad.n_layers = 0;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "zero layers");
  bad = ok;
  bad.rows = -1;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "negative rows");
  bad = ok;
  bad.hidden_activation = FMLP_ACT_COUNT;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "unknown activation");
  bad = ok;
  bad.final_activation = (fmlp_activation)-1;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "negative activation");
  bad = ok;
  bad.x.data = NULL;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "NULL x");
  bad = ok;
  bad.y = NULL;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "NULL y");
  bad = ok;
  bad.widths = NULL;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "NULL widths");
  bad = ok;
  bad.weights = NULL;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "NULL weights");
  int64_t huge[2] = {INT64_MAX / 2, 4};
  bad = ok;
  bad.rows = 4;
  bad.widths = huge;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_SIZE_OVERFLOW, "rows x width overflow");
  int64_t negative[2] = {2, -3};
  bad = ok;
  bad.widths = negative;
  expect_status(t, fmlp_cpu_chain(&bad, NULL), FMLP_ERR_INVALID_ARGUMENT, "negative width");

  /* a pre-activation may be left out only where the layer's output serves: a
   * layer whose derivative reads its output (relu), the last one's from y */
  float h_data[4] = {0}, pre_data[4] = {0}, gy_data[4] = {0}, gw_data[2][4] = {{0}};
  int64_t backward_widths[3] = {2, 2, 2};
  const fmlp_input backward_weights[2] = {w, w};
  const void *hidden_pre_left_out[2] = {NULL, pre_data}, *final_pre_left_out[2] = {pre_data, NULL};
  const void *saved_hidden[2] = {h_data, NULL};
  void *grad_weights[2] = {gw_data[0], gw_data[1]};
  fmlp_cpu_chain_backward_args backward = {
      .dtype = FMLP_F32,
      .rows = 2,
      .n_layers = 2,
      .widths = backward_widths,
      .x = {x_data, 2, 1},
      .weights = backward_weights,
      .hidden_activation = FMLP_ACT_RELU,
      .final_activation = FMLP_ACT_RELU,
      .saved_pre = hidden_pre_left_out,
      .saved_hidden = saved_hidden,
      .grad_y = {gy_data, 2, 1},
      .grad_weights = grad_weights,
  };
  expect_status(t, fmlp_cpu_chain_backward(&backward, NULL), FMLP_OK,
                "relu hidden layer without its pre-activation");
  backward.hidden_activation = FMLP_ACT_GELU;
  expect_status(t, fmlp_cpu_chain_backward(&backward, NULL), FMLP_ERR_INVALID_ARGUMENT,
                "gelu hidden layer without its pre-activation");
  backward.hidden_activation = FMLP_ACT_RELU;
  backward.saved_pre = final_pre_left_out;
  expect_status(t, fmlp_cpu_chain_backward(&backward, NULL), FMLP_ERR_INVALID_ARGUMENT,
                "relu last layer without its pre-activation or y");
  backward.y = y_data;
  expect_status(t, fmlp_cpu_chain_backward(&backward, NULL), FMLP_OK,
                "relu last layer without its pre-activation, with y");
  backward.final_activation = FMLP_ACT_GELU;
  expect_status(t, fmlp_cpu_chain_backward(&backward, NULL), FMLP_ERR_INVALID_ARGUMENT,
                "gelu last layer without its pre-activation, with y");

  fmlp_cpu_gated_args gated = {
      .dtype = FMLP_F64,
      .rows = INT64_MAX / 4,
      .dim = 1,
      .hidden = 2,
      .out_dim = 1,
      .x = {x_data, 0, 1},
      .w_gate = {w_data, 1, 1},
      .w_up = {w_data, 1, 1},
      .w_down = {w_data, 2, 1},
      .y = y_data,
      .y_row_stride = 1,
  };
  expect_status(t, fmlp_cpu_gated(&gated, NULL), FMLP_ERR_SIZE_OVERFLOW,
                "gated scratch rows x 3 hidden overflow");
  gated.rows = 1;
  gated.activation = FMLP_ACT_COUNT;
  expect_status(t, fmlp_cpu_gated(&gated, NULL), FMLP_ERR_INVALID_ARGUMENT,
                "gated unknown activation");
  gated.activation = FMLP_ACT_RELU;
  gated.w_down.data = NULL;
  expect_status(t, fmlp_cpu_gated(&gated, NULL), FMLP_ERR_INVALID_ARGUMENT, "gated NULL w_down");
  expect_status(t, fmlp_cpu_gated(NULL, NULL), FMLP_ERR_INVALID_ARGUMENT, "gated NULL args");

  expect_status(t, fmlp_cpu_activation_backward(FMLP_F32, -1, x_data, x_data, FMLP_ACT_RELU,
                                                y_data, NULL),
                FMLP_ERR_INVALID_ARGUMENT, "activation_backward negative n");
  expect_status(t, fmlp_cpu_activation_backward(FMLP_F32, 4, NULL, x_data, FMLP_ACT_RELU, y_data,
                                                NULL),
                FMLP_ERR_INVALID_ARGUMENT, "activation_backward NULL grad");
  expect_status(t, fmlp_cpu_activation_backward(FMLP_F16, 4, x_data, x_data, FMLP_ACT_RELU,
                                                y_data, NULL),
                FMLP_ERR_INVALID_ARGUMENT, "activation_backward f16 on CPU");
  expect_status(t, fmlp_cpu_activation_backward(FMLP_F32, 0, NULL, NULL, FMLP_ACT_GELU, NULL,
                                                NULL),
                FMLP_OK, "activation_backward n = 0 with NULLs");
  expect_status(t, fmlp_cpu_gated_backward(FMLP_F64, 2, x_data, x_data, NULL, FMLP_ACT_SILU,
                                           y_data, y_data, NULL),
                FMLP_ERR_INVALID_ARGUMENT, "gated_backward NULL up");
  expect_status(t, fmlp_cpu_gated_backward(FMLP_F64, 2, x_data, x_data, x_data,
                                           (fmlp_activation)99, y_data, y_data, NULL),
                FMLP_ERR_INVALID_ARGUMENT, "gated_backward unknown activation");
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s SECONDS [SEED]\n", argv[0]);
    return 2;
  }
  const double seconds = atof(argv[1]);
  const uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : (uint64_t)time(NULL);
  rng_state = seed;
  tally t = {0, 0, "", FMLP_F32};
  fuzz_invalid(&t);
  const double start = now_seconds();
  /* each operation's share of the iterations (tenths) */
  static const char *const names[] = {"chain", "gated", "chain_backward", "gated_block_backward",
                                      "activation_backward", "gated_backward"};
  static const int64_t shares[] = {3, 2, 2, 1, 1, 1};
  int64_t iterations = 0, per_op[6] = {0};
  while (now_seconds() - start < seconds && t.failures == 0) {
    static const fmlp_dtype dtypes[] = {FMLP_F32, FMLP_F64, FMLP_BF16};
    const fmlp_dtype dtype = dtypes[below(3)];
    int64_t op = 0, draw = below(10);
    while (draw >= shares[op]) draw -= shares[op++];
    switch (op) {
      case 0: fuzz_chain(&t, dtype); break;
      case 1: fuzz_gated(&t, dtype); break;
      case 2: fuzz_chain_backward(&t, dtype); break;
      case 3: fuzz_gated_block_backward(&t, dtype); break;
      default: fuzz_backward(&t, dtype, op == 5); break;
    }
    ++per_op[op];
    ++iterations;
  }
  printf("seed %llu: %lld iterations (", (unsigned long long)seed, (long long)iterations);
  for (int op = 0; op < 6; ++op) {
    printf("%s%s %lld", op ? ", " : "", names[op], (long long)per_op[op]);
  }
  printf("), %lld checks, %lld failed in %.1f s\n", (long long)t.checks, (long long)t.failures,
         now_seconds() - start);
  return t.failures == 0 ? 0 : 1;
}
