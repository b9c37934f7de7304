"""What `python -m fusedmlp.profile` writes: the tables, summary.md and summary.json."""

from __future__ import annotations

import json
import math
import os
import platform
from collections import Counter
from pathlib import Path

import torch

from fusedmlp.profile.measure import ExperimentResult, VariantResult
from fusedmlp.profile.optree import tree_text
from fusedmlp.profile.reading import (
    describe_ops,
    experiment_reading,
    format_count,
    format_ms,
)
from fusedmlp.tools.memory import format_mib

KERNEL_NAME_CHARS = 90
TABLE_HEADERS = (
    "variant",
    "matches eager",
    "ops/fwd",
    "kernels/fwd",
    "CPU ms/fwd",
    "GPU ms/fwd",
    "wall ms/fwd",
    "speedup (wall)",
    "first call s",
    "peak fwd MiB",
    "saved for bwd MiB",
)


def timeline_file(experiment: str) -> str:
    return f"timeline-{experiment}.png"


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_average() -> float | None:
    """The 1-minute load average: above the core count, every timing here is inflated."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def environment(device: torch.device) -> dict[str, str | int | float | None]:
    on_cuda = device.type == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": load_average(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def markdown_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: tuple[str, ...]) -> str:
        padded = (cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        return "| " + " | ".join(padded) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), separator, *(line(row) for row in rows)])


def table_row(result: VariantResult, eager: VariantResult) -> tuple[str, ...]:
    kernels = result.kernels_per_forward
    speedup = eager.wall.median_ms / result.wall.median_ms
    return (
        result.variant,
        "yes" if result.check.matches_eager else "NO",
        format_count(result.ops_per_forward),
        "n/a" if kernels is None else format_count(kernels),
        format_ms(result.counts.cpu_ms),
        format_ms(result.counts.device_ms),
        format_ms(result.wall.median_ms),
        f"{speedup:.2f}x",
        f"{result.first_call_s:.2f}",
        format_mib(result.memory.inference_peak_bytes) + result.peak_mark,
        format_mib(result.memory.saved_for_backward_bytes),
    )


def experiment_table(experiment: ExperimentResult) -> str:
    rows = [table_row(result, experiment.eager) for result in experiment.variants]
    return markdown_table(TABLE_HEADERS, rows)


def short_kernel_names(kernels: dict[str, float]) -> Counter[str]:
    """Demangled CUDA kernel names run to hundreds of characters; the start names the kernel."""
    short: Counter[str] = Counter()
    for name, count in kernels.items():
        name = name.removeprefix("void ")
        if len(name) > KERNEL_NAME_CHARS:
            name = name[: KERNEL_NAME_CHARS - 1] + "…"
        short[name] += count
    return short


def variant_details(result: VariantResult) -> list[str]:
    counts = result.counts
    ops = describe_ops(Counter(counts.top_level_ops))
    all_ops = format_count(sum(counts.all_ops.values()))
    details = [f"- {result.variant}: {ops} ({all_ops} operator calls, nested included)"]
    if counts.device_kernels is not None:
        kernels = describe_ops(short_kernel_names(counts.device_kernels)) or "none"
        details.append(f"  - kernels: {kernels}")
    if counts.inductor_cpu_kernels:
        generated = describe_ops(Counter(counts.inductor_cpu_kernels))
        details.append(f"  - generated C++ kernels: {generated}")
    return details


def input_shape_text(experiment: ExperimentResult) -> str:
    return "(" + ", ".join(str(size) for size in experiment.input_shape) + ")"


def op_tree_lines(result: VariantResult) -> list[str]:
    calls = format_count(sum(result.counts.all_ops.values()))
    return [
        f"{result.variant} ({calls} operator calls per forward):",
        "",
        "```text",
        tree_text(result.op_tree),
        "```",
        "",
    ]


def partial_peak_note(experiment: ExperimentResult) -> list[str]:
    """The footnote to the table's starred peaks, where it has any."""
    if all(result.memory.peak_is_whole for result in experiment.variants):
        return []
    return [
        "\\* torch's allocations only: the fused ops' C kernels allocate their scratch and "
        "weight packs themselves (scripts/heap_peak.py counts them).",
        "",
    ]


def experiment_section(experiment: ExperimentResult) -> str:
    lines = [
        f"## {experiment.name}: {experiment.description}, input {input_shape_text(experiment)}",
        "",
        experiment_table(experiment),
        "",
        *partial_peak_note(experiment),
        "Ops per forward (top-level operator events):",
        "",
    ]
    for result in experiment.variants:
        lines.extend(variant_details(result))
    for variant, reason in experiment.skipped.items():
        lines.append(f"- {variant}: skipped: {reason}")
    lines += [
        "",
        "Op tree of one forward (per forward over the profiled ones; total and self are host "
        "times, GPU ms (on CUDA) its kernels; views, reshapes, allocations and as_strided "
        "folded into their callers; shapes of the GEMMs' inputs):",
        "",
    ]
    for result in experiment.variants:
        lines.extend(op_tree_lines(result))
    timeline = timeline_file(experiment.name)
    lines += [f"One forward per variant, on one time axis: ![timeline]({timeline})"]
    lines += ["", "What changed:", ""]
    lines.extend(f"- {sentence}" for sentence in experiment_reading(experiment))
    traces = ", ".join(result.trace_file for result in experiment.variants)
    lines += ["", f"Traces (chrome://tracing or ui.perfetto.dev): {traces}"]
    return "\n".join(lines)


