"""A training bench case's forward (with grad) and backward apart (issue 13): times the case's
forward alone and its whole step (`zero grads; model(x).sum().backward()`), eager and fused
taking turns in every round, and prints each part's median time, fused/eager and GFLOP/s, the
backward's being the step's median less the forward's, with the FMA peak sampled after the
rounds, so that a step's ratio can be read against what eager's own GEMMs reach:

    PYTHONPATH=python python scripts/step_parts.py [CASE [ROUNDS [DTYPE]]]

CASE: train_step (default), train_small or train_gated. Where eager already runs a part near
the peak, no kernel can take that part much below its time."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import torch
from fusedmlp import _C
from fusedmlp.bench.cases import CASES, build_modules, gemm_flops, make_input, training_call
from fusedmlp.bench.peak import peak_loop, peak_sampler

CALLS_PER_ROUND = 20


def median_us(fn: Callable[[], object]) -> float:
    """The median of CALLS_PER_ROUND calls of fn, in microseconds."""
    times = []
    for _ in range(CALLS_PER_ROUND):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "train_step"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    case = next((c for c in CASES if c.name == name and c.train), None)
    if case is None:
        sys.exit(f"no training bench case {name!r}: " +
                 ", ".join(c.name for c in CASES if c.train))
    sizes = case.sizes
    x = make_input(case.rows, sizes, "cpu", dtype)
    calls: dict[str, Callable[[], object]] = {}
    for variant, module in zip(("eager", "fused"), build_modules(case, sizes, "cpu", dtype)):
        calls[f"{variant} forward"] = lambda module=module: module(x)
        calls[f"{variant} step"] = training_call(module, list(module.parameters()), x)
    for call in calls.values():
        for _ in range(5):
            call()
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(median_us(call))
    us = {key: statistics.median(t) for key, t in times.items()}
    forward_flops = gemm_flops(dataclasses.replace(case, train=False), case.rows, sizes)
    step_flops = gemm_flops(case, case.rows, sizes)
    flops = {"forward": forward_flops, "backward": step_flops - forward_flops}
    parts = {variant: {"forward": us[f"{variant} forward"],
                       "backward": us[f"{variant} step"] - us[f"{variant} forward"]}
             for variant in ("eager", "fused")}
    with peak_sampler(peak_loop(dtype, _C.cpu_isa(str(dtype).removeprefix("torch."))),
                      torch.get_num_threads()) as sampler:
        peak = sampler(0.04, 3) if sampler is not None else None
    print(f"{case.name} ({case.description}), {dtype}, {torch.get_num_threads()} threads, "
          f"medians of {rounds} rounds, FMA peak {peak or float('nan'):.0f} GFLOP/s after them")
    for part, part_flops in flops.items():
        line = f"  {part:>8}:"
        for variant in ("eager", "fused"):
            rate = part_flops / parts[variant][part] / 1e3
            share = f" ({rate / peak:.0%})" if peak else ""
            line += f"  {variant} {parts[variant][part]:9.0f} us {rate:6.1f} GFLOP/s{share}"
        print(f"{line}  fused/eager {parts['fused'][part] / parts['eager'][part]:.3f}")
    print(f"      step:  fused/eager {us['fused step'] / us['eager step']:.3f}")


if __name__ == "__main__":
    main()
