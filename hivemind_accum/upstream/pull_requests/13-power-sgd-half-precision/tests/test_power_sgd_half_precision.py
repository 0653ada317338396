import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_power_sgd_half_precision(dtype: torch.dtype):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    # a rank-1 gradient, which PowerSGD of rank 1 compresses without error
    grad = torch.outer(torch.arange(1.0, 9.0), torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 4.0, -4.0]))

    averagers = []
    try:
        for dht, scale in (dht1, 1.0), (dht2, 3.0):
            model = nn.Linear(8, 8).to(dtype)
            model.weight.grad = (scale * grad).to(dtype)
            model.bias.grad = torch.full((8,), scale, dtype=dtype)  # a vector: averaged without compression
            averager = PowerSGDGradientAverager(
                model.parameters(), averager_rank=1, dht=dht, prefix="test", target_group_size=2, start=True
            )
            averager.accumulate_grads_(batch_size=1)
            averagers.append(averager)

        controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
        for averager, control in zip(averagers, controls):
            averager.step(control=control, wait=False)
        for control in controls:
            control.result(timeout=30)

        # the mean gradient, 2 * grad, holds integers up to 64, exact in float16 and bfloat16
        for averager in averagers:
            with averager.get_tensors() as (weight_grad, bias_grad):
                assert weight_grad.dtype == bias_grad.dtype == dtype
                assert torch.equal(weight_grad, (2 * grad).to(dtype))
                assert torch.equal(bias_grad, torch.full((8,), 2.0, dtype=dtype))
    finally:
        for averager in averagers:
            averager.shutdown()
        dht1.shutdown()
        dht2.shutdown()
