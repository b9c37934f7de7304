"""`python -m fusedmlp.bench --quick` runs every case in every variant and writes its JSON and
PNG. Speed itself is never asserted here: the numbers are the benchmark's business. The sweep
runs compile-max (max-autotune compiles, slow even at tiny shapes) on one case only."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fusedmlp.bench import cli
from fusedmlp.bench.cases import CASES
from fusedmlp.bench.emulate import EMULATIONS, child_command, environment_matches
from fusedmlp.bench.peak import (
    SAMPLE_SECONDS,
    START_REPS,
    START_SECONDS,
    bf16_loop,
    peak_loop,
    peak_sampler,
)
from fusedmlp.registry import cpu_isas

ROOT = Path(__file__).resolve().parent.parent


def run_bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    command = [sys.executable, "-m", "fusedmlp.bench", "--quick", "--min-run-time", "0.01",
               "--out", str(out), *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    # torch.profiler (the memory columns) leaves kineto's trace points and GPU probe unprinted
    assert "USDT" not in result.stderr and "gpuGetDeviceCount" not in result.stderr
    # every case's compiled variants really compiled (the cases share forward code)
    assert "recompile_limit" not in result.stderr
    return result


def test_quick_sweep_writes_every_case(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--no-compile-max")
    document = json.loads((tmp_path / "bench.json").read_text())
    names = [case["name"] for case in document["cases"]]
    assert names == [case.name for case in CASES]
    for case in document["cases"]:
        assert set(case["median_s"]) == {"eager", "compile", "fused"}
        assert all(seconds > 0 for seconds in case["median_s"].values())
        assert case["ratio_vs_eager"] > 0 and case["ratio_vs_compile"] > 0
        assert set(case["memory"]) == {"eager", "compile", "fused"}
        for memory in case["memory"].values():
            assert memory["inference_peak_bytes"] > 0 and memory["saved_for_backward_bytes"] >= 0
        # on the CPU torch does not see our kernels' scratch: fused's peak is flagged partial
        whole = {variant: memory["peak_is_whole"] for variant, memory in case["memory"].items()}
        assert whole == {"eager": True, "compile": True, "fused": False}
    gated = next(case for case in document["cases"] if case["name"] == "gated_1024")
    fused, eager = gated["memory"]["fused"], gated["memory"]["eager"]
    assert fused["inference_peak_bytes"] < eager["inference_peak_bytes"]
    # a level, or aten+<level> where the GEMMs run in ATen (the default on CPUs without AVX2)
    level = document["machine"]["cpu_isa"].removeprefix("aten+")
    assert level in {isa.name for isa in cpu_isas() if isa.supported}
    assert document["machine"]["peak_kind"] in {"fp32 FMA", None}
    assert document["machine"]["rounds"] == 3
    for case, spec in zip(document["cases"], CASES):  # peak samples beside fused's timings
        sampled = spec.gemm_bound and document["machine"]["peak_kind"] is not None
        assert len(case["peak_samples_gflops"]) == (2 * 3 if sampled else 0)  # 3 rounds
        assert (case["peak_gflops"] is not None) == sampled
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak fwd MiB e/c/f" in result.stdout
    for case in CASES:  # the table names every case, and progress went to stderr
        assert case.name in result.stdout
        assert f"{case.name}: round" in result.stderr


def test_unsupported_dtype_is_refused_before_any_timing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    command = [sys.executable, "-m", "fusedmlp.bench", "--quick", "--dtype", "float16",
               "--cases", "small_batch", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "--dtype float16: the fused cpu kernels take float32, float64, bfloat16" in result.stderr
    assert "Traceback" not in result.stderr


def test_case_subset_without_compile(tmp_path: Path) -> None:
    run_bench(tmp_path, "--cases", "small_batch,train_step", "--no-compile")
    document = json.loads((tmp_path / "bench.json").read_text())
    assert [case["name"] for case in document["cases"]] == ["small_batch", "train_step"]
    assert all(set(case["median_s"]) == {"eager", "fused"} for case in document["cases"])


def test_compile_max_runs_inference_cases_only(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--cases", "single_token,train_small")  # one GEMM to tune
    document = json.loads((tmp_path / "bench.json").read_text())
    inference, train = document["cases"]
    assert set(inference["median_s"]) == {"eager", "compile", "compile-max", "fused"}
    assert inference["ratio_vs_compile_max"] > 0
    assert set(inference["memory"]["compile-max"]) == {"inference_peak_bytes"}
    assert inference["warmup_s"]["compile-max"] > 0
    assert set(train["median_s"]) == {"eager", "compile", "fused"}
    assert train["ratio_vs_compile_max"] is None
    assert "fused/compile-max" in result.stdout and "peak fwd MiB e/c/m/f" in result.stdout
    train_row = next(line for line in result.stdout.splitlines() if line.startswith("train_small"))
    assert "\u2014" in train_row
    assert "single_token: compile-max warm-up" in result.stderr


def test_bfloat16_gemm_cases_report_the_fraction_of_the_bf16_peak(tmp_path: Path) -> None:
    run_bench(tmp_path, "--dtype", "bfloat16", "--cases", "large_gemm", "--no-compile")
    document = json.loads((tmp_path / "bench.json").read_text())
    machine, (case,) = document["machine"], document["cases"]
    # AMX tiles or the dot product at the levels that multiply on them, else FMAs (none on
    # portable ISAs)
    loop = peak_loop(torch.bfloat16, machine["cpu_isa"])
    assert machine["peak_kind"] == (loop.kind if loop else None)
    if loop is not None:
        fraction = case["gflops"]["fused"] / case["peak_gflops"]
        assert case["fused_peak_fraction"] == pytest.approx(fraction)
        assert machine["start_peak_gflops"] > 0


def test_gemm_cases_sample_the_peak_beside_fused_and_take_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round samples the peak loop just before and after fused's timings, and the case's
    fraction is against the median of its samples; the timings and samples are stubbed, so
    nothing here is timed."""
    events: list[str] = []
    samples = iter([40.0, 10.0, 30.0, 20.0, 60.0, 50.0])

    def timed_runs(fn: object, min_run_time: float) -> list[float]:
        events.append("timed")
        return [0.001]

    def sample_peak(seconds: float) -> float:
        assert 0 < seconds <= SAMPLE_SECONDS
        events.append("peak")
        return next(samples)

    monkeypatch.setattr(cli, "timed_runs", timed_runs)
    args = cli.parse_args(["--quick", "--no-compile"])
    by_name = {case.name: case for case in CASES}
    result = cli.run_case(by_name["large_gemm"], args, 1, 2, sample_peak)
    assert events == ["timed", "peak", "timed", "peak"] * 3  # eager, then fused; 3 rounds
    assert result.peak_samples_gflops == [40.0, 10.0, 30.0, 20.0, 60.0, 50.0]
    assert result.peak_gflops == 35.0
    fused_gflops = result.flops / 0.001 / 1e9
    assert result.to_json()["fused_peak_fraction"] == pytest.approx(fused_gflops / 35.0)
    events.clear()
    small = cli.run_case(by_name["small_batch"], args, 2, 2, sample_peak)
    assert events == ["timed", "timed"] * 3 and small.peak_gflops is None


