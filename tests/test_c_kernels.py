"""Builds the plain-C kernel tests (no torch) with AddressSanitizer and UBSan and runs them."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def build_c_test(source: Path, output: Path) -> None:
    kernels = sorted(str(p) for p in (ROOT / "csrc" / "cpu").glob("*.c"))
    command = [
        "gcc",
        "-std=c11",
        "-g",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        *SANITIZE,
        f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{ROOT / 'csrc' / 'cpu'}",
        str(source),
        *kernels,
        "-lm",
        "-o",
        str(output),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)


def test_c_kernels_under_sanitizers(tmp_path: Path) -> None:
    binary = tmp_path / "test_kernels"
    build_c_test(ROOT / "tests" / "c" / "test_kernels.c", binary)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("0 failed")
    assert "runtime error" not in result.stderr  # UBSan findings
