"""Activation names, as PyTorch spells them, and their nn.Module counterparts."""

from __future__ import annotations

from torch import nn

from . import _C

# The kernels' registry (csrc/include/fusedmlp/activations.def), in its order.
ACTIVATIONS: tuple[str, ...] = _C.activations()
# Those whose derivative reads their output (its DERIVATIVE column): ReLU's sign.
OUTPUT_DERIVATIVE: frozenset[str] = frozenset(_C.output_derivative_activations())


def check_activation(name: object) -> str:
    """Returns name if it is a known activation, else raises ValueError listing the valid names."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(
            f"fusedmlp: unknown activation {name!r}; valid names are {', '.join(ACTIVATIONS)}"
        )
    return name


def activation_module(name: str) -> nn.Module:
    """The nn.Module computing the activation `name` ("none" is nn.Identity)."""
    modules = {
        "none": nn.Identity,
        "relu": nn.ReLU,
        "gelu": nn.GELU,
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "silu": nn.SiLU,
    }
    return modules[check_activation(name)]()


def activation_name(module: nn.Module) -> str | None:
    """The activation name of an nn.ReLU / nn.GELU / nn.SiLU module, else None."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.SiLU:
        return "silu"
    if type(module) is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return None
