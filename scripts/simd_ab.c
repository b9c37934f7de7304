/* Two builds of a SIMD unit in one process (issues 12, 18): A, the unit as
 * the tree has it, and B, the same unit with some of its headers swapped for
 * variants (scripts/simd_ab.py builds both, their symbols suffixed _a and
 * _b). UNIT is the unit's suffix (f32_avx512, bf16_avx512_bf16), and
 * STORAGE_BF16 says its storage is bfloat16: every buffer then holds
 * bfloat16 values. Whole ops on one thread, A and B alternating within each
 * round (which goes first swaps every round), so both see the same moment's
 * load; each case prints the median and quartiles of B's time over A's and
 * the median GFLOP/s of each. One thread's CPU time: other processes on the
 * core cost it little, though they still share its caches.
 *
 * Cases: linear GELU at 512 rows (`linear`) and 1024 rows (`linear1024`;
 * both one row block, weights packed just in time), the study MLP at 2048
 * rows and the GeGLU block at 1024 tokens (row blocks cut as for two
 * threads, run one after another on this one; `mlp_layers` adds the study
 * MLP's three layers each alone, rows cut alike), the GeGLU block at 256
 * tokens, and (`gated4096`) at 4096 tokens, weights packed ahead. `few`:
 * linear 768 -> 3072 GELU at 1 to 6 rows. `ksweep`:
 * see k_sweep_cases. The training benches' backwards on one thread:
 * `backward`, bench train_step's 256 x 512^3 and train_small's 16 x 256^3
 * ReLU chains without grad_x, and each one's dW and dX products alone;
 * `gated_backward`, train_gated's GeGLU block at 256 tokens; `forward`, the
 * same two chains' training forwards. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusedmlp/cpu.h"
#include "harness.h"

#ifndef UNIT
#error "compile with -DUNIT=<a kernel unit's suffix>, e.g. -DUNIT=f32_avx512"
#endif
#define STRING2(x) #x
#define STRING(x) STRING2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define BUILD_A(name) CAT(CAT(name, _), CAT(UNIT, _a))
#define BUILD_B(name) CAT(CAT(name, _), CAT(UNIT, _b))

#ifdef STORAGE_BF16
#define DTYPE FMLP_BF16
static void *values(int64_t n, unsigned seed) { return filled_bf16(n, seed); }
#else
#define DTYPE FMLP_F32
static void *values(int64_t n, unsigned seed) { return filled(n, seed); }
#endif
fmlp_status BUILD_A(fmlp_cpu_chain)(const fmlp_cpu_chain_args *, const fmlp_threading *);
fmlp_status BUILD_B(fmlp_cpu_chain)(const fmlp_cpu_chain_args *, const fmlp_threading *);
fmlp_status BUILD_A(fmlp_cpu_gated)(const fmlp_cpu_gated_args *, const fmlp_threading *);
fmlp_status BUILD_B(fmlp_cpu_gated)(const fmlp_cpu_gated_args *, const fmlp_threading *);
fmlp_status BUILD_A(fmlp_cpu_chain_backward)(const fmlp_cpu_chain_backward_args *,
                                             const fmlp_threading *);
fmlp_status BUILD_B(fmlp_cpu_chain_backward)(const fmlp_cpu_chain_backward_args *,
                                             const fmlp_threading *);
fmlp_status BUILD_A(fmlp_cpu_gated_block_backward)(const fmlp_cpu_gated_block_backward_args *,
                                                   const fmlp_threading *);
fmlp_status BUILD_B(fmlp_cpu_gated_block_backward)(const fmlp_cpu_gated_block_backward_args *,
                                                   const fmlp_threading *);

enum { MAX_ROUNDS = 1000 };

/* The drivers cut the rows as for two threads; the tasks run one after
 * another on this one. Only for ops of more than GEMM_JIT_MAX_ROWS rows: a
 * single row block splits its columns in stages that wait for each other. */
static void one_after_another(void *pool, int64_t n_tasks, void *context, fmlp_task_fn fn) {
  (void)pool;
  for (int64_t t = 0; t < n_tasks; ++t) fn(context, t, t + 1);
}
static const fmlp_threading AS_FOR_TWO = {one_after_another, NULL, 2};

