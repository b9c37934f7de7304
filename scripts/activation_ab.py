"""The float32 activation pass of a SIMD unit, two builds against each other and PyTorch's
(issue 18): builds the unit of the ISA named (avx2 or avx512) twice as shared libraries, A from
the tree and B with the headers in VARIANT_DIR in place of the tree's (as scripts/simd_ab.py
does), and calls each one's fmlp_cpu_activation_forward through ctypes.

    PYTHONPATH=python python scripts/activation_ab.py time ISA VARIANT_DIR [ROUNDS]
    PYTHONPATH=python python scripts/activation_ab.py bits ISA VARIANT_DIR [STRIDE]
    PYTHONPATH=python python scripts/activation_ab.py gradtime UNIT VARIANT_DIR [ROUNDS]
    PYTHONPATH=python python scripts/activation_ab.py gradbits UNIT VARIANT_DIR [STRIDE]

time: each activation's pass over 64 Ki floats on one thread, A, B and torch taking turns
within each round, one thread's CPU time; prints nanoseconds a value (min, median) and the ratios
of the medians. torch's float32 exact GELU runs oneDNN's JIT kernel (its ISA capped by
ONEDNN_MAX_CPU_ISA, e.g. AVX2), its GELU(tanh) and SiLU ATen's vectorised code (capped by
ATEN_CPU_CAPABILITY). bits: every STRIDE-th float32 bit pattern (default 13) and every bfloat16
value through A, B and torch, each against float64 (the max error in float32 ulps of the float64
value for x >= 0 and of x for x < 0, finite results only; and where a result is NaN or infinite
against a finite reference), plus how many results differ in their bits between A, B and
torch.

gradtime and gradbits do the same for the backward's pointwise passes of UNIT (f32_avx2,
f32_avx512, bf16_avx512, bf16_avx512_amx: its storage dtype and ISA), through
fmlp_cpu_activation_backward (grad * act'(pre), "slope") and fmlp_cpu_gated_backward (grad_gate
and grad_up of act(gate) * up, "gated"). gradtime: ns a value, torch's gelu_backward /
silu_backward beside the slope pass. gradbits: act'(x) (grad 1) against float64's (in ulps of
float64's result for x >= 0, in ulps of 1 for x < 0, where the slope nears 0 by cancelling) and
PyTorch's in the same dtype, bits that differ between A, B and torch, and whether the gated
pass's grad_up (grad 1) is bit for bit the forward's act(gate), as the unit's forward pass
gives it."""

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

from simd_ab import OPTIMISE, SUPPORT, unit_copy, unit_isa  # noqa: E402

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


def build(unit: str, variant: Path, scratch: Path) -> list[ctypes.CDLL]:
    """Builds A and B of kernel unit kernels_UNIT.c as shared libraries in scratch and loads
    them."""
    flags = [*OPTIMISE, "-fPIC", *ISAS[unit_isa(unit)].compile_flags, f"-I{CPU_DIR}"]
    extra = shlex.split(os.environ.get("FMLP_EXTRA_CFLAGS", ""))
    libraries = []
    for name, headers, build_flags in (("a", None, []), ("b", variant, extra)):
        source = unit_copy(unit, name, scratch / name, headers)
        library = scratch / f"{name}.so"
        subprocess.run(["gcc", *flags, *build_flags, "-shared", str(source), *map(str, SUPPORT),
                        "-lm", "-lpthread", "-o", str(library)], check=True)
        libraries.append(ctypes.CDLL(str(library)))
    return libraries


def forward(library: ctypes.CDLL, unit: str, name: str):
    """(activation, x, out) -> None: the build's activation pass over x, serial (no
    threading)."""
    fn = getattr(library, f"fmlp_cpu_activation_forward_{unit}_{name}")
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p]

    def run(activation: int, x: torch.Tensor, out: torch.Tensor) -> None:
        if fn(x.numel(), x.data_ptr(), activation, out.data_ptr(), None) != 0:
            raise RuntimeError(f"build {name}: activation pass failed")

    return run


