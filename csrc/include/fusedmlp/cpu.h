/* CPU kernels: C11, on float, double and bfloat16 storage (FMLP_BF16: each
 * value its 16 bits in a uint16_t). bfloat16 accumulates in float and rounds
 * once to nearest even at each store, as PyTorch does: hidden layers, saved
 * tensors and gradients are handed on rounded, as eager bfloat16 rounds them;
 * bias gradients are summed in float. Which (dtype, instruction set) kernels
 * exist: fusedmlp/cpu_isas.def.
 */
#ifndef FUSEDMLP_CPU_H
#define FUSEDMLP_CPU_H

#include "fusedmlp/fusedmlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Instruction sets the kernels are built for, FMLP_ISA_<ID> in the order of
 * the registry fusedmlp/cpu_isas.def (PORTABLE = 0: plain C11, any CPU). */
typedef enum {
#define FMLP_ISA(id, name, flags, features) FMLP_ISA_##id,
#include "fusedmlp/cpu_isas.def"
  FMLP_ISA_COUNT
} fmlp_cpu_isa;

/* Whether this CPU runs an instruction set: its architecture and the
 * features the registry names (x86: CPUID; aarch64 Linux: the kernel's
 * HWCAP bits). */
int fmlp_cpu_isa_supported(fmlp_cpu_isa isa);

/* Whether the registry marks the ISA FMLP_FORCED_ONLY for this CPU's vendor:
 * detection skips it, FUSEDMLP_ISA may still force it. */
int fmlp_cpu_isa_forced_only(fmlp_cpu_isa isa);

/* Whether the registry marks the ISA FMLP_BF16_NATIVE: its bfloat16 unit
 * multiplies bfloat16 in hardware. */
int fmlp_cpu_isa_bf16_native(fmlp_cpu_isa isa);

/* The best instruction set this CPU supports: the last supported one of the
 * registry that is not FMLP_FORCED_ONLY for its vendor, whatever FUSEDMLP_ISA
 * says. */
fmlp_cpu_isa fmlp_cpu_isa_best(void);

/* The instruction set the kernels use on this CPU: fmlp_cpu_isa_best(), or
 * the one the environment variable FUSEDMLP_ISA names (see
 * fmlp_cpu_isa_name) if the CPU supports it (else the best one).
 * Computed on each call (CPUID is cached by libgcc; getenv is cheap), so no
 * state. Each dtype runs its best kernel unit at or below this one. */
fmlp_cpu_isa fmlp_cpu_isa_in_use(void);

/* The registry's name of an instruction set: "portable", "neon", "avx2"... */
const char *fmlp_cpu_isa_name(fmlp_cpu_isa isa);

/* Where the CPU ops' matrix products run: our kernels, or the host
 * framework's GEMM (ATen) between our epilogue passes (fmlp_cpu_copy_rows,
 * fmlp_cpu_activation_forward, fmlp_cpu_gated_product). */
typedef enum { FMLP_GEMM_KERNELS = 0, FMLP_GEMM_HOST = 1 } fmlp_cpu_gemm;

/* How many rows of a chain of n_layers layers (widths: n_layers + 1 entries,
 * the input's first) the host-GEMM path runs through all its layers at a
 * time: so many that the widest activation of a chunk fits the L2 caches of
 * n_threads threads (at least 256 rows), so that each GEMM reads its input
 * and our pass its output from cache rather than memory; all rows when any
 * weight exceeds one L2 cache (ATen's GEMM would read and pack it again for
 * every chunk) or when a chunk would hold them all. Measured, float32, 2
 * threads, 512 KiB L2: 65536 x (64 -> 128 -> 128 -> 64) ReLU 0.36x eager
 * chunked by 2048 rows, 0.71x unchunked; 2048 x (768 -> 3072 -> 3072 ->
 * 768) GELU, whose weights are 9 MiB, 1.01x chunked by 1024, 0.96x not. */
int64_t fmlp_cpu_host_chunk_rows(fmlp_dtype dtype, int64_t rows, int64_t n_layers,
                                 const int64_t *widths, int64_t n_threads);

/* The instruction set of the kernel unit that dtype runs: its best unit at
 * or below fmlp_cpu_isa_in_use() that this CPU supports (float64 has only
 * PORTABLE); FMLP_ISA_COUNT for a dtype the CPU kernels do not take.
 * Computed on each call, like fmlp_cpu_isa_in_use. */
