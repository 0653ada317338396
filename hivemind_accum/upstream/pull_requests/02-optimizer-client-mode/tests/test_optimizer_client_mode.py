from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


def _make_optimizer(dht: DHT, **kwargs) -> Optimizer:
    model = nn.Linear(2, 1)
    return Optimizer(
        dht=dht,
        run_id="test_run",
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        target_batch_size=4,
        batch_size_per_step=1,
        **kwargs,
    )


@pytest.mark.forked
@pytest.mark.parametrize(
    "dht_client_mode, client_mode, expected",
    [(True, None, True), (False, True, True), (False, None, False)],
)
def test_optimizer_client_mode(dht_client_mode: bool, client_mode: bool, expected: bool):
    bootstrap = DHT(start=True)
    dht = DHT(start=True, client_mode=dht_client_mode, initial_peers=bootstrap.get_visible_maddrs())
    try:
        opt = _make_optimizer(dht, client_mode=client_mode)
        try:
            # not given: copied from the DHT; given: kept, whatever the DHT's mode
            assert opt.client_mode is expected
            assert opt.state_averager.client_mode is expected and opt.grad_averager.client_mode is expected
        finally:
            opt.shutdown()
    finally:
        dht.shutdown()
        bootstrap.shutdown()
