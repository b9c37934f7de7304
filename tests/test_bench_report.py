"""The bench's table and its peak loops, without timing anything: results made up here, the
kernel registry and the CPU feature mocked; the loops themselves run once or twice each, short."""

from __future__ import annotations

import shutil

import pytest
import torch
from fusedmlp.bench import peak
from fusedmlp.bench.report import CaseResult, format_table
from fusedmlp.registry import CpuIsa, cpu_isas

AVX512_FLAGS = ("-mavx512f", "-mfma")


def result(name: str, train: bool, seconds: dict[str, float], peak_gflops: float | None = 10.0,
           gemm_bound: bool = True) -> CaseResult:
    memory = {v: {"inference_peak_bytes": 2 << 20, "saved_for_backward_bytes": 1 << 20}
              for v in seconds if v != "compile-max"}
    if "compile-max" in seconds:
        memory["compile-max"] = {"inference_peak_bytes": 3 << 20}
    return CaseResult(name, name, 4, [8, 8], 2_000_000_000, gemm_bound=gemm_bound, train=train,
                      median_s=seconds, memory=memory, peak_gflops=peak_gflops)


def rows(table: str) -> dict[str, list[str]]:
    lines = table.splitlines()
    return {line.split()[0]: line.split() for line in [lines[0]] + lines[2:]}


def test_compile_max_column_and_its_ratio_with_a_dash_for_training_cases() -> None:
    inference = result("infer", False, {"eager": 1.0, "compile": 0.8, "compile-max": 0.4,
                                         "fused": 0.5})
    train = result("train", True, {"eager": 1.0, "compile": 0.5, "fused": 0.25})
    table = rows(format_table([inference, train]))
    assert table["case"] == ["case", "eager", "ms", "compile", "ms", "compile-max", "ms", "fused",
                             "ms", "fused/eager", "fused/compile", "fused/compile-max", "fused",
                             "GFLOP/s", "peak", "GFLOP/s", "%", "peak", "peak", "fwd", "MiB",
                             "e/c/m/f", "saved", "bwd", "MiB", "e/c/f"]
    assert table["infer"][1:8] == ["1000.000", "800.000", "400.000", "500.000", "0.50x",
                                   "0.62x", "1.25x"]
    assert table["infer"][8:] == ["4.0", "10.0", "40%", "2.00/2.00/3.00/2.00", "1.00/1.00/1.00"]
    assert table["train"][1:8] == ["1000.000", "500.000", "\u2014", "250.000", "0.25x", "0.50x",
                                   "\u2014"]
    assert table["train"][11] == "2.00/2.00/\u2014/2.00"


def test_a_peak_torch_sees_only_in_part_is_starred() -> None:
    case = result("infer", False, {"eager": 1.0, "fused": 0.5})
    case.memory["fused"]["peak_is_whole"] = False  # the CPU kernels' own scratch unseen
    assert rows(format_table([case]))["infer"][-2:] == ["2.00/2.00*", "1.00/1.00"]


def test_without_compile_max_its_columns_are_gone() -> None:
    table = format_table([result("infer", False, {"eager": 1.0, "fused": 0.5})])
    assert "compile" not in table and "e/f" in table
    assert rows(table)["infer"][1:4] == ["1000.000", "500.000", "0.50x"]


def test_each_case_is_a_fraction_of_its_own_peak_sample() -> None:
    """The peak sampled beside a case's timings (CaseResult.peak_gflops), not one for the run:
    the same speed reads 40% of a peak of 10 GFLOP/s and 80% of one of 5; cases that are not
    GEMM-bound, or whose samples failed, show none."""
    seconds = {"eager": 1.0, "fused": 0.5}  # fused: 4 GFLOP/s
    cases = [result("quiet", False, seconds), result("loaded", False, seconds, peak_gflops=5.0),
             result("failed", False, seconds, peak_gflops=None),
             result("small", False, seconds, gemm_bound=False)]
    table = rows(format_table(cases))
    assert table["quiet"][4:7] == ["4.0", "10.0", "40%"]
    assert table["loaded"][4:7] == ["4.0", "5.0", "80%"]
    assert table["failed"][4:7] == ["4.0", "-", "-"]
    assert table["small"][4:7] == ["4.0", "-", "-"]
    assert [c.to_json()["fused_peak_fraction"] for c in cases] == [0.4, 0.8, None, None]


