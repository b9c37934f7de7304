"""Speed sweep: eager PyTorch, torch.compile and fusedmlp on the same shapes, in one run.

    python -m fusedmlp.bench [--device cpu|cuda] [--dtype float32] [--quick] [--out DIR]
                             [--cases a,b] [--no-compile] [--no-compile-max]
                             [--min-run-time S] [--rounds N] [--threads N]
                             [--emulate-cpu avx2|portable] [--weight-cache MIB]

Variants: eager, torch.compile (default mode), compile-max (inference cases only:
torch.compile with mode="max-autotune" and Inductor freezing, which lets Inductor treat the
weights as constants and, on the CPU, pick its C++ GEMM template with fused epilogues; its
compiles take minutes) and fused. Times every case with torch.utils.benchmark (warm-up, CUDA
sync, medians; the variants take turns in rounds so that drifting machine load biases none of
them: --rounds, 3 by default, splits each variant's --min-run-time into that many turns, and
more of them steady the ratios of cases that sit near 1.0x on a shared machine), prints a
table of medians and of fused's time over each other variant's, and each variant's memory
above its inputs and weights (the peak of one inference forward, and what a forward with
autograd saves for backward), and writes bench.json and bench.png into --out.
GEMM-bound cases also report fused's GFLOP/s as a fraction of this machine's peak for the dtype,
timed by a small C loop (peak.py: fp32 FMA; SSE2 multiply and add for float32 at the portable
level on x86-64; for bfloat16 what the level in use multiplies on: AMX tiles at avx512_amx, the
AVX512-BF16 dot product at avx512_bf16) on as many threads as torch uses, in samples taken just
before and just after fused's timings in every round (each a 50 ms window after a 50 ms lead-in,
peak.py). The fraction is against the median of the case's six samples (its "peak GFLOP/s"
column), which ran under the load fused's timings did: on a shared machine a peak from minutes
earlier made the fraction swing with the load. The header gives the peak measured once at the
start (the best of three windows) for reference; on an idle machine the samples read about the
same.
--emulate-cpu avx2 runs the sweep as an AVX2-only CPU would (emulate.py): our kernels and
torch's (MKL, oneDNN, ATen) limited to AVX2, in a child process, against the AVX2 FMA peak.
--emulate-cpu portable runs it as an x86 CPU without AVX2 would: torch limited to its lowest
paths, fused on the path such a CPU takes (ATen's GEMM, our portable epilogue).
--weight-cache MIB sets FUSEDMLP_WEIGHT_CACHE_MB for the run: fused's inference calls then read
their weights packed once (off by default), as compile-max's freezing reads them as constants.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

from fusedmlp import _C
from fusedmlp.bench.cases import (
    CASES,
    Case,
    build_modules,
    gemm_flops,
    inference_call,
    make_input,
    training_call,
)
from fusedmlp.bench.emulate import (
    EMULATIONS,
    check_in_effect,
    child_command,
    describe,
    environment_matches,
)
from fusedmlp.bench.peak import (
    SAMPLE_SECONDS,
    START_REPS,
    START_SECONDS,
    PeakLoop,
    PeakSampler,
    peak_loop,
    peak_sampler,
)
from fusedmlp.bench.report import VARIANTS, CaseResult, format_table, write_json, write_plot
from fusedmlp.registry import DEVICE_DTYPES
from fusedmlp.tools.memory import forward_memory, measure_call, torch_sees_whole_peak
from fusedmlp.tools.plotting import require_matplotlib
from fusedmlp.tools.quiet_profiler import quiet_kineto

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fusedmlp.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and short timings (tests, CI)")
    parser.add_argument("--out", type=Path, default=Path("fusedmlp-bench"),
                        help="folder for bench.json and bench.png")
    parser.add_argument("--cases", default=None,
                        help="comma-separated subset of: " + ", ".join(c.name for c in CASES))
    parser.add_argument("--no-compile", action="store_true",
                        help="skip both torch.compile variants (compile, compile-max)")
    parser.add_argument("--no-compile-max", action="store_true",
                        help="skip compile-max (max-autotune + freezing), whose compiles are slow")
    parser.add_argument("--min-run-time", type=float, default=None,
                        help="seconds of timing per measurement (default 1, --quick 0.05)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="turns the variants take, each timed for min-run-time / rounds "
                             "a turn (default 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before timing (default: torch's)")
    parser.add_argument("--emulate-cpu", choices=list(EMULATIONS), default=None,
                        help="run as a CPU whose best level is this one: fused and eager "
                             "(MKL, oneDNN, ATen) both limited to it")
    parser.add_argument("--weight-cache", type=int, default=None, metavar="MIB",
                        help="FUSEDMLP_WEIGHT_CACHE_MB for the run: fused's inference calls "
                             "read their weights packed once (default: the environment's, off)")
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def select_cases(spec: str | None) -> list[Case]:
    if not spec:
        return list(CASES)
    by_name = {c.name: c for c in CASES}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {sorted(by_name)}")
    return [by_name[n] for n in names]


def warm_up(fn: Callable[[], object]) -> None:
    for _ in range(2):  # torch.compile compiles here, caches fill
        fn()


def timed_runs(fn: Callable[[], object], min_run_time: float) -> list[float]:
    """Seconds per call of each timed block (torch.utils.benchmark handles CUDA sync)."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn},
                            num_threads=torch.get_num_threads())
    return list(timer.blocked_autorange(min_run_time=min_run_time).times)


