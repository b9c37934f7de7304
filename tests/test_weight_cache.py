"""The CPU inference ops' packed-weight cache (csrc/torch/weight_cache.cpp): the same bits
with and without it, never a stale copy (in-place updates, load_state_dict, `.data =`, a
freed weight's address), bounded, safe from several threads, off unless
FUSEDMLP_WEIGHT_CACHE_MB is set and with 0, unused by training calls, inference tensors and
autocast's casts."""

from __future__ import annotations

import threading
from collections.abc import Callable

import fusedmlp
import pytest
import torch
from conftest import transposed_layout
from fusedmlp import _C
from torch import Tensor

ENV = "FUSEDMLP_WEIGHT_CACHE_MB"
ON = "256"  # MiB: room for every weight these tests cache
FEW_ROWS = 8  # rows that read weights in place (up to GEMM_UNPACKED_MAX_ROWS, but portable)
# one row block packing weights just in time, and row blocks over weights packed ahead
# (drivers.h's GEMM_JIT_MAX_ROWS, 512, for these small weights)
ROWS = (100, 600)
DIM, HIDDEN = 160, 288  # past a K block's edge tiles: odd panels and tiles


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch) -> None:
    """Each test starts from an empty cache, turned on, on our kernels' path: the cache is
    theirs, so on a CPU whose default is ATen's GEMM (no AVX2) its best level is forced."""
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    if _C.cpu_isa().startswith("aten+"):
        monkeypatch.setenv("FUSEDMLP_ISA", _C.cpu_isa().removeprefix("aten+"))
    monkeypatch.setenv(ENV, ON)
    fusedmlp.clear_weight_cache()
    yield
    fusedmlp.clear_weight_cache()


