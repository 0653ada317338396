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
# running one: benchmarks/gpu_run.sh measures once and checks the targets on the same samples
BENCH_RESULTS = os.environ.get("HIVEMIND_ACCUM_BENCH_RESULTS")

_sweeps: Dict[str, Dict[str, List[dict]]] = {}
RESULTS_STORAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pytest-benchmark")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """save every benchmark run, with its samples, under benchmarks/results/ (for ``--benchmark-compare``)"""
    config.option.benchmark_autosave = config.option.benchmark_autosave or get_tag()  # what --benchmark-autosave stores
    config.option.benchmark_save_data = True
    if config.option.benchmark_storage in (None, "file://./.benchmarks"):
        config.option.benchmark_storage = f"file://{RESULTS_STORAGE}"


@pytest.fixture(scope="session")
def sweep_results():
    """``get(model)`` runs (once per session) every implementation on ``model`` in alternating fresh processes"""

    def get(model: str) -> Dict[str, List[dict]]:
        if BENCH_RESULTS and not _sweeps:
            with open(BENCH_RESULTS) as f:
                _sweeps.update(json.load(f)["raw"])
        if model not in _sweeps:
            if BENCH_DEVICE == "cuda":
                _sweeps.update(run_sweep([model], BENCH_IMPLEMENTATIONS, rounds=BENCH_ROUNDS, steps=30, warmup=10,
                                         threads=8, device="cuda", preset="report", windows=2))
            else:
                _sweeps.update(run_sweep([model], rounds=BENCH_ROUNDS))
        return _sweeps[model]

    return get


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
