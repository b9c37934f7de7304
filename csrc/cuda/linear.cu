// One fused linear layer on the GPU: cuBLASLt's epilogue where it computes
// the activation exactly, our pointwise kernel after a BIAS epilogue where it
// does not or where the pre-activation must be kept for backward.
#include "internal.h"

namespace {

bool epilogue_is_exact(fmlp_activation activation) {
  // cuBLASLt's GELU is the tanh approximation; exact GELU and SiLU are ours.
  return activation == FMLP_ACT_NONE || activation == FMLP_ACT_RELU ||
         activation == FMLP_ACT_GELU_TANH;
}

bool valid_args(const fmlp_cuda_linear_args *a) {
  const bool dtype_ok = a->dtype == FMLP_F32 || a->dtype == FMLP_BF16 || a->dtype == FMLP_F16;
  const bool act_ok = a->activation >= FMLP_ACT_NONE && a->activation < FMLP_ACT_COUNT;
  const bool sizes_ok = a->m >= 0 && a->n >= 0 && a->k >= 0 && a->batch >= 1;
  // Our pointwise pass treats y (and pre) as one flat range.
  const bool flat_ok = (epilogue_is_exact(a->activation) && a->pre == nullptr) ||
                       (a->batch == 1 && a->y_row_stride == a->n);
  return dtype_ok && act_ok && sizes_ok && flat_ok;
}

}  // namespace

extern "C" fmlp_status fmlp_cuda_linear(const fmlp_cuda_env *env,
                                        const fmlp_cuda_linear_args *args) {
  if (!valid_args(args)) return FMLP_ERR_INVALID_ARGUMENT;
  if (args->k == 0) {
    return args->batch == 1 ? fmlp_cuda_fill_empty_product(args, env->stream)
                            : FMLP_ERR_UNSUPPORTED;
  }
  if (epilogue_is_exact(args->activation) && args->pre == nullptr) {
    const fmlp_status fused = fmlp_cuda_lt_matmul(env, args);
    // No algorithm for this epilogue here: fall back to BIAS + our kernel below.
    const bool flat = args->batch == 1 && args->y_row_stride == args->n;
    if (fused != FMLP_ERR_UNSUPPORTED || args->activation == FMLP_ACT_NONE || !flat) {
      return fused;
    }
  }
  // z = x @ w.T + bias into pre (or y), then y = act(z).
  fmlp_cuda_linear_args bias_only = *args;
  bias_only.activation = FMLP_ACT_NONE;
  if (args->pre != nullptr) {
    bias_only.y = args->pre;
    bias_only.y_row_stride = args->n;
  }
  const fmlp_status status = fmlp_cuda_lt_matmul(env, &bias_only);
  if (status != FMLP_OK) return status;
  return fmlp_cuda_activation(args->dtype, args->m * args->n, bias_only.y, args->activation,
                              args->y, env->stream);
}
