"""Builds tests/c/fuzz_kernels.c with the C kernels under AddressSanitizer and UBSan and runs it
for a bounded time: random sizes, strides, activations and threading modes against a naive
double-precision reference, plus invalid arguments that must be rejected with a status; once
per instruction set the CPU has (FUSEDMLP_ISA), each ISA's kernels built with setup.py's flags.

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
from c_build import ISAS, ROOT, build_c_test, isa_environment

SECONDS = float(os.environ.get("FUSEDMLP_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("FUSEDMLP_FUZZ_SEED", "6"))

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def build_fuzzer(output: Path) -> None:
    build_c_test(ROOT / "tests" / "c" / "fuzz_kernels.c", output, ("-pthread",))


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("fuzz") / "fuzz_kernels"
    build_fuzzer(binary)
    return binary


@pytest.mark.parametrize("isa", list(ISAS))
def test_fuzz_kernels_under_sanitizers(fuzzer: Path, isa: str) -> None:
    """Each instruction set the CPU has gets its share of the time budget."""
    env = dict(isa_environment(isa), ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="")
    seconds = SECONDS / len(ISAS)
    result = subprocess.run(
        [str(fuzzer), str(seconds), str(SEED)],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
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
