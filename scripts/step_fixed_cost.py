"""How much of a small training step is fixed cost (issue 13): times bench train_small's step
(`zero grads; model(x).sum().backward()` on a ReLU chain of 16 rows, eager and FusedMLP
converted from it) at the case's width and at width 8, where the arithmetic is nothing and the
step is the framework's fixed cost (autograd engine, op calls, Python), all taking turns in
every round, and prints the medians, fused/eager at each width, and the size-dependent parts
(full width minus width 8) with their ratio. Beside them a third model, the floor, runs the
same step through one Python autograd.Function that takes the inputs FusedMLP's training
Function takes, saves them as it does, and computes nothing: PyTorch's own cost of the path a
fused step takes (the Function, the autograd engine, AccumulateGrad), which no kernel or glue
of ours can go under:

    PYTHONPATH=python python scripts/step_fixed_cost.py [WIDTH [ROUNDS [THREADS]]]

A step's ratio cannot fall below fused's fixed cost over eager's whole step, however fast the
kernels, nor that fixed cost below the floor's (README, the Zen 3 sweeps)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
from fusedmlp import convert
from fusedmlp.tools.eager_blocks import linear_chain
from torch import nn

ROWS = 16
STEPS_PER_ROUND = 200


class NoArithmetic(torch.autograd.Function):
    """FusedMLP's training Function without its ops: it takes x and the chain's weights and
    biases, saves x and the weights, and returns an output and gradients of the right shapes,
    left uninitialised."""

    @staticmethod
    def forward(ctx, x, n_weights, *parameters):  # type: ignore[override]
        weights = parameters[:n_weights]
        ctx.save_for_backward(x, *weights)
        ctx.shapes = [p.shape for p in parameters]
        return x.new_empty(x.shape[0], weights[-1].shape[0])

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        _ = ctx.saved_tensors  # unpacked (their versions checked) as the fused backward's are
        grads = [grad_y.new_empty(shape) for shape in ctx.shapes]
        return None, None, *grads


class Floor(nn.Module):
    """The floor of a fused step: NoArithmetic over an eager chain's own parameters."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = [m for m in self.chain if isinstance(m, nn.Linear)]
        parameters = [layer.weight for layer in linears] + [layer.bias for layer in linears]
        return NoArithmetic.apply(x, len(linears), *parameters)


def step(model: nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()


def main() -> None:
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    if len(sys.argv) > 3:
        torch.set_num_threads(int(sys.argv[3]))
    torch.manual_seed(0)
    variants: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    for w in (8, width):
        eager = linear_chain((w, w, w, w), "relu")  # bench train_small's model at width w
        x = torch.randn(ROWS, w)
        variants[f"eager {w}"] = (eager, x)
        variants[f"fused {w}"] = (convert(eager), x)
        variants[f"floor {w}"] = (Floor(eager), x)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for model, x in variants.values():
        for _ in range(20):
            step(model, x)
    for _ in range(rounds):
        for name, (model, x) in variants.items():
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                step(model, x)
            times[name].append((time.perf_counter() - start) / STEPS_PER_ROUND * 1e6)
    us = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{ROWS} x ({width} -> {width} -> {width} -> {width}) ReLU training step, "
        f"{torch.get_num_threads()} threads, medians of {rounds} rounds, us"
    )
    for name, value in us.items():
        print(f"  {name:>12}: {value:8.1f}")
    fused_part, eager_part = (
        us[f"fused {width}"] - us["fused 8"],
        us[f"eager {width}"] - us["eager 8"],
    )
    print(
        f"fused/eager: {us[f'fused {width}'] / us[f'eager {width}']:.2f} at width {width}, "
        f"{us['fused 8'] / us['eager 8']:.2f} at width 8 (the fixed cost)"
    )
    print(
        f"above the fixed cost: fused {fused_part:.0f} us, eager {eager_part:.0f} us, "
        f"{fused_part / eager_part:.2f}"
    )
    print(f"fused's fixed cost alone is {us['fused 8'] / us[f'eager {width}']:.2f} of eager's step")
    print(
        f"the floor (one Python autograd node, no arithmetic): {us['floor 8']:.0f} us at width 8, "
        f"{us['floor 8'] / us[f'eager {width}']:.2f} of eager's step; fused's fixed cost "
        f"{us['fused 8'] - us['floor 8']:.0f} us above it"
    )


if __name__ == "__main__":
    main()
