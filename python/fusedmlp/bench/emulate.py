"""`--emulate-cpu LEVEL`: the bench as a CPU whose best instruction set is LEVEL would run it.

Forcing only our kernels to a lower level (FUSEDMLP_ISA=avx2) on a CPU with AVX-512 compares an
AVX2 CPU's fusedmlp with an AVX-512 CPU's eager: torch's GEMMs (MKL, oneDNN) and its pointwise
kernels (ATen's CPU capability) still use every instruction the CPU has, and on an Intel Xeon
AVX2's FMA peak is half of AVX-512's. An AVX2-only CPU is emulated by limiting torch too:

- MKL_ENABLE_INSTRUCTIONS: MKL's code path on Intel CPUs (MKL_VERBOSE=1 names it in its banner;
  on others MKL takes its generic path, which names none);
- ONEDNN_MAX_CPU_ISA: oneDNN's (ONEDNN_VERBOSE=1 prints it; torch then also stops sending
  bfloat16 matmuls to oneDNN, as on a CPU without AVX-512);
- ATEN_CPU_CAPABILITY: ATen's vectorised kernels (torch.backends.cpu.get_cpu_capability()),
  which Inductor's generated code follows too.

An x86 CPU without AVX2 (`portable`) is emulated the same way, torch limited to its lowest
paths (MKL's SSE4.2, oneDNN's SSE4.1, ATen's DEFAULT kernels). FUSEDMLP_ISA=portable alone would
force our portable kernels; such a CPU runs by default what the registry gives a level not
measured to beat eager (ATen's GEMM with our portable epilogue, our kernels for inference calls
of a few rows: README), so the emulation has the registry choose at that level
(FUSEDMLP_CPU_GEMM=auto). MKL follows MKL_ENABLE_INSTRUCTIONS on Intel CPUs only: on others
(AMD) its generic path keeps its AVX2 GEMMs, for eager and for the ATen path alike.

Each library reads its variable once, when it loads or first runs, so the bench runs itself
again in a child process with them set (child_command), and the child, finding them in place
(environment_matches), runs the sweep. The child compiles into a torch.compile cache of its own
(inductor_cache_dir)."""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from collections.abc import Mapping

import torch

from fusedmlp.registry import cpu_isas


class Emulation:
    def __init__(self, level: str, environment: dict[str, str], capability: str) -> None:
        self.level = level  # the registry's name of the level our kernels run at
        self.environment = environment  # what limits fusedmlp and torch to it
        self.capability = capability  # torch.backends.cpu.get_cpu_capability() under it


EMULATIONS = {
    "avx2": Emulation(
        "avx2",
        {
            "FUSEDMLP_ISA": "avx2",
            "FUSEDMLP_CPU_GEMM": "auto",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2",
        },
        "AVX2",
    ),
    "portable": Emulation(
        "portable",
        {
            "FUSEDMLP_ISA": "portable",
            "FUSEDMLP_CPU_GEMM": "auto",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "ATEN_CPU_CAPABILITY": "default",
        },
        "DEFAULT",
    ),
}


def environment_matches(emulation: Emulation, environ: Mapping[str, str]) -> bool:
    """Whether `environ` limits a process to the emulated level already (the child's does)."""
    return all(environ.get(name) == value for name, value in emulation.environment.items())


def inductor_cache_dir(emulation: Emulation, environ: Mapping[str, str]) -> str:
    """A torch.compile cache for the emulated level alone, inside the one the parent uses.
    Sharing it, torch 2.14.1's Inductor handed a `portable` run kernels it had generated at the
    CPU's full level (AVX-512 vectors) to compile against DEFAULT's headers, which lack them:
    a C++ compile error in every case it had compiled before."""
    parent = environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
    )
    return os.path.join(parent, f"emulate-{emulation.level}")


def child_command(emulation: Emulation, argv: list[str],
                  environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The bench run again with `argv`, and the environment that limits it to the level.
    Refuses a level above this CPU's: an emulation can only take instructions away."""
    supported = {isa.name for isa in cpu_isas() if isa.supported}
    if emulation.level not in supported:
        raise SystemExit(f"--emulate-cpu {emulation.level}: this CPU lacks {emulation.level}")
    environment = {**environ, **emulation.environment,
                   "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(emulation, environ)}
    return [sys.executable, "-m", "fusedmlp.bench", *argv], environment


def check_in_effect(emulation: Emulation) -> None:
    """Stops the run where torch ignored the limit (a torch that reads other variables)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != emulation.capability:
        raise SystemExit(f"--emulate-cpu {emulation.level}: torch still runs {capability} "
                         f"kernels under {emulation.environment}")


def describe(emulation: Emulation) -> str:
    """The report's line on what was limited."""
    limits = ", ".join(f"{name}={value}" for name, value in emulation.environment.items())
    return f"emulated {emulation.level} CPU: fused and eager both limited ({limits})"
