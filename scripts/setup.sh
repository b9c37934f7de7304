#!/usr/bin/env bash
# Installs fusedmlp with the "study" extra (matplotlib, for the study's and the bench's charts)
# and, with the argument "test", its test tools into the current Python environment, building
# the C/C++/CUDA extension against the installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The build imports torch, so torch comes first; an existing torch is kept.
python -c "import torch" 2>/dev/null || python -m pip install "torch==2.14.1"
# Without build isolation the build uses these from the environment (editable needs >= 64).
python -m pip install "setuptools>=64" wheel
extras="study"
[[ "${1:-}" == "test" ]] && extras="study,test"
# The aarch64 C tests (tests/test_aarch64.py) cross-compile the kernels with Debian's
# gcc-aarch64-linux-gnu and run them under qemu-user: attempted where apt-get is, never
# fatal, so a machine without it still installs and runs the rest (those tests then skip,
# except in CI, where they must run).
if [[ "${1:-}" == "test" ]] && command -v apt-get >/dev/null; then
  as_root=""
  [[ "$(id -u)" != 0 ]] && as_root="sudo"
  { $as_root apt-get update -qq &&
    $as_root apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; } ||
    echo "fusedmlp: could not install the aarch64 cross tools; tests/test_aarch64.py skips" >&2
fi
python -m pip install --no-build-isolation -e ".[${extras}]"
