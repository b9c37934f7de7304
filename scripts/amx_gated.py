"""The AMX gated tile in gemm_gated_rows (issue 12), two builds compared: builds scripts/amx_gated.c
with this checkout's AMX unit and, given BASE (another checkout's root), with BASE's too, then runs
the two as whole processes in turn, PROCESSES times each, one thread:

    PYTHONPATH=python python scripts/amx_gated.py [--base BASE] [--processes N] [ROUNDS [ROWS]]

Each process prints its cases' output hashes (the two builds' must match) and, per case, the min and
median over ROUNDS (default 20) of one thread's CPU time; the cases (512 rows of 768 -> 3072
GELU(tanh), 1024 -> 4096 GELU, the latter with gate and up saved) are listed in amx_gated.c. Needs
a CPU with AMX; FMLP_EXTRA_CFLAGS as in amx_bisect.py."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from amx_bisect import ISAS, ROOT, build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="another checkout's root, built and run in turn")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("args", nargs="*", help="ROUNDS [ROWS]")
    options = parser.parse_args()
    if not ISAS["avx512_amx"].supported:
        sys.exit("this CPU (or its OS) has no AMX")
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"new": ROOT} | ({"base": options.base.resolve()} if options.base else {})
        binaries = {name: Path(scratch) / name for name in builds}
        for name, root in builds.items():
            build(ROOT / "scripts" / "amx_gated.c", binaries[name], root)
        for _ in range(options.processes):
            for name, binary in binaries.items():
                print(f"--- {name}", flush=True)
                subprocess.run([str(binary), *options.args], check=True)


if __name__ == "__main__":
    main()
