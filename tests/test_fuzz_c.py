"""Builds tests/c/fuzz_kernels.c with the C kernels under AddressSanitizer and UBSan and runs it
for a bounded time: random sizes, strides, activations and threading modes against a naive
double-precision reference, plus invalid arguments that must be rejected with a status.

CI runs FUSEDMLP_FUZZ_SECONDS (default 20) with the fixed FUSEDMLP_FUZZ_SEED (default 6).
For a long run on demand:
    FUSEDMLP_FUZZ_SECONDS=1800 FUSEDMLP_FUZZ_SEED=$RANDOM pytest tests/test_fuzz_c.py
or build by hand (the command in build_fuzzer) and run `fuzz_kernels SECONDS [SEED]`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
SECONDS = float(os.environ.get("FUSEDMLP_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("FUSEDMLP_FUZZ_SEED", "6"))

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def build_fuzzer(output: Path) -> None:
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
        str(ROOT / "tests" / "c" / "fuzz_kernels.c"),
        *kernels,
        "-lm",
        "-pthread",
        "-o",
        str(output),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_fuzz_kernels_under_sanitizers(tmp_path: Path) -> None:
    binary = tmp_path / "fuzz_kernels"
    build_fuzzer(binary)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="")
    result = subprocess.run(
        [str(binary), str(SECONDS), str(SEED)],
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
        env=env,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    summary = re.search(r"(\d+) iterations .* (\d+) checks, (\d+) failed", result.stdout)
    assert summary is not None, report[-6000:]
    iterations, checks, failed = (int(group) for group in summary.groups())
    assert failed == 0
    assert iterations > 10 and checks > 1000  # it really ran
    assert "runtime error" not in result.stderr  # UBSan findings
    assert "ERROR: LeakSanitizer" not in result.stderr
