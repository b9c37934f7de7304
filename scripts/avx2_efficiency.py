"""Where the AVX2 float32 kernels lose to the FMA peak (issue 18): builds
scripts/avx2_efficiency.c, which includes the AVX2 float32 unit itself, with that unit's
flags from the registry and setup.py's optimisation, and runs it on one thread:

    PYTHONPATH=python python scripts/avx2_efficiency.py [ROW_BLOCK [ROWS [PARTS]]]

PARTS: a comma-separated subset of micro,rows,whole (default all). Each line is the best of
several runs, as a fraction of the FMA peak timed just before that run, in CPU time: on a
loaded machine the clock and the share of the core move from one moment to the next."""

from __future__ import annotations

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


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "avx2_efficiency"
        subprocess.run(["gcc", "-std=c11", "-O3", "-fno-math-errno", *ISAS["avx2"].compile_flags,
                        f"-I{ROOT / 'csrc' / 'include'}", f"-I{CPU_DIR}",
                        str(ROOT / "scripts" / "avx2_efficiency.c"), *map(str, SUPPORT),
                        "-lm", "-lpthread", "-o", str(binary)], check=True)
        subprocess.run([str(binary), *sys.argv[1:]], check=True)


if __name__ == "__main__":
    main()
