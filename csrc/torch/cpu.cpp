// CPU kernels of the fusedmlp ops: tensors to pointers and strides, ATen's
// thread pool to the C kernels, which take every dtype here (bfloat16
// included) as it is stored. Stable ABI only (torch/csrc/stable and the C shim):
// the same binary serves every torch from TORCH_TARGET_VERSION on.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <array>

#include "fusedmlp/cpu.h"
#include "op_wrappers.h"
#include "weight_cache.h"

namespace fusedmlp {
namespace {

// ATen's pool through the stable ABI (torch_parallel_for): the pool torch itself
// runs on, with no OpenMP compiled into this module.
void aten_parallel_for(void * /*pool*/, int64_t n_tasks, void *context, fmlp_task_fn fn) {
  torch::stable::parallel_for(0, n_tasks, 1,
                              [&](int64_t begin, int64_t end) { fn(context, begin, end); });
}

fmlp_threading aten_threading() {
  return {aten_parallel_for, nullptr, static_cast<int>(torch::stable::get_num_threads())};
}

void check_status(fmlp_status status, const char *op) {
  FMLP_CHECK(status != FMLP_ERR_OUT_OF_MEMORY, op, ": out of memory");
  FMLP_CHECK(status == FMLP_OK, op, ": CPU kernel failed: ", fmlp_status_string(status));
}

// A profiler event (torch.profiler, record_function) named name() for this scope,
// through the C shim's RecordFunction, while torch's profiler records
// (profiler_records()); otherwise nothing, not even the name.
class ProfilerLabel {
 public:
  template <class Name>
  explicit ProfilerLabel(const Name &name) {
    if (!profiler_records()) return;
    TORCH_ERROR_CODE_CHECK(
        aoti_record_function_start(name().c_str(), nullptr, nullptr, 0, &guard_));
  }
  ~ProfilerLabel() {
    if (guard_ != nullptr) aoti_record_function_end(guard_);
  }
  ProfilerLabel(const ProfilerLabel &) = delete;
  ProfilerLabel &operator=(const ProfilerLabel &) = delete;

 private:
  AtenRecordFunctionHandle guard_ = nullptr;
};

}  // namespace

// Also fusedmlp._C.cpu_isa(dtype)'s (schemas.cpp).
fmlp_dtype kernel_dtype(ScalarType storage) {
  switch (storage) {
    case ScalarType::Double: return FMLP_F64;
    case ScalarType::BFloat16: return FMLP_BF16;
    default: return FMLP_F32;
  }
}

namespace {

fmlp_input input_of(const Tensor &t) { return {t.data_ptr(), t.stride(0), t.stride(1)}; }

const void *optional_data(const OptionalTensor &t) { return t.has_value() ? t->data_ptr() : nullptr; }

OptionalTensor contiguous_bias(const OptionalTensor &bias) {
  if (!bias.has_value()) return std::nullopt;
  return as_contiguous(*bias);
}

void *offset_data(const Tensor &buffer, int64_t offset) {
  return offset < 0 ? nullptr : static_cast<char *>(buffer.data_ptr()) + offset * buffer.element_size();
}

// An ATen out= op through the dispatcher, its arguments on the stack, `out` last.
// The call returns `out` as a new handle, ours to release: left on the stack, it
// would keep the output alive for good (the host-GEMM path once leaked every
// output and `saved` buffer it wrote so).
template <size_t N>
void call_out_op(const char *name, std::array<StableIValue, N> stack) {
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, "out", stack.data(), TORCH_ABI_VERSION));
  torch::stable::detail::to<Tensor>(stack[0]);
}

// The C shim's generated entries to ATen's CPU mm.out and addmm.out kernels,
// weak: a libtorch that no longer (or not yet) exports one still loads this
// module, and the host-GEMM path then calls the op through the dispatcher.
#pragma weak aoti_torch_cpu_mm_out
#pragma weak aoti_torch_cpu_addmm_out

// Whether the host-GEMM path calls ATen's CPU kernel through the shim entry
// (present in this libtorch), as eager's torch.mm and F.linear reach it, rather
// than by name through the dispatcher: that call's lookup and boxing cost 2-3 us
// more a GEMM, which left a 16 x 256 -> 256 ReLU FusedLinear 1.055x eager's
// Linear + ReLU (1.00x through the shim). Under a profiler the dispatcher makes
// the call, so that ATen's event shows inside our op.
bool through_shim(const void *entry) { return entry != nullptr && !profiler_records(); }