def rand(*shape: int, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    return (torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to(dtype)


def uncached(monkeypatch, run: Callable[[], Tensor]) -> Tensor:
    """run() with the cache off (which also empties it), then on again."""
    monkeypatch.setenv(ENV, "0")
    try:
        return run()
    finally:
        monkeypatch.setenv(ENV, ON)


def ops(dtype: torch.dtype, generator: torch.Generator) -> dict[str, tuple[Callable, list]]:
    """Each op as (call(x, weights), weights), strided and transposed weights included."""
    w1 = rand(HIDDEN, DIM, dtype=dtype, generator=generator)
    w2 = transposed_layout(rand(HIDDEN, HIDDEN, dtype=dtype, generator=generator))
    w3 = rand(DIM, HIDDEN + 5, dtype=dtype, generator=generator)[:, :HIDDEN]
    b = rand(HIDDEN, dtype=dtype, generator=generator)
    gate, up = (rand(HIDDEN, DIM, dtype=dtype, generator=generator) for _ in range(2))
    down = rand(DIM, HIDDEN, dtype=dtype, generator=generator)
    return {
        "linear": (lambda x, w: fusedmlp.linear(x, w[0], b, "gelu"), [w1]),
        "mlp": (lambda x, w: fusedmlp.mlp(x, w, [b, b, None], "silu"), [w1, w2, w3]),
        "gated": (lambda x, w: fusedmlp.gated_mlp(x, *w, activation="gelu_tanh"), [gate, up, down]),
    }


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["linear", "mlp", "gated"])
def test_same_bits_with_and_without(op, dtype, rows, isa, monkeypatch, generator) -> None:
    """A miss packs into the cache and a hit reads it; both give the bits of a call that
    packs its own weights, on every instruction set."""
    call, weights = ops(dtype, generator)[op]
    x = rand(rows, DIM, dtype=dtype, generator=generator)
    expected = uncached(monkeypatch, lambda: call(x, weights))
    assert fusedmlp.weight_cache_info()["entries"] == 0
    for _ in range(2):
        assert torch.equal(call(x, weights), expected)
    info = fusedmlp.weight_cache_info()
    assert info["entries"] == len(weights)
    assert info["misses"] == len(weights) and info["hits"] == len(weights)


@pytest.mark.parametrize("op", ["mlp", "gated"])
def test_profiled_calls_same_bits(op, monkeypatch, generator) -> None:
    """Under a profiler the ops run layer by layer (stage by stage), each with its cached
    weights."""
    call, weights = ops(torch.float32, generator)[op]
    x = torch.randn(ROWS[1], DIM, generator=generator)
    expected = call(x, weights)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = call(x, weights)
    assert torch.equal(profiled, expected)
    assert fusedmlp.weight_cache_info()["hits"] == len(weights)


def test_few_rows_take_nothing_from_it(isa, generator) -> None:
    """Few rows read the weights in place: nothing packed, nothing cached (the portable unit
    reads none in place)."""
    call, weights = ops(torch.float32, generator)["linear"]
    call(torch.randn(FEW_ROWS if isa != "portable" else 0, DIM, generator=generator), weights)
    assert fusedmlp.weight_cache_info()["entries"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_update_is_seen(dtype, monkeypatch, generator) -> None:
    call, weights = ops(dtype, generator)["gated"]
    x = rand(ROWS[1], DIM, dtype=dtype, generator=generator)
    before = call(x, weights)
    with torch.no_grad():
        weights[2].add_(0.5)
    expected = uncached(monkeypatch, lambda: call(x, weights))
    call(x, weights)  # cached again, at the new version
    with torch.inference_mode():  # normal tensors bump their version in inference mode too
        weights[0].mul_(2)
    expected = uncached(monkeypatch, lambda: call(x, weights))
    assert not torch.equal(expected, before)
    assert torch.equal(call(x, weights), expected)


def test_load_state_dict_is_seen(monkeypatch, generator) -> None:
    model = fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="silu").eval()
    other = fusedmlp.FusedGatedMLP(DIM, HIDDEN, activation="silu").eval()
    x = torch.randn(ROWS[1], DIM, generator=generator)
    with torch.no_grad():
        model(x)
        model.load_state_dict(other.state_dict())
        expected = uncached(monkeypatch, lambda: other(x))
        assert torch.equal(model(x), expected)


def test_data_swap_is_seen(monkeypatch, generator) -> None:
    layer = fusedmlp.FusedLinear(DIM, HIDDEN, activation="relu").eval()
    x = torch.randn(ROWS[1], DIM, generator=generator)
    with torch.no_grad():
        layer(x)
        layer.weight.data = torch.randn(HIDDEN, DIM, generator=generator)
        expected = uncached(monkeypatch, lambda: layer(x))
        assert torch.equal(layer(x), expected)


def test_new_weight_at_a_freed_address_misses(monkeypatch, generator) -> None:
    """Each entry holds its weight's storage, so a new weight never lands at a cached
    address: weights made and dropped in turn (the allocator would hand the same memory
    back) each miss and give their own result."""
    x = torch.randn(ROWS[1], DIM, generator=generator)
    addresses = set()
    for _ in range(6):
        w = torch.randn(HIDDEN, DIM, generator=generator)
        misses = fusedmlp.weight_cache_info()["misses"]
        got = fusedmlp.linear(x, w, None, "none")
        assert fusedmlp.weight_cache_info()["misses"] == misses + 1
        addresses.add(w.data_ptr())
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)
        del w
    assert len(addresses) == 6


def test_bounded_least_recently_used_first(monkeypatch, generator) -> None:
    monkeypatch.setenv(ENV, "1")  # 1 MiB: five 288 x 160 float32 weights (180 KiB each)
    x = torch.randn(ROWS[1], DIM, generator=generator)
    weights = [torch.randn(HIDDEN, DIM, generator=generator) for _ in range(8)]
    for w in weights:
        got = fusedmlp.linear(x, w, None, "none")
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)
        info = fusedmlp.weight_cache_info()
        assert info["bytes"] <= info["limit_bytes"] == 1 << 20
    assert info["entries"] == (1 << 20) // (info["bytes"] // info["entries"]) < len(weights)
    fusedmlp.linear(x, weights[-1], None, "none")  # the most recent: still there
    assert fusedmlp.weight_cache_info()["hits"] == 1
    fusedmlp.linear(x, weights[0], None, "none")  # the first: evicted
    assert fusedmlp.weight_cache_info()["hits"] == 1
    before = fusedmlp.weight_cache_info()
    big = torch.randn(2048, 256, generator=generator)  # 2 MiB packed: past the bound
    fusedmlp.linear(torch.randn(ROWS[1], 256, generator=generator), big, None, "none")
    after = fusedmlp.weight_cache_info()
    assert (after["entries"], after["bytes"]) == (before["entries"], before["bytes"])


def test_off_with_zero(monkeypatch, generator) -> None:
    call, weights = ops(torch.float32, generator)["mlp"]
    x = torch.randn(ROWS[1], DIM, generator=generator)
    call(x, weights)
    assert fusedmlp.weight_cache_info()["entries"] == 3
    monkeypatch.setenv(ENV, "0")
    call(x, weights)  # drops what it held, caches nothing
    assert fusedmlp.weight_cache_info()["entries"] == 0
    assert fusedmlp.weight_cache_info()["limit_bytes"] == 0


