"""Outputs own their storage: every forward and training path returns a tensor that is not a
view. FSDP2 hooks module outputs and warns on views (an in-place op on one would skip its
pre-backward hook)."""

from __future__ import annotations

from collections.abc import Callable

import fusedmlp
import pytest
import torch
from torch import nn

DIM, HIDDEN, OUT = 8, 16, 4


def modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "linear": fusedmlp.FusedLinear(DIM, OUT, activation="relu"),
        "mlp": fusedmlp.FusedMLP([DIM, HIDDEN, HIDDEN, OUT], activation="gelu"),
        "gated_mlp": fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="silu", bias=True),
    }


@pytest.mark.parametrize("kind", ["linear", "mlp", "gated_mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, DIM), (2, 3, DIM), (DIM,)])
@pytest.mark.parametrize("grad", [True, False])
def test_outputs_are_not_views(kind: str, dtype: torch.dtype, shape: tuple, grad: bool) -> None:
    module = modules()[kind].to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.set_grad_enabled(grad):
        y = module(x)
    assert y.grad_fn is not None if grad else y.grad_fn is None
    assert y._base is None
    assert y.shape[:-1] == shape[:-1]


def _op_calls(name: str) -> tuple[tuple, list[torch.Tensor], Callable[[], torch.Tensor]]:
    """An op's arguments, the weights among them (which require grad) and the same call
    through the functional API. Called directly, the ops take their registered autograd
    rather than the functional calls' autograd.Function."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, DIM)
    w, w_gate, w_up = (torch.randn(n, DIM, requires_grad=True) for n in (OUT, HIDDEN, HIDDEN))
    w_down = torch.randn(DIM, HIDDEN, requires_grad=True)
    if name == "linear":
        return (x, w, None, "gelu"), [w], lambda: fusedmlp.linear(x, w, None, "gelu")
    if name == "mlp":
        weights = [w_gate, w_down]
        return (x, weights, [], "gelu"), weights, lambda: fusedmlp.mlp(x, weights, None, "gelu")
    weights = [w_gate, w_up, w_down]
    args = (x, *weights, None, None, None, "silu")
    return args, weights, lambda: fusedmlp.gated_mlp(x, *weights, "silu")


@pytest.mark.parametrize("name", ["linear", "mlp", "gated_mlp"])
@pytest.mark.parametrize("training", [True, False])
def test_op_outputs_are_not_views(name: str, training: bool) -> None:
    args, weights, functional = _op_calls(name)
    outputs = getattr(torch.ops.fusedmlp, f"{name}_train" if training else name)(*args)
    for output in outputs if training else (outputs,):
        assert output._base is None
    y = outputs[0] if training else outputs
    # An in-place op on the output is an ordinary in-place op: gradients still match.
    y.mul_(2).sum().backward()
    got = [w.grad for w in weights]
    for w in weights:
        w.grad = None
    functional().mul(2).sum().backward()
    for grad, w in zip(got, weights, strict=True):
        torch.testing.assert_close(grad, w.grad)


def storage_holders(t: torch.Tensor) -> int:
    """How many references t's storage has (its tensors' and the Python storage object's)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def in_dtype(arg, dtype: torch.dtype):
    """An op argument in dtype: a tensor, each tensor of a list; anything else as it is."""
    if isinstance(arg, list):
        return [in_dtype(a, dtype) for a in arg]
    return arg.to(dtype) if isinstance(arg, torch.Tensor) else arg


@pytest.mark.parametrize("gemm", ["ours", "aten"])
@pytest.mark.parametrize("name", ["linear", "mlp", "gated_mlp"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_op_outputs_are_held_by_the_caller_alone(
    monkeypatch, gemm: str, name: str, training: bool, dtype: str
) -> None:
    """Nothing else keeps an output's storage: dropped, it is freed. The host-GEMM path (ATen's
    GEMM, then our epilogue: the default for float64 and on CPUs without AVX2) once kept a
    reference to every output and `saved` it wrote, leaking them all, call after call."""
    if gemm == "aten":
        monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    else:
        monkeypatch.setenv("FUSEDMLP_ISA", "portable")  # our kernels, float64's included
    args = [in_dtype(arg, getattr(torch, dtype)) for arg in _op_calls(name)[0]]
    with torch.no_grad():
        outputs = getattr(torch.ops.fusedmlp, f"{name}_train" if training else name)(*args)
    alone = storage_holders(torch.empty(1))
    for output in outputs if training else (outputs,):
        assert storage_holders(output) == alone


@pytest.mark.parametrize("call", ["eager", "op", "functional"])
def test_an_in_place_op_on_a_relu_output_is_refused_as_eager_refuses_it(call: str) -> None:
    """ReLU's backward reads its output (eager's and ours alike, which is why neither saves
    the pre-activation): modified in place, it can no longer serve, and backward says so."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, DIM)
    w = torch.randn(OUT, DIM, requires_grad=True)
    y = {
        "eager": lambda: torch.relu(torch.nn.functional.linear(x, w)),
        "op": lambda: torch.ops.fusedmlp.linear_train(x, w, None, "relu")[0],
        "functional": lambda: fusedmlp.linear(x, w, None, "relu"),
    }[call]()
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
