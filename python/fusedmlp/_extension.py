"""Loads the compiled extensions: fusedmlp._C (the ops, their CPU kernels) always, and
fusedmlp._C_cuda (the CUDA kernels) only under a CUDA build of torch. _C uses LibTorch's
stable ABI of torch 2.10 only, so one build loads under every torch from 2.10 on; if it
still cannot load, importing fusedmlp fails with an error naming the torch it was built
against (fusedmlp/_build.json, written by the build), the one installed, and the command that
rebuilds it. _C_cuda also uses torch's C++ ABI (its cuBLASLt handle and workspace), which
changes between torch releases: it is loaded only under the release it was built against.
When the CUDA module is missing, built for another torch release or cannot load (built for
another CUDA major version), the CPU ops still run and every CUDA call of an op raises an
error saying why and what to install."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

_PACKAGE = Path(__file__).resolve().parent

# The ops with a CUDA kernel (csrc/torch/op_wrappers.h registers them); the backward ops
# chain_backward and gated_mlp_backward are CPU only.
CUDA_OPS = (
    "linear",
    "linear_train",
    "mlp",
    "mlp_train",
    "gated_mlp",
    "gated_mlp_train",
    "activation_backward",
    "gated_backward",
)


def build_record() -> dict[str, Any]:
    """What the build recorded (setup.py's BuildWithKernels); empty if it wrote nothing."""
    path = _PACKAGE / "_build.json"
    return json.loads(path.read_text()) if path.exists() else {}


def release(version: str) -> str:
    """The release of a torch version, without its local build tag: 2.14.1+cu130 -> 2.14.1."""
    return version.split("+")[0]


def rebuild_command(record: dict[str, Any]) -> str:
    """The command that builds fusedmlp again against the installed torch."""
    source = record.get("source")
    if not source or not (Path(source) / "setup.py").exists():
        source = "<fusedmlp source directory>"
    return f"pip install --no-build-isolation --force-reinstall --no-deps {source}"


def built_against(record: dict[str, Any]) -> str:
    return record.get("torch", "an unknown torch (no fusedmlp/_build.json)")


def mismatch_message(record: dict[str, Any], detail: str) -> str:
    return (
        f"fusedmlp was built against torch {built_against(record)}, but torch "
        f"{torch.__version__} is installed ({detail}). fusedmlp's CPU extension uses torch's "
        f"stable ABI, which torch 2.10 and later releases keep: rebuild it against the "
        f"installed torch with\n    {rebuild_command(record)}"
    )


def load_cpu_module(record: dict[str, Any]) -> None:
    """Imports fusedmlp._C, or raises ImportError saying which torch it was built for."""
    try:
        from . import _C  # noqa: F401
    except ImportError as error:
        raise ImportError(mismatch_message(record, f"loading it failed: {error}")) from error


def cuda_unavailable_reason(record: dict[str, Any]) -> str | None:
    """Loads fusedmlp._C_cuda under a CUDA build of torch; why the CUDA kernels are not
    there, or None when they are (or torch has no CUDA, so no CUDA tensor can reach them)."""
    if torch.version.cuda is None:
        return None
    spec = importlib.util.find_spec("fusedmlp._C_cuda")
    if spec is None or spec.origin is None:
        why = record.get("no_cuda_reason") or "its CUDA module is missing"
        return f"this fusedmlp was built without its CUDA kernels: {why}"
    built = built_against(record)
    if release(built) != release(torch.__version__):
        return (
            f"its CUDA module was built against torch {built} and uses torch's C++ ABI, which "
            f"changes between releases; torch {torch.__version__} is installed"
        )
    try:
        torch.ops.load_library(spec.origin)
    except OSError as error:
        return (
            f"its CUDA module, built for CUDA {record.get('torch_cuda')}, does not load under "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}): {error}"
        )
    return None


def register_cuda_refusals(reason: str, record: dict[str, Any]) -> None:
    """Gives each op with a CUDA kernel one that raises `reason` and the fix instead."""
    message = (
        f"fusedmlp: no CUDA kernels: {reason}. Rebuild fusedmlp with the CUDA toolkit of "
        f"torch's CUDA {torch.version.cuda} (nvcc on PATH or CUDA_HOME):\n"
        f"    FUSEDMLP_CUDA=1 {rebuild_command(record)}"
    )

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    for name in CUDA_OPS:
        torch.library.impl(f"fusedmlp::{name}", "CUDA", refuse)


def load() -> None:
    """Loads the extensions as the module docstring says."""
    record = build_record()
    load_cpu_module(record)
    reason = cuda_unavailable_reason(record)
    if reason is not None:
        register_cuda_refusals(reason, record)
