"""fusedmlp.gated_mlp, the fusedmlp::gated_mlp op and FusedGatedMLP against a plain
GeGLU / SwiGLU module written with nn.Linear and F.gelu / F.silu."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ACTIVATIONS,
    DEVICE_DTYPES,
    DEVICES,
    FUNCTIONAL,
    GatedBlock,
    assert_compiled_matches,
    assert_matches_reference,
)
from torch.library import opcheck


def random_params(dim, hidden, dtype, device, bias, generator):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    weights = [
        rand(hidden, dim, scale=dim**-0.5),
        rand(hidden, dim, scale=dim**-0.5),
        rand(dim, hidden, scale=hidden**-0.5),
    ]
    biases = [rand(hidden), rand(hidden), rand(dim)] if bias else [None, None, None]
    return weights, biases


def reference_gated(x, weights, biases, activation):
    x, (wg, wu, wd) = x.double(), [w.double() for w in weights]
    bg, bu, bd = [None if b is None else b.double() for b in biases]
    act = FUNCTIONAL[activation]
    return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def call_fused(x, weights, biases, activation):
    return fusedmlp.gated_mlp(x, *weights, activation, *biases)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dim,hidden", [(1, 3), (17, 40), (33, 1000)])
def test_values_match_pytorch(device, dtype, activation, bias, dim, hidden, generator):
    weights, biases = random_params(dim, hidden, dtype, device, bias, generator)
    x = torch.randn(3, 5, dim, generator=generator).to(device, dtype)
    y = call_fused(x, weights, biases, activation)
    assert y.shape == x.shape and y.dtype == dtype
    assert_matches_reference(y, reference_gated(x, weights, biases, activation))


@pytest.mark.parametrize("device", DEVICES)
def test_many_rows_and_empty_batch(device, generator):
    weights, biases = random_params(24, 72, torch.float32, device, True, generator)
    for rows in (0, 1, 1500):
        x = torch.randn(rows, 24, generator=generator).to(device)
        y = call_fused(x, weights, biases, "silu")
        assert_matches_reference(y, reference_gated(x, weights, biases, "silu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_past_the_l2_on_one_thread(isa, dtype, restore_num_threads, generator):
    """Weights past the L2 (3 MiB), rows past those packed just in time, one thread: row
    blocks of at most drivers.h's HIDDEN_MOST_BLOCK_ROWS (900 rows: 2, not 1) that reuse
    the thread's gate, up and product scratch; every instruction set."""
    torch.set_num_threads(1)
    weights, biases = random_params(256, 1024, dtype, "cpu", True, generator)
    x = torch.randn(900, 256, generator=generator).to(dtype)
    y = call_fused(x, weights, biases, "gelu_tanh")
    assert_matches_reference(y, reference_gated(x, weights, biases, "gelu_tanh"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_past_one_k_block(isa, dtype, generator):
    """Inference with dim past the gated micro-kernel's one K block (2048 at most, AVX2's
    6-row panel in a 48 KiB L1; the float units then keep gate's and up's partial sums in
    the block's scratch, the bfloat16 ones run K whole and their scratch is the product
    alone): one row block split by columns (150 rows) and row blocks (2000), every
    instruction set."""
    weights, biases = random_params(2100, 96, dtype, "cpu", True, generator)
    for rows in (150, 2000):
        x = torch.randn(rows, 2100, generator=generator).to(dtype)
        y = call_fused(x, weights, biases, "silu")
        assert_matches_reference(y, reference_gated(x, weights, biases, "silu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", "gelu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gradients_match_pytorch(dtype, activation, bias, generator):
    weights, biases = random_params(9, 14, dtype, "cpu", bias, generator)
    x = torch.randn(2, 3, 9, generator=generator, dtype=dtype)
    params = [x, *weights, *[b for b in biases if b is not None]]
    for p in params:
        p.requires_grad_(True)
    grad_out = torch.randn(2, 3, 9, generator=generator, dtype=dtype)
    fused = torch.autograd.grad(call_fused(x, weights, biases, activation), params, grad_out)
    expected_out = reference_gated(x, weights, biases, activation).to(dtype)
    expected = torch.autograd.grad(expected_out, params, grad_out)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gradients_past_tiles_and_cache_blocks(dtype, generator):
    """The CPU backward (fusedmlp::gated_mlp_backward) on rows and sizes past the kernels'
    tiles and K blocks (1024), with one bias missing, with and without grad for x."""
    weights, biases = random_params(70, 1030, dtype, "cpu", True, generator)
    biases[1] = None
    x = torch.randn(1100, 70, generator=generator).to(dtype)
    grad_out = torch.randn(1100, 70, generator=generator).to(dtype)
    for x_needs_grad in (True, False):
        params = [x, *weights, biases[0], biases[2]]
        for p in params:
            p.requires_grad_(p is not x or x_needs_grad)
        wanted = params if x_needs_grad else params[1:]
        fused = torch.autograd.grad(call_fused(x, weights, biases, "silu"), wanted, grad_out)
        reference = reference_gated(x, weights, biases, "silu")
        expected = torch.autograd.grad(reference, wanted, grad_out.double())
        for got, want in zip(fused, expected, strict=True):
            assert got.dtype == dtype
            error = (got.double() - want).norm() / want.norm()
            assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error


def test_gradcheck_float64(generator):
    weights, biases = random_params(4, 6, torch.float64, "cpu", True, generator)
    x = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    args = tuple(t.requires_grad_(True) for t in (x, *weights, *biases))
    for activation in ["gelu_tanh", "silu"]:
        assert torch.autograd.gradcheck(
            lambda *a, act=activation: fusedmlp.gated_mlp(*a[:4], act, *a[4:]), args
        )
        assert torch.autograd.gradcheck(
            lambda *a, act=activation: torch.ops.fusedmlp.gated_mlp(*a, act), args
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, generator):
    for activation in ACTIVATIONS:
        for bias in (False, True):
            for requires_grad in (False, True):
                weights, biases = random_params(5, 7, torch.float32, device, bias, generator)
                x = torch.randn(2, 3, 5, generator=generator).to(device)
                for t in (x, *weights, *[b for b in biases if b is not None]):
                    t.requires_grad_(requires_grad)
                args = (x, *weights, *biases, activation)
                opcheck(torch.ops.fusedmlp.gated_mlp.default, args)
                opcheck(torch.ops.fusedmlp.gated_mlp_train.default, args)
    grad, gate, up = (torch.randn(3, 4, device=device) for _ in range(3))
    opcheck(torch.ops.fusedmlp.gated_backward.default, (grad, gate, up, "silu"))


@pytest.mark.parametrize("need_grad_x", [True, False])
def test_opcheck_gated_mlp_backward(need_grad_x, generator):
    weights, biases = random_params(5, 7, torch.float32, "cpu", True, generator)
    x = torch.randn(2, 3, 5, generator=generator)
    for activation in ACTIVATIONS:
        y, saved = torch.ops.fusedmlp.gated_mlp_train(x, *weights, *biases, activation)
        for bias in ([True, False, True], [False] * 3):
            args = (torch.randn_like(y), x, *weights, saved, bias, activation, need_grad_x)
            opcheck(torch.ops.fusedmlp.gated_mlp_backward.default, args)


def test_bad_inputs():
    x = torch.randn(3, 8)
    wg, wu, wd = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="w_up has shape"):
        fusedmlp.gated_mlp(x, wg, torch.randn(12, 8), wd)
    with pytest.raises(RuntimeError, match="w_down has shape"):
        fusedmlp.gated_mlp(x, wg, wu, torch.randn(8, 12))
    with pytest.raises(RuntimeError, match=r"bias_up must have shape \(16\)"):
        fusedmlp.gated_mlp(x, wg, wu, wd, bias_up=torch.randn(8))
    with pytest.raises(ValueError, match="valid names"):
        fusedmlp.gated_mlp(x, wg, wu, wd, activation="swiglu")
    with pytest.raises(TypeError, match="w_up must be a Tensor"):
        fusedmlp.gated_mlp(x, wg, None, wd)


# ---- FusedGatedMLP ----


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [False, True])
def test_module_loads_reference_checkpoints_both_ways(activation, bias, generator):
    reference = GatedBlock(16, 48, activation, bias)
    fused = fusedmlp.FusedGatedMLP(16, 48, activation=activation, bias=bias)
    assert fused.state_dict().keys() == reference.state_dict().keys()
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 16, generator=generator, requires_grad=True)
    torch.testing.assert_close(fused(x), reference(x))
    (grad_fused,) = torch.autograd.grad(fused(x).sum(), x)
    (grad_reference,) = torch.autograd.grad(reference(x).sum(), x)
    torch.testing.assert_close(grad_fused, grad_reference)
    back = GatedBlock(16, 48, activation, bias)
    back.load_state_dict(fused.state_dict())
    torch.testing.assert_close(back(x), reference(x))


def test_module_defaults():
    block = fusedmlp.FusedGatedMLP(8, 32)
    assert block.activation == "gelu_tanh" and block.gate_proj.bias is None
    assert block.gate_proj.weight.shape == (32, 8) and block.down_proj.weight.shape == (8, 32)
    assert "activation=gelu_tanh" in repr(block)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic, generator):
    block = fusedmlp.FusedGatedMLP(8, 24, activation="silu")
    assert_compiled_matches(block, 8, (3, 7), dynamic, generator)


@pytest.mark.parametrize("gemm", ["default", "aten"])
@pytest.mark.parametrize("train", [False, True])
def test_profiler_shows_the_op_and_its_stages(train, gemm, generator, monkeypatch):
    """The stages are labelled on either CPU path: our kernels, or ATen's GEMMs with our
    product pass (FUSEDMLP_CPU_GEMM=aten, the path of CPUs without AVX2)."""
    if gemm == "aten":
        monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    block = fusedmlp.FusedGatedMLP(8, 24, bias=True)
    x = torch.randn(5, 8, generator=generator)
    expected = block(x)  # unprofiled: one call through the whole block
    with torch.profiler.profile() as prof, torch.set_grad_enabled(train):
        y = block(x)
    names = {event.name for event in prof.events()}
    op = "fusedmlp::gated_mlp_train" if train else "fusedmlp::gated_mlp"
    assert op in names
    assert {"fusedmlp.gated_mlp.gate_up", "fusedmlp.gated_mlp.down"} <= names
    torch.testing.assert_close(y, expected)
