"""docs/kernels.md kept honest: every entry of the kernel registries is built, detected,
dispatched and tested, and every activation name works in every op and matches PyTorch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import fusedmlp
import pytest
import torch
from c_build import (
    CPU_DIR,
    NATIVE,
    REGISTRY,
    ROOT,
    kernel_unit_sources,
    registry_isas,
    registry_units,
)
from conftest import assert_matches_reference, reference_activation
from fusedmlp import _C
from fusedmlp.activations import OUTPUT_DERIVATIVE, activation_module, activation_name
from fusedmlp.registry import cpu_bf16_native, cpu_isas

ISA_NAMES = {isa_id: name for isa_id, name, _ in registry_isas()}


def test_the_extension_was_built_from_this_registry():
    """Names and flags in the registry's order: a stale build or a changed parser shows here."""
    built = [(isa.name, isa.compile_flags) for isa in cpu_isas()]
    assert built == [(name, flags) for _, name, flags in registry_isas()]
    assert registry_isas()[0] == ("PORTABLE", "portable", ())


def test_every_kernel_unit_has_its_file_and_nothing_else_does():
    sources = kernel_unit_sources()
    assert set(sources) == set(CPU_DIR.glob("kernels_*.c"))
    for dtype, isa_id, suffix in registry_units():
        assert suffix == f"{dtype.lower()}_{ISA_NAMES[isa_id]}"
    dtypes = {dtype for dtype, _, _ in registry_units()}
    assert {dtype for dtype, isa_id, _ in registry_units() if isa_id == "PORTABLE"} == dtypes


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_every_kernel_unit_is_linked_into_the_extension():
    symbols = subprocess.run(
        ["nm", "--defined-only", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    # another architecture's units are neither built nor linked
    here = {path.stem.removeprefix("kernels_") for path in NATIVE.units()}
    for _, _, suffix in registry_units():
        for entry in ("chain", "gated", "chain_backward", "gated_block_backward"):
            linked = re.search(rf"\bfmlp_cpu_{entry}_{suffix}\b", symbols) is not None
            assert linked == (suffix in here), (entry, suffix)


def cpuinfo_flags() -> set[str] | None:
    """The kernel's CPU flags, spelled without "_" or "-" (cpuinfo writes avx512_bf16 where
    GCC's __builtin_cpu_supports says avx512bf16); None off x86 Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return {re.sub("[_-]", "", flag) for flag in line.split(":", 1)[1].split()}
    return None


def test_detection_agrees_with_the_kernel():
    """An ISA is supported exactly when the OS reports all its features: CPUID detection
    (which the test matrix's skips follow) checked against an independent source."""
    flags = cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags")
    for isa in cpu_isas():
        needed = {re.sub("[_-]", "", feature) for feature in isa.cpu_features}
        assert isa.supported == (needed <= flags), isa


def cpuinfo_vendor() -> str | None:
    """The CPU's vendor as GCC's __builtin_cpu_is names it (intel, amd); None where
    /proc/cpuinfo names none (off x86 Linux) or another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    vendor = re.search(r"^vendor_id\s*:\s*(\w+)", text, re.MULTILINE)
    names = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
    return names.get(vendor.group(1)) if vendor else None


def test_forced_only_on_its_vendor_alone():
    """FMLP_FORCED_ONLY(ISA, vendor): detection skips the ISA on that vendor's CPUs (the
    avx512_bf16 unit is slower than avx512's on Intel, twice as fast on AMD Zen 4) and only
    there, as an independent reading of the vendor says."""
    marked = re.findall(r"^FMLP_FORCED_ONLY\((\w+), (\w+)\)$", REGISTRY.read_text(), re.MULTILINE)
    assert marked, "the registry marks no ISA forced-only: this test checks nothing"
    vendor = cpuinfo_vendor()
    for isa in cpu_isas():
        vendors = {marked_vendor for isa_id, marked_vendor in marked
                   if ISA_NAMES[isa_id] == isa.name}
        assert isa.forced_only == (vendor in vendors), (isa.name, vendor)


def test_bf16_native_as_the_registry_marks_it(monkeypatch):
    """FMLP_BF16_NATIVE(ISA): cpu_isas() says so for exactly the ISAs marked, and
    cpu_bf16_native() follows the bfloat16 level in use: forced to each supported ISA, and
    off where bfloat16's GEMMs run in ATen."""
    marked = set(re.findall(r"^FMLP_BF16_NATIVE\((\w+)\)$", REGISTRY.read_text(), re.MULTILINE))
    assert marked, "the registry marks no ISA bfloat16-native: this test checks nothing"
    assert {isa.name for isa in cpu_isas() if isa.bf16_native} == {ISA_NAMES[m] for m in marked}
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    for isa in (isa for isa in cpu_isas() if isa.supported):
        monkeypatch.setenv("FUSEDMLP_ISA", isa.name)
        assert cpu_bf16_native() == isa.bf16_native, isa.name
        monkeypatch.setenv("FUSEDMLP_CPU_GEMM", "aten")
        assert not cpu_bf16_native(), isa.name
        monkeypatch.delenv("FUSEDMLP_CPU_GEMM")


def test_every_isa_is_detected_and_forced_by_name(monkeypatch):
    isas = cpu_isas()
    monkeypatch.delenv("FUSEDMLP_ISA", raising=False)
    monkeypatch.delenv("FUSEDMLP_CPU_GEMM", raising=False)
    supported = [isa.name for isa in isas if isa.supported]
    detected = [isa.name for isa in isas if isa.supported and not isa.forced_only]
    assert supported[0] == detected[0] == "portable"  # any CPU has it
    # lowest first: the last supported one is the best, FMLP_FORCED_ONLY ones aside
    # (aten+<level> where its GEMMs run in ATen by default: test_cpu_gemm_path)
    assert _C.cpu_isa().removeprefix("aten+") == detected[-1]
    for isa in isas:
        monkeypatch.setenv("FUSEDMLP_ISA", isa.name)
        assert _C.cpu_isa() == (isa.name if isa.supported else detected[-1])
        assert isa.name in _C.cpu_isa.__doc__


@pytest.mark.parametrize("isa", [isa.name for isa in cpu_isas() if isa.supported])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_isa_dispatches(monkeypatch, isa, dtype, generator):
    """Forcing the ISA runs kernels that compute the right thing for each dtype (test_isa and
    the C tests sweep the shapes; this is the registry's roll call)."""
    monkeypatch.setenv("FUSEDMLP_ISA", isa)
    x = torch.randn(37, 29, generator=generator, dtype=dtype)
    w = torch.randn(21, 29, generator=generator, dtype=dtype) * 29**-0.5
    y = fusedmlp.linear(x, w, None, "silu")
    assert_matches_reference(y, torch.nn.functional.silu(x.double() @ w.double().t()))


CALLS_OPS = """
import sys, torch, fusedmlp
x, w = torch.randn(16, 32), torch.randn(48, 32)
for _ in range(int(sys.argv[1])):
    fusedmlp.linear(x, w, None, "gelu")
"""


def tile_data_requests(op_calls: int, tmp_path: Path) -> int:
    """Linux's AMX grant requests (arch_prctl ARCH_REQ_XCOMP_PERM) a process making op_calls
    CPU op calls sends, as strace sees them."""
    trace = tmp_path / f"trace{op_calls}"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSEDMLP_ISA", "FUSEDMLP_CPU_GEMM")}
    env["PYTHONPATH"] = str(ROOT / "python")
    result = subprocess.run(["strace", "-f", "-e", "trace=arch_prctl", "-o", str(trace),
                             sys.executable, "-c", CALLS_OPS, str(op_calls)],
                            capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0 and "ptrace" in result.stderr:
        pytest.skip(f"strace cannot trace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    return trace.read_text().count("ARCH_REQ_XCOMP_PERM")


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.skipif(not any(isa.supported and "amx-tile" in isa.cpu_features
                            for isa in cpu_isas()), reason="only AMX needs the OS's grant")
def test_the_tile_data_grant_is_requested_once_not_per_op_call(tmp_path):
    """Every op call checks which ISAs the CPU supports; the AMX grant is a system call, made
    once per process (csrc/cpu/read_once.h), as the cache sizes are read once."""
    assert tile_data_requests(50, tmp_path) == tile_data_requests(5, tmp_path)


def test_the_activation_table_is_the_registry():
    text = (ROOT / "csrc/include/fusedmlp/activations.def").read_text()
    rows = re.findall(r"^FMLP_ACTIVATION\(\w+, (\w+), \w+, (PRE|OUTPUT)\)", text, re.MULTILINE)
    names = [name for name, _ in rows]
    assert tuple(names) == fusedmlp.ACTIVATIONS
    assert {name for name, derivative in rows if derivative == "OUTPUT"} == OUTPUT_DERIVATIVE
    for name in names:  # the Python side knows each one's module, both ways (convert() needs it)
        module = activation_module(name)
        assert type(module) is type(reference_activation(name))
        assert activation_name(module) == (None if name == "none" else name)


@pytest.mark.parametrize("activation", fusedmlp.ACTIVATIONS)
def test_every_activation_works_in_every_op(activation, generator):
    """Each op, forward and backward, against PyTorch's own module in float64."""
    act = reference_activation(activation)
    x = torch.randn(9, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    w1, w2 = (torch.randn(12, 12, generator=generator, dtype=torch.float64) for _ in range(2))
    w3 = torch.randn(6, 12, generator=generator, dtype=torch.float64)
    b = torch.randn(12, generator=generator, dtype=torch.float64)
    weights = [w.requires_grad_() for w in (w1, w2, w3)]
    cases = [
        (
            lambda: fusedmlp.linear(x, weights[0], b, activation),
            lambda: act(x @ weights[0].t() + b),
        ),
        (
            lambda: fusedmlp.mlp(x, weights[:2], None, activation),
            lambda: act(x @ weights[0].t()) @ weights[1].t(),
        ),
        (
            lambda: fusedmlp.gated_mlp(x, weights[0], weights[1], weights[2], activation),
            lambda: (act(x @ weights[0].t()) * (x @ weights[1].t())) @ weights[2].t(),
        ),
    ]
    for fused, reference in cases:
        y, expected = fused(), reference()
        assert_matches_reference(y, expected.detach())
        inputs = [x, *weights]
        grads = torch.autograd.grad(y.sum(), inputs, allow_unused=True)
        expected_grads = torch.autograd.grad(expected.sum(), inputs, allow_unused=True)
        for got, want in zip(grads, expected_grads):
            assert (got is None) == (want is None)
            if got is not None:
                assert_matches_reference(got, want)
