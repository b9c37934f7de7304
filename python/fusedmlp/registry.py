"""What the kernels take, as the built extension reports it: the CPU instruction sets of the
registry csrc/include/fusedmlp/cpu_isas.def and the dtypes of each device's kernels, which the
fake kernels, the C test build, the tests and the bench read instead of restating them. (The
activation names are fusedmlp.ACTIVATIONS.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from . import _C

# The dtypes each device's kernels take (from the torch layer); other devices
# (meta) take any floating dtype.
DEVICE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    device: tuple(getattr(torch, name) for name in names)
    for device, names in _C.device_dtypes().items()
}


class CpuIsa(NamedTuple):
    name: str  # as FUSEDMLP_ISA and _C.cpu_isa() spell it
    compile_flags: tuple[str, ...]  # what its kernel units are built with
    cpu_features: tuple[str, ...]  # what CPUID must report for it
    supported: bool  # by this CPU
    forced_only: bool = False  # detection skips it; only FUSEDMLP_ISA picks it
    bf16_native: bool = False  # its bfloat16 unit multiplies bfloat16 in hardware


def cpu_isas() -> tuple[CpuIsa, ...]:
    """Every registered instruction set, lowest first."""
    return tuple(
        CpuIsa(name, tuple(flags.split()), tuple(features.split()), supported, forced_only,
               bf16_native)
        for name, flags, features, supported, forced_only, bf16_native in _C.cpu_isas()
    )


def detected_cpu_isa(isas: Iterable[CpuIsa]) -> str:
    """The level detection picks from `isas` (cpu_isas(), lowest first): the best this CPU
    supports, forced-only ones aside. FUSEDMLP_ISA forces our kernels, never ATen's GEMM,
    which runs on this level's vectors."""
    return [isa.name for isa in isas if isa.supported and not isa.forced_only][-1]


def cpu_bf16_native() -> bool:
    """Whether the CPU ops' bfloat16 GEMMs run on a unit that multiplies bfloat16 in
    hardware (FMLP_BF16_NATIVE: vdpbf16ps, AMX tiles), rather than as floats on FMAs or in
    ATen: _C.cpu_isa("bfloat16") names such a level."""
    level = _C.cpu_isa("bfloat16")
    return any(isa.bf16_native and isa.name == level for isa in cpu_isas())


HOST_GEMM_PREFIX = "aten+"  # _C.cpu_isa(dtype)'s answer starts so where the GEMMs run in ATen


def cpu_gemm_in_aten(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the CPU ops' GEMMs in `dtype` run in ATen, each followed by our epilogue pass:
    the default where the dtype's kernel unit is at no level measured to beat eager (float64
    everywhere, every dtype on a CPU without AVX2; inference calls of up to 4 rows aside), or
    FUSEDMLP_CPU_GEMM=aten (_C.cpu_isa(dtype) then says "aten+<isa>")."""
    return _C.cpu_isa(str(dtype).removeprefix("torch.")).startswith(HOST_GEMM_PREFIX)
