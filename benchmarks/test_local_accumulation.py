"""
pytest-benchmark suite: ``pytest benchmarks/ --benchmark-only`` (CPU), or with ``HIVEMIND_ACCUM_BENCH_DEVICE=cuda``
hivemind#566's setting on a GPU (``benchmarks/gpu_run.sh`` runs it on a saved sweep).

One benchmark group per model size (or ``model:precision``, see :mod:`benchmarks.micro_step_worker`) and metric
(full micro-step, no-sync ``step()``), one benchmark per implementation; the averaging-time load is
``benchmarks/test_floor_costs.py``'s. Samples come from fresh worker processes that alternate between implementations
(:func:`benchmarks.sweep.run_sweep`); the tests replay them into pytest-benchmark so its statistics, saved JSON and
``--benchmark-compare`` cover them. Each benchmark of this
package's modes also asserts its target:

- CPU: exact mode micro-step at most 1.15x native accumulation; its no-sync step cheaper than upstream's on models of
  100 M parameters and 100 tensors or more, and with fp16 loss scaling at most ``FP16_EXACT_PARITY`` x upstream's
  (on the CPU it reads the overflow decision on the host and makes as many passes as upstream, each as costly);
  in-place mode micro-step at most 1.03x native, its no-sync step under 1 ms. The exact mode with fp16 loss scaling
  has no micro-step ratio target.
- CUDA (the report's setting): local throughput at least 0.99x native in place and 0.97x native exact; no host
  synchronization in either mode's no-sync step; exact mode fewer kernel launches per no-sync step than parameter
  tensors (upstream launches one or more per tensor) and at most :func:`benchmarks.kernel_launches.exact_step_kernels`;
  peak device memory in place within 1 % of native, exact at most native plus one float32 copy of the gradients
  (the accumulators; with loss scaling float32 ``.grad`` is unscaled in place).
"""
import statistics

import pytest

from benchmarks.conftest import BENCH_DEVICE, BENCH_IMPLEMENTATIONS, BENCH_MODELS, record_samples
from benchmarks.kernel_launches import EXACT_HIVEMIND_STEP_OTHER_OPS, EXACT_STEP_OTHER_OPS, exact_step_kernels
from benchmarks.sweep import pooled

pytestmark = pytest.mark.timeout(3600)  # the first test of each model runs that model's whole sweep

CUDA = BENCH_DEVICE == "cuda"
# micro-step time as a multiple of native's (on CUDA: 1 / the local-throughput target)
MICRO_STEP_TARGETS = {"exact": 1 / 0.97, "inplace": 1 / 0.99} if CUDA else {"exact": 1.15, "inplace": 1.03}
IN_PLACE_NO_SYNC_TARGET_S = 1e-3
# CPU, fp16 loss scaling: exact no-sync step at most this multiple of upstream's (a tie by construction, see
# test_no_sync_step; two quiet runs of the same code measured 0.98x and 1.06x)
FP16_EXACT_PARITY = 1.10
HIVEMIND_IMPLEMENTATIONS = [impl for impl in BENCH_IMPLEMENTATIONS if impl != "native"]


@pytest.mark.parametrize("impl", BENCH_IMPLEMENTATIONS)
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_micro_step(benchmark, sweep_results, model, impl):
    runs = sweep_results(model, impl, "native")
    benchmark.group = f"micro-step {model}" + (" (cuda, report setting)" if CUDA else "")
    samples = pooled(runs[impl], "micro_step")
    record_samples(benchmark, samples)
    native = statistics.median(pooled(runs["native"], "micro_step"))
    ratio = statistics.median(samples) / native
    benchmark.extra_info.update(ratio_to_native=ratio, throughput_vs_native=1 / ratio, params=runs[impl][0]["params"],
                                processes=len(runs[impl]))
    if impl in MICRO_STEP_TARGETS and not (impl == "exact" and model.endswith(":fp16")):
        assert ratio <= MICRO_STEP_TARGETS[impl], (
            f"{impl} micro-step on {model} is {ratio:.3f}x native accumulation (throughput {1 / ratio:.3f}x), "
            f"target <= {MICRO_STEP_TARGETS[impl]:.3f}x"
        )


