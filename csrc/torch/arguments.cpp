#include "arguments.h"

#include <algorithm>

namespace fusedmlp {

std::ostream &operator<<(std::ostream &out, Shape shape) {
  out << "[";
  for (size_t d = 0; d < shape.sizes.size(); ++d) out << (d ? ", " : "") << shape.sizes[d];
  return out << "]";
}

std::ostream &operator<<(std::ostream &out, torch::headeronly::DeviceType type) {
  switch (type) {
    case torch::headeronly::DeviceType::CPU: return out << "cpu";
    case torch::headeronly::DeviceType::CUDA: return out << "cuda";
    case torch::headeronly::DeviceType::Meta: return out << "meta";
    default: return out << "device type " << static_cast<int>(type);
  }
}

std::ostream &operator<<(std::ostream &out, const torch::stable::Device &device) {
  out << device.type();
  return device.has_index() ? out << ":" << static_cast<int>(device.index()) : out;
}

namespace {

// "none, relu, ...": the registry's names, for the error message.
std::string activation_names() {
  std::string names;
  for (const char *name : kActivationNames) {
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  return names;
}

std::string dtype_names(const std::vector<ScalarType> &dtypes) {
  std::string names;
  for (const auto dtype : dtypes) {
    names += (names.empty() ? "" : ", ") + std::string(torch::headeronly::toString(dtype));
  }
  return names;
}

// An argument's name for messages, "weight" or "weight[1]": put together only when a check
// fails (building strings for every layer of every call was part of a small op's fixed cost).
struct ArgName {
  ArgName(const char *base, int64_t index = -1) : base(base), index(index) {}  // implicit: literals
  const char *base;
  int64_t index;  // -1: no index
};

std::ostream &operator<<(std::ostream &out, ArgName name) {
  out << name.base;
  return name.index < 0 ? out : out << "[" << name.index << "]";
}

// Layer l's name among n_layers: indexed only when there are several.
ArgName layer_arg(const char *base, size_t l, size_t n_layers) {
  return {base, n_layers > 1 ? static_cast<int64_t>(l) : -1};
}

void check_same(const char *op, ArgName name, const Tensor &t, const Tensor &x) {
  FMLP_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but x has dtype ", x.scalar_type(), "; all tensors must share one dtype");
  FMLP_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; all tensors must be on one device");
}

void check_x(const char *op, const Tensor &x, const std::vector<ScalarType> &dtypes) {
  FMLP_CHECK(x.dim() >= 1, op, ": x must have shape (*, in_features), got a 0-d tensor");
  check_dtype(op, "x", x, dtypes);
}

void check_weight(const char *op, ArgName name, const Tensor &w,
                  int64_t in_features, const Tensor &x) {
  FMLP_CHECK(w.dim() == 2, op, ": ", name, " must be 2-D (out_features, in_features), got ",
              w.dim(), "-D with shape ", Shape{w.sizes()});
  FMLP_CHECK(w.size(1) == in_features, op, ": ", name, " has shape ", Shape{w.sizes()}, " and expects ",
              w.size(1), " input features, but its input has ", in_features);
  check_same(op, name, w, x);
}

// The number of rows of x viewed as (rows, in_features): the product of its
// leading sizes (x.numel() / in_features fails when in_features is 0), checked
// to fit int64.
int64_t leading_rows(const char *op, const Tensor &x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    FMLP_CHECK(!__builtin_mul_overflow(rows, x.size(d), &rows), op, ": x has shape ", Shape{x.sizes()},
                "; its leading sizes multiply to more rows than int64 can count");
  }
  return rows;
}

// Checks that rows * width * copies, and the running total of such products,
// fit in int64, before anything of that size is allocated.
void check_count(const char *op, ArgName weight, const char *what, int64_t rows,
                 int64_t width, int64_t copies, int64_t *total) {
  int64_t count = 0;
  const bool overflows = __builtin_mul_overflow(rows, width, &count) ||
                         __builtin_mul_overflow(count, copies, &count) ||
                         __builtin_add_overflow(*total, count, total);
  FMLP_CHECK(!overflows, op, ": x has ", rows, " rows and ", weight, " has ", width,
              " output features: ", what, " would have more elements than int64 can count");
}

void check_bias(const char *op, ArgName name, const OptionalTensor &bias,
                int64_t out_features, const Tensor &x) {
  if (!bias.has_value()) return;
  FMLP_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op, ": ", name,
              " must have shape (", out_features, "), got ", Shape{bias->sizes()});
  check_same(op, name, *bias, x);
}

// grad_y, or the forward's output y: the output's shape, x's dtype and device.
void check_output_shaped(const char *op, const char *name, const Tensor &t, const Tensor &x,
                         int64_t out_features) {
  check_same(op, name, t, x);
  const std::vector<int64_t> shape = output_shape(x, out_features);
  FMLP_CHECK(t.sizes().equals(shape), op, ": ", name, " must have the output's shape ",
              Shape{shape}, ", got ", Shape{t.sizes()});
}

}  // namespace

