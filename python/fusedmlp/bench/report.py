"""The benchmark's outputs: a table a person can read, JSON, and a PNG of the ratios."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusedmlp.tools.memory import format_mib
from fusedmlp.tools.plotting import pyplot

VARIANTS = ("eager", "compile", "compile-max", "fused")
COMPARED = ("eager", "compile", "compile-max")  # what fused's time is divided by
INITIALS = {"eager": "e", "compile": "c", "compile-max": "m", "fused": "f"}
NOT_APPLICABLE = "\u2014"  # compile-max on a training case: it compiles inference only


@dataclass
class CaseResult:
    name: str
    description: str
    rows: int
    sizes: list[int]
    flops: int
    gemm_bound: bool
    train: bool = False
    median_s: dict[str, float] = field(default_factory=dict)  # per variant
    # per variant: inference_peak_bytes, saved_for_backward_bytes (tools/memory.py); compile-max
    # compiles inference only and has no saved_for_backward_bytes
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)  # per variant, compiling included
    # GEMM-bound cases: the peak loop's GFLOP/s sampled beside fused's timings in each round
    # (peak.py), and their median, which fused's fraction of the peak is taken against
    peak_samples_gflops: list[float] = field(default_factory=list)
    peak_gflops: float | None = None

    def ratio(self, variant: str) -> float | None:
        """fused time / variant time: below 1 means fused is faster."""
        if "fused" not in self.median_s or variant not in self.median_s:
            return None
        return self.median_s["fused"] / self.median_s[variant]

    def gflops(self, variant: str) -> float | None:
        seconds = self.median_s.get(variant)
        return self.flops / seconds / 1e9 if seconds else None

    def peak_fraction(self) -> float | None:
        """fused's GFLOP/s over the peak sampled under the same load (GEMM-bound cases)."""
        fused = self.gflops("fused")
        return fused / self.peak_gflops if self.gemm_bound and self.peak_gflops and fused else None

    def to_json(self) -> dict:
        record = asdict(self)
        for variant in COMPARED:
            record[f"ratio_vs_{variant.replace('-', '_')}"] = self.ratio(variant)
        record["gflops"] = {v: self.gflops(v) for v in self.median_s}
        record["fused_peak_fraction"] = self.peak_fraction()
        return record


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _runs(result: CaseResult, variant: str) -> bool:
    """Whether the variant is meant to run on this case (compile-max: inference only)."""
    return not (variant == "compile-max" and result.train)


def _cell(result: CaseResult, variant: str, value: float | None, pattern: str) -> str:
    return _number(value, pattern) if _runs(result, variant) else NOT_APPLICABLE


def _memory_variants(results: list[CaseResult], key: str) -> list[str]:
    return [v for v in VARIANTS if any(key in r.memory.get(v, {}) for r in results)]


def _mib_per_variant(result: CaseResult, key: str, variants: list[str]) -> str:
    """The variants' MiB joined by "/" (e.g. eager/compile/compile-max/fused); a peak that
    counts torch's allocations alone (peak_is_whole false) is starred."""
    cells = []
    for variant in variants:
        memory = result.memory.get(variant, {})
        nbytes = memory.get(key)
        partial = key == "inference_peak_bytes" and not memory.get("peak_is_whole", True)
        cells.append(NOT_APPLICABLE if not _runs(result, variant)
                     else "-" if nbytes is None else format_mib(nbytes) + "*" * partial)
    return "/".join(cells) or "-"


def format_table(results: list[CaseResult]) -> str:
    timed = [v for v in VARIANTS if any(v in r.median_s for r in results)]
    memory = {key: _memory_variants(results, key)
              for key in ("inference_peak_bytes", "saved_for_backward_bytes")}
    initials = {key: "/".join(INITIALS[v] for v in variants) for key, variants in memory.items()}
    header = ["case", *(f"{v} ms" for v in timed),
              *(f"fused/{v}" for v in COMPARED if v in timed),
              "fused GFLOP/s", "peak GFLOP/s", "% peak",
              f"peak fwd MiB {initials['inference_peak_bytes']}",
              f"saved bwd MiB {initials['saved_for_backward_bytes']}"]
    rows = [header]
    for r in results:
        fraction = r.peak_fraction()
        rows.append([
            r.name,
            *(_cell(r, v, r.median_s[v] * 1e3 if v in r.median_s else None, "{:.3f}")
              for v in timed),
            *(_cell(r, v, r.ratio(v), "{:.2f}x") for v in COMPARED if v in timed),
            _number(r.gflops("fused"), "{:.1f}"),
            _number(r.peak_gflops if r.gemm_bound else None, "{:.1f}"),
            _number(None if fraction is None else fraction * 100, "{:.0f}%"),
            _mib_per_variant(r, "inference_peak_bytes", memory["inference_peak_bytes"]),
            _mib_per_variant(r, "saved_for_backward_bytes", memory["saved_for_backward_bytes"]),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, machine: dict, results: list[CaseResult]) -> None:
    document = {"machine": machine, "cases": [r.to_json() for r in results]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(path: Path, results: list[CaseResult], title: str) -> None:
    """Bars of fused time / each other variant's time per case (none where that variant did
    not run); the line at 1 is parity."""
    plt = pyplot()
    names = [r.name for r in results]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
    compared = [v for v in COMPARED if any(v in r.median_s for r in results)]
    width = 0.8 / len(compared)
    for index, variant in enumerate(compared):
        values = [r.ratio(variant) or 0.0 for r in results]
        offset = (index - (len(compared) - 1) / 2) * width
        axes.bar([i + offset for i in range(len(names))], values, width,
                 label=f"fused / {variant}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes.set_ylabel("time ratio (lower is better for fused)")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
