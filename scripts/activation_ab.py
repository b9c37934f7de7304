"""The float32 activation pass of a SIMD unit, two builds against each other and PyTorch's
(issue 18): builds the unit of the ISA named (avx2 or avx512) twice as shared libraries, A from
the tree and B with the headers in VARIANT_DIR in place of the tree's (as scripts/simd_ab.py
does), and calls each one's fmlp_cpu_activation_forward through ctypes.

    PYTHONPATH=python python scripts/activation_ab.py time ISA VARIANT_DIR [ROUNDS]
    PYTHONPATH=python python scripts/activation_ab.py bits ISA VARIANT_DIR [STRIDE]

time: each activation's pass over 64 Ki floats on one thread, A, B and torch taking turns
within each round, one thread's CPU time; prints nanoseconds a value (min, median) and the ratios
of the medians. torch's float32 exact GELU runs oneDNN's JIT kernel (its ISA capped by
ONEDNN_MAX_CPU_ISA, e.g. AVX2), its GELU(tanh) and SiLU ATen's vectorised code (capped by
ATEN_CPU_CAPABILITY). bits: every STRIDE-th float32 bit pattern (default 13) and every bfloat16
value through A, B and torch, each against float64 (the max error in float32 ulps of the float64
value for x >= 0 and of x for x < 0, finite results only; and where a result is NaN or infinite
against a finite reference), plus how many results differ in their bits between A, B and
torch."""

from __future__ import annotations

import ctypes
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from simd_ab import OPTIMISE, SUPPORT, unit_copy  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from c_build import CPU_DIR, ISAS  # noqa: E402

# fmlp_activation's values (fusedmlp/activations.def) and PyTorch's own form of each
ACTIVATIONS = {
    "gelu": (2, lambda x, out: torch._C._nn.gelu(x, out=out)),
    "gelu_tanh": (3, lambda x, out: torch._C._nn.gelu(x, approximate="tanh", out=out)),
    "silu": (4, lambda x, out: torch._C._nn.silu(x, out=out)),
}
REFERENCES = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
# the results whose bits check_bits compares
PAIRS = (("A", "B"), ("A", "torch"), ("B", "torch"))
VALUES = 1 << 16
CALLS_PER_SAMPLE = 20


def build(isa: str, variant: Path, scratch: Path) -> list[ctypes.CDLL]:
    """Builds A and B as shared libraries in scratch and loads them."""
    flags = [*OPTIMISE, "-fPIC", *ISAS[isa].compile_flags, f"-I{CPU_DIR}"]
    extra = shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", ""))
    libraries = []
    for name, headers, build_flags in (("a", None, []), ("b", variant, extra)):
        source = unit_copy(isa, name, scratch / name, headers)
        library = scratch / f"{name}.so"
        subprocess.run(["gcc", *flags, *build_flags, "-shared", str(source), *map(str, SUPPORT),
                        "-lm", "-lpthread", "-o", str(library)], check=True)
        libraries.append(ctypes.CDLL(str(library)))
    return libraries


def forward(library: ctypes.CDLL, isa: str, name: str):
    """(x, out) -> None: the build's activation pass, serial (no threading)."""
    fn = getattr(library, f"fmlp_cpu_activation_forward_f32_{isa}_{name}")
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

    def run(activation: int, x: torch.Tensor, out: torch.Tensor) -> None:
        if fn(x.numel(), x.data_ptr(), activation, out.data_ptr(), None) != 0:
            raise RuntimeError(f"build {name}: activation pass failed")

    return run


def per_value_ns(run, x: torch.Tensor, out: torch.Tensor) -> float:
    start = time.thread_time_ns()
    for _ in range(CALLS_PER_SAMPLE):
        run(x, out)
    return (time.thread_time_ns() - start) / (CALLS_PER_SAMPLE * x.numel())


def time_passes(passes: dict[str, dict], rounds: int) -> None:
    torch.set_num_threads(1)
    x = torch.randn(VALUES, generator=torch.Generator().manual_seed(0)) * 3
    out = torch.empty_like(x)
    print(f"{VALUES} floats, {rounds} rounds, ns a value (min / median); load "
          f"{os.getloadavg()[0]:.1f}, torch at {torch.backends.cpu.get_cpu_capability()}")
    for activation, runs in passes.items():
        samples: dict[str, list[float]] = {who: [] for who in runs}
        order = list(runs)
        for r in range(rounds):
            for who in order[r % len(order):] + order[:r % len(order)]:
                samples[who].append(per_value_ns(runs[who], x, out))
        medians = {who: statistics.median(s) for who, s in samples.items()}
        cells = ", ".join(f"{who} {min(s):.3f} / {medians[who]:.3f}" for who, s in samples.items())
        ratios = ", ".join(f"{one}/{other} {medians[one] / medians[other]:.3f}"
                           for one, other in (("B", "A"), ("A", "torch"), ("B", "torch")))
        print(f"{activation:10s} {cells}; median ratios {ratios}")