typedef enum { CHAIN, GATED, CHAIN_BACKWARD, GATED_BACKWARD } op_kind;

typedef struct {
  op_kind kind;
  fmlp_cpu_chain_args chain;
  fmlp_cpu_gated_args block;
  fmlp_cpu_chain_backward_args chain_backward;
  fmlp_cpu_gated_block_backward_args block_backward;
  const fmlp_threading *threading;
} op;

static fmlp_status run_op(const op *o, int build_b) {
  switch (o->kind) {
    case GATED:
      return (build_b ? BUILD_B(fmlp_cpu_gated) : BUILD_A(fmlp_cpu_gated))(&o->block,
                                                                          o->threading);
    case CHAIN_BACKWARD:
      return (build_b ? BUILD_B(fmlp_cpu_chain_backward)
                      : BUILD_A(fmlp_cpu_chain_backward))(&o->chain_backward, o->threading);
    case GATED_BACKWARD:
      return (build_b ? BUILD_B(fmlp_cpu_gated_block_backward)
                      : BUILD_A(fmlp_cpu_gated_block_backward))(&o->block_backward,
                                                                o->threading);
    default:
      return (build_b ? BUILD_B(fmlp_cpu_chain) : BUILD_A(fmlp_cpu_chain))(&o->chain,
                                                                          o->threading);
  }
}

static double seconds(const op *o, int build_b) {
  const double t0 = cpu_now();
  const fmlp_status status = run_op(o, build_b);
  if (status != FMLP_OK) {
    fprintf(stderr, "status %d\n", (int)status);
    exit(1);
  }
  return cpu_now() - t0;
}

static void compare(const char *what, const op *o, int rounds, double flops) {
  double ratio[MAX_ROUNDS], a[MAX_ROUNDS], b[MAX_ROUNDS];
  seconds(o, 0), seconds(o, 1); /* warm */
  for (int r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      a[r] = seconds(o, 0);
      b[r] = seconds(o, 1);
    } else {
      b[r] = seconds(o, 1);
      a[r] = seconds(o, 0);
    }
    ratio[r] = b[r] / a[r];
  }
  qsort(ratio, (size_t)rounds, sizeof(double), by_value);
  qsort(a, (size_t)rounds, sizeof(double), by_value);
  qsort(b, (size_t)rounds, sizeof(double), by_value);
  printf("%-40s B/A time %.3f (quartiles %.3f-%.3f); median A %.1f, B %.1f GFLOP/s\n", what,
         ratio[rounds / 2], ratio[rounds / 4], ratio[rounds - 1 - rounds / 4],
         flops / a[rounds / 2] / 1e9, flops / b[rounds / 2] / 1e9);
  fflush(stdout);
}

/* One layer, rows x k -> n GELU with a bias, its rows cut as `threading`
 * says (NULL: one block). */
static void linear_case(int rounds, int64_t rows, int64_t k, int64_t n,
                        const fmlp_threading *threading) {
  const int64_t widths[2] = {k, n};
  const fmlp_input weight = {values(n * k, 2), k, 1};
  const void *bias[1] = {values(n, 3)};
  const op o = {.kind = CHAIN,
                .chain = {.dtype = DTYPE, .rows = rows, .n_layers = 1, .widths = widths,
                          .x = {values(rows * k, 1), k, 1}, .weights = &weight,
                          .biases = bias, .hidden_activation = FMLP_ACT_GELU,
                          .final_activation = FMLP_ACT_GELU, .y = values(rows * n, 4),
                          .y_row_stride = n},
                .threading = threading};
  char what[80];
  snprintf(what, sizeof what, "linear %lld x %lld -> %lld GELU", (long long)rows, (long long)k,
           (long long)n);
  compare(what, &o, rounds, 2.0 * rows * k * n);
  free((void *)weight.data), free((void *)bias[0]), free((void *)o.chain.x.data);
  free(o.chain.y);
}

static void linear_cases(int rounds, int64_t rows) {
  static const int64_t shapes[][2] = {{768, 3072}, {3072, 768}, {1024, 4096}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s) {
    linear_case(rounds, rows, shapes[s][0], shapes[s][1], NULL);
  }
}

