import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_grads_are_averaged_with_weight_zero(bad_value: float):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    good_grad = torch.arange(1.0, 5.0)
    averagers = []
    for dht, grad in (dht1, torch.tensor([1.0, bad_value, 3.0, 4.0])), (dht2, good_grad):
        param = nn.Parameter(torch.zeros(4))
        param.grad = grad.clone()
        averager = GradientAverager([param], dht=dht, prefix="test", target_group_size=2, start=True)
        averager.accumulate_grads_(batch_size=4)
        averagers.append(averager)

    try:
        controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
        for averager, control in zip(averagers, controls):
            averager.step(control=control, wait=False)
        for averager, control in zip(averagers, controls):
            control.result(timeout=60)
            with averager.get_tensors() as (averaged_grad,):
                assert torch.allclose(averaged_grad, good_grad)  # the first peer sent zeros with weight 0
        assert [control.weight for control in controls] == [0, 4]
    finally:
        for averager in averagers:
            averager.shutdown()
        dht1.shutdown()
        dht2.shutdown()
