// Our own pointwise kernels: the activations cuBLASLt cannot fuse exactly
// (erf GELU, SiLU), the gate product of the gated block, the backward passes,
// and the K == 0 fill. One kernel template serves every dtype and operation;
// math is in float whatever the storage type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fusedmlp/cuda.h"

namespace {

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline float from_float<float>(float v) { return v; }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kGeluTanhKappa = 0.044715f;

__device__ inline float activate(float z, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU: return z < 0.f ? 0.f : z;  // keeps NaN, as torch.relu
    case FMLP_ACT_GELU: return 0.5f * z * (1.f + erff(z * kInvSqrt2));
    case FMLP_ACT_GELU_TANH:
      return 0.5f * z * (1.f + tanhf(kSqrt2OverPi * (z + kGeluTanhKappa * z * z * z)));
    case FMLP_ACT_SILU: return z / (1.f + expf(-z));
    default: return z;
  }
}

__device__ inline float activation_grad(float z, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_RELU: return 1.f;  // the zero side is selected in backward_of()
    case FMLP_ACT_GELU:
      return 0.5f * (1.f + erff(z * kInvSqrt2)) + z * kInvSqrt2Pi * expf(-0.5f * z * z);
    case FMLP_ACT_GELU_TANH: {
      const float t = tanhf(kSqrt2OverPi * (z + kGeluTanhKappa * z * z * z));
      const float inner_grad = kSqrt2OverPi * (1.f + 3.f * kGeluTanhKappa * z * z);
      return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * inner_grad;
    }
    case FMLP_ACT_SILU: {
      const float s = 1.f / (1.f + expf(-z));
      return s * (1.f + z * (1.f - s));
    }
    default: return 1.f;
  }
}

// grad * act'(z); for ReLU a select, as torch's threshold_backward: a NaN z passes
// the gradient and an infinite gradient where z <= 0 gives 0, not NaN.
__device__ inline float backward_of(float grad, float z, fmlp_activation activation) {
  if (activation == FMLP_ACT_RELU) return z <= 0.f ? 0.f : grad;
  return grad * activation_grad(z, activation);
}

enum class Pointwise { kActivate, kActivationBackward, kGateProduct, kGatedBackward };

// Operands by operation: kActivate a -> out0; kActivationBackward (grad a,
// pre b) -> out0; kGateProduct (gate a, up b) -> out0; kGatedBackward
// (grad a, gate b, up c) -> grad_gate out0, grad_up out1.
template <typename T, Pointwise op>
__global__ void pointwise_kernel(int64_t n, fmlp_activation activation, const T *a, const T *b,
                                 const T *c, T *out0, T *out1) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const float va = to_float(a[i]);
    if (op == Pointwise::kActivate) {
      out0[i] = from_float<T>(activate(va, activation));
    } else if (op == Pointwise::kActivationBackward) {
      out0[i] = from_float<T>(backward_of(va, to_float(b[i]), activation));
    } else if (op == Pointwise::kGateProduct) {
      out0[i] = from_float<T>(activate(va, activation) * to_float(b[i]));
    } else {
      const float gate = to_float(b[i]);
      out0[i] = from_float<T>(backward_of(va * to_float(c[i]), gate, activation));
      out1[i] = from_float<T>(va * activate(gate, activation));
    }
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;

int64_t blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

template <typename T, Pointwise op>
fmlp_status launch(int64_t n, fmlp_activation activation, const void *a, const void *b,
                   const void *c, void *out0, void *out1, cudaStream_t stream) {
  if (n == 0) return FMLP_OK;
  pointwise_kernel<T, op><<<(unsigned)blocks_for(n), kThreads, 0, stream>>>(
      n, activation, static_cast<const T *>(a), static_cast<const T *>(b),
      static_cast<const T *>(c), static_cast<T *>(out0), static_cast<T *>(out1));
  return cudaGetLastError() == cudaSuccess ? FMLP_OK : FMLP_ERR_BACKEND;
}