/* One to six rows (token decoding in small batches), each its own linear
 * 768 -> 3072 GELU: the dot-product tiles up to DOT_MAX_ROWS rows, the
 * transposed ones past it. */
static void few_rows_cases(int rounds) {
  for (int64_t rows = 1; rows <= 6; ++rows) linear_case(rounds, rows, 768, 3072, NULL);
}

static void mlp_case(int rounds, int layers) {
  const int64_t rows = 2048, widths[4] = {768, 3072, 3072, 768};
  fmlp_input weights[3];
  const void *biases[3];
  double flops = 0;
  for (int l = 0; l < 3; ++l) {
    weights[l] = (fmlp_input){values(widths[l] * widths[l + 1], 10 + l), widths[l], 1};
    biases[l] = values(widths[l + 1], 20 + l);
    flops += 2.0 * rows * widths[l] * widths[l + 1];
  }
  const op o = {.chain = {.dtype = DTYPE, .rows = rows, .n_layers = 3, .widths = widths,
                          .x = {values(rows * widths[0], 1), widths[0], 1}, .weights = weights,
                          .biases = biases, .hidden_activation = FMLP_ACT_GELU,
                          .final_activation = FMLP_ACT_NONE,
                          .y = values(rows * widths[3], 4), .y_row_stride = widths[3]},
                .threading = &AS_FOR_TWO};
  compare("study MLP 2048 x 768-3072-3072-768 GELU", &o, rounds, flops);
  if (layers) {
    /* each layer alone, its output to a buffer of its own, rows cut alike */
    for (int l = 0; l < 3; ++l) {
      op one = o;
      one.chain.n_layers = 1;
      one.chain.widths = widths + l;
      one.chain.weights = weights + l;
      one.chain.biases = biases + l;
      one.chain.final_activation = l < 2 ? FMLP_ACT_GELU : FMLP_ACT_NONE;
      one.chain.x = (fmlp_input){values(rows * widths[l], 1), widths[l], 1};
      one.chain.y = values(rows * widths[l + 1], 4);
      one.chain.y_row_stride = widths[l + 1];
      char what[80];
      snprintf(what, sizeof what, "  its layer %d alone (%lld -> %lld)", l,
               (long long)widths[l], (long long)widths[l + 1]);
      compare(what, &one, rounds, 2.0 * rows * widths[l] * widths[l + 1]);
      free((void *)one.chain.x.data), free(one.chain.y);
    }
  }
  for (int l = 0; l < 3; ++l) free((void *)weights[l].data), free((void *)biases[l]);
  free((void *)o.chain.x.data), free(o.chain.y);
}

static void gated_cases(int rounds, const int64_t *tokens, size_t count) {
  const int64_t dim = 768, hidden = 3072;
  for (size_t s = 0; s < count; ++s) {
    const int64_t rows = tokens[s];
    const op o = {.kind = GATED,
                  .block = {.dtype = DTYPE, .rows = rows, .dim = dim, .hidden = hidden,
                            .out_dim = dim, .x = {values(rows * dim, 1), dim, 1},
                            .w_gate = {values(hidden * dim, 2), dim, 1},
                            .w_up = {values(hidden * dim, 3), dim, 1},
                            .w_down = {values(dim * hidden, 4), hidden, 1},
                            .activation = FMLP_ACT_GELU_TANH, .y = values(rows * dim, 5),
                            .y_row_stride = dim},
                  .threading = rows > 512 ? &AS_FOR_TWO : NULL};
    char what[80];
    snprintf(what, sizeof what, "GeGLU %lld x 768-3072-768", (long long)rows);
    compare(what, &o, rounds, 2.0 * 3 * rows * dim * hidden);
    free((void *)o.block.x.data), free((void *)o.block.w_gate.data);
    free((void *)o.block.w_up.data), free((void *)o.block.w_down.data), free(o.block.y);
  }
}

/* A training bench's chain forward, `rows` x (width -> width -> width ->
 * width) ReLU with biases, saving each hidden output as fusedmlp::mlp_train
 * does (ReLU's derivative reads its output, so no pre-activation is kept). */
