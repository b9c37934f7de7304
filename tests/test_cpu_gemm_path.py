"""Never slower than eager by default, per dtype: where the kernel unit a dtype would run is
not at a level measured to beat eager (every dtype on CPUs other than x86 with AVX2, and
float64, whose only unit is the scalar portable one, everywhere), the ops' GEMMs run in ATen,
each followed by our epilogue pass in the same op. On a CPU with AVX2 the tests take that path
for float32 with FUSEDMLP_CPU_GEMM=aten, its epilogue at the forced portable level."""

from __future__ import annotations

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from c_build import registry_beats_eager
from conftest import ACTIVATIONS, FUNCTIONAL, assert_matches_reference
from fusedmlp import _C
from fusedmlp.registry import cpu_gemm_in_aten, cpu_isas, detected_cpu_isa

ISAS = {isa.name: isa for isa in cpu_isas()}


@pytest.fixture
def aten_path(monkeypatch) -> None:
    monkeypatch.setenv("FUSEDMLP_ISA", "portable")
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    assert _C.cpu_isa() == "aten+portable"
    assert cpu_gemm_in_aten()


def measured_level_here() -> bool:
    """Whether this CPU has a level measured to beat eager (x86 with AVX2)."""
    return "avx2" in ISAS and ISAS["avx2"].supported


def test_the_default_path_and_what_forces_the_kernels(monkeypatch):
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    best = detected_cpu_isa(ISAS.values())
    assert _C.cpu_isa() == (best if measured_level_here() else f"aten+{best}")
    monkeypatch.setenv("FUSEDMLP_ISA", "portable")  # a forced level runs our kernels
    assert _C.cpu_isa() == "portable"
    assert not cpu_gemm_in_aten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_each_dtype_takes_the_path_of_the_unit_it_runs(monkeypatch, dtype, generator):
    """float32 and bfloat16 run units at the measured level on a CPU with AVX2; float64 has
    only its scalar portable unit, so its GEMMs run in ATen by default on every CPU."""
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    x = sample(16, 32, generator=generator, dtype=dtype)
    weight = sample(48, 32, generator=generator, dtype=dtype)
    linear = lambda: fusedmlp.linear(x, weight, None, "gelu")  # noqa: E731
    ours = measured_level_here() and dtype != torch.float64
    assert gemms_inside("fusedmlp::linear", linear) == (0 if ours else 1)
    monkeypatch.setenv("FUSEDMLP_ISA", "portable")  # a forced level runs our kernels
    assert gemms_inside("fusedmlp::linear", linear) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_isa_and_the_backward_follow_each_dtypes_path(monkeypatch, dtype, generator):
    """_C.cpu_isa(dtype) says each dtype's path, and the backward takes it: float64's is
    ATen's GEMMs (inside our backward op) by default, not our GEMMs on its scalar unit."""
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    best = detected_cpu_isa(ISAS.values())
    ours = measured_level_here() and dtype != torch.float64
    assert _C.cpu_isa(str(dtype).removeprefix("torch.")) == (best if ours else f"aten+{best}")
    assert cpu_gemm_in_aten(dtype) == (not ours)
    x = sample(16, 32, generator=generator, dtype=dtype).requires_grad_()
    weight = sample(48, 32, generator=generator, dtype=dtype).requires_grad_()
    y = fusedmlp.linear(x, weight, None, "gelu")
    backward = lambda: y.sum().backward()  # noqa: E731
    assert gemms_inside("fusedmlp::chain_backward", backward) == (0 if ours else 2)  # dW, dX


