"""The benchmark's outputs: a table a person can read, JSON, and a PNG of the ratios."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusedmlp.tools.memory import format_mib
from fusedmlp.tools.plotting import pyplot

VARIANTS = ("eager", "compile", "fused")


@dataclass
class CaseResult:
    name: str
    description: str
    rows: int
    sizes: list[int]
    flops: int
    gemm_bound: bool
    median_s: dict[str, float] = field(default_factory=dict)  # per variant
    # per variant: inference_peak_bytes, saved_for_backward_bytes (tools/memory.py)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)

    def ratio(self, variant: str) -> float | None:
        """fused time / variant time: below 1 means fused is faster."""
        if "fused" not in self.median_s or variant not in self.median_s:
            return None
        return self.median_s["fused"] / self.median_s[variant]

    def gflops(self, variant: str) -> float | None:
        seconds = self.median_s.get(variant)
        return self.flops / seconds / 1e9 if seconds else None

    def to_json(self, peak_gflops: float | None) -> dict:
        record = asdict(self)
        record["ratio_vs_eager"] = self.ratio("eager")
        record["ratio_vs_compile"] = self.ratio("compile")
        record["gflops"] = {v: self.gflops(v) for v in self.median_s}
        fused = self.gflops("fused")
        record["fused_peak_fraction"] = (
            fused / peak_gflops if self.gemm_bound and peak_gflops and fused else None
        )
        return record


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _mib_per_variant(result: CaseResult, key: str) -> str:
    """The variants' MiB in VARIANTS order, joined by "/" (e.g. eager/compile/fused)."""
    values = [result.memory[v][key] for v in VARIANTS if v in result.memory]
    return "/".join(format_mib(value) for value in values) or "-"


def format_table(results: list[CaseResult], peak_gflops: float | None) -> str:
    variants = "/".join(v[0] for v in VARIANTS if any(v in r.memory for r in results))
    header = ["case", "eager ms", "compile ms", "fused ms", "fused/eager", "fused/compile",
              "fused GFLOP/s", "% peak", f"peak fwd MiB {variants}", f"saved bwd MiB {variants}"]
    rows = [header]
    for r in results:
        fused = r.gflops("fused")
        peak = fused / peak_gflops * 100 if r.gemm_bound and peak_gflops and fused else None
        rows.append([
            r.name,
            _ms(r.median_s.get("eager")),
            _ms(r.median_s.get("compile")),
            _ms(r.median_s.get("fused")),
            _number(r.ratio("eager"), "{:.2f}x"),
            _number(r.ratio("compile"), "{:.2f}x"),
            _number(fused, "{:.1f}"),
            _number(peak, "{:.0f}%"),
            _mib_per_variant(r, "inference_peak_bytes"),
            _mib_per_variant(r, "saved_for_backward_bytes"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, machine: dict, results: list[CaseResult]) -> None:
    peak = machine.get("peak_gflops")
    document = {"machine": machine, "cases": [r.to_json(peak) for r in results]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(path: Path, results: list[CaseResult], title: str) -> None:
    """Bars of fused time / eager and / compile time per case; the line at 1 is parity."""
    plt = pyplot()
    names = [r.name for r in results]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
    width = 0.38
    for offset, variant in ((-width / 2, "eager"), (width / 2, "compile")):
        values = [r.ratio(variant) or 0.0 for r in results]
        positions = [i + offset for i in range(len(names))]
        axes.bar(positions, values, width, label=f"fused / {variant}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes.set_ylabel("time ratio (lower is better for fused)")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
