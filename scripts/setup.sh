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
python -m pip install --no-build-isolation -e ".[${extras}]"
