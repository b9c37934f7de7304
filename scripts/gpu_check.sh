#!/usr/bin/env bash
# The whole CUDA check on a GPU machine, unattended, in one run bounded well inside ten
# minutes (DESIGN.md section 5). Every step runs in its own process with its own time
# limit, all of them inside one overall budget; a failing step is recorded and the next
# one still runs. Logs and JSON go to the results folder. Steps, most valuable first:
#   build    TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e .
#            (if pip itself fails: setup.py build_ext --inplace and PYTHONPATH)
#   values-* edge smoke test per dtype: every activation x bias (none, plain, odd offset) on
#            (1,16,24) (15,1,3) (26,5,1) (7,17,0) (8192,4096,4096), NaN rows, gated blocks
#            with unaligned batch strides; vs float64 F.linear + activation, every mismatch
#   test-*   the CUDA tests, file by file, CUDA_LAUNCH_BLOCKING=1, no -x
#   grads    gradients of linear, mlp and gated_mlp vs eager autograd, float32 and bfloat16
#   kernels  device kernels per op call (torch.profiler): which epilogues really fused
#   ratios   bfloat16 Linear 8192 x 4096 -> 4096 per activation vs F.linear + activation
#   bench    fusedmlp.bench --dtype bfloat16 on the study's cases, without compile
#   study    fusedmlp.profile on the device, if time is left
#
# Usage: bash scripts/gpu_check.sh RESULTS_DIR [--device cpu] [--quick] [--no-install]
#                                              [--budget SECONDS]
#   PYTHON     interpreter (default python3). To rehearse without a GPU, give it a venv that
#              sees the installed torch (python -m venv --system-site-packages DIR), never
#              the shared interpreter: the build step installs fusedmlp into it.
#   --device cpu   run every step on the CPU (rehearsal); --quick   small shapes;
#   --no-install   skip the build step and import fusedmlp from python/ (built in place);
#   --budget       seconds for all steps together (default 540, of which the build may take
#                  up to five ninths).
set -uo pipefail
cd "$(dirname "$0")/.."
results="${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR [options, see the top of this file]}"
shift
device=cuda quick=() install=1 budget=540
while (($#)); do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    --no-install) install=0; shift ;;
    --budget) budget="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
mkdir -p "$results"
results="$(cd "$results" && pwd)"
budget_end=$((SECONDS + budget)) # nine minutes by default, machine start-up not counted
failed=()

step() { # step NAME SECONDS COMMAND... : runs unless the budget is spent, never past it
  local name="$1" limit="$2"
  shift 2
  local left=$((budget_end - SECONDS - 5))
  if ((left < 15)); then
    echo "== $name skipped: budget spent"
    failed+=("$name(skipped)")
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$results/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start))s; tail:"
  tail -n 12 "$results/$name.log" | sed 's/^/   | /'
  # pytest's 5: no test selected (a file without CUDA tests, or a rehearsal on CPU)
  if ((rc != 0)) && ! [[ $name == test-* && $rc -eq 5 ]]; then failed+=("$name(rc=$rc)"); fi
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  "$PYTHON" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, torch.cuda.is_available())" 2>&1
} | tee "$results/machine.txt"

build_env=(env TORCH_CUDA_ARCH_LIST=9.0 FUSEDMLP_CUDA=1 MAX_JOBS="$(nproc)")
if ((install)); then
  step build $((budget * 5 / 9)) "${build_env[@]}" \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
  # pip itself failing (no pip, no editable support offline) need not cost the run: the
  # same build in place, imported through PYTHONPATH. A timeout or a compile error would
  # only repeat, so it is not retried.
  if [[ " ${failed[*]} " == *" build(rc="* && " ${failed[*]} " != *"rc=124"* ]] &&
    ! grep -q "error:" "$results/build.log"; then
    step build-in-place $((budget * 4 / 9)) "${build_env[@]}" "$PYTHON" setup.py -q build_ext \
      --inplace
    install=0
  fi
fi
((install)) || export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# Every later step must test this checkout, not another fusedmlp the interpreter can see.
if ! "$PYTHON" -c "import sys, fusedmlp; print('fusedmlp from', fusedmlp.__file__); \
sys.exit(0 if fusedmlp.__file__.startswith(sys.argv[1]) else 'not this checkout')" \
  "$PWD/python/fusedmlp" 2>&1 | tee -a "$results/machine.txt"; then
  echo "== stopped: $PYTHON does not import this checkout's fusedmlp" | tee "$results/summary.txt"
  exit 1
fi

smoke=("$PYTHON" scripts/gpu_smoke.py --device "$device" --out "$results" "${quick[@]}")
if [[ $device == cuda ]]; then dtypes=(bfloat16 float32 float16); else dtypes=(bfloat16 float32); fi
for dtype in "${dtypes[@]}"; do
  step "values-$dtype" 90 env CUDA_LAUNCH_BLOCKING=1 "${smoke[@]}" values --dtype "$dtype"
done
# The files with CUDA cases (the others test the CPU only); -k cuda picks those cases.
for file in test_linear test_mlp test_gated test_threads test_profile; do
  step "test-$file" 90 env CUDA_LAUNCH_BLOCKING=1 "$PYTHON" -m pytest -q -p no:cacheprovider \
    -k cuda "tests/$file.py"
done
step grads 90 env CUDA_LAUNCH_BLOCKING=1 "${smoke[@]}" grads
step kernels 60 "${smoke[@]}" kernels
step ratios 90 "${smoke[@]}" ratios
bench_size=()
[[ ${#quick[@]} -gt 0 ]] && bench_size=(--quick)
step bench 120 "$PYTHON" -m fusedmlp.bench --device "$device" --dtype bfloat16 --no-compile \
  --cases study_linear,study_gated --out "$results/bench" "${bench_size[@]}"
study_size=()
[[ ${#quick[@]} -gt 0 ]] && study_size=(--tokens 64 --iters 2 --profile-steps 1)
step study 200 "$PYTHON" -m fusedmlp.profile --device "$device" --out "$results/study" \
  "${study_size[@]}"

echo "== done in ${SECONDS}s; failed: ${failed[*]:-none}; results in $results" |
  tee "$results/summary.txt"
((${#failed[@]} == 0))
