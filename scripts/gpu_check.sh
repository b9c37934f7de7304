#!/usr/bin/env bash
# The whole CUDA check on a GPU machine, unattended (DESIGN.md section 5): build for Hopper,
# run the tests (the CUDA ones run when a GPU is present), the profiling study and a short
# benchmark on cuda. Logs and JSON go to the results folder given as the argument.
# Each step is bounded so the whole run stays near five minutes; a failing step is recorded
# and the next one still runs. Usage: bash scripts/gpu_check.sh RESULTS_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
results="${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR}"
mkdir -p "$results"
status=0

step() {  # step NAME SECONDS COMMAND...
  local name="$1" seconds="$2"
  shift 2
  echo "== $name (limit ${seconds}s)"
  local start=$SECONDS
  timeout "$seconds" "$@" >"$results/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start))s; tail:"
  tail -n 15 "$results/$name.log" | sed 's/^/   | /'
  [[ $rc -eq 0 ]] || status=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$results/gpu.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" \
  >>"$results/gpu.txt" 2>&1
cat "$results/gpu.txt"
step build 150 env TORCH_CUDA_ARCH_LIST=9.0 FUSEDMLP_CUDA=1 \
  python -m pip install --no-build-isolation --no-deps -e .
step tests 150 python -m pytest -q -x -k "cuda or CUDA" tests/test_linear.py tests/test_mlp.py \
  tests/test_gated.py tests/test_convert.py
step profile 200 python -m fusedmlp.profile --device cuda --iters 20 --out "$results/profile"
step bench 120 python -m fusedmlp.bench --device cuda --out "$results/bench"
echo "== done, status $status; results in $results"
exit $status
