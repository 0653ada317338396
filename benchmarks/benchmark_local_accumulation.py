"""
The main job: ``python benchmarks/benchmark_local_accumulation.py [--verbose] [--models large]`` from the repository
root. It prints one screen comparing hivemind_accum with upstream hivemind 1.1.12 and native PyTorch accumulation;
the code is in :mod:`benchmarks.main_job`, the explanation in docs/measurement.md#the-main-job.
"""
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout: import this repository's packages

from benchmarks.main_job.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