fmlp_cpu_isa fmlp_cpu_unit_isa(fmlp_dtype dtype);

/* Where dtype's matrix products run: FMLP_GEMM_HOST when the environment
 * variable FUSEDMLP_CPU_GEMM is "aten"; else FMLP_GEMM_KERNELS when
 * FUSEDMLP_ISA names an ISA the CPU supports (it forces our kernels, unless
 * FUSEDMLP_CPU_GEMM is "auto": then it only lowers the level, as on a CPU
 * without the ones above) or the unit dtype runs (fmlp_cpu_unit_isa) is at an
 * ISA the registry lists as measured to beat eager (FMLP_BEATS_EAGER); else
 * FMLP_GEMM_HOST: never slower than eager by default, per dtype (float64,
 * whose only unit is portable, takes the host GEMM on every CPU). Computed
 * on each call, like fmlp_cpu_isa_in_use. */
fmlp_cpu_gemm fmlp_cpu_gemm_in_use(fmlp_dtype dtype);

/* Runs fn over the task range [0, n_tasks), split into chunks that may run
 * concurrently. The kernels never start threads themselves: the caller's
 * thread pool (e.g. ATen's) does, so there is one OpenMP runtime only. */
typedef void (*fmlp_task_fn)(void *task_context, int64_t begin, int64_t end);
typedef struct {
  void (*parallel_for)(void *pool, int64_t n_tasks, void *task_context, fmlp_task_fn fn);
  void *pool;
  int64_t n_threads; /* how many threads parallel_for may use; 1 = serial */
} fmlp_threading;

/* A read-only strided matrix whose sizes come from the surrounding arguments. */
typedef struct {
  const void *data;
  int64_t row_stride, col_stride;
} fmlp_input;

/* Weights packed once for many calls (inference on unchanging weights): the
 * layout in which dtype's kernel unit `unit` (an fmlp_cpu_unit_isa answer)
 * reads a weight packed whole, which depends on the unit, dtype, n and k
 * alone (not on the rows, the cache blocks or w's strides). *bytes: the size
 * of w (n x k) packed for an op over `rows` rows; 0 when such an op takes no
 * packed weight: it reads w in place (a few rows, unit column stride), or w
 * is empty. */
fmlp_status fmlp_cpu_packed_weight_bytes(fmlp_dtype dtype, fmlp_cpu_isa unit, int64_t rows,
                                         fmlp_input w, int64_t n, int64_t k, int64_t *bytes);

/* Where an op that saves nothing for backward runs its matrix products over
 * `rows` rows of the n_weights weights given (their strides matter, not
 * their sizes, which the fmlp_input does not carry): fmlp_cpu_gemm_in_use's
 * answer, except that where it is FMLP_GEMM_HOST by default (not forced by
 * FUSEDMLP_CPU_GEMM=aten), a few rows (up to 4) run our kernels when dtype's
 * unit reads every weight in place at that many rows (fmlp_cpu_packed_weight_bytes
 * 0): such products are bound by reading the weights, and ours read each once
 * (measured: isa.c). Computed on each call, like fmlp_cpu_gemm_in_use. */
fmlp_cpu_gemm fmlp_cpu_inference_gemm(fmlp_dtype dtype, int64_t rows, int64_t n_weights,
                                      const fmlp_input *weights);

/* A buffer of `bytes` for a packed weight, aligned (and huge-page advised)
 * as the kernels' own packs are, so that they read it as fast; free() frees
 * it. NULL when memory runs out. */
void *fmlp_cpu_alloc_packed_weight(int64_t bytes);

/* w (n x k) packed for dtype's unit `unit` into the caller's `packed`, of
 * fmlp_cpu_packed_weight_bytes for rows past the few (best from
 * fmlp_cpu_alloc_packed_weight); the ops take it through their packed_*
 * arguments while w's values stay what they were when packed. */
fmlp_status fmlp_cpu_pack_weight(fmlp_dtype dtype, fmlp_cpu_isa unit, fmlp_input w, int64_t n,
                                 int64_t k, void *packed, const fmlp_threading *threading);

