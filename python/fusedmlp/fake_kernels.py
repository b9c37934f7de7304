"""Fake kernels of the fusedmlp ops: output shapes and strides for FakeTensor, meta and
torch.compile, and the same refusals as the real kernels' argument checks
(csrc/torch/arguments.cpp), message for message."""

from __future__ import annotations

import torch
from torch import Tensor

from .activations import OUTPUT_DERIVATIVE
from .registry import DEVICE_DTYPES
from .saved_layout import chain_layout, leading_rows


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
    dtypes = DEVICE_DTYPES.get(t.device.type)
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
    rows = leading_rows(x)
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
    _, total = chain_layout(leading_rows(x), widths, hidden, final)
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
    return y, x.new_empty((3, leading_rows(x), w_gate.shape[0]))


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
    y: Tensor | None,
    bias: bool,
    hidden_activation: str,
    final_activation: str,
    need_grad_x: bool,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    op = "fusedmlp.chain_backward"
    _, expected = _chain_fake(op, x, weights, [], hidden_activation, final_activation)
    out_features = weights[-1].shape[0]
    _check_backward_inputs(op, grad_y, x, out_features, saved, expected)
    torch._check(
        y is not None or final_activation not in OUTPUT_DERIVATIVE,
        lambda: (
            f"{op}: y (the forward's output) is required: the derivative of the final "
            f"activation '{final_activation}' reads it"
        ),
    )
    if y is not None:
        _check_output_shaped(op, "y", y, x, out_features)
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
    _check_output_shaped(op, "grad_y", grad_y, x, out_features)
    _check_same(op, "saved", saved, x)
    torch._check(
        saved.shape == expected.shape,
        lambda: f"{op}: saved must have shape {tuple(expected.shape)}, got {tuple(saved.shape)}",
    )


def _check_output_shaped(op: str, name: str, t: Tensor, x: Tensor, out_features: int) -> None:
    """grad_y, or the forward's output y: the output's shape, x's dtype and device."""
    _check_same(op, name, t, x)
    shape = (*x.shape[:-1], out_features)
    torch._check(
        t.shape == shape,
        lambda: f"{op}: {name} must have the output's shape {shape}, got {tuple(t.shape)}",
    )


def _grad_x_fake(x: Tensor, need_grad_x: bool) -> Tensor:
    return x.new_empty(x.shape if need_grad_x else (0,))