def test_off_by_default(monkeypatch, generator) -> None:
    """Unset, the cache neither fills nor answers: weights are read as they are each call."""
    monkeypatch.delenv(ENV)
    call, weights = ops(torch.float32, generator)["gated"]
    x = torch.randn(ROWS[0], DIM, generator=generator)
    first = call(x, weights)
    with torch.no_grad():
        weights[0].data.add_(1)  # unseen by the version counter: a cache would go stale here
    assert not torch.equal(call(x, weights), first)
    info = fusedmlp.weight_cache_info()
    assert (info["entries"], info["limit_bytes"]) == (0, 0)


def test_bad_bound_is_named(monkeypatch, generator) -> None:
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(RuntimeError, match=f"{ENV} must be a whole number of MiB"):
        fusedmlp.linear(torch.randn(ROWS[1], 8), torch.randn(8, 8), None, "none")


def test_training_never_fills_it(generator) -> None:
    model = fusedmlp.FusedMLP([DIM, HIDDEN, DIM], activation="gelu")
    gated = fusedmlp.FusedGatedMLP(DIM, HIDDEN)
    x = torch.randn(ROWS[1], DIM, generator=generator)
    (model(x).sum() + gated(x).sum()).backward()
    info = fusedmlp.weight_cache_info()
    assert (info["entries"], info["misses"]) == (0, 0)


def test_inference_tensors_are_not_cached(monkeypatch, generator) -> None:
    """An inference tensor has no version counter to tell an in-place update by."""
    with torch.inference_mode():
        w = torch.randn(HIDDEN, DIM, generator=generator)
        x = torch.randn(ROWS[1], DIM, generator=generator)
        first = fusedmlp.linear(x, w, None, "none")
        w.add_(1)
        expected = uncached(monkeypatch, lambda: fusedmlp.linear(x, w, None, "none"))
        assert torch.equal(fusedmlp.linear(x, w, None, "none"), expected)
        assert not torch.equal(first, expected)
    assert fusedmlp.weight_cache_info()["entries"] == 0


@pytest.mark.usefixtures("restore_num_threads")
def test_threads_with_their_own_weights(monkeypatch, generator) -> None:
    """Python threads calling at once, each its own weights, under a bound that holds only
    some of them: evictions while other calls read their copies, no mixed-up results."""
    monkeypatch.setenv(ENV, "1")
    torch.set_num_threads(2)
    x = torch.randn(ROWS[1], DIM, generator=generator)
    weights = [torch.randn(HIDDEN, DIM, generator=generator) for _ in range(6)]
    expected = [fusedmlp.linear(x, w, None, "relu") for w in weights]
    errors: list[str] = []

    def worker(index: int) -> None:
        for _ in range(20):
            if not torch.equal(fusedmlp.linear(x, weights[index], None, "relu"), expected[index]):
                errors.append(f"thread {index}: wrong result")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(weights))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert fusedmlp.weight_cache_info()["bytes"] <= 1 << 20


def test_compiled_inference_sees_updates(monkeypatch, generator) -> None:
    torch._dynamo.reset()
    model = fusedmlp.FusedGatedMLP(DIM, HIDDEN).eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(ROWS[1], DIM, generator=generator)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        for p in model.parameters():
            p.mul_(-1)
        expected = uncached(monkeypatch, lambda: model(x))
        assert torch.equal(compiled(x), expected)
    assert fusedmlp.weight_cache_info()["hits"] > 0


def test_autocast_casts_skip_it(generator) -> None:
    """Weights autocast casts are new tensors each call: not cached; weights already in the
    autocast dtype are, whatever x's dtype."""
    x = torch.randn(ROWS[1], DIM, generator=generator)
    weights = [torch.randn(*shape, generator=generator) for shape in [(HIDDEN, DIM)] * 2]
    weights.append(torch.randn(DIM, HIDDEN, generator=generator))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        float_weights = fusedmlp.gated_mlp(x, *weights)
        assert fusedmlp.weight_cache_info()["entries"] == 0
        bf16_weights = [w.to(torch.bfloat16) for w in weights]
        assert torch.equal(fusedmlp.gated_mlp(x, *bf16_weights), float_weights)
        assert fusedmlp.weight_cache_info()["entries"] == 3
