"""The CPU ops really run on ATen's thread pool."""

from __future__ import annotations

from pathlib import Path

import fusedmlp._C


def test_extension_hands_its_tasks_to_atens_pool_through_the_stable_abi() -> None:
    # _C reaches ATen's pool through the stable ABI's torch_parallel_for, whatever pool
    # torch was built with; an OpenMP region of its own (at::parallel_for compiled inline)
    # would tie it to torch's OpenMP runtime, and without -fopenmp run on one thread.
    binary = Path(fusedmlp._C.__file__).read_bytes()
    assert b"torch_parallel_for" in binary
    assert b"GOMP_parallel" not in binary
