from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize(
    "averager_factory",
    [GradientAverager, partial(PowerSGDGradientAverager, averager_rank=1)],
    ids=["GradientAverager", "PowerSGDGradientAverager"],
)
def test_nonfinite_grads_are_averaged_with_weight_zero(averager_factory, reuse_grad_buffers: bool, bad_value: float):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    # a rank-1 gradient, which PowerSGD of rank 1 compresses without error
    good_grad = torch.outer(torch.arange(1.0, 9.0), torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 4.0, -4.0]))
    bad_grad = good_grad.clone()
    bad_grad[1, 2] = bad_value  # one bad element in one peer's gradients

    models, averagers = [], []
    for dht in dht1, dht2:
        model = nn.Linear(8, 8)
        averager = averager_factory(
            model.parameters(),
            dht=dht,
            prefix="test",
            target_group_size=2,
            reuse_grad_buffers=reuse_grad_buffers,
            start=True,
        )
        models.append(model)
        averagers.append(averager)

    # the first peer's gradients, its weight (None: the default) and both peers' expected weights, round by round
    rounds = [(bad_grad, None, [0, 4]), (3 * good_grad, 0, [0, 4]), (good_grad, None, [4, 4])]
    for first_grad, first_weight, expected_weights in rounds:
        for model, averager, grad in zip(models, averagers, (first_grad, good_grad)):
            model.weight.grad, model.bias.grad = grad.clone(), torch.ones(8)
            averager.accumulate_grads_(batch_size=4)
        controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
        for averager, control, weight in zip(averagers, controls, (first_weight, None)):
            averager.step(weight=weight, control=control, wait=False)
        for control in controls:
            control.result(timeout=60)

        # a peer with weight 0 sent nothing: both peers get the other peer's gradients, in every round
        for averager in averagers:
            with averager.get_tensors() as (weight_grad, bias_grad):
                assert torch.allclose(weight_grad, good_grad)
                assert torch.allclose(bias_grad, torch.ones(8))
            averager.notify_used_averaged_gradients()
        assert [control.weight for control in controls] == expected_weights

    for averager in averagers:
        averager.shutdown()
    dht1.shutdown()
    dht2.shutdown()
