/* The public CPU API: argument validation, then the kernel for the dtype and
 * the instruction set in use. */
#include <stddef.h>

#include "fusedmlp/cpu.h"
#include "memory.h"
#include "precision_kernels.h"

/* One dtype's kernels, built for one instruction set. */
typedef struct {
  fmlp_status (*chain)(const fmlp_cpu_chain_args *, const fmlp_threading *);
  fmlp_status (*gated)(const fmlp_cpu_gated_args *, const fmlp_threading *);
  fmlp_status (*chain_backward)(const fmlp_cpu_chain_backward_args *, const fmlp_threading *);
  fmlp_status (*gated_block_backward)(const fmlp_cpu_gated_block_backward_args *,
                                      const fmlp_threading *);
  fmlp_status (*activation_backward)(int64_t, const void *, const void *, fmlp_activation,
                                     void *, const fmlp_threading *);
  fmlp_status (*gated_backward)(int64_t, const void *, const void *, const void *,
                                fmlp_activation, void *, void *, const fmlp_threading *);
  fmlp_status (*copy_rows)(int64_t, int64_t, fmlp_input, void *, const fmlp_threading *);
  fmlp_status (*activation_forward)(int64_t, const void *, fmlp_activation, void *,
                                    const fmlp_threading *);
  fmlp_status (*gated_product)(int64_t, const void *, const void *, fmlp_activation, void *,
                               const fmlp_threading *);
  fmlp_status (*column_sums)(int64_t, int64_t, fmlp_input, void *, const fmlp_threading *);
  int64_t (*packed_weight_bytes)(int64_t, fmlp_input, int64_t, int64_t);
  fmlp_status (*pack_weight)(fmlp_input, int64_t, int64_t, void *, const fmlp_threading *);
} precision_kernels;

/* Every fmlp_dtype value indexes the table. */
#define DTYPE_SLOTS (FMLP_F16 + 1)

/* Whether an ISA belongs to the architecture this library is built for: a
 * unit is built (setup.py) and dispatched only there, since the flags and
 * intrinsics of another architecture's ISA do not compile here. An ISA is
 * x86's if it names CPUID features, aarch64's if it names aarch64 ones. */
#if defined(__x86_64__) || defined(__i386__)
#define TARGET_X86 1
#else
#define TARGET_X86 0
#endif
#if defined(__aarch64__)
#define TARGET_AARCH64 1
#else
#define TARGET_AARCH64 0
#endif
enum {
#define FMLP_FEATURE(feature) &&TARGET_X86
#define FMLP_ARM_FEATURE(feature) &&TARGET_AARCH64
#define FMLP_ISA(id, name, flags, features) ON_TARGET_##id = 1 features,
#include "fusedmlp/cpu_isas.def"
};

/* The registry's kernel units by dtype and ISA; a gap (chain == NULL) means
 * no unit here. A unit of another architecture's ISA is folded away (the
 * constant condition), so its symbols are never referenced. */
