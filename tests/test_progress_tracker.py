"""
This package's ProgressTracker against upstream's: what peers read from the DHT (fields, values, refreshes) is the
same, and a report builds no pydantic model in the reporting thread (the record is built when read).
"""
import threading

import hivemind
import pytest
from hivemind.optim import progress_tracker as upstream
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic.v1 import ValidationError

import hivemind_accum
from hivemind_accum.integration.progress_tracker import ProgressTracker
from tests.conftest import swarm, wait_for

# every test starts DHT processes: run each in its own forked process, so that later tests' forked peers inherit none
# of its state (a soak peer forked after these ran in the test process never saw its swarm)
pytestmark = pytest.mark.forked

FAST = dict(min_refresh_period=0.1, max_refresh_period=0.2, default_refresh_period=0.1)


class BuildCounter:
    """counts LocalTrainingProgress models built (validated), by thread"""

    def __init__(self, monkeypatch):
        self.by_thread = {}
        original = LocalTrainingProgress.__init__

        def counting_init(model, **fields):
            ident = threading.get_ident()
            self.by_thread[ident] = self.by_thread.get(ident, 0) + 1
            original(model, **fields)

        monkeypatch.setattr(LocalTrainingProgress, "__init__", counting_init)

    def here(self) -> int:
        return self.by_thread.get(threading.get_ident(), 0)


def published(dht: hivemind.DHT, key: str) -> dict:
    """every peer's record under ``key`` as the DHT holds it, keyed by (epoch, samples_accumulated)"""
    found = dht.get(key, latest=True)
    records = [entry.value for entry in (found.value.values() if found else ()) if entry.value is not None]
    return {(record["epoch"], record["samples_accumulated"]): record for record in records}


def test_peers_read_the_same_records_as_from_an_upstream_tracker():
    with swarm(2) as (ours_dht, upstream_dht):
        reader_dht = upstream_dht  # reads with the trackers' validators (a DHT without them finds nothing)
        # distinct keys: by default both trackers of this process would sign with one key, as one peer
        ours = ProgressTracker(ours_dht, "run", target_batch_size=1000, private_key=RSAPrivateKey(), start=True, **FAST)
        theirs = upstream.ProgressTracker(upstream_dht, "run", target_batch_size=1000, private_key=RSAPrivateKey(),
                                          start=True, **FAST)
        try:
            for samples in (3, 8, 20):
                ours.report_local_progress(0, samples)
                theirs.report_local_progress(0, samples + 1)
                # every report is published (the reporter thread wakes as upstream's does): the reader sees it
                wait_for(lambda: {(0, samples), (0, samples + 1)} <= set(published(reader_dht, "run_progress")))
            records = published(reader_dht, "run_progress")
            mine, upstream_record = records[0, 20], records[0, 21]
            assert set(mine) == set(upstream_record) == set(LocalTrainingProgress.__fields__)
            assert mine["peer_id"] == ours_dht.peer_id.to_bytes() and mine["client_mode"] is False
            assert mine["samples_per_second"] == ours.local_progress.samples_per_second > 0
            assert abs(mine["time"] - get_dht_time()) < 30
            assert LocalTrainingProgress.parse_obj(mine) == ours.local_progress
            # each tracker's swarm view counts both peers' samples: upstream's parses ours and ours parses upstream's
            for tracker in ours, theirs:
                wait_for(lambda: tracker.global_progress.samples_accumulated == 41)
                assert tracker.global_progress.num_peers == 2
            ours.report_local_progress(1, 0)  # a new epoch: samples reset, the reset is published too
            wait_for(lambda: (1, 0) in published(reader_dht, "run_progress"))
            wait_for(lambda: theirs.global_progress.epoch == 1)
            assert not ours.ready_to_update_epoch or ours.global_progress.eta_next_epoch <= get_dht_time()
        finally:
            ours.shutdown()
            theirs.shutdown()


