"""A/B of two builds of a SIMD kernel unit in one process (issues 12, 18): builds
scripts/simd_ab.c with the unit named twice, A from the tree and B with the headers in
VARIANT_DIR in place of the tree's, and times whole ops on one thread, A and B alternating within
each round; prints the median B/A time ratio of each case with its quartiles. On a machine loaded
by other processes, two builds timed in separate processes minutes apart differ by more than the
few percent a kernel change moves; alternating within one process they see the same load:

    PYTHONPATH=python python scripts/simd_ab.py UNIT VARIANT_DIR [ROUNDS [CASES]]

UNIT: a kernel unit's suffix, kernels_UNIT.c's (f32_avx512, bf16_avx512_bf16: its storage dtype
and ISA), or an ISA alone for its float32 unit (avx2, avx512).
CASES: a comma-separated subset of linear,linear1024,few,mlp,mlp_layers,gated,gated4096,ksweep,
backward,gated_backward,forward (default linear,mlp,gated; few is linear 768 -> 3072 at 1 to 6 rows,
token decoding in small batches; mlp_layers is mlp and then its three layers
each alone, linear1024 is linear's shapes at 1024 rows, gated4096
the GeGLU block at 4096 tokens with its weights packed ahead, ksweep single products at K = 768,
1024 and 3072, backward and gated_backward the training benches' backwards, forward the chain
training benches' forwards, saving what their backwards read). A header
of VARIANT_DIR is copied beside B's copy of the unit's source, where the unit's own `#include
"..."` finds it first; a header that another header of csrc/cpu includes (gemm.h from drivers.h) is
replaced only together with its includer. FMLP_EXTRA_CFLAGS (split on spaces) is added to B's
compile line only, so a macro the headers test can be the variant (VARIANT_DIR then empty)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from c_build import CPU_DIR, ISAS, kernel_unit_sources  # noqa: E402

SUPPORT = sorted(p for p in CPU_DIR.glob("*.c")
                 if p not in kernel_unit_sources() and p.name not in ("api.c", "isa.c"))
OPTIMISE = ["-std=c11", "-O3", "-fno-math-errno", f"-I{ROOT / 'csrc' / 'include'}"]


def unit_isa(unit: str) -> str:
    """The registry ISA whose flags unit (f32_avx512, bf16_avx512_amx) is compiled with."""
    return unit.split("_", 1)[1]


def unit_copy(unit: str, build: str, folder: Path, variant: Path | None) -> Path:
    """Kernel unit kernels_UNIT.c in folder, its symbols suffixed _build, beside a copy of
    every kernel header with variant's in their place: a quoted include looks in the including
    header's own folder first, so a variant of a header that another header includes (gemm.h,
    vector_math.h) reaches the build only if the includer is copied too."""
    folder.mkdir()
    source = (CPU_DIR / f"kernels_{unit}.c").read_text()
    suffix = f"#define REAL_SUFFIX {unit}"
    if suffix not in source:
        sys.exit(f"kernels_{unit}.c does not define REAL_SUFFIX as {suffix!r}")
    (folder / "unit.c").write_text(source.replace(suffix, f"{suffix}_{build}"))
    for header in [*CPU_DIR.glob("*.h"), *(variant.glob("*.h") if variant else ())]:
        shutil.copy(header, folder / header.name)
    return folder / "unit.c"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: {sys.argv[0]} UNIT VARIANT_DIR [ROUNDS [CASES]]")
    unit, variant, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if unit in ISAS:
        unit = f"f32_{unit}"
    if not unit.startswith(("f32_", "bf16_")) or not (CPU_DIR / f"kernels_{unit}.c").is_file():
        sys.exit(f"no float32 or bfloat16 kernel unit {unit} (csrc/cpu/kernels_{unit}.c)")
    if not variant.is_dir():
        sys.exit(f"VARIANT_DIR {variant} is not a directory")
    flags = [*OPTIMISE, *ISAS[unit_isa(unit)].compile_flags, f"-I{CPU_DIR}"]
    extra = shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", ""))
    with tempfile.TemporaryDirectory() as scratch:
        objects = []
        for build, headers, build_flags in (("a", None, []), ("b", variant, extra)):
            source = unit_copy(unit, build, Path(scratch) / build, headers)
            objects.append(str(source.with_suffix(".o")))
            subprocess.run(["gcc", *flags, *build_flags, "-c", str(source), "-o", objects[-1]],
                           check=True)
        binary = Path(scratch) / "ab"
        storage = ["-DSTORAGE_BF16"] if unit.startswith("bf16_") else []
        subprocess.run(["gcc", *OPTIMISE, f"-I{CPU_DIR}", f"-DUNIT={unit}", *storage,
                        str(ROOT / "scripts" / "simd_ab.c"),
                        *objects, *map(str, SUPPORT), "-lm", "-lpthread", "-o", str(binary)],
                       check=True)
        subprocess.run([str(binary), *rest], check=True)


if __name__ == "__main__":
    main()