static void chain_forward_case(int rounds, int64_t rows, int64_t width) {
  const int64_t widths[4] = {width, width, width, width};
  fmlp_input weights[3];
  const void *biases[3];
  void *hidden[3] = {NULL, NULL, NULL};
  for (int l = 0; l < 3; ++l) {
    weights[l] = (fmlp_input){values(width * width, 10 + l), width, 1};
    biases[l] = values(width, 20 + l);
    if (l < 2) hidden[l] = values(rows * width, 30 + l);
  }
  const op o = {.chain = {.dtype = DTYPE, .rows = rows, .n_layers = 3, .widths = widths,
                          .x = {values(rows * width, 1), width, 1}, .weights = weights,
                          .biases = biases, .hidden_activation = FMLP_ACT_RELU,
                          .final_activation = FMLP_ACT_NONE, .y = values(rows * width, 4),
                          .y_row_stride = width, .saved_hidden = hidden}};
  char what[80];
  snprintf(what, sizeof what, "forward %lld x %lld^3 ReLU, saving", (long long)rows,
           (long long)width);
  compare(what, &o, rounds, 3 * 2.0 * rows * width * width);
  for (int l = 0; l < 3; ++l) {
    free((void *)weights[l].data), free((void *)biases[l]), free(hidden[l]);
  }
  free((void *)o.chain.x.data), free(o.chain.y);
}

/* A training bench's chain backward, `rows` x (width -> width -> width ->
 * width) ReLU with biases, no grad_x (autograd skips it for an input without
 * grad), then its products one at a time: one layer's dW alone and its dX
 * alone. */
static void chain_backward_cases(int rounds, int64_t rows, int64_t width) {
  const int64_t widths[4] = {width, width, width, width};
  fmlp_input weights[3];
  const void *pre[3], *hidden[3];
  void *grad_w[3], *grad_b[3];
  for (int l = 0; l < 3; ++l) {
    weights[l] = (fmlp_input){values(width * width, 10 + l), width, 1};
    pre[l] = values(rows * width, 20 + l);
    hidden[l] = values(rows * width, 30 + l);
    grad_w[l] = values(width * width, 40 + l);
    grad_b[l] = values(width, 50 + l);
  }
  void *grad_x = values(rows * width, 5);
  const fmlp_cpu_chain_backward_args chain = {
      .dtype = DTYPE, .rows = rows, .n_layers = 3, .widths = widths,
      .x = {values(rows * width, 1), width, 1}, .weights = weights,
      .hidden_activation = FMLP_ACT_RELU, .final_activation = FMLP_ACT_NONE,
      .saved_pre = pre, .saved_hidden = hidden, .grad_y = {values(rows * width, 4), width, 1},
      .grad_x = NULL, .grad_weights = grad_w, .grad_biases = grad_b};
  const double product = 2.0 * rows * width * width;
  op o = {.kind = CHAIN_BACKWARD, .chain_backward = chain};
  char what[80];
  snprintf(what, sizeof what, "backward %lld x %lld^3 ReLU, no grad_x", (long long)rows,
           (long long)width);
  compare(what, &o, rounds, 5 * product);
  void *const no_weights[1] = {NULL};
  o.chain_backward.n_layers = 1;
  o.chain_backward.grad_biases = NULL;
  snprintf(what, sizeof what, "its dW alone (K = %lld)", (long long)rows);
  compare(what, &o, rounds, product);
  o.chain_backward.grad_weights = no_weights;
  o.chain_backward.grad_x = grad_x;
  compare("its dX alone", &o, rounds, product);
  for (int l = 0; l < 3; ++l) {
    free((void *)weights[l].data), free((void *)pre[l]), free((void *)hidden[l]);
    free(grad_w[l]), free(grad_b[l]);
  }
  free(grad_x), free((void *)chain.x.data), free((void *)chain.grad_y.data);
}

