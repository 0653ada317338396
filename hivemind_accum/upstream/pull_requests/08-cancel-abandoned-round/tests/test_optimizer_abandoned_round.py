import time
from functools import partial
from unittest import mock

import pytest
import torch
import torch.nn as nn
from test_optimizer_fallback import launch_peer_that_never_averages

from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_optimizer_cancels_the_round_it_stopped_waiting_for():
    dht = DHT(start=True)
    other_dht, other_tracker = launch_peer_that_never_averages(dht, "test_abandoned_round", target_batch_size=4)
    model = nn.Linear(3, 2, bias=False)
    opt = Optimizer(
        dht=dht,
        run_id="test_abandoned_round",
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=4,
        batch_size_per_step=2,
        matchmaking_time=1.0,
        averaging_timeout=3.0,
        average_state_every=10**6,
        tracker_opts=dict(max_refresh_period=2.0),
    )

    def micro_step():
        opt.zero_grad()
        model.weight.sum().backward()
        opt.step()

    rounds = []
    begin_round = opt.grad_averager.step

    def begin_and_record_round(*args, **kwargs):
        rounds.append(begin_round(*args, **kwargs))
        return rounds[-1]

    try:
        # no pre-scheduled round: the round begins when the epoch ends, without a deadline, and no one joins it
        with mock.patch.object(opt, "_maybe_schedule_gradient_averaging"):
            micro_step()
            deadline = time.monotonic() + 60
            while opt.tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert opt.tracker.global_progress.num_peers == 2

            with mock.patch.object(opt.grad_averager, "step", begin_and_record_round):
                for _ in range(10):
                    micro_step()
                    if rounds:
                        break
        assert len(rounds) == 1
        # the optimizer waited averaging_timeout, then stepped with the local gradients; the round must not go on
        assert rounds[0].done() and rounds[0].cancelled()
    finally:
        opt.shutdown()
        other_tracker.shutdown()
        other_dht.shutdown()
        dht.shutdown()
