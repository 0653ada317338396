"""
The GPU run's bookkeeping, checked on the CPU: the sweep records a failing worker and goes on, writes its results
after every worker, and the benchmark targets replay a saved sweep without measuring anew (fake workers); the kernel
launch counts the CUDA targets are computed from (hand-computed cases, and the op count of exact mode's step); the
main job's claims on synthetic rows (load, and reasons that agree with their numbers); the memory table's counts;
the swarm benchmark's split of unused micro-steps and its tbf arguments; the GPU protocol's paired ratios and verdicts.
"""
import json
import os
import subprocess
import sys

import pytest

import torch

from benchmarks import memory_table, micro_step_worker, sweep
from benchmarks.kernel_launches import (
    CHUNK_SIZE,
    EXACT_HIVEMIND_STEP_OTHER_OPS,
    EXACT_STEP_OTHER_OPS,
    multi_tensor_launches,
)
from benchmarks.micro_step_worker import WORK_KEYS
from hivemind_accum import torch_compat as torch_internals
from hivemind_accum.buffers import finite_add

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
    # linear-1m: 3 micro-step and 2 no-sync step benchmarks; the exact ones and all of mlp-2x4's skipped
    assert "5 passed, 15 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "holds no samples of exact on linear-1m (failed: exact: Killed)" in proc.stdout
    assert "holds no samples of native on mlp-2x4 (not measured)" in proc.stdout
    assert ("no samples of linear-1m exact, mlp-2x4 native, mlp-2x4 upstream, mlp-2x4 exact, mlp-2x4 inplace; "
            "1 failed worker(s): linear-1m exact round 1") in proc.stdout


@pytest.mark.parametrize(
    "numels, depth, large, launches",
    [
        ([], 2, False, 0),
        ([0, 0], 2, False, 0),  # empty tensors are left out
        ([1], 2, False, 1),
        ([1] * 64, 2, False, 1),  # 64 tensors fill one launch of a two-list op
        ([1] * 65, 2, False, 2),
        ([1] * 128, 2, False, 2),
        ([1] * 110, 1, False, 1),  # 110 tensors of a one-list op
        ([1] * 111, 1, False, 2),
        ([1] * 30, 5, False, 1),
        ([1] * 31, 5, False, 2),
        ([320 * CHUNK_SIZE], 2, False, 1),  # 320 blocks fill one launch
        ([320 * CHUNK_SIZE + 1], 2, False, 2),
        ([319 * CHUNK_SIZE, 2 * CHUNK_SIZE], 2, False, 2),  # the second tensor is cut, its last chunk goes on
        ([1] * 63 + [3 * CHUNK_SIZE], 2, False, 1),  # the 64th tensor fills the launch only with its last chunk
        ([1] * 63 + [3 * CHUNK_SIZE, 1], 2, False, 2),
        ([CHUNK_SIZE + 1] * 200, 2, False, 4),  # 400 blocks by 64 tensors: 64, 64, 64, 8 tensors
        ([4 * CHUNK_SIZE] * 100, 2, False, 2),  # 64 tensors (256 blocks) fill a launch before 320 blocks do
        ([1] * 448, 2, True, 1),  # 32 KB kernel arguments: 448 tensors, 2240 blocks
        ([1] * 449, 2, True, 2),
        ([2240 * CHUNK_SIZE, 1], 1, True, 2),
    ],
)
def test_multi_tensor_launches(numels, depth, large, launches):
    assert multi_tensor_launches(numels, depth, large_kernel_args=large) == launches


def test_multi_tensor_launches_rejects_a_depth_it_does_not_know():
    with pytest.raises(ValueError, match="depth: expected 1 to 5 tensor lists, got 6"):
        multi_tensor_launches([1], 6)


@pytest.mark.forked
@pytest.mark.parametrize("impl, other_ops", [("exact", EXACT_STEP_OTHER_OPS),
                                             ("exact_hivemind", EXACT_HIVEMIND_STEP_OTHER_OPS)])
