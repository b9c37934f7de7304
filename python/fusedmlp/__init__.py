"""fusedmlp: fused Linear and MLP layers for PyTorch, as custom ops with C and CUDA C kernels."""

from . import _extension

# Before anything reads fusedmlp._C: a clear error when it does not match the installed torch.
_extension.load()

from . import dtensor_support  # noqa: E402
from .activations import ACTIVATIONS  # noqa: E402
from .convert import convert  # noqa: E402
from .functional import gated_mlp, linear, mlp  # noqa: E402
from .modules import FusedGatedMLP, FusedLinear, FusedMLP  # noqa: E402
from .weight_cache import clear_weight_cache, weight_cache_info  # noqa: E402

dtensor_support.install()

__all__ = [
    "ACTIVATIONS",
    "FusedGatedMLP",
    "FusedLinear",
    "FusedMLP",
    "clear_weight_cache",
    "convert",
    "gated_mlp",
    "linear",
    "mlp",
    "weight_cache_info",
]
