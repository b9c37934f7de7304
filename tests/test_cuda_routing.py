"""The CUDA path's decisions that need no GPU (csrc/cuda/routing.c: routes for empty,
size-1 and huge shapes, epilogues per activation, alignments, the batched gate/up
choice, size limits, failure text), checked by tests/c/test_cuda_routing.c under
AddressSanitizer and UBSan on any machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from c_build import COMMON, ROOT


def test_cuda_routing_decisions(tmp_path: Path) -> None:
    binary = tmp_path / "test_cuda_routing"
    sources = [ROOT / "tests" / "c" / "test_cuda_routing.c", ROOT / "csrc" / "cuda" / "routing.c"]
    build = subprocess.run(
        ["gcc", *COMMON, *map(str, sources), "-o", str(binary)], capture_output=True, text=True
    )
    assert build.returncode == 0, build.stdout + build.stderr
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "test_cuda_routing: 0 failed checks"
    assert "runtime error" not in result.stderr


def test_no_switch_in_the_cuda_sources_has_a_default() -> None:
    """Every switch in csrc/cuda lists its cases: an activation (or dtype, route, epilogue)
    added to an enum then fails to build there (-Wswitch, and internal.h's static_assert on
    FMLP_ACT_COUNT for the device code) instead of silently taking a default branch."""
    sources = sorted((ROOT / "csrc" / "cuda").glob("*"))
    assert sources
    offenders = [
        f"{path.name}:{number}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*default\s*:", line)
    ]
    assert offenders == []