def test_report_builds_no_model_until_read(monkeypatch, dht):
    tracker = ProgressTracker(dht, "lazy", target_batch_size=1000, start=False)
    counter = BuildCounter(monkeypatch)
    for samples in range(1, 6):
        tracker.report_local_progress(0, samples)
    assert counter.here() == 0
    progress = tracker.local_progress
    assert counter.here() == 1 and tracker.local_progress is progress  # built once per report
    assert (progress.epoch, progress.samples_accumulated, progress.client_mode) == (0, 5, False)
    assert progress.samples_per_second == tracker.performance_ema.samples_per_second
    assert tracker.global_progress.samples_accumulated == 5  # upstream's bookkeeping of the swarm's samples
    tracker.report_local_progress(0, 2, update_global_samples=False)
    assert tracker.local_progress.samples_accumulated == 2 and tracker.global_progress.samples_accumulated == 5
    assert counter.here() == 2


@pytest.mark.parametrize("epoch, samples", [(-1, 0), (0, -3), (0, 2.0), (True, 1), (0, None)])
def test_invalid_reports_raise_as_upstream(dht, epoch, samples):
    trackers = [cls(dht, f"bad_{cls.__module__}", target_batch_size=10, start=False)
                for cls in (ProgressTracker, upstream.ProgressTracker)]
    for tracker in trackers:
        tracker.report_local_progress(0, 1)
        with pytest.raises((ValidationError, TypeError)):
            tracker.report_local_progress(epoch, samples)
        assert tracker.local_progress.samples_accumulated == 1  # the failed report left the last record
    ours, theirs = trackers
    assert ours.global_progress.samples_accumulated == theirs.global_progress.samples_accumulated


def test_optimizer_no_sync_step_builds_no_model_and_polls_nothing(monkeypatch, dht):
    import torch

    model = torch.nn.Linear(4, 4)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="count", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**6, batch_size_per_step=2, reuse_grad_buffers=True, verbose=False,
    )
    try:
        assert isinstance(opt.tracker, ProgressTracker)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        counter = BuildCounter(monkeypatch)
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert counter.here() == 0
        assert opt.local_progress.samples_accumulated == 16 and counter.here() == 1
    finally:
        opt.shutdown()


class _Timers:
    """stands in for ``threading.Timer`` in the tracker's module: records each timer, starts none"""

    def __init__(self):
        self.made = []

    def __call__(self, delay, function):
        timers = self

        class Timer:
            daemon = False

            def start(self):
                timers.made.append((delay, function))

            def cancel(self):
                pass

        return Timer()


@pytest.mark.parametrize("cls", [ProgressTracker, upstream.ProgressTracker], ids=["ours", "upstream"])
def test_no_sync_micro_steps_wake_the_reporter_only_when_peers_would_see_it(monkeypatch, dht, cls):
    """upstream's tracker wakes its reporter thread (a DHT store) at every micro-step; ours at a new epoch, a reset,
    a reached target, and at most every half min_refresh_period (peers fetch no more often), a report it did not
    publish at once at most that much later (a timer)"""
    from hivemind.optim import progress_tracker as upstream_module

    from hivemind_accum.integration import progress_tracker as ours_module

    now = [1000.0]
    for module in (upstream_module, ours_module):
        monkeypatch.setattr(module, "get_dht_time", lambda: now[0])
    timers = _Timers()
    monkeypatch.setattr(ours_module.threading, "Timer", timers)
    tracker = cls(dht, f"wake_{cls.__module__}", target_batch_size=200, start=False, min_refresh_period=1.0)
    wakes = []
    monkeypatch.setattr(tracker.should_report_progress, "set", lambda: wakes.append(now[0]))
    for step in range(1, 21):  # 20 micro-steps, 10 ms apart: within half a refresh period
        now[0] += 0.01
        tracker.report_local_progress(0, 4 * step)
    if cls is upstream.ProgressTracker:
        assert len(wakes) == 20
        return
    assert len(wakes) == 1 and len(timers.made) == 1  # the first report, and one deferred wake-up for the rest
    delay, wake = timers.made[0]
    assert delay == pytest.approx(0.5 - 0.01)
    wake()
    assert len(wakes) == 2 and tracker._woken[1] == 80  # the latest record is what the reporter publishes
    now[0] += 0.5
    tracker.report_local_progress(0, 84)  # half a refresh period since the last wake-up
    tracker.report_local_progress(0, 0)  # a reset (an overflow): progress went back
    tracker.report_local_progress(1, 0)  # a new epoch
    assert len(wakes) == 5
    tracker.report_local_progress(1, 200)  # the swarm may have reached its target
    assert len(wakes) == 6
