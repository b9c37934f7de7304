"""The chart of `python -m fusedmlp.profile`: time, ops/kernels and memory per forward, per
variant."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fusedmlp.profile.measure import ExperimentResult
from fusedmlp.tools.memory import MIB
from fusedmlp.tools.plotting import pyplot

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BAR_GROUP_WIDTH = 0.8
LEGEND_HEADROOM = 1.3


def grouped_bars(axes: Axes, labels: list[str], series: dict[str, list[float]]) -> None:
    width = BAR_GROUP_WIDTH / len(series)
    for index, (name, values) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        positions = [position + offset for position in range(len(labels))]
        axes.bar(positions, values, width, label=name)
    axes.set_xticks(range(len(labels)), labels, rotation=20)
    tallest = max(max(values) for values in series.values())
    axes.set_ylim(0, tallest * LEGEND_HEADROOM or 1)
    axes.legend(fontsize="small", loc="upper left", ncols=len(series))


def time_series(experiment: ExperimentResult) -> dict[str, list[float]]:
    results = experiment.variants
    series = {
        "wall": [result.wall.median_ms for result in results],
        "CPU (profiled)": [result.counts.cpu_ms for result in results],
    }
    if all(result.counts.device_ms is not None for result in results):
        series["GPU"] = [result.counts.device_ms or 0.0 for result in results]
    return series


def count_series(experiment: ExperimentResult) -> dict[str, list[float]]:
    results = experiment.variants
    series = {"ops": [result.ops_per_forward for result in results]}
    if all(result.kernels_per_forward is not None for result in results):
        series["kernels"] = [result.kernels_per_forward or 0.0 for result in results]
    return series


def memory_series(experiment: ExperimentResult) -> dict[str, list[float]]:
    memories = [result.memory for result in experiment.variants]
    return {
        "peak forward": [memory.inference_peak_bytes / MIB for memory in memories],
        "saved for backward": [memory.saved_for_backward_bytes / MIB for memory in memories],
    }


def write_chart(path: Path, experiments: list[ExperimentResult], title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    figure, axes = plt.subplots(
        3, len(experiments), figsize=(4.5 * len(experiments), 10), squeeze=False
    )
    for column, experiment in enumerate(experiments):
        labels = [result.variant for result in experiment.variants]
        time_axes, count_axes = axes[0][column], axes[1][column]
        grouped_bars(time_axes, labels, time_series(experiment))
        shape = ", ".join(str(size) for size in experiment.input_shape)
        time_axes.set_title(f"{experiment.name}, input ({shape})")
        time_axes.set_ylabel("ms per forward")
        grouped_bars(count_axes, labels, count_series(experiment))
        count_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        count_axes.set_ylabel("ops / kernels per forward")
        memory_axes = axes[2][column]
        # a starred variant's peak counts torch's allocations alone (summary.md says why)
        memory_labels = [result.variant + result.peak_mark for result in experiment.variants]
        grouped_bars(memory_axes, memory_labels, memory_series(experiment))
        memory_axes.set_ylabel("MiB above inputs and weights")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