def per_value_ns(run, x: torch.Tensor, out: torch.Tensor) -> float:
    start = time.thread_time_ns()
    for _ in range(CALLS_PER_SAMPLE):
        run(x, out)
    return (time.thread_time_ns() - start) / (CALLS_PER_SAMPLE * x.numel())


def rotating_samples(runs: dict, rounds: int, x: torch.Tensor,
                     out: torch.Tensor) -> dict[str, list[float]]:
    """ns a value of each run, `rounds` times, the runs taking turns in a rotating order so
    that drifting load biases none of them."""
    samples: dict[str, list[float]] = {who: [] for who in runs}
    order = list(runs)
    for r in range(rounds):
        for who in order[r % len(order):] + order[:r % len(order)]:
            samples[who].append(per_value_ns(runs[who], x, out))
    return samples


def time_passes(passes: dict[str, dict], rounds: int) -> None:
    torch.set_num_threads(1)
    x = torch.randn(VALUES, generator=torch.Generator().manual_seed(0)) * 3
    out = torch.empty_like(x)
    print(f"{VALUES} floats, {rounds} rounds, ns a value (min / median); load "
          f"{os.getloadavg()[0]:.1f}, torch at {torch.backends.cpu.get_cpu_capability()}")
    for activation, runs in passes.items():
        samples = rotating_samples(runs, rounds, x, out)
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


GRAD_REFERENCES = {
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "gelu_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "silu": lambda g, x: torch.ops.aten.silu_backward(g, x),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def grad_passes(library: ctypes.CDLL, unit: str, name: str) -> dict:
    """The build's serial slope and gated passes and its forward, each over tensors."""
    def symbol(what: str, n_pointers: int):
        fn = getattr(library, f"fmlp_cpu_{what}_{unit}_{name}")
        pointers = [ctypes.c_void_p] * n_pointers
        fn.argtypes = [ctypes.c_int64, *pointers[:-2], ctypes.c_int, *pointers[-2:]]
        return fn

    slope_fn = symbol("activation_backward", 4)
    gated_fn = getattr(library, f"fmlp_cpu_gated_backward_{unit}_{name}")
    gated_fn.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int,
                         *[ctypes.c_void_p] * 3]

    def check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"build {name}: pass failed")

    return {
        "forward": forward(library, unit, name),
        "slope": lambda act, g, x, out: check(slope_fn(g.numel(), g.data_ptr(), x.data_ptr(),
                                                       act, out.data_ptr(), None)),
        "gated": lambda act, g, x, up, out_gate, out_up: check(gated_fn(
            g.numel(), g.data_ptr(), x.data_ptr(), up.data_ptr(), act, out_gate.data_ptr(),
            out_up.data_ptr(), None)),
    }


def grad_run(passes: dict, kind: str, value: int, inputs: tuple, outputs: tuple):
    """(x, out) -> None for per_value_ns: one build's pass of kind over fixed tensors."""
    g, x, up = inputs
    if kind == "slope":
        return lambda _x, _o: passes["slope"](value, g, x, outputs[0])
    return lambda _x, _o: passes["gated"](value, g, x, up, *outputs)


def time_grads(unit: str, builds: dict[str, dict], rounds: int) -> None:
    torch.set_num_threads(1)
    dtype = DTYPES[unit.split("_")[0]]
    rng = torch.Generator().manual_seed(0)
    g, x, up = (torch.randn(VALUES, generator=rng).to(dtype) for _ in range(3))
    x *= 3
    out, out2 = torch.empty_like(x), torch.empty_like(x)
    print(f"{unit}, {VALUES} values, {rounds} rounds, ns a value (min / median); load "
          f"{os.getloadavg()[0]:.1f}")
    for activation, (value, _) in ACTIVATIONS.items():
        for kind in ("slope", "gated"):
            runs = {who: grad_run(passes, kind, value, (g, x, up), (out, out2))
                    for who, passes in builds.items()}
            if kind == "slope":
                runs["torch"] = lambda _x, _o, f=GRAD_REFERENCES[activation]: f(g, x)
            samples = rotating_samples(runs, rounds, x, out)
            medians = {who: statistics.median(s) for who, s in samples.items()}
            cells = ", ".join(f"{who} {min(s):.3f} / {medians[who]:.3f}"
                              for who, s in samples.items())
            print(f"{activation:10s} {kind:5s} {cells}; median B/A "
                  f"{medians['B'] / medians['A']:.3f}")


