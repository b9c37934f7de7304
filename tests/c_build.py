"""Builds plain-C kernel test programs (no torch) with AddressSanitizer and UBSan, each
registered ISA's kernel units compiled with the flags setup.py gives them (both read the
registry csrc/include/fusedmlp/cpu_isas.def), and runs them per instruction set: natively,
or cross-compiled for aarch64 and run under qemu-user (AARCH64)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from fusedmlp.registry import CpuIsa, cpu_isas

ROOT = Path(__file__).resolve().parent.parent
CPU_DIR = ROOT / "csrc" / "cpu"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
COMMON = [
    "-std=c11",
    "-g",
    "-O1",
    "-Wall",
    "-Wextra",
    "-Wpointer-arith",
    "-Werror",
    f"-I{ROOT / 'csrc' / 'include'}",
    f"-I{CPU_DIR}",
]
ISAS: dict[str, CpuIsa] = {isa.name: isa for isa in cpu_isas()}


REGISTRY = ROOT / "csrc" / "include" / "fusedmlp" / "cpu_isas.def"


def registry_isas() -> list[tuple[str, str, tuple[str, ...]]]:
    """(ID, name, compiler flags) of each FMLP_ISA line of the registry, in its order."""
    lines = re.findall(r'^FMLP_ISA\((\w+), (\w+), "([^"]*)",', REGISTRY.read_text(), re.MULTILINE)
    return [(isa_id, name, tuple(flags.split())) for isa_id, name, flags in lines]


def registry_architectures() -> dict[str, str | None]:
    """Each ISA's name -> the architecture whose features it names (None: any), as
    setup.py and api.c tell them apart."""
    lines = re.findall(r"^FMLP_ISA\((\w+), (\w+), .*,(.*)\)$", REGISTRY.read_text(), re.MULTILINE)
    return {
        name: "aarch64"
        if "FMLP_ARM_FEATURE(" in features
        else "x86"
        if "FMLP_FEATURE(" in features
        else None
        for _, name, features in lines
    }


def registry_units() -> list[tuple[str, str, str]]:
    """(DTYPE, ISA_ID, suffix) of each FMLP_KERNELS line of the registry, in its order."""
    return re.findall(r"^FMLP_KERNELS\((\w+), (\w+), (\w+)\)", REGISTRY.read_text(), re.MULTILINE)


def registry_beats_eager() -> set[str]:
    """The names of the ISAs the registry marks FMLP_BEATS_EAGER."""
    ids = set(re.findall(r"^FMLP_BEATS_EAGER\((\w+)\)$", REGISTRY.read_text(), re.MULTILINE))
    return {name for isa_id, name, _ in registry_isas() if isa_id in ids}


def kernel_unit_sources() -> dict[Path, str]:
    """Each kernel unit's source -> its ISA's name (suffix <dtype>_<isa name>)."""
    return {
        CPU_DIR / f"kernels_{suffix}.c": suffix.split("_", 1)[1]
        for _, _, suffix in registry_units()
    }


@dataclass(frozen=True)
class CTarget:
    """Where the C tests are built for and how their binaries run there."""

    architecture: str  # as registry_architectures() names it
    compiler: str
    flags: tuple[str, ...]  # sanitizers and their optimization
    runner: tuple[str, ...]  # the command line's prefix

    def units(self) -> dict[Path, str]:
        """The kernel units of this architecture's ISAs (the ones api.c dispatches to)."""
        architectures = registry_architectures()
        return {
            path: isa
            for path, isa in kernel_unit_sources().items()
            if architectures[isa] in (None, self.architecture)
        }


_MACHINE = platform.machine().lower()
NATIVE = CTarget(
    "aarch64" if _MACHINE in ("aarch64", "arm64") else "x86",
    "gcc",
    tuple(SANITIZE),
    (),
)
# Debian's cross compiler and user-mode emulator (scripts/setup.sh installs them). qemu-user
# cannot host AddressSanitizer's shadow memory, so UBSan alone checks there, at -O2: the
# emulation is ~10-30x slower than the CPU.
AARCH64 = CTarget(
    "aarch64",
    "aarch64-linux-gnu-gcc",
    ("-O2", "-fsanitize=undefined", "-fno-sanitize-recover=all"),
    ("qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"),
)


def require_aarch64_tools() -> None:
    """Skips without the cross tools, with the reason, except in CI, which must run them."""
    missing = [tool for tool in (AARCH64.compiler, AARCH64.runner[0]) if shutil.which(tool) is None]
    if missing and os.environ.get("CI") != "true":
        pytest.skip(
            f"needs {missing}: scripts/setup.sh test installs them (apt-get install "
            "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)"
        )
    assert not missing, f"CI must run the aarch64 tests: {missing} not installed"


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, " ".join(command) + "\n" + result.stdout + result.stderr


# The portable units (float32's is the vector-extension one) built for 256-bit vectors with
# AVX2 and FMA, instead of 128-bit SSE2: the speed proxy for the ARM kernels
# (scripts/vector_proxy.py), and its C tests.
VECTOR_256_FLAGS = {"portable": ("-mavx2", "-mfma", "-ffp-contract=fast", "-DFMLP_VECTOR_BYTES=32")}


def build_c_test(
    source: Path,
    output: Path,
    link_flags: tuple[str, ...] = (),
    target: CTarget = NATIVE,
    isa_flags: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Each ISA's kernel units become objects with that ISA's flags (isa_flags: other flags
    for some ISAs' units); the rest (the API, the units built without flags) is built with
    none, as in setup.py."""
    units = target.units()
    flags = {name: flags for _, name, flags in registry_isas()}
    flags.update(isa_flags or {})
    objects = []
    for path, isa in units.items():
        if flags[isa]:
            obj = output.parent / f"{path.stem}.o"
            run(
                [
                    target.compiler,
                    *COMMON,
                    *target.flags,
                    *flags[isa],
                    "-c",
                    str(path),
                    "-o",
                    str(obj),
                ]
            )
            objects.append(str(obj))
    others = sorted(
        str(p)
        for p in CPU_DIR.glob("*.c")
        if p not in kernel_unit_sources() or (p in units and not flags[units[p]])
    )
    run(
        [
            target.compiler,
            *COMMON,
            *target.flags,
            str(source),
            *others,
            *objects,
            "-lm",
            *link_flags,
            "-o",
            str(output),
        ]
    )


def isa_environment(isa: str) -> dict[str, str]:
    """The environment that runs the kernels for `isa`; skips when the CPU lacks it."""
    if not ISAS[isa].supported:
        pytest.skip(f"this CPU lacks some of {list(ISAS[isa].cpu_features)}")
    return {**os.environ, "FUSEDMLP_ISA": isa}
