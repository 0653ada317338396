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
    grad = torch.outer(torch.arange(1.0, 5.0), torch.tensor([1.0, -1.0, 2.0, -2.0]))  # rank 1: compressed exactly
    params = [nn.Parameter(torch.zeros(4, 4, dtype=dtype)) for _ in range(2)]
    averagers = [
        PowerSGDGradientAverager([param], averager_rank=1, dht=dht, prefix="test", target_group_size=2, start=True)
        for param, dht in zip(params, (dht1, dht2))
    ]
    try:
        for param, averager, factor in zip(params, averagers, (1, 3)):
            param.grad = (factor * grad).to(dtype)
            averager.accumulate_grads_(batch_size=1)
        controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
        for averager, control in zip(averagers, controls):
            averager.step(control=control, wait=False)
        for averager, control in zip(averagers, controls):
            control.result(timeout=30)
            with averager.get_tensors() as (averaged_grad,):
                assert averaged_grad.dtype == dtype and torch.allclose(averaged_grad.float(), 2 * grad)
    finally:
        for averager in averagers:
            averager.shutdown()
        dht1.shutdown()
        dht2.shutdown()
