from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.averaging.averager import compute_schema_hash
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.optimizer import Optimizer
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_averaged_grads_dtype(param_dtype):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    averagers = []
    for dht, grad in (dht1, 2048.0), (dht2, 1.0):
        model = nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, dtype=param_dtype))})
        averager = GradientAverager(
            model.parameters(),
            dht=dht,
            prefix="test",
            target_group_size=2,
            averaged_grads_dtype=torch.float32,
            start=True,
        )
        model.w.grad = torch.full_like(model.w, grad)
        averager.accumulate_grads_(batch_size=1)
        averagers.append(averager)

    controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
    for averager, control in zip(averagers, controls):
        averager.step(control=control, wait=False)
    for control in controls:
        control.result(timeout=30)

    # (2048 + 1) / 2 = 1024.5: float16 and bfloat16 averaged gradients would round it to 1024
    for averager in averagers:
        with averager.get_tensors() as (averaged_grad,):
            assert averaged_grad.dtype == torch.float32
            assert torch.equal(averaged_grad, torch.full((4,), 1024.5))
        averager.shutdown()
    dht1.shutdown()
    dht2.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_averaged_grads_keep_parameter_dtype_by_default(param_dtype):
    dht = DHT(start=True)
    model = nn.Linear(3, 2).to(param_dtype)
    default = GradientAverager(model.parameters(), dht=dht, prefix="test", start=False)
    in_float32 = GradientAverager(
        model.parameters(), dht=dht, prefix="test", averaged_grads_dtype=torch.float32, start=False
    )
    with default.get_tensors() as averaged_grads:
        assert [grad.dtype for grad in averaged_grads] == [param_dtype, param_dtype]
    with in_float32.get_tensors() as averaged_grads:
        assert [grad.dtype for grad in averaged_grads] == [torch.float32, torch.float32]

    # peers that do not set averaged_grads_dtype keep the schema hash they had, so they still average together
    assert default.schema_hash == compute_schema_hash([torch.zeros_like(param) for param in model.parameters()])
    assert in_float32.schema_hash != default.schema_hash
    dht.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_optimizer_with_averaged_grads_dtype(reuse_grad_buffers, offload_optimizer):
    # with offload_optimizer=True the averaged gradients become the .grad of the optimizer's float32 copies of the
    # parameters, so float16 parameters need averaged_grads_dtype=torch.float32: without it, Optimizer() raises
    dht = DHT(start=True)
    model = nn.Linear(3, 2).half()
    opt = Optimizer(
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        run_id="test_run",
        target_batch_size=4,
        batch_size_per_step=2,
        dht=dht,
        reuse_grad_buffers=reuse_grad_buffers,
        offload_optimizer=offload_optimizer,
        grad_averager_factory=partial(GradientAverager, averaged_grads_dtype=torch.float32),
    )
    try:
        with opt.grad_averager.get_tensors() as averaged_grads:
            assert all(grad.dtype == torch.float32 for grad in averaged_grads)

        before = [param.detach().clone() for param in model.parameters()]
        for step in range(2):  # the second micro-step reaches target_batch_size: no other peers, local gradients
            for param in model.parameters():
                if param.grad is None or not reuse_grad_buffers:
                    param.grad = torch.zeros_like(param)
                param.grad.add_(0.25)
            opt.step()
        assert opt.local_epoch == 1
        for param, old in zip(model.parameters(), before):
            # the mean gradient of the two micro-steps, through the float32 averaged gradients
            assert param.dtype == torch.float16 and torch.equal(param, old - 0.25)
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.forked
def test_averaged_grads_dtype_with_averaged_grads():
    dht = DHT(start=True)
    model = nn.Linear(3, 2).half()
    averaged_grads = [torch.zeros_like(param, dtype=torch.float32) for param in model.parameters()]
    with pytest.raises(ValueError, match="averaged_grads_dtype"):
        GradientAverager(
            model.parameters(),
            dht=dht,
            prefix="test",
            averaged_grads=averaged_grads,
            averaged_grads_dtype=torch.float32,
        )
    with pytest.raises(ValueError, match="floating point"):
        GradientAverager(model.parameters(), dht=dht, prefix="test", averaged_grads_dtype=torch.int64)
    dht.shutdown()