/* A chain of linear layers over `rows` rows:
 *   h_0 = x,  h_{l+1} = act_l(h_l @ weights[l].T + biases[l]),
 * with act_l = hidden_activation for every layer but the last and
 * final_activation for the last. A single fused Linear is n_layers = 1. */
typedef struct {
  fmlp_dtype dtype; /* FMLP_F32, FMLP_F64 or FMLP_BF16, shared by every pointer below */
  int64_t rows;
  int64_t n_layers;
  const int64_t *widths;     /* n_layers + 1 sizes: in, h_1, ..., out */
  fmlp_input x;              /* rows x widths[0] */
  const fmlp_input *weights; /* weights[l]: widths[l+1] x widths[l] */
  const void *const *biases; /* biases[l]: widths[l+1] contiguous, or NULL */
  fmlp_activation hidden_activation;
  fmlp_activation final_activation;
  void *y; /* rows x widths[n_layers], unit column stride */
  int64_t y_row_stride;
  /* For training, or NULL: saved_pre[l] receives the pre-activation of
   * layer l (rows x widths[l+1], contiguous); saved_hidden[l] receives h_{l+1}
   * for every layer but the last (contiguous). Either array may be NULL, and
   * so may any entry. */
  void *const *saved_pre;
  void *const *saved_hidden;
  /* NULL, or for each layer weights[l] already packed for the unit
   * packed_unit (fmlp_cpu_pack_weight), or NULL (packed here, as without).
   * With any packed weight the op runs on the unit packed_unit, which must
   * be one of dtype's that this CPU runs; rows that read their weights in
   * place (fmlp_cpu_packed_weight_bytes 0) leave them unused. */
  const void *const *packed_weights;
  fmlp_cpu_isa packed_unit;
} fmlp_cpu_chain_args;

fmlp_status fmlp_cpu_chain(const fmlp_cpu_chain_args *args, const fmlp_threading *threading);

/* The gradients of a chain from what a training call saved: saved_pre[l]
 * for every layer whose activation is not "none", saved_hidden[l] for every
 * layer but the last (as fmlp_cpu_chain writes them). A layer whose
 * activation's derivative reads its output (fmlp_derivative_reads_output:
 * relu) may leave saved_pre[l] NULL; its output then serves: saved_hidden[l],
 * or y for the last layer (the torch layer saves no pre-activation there, as
 * eager saves ReLU's result alone). Each gradient pointer may be NULL (not
 * computed); what is computed is written, not accumulated. */
typedef struct {
  fmlp_dtype dtype; /* FMLP_F32, FMLP_F64 or FMLP_BF16, shared by every pointer below */
  int64_t rows;
  int64_t n_layers;
  const int64_t *widths;     /* n_layers + 1 sizes, as in fmlp_cpu_chain_args */
  fmlp_input x;              /* rows x widths[0] */
  const fmlp_input *weights; /* weights[l]: widths[l+1] x widths[l] */
  fmlp_activation hidden_activation;
  fmlp_activation final_activation;
  const void *const *saved_pre;    /* rows x widths[l+1], contiguous */
  const void *const *saved_hidden; /* rows x widths[l+1], contiguous */
  const void *y; /* the chain's output, rows x widths[n_layers], contiguous; read only
                    where the last layer's saved_pre is NULL (else it may be NULL) */
  fmlp_input grad_y;               /* rows x widths[n_layers], any strides (0 too) */
  void *grad_x;                    /* rows x widths[0], contiguous */
  void *const *grad_weights;       /* [l]: widths[l+1] x widths[l], contiguous */
  void *const *grad_biases;        /* [l]: widths[l+1]; the array itself may be NULL */
} fmlp_cpu_chain_backward_args;

fmlp_status fmlp_cpu_chain_backward(const fmlp_cpu_chain_backward_args *args,
                                    const fmlp_threading *threading);

