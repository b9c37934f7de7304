"""Every CPU instruction set (forced with FUSEDMLP_ISA) against the portable kernels and
PyTorch, on sizes that hit every edge-tile case: 1..33 in each dimension, primes, and
sizes past the cache blocks (K 1024, 64 rows read in place, 48-row blocks, 1024 columns)."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
from conftest import assert_matches_reference, reference_linear
from fusedmlp import _C

EDGE = list(range(1, 34))
PRIMES = [37, 61, 97, 127]
# (rows, out, in): one dimension sweeps 1..33 while the others stay odd; then large ones
SHAPES = (
    [(d, 19, 23) for d in EDGE]
    + [(29, d, 23) for d in EDGE]
    + [(29, 19, d) for d in EDGE]
    + [(p, q, r) for p, q, r in zip(PRIMES, reversed(PRIMES), PRIMES[1:] + PRIMES[:1])]
    + [(64, 45, 1100), (65, 33, 1031), (1001, 1031, 67), (7, 1030, 1025)]
)


def portable(fn, *args, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUSEDMLP_ISA", "portable")
        return fn(*args, **kwargs)


def sample(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_every_edge_tile(isa, shape, generator):
    rows, out, inner = shape
    x = sample(rows, inner, generator=generator)
    w = sample(out, inner, generator=generator, scale=inner**-0.5)
    b = sample(out, generator=generator)
    for activation in fusedmlp.ACTIVATIONS:
        y = fusedmlp.linear(x, w, b, activation)
        reference = reference_linear(x.double(), w.double(), b.double(), activation)
        assert_matches_reference(y, reference)
        torch.testing.assert_close(y, portable(fusedmlp.linear, x, w, b, activation))


@pytest.mark.parametrize("transposed", ["x", "weight"])
def test_linear_strided_operands(isa, transposed, generator):
    x = sample(37, 53, generator=generator)
    w = sample(29, 53, generator=generator, scale=53**-0.5)
    if transposed == "x":
        x = x.t().contiguous().t()
    else:
        w = w.t().contiguous().t()
    y = fusedmlp.linear(x, w, None, "gelu")
    assert_matches_reference(y, reference_linear(x.double(), w.double(), None, "gelu"))


# 5..32 rows: the hidden layers hand their outputs over in the kernels' lanes layout
@pytest.mark.parametrize("rows", [1, 5, 9, 16, 17, 32, 33, 64, 65, 300])
def test_mlp_and_gated(isa, rows, generator):
    x = sample(rows, 40, generator=generator)
    shapes = ((40, 70), (70, 33), (33, 50))
    weights = [sample(o, i, generator=generator, scale=i**-0.5) for i, o in shapes]
    biases = [sample(w.shape[0], generator=generator) for w in weights]
    y = fusedmlp.mlp(x, weights, biases, "silu")
    torch.testing.assert_close(y, portable(fusedmlp.mlp, x, weights, biases, "silu"))
    w_gate, w_up = (sample(96, 40, generator=generator, scale=40**-0.5) for _ in range(2))
    w_down = sample(40, 96, generator=generator, scale=96**-0.5)
    y = fusedmlp.gated_mlp(x, w_gate, w_up, w_down, "gelu_tanh")
    expected = portable(fusedmlp.gated_mlp, x, w_gate, w_up, w_down, "gelu_tanh")
    torch.testing.assert_close(y, expected)


def test_special_values_propagate(isa):
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 90.0, -90.0])
    x = values.reshape(-1, 1)
    for activation in fusedmlp.ACTIVATIONS:
        y = fusedmlp.linear(x, torch.ones(1, 1), None, activation)
        expected = portable(fusedmlp.linear, x, torch.ones(1, 1), None, activation)
        torch.testing.assert_close(y, expected, equal_nan=True)


def test_unknown_isa_falls_back_to_the_best(monkeypatch):
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    best = _C.cpu_isa()
    monkeypatch.setenv("FUSEDMLP_ISA", "sse9")
    assert _C.cpu_isa() == best


@pytest.mark.parametrize("rows,dim", [(70, 1030), (13, 2100), (100, 37)])
def test_gated_across_k_blocks_and_saved(isa, rows, dim, generator):
    """The gated kernel keeps gate and up partial sums between K blocks (dim 1030 past
    AVX-512's one block, 2100 past every unit's) and saves them for backward: values and
    gradients match PyTorch."""
    x = sample(rows, dim, generator=generator).requires_grad_()
    w_gate, w_up = (sample(40, dim, generator=generator, scale=dim**-0.5) for _ in range(2))
    w_down = sample(24, 40, generator=generator, scale=40**-0.5)
    bias_up = sample(40, generator=generator)
    y = fusedmlp.gated_mlp(x, w_gate, w_up, w_down, "silu", bias_up=bias_up)
    x64 = x.detach().double().requires_grad_()
    gate = torch.nn.functional.silu(x64 @ w_gate.double().t())
    reference = (gate * (x64 @ w_up.double().t() + bias_up.double())) @ w_down.double().t()
    assert_matches_reference(y, reference.detach())
    y.sum().backward()
    reference.sum().backward()
    assert_matches_reference(x.grad, x64.grad)
