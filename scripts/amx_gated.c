/* The AMX gated tile in gemm_gated_rows over a row block (issue 12): one
 * thread, bfloat16, ROWS x K -> gate and up of H columns, both weights
 * packed ahead, act(gate) * up into the product; the cases (K, H,
 * activation, gate and up saved or not) run once each a round in turn, so
 * the load moves them alike; each case's line is the min and median over
 * the rounds of one thread's CPU time, after the hash of its outputs (to
 * compare two builds' results by). Built and run by scripts/amx_gated.py. */
#define _DEFAULT_SOURCE /* syscall, CLOCK_THREAD_CPUTIME_ID */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_bf16_avx512_amx.c"
#include "harness.h"
#include "amx_harness.h"

typedef struct {
  int64_t k, h;
  fmlp_activation activation;
  int save_gate_up;
  const char *name;
} gated_case;

static const gated_case cases[] = {
    {768, 3072, FMLP_ACT_GELU_TANH, 0, "768->3072 gelu_tanh"},
    {1024, 4096, FMLP_ACT_GELU, 0, "1024->4096 gelu"},
    {1024, 4096, FMLP_ACT_GELU, 1, "1024->4096 gelu saved"},
};
enum { CASES = sizeof cases / sizeof cases[0] };

/* One case's buffers. */
typedef struct {
  fmlp_input x;
  FN(packed_weight) gate_w, up_w;
  STORE *bias_gate, *bias_up, *gate, *up, *product;
  REAL *input_pack;
} buffers;

static FN(packed_weight) packed(int64_t rows, int64_t n, int64_t k, unsigned seed) {
  const fmlp_input source = {filled_bf16(n * k, seed), k, 1};
  FN(packed_weight) w;
  REAL *data = fmlp_alloc_scratch(FN(packed_weight_elems)(n, k), sizeof(REAL));
  if (data == NULL || FN(pack_weight)(source, n, k, rows, NULL, data, &w) != FMLP_OK) exit(1);
  return w;
}

static buffers make_buffers(int64_t rows, gated_case c) {
  buffers b;
  b.x = (fmlp_input){filled_bf16(rows * c.k, 1), c.k, 1};
  b.gate_w = packed(rows, c.h, c.k, 2);
  b.up_w = packed(rows, c.h, c.k, 3);
  b.bias_gate = filled_bf16(c.h, 4);
  b.bias_up = filled_bf16(c.h, 5);
  b.gate = fmlp_alloc_scratch(rows * c.h, sizeof(STORE));
  b.up = fmlp_alloc_scratch(rows * c.h, sizeof(STORE));
  b.product = fmlp_alloc_scratch(rows * c.h, sizeof(STORE));
  b.input_pack = fmlp_alloc_scratch(FN(input_pack_elems)(rows, c.k), sizeof(REAL));
  if (b.gate == NULL || b.up == NULL || b.product == NULL || b.input_pack == NULL) exit(1);
  return b;
}

static void run_case(const buffers *b, int64_t rows, gated_case c) {
  FN(gemm_gated_rows)(b->x, NULL, rows, &b->gate_w, &b->up_w, b->bias_gate, b->bias_up,
                      c.activation, b->gate, b->up, b->product, c.h, c.save_gate_up,
                      b->input_pack, NULL);
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 20;
  const int64_t rows = argc > 2 ? atoll(argv[2]) : 512;
  if (rounds < 1 || rows <= GEMM_UNPACKED_MAX_ROWS) {
    fprintf(stderr, "usage: %s [ROUNDS [ROWS]] (ROWS > 64)\n", argv[0]);
    return 2;
  }
  request_amx_tiles();
  buffers b[CASES];
  for (int c = 0; c < CASES; ++c) b[c] = make_buffers(rows, cases[c]);
  for (int c = 0; c < CASES; ++c) {
    run_case(&b[c], rows, cases[c]); /* warm-up, every page touched */
    uint64_t hash = hash_bf16(FNV_START, b[c].product, rows * cases[c].h);
    if (cases[c].save_gate_up) {
      hash = hash_bf16(hash_bf16(hash, b[c].gate, rows * cases[c].h), b[c].up,
                       rows * cases[c].h);
    }
    printf("%-24s hash %016llx\n", cases[c].name, (unsigned long long)hash);
  }
  double *times = malloc(sizeof(double) * (size_t)(CASES * rounds));
  if (times == NULL) return 1;
  for (int r = 0; r < rounds; ++r) {
    for (int c = 0; c < CASES; ++c) {
      const double t0 = cpu_now();
      run_case(&b[c], rows, cases[c]);
      times[c * rounds + r] = cpu_now() - t0;
    }
  }
  for (int c = 0; c < CASES; ++c) {
    double *t = times + c * rounds;
    qsort(t, (size_t)rounds, sizeof(double), by_value);
    printf("%-24s min %7.3f ms  med %7.3f ms\n", cases[c].name, t[0] * 1e3,
           t[rounds / 2] * 1e3);
  }
  return 0;
}
