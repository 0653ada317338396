import time
from functools import partial
from unittest import mock

import pytest
import torch
import torch.nn as nn
from test_optimizer_fallback import launch_peer_that_never_averages

from hivemind.averaging.control import AveragingStage
from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_gradient_averaging_round_without_pre_scheduling_ends_by_its_deadline():
    dht = DHT(start=True)
    other_dht, other_tracker = launch_peer_that_never_averages(dht, "test_round_deadline", target_batch_size=4)
    model = nn.Linear(3, 2, bias=False)
    opt = Optimizer(
        dht=dht,
        run_id="test_round_deadline",
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=4,
        batch_size_per_step=2,
        matchmaking_time=1.0,
        averaging_timeout=3.0,
        average_state_every=10**6,
        tracker_opts=dict(max_refresh_period=2.0),
    )
    rounds = []
    step_averager = opt.grad_averager.step

    def step_and_record_round(*args, **kwargs):
        rounds.append(step_averager(*args, **kwargs))
        return rounds[-1]

    try:
        # no pre-scheduled round: a round begins when an epoch ends (once this peer sees the other), no one joins it
        with mock.patch.object(opt, "_maybe_schedule_gradient_averaging"):
            with mock.patch.object(opt.grad_averager, "step", step_and_record_round):
                deadline = time.monotonic() + 60
                while not rounds and time.monotonic() < deadline:
                    opt.zero_grad()
                    model.weight.sum().backward()
                    opt.step()
                    time.sleep(0.1)
        assert len(rounds) == 1
        # the optimizer stopped waiting after averaging_timeout; the round must end too, not keep looking for a group
        deadline = time.monotonic() + 15
        while rounds[0].stage != AveragingStage.FINISHED and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rounds[0].done() and rounds[0].stage == AveragingStage.FINISHED
    finally:
        opt.shutdown()
        other_tracker.shutdown()
        other_dht.shutdown()
        dht.shutdown()
