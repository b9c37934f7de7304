// Autocast for the forward ops: inside torch.autocast, floating inputs are
// cast to the autocast dtype (as nn.Linear's are), then the op runs with
// autocast disabled. One boxed kernel serves every op and both device types.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

template <c10::DeviceType device, c10::DispatchKey key>
void autocast_kernel(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  const size_t n_args = op.schema().arguments().size();
  for (size_t i = stack->size() - n_args; i < stack->size(); ++i) {
    c10::IValue &arg = (*stack)[i];
    if (arg.isTensor()) {
      arg = at::autocast::cached_cast(dtype, arg.toTensor(), device);
    } else if (arg.isList()) {  // Tensor[] and Tensor?[]
      c10::List<c10::IValue> items = arg.toList();
      for (size_t j = 0; j < items.size(); ++j) {
        const c10::IValue item = items.get(j);
        if (item.isTensor()) items.set(j, at::autocast::cached_cast(dtype, item.toTensor(), device));
      }
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  op.callBoxed(stack);
}

template <c10::DeviceType device, c10::DispatchKey key>
void register_autocast(torch::Library &m) {
  for (const char *name :
       {"linear", "linear_train", "mlp", "mlp_train", "gated_mlp", "gated_mlp_train"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<device, key>>());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmlp, AutocastCPU, m) {
  register_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>(m);
}

TORCH_LIBRARY_IMPL(fusedmlp, AutocastCUDA, m) {
  register_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>(m);
}