def test_rounds_split_each_variants_time_into_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds N: the variants take N turns, each timed for min-run-time / N; the medians are
    over every turn's blocks (stubbed timings, so nothing here is timed)."""
    turns: list[tuple[str, float]] = []
    times = {"eager": iter([3.0, 1.0, 2.0, 5.0, 4.0]), "fused": iter([1.0, 1.0, 9.0, 1.0, 1.0])}

    def timed_runs(fn: object, min_run_time: float) -> list[float]:
        variant = "eager" if not turns or turns[-1][0] == "fused" else "fused"
        turns.append((variant, min_run_time))
        return [next(times[variant])]

    monkeypatch.setattr(cli, "timed_runs", timed_runs)
    args = cli.parse_args(["--quick", "--no-compile", "--rounds", "5", "--min-run-time", "1"])
    small = next(case for case in CASES if case.name == "small_batch")
    result = cli.run_case(small, args, 1, 1, None)
    assert turns == [("eager", 0.2), ("fused", 0.2)] * 5
    assert result.median_s == {"eager": 3.0, "fused": 1.0}
    with pytest.raises(SystemExit):
        cli.parse_args(["--rounds", "0"])


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="SSE2 is x86-64's baseline"
)
def test_the_portable_float32_peak_is_sse2_multiply_then_add() -> None:
    """The portable level's float32 unit runs SSE2 vectors, which have no FMA: its peak is a
    multiply and an add a step, 4 lanes."""
    loop = peak_loop(torch.float32, "portable")
    assert loop is not None and loop.kind == "fp32 SSE2 mul+add"
    assert peak_loop(torch.float64, "portable") is None
    with peak_sampler(loop, threads=1) as sample:
        gflops = sample(START_SECONDS, START_REPS) if sample else None
    assert gflops is not None and gflops > 0


def test_bf16_peak_loops_are_the_registrys_bf16_native_levels() -> None:
    """A level whose bfloat16 unit multiplies bfloat16 in hardware (FMLP_BF16_NATIVE) has a
    loop of its own for the bfloat16 peak; every other level's bfloat16 peak is its FMAs'."""
    for isa in cpu_isas():
        own = bf16_loop(isa.name)
        assert (own is not None) == isa.bf16_native, isa.name
        assert peak_loop(torch.bfloat16, isa.name) == (own or peak_loop(torch.float32, isa.name))


