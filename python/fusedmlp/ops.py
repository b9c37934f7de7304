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


# The dtypes each device's kernels take (as csrc/torch/{cpu,cuda}.cpp); other
# devices (meta) take any floating dtype.
_DEVICE_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}


def _check_same(op: str, name: str, t: Tensor | None, x: Tensor) -> None:
    """The fake kernels' twin of the C++ check_same: one dtype and one device for all."""
    if t is None:
        return
    torch._check(
        t.dtype == x.dtype,
        lambda: (
            f"{op}: {name} has dtype {t.dtype} but x has dtype {x.dtype}; "
            "all tensors must share one dtype"
        ),
    )
    torch._check(
        t.device == x.device,
        lambda: (
            f"{op}: {name} is on {t.device} but x is on {x.device}; "
            "all tensors must be on one device"
        ),
    )


def _check_dtype(op: str, name: str, t: Tensor) -> None:
    dtypes = _DEVICE_DTYPES.get(t.device.type)
    supported = t.dtype.is_floating_point if dtypes is None else t.dtype in dtypes
    torch._check_type(
        supported, lambda: f"{op}: {name} has dtype {t.dtype}, not supported on {t.device.type}"
    )


def _check_x(op: str, x: Tensor) -> None:
    torch._check(
        x.dim() >= 1, lambda: f"{op}: x must have shape (*, in_features), got a 0-d tensor"
    )
    _check_dtype(op, "x", x)


def _check_weight(op: str, name: str, weight: Tensor, features: int, x: Tensor) -> None:
    torch._check(
        weight.dim() == 2,
        lambda: f"{op}: {name} must be 2-D (out_features, in_features), got {weight.dim()}-D",
    )
    torch._check(
        weight.shape[1] == features,
        lambda: (
            f"{op}: {name} has shape {tuple(weight.shape)} and expects {weight.shape[1]} "
            f"input features, but its input has {features}"
        ),
    )
    _check_same(op, name, weight, x)


def _check_bias(op: str, name: str, bias: Tensor | None, features: int, x: Tensor) -> None:
    if bias is None:
        return
    torch._check(
        bias.dim() == 1 and bias.shape[0] == features,
        lambda: f"{op}: {name} must have shape ({features}), got {tuple(bias.shape)}",
    )
    _check_same(op, name, bias, x)


_INT64_MAX = 2**63 - 1


def _check_count(op: str, weight: str, what: str, x: Tensor, width: object, copies: int) -> None:
    """The C++ check_count: rows * width * copies must fit int64 (checked when sizes are
    concrete; symbolic sizes are left to the real kernel)."""
    rows = _rows(x)
    if isinstance(rows, int) and isinstance(width, int):
        torch._check(
            rows * width * copies <= _INT64_MAX,
            lambda: (
                f"{op}: x has {rows} rows and {weight} {width} output features: "
                f"{what} would have more elements than int64 can count"
            ),
        )


def _chain_fake(
    op: str, x: Tensor, weights: list[Tensor], biases: list[Tensor | None], hidden: str, final: str
) -> tuple[Tensor, Tensor]:
    _check_x(op, x)
    torch._check(len(weights) > 0, lambda: f"{op}: weights must hold at least one weight")
    torch._check(
        len(biases) in (0, len(weights)),
        lambda: (
            f"{op}: got {len(weights)} weights but {len(biases)} biases; "
            "pass one bias per weight, or none"
        ),
    )
    features = x.shape[-1]
    for index, weight in enumerate(weights):
        suffix = f"[{index}]" if len(weights) > 1 else ""
        _check_weight(op, f"weight{suffix}", weight, features, x)
        features = weight.shape[0]
        _check_bias(op, f"bias{suffix}", biases[index] if biases else None, features, x)
    widths = [x.shape[-1]] + [w.shape[0] for w in weights]
    _check_count(op, "the weights have", "the output and saved activations", x, sum(widths[1:]), 2)
    _, total = chain_layout(_rows(x), widths, hidden, final)
    y = x.new_empty((*x.shape[:-1], weights[-1].shape[0]))
    return y, x.new_empty((total,))


def _gated_fake(
    op: str,
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    biases: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor]:
    _check_x(op, x)
    _check_weight(op, "w_gate", w_gate, x.shape[-1], x)
    _check_weight(op, "w_up", w_up, x.shape[-1], x)
    torch._check(
        w_up.shape[0] == w_gate.shape[0],
        lambda: (
            f"{op}: w_gate has shape {tuple(w_gate.shape)} but w_up has shape "
            f"{tuple(w_up.shape)}; both must be (hidden, dim)"
        ),
    )
    _check_weight(op, "w_down", w_down, w_gate.shape[0], x)
    names = ("bias_gate", "bias_up", "bias_down")
    widths = (w_gate.shape[0], w_up.shape[0], w_down.shape[0])
    for name, bias, features in zip(names, biases, widths, strict=True):
        _check_bias(op, name, bias, features, x)
    _check_count(op, "w_gate has", "the saved gate, up and product activations", x, widths[0], 3)
    _check_count(op, "w_down has", "the output", x, widths[2], 1)
    y = x.new_empty((*x.shape[:-1], w_down.shape[0]))
    return y, x.new_empty((3, _rows(x), w_gate.shape[0]))


