// Argument checking and shape translation shared by every backend of the
// torch layer. No math lives here.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace fusedmlp {

// The activations' names, indexed by fmlp_activation: the registry
// fusedmlp/activations.def.
inline constexpr std::array<const char *, FMLP_ACT_COUNT> kActivationNames = {
#define FMLP_ACTIVATION(id, name, cublaslt) #name,
#include "fusedmlp/activations.def"
};

// The storage dtypes each device's kernels take (fusedmlp._C.device_dtypes()).
inline std::vector<at::ScalarType> cpu_dtypes() { return {at::kFloat, at::kDouble, at::kBFloat16}; }
inline std::vector<at::ScalarType> cuda_dtypes() { return {at::kFloat, at::kHalf, at::kBFloat16}; }

// "none", "relu", ... -> enum; anything else is a ValueError naming the valid names.
fmlp_activation parse_activation(c10::string_view name);

// Validates a chain of layers (linear = one layer): ranks, feature sizes,
// dtypes, devices. `op` names the caller in messages.
// biases holds one bias per weight, or none.
void check_chain(const char *op, const at::Tensor &x, at::TensorList weights,
                 at::TensorList biases, const std::vector<at::ScalarType> &dtypes);

// t's dtype must be one of `dtypes` (those the backend computes in): a TypeError otherwise.
void check_dtype(const char *op, const char *name, const at::Tensor &t,
                 const std::vector<at::ScalarType> &dtypes);

// Layer l's bias, if the chain has biases.
std::optional<at::Tensor> bias_at(at::TensorList biases, size_t layer);

// Validates the backward of a chain: x and weights as check_chain, grad_y of the
// output's shape, saved of the length saved_chain_layout gives.
void check_chain_backward(const char *op, const at::Tensor &grad_y, const at::Tensor &x,
                          at::TensorList weights, const at::Tensor &saved,
                          fmlp_activation hidden, fmlp_activation final_activation,
                          const std::vector<at::ScalarType> &dtypes);

void check_gated(const char *op, const at::Tensor &x, const at::Tensor &w_gate,
                 const at::Tensor &w_up, const at::Tensor &w_down,
                 const std::optional<at::Tensor> &bias_gate,
                 const std::optional<at::Tensor> &bias_up,
                 const std::optional<at::Tensor> &bias_down,
                 const std::vector<at::ScalarType> &dtypes);

// Validates the backward of a gated block: x and weights as check_gated, grad_y of
// the output's shape, saved of shape (3, rows, hidden).
void check_gated_backward(const char *op, const at::Tensor &grad_y, const at::Tensor &x,
                          const at::Tensor &w_gate, const at::Tensor &w_up,
                          const at::Tensor &w_down, const at::Tensor &saved,
                          const std::vector<at::ScalarType> &dtypes);

// x as rows x features: a view when strides allow, else a copy.
at::Tensor as_rows(const at::Tensor &x);

// The output shape (*, out_features) for an input of shape (*, in_features). A
// backend allocates the op's output in this shape and writes it through a
// (rows, out_features) view, so that the output itself is no view (FSDP2 hooks
// module outputs and warns on views: an in-place op on one would skip its
// pre-backward hook) without reshaping below the ADInplaceOrView key (a guard the
// stable ABI lacks).
std::vector<int64_t> output_shape(const at::Tensor &x, int64_t out_features);

// Which saved tensors a training chain keeps, in order, in one flat buffer:
// for each layer l, its pre-activation when its activation is not "none",
// then its output h_{l+1} when it is not the last layer.
struct SavedChainLayout {
  std::vector<int64_t> pre_offset;     // -1: not saved
  std::vector<int64_t> hidden_offset;  // -1: not saved
  int64_t total = 0;
};
SavedChainLayout saved_chain_layout(int64_t rows, const std::vector<int64_t> &widths,
                                    fmlp_activation hidden, fmlp_activation final_activation);

std::vector<int64_t> chain_widths(const at::Tensor &x, at::TensorList weights);

// Profiler label of one layer inside a multi-layer op.
std::string layer_label(const char *op, int64_t layer);

}  // namespace fusedmlp
