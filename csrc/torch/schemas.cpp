// The op schemas, through the stable ABI. Backends register their kernels in
// their own files.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(fusedmlp, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor");
  // (y, saved): saved holds what the backward needs, see saved_layout.py.
  m.def("linear_train(Tensor x, Tensor weight, Tensor? bias, str activation) -> (Tensor, Tensor)");
  // biases: one per weight, or none at all (Tensor?[] would hide them from autograd).
  m.def("mlp(Tensor x, Tensor[] weights, Tensor[] biases, str activation) -> Tensor");
  m.def(
      "mlp_train(Tensor x, Tensor[] weights, Tensor[] biases, str activation)"
      " -> (Tensor, Tensor)");
  // The gradients of linear / mlp from their training twin's output y and saved buffer
  // (y may be None unless the final activation's derivative reads it: relu); grad_x is
  // an empty tensor unless need_grad_x, grad_biases empty unless bias.
  m.def(
      "chain_backward(Tensor grad_y, Tensor x, Tensor[] weights, Tensor saved, Tensor? y,"
      " bool bias, str hidden_activation, str final_activation, bool need_grad_x)"
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

// fusedmlp._C is imported for the registrations above, and tells Python what
// the registries hold (activations, instruction sets) and each device's dtypes,
// so that Python never restates them. Only CPython's limited API (3.10) is used:
// the module is built as abi3, one file for every CPython from 3.10 on.
#include <Python.h>

#include <algorithm>
#include <cstring>

#include "arguments.h"
#include "fusedmlp/cpu.h"
#include "weight_cache.h"

// The names of the activations `keep` accepts, in the enum's order.
static PyObject *activation_names(bool (*keep)(fmlp_activation)) {
  PyObject *names = PyList_New(0);
  if (names == nullptr) return nullptr;
  for (int i = 0; i < FMLP_ACT_COUNT; ++i) {
    if (!keep(static_cast<fmlp_activation>(i))) continue;
    PyObject *name = PyUnicode_FromString(fusedmlp::kActivationNames[i]);
    const bool added = name != nullptr && PyList_Append(names, name) == 0;
    Py_XDECREF(name);
    if (!added) {
      Py_DECREF(names);
      return nullptr;
    }
  }
  PyObject *tuple = PyList_AsTuple(names);
  Py_DECREF(names);
  return tuple;
}

static PyObject *activations(PyObject * /*module*/, PyObject * /*unused*/) {
  return activation_names([](fmlp_activation) { return true; });
}

static PyObject *output_derivative_activations(PyObject * /*module*/, PyObject * /*unused*/) {
  return activation_names(
      [](fmlp_activation activation) { return fmlp_derivative_reads_output(activation) != 0; });
}

// torch's Python name of a dtype the kernels take (the stable ABI has no table of them).
static const char *dtype_name(fusedmlp::ScalarType dtype) {
  switch (dtype) {
    case fusedmlp::ScalarType::Float: return "float32";
    case fusedmlp::ScalarType::Double: return "float64";
    case fusedmlp::ScalarType::Half: return "float16";
    case fusedmlp::ScalarType::BFloat16: return "bfloat16";
    default: return nullptr;
  }
}

// ("float32", ...): torch's names of the dtypes.
static PyObject *dtype_names(const std::vector<fusedmlp::ScalarType> &dtypes) {
  PyObject *names = PyTuple_New(static_cast<Py_ssize_t>(dtypes.size()));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const char *name = dtype_name(dtypes[i]);
    PyObject *item = name != nullptr ? PyUnicode_FromString(name)
                                     : PyErr_Format(PyExc_SystemError, "fusedmlp: dtype %d has no name",
                                                    static_cast<int>(dtypes[i]));
    if (item == nullptr || PyTuple_SetItem(names, static_cast<Py_ssize_t>(i), item) != 0) {
      Py_DECREF(names);
      return nullptr;
    }
  }
  return names;
}

static PyObject *device_dtypes(PyObject * /*module*/, PyObject * /*unused*/) {
  return Py_BuildValue("{s:N,s:N}", "cpu", dtype_names(fusedmlp::cpu_dtypes()), "cuda",
                       dtype_names(fusedmlp::cuda_dtypes()));
}

namespace fusedmlp {
fmlp_dtype kernel_dtype(ScalarType storage);  // cpu.cpp
}

static PyObject *cpu_isa(PyObject * /*module*/, PyObject *args) {
  const char *requested = "float32";
  if (!PyArg_ParseTuple(args, "|s:cpu_isa", &requested)) return nullptr;
  const std::vector<fusedmlp::ScalarType> dtypes = fusedmlp::cpu_dtypes();
  const auto named = std::find_if(dtypes.begin(), dtypes.end(), [&](fusedmlp::ScalarType dtype) {
    const char *name = dtype_name(dtype);
    return name != nullptr && std::strcmp(name, requested) == 0;
  });
  if (named == dtypes.end()) {
    return PyErr_Format(PyExc_ValueError, "cpu_isa: dtype '%s' is not one the CPU kernels take",
                        requested);
  }
  const char *isa = fmlp_cpu_isa_name(fmlp_cpu_isa_in_use());
  if (fmlp_cpu_gemm_in_use(fusedmlp::kernel_dtype(*named)) == FMLP_GEMM_HOST) {
    return PyUnicode_FromFormat("aten+%s", isa);
  }
  return PyUnicode_FromString(isa);
}

