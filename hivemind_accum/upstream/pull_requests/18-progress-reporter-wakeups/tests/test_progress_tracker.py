import pytest

import hivemind
from hivemind.optim import progress_tracker
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time


@pytest.mark.forked
def test_progress_tracker_wakes_reporter_only_when_peers_would_see_it(monkeypatch):
    clock = [get_dht_time()]
    monkeypatch.setattr(progress_tracker, "get_dht_time", lambda: clock[0])
    dht = hivemind.DHT(start=True)
    tracker = ProgressTracker(dht, "my_exp", target_batch_size=100, min_refresh_period=1.0, start=True)
    wakeups = []  # samples_accumulated of the progress the reporter was woken up for
    wake_reporter = tracker.should_report_progress.set

    def record_wakeup():
        wakeups.append(tracker.local_progress.samples_accumulated)
        wake_reporter()

    monkeypatch.setattr(tracker.should_report_progress, "set", record_wakeup)
    try:
        for samples in range(1, 21):  # 20 micro-steps 10 ms apart, all within min_refresh_period / 2
            clock[0] += 0.01
            tracker.report_local_progress(0, samples)
        assert wakeups == [1]  # the first report; on master, every report wakes the reporter (a DHT store)

        delayed_report = tracker._delayed_report  # publishes the latest report half a refresh period after the first
        assert delayed_report.interval == pytest.approx(0.5 - 0.01)
        delayed_report.join()
        assert wakeups == [1, 20]

        tracker.report_local_progress(0, 100)  # the swarm may have reached target_batch_size
        tracker.report_local_progress(1, 0)  # a new epoch
        assert wakeups == [1, 20, 100, 0]
    finally:
        tracker.shutdown()
        dht.shutdown()
