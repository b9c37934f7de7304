"""Which autograd a training call takes: eager calls on plain tensors enter through the lean
autograd.Function (ChainTrain, GatedMLPTrain), which saves only x, the saved buffer, the
weights and (a final ReLU's) y; a dispatch mode (as DTensor, FakeTensor and compiled graphs
bring) keeps the ops' registered autograd. Both give the same gradients."""

from __future__ import annotations

from collections.abc import Callable

import fusedmlp
import pytest
import torch
from conftest import FUNCTIONAL
from fusedmlp.registry import cpu_gemm_in_aten
from torch.utils._python_dispatch import TorchDispatchMode

DIM, HIDDEN, OUT = 6, 10, 4


class PassThrough(TorchDispatchMode):
    """Runs every op unchanged: only its presence matters."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def calls() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor], str]]:
    """name -> (the call, its parameters, the training op's name)"""
    torch.manual_seed(0)
    linear = fusedmlp.FusedLinear(DIM, OUT, activation="gelu")
    relu_linear = fusedmlp.FusedLinear(DIM, OUT, activation="relu")
    mlp = fusedmlp.FusedMLP([DIM, HIDDEN, HIDDEN, OUT], activation="silu")
    unbiased = fusedmlp.FusedMLP([DIM, HIDDEN, OUT], bias=False)
    gated = fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="gelu_tanh", bias=True)
    return {
        "linear": (linear, list(linear.parameters()), "linear_train"),
        "relu linear": (relu_linear, list(relu_linear.parameters()), "linear_train"),
        "mlp": (mlp, list(mlp.parameters()), "mlp_train"),
        "mlp without biases": (unbiased, list(unbiased.parameters()), "mlp_train"),
        "gated_mlp": (gated, list(gated.parameters()), "gated_mlp_train"),
    }


@pytest.mark.parametrize("name", list(calls()))
def test_eager_calls_take_the_function_and_save_no_bias(name: str) -> None:
    call, parameters, _ = calls()[name]
    x = torch.randn(3, DIM)
    y = call(x)
    expected = "GatedMLPTrainBackward" if name == "gated_mlp" else "ChainTrainBackward"
    assert type(y.grad_fn).__name__ == expected
    weights = [p for p in parameters if p.dim() == 2]
    saved = y.grad_fn.saved_tensors
    assert saved[0] is x
    if name == "gated_mlp":
        assert len(saved) == 2 + len(weights)
    else:  # y, kept where the final activation's derivative reads it (ReLU's)
        assert len(saved) == 3 + len(weights)
        kept_y, saved = saved[2], saved[:2] + saved[3:]
        if name == "relu linear":
            assert kept_y.data_ptr() == y.data_ptr()
        else:
            assert kept_y is None
    assert all(s is w for s, w in zip(saved[2:], weights, strict=True))


@pytest.mark.parametrize("name", list(calls()))
def test_a_dispatch_mode_keeps_the_op_autograd_with_the_same_gradients(name: str) -> None:
    call, parameters, train_op = calls()[name]
    x = torch.randn(2, 3, DIM, requires_grad=True)
    grad_y = torch.randn(2, 3, parameters[-1].shape[0])
    gradients = []
    for mode in (None, PassThrough()):
        for tensor in (x, *parameters):
            tensor.grad = None
        if mode is None:
            y = call(x)
        else:
            with mode:
                y = call(x)
            assert train_op in type(y.grad_fn).__name__
        y.backward(grad_y)
        gradients.append([t.grad for t in (x, *parameters)])
    for function_grad, op_grad in zip(*gradients, strict=True):
        torch.testing.assert_close(function_grad, op_grad)


# An output gradient of shape (*leading, out) in the layouts autograd hands on, with x's
# leading dimensions: one value expanded (stride 0, from a loss's sum() or mean()), every other
# column of a wider tensor, and column-major rows.
STRIDED_GRADIENTS: dict[str, tuple[tuple[int, ...], Callable[..., torch.Tensor]]] = {
    "expanded": ((2, 3), lambda shape, dtype: torch.randn((), dtype=dtype).expand(shape)),
    "sliced": (
        (2, 3),
        lambda shape, dtype: torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2],
    ),
    "transposed": ((6,), lambda shape, dtype: torch.randn(shape[::-1], dtype=dtype).t()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(STRIDED_GRADIENTS))
