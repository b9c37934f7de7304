"""The CPU ops really run on ATen's thread pool."""

from __future__ import annotations

from pathlib import Path

import fusedmlp._C
import pytest
import torch


@pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="torch's thread pool is not OpenMP"
)
def test_extension_compiles_parallel_for_as_an_openmp_region() -> None:
    # at::parallel_for is an inline `#pragma omp parallel`: built without -fopenmp it
    # compiles to a serial loop and every op silently runs on one thread.
    binary = Path(fusedmlp._C.__file__).read_bytes()
    assert b"GOMP_parallel" in binary
