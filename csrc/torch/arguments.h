// Argument checking and shape translation shared by every backend of the
// torch layer, written against LibTorch's stable ABI (torch::stable::Tensor), so
// that fusedmlp._C loads under every torch from the one it targets on. No math
// lives here.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <array>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fusedmlp/fusedmlp.h"

namespace fusedmlp {

using Tensor = torch::stable::Tensor;
using TensorList = torch::headeronly::HeaderOnlyArrayRef<Tensor>;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;
using ScalarType = torch::headeronly::ScalarType;
using OptionalTensor = std::optional<Tensor>;

// The activations' names, indexed by fmlp_activation: the registry
// fusedmlp/activations.def.
inline constexpr std::array<const char *, FMLP_ACT_COUNT> kActivationNames = {
#define FMLP_ACTIVATION(id, name, cublaslt, derivative) #name,
#include "fusedmlp/activations.def"
};

// The storage dtypes each device's kernels take (fusedmlp._C.device_dtypes()).
// Constants built once: each op call checks x against them, and a fresh vector
// was an allocation a call.
inline const std::vector<ScalarType> &cpu_dtypes() {
  static const std::vector<ScalarType> dtypes{ScalarType::Float, ScalarType::Double,
                                              ScalarType::BFloat16};
  return dtypes;
}
inline const std::vector<ScalarType> &cuda_dtypes() {
  static const std::vector<ScalarType> dtypes{ScalarType::Float, ScalarType::Half,
                                              ScalarType::BFloat16};
  return dtypes;
}

// A size list as torch prints one: "[2, 3]".
struct Shape {
  IntList sizes;
};
std::ostream &operator<<(std::ostream &out, Shape shape);
// A device as torch prints one: "cpu", "cuda:0".
std::ostream &operator<<(std::ostream &out, const torch::stable::Device &device);
std::ostream &operator<<(std::ostream &out, torch::headeronly::DeviceType type);

// The stable ABI carries every exception from a kernel to Python as a RuntimeError
// with its what(): thrown here with exactly the message, no prefix.
template <class... Args>
[[noreturn]] void fail(const Args &...args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

// TORCH_CHECK's stable twin: the message is built only when the check fails.
#define FMLP_CHECK(condition, ...) \
  if (!(condition)) ::fusedmlp::fail(__VA_ARGS__)

// "none", "relu", ... -> enum; anything else fails naming the valid names (the
// Python front end raises that message as a ValueError before calling an op).
fmlp_activation parse_activation(std::string_view name);

// Validates a chain of layers (linear = one layer): ranks, feature sizes,
// dtypes, devices. `op` names the caller in messages.
// biases holds one bias per weight, or none.
void check_chain(const char *op, const Tensor &x, TensorList weights, TensorList biases,
                 const std::vector<ScalarType> &dtypes);

// t's dtype must be one of `dtypes` (those the backend computes in); the Python
// front end raises the same message as a TypeError before calling an op.
void check_dtype(const char *op, const char *name, const Tensor &t,
                 const std::vector<ScalarType> &dtypes);

// Layer l's bias, if the chain has biases.
OptionalTensor bias_at(TensorList biases, size_t layer);

// Validates the backward of a chain: x and weights as check_chain, grad_y and y
// of the output's shape (y required where the final activation's derivative reads
// it), saved of the length saved_chain_layout gives.
void check_chain_backward(const char *op, const Tensor &grad_y, const Tensor &x,
                          TensorList weights, const Tensor &saved, const OptionalTensor &y,
                          fmlp_activation hidden, fmlp_activation final_activation,
                          const std::vector<ScalarType> &dtypes);

void check_gated(const char *op, const Tensor &x, const Tensor &w_gate, const Tensor &w_up,
                 const Tensor &w_down, const OptionalTensor &bias_gate,
                 const OptionalTensor &bias_up, const OptionalTensor &bias_down,
                 const std::vector<ScalarType> &dtypes);

// Validates the backward of a gated block: x and weights as check_gated, grad_y of
// the output's shape, saved of shape (3, rows, hidden).
void check_gated_backward(const char *op, const Tensor &grad_y, const Tensor &x,
                          const Tensor &w_gate, const Tensor &w_up, const Tensor &w_down,
                          const Tensor &saved, const std::vector<ScalarType> &dtypes);

// x as rows x features: a view when strides allow, else a copy.
Tensor as_rows(const Tensor &x);

// t itself when contiguous, else a contiguous copy.
Tensor as_contiguous(const Tensor &t);

// An uninitialised contiguous tensor of `like`'s dtype and device, allocated by
// the C shim (aoti_torch_empty_strided: on CPU, ATen's allocator directly):
// torch::stable::empty is a call of aten::empty that the dispatcher looks up by
// name each time, ~1 us of a small op call per tensor.
Tensor empty(IntList shape, const Tensor &like);

// rows x width at `offset` elements into `buffer`, a contiguous tensor of our
// own making (storage offset 0), by the C shim's _reinterpret_tensor: no
// dispatcher call, unlike narrow and view. The result shares buffer's storage
// without being its autograd view (a buffer of that 2-D shape is itself the
// result): for the kernels' own use, never returned.
Tensor rows_at(const Tensor &buffer, int64_t offset, int64_t rows, int64_t width);

// Rows [first, first + count) of the 2-D t, by the same shim call (any view of
// any storage works): for the kernels' own use, never returned, like rows_at.
Tensor row_range(const Tensor &t, int64_t first, int64_t count);

// The 2-D t transposed, by the same shim call (its offset is added to t's
// storage offset, so any view of any storage works): for the kernels' own use,
// never returned, like rows_at.
Tensor transposed(const Tensor &t);

// The output shape (*, out_features) for an input of shape (*, in_features). A
// backend allocates the op's output in this shape and writes it through a
// (rows, out_features) view, so that the output itself is no view (FSDP2 hooks
// module outputs and warns on views: an in-place op on one would skip its
// pre-backward hook) without reshaping below the ADInplaceOrView key (a guard the
// stable ABI lacks).
std::vector<int64_t> output_shape(const Tensor &x, int64_t out_features);

// Which saved tensors a training chain keeps, in order, in one flat buffer:
// for each layer l, its pre-activation when its activation is not "none" and
// its derivative does not read the output instead (fmlp_chain_saves_pre), then
// its output h_{l+1} when it is not the last layer (the last one's is y).
struct SavedChainLayout {
  std::vector<int64_t> pre_offset;     // -1: not saved
  std::vector<int64_t> hidden_offset;  // -1: not saved
  int64_t total = 0;
};
SavedChainLayout saved_chain_layout(int64_t rows, const std::vector<int64_t> &widths,
                                    fmlp_activation hidden, fmlp_activation final_activation);

std::vector<int64_t> chain_widths(const Tensor &x, TensorList weights);

// Whether torch's profiler records the ops called on this thread: then they run
// their layers (stages) one call each, each under its own profiler label, and
// only then do they make labels at all (the C shim's RecordFunction costs a
// small call its time whether or not anything records, and the dispatcher
// gives every op call its own event anyway). The kernels asked
// at::hasCallbacks(); the stable ABI has no such query, so Python sets this for
// the calls it makes while a profiler records (fusedmlp/profiling.py).
bool &profiler_records();

// Profiler label of one layer inside a multi-layer op.
std::string layer_label(const char *op, int64_t layer);

}  // namespace fusedmlp
