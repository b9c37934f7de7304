// CUDA kernels of the fusedmlp ops: tensors to pointers and strides, the
// current stream, and torch's own cuBLAS and cuBLASLt handles with the Lt workspace
// it keeps per handle and stream (no allocation per call). Multi-layer ops run one
// fused GEMM per layer, each labelled for the profiler. The arguments arrive as
// stable-ABI tensors through the shared op_wrappers.h; nothing stable gives torch's
// cuBLAS(Lt) handles, workspace or TF32 decision, so the kernels below work on the
// ATen tensors they wrap, and _C_cuda is tied to the torch it was built against.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <mutex>

#include "fusedmlp/cuda.h"
#include "op_wrappers.h"

namespace fusedmlp {
namespace {

// The kernel's own detail names the failing CUDA or cuBLAS call, its status and the sizes.
void check_status(fmlp_status status, const char *op) {
  TORCH_CHECK(status == FMLP_OK, op, ": CUDA kernel failed (", fmlp_status_string(status),
              "): ", fmlp_cuda_error_detail());
}

fmlp_dtype kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return FMLP_BF16;
    case at::kHalf: return FMLP_F16;
    default: return FMLP_F32;
  }
}

// The ATen tensor a stable one wraps (the same tensor, no copy), and back.
at::Tensor aten(const Tensor &t) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(t.get());
}
Tensor stable(at::Tensor t) { return Tensor(torch::aot_inductor::new_tensor_handle(std::move(t))); }
std::vector<at::Tensor> aten(TensorList list) {
  std::vector<at::Tensor> tensors;
  for (const Tensor &t : list) tensors.push_back(aten(t));
  return tensors;
}
at::Tensor aten(const OptionalTensor &t) { return t.has_value() ? aten(*t) : at::Tensor(); }

fmlp_cuda_plan_cache *plan_cache() {
  // One process-wide cache, alive until exit: plans hold no device memory.
  static fmlp_cuda_plan_cache *cache = nullptr;
  static std::once_flag created;
  std::call_once(created, [] {
    fmlp_cuda_plan_cache *made = nullptr;
    check_status(fmlp_cuda_plan_cache_create(&made), "fusedmlp");
    cache = made;
  });
  return cache;
}

// float32 GEMMs may use TF32 exactly when torch's own do. torch decides it from its
// fp32-precision setting each time it hands out its cuBLAS handle (CublasHandlePool.cpp
// sets CUBLAS_TF32_TENSOR_OP_MATH or CUBLAS_DEFAULT_MATH), so the handle's math mode is
// its answer, in every torch version, without allowTF32CuBLAS(), which raises once the
// legacy and the new precision settings have both been used.
bool allow_tf32(cublasHandle_t torch_handle) {
  cublasMath_t mode = CUBLAS_DEFAULT_MATH;
  TORCH_CHECK(cublasGetMathMode(torch_handle, &mode) == CUBLAS_STATUS_SUCCESS,
              "fusedmlp: cublasGetMathMode failed on torch's cuBLAS handle");
  const int without_flags = static_cast<int>(mode) &
                            ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  return without_flags == static_cast<int>(CUBLAS_TF32_TENSOR_OP_MATH);
}

// Everything one op call needs for its GEMMs, all of it torch's: handles bound to the
// current stream, and the cuBLASLt workspace torch keeps for this handle and stream.
fmlp_cuda_env gemm_env(const at::Tensor &like) {
  cublasHandle_t blas_handle = at::cuda::getCurrentCUDABlasHandle();
  return {at::cuda::getCurrentCUDABlasLtHandle(),
          blas_handle,
          at::cuda::getCurrentCUDAStream(),
          static_cast<int>(like.get_device()),
          at::cuda::getCUDABlasLtWorkspace(),
          static_cast<int64_t>(at::cuda::getCUDABlasLtWorkspaceSize()),
          plan_cache(),
          allow_tf32(blas_handle) ? 1 : 0};
}

