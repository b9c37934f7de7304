"""The CPU instruction sets of the kernel registry (csrc/include/fusedmlp/cpu_isas.def), as
the built extension reports them: what the C test build, the tests and the bench's peak loop
read instead of restating them."""

from __future__ import annotations

from typing import NamedTuple

from . import _C


class CpuIsa(NamedTuple):
    name: str  # as FUSEDMLP_ISA and _C.cpu_isa() spell it
    compile_flags: tuple[str, ...]  # what its kernel units are built with
    cpu_features: tuple[str, ...]  # what CPUID must report for it
    supported: bool  # by this CPU


def cpu_isas() -> tuple[CpuIsa, ...]:
    """Every registered instruction set, lowest first."""
    return tuple(
        CpuIsa(name, tuple(flags.split()), tuple(features.split()), supported)
        for name, flags, features, supported in _C.cpu_isas()
    )
