"""Per-layer profiler labels. Under a profiler the CPU kernels run a multi-layer op one
layer (a gated block one stage) per call, each under its own label (fusedmlp.mlp.layer0,
fusedmlp.gated_mlp.gate_up, ...); otherwise row blocks run through every layer in one call.
The kernels used to ask ATen whether a profiler records; LibTorch's stable ABI has no such
query, and splitting always costs small calls 4-13%, so the Python front end tells them, for
the calls it makes while torch's profiler records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.autograd.profiler as _profiler

from . import _C


@contextlib.contextmanager
def _split() -> Iterator[None]:
    previous = _C.split_for_profiler(True)
    try:
        yield
    finally:
        _C.split_for_profiler(previous)


def labelled_layers() -> contextlib.AbstractContextManager[None]:
    """A context in which this thread's fusedmlp ops run in labelled layers when torch's
    profiler records, and as usual otherwise."""
    return _split() if _profiler._is_profiler_enabled else contextlib.nullcontext()
