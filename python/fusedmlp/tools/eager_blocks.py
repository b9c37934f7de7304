"""The plain-PyTorch blocks that the benchmark and the profiling study compare with."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fusedmlp.activations import activation_module


class GatedBlock(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) without biases: the GeGLU ("gelu_tanh") /
    SwiGLU ("silu") block, with FusedGatedMLP's state_dict keys."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)
        self.act = activation_module(activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def linear_chain(
    sizes: Sequence[int],
    activation: str,
    final_activation: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Sequential:
    """nn.Sequential(Linear, Act, Linear, ..., Linear), with an Act after the last Linear too
    when final_activation."""
    layers: list[nn.Module] = []
    for index, (size_in, size_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(size_in, size_out, device=device, dtype=dtype))
        if final_activation or index < len(sizes) - 2:
            layers.append(activation_module(activation))
    return nn.Sequential(*layers)
