"""FusedMLP and FusedGatedMLP under DistributedDataParallel (gloo, 2 processes on this machine,
loopback only): per-step gradients and final weights match single-process training on the
whole batch, and single-process training of the equivalent plain-PyTorch modules.

The ranks are started by distributed_spawn.run_ranks; float64 keeps the comparison tight (DDP
averages the ranks' gradients, which only reorders a sum).
"""

from __future__ import annotations

import fusedmlp
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_spawn import run_ranks
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

WORLD_SIZE = 2
STEPS = 4
BATCH = 8  # global batch, split evenly between the ranks
DIM, HIDDEN, OUT = 12, 24, 5
TIMEOUT_S = 90

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def make_model(kind: str) -> nn.Module:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    if kind == "mlp":
        return fusedmlp.FusedMLP([DIM, HIDDEN, HIDDEN, OUT], activation="gelu", dtype=torch.float64)
    return fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="silu", bias=True, dtype=torch.float64)


def plain_model(kind: str) -> nn.Module:
    """The nn.Linear equivalent, with the same state_dict keys and initial weights."""
    if kind == "mlp":
        model: nn.Module = nn.Sequential(
            nn.Linear(DIM, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, OUT),
        )
    else:
        model = PlainGated()
    model = model.double()
    model.load_state_dict(make_model(kind).state_dict())
    return model


class PlainGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN)
        self.up_proj = nn.Linear(DIM, HIDDEN)
        self.down_proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def batch(kind: str, step: int) -> tuple[Tensor, Tensor]:
    """Step `step`'s global batch: inputs of shape (BATCH, 3, DIM) and targets."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 3, DIM, generator=generator, dtype=torch.float64)
    out = OUT if kind == "mlp" else DIM
    return x, torch.randn(BATCH, 3, out, generator=generator, dtype=torch.float64)


def train(model: nn.Module, kind: str, rank: int, world_size: int) -> dict[str, list]:
    """SGD with momentum on this rank's share of each batch; records the gradients each step
    and the final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    share = BATCH // world_size
    grads: list[dict[str, Tensor]] = []
    for step in range(STEPS):
        x, target = batch(kind, step)
        rows = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        F.mse_loss(model(x[rows]), target[rows]).backward()
        grads.append({name: p.grad.detach().clone() for name, p in _named(model)})
        optimizer.step()
    final = {name: p.detach().clone() for name, p in _named(model)}
    return {"grads": grads, "params": final}


def _named(model: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names without DDP's "module." prefix."""
    return [(name.removeprefix("module."), p) for name, p in model.named_parameters()]


def rank_main(rank: int, world_size: int) -> dict[str, dict]:
    """One DDP rank: trains both models, returns what it saw."""
    return {
        kind: train(DistributedDataParallel(make_model(kind)), kind, rank, world_size)
        for kind in ("mlp", "gated")
    }


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(rank_main, WORLD_SIZE, tmp_path_factory.mktemp("ddp"), TIMEOUT_S)


@pytest.mark.parametrize("kind", ["mlp", "gated"])
def test_ddp_matches_single_process(ddp_results: list[dict], kind: str) -> None:
    single = train(make_model(kind), kind, rank=0, world_size=1)
    plain = train(plain_model(kind), kind, rank=0, world_size=1)
    for rank, results in enumerate(ddp_results):
        ddp = results[kind]
        for step in range(STEPS):
            for name, grad in single["grads"][step].items():
                # Every rank holds the all-reduced (averaged) gradient of the whole batch.
                torch.testing.assert_close(
                    ddp["grads"][step][name], grad, msg=f"rank {rank} step {step} grad {name}"
                )
        for name, param in single["params"].items():
            torch.testing.assert_close(ddp["params"][name], param, msg=f"rank {rank} {name}")
    for name, param in single["params"].items():
        torch.testing.assert_close(param, plain["params"][name], msg=f"fused vs nn: {name}")
    # Training moved the weights: the comparison is not between untouched initial values.
    initial = dict(_named(make_model(kind)))
    assert any(not torch.equal(initial[n], p) for n, p in single["params"].items())
