"""How much memory one call allocates: its peak above what was allocated before it, and what it
leaves allocated (its output and, with autograd on, what the graph saved for backward).

CUDA reads the caching allocator's counters. The CPU allocator keeps none, so on the CPU the call
runs under torch.profiler with profile_memory=True and the allocation records it reports are
summed in time order. Memory a kernel takes outside torch's allocator (plain malloc) is in
neither; fusedmlp's CPU ops take their workspace as torch tensors, so theirs is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

MEMORY_RECORD = "[memory]"
MIB = 1024 * 1024


def format_mib(nbytes: float) -> str:
    """MiB to about three significant digits (0.00 below 5 KiB)."""
    mib = nbytes / MIB
    decimals = 0 if mib >= 100 else 1 if mib >= 10 else 2
    return f"{mib:.{decimals}f}"


@dataclass(frozen=True)
class CallMemory:
    peak_bytes: int
    held_bytes: int


def cpu_allocation_records(prof: profile) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every CPU allocator record in the profile.

    FunctionEvent lists fold these records into the op around them, keeping only the net sum;
    the raw records keep their order, which the peak needs."""
    records = prof.profiler.kineto_results.events()
    return [
        (record.start_ns(), record.nbytes())
        for record in records
        if record.name() == MEMORY_RECORD and record.device_type() == DeviceType.CPU
    ]


def measure_cpu(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, CallMemory]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        output = call()
    running = peak = 0
    for _, nbytes in sorted(cpu_allocation_records(prof)):
        running += nbytes
        peak = max(peak, running)
    return output, CallMemory(peak, running)


def measure_cuda(
    call: Callable[[], torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, CallMemory]:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    output = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return output, CallMemory(peak, torch.cuda.memory_allocated(device) - before)


def measure_call(
    call: Callable[[], torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, CallMemory]:
    """Runs call() once; returns its output and what it allocated on `device`."""
    if device.type == "cuda":
        return measure_cuda(call, device)
    return measure_cpu(call)


@dataclass(frozen=True)
class ForwardMemory:
    """Bytes of one forward above its inputs and weights: the inference peak (output included),
    and with autograd what the forward saved for backward (what it leaves, less its output).
    peak_is_whole: False where the peak counts torch's allocations alone, missing memory the
    forward's kernels allocate themselves (fusedmlp's C kernels on the CPU)."""

    inference_peak_bytes: int
    saved_for_backward_bytes: int
    peak_is_whole: bool = True


def torch_sees_whole_peak(device: torch.device, runs_fusedmlp: bool) -> bool:
    """Whether torch's allocations are all of a forward's memory: not where fusedmlp's ops run on
    the CPU, whose C kernels allocate their scratch and weight packs themselves, unseen by
    torch.profiler (scripts/heap_peak.py counts them)."""
    return not (runs_fusedmlp and device.type == "cpu")


def forward_memory(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
                   device: torch.device, compiled: bool) -> ForwardMemory:
    return ForwardMemory(inference_peak(model, inputs, device),
                         saved_for_backward(model, inputs, device, compiled))


def inference_peak(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
                   device: torch.device) -> int:
    with torch.inference_mode():
        _, memory = measure_call(lambda: model(inputs), device)
    return memory.peak_bytes


def saved_for_backward(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
                       device: torch.device, compiled: bool) -> int:
    """Needs weights that require grad and were not made under inference_mode. A compiled model
    first runs one unmeasured forward with autograd: its graphs for autograd differ, and
    compiling them must not count."""
    with torch.enable_grad():
        if compiled:
            model(inputs)
        output, memory = measure_call(lambda: model(inputs), device)
        output_bytes = output.untyped_storage().nbytes()
        del output  # frees the graph and what it saved
    return memory.held_bytes - output_bytes
