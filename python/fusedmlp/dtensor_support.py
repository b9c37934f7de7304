"""DTensor support, loaded with DTensor rather than with fusedmlp.

Importing torch.distributed.tensor costs 1-2 s, more than half of `import torch`, and a
DTensor can only exist once that module is loaded. So fusedmlp registers its sharding rules
(sharding.py) right after torch.distributed.tensor finishes loading, whenever that happens,
and tells a DTensor apart without importing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether t is a DTensor: an exact type test (isinstance costs ~5x more on every
    forward), False while torch.distributed.tensor is not loaded."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and type(t) is getattr(module, "DTensor", None)


def _register_sharding_rules() -> None:
    from . import sharding  # noqa: F401  (registers the rules as it loads)


class _AfterDTensorLoads(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.tensor as the other finders would, and registers the
    sharding rules once its module has run; then leaves sys.meta_path."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DTENSOR_MODULE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            run_module(module)
            _register_sharding_rules()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Registers the sharding rules now if DTensor is loaded, else as soon as it is."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR_MODULE in sys.modules:
        _register_sharding_rules()
    else:
        sys.meta_path.insert(0, _AfterDTensorLoads())