def registry(*extra: CpuIsa) -> tuple[CpuIsa, ...]:
    return (CpuIsa("portable", (), (), True), CpuIsa("avx512", AVX512_FLAGS, ("avx512f",), True),
            *extra)


def test_fp32_peak_uses_the_flags_of_the_isa_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "cpu_isas", registry)
    assert peak.peak_loop(torch.float32, "avx512") == peak.PeakLoop("fp32 FMA", AVX512_FLAGS)
    assert peak.peak_loop(torch.float64, "avx512") is None


def test_host_gemm_peak_is_the_cpus_best_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GEMMs run in ATen ("aten+<level>", the level FUSEDMLP_ISA forced, if any),
    the peak is that of the CPU's best level, a forced-only one aside: ATen's GEMM runs
    there whatever our kernels were forced to."""
    forced_only = CpuIsa("avx512_bf16", (*AVX512_FLAGS, "-mavx512bf16"), ("avx512bf16",), True,
                         True)
    monkeypatch.setattr(peak, "cpu_isas", lambda: registry(forced_only))
    fma = peak.PeakLoop("fp32 FMA", AVX512_FLAGS)
    for level in ("portable", "avx512"):
        assert peak.peak_loop(torch.float32, f"aten+{level}") == fma
        assert peak.peak_loop(torch.bfloat16, f"aten+{level}") == fma
    assert peak.peak_loop(torch.float64, "aten+avx512") is None
    unsupported = CpuIsa("avx512", AVX512_FLAGS, ("avx512f",), False)
    monkeypatch.setattr(peak, "cpu_isas", lambda: (CpuIsa("portable", (), (), True), unsupported))
    monkeypatch.setattr(peak.platform, "machine", lambda: "x86_64")
    assert peak.peak_loop(torch.float32, "aten+portable") == peak.SSE2_LOOP


def test_the_portable_peak_is_sse2_on_x86_64_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable float32 and bfloat16 units are SSE2 vectors on x86-64 (no FMA), plain
    code elsewhere; float64's is scalar."""
    monkeypatch.setattr(peak, "cpu_isas", registry)
    monkeypatch.setattr(peak.platform, "machine", lambda: "x86_64")
    for dtype in (torch.float32, torch.bfloat16):
        assert peak.peak_loop(dtype, "portable") == peak.SSE2_LOOP
    assert peak.peak_loop(torch.float64, "portable") is None
    monkeypatch.setattr(peak.platform, "machine", lambda: "aarch64")
    assert peak.peak_loop(torch.float32, "portable") is None


def test_bf16_peak_is_what_the_level_in_use_multiplies_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags = (*AVX512_FLAGS, "-mavx512bf16", "-mextra")
    entry = CpuIsa("avx512_bf16", flags, ("avx512f", "avx512bf16"), True, True)
    amx_flags = (*flags, "-mamx-tile")
    amx = CpuIsa("avx512_amx", amx_flags, ("avx512f", "amx-tile"), True)
    monkeypatch.setattr(peak, "cpu_isas", lambda: registry(entry, amx))
    loop = peak.peak_loop(torch.bfloat16, "avx512_bf16")
    assert loop == peak.PeakLoop("bf16 dot product", flags, ("-DPEAK_BF16",))
    assert peak.peak_loop(torch.bfloat16, "avx512_amx") == peak.PeakLoop(
        "bf16 AMX tiles", amx_flags, ("-DPEAK_AMX",)
    )
    assert peak.peak_loop(torch.float32, "avx512_amx") == peak.PeakLoop("fp32 FMA", amx_flags)
    # below it the bfloat16 units multiply on FMAs
    assert peak.peak_loop(torch.bfloat16, "avx512") == peak.PeakLoop("fp32 FMA", AVX512_FLAGS)


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", [isa.name for isa in cpu_isas() if isa.supported])
def test_peak_loops_build_and_run_on_this_cpu(dtype: torch.dtype, isa: str) -> None:
    loop = peak.peak_loop(dtype, isa)
    if loop is None:
        pytest.skip(f"no {dtype} peak loop for ISA {isa}")
    with peak.peak_sampler(loop, threads=1) as sample:
        assert sample is not None
        gflops = sample(peak.START_SECONDS, peak.START_REPS)  # the start-of-run peak
        assert gflops is not None and gflops > 1.0
        gflops = sample(0.001)  # one short window, as beside a case (a loaded one reads low)
        assert gflops is not None and gflops > 0


def test_no_loop_no_sampler() -> None:
    with peak.peak_sampler(None, threads=1) as sample:
        assert sample is None
