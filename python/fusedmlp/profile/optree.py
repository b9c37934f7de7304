"""The operator tree of one forward, built from torch.profiler's events: which ops a forward
dispatches, what each one calls, how often, and where the time goes.

The raw tree is deep and mostly bookkeeping (views, as_strided, empty); a reader needs the
article's `aten::linear -> aten::t -> aten::addmm`, the GEMMs' shapes, the compile wrappers and
the generated kernels. So bookkeeping ops are folded away (their time stays in their parent's
total), and siblings with the same name (and, for GEMMs, the same shapes) merge into one node
with a call count. Trees of several profiled forwards merge the same way, then are divided by
the number of forwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch.autograd.profiler_util import FunctionEvent

# Ops that move no data and call nothing a reader looks for (views, metadata, allocation).
BOOKKEEPING_OPS = frozenset({
    "aten::alias",
    "aten::as_strided",
    "aten::detach",
    "aten::empty",
    "aten::empty_strided",
    "aten::expand",
    "aten::lift_fresh",
    "aten::reshape",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::transpose",
    "aten::_unsafe_view",
    "aten::view",
})
# Ops whose input shapes are the point: the products and our fused blocks.
GEMM_OPS = frozenset({
    "aten::linear",
    "aten::addmm",
    "aten::mm",
    "aten::matmul",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_addmm_activation",
})
SHAPED_PREFIX = "fusedmlp::"
# "## Call CompiledFxGraph <52-character hash> ##": the hash differs per build and says nothing.
COMPILED_GRAPH = re.compile(r"## Call CompiledFxGraph (\w{6})\w* ##")


@dataclass
class OpNode:
    """One row of the tree, per forward: calls, and times in ms (GPU: kernels it launched)."""

    name: str
    shapes: str | None
    calls: float = 0.0
    total_ms: float = 0.0
    self_ms: float = 0.0
    gpu_ms: float | None = None
    children: list[OpNode] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "shapes": self.shapes,
            "calls": self.calls,
            "total_ms": self.total_ms,
            "self_ms": self.self_ms,
            "gpu_ms": self.gpu_ms,
            "children": [child.as_json() for child in self.children],
        }


def display_name(event: FunctionEvent) -> str:
    return COMPILED_GRAPH.sub(r"## Call CompiledFxGraph \1… ##", event.name)


def shapes_text(event: FunctionEvent) -> str | None:
    if event.name not in GEMM_OPS and not event.name.startswith(SHAPED_PREFIX):
        return None
    shapes = [shape for shape in event.input_shapes or [] if shape]
    return " ".join("(" + ", ".join(str(size) for size in shape) + ")" for shape in shapes)


def shown_children(event: FunctionEvent) -> list[FunctionEvent]:
    """The CPU children a reader sees: bookkeeping ops dropped, with what they called."""
    return [child for child in event.cpu_children if child.name not in BOOKKEEPING_OPS]


def add_event(siblings: list[OpNode], event: FunctionEvent, on_cuda: bool) -> None:
    name, shapes = display_name(event), shapes_text(event)
    node = next((n for n in siblings if n.name == name and n.shapes == shapes), None)
    if node is None:
        node = OpNode(name, shapes, gpu_ms=0.0 if on_cuda else None)
        siblings.append(node)
    node.calls += 1
    node.total_ms += event.cpu_time_total / 1e3
    node.self_ms += event.self_cpu_time_total / 1e3
    if node.gpu_ms is not None:
        node.gpu_ms += event.device_time_total / 1e3
    for child in shown_children(event):
        add_event(node.children, child, on_cuda)


def scale(nodes: list[OpNode], factor: float) -> None:
    for node in nodes:
        node.calls *= factor
        node.total_ms *= factor
        node.self_ms *= factor
        if node.gpu_ms is not None:
            node.gpu_ms *= factor
        scale(node.children, factor)


def forward_tree(forwards: list[FunctionEvent], on_cuda: bool) -> list[OpNode]:
    """The merged tree under the given forward-label events, per forward."""
    roots: list[OpNode] = []
    for forward in forwards:
        for event in shown_children(forward):
            add_event(roots, event, on_cuda)
    scale(roots, 1 / max(len(forwards), 1))
    return roots


def format_calls(calls: float) -> str:
    return f"{round(calls)}x" if abs(calls - round(calls)) < 0.05 else f"{calls:.1f}x"


def format_tree_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def tree_rows(nodes: list[OpNode], depth: int = 0) -> list[tuple[str, ...]]:
    rows = []
    for node in nodes:
        row = (
            "  " * depth + node.name,
            format_calls(node.calls),
            format_tree_ms(node.total_ms),
            format_tree_ms(node.self_ms),
        )
        gpu = () if node.gpu_ms is None else (format_tree_ms(node.gpu_ms),)
        rows.append((*row, *gpu, node.shapes or ""))
        rows.extend(tree_rows(node.children, depth + 1))
    return rows


def tree_text(nodes: list[OpNode]) -> str:
    """The tree as aligned plain-text columns (for a code block)."""
    on_cuda = any(node.gpu_ms is not None for node in nodes)
    headers = ("op", "calls", "total ms", "self ms", *(("GPU ms",) if on_cuda else ()), "shapes")
    rows = [headers, *tree_rows(nodes)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers) - 1)]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:])]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)