def header(env: dict[str, str | int | float | None], settings: dict[str, object]) -> str:
    gpu = f", GPU {env['gpu']}" if env["gpu"] else ""
    cuda = f", CUDA {env['cuda']}" if env["cuda"] else ""
    load_average_1min = env["load_average_1min"]
    load = f", load average {load_average_1min} at the end" if load_average_1min else ""
    setup = (
        f"torch {env['torch']}{cuda}; device {settings['device']}{gpu}; "
        f"dtype {settings['dtype']}; CPU {env['cpu']}, {env['torch_threads']} torch threads, "
        f"{env['cpu_count']} cores{load}."
    )
    method = (
        f"Wall time: median of {settings['iters']} forwards after {settings['warmup']} "
        "warm-up runs, the variants taking turns forward by forward. Op and kernel counts, "
        f"CPU and GPU time: torch.profiler over {settings['profile_steps']} forwards. CPU time "
        "is the median host time of a forward under the profiler; GPU time sums the device "
        "kernels' durations. Speedup is eager's wall time over the variant's. Memory, above "
        "the inputs and weights: the peak of one inference forward (its output included), and "
        "what one forward with autograd saves for backward (what it leaves allocated, less its "
        "output); "
        + (
            "from torch.cuda's allocator statistics."
            if str(settings["device"]).startswith("cuda")
            else "from torch.profiler's CPU allocation records. These see torch's "
            "allocations only: they leave out the scratch and per-call weight packs the fused "
            "ops' C kernels allocate themselves (scripts/heap_peak.py counts them), and under "
            "the profiler a fused module runs its op layer by layer, each layer's output a "
            "torch tensor, so the fused row shows that layered run."
        )
    )
    return f"# fusedmlp profile: eager vs torch.compile vs fused\n\n{setup}\n\n{method}"


def summary_markdown(
    env: dict[str, str | int | float | None],
    settings: dict[str, object],
    experiments: list[ExperimentResult],
    chart_file: str,
) -> str:
    sections = [header(env, settings)]
    sections.extend(experiment_section(experiment) for experiment in experiments)
    sections.append(f"![time, ops and memory per forward]({chart_file})")
    return "\n\n".join(sections) + "\n"


def variant_json(result: VariantResult) -> dict[str, object]:
    counts = result.counts
    return {
        "trace_file": result.trace_file,
        "matches_eager": result.check.matches_eager,
        "max_abs_diff": result.check.max_abs_diff,
        "rtol": result.check.rtol,
        "atol": result.check.atol,
        "ops_per_forward": result.ops_per_forward,
        "ops": counts.top_level_ops,
        "all_ops_per_forward": sum(counts.all_ops.values()),
        "all_ops": counts.all_ops,
        "kernels_per_forward": result.kernels_per_forward,
        "kernels": counts.device_kernels,
        "inductor_cpu_kernels": counts.inductor_cpu_kernels,
        "cpu_ms_per_forward": counts.cpu_ms,
        "gpu_ms_per_forward": counts.device_ms,
        "wall_ms_per_forward": result.wall.median_ms,
        "wall_ms_min": result.wall.min_ms,
        "wall_ms_max": result.wall.max_ms,
        "first_call_s": result.first_call_s,
        "inference_peak_bytes": result.memory.inference_peak_bytes,
        "inference_peak_is_whole": result.memory.peak_is_whole,
        "saved_for_backward_bytes": result.memory.saved_for_backward_bytes,
        "op_tree": [node.as_json() for node in result.op_tree],
    }


def experiment_json(experiment: ExperimentResult) -> dict[str, object]:
    return {
        "description": experiment.description,
        "input_shape": list(experiment.input_shape),
        "tokens": math.prod(experiment.input_shape[:-1]),
        "variants": {result.variant: variant_json(result) for result in experiment.variants},
        "skipped_variants": experiment.skipped,
        "timeline_file": timeline_file(experiment.name),
        "reading": experiment_reading(experiment),
    }


def write_summary_json(
    path: Path,
    env: dict[str, str | int | float | None],
    settings: dict[str, object],
    experiments: list[ExperimentResult],
) -> None:
    summary = {
        "tool": "fusedmlp.profile",
        "environment": env,
        "settings": settings,
        "experiments": {experiment.name: experiment_json(experiment) for experiment in experiments},
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
