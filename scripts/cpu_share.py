"""How much of the CPU the fused bench cases got (issue 18): runs the fused variant of the
named bench cases (default: the float32 GEMM-bound ones) at THREADS threads, the cases taking
turns within each round (order reversed every other round), and prints, from medians over the
rounds, GFLOP/s by wall time, GFLOP/s per second of the process's CPU time (all its threads),
and CPU time over wall time: THREADS when every thread ran throughout, less when other
processes took the cores or a thread waited:

    PYTHONPATH=python python scripts/cpu_share.py [THREADS [ROUNDS [CASES [DTYPE]]]]

On the shared 2-core machine the bench's wall GFLOP/s (and so its % of peak) follow the load
of the moment: a case whose CPU/wall reads ~1 at 2 threads ran on one core's worth, however
fast its kernels. FUSEDMLP_ISA (e.g. avx2) picks the unit as for the bench; eager is not run."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from fusedmlp.bench.cases import CASES, build_modules, forward_flops, inference_call, make_input

GEMM_BOUND = [c.name for c in CASES if c.gemm_bound and not c.train]


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else GEMM_BOUND
    dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; choose from {sorted(by_name)}")
    torch.set_num_threads(threads)
    calls: dict[str, tuple[Callable[[], object], int]] = {}
    for name in names:
        case = by_name[name]
        rows, sizes = case.shape(False)
        _, fused = build_modules(case, sizes, "cpu", dtype)
        x = make_input(rows, sizes, "cpu", dtype)
        calls[name] = (inference_call(fused, x), forward_flops(case, rows, sizes))
    wall: dict[str, list[float]] = {n: [] for n in calls}
    cpu: dict[str, list[float]] = {n: [] for n in calls}
    for call, _ in calls.values():
        call()  # warm
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for name in order:
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            calls[name][0]()
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    print(f"{threads} threads, {rounds} rounds, {dtype}, medians")
    for name, (_, flops) in calls.items():
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"{name:14s} wall {flops / w / 1e9:7.1f} GFLOP/s  per CPU-second "
              f"{flops / c / 1e9:7.1f}  CPU/wall {c / w:4.2f}")


if __name__ == "__main__":
    main()
