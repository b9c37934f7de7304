"""Plain-language reading of a study: what changed and what stayed, variant to variant."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from fusedmlp.profile.experiments import COMPILE, FUSED_COMPILE
from fusedmlp.profile.measure import ExperimentResult, VariantResult
from fusedmlp.tools.memory import format_mib

# A change in time under this fraction is reported as "about the same": runs on a shared
# machine drift by a few percent.
TIME_NOISE = 0.03
# Decimal places for a time in ms, by its size: about three significant digits.
MS_DECIMALS = ((100.0, 0), (10.0, 1), (1.0, 2), (0.0, 3))
# From this ratio on a change reads better as "fell 3.1x" than as "fell 68%".
FACTOR_WORDING_FROM = 2.0

# (singular, plural) name of each kind of device kernel that kernel_kind tells apart.
KERNEL_KINDS = {
    "memory": ("memcpy/memset", "memcpys/memsets"),
    "triton": ("generated Triton kernel", "generated Triton kernels"),
    "fusedmlp": ("fusedmlp kernel", "fusedmlp kernels"),
    "gemm": ("GEMM", "GEMMs"),
    "pointwise": ("pointwise kernel", "pointwise kernels"),
    "other": ("other kernel", "other kernels"),
}
GEMM_NAME_MARKS = ("gemm", "xmma", "cutlass", "cublas", "nvjet", "sm90_", "sm80_", "ampere_")
POINTWISE_NAME_MARKS = ("elementwise", "pointwise", "at::native")


def format_count(count: float) -> str:
    return str(round(count)) if abs(count - round(count)) < 0.05 else f"{count:.1f}"


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    decimals = next(places for floor, places in MS_DECIMALS if ms >= floor)
    return f"{ms:.{decimals}f}"


def join_words(words: list[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


def describe_ops(counts: Counter[str]) -> str:
    return join_words([f"{format_count(n)} {name}" for name, n in counts.most_common()])


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "memcpy" in lowered or "memset" in lowered:
        return "memory"
    if "triton" in lowered:
        return "triton"
    if "fusedmlp" in lowered:
        return "fusedmlp"
    if any(mark in lowered for mark in GEMM_NAME_MARKS):
        return "gemm"
    if any(mark in lowered for mark in POINTWISE_NAME_MARKS):
        return "pointwise"
    return "other"


def describe_kernel_kinds(kinds: Counter[str]) -> str:
    words = []
    for kind, count in kinds.most_common():
        singular, plural = KERNEL_KINDS[kind]
        words.append(f"{format_count(count)} {singular if round(count) == 1 else plural}")
    return join_words(words)


def ops_phrase(subject: str, before: Counter[str], after: Counter[str]) -> str:
    removed, added, kept = before - after, after - before, before & after
    if not removed and not added:
        return f"{subject} dispatches the same ops ({describe_ops(after)})"
    if removed and added:
        change = f"{subject} replaced {describe_ops(removed)} with {describe_ops(added)}"
    elif removed:
        change = f"{subject} dropped {describe_ops(removed)}"
    else:
        change = f"{subject} added {describe_ops(added)}"
    stayed = f"; {describe_ops(kept)} stayed" if kept else ""
    totals = f"{format_count(sum(before.values()))} → {format_count(sum(after.values()))}"
    return f"{change}{stayed} (ops per forward {totals})"


def kernels_phrase(before: dict[str, float], after: dict[str, float]) -> str:
    before_kinds = kind_counts(before)
    after_kinds = kind_counts(after)
    removed, added = before_kinds - after_kinds, after_kinds - before_kinds
    kept = before_kinds & after_kinds
    if not removed and not added:
        total = format_count(sum(after.values()))
        return f"the same {total} kernels ran ({describe_kernel_kinds(after_kinds)})"
    if removed and added:
        change = f"{describe_kernel_kinds(removed)} became {describe_kernel_kinds(added)}"
    elif removed:
        change = f"{describe_kernel_kinds(removed)} went away"
    else:
        change = f"{describe_kernel_kinds(added)} appeared"
    stayed = f", the {describe_kernel_kinds(kept)} stayed" if kept else ""
    totals = f"{format_count(sum(before.values()))} → {format_count(sum(after.values()))}"
    return f"{change}{stayed} (kernels per forward {totals})"


def kind_counts(kernels: dict[str, float]) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for name, count in kernels.items():
        kinds[kernel_kind(name)] += count
    return kinds


def operator_calls_phrase(before: VariantResult, after: VariantResult) -> str | None:
    before_calls = sum(before.counts.all_ops.values())
    after_calls = sum(after.counts.all_ops.values())
    if round(before_calls) == round(after_calls):
        return None
    totals = f"{format_count(before_calls)} → {format_count(after_calls)}"
    return f"operator calls per forward, nested included, went {totals}"


def generated_cpu_kernels_phrase(before: VariantResult, after: VariantResult) -> str | None:
    before_kernels = before.counts.inductor_cpu_kernels
    after_kernels = Counter(after.counts.inductor_cpu_kernels)
    if after_kernels == Counter(before_kernels):
        return None
    if not after_kernels:
        return "Inductor's generated C++ kernels are gone"
    return f"Inductor's generated C++ runs {describe_ops(after_kernels)}"


def change_phrase(
    label: str, before: float, after: float, formatted: Callable[[float], str], unit: str
) -> str:
    values = f"{formatted(before)} → {formatted(after)} {unit}"
    if before == after:
        return f"{label} stayed at {formatted(after)} {unit}"
    if min(before, after) <= 0:
        return f"{label} went {values}"
    change = after / before - 1
    if abs(change) < TIME_NOISE:
        return f"{label} stayed about the same ({values})"
    verb = "fell" if change < 0 else "rose"
    factor = max(before, after) / min(before, after)
    amount = f"{factor:.1f}x" if factor >= FACTOR_WORDING_FROM else f"{abs(change):.0%}"
    return f"{label} {verb} {amount} ({values})"


def time_phrase(label: str, before_ms: float, after_ms: float) -> str:
    return change_phrase(label, before_ms, after_ms, format_ms, "ms")


def memory_phrases(before: VariantResult, after: VariantResult) -> list[str]:
    old, new = before.memory, after.memory
    whole = old.peak_is_whole and new.peak_is_whole
    return [
        change_phrase(
            "peak forward memory" if whole else "peak forward memory torch sees",
            old.inference_peak_bytes,
            new.inference_peak_bytes,
            format_mib,
            "MiB",
        ),
        change_phrase(
            "memory saved for backward",
            old.saved_for_backward_bytes,
            new.saved_for_backward_bytes,
            format_mib,
            "MiB",
        ),
    ]


def step_reading(before: VariantResult, after: VariantResult) -> str:
    before_counts, after_counts = before.counts, after.counts
    parts = [
        ops_phrase(
            after.variant,
            Counter(before_counts.top_level_ops),
            Counter(after_counts.top_level_ops),
        ),
        operator_calls_phrase(before, after),
        generated_cpu_kernels_phrase(before, after),
    ]
    if before_counts.device_kernels is not None and after_counts.device_kernels is not None:
        parts.append(kernels_phrase(before_counts.device_kernels, after_counts.device_kernels))
    parts.append(time_phrase("wall time per forward", before.wall.median_ms, after.wall.median_ms))
    parts.append(time_phrase("CPU time", before_counts.cpu_ms, after_counts.cpu_ms))
    if before_counts.device_ms is not None and after_counts.device_ms is not None:
        parts.append(time_phrase("GPU time", before_counts.device_ms, after_counts.device_ms))
    parts += memory_phrases(before, after)
    if after.variant in (COMPILE, FUSED_COMPILE):
        parts.append(f"its first call, compiling included, took {after.first_call_s:.1f} s")
    reading = f"{before.variant} → {after.variant}: " + "; ".join(filter(None, parts)) + "."
    if not after.check.matches_eager:
        reading += (
            f" Its output does NOT match eager (max abs diff {after.check.max_abs_diff:.3g},"
            f" tolerance {after.check.atol:.3g})."
        )
    return reading


def bottom_line(experiment: ExperimentResult) -> str:
    eager = experiment.eager
    fastest = min(experiment.variants, key=lambda result: result.wall.median_ms)
    fewest_ops = min(experiment.variants, key=lambda result: result.ops_per_forward)
    # A peak that misses the kernels' own allocations is not ranked against whole ones.
    whole = [result for result in experiment.variants if result.memory.peak_is_whole]
    unranked = [result.variant for result in experiment.variants if not result.memory.peak_is_whole]
    leanest = min(whole, key=lambda result: result.memory.inference_peak_bytes)
    speedup = eager.wall.median_ms / fastest.wall.median_ms
    mismatched = [
        result.variant for result in experiment.variants if not result.check.matches_eager
    ]
    matching = (
        "every variant matches eager"
        if not mismatched
        else f"NOT matching eager: {join_words(mismatched)}"
    )
    fastest_text = (
        "eager itself" if fastest is eager else f"{fastest.variant} ({speedup:.2f}x eager)"
    )
    eager_peak = eager.memory.inference_peak_bytes
    leanest_peak = leanest.memory.inference_peak_bytes
    share = f", {leanest_peak / eager_peak:.0%} of eager's" if eager_peak else ""
    leanest_text = (
        f"{leanest.variant} ({format_mib(leanest_peak)} MiB{share})"
        if leanest_peak < eager_peak
        else f"eager itself ({format_mib(eager_peak)} MiB)"
    )
    if unranked:
        leanest_text += (
            f", {join_words(unranked)} not ranked (torch does not see their kernels' scratch)"
        )
    return (
        f"Fastest by wall time: {fastest_text}; fewest ops per "
        f"forward: {fewest_ops.variant} ({format_count(fewest_ops.ops_per_forward)}); "
        f"lowest peak forward memory: {leanest_text}; {matching}."
    )


def experiment_reading(experiment: ExperimentResult) -> list[str]:
    steps = itertools.pairwise(experiment.variants)
    return [step_reading(before, after) for before, after in steps] + [bottom_line(experiment)]