/* Bench train_gated's backward: the GeGLU block at 256 tokens, no biases. */
static void gated_backward_case(int rounds) {
  const int64_t rows = 256, dim = 768, hidden = 3072;
  const fmlp_cpu_gated_block_backward_args b = {
      .dtype = DTYPE, .rows = rows, .dim = dim, .hidden = hidden, .out_dim = dim,
      .x = {values(rows * dim, 1), dim, 1}, .w_gate = {values(hidden * dim, 2), dim, 1},
      .w_up = {values(hidden * dim, 3), dim, 1}, .w_down = {values(dim * hidden, 4), hidden, 1},
      .activation = FMLP_ACT_GELU_TANH, .saved_gate = values(rows * hidden, 5),
      .saved_up = values(rows * hidden, 6), .saved_product = values(rows * hidden, 7),
      .grad_y = {values(rows * dim, 8), dim, 1}, .grad_x = values(rows * dim, 9),
      .grad_w_gate = values(hidden * dim, 10), .grad_w_up = values(hidden * dim, 11),
      .grad_w_down = values(dim * hidden, 12)};
  const op o = {.kind = GATED_BACKWARD, .block_backward = b};
  compare("GeGLU backward 256 x 768-3072-768", &o, rounds, 2.0 * 6 * rows * dim * hidden);
  free((void *)b.x.data), free((void *)b.w_gate.data), free((void *)b.w_up.data);
  free((void *)b.w_down.data), free((void *)b.saved_gate), free((void *)b.saved_up);
  free((void *)b.saved_product), free((void *)b.grad_y.data), free(b.grad_x);
  free(b.grad_w_gate), free(b.grad_w_up), free(b.grad_w_down);
}

/* Single products at K = 768, 1024 and 3072, everything else equal (issue
 * 18: the cases with K >= 1024 ran at a lower fraction of the peak): rows x K
 * -> 3072 GELU at 1024 rows (one row block, weights packed just in time) and
 * 4096 (packed ahead, row blocks cut as for two threads). */
static void k_sweep_cases(int rounds) {
  static const int64_t row_counts[] = {1024, 4096}, depths[] = {768, 1024, 3072};
  for (size_t r = 0; r < sizeof row_counts / sizeof row_counts[0]; ++r) {
    for (size_t d = 0; d < sizeof depths / sizeof depths[0]; ++d) {
      const int64_t rows = row_counts[r];
      linear_case(rounds, rows, depths[d], 3072, rows > 1024 ? &AS_FOR_TWO : NULL);
    }
  }
}

/* Whether the comma-separated list `cases` names `name`. */
static int names(const char *cases, const char *name) {
  const size_t length = strlen(name);
  for (const char *at = cases; (at = strstr(at, name)) != NULL; at += length) {
    if ((at == cases || at[-1] == ',') && (at[length] == ',' || at[length] == '\0')) return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 15;
  const char *cases = argc > 2 ? argv[2] : "linear,mlp,gated";
  if (rounds < 1) rounds = 1;
  if (rounds > MAX_ROUNDS) rounds = MAX_ROUNDS;
  printf("one thread, %d rounds, B/A of the %s unit\n", rounds, STRING(UNIT));
  if (names(cases, "linear")) linear_cases(rounds, 512);
  if (names(cases, "linear1024")) linear_cases(rounds, 1024);
  if (names(cases, "few")) few_rows_cases(rounds);
  if (names(cases, "mlp") || names(cases, "mlp_layers")) {
    mlp_case(rounds, names(cases, "mlp_layers"));
  }
  static const int64_t one_block[] = {256, 1024}, row_blocks[] = {4096};
  if (names(cases, "gated")) gated_cases(rounds, one_block, 2);
  if (names(cases, "gated4096")) gated_cases(rounds, row_blocks, 1);
  if (names(cases, "ksweep")) k_sweep_cases(rounds);
  if (names(cases, "backward")) {
    chain_backward_cases(rounds, 256, 512); /* train_step */
    chain_backward_cases(rounds, 16, 256);  /* train_small */
  }
  if (names(cases, "forward")) {
    chain_forward_case(rounds, 256, 512); /* train_step */
    chain_forward_case(rounds, 16, 256);  /* train_small */
  }
  if (names(cases, "gated_backward")) gated_backward_case(rounds);
  return 0;
}