def all_patterns(stride: int):
    """Every stride-th float32 pattern, in blocks, then every bfloat16 value as float32."""
    block = 1 << 24
    for start in range(0, 1 << 32, block * stride):
        bits = torch.arange(start, min(start + block * stride, 1 << 32), stride, dtype=torch.int64)
        yield "float32", bits.to(torch.int32).view(torch.float32)
    yield "bfloat16", torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()


def ulps(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """The max |y - ref| in units of the last place of scale (float64) rounded to float32,
    where y and ref are finite."""
    finite = torch.isfinite(y) & torch.isfinite(ref)
    y, ref, scale = y[finite].double(), ref[finite], scale[finite]
    exponent = torch.frexp(scale.float().double()).exponent.clamp(min=-125)
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 24)
    return float(((y - ref).abs() / ulp).max()) if y.numel() else 0.0


def errors(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """y's max error in ulps of the float64 value ref for x >= 0, and in ulps of x for x < 0,
    where 1 + erf and 1 + tanh cancel: a result far below x's scale has no float32 ulps to
    count in."""
    positive = x >= 0
    return (ulps(y[positive], ref[positive], ref[positive]),
            ulps(y[~positive], ref[~positive], x[~positive].double()))


def check_bits(passes: dict[str, dict], stride: int) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"every {stride}th float32 pattern and every bfloat16 value; max error in ulps of "
          "float64's result (x >= 0) / of x (x < 0), results not finite where float64's is, "
          "results whose bits differ")
    for activation, runs in passes.items():
        worst: dict[tuple[str, str], tuple[float, float]] = {}
        nonfinite: dict[tuple[str, str], int] = {}
        differs: dict[tuple[str, str, str], int] = {}
        for kind, x in all_patterns(stride):
            ref = REFERENCES[activation](x.double())
            results = {}
            for who, run in runs.items():
                results[who] = torch.empty_like(x)
                run(x, results[who])
                key = (kind, who)
                error = errors(results[who], ref, x)
                worst[key] = tuple(map(max, worst.get(key, (0.0, 0.0)), error))
                bad = (~torch.isfinite(results[who]) & torch.isfinite(ref.float())).sum()
                nonfinite[key] = nonfinite.get(key, 0) + int(bad)
            for one, other in PAIRS:
                same = (results[one] == results[other]) | (
                    results[one].isnan() & results[other].isnan())
                key = (kind, one, other)
                differs[key] = differs.get(key, 0) + int((~same).sum())
        for kind in ("float32", "bfloat16"):
            cells = ", ".join(f"{who} {worst[kind, who][0]:.2f} / {worst[kind, who][1]:.3f} "
                              f"({nonfinite[kind, who]} not finite)" for who in runs)
            pairs = ", ".join(f"{one} vs {other} {differs[kind, one, other]}"
                              for one, other in PAIRS)
            print(f"{activation:10s} {kind:8s} {cells}; results whose bits differ: {pairs}")


def main() -> None:
    modes = {"time": 31, "bits": 13}
    if len(sys.argv) < 4 or sys.argv[1] not in modes or sys.argv[2] not in ("avx2", "avx512"):
        sys.exit(f"usage: {sys.argv[0]} {{time,bits}} {{avx2,avx512}} VARIANT_DIR [N]")
    mode, isa, variant = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    count = int(sys.argv[4]) if len(sys.argv) > 4 else modes[mode]
    if not variant.is_dir() or count < 1:
        sys.exit(f"VARIANT_DIR {variant} is not a directory, or N {count} is not positive")
    with tempfile.TemporaryDirectory() as scratch:
        library_a, library_b = build(isa, variant, Path(scratch))
        ours = {"A": forward(library_a, isa, "a"), "B": forward(library_b, isa, "b")}
        passes = {}
        for activation, (value, torch_pass) in ACTIVATIONS.items():
            passes[activation] = {
                "A": lambda x, out, run=ours["A"], v=value: run(v, x, out),
                "B": lambda x, out, run=ours["B"], v=value: run(v, x, out),
                "torch": torch_pass,
            }
        (time_passes if mode == "time" else check_bits)(passes, count)


if __name__ == "__main__":
    main()
