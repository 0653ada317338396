import multiprocessing as mp
import time
from functools import partial
from unittest import mock

import pytest
import torch
import torch.nn as nn

from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer
from hivemind.optim.progress_tracker import ProgressTracker


def _run_silent_peer(run_id: str, maddrs_pipe, stop_event):
    """a peer that reports progress once and never averages gradients"""
    dht = DHT(start=True)
    tracker = ProgressTracker(
        dht,
        prefix=run_id,
        target_batch_size=4,
        start=True,
        metadata_expiration=600,
        min_refresh_period=600,
        max_refresh_period=600,
        default_refresh_period=600,
    )
    try:
        tracker.performance_ema.update(task_size=1, interval=10**6)  # a slow peer: its progress estimate stays put
        tracker.report_local_progress(local_epoch=0, samples_accumulated=1)
        while dht.get(f"{run_id}_progress", latest=True) is None:
            time.sleep(0.1)
        maddrs_pipe.send(dht.get_visible_maddrs())
        stop_event.wait(timeout=120)
    finally:
        tracker.shutdown()
        dht.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_optimizer_falls_back_to_local_gradients_after_failed_averaging(reuse_grad_buffers: bool):
    # the other peer's progress makes this peer begin its gradient averaging round, which then fails: no one joins it
    maddrs_receiver, maddrs_sender = mp.Pipe(duplex=False)
    stop_event = mp.Event()
    silent_peer = mp.Process(target=_run_silent_peer, args=("test_fallback", maddrs_sender, stop_event))
    silent_peer.start()
    dht = opt = None
    try:
        assert maddrs_receiver.poll(timeout=60)
        dht = DHT(start=True, initial_peers=maddrs_receiver.recv())
        model = nn.Linear(3, 2, bias=False)
        grad = torch.randn(2, 3)
        opt = Optimizer(
            dht=dht,
            run_id="test_fallback",
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=1.0),
            target_batch_size=4,
            batch_size_per_step=2,
            reuse_grad_buffers=reuse_grad_buffers,
            matchmaking_time=1.0,
            averaging_timeout=3.0,
            average_state_every=10**6,
            tracker_opts=dict(max_refresh_period=2.0),
        )

        def micro_step():
            if not reuse_grad_buffers:
                opt.zero_grad()
            (model.weight * grad).sum().backward()  # the gradient is `grad` at every micro-step
            opt.step()

        micro_step()
        deadline = time.monotonic() + 60
        while opt.tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert opt.tracker.global_progress.num_peers == 2

        with mock.patch.object(opt.grad_averager, "step", wraps=opt.grad_averager.step) as begin_round:
            with mock.patch.object(
                opt, "_load_local_gradients_into_optimizer", wraps=opt._load_local_gradients_into_optimizer
            ) as fall_back:
                for _ in range(10):  # micro-steps until an epoch ends with its round begun (and failed)
                    begin_round.reset_mock()
                    fall_back.reset_mock()
                    epoch, weight_before = opt.local_epoch, model.weight.detach().clone()
                    micro_step()
                    if opt.local_epoch != epoch and begin_round.called:
                        break
        assert begin_round.called and fall_back.called
        # SGD with lr=1 steps by the mean local gradient, not by zeros
        assert torch.allclose(model.weight, weight_before - grad)
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()
        stop_event.set()
        silent_peer.join(timeout=30)