@pytest.mark.parametrize("impl", HIVEMIND_IMPLEMENTATIONS)
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_no_sync_step(benchmark, sweep_results, model, impl):
    runs = sweep_results(model, impl, "upstream")
    benchmark.group = f"no-sync step {model}" + (" (cuda, host time)" if CUDA else "")
    samples = pooled(runs[impl], "no_sync_step")
    record_samples(benchmark, samples)
    median, upstream = statistics.median(samples), statistics.median(pooled(runs["upstream"], "no_sync_step"))
    benchmark.extra_info.update(ratio_to_upstream=median / upstream, params=runs[impl][0]["params"])
    many_tensors = runs[impl][0]["params"] >= 100e6 and runs[impl][0]["tensors"] >= 100
    if impl == "exact" and not CUDA and many_tensors:
        # on CPU the no-sync step is memory-bound: the fused op saves upstream's per-tensor Python overhead, which
        # stands out of the timing noise only with many tensors (ConvNeXt-Large: 344; Linear-100M has 48)
        assert median < upstream, f"exact no-sync step on {model}: {1e3 * median:.2f} ms, upstream {1e3 * upstream:.2f} ms"
    if impl == "exact" and not CUDA and model.endswith(":fp16"):
        # with fp16 loss scaling both make two passes over the gradients (exact: a read-only check, then the add with
        # the unscale folded in; upstream: unscale in place, then add) and on one core a read-only pass costs what a
        # read-write one does (1.66 vs 1.61 ms per 8.4 M float32 elements, finite_add.add_finite_with_host_check):
        # a tie, so this guards parity (two quiet runs measured 3.80 vs 3.86 and 4.13 vs 3.89 ms on Linear-10M)
        assert median <= FP16_EXACT_PARITY * upstream, (
            f"exact no-sync step on {model} with fp16 loss scaling: {1e3 * median:.2f} ms, upstream "
            f"{1e3 * upstream:.2f} ms (target <= {FP16_EXACT_PARITY}x)"
        )
    if impl == "inplace" and not CUDA:
        assert median < IN_PLACE_NO_SYNC_TARGET_S, f"in-place no-sync step on {model}: {1e3 * median:.3f} ms, target < 1 ms"


@pytest.mark.skipif(not CUDA, reason="host syncs, kernel launches and device memory are measured on CUDA")
@pytest.mark.parametrize("impl", ["exact", "exact_hivemind", "inplace"])
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_cuda_work_and_memory(sweep_results, model, impl):
    """deterministic counts from the same worker processes (one profiled no-sync step each), checked per process"""
    runs = sweep_results(model, impl, "native")
    for run, native in zip(runs[impl], runs["native"]):
        work = run["work"]
        assert work.get("error") is None, work
        # the counting harness synchronizes once itself: native's empty step counts 1 of each on an H200
        harness = native["work"]
        assert work["host_reads"] == 0, f"{impl} no-sync step reads the device from the host: {work}"
        assert work["sync_warnings"] <= harness["sync_warnings"] and work["device_syncs"] <= harness["device_syncs"], (
            f"{impl} no-sync step synchronizes: {work}, native's empty step {harness}")
        if impl != "inplace":  # the report's models hold float32 parameters only: one bucket
            # the bound with 4 KB kernel arguments; 32 KB ones (CUDA 12.1+, sm_70+) launch fewer
            other_ops = EXACT_STEP_OTHER_OPS if impl == "exact" else EXACT_HIVEMIND_STEP_OTHER_OPS
            bound = exact_step_kernels(run["numels"], other_ops=other_ops)
            assert work["kernels"] <= bound, (work, bound, exact_step_kernels(run["numels"], True, other_ops))
            assert work["kernels"] < run["tensors"], work  # upstream launches one or more per tensor
        grad_bytes = 4 * run["params"]  # float32 parameters
        if impl == "inplace":
            assert run["peak_device_bytes"] <= 1.01 * native["peak_device_bytes"], (run["peak_device_bytes"], native)
        else:  # the accumulators (docs/guide.md): float32 .grad is unscaled in place, no staging buffer
            assert run["peak_device_bytes"] <= 1.01 * native["peak_device_bytes"] + grad_bytes, (
                run["peak_device_bytes"], native["peak_device_bytes"], grad_bytes)
