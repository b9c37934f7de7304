// The op schemas. Backends register their kernels in their own files.
#include <torch/library.h>

TORCH_LIBRARY(fusedmlp, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor");
  // (y, saved): saved holds what the backward needs, see ops.py.
  m.def("linear_train(Tensor x, Tensor weight, Tensor? bias, str activation) -> (Tensor, Tensor)");
  // biases: one per weight, or none at all (Tensor?[] would hide them from autograd).
  m.def("mlp(Tensor x, Tensor[] weights, Tensor[] biases, str activation) -> Tensor");
  m.def(
      "mlp_train(Tensor x, Tensor[] weights, Tensor[] biases, str activation)"
      " -> (Tensor, Tensor)");
  // The gradients of linear / mlp from their training twin's saved buffer; grad_x is
  // an empty tensor unless need_grad_x, grad_biases empty unless bias.
  m.def(
      "chain_backward(Tensor grad_y, Tensor x, Tensor[] weights, Tensor saved, bool bias,"
      " str hidden_activation, str final_activation, bool need_grad_x)"
      " -> (Tensor grad_x, Tensor[] grad_weights, Tensor[] grad_biases)");
  m.def(
      "gated_mlp(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? bias_gate,"
      " Tensor? bias_up, Tensor? bias_down, str activation) -> Tensor");
  m.def(
      "gated_mlp_train(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? bias_gate,"
      " Tensor? bias_up, Tensor? bias_down, str activation) -> (Tensor, Tensor)");
  // The gradients of gated_mlp from its training twin's saved buffer; grad_x is an empty
  // tensor unless need_grad_x; grad_biases holds one gradient per true entry of
  // bias (gate, up, down).
  m.def(
      "gated_mlp_backward(Tensor grad_y, Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down,"
      " Tensor saved, bool[3] bias, str activation, bool need_grad_x) -> (Tensor grad_x,"
      " Tensor grad_w_gate, Tensor grad_w_up, Tensor grad_w_down, Tensor[] grad_biases)");
  m.def("activation_backward(Tensor grad, Tensor pre, str activation) -> Tensor");
  m.def(
      "gated_backward(Tensor grad_product, Tensor gate, Tensor up, str activation)"
      " -> (Tensor, Tensor)");
}

// fusedmlp._C is imported for the registrations above, and tells which
// instruction set the CPU kernels use (for tests and benchmarks).
#include <Python.h>

#include "fusedmlp/cpu.h"

static PyObject *cpu_isa(PyObject * /*module*/, PyObject * /*unused*/) {
  return PyUnicode_FromString(fmlp_cpu_isa_name(fmlp_cpu_isa_in_use()));
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"cpu_isa", cpu_isa, METH_NOARGS,
       "The instruction set of the float CPU kernels now: avx512, avx2 or portable "
       "(FUSEDMLP_ISA forces a lower one)."},
      {nullptr, nullptr, 0, nullptr}};
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fusedmlp kernels", -1, methods};
  return PyModule_Create(&module);
}