def test_weight_cache_option_turns_it_on_and_says_so(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--weight-cache", "64", "--cases", "large_gemm", "--no-compile")
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["weight_cache_mib"] == 64
    assert "read their weights packed once (FUSEDMLP_WEIGHT_CACHE_MB=64)" in result.stdout
    result = run_bench(tmp_path, "--cases", "large_gemm", "--no-compile")
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["weight_cache_mib"] == 0
    assert "packed once" not in result.stdout


def test_emulated_cpu_environment_is_the_childs_and_only_the_childs() -> None:
    emulation = EMULATIONS["avx2"]
    assert not environment_matches(emulation, {"FUSEDMLP_ISA": "avx2"})
    if "avx2" not in {isa.name for isa in cpu_isas() if isa.supported}:
        with pytest.raises(SystemExit, match="--emulate-cpu avx2: this CPU lacks avx2"):
            child_command(emulation, [], {})
        return
    command, environment = child_command(emulation, ["--quick", "--emulate-cpu", "avx2"],
                                         {"PATH": "/bin", "FUSEDMLP_ISA": "avx512",
                                          "TORCHINDUCTOR_CACHE_DIR": "/cache"})
    assert command == [sys.executable, "-m", "fusedmlp.bench", "--quick", "--emulate-cpu", "avx2"]
    assert environment["PATH"] == "/bin" and environment["FUSEDMLP_ISA"] == "avx2"
    assert environment_matches(emulation, environment)
    # compiled code of its own: never kernels compiled for the CPU's full level
    assert environment["TORCHINDUCTOR_CACHE_DIR"] == os.path.join("/cache", "emulate-avx2")
    _, environment = child_command(emulation, [], {})
    assert environment["TORCHINDUCTOR_CACHE_DIR"].endswith("emulate-avx2")


def test_emulate_cpu_portable_runs_the_path_such_a_cpu_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an x86 CPU without AVX2: torch's ATen kernels at their DEFAULT level, and fused on the
    path the registry gives a level not measured to beat eager (ATen's GEMM with our portable
    epilogue, our kernels for inference calls of a few rows), whatever the parent's environment
    forced."""
    monkeypatch.setenv("FUSEDMLP_ISA", "avx2")
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
    result = run_bench(tmp_path, "--emulate-cpu", "portable", "--cases", "small_batch",
                       "--no-compile")
    machine = json.loads((tmp_path / "bench.json").read_text())["machine"]
    assert machine["emulated_cpu"] == "portable" and machine["cpu_isa"] == "aten+portable"
    assert machine["torch_cpu_capability"] == "DEFAULT"
    assert ("emulated portable CPU: fused and eager both limited (FUSEDMLP_ISA=portable, "
            "FUSEDMLP_CPU_GEMM=auto, MKL_ENABLE_INSTRUCTIONS=SSE4_2, ONEDNN_MAX_CPU_ISA=SSE41, "
            "ATEN_CPU_CAPABILITY=default)" in result.stdout)


@pytest.mark.skipif(not any(isa.name == "avx2" and isa.supported for isa in cpu_isas()),
                    reason="emulating an AVX2 CPU takes a CPU with AVX2")
def test_emulate_cpu_avx2_limits_fused_and_torch(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep reruns itself with fusedmlp, MKL, oneDNN and ATen limited to AVX2: the child's
    kernels, torch's CPU capability and MKL's code path (its verbose banner) say AVX2, and the
    peak is AVX2's FMA loop."""
    monkeypatch.setenv("MKL_VERBOSE", "1")
    monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")  # the child chooses as an AVX2 CPU would
    result = run_bench(tmp_path, "--emulate-cpu", "avx2", "--cases", "large_gemm", "--no-compile")
    machine = json.loads((tmp_path / "bench.json").read_text())["machine"]
    assert machine["emulated_cpu"] == "avx2" and machine["cpu_isa"] == "avx2"
    assert machine["torch_cpu_capability"] == "AVX2"
    loop = peak_loop(torch.float32, "avx2")
    assert loop is not None and loop.compile_flags == ("-mavx2", "-mfma")
    assert machine["peak_kind"] in (loop.kind, None)  # None: no C compiler
    assert ("emulated avx2 CPU: fused and eager both limited (FUSEDMLP_ISA=avx2, "
            "FUSEDMLP_CPU_GEMM=auto, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2, "
            "ATEN_CPU_CAPABILITY=avx2)" in result.stdout)
    if torch.backends.mkl.is_available():
        # On an Intel CPU the banner names MKL's instruction-set path; on others (AMD) MKL takes
        # its generic path, no wider than AVX2, and names none.
        banners = [line for line in result.stdout.splitlines() if "MKL_VERBOSE oneMKL" in line]
        assert banners and all("(Intel(R) AVX2) enabled processors" in b
                               for b in banners if "enabled processors" in b)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_gemm_flops_are_those_torch_counts_for_the_eager_call(case) -> None:
    """Each case's FLOPs (its GFLOP/s column) are what torch's FlopCounterMode counts for the
    eager module's call: the forward's GEMMs, and training, the backward's too (no dX for x,
    which needs no gradient)."""
    from fusedmlp.bench.cases import build_modules, gemm_flops, make_input
    from torch.utils.flop_counter import FlopCounterMode

    rows, sizes = case.shape(quick=True)
    eager, _ = build_modules(case, sizes, "cpu", torch.float32)
    x = make_input(rows, sizes, "cpu", torch.float32)
    with FlopCounterMode(display=False) as counter:
        if case.train:
            eager(x).sum().backward()
        else:
            with torch.no_grad():
                eager(x)
    assert gemm_flops(case, rows, sizes) == counter.get_total_flops()
