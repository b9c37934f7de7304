"""Where a SIMD float32 unit loses to the FMA peak and to MKL (issues 12, 13, 18): builds
scripts/simd_efficiency.c, which includes the float32 unit of the ISA named (avx2 or avx512)
itself, with that unit's flags from the registry and setup.py's optimisation, and runs it on one
thread, with MKL's packed sgemm (from torch's libtorch_cpu) timed on the same shapes; for avx2,
MKL is held to AVX2 as well (MKL_ENABLE_INSTRUCTIONS), so the two compare at the same width:

    PYTHONPATH=python python scripts/simd_efficiency.py ISA [ROW_BLOCK [ROWS [PARTS]]]

PARTS: a comma-separated subset of micro,rows,mkl,whole,paired,strides (default all but paired
and strides). Each line is the best of several runs, as a fraction of the FMA peak timed just
before that run, in CPU time: on a loaded machine the clock and the share of the core move from
one moment to the next. paired times ours and MKL alternately within each of 21 rounds on the
up, down and gated rows and prints the median ratio of their times: MKL is the control, so two
builds of ours (FMLP_EXTRA_CFLAGS) compare by their ratios even when the load moved between
their runs. strides times the row block's products into outputs whose row stride is HIDDEN
(3072 floats, 12 KiB: every row of a tile in the same cache sets) against 16 floats more,
alternating, and prints the median padded/plain time ratio.
FMLP_EXTRA_CFLAGS (split on spaces) is added to the compile line, to build a variant."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from c_build import CPU_DIR, ISAS, kernel_unit_sources  # noqa: E402

# the unit is compiled into the harness; the API and its dispatch (api.c, isa.c) are not needed
SUPPORT = sorted(p for p in CPU_DIR.glob("*.c")
                 if p not in kernel_unit_sources() and p.name not in ("api.c", "isa.c"))
MKL_INSTRUCTIONS = {"avx2": "AVX2", "avx512": "AVX512"}


def mkl_library() -> str:
    """torch's CPU library, which carries MKL's CBLAS, or "" where torch is not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ""
    library = Path(spec.origin).parent / "lib" / "libtorch_cpu.so"
    return str(library) if library.exists() else ""


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MKL_INSTRUCTIONS:
        isas = ",".join(MKL_INSTRUCTIONS)
        sys.exit(f"usage: {sys.argv[0]} {{{isas}}} [ROW_BLOCK [ROWS [PARTS]]]")
    isa, rest = sys.argv[1], sys.argv[2:]
    args = [*rest, *["120", "1024", "micro,rows,mkl,whole"][len(rest):3], mkl_library()]
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": MKL_INSTRUCTIONS[isa], "MKL_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / f"{isa}_efficiency"
        subprocess.run(["gcc", "-std=c11", "-O3", "-fno-math-errno", *ISAS[isa].compile_flags,
                        *shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", "")),
                        f"-DFMLP_UNIT_SOURCE=\"kernels_f32_{isa}.c\"",
                        f"-I{ROOT / 'csrc' / 'include'}", f"-I{CPU_DIR}",
                        str(ROOT / "scripts" / "simd_efficiency.c"), *map(str, SUPPORT),
                        "-lm", "-lpthread", "-ldl", "-o", str(binary)], check=True)
        subprocess.run([str(binary), *args], check=True, env=env)


if __name__ == "__main__":
    main()
