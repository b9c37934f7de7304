"""The compatibility matrix: which torch releases fusedmlp installs and runs under.

Builds one wheel with this interpreter's torch (or takes --wheel, built so earlier), then
for each torch requirement given (one fresh virtual environment each, created under --venvs
and kept for the next run) checks
  1. the one wheel: `pip install --no-deps` it, import fusedmlp and run a CPU op. Its CPU
     module uses LibTorch's stable ABI of torch 2.10, so it loads under every torch from
     2.10 on. Its CUDA module uses torch's C++ ABI as well: under a CUDA build of torch it
     loads only under the release it was built against, and elsewhere each CUDA call of an
     op is given an error saying why (not loaded under a CPU-only torch at all);
  2. the quick test subset (QUICK_TESTS: every op, autograd, torch.compile, the profiler,
     bad inputs) against that same wheel;
  3. `pip install .` from the checkout, build isolation on, as a new user types it: it must
     compile against that environment's torch, and the build must import and run a CPU op.
It prints the matrix as a Markdown table and writes it to --out, and exits non-zero when a
cell differs from what is expected.

    python scripts/compat_matrix.py --torch 2.13.0+cpu --torch 2.14.1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# One quick pass over every op (linear, mlp, gated_mlp, their training twins and
# backwards, through opcheck), autograd (gradcheck), torch.compile, the profiler's names,
# autocast and the argument checks.
QUICK_TESTS = [
    "tests/test_linear.py",
    "tests/test_mlp.py",
    "tests/test_gated.py",
    "-k",
    "opcheck or gradcheck or compile or profiler or autocast or bad_inputs",
]
TEST_TOOLS = ["pytest", "hypothesis", "expecttest"]

# Imports the installed fusedmlp, runs a CPU op and prints, last, what became of the CUDA
# kernels: "loaded", "refused: <the reason a CUDA call raises>" or "not loaded" (CPU torch).
WHEEL_PROBE = """
import torch, fusedmlp
from fusedmlp import _extension
x, w = torch.randn(2, 3), torch.randn(4, 3)
torch.testing.assert_close(fusedmlp.linear(x, w, None, "relu"), torch.relu(x @ w.T))
reason = _extension.cuda_unavailable_reason(_extension.build_record())
print("not loaded" if torch.version.cuda is None else
      "loaded" if reason is None else f"refused: {reason}")
"""


@dataclass
class Row:
    torch_requirement: str
    torch_version: str = "?"
    wheel: str = "not run"
    pip_install: str = "not run"
    tests: str = "not run"
    ok: bool = False


def run(command: list[str], log: Path, cwd: Path = ROOT) -> tuple[int, str, str]:
    """Runs command without PYTHONPATH (the venv's own fusedmlp must be the one imported),
    appending its output to log; (exit status, stdout, stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    with log.open("a") as f:
        f.write(f"$ {' '.join(command)}\n{output}\n[exit {done.returncode}]\n")
    return done.returncode, done.stdout, output


def build_wheel(out: Path, log: Path) -> Path:
    """The one wheel, built against this interpreter's torch."""
    code, _, output = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
         "."],
        log,
    )
    wheels = sorted(out.glob("fusedmlp-*.whl"))
    if code != 0 or not wheels:
        sys.exit(f"compat_matrix: building the wheel failed:\n{output[-3000:]}")
    return wheels[-1]


def fresh_venv(directory: Path, torch_requirement: str, log: Path) -> Path:
    """A virtual environment holding torch_requirement and the test tools (made once)."""
    python = directory / "bin" / "python"
    if not python.exists():
        venv.create(directory, with_pip=True)
    code, _, output = run(
        [str(python), "-m", "pip", "install", "-q", f"torch=={torch_requirement}", *TEST_TOOLS],
        log,
    )
    if code != 0:
        raise RuntimeError(f"installing torch=={torch_requirement} failed: {output[-500:]}")
    return python


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def check(torch_requirement: str, wheel: Path, built_for: str, venvs: Path, log: Path) -> Row:
    row = Row(torch_requirement)
    name = re.sub(r"[^A-Za-z0-9.]+", "_", torch_requirement)
    try:
        python = fresh_venv(venvs / f"torch-{name}", torch_requirement, log)
    except RuntimeError as error:
        row.wheel = row.pip_install = row.tests = str(error)
        return row
    _, version, _ = run([str(python), "-c", "import torch; print(torch.__version__)"], log)
    row.torch_version = version.strip()
    pip = [str(python), "-m", "pip"]

    run([*pip, "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], log)
    code, stdout, output = run([str(python), "-c", WHEEL_PROBE], log)
    if code != 0:
        row.wheel = f"import failed: {last_line(output)}"
        wheel_ok = False
    else:
        cuda = last_line(stdout)
        same_release = row.torch_version.split("+")[0] == built_for.split("+")[0]
        has_cuda = "+cpu" not in row.torch_version
        expected = ("loaded" if same_release else "refused") if has_cuda else "not loaded"
        wheel_ok = cuda.startswith(expected)
        row.wheel = f"loads, CPU op runs; CUDA kernels: {cuda}"

    tests_ok = False
    if wheel_ok:
        code, _, output = run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUICK_TESTS], log
        )
        tests_ok = code == 0
        row.tests = last_line(output)

    code, _, output = run([*pip, "install", "-q", "--force-reinstall", "--no-deps", "."], log)
    if code == 0:
        code, _, output = run([str(python), "-c", WHEEL_PROBE], log)
    install_ok = code == 0
    row.pip_install = (
        "builds, installs, CPU op runs" if install_ok else f"failed: {last_line(output)}"
    )
    row.ok = wheel_ok and tests_ok and install_ok
    return row


def table(rows: list[Row], built_for: str) -> str:
    lines = [
        f"| torch | the one wheel (built against {built_for}) | quick tests of that wheel | "
        "`pip install .` | as expected |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.torch_version} | {r.wheel} | {r.tests} | {r.pip_install} | "
            f"{'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="append", required=True, dest="torches",
                        help="a torch version to test, e.g. 2.13.0+cpu (repeat)")
    parser.add_argument("--venvs", type=Path,
                        default=Path(tempfile.gettempdir()) / "fusedmlp-venvs",
                        help="where the per-torch virtual environments are kept")
    parser.add_argument("--out", type=Path, default=Path("compat-matrix.md"))
    parser.add_argument("--wheel", type=Path,
                        help="a wheel built earlier with this environment's torch, instead "
                        "of building one")
    args = parser.parse_args()
    args.venvs.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    log.write_text("")
    with tempfile.TemporaryDirectory() as wheel_dir:
        wheel = args.wheel or build_wheel(Path(wheel_dir), log)
        rows = [check(t, wheel, torch.__version__, args.venvs, log) for t in args.torches]
    text = table(rows, torch.__version__)
    args.out.write_text(text)
    print(text + f"(log: {log})")
    sys.exit(0 if all(r.ok for r in rows) else 1)


if __name__ == "__main__":
    main()