def test_cpu_isa_reports_float32_unless_told_and_names_a_bad_dtype(monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    assert _C.cpu_isa() == _C.cpu_isa("float32") and _C.cpu_isa().startswith("aten+")
    with pytest.raises(ValueError, match="cpu_isa: dtype 'float16' is not one the CPU kernels"):
        _C.cpu_isa("float16")


def sample(*shape: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_and_its_gradients_match_eager(aten_path, activation, dtype, generator):
    x = sample(2, 37, 29, generator=generator, dtype=dtype).requires_grad_()
    weight = sample(45, 29, generator=generator, dtype=dtype).requires_grad_()
    bias = sample(45, generator=generator, dtype=dtype).requires_grad_()
    y = fusedmlp.linear(x, weight, bias, activation)
    grad_y = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(grad_y)
    inputs = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = FUNCTIONAL[activation](F.linear(*inputs))
    expected.backward(grad_y.double())
    assert_matches_reference(y, expected.detach())
    for got, want in zip((x, weight, bias), inputs):
        assert_matches_reference(got.grad, want.grad)


@pytest.mark.parametrize("rows,features", [(0, 29), (5, 0)])
def test_empty_products_match_eager(aten_path, rows, features, generator):
    x = torch.randn(rows, features, generator=generator)
    weight = torch.randn(7, features, generator=generator)
    bias = torch.randn(7, generator=generator)
    expected = F.gelu(F.linear(x, weight, bias))
    torch.testing.assert_close(fusedmlp.linear(x, weight, bias, "gelu"), expected)
    w_gate, w_up = (torch.randn(6, features, generator=generator) for _ in range(2))
    w_down = torch.randn(features, 6, generator=generator)
    gated = fusedmlp.gated_mlp(x, w_gate, w_up, w_down, "silu", bias_gate=bias[:6])
    gate, up = F.linear(x, w_gate, bias[:6]), F.linear(x, w_up)
    torch.testing.assert_close(gated, F.linear(F.silu(gate) * up, w_down))


def test_mlp_and_its_gradients_match_eager(aten_path, generator):
    x = sample(70, 33, generator=generator, dtype=torch.float64).requires_grad_()
    weights = [
        sample(*shape, generator=generator, dtype=torch.float64).requires_grad_()
        for shape in ((40, 33), (24, 40))
    ]
    y = fusedmlp.mlp(x, weights, activation="silu")
    expected = F.linear(F.silu(F.linear(x, weights[0])), weights[1])
    torch.testing.assert_close(y, expected)
    grads = torch.autograd.grad(y.sum(), [x, *weights])
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), [x, *weights]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 700])  # 700 x 96: the bias pass split into tasks
def test_a_bias_gemm_makes_eagers_own_sums(aten_path, dtype, rows, generator):
    """Our pass lays the bias over the output's rows and ATen's GEMM adds the product into
    them: the sums eager's addmm makes, bit for bit, for one layer and a chain."""
    x = sample(rows, 64, generator=generator, dtype=dtype)
    weight = sample(96, 64, generator=generator, dtype=dtype)
    bias = sample(96, generator=generator, dtype=dtype)
    assert torch.equal(fusedmlp.linear(x, weight, bias), F.linear(x, weight, bias))
    down = sample(64, 96, generator=generator, dtype=dtype)
    bias_down = sample(64, generator=generator, dtype=dtype)
    y = fusedmlp.mlp(x, [weight, down], [bias, bias_down], "relu")
    assert torch.equal(y, F.linear(F.relu(F.linear(x, weight, bias)), down, bias_down))


# The biases go into ATen's GEMM, as eager's (in bfloat16, added after its rounding they
# would cancel to noise near zero: the bfloat16 ReLU case of
# test_linear_and_its_gradients_match_eager fails then)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gated_with_biases_and_its_gradients_match_eager(aten_path, dtype, generator):
    x = sample(70, 33, generator=generator, dtype=dtype).requires_grad_()
    shapes = ((40, 33), (40, 33), (33, 40), (40,), (40,), (33,))
    parameters = [
        sample(*shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes
    ]
    w_gate, w_up, w_down, b_gate, b_up, b_down = parameters
    y = fusedmlp.gated_mlp(x, w_gate, w_up, w_down, "gelu_tanh", b_gate, b_up, b_down)
    grads = torch.autograd.grad(y.sum(), [x, *parameters])
    inputs = [t.detach().double().requires_grad_() for t in (x, *parameters)]
    xd, gd, ud, dd, bgd, bud, bdd = inputs
    gelu = FUNCTIONAL["gelu_tanh"]
    expected = F.linear(gelu(F.linear(xd, gd, bgd)) * F.linear(xd, ud, bud), dd, bdd)
    assert_matches_reference(y, expected.detach())
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), inputs)):
        assert_matches_reference(got, want)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grad_x", [True, False])
