"""Shared helpers: devices and dtypes under test, PyTorch reference activations, tolerances."""

from __future__ import annotations

import os
import shutil
import tempfile

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from fusedmlp import _C
from fusedmlp.registry import cpu_isas
from torch import Tensor, nn

ACTIVATIONS = list(fusedmlp.ACTIVATIONS)
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DTYPES = {
    "cpu": [torch.float32, torch.float64, torch.bfloat16],
    "cuda": [torch.float32, torch.float16, torch.bfloat16],
}
DEVICE_DTYPES = [(device, dtype) for device in DEVICES for dtype in DTYPES[device]]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


ISAS = {isa.name: isa for isa in cpu_isas()}

_OWN_COMPILE_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def pytest_configure(config: pytest.Config) -> None:
    """torch.compile's on-disk caches key a graph on the names of its ops, not on their
    schemas or autograd formulas: a cache an earlier build of fusedmlp wrote would replay
    that build's backward graphs. So a test run compiles into a cache of its own (its
    subprocesses inherit it), unless TORCHINDUCTOR_CACHE_DIR names one."""
    if _OWN_COMPILE_CACHE:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusedmlp-tests-inductor-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_COMPILE_CACHE:
        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)


@pytest.fixture(params=list(ISAS))
def isa(request, monkeypatch) -> str:
    """Each instruction set the CPU has, forced with FUSEDMLP_ISA for the test (our kernels,
    also in a suite run under FUSEDMLP_CPU_GEMM=aten)."""
    if not ISAS[request.param].supported:
        pytest.skip(f"this CPU lacks some of {list(ISAS[request.param].cpu_features)}")
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    monkeypatch.setenv("FUSEDMLP_ISA", request.param)
    assert _C.cpu_isa() == request.param
    return request.param


def reference_activation(name: str) -> nn.Module:
    """The PyTorch module each activation name stands for."""
    return {
        "none": nn.Identity(),
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "gelu_tanh": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
    }[name]


FUNCTIONAL = {
    "none": lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


class GatedBlock(nn.Module):
    """The block as models write it: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = FUNCTIONAL[self.activation]
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return reference_activation(activation)(F.linear(x, weight, bias))


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances against a float64 reference. float32 sums in a different order than the
    reference (blocked K); half types round every output to 8 or 11 bits of mantissa."""
    return {
        torch.float64: {"rtol": 1e-10, "atol": 1e-10},
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
        torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    }[dtype]


def assert_matches_reference(actual: Tensor, expected64: Tensor) -> None:
    """Compares a result with its float64 reference, in the result's dtype tolerance."""
    torch.testing.assert_close(
        actual.double(), expected64.to(actual.device), **tolerances(actual.dtype)
    )


def strided_rows(x: Tensor) -> Tensor:
    """x as a view whose rows lie further apart than its width."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 3, dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


def transposed_layout(w: Tensor) -> Tensor:
    """w with unit row stride (column stride its rows), as a transposed weight is."""
    return w.t().contiguous().t()


def make_weights(
    sizes: list[int], dtype: torch.dtype, device: str, bias: bool, generator: torch.Generator
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Weights scaled like nn.Linear's init, so every layer's output stays O(1)."""
    weights, biases = [], []
    for size_in, size_out in zip(sizes[:-1], sizes[1:]):
        scale = 1.0 / max(size_in, 1) ** 0.5
        weights.append(
            (torch.randn(size_out, size_in, generator=generator) * scale).to(device, dtype)
        )
        biases.append(
            torch.randn(size_out, generator=generator).to(device, dtype) if bias else None
        )
    return weights, biases


@pytest.fixture
def restore_num_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def assert_compiled_matches(
    model: nn.Module,
    in_features: int,
    rows: tuple[int, ...],
    dynamic: bool,
    generator: torch.Generator,
) -> None:
    """torch.compile(fullgraph=True) of model gives its eager outputs for each row count,
    and the same parameter gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for count in rows:
        x = torch.randn(count, in_features, generator=generator)
        torch.testing.assert_close(compiled(x), model(x))
    x = torch.randn(rows[0] + 1, in_features, generator=generator)
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
