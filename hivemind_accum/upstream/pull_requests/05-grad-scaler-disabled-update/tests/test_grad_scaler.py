import torch

from hivemind.optim.grad_scaler import GradScaler


def test_disabled_grad_scaler():
    scaler = GradScaler(enabled=False)
    loss = torch.tensor(2.0, requires_grad=True)
    assert scaler.scale(loss) is loss

    assert scaler.update() is False
    assert not scaler.is_enabled()
