"""fusedmlp: fused Linear and MLP layers for PyTorch, as custom ops with C and CUDA C kernels."""

import torch

from .activations import ACTIVATIONS
from .convert import convert
from .functional import gated_mlp, linear, mlp
from .modules import FusedGatedMLP, FusedLinear, FusedMLP

if torch.distributed.is_available():
    from . import sharding  # noqa: F401  (registers the DTensor sharding rules)

__all__ = [
    "ACTIVATIONS",
    "FusedGatedMLP",
    "FusedLinear",
    "FusedMLP",
    "convert",
    "gated_mlp",
    "linear",
    "mlp",
]
