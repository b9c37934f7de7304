"""Autograd for the fusedmlp ops; the kernels live in fusedmlp._C.

Each forward op has a training twin (`*_train`) that also returns `saved`, one
buffer with what the backward needs (pre-activations, hidden outputs). The
public functions call the twin when autograd will need it; the plain ops, when
differentiated directly, recompute the twin in their backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C  # noqa: F401  (registers the ops)
from .activations import OUTPUT_DERIVATIVE
from .profiling import labelled_layers
from .registry import cpu_gemm_in_aten
from .saved_layout import ChainLayer, chain_layout, leading_rows

_ops = torch.ops.fusedmlp


def _whole_backward_on_cpu(x: Tensor) -> bool:
    """Whether one fusedmlp::*_backward op runs the backward: on CPU, unless the backward
    itself is being differentiated (create_graph=True). Where the CPU's GEMMs in x's dtype
    run in ATen, fusedmlp::chain_backward runs ATen's GEMMs around our pointwise passes
    itself; the gated block's backward stays those calls made from here (its steps are
    large products, where calls from Python cost little: 0.95-1.04x eager's step)."""
    return x.is_cpu and not torch.is_grad_enabled()


def _chain_backward(
    x: Tensor,
    weights: list[Tensor],
    has_bias: bool,
    saved: Tensor,
    y: Tensor | None,
    grad_y: Tensor,
    hidden: str,
    final: str,
    need_grad_x: bool = True,
) -> tuple[Tensor | None, list[Tensor], list[Tensor | None]]:
    """Gradients of a chain whose biases are all present (has_bias) or all absent, from
    its saved buffer and, where the final activation's derivative reads it, its output y;
    grad_x is None when not needed (the first layer's dX GEMM, a sixth of a 3-layer
    backward, is skipped as eager autograd does). On CPU one fusedmlp::chain_backward call
    runs it all through our GEMM core; elsewhere, and for a double backward, ATen GEMMs
    around fusedmlp::activation_backward."""
    if _whole_backward_on_cpu(x):
        with labelled_layers():  # so that, under a profiler, its ATen GEMMs show inside it
            grad_x, grad_weights, grad_biases = _ops.chain_backward(
                grad_y, x, weights, saved, y, has_bias, hidden, final, need_grad_x
            )
        biases: list[Tensor | None] = list(grad_biases) or [None] * len(weights)
        return (grad_x if need_grad_x else None), list(grad_weights), biases
    rows = leading_rows(x)
    x_rows = x.reshape(rows, x.shape[-1])
    widths = [x.shape[-1]] + [w.shape[0] for w in weights]
    layers, _ = chain_layout(rows, widths, hidden, final)

    def view(offset: int, width: int) -> Tensor:
        return saved[offset : offset + rows * width].view(rows, width)

    def derivative_input(layer: ChainLayer) -> Tensor:
        """The pre-activation, or where none is saved (ReLU) the layer's output."""
        offset = layer.pre_offset if layer.pre_offset is not None else layer.hidden_offset
        if offset is None:  # the last layer's output
            assert y is not None, "the final activation's derivative reads y"
            return y.reshape(rows, layer.width)
        return view(offset, layer.width)

    grad = grad_y.reshape(rows, widths[-1])
    grad_weights: list[Tensor] = [torch.empty(0)] * len(weights)
    grad_biases: list[Tensor | None] = [None] * len(weights)
    for index in reversed(range(len(weights))):
        layer = layers[index]
        if layer.activation != "none":
            grad = _ops.activation_backward(grad, derivative_input(layer), layer.activation)
        below = layers[index - 1] if index > 0 else None
        layer_input = x_rows if below is None else view(below.hidden_offset, below.width)
        grad_weights[index] = grad.t().mm(layer_input)
        if has_bias:
            grad_biases[index] = grad.sum(0)
        if index == 0 and not need_grad_x:
            return None, grad_weights, grad_biases
        grad = grad.mm(weights[index])
    return grad.view(x.shape), grad_weights, grad_biases


