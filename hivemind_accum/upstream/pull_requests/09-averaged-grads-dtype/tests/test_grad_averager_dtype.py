import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_averaged_grads_dtype(param_dtype):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    averagers = []
    for dht, grad in (dht1, 2048.0), (dht2, 1.0):
        model = nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, dtype=param_dtype))})
        averager = GradientAverager(
            model.parameters(),
            dht=dht,
            prefix="test",
            target_group_size=2,
            averaged_grads_dtype=torch.float32,
            start=True,
        )
        model.w.grad = torch.full_like(model.w, grad)
        averager.accumulate_grads_(batch_size=1)
        averagers.append(averager)

    controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
    for averager, control in zip(averagers, controls):
        averager.step(control=control, wait=False)
    for control in controls:
        control.result(timeout=30)

    # (2048 + 1) / 2 = 1024.5: float16 and bfloat16 averaged gradients would round it to 1024
    for averager in averagers:
        with averager.get_tensors() as (averaged_grad,):
            assert averaged_grad.dtype == torch.float32
            assert torch.equal(averaged_grad, torch.full((4,), 1024.5))
        averager.shutdown()
    dht1.shutdown()
    dht2.shutdown()


@pytest.mark.forked
def test_averaged_grads_dtype_errors():
    dht = DHT(start=True)
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float16))]
    with pytest.raises(ValueError, match="not both"):
        GradientAverager(
            params, dht=dht, prefix="test", averaged_grads=[torch.zeros(3)], averaged_grads_dtype=torch.float32
        )
    with pytest.raises(ValueError, match="floating point"):
        GradientAverager(params, dht=dht, prefix="test", averaged_grads_dtype=torch.int64)
    dht.shutdown()
