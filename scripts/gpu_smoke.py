"""The Python steps of scripts/gpu_check.sh, one per subcommand so that each runs in its own
process (a sticky CUDA fault then spoils one step, not the rest). Every step prints each
mismatch it finds and goes on; the exit status is 1 if any was found. --device cpu (with
--quick for small shapes) rehearses every step on a machine without a GPU.

    python scripts/gpu_smoke.py values  --device cuda --dtype bfloat16 [--quick]
    python scripts/gpu_smoke.py grads   --device cuda [--quick]
    python scripts/gpu_smoke.py kernels --device cuda --out DIR [--quick]
    python scripts/gpu_smoke.py ratios  --device cuda --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import fusedmlp
import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
from fusedmlp.activations import activation_module
from torch import Tensor

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# Against a float64 reference computed from the same (rounded) inputs: the output's own
# rounding plus the accumulation error of a K-long sum.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# (rows, in_features, out_features): one row, K = 1, N = 1, N = 0, and a large GEMM.
LINEAR_SHAPES = [(1, 16, 24), (15, 1, 3), (26, 5, 1), (7, 17, 0), (8192, 4096, 4096)]
QUICK_LARGE = (64, 96, 80)
# (rows, dim, hidden): gate/up output batch strides of 180 and 168 bytes in float32 (not
# 16-byte aligned), one row, and the study's block.
GATED_SHAPES = [(15, 16, 3), (6, 16, 7), (1, 16, 24), (8192, 768, 3072)]
QUICK_GATED = (64, 48, 40)


class Mismatches:
    """Counts and prints every mismatch or error, and goes on."""

    def __init__(self) -> None:
        self.count = 0
        self.checked = 0

    def compare(self, case: str, got: Tensor, want: Tensor, tolerance: float) -> None:
        self.checked += 1
        # on the device: a 8192 x 4096 output is compared in place, not copied to the host
        got64, want64 = got.double(), want.double().to(got.device)
        if got64.shape != want64.shape:
            self.report(case, f"shape {tuple(got64.shape)}, expected {tuple(want64.shape)}")
            return
        nan_ok = torch.isnan(got64) == torch.isnan(want64)
        error = (got64 - want64).abs().nan_to_num(0.0)
        bound = tolerance * (1 + want64.abs().nan_to_num(0.0))
        bad = (error > bound) | ~nan_ok
        if bool(bad.any()):
            where = bad.nonzero()[:3].tolist()
            self.report(
                case,
                f"{int(bad.sum())} of {bad.numel()} elements off (max abs error "
                f"{float(error.max()):.3g}, NaN mismatches {int((~nan_ok).sum())}; first at "
                f"{where}: got {[float(got64[tuple(i)]) for i in where]}, expected "
                f"{[float(want64[tuple(i)]) for i in where]})",
            )

    def report(self, case: str, what: str) -> None:
        self.count += 1
        print(f"MISMATCH {case}: {what}", flush=True)

    def guarded(self, case: str, check: Callable[..., None], *args: object) -> None:
        """check(*args), reporting what it raises; stops the step after a CUDA error."""
        try:
            check(*args)
        except Exception as error:  # noqa: BLE001 - every failure is reported, then on
            self.checked += 1
            self.report(case, f"raised {type(error).__name__}: {error}")
            if "CUDA error" in str(error) or "illegal" in str(error):
                print("a CUDA error may be sticky: stopping this step", flush=True)
                self.finish()

    def finish(self) -> None:
        print(f"{self.checked} checks, {self.count} mismatches", flush=True)
        sys.exit(1 if self.count else 0)


def reference(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """F.linear + the activation module in float64, from the same rounded inputs."""
    x64, w64 = x.double(), weight.double()
    b64 = None if bias is None else bias.double()
    return activation_module(activation)(F.linear(x64, w64, b64))


def scaled(rows: int, cols: int, generator: torch.Generator, device: str, dtype) -> Tensor:
    """Weights scaled like nn.Linear's init, so outputs stay O(1) at every K."""
    scale = 1.0 / math.sqrt(max(cols, 1))
    return (torch.randn(rows, cols, generator=generator) * scale).to(device, dtype)


