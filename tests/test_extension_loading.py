"""How the extensions load: the CPU module has no CUDA dependency, a torch other than the
one fusedmlp was built against is refused at import with the fix, and missing CUDA kernels
make CUDA calls fail saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import fusedmlp._C
import pytest
import torch
from fusedmlp import _extension

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_backend"))
import installed_torch_backend  # noqa: E402


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_cpu_module_links_no_cuda_library() -> None:
    dynamic = subprocess.run(
        ["readelf", "-d", fusedmlp._C.__file__], capture_output=True, text=True, check=True
    ).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not [line for line in needed if "cuda" in line or "cublas" in line]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_cpu_module_is_abi3_and_needs_no_python_binding_library() -> None:
    """Built against CPython's limited API: one file for every CPython from 3.10 on, linked
    to no libtorch_python or libpython of one CPython version."""
    assert fusedmlp._C.__file__.endswith(".abi3.so")
    dynamic = subprocess.run(
        ["readelf", "-d", fusedmlp._C.__file__], capture_output=True, text=True, check=True
    ).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not [line for line in needed if "python" in line]


def test_build_record_names_this_torch() -> None:
    record = _extension.build_record()
    assert _extension.release(record["torch"]) == _extension.release(torch.__version__)
    assert record["cuda_module"] == (record["no_cuda_reason"] is None)


def test_cpu_module_loads_under_another_torch_release() -> None:
    # _C uses the stable ABI only: the release it was built against does not matter.
    _extension.load_cpu_module({"torch": "2.10.0+cu128", "source": str(ROOT)})


def test_a_cpu_module_that_cannot_load_names_both_torches_and_the_fix() -> None:
    message = _extension.mismatch_message(
        {"torch": "1.13.1+cu117", "source": str(ROOT)}, "loading it failed: undefined symbol"
    )
    assert "built against torch 1.13.1+cu117" in message
    assert f"torch {torch.__version__} is installed" in message
    assert f"pip install --no-build-isolation --force-reinstall --no-deps {ROOT}" in message


@pytest.mark.skipif(torch.version.cuda is None, reason="torch without CUDA never loads _C_cuda")
def test_cuda_module_of_another_torch_release_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = type("Spec", (), {"origin": "/nonexistent/_C_cuda.abi3.so"})()
    monkeypatch.setattr(_extension.importlib.util, "find_spec", lambda name: spec)
    reason = _extension.cuda_unavailable_reason({"torch": "2.10.0+cu128"})
    assert reason == (
        "its CUDA module was built against torch 2.10.0+cu128 and uses torch's C++ ABI, which "
        f"changes between releases; torch {torch.__version__} is installed"
    )


def test_rebuild_command_without_the_source_says_where_it_goes() -> None:
    assert _extension.rebuild_command({"source": "/nonexistent"}).endswith(
        "<fusedmlp source directory>"
    )


@pytest.mark.skipif(torch.version.cuda is None, reason="torch without CUDA never loads _C_cuda")
def test_missing_cuda_module_is_reported_with_the_builds_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_extension.importlib.util, "find_spec", lambda name: None)
    reason = _extension.cuda_unavailable_reason({"no_cuda_reason": "it was built with X"})
    assert reason == "this fusedmlp was built without its CUDA kernels: it was built with X"


@pytest.mark.skipif(torch.version.cuda is None, reason="torch without CUDA never loads _C_cuda")
def test_ops_without_cuda_kernels_get_a_refusing_one() -> None:
    # In a fresh process whose fusedmlp finds no CUDA module (a CPU-only build).
    script = (
        "import importlib.util, torch\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n: None if n == 'fusedmlp._C_cuda' else find(n)\n"
        "import fusedmlp\n"
        "for name in fusedmlp._extension.CUDA_OPS:\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key(f'fusedmlp::{name}', 'CUDA')\n"
        "assert not torch._C._dispatch_has_kernel_for_dispatch_key("
        "'fusedmlp::chain_backward', 'CUDA')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert done.returncode == 0, done.stderr


def test_build_backend_finds_the_installed_torch() -> None:
    # This interpreter has torch: a build compiles against it, requiring no other.
    assert installed_torch_backend.torch_requirement() == []
    dirs = installed_torch_backend.installed_torch_site_dirs()
    assert str(Path(torch.__file__).parent.parent) in dirs


def test_build_backend_requires_torch_only_where_none_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "site-packages"
    empty.mkdir()
    monkeypatch.setattr(installed_torch_backend.sysconfig, "get_path", lambda name: str(empty))
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    assert installed_torch_backend.torch_requirement() == ["torch>=2.10"]
    # `python -m build` runs in its own environment: the activated one's torch is found.
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    venv_torch = tmp_path / "venv" / "lib" / version / "site-packages" / "torch"
    venv_torch.mkdir(parents=True)
    (venv_torch / "__init__.py").write_text("")
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / "venv"))
    assert installed_torch_backend.installed_torch_site_dirs() == [str(venv_torch.parent)]
    assert installed_torch_backend.torch_requirement() == []
