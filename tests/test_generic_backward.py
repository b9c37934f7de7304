"""The backward that CUDA runs (python/fusedmlp/autograd.py: ATen GEMMs around
fusedmlp::activation_backward / gated_backward, grad_x of the gated block as one addmm
accumulation), run here on CPU by turning off the CPU's one-op backward, against
PyTorch's autograd in float64."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
from conftest import ACTIVATIONS, reference_activation
from fusedmlp import autograd


@pytest.fixture
def generic_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autograd, "_whole_backward_on_cpu", lambda x: False)


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors if t is not None]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_gradients(generic_backward: None, activation: str, bias: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    dim, hidden, rows = 6, 10, 5
    tensors = [
        torch.randn(rows, dim, generator=generator, dtype=torch.float64),
        torch.randn(hidden, dim, generator=generator, dtype=torch.float64),
        torch.randn(hidden, dim, generator=generator, dtype=torch.float64),
        torch.randn(dim, hidden, generator=generator, dtype=torch.float64),
    ]
    biases = [
        torch.randn(n, generator=generator, dtype=torch.float64) if bias else None
        for n in (hidden, hidden, dim)
    ]
    fused_inputs, reference_inputs = leaves(*tensors, *biases), leaves(*tensors, *biases)

    def call(inputs: list[torch.Tensor], fused: bool) -> torch.Tensor:
        x, w_gate, w_up, w_down, *rest = inputs
        b_gate, b_up, b_down = rest if bias else (None, None, None)
        if fused:
            return fusedmlp.gated_mlp(x, w_gate, w_up, w_down, activation, b_gate, b_up, b_down)
        act = reference_activation(activation)
        gate = torch.nn.functional.linear(x, w_gate, b_gate)
        up = torch.nn.functional.linear(x, w_up, b_up)
        return torch.nn.functional.linear(act(gate) * up, w_down, b_down)

    grad_y = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
    call(fused_inputs, True).backward(grad_y)
    call(reference_inputs, False).backward(grad_y)
    for got, want in zip(fused_inputs, reference_inputs, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_gradients(generic_backward: None, activation: str) -> None:
    generator = torch.Generator().manual_seed(8)
    sizes = [5, 7, 3]
    x = torch.randn(4, sizes[0], generator=generator, dtype=torch.float64)
    weights = [
        torch.randn(o, i, generator=generator, dtype=torch.float64)
        for i, o in zip(sizes[:-1], sizes[1:])
    ]
    biases = [torch.randn(o, generator=generator, dtype=torch.float64) for o in sizes[1:]]
    fused_inputs, reference_inputs = leaves(x, *weights, *biases), leaves(x, *weights, *biases)
    fused = fusedmlp.mlp(fused_inputs[0], fused_inputs[1:3], fused_inputs[3:], activation)
    h = reference_inputs[0]
    for layer in range(2):
        h = torch.nn.functional.linear(h, reference_inputs[1 + layer], reference_inputs[3 + layer])
        h = reference_activation(activation)(h) if layer == 0 else h
    grad_y = torch.randn(fused.shape, generator=generator, dtype=torch.float64)
    fused.backward(grad_y)
    h.backward(grad_y)
    for got, want in zip(fused_inputs, reference_inputs, strict=True):
        torch.testing.assert_close(got.grad, want.grad)
