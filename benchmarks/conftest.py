import itertools
import os
from typing import Dict, List

import pytest

from benchmarks.sweep import DEFAULT_MODELS, run_sweep

BENCH_MODELS = tuple(os.environ.get("HIVEMIND_ACCUM_BENCH_MODELS", " ".join(DEFAULT_MODELS)).split())
BENCH_ROUNDS = int(os.environ.get("HIVEMIND_ACCUM_BENCH_ROUNDS", "2"))

_sweeps: Dict[str, Dict[str, List[dict]]] = {}


@pytest.fixture(scope="session")
def sweep_results():
    """``get(model)`` runs (once per session) every implementation on ``model`` in alternating fresh processes"""

    def get(model: str) -> Dict[str, List[dict]]:
        if model not in _sweeps:
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
