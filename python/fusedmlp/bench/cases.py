"""The benchmark's cases: for each, an eager PyTorch module, the same computation as fused
modules sharing its parameters, an input, and the FLOPs one call costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fusedmlp.convert import convert
from fusedmlp.modules import FusedGatedMLP
from fusedmlp.tools.eager_blocks import GatedBlock, linear_chain


@dataclass(frozen=True)
class Case:
    """One benchmark shape. kind: "chain" (Linear + activation layers, the activation after
    every layer but the last unless final_activation) or "gated" (down(act(gate(x)) * up(x)),
    sizes = (dim, hidden)); train: time forward + backward instead of a no-grad forward."""

    name: str
    description: str
    kind: str
    rows: int
    sizes: tuple[int, ...]
    activation: str
    quick_rows: int
    quick_sizes: tuple[int, ...]
    final_activation: bool = False
    gemm_bound: bool = False  # report GFLOP/s as a fraction of the machine's peak
    train: bool = False

    def shape(self, quick: bool) -> tuple[int, tuple[int, ...]]:
        return (self.quick_rows, self.quick_sizes) if quick else (self.rows, self.sizes)


CASES: list[Case] = [
    Case("study_linear", "study: Linear+GELU(tanh), 64x128 tokens, 768 -> 3072", "chain",
         8192, (768, 3072), "gelu_tanh", 8, (16, 24), final_activation=True, gemm_bound=True),
    Case("study_gated", "study: GeGLU block, 64x128 tokens, 768 -> 3072 -> 768", "gated",
         8192, (768, 3072), "gelu_tanh", 8, (16, 24), gemm_bound=True),
    Case("study_mlp", "study: 3-layer GELU MLP, 2048 tokens, 768 -> 3072 -> 3072 -> 768", "chain",
         2048, (768, 3072, 3072, 768), "gelu", 8, (16, 24, 24, 16), gemm_bound=True),
    Case("gated_1024", "GeGLU block, 1024 tokens, 768 -> 3072 -> 768", "gated",
         1024, (768, 3072), "gelu_tanh", 4, (8, 40), gemm_bound=True),
    Case("large_gemm", "large GEMM: Linear+GELU 4096 x 1024 -> 4096", "chain",
         4096, (1024, 4096), "gelu", 5, (33, 17), final_activation=True, gemm_bound=True),
    Case("small_batch", "small-batch inference: 16 x (256->256->256->256) ReLU", "chain",
         16, (256, 256, 256, 256), "relu", 2, (8, 8, 8, 8)),
    Case("single_token", "one token: Linear+GELU(tanh) 1 x 768 -> 3072", "chain",
         1, (768, 3072), "gelu_tanh", 1, (8, 16), final_activation=True),
    Case("gated_token", "one token through the GeGLU block 768 -> 3072 -> 768", "gated",
         1, (768, 3072), "gelu_tanh", 1, (8, 40)),
    Case("narrow_tall", "narrow and tall: 65536 x (64->128->128->64) ReLU", "chain",
         65536, (64, 128, 128, 64), "relu", 100, (4, 8, 8, 4)),
    Case("train_step", "training step fwd+bwd: 256 x (512->512->512->512) ReLU", "chain",
         256, (512, 512, 512, 512), "relu", 6, (8, 12, 8, 4), train=True),
    Case("train_small", "small training step fwd+bwd: 16 x (256->256->256->256) ReLU", "chain",
         16, (256, 256, 256, 256), "relu", 2, (8, 8, 8, 8), train=True),
    Case("train_gated", "GeGLU block fwd+bwd, 256 tokens, 768 -> 3072 -> 768", "gated",
         256, (768, 3072), "gelu_tanh", 4, (8, 40), train=True),
]


def gemm_flops(case: Case, rows: int, sizes: tuple[int, ...]) -> int:
    """The FLOPs of the GEMMs one call runs: the forward's and, training, the backward's: a dW
    GEMM per forward GEMM, and a dX GEMM per forward GEMM but those that read x (the input
    needs no gradient, so neither eager nor fused autograd computes one)."""
    if case.kind == "gated":
        dim, hidden = sizes
        forward = 2 * rows * 3 * dim * hidden
        reading_x = 2 * rows * 2 * dim * hidden  # gate's and up's
    else:
        layers = [2 * rows * a * b for a, b in zip(sizes[:-1], sizes[1:])]
        forward, reading_x = sum(layers), layers[0]
    return 3 * forward - reading_x if case.train else forward


def build_modules(
    case: Case, sizes: tuple[int, ...], device: str, dtype: torch.dtype
) -> tuple[nn.Module, nn.Module]:
    """(eager, fused), the fused one sharing the eager one's parameters where it can."""
    torch.manual_seed(0)
    if case.kind == "gated":
        eager = GatedBlock(*sizes, case.activation).to(device, dtype)
        fused = FusedGatedMLP(*sizes, activation=case.activation, bias=False)
        fused = fused.to(device, dtype)
        fused.load_state_dict(eager.state_dict())
        return eager, fused
    eager = linear_chain(sizes, case.activation, case.final_activation).to(device, dtype)
    return eager, convert(eager)


def make_input(rows: int, sizes: tuple[int, ...], device: str, dtype: torch.dtype) -> Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, sizes[0], generator=generator).to(device, dtype)


def inference_call(module: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], Tensor]:
    def call() -> Tensor:
        with torch.no_grad():
            return module(x)

    return call


def training_call(
    module: Callable[[Tensor], Tensor], parameters: list[nn.Parameter], x: Tensor
) -> Callable[[], None]:
    def call() -> None:
        for parameter in parameters:
            parameter.grad = None
        module(x).sum().backward()

    return call
