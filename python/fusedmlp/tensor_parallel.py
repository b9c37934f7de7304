"""PyTorch's tensor-parallel plans on the fused modules.

`parallelize_module` shards each planned nn.Linear's parameters (DTensors) and hooks the
Linear: a pre-hook turns its input into a DTensor, a hook turns its output back. A fused
block (FusedMLP, FusedGatedMLP) never calls its Linear children: it runs their parameters
through one op. So under a plan it runs the first Linear's input hooks, the op on DTensors
(sharding.py decides how it splits), and the last Linear's output hooks. The hooks between
layers are what the fused op does internally: with the Megatron plan (column then row),
the hidden activation stays sharded and never leaves the rank.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

MLP_PLAN = '{"0": ColwiseParallel(), "2": RowwiseParallel()}'
GATED_PLAN = (
    '{"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}'
)


class PlanError(ValueError):
    """A parallel plan a fused module cannot honour."""


def check_linear(module: nn.Module, weight: DTensor) -> None:
    """FusedLinear: a row split (RowwiseParallel) leaves a partial sum, to which the fused
    activation cannot be applied."""
    row_split = any(getattr(p, "dim", None) == 1 for p in weight.placements)
    if row_split and module.activation != "none":
        raise PlanError(
            f"{module!r}: RowwiseParallel shards the weight on its input dim, which leaves a "
            f"partial sum, and activation {module.activation!r} cannot be applied before the "
            "reduction; use ColwiseParallel, or activation='none' with the activation after"
        )


def run_block(
    block: nn.Module,
    names: list[str],
    plan: str,
    x: Tensor,
    compute: Callable[[Tensor], Tensor],
) -> Tensor:
    """compute(x) for a fused block whose Linear children `names` (first to last) hold
    DTensor parameters, with the first child's input hooks and the last child's output
    hooks around it."""
    children = [block.get_submodule(name) for name in names]
    for name, child in zip(names, children):
        if isinstance(child, FSDPModule):
            raise PlanError(
                f"{type(block).__name__}: fully_shard was applied to its Linear {name!r}; "
                "the block runs its Linears' parameters in one op, so their own hooks never "
                "run: apply fully_shard to the block (or a module above it) instead"
            )
    plain = [n for n, c in zip(names, children) if not isinstance(c.weight, DTensor)]
    if plain:
        raise PlanError(
            f"{type(block).__name__}: a tensor-parallel plan covers some of its Linears but "
            f"not {plain}; the block runs them all in one op, so plan every one, e.g. {plan}"
        )
    first, last = children[0], children[-1]
    (x,) = _run_input_hooks(first, (x,))
    if not isinstance(x, DTensor):  # no input hook: taken as the same on every rank
        mesh = first.weight.device_mesh
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return _run_output_hooks(last, (x,), compute(x))


def _run_input_hooks(module: nn.Module, args: tuple) -> tuple:
    """module's forward pre-hooks, as nn.Module.__call__ runs them."""
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, {})
            if result is not None:
                args = result[0]
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args


def _run_output_hooks(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    """module's forward hooks, as nn.Module.__call__ runs them."""
    for hook_id, hook in module._forward_hooks.items():
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, {}, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


def check_mlp_depth(block: nn.Module, n_layers: int) -> None:
    """A sharded chain ends after two layers (column then row): see sharding.py."""
    if n_layers > 2:
        raise PlanError(
            f"{type(block).__name__} with {n_layers} Linear layers: tensor parallelism "
            f"splits a two-layer FusedMLP ({MLP_PLAN}); split the chain into two-layer "
            "FusedMLPs (or apply no plan to it)"
        )