// The host-GEMM path (fmlp_cpu_gemm_in_use() == FMLP_GEMM_HOST, on CPUs where no
// kernel level was measured to beat eager): out = a @ b by ATen's GEMM
// (aten::mm.out), our passes around it.
void host_mm(const Tensor &out, const Tensor &a, const Tensor &b) {
  if (through_shim(reinterpret_cast<const void *>(&aoti_torch_cpu_mm_out))) {
    TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(out.get(), a.get(), b.get()));
    return;
  }
  using torch::stable::detail::from;
  call_out_op<3>("aten::mm", {from(a), from(b), from(out)});
}

// out = x @ w.T + b by ATen's GEMM, as F.linear computes it (addmm for 2-D x):
// our pass lays the bias over out's rows and ATen's GEMM adds the product into
// them (addmm with out as its own input, beta = 1), the same sums as
// addmm(b, ...) makes, without addmm's own copy of the bias (a broadcast view and
// an iterator copy each call). In one process, alternating, 2 threads, float32
// Linear + ReLU against addmm(b, ...): 2 x 8 -> 8 0.68x the time, 16 x 256 ->
// 256 0.88x, 128 x 256 -> 256 0.91x. The dispatcher's way is aten::linear.out:
// the stable ABI cannot box addmm's Scalar arguments, which the shim entry takes
// as doubles. out has contiguous rows (ours: the output, saved or scratch rows).
void host_addmm(const char *op, const Tensor &out, const Tensor &x, const Tensor &w,
                const Tensor &b, const fmlp_threading &threading) {
  if (through_shim(reinterpret_cast<const void *>(&aoti_torch_cpu_addmm_out))) {
    check_status(fmlp_cpu_copy_rows(kernel_dtype(out.scalar_type()), out.size(0), out.size(1),
                                    {b.data_ptr(), 0, 1}, out.data_ptr(), &threading),
                 op);
    TORCH_ERROR_CODE_CHECK(
        aoti_torch_cpu_addmm_out(out.get(), out.get(), x.get(), transposed(w).get(), 1.0, 1.0));
    return;
  }
  using torch::stable::detail::from;  // linear's bias is optional: boxed as one
  call_out_op<4>("aten::linear", {from(x), from(w), from(OptionalTensor(b)), from(out)});
}

// out = x @ w.T + b by ATen's GEMM, the GEMM eager's F.linear runs: the bias goes
// in with the product, not into our pass after it. In bfloat16 a bias added to
// the rounded product would lose the low bits of every sum near zero (ReLU's
// sign, the activations' slope); in float32 MKL's beta = 0 GEMM zeroes the
// product first (sgemm_mscale), a pass over it as long as addmm's copy of the
// bias, and our pass then read it back for the bias: in one process,
// alternating (Zen 3, 2 threads), 4096 x (64 -> 128 -> 64) ReLU 1.051x eager
// with the bias in our pass, 1.019x in addmm; 1024 x 768 -> 3072 GELU 1.044x,
// 1.010x; 16 x 256^4 ReLU 0.969x, 0.981x.
void host_gemm(const char *op, const Tensor &out, const Tensor &x, const Tensor &w,
               const OptionalTensor &b, const fmlp_threading &threading) {
  if (b.has_value()) {
    host_addmm(op, out, x, w, *b, threading);
  } else {
    host_mm(out, x, transposed(w));
  }
}

// One layer on the host-GEMM path: out = act(x @ w.T + b); the GEMM writes into
// pre (the saved pre-activation, bias included) when it is defined, else into
// out, and our pass activates from there into out.
void host_gemm_layer(const char *op, const Tensor &x, const Tensor &w,
                     const OptionalTensor &b, fmlp_activation activation, const OptionalTensor &pre,
                     const Tensor &out, const fmlp_threading &threading) {
  const Tensor &product = pre.has_value() ? *pre : out;
  host_gemm(op, product, x, w, b, threading);
  check_status(fmlp_cpu_activation_forward(kernel_dtype(out.scalar_type()), out.numel(),
                                           product.data_ptr(), activation, out.data_ptr(),
                                           &threading),
               op);
}

