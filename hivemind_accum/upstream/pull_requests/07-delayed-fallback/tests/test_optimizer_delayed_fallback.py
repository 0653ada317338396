from functools import partial
from unittest import mock

import pytest
import torch
import torch.nn as nn

from hivemind.dht import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_failed_delayed_round_falls_back_to_its_own_gradients():
    dht = DHT(start=True)
    model = nn.Linear(3, 2, bias=False)
    opt = Optimizer(
        dht=dht,
        run_id="test_run",
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=100,
        batch_size_per_step=1,
        offload_optimizer=True,
        delay_optimizer_step=True,
        delay_grad_averaging=True,
    )
    grad = torch.randn(2, 3)
    try:
        model.weight.grad = grad.clone()
        opt.grad_averager.accumulate_grads_(batch_size=1)
        opt.grad_averager.load_accumulators_into_averager_()  # as the round does when it begins
        opt.grad_averager.reset_accumulated_grads_()  # the next epoch accumulates while the round runs
        model.weight.grad = 10 * grad
        opt.grad_averager.accumulate_grads_(batch_size=1)

        failed_round = mock.Mock(triggered=True, result=mock.Mock(side_effect=TimeoutError))
        opt._average_gradients_and_load_into_optimizer(failed_round)
        (offloaded_param,) = opt.state_averager.optimizer.param_groups[0]["params"]
        assert torch.allclose(offloaded_param.grad, grad)  # this round's gradients, not the next epoch's
    finally:
        opt.shutdown()
        dht.shutdown()