// A single row's stride is arbitrary; cuBLASLt still wants one >= the row length.
int64_t row_stride(const at::Tensor &t) {
  return t.size(0) <= 1 ? std::max<int64_t>(1, t.size(1)) : t.stride(0);
}

// cuBLAS takes rows with unit column stride and a row stride >= the row length; its
// classic GEMM (size-1 and huge dimensions) takes strides that fit an int: others are
// copied, so that only a row length beyond it is refused (FMLP_CUDA_GEMM_MAX_DIM).
at::Tensor gemm_operand(const at::Tensor &t) {
  const int64_t stride = row_stride(t);
  const bool usable = t.stride(1) == 1 && stride >= std::max<int64_t>(1, t.size(1)) &&
                      stride <= FMLP_CUDA_GEMM_MAX_DIM;
  return usable ? t : t.contiguous();
}

const void *optional_data(const at::Tensor &t) { return t.defined() ? t.data_ptr() : nullptr; }

at::Tensor bias_operand(const at::Tensor &bias) {
  return bias.defined() ? bias.contiguous() : at::Tensor();
}

fmlp_cuda_linear_args linear_args(const at::Tensor &x, const at::Tensor &w, const at::Tensor &b,
                                  const at::Tensor &y, fmlp_activation activation, void *pre) {
  fmlp_cuda_linear_args args = {};
  args.dtype = kernel_dtype(x.scalar_type());
  args.m = x.size(0);
  args.n = w.size(0);
  args.k = w.size(1);
  args.batch = 1;
  args.x = x.data_ptr();
  args.x_row_stride = row_stride(x);
  args.w = w.data_ptr();
  args.w_row_stride = row_stride(w);
  args.bias = optional_data(b);
  args.y = y.data_ptr();
  args.y_row_stride = row_stride(y);
  args.activation = activation;
  args.pre = pre;
  return args;
}

void *saved_at(const at::Tensor &saved, int64_t offset) {
  return offset < 0 ? nullptr
                    : static_cast<char *>(saved.data_ptr()) + offset * saved.element_size();
}

// Gate and up as one strided-batched GEMM when routing.c's decision allows
// (fmlp_cuda_gate_up_batchable); sets the batch strides.
bool gate_up_batchable(const at::Tensor &wg, const at::Tensor &wu, const at::Tensor &bg,
                       const at::Tensor &bu, int64_t rows, int64_t *w_stride,
                       int64_t *b_stride) {
  const auto address = [](const at::Tensor &t) {
    return t.defined() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : uintptr_t{0};
  };
  const fmlp_cuda_gate_up gate_up = {address(wg),    address(wu),     address(bg),
                                     address(bu),    row_stride(wg),  row_stride(wu),
                                     rows,           wg.size(0),      wg.size(1),
                                     wg.element_size()};
  return fmlp_cuda_gate_up_batchable(&gate_up, w_stride, b_stride) != 0;
}

// The ops on ATen tensors; CudaBackend below wraps them for op_wrappers.h.
using AtenPair = std::tuple<at::Tensor, at::Tensor>;

