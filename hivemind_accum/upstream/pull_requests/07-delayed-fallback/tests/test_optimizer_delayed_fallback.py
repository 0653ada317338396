import threading
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
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_delayed_grad_averaging_falls_back_to_the_rounds_gradients(reuse_grad_buffers: bool):
    dht = DHT(start=True)
    other_dht, other_tracker = launch_peer_that_never_averages(dht, "test_delayed_fallback", target_batch_size=4)

    model = nn.Linear(3, 2, bias=False)
    grad = torch.randn(2, 3)
    opt = Optimizer(
        dht=dht,
        run_id="test_delayed_fallback",
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=4,
        batch_size_per_step=2,
        reuse_grad_buffers=reuse_grad_buffers,
        offload_optimizer=True,
        delay_optimizer_step=True,
        delay_grad_averaging=True,
        matchmaking_time=1.0,
        averaging_timeout=3.0,
        average_state_every=10**6,
        tracker_opts=dict(max_refresh_period=2.0),
    )

    def micro_step(gradient: torch.Tensor):
        if not reuse_grad_buffers:
            opt.zero_grad()
        (model.weight * gradient).sum().backward()
        opt.step()

    # the round's result is awaited in the background; hold it until the next epoch has accumulated a micro-step
    next_epoch_accumulated, fell_back = threading.Event(), threading.Event()
    round_failed = []
    average_and_load = opt._average_gradients_and_load_into_optimizer

    def average_after_next_micro_step(control):
        assert next_epoch_accumulated.wait(60)
        try:
            average_and_load(control)
            control.result(timeout=0)  # raises if the round failed or is still running: the optimizer gave up on it
            round_failed.append(False)
        except BaseException:
            round_failed.append(True)
        finally:
            fell_back.set()

    try:
        with mock.patch.object(opt.grad_averager, "step", wraps=opt.grad_averager.step) as begin_round:
            with mock.patch.object(opt, "_average_gradients_and_load_into_optimizer", average_after_next_micro_step):
                # micro-steps until an epoch ends with its round begun (once this peer sees the other one)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    opt.state_averager.step(wait_for_delayed_updates=True)  # apply an earlier epoch's step, if any
                    begin_round.reset_mock()
                    epoch, weight_before = opt.local_epoch, model.weight.detach().clone()
                    micro_step(grad)
                    if opt.local_epoch != epoch and begin_round.called:
                        break
                    time.sleep(0.1)
                assert begin_round.called
                # the next epoch's first micro-step, accumulated before the round ends (without opt.step(), which
                # could end that epoch too)
                if not reuse_grad_buffers:
                    opt.zero_grad()
                (model.weight * 10 * grad).sum().backward()
                opt.grad_averager.accumulate_grads_(batch_size=2)
                next_epoch_accumulated.set()
                assert fell_back.wait(60)
                opt.state_averager.step(wait_for_delayed_updates=True)  # wait for the delayed step and apply it
        assert round_failed == [True]
        # SGD with lr=1 steps by the round's mean local gradient, not by the next epoch's
        assert torch.allclose(model.weight, weight_before - grad)
    finally:
        next_epoch_accumulated.set()
        opt.shutdown()
        other_tracker.shutdown()
        other_dht.shutdown()
        dht.shutdown()
