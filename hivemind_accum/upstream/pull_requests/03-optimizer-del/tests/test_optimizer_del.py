import gc
import sys

import pytest
import torch

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


@pytest.mark.forked
def test_optimizer_del_after_failed_constructor(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    dht = DHT(start=True)
    try:
        Optimizer(dht=dht, run_id="test_run", params=[torch.zeros(3)], optimizer=None, target_batch_size=4)
    except ValueError:
        pass  # neither an optimizer nor a factory: the constructor raises before it creates any averager
    finally:
        dht.shutdown()
    gc.collect()

    assert [repr(hook_args.exc_value) for hook_args in unraisable] == []
