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

from c_build import CPU_DIR, ISAS, kernel_unit_sources  # noqa: E402

# the unit is compiled into the harness; the API and its dispatch (api.c, isa.c) are not needed
SUPPORT = sorted(p for p in CPU_DIR.glob("*.c")
                 if p not in kernel_unit_sources() and p.name not in ("api.c", "isa.c"))


def main() -> None:
    if not ISAS["avx512_amx"].supported:
        sys.exit("this CPU (or its OS) has no AMX")
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "amx_bisect"
        subprocess.run(["gcc", "-std=c11", "-O3", "-fno-math-errno",
                        *ISAS["avx512_amx"].compile_flags,
                        *shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", "")),
                        f"-I{ROOT / 'csrc' / 'include'}", f"-I{CPU_DIR}", f"-I{ROOT / 'scripts'}",
                        str(ROOT / "scripts" / "amx_bisect.c"), *map(str, SUPPORT),
                        "-lm", "-lpthread", "-o", str(binary)], check=True)
        subprocess.run([str(binary), *sys.argv[1:]], check=True)


if __name__ == "__main__":
    main()
