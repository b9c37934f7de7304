"""The op, autograd and output tests once more on the host-GEMM path (ATen's GEMMs, then our
epilogue passes): the default of every CPU without AVX2, aarch64 included, and of float64.

On a CPU with AVX2 the suite's float32 and bfloat16 calls never take that path, and it went
unwatched: it leaked every output it wrote, held more memory than eager in the gated block and
left its stages unlabelled. So these modules run again in a subprocess under
FUSEDMLP_CPU_GEMM=aten (about a minute). Where the default already is that path, the main run
covers it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fusedmlp
import pytest
from fusedmlp import _C

MODULES = [
    "test_linear.py",
    "test_mlp.py",
    "test_gated.py",
    "test_training_path.py",
    "test_outputs.py",
    "test_convert.py",
    "test_generic_backward.py",
    "test_properties.py",
]


@pytest.mark.skipif(_C.cpu_isa().startswith("aten+"), reason="the default path here already")
def test_op_tests_pass_on_the_host_gemm_path() -> None:
    tests = Path(__file__).resolve().parent
    # the fusedmlp this process imported, wherever it came from (an install, PYTHONPATH)
    package_root = str(Path(fusedmlp.__file__).resolve().parent.parent)
    search_path = os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "FUSEDMLP_CPU_GEMM": "aten", "PYTHONPATH": search_path}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES],
        cwd=tests, env=env, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
