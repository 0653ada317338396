"""
The GPU run's bookkeeping, checked on the CPU with fake workers: the sweep records a failing worker and goes on,
writes its results after every worker, and the benchmark targets replay a saved sweep without measuring anew.
"""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import sweep
from benchmarks.micro_step_worker import WORK_KEYS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_result(impl: str, model: str) -> dict:
    """what a worker prints, with equal times for every implementation"""
    return dict(impl=impl, model=model, device="cpu", params=1000, tensors=2, batch_size=4, micro_step=[0.01, 0.01],
                no_sync_step=[] if impl == "native" else [1e-4, 1e-4], load=[] if impl == "native" else [1e-3],
                peak_rss_bytes=2**20, peak_device_bytes=None, work=dict.fromkeys(WORK_KEYS, 0))


def test_sweep_records_a_failed_worker_and_goes_on(monkeypatch, tmp_path):
    calls = []

    def run_configuration(impl, model, *args, **kwargs):
        if calls:  # every earlier worker is already on disk
            saved = json.loads((tmp_path / "s.json").read_text())
            assert len(saved["raw"]["m"][calls[-1]]) == 1 or saved["failures"][-1]["impl"] == calls[-1]
        calls.append(impl)
        if impl == "exact":
            raise RuntimeError("python -m benchmarks.micro_step_worker --impl exact failed:\nCUDA error: out of memory")
        return fake_result(impl, model)

    monkeypatch.setattr(sweep, "run_configuration", run_configuration)
    with pytest.raises(SystemExit, match=r"1 worker\(s\) failed"):
        sweep.main(["--models", "m", "--impls", "native", "exact", "inplace", "--rounds", "1", "--no-plot",
                    "--output-dir", str(tmp_path), "--name", "s"])
    assert calls == ["native", "exact", "inplace"]
    saved = json.loads((tmp_path / "s.json").read_text())
    assert [len(saved["raw"]["m"][impl]) for impl in ("native", "exact", "inplace")] == [1, 0, 1]
    assert [(f["model"], f["impl"], f["round"]) for f in saved["failures"]] == [("m", "exact", 1)]
    assert [row["impl"] for row in saved["rows"]] == ["native", "inplace"]
    assert "- m exact round 1: CUDA error: out of memory" in (tmp_path / "s.md").read_text()


def test_merge_adds_to_saved_results(monkeypatch, tmp_path):
    monkeypatch.setattr(sweep, "run_configuration", lambda impl, model, *a, **k: fake_result(impl, model))
    common = ["--models", "m", "--rounds", "1", "--no-plot", "--output-dir", str(tmp_path), "--name", "s"]
    sweep.main(common + ["--impls", "native", "upstream"])
    sweep.main(common + ["--impls", "upstream_reuse", "--merge"])
    saved = json.loads((tmp_path / "s.json").read_text())
    assert {impl: len(runs) for impl, runs in saved["raw"]["m"].items()} == dict(native=1, upstream=1, upstream_reuse=1)
    assert [row["throughput_vs_native"] for row in saved["rows"]] == [1.0, 1.0, 1.0]


def test_targets_replay_what_exists_and_name_what_is_missing(tmp_path):
    """a model the saved sweep lacks is skipped and named, not measured (a new sweep would outlast the stage)"""
    raw = {"linear-1m": {impl: [fake_result(impl, "linear-1m")] for impl in ("native", "upstream", "exact", "inplace")}}
    raw["linear-1m"]["exact"] = []
    failures = [dict(model="linear-1m", impl="exact", round=1, error="...failed:\nKilled")]
    (tmp_path / "sweep.json").write_text(json.dumps(dict(raw=raw, failures=failures)))
    env = dict(os.environ, HIVEMIND_ACCUM_BENCH_RESULTS=str(tmp_path / "sweep.json"),
               HIVEMIND_ACCUM_BENCH_MODELS="linear-1m mlp-2x4", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "benchmarks/test_local_accumulation.py",
         "--benchmark-only", "--benchmark-storage", f"file://{tmp_path}/storage"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # linear-1m: 3 micro-step, 2 no-sync step and 2 load benchmarks; the exact ones and all of mlp-2x4's skipped
    assert "7 passed, 17 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "holds no samples of exact on linear-1m (failed: exact: Killed)" in proc.stdout
    assert "holds no samples of native on mlp-2x4 (not measured)" in proc.stdout
    assert ("no samples of linear-1m exact, mlp-2x4 native, mlp-2x4 upstream, mlp-2x4 exact, mlp-2x4 inplace; "
            "1 failed worker(s): linear-1m exact round 1") in proc.stdout
