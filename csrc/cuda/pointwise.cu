// Our own pointwise kernels: the activations cuBLASLt cannot compute as PyTorch does
// (ReLU keeping NaN, erf GELU, SiLU), the gate product of the gated block, the backward
// passes, and the bias fill. Math is in float whatever the storage type. Every kernel
// moves 16 bytes per access (4 floats or 8 halves) when its pointers and row lengths
// allow, one element otherwise; the kernels are memory bound, so that is their speed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>

#include "internal.h"

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
    case FMLP_ACT_NONE: return z;
    case FMLP_ACT_RELU: return z < 0.f ? 0.f : z;  // keeps NaN, as torch.relu
    case FMLP_ACT_GELU: return 0.5f * z * (1.f + erff(z * kInvSqrt2));
    case FMLP_ACT_GELU_TANH:
      return 0.5f * z * (1.f + tanhf(kSqrt2OverPi * (z + kGeluTanhKappa * z * z * z)));
    case FMLP_ACT_SILU: return z / (1.f + expf(-z));
    case FMLP_ACT_COUNT: break;  // not an activation; refused before any launch
  }
  return z;
}

__device__ inline float activation_grad(float z, fmlp_activation activation) {
  switch (activation) {
    case FMLP_ACT_NONE: return 1.f;
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
    case FMLP_ACT_COUNT: break;  // not an activation; refused before any launch
  }
  return 1.f;
}

// grad * act'(z); for ReLU a select, as torch's threshold_backward: a NaN z passes
// the gradient and an infinite gradient where z <= 0 gives 0, not NaN.
__device__ inline float backward_of(float grad, float z, fmlp_activation activation) {
  if (activation == FMLP_ACT_RELU) return z <= 0.f ? 0.f : grad;
  return grad * activation_grad(z, activation);
}

// V elements of T in one aligned access (V * sizeof(T) is 16 bytes, or V is 1).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ inline Pack<T, V> load(const T *base, int64_t index) {
  return reinterpret_cast<const Pack<T, V> *>(base)[index];
}

template <typename T, int V>
__device__ inline void store(T *base, int64_t index, const Pack<T, V> &pack) {
  reinterpret_cast<Pack<T, V> *>(base)[index] = pack;
}

enum class Pointwise { kActivationBackward, kGateProduct, kGatedBackward };

// Operands by operation: kActivationBackward (grad a, pre b) -> out0; kGateProduct
// (gate a, up b) -> out0 (out0 may be a); kGatedBackward (grad a, gate b, up c) ->
// grad_gate out0, grad_up out1.
template <Pointwise op>
__device__ inline void apply(float a, float b, float c, fmlp_activation activation, float *out0,
                             float *out1) {
  if (op == Pointwise::kActivationBackward) {
    *out0 = backward_of(a, b, activation);
  } else if (op == Pointwise::kGateProduct) {
    *out0 = activate(a, activation) * b;
  } else {
    *out0 = backward_of(a * c, b, activation);
    *out1 = a * activate(b, activation);
  }
}

// n contiguous elements: the first n / V * V as V-element packs, the rest one by one.
template <typename T, Pointwise op, int V>
__global__ void pointwise_kernel(int64_t n, fmlp_activation activation, const T *a, const T *b,
                                 const T *c, T *out0, T *out1) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = n / V;
  for (int64_t p = first; p < packs; p += step) {
    const Pack<T, V> pa = load<T, V>(a, p), pb = load<T, V>(b, p);
    Pack<T, V> pc, r0, r1;
    if (op == Pointwise::kGatedBackward) pc = load<T, V>(c, p);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float o0 = 0.f, o1 = 0.f;
      apply<op>(to_float(pa.v[j]), to_float(pb.v[j]),
                op == Pointwise::kGatedBackward ? to_float(pc.v[j]) : 0.f, activation, &o0, &o1);
      r0.v[j] = from_float<T>(o0);
      r1.v[j] = from_float<T>(o1);
    }
    store<T, V>(out0, p, r0);
    if (op == Pointwise::kGatedBackward) store<T, V>(out1, p, r1);
  }
  for (int64_t i = packs * V + first; i < n; i += step) {
    float o0 = 0.f, o1 = 0.f;
    apply<op>(to_float(a[i]), to_float(b[i]),
              op == Pointwise::kGatedBackward ? to_float(c[i]) : 0.f, activation, &o0, &o1);
    out0[i] = from_float<T>(o0);
    if (op == Pointwise::kGatedBackward) out1[i] = from_float<T>(o1);
  }
}

