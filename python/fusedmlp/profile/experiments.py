"""The experiments of `python -m fusedmlp.profile`: models, inputs and the four variants (and,
for the gated block on CUDA, Liger's GEGLU MLP when liger_kernel is installed).

Every variant of an experiment shares the eager model's weights, so their outputs must agree.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

import fusedmlp
from fusedmlp.activations import ACTIVATIONS
from fusedmlp.tools.eager_blocks import GatedBlock, linear_chain

EXPERIMENTS = ("linear", "mlp", "gated")
EAGER, COMPILE, FUSED, FUSED_COMPILE = "eager", "compile", "fused", "fused+compile"
ALL_VARIANTS = (EAGER, COMPILE, FUSED, FUSED_COMPILE)
UNCOMPILED_VARIANTS = (EAGER, FUSED)
LIGER = "liger"
MLP_ACTIVATIONS = tuple(name for name in ACTIVATIONS if name != "none")

LINEAR_IN, LINEAR_OUT = 32, 64
MLP_SIZES = (768, 3072, 3072, 768)
GATED_DIM, GATED_HIDDEN, GATED_SEQ = 768, 3072, 128

# Rows of input per experiment. The CPU numbers are shrunk so that the whole default study,
# torch.compile warm-ups included, takes about two minutes on a 2-core machine; the fused
# variants' speed sets most of that time, so re-check it when the CPU kernels change.
DEFAULT_TOKENS = {
    "cuda": {"linear": 1024, "mlp": 8192, "gated": 64 * GATED_SEQ},
    "cpu": {"linear": 1024, "mlp": 2048, "gated": 64 * GATED_SEQ},
}


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    eager: nn.Module
    fused: nn.Module
    inputs: torch.Tensor
    # Variants only this experiment has (run after the common ones), and those it skipped, why.
    extra_variants: dict[str, nn.Module] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def default_tokens(experiment: str, device: torch.device) -> int:
    return DEFAULT_TOKENS["cuda" if device.type == "cuda" else "cpu"][experiment]


def gated_batch_and_seq(tokens: int) -> tuple[int, int]:
    """Split tokens into (batch, seq) with seq = 128 where it divides, else one sequence."""
    if tokens % GATED_SEQ == 0:
        return tokens // GATED_SEQ, GATED_SEQ
    return 1, tokens


def build_linear(tokens: int, device: torch.device, dtype: torch.dtype) -> Experiment:
    eager = nn.Linear(LINEAR_IN, LINEAR_OUT, device=device, dtype=dtype)
    return Experiment(
        name="linear",
        description=f"nn.Linear({LINEAR_IN}, {LINEAR_OUT}) with bias",
        eager=eager,
        fused=fusedmlp.FusedLinear.from_linear(eager),
        inputs=torch.randn(tokens, LINEAR_IN, device=device, dtype=dtype),
    )


def build_mlp(tokens: int, device: torch.device, dtype: torch.dtype, activation: str) -> Experiment:
    eager = linear_chain(MLP_SIZES, activation, device=device, dtype=dtype)
    sizes = " -> ".join(str(size) for size in MLP_SIZES)
    return Experiment(
        name="mlp",
        description=f"3 x nn.Linear with bias, {sizes}, {activation} between",
        eager=eager,
        fused=fusedmlp.FusedMLP.from_sequential(eager),
        inputs=torch.randn(tokens, MLP_SIZES[0], device=device, dtype=dtype),
    )


def liger_block(eager: GatedBlock, device: torch.device) -> nn.Module | str:
    """Liger's GEGLU MLP (gate/up/down Linears around its Triton gelu_tanh * up kernel) with
    the eager block's weights, or why it cannot run here."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install liger-kernel adds it on CUDA)"
    if device.type != "cuda":
        return "Liger's kernels are Triton kernels, which run on CUDA only"
    try:
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
    except ImportError as error:
        return f"liger_kernel is installed but does not import: {error}"
    config = SimpleNamespace(
        hidden_size=GATED_DIM, intermediate_size=GATED_HIDDEN, hidden_act="gelu_pytorch_tanh"
    )
    weight = eager.gate_proj.weight
    block = LigerGEGLUMLP(config).to(weight.device, weight.dtype)
    block.load_state_dict(eager.state_dict())
    return block


def build_gated(tokens: int, device: torch.device, dtype: torch.dtype) -> Experiment:
    eager = GatedBlock(GATED_DIM, GATED_HIDDEN, "gelu_tanh", device, dtype)
    fused = fusedmlp.FusedGatedMLP(
        GATED_DIM, GATED_HIDDEN, activation="gelu_tanh", bias=False, device=device, dtype=dtype
    )
    fused.load_state_dict(eager.state_dict())
    batch, seq = gated_batch_and_seq(tokens)
    liger = liger_block(eager, device)
    return Experiment(
        name="gated",
        description=(
            f"GeGLU down(gelu_tanh(gate(x)) * up(x)), no bias, "
            f"dim {GATED_DIM}, hidden {GATED_HIDDEN}"
        ),
        eager=eager,
        fused=fused,
        inputs=torch.randn(batch, seq, GATED_DIM, device=device, dtype=dtype),
        extra_variants={} if isinstance(liger, str) else {LIGER: liger},
        skipped={LIGER: liger} if isinstance(liger, str) else {},
    )


def build_experiment(
    name: str,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    mlp_activation: str,
) -> Experiment:
    torch.manual_seed(0)
    if name == "linear":
        return build_linear(tokens, device, dtype)
    if name == "mlp":
        return build_mlp(tokens, device, dtype, mlp_activation)
    return build_gated(tokens, device, dtype)


def compile_model(model: nn.Module, device: torch.device) -> Callable[..., torch.Tensor]:
    # On CPU, Inductor's generated C++ kernels are invisible to the profiler unless asked to
    # label themselves; on CUDA they show up as device kernels anyway.
    options = {"cpp.enable_kernel_profile": True} if device.type == "cpu" else None
    return torch.compile(model, fullgraph=True, options=options)


def variant_model(
    experiment: Experiment, variant: str, device: torch.device
) -> Callable[..., torch.Tensor]:
    models: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {
        EAGER: lambda: experiment.eager,
        COMPILE: lambda: compile_model(experiment.eager, device),
        FUSED: lambda: experiment.fused,
        FUSED_COMPILE: lambda: compile_model(experiment.fused, device),
    }
    if variant in experiment.extra_variants:
        return experiment.extra_variants[variant]
    return models[variant]()
