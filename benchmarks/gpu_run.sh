#!/usr/bin/env bash
# The GPU benchmark in one command of at most 9 minutes (docs/gpu.md gives the device call). On a CUDA machine:
#
#   benchmarks/gpu_run.sh OUTDIR          the GPU run: every stage below; their time limits add to 540 s
#   benchmarks/gpu_run.sh OUTDIR --quick  when little device time is left: stage 0 without the CUDA tests, then
#                                         stage 1 on ResNet-152 alone, one window per worker (limits add to 190 s)
#   benchmarks/gpu_run.sh OUTDIR --check  on any CPU: the GPU run's stages on a small model and few steps, to check
#                                         the plumbing (its numbers mean nothing)
#
# A machine without network access: if hivemind, pytest-forked or pytest 8 cannot be imported and a folder .whl/
# exists in the repository root, the script installs the wheels in it into /tmp/site (benchmarks/gpu_wheels.sh
# builds that folder for the machine's Python).
#
# Stages, each under its own time limit (LIMIT below), logged to OUTDIR/gpu_run.log; none stops the next when it
# fails (the exit status is 1 if any failed, so that a CI run of --check catches a stage that broke):
#   0. install the wheels if needed; print Python, torch, CUDA, the GPU and its driver; run
#      check_grad_scaler_internals(); start a hivemind DHT (its p2pd daemon); then every test under
#      tests/ named cuda (-k cuda)
#   1. hivemind#566's own configuration first (exact mode with hivemind.GradScaler: exact_hivemind), then what the
#      README's GPU table needs: native, upstream, exact and in place in hivemind#566's setting on ResNet-152, then on
#      ConvNeXt-Large (python -m benchmarks.sweep --preset report), each worker in its own fresh process
#   2. upstream with hivemind.GradScaler and upstream reuse_grad_buffers=True on both models, added to the same
#      results (--merge)
#   3. the pytest-benchmark targets checked on those samples (HIVEMIND_ACCUM_BENCH_RESULTS); a configuration the
#      results lack is skipped and named
# The sweep writes OUTDIR/sweep_cuda.{json,md} after every worker; a worker that fails or runs past WORKER_TIMEOUT
# is recorded there and skipped. The table is printed last. Environment: ROUNDS (processes per implementation,
# default 1), STEPS (micro-steps per timed window, default 30), WINDOWS (default 2), WORKER_TIMEOUT (seconds, default
# 90), PYTHON (default python3).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_run.sh OUTDIR [--quick|--check]}
MODE=${2:-gpu}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# torch.cuda.is_available() asks NVML, which does not poison fork for the forked CUDA tests (tests/conftest.py)
export PYTORCH_NVML_BASED_CUDA_CHECK=1
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
started=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - started )) s] $*"; }
failed=()
check() { [ "$1" -eq 0 ] || failed+=("$2 (exit status $1)"); }

# seconds per stage; 0 skips it. The GPU run's add to at most 540 (one command of 9 minutes), --quick's to at most 190.
# On an H200 a sweep worker takes 25-30 s, mostly process start-up: stage 1 runs 10 workers, stage 2 four
declare -A GPU_LIMIT=([install]=30 [environment]=30 [tests]=60 [readme]=280 [reuse]=120 [targets]=20)
declare -A QUICK_LIMIT=([install]=20 [environment]=25 [tests]=0 [readme]=145 [reuse]=0 [targets]=0)
sum() { local -n limits=$1; local total=0 key; for key in "${!limits[@]}"; do total=$(( total + limits[$key] )); done; echo $total; }
[ "$(sum GPU_LIMIT)" -le 540 ] && [ "$(sum QUICK_LIMIT)" -le 190 ] || {
  echo "stage limits add to $(sum GPU_LIMIT) s (GPU run, at most 540) and $(sum QUICK_LIMIT) s (--quick, at most 190)"
  exit 1
}
TEST_SELECTION=(-k cuda)
case "$MODE" in
  gpu)   declare -n LIMIT=GPU_LIMIT; DEVICE=cuda; MODELS="resnet152 convnext-large"; WARMUP=10; THREADS=8 ;;
  --quick) declare -n LIMIT=QUICK_LIMIT; DEVICE=cuda; MODELS="resnet152"; WARMUP=5; THREADS=8; WINDOWS=1 ;;
  --check)
    # a CPU busy with CI's other stages: twice the GPU run's limits, so that only a broken stage fails
    declare -A CHECK_LIMIT; for key in "${!GPU_LIMIT[@]}"; do CHECK_LIMIT[$key]=$(( 2 * GPU_LIMIT[$key] )); done
    declare -n LIMIT=CHECK_LIMIT; DEVICE=cpu; MODELS="linear-1m"; STEPS=${STEPS:-2}; WINDOWS=1; WARMUP=1; THREADS=1
    TEST_SELECTION=(-k "cuda or cost_is_one_fused_op")  # on a CPU the CUDA cases skip: run one cost guard too
    ;;
  *) echo "unknown mode $MODE: use --quick or --check, or nothing"; exit 1 ;;