// The chain on the host-GEMM path: layer by layer through ATen's GEMM and our
// pass, row chunk by row chunk (fmlp_cpu_host_chunk_rows) where the weights are
// small, so that a chunk's activations stay in cache from one layer to the next.
// Hidden activations go into `saved` where its layout keeps them (training),
// else into two chunk-sized scratch buffers taken in turn.
void host_chain(const char *op, const Tensor &x_rows, TensorList weights,
                const std::vector<OptionalTensor> &b, const std::vector<int64_t> &widths,
                fmlp_activation hidden, fmlp_activation final_activation,
                const SavedChainLayout *layout, const Tensor &saved, const Tensor &y_rows,
                const fmlp_threading &threading) {
  const int64_t rows = x_rows.size(0), n_layers = static_cast<int64_t>(weights.size());
  const int64_t chunk = fmlp_cpu_host_chunk_rows(kernel_dtype(x_rows.scalar_type()), rows,
                                                 n_layers, widths.data(), threading.n_threads);
  // where layout keeps layer l's output and pre-activation in saved; -1: not kept
  const auto hidden_at = [&](int64_t l) { return layout ? layout->hidden_offset[l] : -1; };
  const auto pre_at = [&](int64_t l) { return layout ? layout->pre_offset[l] : -1; };
  int64_t scratch_width = 0;
  for (int64_t l = 0; l + 1 < n_layers; ++l) {
    if (hidden_at(l) < 0) scratch_width = std::max(scratch_width, widths[l + 1]);
  }
  // optional: a default torch::stable::Tensor allocates a handle, which a chain
  // without scratch (one layer, or every hidden activation saved) would only drop
  const std::array<OptionalTensor, 2> scratch =
      scratch_width > 0 ? std::array<OptionalTensor, 2>{empty({chunk * scratch_width}, x_rows),
                                                        empty({chunk * scratch_width}, x_rows)}
                        : std::array<OptionalTensor, 2>{};
  const bool whole = chunk == rows;
  for (int64_t first_row = 0; first_row < rows; first_row += chunk) {
    const int64_t count = std::min(chunk, rows - first_row);
    const auto rows_of = [&](const Tensor &t) { return whole ? t : row_range(t, first_row, count); };
    // rows of layer l's block at `offset` in saved, or of scratch when not saved (-1)
    const auto block_at = [&](int64_t offset, int64_t l) {
      const int64_t width = widths[l + 1];
      return offset >= 0 ? rows_at(saved, offset + first_row * width, count, width)
                         : rows_at(*scratch[l % 2], 0, count, width);
    };
    Tensor input = rows_of(x_rows);
    for (int64_t l = 0; l < n_layers; ++l) {
      const bool last = l + 1 == n_layers;
      const Tensor out = last ? rows_of(y_rows) : block_at(hidden_at(l), l);
      const int64_t pre_offset = pre_at(l);
      const OptionalTensor pre =
          pre_offset >= 0 ? OptionalTensor(block_at(pre_offset, l)) : std::nullopt;
      const ProfilerLabel label(
          [&] { return n_layers > 1 ? layer_label(op, l) : std::string(op); });
      host_gemm_layer(op, input, weights[l], b[l], last ? final_activation : hidden, pre, out,
                      threading);
      input = out;
    }
  }
}

// The gated block on the host-GEMM path: gate and up by ATen's GEMM (biases
// included) into block[0] and block[1], our pass forming block[2] =
// act(gate) * up (block[2] may be block[0]), then y = down(block[2]); under a
// profiler labelled in the two stages our kernels' path shows.
void host_gemm_gated(const char *op, const Tensor &x, const std::array<Tensor, 3> &w,
                     const std::array<OptionalTensor, 3> &b, fmlp_activation activation,
                     const std::array<Tensor, 3> &block, const Tensor &y,
                     const fmlp_threading &threading) {
  {
    const ProfilerLabel label([&] { return std::string(op) + ".gate_up"; });
    host_gemm(op, block[0], x, w[0], b[0], threading);
    host_gemm(op, block[1], x, w[1], b[1], threading);
    check_status(fmlp_cpu_gated_product(kernel_dtype(y.scalar_type()), block[2].numel(),
                                        block[0].data_ptr(), block[1].data_ptr(), activation,
                                        block[2].data_ptr(), &threading),
                 op);
  }
  const ProfilerLabel label([&] { return std::string(op) + ".down"; });
  host_gemm_layer(op, block[2], w[2], b[2], FMLP_ACT_NONE, std::nullopt, y, threading);
}

// Whether an op in `dtype` over `rows` rows of `weights` runs its products in ATen (the
// host-GEMM path): the dtype's path (fmlp_cpu_gemm_in_use), which a training call keeps
// so that its backward runs where its forward ran; an inference call's few rows may run
// our kernels on that path (fmlp_cpu_inference_gemm).
bool runs_host_gemm(fmlp_dtype dtype, int64_t rows, TensorList weights, bool save) {
  if (fmlp_cpu_gemm_in_use(dtype) != FMLP_GEMM_HOST) return false;
  if (save) return true;
  std::vector<fmlp_input> inputs;
  inputs.reserve(weights.size());
  for (const Tensor &w : weights) inputs.push_back(input_of(w));
  return fmlp_cpu_inference_gemm(dtype, rows, static_cast<int64_t>(inputs.size()),
                                 inputs.data()) == FMLP_GEMM_HOST;
}

// The weights of an inference call packed once, from the cache (weight_cache.h),
// each entry nullptr where the kernels pack it themselves; `data` empty for none.
// Training calls never take them: their weights change every step.
struct PackedWeights {
  std::vector<std::shared_ptr<const void>> holders;  // keep the copies alive for the call
  std::vector<const void *> data;
};

