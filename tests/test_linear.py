"""fusedmlp.linear, the fusedmlp::linear op and FusedLinear against F.linear + activation."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ACTIVATIONS,
    DEVICE_DTYPES,
    DEVICES,
    assert_matches_reference,
    reference_linear,
    requires_cuda,
)
from torch import nn
from torch.library import opcheck


def sample_linear(device, dtype, shape, out_features, bias, generator):
    x = torch.randn(*shape, generator=generator).to(device, dtype)
    w = torch.randn(out_features, shape[-1], generator=generator) / max(shape[-1], 1) ** 0.5
    b = torch.randn(out_features, generator=generator) if bias else None
    return x, w.to(device, dtype), None if b is None else b.to(device, dtype)


def reference64(x, w, b, activation):
    return reference_linear(x.double(), w.double(), None if b is None else b.double(), activation)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 3, 4, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_match_pytorch(device, dtype, activation, shape, bias, generator):
    x, w, b = sample_linear(device, dtype, shape, 24, bias, generator)
    y = fusedmlp.linear(x, w, b, activation)
    assert y.shape == (*shape[:-1], 24) and y.dtype == dtype and y.device == x.device
    assert_matches_reference(y, reference64(x, w, b, activation))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_sizes_that_cross_every_block_boundary(device, activation, generator):
    # 1031 columns and 1000+ K cross the column-panel, K-block and row-block edges.
    x, w, b = sample_linear(device, torch.float32, (131, 1037), 1031, True, generator)
    assert_matches_reference(fusedmlp.linear(x, w, b, activation), reference64(x, w, b, activation))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_block_of_several_input_blocks(isa, dtype, restore_num_threads, generator):
    """Weights packed ahead (past 512 rows) and past the L2, one thread: a row block of up to
    480 rows that gemm.h's input blocks cut in several at K 4096 (a whole-K bfloat16 unit's
    block is the L2's worth, ~128 rows with 1 MiB), every instruction set, against float64."""
    torch.set_num_threads(1)
    x, w, b = sample_linear("cpu", dtype, (1100, 4096), 160, True, generator)
    assert_matches_reference(fusedmlp.linear(x, w, b, "gelu"), reference64(x, w, b, "gelu"))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device, generator):
    base = torch.randn(40, 33, generator=generator).to(device)
    w_base = torch.randn(33, 17, generator=generator).to(device)
    bias = torch.randn(17, generator=generator).to(device)
    inputs = {
        "transposed x": torch.randn(33, 40, generator=generator).to(device).t(),
        "sliced x": base[::3, :],
        "column-sliced x": torch.randn(9, 66, generator=generator).to(device)[:, ::2],
        "expanded x": base[:1].expand(6, 33),
        "4-d permuted x": torch.randn(3, 33, 2, 5, generator=generator)
        .to(device)
        .permute(0, 2, 3, 1),
    }
    for name, x in inputs.items():
        for weight in (w_base.t(), w_base.t().contiguous()):
            expected = reference64(x, weight, bias, "gelu")
            assert_matches_reference(fusedmlp.linear(x, weight, bias, "gelu"), expected), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_empty_shapes(device, activation, generator):
    w = torch.randn(24, 16, generator=generator).to(device)
    b = torch.randn(24, generator=generator).to(device)
    for shape in [(0, 16), (2, 0, 16)]:
        y = fusedmlp.linear(torch.randn(*shape, device=device), w, b, activation)
        assert y.shape == (*shape[:-1], 24)
    # K = 0: the product is empty and the output is act(bias) on every row
    x0, w0 = torch.randn(5, 0, device=device), torch.randn(24, 0, device=device)
    expected = reference_linear(x0.double(), w0.double(), b.double(), activation)
    assert_matches_reference(fusedmlp.linear(x0, w0, b, activation), expected)
    assert_matches_reference(fusedmlp.linear(x0, w0, None, activation), torch.zeros(5, 24).double())


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate(device):
    # cuBLASLt's ReLU epilogue maps NaN to 0 (a documented difference), so ReLU is CPU only.
    activations = ["none", "gelu", "gelu_tanh", "silu"] + (["relu"] if device == "cpu" else [])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]], device=device)
    nan_rows = torch.tensor([[float("nan"), 1.0], [1.0, 2.0]], device=device)
    # torch's vectorised exact GELU turns +inf into NaN (its scalar path gives inf, as we do),
    # so infinities are compared for the other activations only.
    inf_rows = torch.tensor([[float("inf"), 1.0], [-float("inf"), 2.0]], device=device)
    for activation in activations:
        for x in [nan_rows] + ([inf_rows] if activation != "gelu" else []):
            torch.testing.assert_close(
                fusedmlp.linear(x, w, None, activation),
                reference_linear(x, w, None, activation),
                equal_nan=True,
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_pytorch(dtype, activation, bias, generator):
    x, w, b = sample_linear("cpu", dtype, (3, 4, 19), 23, bias, generator)
    params = [t for t in (x, w, b) if t is not None]
    for t in params:
        t.requires_grad_(True)
    grad_out = torch.randn(3, 4, 23, generator=generator, dtype=dtype)
    fused = torch.autograd.grad(fusedmlp.linear(x, w, b, activation), params, grad_out)
    expected = torch.autograd.grad(reference_linear(x, w, b, activation), params, grad_out)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation, generator):
    x, w, b = sample_linear("cpu", torch.float64, (2, 3, 5), 4, True, generator)
    args = tuple(t.requires_grad_(True) for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda *a: fusedmlp.linear(*a, activation), args)
    # the plain op (not the training twin) recomputes what its backward needs
    assert torch.autograd.gradcheck(lambda *a: torch.ops.fusedmlp.linear(*a, activation), args)