esac
ROUNDS=${ROUNDS:-1}; STEPS=${STEPS:-30}; WINDOWS=${WINDOWS:-2}; WORKER_TIMEOUT=${WORKER_TIMEOUT:-90}
[ "$MODE" = --check ] && WORKER_TIMEOUT=$(( 2 * WORKER_TIMEOUT ))
echo "mode ${MODE#--}: stage limits $(for key in install environment tests readme reuse targets; do
  printf '%s=%s ' "$key" "${LIMIT[$key]}"; done)(sum $(sum LIMIT) s)"

stage "0. environment"
needs_wheels() { ! "$PYTHON" -c "import hivemind, pytest_forked, pytest; assert int(pytest.__version__.split('.')[0]) < 9" 2>/dev/null; }
if needs_wheels; then
  [ -d .whl ] || { echo "hivemind, pytest-forked or pytest 8 is missing: install requirements-dev.txt, or carry .whl/ (see the header)"; exit 1; }
  timeout "${LIMIT[install]}" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# an image's pytest-timeout may be too new for pytest 8 (2.4 declares a float ini option that pytest 8.3.5 refuses):
# leave it out then, in the pytest processes the tests start too; each stage's own time limit bounds the tests
"$PYTHON" -m pytest --version >/dev/null 2>&1 || export PYTEST_ADDOPTS="-p no:timeout ${PYTEST_ADDOPTS:-}"
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true; }
timeout "${LIMIT[environment]}" "$PYTHON" - "$DEVICE" <<'EOF' || { echo "environment check failed: see above"; exit 1; }
import sys, platform, torch, hivemind, pytest
from hivemind_accum.optim.torch_internals import check_grad_scaler_internals
device = sys.argv[1]
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), hivemind "
      f"{hivemind.__version__}, pytest {pytest.__version__}")
if device == "cuda":
    assert torch.cuda.is_available(), "torch does not see a CUDA device"
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
          f"{props.multi_processor_count} SMs")
check_grad_scaler_internals()
print("check_grad_scaler_internals(): the loss-scaling contract holds")
dht = hivemind.DHT(start=True)
print("DHT started:", dht.get_visible_maddrs()[:1])
dht.shutdown()
EOF
if [ "${LIMIT[tests]}" -gt 0 ]; then
  stage "0. CUDA tests (every test named cuda)"
  timeout "${LIMIT[tests]}" "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/ "${TEST_SELECTION[@]}" --junitxml="$OUT/cuda_tests.xml"
  status=$?; echo "tests exit status: $status"; check $status "0. CUDA tests"
fi

sweep() {  # sweep LIMIT_KEY IMPLS... [--merge]: one sweep stage into OUTDIR/sweep_$DEVICE.{json,md}
  local limit=${LIMIT[$1]}; shift
  # shellcheck disable=SC2086
  timeout "$limit" "$PYTHON" -m benchmarks.sweep --device "$DEVICE" --preset report --models $MODELS \
    --rounds "$ROUNDS" --steps "$STEPS" --windows "$WINDOWS" --warmup "$WARMUP" --threads "$THREADS" \
    --worker-timeout "$WORKER_TIMEOUT" --output-dir "$OUT" --name "sweep_$DEVICE" --impls "$@"
}
stage "1. hivemind#566's configuration (exact_hivemind), then the README table: native, upstream, exact, in place on $DEVICE: $MODELS"
sweep readme exact_hivemind native upstream exact inplace
status=$?; echo "sweep exit status: $status"; check $status "1. README table sweep"

if [ "${LIMIT[reuse]}" -gt 0 ]; then
  stage "2. upstream with hivemind.GradScaler, upstream reuse_grad_buffers=True on $DEVICE: $MODELS"
  sweep reuse upstream_hivemind upstream_reuse --merge
  status=$?; echo "sweep exit status: $status"; check $status "2. upstream_reuse sweep"
fi

if [ "${LIMIT[targets]}" -gt 0 ]; then
  stage "3. pytest-benchmark targets on the same samples"
  if [ -f "$OUT/sweep_$DEVICE.json" ]; then
    HIVEMIND_ACCUM_BENCH_DEVICE=$DEVICE HIVEMIND_ACCUM_BENCH_RESULTS="$OUT/sweep_$DEVICE.json" \
      HIVEMIND_ACCUM_BENCH_MODELS="$MODELS" timeout "${LIMIT[targets]}" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
      benchmarks/test_local_accumulation.py --benchmark-only --benchmark-storage "file:///tmp/pytest-benchmark" \
      --benchmark-json "$OUT/pytest_benchmark_$DEVICE.json" --benchmark-columns=median,iqr,rounds
    status=$?; echo "benchmark targets exit status: $status"
    # with --check the samples are 2 micro-steps of a small model on a busy CPU: the targets run, their verdict is noise
    [ "$MODE" = --check ] || check $status "3. benchmark targets"
  else
    check 1 "3. benchmark targets (no sweep results)"
  fi
fi

stage "done in $(( $(date +%s) - started )) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo
cat "$OUT/sweep_$DEVICE.md" 2>/dev/null || echo "no results table"
if [ ${#failed[@]} -gt 0 ]; then echo; echo "failed stages: ${failed[*]}"; exit 1; fi
