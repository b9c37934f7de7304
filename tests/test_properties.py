"""Property-based tests: fused linear / mlp / gated_mlp against PyTorch in float64, values and
gradients, over random shapes (0 and 1 included), leading dimensions, strides (transposed,
sliced, expanded), dtypes, activations, biases and layer counts.

Profiles: "ci" (default; derandomized, fixed examples, well under a minute on 2 cores) and
"long" (many random examples), chosen with FUSEDMLP_HYPOTHESIS_PROFILE=long.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile(os.environ.get("FUSEDMLP_HYPOTHESIS_PROFILE", "ci"))

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]
REFERENCE: dict[str, nn.Module] = {
    "none": nn.Identity(),
    "relu": nn.ReLU(),
    "gelu": nn.GELU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(),
}


def tolerance(dtype: torch.dtype, scale: float) -> dict[str, float]:
    """Against the float64 reference. float32: summation order differs (blocked K).
    bfloat16: inputs and outputs carry 8 mantissa bits and the backward matmuls run in
    bfloat16 (as nn.Linear's do), so errors scale with the largest value involved."""
    rtol, atol = {
        torch.float64: (1e-9, 1e-9),
        torch.float32: (1e-4, 1e-4),
        torch.bfloat16: (4e-2, 4e-2),
    }[dtype]
    return {"rtol": rtol, "atol": atol * max(1.0, scale)}


def assert_close_to_reference(actual: Tensor, expected: Tensor, name: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(),
        expected,
        **tolerance(actual.dtype, scale),
        msg=lambda message: f"{name}: {message}",
    )


def laid_out(values: Tensor, layout: str) -> Tensor:
    """The same values (a float64 tensor) as a leaf in the given memory layout, in values'
    dtype: transposed (last two dims swapped in memory), sliced (every other element of a
    wider buffer) or expanded (stride 0 along the first dim, when that dim's values repeat)."""
    if layout == "transposed" and values.dim() >= 2:
        laid = values.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "sliced":
        wide = torch.zeros(*values.shape[:-1], 2 * values.shape[-1], dtype=values.dtype)
        wide[..., ::2] = values
        laid = wide[..., ::2]
    elif layout == "expanded" and values.dim() >= 1 and values.shape[0] > 0:
        laid = values[:1].expand(values.shape)
    else:
        laid = values.contiguous()
    assert laid.shape == values.shape
    return laid.detach().requires_grad_()


@dataclass
class Operand:
    """One input: the tensor handed to fusedmlp and its float64 twin for the reference."""

    tensor: Tensor
    reference: Tensor

    @classmethod
    def make(
        cls, shape: tuple[int, ...], dtype: torch.dtype, layout: str, scale: float, seed: int
    ) -> Operand:
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        if layout == "expanded" and len(shape) >= 1 and shape[0] > 0:
            values = values[:1].expand(shape).clone()
        tensor = laid_out(values.to(dtype), layout)
        # The reference sees exactly the (rounded) values fusedmlp sees.
        return cls(tensor, tensor.detach().double().requires_grad_())


def check_values_and_gradients(
    actual: Tensor, expected: Tensor, operands: list[Operand], seed: int
) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == operands[0].tensor.dtype
    assert_close_to_reference(actual, expected.detach(), "output")
    if actual.numel() == 0:
        return
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    inputs = [o.tensor for o in operands]
    grads = torch.autograd.grad(actual, inputs, grad_out.to(actual.dtype), allow_unused=True)
    references = torch.autograd.grad(
        expected, [o.reference for o in operands], grad_out, allow_unused=True
    )
    for index, (grad, reference) in enumerate(zip(grads, references)):
        if reference is None:
            reference = torch.zeros_like(operands[index].reference)
        assert grad is not None, f"no gradient for input {index}"
        assert grad.shape == operands[index].tensor.shape
        assert_close_to_reference(grad, reference, f"grad of input {index}")


# ---- strategies ----

sizes = st.integers(min_value=0, max_value=17)
positive_sizes = st.integers(min_value=1, max_value=17)
leading_shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=2)
layouts = st.sampled_from(LAYOUTS)
dtypes = st.sampled_from(DTYPES)
activations = st.sampled_from(list(fusedmlp.ACTIVATIONS))
seeds = st.integers(min_value=0, max_value=2**31 - 1)


@given(
    leading=leading_shapes,
    in_features=sizes,
    out_features=sizes,
    dtype=dtypes,
    activation=activations,
    bias=st.booleans(),
    x_layout=layouts,
    w_layout=layouts,
    seed=seeds,
)
@settings(parent=PROFILE)
def test_linear_matches_pytorch(
    leading: list[int],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    activation: str,
    bias: bool,
    x_layout: str,
    w_layout: str,
    seed: int,
) -> None:
    x = Operand.make((*leading, in_features), dtype, x_layout, 1.0, seed)
    scale = 1.0 / max(in_features, 1) ** 0.5
    w = Operand.make((out_features, in_features), dtype, w_layout, scale, seed + 1)
    operands = [x, w]
    if bias:
        operands.append(Operand.make((out_features,), dtype, "contiguous", 1.0, seed + 2))
    b, b_ref = (operands[2].tensor, operands[2].reference) if bias else (None, None)
    actual = fusedmlp.linear(x.tensor, w.tensor, b, activation)
    expected = REFERENCE[activation](F.linear(x.reference, w.reference, b_ref))
    check_values_and_gradients(actual, expected, operands, seed)