def opcheck_samples(device):
    g = torch.Generator().manual_seed(7)
    for activation in ACTIVATIONS:
        for shape in [(3, 8), (2, 2, 8), (8,), (0, 8)]:
            for bias in (True, False):
                for requires_grad in (False, True):
                    x, w, b = sample_linear(device, torch.float32, shape, 5, bias, g)
                    for t in (x, w, b):
                        if t is not None:
                            t.requires_grad_(requires_grad)
                    yield (x, w, b, activation)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in opcheck_samples(device):
        opcheck(torch.ops.fusedmlp.linear.default, args)
        opcheck(torch.ops.fusedmlp.linear_train.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_activation_backward(device):
    for activation in ACTIVATIONS:
        grad, pre = torch.randn(4, 6, device=device), torch.randn(4, 6, device=device)
        opcheck(torch.ops.fusedmlp.activation_backward.default, (grad, pre, activation))


@pytest.mark.parametrize("activation", ["gelu", "relu"])  # relu: the backward reads y
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic, activation, generator):
    torch._dynamo.reset()
    layer = fusedmlp.FusedLinear(16, 12, activation=activation)
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    for rows in (5, 9):
        x = torch.randn(rows, 16, generator=generator, requires_grad=True)
        expected = layer(x)
        actual = compiled(x)
        torch.testing.assert_close(actual, expected)
        (grad_expected,) = torch.autograd.grad(expected.sum(), x)
        (grad_actual,) = torch.autograd.grad(actual.sum(), x)
        torch.testing.assert_close(grad_actual, grad_expected)


