"""Builds the plain-C kernel tests (no torch) with AddressSanitizer and UBSan and runs them
once per registered instruction set this CPU has (FUSEDMLP_ISA), each ISA's kernels compiled
with the same flags setup.py gives them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from c_build import ISAS, ROOT, VECTOR_256_FLAGS, build_c_test, isa_environment


@pytest.fixture(scope="module")
def c_test_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("c_kernels") / "test_kernels"
    build_c_test(ROOT / "tests" / "c" / "test_kernels.c", binary)
    return binary


@pytest.mark.parametrize("isa", list(ISAS))
def test_c_kernels_under_sanitizers(c_test_binary: Path, isa: str) -> None:
    env = isa_environment(isa)
    result = subprocess.run(
        [str(c_test_binary)], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == f"isa {isa}"
    assert result.stdout.strip().endswith("0 failed")
    assert "runtime error" not in result.stderr  # UBSan findings


def test_c_kernels_vector_unit_at_256_bits(tmp_path: Path) -> None:
    """The portable float32 unit (vector extensions) built for 256-bit vectors (the speed
    proxy's build, whose 8 x 8 transpose and tiles the 128-bit build never runs) passes the
    same tests."""
    env = isa_environment("avx2")  # skips without AVX2 and FMA
    binary = tmp_path / "test_kernels_vector_256"
    build_c_test(ROOT / "tests" / "c" / "test_kernels.c", binary, isa_flags=VECTOR_256_FLAGS)
    env["FUSEDMLP_ISA"] = "portable"
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "isa portable"
    assert result.stdout.strip().endswith("0 failed")
    assert "runtime error" not in result.stderr