def odd_offset_bias(features: int, generator: torch.Generator, device: str, dtype) -> Tensor:
    """A bias that is a view one element into its storage (b[1:]): 2 or 4 bytes off."""
    return torch.randn(features + 1, generator=generator).to(device, dtype)[1:]


def check_values(args: argparse.Namespace) -> None:
    dtype, device = DTYPES[args.dtype], args.device
    tolerance = TOLERANCES[dtype]
    generator = torch.Generator().manual_seed(0)
    found = Mismatches()
    shapes = [QUICK_LARGE if args.quick and s[0] > 1024 else s for s in LINEAR_SHAPES]
    for rows, k, n in shapes:
        x = scaled(rows, k, generator, device, dtype) * math.sqrt(max(k, 1))
        weight = scaled(n, k, generator, device, dtype)
        biases = {
            "no bias": None,
            "bias": torch.randn(n, generator=generator).to(device, dtype),
            "odd-offset bias": odd_offset_bias(n, generator, device, dtype),
        }
        for bias_name, bias in biases.items():
            for activation in fusedmlp.ACTIVATIONS:
                label = f"linear {args.dtype} {rows}x{k}->{n} {activation} {bias_name}"
                check_linear_modes(found, label, x, weight, bias, activation, tolerance)
    check_nan_propagation(args, found)
    check_gated_values(args, found)
    found.finish()


def check_linear_modes(
    found: Mismatches,
    label: str,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    tolerance: float,
) -> None:
    """One linear call in inference and in training mode against the float64 reference,
    each guarded so that a failure is recorded and the sweep goes on."""
    want = reference(x, weight, bias, activation)
    for mode in ("inference", "training"):
        case = f"{label} {mode}"
        found.guarded(
            case, compare_linear, found, case, x, weight, bias, activation, mode, want, tolerance
        )


def compare_linear(
    found: Mismatches,
    case: str,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    mode: str,
    want: Tensor,
    tolerance: float,
) -> None:
    """fusedmlp.linear without grad (inference) or on an x that requires grad (training,
    the op that saves the pre-activation) against the float64 reference."""
    x_in = x.clone().requires_grad_(mode == "training")
    got = fusedmlp.linear(x_in, weight, bias, activation)
    found.compare(case, got.detach(), want, tolerance)


def compare_gated(
    found: Mismatches,
    case: str,
    x: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    biases: list[Tensor | None],
    activation: str,
    want: Tensor,
    tolerance: float,
) -> None:
    got = fusedmlp.gated_mlp(x, *weights, activation, *biases)
    found.compare(case, got, want, tolerance)


def check_nan_propagation(args: argparse.Namespace, found: Mismatches) -> None:
    """A NaN in one row of x gives NaN in that row for every activation (torch.relu keeps
    NaN), in inference and training alike."""
    dtype, device = DTYPES[args.dtype], args.device
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=generator).to(device, dtype)
    x[3, 5] = float("nan")
    weight = scaled(48, 64, generator, device, dtype)
    bias = torch.randn(48, generator=generator).to(device, dtype)
    for activation in fusedmlp.ACTIVATIONS:
        label = f"NaN propagation {args.dtype} {activation}"
        check_linear_modes(found, label, x, weight, bias, activation, TOLERANCES[dtype])


