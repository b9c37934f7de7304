"""fusedmlp.mlp, the fusedmlp::mlp op and FusedMLP against nn.Sequential of Linear + activations."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
from conftest import (
    ACTIVATIONS,
    DEVICE_DTYPES,
    DEVICES,
    assert_compiled_matches,
    assert_matches_reference,
    make_weights,
    reference_activation,
)
from torch import nn
from torch.library import opcheck


def reference_mlp(x, weights, biases, activation):
    """float64 nn.Sequential semantics: activation after every layer but the last."""
    h = x.double()
    for index, (w, b) in enumerate(zip(weights, biases)):
        h = torch.nn.functional.linear(h, w.double(), None if b is None else b.double())
        if index < len(weights) - 1:
            h = reference_activation(activation)(h)
    return h


def reference_sequential(sizes, activation, bias=True):
    layers: list[nn.Module] = []
    for index, (size_in, size_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if index:
            layers.append(reference_activation(activation))
        layers.append(nn.Linear(size_in, size_out, bias=bias))
    return nn.Sequential(*layers)


LAYER_SIZES = [[17, 3], [5, 1, 7], [3, 17, 1000, 5], [9, 3, 17, 1, 6], [8, 16, 16, 16, 16, 4]]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("sizes", LAYER_SIZES, ids=lambda s: "x".join(map(str, s)))
def test_values_match_pytorch(device, dtype, activation, sizes, generator):
    weights, biases = make_weights(sizes, dtype, device, bias=True, generator=generator)
    x = torch.randn(2, 13, sizes[0], generator=generator).to(device, dtype)
    y = fusedmlp.mlp(x, weights, biases, activation)
    assert y.shape == (2, 13, sizes[-1]) and y.dtype == dtype
    assert_matches_reference(y, reference_mlp(x, weights, biases, activation))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1, 300, 2053])
def test_row_counts_and_missing_biases(device, rows, generator):
    sizes = [33, 65, 17, 9]
    weights, biases = make_weights(sizes, torch.float32, device, bias=True, generator=generator)
    biases[1] = None  # a layer without bias among layers with one
    x = torch.randn(rows, sizes[0], generator=generator).to(device)
    for layer_biases in (biases, None):
        expected = reference_mlp(x, weights, layer_biases or [None] * 3, "silu")
        assert_matches_reference(fusedmlp.mlp(x, weights, layer_biases, "silu"), expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_of_a_chain_past_the_l2(isa, dtype, threads, restore_num_threads, generator):
    """A chain whose weights exceed the L2, past the rows packed just in time: on two threads
    its row blocks take at least drivers.h's CHAIN_LEAST_BLOCK_ROWS (900 rows: 4 blocks, not
    8), so blocks end mid-tile and the threads' shares differ; on one thread at most
    HIDDEN_MOST_BLOCK_ROWS (2 blocks, not 1), which reuse its hidden scratch; every
    instruction set."""
    torch.set_num_threads(threads)
    sizes = [512, 1024, 512]  # 1M weights, 4 MiB packed
    weights, biases = make_weights(sizes, dtype, "cpu", bias=True, generator=generator)
    x = torch.randn(900, sizes[0], generator=generator).to(dtype)
    y = fusedmlp.mlp(x, weights, biases, "gelu")
    assert_matches_reference(y, reference_mlp(x, weights, biases, "gelu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n_layers", [1, 2, 3, 5])
def test_gradients_match_pytorch(dtype, activation, n_layers, generator):
    sizes = [7, 17, 3, 11, 5, 4][: n_layers + 1]
    weights, biases = make_weights(sizes, dtype, "cpu", bias=True, generator=generator)
    biases[0] = None
    x = torch.randn(3, 2, sizes[0], generator=generator, dtype=dtype)
    params = [x, *weights, *[b for b in biases if b is not None]]
    for p in params:
        p.requires_grad_(True)
    grad_out = torch.randn(3, 2, sizes[-1], generator=generator, dtype=dtype)
    fused = torch.autograd.grad(fusedmlp.mlp(x, weights, biases, activation), params, grad_out)
    expected_out = reference_mlp(x, weights, biases, activation).to(dtype)
    expected = torch.autograd.grad(expected_out, params, grad_out)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_gradients_past_tiles_and_cache_blocks(dtype, activation, generator):
    """The CPU backward (fusedmlp::chain_backward) on rows and widths past the kernels' tiles
    and K blocks (1024), from a transposed x, with and without grad for x."""
    sizes = [70, 1030, 33]
    weights, biases = make_weights(sizes, dtype, "cpu", bias=True, generator=generator)
    x = torch.randn(sizes[0], 1100, generator=generator).to(dtype).t()
    grad_out = torch.randn(1100, sizes[-1], generator=generator).to(dtype)
    for x_needs_grad in (True, False):
        params = [x, *weights, *biases]
        for p in params:
            p.requires_grad_(p is not x or x_needs_grad)
        wanted = params if x_needs_grad else params[1:]
        fused = torch.autograd.grad(fusedmlp.mlp(x, weights, biases, activation), wanted, grad_out)
        reference = reference_mlp(x, weights, biases, activation)
        expected = torch.autograd.grad(reference, wanted, grad_out.double())
        for got, want in zip(fused, expected, strict=True):
            assert got.dtype == dtype
            error = (got.double() - want).norm() / want.norm()
            assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_training_saves_a_pre_activation_only_where_the_derivative_reads_it(activation, generator):
    """A ReLU layer's derivative reads its output's sign (as eager's threshold_backward reads
    ReLU's result), and a hidden layer's output is saved anyway: no pre-activation is saved
    beside it. The other activations' derivatives read the pre-activation."""
    rows, sizes = 5, [6, 8, 9, 4]
    weights, biases = make_weights(sizes, torch.float32, "cpu", bias=True, generator=generator)
    x = torch.randn(rows, sizes[0], generator=generator)
    _, saved = torch.ops.fusedmlp.mlp_train(x, weights, biases, activation)
    outputs = rows * (8 + 9)
    reads_pre = activation not in ("none", "relu")
    assert saved.numel() == outputs * (2 if reads_pre else 1)
    # One layer saves nothing but a pre-activation; a final ReLU's backward reads y.
    _, saved = torch.ops.fusedmlp.linear_train(x, weights[0], biases[0], activation)
    assert saved.numel() == (rows * 8 if reads_pre else 0)


def test_a_relu_mlp_saves_for_backward_what_eager_saves(generator):
    from fusedmlp.tools.memory import saved_for_backward

    eager = reference_sequential([64, 128, 128, 32], "relu")
    fused = fusedmlp.FusedMLP.from_sequential(eager)
    x = torch.randn(16, 64, generator=generator)
    cpu = torch.device("cpu")
    eager_bytes = saved_for_backward(eager, x, cpu, compiled=False)
    assert eager_bytes >= 2 * 16 * 128 * 4  # the two hidden outputs
    assert saved_for_backward(fused, x, cpu, compiled=False) == eager_bytes


def test_a_stack_of_relu_linears_saves_for_backward_what_eager_saves(generator):
    """FusedLinear(activation="relu") layers swapped in one by one: each saves its output
    for its ReLU's derivative (the next layer saves it too, as its x), no pre-activation."""
    from fusedmlp.tools.memory import saved_for_backward

    sizes = [64, 128, 128, 32]
    linears = [nn.Linear(n_in, n_out) for n_in, n_out in zip(sizes[:-1], sizes[1:])]
    eager = nn.Sequential(*(layer for linear in linears for layer in (linear, nn.ReLU())))
    fused = nn.Sequential(*(fusedmlp.FusedLinear.from_linear(m, "relu") for m in linears))
    x = torch.randn(16, 64, generator=generator)
    torch.testing.assert_close(fused(x), eager(x))
    cpu = torch.device("cpu")
    eager_bytes = saved_for_backward(eager, x, cpu, compiled=False)
    # the hidden ReLUs' outputs (the last one's is y, which saved_for_backward leaves out)
    assert eager_bytes >= 16 * (128 + 128) * 4
    assert saved_for_backward(fused, x, cpu, compiled=False) == eager_bytes


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_grad_x", [True, False])
def test_opcheck_chain_backward(bias, need_grad_x, generator):
    weights, biases = make_weights([6, 5, 7], torch.float32, "cpu", bias, generator)
    x = torch.randn(2, 3, 6, generator=generator)
    present = [b for b in biases if b is not None]
    for activation in ACTIVATIONS:
        y, saved = torch.ops.fusedmlp.mlp_train(x, weights, present, activation)
        grad_y = torch.randn_like(y)
        args = (grad_y, x, weights, saved, None, bias, activation, "none", need_grad_x)
        opcheck(torch.ops.fusedmlp.chain_backward.default, args)
        # the same chain ending in the activation, which may read y
        y, saved = torch.ops.fusedmlp.linear_train(x, weights[0], biases[0], activation)
        grad_y = torch.randn_like(y)
        args = (grad_y, x, weights[:1], saved, y, bias, "none", activation, need_grad_x)
        opcheck(torch.ops.fusedmlp.chain_backward.default, args)


def test_gradcheck_float64_plain_op_and_training_op(generator):
    sizes = [4, 6, 5, 3]
    weights, biases = make_weights(sizes, torch.float64, "cpu", bias=True, generator=generator)
    x = torch.randn(2, 4, generator=generator, dtype=torch.float64)
    args = [x, *weights, *biases]
    for t in args:
        t.requires_grad_(True)
    for activation in ["relu", "gelu", "silu"]:

        def through_op(x, *p, activation=activation):
            return torch.ops.fusedmlp.mlp(x, list(p[:3]), list(p[3:]), activation)

        def through_function(x, *p, activation=activation):
            return fusedmlp.mlp(x, p[:3], p[3:], activation)

        assert torch.autograd.gradcheck(through_op, tuple(args))
        assert torch.autograd.gradcheck(through_function, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, generator):
    for activation in ACTIVATIONS:
        for bias in (True, False):
            for requires_grad in (False, True):
                weights, biases = make_weights([6, 5, 7], torch.float32, device, bias, generator)
                x = torch.randn(3, 6, generator=generator).to(device)
                for t in (x, *weights, *[b for b in biases if b is not None]):
                    t.requires_grad_(requires_grad)
                args = (x, weights, [b for b in biases if b is not None], activation)
                opcheck(torch.ops.fusedmlp.mlp.default, args)
                opcheck(torch.ops.fusedmlp.mlp_train.default, args)


def test_bad_inputs():
    x = torch.randn(3, 8)
    w1, w2 = torch.randn(5, 8), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match=r"weight\[1\] has shape \[4, 6\]"):
        fusedmlp.mlp(x, [w1, torch.randn(4, 6)])
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        fusedmlp.mlp(x, [w1, w2], [None])
    with pytest.raises(ValueError, match="at least one weight"):
        fusedmlp.mlp(x, [])
    with pytest.raises(RuntimeError, match="pass one bias per weight"):
        torch.ops.fusedmlp.mlp(x, [w1, w2], [torch.randn(5)], "relu")
    with pytest.raises(ValueError, match="valid names"):
        fusedmlp.mlp(x, [w1, w2], activation="elu")


