"""Where the AMX tile loop loses time inside the op (issue 12): builds scripts/amx_bisect.c, which
includes the bfloat16 AMX unit itself (kernels_bf16_avx512_amx.c) with the unit's flags from the
registry and setup.py's optimisation, and runs it on one thread:

    PYTHONPATH=python python scripts/amx_bisect.py [ROUNDS [ROWS K N]]

(default 20 rounds of a 512-row block of 1024 -> 4096, the two-thread row block of the bench's
large_gemm). It times, one thread's CPU time, every step once a round in turn (so the load moves
them alike) and prints each step's min and median over the rounds: from the 2 x 2 tile loop over
packed panels in L2 to the unit's gemm_rows, adding the op's features one at a time (C tile stores,
the deferred epilogue, the real output, the whole packed weight, the input pack), then gemm_rows
against page sizes, a fresh output, a padded output stride, the just-in-time weight pack and a
bias with GELU. The steps are described in amx_bisect.c's header. Needs a CPU with AMX.
FMLP_EXTRA_CFLAGS (split on spaces) is added to the compile line, to build a variant."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from c_build import ISAS, kernel_unit_sources  # noqa: E402


# the unit is compiled into the harness; the API and its dispatch (api.c, isa.c) are not needed
def support_sources(cpu_dir: Path) -> list[Path]:
    units = {p.name for p in kernel_unit_sources()}
    return sorted(p for p in cpu_dir.glob("*.c") if p.name not in units | {"api.c", "isa.c"})


def build(harness: Path, binary: Path, root: Path = ROOT) -> None:
    """Compiles scripts/HARNESS with the AMX unit of the source tree at root (this checkout's, or
    another's to build a base to compare with)."""
    cpu_dir = root / "csrc" / "cpu"
    subprocess.run(["gcc", "-std=c11", "-O3", "-fno-math-errno",
                    *ISAS["avx512_amx"].compile_flags,
                    *shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", "")),
                    f"-I{root / 'csrc' / 'include'}", f"-I{cpu_dir}", f"-I{ROOT / 'scripts'}",
                    str(harness), *map(str, support_sources(cpu_dir)),
                    "-lm", "-lpthread", "-o", str(binary)], check=True)


def main() -> None:
    if not ISAS["avx512_amx"].supported:
        sys.exit("this CPU (or its OS) has no AMX")
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "amx_bisect"
        build(ROOT / "scripts" / "amx_bisect.c", binary)
        subprocess.run([str(binary), *sys.argv[1:]], check=True)


if __name__ == "__main__":
    main()
