#include "arguments.h"

#include <c10/util/safe_numerics.h>

namespace fusedmlp {

namespace {

// "none, relu, ...": the registry's names, for the error message.
std::string activation_names() {
  std::string names;
  for (const char *name : kActivationNames) {
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  return names;
}

std::string dtype_names(const std::vector<at::ScalarType> &dtypes) {
  std::string names;
  for (const auto dtype : dtypes) {
    names += (names.empty() ? "" : ", ") + std::string(c10::toString(dtype));
  }
  return names;
}

void check_same(const char *op, const char *name, const at::Tensor &t, const at::Tensor &x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but x has dtype ", x.scalar_type(), "; all tensors must share one dtype");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; all tensors must be on one device");
}

void check_x(const char *op, const at::Tensor &x, const std::vector<at::ScalarType> &dtypes) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape (*, in_features), got a 0-d tensor");
  check_dtype(op, "x", x, dtypes);
}

void check_weight(const char *op, const std::string &name, const at::Tensor &w,
                  int64_t in_features, const at::Tensor &x) {
  TORCH_CHECK(w.dim() == 2, op, ": ", name, " must be 2-D (out_features, in_features), got ",
              w.dim(), "-D with shape ", w.sizes());
  TORCH_CHECK(w.size(1) == in_features, op, ": ", name, " has shape ", w.sizes(), " and expects ",
              w.size(1), " input features, but its input has ", in_features);
  check_same(op, name.c_str(), w, x);
}

// The number of rows of x viewed as (rows, in_features): the product of its
// leading sizes (x.numel() / in_features fails when in_features is 0), checked
// to fit int64.
int64_t leading_rows(const char *op, const at::Tensor &x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    TORCH_CHECK(!c10::mul_overflows(rows, x.size(d), &rows), op, ": x has shape ", x.sizes(),
                "; its leading sizes multiply to more rows than int64 can count");
  }
  return rows;
}

// Checks that rows * width * copies, and the running total of such products,
// fit in int64, before anything of that size is allocated.
void check_count(const char *op, const std::string &weight, const char *what, int64_t rows,
                 int64_t width, int64_t copies, int64_t *total) {
  int64_t count = 0;
  const bool overflows = c10::mul_overflows(rows, width, &count) ||
                         c10::mul_overflows(count, copies, &count) ||
                         c10::add_overflows(*total, count, total);
  TORCH_CHECK(!overflows, op, ": x has ", rows, " rows and ", weight, " has ", width,
              " output features: ", what, " would have more elements than int64 can count");
}

void check_bias(const char *op, const std::string &name, const std::optional<at::Tensor> &bias,
                int64_t out_features, const at::Tensor &x) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op, ": ", name,
              " must have shape (", out_features, "), got ", bias->sizes());
  check_same(op, name.c_str(), *bias, x);
}

void check_grad_y(const char *op, const at::Tensor &grad_y, const at::Tensor &x,
                  int64_t out_features) {
  check_same(op, "grad_y", grad_y, x);
  const std::vector<int64_t> shape = output_shape(x, out_features);
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(shape), op,
              ": grad_y must have the output's shape ", at::IntArrayRef(shape), ", got ",
              grad_y.sizes());
}

}  // namespace

void check_dtype(const char *op, const char *name, const at::Tensor &t,
                 const std::vector<at::ScalarType> &dtypes) {
  bool supported = false;
  for (const auto dtype : dtypes) supported = supported || t.scalar_type() == dtype;
  TORCH_CHECK_TYPE(supported, op, ": ", name, " has dtype ", t.scalar_type(), ", but on ",
                   t.device().type(), " only ", dtype_names(dtypes), " are supported");
}

fmlp_activation parse_activation(c10::string_view name) {
  for (size_t i = 0; i < kActivationNames.size(); ++i) {
    if (name == kActivationNames[i]) return static_cast<fmlp_activation>(i);
  }
  TORCH_CHECK_VALUE(false, "fusedmlp: unknown activation '", std::string(name),
                    "'; valid names are ", activation_names());
}

std::optional<at::Tensor> bias_at(at::TensorList biases, size_t layer) {
  return biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[layer]);
}