# ---- FusedMLP ----


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_module_state_dict_round_trips(activation, bias, generator):
    sizes = [12, 20, 20, 6]
    reference = reference_sequential(sizes, activation, bias)
    fused = fusedmlp.FusedMLP(sizes, activation=activation, bias=bias)
    assert fused.state_dict().keys() == reference.state_dict().keys()
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(4, 12, generator=generator)
    torch.testing.assert_close(fused(x), reference(x))
    back = reference_sequential(sizes, activation, bias)
    back.load_state_dict(fused.state_dict())
    torch.testing.assert_close(back(x), reference(x))


def test_module_init_matches_sequential():
    torch.manual_seed(11)
    reference = reference_sequential([6, 9, 4], "relu")
    torch.manual_seed(11)
    fused = fusedmlp.FusedMLP([6, 9, 4], activation="relu")
    for (name, p), (ref_name, q) in zip(fused.named_parameters(), reference.named_parameters()):
        assert name == ref_name
        torch.testing.assert_close(p, q)
    assert fusedmlp.FusedMLP([3, 4], dtype=torch.float64).linears()[0].weight.dtype == torch.float64


def test_from_sequential_shares_parameters_and_trains_the_same(generator):
    reference = reference_sequential([5, 8, 8, 3], "gelu")
    fused = fusedmlp.FusedMLP.from_sequential(reference)
    assert fused[0].weight is reference[0].weight
    x = torch.randn(7, 5, generator=generator)
    fused(x).square().sum().backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    reference.zero_grad()
    reference_out = nn.Sequential(*reference)(x)  # plain Sequential forward
    reference_out.square().sum().backward()
    for got, want in zip(grads, [p.grad for p in reference.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="from_sequential expects"):
        fusedmlp.FusedMLP.from_sequential(
            nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        )


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic, generator):
    model = fusedmlp.FusedMLP([8, 16, 16, 4], activation="silu")
    assert_compiled_matches(model, 8, (3, 6), dynamic, generator)


def test_profiler_labels_each_layer(generator):
    model = fusedmlp.FusedMLP([8, 16, 16, 4], activation="relu")
    x = torch.randn(4, 8, generator=generator)
    with torch.profiler.profile() as prof, torch.no_grad():
        model(x)
    names = [event.name for event in prof.events()]
    assert names.count("fusedmlp::mlp") == 1
    for layer in range(3):
        assert f"fusedmlp.mlp.layer{layer}" in names
