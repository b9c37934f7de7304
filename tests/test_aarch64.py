"""The C kernel tests and the fuzzer cross-compiled for aarch64 (Debian's
gcc-aarch64-linux-gnu) and run under qemu-user, so the NEON and portable levels are checked on
an x86 machine. The kernel tests run once, for float (double runs scalar portable C, which the
native tests check and the fuzzer covers here), at the level the program picks from the (emulated)
CPU's HWCAP bits exactly as on a real ARM CPU (NEON); the fuzzer runs once per ARM level,
forced with FUSEDMLP_ISA (portable float32 is NEON's code with a 16-register tile). Speed
cannot be measured under emulation; these check correctness only, under UBSan (qemu-user
cannot host AddressSanitizer). About 3 minutes on 2 busy cores, half of it compiling.

Without the tools the tests skip and say so, except in CI (CI=true), where
scripts/setup.sh installs them and they must run."""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from c_build import AARCH64, ROOT, build_c_test, registry_architectures, require_aarch64_tools

# The levels an aarch64 CPU has, lowest first; the last is the one it picks by itself.
ARM_ISAS = [name for name, arch in registry_architectures().items() if arch in (None, "aarch64")]
# The fuzzer's time, split over the ARM levels: 60 s at most in all (emulated, ~10-30x slower).
FUZZ_SECONDS = min(60.0, float(os.environ.get("FUSEDMLP_FUZZ_SECONDS", "20")))
SEED = int(os.environ.get("FUSEDMLP_FUZZ_SEED", "6"))


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_aarch64_tools()
    out = tmp_path_factory.mktemp("aarch64")
    programs = {"test_kernels": (), "fuzz_kernels": ("-pthread",)}
    for name in programs:
        (out / name).mkdir()
    with ThreadPoolExecutor(len(programs)) as pool:  # the cross builds take most of the time
        builds = [
            pool.submit(
                build_c_test,
                ROOT / "tests" / "c" / f"{name}.c",
                out / name / name,
                link_flags,
                AARCH64,
            )
            for name, link_flags in programs.items()
        ]
        for build in builds:
            build.result()
    return {name: out / name / name for name in programs}


def run_arm(binary: Path, *args: str, isa: str | None, timeout: float) -> str:
    env = {key: value for key, value in os.environ.items() if key != "FUSEDMLP_ISA"}
    if isa is not None:
        env["FUSEDMLP_ISA"] = isa
    result = subprocess.run(
        [*AARCH64.runner, str(binary), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    assert "runtime error" not in result.stderr, report[-6000:]  # UBSan findings
    return result.stdout


def test_aarch64_c_kernels_at_the_level_arm_picks(binaries):
    assert ARM_ISAS[-1] == "neon"
    stdout = run_arm(binaries["test_kernels"], "f32", isa=None, timeout=600)
    assert stdout.splitlines()[0] == "isa neon"
    assert stdout.strip().endswith("0 failed")


@pytest.mark.parametrize("isa", ARM_ISAS)
def test_aarch64_fuzz(binaries, isa):
    seconds = FUZZ_SECONDS / len(ARM_ISAS)
    stdout = run_arm(
        binaries["fuzz_kernels"], str(seconds), str(SEED), isa=isa, timeout=seconds + 120
    )
    summary = re.search(r"(\d+) iterations .* (\d+) checks, (\d+) failed", stdout)
    assert summary is not None, stdout[-6000:]
    iterations, checks, failed = (int(group) for group in summary.groups())
    assert failed == 0
    assert iterations > 10 and checks > 1000  # it really ran