void check_dtype(const char *op, const char *name, const Tensor &t,
                 const std::vector<ScalarType> &dtypes) {
  bool supported = false;
  for (const auto dtype : dtypes) supported = supported || t.scalar_type() == dtype;
  FMLP_CHECK(supported, op, ": ", name, " has dtype ", t.scalar_type(), ", but on ",
                   t.device().type(), " only ", dtype_names(dtypes), " are supported");
}

fmlp_activation parse_activation(std::string_view name) {
  for (size_t i = 0; i < kActivationNames.size(); ++i) {
    if (name == kActivationNames[i]) return static_cast<fmlp_activation>(i);
  }
  fail("fusedmlp: unknown activation '", name,
                    "'; valid names are ", activation_names());
}

OptionalTensor bias_at(TensorList biases, size_t layer) {
  return biases.empty() ? std::nullopt : OptionalTensor(biases[layer]);
}

void check_chain(const char *op, const Tensor &x, TensorList weights,
                 TensorList biases, const std::vector<ScalarType> &dtypes) {
  check_x(op, x, dtypes);
  FMLP_CHECK(!weights.empty(), op, ": weights must hold at least one weight");
  FMLP_CHECK(biases.empty() || biases.size() == weights.size(), op, ": got ", weights.size(),
              " weights but ", biases.size(), " biases; pass one bias per weight, or none");
  int64_t features = x.size(-1);
  for (size_t l = 0; l < weights.size(); ++l) {
    check_weight(op, layer_arg("weight", l, weights.size()), weights[l], features, x);
    features = weights[l].size(0);
    check_bias(op, layer_arg("bias", l, weights.size()), bias_at(biases, l), features, x);
  }
  // Every layer's output may be saved twice (pre-activation and hidden), so the
  // saved buffer holds at most 2 * rows * sum(widths) elements.
  const int64_t rows = leading_rows(op, x);
  int64_t saved = 0;
  for (size_t l = 0; l < weights.size(); ++l) {
    check_count(op, layer_arg("weight", l, weights.size()), "the output and saved activations",
                rows, weights[l].size(0), 2, &saved);
  }
}

void check_chain_backward(const char *op, const Tensor &grad_y, const Tensor &x,
                          TensorList weights, const Tensor &saved, const OptionalTensor &y,
                          fmlp_activation hidden, fmlp_activation final_activation,
                          const std::vector<ScalarType> &dtypes) {
  check_chain(op, x, weights, {}, dtypes);
  const int64_t out_features = weights.back().size(0);
  check_output_shaped(op, "grad_y", grad_y, x, out_features);
  FMLP_CHECK(y.has_value() || !fmlp_derivative_reads_output(final_activation), op,
              ": y (the forward's output) is required: the derivative of the final activation '",
              kActivationNames[final_activation], "' reads it");
  if (y.has_value()) check_output_shaped(op, "y", *y, x, out_features);
  check_same(op, "saved", saved, x);
  const SavedChainLayout layout =
      saved_chain_layout(leading_rows(op, x), chain_widths(x, weights), hidden, final_activation);
  FMLP_CHECK(saved.dim() == 1 && saved.size(0) == layout.total, op,
              ": saved must be the 1-D buffer of ", layout.total,
              " elements the training op returns for these arguments, got shape ", Shape{saved.sizes()});
}

void check_gated(const char *op, const Tensor &x, const Tensor &w_gate,
                 const Tensor &w_up, const Tensor &w_down,
                 const OptionalTensor &bias_gate,
                 const OptionalTensor &bias_up,
                 const OptionalTensor &bias_down,
                 const std::vector<ScalarType> &dtypes) {
  check_x(op, x, dtypes);
  check_weight(op, "w_gate", w_gate, x.size(-1), x);
  check_weight(op, "w_up", w_up, x.size(-1), x);
  FMLP_CHECK(w_up.size(0) == w_gate.size(0), op, ": w_gate has shape ", Shape{w_gate.sizes()},
              " but w_up has shape ", Shape{w_up.sizes()}, "; both must be (hidden, dim)");
  check_weight(op, "w_down", w_down, w_gate.size(0), x);
  check_bias(op, "bias_gate", bias_gate, w_gate.size(0), x);
  check_bias(op, "bias_up", bias_up, w_up.size(0), x);
  check_bias(op, "bias_down", bias_down, w_down.size(0), x);
  const int64_t rows = leading_rows(op, x);
  int64_t saved_total = 0, output_total = 0;
  check_count(op, "w_gate", "the saved gate, up and product activations", rows, w_gate.size(0),
              3, &saved_total);
  check_count(op, "w_down", "the output", rows, w_down.size(0), 1, &output_total);
}