template <Pointwise op>
fmlp_status dispatch(fmlp_dtype dtype, int64_t n, fmlp_activation activation, const void *a,
                     const void *b, const void *c, void *out0, void *out1, cudaStream_t stream) {
  if (n < 0 || activation < FMLP_ACT_NONE || activation >= FMLP_ACT_COUNT) {
    return FMLP_ERR_INVALID_ARGUMENT;
  }
  switch (dtype) {
    case FMLP_F32: return launch<float, op>(n, activation, a, b, c, out0, out1, stream);
    case FMLP_BF16: return launch<__nv_bfloat16, op>(n, activation, a, b, c, out0, out1, stream);
    case FMLP_F16: return launch<__half, op>(n, activation, a, b, c, out0, out1, stream);
    default: return FMLP_ERR_UNSUPPORTED;
  }
}

// y[i, j] = act(bias[j]) (or act(0)) for an empty product (K == 0).
template <typename T>
__global__ void fill_empty_product_kernel(int64_t m, int64_t n, const T *bias,
                                          fmlp_activation activation, T *y, int64_t y_row_stride,
                                          T *pre) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m * n; i += step) {
    const int64_t row = i / n, col = i % n;
    const float z = bias != nullptr ? to_float(bias[col]) : 0.f;
    if (pre != nullptr) pre[i] = from_float<T>(z);
    y[row * y_row_stride + col] = from_float<T>(activate(z, activation));
  }
}

template <typename T>
fmlp_status launch_fill(const fmlp_cuda_linear_args *a, cudaStream_t stream) {
  fill_empty_product_kernel<T><<<(unsigned)blocks_for(a->m * a->n), kThreads, 0, stream>>>(
      a->m, a->n, static_cast<const T *>(a->bias), a->activation, static_cast<T *>(a->y),
      a->y_row_stride, static_cast<T *>(a->pre));
  return cudaGetLastError() == cudaSuccess ? FMLP_OK : FMLP_ERR_BACKEND;
}

}  // namespace

// Used by linear.cu for K == 0.
fmlp_status fmlp_cuda_fill_empty_product(const fmlp_cuda_linear_args *args, cudaStream_t stream) {
  if (args->m == 0 || args->n == 0) return FMLP_OK;
  switch (args->dtype) {
    case FMLP_F32: return launch_fill<float>(args, stream);
    case FMLP_BF16: return launch_fill<__nv_bfloat16>(args, stream);
    case FMLP_F16: return launch_fill<__half>(args, stream);
    default: return FMLP_ERR_UNSUPPORTED;
  }
}

extern "C" {

fmlp_status fmlp_cuda_activation(fmlp_dtype dtype, int64_t n, const void *in,
                                 fmlp_activation activation, void *out, cudaStream_t stream) {
  return dispatch<Pointwise::kActivate>(dtype, n, activation, in, nullptr, nullptr, out, nullptr,
                                        stream);
}

fmlp_status fmlp_cuda_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                          const void *pre, fmlp_activation activation,
                                          void *grad_pre, cudaStream_t stream) {
  return dispatch<Pointwise::kActivationBackward>(dtype, n, activation, grad_out, pre, nullptr,
                                                  grad_pre, nullptr, stream);
}

fmlp_status fmlp_cuda_gate_product(fmlp_dtype dtype, int64_t n, const void *gate, const void *up,
                                   fmlp_activation activation, void *product,
                                   cudaStream_t stream) {
  return dispatch<Pointwise::kGateProduct>(dtype, n, activation, gate, up, nullptr, product,
                                           nullptr, stream);
}

fmlp_status fmlp_cuda_gated_backward(fmlp_dtype dtype, int64_t n, const void *grad_product,
                                     const void *gate, const void *up,
                                     fmlp_activation activation, void *grad_gate, void *grad_up,
                                     cudaStream_t stream) {
  return dispatch<Pointwise::kGatedBackward>(dtype, n, activation, grad_product, gate, up,
                                             grad_gate, grad_up, stream);
}

}  // extern "C"