/* The gated block y = down(act(gate(x)) * up(x)). */
typedef struct {
  fmlp_dtype dtype; /* FMLP_F32, FMLP_F64 or FMLP_BF16 */
  int64_t rows, dim, hidden, out_dim;
  fmlp_input x;      /* rows x dim */
  fmlp_input w_gate; /* hidden x dim */
  fmlp_input w_up;   /* hidden x dim */
  fmlp_input w_down; /* out_dim x hidden */
  const void *bias_gate, *bias_up, *bias_down; /* contiguous, or NULL */
  fmlp_activation activation;
  void *y; /* rows x out_dim, unit column stride */
  int64_t y_row_stride;
  /* For training, or NULL: gate pre-activation, up projection and
   * act(gate) * up, each rows x hidden contiguous. */
  void *saved_gate, *saved_up, *saved_product;
  /* Each weight already packed for the unit packed_unit, or NULL, as
   * fmlp_cpu_chain_args' packed_weights: packed_gate and packed_up both or
   * neither (the gated micro-kernel reads them together). */
  const void *packed_gate, *packed_up, *packed_down;
  fmlp_cpu_isa packed_unit;
} fmlp_cpu_gated_args;

fmlp_status fmlp_cpu_gated(const fmlp_cpu_gated_args *args, const fmlp_threading *threading);

/* The gradients of fmlp_cpu_gated from what its training call saved (gate,
 * up and product, each rows x hidden contiguous). Each gradient pointer may
 * be NULL (not computed); what is computed is written, not accumulated. */
typedef struct {
  fmlp_dtype dtype; /* FMLP_F32, FMLP_F64 or FMLP_BF16 */
  int64_t rows, dim, hidden, out_dim;
  fmlp_input x, w_gate, w_up, w_down; /* as in fmlp_cpu_gated_args */
  fmlp_activation activation;
  const void *saved_gate, *saved_up, *saved_product;
  fmlp_input grad_y;                            /* rows x out_dim, any strides (0 too) */
  void *grad_x;                                 /* rows x dim, contiguous */
  void *grad_w_gate, *grad_w_up, *grad_w_down;  /* the weights' shapes, contiguous */
  void *grad_bias_gate, *grad_bias_up, *grad_bias_down;
} fmlp_cpu_gated_block_backward_args;

fmlp_status fmlp_cpu_gated_block_backward(const fmlp_cpu_gated_block_backward_args *args,
                                          const fmlp_threading *threading);

/* grad_pre = grad_out * act'(pre), elementwise over n contiguous values
 * (grad_pre may be grad_out). */
fmlp_status fmlp_cpu_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                         const void *pre, fmlp_activation activation,
                                         void *grad_pre, const fmlp_threading *threading);

/* For h = act(gate) * up: grad_gate = grad_h * up * act'(gate) and
 * grad_up = grad_h * act(gate), elementwise over n contiguous values. */
fmlp_status fmlp_cpu_gated_backward(fmlp_dtype dtype, int64_t n, const void *grad_product,
                                    const void *gate, const void *up, fmlp_activation activation,
                                    void *grad_gate, void *grad_up,
                                    const fmlp_threading *threading);

/* The passes around a host GEMM (FMLP_GEMM_HOST). Before it: out (rows x
 * cols, contiguous rows, apart from src) = src, in any strides (0 included):
 * the bias laid over every row (row stride 0) for the GEMM to add the
 * product into (beta = 1), as the host's own addmm does; a gradient the GEMM
 * cannot read as it is (a sum()'s, expanded from one value), copied once.
 * After it, over n contiguous values: out = act(pre) (out may be pre),
 * and product = act(gate) * up (product may be gate or up, else overlaps
 * neither), each value formed at the kernels' precision (float; double for
 * float64) and rounded once. */
fmlp_status fmlp_cpu_copy_rows(fmlp_dtype dtype, int64_t rows, int64_t cols, fmlp_input src,
                               void *out, const fmlp_threading *threading);
fmlp_status fmlp_cpu_activation_forward(fmlp_dtype dtype, int64_t n, const void *pre,
                                        fmlp_activation activation, void *out,
                                        const fmlp_threading *threading);
fmlp_status fmlp_cpu_gated_product(fmlp_dtype dtype, int64_t n, const void *gate, const void *up,
                                   fmlp_activation activation, void *product,
                                   const fmlp_threading *threading);
/* ... and the bias gradients: sums[j] = the sum of column j of m (rows x cols,
 * any strides, 0 included), summed at that precision. */
fmlp_status fmlp_cpu_column_sums(fmlp_dtype dtype, int64_t rows, int64_t cols, fmlp_input m,
                                 void *sums, const fmlp_threading *threading);

#ifdef __cplusplus
}
#endif

#endif /* FUSEDMLP_CPU_H */
