"""Property-based tests: fused linear / mlp / gated_mlp against PyTorch in float64, values and
gradients, over random shapes (0 and 1 included), leading dimensions, strides (transposed,
sliced, expanded), dtypes, activations, biases and layer counts.

Profiles: "ci" (default; derandomized, fixed examples, well under a minute on 2 cores) and
"long" (many random examples), chosen with FUSEDMLP_HYPOTHESIS_PROFILE=long.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
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


# Error allowed per unit of "magnitude": the same computation on |inputs| with no activation,
# i.e. the sum of the absolute values of the terms behind each result (|act(z)| <= |z| and
# |act'(z)| <= 1.13 for every activation here). float32: the kernel sums K in another order
# than the reference; bfloat16: inputs are already rounded, but the output and, in backward,
# every intermediate of the bfloat16 matmuls (as in nn.Linear) is rounded to 8 bits.
RELATIVE_ERROR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def assert_within(actual: Tensor, expected: Tensor, magnitude: Tensor, name: str) -> None:
    """|actual - expected| <= RELATIVE_ERROR[dtype] * magnitude, elementwise (plus a tiny
    absolute floor for results whose terms are all zero)."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    error = (actual.double() - expected).abs()
    bound = RELATIVE_ERROR[actual.dtype] * magnitude + 1e-300
    excess = error - bound
    if excess.numel() and excess.max() > 0:
        index = int(excess.argmax())
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} of {excess.numel()} elements off; worst at flat "
            f"index {index}: got {actual.double().flatten()[index].item()!r}, expected "
            f"{expected.flatten()[index].item()!r}, allowed error {bound.flatten()[index].item()!r}"
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


Reference = Callable[[list[Tensor], str], Tensor]


def check_against_reference(
    actual: Tensor, operands: list[Operand], reference: Reference, activation: str, seed: int
) -> None:
    """Values and the gradients of every operand against reference(operand values, activation)
    in float64, within RELATIVE_ERROR of the magnitude of the terms involved."""
    values = [o.reference for o in operands]
    expected = reference(values, activation)
    absolutes = [v.detach().abs().requires_grad_() for v in values]
    magnitude = reference(absolutes, "none")
    assert actual.dtype == operands[0].tensor.dtype
    assert_within(actual, expected.detach(), magnitude.detach(), "output")
    if actual.numel() == 0:
        return
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(actual, [o.tensor for o in operands], grad_out.to(actual.dtype))
    wanted = torch.autograd.grad(expected, values, grad_out, allow_unused=True)
    bounds = torch.autograd.grad(magnitude, absolutes, grad_out.abs(), allow_unused=True)
    for index, (grad, want, bound) in enumerate(zip(grads, wanted, bounds)):
        zeros = torch.zeros_like(values[index])
        assert grad.shape == operands[index].tensor.shape
        assert_within(
            grad,
            zeros if want is None else want,
            zeros if bound is None else bound,
            f"grad of operand {index}",
        )


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
    b = operands[2].tensor if bias else None
    actual = fusedmlp.linear(x.tensor, w.tensor, b, activation)

    def reference(values: list[Tensor], act: str) -> Tensor:
        return REFERENCE[act](F.linear(*values[:2], values[2] if bias else None))

    check_against_reference(actual, operands, reference, activation, seed)


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
# Found by this test: an mlp whose last layer has 0 outputs failed in the C kernel.
@example(
    leading=[],
    widths=[0, 1, 0],
    dtype=torch.float32,
    activation="none",
    biases=[False] * 4,
    x_layout="contiguous",
    w_layouts=["contiguous"] * 4,
    seed=0,
)
# bfloat16 gradient whose terms cancel: needs the magnitude-relative tolerance.
@example(
    leading=[5],
    widths=[0, 0, 2, 1, 11],
    dtype=torch.bfloat16,
    activation="none",
    biases=[False, True, False, False],
    x_layout="contiguous",
    w_layouts=["contiguous", "contiguous", "contiguous", "expanded"],
    seed=9,
)
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

    def reference(values: list[Tensor], act: str) -> Tensor:
        remaining = iter(values)
        h = next(remaining)
        for layer in range(len(weights)):
            w = next(remaining)
            h = F.linear(h, w, next(remaining) if biases[layer] else None)
            if layer + 1 < len(weights):
                h = REFERENCE[act](h)
        return h

    check_against_reference(actual, operands, reference, activation, seed)


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

    def reference(values: list[Tensor], act: str) -> Tensor:
        x_, w_gate_, w_up_, w_down_, *present = values
        remaining = iter(present)
        bg, bu, bd = (next(remaining) if b is not None else None for b in bias_ops)
        gate = REFERENCE[act](F.linear(x_, w_gate_, bg))
        return F.linear(gate * F.linear(x_, w_up_, bu), w_down_, bd)

    check_against_reference(actual, operands, reference, activation, seed)


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
