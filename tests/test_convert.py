"""fusedmlp.convert() on models mixing convertible and unconvertible parts."""

from __future__ import annotations

import fusedmlp
import torch
from conftest import GatedBlock
from torch import nn


class Block(nn.Module):
    """A transformer-ish block: attention (a built-in holding Linear children), an MLP chain,
    a gated MLP, a Linear followed by a functional activation, and a non-activation module."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))
        self.gated = GatedBlock(16, 24, "silu")
        self.head = nn.Sequential(
            nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 4), nn.Tanh()
        )
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x, x, x, need_weights=False)[0]
        x = x + self.mlp(x)
        x = x + self.gated(x)
        return self.norm(torch.relu(self.proj(self.head(x))))


class LookAlike(nn.Module):
    """Has gate_proj/up_proj/down_proj and an activation, but computes something else."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(6, 10), nn.Linear(6, 10)
        self.down_proj, self.act = nn.Linear(10, 6), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) + self.up_proj(x))


def test_converts_what_it_recognises_and_keeps_outputs():
    torch.manual_seed(0)
    model = Block()
    converted = fusedmlp.convert(model)
    assert converted is not model and isinstance(model.mlp, nn.Sequential)  # original untouched
    assert isinstance(converted.mlp, fusedmlp.FusedMLP)
    assert converted.mlp.activation == "gelu_tanh"
    assert isinstance(converted.gated, fusedmlp.FusedGatedMLP)
    assert converted.gated.activation == "silu"
    assert isinstance(converted.head[0], fusedmlp.FusedLinear)
    assert converted.head[0].activation == "relu" and isinstance(converted.head[1], nn.Identity)
    assert isinstance(converted.head[2], nn.Dropout) and isinstance(converted.head[4], nn.Tanh)
    assert isinstance(converted.head[3], fusedmlp.FusedLinear)
    assert converted.head[3].activation == "none"
    assert isinstance(converted.proj, fusedmlp.FusedLinear)
    # MultiheadAttention reads out_proj's weight itself: left alone
    assert type(converted.attention.out_proj) is type(model.attention.out_proj)
    assert converted.mlp[0].weight is model.mlp[0].weight  # Parameters shared
    assert converted.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(converted(x), model(x))


def test_converted_model_trains_the_same():
    torch.manual_seed(1)
    model = Block()
    reference = Block()
    reference.load_state_dict(model.state_dict())
    converted = fusedmlp.convert(model, inplace=True)
    assert converted is model
    x = torch.randn(3, 4, 16)
    for net in (converted, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        for _ in range(2):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
    for (name, p), q in zip(converted.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_look_alike_gated_module_is_left_alone():
    model = nn.Sequential(LookAlike())
    converted = fusedmlp.convert(model)
    assert isinstance(converted[0], LookAlike)
    assert isinstance(converted[0].gate_proj, fusedmlp.FusedLinear)  # its Linears still convert
    x = torch.randn(3, 6)
    torch.testing.assert_close(converted(x), model(x))


def test_plain_linear_and_already_fused_modules():
    linear = nn.Linear(3, 2)
    assert isinstance(fusedmlp.convert(linear), fusedmlp.FusedLinear)
    fused = fusedmlp.FusedMLP([3, 4, 2])
    assert fusedmlp.convert(fused) is not None
    assert isinstance(fusedmlp.convert(fused), fusedmlp.FusedMLP)
    chain = nn.Sequential(nn.Linear(3, 4), nn.SiLU(), nn.Linear(4, 2))
    assert isinstance(fusedmlp.convert(chain), fusedmlp.FusedMLP)


class ChildActivationBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(6, 10, bias=False), nn.Linear(6, 10, bias=False)
        self.down_proj, self.act_fn = nn.Linear(10, 6, bias=False), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_gated_activation_from_child_or_forward():
    converted = fusedmlp.convert(ChildActivationBlock())
    assert isinstance(converted, fusedmlp.FusedGatedMLP) and converted.activation == "gelu"
    for activation in ["gelu", "gelu_tanh", "silu", "relu"]:
        block = GatedBlock(6, 10, activation)
        fused = fusedmlp.convert(block)
        assert isinstance(fused, fusedmlp.FusedGatedMLP) and fused.activation == activation
        x = torch.randn(3, 6)
        torch.testing.assert_close(fused(x), block(x))
