"""The bfloat16 kernels compute activations with cheaper formulas than the float ones
(csrc/cpu/vector_math.h, STORE_ROUNDS_TO_BF16): their error must stay invisible after the
rounding to bfloat16. Over every bfloat16 input in [-16, 16], an activation (and its
derivative, through the backward) applied by a fused Linear with an identity weight, so the
product is exact, is as close to float64 as eager bfloat16's result, measured in bfloat16
ulps of the exact value, element by element. The test_bf16_accuracy tests, on matrix products,
would hide an activation error of a good fraction of an ulp under the products' own
rounding."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import fusedmlp
import pytest
import torch
from conftest import FUNCTIONAL
from torch import Tensor

WIDTH = 32  # the identity weight's side: one AMX tile, two AVX-512 vectors
# an activation error of 2% of an ulp is a relative error of 2^-8 / 50 = 8e-5, 15 times what
# the cheaper formulas make and 25 times what rounds a bfloat16 result the wrong way in 1%
# of the inputs
ULP_SLACK = 0.02
# the share of inputs rounded other than the exact value is, at most this much above eager's
SHARE_SLACK = 0.01


def every_bf16_up_to(limit: float) -> Tensor:
    """Every normal bfloat16 value of magnitude at most limit, padded with zeros to rows of
    WIDTH. Subnormals are left out: the bfloat16 dot-product instructions (vdpbf16ps, AMX)
    read them as zero, which is the product's doing, not the activation's."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    magnitude = values.float().abs()
    values = values[(magnitude >= torch.finfo(torch.bfloat16).tiny) & (magnitude <= limit)]
    padding = (-values.numel()) % WIDTH
    return torch.cat([values, values.new_zeros(padding)]).reshape(-1, WIDTH)


def ulps(actual: Tensor, exact: Tensor) -> Tensor:
    """|actual - exact| in bfloat16 ulps of exact (8 significant bits; the subnormal spacing
    below the smallest normal)."""
    _, exponent = torch.frexp(exact)
    ulp = torch.ldexp(torch.ones_like(exact), (exponent - 8).clamp_min(-133))
    return (actual.double() - exact).abs() / ulp


def value_and_slope(activation: str, x: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
    """act(x) and act'(x) in x's dtype: the fused Linear with an identity weight, or eager."""
    x = x.clone().requires_grad_()
    if fused:
        identity = torch.eye(WIDTH, dtype=x.dtype)
        y = fusedmlp.linear(x, identity, torch.zeros(WIDTH, dtype=x.dtype), activation)
    else:
        y = FUNCTIONAL[activation](x)
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    return y.detach(), x.grad


def exact_value_and_slope(activation: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """act(x) and act'(x) in float64. Eager's GELUs are exact enough there except in the
    negative tail, where 1 + erf and 1 + tanh cancel to nothing in float64 too (below
    x = -8.3 and -6.9) while the result is still a normal bfloat16: those two are written
    as x Phi(x) with Phi(x) = erfc(-x / sqrt2) / 2 (torch.special.ndtr also flushes to 0
    there) and as x sigmoid(2u)."""
    x = x.double()
    if activation == "gelu":
        cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
        density = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return x * cdf, cdf + x * density
    if activation == "gelu_tanh":
        c, kappa = math.sqrt(2.0 / math.pi), 0.044715
        u = c * (x + kappa * x**3)
        s = torch.sigmoid(2.0 * u)
        du = c * (1.0 + 3.0 * kappa * x * x)
        return x * s, s + 2.0 * x * s * torch.sigmoid(-2.0 * u) * du
    return value_and_slope(activation, x, fused=False)


@pytest.mark.parametrize("activation", fusedmlp.ACTIVATIONS)
def test_activation_as_accurate_as_eager(isa, activation):
    x = every_bf16_up_to(16.0)
    exact = exact_value_and_slope(activation, x)
    mine = value_and_slope(activation, x, fused=True)
    eager = value_and_slope(activation, x, fused=False)
    for name, ours, theirs, truth in zip(["value", "slope"], mine, eager, exact, strict=True):
        assert ours.dtype == torch.bfloat16, name
        error, eager_error = ulps(ours, truth).flatten(), ulps(theirs, truth).flatten()
        excess = error - eager_error.clamp_min(0.5)
        worst = excess.argmax()
        assert excess[worst] <= ULP_SLACK, (
            name,
            x.flatten()[worst].item(),
            error[worst].item(),
            eager_error[worst].item(),
        )
        share, eager_share = (error > 0.5).double().mean(), (eager_error > 0.5).double().mean()
        assert share <= eager_share + SHARE_SLACK, (name, share.item(), eager_share.item())


def test_the_tail_polynomial_is_the_fit_scripts():
    """vector_math.h's v_erfc_tail_poly coefficients are what scripts/fit_erfc_tail.py derives,
    and the fit's worst relative error is the one the header states (1.8e-7)."""
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(
        "fit_erfc_tail", root / "scripts" / "fit_erfc_tail.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    coefficients, worst = script.fit()
    header = (root / "csrc" / "cpu" / "vector_math.h").read_text()
    table = re.search(r"v_erfc_tail_poly\b.*?q\[\] = \{(.*?)\};", header, re.S)
    assert table is not None
    in_header = torch.tensor([float(c.strip().rstrip("f")) for c in table.group(1).split(",")])
    # a float32 ulp or two: another BLAS's least squares may round a last bit the other way
    torch.testing.assert_close(in_header, coefficients.float(), rtol=2.5e-7, atol=0.0)
    assert worst <= 1.8e-7