def check_gated_values(args: argparse.Namespace, found: Mismatches) -> None:
    dtype, device = DTYPES[args.dtype], args.device
    generator = torch.Generator().manual_seed(2)
    shapes = [QUICK_GATED if args.quick and s[0] > 1024 else s for s in GATED_SHAPES]
    for rows, dim, hidden in shapes:
        x = torch.randn(rows, dim, generator=generator).to(device, dtype)
        w_gate, w_up = (
            scaled(hidden, dim, generator, device, dtype),
            scaled(hidden, dim, generator, device, dtype),
        )
        # up's weight 2 x hidden x dim elements after gate's, in one storage: the batched path
        packed = scaled(2 * hidden, dim, generator, device, dtype)
        w_down = scaled(dim, hidden, generator, device, dtype)
        for layout, (wg, wu) in {
            "separate": (w_gate, w_up),
            "packed": (packed[:hidden], packed[hidden:]),
        }.items():
            for with_bias in (False, True):
                biases = [
                    torch.randn(f, generator=generator).to(device, dtype) if with_bias else None
                    for f in (hidden, hidden, dim)
                ]
                for activation in fusedmlp.ACTIVATIONS:
                    act = activation_module(activation)
                    gate = reference(x, wg, biases[0], "none")
                    up = reference(x, wu, biases[1], "none")
                    want = reference(act(gate) * up, w_down, biases[2], "none")
                    case = (
                        f"gated {args.dtype} {rows}x{dim}->{hidden} {layout} {activation} "
                        f"bias={with_bias}"
                    )

                    # two roundings (hidden, output) in the storage dtype
                    found.guarded(
                        case,
                        compare_gated,
                        found,
                        case,
                        x,
                        (wg, wu, w_down),
                        biases,
                        activation,
                        want,
                        2 * TOLERANCES[dtype],
                    )


def check_gradients(args: argparse.Namespace) -> None:
    """Gradients of every op (linear, mlp, gated_mlp) and input, fused vs eager autograd in
    the same dtype, for float32 and bfloat16: relative to the largest eager gradient."""
    device = args.device
    found = Mismatches()
    for dtype_name in ("float32", "bfloat16"):
        dtype = DTYPES[dtype_name]
        tolerance = 1e-4 if dtype == torch.float32 else 4e-2
        # widths that are multiples of 8 (gelu_tanh saves through GELU_AUX) and not
        for rows, dim, hidden in [(33, 40, 24), (17, 20, 12)]:
            for activation in fusedmlp.ACTIVATIONS:
                for op in ("linear", "mlp", "gated_mlp"):
                    case = f"grad {op} {dtype_name} {rows}x{dim}->{hidden} {activation}"

                    found.guarded(
                        case,
                        compare_gradients,
                        found,
                        case,
                        op,
                        activation,
                        rows,
                        dim,
                        hidden,
                        device,
                        dtype,
                        tolerance,
                    )
    found.finish()


def compare_gradients(
    found: Mismatches,
    case: str,
    op: str,
    activation: str,
    rows: int,
    dim: int,
    hidden: int,
    device: str,
    dtype,
    tolerance: float,
) -> None:
    generator = torch.Generator().manual_seed(3)
    shapes = {
        "linear": [(rows, dim), (hidden, dim), (hidden,)],
        "mlp": [(rows, dim), (hidden, dim), (dim, hidden), (hidden,), (dim,)],
        "gated_mlp": [
            (rows, dim),
            (hidden, dim),
            (hidden, dim),
            (dim, hidden),
            (hidden,),
            (hidden,),
            (dim,),
        ],
    }[op]
    values = [torch.randn(s, generator=generator) / math.sqrt(s[-1]) for s in shapes]
    fused_inputs = [v.to(device, dtype).requires_grad_() for v in values]
    eager_inputs = [v.to(device, dtype).requires_grad_() for v in values]
    act = activation_module(activation)
    if op == "linear":
        fused = fusedmlp.linear(*fused_inputs, activation=activation)
        x, w, b = eager_inputs
        eager = act(F.linear(x, w, b))
    elif op == "mlp":
        x, w0, w1, b0, b1 = fused_inputs
        fused = fusedmlp.mlp(x, [w0, w1], [b0, b1], activation)
        x, w0, w1, b0, b1 = eager_inputs
        eager = F.linear(act(F.linear(x, w0, b0)), w1, b1)
    else:
        x, wg, wu, wd, bg, bu, bd = fused_inputs
        fused = fusedmlp.gated_mlp(x, wg, wu, wd, activation, bg, bu, bd)
        x, wg, wu, wd, bg, bu, bd = eager_inputs
        eager = F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)
    grad_y = torch.randn(eager.shape, generator=generator).to(device, dtype)
    fused.backward(grad_y)
    eager.backward(grad_y)
    for index, (got, want) in enumerate(zip(fused_inputs, eager_inputs, strict=True)):
        scale = float(want.grad.double().abs().max()) or 1.0
        found.compare(f"{case} input {index}", got.grad / scale, want.grad / scale, tolerance)


