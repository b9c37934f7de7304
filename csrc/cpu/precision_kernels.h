/* The per-dtype, per-ISA entry points behind the public CPU API (cpu.h),
 * which validates arguments and then picks one of these by dtype and by
 * fmlp_cpu_isa_in_use(): one set per kernel unit of the registry
 * fusedmlp/cpu_isas.def, each defined in its own translation unit. */
#ifndef FUSEDMLP_CPU_PRECISION_KERNELS_H
#define FUSEDMLP_CPU_PRECISION_KERNELS_H

#include "fusedmlp/cpu.h"

#define FMLP_KERNELS(dtype, isa, suffix)                                                        \
  fmlp_status fmlp_cpu_chain_##suffix(const fmlp_cpu_chain_args *args,                          \
                                      const fmlp_threading *threading);                         \
  fmlp_status fmlp_cpu_gated_##suffix(const fmlp_cpu_gated_args *args,                          \
                                      const fmlp_threading *threading);                         \
  fmlp_status fmlp_cpu_chain_backward_##suffix(const fmlp_cpu_chain_backward_args *args,        \
                                               const fmlp_threading *threading);                \
  fmlp_status fmlp_cpu_gated_block_backward_##suffix(                                           \
      const fmlp_cpu_gated_block_backward_args *args, const fmlp_threading *threading);         \
  fmlp_status fmlp_cpu_activation_backward_##suffix(                                            \
      int64_t n, const void *grad_out, const void *pre, fmlp_activation activation,             \
      void *grad_pre, const fmlp_threading *threading);                                         \
  fmlp_status fmlp_cpu_gated_backward_##suffix(                                                 \
      int64_t n, const void *grad_product, const void *gate, const void *up,                    \
      fmlp_activation activation, void *grad_gate, void *grad_up,                               \
      const fmlp_threading *threading);                                                         \
  fmlp_status fmlp_cpu_copy_rows_##suffix(int64_t rows, int64_t cols, fmlp_input src, void *out, \
                                          const fmlp_threading *threading);                     \
  fmlp_status fmlp_cpu_activation_forward_##suffix(int64_t n, const void *pre,                  \
                                                   fmlp_activation activation, void *out,       \
                                                   const fmlp_threading *threading);            \
  fmlp_status fmlp_cpu_gated_product_##suffix(int64_t n, const void *gate, const void *up,      \
                                              fmlp_activation activation, void *product,        \
                                              const fmlp_threading *threading);                 \
  fmlp_status fmlp_cpu_column_sums_##suffix(int64_t rows, int64_t cols, fmlp_input m,           \
                                            void *sums, const fmlp_threading *threading);       \
  int64_t fmlp_cpu_packed_weight_bytes_##suffix(int64_t rows, fmlp_input w, int64_t n,          \
                                                int64_t k);                                     \
  fmlp_status fmlp_cpu_pack_weight_##suffix(fmlp_input w, int64_t n, int64_t k, void *packed,   \
                                            const fmlp_threading *threading);
#include "fusedmlp/cpu_isas.def"

#endif /* FUSEDMLP_CPU_PRECISION_KERNELS_H */