def _pointwise_fake(op: str, grad_name: str, grad: Tensor, others: dict[str, Tensor]) -> None:
    _check_dtype(op, grad_name, grad)
    for name, t in others.items():
        torch._check(
            t.shape == grad.shape,
            lambda name=name, t=t: (
                f"{op}: {name} must have the shape of {grad_name}, "
                f"{tuple(grad.shape)}, got {tuple(t.shape)}"
            ),
        )
        torch._check(
            t.dtype == grad.dtype and t.device == grad.device,
            lambda name=name: f"{op}: {name} must share the dtype and device of {grad_name}",
        )


@torch.library.register_fake("fusedmlp::linear")
def _linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return _chain_fake("fusedmlp.linear", x, [weight], [bias], activation, activation)[0]


@torch.library.register_fake("fusedmlp::linear_train")
def _linear_train_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor]:
    return _chain_fake("fusedmlp.linear", x, [weight], [bias], activation, activation)


@torch.library.register_fake("fusedmlp::mlp")
def _mlp_fake(x: Tensor, weights: list[Tensor], biases: list[Tensor], activation: str) -> Tensor:
    return _chain_fake("fusedmlp.mlp", x, weights, biases, activation, "none")[0]


@torch.library.register_fake("fusedmlp::mlp_train")
def _mlp_train_fake(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activation: str
) -> tuple[Tensor, Tensor]:
    return _chain_fake("fusedmlp.mlp", x, weights, biases, activation, "none")


@torch.library.register_fake("fusedmlp::gated_mlp")
def _gated_mlp_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation):
    return _gated_fake(
        "fusedmlp.gated_mlp", x, w_gate, w_up, w_down, (bias_gate, bias_up, bias_down)
    )[0]


@torch.library.register_fake("fusedmlp::gated_mlp_train")
def _gated_mlp_train_fake(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation):
    return _gated_fake(
        "fusedmlp.gated_mlp", x, w_gate, w_up, w_down, (bias_gate, bias_up, bias_down)
    )


@torch.library.register_fake("fusedmlp::activation_backward")
def _activation_backward_fake(grad: Tensor, pre: Tensor, activation: str) -> Tensor:
    _pointwise_fake("fusedmlp.activation_backward", "grad", grad, {"pre": pre})
    return grad.new_empty(grad.shape)


