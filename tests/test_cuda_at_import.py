"""
Collecting the CUDA test modules makes no CUDA call in the pytest process.

Such a call, ``torch.cuda.is_available()`` included, poisons fork: on a CUDA machine every later
``@pytest.mark.forked`` CUDA test then fails with "Cannot re-initialize CUDA in forked subprocess". The parent still
reads ``torch.cuda.is_initialized() == False``; only a forked child sees the poison
(``torch.cuda._is_in_bad_fork()``). A CUDA build of torch poisons fork on a machine without a GPU too, so this test
catches a regression there (CI's torch 2.14.1 stage); with a CPU build it passes trivially.
"""
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the modules whose CUDA cases run in benchmarks/gpu_run.sh, and the benchmark targets it collects after them
COLLECTED = ("tests/test_cost_guards.py", "tests/test_mixed_precision.py", "benchmarks/test_local_accumulation.py")

# collects as pytest does, then forks once and asks the child whether it inherited a poisoned CUDA state
PROBE = """
import json, os, sys
import pytest
exit_code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
import torch
pid = os.fork()
if pid == 0:
    os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
_, status = os.waitpid(pid, 0)
print(json.dumps(dict(exit_code=int(exit_code), initialized=torch.cuda.is_initialized(),
                      child_in_bad_fork=os.waitstatus_to_exitcode(status) == 3)))
"""


@pytest.mark.timeout(300)
def test_collecting_cuda_test_modules_leaves_cuda_untouched():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
               HIVEMIND_ACCUM_BENCH_DEVICE="cuda")
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # as a plain pytest run starts: tests/conftest.py sets it
    proc = subprocess.run([sys.executable, "-c", PROBE, *COLLECTED], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict(exit_code=0, initialized=False, child_in_bad_fork=False), proc.stdout[-3000:]
