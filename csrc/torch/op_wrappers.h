// The ops' argument handling, shared by every backend: validate, flatten
// (*, in) to rows, call the backend with the output's shape (*, out). A
// Backend provides dtypes(), chain(), gated(), activation_backward() and
// gated_backward().
#pragma once

#include <torch/library.h>

#include <tuple>

#include "arguments.h"

namespace fusedmlp {

using OptionalTensor = std::optional<at::Tensor>;
using TensorPair = std::tuple<at::Tensor, at::Tensor>;

template <class Backend>
struct OpWrappers {
  static TensorPair run_chain(const char *op, const at::Tensor &x, at::TensorList weights,
                              at::TensorList biases,
                              fmlp_activation hidden, fmlp_activation final_activation,
                              bool save) {
    check_chain(op, x, weights, biases, Backend::dtypes());
    return Backend::chain(op, as_rows(x), output_shape(x, weights.back().size(0)), weights,
                          biases, hidden, final_activation, save);
  }

  static TensorPair run_linear(const at::Tensor &x, const at::Tensor &weight,
                               const OptionalTensor &bias, c10::string_view activation,
                               bool save) {
    const fmlp_activation act = parse_activation(activation);
    std::vector<at::Tensor> biases;
    if (bias.has_value()) biases.push_back(*bias);
    return run_chain("fusedmlp.linear", x, {weight}, biases, act, act, save);
  }

  static at::Tensor linear(const at::Tensor &x, const at::Tensor &weight,
                           const OptionalTensor &bias, c10::string_view activation) {
    return std::get<0>(run_linear(x, weight, bias, activation, false));
  }

  static TensorPair linear_train(const at::Tensor &x, const at::Tensor &weight,
                                 const OptionalTensor &bias, c10::string_view activation) {
    return run_linear(x, weight, bias, activation, true);
  }

  static TensorPair run_mlp(const at::Tensor &x, at::TensorList weights,
                            at::TensorList biases, c10::string_view activation,
                            bool save) {
    return run_chain("fusedmlp.mlp", x, weights, biases, parse_activation(activation),
                     FMLP_ACT_NONE, save);
  }

  static at::Tensor mlp(const at::Tensor &x, at::TensorList weights,
                        at::TensorList biases, c10::string_view activation) {
    return std::get<0>(run_mlp(x, weights, biases, activation, false));
  }

  static TensorPair mlp_train(const at::Tensor &x, at::TensorList weights,
                              at::TensorList biases,
                              c10::string_view activation) {
    return run_mlp(x, weights, biases, activation, true);
  }

  static TensorPair run_gated(const at::Tensor &x, const at::Tensor &w_gate,
                              const at::Tensor &w_up, const at::Tensor &w_down,
                              const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                              const OptionalTensor &bias_down, c10::string_view activation,
                              bool save) {
    const char *op = "fusedmlp.gated_mlp";
    const fmlp_activation act = parse_activation(activation);
    check_gated(op, x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, Backend::dtypes());
    return Backend::gated(op, as_rows(x), output_shape(x, w_down.size(0)), w_gate, w_up, w_down,
                          bias_gate, bias_up, bias_down, act, save);
  }

  static at::Tensor gated_mlp(const at::Tensor &x, const at::Tensor &w_gate,
                              const at::Tensor &w_up, const at::Tensor &w_down,
                              const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                              const OptionalTensor &bias_down, c10::string_view activation) {
    return std::get<0>(
        run_gated(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation, false));
  }

  static TensorPair gated_mlp_train(const at::Tensor &x, const at::Tensor &w_gate,
                                    const at::Tensor &w_up, const at::Tensor &w_down,
                                    const OptionalTensor &bias_gate,
                                    const OptionalTensor &bias_up,
                                    const OptionalTensor &bias_down,
                                    c10::string_view activation) {
    return run_gated(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation, true);
  }

  // The kernels read numel() elements of the backend's compute type from every
  // tensor, so an unsupported dtype (say uint8 or float16 on CPU) would make them
  // read past the end of the buffer: reject it.
  static void check_pointwise(const char *op, const at::Tensor &grad, const char *grad_name,
                              std::initializer_list<std::pair<const char *, const at::Tensor *>>
                                  others) {
    check_dtype(op, grad_name, grad, Backend::dtypes());
    for (const auto &[name, t] : others) {
      TORCH_CHECK(t->sizes() == grad.sizes(), op, ": ", name, " must have the shape of ",
                  grad_name, ", ", grad.sizes(), ", got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == grad.scalar_type(), op, ": ", name, " has dtype ",
                  t->scalar_type(), " but ", grad_name, " has dtype ", grad.scalar_type(),
                  "; all tensors must share one dtype");
      TORCH_CHECK(t->device() == grad.device(), op, ": ", name, " is on ", t->device(), " but ",
                  grad_name, " is on ", grad.device(), "; all tensors must be on one device");
    }
  }

  static at::Tensor activation_backward(const at::Tensor &grad, const at::Tensor &pre,
                                        c10::string_view activation) {
    check_pointwise("fusedmlp.activation_backward", grad, "grad", {{"pre", &pre}});
    return Backend::activation_backward(grad.contiguous(), pre.contiguous(),
                                        parse_activation(activation));
  }

  static TensorPair gated_backward(const at::Tensor &grad_product, const at::Tensor &gate,
                                   const at::Tensor &up, c10::string_view activation) {
    check_pointwise("fusedmlp.gated_backward", grad_product, "grad_product",
                    {{"gate", &gate}, {"up", &up}});
    return Backend::gated_backward(grad_product.contiguous(), gate.contiguous(), up.contiguous(),
                                   parse_activation(activation));
  }

  static void register_kernels(torch::Library &m) {
    m.impl("linear", &linear);
    m.impl("linear_train", &linear_train);
    m.impl("mlp", &mlp);
    m.impl("mlp_train", &mlp_train);
    m.impl("gated_mlp", &gated_mlp);
    m.impl("gated_mlp_train", &gated_mlp_train);
    m.impl("activation_backward", &activation_backward);
    m.impl("gated_backward", &gated_backward);
  }
};

}  // namespace fusedmlp
