"""The CPU inference ops' cache of packed weights (csrc/torch/weight_cache.cpp).

Calls nothing will differentiate (no grad, or weights that do not require it) read each
weight packed once for the kernels, keyed on where its values lie, its shape, strides,
dtype, the kernel unit and its version counter, so an in-place update, `load_state_dict`
or `.data =` makes the next call pack it again. The cache holds up to
FUSEDMLP_WEIGHT_CACHE_MB MiB of packed copies, least recently used out first. It is off
unless that variable is set (0, the default, turns it off): writes the version counter does
not see (through `.data`, or memory shared with numpy) are not seen and would leave a stale
copy; call clear_weight_cache() after them."""

from __future__ import annotations

from . import _C


def clear_weight_cache() -> None:
    """Drops every packed weight the cache holds (and the weights it kept alive)."""
    _C.clear_weight_cache()


def weight_cache_info() -> dict[str, int]:
    """{"entries", "bytes", "limit_bytes", "hits", "misses"}: what the cache holds now, its
    bound, and its hits and misses since the last clear."""
    return _C.weight_cache_info()