// out = act(in) on m rows of n columns; V divides n and both row strides.
template <typename T, int V>
__global__ void activation_rows_kernel(int64_t m, int64_t n, const T *in, int64_t in_stride,
                                       fmlp_activation activation, T *out, int64_t out_stride) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_packs = n / V;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       p < m * row_packs; p += step) {
    const int64_t row = p / row_packs, pack = p % row_packs;
    const Pack<T, V> z = load<T, V>(in + row * in_stride, pack);
    Pack<T, V> y;
#pragma unroll
    for (int j = 0; j < V; ++j) y.v[j] = from_float<T>(activate(to_float(z.v[j]), activation));
    store<T, V>(out + row * out_stride, pack, y);
  }
}

// y[i, j] = act(bias[j]) (or act(0)); pre[i, j] = bias[j] when pre is not NULL.
template <typename T>
__global__ void fill_rows_kernel(int64_t m, int64_t n, const T *bias, fmlp_activation activation,
                                 T *y, int64_t y_stride, T *pre) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * n;
       i += step) {
    const int64_t row = i / n, col = i % n;
    const float z = bias != nullptr ? to_float(bias[col]) : 0.f;
    if (pre != nullptr) pre[i] = from_float<T>(z);
    y[row * y_stride + col] = from_float<T>(activate(z, activation));
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;

unsigned blocks_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Launches and reports this launch's error with the kernel's name and size. An error
// already pending before it (left by earlier asynchronous work, not by this call) is
// reported as such rather than blamed on this kernel.
template <typename Launch>
fmlp_status checked_launch(const char *kernel, fmlp_dtype dtype, int64_t elements,
                           Launch launch) {
  char call[160];
  snprintf(call, sizeof(call), "launch of %s on %lld %s elements", kernel,
           static_cast<long long>(elements), fmlp_cuda_dtype_name(dtype));
  char text[256];
  const cudaError_t earlier = cudaGetLastError();
  if (earlier != cudaSuccess) {
    snprintf(text, sizeof(text), "a CUDA error from earlier work was pending: %s (%s)",
             cudaGetErrorName(earlier), cudaGetErrorString(earlier));
    fmlp_cuda_record_failure(call, text, nullptr);
    return FMLP_ERR_BACKEND;
  }
  launch();
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return FMLP_OK;
  snprintf(text, sizeof(text), "%s (%s)", cudaGetErrorName(error), cudaGetErrorString(error));
  fmlp_cuda_record_failure(call, text, nullptr);
  return FMLP_ERR_BACKEND;
}

bool aligned16(const void *pointer) {
  return fmlp_cuda_alignment(reinterpret_cast<uintptr_t>(pointer), 0) >= 16;
}

template <typename T, Pointwise op>
fmlp_status launch(const char *kernel, fmlp_dtype dtype, int64_t n, fmlp_activation activation,
                   const void *a, const void *b, const void *c, void *out0, void *out1,
                   cudaStream_t stream) {
  if (n == 0) return FMLP_OK;
  constexpr int kVector = 16 / sizeof(T);
  const bool vector = aligned16(a) && aligned16(b) && aligned16(out0) &&
                      (op != Pointwise::kGatedBackward || (aligned16(c) && aligned16(out1)));
  const T *ta = static_cast<const T *>(a), *tb = static_cast<const T *>(b),
          *tc = static_cast<const T *>(c);
  T *to0 = static_cast<T *>(out0), *to1 = static_cast<T *>(out1);
  return checked_launch(kernel, dtype, n, [&] {
    if (vector) {
      pointwise_kernel<T, op, kVector><<<blocks_for(n / kVector + 1), kThreads, 0, stream>>>(
          n, activation, ta, tb, tc, to0, to1);
    } else {
      pointwise_kernel<T, op, 1><<<blocks_for(n), kThreads, 0, stream>>>(n, activation, ta, tb,
                                                                           tc, to0, to1);
    }
  });
}

bool valid_activation(fmlp_activation activation) {
  return activation >= FMLP_ACT_NONE && activation < FMLP_ACT_COUNT;
}

fmlp_status refuse(const char *kernel, const char *why) {
  fmlp_cuda_record_failure(kernel, why, nullptr);
  return FMLP_ERR_INVALID_ARGUMENT;
}

template <Pointwise op>
fmlp_status dispatch(const char *kernel, fmlp_dtype dtype, int64_t n, fmlp_activation activation,
                     const void *a, const void *b, const void *c, void *out0, void *out1,
                     cudaStream_t stream) {
  fmlp_cuda_clear_error();
  if (n < 0) return refuse(kernel, "negative element count");
  if (!valid_activation(activation)) return refuse(kernel, "unknown activation");
  switch (dtype) {
    case FMLP_F32:
      return launch<float, op>(kernel, dtype, n, activation, a, b, c, out0, out1, stream);
    case FMLP_BF16:
      return launch<__nv_bfloat16, op>(kernel, dtype, n, activation, a, b, c, out0, out1, stream);
    case FMLP_F16:
      return launch<__half, op>(kernel, dtype, n, activation, a, b, c, out0, out1, stream);
    case FMLP_F64: break;
  }
  fmlp_cuda_record_failure(kernel, "dtype has no CUDA kernel", nullptr);
  return FMLP_ERR_UNSUPPORTED;
}

template <typename T>
fmlp_status launch_activation_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *in,
                                   int64_t in_stride, fmlp_activation activation, void *out,
                                   int64_t out_stride, cudaStream_t stream) {
  constexpr int kVector = 16 / sizeof(T);
  const bool vector = aligned16(in) && aligned16(out) && n % kVector == 0 &&
                      in_stride % kVector == 0 && out_stride % kVector == 0;
  const T *tin = static_cast<const T *>(in);
  T *tout = static_cast<T *>(out);
  return checked_launch("the activation kernel", dtype, m * n, [&] {
    if (vector) {
      activation_rows_kernel<T, kVector><<<blocks_for(m * n / kVector), kThreads, 0, stream>>>(
          m, n, tin, in_stride, activation, tout, out_stride);
    } else {
      activation_rows_kernel<T, 1><<<blocks_for(m * n), kThreads, 0, stream>>>(
          m, n, tin, in_stride, activation, tout, out_stride);
    }
  });
}

