"""Autocast for the forward ops: inside torch.autocast, floating inputs (float64 aside) on the
autocast device are cast to the autocast dtype, as nn.Linear's are, then the op runs with
autocast disabled.

torch.library.register_autocast does this for one fixed dtype; ours reads the dtype of the
enclosing torch.autocast at each call (bfloat16 or float16 alike), as ATen's own autocast
kernels do. It lives in Python because the LibTorch stable ABI, which the C++ layer is built
on, has no autocast API."""

from __future__ import annotations

from typing import Any

import torch

from . import _C  # (also registers the ops)

FORWARD_OPS = ("linear", "linear_train", "mlp", "mlp_train", "gated_mlp", "gated_mlp_train")
DEVICE_TYPES = ("cpu", "cuda")

_LIBRARY = torch.library.Library("fusedmlp", "IMPL")


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    """value with each eligible tensor, in it or in its lists, cast to dtype."""
    if isinstance(value, torch.Tensor):
        eligible = (
            value.is_floating_point()
            and value.device.type == device_type
            and value.dtype is not torch.float64
        )
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, device_type, dtype) for item in value)
    return value


def _casts_any(before: Any, after: Any) -> bool:
    """Whether _cast made a new tensor of any tensor in `before`."""
    if isinstance(before, torch.Tensor):
        return after is not before
    if isinstance(before, (list, tuple)):
        return any(_casts_any(b, a) for b, a in zip(before, after))
    return False


def _register(name: str, device_type: str) -> None:
    op = getattr(torch.ops.fusedmlp, name).default
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def autocast_kernel(*args: Any) -> Any:
        dtype = torch.get_autocast_dtype(device_type)
        cast = _cast(args, device_type, dtype)
        # Weights cast here are new tensors each call: packed-weight cache entries for them
        # would never hit, so these calls skip the cache (weight_cache.py). x, the first
        # argument, may be cast or not: weights already in the dtype are still cached.
        paused = _C.pause_weight_cache(_casts_any(args[1:], cast[1:]))
        try:
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
                return op(*cast)
        finally:
            _C.pause_weight_cache(paused)

    # The Python-dispatcher twin, which torch.compile's tracing runs, then the kernel.
    op.py_impl(key)(autocast_kernel)
    _LIBRARY.impl(name, lambda _keyset, *args: autocast_kernel(*args), key_name, with_keyset=True)


for _name in FORWARD_OPS:
    for _device_type in DEVICE_TYPES:
        _register(_name, _device_type)
