"""Tensor parallelism (parallelize_module with PyTorch's own plans) and FSDP2 (fully_shard) on
the fused modules, 2 gloo ranks on this machine (loopback only), against single-process models
built from nn.Linear with the same weights, in float32 and bfloat16.

One spawn runs every check (rank_main); each returns what its rank saw, as plain tensors and
strings, and the tests here compare. A step is: forward, (y * target) reduced to a scalar,
backward, SGD; the checks cover the output, the input's gradient, every parameter's gathered
gradient and the output after the step.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import fusedmlp
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import reference_activation, tolerances
from distributed_spawn import run_ranks
from torch import Tensor, nn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORLD_SIZE = 2
TIMEOUT_S = 120
DIM, HIDDEN, OUT = 8, 16, 6  # HIDDEN and OUT split evenly over the ranks
BATCH, SEQ = 4, 4  # x is (BATCH, SEQ, DIM); FSDP splits the batch, sequence parallel SEQ
DTYPES = [torch.float32, torch.bfloat16]
TP_KINDS = ["linear", "relu_linear", "mlp", "gated"]
# The two-layer kinds' activation (ReLU's backward reads the layer's output, not a saved
# pre-activation); the "linear" kinds swap in a FusedLinear per layer, "mlp" a FusedMLP.
TWO_LAYER_ACTIVATIONS = {"linear": "gelu", "relu_linear": "relu", "mlp": "gelu"}
LR = 0.1
VIEW_WARNING = "returned a view tensor"  # FSDP2 on a module output that is a view


class PlainGated(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def plain_model(kind: str, dtype: torch.dtype) -> nn.Module:
    """The nn.Linear model of each check; seeded, so every process builds the same one."""
    torch.manual_seed(0)
    if kind == "gated":
        model: nn.Module = PlainGated(DIM, HIDDEN)
    elif kind == "fsdp":  # two blocks, each wrapped by fully_shard
        model = nn.Sequential(
            nn.Sequential(
                nn.Linear(DIM, HIDDEN),
                nn.GELU(),
                nn.Linear(HIDDEN, HIDDEN),
                nn.GELU(),
                nn.Linear(HIDDEN, DIM),
            ),
            PlainGated(DIM, HIDDEN),
        )
    else:
        activation = reference_activation(TWO_LAYER_ACTIVATIONS[kind])
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), activation, nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def fused_model(kind: str, dtype: torch.dtype) -> nn.Module:
    """plain_model's fused twin, sharing its Parameters."""
    plain = plain_model(kind, dtype)
    if kind in ("linear", "relu_linear"):  # named as in plain, so the gradients' names match
        layers = {
            "0": fusedmlp.FusedLinear.from_linear(plain[0], TWO_LAYER_ACTIVATIONS[kind]),
            "2": fusedmlp.FusedLinear.from_linear(plain[2]),
        }
        return nn.Sequential(OrderedDict(layers))
    fused = fusedmlp.convert(plain)
    assert {type(m) for m in fused.modules()} & {fusedmlp.FusedMLP, fusedmlp.FusedGatedMLP}
    return fused


def tp_plan(kind: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "linear": {"0": ColwiseParallel(), "2": RowwiseParallel()},
        "relu_linear": {"0": ColwiseParallel(), "2": RowwiseParallel()},
        "mlp": {"0": ColwiseParallel(), "2": RowwiseParallel()},
        "gated": {
            "gate_proj": ColwiseParallel(),
            "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel(),
        },
    }[kind]


def batch(kind: str) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=generator)
    out = OUT if kind in ("linear", "relu_linear", "mlp") else DIM
    return x, torch.randn(BATCH, SEQ, out, generator=generator)