COMPILE_MAX = "compile-max"


def compiling(variant: str) -> contextlib.AbstractContextManager:
    """What compile-max compiles under: Inductor freezing (weights as constants, which its CPU
    GEMM template needs), patched only around its own calls that compile, and no autotuning
    tables printed into the progress lines (TORCH_LOGS still shows them). torch.compile
    compiles lazily, so this wraps compile-max's warm-up and memory forwards, not torch.compile;
    the other variants compile with Inductor's defaults."""
    if variant != COMPILE_MAX:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True, autotune_num_choices_displayed=0,
                                 max_autotune_report_choices_stats=False)


def variant_modules(case: Case, sizes: tuple[int, ...], device: str, dtype: torch.dtype,
                    args: argparse.Namespace) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    eager, fused = build_modules(case, sizes, device, dtype)
    modules = {"eager": eager, "fused": fused}
    if not args.no_compile:
        modules["compile"] = torch.compile(eager)
        if not (args.no_compile_max or case.train):
            modules[COMPILE_MAX] = torch.compile(eager, mode="max-autotune")
    return modules


def variant_calls(case: Case, modules: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                  x: torch.Tensor) -> dict[str, Callable[[], object]]:
    if not case.train:
        return {name: inference_call(m, x) for name, m in modules.items()}
    calls = {}
    for name, module in modules.items():
        owner = modules["fused" if name == "fused" else "eager"]
        assert isinstance(owner, torch.nn.Module)
        calls[name] = training_call(module, list(owner.parameters()), x)
    return calls


def run_case(case: Case, args: argparse.Namespace, index: int, total: int,
             sample_peak: Callable[[float], float | None] | None) -> CaseResult:
    """Times the case's variants in turns; GEMM-bound cases also sample the peak loop
    (`sample_peak(seconds)`, GFLOP/s) just before and after fused's timings in each round."""
    rows, sizes = case.shape(args.quick)
    dtype = DTYPES[args.dtype]
    x = make_input(rows, sizes, args.device, dtype)
    # Each case compiles afresh, as a user's model would: cases share forward code
    # (nn.Sequential's, GatedBlock's), whose compiled entries would otherwise pile up until
    # Dynamo's recompile limit (8) silently runs the later cases eagerly, or serve a later
    # case a graph made dynamic in the shapes of earlier ones.
    torch._dynamo.reset()
    modules = variant_modules(case, sizes, args.device, dtype, args)
    calls = variant_calls(case, modules, x)
    result = CaseResult(case.name, case.description, rows, list(sizes),
                        gemm_flops(case, rows, sizes), case.gemm_bound, case.train)
    min_run_time = args.min_run_time or (0.05 if args.quick else 1.0)
    variants = [v for v in VARIANTS if v in calls]
    runs: dict[str, list[float]] = {v: [] for v in variants}
    rounds = args.rounds  # variants take turns, so drifting machine load biases none of them
    sample_seconds = min(SAMPLE_SECONDS, min_run_time / rounds)  # --quick: shorter
    peaks: list[float | None] = []
    for variant in variants:
        started = time.perf_counter()
        print(f"[{index}/{total}] {case.name}: {variant} warm-up ...", end="", file=sys.stderr,
              flush=True)
        with compiling(variant):
            warm_up(calls[variant])
        result.warmup_s[variant] = time.perf_counter() - started
        print(f" {result.warmup_s[variant]:.1f} s", file=sys.stderr, flush=True)
    for round_index in range(rounds):
        for variant in variants:
            beside = case.gemm_bound and variant == "fused" and sample_peak is not None
            if beside:
                peaks.append(sample_peak(sample_seconds))
            runs[variant] += timed_runs(calls[variant], min_run_time / rounds)
            if beside:
                peaks.append(sample_peak(sample_seconds))
        medians = ", ".join(f"{v} {statistics.median(runs[v]) * 1e3:.3f} ms" for v in variants)
        if peaks:
            shown = ", ".join("-" if p is None else f"{p:.0f}" for p in peaks[-2:])
            medians += f"; peak samples {shown} GFLOP/s"
        print(f"[{index}/{total}] {case.name}: round {round_index + 1}/{rounds}: {medians}",
              file=sys.stderr, flush=True)
    result.median_s = {v: statistics.median(runs[v]) for v in variants}
    result.peak_samples_gflops = [p for p in peaks if p is not None]
    if result.peak_samples_gflops:
        result.peak_gflops = statistics.median(result.peak_samples_gflops)
    device = torch.device(args.device)
    for variant in variants:
        if variant == COMPILE_MAX:
            # Compiled for inference only, so nothing saved for backward; measured through its
            # timed call (no_grad), since inference_mode would compile it again.
            with compiling(variant):
                _, memory = measure_call(calls[variant], device)
            result.memory[variant] = {"inference_peak_bytes": memory.peak_bytes}
            continue
        memory = forward_memory(modules[variant], x, device, compiled=variant == "compile")
        memory = replace(memory, peak_is_whole=torch_sees_whole_peak(device, variant == "fused"))
        result.memory[variant] = asdict(memory)
    return result