def test_profiler_shows_the_op(generator):
    x, w, b = sample_linear("cpu", torch.float32, (4, 8), 8, True, generator)
    with torch.profiler.profile() as prof:
        fusedmlp.linear(x, w, b, "relu")
    names = {event.name for event in prof.events()}
    assert "fusedmlp::linear" in names


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    x, w, b = (
        torch.randn(3, 8, device=device),
        torch.randn(5, 8, device=device),
        torch.randn(5, device=device),
    )
    cases = [
        (
            lambda: fusedmlp.linear(x, torch.randn(5, 7, device=device)),
            RuntimeError,
            "input features",
        ),
        (
            lambda: fusedmlp.linear(x, torch.randn(5, 8, 1, device=device)),
            RuntimeError,
            "weight must be 2-D",
        ),
        (
            lambda: fusedmlp.linear(x, w, torch.randn(4, device=device)),
            RuntimeError,
            "bias must have shape",
        ),
        (lambda: fusedmlp.linear(x.double(), w), RuntimeError, "dtype"),
        (lambda: fusedmlp.linear(x, w, b, "tanh"), ValueError, "valid names are none, relu"),
        (  # through the stable ABI an op raises RuntimeError only (docs/limits.md)
            lambda: torch.ops.fusedmlp.linear(x, w, b, "tanh"),
            RuntimeError,
            "valid names are none, relu",
        ),
        (lambda: fusedmlp.linear(torch.tensor(1.0, device=device), w), RuntimeError, "0-d"),
        (lambda: fusedmlp.linear(x.int(), w.int()), TypeError, "dtype"),
        (lambda: fusedmlp.linear(x, w.to("meta")), RuntimeError, "device"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@requires_cuda
def test_device_mismatch_cuda():
    with pytest.raises(RuntimeError, match="device"):
        fusedmlp.linear(torch.randn(3, 8, device="cuda"), torch.randn(5, 8))


# ---- FusedLinear ----


def test_module_matches_nn_linear_init_and_state_dict():
    torch.manual_seed(3)
    reference = nn.Linear(12, 7)
    torch.manual_seed(3)
    fused = fusedmlp.FusedLinear(12, 7, activation="silu")
    assert dict(fused.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    torch.testing.assert_close(fused.weight, reference.weight)
    torch.testing.assert_close(fused.bias, reference.bias)
    reloaded = nn.Linear(12, 7)
    reloaded.load_state_dict(fused.state_dict())
    fused2 = fusedmlp.FusedLinear(12, 7, activation="silu")
    fused2.load_state_dict(reference.state_dict())
    x = torch.randn(4, 12)
    torch.testing.assert_close(fused2(x), F.silu(reference(x)))
    torch.testing.assert_close(fused(x), F.silu(reloaded(x)))
    assert repr(fused) == "FusedLinear(in_features=12, out_features=7, bias=True, activation=silu)"


def test_module_options():
    fused = fusedmlp.FusedLinear(4, 3, bias=False, dtype=torch.float64)
    assert fused.bias is None and fused.weight.dtype == torch.float64
    assert fusedmlp.FusedLinear(4, 3, device="meta").weight.device.type == "meta"
    with pytest.raises(ValueError, match="valid names"):
        fusedmlp.FusedLinear(4, 3, activation="swish")


def test_from_linear_shares_parameters():
    linear = nn.Linear(6, 5)
    fused = fusedmlp.FusedLinear.from_linear(linear, activation="relu")
    assert fused.weight is linear.weight and fused.bias is linear.bias
    x = torch.randn(2, 6)
    torch.testing.assert_close(fused(x), F.relu(linear(x)))
    with pytest.raises(TypeError):
        fusedmlp.FusedLinear.from_linear(nn.ReLU())


def test_module_trains_like_nn_linear(generator):
    torch.manual_seed(5)
    reference = nn.Sequential(nn.Linear(8, 6), nn.GELU())
    fused = fusedmlp.FusedLinear(8, 6, activation="gelu")
    fused.load_state_dict(reference[0].state_dict())
    x = torch.randn(10, 8, generator=generator)
    for model in (reference, fused):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    torch.testing.assert_close(fused.weight, reference[0].weight)
    torch.testing.assert_close(fused.bias, reference[0].bias)


def test_autocast_cpu_like_nn_linear(generator):
    fused = fusedmlp.FusedLinear(8, 4, activation="relu")
    x = torch.randn(3, 8, generator=generator, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused(x)
        expected = F.relu(F.linear(x, fused.weight, fused.bias))
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert x.grad is not None and fused.weight.grad.dtype == torch.float32


def test_autocast_casts_op_inputs_to_the_autocast_dtype(generator):
    """The ops themselves (lists of tensors included) take the dtype of the enclosing
    autocast, whichever it is; float64 inputs are left alone, as ATen's autocast does."""
    x = torch.randn(3, 8, generator=generator)
    weights = [torch.randn(6, 8, generator=generator), torch.randn(4, 6, generator=generator)]
    biases = [torch.randn(6, generator=generator), torch.randn(4, generator=generator)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.fusedmlp.mlp(x, weights, biases, "relu")
        double = torch.ops.fusedmlp.linear(x.double(), weights[0].double(), None, "none")
    assert y.dtype == torch.bfloat16 and double.dtype == torch.float64
    expected = F.linear(F.relu(F.linear(x, weights[0], biases[0])), weights[1], biases[1])
    torch.testing.assert_close(y.float(), expected, rtol=5e-2, atol=5e-2)
    # A direct op call: through the stable ABI, RuntimeError (docs/limits.md).
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="Half"):
        torch.ops.fusedmlp.linear(x, weights[0], None, "none")


@requires_cuda
def test_autocast_cuda_and_cuda_graphs(generator):
    fused = fusedmlp.FusedLinear(64, 32, activation="gelu").cuda()
    x = torch.randn(16, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert fused(x).dtype == torch.float16
    compiled = torch.compile(fused, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), fused(x))


@requires_cuda
def test_cuda_float32_after_mixed_precision_settings(generator):
    """TF32 on through the new fp32_precision API while the legacy matmul precision says
    "highest": torch's allowTF32CuBLAS() raises in that mixed state; fusedmlp reads torch's
    own decision and runs like F.linear (TF32, so a TF32 tolerance)."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    weight = torch.randn(32, 64, generator=generator).cuda() / 8
    x = torch.randn(16, 64, generator=generator).cuda()
    before = torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        got = fusedmlp.linear(x, weight, None, "relu")
        torch.testing.assert_close(got, F.relu(F.linear(x, weight)), rtol=5e-3, atol=5e-3)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before[0]
        torch.set_float32_matmul_precision(before[1])


def assert_close_to_float64(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(
        actual.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}"
    )


def test_few_rows_every_row_count_and_column_span(isa, generator):
    """One to five rows read the weight in place (dot products specialised on the row count,
    the epilogue per 64-column span): every row count, column counts on both sides of a span,
    short and long K, saved pre-activation (grad enabled) or not, against float64."""
    for rows in range(1, 6):
        for n in (1, 63, 64, 65, 130):
            for k in (17, 768):
                for activation in ("relu", "gelu_tanh"):
                    x, w, b = sample_linear(
                        "cpu", torch.float32, (rows, k), n, n % 2 == 1, generator
                    )
                    x.requires_grad_()
                    y = fusedmlp.linear(x, w, b, activation)
                    expected = reference64(x.detach(), w, b, activation)
                    where = f"{isa}: {rows} x {k} -> {n}, {activation}"
                    assert_close_to_float64(y, expected, where)
                    (grad,) = torch.autograd.grad(y.sum(), x)
                    x64 = x.detach().double().requires_grad_()
                    (grad64,) = torch.autograd.grad(reference64(x64, w, b, activation).sum(), x64)
                    assert_close_to_float64(grad, grad64, f"{where}, grad")
