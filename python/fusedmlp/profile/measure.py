"""Measuring one variant: warm-up, output check, torch.profiler counts, wall time."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from fusedmlp.profile.optree import OpNode, forward_tree
from fusedmlp.profile.timeline import Timeline, forward_timeline
from fusedmlp.tools.memory import ForwardMemory

Model = Callable[..., torch.Tensor]

FORWARD_LABEL = "fusedmlp.profile: forward"
PROFILER_WAIT_STEPS, PROFILER_WARMUP_STEPS = 1, 1
DEVICE_ACTIVITY_TYPES = ("kernel", "gpu_memcpy", "gpu_memset")
INDUCTOR_CPU_KERNEL_MARK = "cpp_fused"

# Relative tolerance per dtype, applied to every element and, as absolute tolerance, to the
# output's largest magnitude: variants reduce over K in different orders, which moves each
# output by about sqrt(K) * eps of the output's scale, not of the element itself. float32 is
# looser than assert_close's 1.3e-6 for the same reason (K is up to 3072, three layers deep).
RELATIVE_TOLERANCE = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-3,
    torch.bfloat16: 1.6e-2,
}


@dataclass(frozen=True)
class OutputCheck:
    matches_eager: bool
    max_abs_diff: float
    rtol: float
    atol: float


@dataclass(frozen=True)
class ProfileCounts:
    """Per forward, over the profiler's active steps: mean counts, median CPU time."""

    top_level_ops: dict[str, float]
    all_ops: dict[str, float]
    device_kernels: dict[str, float] | None
    inductor_cpu_kernels: dict[str, float]
    cpu_ms: float
    device_ms: float | None


@dataclass(frozen=True)
class WallTime:
    median_ms: float
    min_ms: float
    max_ms: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(model: Model, inputs: torch.Tensor, runs: int, device: torch.device) -> float:
    """Runs the model `runs` times (compiling it if needed); returns the first call's seconds."""
    synchronize(device)
    start = time.perf_counter()
    model(inputs)
    synchronize(device)
    first_call_s = time.perf_counter() - start
    for _ in range(runs - 1):
        model(inputs)
    synchronize(device)
    return first_call_s


def check_output(actual: torch.Tensor, expected: torch.Tensor) -> OutputCheck:
    rtol = RELATIVE_TOLERANCE[expected.dtype]
    atol = rtol * expected.abs().max().item()
    max_abs_diff = (actual.double() - expected.double()).abs().max().item()
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return OutputCheck(False, max_abs_diff, rtol, atol)
    return OutputCheck(True, max_abs_diff, rtol, atol)