template <typename T>
fmlp_status launch_fill_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *bias,
                             fmlp_activation activation, void *y, int64_t y_stride, void *pre,
                             cudaStream_t stream) {
  return checked_launch("the bias fill kernel", dtype, m * n, [&] {
    fill_rows_kernel<T><<<blocks_for(m * n), kThreads, 0, stream>>>(
        m, n, static_cast<const T *>(bias), activation, static_cast<T *>(y), y_stride,
        static_cast<T *>(pre));
  });
}

}  // namespace

fmlp_status fmlp_cuda_activation_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *in,
                                      int64_t in_stride, fmlp_activation activation, void *out,
                                      int64_t out_stride, cudaStream_t stream) {
  if (m == 0 || n == 0) return FMLP_OK;
  switch (dtype) {
    case FMLP_F32:
      return launch_activation_rows<float>(dtype, m, n, in, in_stride, activation, out,
                                           out_stride, stream);
    case FMLP_BF16:
      return launch_activation_rows<__nv_bfloat16>(dtype, m, n, in, in_stride, activation, out,
                                                   out_stride, stream);
    case FMLP_F16:
      return launch_activation_rows<__half>(dtype, m, n, in, in_stride, activation, out,
                                            out_stride, stream);
    case FMLP_F64: break;
  }
  fmlp_cuda_record_failure("the activation kernel", "dtype has no CUDA kernel", nullptr);
  return FMLP_ERR_UNSUPPORTED;
}

fmlp_status fmlp_cuda_fill_rows(fmlp_dtype dtype, int64_t m, int64_t n, const void *bias,
                                fmlp_activation activation, void *y, int64_t y_stride, void *pre,
                                cudaStream_t stream) {
  if (m == 0 || n == 0) return FMLP_OK;
  switch (dtype) {
    case FMLP_F32:
      return launch_fill_rows<float>(dtype, m, n, bias, activation, y, y_stride, pre, stream);
    case FMLP_BF16:
      return launch_fill_rows<__nv_bfloat16>(dtype, m, n, bias, activation, y, y_stride, pre,
                                             stream);
    case FMLP_F16:
      return launch_fill_rows<__half>(dtype, m, n, bias, activation, y, y_stride, pre, stream);
    case FMLP_F64: break;
  }
  fmlp_cuda_record_failure("the bias fill kernel", "dtype has no CUDA kernel", nullptr);
  return FMLP_ERR_UNSUPPORTED;
}

extern "C" {

fmlp_status fmlp_cuda_activation_backward(fmlp_dtype dtype, int64_t n, const void *grad_out,
                                          const void *pre, fmlp_activation activation,
                                          void *grad_pre, cudaStream_t stream) {
  return dispatch<Pointwise::kActivationBackward>("the activation backward kernel", dtype, n,
                                                  activation, grad_out, pre, nullptr, grad_pre,
                                                  nullptr, stream);
}

fmlp_status fmlp_cuda_gate_product(fmlp_dtype dtype, int64_t n, const void *gate, const void *up,
                                   fmlp_activation activation, void *product,
                                   cudaStream_t stream) {
  return dispatch<Pointwise::kGateProduct>("the gate product kernel", dtype, n, activation, gate,
                                           up, nullptr, product, nullptr, stream);
}

fmlp_status fmlp_cuda_gated_backward(fmlp_dtype dtype, int64_t n, const void *grad_product,
                                     const void *gate, const void *up,
                                     fmlp_activation activation, void *grad_gate, void *grad_up,
                                     cudaStream_t stream) {
  return dispatch<Pointwise::kGatedBackward>("the gated backward kernel", dtype, n, activation,
                                             grad_product, gate, up, grad_gate, grad_up, stream);
}

}  // extern "C"
