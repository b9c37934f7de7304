// The ops' argument handling, shared by every backend: validate, flatten
// (*, in) to rows, call the backend with the output's shape (*, out). A
// Backend provides dtypes(), chain(), gated(), activation_backward() and
// gated_backward(). The kernels are registered boxed, through the stable ABI.
#pragma once

#include <torch/csrc/stable/library.h>

#include <initializer_list>
#include <tuple>
#include <utility>

#include "arguments.h"

namespace fusedmlp {

using TensorPair = std::tuple<Tensor, Tensor>;

template <class Backend>
struct OpWrappers {
  static TensorPair run_chain(const char *op, const Tensor &x, TensorList weights,
                              TensorList biases,
                              fmlp_activation hidden, fmlp_activation final_activation,
                              bool save) {
    check_chain(op, x, weights, biases, Backend::dtypes());
    return Backend::chain(op, as_rows(x), output_shape(x, weights.back().size(0)), weights,
                          biases, hidden, final_activation, save);
  }

  static TensorPair run_linear(const Tensor &x, const Tensor &weight,
                               const OptionalTensor &bias, std::string_view activation,
                               bool save) {
    const fmlp_activation act = parse_activation(activation);
    std::vector<Tensor> biases;
    if (bias.has_value()) biases.push_back(*bias);
    return run_chain("fusedmlp.linear", x, {weight}, biases, act, act, save);
  }

  static Tensor linear(const Tensor &x, const Tensor &weight,
                           const OptionalTensor &bias, std::string_view activation) {
    return std::get<0>(run_linear(x, weight, bias, activation, false));
  }

  static TensorPair linear_train(const Tensor &x, const Tensor &weight,
                                 const OptionalTensor &bias, std::string_view activation) {
    return run_linear(x, weight, bias, activation, true);
  }

  static TensorPair run_mlp(const Tensor &x, TensorList weights,
                            TensorList biases, std::string_view activation,
                            bool save) {
    return run_chain("fusedmlp.mlp", x, weights, biases, parse_activation(activation),
                     FMLP_ACT_NONE, save);
  }

  static Tensor mlp(const Tensor &x, TensorList weights,
                        TensorList biases, std::string_view activation) {
    return std::get<0>(run_mlp(x, weights, biases, activation, false));
  }

  static TensorPair mlp_train(const Tensor &x, TensorList weights,
                              TensorList biases,
                              std::string_view activation) {
    return run_mlp(x, weights, biases, activation, true);
  }

  static TensorPair run_gated(const Tensor &x, const Tensor &w_gate,
                              const Tensor &w_up, const Tensor &w_down,
                              const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                              const OptionalTensor &bias_down, std::string_view activation,
                              bool save) {
    const char *op = "fusedmlp.gated_mlp";
    const fmlp_activation act = parse_activation(activation);
    check_gated(op, x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, Backend::dtypes());
    return Backend::gated(op, as_rows(x), output_shape(x, w_down.size(0)), w_gate, w_up, w_down,
                          bias_gate, bias_up, bias_down, act, save);
  }

  static Tensor gated_mlp(const Tensor &x, const Tensor &w_gate,
                              const Tensor &w_up, const Tensor &w_down,
                              const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                              const OptionalTensor &bias_down, std::string_view activation) {
    return std::get<0>(
        run_gated(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation, false));
  }

  static TensorPair gated_mlp_train(const Tensor &x, const Tensor &w_gate,
                                    const Tensor &w_up, const Tensor &w_down,
                                    const OptionalTensor &bias_gate,
                                    const OptionalTensor &bias_up,
                                    const OptionalTensor &bias_down,
                                    std::string_view activation) {
    return run_gated(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation, true);
  }

  // The kernels read numel() elements of the backend's compute type from every
  // tensor, so an unsupported dtype (say uint8 or float16 on CPU) would make them
  // read past the end of the buffer: reject it.
  static void check_pointwise(const char *op, const Tensor &grad, const char *grad_name,
                              std::initializer_list<std::pair<const char *, const Tensor *>>
                                  others) {
    check_dtype(op, grad_name, grad, Backend::dtypes());
    for (const auto &[name, t] : others) {
      FMLP_CHECK(t->sizes().equals(grad.sizes()), op, ": ", name, " must have the shape of ",
                 grad_name, ", ", Shape{grad.sizes()}, ", got ", Shape{t->sizes()});
      FMLP_CHECK(t->scalar_type() == grad.scalar_type(), op, ": ", name, " has dtype ",
                 t->scalar_type(), " but ", grad_name, " has dtype ", grad.scalar_type(),
                 "; all tensors must share one dtype");
      FMLP_CHECK(t->device() == grad.device(), op, ": ", name, " is on ", t->device(), " but ",
                 grad_name, " is on ", grad.device(), "; all tensors must be on one device");
    }
  }

  static Tensor activation_backward(const Tensor &grad, const Tensor &pre,
                                        std::string_view activation) {
    check_pointwise("fusedmlp.activation_backward", grad, "grad", {{"pre", &pre}});
    return Backend::activation_backward(as_contiguous(grad), as_contiguous(pre),
                                        parse_activation(activation));
  }

  static TensorPair gated_backward(const Tensor &grad_product, const Tensor &gate,
                                   const Tensor &up, std::string_view activation) {
    check_pointwise("fusedmlp.gated_backward", grad_product, "grad_product",
                    {{"gate", &gate}, {"up", &up}});
    return Backend::gated_backward(as_contiguous(grad_product), as_contiguous(gate), as_contiguous(up),
                                   parse_activation(activation));
  }

  static void register_kernels(torch::stable::detail::StableLibrary &m) {
    m.impl("linear", TORCH_BOX(&linear));
    m.impl("linear_train", TORCH_BOX(&linear_train));
    m.impl("mlp", TORCH_BOX(&mlp));
    m.impl("mlp_train", TORCH_BOX(&mlp_train));
    m.impl("gated_mlp", TORCH_BOX(&gated_mlp));
    m.impl("gated_mlp_train", TORCH_BOX(&gated_mlp_train));
    m.impl("activation_backward", TORCH_BOX(&activation_backward));
    m.impl("gated_backward", TORCH_BOX(&gated_backward));
  }
};

}  // namespace fusedmlp