def has_operator_ancestor(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if "::" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def is_device_work(event: FunctionEvent) -> bool:
    if event.device_type != DeviceType.CUDA or event.is_user_annotation:
        return False
    return getattr(event, "activity_type", "kernel") in DEVICE_ACTIVITY_TYPES


def per_forward(counts: Counter[str], steps: int) -> dict[str, float]:
    return {name: count / steps for name, count in counts.most_common()}


def count_events(
    events: list[FunctionEvent],
    steps: int,
    device: torch.device,
) -> ProfileCounts:
    top_level_ops: Counter[str] = Counter()
    all_ops: Counter[str] = Counter()
    device_kernels: Counter[str] = Counter()
    inductor_cpu_kernels: Counter[str] = Counter()
    device_us = 0.0
    forward_us: list[float] = []
    for event in events:
        if is_device_work(event):
            device_kernels[event.name] += 1
            device_us += event.time_range.elapsed_us()
        elif event.device_type != DeviceType.CPU:
            continue
        elif event.name == FORWARD_LABEL:
            forward_us.append(event.time_range.elapsed_us())
        elif "::" in event.name:
            all_ops[event.name] += 1
            if not has_operator_ancestor(event):
                top_level_ops[event.name] += 1
        elif INDUCTOR_CPU_KERNEL_MARK in event.name:
            inductor_cpu_kernels[event.name] += 1
    on_cuda = device.type == "cuda"
    return ProfileCounts(
        top_level_ops=per_forward(top_level_ops, steps),
        all_ops=per_forward(all_ops, steps),
        device_kernels=per_forward(device_kernels, steps) if on_cuda else None,
        inductor_cpu_kernels=per_forward(inductor_cpu_kernels, steps),
        cpu_ms=statistics.median(forward_us) / 1e3,
        device_ms=device_us / steps / 1e3 if on_cuda else None,
    )


@dataclass(frozen=True)
class ForwardProfile:
    counts: ProfileCounts
    op_tree: list[OpNode]
    timeline: Timeline  # of the profiled forward of median CPU time


def median_forward_timeline(forwards: list[FunctionEvent], events: list[FunctionEvent],
                            device: torch.device) -> Timeline:
    """The timeline of the forward of median CPU time: one forward, not an outlier of a shared
    machine. Its GPU kernels are those that start before the next forward does."""
    forwards = sorted(forwards, key=lambda event: event.time_range.start)
    by_duration = sorted(forwards, key=lambda event: event.time_range.elapsed_us())
    forward = by_duration[len(by_duration) // 2]
    if device.type != "cuda":
        return forward_timeline(forward, None)
    start = forward.time_range.start
    later = [event.time_range.start for event in forwards if event.time_range.start > start]
    end = min(later, default=math.inf)
    kernels = [e for e in events if is_device_work(e) and start <= e.time_range.start < end]
    return forward_timeline(forward, kernels)


def profile_forward(
    model: Model,
    inputs: torch.Tensor,
    steps: int,
    device: torch.device,
    trace_path: Path,
) -> ForwardProfile:
    """Profiles `steps` forwards after the profiler's own wait/warm-up steps; writes the trace.
    Each forward is followed by a device synchronisation, as in time_forward, so that each
    forward's GPU kernels run before the next forward starts (the timeline needs that)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    total_steps = PROFILER_WAIT_STEPS + PROFILER_WARMUP_STEPS + steps
    with profile(
        activities=activities,
        schedule=schedule(wait=PROFILER_WAIT_STEPS, warmup=PROFILER_WARMUP_STEPS, active=steps),
        record_shapes=True,
    ) as profiler:
        for _ in range(total_steps):
            with record_function(FORWARD_LABEL):
                model(inputs)
            synchronize(device)
            profiler.step()
    profiler.export_chrome_trace(str(trace_path))
    events = list(profiler.events())
    forwards = [event for event in events if event.name == FORWARD_LABEL]
    return ForwardProfile(
        counts=count_events(events, steps, device),
        op_tree=forward_tree(forwards, device.type == "cuda"),
        timeline=median_forward_timeline(forwards, events, device),
    )


def time_forwards(models: dict[str, Model], inputs: torch.Tensor, iters: int,
                  device: torch.device) -> dict[str, WallTime]:
    """`iters` timed forwards of each model, the models taking turns forward by forward (in an
    order rotated each round), so that load drifting on a shared machine biases none of them.
    Timed one variant after another, the same fused op ran 521 ms as "fused" and 328 ms as
    "fused+compile" in one CPU run of the study (eager: 268 ms)."""
    names = list(models)
    samples_ms: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(iters):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            models[name](inputs)
            synchronize(device)
            samples_ms[name].append((time.perf_counter() - start) * 1e3)
    return {name: WallTime(statistics.median(samples), min(samples), max(samples))
            for name, samples in samples_ms.items()}


@dataclass(frozen=True)
class VariantResult:
    variant: str
    trace_file: str
    first_call_s: float
    check: OutputCheck
    counts: ProfileCounts
    op_tree: list[OpNode]
    timeline: Timeline
    memory: ForwardMemory
    wall: WallTime

    @property
    def ops_per_forward(self) -> float:
        return sum(self.counts.top_level_ops.values())

    @property
    def peak_mark(self) -> str:
        """"*" where the inference peak counts torch's allocations alone, else ""."""
        return "" if self.memory.peak_is_whole else "*"

    @property
    def kernels_per_forward(self) -> float | None:
        kernels = self.counts.device_kernels
        return None if kernels is None else sum(kernels.values())


@dataclass(frozen=True)
class ExperimentResult:
    name: str
    description: str
    input_shape: tuple[int, ...]
    variants: list[VariantResult]
    skipped: dict[str, str]  # variant -> why it did not run

    @property
    def eager(self) -> VariantResult:
        return self.variants[0]
