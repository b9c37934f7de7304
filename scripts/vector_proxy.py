"""The speed proxy for the ARM kernels (issue 18, which cannot be timed under qemu): builds
the vector-extension unit for 256-bit vectors with AVX2 and FMA (tests/c_build.py's
VECTOR_256_FLAGS) beside the hand-written AVX2 unit, at -O3, and times both on one thread
(scripts/vector_proxy.c). Needs an x86 CPU with AVX2 and a built extension:

    PYTHONPATH=python python scripts/vector_proxy.py

The target: the vector kernel at >= 0.70 of the AVX2 kernel's speed."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from c_build import NATIVE, VECTOR_256_FLAGS, build_c_test  # noqa: E402

# setup.py's optimisation instead of the sanitizers
SPEED = replace(NATIVE, flags=("-O3", "-fno-math-errno"))


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "vector_proxy"
        build_c_test(
            ROOT / "scripts" / "vector_proxy.c", binary, target=SPEED, isa_flags=VECTOR_256_FLAGS
        )
        subprocess.run([str(binary)], check=True)


if __name__ == "__main__":
    main()
