"""A training bench case's forward (with grad) and backward apart (issue 13): times the case's
forward alone and its whole step (`zero grads; model(x).sum().backward()`), eager and fused
taking turns in every round (the bench's timer), and prints each part's median time,
fused/eager and GFLOP/s, the backward's being the step's median less the forward's, with the
peak (peak.py's loop for the dtype and level) sampled after the rounds, so that a step's
ratio can be read against what eager's own GEMMs reach:

    PYTHONPATH=python python scripts/step_parts.py [CASE] [--rounds N] [--dtype D]
                                                   [--min-run-time S]

CASE: train_step (default), train_small or train_gated. Where eager already runs a part near
the peak, no kernel can take that part much below its time."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import torch
from fusedmlp import _C
from fusedmlp.bench.cases import CASES, build_modules, gemm_flops, make_input, training_call
from fusedmlp.bench.cli import timed_runs, warm_up
from fusedmlp.bench.peak import START_REPS, START_SECONDS, peak_loop, peak_sampler

TRAINING_CASES = {case.name: case for case in CASES if case.train}
VARIANTS = ("eager", "fused")
PARTS = ("forward", "backward")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", nargs="?", default="train_step", choices=sorted(TRAINING_CASES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--min-run-time", type=float, default=0.2,
                        help="seconds each variant's call is timed for in a round")
    args = parser.parse_args()
    if args.rounds < 1 or args.min_run_time <= 0:
        parser.error("--rounds must be at least 1 and --min-run-time positive")
    return args


def main() -> None:
    args = parse_args()
    case, dtype = TRAINING_CASES[args.case], getattr(torch, args.dtype)
    x = make_input(case.rows, case.sizes, "cpu", dtype)
    calls: dict[str, Callable[[], object]] = {}
    for variant, module in zip(VARIANTS, build_modules(case, case.sizes, "cpu", dtype)):
        calls[f"{variant} forward"] = lambda module=module: module(x)
        calls[f"{variant} step"] = training_call(module, list(module.parameters()), x)
    for call in calls.values():
        warm_up(call)
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            times[key] += timed_runs(call, args.min_run_time)
    us = {key: statistics.median(t) * 1e6 for key, t in times.items()}
    forward_flops = gemm_flops(dataclasses.replace(case, train=False), case.rows, case.sizes)
    flops = {"forward": forward_flops,
             "backward": gemm_flops(case, case.rows, case.sizes) - forward_flops}
    part_us = {(variant, "forward"): us[f"{variant} forward"] for variant in VARIANTS}
    part_us |= {(variant, "backward"): us[f"{variant} step"] - us[f"{variant} forward"]
                for variant in VARIANTS}
    threads = torch.get_num_threads()
    loop = peak_loop(dtype, _C.cpu_isa(args.dtype))
    with peak_sampler(loop, threads) as sampler:
        peak = sampler(START_SECONDS, START_REPS) if sampler is not None else None
    timed_peak = f"{loop.kind} peak {peak:.0f} GFLOP/s" if loop and peak else "no peak timed"
    print(f"{case.name} ({case.description}), {args.dtype}, {threads} threads, "
          f"{args.rounds} rounds, {timed_peak} after them")
    for part in PARTS:
        line = f"  {part:>8}:"
        for variant in VARIANTS:
            rate = flops[part] / part_us[variant, part] / 1e3
            share = f" ({rate / peak:.0%})" if peak else ""
            line += f"  {variant} {part_us[variant, part]:9.0f} us {rate:6.1f} GFLOP/s{share}"
        ratio = part_us["fused", part] / part_us["eager", part]
        print(f"{line}  fused/eager {ratio:.3f}")
    print(f"      step:  fused/eager {us['fused step'] / us['eager step']:.3f}")


if __name__ == "__main__":
    main()