def test_mlp_gradients_match_eager(aten_path, activation, bias, grad_x, generator):
    """The host-GEMM path's chain_backward: every layer's dW, bias gradient and dX, the
    derivative reading a pre-activation (GELU) or a layer's output (ReLU), dX of the first
    layer skipped when x needs none; grad_y a view into a larger buffer (a storage offset)."""
    x = sample(3, 23, 33, generator=generator, dtype=torch.float64).requires_grad_(grad_x)
    shapes = ((40, 33), (24, 40), (17, 24))
    weights = [sample(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    biases = [sample(shape[0], generator=generator, dtype=torch.float64) for shape in shapes]
    parameters = [*weights, *(biases if bias else [])]
    for parameter in parameters:
        parameter.requires_grad_()
    y = fusedmlp.mlp(x, weights, biases if bias else None, activation)
    expected = x
    for index, (weight, b) in enumerate(zip(weights, biases)):
        expected = F.linear(expected, weight, b if bias else None)
        if index < len(weights) - 1:
            expected = FUNCTIONAL[activation](expected)
    torch.testing.assert_close(y, expected)
    wrt = [x, *parameters] if grad_x else parameters
    grad_y = torch.randn(2 * y.numel(), generator=generator, dtype=torch.float64)
    grad_y = grad_y[y.numel() :].view(y.shape)
    torch.testing.assert_close(
        torch.autograd.grad(y, wrt, grad_y), torch.autograd.grad(expected, wrt, grad_y)
    )


GRAD_LAYOUTS = {
    "rows": lambda shape, g: torch.randn(shape, generator=g, dtype=torch.float64),
    # a sum()'s gradient: one value, strides 0 (ATen's GEMM cannot read it as it is)
    "expanded": lambda shape, g: torch.randn((), generator=g, dtype=torch.float64).expand(shape),
    "column-major": lambda shape, g: torch.randn(
        shape[::-1], generator=g, dtype=torch.float64
    ).t(),
    "every other column": lambda shape, g: torch.randn(
        shape[0], 2 * shape[1], generator=g, dtype=torch.float64
    )[:, ::2],
}


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("layers", [1, 3])
def test_a_gradient_in_any_layout_gives_eagers_gradients(aten_path, layout, layers, generator):
    """The host-GEMM path's chain_backward reads grad_y as it is where ATen's GEMM does and
    copies it once otherwise; each activation's derivative goes in place into gradients of
    its own, never into the caller's grad_y. One ReLU layer (the derivative reads grad_y)
    and a three-layer chain (the last layer's GEMMs read it)."""
    widths = (33, 40, 24, 17)[: layers + 1]
    x = sample(29, widths[0], generator=generator, dtype=torch.float64)
    parameters = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        parameters += [sample(fan_out, fan_in, generator=generator, dtype=torch.float64),
                       sample(fan_out, generator=generator, dtype=torch.float64)]
    for parameter in parameters:
        parameter.requires_grad_()
    weights, biases = parameters[::2], parameters[1::2]
    if layers == 1:
        y = fusedmlp.linear(x, weights[0], biases[0], "relu")
        expected = F.relu(F.linear(x, weights[0], biases[0]))
    else:
        y = fusedmlp.mlp(x, weights, biases, "relu")
        expected = x
        for index, (weight, bias) in enumerate(zip(weights, biases)):
            expected = F.linear(expected, weight, bias)
            expected = F.relu(expected) if index < layers - 1 else expected
    grad_y = GRAD_LAYOUTS[layout](y.shape, generator)
    kept = grad_y.clone()
    torch.testing.assert_close(
        torch.autograd.grad(y, parameters, grad_y),
        torch.autograd.grad(expected, parameters, grad_y),
    )
    assert torch.equal(grad_y, kept)


def gemms_inside(op: str, run) -> int:
    """How many aten::addmm / aten::mm events the profiler shows inside `op`'s event."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = prof.events()
    assert any(e.name == op for e in events), sorted({e.name for e in events})

    def inside(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and parent.name != op:
            parent = parent.cpu_parent
        return parent is not None

    return sum(e.name in ("aten::addmm", "aten::mm") and inside(e) for e in events)


def test_the_profiler_shows_atens_gemm_inside_our_op(aten_path, monkeypatch, generator):
    x = sample(16, 32, generator=generator, dtype=torch.float32)
    w_gate, w_up = (sample(48, 32, generator=generator, dtype=torch.float32) for _ in range(2))
    w_down = sample(32, 48, generator=generator, dtype=torch.float32)
    linear = lambda: fusedmlp.linear(x, w_gate, None, "gelu")  # noqa: E731
    gated = lambda: fusedmlp.gated_mlp(x, w_gate, w_up, w_down)  # noqa: E731
    assert gemms_inside("fusedmlp::linear", linear) == 1
    assert gemms_inside("fusedmlp::gated_mlp", gated) == 3
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM")  # the forced level alone: our kernels
    assert gemms_inside("fusedmlp::linear", linear) == 0


@pytest.fixture
def portable_default(monkeypatch) -> None:
    """What an x86 CPU without AVX2 runs by default: FUSEDMLP_CPU_GEMM=auto makes the forced
    portable level only a limit, the registry choosing the path at it."""
    monkeypatch.setenv("FUSEDMLP_ISA", "portable")
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "auto")
    assert _C.cpu_isa() == "aten+portable"


def test_auto_lets_the_registry_choose_at_a_forced_level(monkeypatch):
    measured_levels = registry_beats_eager()
    assert measured_levels, "the registry marks no ISA FMLP_BEATS_EAGER: this test checks nothing"
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "auto")
    for isa in (isa for isa in cpu_isas() if isa.supported):
        monkeypatch.setenv("FUSEDMLP_ISA", isa.name)
        measured = isa.name in measured_levels
        assert _C.cpu_isa() == (isa.name if measured else f"aten+{isa.name}"), isa.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_few_rows_of_inference_run_our_kernels_where_gemms_run_in_aten(
    portable_default, monkeypatch, dtype, generator
):
    """Up to 4 rows, an inference call reads each weight once in our kernels (a product bound
    by reading the weights) where the GEMMs otherwise run in ATen by default; more rows, a
    training call, a weight the unit would pack (float64's scalar unit packs all) or
    FUSEDMLP_CPU_GEMM=aten keep ATen's GEMM. Outputs are eager's either way."""
    ours = dtype != torch.float64
    weight = sample(48, 32, generator=generator, dtype=dtype)
    w_up = sample(48, 32, generator=generator, dtype=dtype)
    w_down = sample(32, 48, generator=generator, dtype=dtype)

    def gemms(rows: int, w: torch.Tensor = weight) -> int:
        x = sample(rows, 32, generator=generator, dtype=dtype)
        expected = F.gelu(F.linear(x.double(), w.double()))
        assert_matches_reference(fusedmlp.linear(x, w, None, "gelu"), expected)
        return gemms_inside("fusedmlp::linear", lambda: fusedmlp.linear(x, w, None, "gelu"))

    assert gemms(1) == gemms(4) == (0 if ours else 1)
    assert gemms(5) == 1
    assert gemms(4, weight.t().contiguous().t()) == 1  # columns apart: the unit would pack it
    x = sample(2, 32, generator=generator, dtype=dtype)
    gated = lambda: fusedmlp.gated_mlp(x, weight, w_up, w_down, "silu")  # noqa: E731
    assert gemms_inside("fusedmlp::gated_mlp", gated) == (0 if ours else 3)
    expected = F.linear(F.silu(F.linear(x.double(), weight.double())) *
                        F.linear(x.double(), w_up.double()), w_down.double())
    assert_matches_reference(gated(), expected)
    training = weight.detach().requires_grad_()
    train = lambda: fusedmlp.linear(x, training, None, "gelu")  # noqa: E731
    assert gemms_inside("fusedmlp::linear_train", train) == 1
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    assert gemms(1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_under_the_profiler_the_bias_gemm_is_atens_linear(aten_path, dtype, generator):
    """A bias goes into ATen's GEMM, through the dispatcher's aten::linear.out (whose bias is
    optional) while a profiler records: its addmm shows inside our op, and the output is
    eager's."""
    x = sample(16, 32, generator=generator, dtype=dtype)
    weight = sample(48, 32, generator=generator, dtype=dtype)
    bias = sample(48, generator=generator, dtype=dtype)
    assert gemms_inside("fusedmlp::linear", lambda: fusedmlp.linear(x, weight, bias, "relu")) == 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        y = fusedmlp.linear(x, weight, bias, "relu")
    torch.testing.assert_close(y, F.relu(F.linear(x, weight, bias)))


# The chunks' size follows the L2 cache (csrc/cpu/host_chunks.c); these shapes hold for any
# L2 cache of at most 4 MiB a core, on one thread.
L2_AT_MOST = 4 << 20


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tall_chains_run_in_row_chunks_and_match_eager(aten_path, one_thread, generator):
    """With weights that stay in cache, the host-GEMM path runs a tall chain a chunk of rows
    at a time through every layer (a chunk's widest activation filling an L2 cache per
    thread): each chunk's GEMMs show under the profiler, and the output and gradients (the
    saved activations written chunk by chunk) match eager's."""
    widths, dtype = (8, 16, 8), torch.float64
    rows = L2_AT_MOST // (max(widths) * 8) + 77  # over one chunk, not a multiple of one
    x = sample(rows, widths[0], generator=generator, dtype=dtype).requires_grad_()
    weights = [
        sample(n, k, generator=generator, dtype=dtype).requires_grad_()
        for k, n in zip(widths[:-1], widths[1:])
    ]
    biases = [sample(n, generator=generator, dtype=dtype).requires_grad_() for n in widths[1:]]
    with torch.no_grad():
        gemms = gemms_inside("fusedmlp::mlp", lambda: fusedmlp.mlp(x, weights, biases, "gelu"))
    assert gemms > 2 and gemms % 2 == 0  # both layers' GEMMs for each of several chunks
    y = fusedmlp.mlp(x, weights, biases, "gelu")
    expected = F.linear(F.gelu(F.linear(x, weights[0], biases[0])), weights[1], biases[1])
    torch.testing.assert_close(y, expected)
    wrt = [x, *weights, *biases]
    torch.testing.assert_close(
        torch.autograd.grad(y.sum(), wrt), torch.autograd.grad(expected.sum(), wrt)
    )


def test_a_weight_larger_than_l2_keeps_the_rows_whole(aten_path, one_thread, generator):
    """ATen's GEMM would read and pack a weight that outgrows the L2 cache again for every
    chunk: such a layer runs all rows in one GEMM."""
    width = 768  # a float64 768 x 768 weight: 4.5 MiB
    assert width * width * 8 > L2_AT_MOST
    rows = 4 * L2_AT_MOST // (width * 8)  # four chunks of a chunked run
    x = sample(rows, width, generator=generator, dtype=torch.float64)
    weight = sample(width, width, generator=generator, dtype=torch.float64)
    assert gemms_inside("fusedmlp::linear", lambda: fusedmlp.linear(x, weight, None, "relu")) == 1
