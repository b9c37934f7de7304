"""The CPU backward of up to BACKWARD_COLUMNS_MAX_ROWS rows (csrc/cpu/backward.h) splits
each product's output columns over the threads and packs its transposed operand a block at a
time, or, where each thread's rows are past the few (here 512 rows on two threads, against
the column split on one), runs every dX over the threads' rows and then every dW over its
rows (rows_then_weights); past the bound, it splits rows. Gradients on both sides of the
bound, a layer wider than one row chunk of a dW (its rows in two input blocks), K past one K
block, a strided input and a transposed-layout weight: against float64 references, and
bit-identical on one and two threads, every dtype and instruction set."""

from __future__ import annotations

from collections.abc import Callable

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from conftest import FUNCTIONAL, strided_rows, tolerances, transposed_layout
from torch import Tensor

MAX_ROWS = 512  # BACKWARD_COLUMNS_MAX_ROWS (= GEMM_JIT_MAX_ROWS) in csrc/cpu/backward.h
# just past the few-row backward (up to 64 rows on AVX-512), the bound, just past it
ROWS = (65, MAX_ROWS, MAX_ROWS + 1)
WIDE = 600  # dW of a layer this wide: rows in two chunks; dX over it: K past one K block

pytestmark = [
    pytest.mark.usefixtures("restore_num_threads"),
    pytest.mark.parametrize("rows", ROWS),
    pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16]),
]


def gradients(call: Callable[..., Tensor], inputs: list[Tensor], grad_y: Tensor) -> list[Tensor]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    return list(torch.autograd.grad(call(*leaves), leaves, grad_y))


def check(
    fused: Callable[..., Tensor],
    reference: Callable[..., Tensor],
    inputs: list[Tensor],
    grad_y: Tensor,
) -> None:
    """fused's gradients on 1 and 2 threads: bit-identical, and close to the reference's in
    float64."""
    torch.set_num_threads(1)
    one = gradients(fused, inputs, grad_y)
    torch.set_num_threads(2)
    two = gradients(fused, inputs, grad_y)
    expected = gradients(reference, [t.double() for t in inputs], grad_y.double())
    for index, (a, b, reference) in enumerate(zip(one, two, expected)):
        assert torch.equal(a, b), f"gradient {index} differs between 1 and 2 threads"
        # bfloat16: every product and grad_pre rounded; the bound scales with the gradient
        scale = reference.abs().max().item() if a.dtype == torch.bfloat16 else 1.0
        tol = tolerances(a.dtype)
        torch.testing.assert_close(
            a.double(),
            reference,
            rtol=tol["rtol"],
            atol=tol["atol"] * scale,
            msg=lambda m, index=index: f"gradient {index}: {m}",
        )


def test_chain_gradients(isa, dtype, rows, generator):
    widths = (130, WIDE, 97)
    x = strided_rows(torch.randn(rows, widths[0], generator=generator).to(dtype))
    weights = [
        (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
        for k, n in zip(widths, widths[1:])
    ]
    weights[1] = transposed_layout(weights[1])
    biases = [torch.randn(n, generator=generator).to(dtype) for n in widths[1:]]
    grad_y = (torch.randn(rows, widths[-1], generator=generator) * rows**-0.5).to(dtype)

    def fused(x: Tensor, w0: Tensor, w1: Tensor, b0: Tensor, b1: Tensor) -> Tensor:
        return fusedmlp.mlp(x, [w0, w1], [b0, b1], "silu")

    def reference(x: Tensor, w0: Tensor, w1: Tensor, b0: Tensor, b1: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, w0, b0)), w1, b1)

    check(fused, reference, [x, *weights, *biases], grad_y)


def test_gated_gradients(isa, dtype, rows, generator):
    dim, hidden = 130, WIDE
    x = strided_rows(torch.randn(rows, dim, generator=generator).to(dtype))
    w_gate, w_up = (
        (torch.randn(hidden, dim, generator=generator) * dim**-0.5).to(dtype) for _ in range(2)
    )
    w_down = transposed_layout(
        (torch.randn(dim, hidden, generator=generator) * hidden**-0.5).to(dtype)
    )
    biases = [torch.randn(n, generator=generator).to(dtype) for n in (hidden, hidden, dim)]
    grad_y = (torch.randn(rows, dim, generator=generator) * rows**-0.5).to(dtype)
    act = FUNCTIONAL["gelu_tanh"]

    def fused(*inputs: Tensor) -> Tensor:
        x, wg, wu, wd, bg, bu, bd = inputs
        return fusedmlp.gated_mlp(x, wg, wu, wd, "gelu_tanh", bg, bu, bd)

    def reference(*inputs: Tensor) -> Tensor:
        x, wg, wu, wd, bg, bu, bd = inputs
        return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    check(fused, reference, [x, w_gate, w_up, w_down, *biases], grad_y)
