"""The functional API: fused Linear, MLP and gated MLP over inputs of shape (*, in_features)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import autocast, autograd, fake_kernels  # noqa: F401  (register the ops' Python parts)
from .activations import check_activation
from .profiling import labelled_layers
from .registry import DEVICE_DTYPES

_ops = torch.ops.fusedmlp


def _needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will differentiate through an op taking these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _without_autograd(op: torch._ops.OpOverload, *args: object) -> Tensor:
    """`op(*args)` below the autograd dispatch key, for calls nothing will differentiate.

    The registered Python autograd kernel does exactly this when no input needs a gradient,
    but entering it costs ~4 us a call, a fifth of a small MLP's fixed cost. Under Dynamo
    the op is traced as it is, since the guard object is not traceable.
    """
    if torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd(), labelled_layers():
        return op(*args)


def check_tensor(name: str, value: object, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, Tensor):
        expected = "a Tensor or None" if optional else "a Tensor"
        raise TypeError(f"fusedmlp: {name} must be {expected}, got {type(value).__name__}")


def aten_dtype_name(dtype: torch.dtype) -> str:
    """ATen's name of a dtype, as the kernels' messages spell it: torch.int32 -> "Int"."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


# The dtypes every device's kernels take: x in one of them needs no look at its device
# (x.device builds a torch.device, half a microsecond of a small call).
_DTYPES_EVERYWHERE = frozenset.intersection(*map(frozenset, DEVICE_DTYPES.values()))


def check_dtype(op: str, x: Tensor) -> None:
    """The kernels' check of x's dtype, with their message, raised here as a TypeError: the
    ops are registered through LibTorch's stable ABI, whose kernels can raise RuntimeError
    only (docs/limits.md)."""
    if x.dtype in _DTYPES_EVERYWHERE:
        return
    dtypes = DEVICE_DTYPES.get(x.device.type)
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(
            f"{op}: x has dtype {aten_dtype_name(x.dtype)}, but on {x.device.type} only "
            f"{', '.join(aten_dtype_name(d) for d in dtypes)} are supported"
        )


def _check_tensors(name: str, values: list[object], optional: bool = False) -> None:
    for index, value in enumerate(values):
        if not isinstance(value, Tensor):  # names the culprit only when there is one
            check_tensor(f"{name}[{index}]", value, optional)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    """act(x @ weight.T + bias), like F.linear followed by the activation, in one op."""
    check_activation(activation)
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_tensor("bias", bias, optional=True)
    check_dtype("fusedmlp.linear", x)
    if _needs_grad(x, weight, bias):
        return autograd.train_linear(x, weight, bias, activation)
    return _without_autograd(_ops.linear.default, x, weight, bias, activation)


def mlp(
    x: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None] | None = None,
    activation: str = "relu",
) -> Tensor:
    """Linear layers with `activation` after every layer but the last, in one op."""
    check_activation(activation)
    check_tensor("x", x)
    if isinstance(weights, Tensor) or isinstance(biases, Tensor):
        raise TypeError(
            "fusedmlp.mlp: weights and biases must be sequences of Tensors, not a Tensor"
        )
    weights = list(weights)
    if not weights:
        raise ValueError("fusedmlp.mlp: weights must hold at least one weight")
    _check_tensors("weights", weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(
            f"fusedmlp.mlp: got {len(weights)} weights but {len(biases)} biases; "
            "pass one bias (or None) per weight"
        )
    _check_tensors("biases", biases, optional=True)
    return run_mlp(x, weights, biases, activation)


def run_mlp(
    x: Tensor, weights: list[Tensor], biases: list[Tensor | None], activation: str
) -> Tensor:
    """mlp() for arguments already checked (FusedMLP's own): one bias or None per weight."""
    check_dtype("fusedmlp.mlp", x)
    train = _needs_grad(x, *weights, *biases)
    biases = _all_or_no_biases(weights, biases)
    if train:
        return autograd.train_mlp(x, weights, biases, activation)
    return _without_autograd(_ops.mlp.default, x, weights, biases, activation)


def _all_or_no_biases(weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """The op takes a bias for every layer or for none: missing ones become zeros."""
    if all(b is None for b in biases):
        return []
    if all(b is not None for b in biases):
        return biases
    return [
        torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
        for w, b in zip(weights, biases)
    ]


def gated_mlp(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    activation: str = "gelu_tanh",
    bias_gate: Tensor | None = None,
    bias_up: Tensor | None = None,
    bias_down: Tensor | None = None,
) -> Tensor:
    """down(act(gate(x)) * up(x)): the GeGLU ("gelu_tanh") / SwiGLU ("silu") block, in one op."""
    check_activation(activation)
    for name, tensor in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_tensor(name, tensor)
    for name, tensor in (("bias_gate", bias_gate), ("bias_up", bias_up), ("bias_down", bias_down)):
        check_tensor(name, tensor, optional=True)
    check_dtype("fusedmlp.gated_mlp", x)
    args = (x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation)
    if _needs_grad(*args[:-1]):
        return autograd.train_gated(*args)
    return _without_autograd(_ops.gated_mlp.default, *args)


__all__ = ["linear", "mlp", "gated_mlp"]