PackedWeights packed_weights(TensorList weights, fmlp_dtype dtype, fmlp_cpu_isa unit,
                             int64_t rows, const fmlp_threading &threading) {
  PackedWeights packed;
  packed.holders.reserve(weights.size());
  packed.data.reserve(weights.size());
  for (const Tensor &w : weights) {
    packed.holders.push_back(cached_packed_weight(w, dtype, unit, rows, threading));
    packed.data.push_back(packed.holders.back().get());
  }
  return packed;
}

struct CpuBackend {
  static const std::vector<ScalarType> &dtypes() { return cpu_dtypes(); }

  static TensorPair chain(const char *op, const Tensor &x_rows,
                          const std::vector<int64_t> &y_shape, TensorList weights,
                          TensorList biases, fmlp_activation hidden,
                          fmlp_activation final_activation, bool save) {
    const ScalarType storage = x_rows.scalar_type();
    const Tensor &options = x_rows;  // the dtype and device to allocate in
    const int64_t rows = x_rows.size(0), n_layers = static_cast<int64_t>(weights.size());
    std::vector<int64_t> widths = chain_widths(x_rows, weights);
    std::vector<OptionalTensor> b(weights.size());
    for (size_t l = 0; l < weights.size(); ++l) b[l] = contiguous_bias(bias_at(biases, l));
    const Tensor y = empty(y_shape, options), y_rows = rows_at(y, 0, rows, widths.back());
    const SavedChainLayout layout = saved_chain_layout(rows, widths, hidden, final_activation);
    // The inference ops return y alone: their `saved` is never allocated.
    const Tensor saved = save ? empty({layout.total}, options) : Tensor();
    const fmlp_threading threading = aten_threading();
    const bool host = runs_host_gemm(kernel_dtype(storage), rows, weights, save);
    const fmlp_cpu_isa unit = fmlp_cpu_unit_isa(kernel_dtype(storage));
    const PackedWeights packed = save || host ? PackedWeights{}
                                              : packed_weights(weights, kernel_dtype(storage),
                                                               unit, rows, threading);

    if (host) {
      host_chain(op, x_rows, weights, b, widths, hidden, final_activation,
                 save ? &layout : nullptr, saved, y_rows, threading);
      return {y, saved};
    }
    // Under a profiler, run layer by layer so each layer gets its own event;
    // otherwise one call runs row blocks through every layer.
    const bool per_layer = n_layers > 1 && profiler_records();
    Tensor input = x_rows;
    for (int64_t first = 0; first < n_layers; first += per_layer ? 1 : n_layers) {
      const int64_t count = per_layer ? 1 : n_layers;
      const bool ends_chain = first + count == n_layers;
      Tensor out = y_rows;
      if (!ends_chain) {  // a single hidden layer: into saved, or a scratch tensor
        const int64_t offset = save ? layout.hidden_offset[first] : -1;
        const int64_t width = widths[first + 1];
        out = offset >= 0 ? rows_at(saved, offset, rows, width) : empty({rows, width}, options);
      }
      // Sized up front: malloc/free is a quarter of a small op call's fixed cost, and growing
      // these one push at a time reallocated each of them up to log2(layers) times.
      std::vector<fmlp_input> w_inputs;
      std::vector<const void *> b_data;
      std::vector<void *> pre_data, hidden_data;
      w_inputs.reserve(count);
      b_data.reserve(count);
      pre_data.reserve(count);
      hidden_data.reserve(count);
      for (int64_t l = first; l < first + count; ++l) {
        w_inputs.push_back(input_of(weights[l]));
        b_data.push_back(optional_data(b[l]));
        pre_data.push_back(save ? offset_data(saved, layout.pre_offset[l]) : nullptr);
        hidden_data.push_back(save ? offset_data(saved, layout.hidden_offset[l]) : nullptr);
      }
      const fmlp_cpu_chain_args args = {
          .dtype = kernel_dtype(storage),
          .rows = rows,
          .n_layers = count,
          .widths = widths.data() + first,
          .x = input_of(input),
          .weights = w_inputs.data(),
          .biases = b_data.data(),
          .hidden_activation = hidden,
          .final_activation = first + count == n_layers ? final_activation : hidden,
          .y = out.data_ptr(),
          .y_row_stride = out.stride(0),
          .saved_pre = pre_data.data(),
          .saved_hidden = hidden_data.data(),
          .packed_weights = packed.data.empty() ? nullptr : packed.data.data() + first,
          .packed_unit = unit,
      };
      const ProfilerLabel label(
          [&] { return per_layer ? layer_label(op, first) : std::string(op); });
      check_status(fmlp_cpu_chain(&args, &threading), op);
      input = out;
    }
    return {y, saved};
  }

