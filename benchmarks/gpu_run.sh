#!/usr/bin/env bash
# The GPU benchmark in one command (docs/gpu.md). On a CUDA machine with the requirements installed:
#
#   benchmarks/gpu_run.sh OUTDIR          the GPU run (about 5-7 minutes on one H200; the stages' timeouts bound it
#                                         to 10)
#   benchmarks/gpu_run.sh OUTDIR --check  on any CPU: the same stages on a small model and few steps, to check the
#                                         plumbing first (about 80 s on 2 cores; its numbers mean nothing)
#
# Optional, for a machine without network access: if hivemind cannot be imported and a folder .whl/ exists in the
# repository root, the script installs the wheels in it into /tmp/site. Build that folder on a machine with network
# access and the same Python version, e.g. `pip wheel -r requirements-dev.txt --no-deps -w .whl` (leave torch out
# if the GPU machine has its own), and copy it along.
#
# Stages, each logged to OUTDIR/gpu_run.log and none stopping the next when it fails (the exit status is 1 if any
# failed, so that a CI run of --check catches a stage that broke):
#   0. install the wheels in .whl/ into /tmp/site if hivemind is missing (see above), then fail fast unless torch
#      sees CUDA and a hivemind DHT starts (its p2pd daemon)
#   1. CUDA tests: tests/test_cost_guards.py and tests/test_mixed_precision.py (their CUDA cases run only there)
#   2. hivemind#566's setting on ResNet-152 and ConvNeXt-Large (python -m benchmarks.sweep --device cuda
#      --preset report): native, upstream default, upstream reuse_grad_buffers=True, exact, in place, each in its own
#      fresh process, alternating; JSON, markdown table and the two figures into OUTDIR
#   3. the pytest-benchmark targets checked on the same samples (HIVEMIND_ACCUM_BENCH_RESULTS)
# The table is printed last. Environment: ROUNDS (processes per implementation, default 1), STEPS (micro-steps per
# timed window, default 30), WINDOWS (default 3), PYTHON (default python3).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_run.sh OUTDIR [--check]}
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

if [ "$MODE" = "--check" ]; then
  DEVICE=cpu; MODELS="linear-1m"; ROUNDS=${ROUNDS:-1}; STEPS=${STEPS:-2}; WINDOWS=1; WARMUP=1; THREADS=1
  TEST_SELECTION=(-k "cuda or cost_is_one_fused_op")
else
  DEVICE=cuda; MODELS="resnet152 convnext-large"; ROUNDS=${ROUNDS:-1}; STEPS=${STEPS:-30}; WINDOWS=${WINDOWS:-3}
  WARMUP=10; THREADS=8
  # the CUDA cases and the device-parametrized guards; the CPU-only peers' tests run in CI
  TEST_SELECTION=(-k "cuda or cost or guard or dropped or unscaled")
fi

stage "0. environment"
if ! "$PYTHON" -c "import hivemind" 2>/dev/null; then
  [ -d .whl ] || { echo "hivemind is missing: install requirements-dev.txt, or put its wheels in .whl/ (see the header)"; exit 1; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 120 "$PYTHON" - "$DEVICE" <<'EOF' || { echo "environment check failed: see above"; exit 1; }
import sys, platform, torch, hivemind, pytest
device = sys.argv[1]
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), hivemind "
      f"{hivemind.__version__}, pytest {pytest.__version__}")
if device == "cuda":
    assert torch.cuda.is_available(), "torch does not see a CUDA device"
    print("device:", torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
dht = hivemind.DHT(start=True)
print("DHT started:", dht.get_visible_maddrs()[:1])
dht.shutdown()
EOF

stage "1. CUDA tests (cost guards, mixed precision)"
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_cost_guards.py tests/test_mixed_precision.py \
  "${TEST_SELECTION[@]}" --junitxml="$OUT/cuda_tests.xml"
status=$?; echo "tests exit status: $status"; check $status "1. tests"

stage "2. hivemind#566's setting on $DEVICE: $MODELS"
# shellcheck disable=SC2086
timeout 330 "$PYTHON" -m benchmarks.sweep --device "$DEVICE" --preset report --models $MODELS --rounds "$ROUNDS" \
  --steps "$STEPS" --windows "$WINDOWS" --warmup "$WARMUP" --threads "$THREADS" --output-dir "$OUT" --name "sweep_$DEVICE"
status=$?; echo "sweep exit status: $status"; check $status "2. sweep"
if [ ! -f "$OUT/sweep_$DEVICE.json" ] && [ -f "$OUT/sweep_$DEVICE.partial.json" ]; then
  stage "2b. the sweep was cut short: summarizing what it measured"
  "$PYTHON" - "$OUT" "$DEVICE" <<'EOF'
import json, os, sys
from benchmarks.sweep import markdown_table, summarize
out, device = sys.argv[1:]
raw = json.load(open(os.path.join(out, f"sweep_{device}.partial.json")))
raw = {model: {impl: runs for impl, runs in by_impl.items() if runs} for model, by_impl in raw.items()}
raw = {model: by_impl for model, by_impl in raw.items() if by_impl}
rows = summarize(raw)
json.dump(dict(machine="partial run", rows=rows, raw=raw), open(os.path.join(out, f"sweep_{device}.json"), "w"), indent=1)
open(os.path.join(out, f"sweep_{device}.md"), "w").write("Partial run (cut short)\n\n" + markdown_table(rows) + "\n")
EOF
fi

stage "3. pytest-benchmark targets on the same samples"
if [ -f "$OUT/sweep_$DEVICE.json" ]; then
  HIVEMIND_ACCUM_BENCH_DEVICE=$DEVICE HIVEMIND_ACCUM_BENCH_RESULTS="$OUT/sweep_$DEVICE.json" \
    HIVEMIND_ACCUM_BENCH_MODELS="$MODELS" timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    benchmarks/test_local_accumulation.py \
    --benchmark-only --benchmark-storage "file:///tmp/pytest-benchmark" --benchmark-json "$OUT/pytest_benchmark_$DEVICE.json" \
    --benchmark-columns=median,iqr,rounds
  status=$?; echo "benchmark targets exit status: $status"
  # with --check the samples are 2 micro-steps of a small model on a busy CPU: the targets run, their verdict is noise
  [ "$MODE" = "--check" ] || check $status "3. benchmark targets"
  # ratios the targets are about, in one place
  "$PYTHON" - "$OUT/sweep_$DEVICE.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for row in rows:
    if row["impl"] != "native":
        print(f"{row['model']:>15} {row['impl']:>14}: throughput {row['throughput_vs_native']:.3f}x native, "
              f"no-sync step {row['no_sync_step_ms']:.2f} ms, syncs {row.get('sync_warnings')}, "
              f"host reads {row.get('host_reads')}, kernels {row.get('kernels')}, top-level ops {row.get('top_level_ops')}")
EOF
else
  check 1 "3. benchmark targets (no sweep results)"
fi
rm -f "$OUT/sweep_$DEVICE.partial.json"

stage "done in $(( $(date +%s) - started )) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo
cat "$OUT/sweep_$DEVICE.md" 2>/dev/null || echo "no results table"
if [ ${#failed[@]} -gt 0 ]; then echo; echo "failed stages: ${failed[*]}"; exit 1; fi
