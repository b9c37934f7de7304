"""bfloat16 on the CPU is no less accurate than eager bfloat16: per op, per activation, for
the output and every gradient, the fused result's error against a float64 computation on the
same bfloat16 inputs is at most eager bfloat16's own error there (nn.functional on bfloat16
tensors, oneDNN's kernels), with a margin for the two summing in different orders. Every
instruction set the CPU has runs it (FUSEDMLP_ISA), so each bfloat16 kernel unit does: the
few-row paths (weights read in place) and the packed ones (many rows)."""

from __future__ import annotations

from collections.abc import Callable

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from conftest import FUNCTIONAL
from torch import Tensor

# 4: dot products; 24: the transposed kernel; 150: packed weights (the dpbf16 and AMX
# micro-kernels, their last tile partly filled)
ROWS = [4, 24, 150]
# rounding the same values in another order moves a relative error by a few percent of itself
MARGIN = 1.1


def sample(*shape: int, generator: torch.Generator, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=generator) * scale).bfloat16()


def relative_error(actual: Tensor, reference: Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def outputs_and_gradients(
    block: Callable[..., Tensor], inputs: list[Tensor], dtype: torch.dtype, grad_y: Tensor
) -> list[Tensor]:
    """block's output and the gradients of every input, from copies of inputs in dtype."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    y = block(*leaves)
    y.backward(grad_y.to(dtype))
    return [y.detach()] + [leaf.grad for leaf in leaves]


def assert_no_worse_than_eager(
    fused: Callable[..., Tensor],
    eager: Callable[..., Tensor],
    inputs: list[Tensor],
    out_features: int,
    generator: torch.Generator,
) -> None:
    grad_y = sample(inputs[0].shape[0], out_features, generator=generator)
    reference = outputs_and_gradients(eager, inputs, torch.float64, grad_y)
    ours = outputs_and_gradients(fused, inputs, torch.bfloat16, grad_y)
    theirs = outputs_and_gradients(eager, inputs, torch.bfloat16, grad_y)
    names = ["output"] + [f"grad of input {i}" for i in range(len(inputs))]
    for name, mine, eager_bf16, exact in zip(names, ours, theirs, reference, strict=True):
        assert mine.dtype == torch.bfloat16, name
        error, eager_error = relative_error(mine, exact), relative_error(eager_bf16, exact)
        assert error <= MARGIN * eager_error + 1e-6, (name, error, eager_error)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activation", fusedmlp.ACTIVATIONS)
def test_linear(isa, activation, rows, generator):
    x = sample(rows, 100, generator=generator)  # K past a whole 32: the AMX tail
    w = sample(160, 100, generator=generator, scale=100**-0.5)
    b = sample(160, generator=generator)
    act = FUNCTIONAL[activation]
    assert_no_worse_than_eager(
        lambda x, w, b: fusedmlp.linear(x, w, b, activation),
        lambda x, w, b: act(F.linear(x, w, b)),
        [x, w, b],
        160,
        generator,
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activation", fusedmlp.ACTIVATIONS)
def test_mlp(isa, activation, rows, generator):
    sizes = [(96, 130), (130, 70), (70, 50)]
    inputs = [sample(rows, 96, generator=generator)]
    for fan_in, fan_out in sizes:
        inputs += [sample(fan_out, fan_in, generator=generator, scale=fan_in**-0.5)]
        inputs += [sample(fan_out, generator=generator)]
    act = FUNCTIONAL[activation]

    def eager(x: Tensor, *params: Tensor) -> Tensor:
        for layer in range(3):
            x = F.linear(x, params[2 * layer], params[2 * layer + 1])
            x = act(x) if layer < 2 else x
        return x

    assert_no_worse_than_eager(
        lambda x, *p: fusedmlp.mlp(x, p[0::2], p[1::2], activation), eager, inputs, 50, generator
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activation", fusedmlp.ACTIVATIONS)
def test_gated_mlp(isa, activation, rows, generator):
    dim, hidden = 96, 200
    inputs = [
        sample(rows, dim, generator=generator),
        sample(hidden, dim, generator=generator, scale=dim**-0.5),
        sample(hidden, dim, generator=generator, scale=dim**-0.5),
        sample(dim, hidden, generator=generator, scale=hidden**-0.5),
        sample(hidden, generator=generator),
        sample(hidden, generator=generator),
        sample(dim, generator=generator),
    ]
    act = FUNCTIONAL[activation]

    def eager(
        x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Tensor, bu: Tensor, bd: Tensor
    ) -> Tensor:
        return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    def fused(
        x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Tensor, bu: Tensor, bd: Tensor
    ) -> Tensor:
        return fusedmlp.gated_mlp(x, wg, wu, wd, activation, bg, bu, bd)

    assert_no_worse_than_eager(fused, eager, inputs, dim, generator)


# (rows, K, N): the few-row paths (up to 40 rows) and packed tiles partly filled, K odd or
# short of or past a whole 32 (the AMX tiles' K), N not a multiple of 16 (a tile's columns)
ODD_SHAPES = [(1, 33, 17), (7, 1, 5), (17, 63, 40), (40, 31, 1), (65, 17, 33), (97, 15, 100),
              (131, 65, 47)]


@pytest.mark.parametrize(("rows", "k", "n"), ODD_SHAPES)
def test_linear_odd_shapes(isa, rows, k, n, generator):
    x = sample(rows, k, generator=generator)
    w = sample(n, k, generator=generator, scale=k**-0.5)
    b = sample(n, generator=generator)
    assert_no_worse_than_eager(
        lambda x, w, b: fusedmlp.linear(x, w, b, "gelu"),
        lambda x, w, b: F.gelu(F.linear(x, w, b)),
        [x, w, b],
        n,
        generator,
    )


@pytest.mark.parametrize(("rows", "dim", "hidden"), [(70, 33, 17), (131, 15, 40), (40, 63, 9)])
def test_gated_mlp_odd_shapes(isa, rows, dim, hidden, generator):
    x = sample(rows, dim, generator=generator)
    wg = sample(hidden, dim, generator=generator, scale=dim**-0.5)
    wu = sample(hidden, dim, generator=generator, scale=dim**-0.5)
    wd = sample(dim, hidden, generator=generator, scale=hidden**-0.5)
    assert_no_worse_than_eager(
        lambda x, wg, wu, wd: fusedmlp.gated_mlp(x, wg, wu, wd, "silu"),
        lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
        [x, wg, wu, wd],
        dim,
        generator,
    )


@pytest.mark.parametrize("k", [96, 100])
def test_input_layouts_agree(isa, k, generator):
    """Many rows (packed weights): the same x in every memory layout gives the same bits,
    whether the kernels read its rows in place (the AMX unit, unit column stride and an even
    row stride; the last 22 rows, short of a 32-row tile, packed) or pack them (odd row
    stride, transposed), K whole 32s or with a tail."""
    x = sample(150, k, generator=generator)
    w = sample(70, k, generator=generator, scale=k**-0.5)
    b = sample(70, generator=generator)
    wide = torch.zeros(150, k + 6, dtype=torch.bfloat16)
    odd = torch.zeros(150, k + 3, dtype=torch.bfloat16)
    layouts = {
        "even row stride": wide[:, :k].copy_(x),
        "odd row stride": odd[:, 1 : k + 1].copy_(x),
        "transposed": x.t().contiguous().t(),
    }
    expected = fusedmlp.linear(x, w, b, "gelu").view(torch.int16)
    for name, layout in layouts.items():
        assert torch.equal(fusedmlp.linear(layout, w, b, "gelu").view(torch.int16), expected), name


def test_subnormal_and_nan_results_keep_their_rounding(isa):
    """Results that are subnormal floats (GELU far left: gelu(-13.1875) ~ 4.6e-39) keep their
    bits at the bfloat16 store, and every NaN is stored as 0x7FC0, on the packed path (150
    rows) as on the few-row one (4 rows), which share the activation's code: the AMX unit's
    packed stores round with VCVTNE2PS2BF16, which flushes subnormals and keeps NaN payloads,
    and take the integer rounding for rows holding either. With x zero, each output row is
    gelu(bias)."""
    values = [-13.1875, float("nan"), 1.0, -0.5, -13.1875, 2.0, -13.125, -13.1875]
    bias = torch.tensor(values * 8).bfloat16()
    w = torch.ones(64, 32, dtype=torch.bfloat16)
    few = fusedmlp.linear(torch.zeros(4, 32, dtype=torch.bfloat16), w, bias, "gelu")
    many = fusedmlp.linear(torch.zeros(150, 32, dtype=torch.bfloat16), w, bias, "gelu")
    row = few[0].view(torch.int16)
    subnormal = (row & 0x7F80 == 0) & (row & 0x7F != 0)
    assert subnormal.sum() == 24
    assert (row[bias.isnan()] == 0x7FC0).all()
    assert torch.equal(many.view(torch.int16), row.expand(150, 64))


@pytest.mark.parametrize("rows", [3, 24, 100])
def test_one_rounding_at_the_store(isa, rows, generator):
    """Inputs whose float sums are exact (small integers times 1/256), so the kernels' only
    rounding is the store's: bitwise what PyTorch's float -> bfloat16 conversion gives (nearest,
    ties to even), ties included; NaN stays NaN."""
    x = torch.randint(-8, 9, (rows, 4), generator=generator).bfloat16()
    w = (torch.randint(-255, 256, (96, 4), generator=generator) / 256).bfloat16()
    b = (torch.randint(-255, 256, (96,), generator=generator) / 16).bfloat16()
    x[rows // 2, 1] = float("nan")
    y = fusedmlp.linear(x, w, b, "none")
    expected = (x.float() @ w.float().T + b.float()).bfloat16()
    assert torch.equal(y.isnan(), expected.isnan())
    assert y.isnan()[rows // 2].all()
    finite = ~expected.isnan()
    assert torch.equal(y[finite].view(torch.int16), expected[finite].view(torch.int16))
