"""
Medians with a 95 % bootstrap interval, and the verdict an interval gives on a target: one place for both.
"""
import random
import statistics
from typing import Sequence, Tuple


def bootstrap_interval(values: Sequence[float], resamples: int = 10_000, seed: int = 0) -> Tuple[float, float, float]:
    """the median of ``values`` and a 95 % percentile-bootstrap interval of it: ``(median, low, high)``"""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdict(interval: Tuple[float, float, float], target: float) -> str:
    """
    "holds" if the interval's lower bound clears ``target``, "falls short" if its upper bound is below it, else
    "undecided" (the measurement cannot tell)
    """
    _, low, high = interval
    if low >= target:
        return "holds"
    if high < target:
        return "falls short"
    return "undecided"
