import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hivemind import DHT
from hivemind.optim.grad_scaler import GradScaler
from hivemind.optim.optimizer import Optimizer


class HostReads(TorchDispatchMode):
    """counts the reads of a tensor's value on the host (.item(), bool(), ...): each stalls a GPU"""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.forked
def test_grad_scaler_update_without_global_step_reads_nothing_on_the_host():
    dht = DHT(start=True)
    param = torch.nn.Parameter(torch.ones(3))
    opt = Optimizer(
        dht=dht,
        run_id="test_run",
        params=[param],
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=100,
        batch_size_per_step=1,
        reuse_grad_buffers=True,
    )
    scaler = GradScaler("cpu", init_scale=16.0)
    try:
        for value, scale in (1.0, 16.0), (float("inf"), 8.0):
            scaler.scale((param * value).sum()).backward()
            opt.step(grad_scaler=scaler)
            with HostReads() as reads:
                scaler.update()
            assert reads.count == 0 and scaler.get_scale() == scale
    finally:
        opt.shutdown()
        dht.shutdown()
