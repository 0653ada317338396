import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
def test_power_sgd_round_with_weight_zero_keeps_error_feedback():
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    grad = torch.outer(torch.arange(1.0, 5.0), torch.tensor([1.0, -1.0, 2.0, -2.0]))  # rank 1: compressed exactly
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    averagers = [
        PowerSGDGradientAverager([param], averager_rank=1, dht=dht, prefix="test", target_group_size=2, start=True)
        for param, dht in zip(params, (dht1, dht2))
    ]
    try:
        # the first peer joins round 1 with weight 0, then both average the same gradients
        for first_grad, first_weight in (3 * grad, 0), (grad, None):
            for param, averager, peer_grad in zip(params, averagers, (first_grad, grad)):
                param.grad = peer_grad.clone()
                averager.accumulate_grads_(batch_size=1)
            controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
            for averager, control, weight in zip(averagers, controls, (first_weight, None)):
                averager.step(weight=weight, control=control, wait=False)
            for averager, control in zip(averagers, controls):
                control.result(timeout=60)
                with averager.get_tensors() as (averaged_grad,):
                    assert torch.allclose(averaged_grad, grad)
                averager.notify_used_averaged_gradients()
    finally:
        for averager in averagers:
            averager.shutdown()
        dht1.shutdown()
        dht2.shutdown()
