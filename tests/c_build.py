"""Builds plain-C kernel test programs (no torch) with AddressSanitizer and UBSan, each
registered ISA's kernel units compiled with the flags setup.py gives them (both read the
registry csrc/include/fusedmlp/cpu_isas.def), and runs them per instruction set."""

from __future__ import annotations

import os
import re
import subprocess
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
    "-Werror",
    *SANITIZE,
    f"-I{ROOT / 'csrc' / 'include'}",
    f"-I{CPU_DIR}",
]
ISAS: dict[str, CpuIsa] = {isa.name: isa for isa in cpu_isas()}


REGISTRY = ROOT / "csrc" / "include" / "fusedmlp" / "cpu_isas.def"


def registry_isas() -> list[tuple[str, str, tuple[str, ...]]]:
    """(ID, name, compiler flags) of each FMLP_ISA line of the registry, in its order."""
    lines = re.findall(r'^FMLP_ISA\((\w+), (\w+), "([^"]*)",', REGISTRY.read_text(), re.MULTILINE)
    return [(isa_id, name, tuple(flags.split())) for isa_id, name, flags in lines]


def registry_units() -> list[tuple[str, str, str]]:
    """(DTYPE, ISA_ID, suffix) of each FMLP_KERNELS line of the registry, in its order."""
    return re.findall(r"^FMLP_KERNELS\((\w+), (\w+), (\w+)\)", REGISTRY.read_text(), re.MULTILINE)


def kernel_unit_sources() -> dict[Path, str]:
    """Each kernel unit's source -> its ISA's name (suffix <dtype>_<isa name>)."""
    return {
        CPU_DIR / f"kernels_{suffix}.c": suffix.split("_", 1)[1]
        for _, _, suffix in registry_units()
    }


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, " ".join(command) + "\n" + result.stdout + result.stderr


def build_c_test(source: Path, output: Path, link_flags: tuple[str, ...] = ()) -> None:
    """Each ISA's kernel units become objects with that ISA's flags; the rest (the API, the
    portable units) is built with none, as in setup.py."""
    isa_units = {
        path: isa for path, isa in kernel_unit_sources().items() if ISAS[isa].compile_flags
    }
    objects = []
    for path, isa in isa_units.items():
        obj = output.parent / f"{path.stem}.o"
        run(["gcc", *COMMON, *ISAS[isa].compile_flags, "-c", str(path), "-o", str(obj)])
        objects.append(str(obj))
    portable = sorted(str(p) for p in CPU_DIR.glob("*.c") if p not in isa_units)
    run(["gcc", *COMMON, str(source), *portable, *objects, "-lm", *link_flags, "-o", str(output)])


def isa_environment(isa: str) -> dict[str, str]:
    """The environment that runs the kernels for `isa`; skips when the CPU lacks it."""
    if not ISAS[isa].supported:
        pytest.skip(f"this CPU lacks some of {list(ISAS[isa].cpu_features)}")
    return {**os.environ, "FUSEDMLP_ISA": isa}
