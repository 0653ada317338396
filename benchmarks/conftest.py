import itertools
import json
import os
from typing import Dict, List

import pytest
from pytest_benchmark.utils import get_tag

from benchmarks.micro_step_worker import IMPLEMENTATIONS, REPORT_IMPLEMENTATIONS
from benchmarks.sweep import DEFAULT_MODELS, REPORT_MODELS, run_sweep

# HIVEMIND_ACCUM_BENCH_DEVICE=cuda: hivemind#566's setting (ResNet-152 and ConvNeXt-Large, batch 32 of 224x224,
# fp16 AMP with loss scaling) with upstream reuse_grad_buffers=True too; each sample a window of 30 micro-steps
BENCH_DEVICE = os.environ.get("HIVEMIND_ACCUM_BENCH_DEVICE", "cpu")
# one row per precision (ratios to native accumulation in the same precision) on the smallest model
PRECISION_MODELS = ("linear-10m:bf16", "linear-10m:fp16")
_DEFAULT_MODELS = REPORT_MODELS if BENCH_DEVICE == "cuda" else DEFAULT_MODELS + PRECISION_MODELS
BENCH_MODELS = tuple(os.environ.get("HIVEMIND_ACCUM_BENCH_MODELS", " ".join(_DEFAULT_MODELS)).split())
BENCH_ROUNDS = int(os.environ.get("HIVEMIND_ACCUM_BENCH_ROUNDS", "3"))
BENCH_IMPLEMENTATIONS = REPORT_IMPLEMENTATIONS if BENCH_DEVICE == "cuda" else IMPLEMENTATIONS
# HIVEMIND_ACCUM_BENCH_RESULTS=path.json: replay a saved sweep (benchmarks.sweep's JSON, its "raw" results) instead of
# running one: benchmarks/gpu_run.sh measures once and checks the targets on the same samples; configurations the
# file lacks are skipped and named, never measured anew
BENCH_RESULTS = os.environ.get("HIVEMIND_ACCUM_BENCH_RESULTS")

_sweeps: Dict[str, Dict[str, List[dict]]] = {}
_replay: dict = {}  # BENCH_RESULTS once read: raw, failures
RESULTS_STORAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pytest-benchmark")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """save every benchmark run, with its samples, under benchmarks/results/ (for ``--benchmark-compare``)"""
    config.option.benchmark_autosave = config.option.benchmark_autosave or get_tag()  # what --benchmark-autosave stores
    config.option.benchmark_save_data = True
    if config.option.benchmark_storage in (None, "file://./.benchmarks"):
        config.option.benchmark_storage = f"file://{RESULTS_STORAGE}"


def _replayed() -> Dict[str, Dict[str, List[dict]]]:
    """the raw results and failures of BENCH_RESULTS, read once"""
    if not _replay:
        with open(BENCH_RESULTS) as f:
            saved = json.load(f)
        _replay.update(raw=saved["raw"], failures=saved.get("failures", []))
    return _replay["raw"]


def _missing() -> List[str]:
    """(model, implementation) pairs of this session that BENCH_RESULTS holds no samples of"""
    raw = _replayed()
    return [f"{model} {impl}" for model in BENCH_MODELS for impl in BENCH_IMPLEMENTATIONS
            if not raw.get(model, {}).get(impl)]


@pytest.fixture(scope="session")
def sweep_results():
    """
    ``get(model, *needed)``: every implementation's worker results on ``model``, from a sweep run once per session
    (alternating fresh processes) or, with BENCH_RESULTS, replayed from that file (never a new sweep: a run that was
    cut short is checked on what it measured). Skips the test if an implementation in ``needed`` has no samples.
    """

    def get(model: str, *needed: str) -> Dict[str, List[dict]]:
        if BENCH_RESULTS:
            runs = _replayed().get(model, {})
        else:
            if model not in _sweeps:
                if BENCH_DEVICE == "cuda":
                    _sweeps.update(run_sweep([model], BENCH_IMPLEMENTATIONS, rounds=BENCH_ROUNDS, steps=30, warmup=10,
                                             threads=8, device="cuda", preset="report", windows=2))
                else:
                    _sweeps.update(run_sweep([model], rounds=BENCH_ROUNDS))
            runs = _sweeps[model]
        missing = [impl for impl in dict.fromkeys(needed) if not runs.get(impl)]
        if missing:
            failed = [f"{f['impl']}: {f['error'].strip().splitlines()[-1]}" for f in _replay.get("failures", [])
                      if f["model"] == model and f["impl"] in missing]
            pytest.skip(f"{BENCH_RESULTS} holds no samples of {' and '.join(missing)} on {model}"
                        + (f" (failed: {'; '.join(failed)})" if failed else " (not measured)"))
        return runs

    return get


def pytest_terminal_summary(terminalreporter):
    """with BENCH_RESULTS, one line naming the configurations it lacks and the workers that failed"""
    if not BENCH_RESULTS or not _replay:
        return
    missing, failures = _missing(), _replay["failures"]
    terminalreporter.write_line(
        f"replayed {BENCH_RESULTS}: " + (f"no samples of {', '.join(missing)}" if missing else "every configuration")
        + (f"; {len(failures)} failed worker(s): "
           + ", ".join(f"{f['model']} {f['impl']} round {f['round']}" for f in failures) if failures else "")
    )


class ReplayTimer:
    """
    A clock for pytest-benchmark whose consecutive (start, end) readings differ by samples measured elsewhere (in
    the worker processes), so that pytest-benchmark's statistics, JSON and ``--benchmark-compare`` cover them.
    """

    def __init__(self, samples: List[float]):
        starts = itertools.accumulate([0.0] + list(samples[:-1]))
        self._readings = itertools.chain.from_iterable((t, t + s) for t, s in zip(starts, samples))

    def __call__(self) -> float:
        return next(self._readings)


def record_samples(benchmark, samples: List[float]) -> None:
    """report ``samples`` (seconds, one per round) as this benchmark's measured rounds"""
    benchmark._timer = ReplayTimer(samples)  # pytest-benchmark's runner reads the clock from this attribute
    benchmark.pedantic(lambda: None, rounds=len(samples), iterations=1)
