from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("offload_optimizer, reuse_tensors", [(False, False), (True, False), (False, True)])
def test_nonfinite_state_is_averaged_with_weight_zero(offload_optimizer: bool, reuse_tensors: bool, bad_value: float):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    good_weight = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -4.0]])

    models, averagers = [], []
    for dht in dht1, dht2:
        model = nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(good_weight)
            model.bias.fill_(1.0)
        averager = TrainingStateAverager(
            dht=dht,
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.1),
            offload_optimizer=offload_optimizer,
            reuse_tensors=reuse_tensors,
            target_group_size=2,
            prefix="test",
            start=True,
        )
        models.append(model)
        averagers.append(averager)
    with torch.no_grad():
        models[0].weight[1, 2] = bad_value  # one bad element in one peer's parameters
        if offload_optimizer:
            averagers[0].optimizer.param_groups[0]["params"][0][1, 2] = bad_value

    controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
    for averager, control in zip(averagers, controls):
        averager.step(averaging_round=True, averaging_control=control, delay_averaging=True)
    for averager in averagers:
        averager.step(wait_for_delayed_updates=True)

    # the peer with inf/NaN sent zeros with weight 0: both peers take the other peer's parameters
    for model in models:
        assert torch.equal(model.weight, good_weight)
        assert torch.equal(model.bias, torch.ones(2))
    assert [control.weight for control in controls] == [0, 1]
    for averager in averagers:
        averager.shutdown()
    dht1.shutdown()
    dht2.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_tensors", [False, True])
def test_nonfinite_state_is_kept_after_a_failed_round(reuse_tensors: bool):
    dht = DHT(start=True)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    weight_before, bias_before = model.weight.detach().clone(), model.bias.detach().clone()
    averager = TrainingStateAverager(
        dht=dht,
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        reuse_tensors=reuse_tensors,
        target_group_size=2,
        prefix="test",
        start=True,
    )

    # no other peer: the round fails, and this peer keeps its own state, not the zeros it would have sent
    control = averager.schedule_step(get_dht_time() + 1, timeout=3)
    averager.step(averaging_round=True, averaging_control=control)
    assert control.done() and control.exception() is not None and control.weight == 0
    assert torch.allclose(model.weight, weight_before, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(model.bias, bias_before)
    averager.shutdown()
    dht.shutdown()