struct AtenCuda {
  static AtenPair chain(const char *op, const at::Tensor &x_rows,
                        const std::vector<int64_t> &y_shape, at::TensorList weights,
                        at::TensorList biases, const std::vector<int64_t> &widths,
                        fmlp_activation hidden, fmlp_activation final_activation, bool save) {
    const c10::cuda::CUDAGuard device_guard(x_rows.device());
    const int64_t rows = x_rows.size(0), n_layers = static_cast<int64_t>(weights.size());
    const SavedChainLayout layout = saved_chain_layout(rows, widths, hidden, final_activation);
    const at::Tensor y = at::empty(y_shape, x_rows.options()),
                     y_rows = y.view({rows, widths.back()});
    at::Tensor saved = at::empty({save ? layout.total : 0}, x_rows.options());
    int64_t max_hidden = 0;
    for (int64_t l = 0; l + 1 < n_layers; ++l) max_hidden = std::max(max_hidden, widths[l + 1]);
    // Inference intermediates ping-pong in one allocation.
    at::Tensor scratch = at::empty({save ? 0 : 2 * rows * max_hidden}, x_rows.options());
    const fmlp_cuda_env env = gemm_env(x_rows);
    at::Tensor input = gemm_operand(x_rows);
    for (int64_t l = 0; l < n_layers; ++l) {
      RECORD_FUNCTION(layer_label(op, l), std::vector<c10::IValue>());
      const bool last = l + 1 == n_layers;
      at::Tensor out = y_rows;
      if (!last) {
        const int64_t size = rows * widths[l + 1];
        out = (save ? saved.narrow(0, layout.hidden_offset[l], size)
                    : scratch.narrow(0, (l % 2) * rows * max_hidden, size))
                  .view({rows, widths[l + 1]});
      }
      const fmlp_cuda_linear_args args = linear_args(
          input, gemm_operand(weights[l]), biases.empty() ? at::Tensor() : bias_operand(biases[l]),
          out,
          last ? final_activation : hidden, save ? saved_at(saved, layout.pre_offset[l]) : nullptr);
      check_status(fmlp_cuda_linear(&env, &args), op);
      input = out;
    }
    return {y, saved};
  }

  static AtenPair gated(const char *op, const at::Tensor &x_rows,
                        const std::vector<int64_t> &y_shape, const at::Tensor &w_gate,
                        const at::Tensor &w_up, const at::Tensor &w_down,
                        const at::Tensor &bias_gate, const at::Tensor &bias_up,
                        const at::Tensor &bias_down, fmlp_activation activation, bool save) {
    const c10::cuda::CUDAGuard device_guard(x_rows.device());
    const int64_t rows = x_rows.size(0), hidden = w_gate.size(0);
    const at::Tensor x = gemm_operand(x_rows), wg = gemm_operand(w_gate),
                     wu = gemm_operand(w_up), bg = bias_operand(bias_gate),
                     bu = bias_operand(bias_up);
    // [gate pre-activation, up] and, saved for backward, act(gate) * up; in inference
    // the product overwrites the gate in place.
    at::Tensor buffers = at::empty({save ? 3 : 2, rows, hidden}, x_rows.options());
    at::Tensor product = buffers[save ? 2 : 0];
    const at::Tensor y = at::empty(y_shape, x_rows.options()),
                     y_rows = y.view({rows, w_down.size(0)});
    const fmlp_cuda_env env = gemm_env(x_rows);
    {
      RECORD_FUNCTION(std::string(op) + ".gate_up", std::vector<c10::IValue>());
      fmlp_cuda_linear_args args = linear_args(x, wg, bg, buffers[0], FMLP_ACT_NONE, nullptr);
      int64_t w_stride = 0, b_stride = 0;
      fmlp_status batched = FMLP_ERR_UNSUPPORTED;
      if (gate_up_batchable(wg, wu, bg, bu, rows, &w_stride, &b_stride)) {
        fmlp_cuda_linear_args both = args;
        both.batch = 2;
        both.w_batch_stride = w_stride;
        both.bias_batch_stride = b_stride;
        both.y_batch_stride = rows * hidden;
        batched = fmlp_cuda_linear(&env, &both);
      }
      // No batched algorithm (or not batchable): two GEMMs.
      if (batched == FMLP_ERR_UNSUPPORTED) {
        check_status(fmlp_cuda_linear(&env, &args), op);
        const fmlp_cuda_linear_args up =
            linear_args(x, wu, bu, buffers[1], FMLP_ACT_NONE, nullptr);
        check_status(fmlp_cuda_linear(&env, &up), op);
      } else {
        check_status(batched, op);
      }
    }
    {
      RECORD_FUNCTION(std::string(op) + ".product", std::vector<c10::IValue>());
      check_status(fmlp_cuda_gate_product(kernel_dtype(x.scalar_type()), rows * hidden,
                                          buffers[0].data_ptr(), buffers[1].data_ptr(),
                                          activation, product.data_ptr(),
                                          at::cuda::getCurrentCUDAStream()),
                   op);
    }
    {
      RECORD_FUNCTION(std::string(op) + ".down", std::vector<c10::IValue>());
      const fmlp_cuda_linear_args args = linear_args(
          product, gemm_operand(w_down), bias_operand(bias_down), y_rows, FMLP_ACT_NONE,
          nullptr);
      check_status(fmlp_cuda_linear(&env, &args), op);
    }
    return {y, save ? buffers : at::empty({0, rows, hidden}, x_rows.options())};
  }