@torch.library.register_fake("fusedmlp::gated_backward")
def _gated_backward_fake(
    grad_product: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    _pointwise_fake(
        "fusedmlp.gated_backward", "grad_product", grad_product, {"gate": gate, "up": up}
    )
    return grad_product.new_empty(grad_product.shape), grad_product.new_empty(grad_product.shape)


@torch.library.register_fake("fusedmlp::chain_backward")
def _chain_backward_fake(
    grad_y: Tensor,
    x: Tensor,
    weights: list[Tensor],
    saved: Tensor,
    bias: bool,
    hidden_activation: str,
    final_activation: str,
    need_grad_x: bool,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    op = "fusedmlp.chain_backward"
    _, expected = _chain_fake(op, x, weights, [], hidden_activation, final_activation)
    _check_backward_inputs(op, grad_y, x, weights[-1].shape[0], saved, expected)
    grad_biases = [w.new_empty(w.shape[0]) for w in weights] if bias else []
    return _grad_x_fake(x, need_grad_x), [w.new_empty(w.shape) for w in weights], grad_biases


@torch.library.register_fake("fusedmlp::gated_mlp_backward")
def _gated_mlp_backward_fake(
    grad_y: Tensor,
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    saved: Tensor,
    bias: list[bool],
    activation: str,
    need_grad_x: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    op = "fusedmlp.gated_mlp_backward"
    _, expected = _gated_fake(op, x, w_gate, w_up, w_down, (None, None, None))
    _check_backward_inputs(op, grad_y, x, w_down.shape[0], saved, expected)
    weights = (w_gate, w_up, w_down)
    grad_biases = [w.new_empty(w.shape[0]) for w, present in zip(weights, bias) if present]
    grad_w_gate, grad_w_up, grad_w_down = (w.new_empty(w.shape) for w in weights)
    return _grad_x_fake(x, need_grad_x), grad_w_gate, grad_w_up, grad_w_down, grad_biases


def _check_backward_inputs(
    op: str, grad_y: Tensor, x: Tensor, out_features: int, saved: Tensor, expected: Tensor
) -> None:
    _check_same(op, "grad_y", grad_y, x)
    _check_same(op, "saved", saved, x)
    torch._check(
        grad_y.shape == (*x.shape[:-1], out_features),
        lambda: f"{op}: grad_y must have the output's shape, got {tuple(grad_y.shape)}",
    )
    torch._check(
        saved.shape == expected.shape,
        lambda: f"{op}: saved must have shape {tuple(expected.shape)}, got {tuple(saved.shape)}",
    )


def _grad_x_fake(x: Tensor, need_grad_x: bool) -> Tensor:
    return x.new_empty(x.shape if need_grad_x else (0,))


# ---- autograd ----


def _whole_backward_on_cpu(x: Tensor) -> bool:
    """Whether one fusedmlp::*_backward op runs the backward: on CPU, unless the backward
    itself is being differentiated (create_graph=True)."""
    return x.device.type == "cpu" and not torch.is_grad_enabled()


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
    a sixth of a 3-layer backward, is skipped as eager autograd does). On CPU one
    fusedmlp::chain_backward call runs it all through our GEMM core; elsewhere, and for a
    double backward, ATen GEMMs around fusedmlp::activation_backward."""
    if _whole_backward_on_cpu(x):
        # a chain's biases are all present or all absent
        grad_x, grad_weights, grad_biases = _ops.chain_backward(
            grad_y, x, weights, saved, has_bias[0], hidden, final, need_grad_x
        )
        biases: list[Tensor | None] = list(grad_biases) or [None] * len(weights)
        return (grad_x if need_grad_x else None), list(grad_weights), biases
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
    if _whole_backward_on_cpu(x):
        grad_x, *grad_weights, grad_biases = _ops.gated_mlp_backward(
            grad_y, x, w_gate, w_up, w_down, saved, list(has_bias), activation, need_grad_x
        )
        present = iter(grad_biases)
        biases = [next(present) if has else None for has in has_bias]
        return (grad_x if need_grad_x else None), *grad_weights, *biases
    x_rows = x.reshape(_rows(x), x.shape[-1])
    grad = grad_y.reshape(x_rows.shape[0], w_down.shape[0])
    gate, up, product = saved[0], saved[1], saved[2]
    grad_w_down = grad.t().mm(product)
    grad_gate, grad_up = _ops.gated_backward(grad.mm(w_down), gate, up, activation)
    # grad_x = grad_gate @ w_gate + grad_up @ w_up, the second GEMM accumulating (beta = 1)
    grad_x = grad_up.mm(w_up).addmm_(grad_gate, w_gate).view(x.shape) if need_grad_x else None
    grads = (grad_gate, grad_up, grad)
    grad_biases = tuple(g.sum(0) if present else None for g, present in zip(grads, has_bias))
    return (
        grad_x,
        grad_gate.t().mm(x_rows),
        grad_up.t().mm(x_rows),
        grad_w_down,
        *grad_biases,
    )


def _refuse_double_backward(op: str, differentiable: bool) -> None:
    """The backward reads pre-activations and hidden outputs from `saved`, which autograd
    cannot differentiate through, and fusedmlp::activation_backward / gated_backward have no
    derivative: under create_graph=True second-order gradients would silently lose terms
    (a ReLU mlp's gradient penalty came out wrong). Refuse them unless the backward is made of
    differentiable matmuls only."""
    if torch.is_grad_enabled() and not differentiable:
        raise RuntimeError(
            f"fusedmlp.{op}: double backward (create_graph=True) is not supported; "
            "use torch.nn.Linear and activation modules for higher-order gradients"
        )


def _save(ctx, x: Tensor, saved: Tensor, weights: list[Tensor], biases: list) -> None:
    # `saved` never gets a gradient; materialized, it would be a zero-filled tensor its size
    # on every backward (0.5 ms of a 7 ms training step at 256 x 512 x 3 layers).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, saved, *weights, *[b for b in biases if b is not None])
    ctx.n_weights = len(weights)
    ctx.has_bias = [b is not None for b in biases]


def _saved_inputs(ctx) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
    x, saved, *rest = ctx.saved_tensors
    weights, present = rest[: ctx.n_weights], iter(rest[ctx.n_weights :])
    biases = [next(present) if has else None for has in ctx.has_bias]
    return x, saved, weights, biases


def _grad_or_zeros(grad_y: Tensor | None, x: Tensor, out_features: int) -> Tensor:
    """grad_y, or zeros of y's shape where no gradient reached y (grads are not
    materialized, see _save)."""
    return x.new_zeros((*x.shape[:-1], out_features)) if grad_y is None else grad_y


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

        def backward(ctx, grad_y: Tensor | None, *_unused):
            # One layer without activation differentiates only through x and weight.
            _refuse_double_backward(self.name, self.single_layer and ctx.activation == "none")
            x, saved, weights, biases = _saved_inputs(ctx)
            if ctx.recompute:
                saved = train_op(*self.pack(x, weights, biases, ctx.activation))[1]
            grad_x, grad_weights, grad_biases = _chain_backward(
                x,
                weights,
                ctx.has_bias,
                saved,
                _grad_or_zeros(grad_y, x, weights[-1].shape[0]),
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

    def backward(ctx, grad_y: Tensor | None, *_unused):
        _refuse_double_backward("gated_mlp", False)
        x, saved, weights, biases = _saved_inputs(ctx)
        if ctx.recompute:
            saved = _ops.gated_mlp_train(x, *weights, *biases, ctx.activation)[1]
        grad_y = _grad_or_zeros(grad_y, x, weights[2].shape[0])
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