  static TensorPair gated(const char *op, const Tensor &x_rows,
                          const std::vector<int64_t> &y_shape, const Tensor &w_gate,
                          const Tensor &w_up, const Tensor &w_down,
                          const OptionalTensor &bias_gate, const OptionalTensor &bias_up,
                          const OptionalTensor &bias_down, fmlp_activation activation,
                          bool save) {
    const ScalarType storage = x_rows.scalar_type();
    const Tensor &options = x_rows;  // the dtype and device to allocate in
    const int64_t rows = x_rows.size(0), hidden = w_gate.size(0), out_dim = w_down.size(0);
    const OptionalTensor bg = contiguous_bias(bias_gate), bu = contiguous_bias(bias_up),
                         bd = contiguous_bias(bias_down);
    const Tensor y = empty(y_shape, options), y_rows = rows_at(y, 0, rows, out_dim);
    const Tensor saved = save ? empty({3, rows, hidden}, options) : Tensor();
    // gate, up and their product, rows x hidden each
    const auto saved_block = [&](int64_t i) {
      return rows_at(saved, i * rows * hidden, rows, hidden);
    };
    const fmlp_threading threading = aten_threading();
    const std::vector<Tensor> weights = {w_gate, w_up, w_down};
    if (runs_host_gemm(kernel_dtype(storage), rows, weights, save)) {
      // gate, up, product: saved, or scratch, the product then over the gate (inference
      // keeps two hidden matrices, not three: less than eager's act(gate), up, product)
      const auto block = [&](int64_t i) {
        return save ? saved_block(i) : empty({rows, hidden}, options);
      };
      const Tensor gate = block(0);
      host_gemm_gated(op, x_rows, {w_gate, w_up, w_down}, {bg, bu, bd}, activation,
                      {gate, block(1), save ? saved_block(2) : gate}, y_rows, threading);
      return {y, saved};
    }
    const fmlp_cpu_isa unit = fmlp_cpu_unit_isa(kernel_dtype(storage));
    PackedWeights packed = save ? PackedWeights{}
                                : packed_weights(weights, kernel_dtype(storage), unit, rows,
                                                 threading);
    if (!packed.data.empty() && (packed.data[0] == nullptr) != (packed.data[1] == nullptr)) {
      packed.data[0] = packed.data[1] = nullptr;  // the kernel reads gate and up alike
    }
    const auto packed_at = [&](size_t i) { return packed.data.empty() ? nullptr : packed.data[i]; };
    // Under a profiler the block runs in two labelled stages (gate and up with their
    // product, then down); otherwise row blocks run through all of it in one call.
    const bool staged = profiler_records();
    const OptionalTensor product =
        save ? OptionalTensor(saved_block(2))
             : (staged ? OptionalTensor(empty({rows, hidden}, options)) : std::nullopt);
    fmlp_cpu_gated_args args = {
        .dtype = kernel_dtype(storage),
        .rows = rows,
        .dim = x_rows.size(1),
        .hidden = hidden,
        .out_dim = out_dim,
        .x = input_of(x_rows),
        .w_gate = input_of(w_gate),
        .w_up = input_of(w_up),
        .w_down = input_of(w_down),
        .bias_gate = optional_data(bg),
        .bias_up = optional_data(bu),
        .bias_down = optional_data(bd),
        .activation = activation,
        .y = y_rows.data_ptr(),
        .y_row_stride = y_rows.stride(0),
        .saved_gate = save ? offset_data(saved, 0) : nullptr,
        .saved_up = save ? offset_data(saved, rows * hidden) : nullptr,
        .saved_product = product.has_value() ? product->data_ptr() : nullptr,
        .packed_gate = packed_at(0),
        .packed_up = packed_at(1),
        .packed_down = packed_at(2),
        .packed_unit = unit,
    };
    if (!staged) {
      check_status(fmlp_cpu_gated(&args, &threading), op);
      return {y, saved};
    }
    {
      const ProfilerLabel label([&] { return std::string(op) + ".gate_up"; });
      args.out_dim = 0;  // no down projection: stop at the product
      args.w_down = {nullptr, 0, 1};
      args.bias_down = nullptr;
      args.y = nullptr;
      args.packed_down = nullptr;
      check_status(fmlp_cpu_gated(&args, &threading), op);
    }
    {
      const ProfilerLabel label([&] { return std::string(op) + ".down"; });
      const int64_t widths[2] = {hidden, out_dim};
      const fmlp_input down = input_of(w_down);
      const void *down_bias = optional_data(bd);
      const fmlp_cpu_chain_args down_args = {
          .dtype = kernel_dtype(storage),
          .rows = rows,
          .n_layers = 1,
          .widths = widths,
          .x = input_of(*product),
          .weights = &down,
          .biases = &down_bias,
          .hidden_activation = FMLP_ACT_NONE,
          .final_activation = FMLP_ACT_NONE,
          .y = y_rows.data_ptr(),
          .y_row_stride = y_rows.stride(0),
          .saved_pre = nullptr,
          .saved_hidden = nullptr,
          .packed_weights = packed.data.empty() ? nullptr : &packed.data[2],
          .packed_unit = unit,
      };
      check_status(fmlp_cpu_chain(&down_args, &threading), op);
    }
    return {y, saved};
  }