  static at::Tensor activation_backward(const at::Tensor &grad, const at::Tensor &pre,
                                        fmlp_activation activation) {
    const c10::cuda::CUDAGuard device_guard(grad.device());
    at::Tensor grad_pre = at::empty_like(grad);
    check_status(fmlp_cuda_activation_backward(kernel_dtype(grad.scalar_type()), grad.numel(),
                                               grad.data_ptr(), pre.data_ptr(), activation,
                                               grad_pre.data_ptr(),
                                               at::cuda::getCurrentCUDAStream()),
                 "fusedmlp.activation_backward");
    return grad_pre;
  }

  static AtenPair gated_backward(const at::Tensor &grad_product, const at::Tensor &gate,
                                 const at::Tensor &up, fmlp_activation activation) {
    const c10::cuda::CUDAGuard device_guard(grad_product.device());
    at::Tensor grad_gate = at::empty_like(grad_product), grad_up = at::empty_like(grad_product);
    check_status(fmlp_cuda_gated_backward(kernel_dtype(grad_product.scalar_type()),
                                          grad_product.numel(), grad_product.data_ptr(),
                                          gate.data_ptr(), up.data_ptr(), activation,
                                          grad_gate.data_ptr(), grad_up.data_ptr(),
                                          at::cuda::getCurrentCUDAStream()),
                 "fusedmlp.gated_backward");
    return {grad_gate, grad_up};
  }
};

TensorPair stable(AtenPair pair) {
  return {stable(std::move(std::get<0>(pair))), stable(std::move(std::get<1>(pair)))};
}

struct CudaBackend {
  static const std::vector<ScalarType> &dtypes() { return cuda_dtypes(); }

  static TensorPair chain(const char *op, const Tensor &x_rows,
                          const std::vector<int64_t> &y_shape, TensorList weights,
                          TensorList biases, fmlp_activation hidden,
                          fmlp_activation final_activation, bool save) {
    return stable(AtenCuda::chain(op, aten(x_rows), y_shape, aten(weights), aten(biases),
                                  chain_widths(x_rows, weights), hidden, final_activation, save));
  }

  static TensorPair gated(const char *op, const Tensor &x_rows,
                          const std::vector<int64_t> &y_shape, const Tensor &w_gate,
                          const Tensor &w_up, const Tensor &w_down,
                          const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                          const OptionalTensor &bias_down, fmlp_activation activation,
                          bool save) {
    return stable(AtenCuda::gated(op, aten(x_rows), y_shape, aten(w_gate), aten(w_up),
                                  aten(w_down), aten(bias_gate), aten(bias_up), aten(bias_down),
                                  activation, save));
  }

  static Tensor activation_backward(const Tensor &grad, const Tensor &pre,
                                    fmlp_activation activation) {
    return stable(AtenCuda::activation_backward(aten(grad), aten(pre), activation));
  }

  static TensorPair gated_backward(const Tensor &grad_product, const Tensor &gate,
                                   const Tensor &up, fmlp_activation activation) {
    return stable(AtenCuda::gated_backward(aten(grad_product), aten(gate), aten(up), activation));
  }
};

}  // namespace
}  // namespace fusedmlp

STABLE_TORCH_LIBRARY_IMPL(fusedmlp, CUDA, m) {
  fusedmlp::OpWrappers<fusedmlp::CudaBackend>::register_kernels(m);
}
