"""Thread safety: the ops called concurrently from several Python threads (and while
torch.set_num_threads changes) give the same results as serial calls.

The CPU kernels split rows into blocks (and, for few rows, columns into slices) whose
arithmetic does not depend on the partition, and the backward's bias sums add fixed chunks in a
fixed order, so outputs and gradients must be bit-identical whatever the thread count. That
is a property of our kernels, not of ATen's GEMM (float64's default path, see
test_cpu_gemm_path.py), so these tests force our kernels at the CPU's own level.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fusedmlp
import pytest
import torch
from torch import Tensor

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WORKERS = 4
ROUNDS = 3


@pytest.fixture(autouse=True)
def our_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEDMLP_ISA at the level in use: every dtype runs our kernels, none ATen's GEMM."""
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    level = fusedmlp._C.cpu_isa().removeprefix("aten+")
    monkeypatch.setenv("FUSEDMLP_ISA", level)


@dataclass
class Case:
    """One op call: run() returns its output (training calls: and their inputs' gradients)."""

    name: str
    run: Callable[[], list[Tensor]]


def _tensor(generator: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale


def make_cases(device: str) -> list[Case]:
    """Small and large (multi-block, so the kernel's parallel_for engages) calls of every op,
    float32 and float64/bfloat16, with different activations."""
    generator = torch.Generator().manual_seed(42)
    dtypes = (
        [torch.float32, torch.float64, torch.bfloat16]
        if device == "cpu"
        else [torch.float32, torch.bfloat16]
    )
    cases = []
    for dtype in dtypes:
        # few rows over wide layers: each product's columns are split over the threads
        for rows, dim, hidden in [(3, 8, 12), (300, 96, 160), (16, 256, 2048)]:

            def leaf(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> Tensor:
                values = _tensor(generator, *shape, scale=scale)
                return values.to(device, dtype).requires_grad_()

            x = leaf(rows, dim)
            w1, b1 = leaf(hidden, dim, scale=dim**-0.5), leaf(hidden)
            w2, b2 = leaf(dim, hidden, scale=hidden**-0.5), leaf(dim)
            gate, up = leaf(hidden, dim, scale=dim**-0.5), leaf(hidden, dim, scale=dim**-0.5)
            tag = f"{device}-{dtype}-{rows}x{dim}x{hidden}"
            cases += [
                Case(
                    f"linear-{tag}",
                    _with_grads(
                        lambda x=x, w1=w1, b1=b1: fusedmlp.linear(x, w1, b1, "gelu"), [x, w1, b1]
                    ),
                ),
                Case(
                    f"mlp-{tag}",
                    _with_grads(
                        lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: fusedmlp.mlp(
                            x, [w1, w2], [b1, b2], "silu"
                        ),
                        [x, w1, b1, w2, b2],
                    ),
                ),
                Case(
                    f"mlp-inference-{tag}",
                    lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: _no_grad_outputs(
                        fusedmlp.mlp, x, [w1, w2, w1], [b1, b2, b1], "relu"
                    ),
                ),
                Case(
                    f"gated-{tag}",
                    _with_grads(
                        lambda x=x, gate=gate, up=up, w2=w2: fusedmlp.gated_mlp(
                            x, gate, up, w2, "gelu_tanh"
                        ),
                        [x, gate, up, w2],
                    ),
                ),
            ]
    return cases


def _with_grads(forward: Callable[[], Tensor], inputs: list[Tensor]) -> Callable[[], list[Tensor]]:
    """forward() and the gradients of a fixed weighted sum of it, computed without touching
    the inputs' .grad (so concurrent calls share nothing mutable)."""

    def run() -> list[Tensor]:
        y = forward()
        weights = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view(y.shape)
        grads = torch.autograd.grad((y * weights).sum(), inputs)
        return [y.detach(), *grads]

    return run


def _no_grad_outputs(op: Callable[..., Tensor], *args: object) -> list[Tensor]:
    """Inference, where a few-row chain keeps hidden outputs in the kernels' own layout."""
    with torch.no_grad():
        return [op(*args)]


def run_serially(cases: list[Case]) -> dict[str, list[Tensor]]:
    return {case.name: case.run() for case in cases}


def in_fresh_thread(function: Callable[[], object]) -> object:
    """Runs function in a new thread, so it sees the thread-count defaults the workers see."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function).result()


def assert_same(actual: list[Tensor], expected: list[Tensor], name: str) -> None:
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        what = "output" if index == 0 else f"grad {index - 1}"
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"{name} {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_calls_match_serial(device: str) -> None:
    cases = make_cases(device)
    expected = in_fresh_thread(lambda: run_serially(cases))
    start = threading.Barrier(WORKERS)

    def worker(seed: int) -> list[tuple[str, list[Tensor]]]:
        order = [case for _ in range(ROUNDS) for case in cases]
        random.Random(seed).shuffle(order)
        start.wait()
        results = [(case.name, case.run()) for case in order]
        # A bad call in the middle of the traffic: a clean error in this thread only.
        with pytest.raises(RuntimeError, match="expects 5 input features"):
            fusedmlp.linear(torch.randn(2, 4, device=device), torch.randn(3, 5, device=device))
        return results

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        outcomes = [pool.submit(worker, seed) for seed in range(WORKERS)]
        results = [item for outcome in outcomes for item in outcome.result()]
    assert len(results) == WORKERS * ROUNDS * len(cases)
    for name, actual in results:
        assert_same(actual, expected[name], name)


@pytest.mark.usefixtures("restore_num_threads")
def test_results_independent_of_num_threads() -> None:
    cases = make_cases("cpu")
    torch.set_num_threads(1)
    expected = run_serially(cases)
    for threads in (2, 3, 1, 4, 2):
        torch.set_num_threads(threads)
        for name, actual in run_serially(cases).items():
            assert_same(actual, expected[name], f"{name} at {threads} threads")


@pytest.mark.usefixtures("restore_num_threads")
def test_concurrent_calls_while_num_threads_changes() -> None:
    """Workers compute while the main thread keeps changing torch.set_num_threads."""
    cases = make_cases("cpu")
    expected = in_fresh_thread(lambda: run_serially(cases))
    done = threading.Event()

    def worker(seed: int) -> list[tuple[str, list[Tensor]]]:
        order = [case for _ in range(ROUNDS) for case in cases]
        random.Random(seed).shuffle(order)
        return [(case.name, case.run()) for case in order]

    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = [pool.submit(worker, seed) for seed in range(3)]
        threads = 1
        while not all(outcome.done() for outcome in outcomes):
            torch.set_num_threads(threads)
            threads = threads % 3 + 1
            done.wait(0.002)
        results = [item for outcome in outcomes for item in outcome.result()]
    for name, actual in results:
        assert_same(actual, expected[name], name)
