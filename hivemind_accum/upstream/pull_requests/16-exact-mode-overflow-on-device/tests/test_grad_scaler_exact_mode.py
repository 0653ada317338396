from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hivemind import DHT
from hivemind.optim import grad_scaler
from hivemind.optim.grad_scaler import GradScaler
from hivemind.optim.optimizer import Optimizer


class HostReads(TorchDispatchMode):
    """counts the reads of a tensor's value on the host (.item(), bool(), ...): each stalls a GPU"""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.forked
def test_exact_mode_skips_an_overflowing_micro_step_without_host_reads():
    dht = DHT(start=True)
    param = torch.nn.Parameter(torch.ones(3))
    opt = Optimizer(
        dht=dht,
        run_id="test_run",
        params=[param],
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=100,
        batch_size_per_step=1,
    )
    scaler = GradScaler("cpu", init_scale=16.0)
    try:
        # the branch of an accelerator, where a host read stalls, taken on the CPU
        with mock.patch.object(grad_scaler, "_host_read_stalls", lambda device: True, create=True):
            for value in 1.0, float("inf"), 2.0:  # scaled gradients 16, inf (skipped: the scale backs off to 8), 16
                opt.zero_grad()
                scaler.scale((param * value).sum()).backward()
                with HostReads() as reads:
                    scaler.step(opt)
                    scaler.update()
                assert reads.count == 0
        assert scaler.get_scale() == 8.0
        opt.grad_averager.load_accumulators_into_averager_()
        assert opt.grad_averager.local_samples_accumulated == 2
        with opt.grad_averager.get_tensors() as (averaged_grad,):
            assert torch.equal(averaged_grad, torch.full((3,), 16.0))
    finally:
        opt.shutdown()
        dht.shutdown()
