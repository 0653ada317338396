import pytest
import torch

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_optimizer_rejects_auxiliary_client():
    bootstrap = DHT(start=True)
    dht = DHT(start=True, client_mode=True, initial_peers=bootstrap.get_visible_maddrs())
    try:
        with pytest.raises(ValueError, match="auxiliary"):
            Optimizer(
                dht=dht,
                run_id="test_run",
                params=[torch.zeros(3, requires_grad=True)],
                optimizer=torch.optim.SGD,
                target_batch_size=4,
                client_mode=True,
                auxiliary=True,
            )
    finally:
        dht.shutdown()
        bootstrap.shutdown()
