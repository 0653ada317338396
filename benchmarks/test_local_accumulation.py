"""
pytest-benchmark suite: ``pytest benchmarks/ --benchmark-only``.

One benchmark group per model size (or ``model:precision``, see :mod:`benchmarks.micro_step_worker`) and metric
(full micro-step, no-sync ``step()``, averaging-time load), one benchmark per implementation. Samples come from fresh worker processes that alternate between implementations
(:func:`benchmarks.sweep.run_sweep`); the tests replay them into pytest-benchmark so its statistics, saved JSON and
``--benchmark-compare`` cover them. Each benchmark of this package's modes also asserts its target ratio:

- exact mode micro-step at most 1.15x native accumulation; its no-sync step cheaper than upstream's on models of
  100 M parameters and 100 tensors or more;
- in-place mode micro-step at most 1.03x native accumulation; its no-sync step under 1 ms.

The ratio targets hold in every precision except the exact mode with fp16 loss scaling, which has none: there each
micro-step is copied, unscaled, checked and added on the device (four memory-bound passes on CPU, where upstream's
unscale, host read and add make three) to avoid the host synchronization and keep the micro-steps that did not
overflow; its ratios are recorded, not asserted.
"""
import statistics

import pytest

from benchmarks.conftest import BENCH_MODELS, record_samples
from benchmarks.sweep import pooled

pytestmark = pytest.mark.timeout(3600)  # the first test of each model runs that model's whole sweep

MICRO_STEP_TARGETS = {"exact": 1.15, "inplace": 1.03}
IN_PLACE_NO_SYNC_TARGET_S = 1e-3


@pytest.mark.parametrize("impl", ["native", "upstream", "exact", "inplace"])
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_micro_step(benchmark, sweep_results, model, impl):
    runs = sweep_results(model)
    benchmark.group = f"micro-step {model}"
    samples = pooled(runs[impl], "micro_step")
    record_samples(benchmark, samples)
    native = statistics.median(pooled(runs["native"], "micro_step"))
    ratio = statistics.median(samples) / native
    benchmark.extra_info.update(ratio_to_native=ratio, params=runs[impl][0]["params"], processes=len(runs[impl]))
    if impl in MICRO_STEP_TARGETS and not (impl == "exact" and model.endswith(":fp16")):
        assert ratio <= MICRO_STEP_TARGETS[impl], (
            f"{impl} micro-step on {model} is {ratio:.3f}x native accumulation, target <= {MICRO_STEP_TARGETS[impl]}x"
        )


@pytest.mark.parametrize("impl", ["upstream", "exact", "inplace"])
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_no_sync_step(benchmark, sweep_results, model, impl):
    runs = sweep_results(model)
    benchmark.group = f"no-sync step {model}"
    samples = pooled(runs[impl], "no_sync_step")
    record_samples(benchmark, samples)
    median, upstream = statistics.median(samples), statistics.median(pooled(runs["upstream"], "no_sync_step"))
    benchmark.extra_info.update(ratio_to_upstream=median / upstream, params=runs[impl][0]["params"])
    if impl == "exact" and runs[impl][0]["params"] >= 100e6 and runs[impl][0]["tensors"] >= 100:
        # on CPU the no-sync step is memory-bound: the fused op saves upstream's per-tensor Python overhead, which
        # stands out of the timing noise only with many tensors (ConvNeXt-Large: 344; Linear-100M has 48)
        assert median < upstream, f"exact no-sync step on {model}: {1e3 * median:.2f} ms, upstream {1e3 * upstream:.2f} ms"
    if impl == "inplace":
        assert median < IN_PLACE_NO_SYNC_TARGET_S, f"in-place no-sync step on {model}: {1e3 * median:.3f} ms, target < 1 ms"


@pytest.mark.parametrize("impl", ["upstream", "exact", "inplace"])
@pytest.mark.parametrize("model", BENCH_MODELS)
def test_averaging_time_load(benchmark, sweep_results, model, impl):
    runs = sweep_results(model)
    benchmark.group = f"averaging-time load {model}"
    record_samples(benchmark, pooled(runs[impl], "load"))