def timed(fn: Callable[[], object], device: str, min_run_time: float) -> float:
    """Median seconds per call (torch.utils.benchmark: warm-up, CUDA sync)."""
    for _ in range(3):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def measure_ratios(args: argparse.Namespace) -> None:
    """Linear rows x K -> N in bfloat16 (CUDA) per activation: fused vs F.linear + the
    activation module, both timed in this run."""
    device = args.device
    dtype = torch.bfloat16
    rows, k, n = (256, 256, 256) if args.quick else (8192, 4096, 4096)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    weight = scaled(n, k, generator, device, dtype)
    bias = torch.randn(n, generator=generator).to(device, dtype)
    results = []
    with torch.no_grad():
        for activation in ("none", "relu", "gelu_tanh", "gelu", "silu"):
            act = activation_module(activation)
            fused = timed(
                lambda a=activation: fusedmlp.linear(x, weight, bias, a), device, args.min_run_time
            )
            eager = timed(lambda a=act: a(F.linear(x, weight, bias)), device, args.min_run_time)
            results.append(
                {
                    "activation": activation,
                    "fused_s": fused,
                    "eager_s": eager,
                    "eager_over_fused": eager / fused,
                }
            )
            print(
                f"linear {rows}x{k}->{n} bf16 {activation:9s}: fused {fused * 1e6:9.1f} us, "
                f"F.linear+act {eager * 1e6:9.1f} us, speedup {eager / fused:5.2f}x",
                flush=True,
            )
    write_json(args.out / "ratios.json", {"shape": [rows, k, n], "results": results})


def count_kernels(args: argparse.Namespace) -> None:
    """Which epilogues really fused: the device kernels (CUDA) or ATen ops (CPU) one call
    of each op launches, from torch.profiler."""
    device = args.device
    dtype = torch.bfloat16
    rows, dim, hidden = (64, 64, 96) if args.quick else (2048, 1024, 4096)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, dim, generator=generator).to(device, dtype)
    w_gate, w_up = (
        scaled(hidden, dim, generator, device, dtype),
        scaled(hidden, dim, generator, device, dtype),
    )
    w_down = scaled(dim, hidden, generator, device, dtype)
    bias = torch.randn(hidden, generator=generator).to(device, dtype)
    calls: dict[str, Callable[[], object]] = {}
    for activation in fusedmlp.ACTIVATIONS:
        calls[f"linear {activation} inference"] = lambda a=activation: fusedmlp.linear(
            x, w_gate, bias, a
        )
        calls[f"linear {activation} training"] = lambda a=activation: fusedmlp.linear(
            x.detach().requires_grad_(), w_gate, bias, a
        )
    calls["gated_mlp gelu_tanh inference"] = lambda: fusedmlp.gated_mlp(
        x, w_gate, w_up, w_down, "gelu_tanh"
    )
    calls["F.linear + gelu_tanh (eager)"] = lambda: F.gelu(
        F.linear(x, w_gate, bias), approximate="tanh"
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    table = {}
    for name, call in calls.items():
        call()
        with torch.profiler.profile(activities=activities) as profiler:
            call()
            if device == "cuda":
                torch.cuda.synchronize()
        if device == "cuda":
            kernels = [
                e.name for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA
            ]
        else:  # no device kernels: the ATen ops below our op, for the rehearsal
            kernels = [e.name for e in profiler.events() if e.name.startswith("aten::")]
        table[name] = kernels
        print(
            f"{name:36s} {len(kernels)} {'kernels' if device == 'cuda' else 'aten ops'}: "
            f"{'; '.join(k[:60] for k in kernels)}",
            flush=True,
        )
    write_json(args.out / "kernels.json", table)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("step", choices=["values", "grads", "kernels", "ratios"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="bfloat16", help="values: the dtype under test"
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU rehearsal)")
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--min-run-time", type=float, default=0.5)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no CUDA GPU")
    print(f"fusedmlp from {fusedmlp.__file__}, torch {torch.__version__}", flush=True)
    {
        "values": check_values,
        "grads": check_gradients,
        "kernels": count_kernels,
        "ratios": measure_ratios,
    }[args.step](args)


if __name__ == "__main__":
    main()