void check_gated_backward(const char *op, const Tensor &grad_y, const Tensor &x,
                          const Tensor &w_gate, const Tensor &w_up,
                          const Tensor &w_down, const Tensor &saved,
                          const std::vector<ScalarType> &dtypes) {
  check_gated(op, x, w_gate, w_up, w_down, std::nullopt, std::nullopt, std::nullopt, dtypes);
  check_output_shaped(op, "grad_y", grad_y, x, w_down.size(0));
  check_same(op, "saved", saved, x);
  const std::vector<int64_t> shape = {3, leading_rows(op, x), w_gate.size(0)};
  FMLP_CHECK(saved.sizes().equals(shape), op, ": saved must have shape ", Shape{shape},
        " (gate, up, product), got ", Shape{saved.sizes()});
}

Tensor as_contiguous(const Tensor &t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

Tensor empty(IntList shape, const Tensor &like) {
  int32_t dtype = 0, device_type = 0, device_index = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  // Contiguous strides; the callers' sizes were checked to multiply within int64.
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()),
                                                  shape.data(), strides.data(), dtype,
                                                  device_type, device_index, &handle));
  return Tensor(handle);
}

namespace {

// A 2-D view of t's storage, offset elements past t's own offset.
Tensor reinterpreted(const Tensor &t, const std::array<int64_t, 2> &sizes,
                     const std::array<int64_t, 2> &strides, int64_t offset) {
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(t.get(), 2, sizes.data(), strides.data(),
                                                        offset, &handle));
  return Tensor(handle);
}

}  // namespace

Tensor rows_at(const Tensor &buffer, int64_t offset, int64_t rows, int64_t width) {
  // A buffer that has that shape already (an op's 2-D output) is its own rows: a view
  // would cost a TensorImpl and a handle each call.
  if (offset == 0 && buffer.dim() == 2 && buffer.size(0) == rows && buffer.size(1) == width &&
      buffer.is_contiguous()) {
    return buffer;
  }
  return reinterpreted(buffer, {rows, width}, {width, 1}, offset);
}

Tensor row_range(const Tensor &t, int64_t first, int64_t count) {
  return reinterpreted(t, {count, t.size(1)}, {t.stride(0), t.stride(1)}, first * t.stride(0));
}

Tensor transposed(const Tensor &t) {
  return reinterpreted(t, {t.size(1), t.size(0)}, {t.stride(1), t.stride(0)}, 0);
}

Tensor as_rows(const Tensor &x) {
  // Already rows: each stable op is a by-name dispatcher call, which the ops'
  // hot path need not pay for nothing.
  if (x.dim() == 2) return x;
  // The row count is explicit: with 0 features, -1 would be ambiguous.
  const IntList sizes = x.sizes();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < sizes.size(); ++d) rows *= sizes[d];
  return torch::stable::reshape(x, {rows, x.size(-1)});
}

std::vector<int64_t> output_shape(const Tensor &x, int64_t out_features) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return shape;
}

SavedChainLayout saved_chain_layout(int64_t rows, const std::vector<int64_t> &widths,
                                    fmlp_activation hidden, fmlp_activation final_activation) {
  SavedChainLayout layout;
  const size_t n_layers = widths.size() - 1;
  layout.pre_offset.reserve(n_layers);
  layout.hidden_offset.reserve(n_layers);
  for (size_t l = 0; l < n_layers; ++l) {
    const bool last = l + 1 == n_layers;
    const int64_t size = rows * widths[l + 1];
    const bool save_pre = fmlp_chain_saves_pre(last ? final_activation : hidden);
    layout.pre_offset.push_back(save_pre ? layout.total : -1);
    layout.total += save_pre ? size : 0;
    layout.hidden_offset.push_back(last ? -1 : layout.total);
    layout.total += last ? 0 : size;
  }
  return layout;
}

std::vector<int64_t> chain_widths(const Tensor &x, TensorList weights) {
  std::vector<int64_t> widths;
  widths.reserve(weights.size() + 1);
  widths.push_back(x.size(-1));
  for (const auto &w : weights) widths.push_back(w.size(0));
  return widths;
}

bool &profiler_records() {
  thread_local bool records = false;
  return records;
}

std::string layer_label(const char *op, int64_t layer) {
  return std::string(op) + ".layer" + std::to_string(layer);
}

}  // namespace fusedmlp