  static Tensor activation_backward(const Tensor &grad, const Tensor &pre,
                                    fmlp_activation activation) {
    const Tensor grad_pre = empty(grad.sizes(), grad);
    const fmlp_threading threading = aten_threading();
    check_status(fmlp_cpu_activation_backward(kernel_dtype(grad.scalar_type()), grad.numel(),
                                              grad.data_ptr(), pre.data_ptr(), activation,
                                              grad_pre.data_ptr(), &threading),
                 "fusedmlp.activation_backward");
    return grad_pre;
  }

  static TensorPair gated_backward(const Tensor &grad_product, const Tensor &gate,
                                   const Tensor &up, fmlp_activation activation) {
    const Tensor &g = grad_product;
    const Tensor grad_gate = empty(g.sizes(), g), grad_up = empty(g.sizes(), g);
    const fmlp_threading threading = aten_threading();
    check_status(fmlp_cpu_gated_backward(kernel_dtype(g.scalar_type()), g.numel(), g.data_ptr(),
                                         gate.data_ptr(), up.data_ptr(), activation,
                                         grad_gate.data_ptr(), grad_up.data_ptr(), &threading),
                 "fusedmlp.gated_backward");
    return {grad_gate, grad_up};
  }
};

// What a backward computes from: x (the dtype and device to allocate in), x as
// rows, grad_y as rows in any layout (the kernels copy a strided one themselves, the
// host-GEMM path's ATen GEMMs take it as it is), the saved buffer contiguous.
struct BackwardInputs {
  Tensor options, x_rows, grad, saved;
};

BackwardInputs backward_inputs(const Tensor &x, const Tensor &grad_y, const Tensor &saved) {
  return {x, as_rows(x), as_rows(grad_y), as_contiguous(saved)};
}

// Whether ATen's GEMM reads a matrix as it is: one stride 1, the other at least
// as long as the rows (or columns) it steps over; otherwise it copies it first.
bool gemm_reads_as_is(const Tensor &m) {
  const int64_t row_stride = m.stride(0), col_stride = m.stride(1);
  return (col_stride == 1 && row_stride >= std::max<int64_t>(1, m.size(1))) ||
         (row_stride == 1 && col_stride >= std::max<int64_t>(1, m.size(0)));
}

// m (2-D, any strides) copied into new contiguous rows by our pass.
Tensor rows_copy(const Tensor &m, const fmlp_threading &threading) {
  const Tensor rows = empty(m.sizes(), m);
  check_status(fmlp_cpu_copy_rows(kernel_dtype(m.scalar_type()), m.size(0), m.size(1),
                                  input_of(m), rows.data_ptr(), &threading),
               "fusedmlp.chain_backward");
  return rows;
}

