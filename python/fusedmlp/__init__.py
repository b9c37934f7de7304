"""fusedmlp: fused Linear and MLP layers for PyTorch, as custom ops with C and CUDA C kernels."""

from . import dtensor_support
from .activations import ACTIVATIONS
from .convert import convert
from .functional import gated_mlp, linear, mlp
from .modules import FusedGatedMLP, FusedLinear, FusedMLP

dtensor_support.install()

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
