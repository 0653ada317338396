import pytest
import torch

from hivemind import DHT
from hivemind.optim.grad_scaler import GradScaler
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_disabled_grad_scaler_loop():
    dht = DHT(start=True)
    param = torch.nn.Parameter(torch.ones(3))
    opt = Optimizer(
        dht=dht,
        run_id="test_run",
        params=[param],
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        target_batch_size=1,
        batch_size_per_step=1,
    )
    scaler = GradScaler(enabled=False)
    try:
        loss = (param * torch.tensor([1.0, 2.0, 3.0])).sum()
        scaled_loss = scaler.scale(loss)
        assert scaled_loss is loss
        scaled_loss.backward()
        scaler.step(opt)
        assert scaler.update() is False
        assert torch.allclose(param.detach(), torch.tensor([0.5, 0.0, -0.5]))
    finally:
        opt.shutdown()
        dht.shutdown()