def _gated_backward(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    has_bias: tuple[bool, bool, bool],
    saved: Tensor,
    grad_y: Tensor,
    activation: str,
    need_grad_x: bool = True,
) -> tuple[Tensor | None, ...]:
    if _whole_backward_on_cpu(x) and not cpu_gemm_in_aten(x.dtype):
        grad_x, *grad_weights, grad_biases = _ops.gated_mlp_backward(
            grad_y, x, w_gate, w_up, w_down, saved, list(has_bias), activation, need_grad_x
        )
        present = iter(grad_biases)
        biases = [next(present) if has else None for has in has_bias]
        return (grad_x if need_grad_x else None), *grad_weights, *biases
    x_rows = x.reshape(leading_rows(x), x.shape[-1])
    grad = grad_y.reshape(x_rows.shape[0], w_down.shape[0])
    gate, up, product = saved[0], saved[1], saved[2]
    grad_w_down = grad.t().mm(product)
    grad_gate, grad_up = _ops.gated_backward(grad.mm(w_down), gate, up, activation)
    # grad_x = grad_gate @ w_gate + grad_up @ w_up, the second GEMM accumulating (beta = 1)
    grad_x = grad_up.mm(w_up).addmm_(grad_gate, w_gate).view(x.shape) if need_grad_x else None
    grads = (grad_gate, grad_up, grad)
    grad_biases = tuple(g.sum(0) if present else None for g, present in zip(grads, has_bias))
    return (
        grad_x,
        grad_gate.t().mm(x_rows),
        grad_up.t().mm(x_rows),
        grad_w_down,
        *grad_biases,
    )


def _refuse_double_backward(op: str, differentiable: bool) -> None:
    """The backward reads pre-activations and hidden outputs from `saved`, which autograd
    cannot differentiate through, and fusedmlp::activation_backward / gated_backward have no
    derivative: under create_graph=True second-order gradients would silently lose terms
    (a ReLU mlp's gradient penalty came out wrong). Refuse them unless the backward is made of
    differentiable matmuls only."""
    if torch.is_grad_enabled() and not differentiable:
        raise RuntimeError(
            f"fusedmlp.{op}: double backward (create_graph=True) is not supported; "
            "use torch.nn.Linear and activation modules for higher-order gradients"
        )


# ---- eager calls on plain tensors: an autograd.Function per op kind ----
#
# register_autograd's generic wrapper (the ops' own autograd, below) flattens and checks every
# input and gradient with pytree on each call, a fifth of a 16 x 256^3 ReLU training step
# (cProfile). Eager training calls on plain tensors take these Functions instead: they run the
# same `*_train` op below autograd and the same backward, keep nothing but what the backward
# reads (x, `saved`, the weights, y where a final ReLU's derivative reads it; not the biases,
# whose gradients are column sums) and return y alone (`saved` stays out of autograd's
# outputs, so it needs no gradient bookkeeping).

_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter, type(None)))


def _function_fits(x: Tensor, *parameters: Tensor | None) -> bool:
    """Whether a training call may enter autograd through the Functions below rather than
    the op's registered autograd. Compiled graphs (checked first: Dynamo traces nothing past
    it), tensor subclasses (DTensor), dispatch modes, autocast and other devices (meta) keep
    the op."""
    if torch.compiler.is_compiling():
        return False
    return (
        _PLAIN_TYPES.issuperset(map(type, (x, *parameters)))
        and (x.is_cpu or x.is_cuda)
        and _get_current_dispatch_mode() is None
        and not torch._C._is_any_autocast_enabled()  # autocast casts above autograd
    )


@dataclass(frozen=True)
class _ChainOp:
    """How linear / mlp map onto a chain of layers."""

    name: str
    single_layer: bool

    def unpack(self, inputs) -> tuple[Tensor, list[Tensor], list, str]:
        x, weights, biases, activation = inputs
        if self.single_layer:
            return x, [weights], [biases], activation
        return x, list(weights), list(biases) or [None] * len(weights), activation

    def pack(self, first, weights: list, biases: list, last):
        """Op arguments (or their gradients) from per-layer lists; an mlp's biases are
        all present or an empty list."""
        if self.single_layer:
            return first, weights[0], biases[0], last
        return first, weights, [b for b in biases if b is not None], last

    def final(self, activation: str) -> str:
        return activation if self.single_layer else "none"

    def backward_reads_y(self, activation: str) -> bool:
        """Whether the backward reads the output y: where the final activation's
        derivative does (ReLU; no pre-activation is saved then, as eager saves only
        ReLU's result)."""
        return self.final(activation) in OUTPUT_DERIVATIVE

    def differentiable(self, activation: str) -> bool:
        """One layer without activation differentiates only through x and weight, so its
        backward may itself be differentiated."""
        return self.single_layer and activation == "none"

    def train(self, x: Tensor, weights, biases, activation: str) -> tuple[Tensor, Tensor]:
        """fusedmlp::<name>_train from per-layer weights and the biases present, if any."""
        if self.single_layer:
            bias = biases[0] if biases else None
            return _ops.linear_train.default(x, weights[0], bias, activation)
        return _ops.mlp_train.default(x, weights, biases, activation)


