"""Fake kernels and autograd for the fusedmlp ops; the kernels live in fusedmlp._C.

Each forward op has a training twin (`*_train`) that also returns `saved`, one
buffer with what the backward needs (pre-activations, hidden outputs). The
public functions call the twin when autograd will need it; the plain ops, when
differentiated directly, recompute the twin in their backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the ops)

_ops = torch.ops.fusedmlp


@dataclass(frozen=True)
class ChainLayer:
    """Where one layer's saved tensors sit in a chain's flat `saved` buffer."""

    activation: str
    pre_offset: int | None
    hidden_offset: int | None
    width: int


def chain_layout(
    rows: int, widths: list[int], hidden: str, final: str
) -> tuple[list[ChainLayer], int]:
    """Mirrors the C++ layout: per layer its pre-activation (when its activation is
    not "none"), then its output (every layer but the last)."""
    layers, total = [], 0
    for index, width in enumerate(widths[1:]):
        last = index == len(widths) - 2
        activation = final if last else hidden
        pre_offset = None if activation == "none" else total
        total += 0 if pre_offset is None else rows * width
        hidden_offset = None if last else total
        total += 0 if last else rows * width
        layers.append(ChainLayer(activation, pre_offset, hidden_offset, width))
    return layers, total


def _rows(x: Tensor) -> int:
    return math.prod(x.shape[:-1])


def _check_like_x(x: Tensor, named: dict[str, Tensor | None]) -> None:
    """The real kernels' device and dtype checks, for fake tensors (and the meta device,
    which the fake kernels also serve)."""
    for name, tensor in named.items():
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise RuntimeError(
                f"fusedmlp: {name} is on {tensor.device} but x is on {x.device}; "
                "all tensors must be on one device"
            )
        if tensor.dtype != x.dtype:
            raise RuntimeError(
                f"fusedmlp: {name} has dtype {tensor.dtype} but x has dtype {x.dtype}; "
                "all tensors must share one dtype"
            )


def _chain_fake(
    x: Tensor, weights: list[Tensor], biases: list, hidden: str, final: str
) -> tuple[Tensor, Tensor]:
    _check_like_x(x, {f"weights[{i}]": w for i, w in enumerate(weights)})
    _check_like_x(x, {f"biases[{i}]": b for i, b in enumerate(biases)})
    torch._check(x.dim() >= 1, lambda: "x must have shape (*, in_features)")
    features = x.shape[-1]
    for weight in weights:
        torch._check(weight.dim() == 2, lambda: "weight must be 2-D")
        torch._check(weight.shape[1] == features, lambda: "weight and input features differ")
        features = weight.shape[0]
    widths = [x.shape[-1]] + [w.shape[0] for w in weights]
    _, total = chain_layout(_rows(x), widths, hidden, final)
    y = x.new_empty((*x.shape[:-1], weights[-1].shape[0]))
    return y, x.new_empty((total,))


def _gated_fake(x: Tensor, *params: Tensor | None) -> tuple[Tensor, Tensor]:
    names = ("w_gate", "w_up", "w_down", "bias_gate", "bias_up", "bias_down")
    _check_like_x(x, dict(zip(names, params)))
    w_gate, w_down = params[0], params[2]
    torch._check(w_gate.shape[1] == x.shape[-1], lambda: "w_gate and x features differ")
    y = x.new_empty((*x.shape[:-1], w_down.shape[0]))
    return y, x.new_empty((3, _rows(x), w_gate.shape[0]))


@torch.library.register_fake("fusedmlp::linear")
def _linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return _chain_fake(x, [weight], [bias], activation, activation)[0]


@torch.library.register_fake("fusedmlp::linear_train")
def _linear_train_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor]:
    return _chain_fake(x, [weight], [bias], activation, activation)


@torch.library.register_fake("fusedmlp::mlp")
def _mlp_fake(x: Tensor, weights: list[Tensor], biases: list[Tensor], activation: str) -> Tensor:
    return _chain_fake(x, weights, biases, activation, "none")[0]


@torch.library.register_fake("fusedmlp::mlp_train")
def _mlp_train_fake(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activation: str
) -> tuple[Tensor, Tensor]:
    return _chain_fake(x, weights, biases, activation, "none")


@torch.library.register_fake("fusedmlp::gated_mlp")
def _gated_mlp_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation):
    return _gated_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down)[0]


@torch.library.register_fake("fusedmlp::gated_mlp_train")
def _gated_mlp_train_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation):
    return _gated_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down)


@torch.library.register_fake("fusedmlp::activation_backward")
def _activation_backward_fake(grad: Tensor, pre: Tensor, activation: str) -> Tensor:
    return grad.new_empty(grad.shape)


@torch.library.register_fake("fusedmlp::gated_backward")
def _gated_backward_fake(
    grad_product: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    return grad_product.new_empty(grad_product.shape), grad_product.new_empty(grad_product.shape)


# ---- autograd ----


def _chain_backward(
    x: Tensor,
    weights: list[Tensor],
    has_bias: list[bool],
    saved: Tensor,
    grad_y: Tensor,
    hidden: str,
    final: str,
    need_grad_x: bool = True,
) -> tuple[Tensor | None, list[Tensor], list[Tensor | None]]:
    """Gradients of a chain; grad_x is None when not needed (the first layer's dX GEMM,
    a sixth of a 3-layer backward, is skipped as eager autograd does)."""
    rows = _rows(x)
    x_rows = x.reshape(rows, x.shape[-1])
    widths = [x.shape[-1]] + [w.shape[0] for w in weights]
    layers, _ = chain_layout(rows, widths, hidden, final)

    def view(offset: int, width: int) -> Tensor:
        return saved[offset : offset + rows * width].view(rows, width)

    grad = grad_y.reshape(rows, widths[-1])
    grad_weights: list[Tensor] = [torch.empty(0)] * len(weights)
    grad_biases: list[Tensor | None] = [None] * len(weights)
    for index in reversed(range(len(weights))):
        layer = layers[index]
        if layer.pre_offset is not None:
            pre = view(layer.pre_offset, layer.width)
            grad = _ops.activation_backward(grad, pre, layer.activation)
        below = layers[index - 1] if index > 0 else None
        layer_input = x_rows if below is None else view(below.hidden_offset, below.width)
        grad_weights[index] = grad.t().mm(layer_input)
        if has_bias[index]:
            grad_biases[index] = grad.sum(0)
        if index == 0 and not need_grad_x:
            return None, grad_weights, grad_biases
        grad = grad.mm(weights[index])
    return grad.view(x.shape), grad_weights, grad_biases


def _gated_backward(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    has_bias: tuple[bool, bool, bool],
    saved: Tensor,
    grad_y: Tensor,
    activation: str,
    need_grad_x: bool = True,
) -> tuple[Tensor | None, ...]:
    x_rows = x.reshape(_rows(x), x.shape[-1])
    grad = grad_y.reshape(x_rows.shape[0], w_down.shape[0])
    gate, up, product = saved[0], saved[1], saved[2]
    grad_w_down = grad.t().mm(product)
    grad_gate, grad_up = _ops.gated_backward(grad.mm(w_down), gate, up, activation)
    grad_x = (grad_gate.mm(w_gate) + grad_up.mm(w_up)).view(x.shape) if need_grad_x else None
    grads = (grad_gate, grad_up, grad)
    grad_biases = tuple(g.sum(0) if present else None for g, present in zip(grads, has_bias))
    return (
        grad_x,
        grad_gate.t().mm(x_rows),
        grad_up.t().mm(x_rows),
        grad_w_down,
        *grad_biases,
    )


def _save(ctx, x: Tensor, saved: Tensor, weights: list[Tensor], biases: list) -> None:
    ctx.save_for_backward(x, saved, *weights, *[b for b in biases if b is not None])
    ctx.n_weights = len(weights)
    ctx.has_bias = [b is not None for b in biases]


def _saved_inputs(ctx) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
    x, saved, *rest = ctx.saved_tensors
    weights, present = rest[: ctx.n_weights], iter(rest[ctx.n_weights :])
    biases = [next(present) if has else None for has in ctx.has_bias]
    return x, saved, weights, biases


@dataclass(frozen=True)
class _ChainOp:
    """How linear / mlp map onto a chain of layers."""

    name: str
    single_layer: bool

    def unpack(self, inputs) -> tuple[Tensor, list[Tensor], list, str]:
        x, weights, biases, activation = inputs
        if self.single_layer:
            return x, [weights], [biases], activation
        return x, list(weights), list(biases) or [None] * len(weights), activation

    def pack(self, first, weights: list, biases: list, last):
        """Op arguments (or their gradients) from per-layer lists; an mlp's biases are
        all present or an empty list."""
        if self.single_layer:
            return first, weights[0], biases[0], last
        return first, weights, [b for b in biases if b is not None], last

    def final(self, activation: str) -> str:
        return activation if self.single_layer else "none"

    def register(self) -> None:
        train_op = getattr(_ops, f"{self.name}_train")

        def setup(ctx, inputs, output, training: bool) -> None:
            x, weights, biases, activation = self.unpack(inputs)
            saved = output[1] if training else x.new_empty(0)
            if training:
                ctx.mark_non_differentiable(saved)
            _save(ctx, x, saved, weights, biases)
            ctx.activation, ctx.recompute = activation, not training

        def backward(ctx, grad_y: Tensor, *_unused):
            x, saved, weights, biases = _saved_inputs(ctx)
            if ctx.recompute:
                saved = train_op(*self.pack(x, weights, biases, ctx.activation))[1]
            grad_x, grad_weights, grad_biases = _chain_backward(
                x,
                weights,
                ctx.has_bias,
                saved,
                grad_y,
                ctx.activation,
                self.final(ctx.activation),
                need_grad_x=ctx.needs_input_grad[0],
            )
            return self.pack(grad_x, grad_weights, grad_biases, None)

        torch.library.register_autograd(
            f"fusedmlp::{self.name}",
            backward,
            setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output, False),
        )
        torch.library.register_autograd(
            f"fusedmlp::{self.name}_train",
            backward,
            setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output, True),
        )


_ChainOp("linear", single_layer=True).register()
_ChainOp("mlp", single_layer=False).register()


def _register_gated() -> None:
    def setup(ctx, inputs, output, training: bool) -> None:
        x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation = inputs
        saved = output[1] if training else x.new_empty(0)
        if training:
            ctx.mark_non_differentiable(saved)
        _save(ctx, x, saved, [w_gate, w_up, w_down], [bias_gate, bias_up, bias_down])
        ctx.activation, ctx.recompute = activation, not training

    def backward(ctx, grad_y: Tensor, *_unused):
        x, saved, weights, biases = _saved_inputs(ctx)
        if ctx.recompute:
            saved = _ops.gated_mlp_train(x, *weights, *biases, ctx.activation)[1]
        grads = _gated_backward(
            x, *weights, tuple(ctx.has_bias), saved, grad_y, ctx.activation,
            need_grad_x=ctx.needs_input_grad[0],
        )
        return (*grads, None)

    for name, training in (("gated_mlp", False), ("gated_mlp_train", True)):
        torch.library.register_autograd(
            f"fusedmlp::{name}",
            backward,
            setup_context=lambda ctx, inputs, output, t=training: setup(ctx, inputs, output, t),
        )


_register_gated()
