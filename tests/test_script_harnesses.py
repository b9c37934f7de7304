"""The C timing harnesses under scripts/ compile against the kernels as they are. They include
the kernel units' internals (block sizes, micro-kernels, packing), which change without them: a
new argument to one internal routine once left two harnesses broken until someone ran them.
Compiled only (-fsyntax-only, so the CPU need not have the instruction set): running them is
timing, done on demand. scripts/heap_peak.py, a memory count, runs in its quick form, and
scripts/step_parts.py and scripts/step_fixed_cost.py one short round each, to show they still
run."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import pytest
from c_build import CPU_DIR, ISAS, ROOT, VECTOR_256_FLAGS

SCRIPTS = ROOT / "scripts"

# harness, the registry level whose flags it is compiled with (None: no ISA flags), and the
# defines its driver script passes
HARNESSES = [
    ("simd_ab.c", None, ("-DUNIT=f32_avx2",)),
    ("simd_ab.c", None, ("-DUNIT=f32_avx512",)),
    ("simd_ab.c", None, ("-DUNIT=bf16_avx512_bf16", "-DSTORAGE_BF16")),
    ("simd_efficiency.c", "avx2", ('-DFMLP_UNIT_SOURCE="kernels_f32_avx2.c"',)),
    ("simd_efficiency.c", "avx512", ('-DFMLP_UNIT_SOURCE="kernels_f32_avx512.c"',)),
    ("amx_bisect.c", "avx512_amx", ()),
    ("amx_gated.c", "avx512_amx", ()),
    ("vector_proxy.c", None, VECTOR_256_FLAGS["portable"]),
]

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gcc") is None,
    reason="the harnesses are x86-64 timing programs built with gcc",
)


@pytest.mark.parametrize(("harness", "isa", "defines"), HARNESSES,
                         ids=[f"{h}-{isa or d[0]}" for h, isa, d in HARNESSES])
def test_harness_compiles(harness: str, isa: str | None, defines: tuple[str, ...]) -> None:
    flags = ISAS[isa].compile_flags if isa is not None else ()
    command = ["gcc", "-std=c11", "-fsyntax-only", "-Werror=implicit-function-declaration",
               *flags, *defines, f"-I{ROOT / 'csrc' / 'include'}", f"-I{CPU_DIR}",
               f"-I{SCRIPTS}", str(SCRIPTS / harness)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"scripts/{harness} no longer compiles:\n{result.stderr}"


def test_heap_peak_counts_what_torch_allocates_and_more() -> None:
    """scripts/heap_peak.py --quick: its shim sees every heap allocation, so for eager (whose
    memory torch allocates) it counts at least what torch.profiler counts."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "heap_peak.py"), "--quick"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (block, dtype, variant)
        for dtype in ("float32", "bfloat16")
        for block in ("mlp", "gated")
        for variant in ("eager", "fused")
    ]
    for block, dtype, variant, heap, profiled in rows:
        assert float(heap) > 0, (block, dtype, variant)
        if variant == "eager":
            assert float(heap) >= 0.9 * float(profiled), (block, dtype, heap, profiled)


def test_step_parts_times_both_parts_of_a_training_case() -> None:
    """scripts/step_parts.py, one short round of train_small: it still runs against the bench's
    cases and timer, and prints a forward, a backward and a step line with positive times."""
    command = [sys.executable, str(SCRIPTS / "step_parts.py"), "train_small", "--rounds", "1",
               "--min-run-time", "0.02"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = {line.split(":")[0].strip(): line for line in result.stdout.splitlines()[1:]}
    assert sorted(lines) == ["backward", "forward", "step"], result.stdout
    for part in ("forward", "backward"):
        words = lines[part].split()
        times = [float(words[i - 1]) for i, word in enumerate(words) if word == "us"]
        assert len(times) == 2 and min(times) > 0, lines[part]
    assert float(lines["step"].split()[-1]) > 0


def test_step_parts_refuses_an_inference_case() -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "step_parts.py"), "study_linear"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "invalid choice: 'study_linear'" in result.stderr


def test_step_fixed_cost_times_eager_fused_and_the_floor() -> None:
    """scripts/step_fixed_cost.py, one round at width 16: it still builds its three models
    (eager, fused, the no-arithmetic floor) at both widths and prints a positive time for each."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "step_fixed_cost.py"), "16", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    times = {}
    for line in result.stdout.splitlines():
        name, _, value = line.strip().partition(":")
        words = name.split()
        if len(words) == 2 and words[0] in ("eager", "fused", "floor") and words[1].isdigit():
            times[name] = float(value)
    expected = {f"{model} {width}" for model in ("eager", "fused", "floor") for width in (8, 16)}
    assert set(times) == expected and min(times.values()) > 0, result.stdout
    assert "the floor (one Python autograd node, no arithmetic)" in result.stdout