#define UNIT(isa, entry) (ON_TARGET_##isa ? entry : NULL)
static const precision_kernels kernel_units[DTYPE_SLOTS][FMLP_ISA_COUNT] = {
#define FMLP_KERNELS(dtype, isa, suffix)                                                       \
  [FMLP_##dtype][FMLP_ISA_##isa] = {                                                           \
      UNIT(isa, fmlp_cpu_chain_##suffix), UNIT(isa, fmlp_cpu_gated_##suffix),                  \
      UNIT(isa, fmlp_cpu_chain_backward_##suffix),                                             \
      UNIT(isa, fmlp_cpu_gated_block_backward_##suffix),                                       \
      UNIT(isa, fmlp_cpu_activation_backward_##suffix),                                        \
      UNIT(isa, fmlp_cpu_gated_backward_##suffix),                                             \
      UNIT(isa, fmlp_cpu_copy_rows_##suffix),                                                  \
      UNIT(isa, fmlp_cpu_activation_forward_##suffix),                                         \
      UNIT(isa, fmlp_cpu_gated_product_##suffix),                                              \
      UNIT(isa, fmlp_cpu_column_sums_##suffix),                                                \
      UNIT(isa, fmlp_cpu_packed_weight_bytes_##suffix),                                        \
      UNIT(isa, fmlp_cpu_pack_weight_##suffix)},
#include "fusedmlp/cpu_isas.def"
};

/* The CPU kernels take a dtype that has a portable unit. */
static int valid_dtype(fmlp_dtype dtype) {
  return (int)dtype >= 0 && (int)dtype < DTYPE_SLOTS &&
         kernel_units[dtype][FMLP_ISA_PORTABLE].chain != NULL;
}

fmlp_cpu_isa fmlp_cpu_unit_isa(fmlp_dtype dtype) {
  if (!valid_dtype(dtype)) return FMLP_ISA_COUNT;
  int isa = (int)fmlp_cpu_isa_in_use();
  while (kernel_units[dtype][isa].chain == NULL || !fmlp_cpu_isa_supported((fmlp_cpu_isa)isa)) {
    --isa; /* stops at PORTABLE: every valid dtype has that unit, and every CPU runs it */
  }
  return (fmlp_cpu_isa)isa;
}

/* The unit fmlp_cpu_unit_isa names (valid dtypes only). */
static const precision_kernels *kernels_for(fmlp_dtype dtype) {
  return &kernel_units[dtype][fmlp_cpu_unit_isa(dtype)];
}

/* dtype's unit at `isa` when there is one and this CPU runs it, else NULL:
 * the unit that packed an op's weights (fmlp_cpu_pack_weight) runs the op. */
static const precision_kernels *unit_at(fmlp_dtype dtype, fmlp_cpu_isa isa) {
  if (!valid_dtype(dtype) || (int)isa < 0 || isa >= FMLP_ISA_COUNT) return NULL;
  const precision_kernels *unit = &kernel_units[dtype][isa];
  return unit->chain != NULL && fmlp_cpu_isa_supported(isa) ? unit : NULL;
}

static int valid_activation(fmlp_activation activation) {
  return activation >= FMLP_ACT_NONE && activation < FMLP_ACT_COUNT;
}

/* rows x cols elements must be countable in int64_t. */
static fmlp_status check_count(int64_t rows, int64_t cols, int64_t *count) {
  if (rows < 0 || cols < 0) return FMLP_ERR_INVALID_ARGUMENT;
  return fmlp_checked_mul(rows, cols, count) ? FMLP_OK : FMLP_ERR_SIZE_OVERFLOW;
}

/* ... and data present when there are any. */
static fmlp_status check_extent(const void *data, int64_t rows, int64_t cols) {
  int64_t count;
  const fmlp_status status = check_count(rows, cols, &count);
  if (status != FMLP_OK) return status;
  return count > 0 && data == NULL ? FMLP_ERR_INVALID_ARGUMENT : FMLP_OK;
}

static fmlp_status check_chain(const fmlp_cpu_chain_args *a) {
  if (a == NULL || !valid_dtype(a->dtype) || a->n_layers < 1 || a->widths == NULL ||
      a->weights == NULL || !valid_activation(a->hidden_activation) ||
      !valid_activation(a->final_activation)) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  fmlp_status status = check_extent(a->x.data, a->rows, a->widths[0]);
  int64_t hidden_count; /* every layer's rows x width must be countable, for scratch */
  for (int64_t l = 0; l < a->n_layers && status == FMLP_OK; ++l) {
    status = check_extent(a->weights[l].data, a->widths[l + 1], a->widths[l]);
    if (status == FMLP_OK) status = check_count(a->rows, a->widths[l + 1], &hidden_count);
  }
  if (status == FMLP_OK) status = check_extent(a->y, a->rows, a->widths[a->n_layers]);
  return status;
}

static fmlp_status check_chain_backward(const fmlp_cpu_chain_backward_args *a) {
  if (a == NULL || !valid_dtype(a->dtype) || a->n_layers < 1 || a->widths == NULL ||
      a->weights == NULL || a->saved_pre == NULL || a->saved_hidden == NULL ||
      a->grad_weights == NULL || !valid_activation(a->hidden_activation) ||
      !valid_activation(a->final_activation)) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  fmlp_status status = check_extent(a->x.data, a->rows, a->widths[0]);
  int64_t max_width = 0, scratch_count;
  for (int64_t l = 0; l < a->n_layers && status == FMLP_OK; ++l) {
    const int64_t width = a->widths[l + 1];
    const int last = l == a->n_layers - 1;
    const fmlp_activation activation = last ? a->final_activation : a->hidden_activation;
    status = check_extent(a->weights[l].data, width, a->widths[l]);
    /* a layer whose output serves may still be handed its pre-activation */
    const int pre_given = activation != FMLP_ACT_NONE && a->saved_pre[l] != NULL;
    if (status == FMLP_OK && (fmlp_chain_saves_pre(activation) || pre_given)) {
      status = check_extent(a->saved_pre[l], a->rows, width);
    } else if (status == FMLP_OK && last && activation != FMLP_ACT_NONE) {
      status = check_extent(a->y, a->rows, width); /* the output serves */
    }
    if (status == FMLP_OK && !last) status = check_extent(a->saved_hidden[l], a->rows, width);
    if (width > max_width) max_width = width;
  }
  /* the scratch: two rows x max_width matrices */
  if (status == FMLP_OK) status = check_count(a->rows, max_width, &scratch_count);
  if (status == FMLP_OK) status = check_count(scratch_count, 2, &scratch_count);
  if (status == FMLP_OK) {
    status = check_extent(a->grad_y.data, a->rows, a->widths[a->n_layers]);
  }
  return status;
}

/* What the gated block and its backward share: dtype, activation, x, the
 * weights, and `scratch_matrices` rows x hidden matrices of scratch. */
static fmlp_status check_gated_operands(fmlp_dtype dtype, fmlp_activation activation,
                                        int64_t rows, int64_t dim, int64_t hidden,
                                        int64_t out_dim, const fmlp_input *x,
                                        const fmlp_input *w_gate, const fmlp_input *w_up,
                                        const fmlp_input *w_down, int64_t scratch_matrices) {
  if (!valid_dtype(dtype) || !valid_activation(activation)) return FMLP_ERR_INVALID_ARGUMENT;
  fmlp_status status = check_extent(x->data, rows, dim);
  if (status == FMLP_OK) status = check_extent(w_gate->data, hidden, dim);
  if (status == FMLP_OK) status = check_extent(w_up->data, hidden, dim);
  if (status == FMLP_OK) status = check_extent(w_down->data, out_dim, hidden);
  int64_t scratch_cols, scratch_count;
  if (status == FMLP_OK) status = check_count(hidden, scratch_matrices, &scratch_cols);
  if (status == FMLP_OK) status = check_count(rows, scratch_cols, &scratch_count);
  return status;
}

static fmlp_status check_gated(const fmlp_cpu_gated_args *a) {
  if (a == NULL) return FMLP_ERR_INVALID_ARGUMENT;
  fmlp_status status =
      check_gated_operands(a->dtype, a->activation, a->rows, a->dim, a->hidden, a->out_dim,
                           &a->x, &a->w_gate, &a->w_up, &a->w_down, 3);
  if (status == FMLP_OK) status = check_extent(a->y, a->rows, a->out_dim);
  return status;
}

static fmlp_status check_gated_block_backward(const fmlp_cpu_gated_block_backward_args *a) {
  if (a == NULL) return FMLP_ERR_INVALID_ARGUMENT;
  fmlp_status status =
      check_gated_operands(a->dtype, a->activation, a->rows, a->dim, a->hidden, a->out_dim,
                           &a->x, &a->w_gate, &a->w_up, &a->w_down, 2);
  if (status == FMLP_OK) status = check_extent(a->saved_gate, a->rows, a->hidden);
  if (status == FMLP_OK) status = check_extent(a->saved_up, a->rows, a->hidden);
  if (status == FMLP_OK) status = check_extent(a->saved_product, a->rows, a->hidden);
  if (status == FMLP_OK) status = check_extent(a->grad_y.data, a->rows, a->out_dim);
  return status;
}

fmlp_status fmlp_cpu_packed_weight_bytes(fmlp_dtype dtype, fmlp_cpu_isa unit, int64_t rows,
                                         fmlp_input w, int64_t n, int64_t k, int64_t *bytes) {
  const precision_kernels *kernels = unit_at(dtype, unit);
  if (kernels == NULL || bytes == NULL || rows < 0) return FMLP_ERR_INVALID_ARGUMENT;
  const fmlp_status status = check_extent(w.data, n, k);
  if (status != FMLP_OK) return status;
  *bytes = kernels->packed_weight_bytes(rows, w, n, k);
  return *bytes < 0 ? FMLP_ERR_SIZE_OVERFLOW : FMLP_OK;
}

void *fmlp_cpu_alloc_packed_weight(int64_t bytes) { return fmlp_alloc_scratch(bytes, 1); }

fmlp_status fmlp_cpu_pack_weight(fmlp_dtype dtype, fmlp_cpu_isa unit, fmlp_input w, int64_t n,
                                 int64_t k, void *packed, const fmlp_threading *threading) {
  int64_t bytes;
  const fmlp_status status = fmlp_cpu_packed_weight_bytes(dtype, unit, INT64_MAX, w, n, k, &bytes);
  if (status != FMLP_OK) return status;
  if (bytes > 0 && packed == NULL) return FMLP_ERR_INVALID_ARGUMENT;
  return unit_at(dtype, unit)->pack_weight(w, n, k, packed, threading);
}

/* The unit an op runs: the one that packed its weights when it takes any
 * packed (NULL when that unit is not one this CPU runs), else dtype's. */
static const precision_kernels *unit_for(fmlp_dtype dtype, int packed, fmlp_cpu_isa unit) {
  return packed ? unit_at(dtype, unit) : kernels_for(dtype);
}

static int takes_packed_layers(const fmlp_cpu_chain_args *a) {
  for (int64_t l = 0; a->packed_weights != NULL && l < a->n_layers; ++l) {
    if (a->packed_weights[l] != NULL) return 1;
  }
  return 0;
}

fmlp_status fmlp_cpu_chain(const fmlp_cpu_chain_args *args, const fmlp_threading *threading) {
  const fmlp_status status = check_chain(args);
  if (status != FMLP_OK) return status;
  const precision_kernels *kernels =
      unit_for(args->dtype, takes_packed_layers(args), args->packed_unit);
  return kernels != NULL ? kernels->chain(args, threading) : FMLP_ERR_INVALID_ARGUMENT;
}

fmlp_status fmlp_cpu_gated(const fmlp_cpu_gated_args *args, const fmlp_threading *threading) {
  const fmlp_status status = check_gated(args);
  if (status != FMLP_OK) return status;
  if ((args->packed_gate == NULL) != (args->packed_up == NULL)) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  const int packed = args->packed_gate != NULL || args->packed_down != NULL;
  const precision_kernels *kernels = unit_for(args->dtype, packed, args->packed_unit);
  return kernels != NULL ? kernels->gated(args, threading) : FMLP_ERR_INVALID_ARGUMENT;
}

fmlp_status fmlp_cpu_chain_backward(const fmlp_cpu_chain_backward_args *args,
                                    const fmlp_threading *threading) {
  const fmlp_status status = check_chain_backward(args);
  if (status != FMLP_OK) return status;
  return kernels_for(args->dtype)->chain_backward(args, threading);
}

fmlp_status fmlp_cpu_gated_block_backward(const fmlp_cpu_gated_block_backward_args *args,
                                          const fmlp_threading *threading) {
  const fmlp_status status = check_gated_block_backward(args);
  if (status != FMLP_OK) return status;
  return kernels_for(args->dtype)->gated_block_backward(args, threading);
}

fmlp_status fmlp_cpu_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                         const void *pre, fmlp_activation activation,
                                         void *grad_pre, const fmlp_threading *threading) {
  if (!valid_dtype(dtype) || !valid_activation(activation) || n < 0 ||
      (n > 0 && (grad_out == NULL || pre == NULL || grad_pre == NULL))) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  return kernels_for(dtype)->activation_backward(n, grad_out, pre, activation, grad_pre,
                                                 threading);
}

fmlp_status fmlp_cpu_gated_backward(fmlp_dtype dtype, int64_t n, const void *grad_product,
                                    const void *gate, const void *up, fmlp_activation activation,
                                    void *grad_gate, void *grad_up,
                                    const fmlp_threading *threading) {
  if (!valid_dtype(dtype) || !valid_activation(activation) || n < 0 ||
      (n > 0 && (grad_product == NULL || gate == NULL || up == NULL || grad_gate == NULL ||
                 grad_up == NULL))) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  return kernels_for(dtype)->gated_backward(n, grad_product, gate, up, activation, grad_gate,
                                            grad_up, threading);
}

fmlp_status fmlp_cpu_copy_rows(fmlp_dtype dtype, int64_t rows, int64_t cols, fmlp_input src,
                               void *out, const fmlp_threading *threading) {
  int64_t count;
  const fmlp_status status = check_count(rows, cols, &count);
  if (status != FMLP_OK) return status;
  if (!valid_dtype(dtype) || (count > 0 && (src.data == NULL || out == NULL))) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  return kernels_for(dtype)->copy_rows(rows, cols, src, out, threading);
}

fmlp_status fmlp_cpu_activation_forward(fmlp_dtype dtype, int64_t n, const void *pre,
                                        fmlp_activation activation, void *out,
                                        const fmlp_threading *threading) {
  if (!valid_dtype(dtype) || !valid_activation(activation) || n < 0 ||
      (n > 0 && (pre == NULL || out == NULL))) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  return kernels_for(dtype)->activation_forward(n, pre, activation, out, threading);
}

fmlp_status fmlp_cpu_gated_product(fmlp_dtype dtype, int64_t n, const void *gate, const void *up,
                                   fmlp_activation activation, void *product,
                                   const fmlp_threading *threading) {
  if (!valid_dtype(dtype) || !valid_activation(activation) || n < 0 ||
      (n > 0 && (gate == NULL || up == NULL || product == NULL))) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  return kernels_for(dtype)->gated_product(n, gate, up, activation, product, threading);
}

fmlp_status fmlp_cpu_column_sums(fmlp_dtype dtype, int64_t rows, int64_t cols, fmlp_input m,
                                 void *sums, const fmlp_threading *threading) {
  const fmlp_status status = check_extent(m.data, rows, cols);
  if (status != FMLP_OK) return status;
  if (!valid_dtype(dtype) || (cols > 0 && sums == NULL)) return FMLP_ERR_INVALID_ARGUMENT;
  return kernels_for(dtype)->column_sums(rows, cols, m, sums, threading);
}
