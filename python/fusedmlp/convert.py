"""convert(): swap the Linear layers and MLP blocks of an existing model for fused modules
that share the same Parameters.

What it matches, and nothing else:
- an nn.Sequential that is exactly nn.Linear, Act, nn.Linear, ..., nn.Linear (one activation
  type, sizes that chain) becomes a FusedMLP (same state_dict keys);
- inside any other nn.Sequential, an nn.Linear directly followed by an activation becomes a
  FusedLinear with that activation, and the activation's slot becomes nn.Identity (keys kept);
- a module with nn.Linear children gate_proj, up_proj, down_proj becomes a FusedGatedMLP, but
  only after checking on a random input that it computes down_proj(act(gate_proj(x)) *
  up_proj(x)) -- with act its one activation child, or, when it applies the activation
  functionally, the activation that matches best; a module whose forward differs is left alone;
- any other nn.Linear (exactly that type: subclasses such as MultiheadAttention's out_proj,
  which their owner reads directly, are left alone) becomes a FusedLinear.
Activations: nn.ReLU, nn.GELU (both approximations), nn.SiLU.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .activations import ACTIVATIONS, activation_name
from .modules import FusedGatedMLP, FusedLinear, FusedMLP, chain_activation

_FUSED = (FusedLinear, FusedMLP, FusedGatedMLP)


def convert(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Returns `model` with fused modules swapped in. With inplace=False the module tree is
    copied first, but the copy shares its Parameters and buffers with `model`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusedmlp.convert: model must be an nn.Module, got {type(model).__name__}")
    root = model if inplace else _copy_tree(model)
    return _convert(root)


def _copy_tree(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose Parameters and buffers are the original objects."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {
        name: None if child is None else _copy_tree(child)
        for name, child in module._modules.items()
    }
    return clone


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, _FUSED):
        return module
    replacement = _whole_module_replacement(module)
    if replacement is not None:
        return replacement
    if type(module) is nn.Sequential:
        _fuse_linear_activation_pairs(module)
    for name, child in module.named_children():
        converted = _convert(child)
        if converted is not child:
            setattr(module, name, converted)
    return module


def _whole_module_replacement(module: nn.Module) -> nn.Module | None:
    if type(module) is nn.Linear:
        return FusedLinear.from_linear(module)
    is_sequential = type(module) is nn.Sequential and len(module) >= 3
    if is_sequential and chain_activation(list(module)) is not None:
        return FusedMLP.from_sequential(module)
    return _gated_replacement(module)


def _fuse_linear_activation_pairs(sequential: nn.Sequential) -> None:
    modules = list(sequential)
    for index in range(len(modules) - 1):
        linear, following = modules[index], modules[index + 1]
        name = activation_name(following)
        if type(linear) is nn.Linear and name is not None:
            sequential[index] = FusedLinear.from_linear(linear, name)
            sequential[index + 1] = nn.Identity()
            modules[index + 1] = sequential[index + 1]


def _gated_replacement(module: nn.Module) -> FusedGatedMLP | None:
    children = dict(module.named_children())
    projections = [children.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(type(p) is not nn.Linear for p in projections):
        return None
    named = [activation_name(c) for c in children.values() if activation_name(c)]
    # One activation child names the activation; a functional one (F.silu in forward) is
    # found by trying each and keeping the closest match.
    candidates = named if len(named) == 1 else list(ACTIVATIONS)
    best, best_error = None, float("inf")
    for activation in candidates:
        fused = FusedGatedMLP.from_projections(*projections, activation)
        fused.train(module.training)
        error = _mismatch(module, fused, projections[0].in_features)
        if error < best_error:
            best, best_error = fused, error
    return best if best_error <= 1.0 else None


def _mismatch(original: nn.Module, fused: nn.Module, in_features: int) -> float:
    """How far apart both modules' outputs are on a small random input, as a multiple of the
    tolerance of their dtype: <= 1 means they compute the same; inf when not comparable."""
    weight = fused.gate_proj.weight
    if weight.device.type == "meta":
        return float("inf")
    generator = torch.Generator(device=weight.device).manual_seed(0)
    probe = torch.randn(
        4, in_features, generator=generator, device=weight.device, dtype=weight.dtype
    )
    half = weight.dtype in (torch.float16, torch.bfloat16)
    rtol, atol = (1e-2, 1e-2) if half else (1e-4, 1e-5)
    try:
        with torch.no_grad():
            expected, actual = original(probe), fused(probe)
    except Exception:  # the original's forward takes something else: not a gated block
        return float("inf")
    if not isinstance(expected, torch.Tensor) or expected.shape != actual.shape:
        return float("inf")
    excess = (actual - expected).abs() / (atol + rtol * expected.abs())
    return float(excess.max()) if excess.numel() else 0.0