// A chain's backward on the host-GEMM path, as eager's runs it: from the last layer
// on, its activation's derivative by our pointwise pass, then dW = grad^T h and
// dX = grad W by ATen's GEMM, the bias gradient by our column sums. One op call,
// so a small training step does not pay Python for each of these calls.
void host_chain_backward(const Tensor &options, const Tensor &x_rows, TensorList weights,
                         const Tensor &saved, const OptionalTensor &y_rows,
                         const Tensor &grad_y_rows, fmlp_activation hidden,
                         fmlp_activation final_act, const std::vector<int64_t> &widths,
                         const SavedChainLayout &layout, const OptionalTensor &grad_x_rows,
                         const std::vector<Tensor> &grad_w, const std::vector<Tensor> &grad_b) {
  const int64_t rows = x_rows.size(0), n_layers = static_cast<int64_t>(weights.size());
  const auto saved_rows = [&](int64_t offset, int64_t width) {
    return rows_at(saved, offset, rows, width);
  };
  const fmlp_threading threading = aten_threading();
  // grad_y as it is where ATen's GEMMs and our derivative pass read it so, else
  // copied once into rows of ours: ATen copies an expanded gradient (a sum()'s,
  // strides 0) for each of the last layer's two GEMMs. A gradient of ours takes
  // each derivative in place rather than in a new buffer. Both: a 16 x 8^3 ReLU
  // training step (sum().backward()) 1.12-1.13x eager's time -> 1.04-1.06x.
  bool grad_is_ours = !gemm_reads_as_is(grad_y_rows) ||
                      (final_act != FMLP_ACT_NONE && !grad_y_rows.is_contiguous());
  Tensor grad = grad_is_ours ? rows_copy(grad_y_rows, threading) : grad_y_rows;
  for (int64_t l = n_layers - 1; l >= 0; --l) {
    const fmlp_activation act = l == n_layers - 1 ? final_act : hidden;
    if (act != FMLP_ACT_NONE) {
      // The derivative reads the pre-activation, or where none is saved (ReLU) the
      // layer's output: a hidden one from saved, the last one y.
      const int64_t offset =
          layout.pre_offset[l] >= 0 ? layout.pre_offset[l] : layout.hidden_offset[l];
      const Tensor pre = offset >= 0 ? saved_rows(offset, widths[l + 1]) : *y_rows;
      const Tensor grad_pre = grad_is_ours ? grad : empty(grad.sizes(), grad);
      check_status(fmlp_cpu_activation_backward(kernel_dtype(grad.scalar_type()), grad.numel(),
                                                grad.data_ptr(), pre.data_ptr(), act,
                                                grad_pre.data_ptr(), &threading),
                   "fusedmlp.chain_backward");
      grad = grad_pre;
      grad_is_ours = true;
    }
    const Tensor input = l == 0 ? x_rows : saved_rows(layout.hidden_offset[l - 1], widths[l]);
    host_mm(grad_w[l], transposed(grad), input);
    if (!grad_b.empty()) {
      check_status(fmlp_cpu_column_sums(kernel_dtype(grad.scalar_type()), rows, grad.size(1),
                                        input_of(grad), grad_b[l].data_ptr(), &threading),
                   "fusedmlp.chain_backward");
    }
    if (l == 0 && !grad_x_rows.has_value()) break;
    const Tensor below = l == 0 ? *grad_x_rows : empty({rows, widths[l]}, options);
    host_mm(below, grad, weights[l]);
    grad = below;
    grad_is_ours = true;
  }
}

