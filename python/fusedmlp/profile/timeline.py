"""One forward on a time axis: the profiler's own events of one of a variant's profiled forwards
(CPU operator spans by nesting depth, and on CUDA the GPU kernels), and the picture that puts
every variant of an experiment in its own lane on a common axis."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.autograd.profiler_util import FunctionEvent

from fusedmlp.profile.optree import display_name, shown_children
from fusedmlp.tools.plotting import pyplot

# CPU nesting levels drawn: enough for Compiled Region -> CompiledFxGraph -> aten::mm -> copy_.
CPU_ROWS = 4
KIND_COLORS = {
    "aten op": "#4c78a8",
    "fusedmlp": "#f58518",
    "generated kernel": "#54a24b",
    "compile wrapper": "#bab0ac",
    "GPU kernel": "#b279a2",
}
LANE_GAP_ROWS = 0.6
# Text is drawn inside a span only where it fits: about this many points per character.
POINTS_PER_CHAR = 5.5
FIGURE_WIDTH_IN = 13.0
ROW_HEIGHT_IN = 0.28
SHORT_NAMES = (
    ("Torch-Compiled Region", "compiled region"),
    ("TorchDynamo Cache Lookup", "dynamo cache lookup"),
    ("## Call CompiledFxGraph", "CompiledFxGraph"),
    ("AOTDispatcher Runtime Wrapper Prologue", "AOT prologue"),
)


@dataclass(frozen=True)
class Span:
    name: str
    kind: str
    row: int  # CPU nesting depth, or CPU_ROWS for the GPU
    start_ms: float  # from the forward's start
    duration_ms: float


@dataclass(frozen=True)
class Timeline:
    duration_ms: float
    spans: list[Span]
    has_gpu_row: bool


def span_kind(name: str) -> str:
    if name.startswith("fusedmlp"):
        return "fusedmlp"
    if "::" in name:
        return "aten op"
    if "cpp_fused" in name or "triton" in name:
        return "generated kernel"
    return "compile wrapper"


def cpu_spans(event: FunctionEvent, origin_us: float, depth: int) -> list[Span]:
    name = display_name(event)
    start_ms = (event.time_range.start - origin_us) / 1e3
    spans = [Span(name, span_kind(name), depth, start_ms, event.time_range.elapsed_us() / 1e3)]
    if depth + 1 < CPU_ROWS:
        for child in shown_children(event):
            spans += cpu_spans(child, origin_us, depth + 1)
    return spans


def forward_timeline(forward: FunctionEvent, gpu_kernels: list[FunctionEvent] | None) -> Timeline:
    """The spans of one forward-label event; gpu_kernels are the device kernels that ran after
    it started (the profiler synchronises after each forward, so they are this forward's)."""
    origin_us = forward.time_range.start
    spans = []
    for event in shown_children(forward):
        spans += cpu_spans(event, origin_us, 0)
    end_ms = forward.time_range.elapsed_us() / 1e3
    for kernel in gpu_kernels or []:
        start_ms = (kernel.time_range.start - origin_us) / 1e3
        duration_ms = kernel.time_range.elapsed_us() / 1e3
        spans.append(Span(kernel.name, "GPU kernel", CPU_ROWS, start_ms, duration_ms))
        end_ms = max(end_ms, start_ms + duration_ms)
    return Timeline(end_ms, spans, gpu_kernels is not None)


def short_name(name: str) -> str:
    for prefix, short in SHORT_NAMES:
        if name.startswith(prefix):
            return short
    for prefix in ("void ", "aten::", "fusedmlp::"):
        name = name.removeprefix(prefix)
    return name.split("<", 1)[0].split("(", 1)[0]


def fitted_label(name: str, width_points: float) -> str | None:
    chars = int(width_points / POINTS_PER_CHAR)
    if chars < 3:
        return None
    return name if len(name) <= chars else name[: chars - 1] + "…"


def duration_text(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def rows_of(timeline: Timeline) -> int:
    cpu_rows = max((span.row for span in timeline.spans if span.row < CPU_ROWS), default=0) + 1
    return cpu_rows + int(timeline.has_gpu_row)


def write_timeline(path: Path, title: str, lanes: list[tuple[str, Timeline]]) -> None:
    """One lane per (variant, timeline), top to bottom, on one time axis in ms."""
    plt = pyplot()
    lane_rows = [rows_of(timeline) for _, timeline in lanes]
    total_rows = sum(lane_rows) + LANE_GAP_ROWS * (len(lanes) - 1)
    figure, axes = plt.subplots(
        figsize=(FIGURE_WIDTH_IN, 1.2 + ROW_HEIGHT_IN * total_rows * 1.6)
    )
    axis_ms = max(timeline.duration_ms for _, timeline in lanes) or 1.0
    points_per_ms = (FIGURE_WIDTH_IN - 2.2) * 72 / axis_ms
    top, centres, labels = 0.0, [], []
    for (variant, timeline), rows in zip(lanes, lane_rows):
        for span in timeline.spans:
            # the GPU row sits right under the lane's deepest CPU row
            row = rows - 1 if span.row == CPU_ROWS else span.row
            y = top + row
            axes.barh(y, span.duration_ms, left=span.start_ms, height=0.8,
                      color=KIND_COLORS[span.kind], edgecolor="white", linewidth=0.3)
            label = fitted_label(short_name(span.name), span.duration_ms * points_per_ms)
            if label:
                axes.text(span.start_ms + span.duration_ms / 2, y, label, ha="center",
                          va="center", fontsize=7, clip_on=True)
        centres.append(top + (rows - 1) / 2)
        gpu = ", GPU row last" if timeline.has_gpu_row else ""
        labels.append(f"{variant}\n{duration_text(timeline.duration_ms)}{gpu}")
        top += rows + LANE_GAP_ROWS
    axes.set_yticks(centres, labels, fontsize=8)
    axes.set_ylim(top - LANE_GAP_ROWS - 0.5, -0.5)
    axes.set_xlim(0, axis_ms)
    axes.set_xlabel("ms from the start of the forward (CPU spans nested top to bottom)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in KIND_COLORS.values()]
    axes.legend(handles, list(KIND_COLORS), fontsize=7, ncols=len(KIND_COLORS),
                loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    axes.set_title(title, pad=22, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
