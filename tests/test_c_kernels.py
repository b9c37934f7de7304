"""Builds the plain-C kernel tests (no torch) with AddressSanitizer and UBSan and runs them
once per instruction set this CPU has (FUSEDMLP_ISA), each ISA's kernels compiled with the
same flags setup.py gives them."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    f"-I{ROOT / 'csrc' / 'cpu'}",
]
# What each ISA needs from /proc/cpuinfo, as in csrc/cpu/isa.c.
CPU_FLAGS_NEEDED = {
    "portable": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma"},
}


def isa_compile_flags() -> dict[str, list[str]]:
    """setup.py's CPU_ISA_FLAGS, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CPU_ISA_FLAGS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no CPU_ISA_FLAGS")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, " ".join(command) + "\n" + result.stdout + result.stderr


def build_c_test(source: Path, output: Path, link_flags: tuple[str, ...] = ()) -> None:
    """Each ISA translation unit becomes an object with its own flags; the rest (the API,
    the portable kernels) is built with none, as in setup.py."""
    flags = isa_compile_flags()
    isa_sources = {ROOT / "csrc" / "cpu" / f"kernels_f32_{isa}.c": isa for isa in flags}
    objects = []
    for path, isa in isa_sources.items():
        obj = output.parent / f"{path.stem}.o"
        run(["gcc", *COMMON, *flags[isa], "-c", str(path), "-o", str(obj)])
        objects.append(str(obj))
    portable = sorted(
        str(p) for p in (ROOT / "csrc" / "cpu").glob("*.c") if p not in isa_sources
    )
    run(["gcc", *COMMON, str(source), *portable, *objects, "-lm", *link_flags, "-o", str(output)])


@pytest.fixture(scope="module")
def c_test_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("c_kernels") / "test_kernels"
    build_c_test(ROOT / "tests" / "c" / "test_kernels.c", binary)
    return binary


def isa_environment(isa: str) -> dict[str, str]:
    """The environment that runs the kernels for `isa`; skips when the CPU lacks it."""
    missing = CPU_FLAGS_NEEDED[isa] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    return {**os.environ, "FUSEDMLP_ISA": isa}


@pytest.mark.parametrize("isa", list(CPU_FLAGS_NEEDED))
def test_c_kernels_under_sanitizers(c_test_binary: Path, isa: str) -> None:
    env = isa_environment(isa)
    result = subprocess.run(
        [str(c_test_binary)], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == f"isa {isa}"
    assert result.stdout.strip().endswith("0 failed")
    assert "runtime error" not in result.stderr  # UBSan findings