@pytest.mark.parametrize("name", list(calls()))
def test_a_strided_output_gradient_gives_the_gradients_of_its_values(
    name: str, layout: str, dtype: torch.dtype
) -> None:
    """The CPU backward takes grad_y in any layout: the gradients must be those of the same
    values laid out contiguously, bit for bit where our kernels run (they copy a strided one
    themselves); ATen's GEMMs, on the host-GEMM path (test_host_gemm_suite runs this module
    there), may sum a transposed operand in another order."""
    call, parameters, _ = calls()[name]
    call.to(dtype)
    leading, make = STRIDED_GRADIENTS[layout]
    x = torch.randn(*leading, DIM, dtype=dtype, requires_grad=True)
    grad_y = make((*leading, parameters[-1].shape[0]), dtype)
    assert not grad_y.is_contiguous()
    strided, contiguous = (
        torch.autograd.grad(call(x), [x, *parameters], g) for g in (grad_y, grad_y.contiguous())
    )
    for got, want in zip(strided, contiguous, strict=True):
        if cpu_gemm_in_aten(dtype):
            torch.testing.assert_close(got, want)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(calls()))
def test_parameter_gradients_are_the_backwards_own_tensors(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AccumulateGrad steals a fresh gradient into .grad only when nothing else holds it and it
    is no view; otherwise it copies it (a ~0.8 MB clone per 16 x 256^3 step, as much as the
    backward's arithmetic). Each .grad must be the very storage the backward wrote."""
    from fusedmlp import autograd

    call, parameters, _ = calls()[name]
    produced: list[int] = []  # data pointers only: holding the tensors would prevent the steal

    def recording(backward):
        def run(*args, **kwargs):
            grads = backward(*args, **kwargs)
            flat = [g for part in grads for g in (part if isinstance(part, list) else [part])]
            produced.extend(g.data_ptr() for g in flat if g is not None)
            return grads

        return run

    monkeypatch.setattr(autograd, "_chain_backward", recording(autograd._chain_backward))
    monkeypatch.setattr(autograd, "_gated_backward", recording(autograd._gated_backward))
    call(torch.randn(3, DIM)).sum().backward()
    for parameter in parameters:
        assert parameter.grad._base is None
        assert parameter.grad.data_ptr() in produced


@pytest.mark.parametrize("name", list(calls()))
def test_a_training_step_leaves_nothing_for_the_cycle_collector(name: str) -> None:
    """Everything an eager training step allocates (the Function's ctx, saved tensors, argument
    lists) is freed by reference counting: a reference cycle (a ctx or closure holding itself)
    would make every step feed Python's collector, whose full passes scan all of torch's
    objects. The collector is paused only inside this test, so that no pass of its own can
    hide a cycle before the count."""
    import gc

    call, parameters, _ = calls()[name]
    x = torch.randn(3, DIM, requires_grad=True)
    call(x).sum().backward()  # first-call caches fill outside the count
    # Collect until nothing is left: a pass can free what earlier tests left behind (a
    # torch.compile's shape environment, held by weak-keyed caches whose keys die in the
    # pass) only for the next pass to find it.
    while gc.collect():
        pass
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for tensor in (x, *parameters):
            tensor.grad = None
        call(x).sum().backward()
        unreachable = gc.collect()
    finally:
        if was_enabled:
            gc.enable()
    assert unreachable == 0


class Doubled(torch.nn.Module):
    """A parametrization: the layer's weight becomes a class property computing 2 * weight."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def eager_twin(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same computation through nn.Linear and torch's activations, reading the same
    (possibly replaced or parametrized) parameters."""
    functional = torch.nn.functional
    if isinstance(module, fusedmlp.FusedLinear):
        activation = FUNCTIONAL[module.activation]
        return lambda x: activation(functional.linear(x, module.weight, module.bias))
    if isinstance(module, fusedmlp.FusedMLP):
        return lambda x: torch.nn.Sequential.forward(module, x)
    return lambda x: module.down_proj(
        functional.gelu(module.gate_proj(x), approximate="tanh") * module.up_proj(x)
    )


@pytest.mark.parametrize("name", list(calls()))
def test_modules_read_replaced_and_parametrized_weights(name: str) -> None:
    """The modules read each Linear's weight and bias on every call, from its parameters or,
    parametrized, through its property: a replaced Parameter and a parametrization both count."""
    from torch.nn.utils import parametrize

    module, _, _ = calls()[name]
    first = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(3, DIM, dtype=torch.float64)
    module.double()
    first.weight = torch.nn.Parameter(torch.randn_like(first.weight))
    torch.testing.assert_close(module(x), eager_twin(module)(x))
    parametrize.register_parametrization(first, "weight", Doubled())
    torch.testing.assert_close(module(x), eager_twin(module)(x))
