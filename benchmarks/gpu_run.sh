#!/usr/bin/env bash
# The GPU measurement in one command of at most 8 minutes (docs/measurement.md#the-command). On a CUDA machine:
#
#   benchmarks/gpu_run.sh OUTDIR          every stage below; their time limits add to 480 s
#   benchmarks/gpu_run.sh OUTDIR --quick  when little device time is left: stage 1 on ResNet-152 alone (190 s)
#   benchmarks/gpu_run.sh OUTDIR --check  on any CPU: the same stages on a small model and few blocks, to check the
#                                         plumbing and the verdicts' printing (its numbers mean nothing)
#
# A machine without network access: if hivemind, pytest-forked or pytest 8 cannot be imported and a folder .whl/
# exists in the repository root, the script installs the wheels in it into /tmp/site (benchmarks/gpu_wheels.sh
# builds that folder for the machine's Python).
#
# Stages, each under its own time limit (LIMIT below), logged to OUTDIR/gpu_run.log; none stops the next when it
# fails (the exit status is 1 if any failed, so that a CI run of --check catches a stage that broke):
#   0. install the wheels if needed; print Python, torch, CUDA, the GPU and its driver; run
#      check_grad_scaler_internals(); start a hivemind DHT (its p2pd daemon); then every test under tests/ named cuda
#   1. python -m benchmarks.gpu_protocol on ResNet-152, then on ConvNeXt-Large, in hivemind#566's setting: native,
#      in place, exact, the report's hivemind.GradScaler loop (exact_hivemind; in place uses it too), upstream's two
#      modes, interleaved in one process; verdicts on 0.99 of native (OUTDIR/protocol_<model>.{json,md})
#   2. the report's regime: the same process confined to 2 cores (taskset -c 0,1) beside 2 busy processes of a data
#      loader's kind; native, upstream and ours on ResNet-152, verdicts on 0.97 (OUTDIR/two_cores_resnet152.*)
# Each protocol writes its files after every block, so a stage cut short by its limit keeps what it measured.
# Environment: PYTHON (default python3).
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

# seconds per stage; 0 skips it. The GPU run's add to at most 480 (one command of 8 minutes), --quick's to 190.
# A protocol stage builds its loops (tens of seconds), then runs blocks of about 2.5 s (six loops of 6 micro-steps
# of 50-65 ms on an H200) until DEADLINE_MARGIN seconds before its limit
declare -A GPU_LIMIT=([install]=20 [environment]=25 [tests]=45 [resnet152]=140 [convnext-large]=140 [two_cores]=110)
declare -A QUICK_LIMIT=([install]=20 [environment]=25 [tests]=0 [resnet152]=145 [convnext-large]=0 [two_cores]=0)
sum() { local -n limits=$1; local total=0 key; for key in "${!limits[@]}"; do total=$(( total + limits[$key] )); done; echo $total; }
[ "$(sum GPU_LIMIT)" -le 480 ] && [ "$(sum QUICK_LIMIT)" -le 190 ] || {
  echo "stage limits add to $(sum GPU_LIMIT) s (GPU run, at most 480) and $(sum QUICK_LIMIT) s (--quick, at most 190)"
  exit 1
}
TEST_SELECTION=(-k cuda)
# the protocol's arguments; a stage's protocol stops its blocks DEADLINE_MARGIN seconds before the stage's limit, to
# profile one step per implementation and write its files; CHECK_MODEL stands in for both models with --check
PROTOCOL=(--device cuda --steps 5 --min-blocks 30)
THREADS=8 DEADLINE_MARGIN=15 CHECK_MODEL=
case "$MODE" in
  gpu)   declare -n LIMIT=GPU_LIMIT; DEVICE=cuda; MODELS="resnet152 convnext-large" ;;
  --quick) declare -n LIMIT=QUICK_LIMIT; DEVICE=cuda; MODELS="resnet152" ;;
  --check)
    # a CPU busy with CI's other stages: twice the GPU run's limits, so that only a broken stage fails; a small
    # model stands in for both models, few blocks
    declare -A CHECK_LIMIT; for key in "${!GPU_LIMIT[@]}"; do CHECK_LIMIT[$key]=$(( 2 * GPU_LIMIT[$key] )); done
    declare -n LIMIT=CHECK_LIMIT; DEVICE=cpu; MODELS="resnet152 convnext-large"
    PROTOCOL=(--device cpu --steps 2 --min-blocks 3 --blocks 4 --warmup 1); THREADS=1 CHECK_MODEL=mlp-20x16
    TEST_SELECTION=(-k "cuda or cost_is_one_fused_op")  # on a CPU the CUDA cases skip: run one cost guard too
    ;;
  *) echo "unknown mode $MODE: use --quick or --check, or nothing"; exit 1 ;;
esac
echo "mode ${MODE#--}: stage limits $(for key in install environment tests resnet152 convnext-large two_cores; do
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
from hivemind_accum.torch_compat import check_grad_scaler_internals
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

protocol() {  # protocol LIMIT_KEY NAME MODEL [COMMAND PREFIX] -- ARGS...: one protocol stage under its limit
  local limit=${LIMIT[$1]} name=$2 model=${CHECK_MODEL:-$3}; shift 3
  local prefix=(); while [ "$1" != -- ]; do prefix+=("$1"); shift; done; shift
  "${prefix[@]}" timeout "$limit" "$PYTHON" -m benchmarks.gpu_protocol --out-dir "$OUT" --name "$name" --model "$model" \
    --deadline-s $(( limit - DEADLINE_MARGIN )) "${PROTOCOL[@]}" "$@"
}
for model in $MODELS; do
  [ "${LIMIT[$model]}" -gt 0 ] || continue
  stage "1. $model in hivemind#566's setting: every implementation interleaved in one process"
  protocol "$model" "protocol_$model" "$model" -- --threads "$THREADS"
  status=$?; echo "protocol exit status: $status"; check $status "1. $model"
done

if [ "${LIMIT[two_cores]}" -gt 0 ]; then
  stage "2. the report's regime: 2 cores (taskset -c 0,1), 2 busy processes beside, ResNet-152"
  if command -v taskset >/dev/null && [ "$(nproc --all)" -ge 2 ]; then
    protocol two_cores two_cores_resnet152 resnet152 taskset -c 0,1 -- --threads 2 --cpu-load 2 --target 0.97 \
      --impls native upstream_hivemind exact_hivemind inplace
    status=$?; echo "protocol exit status: $status"; check $status "2. two cores"
  else
    echo "taskset or a second core is missing: stage 2 skipped"
  fi
fi

stage "done in $(( $(date +%s) - started )) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
for table in "$OUT"/protocol_*.md "$OUT"/two_cores_*.md; do [ -f "$table" ] && { echo; cat "$table"; }; done
if [ ${#failed[@]} -gt 0 ]; then echo; echo "failed stages: ${failed[*]}"; exit 1; fi