@pytest.mark.parametrize("model", ["mlp-20x8", "mlp-200x8"])
def test_exact_step_runs_a_fixed_number_of_other_ops(model, impl, other_ops):
    """exact mode's loss-scaled no-sync step, on the path an accelerator takes (forced on the CPU), runs its two fused
    ops and a fixed number of others (one more pair with hivemind.GradScaler), for 40 and 400 tensors: what the CUDA
    kernel target counts on"""
    if not torch_internals.has_add_unless_found_inf(torch.device("cpu"), torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for _fused_sgd_: CUDA's path cannot run here")
    finite_add.host_check_is_free = lambda buckets: False
    result = micro_step_worker.run(impl, model, steps=1, warmup=2, batch_size=4, threads=1, precision="fp16")
    assert result["work"]["top_level_ops"] == 2 + other_ops, result["work"]


# ----------------------------------------------- the main job's claims --------------------------------------------
def _work_rows(**micro_step_ms):
    """work rows for every mode: in place and exact as cheap as native unless ``micro_step_ms`` says otherwise"""
    rows = {}
    for key in ("native", "upstream", "upstream_reuse", "exact", "inplace"):
        ms = micro_step_ms.get(key, 10.0)
        rows[key] = dict(no_sync_step_ms=1.0 if key in ("upstream", "exact") else 0.1, no_sync_step_fp16_ms=1.0,
                         step_ops=0, host_reads_fp16=0, accum_mb_fp32=0.0, accum_mb_fp16=0.0, fallback_mb=0.0,
                         micro_step_ms=ms, x_native=ms / 10.0, zero_grad_error=None)
    rows["upstream"]["step_ops"] = rows["upstream_reuse"]["host_reads_fp16"] = 1
    rows["upstream"]["accum_mb_fp32"] = 1.0
    rows["upstream_reuse"]["zero_grad_error"] = "ValueError: not allowed"
    return rows


def test_main_job_timing_claims_on_a_loaded_machine_are_not_judged():
    """on a loaded machine every timing claim is not judged, those whose numbers hold as those whose numbers fail"""
    from benchmarks.main_job.claims import UNEXPECTED, loaded, make_claims
    from benchmarks.main_job.report import format_claims

    work = _work_rows(inplace=34.5, upstream_reuse=10.0, upstream=12.0)  # in place 3.45x native
    idle = dict(cores=2, load_average=[0.9, 0.8, 0.7])
    busy = dict(cores=2, load_average=[3.1, 2.0, 1.0])
    assert loaded([idle, idle]) is None
    assert loaded([idle, busy]).startswith("not judged: the machine was loaded (1-minute load average 3.1 on 2 cores)")
    for load, judged in ((None, True), (loaded([idle, busy]), False)):
        claims = {c["text"]: c for c in make_claims(work, {}, load=load)}
        in_place = claims["accum in place micro-step within 1.03x native"]
        assert not in_place["holds"] and in_place["judged"] is judged
        assert (UNEXPECTED in in_place["why"]) is judged and ("not judged" in in_place["why"]) is not judged
        exact = claims["accum exact micro-step within 1.15x native"]  # 1.000x: its numbers hold
        assert exact["holds"] and exact["judged"] is judged and (exact["why"] is None) is judged
        counts = claims["accum exact tensor ops per no-sync step fewer than upstream"]
        assert counts["holds"] and counts["judged"]  # a count is judged on any machine
        timing = [c for c in claims.values() if c["a"].endswith(("ms", "x"))]
        assert len(timing) == 9 and all(c["judged"] is judged for c in timing)
        lines = format_claims(list(claims.values())).splitlines()
        assert sum(line.startswith("not judged") for line in lines) == (0 if judged else 9)


def test_main_job_vs_always_names_the_upstream_modes_number():
    """'a vs b': b is the upstream mode the claim names; a claim held to a target prints its one number"""
    from benchmarks.main_job.claims import make_claims
    from benchmarks.main_job.common import MODES
    from benchmarks.main_job.report import format_claims

    claims = make_claims(_work_rows(), {})
    upstream = (MODES["upstream"].label, MODES["upstream_reuse"].label)
    for c in claims:
        if c["b"] is None:
            assert "x native" in c["text"] and " vs " not in format_claims([c])
        else:
            assert any(label in c["text"] for label in upstream), c["text"]
    targets = {c["text"]: c for c in claims if c["b"] is None}
    assert sorted(targets) == ["accum exact micro-step within 1.15x native",
                               "accum in place micro-step within 1.03x native"]
    assert format_claims([targets["accum exact micro-step within 1.15x native"]]).endswith(": 1.000x")


@pytest.mark.parametrize("load_average", [None, [0.5, 0.4, 0.3], [12.0, 6.5, 3.2]])
def test_main_job_screen_from_the_committed_run_fits_120_columns(load_average):
    """the screen rebuilt from benchmarks/results/local_accumulation.json, idle and loaded, with today's claims"""
    from benchmarks.main_job.claims import loaded, make_claims
    from benchmarks.main_job.report import WIDTH, render

    with open(os.path.join(REPO_ROOT, "benchmarks", "results", "local_accumulation.json")) as file:
        report = json.load(file)
    if load_average is not None:
        sample = dict(cores=2, load_average=load_average)
        report["load"] = dict(start=sample, after_work=sample, end=sample)
    reason = loaded(list(report["load"].values())[:2]) if "load" in report else None
    report["claims"] = make_claims({row["mode"]: row for row in report["work"]},
                                   {(row["section"], row["mode"]): row for row in report["training"]}, load=reason)
    lines = render(report, "/tmp/hivemind_accum_main_job_jfhfuw6d")
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    assert any(line.startswith("Claims (26: ") for line in lines)
    assert sum(line.startswith("not judged") for line in lines) == (9 if reason else 0)


def test_main_job_outside_step_reason_agrees_with_its_numbers():
    """"not this package's cost" only where the time outside opt.step() is no more than the upstream mode's"""
    from benchmarks.main_job.claims import make_claims

    text = "accum exact micro-step within 1.15x native"
    # exact: 13.3 ms outside its 1 ms step; upstream: 10.9 ms outside its step: more, so not explained by it
    why = {c["text"]: c for c in make_claims(_work_rows(exact=24.3, upstream=21.9), {})}[text]["why"]
    assert "not this package's cost" not in why and "slower" in why
    why = {c["text"]: c for c in make_claims(_work_rows(exact=24.3, upstream=25.0), {})}[text]["why"]
    assert why.startswith("opt.step() 1.00 ms; 13.3 ms outside it") and "not this package's cost" in why


@pytest.mark.forked
@pytest.mark.parametrize("label, dtype, expected", [
    ("upstream, reuse_grad_buffers=False", torch.float16, (2, 2, 2)),
    ("exact", torch.float32, (4, 4, 4)),
    ("exact", torch.bfloat16, (2, 8, 2)),  # float32 staging buffer and accumulators, bf16 shared buffers
    ("exact, loss scaling on an accelerator", torch.float32, (4, 4, 4)),  # .grad unscaled in place: no staging
    ("exact, accumulate_in_fp32=False", torch.float16, (2, 2, 2)),
    ("exact, averaged_grads_dtype=torch.float32", torch.bfloat16, (2, 8, 4)),
    ("in place", torch.float16, (2, 0, 2)),
])
def test_memory_table_counts_each_buffer_once(dht, label, dtype, expected):
    """docs/guide.md's memory table: bytes per parameter element in .grad, accumulators and staging, shared buffers"""
    configuration = next(c for c in memory_table.CONFIGURATIONS if c[0] == label)
    held = memory_table.measure(dht, *configuration, dtype)
    # loss scaling keeps 8 float32 drop flags besides the buffers: 32 bytes over the MLP's 10 384 elements
    assert tuple(round(held[group], 2) for group in (".grad", "accumulators", "shared")) == expected, held


def test_swarm_training_splits_unused_micro_steps_by_why():
    from benchmarks.swarm_training import split_unused
    from benchmarks.links import burst_bytes, tbf_args

    # micro-steps 0-9: 2-3 dropped by a download (2 unused, 3 used), 7-9 unfinished, 5 lost, 8 used
    uses = [1, 1, 0, 1, 1, 0, 2, 0, 1, 0]
    assert split_unused(uses, dropped=[2, 3], final_window_start=7) == dict(download=1, unfinished=2, lost=1)
    assert split_unused(uses, dropped=[], final_window_start=10) == dict(download=0, unfinished=0, lost=4)
    assert split_unused([0, 0], dropped=[0, 1], final_window_start=0) == dict(download=2, unfinished=0, lost=0)
    assert tbf_args(1) == ["tbf", "rate", "1000kbit", "burst", "4096", "latency", "100ms"]
    assert burst_bytes(100) == 125000


def test_swarm_accounting_tallies_every_peer():
    from benchmarks.swarm_accounting import table, tally

    def peer(used, download, lost, weights):
        return dict(used=used, unused=dict(download=download, unfinished=0, lost=lost), weights=weights)

    runs = [dict(complete=True, config=dict(epochs=2), peers=[peer([3, 10, 1, 0], 2, 1, [60, 50]),
                                                             peer([0, 8, 0, 1], 0, 0, [40, 50])]),
            dict(complete=False, config=dict(epochs=1), peers=[peer([1, 5, 0, 0], 1, 0, [120])])]
    counts = tally(runs)
    assert counts == dict(used_0=4, used_1=23, used_2=1, used_more=1, download=3, unfinished=0, lost=1,
                          incomplete_runs=1, samples_per_epoch=110)  # the median of 100 and 120
    row = table([dict(setting="(a) defaults", delay=True, implementation="ours", counts=counts)]).splitlines()[-1]
    assert row == "| (a) defaults | yes | ours | 4 / 23 / 1 | 3 / 0 / 1 | 2 | 110 |"


@pytest.mark.parametrize("verbose", [False, True])
def test_main_job_progress_lines_fit_120_columns(verbose, capsys):
    """without a terminal (as under pytest), progress goes to stdout, wrapped to the screen's width"""
    from benchmarks.main_job.cli import progress_printer
    from benchmarks.main_job.report import WIDTH

    runs = "; ".join(f"training: mode {i}" for i in range(12))
    progress_printer(verbose)(f"[peers] 2 peers, target_batch_size=384, 12 runs in turn: {runs}")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and max(len(line) for line in lines) <= WIDTH, lines


# ------------------------------------------------ hivemind's shutdown noise -----------------------------------------
EXITED_SENDER = """
import multiprocessing as mp, sys, time
import hivemind
from hivemind.utils import get_dht_time
if sys.argv[1] == "filtered":
    from hivemind_accum.shutdown_noise import silence_exited_sender_errors
    silence_exited_sender_errors()

async def block(dht, node):
    time.sleep(1.5)  # holds the DHT's event loop: the next request waits in its pipe until its sender has exited

def send_and_exit(dht):
    dht.store("key", "value", get_dht_time() + 60, return_future=True)

if __name__ == "__main__":
    dht = hivemind.DHT(start=True)
    blocked = dht.run_coroutine(block, return_future=True)
    sender = mp.get_context("fork").Process(target=send_and_exit, args=(dht,))
    sender.start(), sender.join()
    blocked.result()
    dht.get("key")  # a round trip: the DHT has read the exited sender's request
    dht.shutdown()
"""


@pytest.mark.parametrize("mode", ["plain", "filtered"])
def test_exited_sender_error_is_silenced_only_by_the_filter(mode, tmp_path):
    """hivemind's DHT logs a request from an exited process as [ERROR] with a traceback; the filter drops it"""
    (tmp_path / "exited_sender.py").write_text(EXITED_SENDER)
    proc = subprocess.run([sys.executable, str(tmp_path / "exited_sender.py"), mode], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = "[hivemind.dht.dht._run:130]" in proc.stderr and "resource_sharer.py" in proc.stderr
    assert noise is (mode == "plain"), proc.stderr[-3000:]
    assert "[ERROR]" not in proc.stderr or mode == "plain", proc.stderr[-3000:]


def test_exited_sender_filter_passes_every_other_record():
    import logging

    from hivemind_accum.shutdown_noise import ExitedSenderFilter

    def record(func: str, error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            return logging.LogRecord("hivemind.dht.dht", logging.ERROR, __file__, 1, str(error), None, sys.exc_info(),
                                     func=func)

    keep = ExitedSenderFilter().filter
    assert keep(record("_run", FileNotFoundError(2, "No such file or directory")))  # not raised by resource_sharer
    assert keep(record("_run", RuntimeError("real")))
    assert keep(record("_run_coroutine", ConnectionResetError(104, "reset")))


@pytest.mark.parametrize("interval, expected", [
    ((1.00, 0.995, 1.01), "holds"), ((0.97, 0.96, 0.985), "falls short"), ((0.99, 0.98, 1.00), "undecided"),
])
def test_a_verdict_needs_the_whole_interval_on_one_side(interval, expected):
    from benchmarks.intervals import verdict

    assert verdict(interval, 0.99) == expected


def test_protocol_ratios_are_paired_per_block_and_few_blocks_give_no_verdict():
    from benchmarks.gpu_protocol import summarize

    # native's time drifts 2x over the blocks; in place is always 1 % slower in its block, upstream 20 %
    blocks = [dict(native=dict(time=t, main_cpu=0.001, other_cpu=0.0), inplace=dict(time=1.01 * t, main_cpu=0.001,
                   other_cpu=0.0), upstream_reuse=dict(time=1.2 * t, main_cpu=0.001, other_cpu=0.002))
              for t in [0.05 + 0.001 * i for i in range(50)]]
    summary = summarize(blocks, ["native", "inplace", "upstream_reuse"], target=0.98, min_blocks=30)
    median, low, high = summary["inplace"]["ratio"]
    assert median == low == high == pytest.approx(1 / 1.01)
    assert summary["inplace"]["verdict"] == "holds"
    assert summary["upstream_reuse"]["ratio"][0] == pytest.approx(1 / 1.2) and summary["upstream_reuse"]["verdict"] is None
    assert summary["upstream_reuse"]["other_cpu_ms"] == pytest.approx(2.0)
    assert summarize(blocks[:29], ["native", "inplace"], target=0.98, min_blocks=30)["inplace"]["verdict"] == "undecided"


def test_main_job_work_table_says_what_its_x_native_ratios_are():
    from benchmarks.main_job.report import work_section

    rows = [dict(label=label, params=10**6, tensors=2, micro_step_ms=ms, x_native=ms / 10.0)
            for label, ms in (("native", 10.0), ("accum exact", 11.0), ("accum in place", 8.5))]
    quiet = work_section(rows).splitlines()
    assert quiet[-2] == "x native below 1: accum in place 0.850" and "noise between processes" in quiet[-1]
    loaded = work_section(rows, "not judged: the machine was loaded (1-minute load average 7.0 on 2 cores)")
    assert "0.850" not in loaded and "1.100" not in loaded
    assert loaded.splitlines()[-1] == "x native left out: the machine was loaded (1-minute load average 7.0 on 2 cores)"


@pytest.mark.forked
def test_silencing_after_a_dht_started_warns_that_it_keeps_logging():
    import warnings

    import hivemind

    import hivemind_accum

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hivemind_accum.silence_exited_sender_errors()  # before any DHT: silent
    dht = hivemind.DHT(start=True)
    try:
        with pytest.warns(UserWarning, match=r"1 DHT\(s\) already started keep logging these errors; call it before"):
            hivemind_accum.silence_exited_sender_errors()
    finally:
        dht.shutdown()
