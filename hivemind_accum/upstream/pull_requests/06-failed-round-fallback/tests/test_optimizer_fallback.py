import time
from functools import partial
from typing import Tuple
from unittest import mock

import pytest
import torch
import torch.nn as nn

from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey


def launch_peer_that_never_averages(dht: DHT, run_id: str, target_batch_size: int) -> Tuple[DHT, ProgressTracker]:
    """Another peer that reports progress once and never averages: gradient averaging rounds begun with it fail"""
    other_dht = DHT(start=True, initial_peers=dht.get_visible_maddrs())
    other_tracker = ProgressTracker(
        other_dht,
        prefix=run_id,
        target_batch_size=target_batch_size,
        start=True,
        private_key=RSAPrivateKey(),  # its own record, not the process-wide key's
        metadata_expiration=600,
        min_refresh_period=600,
        max_refresh_period=600,
        default_refresh_period=600,
    )
    other_tracker.report_local_progress(local_epoch=0, samples_accumulated=1)
    return other_dht, other_tracker


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers, offload_optimizer", [(False, False), (True, False), (False, True)])
def test_optimizer_falls_back_to_local_gradients_after_failed_averaging(
    reuse_grad_buffers: bool, offload_optimizer: bool
):
    dht = DHT(start=True)
    other_dht, other_tracker = launch_peer_that_never_averages(dht, "test_fallback", target_batch_size=4)

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
        offload_optimizer=offload_optimizer,
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

    try:
        with mock.patch.object(opt.grad_averager, "step", wraps=opt.grad_averager.step) as begin_round:
            with mock.patch.object(
                opt, "_load_local_gradients_into_optimizer", wraps=opt._load_local_gradients_into_optimizer
            ) as fall_back:
                # micro-steps until an epoch ends with its round begun (once this peer sees the other one)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    begin_round.reset_mock()
                    fall_back.reset_mock()
                    epoch, weight_before = opt.local_epoch, model.weight.detach().clone()
                    micro_step()
                    if opt.local_epoch != epoch and begin_round.called:
                        break
                    time.sleep(0.1)
        assert begin_round.called and fall_back.called
        # SGD with lr=1 steps by the mean local gradient, not by zeros
        assert torch.allclose(model.weight, weight_before - grad)
    finally:
        opt.shutdown()
        other_tracker.shutdown()
        other_dht.shutdown()
        dht.shutdown()
