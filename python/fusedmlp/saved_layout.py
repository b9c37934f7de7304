"""Where the training ops put what the backward needs: the layout of a chain's flat `saved`
buffer, as the C++ layer writes it (csrc/torch/arguments.cpp, saved_chain_layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .activations import OUTPUT_DERIVATIVE


@dataclass(frozen=True)
class ChainLayer:
    """Where one layer's saved tensors sit in a chain's flat `saved` buffer."""

    activation: str
    pre_offset: int | None
    hidden_offset: int | None
    width: int


def chain_layout(
    rows: int, widths: list[int], hidden: str, final: str
) -> tuple[list[ChainLayer], int]:
    """Mirrors the C++ layout: per layer its pre-activation (when its activation is not
    "none" and its derivative does not read the layer's output instead), then its output
    (every layer but the last, whose output is the op's y)."""
    layers, total = [], 0
    for index, width in enumerate(widths[1:]):
        last = index == len(widths) - 2
        activation = final if last else hidden
        save_pre = activation != "none" and activation not in OUTPUT_DERIVATIVE
        pre_offset = total if save_pre else None
        total += rows * width if save_pre else 0
        hidden_offset = None if last else total
        total += 0 if last else rows * width
        layers.append(ChainLayer(activation, pre_offset, hidden_offset, width))
    return layers, total


def leading_rows(x: Tensor) -> int:
    """The rows of x viewed as (rows, features)."""
    return math.prod(x.shape[:-1])
