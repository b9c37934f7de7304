"""The profiling study, `python -m fusedmlp.profile`, run small on CPU through main()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from fusedmlp.profile import main
from fusedmlp.profile.cli import default_dtype, parse_settings
from fusedmlp.profile.measure import check_output, time_forwards
from fusedmlp.profile.reading import kernels_phrase, ops_phrase, time_phrase
from fusedmlp.registry import cpu_isas

ROOT = Path(__file__).resolve().parent.parent
SMALL_RUN = ["--device", "cpu", "--tokens", "8", "--iters", "2", "--warmup", "1"]
SMALL_RUN += ["--profile-steps", "2"]
EXPERIMENTS = ("linear", "mlp", "gated")


def trace_event_names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    return {event.get("name", "") for event in trace["traceEvents"]}


@pytest.fixture(scope="module")
def uncompiled_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile")
    assert main([*SMALL_RUN, "--no-compile", "--out", str(out)]) == 0
    return out


def test_writes_summary_chart_and_a_trace_per_variant(uncompiled_study: Path) -> None:
    expected = {"summary.json", "summary.md", "summary.png"}
    expected |= {f"{name}-{variant}.json" for name in EXPERIMENTS for variant in ("eager", "fused")}
    assert expected <= {path.name for path in uncompiled_study.iterdir()}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_writes_a_timeline_picture_per_experiment(uncompiled_study: Path, experiment: str) -> None:
    picture = (uncompiled_study / f"timeline-{experiment}.png").read_bytes()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n" and len(picture) > 10_000


def child_names(node: dict) -> list[str]:
    return [child["name"] for child in node["children"]]


def test_eager_linear_tree_is_linear_then_t_and_addmm(uncompiled_study: Path) -> None:
    summary = json.loads((uncompiled_study / "summary.json").read_text())
    variants = summary["experiments"]["linear"]["variants"]
    (linear,) = variants["eager"]["op_tree"]
    assert linear["name"] == "aten::linear" and linear["calls"] == 1
    assert linear["shapes"] == "(8, 32) (64, 32) (64)"
    assert child_names(linear)[:2] == ["aten::t", "aten::addmm"]
    addmm = linear["children"][1]
    assert 0 < addmm["self_ms"] <= addmm["total_ms"] <= linear["total_ms"]
    (fused,) = variants["fused"]["op_tree"]
    assert fused["name"] == "fusedmlp::linear" and child_names(fused) == ["fusedmlp.linear"]


def test_fused_gated_block_needs_less_memory_than_eager(uncompiled_study: Path) -> None:
    variants = json.loads((uncompiled_study / "summary.json").read_text())["experiments"]
    eager, fused = variants["gated"]["variants"]["eager"], variants["gated"]["variants"]["fused"]
    # eager holds act(gate), up and their product (8 x 3072 floats each) at once
    assert eager["inference_peak_bytes"] >= 3 * 8 * 3072 * 4
    assert 0 < fused["inference_peak_bytes"] < eager["inference_peak_bytes"]
    assert 0 < fused["saved_for_backward_bytes"] < eager["saved_for_backward_bytes"]
    # nn.Linear saves only its input and weight, which were there before the forward
    assert variants["linear"]["variants"]["eager"]["saved_for_backward_bytes"] == 0


@pytest.mark.parametrize(
    ("trace", "op"),
    [
        ("linear-eager.json", "aten::addmm"),
        ("linear-fused.json", "fusedmlp::linear"),
        ("mlp-fused.json", "fusedmlp::mlp"),
        ("gated-fused.json", "fusedmlp::gated_mlp"),
    ],
)
def test_traces_show_the_dispatched_op(uncompiled_study: Path, trace: str, op: str) -> None:
    assert op in trace_event_names(uncompiled_study / trace)


def test_summary_json_has_every_variant_matching_eager(uncompiled_study: Path) -> None:
    summary = json.loads((uncompiled_study / "summary.json").read_text())
    assert summary["environment"]["torch"] == torch.__version__
    assert list(summary["experiments"]) == list(EXPERIMENTS)
    for experiment in summary["experiments"].values():
        assert experiment["tokens"] == 8
        variants = experiment["variants"]
        assert list(variants) == ["eager", "fused"]
        assert all(variant["matches_eager"] for variant in variants.values())
        assert variants["fused"]["ops_per_forward"] == 1
        assert variants["eager"]["gpu_ms_per_forward"] is None
        assert experiment["timeline_file"].startswith("timeline-")
        for variant in variants.values():
            assert variant["op_tree"] and variant["inference_peak_bytes"] > 0
            assert variant["saved_for_backward_bytes"] >= 0
    skipped = summary["experiments"]["gated"]["skipped_variants"]
    assert "liger_kernel is not installed" in skipped["liger"] or "CUDA only" in skipped["liger"]


def test_summary_md_reads_each_step(uncompiled_study: Path) -> None:
    summary = (uncompiled_study / "summary.md").read_text()
    assert "| eager " in summary and "| fused " in summary
    assert "fused replaced 3 aten::linear and 2 aten::gelu with 1 fusedmlp::mlp" in summary
    assert "\n  aten::addmm " in summary and "fusedmlp.gated_mlp.gate_up" in summary
    assert "- liger: skipped: " in summary and "![timeline](timeline-gated.png)" in summary
    assert "| peak fwd MiB |" in summary
    # on the CPU the memory figures say what torch.profiler cannot see: the fused peaks are
    # starred, worded as what torch sees, and not ranked against eager's whole one
    assert "scripts/heap_peak.py counts them" in summary
    assert summary.count("\\* torch's allocations only") == len(EXPERIMENTS)
    fused_rows = [row for row in summary.splitlines() if row.startswith("| fused ")]
    assert len(fused_rows) == len(EXPERIMENTS)
    assert all(row.split("|")[10].strip().endswith("*") for row in fused_rows)
    assert "peak forward memory torch sees " in summary
    assert "peak forward memory fell" not in summary
    assert summary.count("lowest peak forward memory: eager itself") == len(EXPERIMENTS)
    assert "fused not ranked (torch does not see their kernels' scratch)" in summary
    experiments = json.loads((uncompiled_study / "summary.json").read_text())["experiments"]
    for experiment in experiments.values():
        whole = {name: v["inference_peak_is_whole"] for name, v in experiment["variants"].items()}
        assert whole == {"eager": True, "fused": False}


def test_compiled_variants_of_linear(tmp_path: Path) -> None:
    assert main([*SMALL_RUN, "--experiments", "linear", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    variants = summary["experiments"]["linear"]["variants"]
    assert list(variants) == ["eager", "compile", "fused", "fused+compile"]
    assert all(variant["matches_eager"] for variant in variants.values())
    assert "aten::addmm" in trace_event_names(tmp_path / "linear-compile.json")
    assert "fusedmlp::linear" in trace_event_names(tmp_path / "linear-fused-compile.json")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_study_reports_kernels_and_gpu_time(tmp_path: Path) -> None:
    argv = ["--device", "cuda", "--tokens", "8", "--iters", "2", "--warmup", "1"]
    argv += ["--profile-steps", "2", "--no-compile", "--out", str(tmp_path)]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"]["dtype"] == "bfloat16"
    for experiment in summary["experiments"].values():
        for variant in experiment["variants"].values():
            assert variant["matches_eager"]
            assert variant["kernels_per_forward"] > 0
            assert variant["gpu_ms_per_forward"] > 0
            assert sum(node["gpu_ms"] for node in variant["op_tree"]) > 0
    assert (tmp_path / "timeline-gated.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("argv", "named_in_error"),
    [
        (["--experiments", "linear,bogus"], "bogus"),
        (["--dtype", "float8"], "float8"),
        (["--tokens", "0"], "--tokens"),
        (["--device", "tpu"], "tpu"),
    ],
)
def test_bad_option_exits_with_a_message(
    argv: list[str], named_in_error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    assert named_in_error in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code != 0
    assert "no CUDA GPU" in capsys.readouterr().err


def test_reading_names_replaced_and_kept_ops() -> None:
    eager = Counter({"aten::linear": 3, "aten::gelu": 2})
    compiled = Counter({"aten::addmm": 3})
    assert ops_phrase("compile", eager, compiled) == (
        "compile replaced 3 aten::linear and 2 aten::gelu with 3 aten::addmm"
        " (ops per forward 5 → 3)"
    )
    assert (
        ops_phrase("fused", compiled, compiled) == "fused dispatches the same ops (3 aten::addmm)"
    )


def test_reading_groups_cuda_kernels_by_kind() -> None:
    gemm = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"
    eager = {
        gemm: 3.0,
        "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>": 1.0,
        "void at::native::vectorized_elementwise_kernel<4, MulFunctor>": 1.0,
    }
    compiled = {gemm: 3.0, "triton_poi_fused_gelu_mul_0": 1.0}
    assert kernels_phrase(eager, compiled) == (
        "2 pointwise kernels became 1 generated Triton kernel, the 3 GEMMs stayed"
        " (kernels per forward 5 → 4)"
    )


def test_default_dtype_is_bfloat16_where_the_kernels_multiply_it_natively(monkeypatch) -> None:
    """The study runs in bfloat16 on CUDA and on a CPU whose bfloat16 unit in use is a
    FMLP_BF16_NATIVE level (each supported ISA forced in turn), float32 on other CPUs and
    where bfloat16's GEMMs run in ATen; --dtype overrides it."""
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    for isa in (isa for isa in cpu_isas() if isa.supported):
        monkeypatch.setenv("FUSEDMLP_ISA", isa.name)
        expected = torch.bfloat16 if isa.bf16_native else torch.float32
        assert parse_settings(["--device", "cpu"]).dtype == expected, isa.name
        assert parse_settings(["--device", "cpu", "--dtype", "float32"]).dtype == torch.float32
        monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
        assert parse_settings(["--device", "cpu"]).dtype == torch.float32, isa.name
        monkeypatch.delenv("FUSEDMLP_CPU_GEMM")
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_check_allows_rounding_but_not_a_missing_bias(dtype: torch.dtype) -> None:
    exact = torch.randn(64, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = exact.to(dtype)
    rounded_differently = (exact * (1 + 1e-6)).to(dtype)
    without_bias = (exact - 0.5).to(dtype)
    assert check_output(rounded_differently, expected).matches_eager
    assert not check_output(without_bias, expected).matches_eager


def test_variants_take_turns_when_timed() -> None:
    # timed one after another, load drifting on a shared machine would bias the later ones
    calls: list[str] = []
    models = {name: (lambda x, name=name: calls.append(name)) for name in ("a", "b", "c")}
    walls = time_forwards(models, torch.ones(1), 4, torch.device("cpu"))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert set(walls) == {"a", "b", "c"}
    assert all(0 <= wall.min_ms <= wall.median_ms <= wall.max_ms for wall in walls.values())


def test_reading_words_time_changes() -> None:
    assert time_phrase("wall", 10.0, 10.2) == "wall stayed about the same (10.0 → 10.2 ms)"
    assert time_phrase("wall", 10.0, 7.7) == "wall fell 23% (10.0 → 7.70 ms)"
    assert time_phrase("wall", 0.5, 2.0) == "wall rose 4.0x (0.500 → 2.00 ms)"
    assert time_phrase("wall", 384.4, 7408.0) == "wall rose 19.3x (384 → 7408 ms)"


def test_library_imports_without_matplotlib_and_the_study_says_what_to_install() -> None:
    # A None entry in sys.modules makes `import matplotlib` fail as if it were not installed.
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import fusedmlp, torch\n"
        "fusedmlp.linear(torch.ones(1, 2), torch.ones(3, 2))\n"
        "from fusedmlp.profile import main\n"
        "main(['--device', 'cpu'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "matplotlib, which is not installed" in result.stderr
    assert "pip install 'fusedmlp[study]'" in result.stderr
