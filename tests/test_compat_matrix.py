"""The compatibility matrix (scripts/compat_matrix.py), on demand only: it builds a wheel and
installs torch into a fresh virtual environment per release, minutes and gigabytes each.

    FUSEDMLP_COMPAT_MATRIX="2.13.0+cpu 2.14.1" python -m pytest -q tests/test_compat_matrix.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHES = os.environ.get("FUSEDMLP_COMPAT_MATRIX", "").split()
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(
    not TORCHES, reason='on demand: FUSEDMLP_COMPAT_MATRIX="<torch version> ..." (slow)'
)
def test_one_wheel_and_pip_install_under_each_torch(tmp_path: Path) -> None:
    venvs = Path(os.environ.get("FUSEDMLP_COMPAT_VENVS", tmp_path / "venvs"))
    command = [sys.executable, str(ROOT / "scripts" / "compat_matrix.py"), "--venvs", str(venvs),
               "--out", str(tmp_path / "matrix.md")]
    for version in TORCHES:
        command += ["--torch", version]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