def cpu_isa(args: argparse.Namespace) -> str:
    return _C.cpu_isa(args.dtype if args.device == "cpu" else "float32")


def bench_peak_loop(args: argparse.Namespace) -> PeakLoop | None:
    return peak_loop(DTYPES[args.dtype], cpu_isa(args)) if args.device == "cpu" else None


def machine_description(args: argparse.Namespace, loop: PeakLoop | None,
                        sampler: PeakSampler | None) -> dict:
    isa = cpu_isa(args)
    threads = torch.get_num_threads()
    description = {
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_isa": isa,
        "threads": threads,
        "rounds": args.rounds,
        # the peak loop's GFLOP/s at the start, for reference: each GEMM-bound case's fraction
        # is against the peak sampled beside its timings (its peak_gflops)
        "start_peak_gflops": None,
        "peak_kind": None,  # what the peak loop times: peak.PeakLoop.kind
        "emulated_cpu": args.emulate_cpu,  # --emulate-cpu: torch limited to it too
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "weight_cache_mib": _C.weight_cache_info()["limit_bytes"] >> 20,
    }
    if args.device == "cuda":
        description["gpu"] = torch.cuda.get_device_name()
        return description
    if loop is not None and sampler is not None:
        print(f"measuring the {loop.kind} peak ({threads} threads) ...", file=sys.stderr,
              flush=True)
        description["start_peak_gflops"] = sampler(START_SECONDS, START_REPS)
        description["peak_kind"] = loop.kind if description["start_peak_gflops"] else None
    return description


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_cpu is not None:
        emulation = EMULATIONS[args.emulate_cpu]
        if not environment_matches(emulation, os.environ):
            command, environment = child_command(
                emulation, sys.argv[1:] if argv is None else list(argv), os.environ)
            return subprocess.run(command, env=environment).returncode
        check_in_effect(emulation)
    require_matplotlib("python -m fusedmlp.bench")
    quiet_kineto()  # the memory columns run torch.profiler
    # Inductor's pool of compile worker processes would keep cores busy while we time.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if DTYPES[args.dtype] not in DEVICE_DTYPES[args.device]:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DEVICE_DTYPES[args.device])
        raise SystemExit(f"--dtype {args.dtype}: the fused {args.device} kernels take {supported}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.weight_cache is not None:
        os.environ["FUSEDMLP_WEIGHT_CACHE_MB"] = str(args.weight_cache)
    cases = select_cases(args.cases)
    started = time.perf_counter()
    loop = bench_peak_loop(args)
    with peak_sampler(loop, torch.get_num_threads()) as sampler:
        machine = machine_description(args, loop, sampler)
        results = [run_case(case, args, i + 1, len(cases), sampler)
                   for i, case in enumerate(cases)]
    print(f"bench took {time.perf_counter() - started:.0f} s", file=sys.stderr)
    peak = machine["start_peak_gflops"]
    print()
    print(f"fusedmlp bench: {args.device} {args.dtype}, ISA {machine['cpu_isa']}, "
          f"{machine['threads']} threads, torch {machine['torch']}, "
          + (f"{machine['peak_kind']} peak {peak:.1f} GFLOP/s at the start (% peak: of the "
             "peak sampled beside each case)" if peak else "peak n/a"))
    if args.emulate_cpu is not None:
        print(describe(EMULATIONS[args.emulate_cpu]))
    if machine["weight_cache_mib"]:
        print(f"fused's inference calls read their weights packed once "
              f"(FUSEDMLP_WEIGHT_CACHE_MB={machine['weight_cache_mib']})")
    print(format_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "bench.json", machine, results)
    title = f"fusedmlp vs eager / torch.compile / compile-max ({args.device}, {args.dtype})"
    write_plot(args.out / "bench.png", results, title)
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0