def check_grad_bits(unit: str, builds: dict[str, dict], stride: int) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = DTYPES[unit.split("_")[0]]
    print(f"{unit}: act'(x) max error in ulps of float64's (x >= 0) / of 1 (x < 0); results "
          "whose bits differ; gated grad_up values that differ from the forward's act")
    for activation, (value, _) in ACTIVATIONS.items():
        worst: dict[str, list[float]] = {who: [0.0, 0.0] for who in (*builds, "torch")}
        differs = {pair: 0 for pair in PAIRS}
        act_differs = {who: 0 for who in builds}
        for _, x in all_patterns(stride):
            x = x.to(dtype)
            ones = torch.ones_like(x)
            ref = GRAD_REFERENCES[activation](ones.double(), x.double())
            results = {"torch": GRAD_REFERENCES[activation](ones, x)}
            for who, passes in builds.items():
                results[who] = torch.empty_like(x)
                passes["slope"](value, ones, x, results[who])
                forward, grad_gate, grad_up = (torch.empty_like(x) for _ in range(3))
                passes["forward"](value, x, forward)
                passes["gated"](value, ones, x, ones, grad_gate, grad_up)
                same = (forward == grad_up) | (forward.isnan() & grad_up.isnan())
                act_differs[who] += int((~same).sum())
            positive = x >= 0
            for who, y in results.items():
                y = y.float()
                worst[who][0] = max(worst[who][0], ulps(y[positive], ref[positive], ref[positive]))
                worst[who][1] = max(worst[who][1], ulps(y[~positive], ref[~positive],
                                                        torch.ones_like(ref[~positive])))
            for one, other in PAIRS:
                same = (results[one] == results[other]) | (
                    results[one].isnan() & results[other].isnan())
                differs[one, other] += int((~same).sum())
        cells = ", ".join(f"{who} {w[0]:.2f} / {w[1]:.2f}" for who, w in worst.items())
        pairs = ", ".join(f"{one} vs {other} {n}" for (one, other), n in differs.items())
        acts = ", ".join(f"{who} {n}" for who, n in act_differs.items())
        print(f"{activation:10s} {cells}; bits differ: {pairs}; grad_up vs forward: {acts}")


def grad_main(mode: str, unit: str, variant: Path, count: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        library_a, library_b = build(unit, variant, Path(scratch))
        builds = {"A": grad_passes(library_a, unit, "a"), "B": grad_passes(library_b, unit, "b")}
        (time_grads if mode == "gradtime" else check_grad_bits)(unit, builds, count)


def main() -> None:
    modes = {"time": 31, "bits": 13, "gradtime": 31, "gradbits": 13}
    units = ("f32_avx2", "f32_avx512", "bf16_avx512", "bf16_avx512_amx")
    grad = len(sys.argv) > 1 and sys.argv[1].startswith("grad")
    if len(sys.argv) < 4 or sys.argv[1] not in modes or sys.argv[2] not in (
            units if grad else ("avx2", "avx512")):
        sys.exit(f"usage: {sys.argv[0]} {{time,bits}} {{avx2,avx512}} VARIANT_DIR [N]\n"
                 f"       {sys.argv[0]} {{gradtime,gradbits}} {{{','.join(units)}}} "
                 "VARIANT_DIR [N]")
    mode, isa, variant = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    count = int(sys.argv[4]) if len(sys.argv) > 4 else modes[mode]
    if not variant.is_dir() or count < 1:
        sys.exit(f"VARIANT_DIR {variant} is not a directory, or N {count} is not positive")
    if mode.startswith("grad"):
        grad_main(mode, isa, variant, count)
        return
    with tempfile.TemporaryDirectory() as scratch:
        library_a, library_b = build(f"f32_{isa}", variant, Path(scratch))
        ours = {"A": forward(library_a, f"f32_{isa}", "a"),
                "B": forward(library_b, f"f32_{isa}", "b")}
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