// The whole backwards, CPU only: elsewhere they are ATen GEMMs around the pointwise
// ops (autograd.py).
std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>> chain_backward(
    const Tensor &grad_y, const Tensor &x, TensorList weights,
    const Tensor &saved, const OptionalTensor &y, bool bias, std::string_view hidden_activation,
    std::string_view final_activation, bool need_grad_x) {
  const char *op = "fusedmlp.chain_backward";
  const fmlp_activation hidden = parse_activation(hidden_activation),
                        final_act = parse_activation(final_activation);
  check_chain_backward(op, grad_y, x, weights, saved, y, hidden, final_act,
                       CpuBackend::dtypes());
  const auto [options, x_rows, grad, saved_rows] = backward_inputs(x, grad_y, saved);
  const OptionalTensor y_rows =
      y.has_value() ? OptionalTensor(as_contiguous(as_rows(*y))) : std::nullopt;
  const int64_t rows = x_rows.size(0), n_layers = static_cast<int64_t>(weights.size());
  const std::vector<int64_t> widths = chain_widths(x, weights);
  const SavedChainLayout layout = saved_chain_layout(rows, widths, hidden, final_act);
  // Each gradient is its own tensor, held by nothing else once returned: AccumulateGrad
  // steals it into .grad rather than copying it.
  std::vector<Tensor> grad_w(weights.size()), grad_b;
  grad_b.reserve(bias ? n_layers : 0);
  for (int64_t l = 0; l < n_layers; ++l) {
    grad_w[l] = empty({widths[l + 1], widths[l]}, options);
    if (bias) grad_b.push_back(empty({widths[l + 1]}, options));
  }
  const Tensor grad_x = need_grad_x ? empty(x.sizes(), options) : empty({0}, options);
  const fmlp_dtype dtype = kernel_dtype(x.scalar_type());
  if (fmlp_cpu_gemm_in_use(dtype) == FMLP_GEMM_HOST) {
    host_chain_backward(options, x_rows, weights, saved_rows, y_rows, grad, hidden, final_act,
                        widths, layout,
                        need_grad_x ? OptionalTensor(as_rows(grad_x)) : std::nullopt, grad_w,
                        grad_b);
    return {grad_x, grad_w, grad_b};
  }
  // Sized up front (see CpuBackend::chain).
  std::vector<fmlp_input> w_inputs;
  std::vector<const void *> pre_data, hidden_data;
  std::vector<void *> grad_w_data, grad_b_data;
  w_inputs.reserve(n_layers);
  pre_data.reserve(n_layers);
  hidden_data.reserve(n_layers);
  grad_w_data.reserve(n_layers);
  grad_b_data.reserve(grad_b.size());
  for (int64_t l = 0; l < n_layers; ++l) {
    w_inputs.push_back(input_of(weights[l]));
    pre_data.push_back(offset_data(saved_rows, layout.pre_offset[l]));
    hidden_data.push_back(offset_data(saved_rows, layout.hidden_offset[l]));
    grad_w_data.push_back(grad_w[l].data_ptr());
  }
  for (const Tensor &g : grad_b) grad_b_data.push_back(g.data_ptr());
  const fmlp_cpu_chain_backward_args args = {
      .dtype = dtype,
      .rows = rows,
      .n_layers = n_layers,
      .widths = widths.data(),
      .x = input_of(x_rows),
      .weights = w_inputs.data(),
      .hidden_activation = hidden,
      .final_activation = final_act,
      .saved_pre = pre_data.data(),
      .saved_hidden = hidden_data.data(),
      .y = optional_data(y_rows),
      .grad_y = input_of(grad),
      .grad_x = need_grad_x ? grad_x.data_ptr() : nullptr,
      .grad_weights = grad_w_data.data(),
      .grad_biases = bias ? grad_b_data.data() : nullptr,
  };
  const fmlp_threading threading = aten_threading();
  check_status(fmlp_cpu_chain_backward(&args, &threading), op);
  return {grad_x, grad_w, grad_b};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>>
gated_mlp_backward(const Tensor &grad_y, const Tensor &x, const Tensor &w_gate,
                   const Tensor &w_up, const Tensor &w_down, const Tensor &saved,
                   const std::vector<bool> &bias, std::string_view activation, bool need_grad_x) {
  const char *op = "fusedmlp.gated_mlp_backward";
  // bool[3] arrives as a list the stable ABI does not size-check: ATen's message.
  FMLP_CHECK(bias.size() == 3, "Tried to convert a List with ", bias.size(),
             " elements to a fixed-size array of size 3");
  const fmlp_activation act = parse_activation(activation);
  check_gated_backward(op, grad_y, x, w_gate, w_up, w_down, saved, CpuBackend::dtypes());
  const auto [options, x_rows, grad, s] = backward_inputs(x, grad_y, saved);
  const Tensor &wg = w_gate, &wu = w_up, &wd = w_down;
  const int64_t rows = x_rows.size(0);
  const Tensor grad_x = need_grad_x ? empty(x.sizes(), options) : empty({0}, options);
  std::array<Tensor, 3> grad_w = {empty(wg.sizes(), options), empty(wu.sizes(), options),
                                  empty(wd.sizes(), options)};
  std::array<Tensor, 3> grad_b;
  for (size_t p = 0; p < 3; ++p) {
    if (bias[p]) grad_b[p] = empty({grad_w[p].size(0)}, options);
  }
  const fmlp_cpu_gated_block_backward_args args = {
      .dtype = kernel_dtype(x.scalar_type()),
      .rows = rows,
      .dim = x_rows.size(1),
      .hidden = wg.size(0),
      .out_dim = wd.size(0),
      .x = input_of(x_rows),
      .w_gate = input_of(wg),
      .w_up = input_of(wu),
      .w_down = input_of(wd),
      .activation = act,
      .saved_gate = offset_data(s, 0),
      .saved_up = offset_data(s, rows * wg.size(0)),
      .saved_product = offset_data(s, 2 * rows * wg.size(0)),
      .grad_y = input_of(grad),
      .grad_x = need_grad_x ? grad_x.data_ptr() : nullptr,
      .grad_w_gate = grad_w[0].data_ptr(),
      .grad_w_up = grad_w[1].data_ptr(),
      .grad_w_down = grad_w[2].data_ptr(),
      .grad_bias_gate = bias[0] ? grad_b[0].data_ptr() : nullptr,
      .grad_bias_up = bias[1] ? grad_b[1].data_ptr() : nullptr,
      .grad_bias_down = bias[2] ? grad_b[2].data_ptr() : nullptr,
  };
  const fmlp_threading threading = aten_threading();
  check_status(fmlp_cpu_gated_block_backward(&args, &threading), op);
  std::vector<Tensor> present_b;
  for (size_t p = 0; p < 3; ++p) {
    if (bias[p]) present_b.push_back(grad_b[p]);
  }
  return {grad_x, grad_w[0], grad_w[1], grad_w[2], present_b};
}

}  // namespace
}  // namespace fusedmlp

STABLE_TORCH_LIBRARY_IMPL(fusedmlp, CPU, m) {
  fusedmlp::OpWrappers<fusedmlp::CpuBackend>::register_kernels(m);
  m.impl("chain_backward", TORCH_BOX(&fusedmlp::chain_backward));
  m.impl("gated_mlp_backward", TORCH_BOX(&fusedmlp::gated_mlp_backward));
}
