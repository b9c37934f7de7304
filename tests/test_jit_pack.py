"""Ops of up to GEMM_JIT_MAX_ROWS rows (GEMM_JIT_LARGE_MAX_ROWS for ops of at least
GEMM_JIT_LARGE_MULTIPLY_ADDS multiply-adds a row; csrc/cpu/drivers.h) run as one row block
whose products split their columns over the threads and pack each weight block just before
its tiles use it; past the few rows that read weights in place, the threads pack each
product's input once between them and share it. Past the bound, the weights are packed
whole ahead and rows split in blocks. Both sides of the bounds, odd widths, K past one K
block, strided inputs and weights, every dtype and instruction set, one and two threads,
against float64 references."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from conftest import FUNCTIONAL, assert_matches_reference, strided_rows, transposed_layout
from torch import Tensor

JIT_MAX_ROWS = 512  # GEMM_JIT_MAX_ROWS in csrc/cpu/drivers.h
JIT_LARGE_MAX_ROWS = 1024  # GEMM_JIT_LARGE_MAX_ROWS
JIT_LARGE_MULTIPLY_ADDS = 1 << 21  # GEMM_JIT_LARGE_MULTIPLY_ADDS, a row
# just past the few-row path (weights read in place up to 64 rows on AVX-512), both
# sides of the bound
ROWS = (65, JIT_MAX_ROWS - 1, JIT_MAX_ROWS, JIT_MAX_ROWS + 1)
# a large op: past the small ops' bound, both sides of its own
LARGE_ROWS = (JIT_MAX_ROWS + 1, JIT_LARGE_MAX_ROWS, JIT_LARGE_MAX_ROWS + 1)
DIM = 600  # past one K block: float32 cuts K in blocks of at most ~512
GATED_DIM = 2100  # past one K block of gate and up together (float32: 2048 at most, AVX2 in 48 KiB)
WIDTHS = (DIM, 97, 130, 33)  # odd widths: edge panels and tiles


# every test: each dtype, one and two threads
pytestmark = [
    pytest.mark.usefixtures("restore_num_threads"),
    pytest.mark.parametrize("threads", [1, 2]),
    pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16]),
]


def rand(*shape: int, generator: torch.Generator, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=generator) * scale


@pytest.mark.parametrize("rows", ROWS)
def test_chain_around_the_bound(isa, dtype, threads, rows, generator):
    torch.set_num_threads(threads)
    x64 = rand(rows, DIM, generator=generator)
    weights64 = [rand(n, k, generator=generator, scale=k**-0.5) for k, n in zip(WIDTHS, WIDTHS[1:])]
    biases64 = [rand(n, generator=generator) for n in WIDTHS[1:]]
    x = strided_rows(x64.to(dtype))
    weights = [w.to(dtype) for w in weights64]
    weights[1] = transposed_layout(weights[1])
    biases = [b.to(dtype) for b in biases64]
    expected = F.linear(x.double(), weights[0].double(), biases[0].double())
    for w, b in zip(weights[1:], biases[1:]):
        expected = F.linear(F.relu(expected), w.double(), b.double())
    linear = F.gelu(F.linear(x.double(), weights[0].double(), biases[0].double()))
    with torch.no_grad():
        assert_matches_reference(fusedmlp.mlp(x, weights, biases, "relu"), expected)
        assert_matches_reference(fusedmlp.linear(x, weights[0], biases[0], "gelu"), linear)
    trained = [w.detach().requires_grad_() for w in weights]
    y = fusedmlp.mlp(x, trained, biases, "relu")  # the training twin, saving hidden
    assert_matches_reference(y.detach(), expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [DIM, GATED_DIM])
def test_gated_around_the_bound(isa, dtype, threads, rows, dim, generator):
    torch.set_num_threads(threads)
    hidden = 97
    x64 = rand(rows, dim, generator=generator)
    w64 = [
        rand(hidden, dim, generator=generator, scale=dim**-0.5),
        rand(hidden, dim, generator=generator, scale=dim**-0.5),
        rand(dim, hidden, generator=generator, scale=hidden**-0.5),
    ]
    b64 = [
        rand(hidden, generator=generator),
        rand(hidden, generator=generator),
        rand(dim, generator=generator),
    ]
    x = strided_rows(x64.to(dtype))
    w = [t.to(dtype) for t in w64]
    b = [t.to(dtype) for t in b64]
    xd, wd, bd = x.double(), [t.double() for t in w], [t.double() for t in b]
    act = FUNCTIONAL["gelu_tanh"]
    expected = F.linear(act(F.linear(xd, wd[0], bd[0])) * F.linear(xd, wd[1], bd[1]), wd[2], bd[2])
    with torch.no_grad():
        y = fusedmlp.gated_mlp(x, *w, "gelu_tanh", *b)
    assert_matches_reference(y, expected)
    trained = [t.detach().requires_grad_() for t in w]
    y = fusedmlp.gated_mlp(x, *trained, "gelu_tanh", *b)  # the training twin
    assert_matches_reference(y.detach(), expected)


@pytest.mark.parametrize("rows", LARGE_ROWS)
def test_large_linear_around_its_bound(isa, dtype, threads, rows, generator):
    torch.set_num_threads(threads)
    k = DIM
    n = JIT_LARGE_MULTIPLY_ADDS // k + 1  # just large; not whole panels: an edge panel
    x = strided_rows(rand(rows, k, generator=generator).to(dtype))
    w = rand(n, k, generator=generator, scale=k**-0.5).to(dtype)
    b = rand(n, generator=generator).to(dtype)
    expected = F.gelu(F.linear(x.double(), w.double(), b.double()))
    with torch.no_grad():
        assert_matches_reference(fusedmlp.linear(x, w, b, "gelu"), expected)
