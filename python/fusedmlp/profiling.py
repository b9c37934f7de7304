"""Profiler labels. Under a profiler the CPU kernels label their calls and run a multi-layer
op one layer (a gated block one stage) per call, each under its own label
(fusedmlp.mlp.layer0, fusedmlp.gated_mlp.gate_up, ...); otherwise row blocks run through
every layer in one call and no label is made (the C shim's RecordFunction costs a small call
its time whether or not anything records; the dispatcher gives every op call its own event).
The kernels used to ask ATen whether a profiler records; LibTorch's stable ABI has no such
query, so the Python front end tells them, for the calls it makes while torch's profiler
records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.autograd.profiler as _profiler

from . import _C


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    previous = _C.profiler_records(True)
    try:
        yield
    finally:
        _C.profiler_records(previous)


_AS_USUAL = contextlib.nullcontext()  # reusable: one object for every call


def labelled_layers() -> contextlib.AbstractContextManager[None]:
    """A context in which this thread's fusedmlp ops label their calls and layers when
    torch's profiler records, and run as usual otherwise."""
    return _recording() if _profiler._is_profiler_enabled else _AS_USUAL