// One (name, compiler flags, CPU features, supported here, forced only here,
// bfloat16 native) tuple per ISA of fusedmlp/cpu_isas.def, in its order; flags
// and features space-separated.
static PyObject *cpu_isas(PyObject * /*module*/, PyObject * /*unused*/) {
  struct Entry {
    fmlp_cpu_isa isa;
    const char *flags, *features;
  };
#define FMLP_FEATURE(feature) " " #feature
#define FMLP_ISA(id, name, flags, features) {FMLP_ISA_##id, flags, "" features},
  static const Entry entries[] = {
#include "fusedmlp/cpu_isas.def"
  };
  PyObject *result = PyTuple_New(FMLP_ISA_COUNT);
  if (result == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < FMLP_ISA_COUNT; ++i) {
    const Entry &e = entries[i];
    const char *features = e.features[0] == ' ' ? e.features + 1 : e.features;
    PyObject *entry = Py_BuildValue("(sssOOO)", fmlp_cpu_isa_name(e.isa), e.flags, features,
                                    fmlp_cpu_isa_supported(e.isa) ? Py_True : Py_False,
                                    fmlp_cpu_isa_forced_only(e.isa) ? Py_True : Py_False,
                                    fmlp_cpu_isa_bf16_native(e.isa) ? Py_True : Py_False);
    if (entry == nullptr || PyTuple_SetItem(result, i, entry) != 0) {
      Py_DECREF(result);
      return nullptr;
    }
  }
  return result;
}

// " portable avx2 avx512": the registry's names, for the docstring.
#define FMLP_ISA(id, name, flags, features) " " #name
static const char kCpuIsaDoc[] =
    "The instruction set of the CPU kernels now, one of (best last):"
#include "fusedmlp/cpu_isas.def"
    "; detection skips the forced-only ones (cpu_isas()), FUSEDMLP_ISA forces any one the CPU "
    "supports. 'aten+<isa>': the ops' GEMMs in `dtype` (a name of device_dtypes()['cpu'], "
    "float32 by default) run in ATen, each followed by our epilogue pass in the dtype's kernel "
    "unit at or below <isa> (the default where that unit is at no level measured to beat eager, "
    "inference calls of up to 4 rows aside, or FUSEDMLP_CPU_GEMM=aten).";

// Sets a thread's flag to value's truth; returns what it was.
static PyObject *swap_flag(bool &flag, PyObject *value) {
  const int truth = PyObject_IsTrue(value);
  if (truth < 0) return nullptr;
  const bool previous = flag;
  flag = truth != 0;
  return PyBool_FromLong(previous);
}

static PyObject *profiler_records(PyObject * /*module*/, PyObject *records) {
  return swap_flag(fusedmlp::profiler_records(), records);
}

static PyObject *weight_cache_info(PyObject * /*module*/, PyObject * /*unused*/) {
  const fusedmlp::WeightCacheInfo info = fusedmlp::weight_cache_info();
  return Py_BuildValue("{sLsLsLsLsL}", "entries", static_cast<long long>(info.entries), "bytes",
                       static_cast<long long>(info.bytes), "limit_bytes",
                       static_cast<long long>(info.limit_bytes), "hits",
                       static_cast<long long>(info.hits), "misses",
                       static_cast<long long>(info.misses));
}

static PyObject *pause_weight_cache(PyObject * /*module*/, PyObject *paused) {
  return swap_flag(fusedmlp::weight_cache_paused(), paused);
}

static PyObject *clear_weight_cache(PyObject * /*module*/, PyObject * /*unused*/) {
  fusedmlp::clear_weight_cache();
  Py_RETURN_NONE;
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"activations", activations, METH_NOARGS,
       "The activation names, in the order of the kernels' enum."},
      {"output_derivative_activations", output_derivative_activations, METH_NOARGS,
       "The activations whose derivative reads their output (ReLU's sign): a training chain "
       "saves no pre-activation for its layers that use one."},
      {"device_dtypes", device_dtypes, METH_NOARGS,
       "{device type: the names of the dtypes its kernels take}."},
      {"cpu_isa", cpu_isa, METH_VARARGS, kCpuIsaDoc},
      {"cpu_isas", cpu_isas, METH_NOARGS,
       "The registered instruction sets, lowest first: (name, compiler flags, CPU features, "
       "supported by this CPU, forced only: detection skips it on this CPU's vendor, bfloat16 "
       "native: its bfloat16 unit multiplies bfloat16 in hardware) each."},
      {"profiler_records", profiler_records, METH_O,
       "Whether torch's profiler records the ops called on this thread (then they label "
       "their calls, each layer (stage) its own call under its own label): sets it, returns "
       "the previous setting (fusedmlp/profiling.py)."},
      {"weight_cache_info", weight_cache_info, METH_NOARGS,
       "The inference ops' packed-weight cache: {entries, bytes, limit_bytes, hits, misses} "
       "(hits and misses since the last clear)."},
      {"pause_weight_cache", pause_weight_cache, METH_O,
       "Whether the ops called on this thread skip the packed-weight cache (for weights "
       "that are new tensors each call, autocast's casts): sets it, returns the previous "
       "setting."},
      {"clear_weight_cache", clear_weight_cache, METH_NOARGS,
       "Empties the packed-weight cache (fusedmlp.clear_weight_cache)."},
      {nullptr, nullptr, 0, nullptr}};
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fusedmlp kernels", -1, methods};
  return PyModule_Create(&module);
}