def _plain(t: Tensor) -> Tensor:
    """A gathered plain copy of a DTensor (or of a collective's output)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def step(
    model: nn.Module, x: Tensor, target: Tensor, dtype: torch.dtype, scale: float = 1.0
) -> dict:
    """One training step, on the loss (y * target).mean() * scale; what it saw, gathered."""
    x = x.to(dtype).requires_grad_()
    y = model(x)
    ((y * target.to(y.dtype)).mean() * scale).backward()
    grads = {name: _plain(p.grad) for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    with torch.no_grad():
        y_after = model(x)
    return {"y": _plain(y), "grad_x": _plain(x.grad), "grads": grads, "y_after": _plain(y_after)}


def tp_checks(mesh) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    results = {}
    for kind in TP_KINDS:
        for dtype in DTYPES:
            model = parallelize_module(fused_model(kind, dtype), mesh, tp_plan(kind))
            results[kind, dtype] = step(model, *batch(kind), dtype)
    return results


def sequence_parallel_checks(mesh, rank: int) -> dict:
    """The gated plan inside sequence parallelism (torchtitan's Llama MLP): the block's input
    and output split on the sequence dim, gathered before gate/up, reduce-scattered after."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    x, target = batch("gated")
    mine = sequence_share(rank, mesh.size())
    results = {}
    for dtype in DTYPES:
        model = fused_model("gated", dtype)
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(model, mesh, gather)
        plan = {**tp_plan("gated"), "down_proj": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(model, mesh, plan)
        # Each rank's mean covers its share of the sequence: their sum is the whole mean.
        results[dtype] = step(model, x[:, mine], target[:, mine], dtype, 1 / mesh.size())
    return results


def sequence_share(rank: int, ranks: int) -> slice:
    return slice(rank * SEQ // ranks, (rank + 1) * SEQ // ranks)


def fsdp_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, target = batch("fsdp")
    share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    results = {}
    for name, dtype, policy in (
        ("float32", torch.float32, MixedPrecisionPolicy()),
        ("bfloat16", torch.bfloat16, MixedPrecisionPolicy()),
        ("param_dtype=bfloat16", torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    ):
        model = fused_model("fsdp", dtype)
        for block in model:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[name] = step(model, x[share], target[share], dtype)
        results[name]["warnings"] = [str(w.message) for w in caught]
    return results


def refusals(mesh) -> dict[str, str]:
    """The error each plan that cannot be honoured raises."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    x = torch.randn(2, DIM)
    cases: dict[str, Callable[[], object]] = {}

    def rowwise_activation() -> object:
        module = fusedmlp.FusedLinear(DIM, OUT, activation="relu")
        return parallelize_module(module, mesh, RowwiseParallel())(x[:, : DIM // 2])

    def deep_mlp() -> object:
        module = fusedmlp.FusedMLP([DIM, HIDDEN, HIDDEN, OUT])
        return parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})(x)

    def partial_plan() -> object:
        module = fusedmlp.FusedMLP([DIM, HIDDEN, OUT])
        return parallelize_module(module, mesh, {"0": ColwiseParallel()})(x)

    def fsdp_on_a_child() -> object:
        module = fusedmlp.FusedMLP([DIM, HIDDEN, OUT])
        fully_shard(module[0], mesh=mesh)
        return module(x)

    def functional_row_split_before_activation() -> object:
        weight = distribute_tensor(torch.randn(OUT, DIM), mesh, [Shard(1)])
        x_columns = distribute_tensor(x, mesh, [Shard(1)])
        # Allowed without an activation; the rule cache must not carry that over to "gelu".
        assert fusedmlp.linear(x_columns, weight, None, "none").placements[0].is_partial()
        return fusedmlp.linear(x_columns, weight, None, "gelu")

    def functional_deep_sharded_chain() -> object:
        weights = [torch.randn(HIDDEN, DIM), torch.randn(HIDDEN, HIDDEN), torch.randn(OUT, HIDDEN)]
        weights = [distribute_tensor(w, mesh, [Shard(0)]) for w in weights]
        return fusedmlp.mlp(distribute_tensor(x, mesh, [Shard(0)]), weights)

    for case in (
        rowwise_activation,
        deep_mlp,
        partial_plan,
        fsdp_on_a_child,
        functional_row_split_before_activation,
        functional_deep_sharded_chain,
    ):
        try:
            case()
            cases[case.__name__] = "no error"
        except Exception as error:  # the test checks what each one says
            cases[case.__name__] = f"{type(error).__name__}: {error}"
    return cases


def functional_inputs() -> dict[str, Tensor]:
    """x, a three-layer chain, and inputs of the pointwise backward ops; seeded."""
    generator = torch.Generator().manual_seed(2)
    sizes = [DIM, HIDDEN, HIDDEN, OUT]
    inputs = {"x": torch.randn(BATCH, 3, DIM, generator=generator)}
    for index, (size_in, size_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        inputs[f"w{index}"] = torch.randn(size_out, size_in, generator=generator) / 4
        inputs[f"b{index}"] = torch.randn(size_out, generator=generator)
    for name in ("grad", "pre", "up"):
        inputs[name] = torch.randn(6, HIDDEN, generator=generator)
    return inputs


def functional_checks(mesh) -> dict:
    """Functional calls on DTensors placed by hand: each result's placement and value."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    t = functional_inputs()
    placed = {name: distribute_tensor(value, mesh, [Replicate()]) for name, value in t.items()}
    x = distribute_tensor(t["x"], mesh, [Shard(0)]).requires_grad_()
    weights = [placed[f"w{i}"].requires_grad_() for i in range(3)]
    # Rows split, weights replicated, three layers: the rows ("batch") strategy.
    y = fusedmlp.mlp(x, weights, [placed[f"b{i}"] for i in range(3)], "silu")
    y.sum().backward()
    results = {
        "mlp rows": (str(y.placements), _plain(y)),
        "mlp rows grad_x": (str(x.grad.placements), _plain(x.grad)),
        "mlp rows grad_w0": (str(weights[0].grad.placements), _plain(weights[0].grad)),
    }
    columns = {n: distribute_tensor(t[n], mesh, [Shard(1)]) for n in ("grad", "pre", "up")}
    out = torch.ops.fusedmlp.activation_backward(columns["grad"], columns["pre"], "gelu")
    results["activation_backward"] = (str(out.placements), _plain(out))
    outs = torch.ops.fusedmlp.gated_backward(columns["grad"], columns["pre"], columns["up"], "silu")
    results["gated_backward"] = (str(outs[0].placements), *(_plain(o) for o in outs))
    return results


def rank_main(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "tp": tp_checks(mesh),
        "sequence_parallel": sequence_parallel_checks(mesh, rank),
        "fsdp": fsdp_checks(rank, world_size),
        "refusals": refusals(mesh),
        "functional": functional_checks(mesh),
    }


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(rank_main, WORLD_SIZE, tmp_path_factory.mktemp("parallel"), TIMEOUT_S)


def assert_steps_match(got: dict, want: dict, dtype: torch.dtype, what: str) -> None:
    tolerance = tolerances(dtype)
    for key in ("y", "grad_x", "y_after"):
        if key in want:
            torch.testing.assert_close(got[key], want[key], **tolerance, msg=f"{what}: {key}")
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(
            got["grads"][name].float(), grad.float(), **tolerance, msg=f"{what}: grad {name}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", TP_KINDS)
def test_tensor_parallel_plans_match_nn_linear(
    rank_results: list[dict], kind: str, dtype: torch.dtype
) -> None:
    want = step(plain_model(kind, dtype), *batch(kind), dtype)
    for rank, results in enumerate(rank_results):
        assert_steps_match(results["tp"][kind, dtype], want, dtype, f"{kind} rank {rank}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_plan_inside_sequence_parallelism(rank_results: list[dict], dtype: torch.dtype):
    want = step(plain_model("gated", dtype), *batch("gated"), dtype)
    for rank, results in enumerate(rank_results):
        mine = sequence_share(rank, WORLD_SIZE)
        want_mine = {key: value[:, mine] for key, value in want.items() if key != "grads"}
        got = results["sequence_parallel"][dtype]
        assert_steps_match(got, {**want_mine, "grads": want["grads"]}, dtype, f"rank {rank}")


@pytest.mark.parametrize("name", ["float32", "bfloat16", "param_dtype=bfloat16"])
def test_fsdp2_matches_nn_linear(rank_results: list[dict], name: str) -> None:
    mixed = name == "param_dtype=bfloat16"
    dtype = torch.bfloat16 if "bfloat16" in name else torch.float32
    x, target = batch("fsdp")
    plain = plain_model("fsdp", torch.float32 if mixed else dtype)
    if mixed:  # FSDP computes with bfloat16 copies of the parameters, on a bfloat16 input
        plain.to(torch.bfloat16).register_forward_pre_hook(
            lambda _, args: tuple(a.to(torch.bfloat16) for a in args)
        )
        want = step(plain, x, target, torch.float32)
        del want["y_after"]  # the step updates the float32 parameters FSDP keeps
    else:
        want = step(plain, x, target, dtype)
    rows = BATCH // WORLD_SIZE
    for rank, results in enumerate(rank_results):
        got = results["fsdp"][name]
        mine = slice(rank * rows, (rank + 1) * rows)
        assert_steps_match(*on_rows(got, want, mine, WORLD_SIZE), dtype, f"{name} rank {rank}")
        assert not [w for w in got["warnings"] if VIEW_WARNING in w], got["warnings"]


def on_rows(got: dict, want: dict, rows: slice, shares: int) -> tuple[dict, dict]:
    """A data-parallel rank's step against the whole batch's: the rank's loss is the mean over
    its 1/shares of the rows, so its input gradient is `shares` times the whole batch's on
    those rows; FSDP averages the parameter gradients, which are the whole batch's."""
    want_rows = {key: value[rows] for key, value in want.items() if key != "grads"}
    return {**got, "grad_x": got["grad_x"] / shares}, {**want_rows, "grads": want["grads"]}


REFUSALS = {
    "rowwise_activation": ["FusedLinear", "RowwiseParallel", "'relu'"],
    "deep_mlp": ["FusedMLP with 3 Linear layers", '"0": ColwiseParallel()'],
    "partial_plan": ["FusedMLP", "not ['2']", "RowwiseParallel"],
    "fsdp_on_a_child": ["FusedMLP", "fully_shard", "'0'"],
    "functional_row_split_before_activation": ["fusedmlp.linear", "'gelu'", "input dim"],
    "functional_deep_sharded_chain": ["fusedmlp.mlp", "3 layers", "replicated"],
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_plans_that_cannot_be_honoured_raise_clearly(rank_results: list[dict], case: str):
    for results in rank_results:
        message = results["refusals"][case]
        for expected in REFUSALS[case]:
            assert expected in message, message


def test_functional_ops_on_placed_dtensors(rank_results: list[dict]) -> None:
    """The rows split keeps the output on the rows; pointwise backward ops keep any shard."""
    t = functional_inputs()
    x, w0 = t["x"].requires_grad_(), t["w0"].requires_grad_()
    y = x
    for index in range(3):
        y = F.linear(y, t[f"w{index}"], t[f"b{index}"])
        y = F.silu(y) if index < 2 else y
    y.sum().backward()
    activation_backward = torch.ops.fusedmlp.activation_backward(t["grad"], t["pre"], "gelu")
    gated_backward = torch.ops.fusedmlp.gated_backward(t["grad"], t["pre"], t["up"], "silu")
    for results in rank_results:
        got = results["functional"]
        assert got["mlp rows"][0] == "(Shard(dim=0),)"
        torch.testing.assert_close(got["mlp rows"][1], y.detach())
        assert got["mlp rows grad_x"][0] == "(Shard(dim=0),)"
        torch.testing.assert_close(got["mlp rows grad_x"][1], x.grad)
        # A replicated weight of a rows split gets each rank's share of its gradient.
        assert got["mlp rows grad_w0"][0] == "(Partial(sum),)"
        torch.testing.assert_close(got["mlp rows grad_w0"][1], w0.grad)
        assert got["activation_backward"][0] == "(Shard(dim=1),)"
        torch.testing.assert_close(got["activation_backward"][1], activation_backward)
        assert got["gated_backward"][0] == "(Shard(dim=1),)"
        torch.testing.assert_close(got["gated_backward"][1], gated_backward[0])
        torch.testing.assert_close(got["gated_backward"][2], gated_backward[1])


def rank_main_2d(rank: int, world_size: int) -> dict:
    """FSDP over "dp" and the gated plan over "tp", on a 2 x 2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    x, target = batch("gated")
    share = BATCH // mesh["dp"].size()
    rows = slice(mesh["dp"].get_local_rank() * share, (mesh["dp"].get_local_rank() + 1) * share)
    results: dict = {"rows": (rows.start, rows.stop)}
    for dtype in DTYPES:
        for name, build in (("fused", fused_model), ("plain", plain_model)):
            model = parallelize_module(build("gated", dtype), mesh["tp"], tp_plan("gated"))
            fully_shard(model, mesh=mesh["dp"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[name, dtype] = step(model, x[rows], target[rows], dtype)
            results[name, dtype]["warnings"] = [str(w.message) for w in caught]
    return results


@pytest.mark.skipif(
    os.environ.get("FUSEDMLP_DIST_2D") != "1",
    reason="4 processes: on demand only (FUSEDMLP_DIST_2D=1), too slow for 2-core CI",
)
def test_fsdp_times_tensor_parallel_2d_mesh(tmp_path: Path) -> None:
    ranks = run_ranks(rank_main_2d, 4, tmp_path, 2 * TIMEOUT_S)
    for dtype in DTYPES:
        want = step(plain_model("gated", dtype), *batch("gated"), dtype)
        for rank, seen in enumerate(ranks):
            got, want_rows = on_rows(seen["fused", dtype], want, slice(*seen["rows"]), 2)
            assert_steps_match(got, want_rows, dtype, f"rank {rank}")
            # RowwiseParallel's output (to_local of a DTensor) is a view for nn.Linear too:
            # FSDP2 warns no more often for the fused block than for the plain one.
            views = {
                name: [w for w in seen[name, dtype]["warnings"] if VIEW_WARNING in w]
                for name in ("fused", "plain")
            }
            assert len(views["fused"]) <= len(views["plain"]), views



_RULES_REGISTERED = """
import sys
from torch.distributed.tensor._api import DTensor
assert "fusedmlp.sharding" in sys.modules, "rules not registered"
strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
assert any(str(op).startswith("fusedmlp.") for op in strategies), "no fusedmlp op has a rule"
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import fusedmlp\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'loaded by fusedmlp'\n"
        "import torch.distributed.tensor",
        "import torch.distributed.tensor\nimport fusedmlp",
    ],
    ids=["fusedmlp_first", "dtensor_first"],
)
def test_sharding_rules_load_with_dtensor_not_with_fusedmlp(imports: str) -> None:
    """`import fusedmlp` leaves torch.distributed.tensor (1-2 s to import) unloaded; the
    rules are registered as soon as DTensor is loaded, in either order."""
    import subprocess
    import sys

    script = "import sys\n" + imports + _RULES_REGISTERED
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
