"""Tensor parallelism: DTensor sharding rules for the fusedmlp ops, and their backward on the
local shards. Loaded by dtensor_support.py as soon as torch.distributed.tensor is.

A strategy says, for one mesh dimension, how an op's output, saved buffer and inputs are
placed; DTensor expands the strategies over every mesh dimension, picks the cheapest and
redistributes the inputs to match it. The strategies (R replicate, S(d) shard on dim d,
P partial sum; `last` is x's last dim):

    op              strategy    x        weights              biases               y
    linear          replicate   R        R                    R                    R
                    batch d     S(d)     R                    R                    S(d)
                    column      R        S(0)                 S(0)                 S(last)
                    row         S(last)  S(1)                 P (added once)       P
    mlp             replicate, batch d: as linear, every layer
      1 layer       column, row: as linear
      2 layers      megatron    R        S(0), S(1)           S(0), P              P
    gated_mlp       replicate, batch d: as linear
                    megatron    R        gate, up S(0); down S(1)  S(0), S(0), P   P

`row` exists only for activation "none" (an activation cannot be applied to a partial sum);
a weight sharded on its input dim ahead of an activation is refused, as is any sharded
weight in an mlp of more than two layers (gathering every weight on every call would undo
the parallelism silently). The `*_train` twins follow their op; their `saved` buffer is
opaque: each rank's holds what its own backward reads.

The backward ops never see a DTensor: the autograd formulas (autograd.py) hand them the local
shards, through `backward_on_shards`, and place each gradient like its input (a replicated
input of a split strategy gets a partial-sum gradient, a partial bias a replicated one).
`activation_backward` and `gated_backward` are pointwise and carry rules of their own;
`chain_backward` and `gated_mlp_backward` return lists of tensors, which DTensor's
strategies cannot place, so they have none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

_ops = torch.ops.fusedmlp
_R = Replicate()


@dataclass(frozen=True)
class Strategy:
    """The placements, on one mesh dimension, of an op's output, saved buffer and inputs.
    `biases` has one entry per layer; an absent bias is skipped."""

    y: Placement
    saved: Placement
    x: Placement
    weights: tuple[Placement, ...]
    biases: tuple[Placement, ...]

    def inputs(self, has_bias: Sequence[bool]) -> list[Placement]:
        present = [p for p, has in zip(self.biases, has_bias) if has]
        return [self.x, *self.weights, *present]


def _common(x_ndim: int, n_weights: int, saved_rows_dim: int) -> list[Strategy]:
    """Replicate, and the rows split on any leading dim of x (weights replicated)."""
    replicated = (_R,) * n_weights
    strategies = [Strategy(_R, _R, _R, replicated, replicated)]
    for dim in range(x_ndim - 1):
        strategies.append(
            Strategy(Shard(dim), Shard(saved_rows_dim), Shard(dim), replicated, replicated)
        )
    return strategies


def chain_strategies(x_ndim: int, n_layers: int, final_activation: str) -> list[Strategy]:
    """linear (one layer, final_activation its activation) and mlp (final "none")."""
    strategies = _common(x_ndim, n_layers, 0)
    last = Shard(x_ndim - 1)
    if n_layers == 1:
        strategies.append(Strategy(last, Shard(0), _R, (Shard(0),), (Shard(0),)))
        if final_activation == "none":
            strategies.append(Strategy(Partial(), _R, last, (Shard(1),), (Partial(),)))
    elif n_layers == 2:
        strategies.append(
            Strategy(Partial(), Shard(0), _R, (Shard(0), Shard(1)), (Shard(0), Partial()))
        )
    return strategies


def gated_strategies(x_ndim: int) -> list[Strategy]:
    # saved is (3, rows, hidden): rows on dim 1, hidden on dim 2.
    strategies = _common(x_ndim, 3, 1)
    column, row = Shard(0), Shard(1)
    strategies.append(
        Strategy(Partial(), Shard(2), _R, (column, column, row), (column, column, Partial()))
    )
    return strategies


def _as_rules(
    strategies: list[Strategy], has_bias: Sequence[bool], training: bool
) -> list[tuple[list[Placement], list[Placement]]]:
    """register_sharding's form: (output placements, input placements) per strategy."""
    return [([s.y, s.saved] if training else [s.y], s.inputs(has_bias)) for s in strategies]


def _sharded_on(spec: object, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in spec.placements)


def _refuse_row_split_before_activation(op: str, weight: object, activation: str) -> None:
    if activation != "none" and _sharded_on(weight, 1):
        raise ValueError(
            f"fusedmlp.{op}: the weight is sharded on its input dim (RowwiseParallel), which "
            f"leaves a partial sum, and activation {activation!r} cannot be applied before "
            "the reduction; use activation='none' (apply the activation after the layer) or "
            "ColwiseParallel"
        )


def _linear_rules(training: bool) -> Callable:
    def rules(x, weight, bias, activation):
        _refuse_row_split_before_activation("linear", weight, activation)
        strategies = chain_strategies(x.ndim, 1, activation)
        return _as_rules(strategies, [bias is not None], training)

    return rules


