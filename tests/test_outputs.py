"""Outputs own their storage: every forward and training path returns a tensor that is not a
view. FSDP2 hooks module outputs and warns on views (an in-place op on one would skip its
pre-backward hook)."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
from torch import nn

DIM, HIDDEN, OUT = 8, 16, 4


def modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "linear": fusedmlp.FusedLinear(DIM, OUT, activation="relu"),
        "mlp": fusedmlp.FusedMLP([DIM, HIDDEN, HIDDEN, OUT], activation="gelu"),
        "gated_mlp": fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="silu", bias=True),
    }


@pytest.mark.parametrize("kind", ["linear", "mlp", "gated_mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, DIM), (2, 3, DIM), (DIM,)])
@pytest.mark.parametrize("grad", [True, False])
def test_outputs_are_not_views(kind: str, dtype: torch.dtype, shape: tuple, grad: bool) -> None:
    module = modules()[kind].to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.set_grad_enabled(grad):
        y = module(x)
    assert y.grad_fn is not None if grad else y.grad_fn is None
    assert y._base is None
    assert y.shape[:-1] == shape[:-1]


def test_training_op_outputs_are_not_views() -> None:
    x, weight = torch.randn(2, 3, DIM), torch.randn(OUT, DIM, requires_grad=True)
    y, saved = torch.ops.fusedmlp.linear_train(x, weight, None, "relu")
    assert y._base is None and saved._base is None
    # An in-place op on the output is an ordinary in-place op: gradients still match.
    y.mul_(2)
    y.sum().backward()
    expected = torch.autograd.grad(torch.relu(x @ weight.T).mul(2).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, expected)
