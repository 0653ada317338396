from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("offload_optimizer", [False, True])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_after_every_micro_step(reuse_grad_buffers, offload_optimizer, set_to_none):
    dht = DHT(start=True)
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = Optimizer(
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        run_id="test_run",
        target_batch_size=4,
        batch_size_per_step=2,
        dht=dht,
        reuse_grad_buffers=reuse_grad_buffers,
        offload_optimizer=offload_optimizer,
    )

    # two epochs of two micro-steps each; the loss makes each micro-step's gradient equal to its input
    micro_batches = [0.25, 0.75], [1.0, 2.0]
    for epoch, inputs in enumerate(micro_batches):
        for value in inputs:
            model(torch.full((1, 4), value)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        assert opt.local_epoch == epoch + 1
    # the optimizer stepped with each epoch's mean gradient: 0.5, then 1.5
    assert torch.equal(model.weight, torch.full((1, 4), -2.0))
    opt.shutdown()
    dht.shutdown()