_LINEAR = _ChainOp("linear", single_layer=True)
_MLP = _ChainOp("mlp", single_layer=False)


class ChainTrain(torch.autograd.Function):
    """fusedmlp::linear_train / mlp_train and the chain backward (see the comment above).
    Arguments after n_weights: the weights, then the biases if there are any."""

    @staticmethod
    def forward(ctx, x, chain, activation, n_weights, *parameters):  # type: ignore[override]
        weights, biases = parameters[:n_weights], parameters[n_weights:]
        with torch._C._AutoDispatchBelowAutograd(), labelled_layers():
            y, saved = chain.train(x, weights, biases, activation)
        ctx.save_for_backward(x, saved, y if chain.backward_reads_y(activation) else None, *weights)
        ctx.chain, ctx.activation, ctx.has_bias = chain, activation, bool(biases)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        chain, activation, has_bias = ctx.chain, ctx.activation, ctx.has_bias
        _refuse_double_backward(chain.name, chain.differentiable(activation))
        x, saved, y, *weights = ctx.saved_tensors
        grad_x, grad_weights, grad_biases = _chain_backward(
            x, weights, has_bias, saved, y, grad_y, activation, chain.final(activation),
            need_grad_x=ctx.needs_input_grad[0],
        )
        return grad_x, None, None, None, *grad_weights, *(grad_biases if has_bias else ())