void check_chain(const char *op, const at::Tensor &x, at::TensorList weights,
                 at::TensorList biases, const std::vector<at::ScalarType> &dtypes) {
  check_x(op, x, dtypes);
  TORCH_CHECK(!weights.empty(), op, ": weights must hold at least one weight");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), op, ": got ", weights.size(),
              " weights but ", biases.size(), " biases; pass one bias per weight, or none");
  int64_t features = x.size(-1);
  for (size_t l = 0; l < weights.size(); ++l) {
    const std::string suffix = weights.size() > 1 ? "[" + std::to_string(l) + "]" : "";
    check_weight(op, "weight" + suffix, weights[l], features, x);
    features = weights[l].size(0);
    check_bias(op, "bias" + suffix, bias_at(biases, l), features, x);
  }
  // Every layer's output may be saved twice (pre-activation and hidden), so the
  // saved buffer holds at most 2 * rows * sum(widths) elements.
  const int64_t rows = leading_rows(op, x);
  int64_t saved = 0;
  for (size_t l = 0; l < weights.size(); ++l) {
    const std::string name = weights.size() > 1 ? "weight[" + std::to_string(l) + "]" : "weight";
    check_count(op, name, "the output and saved activations", rows, weights[l].size(0), 2,
                &saved);
  }
}

void check_chain_backward(const char *op, const at::Tensor &grad_y, const at::Tensor &x,
                          at::TensorList weights, const at::Tensor &saved,
                          fmlp_activation hidden, fmlp_activation final_activation,
                          const std::vector<at::ScalarType> &dtypes) {
  check_chain(op, x, weights, {}, dtypes);
  check_grad_y(op, grad_y, x, weights.back().size(0));
  check_same(op, "saved", saved, x);
  const SavedChainLayout layout =
      saved_chain_layout(leading_rows(op, x), chain_widths(x, weights), hidden, final_activation);
  TORCH_CHECK(saved.dim() == 1 && saved.size(0) == layout.total, op,
              ": saved must be the 1-D buffer of ", layout.total,
              " elements the training op returns for these arguments, got shape ", saved.sizes());
}

void check_gated(const char *op, const at::Tensor &x, const at::Tensor &w_gate,
                 const at::Tensor &w_up, const at::Tensor &w_down,
                 const std::optional<at::Tensor> &bias_gate,
                 const std::optional<at::Tensor> &bias_up,
                 const std::optional<at::Tensor> &bias_down,
                 const std::vector<at::ScalarType> &dtypes) {
  check_x(op, x, dtypes);
  check_weight(op, "w_gate", w_gate, x.size(-1), x);
  check_weight(op, "w_up", w_up, x.size(-1), x);
  TORCH_CHECK(w_up.size(0) == w_gate.size(0), op, ": w_gate has shape ", w_gate.sizes(),
              " but w_up has shape ", w_up.sizes(), "; both must be (hidden, dim)");
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

void check_gated_backward(const char *op, const at::Tensor &grad_y, const at::Tensor &x,
                          const at::Tensor &w_gate, const at::Tensor &w_up,
                          const at::Tensor &w_down, const at::Tensor &saved,
                          const std::vector<at::ScalarType> &dtypes) {
  check_gated(op, x, w_gate, w_up, w_down, std::nullopt, std::nullopt, std::nullopt, dtypes);
  check_grad_y(op, grad_y, x, w_down.size(0));
  check_same(op, "saved", saved, x);
  const std::vector<int64_t> shape = {3, leading_rows(op, x), w_gate.size(0)};
  TORCH_CHECK(saved.sizes() == at::IntArrayRef(shape), op, ": saved must have shape ",
              at::IntArrayRef(shape), " (gate, up, product), got ", saved.sizes());
}

at::Tensor as_rows(const at::Tensor &x) {
  // The row count is explicit: with 0 features, -1 would be ambiguous.
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  return x.reshape({rows, x.size(-1)});
}

std::vector<int64_t> output_shape(const at::Tensor &x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

SavedChainLayout saved_chain_layout(int64_t rows, const std::vector<int64_t> &widths,
                                    fmlp_activation hidden, fmlp_activation final_activation) {
  SavedChainLayout layout;
  const size_t n_layers = widths.size() - 1;
  for (size_t l = 0; l < n_layers; ++l) {
    const bool last = l + 1 == n_layers;
    const int64_t size = rows * widths[l + 1];
    const bool save_pre = (last ? final_activation : hidden) != FMLP_ACT_NONE;
    layout.pre_offset.push_back(save_pre ? layout.total : -1);
    layout.total += save_pre ? size : 0;
    layout.hidden_offset.push_back(last ? -1 : layout.total);
    layout.total += last ? 0 : size;
  }
  return layout;
}

std::vector<int64_t> chain_widths(const at::Tensor &x, at::TensorList weights) {
  std::vector<int64_t> widths = {x.size(-1)};
  for (const auto &w : weights) widths.push_back(w.size(0));
  return widths;
}

std::string layer_label(const char *op, int64_t layer) {
  return std::string(op) + ".layer" + std::to_string(layer);
}

}  // namespace fusedmlp
