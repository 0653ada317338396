from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
@pytest.mark.parametrize(
    "reuse_grad_buffers, offload_optimizer, delay_optimizer_step, use_local_updates",
    [
        (False, False, False, False),
        (True, False, False, False),
        (False, True, False, False),
        (True, True, False, False),
        (False, True, True, False),
        (True, True, True, False),
        (False, False, False, True),
    ],
)
def test_optimizer_skips_step_with_nonfinite_grads(
    reuse_grad_buffers: bool, offload_optimizer: bool, delay_optimizer_step: bool, use_local_updates: bool
):
    dht = DHT(start=True)
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))]
    opt = Optimizer(
        params=params,
        optimizer=partial(torch.optim.SGD, lr=1.0),
        run_id="test_run",
        target_batch_size=1,
        batch_size_per_step=1,
        dht=dht,
        reuse_grad_buffers=reuse_grad_buffers,
        offload_optimizer=offload_optimizer,
        delay_optimizer_step=delay_optimizer_step,
        delay_grad_averaging=delay_optimizer_step,
        use_local_updates=use_local_updates,
    )
    try:
        # one micro-step per epoch: first with one NaN element in the first parameter's gradient, then finite
        for epoch, first_grad, second_grad, expected in (
            (1, [1.0, float("nan"), 1.0, 1.0], [1.0] * 4, 0.0),
            (2, [0.25] * 4, [0.25] * 4, -0.25),
        ):
            for param, grad in zip(params, (first_grad, second_grad)):
                if param.grad is None or not reuse_grad_buffers:
                    param.grad = torch.zeros_like(param)
                param.grad.add_(torch.tensor(grad))
            opt.step()
            opt.state_averager.step(wait_for_delayed_updates=True)  # apply a delayed optimizer step, if any
            assert use_local_updates or opt.local_epoch == epoch
            # the step with NaN gradients was skipped; the next one ran as usual
            for param in params:
                assert torch.equal(param, torch.full((4,), expected))
    finally:
        opt.shutdown()
        dht.shutdown()