def _mlp_rules(training: bool) -> Callable:
    def rules(x, weights, biases, activation):
        if len(weights) > 2 and any(not spec.is_replicated() for spec in weights):
            raise ValueError(
                f"fusedmlp.mlp: an mlp of {len(weights)} layers takes only replicated "
                "weights under tensor parallelism (a sharded chain ends after two layers, "
                "column then row); split it into two-layer FusedMLPs, or replicate its weights"
            )
        for spec in weights[:-1]:
            _refuse_row_split_before_activation("mlp", spec, activation)
        strategies = chain_strategies(x.ndim, len(weights), "none")
        return _as_rules(strategies, [bool(biases)] * len(weights), training)

    return rules


def _gated_rules(training: bool) -> Callable:
    def rules(x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation):
        has_bias = [b is not None for b in (bias_gate, bias_up, bias_down)]
        return _as_rules(gated_strategies(x.ndim), has_bias, training)

    return rules


def _pointwise_rules(n_outputs: int) -> Callable:
    """activation_backward (grad, pre) and gated_backward (grad_product, gate, up): any one
    placement for all, or a partial-sum gradient with the rest replicated (both are linear
    in the gradient)."""

    def rules(grad, *others_and_activation):
        n_others = len(others_and_activation) - 1
        placements = [_R, *(Shard(d) for d in range(grad.ndim))]
        result = [([p] * n_outputs, [p] * (1 + n_others)) for p in placements]
        result.append(([Partial()] * n_outputs, [Partial(), *[_R] * n_others]))
        return result

    return rules


def _register(op: torch._ops.OpOverload, rules: Callable, activation_index: int) -> None:
    register_sharding(op)(rules)
    # register_sharding keys its cache on tensor placements only (it hashes from the first
    # int argument on, and these ops have none): the activation decides which strategies
    # exist, so it joins the key.
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(activation_index, needs_pytree=True)


for _training in (False, True):
    _suffix = "_train" if _training else ""
    _register(getattr(_ops, f"linear{_suffix}").default, _linear_rules(_training), 3)
    _register(getattr(_ops, f"mlp{_suffix}").default, _mlp_rules(_training), 3)
    _register(getattr(_ops, f"gated_mlp{_suffix}").default, _gated_rules(_training), 7)
_register(_ops.activation_backward.default, _pointwise_rules(1), 2)
_register(_ops.gated_backward.default, _pointwise_rules(2), 3)


def _strategy_of(strategies: list[Strategy], y: Placement) -> Strategy:
    """The strategy that gave an output this placement (each gives its own)."""
    return next(s for s in strategies if s.y == y)


def _grad_placement(p: Placement, split: bool) -> Placement:
    """Where an input's gradient lies when the input was placed `p`."""
    if p.is_partial():
        return _R  # every rank's share of a partial input received the whole gradient
    if p.is_replicate() and split:
        return Partial()  # each rank holds its share of the sum over the split
    return p


LocalBackward = Callable[
    [Tensor, Tensor, list[Tensor], Tensor, Tensor | None],
    tuple[Tensor | None, list[Tensor], list[Tensor | None]],
]


def backward_on_shards(
    op: str,
    y_placements: Sequence[Placement],
    local_backward: LocalBackward,
    grad_y: DTensor,
    x: DTensor,
    weights: list[DTensor],
    saved: DTensor,
    y: DTensor | None,
) -> tuple[DTensor | None, list[DTensor], list[DTensor | None]]:
    """The backward of a fusedmlp op whose forward ran on DTensors: each rank runs
    `local_backward(grad_y, x, weights, saved, y)` on its local shards, placed as the forward's
    strategy (found from the output's placement) placed them, and its gradients are
    placed like their inputs."""
    if op == "gated_mlp":
        strategies = gated_strategies(x.ndim)
    else:  # the final activation only decides whether `row` exists; y's placement chooses
        strategies = chain_strategies(x.ndim, len(weights), "none")
    chosen = [_strategy_of(strategies, p) for p in y_placements]
    mesh = x.device_mesh

    def local(t: DTensor, placements: Sequence[Placement]) -> Tensor:
        return t.redistribute(mesh, placements).to_local()

    grad_placements = [_R if p.is_partial() else p for p in y_placements]
    grad_x, grad_weights, grad_biases = local_backward(
        local(grad_y, grad_placements),
        local(x, [s.x for s in chosen]),
        [local(w, [s.weights[i] for s in chosen]) for i, w in enumerate(weights)],
        saved.to_local(),
        None if y is None else local(y, grad_placements),
    )

    split = [s.y != _R for s in chosen]

    def placed(g: Tensor | None, shape: Sequence[int], input_placements: list[Placement]):
        if g is None:
            return None
        placements = [_grad_placement(p, each) for p, each in zip(input_placements, split)]
        return DTensor.from_local(
            g,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=make_contiguous_strides_for(shape),
        )

    return (
        placed(grad_x, x.shape, [s.x for s in chosen]),
        [
            placed(g, w.shape, [s.weights[i] for s in chosen])
            for i, (g, w) in enumerate(zip(grad_weights, weights))
        ],
        [
            placed(g, w.shape[:1], [s.biases[i] for s in chosen])
            for i, (g, w) in enumerate(zip(grad_biases, weights))
        ],
    )