class GatedMLPTrain(torch.autograd.Function):
    """fusedmlp::gated_mlp_train and its backward (see the comment above ChainTrain)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation
    ):
        with torch._C._AutoDispatchBelowAutograd(), labelled_layers():
            y, saved = _ops.gated_mlp_train.default(
                x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation
            )
        ctx.save_for_backward(x, saved, w_gate, w_up, w_down)
        ctx.activation = activation
        ctx.has_bias = (bias_gate is not None, bias_up is not None, bias_down is not None)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        _refuse_double_backward("gated_mlp", False)
        x, saved, *weights = ctx.saved_tensors
        grads = _gated_backward(
            x, *weights, ctx.has_bias, saved, grad_y, ctx.activation,
            need_grad_x=ctx.needs_input_grad[0],
        )
        return *grads, None


def _train_chain(chain: _ChainOp, x: Tensor, weights, biases, activation: str) -> Tensor:
    if _function_fits(x, *weights, *biases):
        return ChainTrain.apply(x, chain, activation, len(weights), *weights, *biases)
    return chain.train(x, weights, biases, activation)[0]


def train_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """y of fusedmlp::linear_train, differentiable."""
    return _train_chain(_LINEAR, x, (weight,), () if bias is None else (bias,), activation)


def train_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], activation: str) -> Tensor:
    """y of fusedmlp::mlp_train (biases: one per weight, or none), differentiable."""
    return _train_chain(_MLP, x, weights, biases, activation)


def train_gated(*args) -> Tensor:
    """y of fusedmlp::gated_mlp_train(*args), differentiable."""
    if _function_fits(*args[:7]):
        return GatedMLPTrain.apply(*args)
    return _ops.gated_mlp_train(*args)[0]


# ---- the ops' own autograd: compiled graphs, tensor subclasses, modes, direct op calls ----


def _save(
    ctx, x: Tensor, saved: Tensor, weights: list[Tensor], biases: list, y: Tensor, keep_y: bool
) -> None:
    # `saved` never gets a gradient; materialized, it would be a zero-filled tensor its size
    # on every backward (0.5 ms of a 7 ms training step at 256 x 512 x 3 layers).
    ctx.set_materialize_grads(False)
    kept_y = y if keep_y else None
    ctx.save_for_backward(x, saved, kept_y, *weights, *[b for b in biases if b is not None])
    ctx.n_weights = len(weights)
    ctx.has_bias = [b is not None for b in biases]
    # A DTensor output (tensor parallelism) says which sharding strategy ran: see sharding.py.
    ctx.placements = getattr(y, "placements", None)


def _backward_maybe_sharded(ctx, op: str, local_backward, grad_y, x, weights, saved, y):
    """local_backward(grad_y, x, weights, saved, y) on plain tensors, or on each rank's
    shards when the forward ran on DTensors."""
    if ctx.placements is None:
        return local_backward(grad_y, x, weights, saved, y)
    from .sharding import backward_on_shards

    return backward_on_shards(op, ctx.placements, local_backward, grad_y, x, weights, saved, y)


def _saved_inputs(ctx) -> tuple[Tensor, Tensor, Tensor | None, list[Tensor], list[Tensor | None]]:
    """x, saved, y (None unless kept), the weights and the biases."""
    x, saved, y, *rest = ctx.saved_tensors
    weights, present = rest[: ctx.n_weights], iter(rest[ctx.n_weights :])
    biases = [next(present) if has else None for has in ctx.has_bias]
    return x, saved, y, weights, biases


def _grad_or_zeros(grad_y: Tensor | None, x: Tensor, out_features: int) -> Tensor:
    """grad_y, or zeros of y's shape where no gradient reached y (grads are not
    materialized, see _save)."""
    return x.new_zeros((*x.shape[:-1], out_features)) if grad_y is None else grad_y


def _register_chain(chain: _ChainOp) -> None:
    train_op = getattr(_ops, f"{chain.name}_train")

    def setup(ctx, inputs, output, training: bool) -> None:
        x, weights, biases, activation = chain.unpack(inputs)
        saved = output[1] if training else x.new_empty(0)
        if training:
            ctx.mark_non_differentiable(saved)
        y = output[0] if training else output
        _save(ctx, x, saved, weights, biases, y, training and chain.backward_reads_y(activation))
        ctx.activation, ctx.recompute = activation, not training

    def backward(ctx, grad_y: Tensor | None, *_unused):
        _refuse_double_backward(chain.name, chain.differentiable(ctx.activation))
        x, saved, y, weights, biases = _saved_inputs(ctx)
        if ctx.recompute:
            y, saved = train_op(*chain.pack(x, weights, biases, ctx.activation))
            y = y if chain.backward_reads_y(ctx.activation) else None

        def local_backward(grad_y, x, weights, saved, y):
            return _chain_backward(
                x,
                weights,
                ctx.has_bias[0],
                saved,
                y,
                grad_y,
                ctx.activation,
                chain.final(ctx.activation),
                need_grad_x=ctx.needs_input_grad[0],
            )

        grad_y = _grad_or_zeros(grad_y, x, weights[-1].shape[0])
        grad_x, grad_weights, grad_biases = _backward_maybe_sharded(
            ctx, chain.name, local_backward, grad_y, x, weights, saved, y
        )
        return chain.pack(grad_x, grad_weights, grad_biases, None)

    torch.library.register_autograd(
        f"fusedmlp::{chain.name}",
        backward,
        setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output, False),
    )
    torch.library.register_autograd(
        f"fusedmlp::{chain.name}_train",
        backward,
        setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output, True),
    )


_register_chain(_LINEAR)
_register_chain(_MLP)


def _register_gated() -> None:
    def setup(ctx, inputs, output, training: bool) -> None:
        x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, activation = inputs
        saved = output[1] if training else x.new_empty(0)
        if training:
            ctx.mark_non_differentiable(saved)
        y = output[0] if training else output
        _save(ctx, x, saved, [w_gate, w_up, w_down], [bias_gate, bias_up, bias_down], y, False)
        ctx.activation, ctx.recompute = activation, not training

    def backward(ctx, grad_y: Tensor | None, *_unused):
        _refuse_double_backward("gated_mlp", False)
        x, saved, _, weights, biases = _saved_inputs(ctx)
        if ctx.recompute:
            saved = _ops.gated_mlp_train(x, *weights, *biases, ctx.activation)[1]
        grad_y = _grad_or_zeros(grad_y, x, weights[2].shape[0])

        def local_backward(grad_y, x, weights, saved, _y):  # the gated backward reads no y
            grads = _gated_backward(
                x, *weights, tuple(ctx.has_bias), saved, grad_y, ctx.activation,
                need_grad_x=ctx.needs_input_grad[0],
            )
            return grads[0], list(grads[1:4]), list(grads[4:])

        grad_x, grad_weights, grad_biases = _backward_maybe_sharded(
            ctx, "gated_mlp", local_backward, grad_y, x, weights, saved, None
        )
        return (grad_x, *grad_weights, *grad_biases, None)

    for name, training in (("gated_mlp", False), ("gated_mlp_train", True)):
        torch.library.register_autograd(
            f"fusedmlp::{name}",
            backward,
            setup_context=lambda ctx, inputs, output, t=training: setup(ctx, inputs, output, t),
        )


_register_gated()