@given(
    leading=leading_shapes,
    widths=st.lists(sizes, min_size=2, max_size=5),
    dtype=dtypes,
    activation=activations,
    biases=st.lists(st.booleans(), min_size=4, max_size=4),
    x_layout=layouts,
    w_layouts=st.lists(layouts, min_size=4, max_size=4),
    seed=seeds,
)
@settings(parent=PROFILE)
def test_mlp_matches_pytorch(
    leading: list[int],
    widths: list[int],
    dtype: torch.dtype,
    activation: str,
    biases: list[bool],
    x_layout: str,
    w_layouts: list[str],
    seed: int,
) -> None:
    """Any number of layers (1-4), each with or without a bias (a missing bias among present
    ones is a zero bias, as in fusedmlp.mlp)."""
    x = Operand.make((*leading, widths[0]), dtype, x_layout, 1.0, seed)
    operands, weights, bias_list = [x], [], []
    for layer, (size_in, size_out) in enumerate(zip(widths[:-1], widths[1:])):
        scale = 1.0 / max(size_in, 1) ** 0.5
        w = Operand.make((size_out, size_in), dtype, w_layouts[layer], scale, seed + 10 + layer)
        b = Operand.make((size_out,), dtype, "sliced", 1.0, seed + 20 + layer)
        weights.append(w)
        bias_list.append(b if biases[layer] else None)
        operands += [w] + ([b] if biases[layer] else [])
    actual = fusedmlp.mlp(
        x.tensor,
        [w.tensor for w in weights],
        [None if b is None else b.tensor for b in bias_list],
        activation,
    )
    expected = x.reference
    for layer, (w, b) in enumerate(zip(weights, bias_list)):
        expected = F.linear(expected, w.reference, None if b is None else b.reference)
        if layer + 1 < len(weights):
            expected = REFERENCE[activation](expected)
    check_values_and_gradients(actual, expected, operands, seed)


@given(
    leading=leading_shapes,
    dim=sizes,
    hidden=sizes,
    dtype=dtypes,
    activation=activations,
    biases=st.lists(st.booleans(), min_size=3, max_size=3),
    layouts_=st.lists(layouts, min_size=4, max_size=4),
    seed=seeds,
)
@settings(parent=PROFILE)
def test_gated_mlp_matches_pytorch(
    leading: list[int],
    dim: int,
    hidden: int,
    dtype: torch.dtype,
    activation: str,
    biases: list[bool],
    layouts_: list[str],
    seed: int,
) -> None:
    x = Operand.make((*leading, dim), dtype, layouts_[0], 1.0, seed)
    in_scale, hidden_scale = 1.0 / max(dim, 1) ** 0.5, 1.0 / max(hidden, 1) ** 0.5
    w_gate = Operand.make((hidden, dim), dtype, layouts_[1], in_scale, seed + 1)
    w_up = Operand.make((hidden, dim), dtype, layouts_[2], in_scale, seed + 2)
    w_down = Operand.make((dim, hidden), dtype, layouts_[3], hidden_scale, seed + 3)
    bias_ops = [
        Operand.make((size,), dtype, "contiguous", 1.0, seed + 4 + i) if present else None
        for i, (size, present) in enumerate(zip((hidden, hidden, dim), biases))
    ]
    operands = [x, w_gate, w_up, w_down] + [b for b in bias_ops if b is not None]
    actual = fusedmlp.gated_mlp(
        x.tensor,
        w_gate.tensor,
        w_up.tensor,
        w_down.tensor,
        activation,
        *[None if b is None else b.tensor for b in bias_ops],
    )
    bg, bu, bd = (None if b is None else b.reference for b in bias_ops)
    gate = REFERENCE[activation](F.linear(x.reference, w_gate.reference, bg))
    expected = F.linear(gate * F.linear(x.reference, w_up.reference, bu), w_down.reference, bd)
    check_values_and_gradients(actual, expected, operands, seed)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_laid_out_really_changes_strides(layout: str) -> None:
    """Guards the strategy itself: each layout yields the strides it promises."""
    values = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    if layout == "expanded":
        values = values[:1].expand(3, 4).clone()
    laid = laid_out(values, layout)
    torch.testing.assert_close(laid, values, rtol=0, atol=0)
    expected_strides = {
        "contiguous": (4, 1),
        "transposed": (1, 3),
        "sliced": (8, 2),
        "expanded": (0, 1),
    }[layout]
    assert laid.stride() == expected_strides
    assert laid.is_leaf and laid.requires_grad
