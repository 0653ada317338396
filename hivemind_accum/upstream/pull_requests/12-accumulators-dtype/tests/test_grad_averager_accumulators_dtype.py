from functools import partial

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.optimizer import Optimizer

# the first gradient is large enough that adding 1 to it rounds away in a half-precision sum:
# float16 holds 2048 + 1 as 2048 (spacing 2), bfloat16 holds 256 + 1 as 256 (spacing 2)
MICRO_STEP_GRADIENTS = {torch.float16: (2048.0, 1.0, 1.0, 2.0), torch.bfloat16: (256.0, 1.0, 1.0, 2.0)}


@pytest.mark.forked
@pytest.mark.parametrize(
    "param_dtype, averaged_grads_dtype, gradients",
    [
        (torch.float16, torch.float32, MICRO_STEP_GRADIENTS[torch.float16]),
        (torch.bfloat16, torch.float32, MICRO_STEP_GRADIENTS[torch.bfloat16]),
        # a narrower averaged_grads_dtype does not narrow the accumulators
        (torch.float32, torch.float16, MICRO_STEP_GRADIENTS[torch.float16]),
        (torch.float16, torch.bfloat16, MICRO_STEP_GRADIENTS[torch.bfloat16]),
    ],
)
def test_accumulators_in_averaged_grads_dtype(param_dtype, averaged_grads_dtype, gradients):
    dht = DHT(start=True)
    model = nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, dtype=param_dtype))})
    try:
        averager = GradientAverager(
            model.parameters(), dht=dht, prefix="test", averaged_grads_dtype=averaged_grads_dtype, start=False
        )
        for grad in gradients:
            model.w.grad = torch.full_like(model.w, grad)
            averager.accumulate_grads_(batch_size=1)
        averager.load_accumulators_into_averager_()

        # float16 accumulators give (2048 + 0 + 0 + 2) / 4 = 512.5, bfloat16 ones (256 + 0 + 0 + 2) / 4 = 64.5
        with averager.get_tensors() as (averaged_grad,):
            expected = torch.full((4,), sum(gradients) / len(gradients), dtype=averaged_grads_dtype)
            assert torch.equal(averaged_grad, expected)
    finally:
        dht.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_optimizer_steps_with_unrounded_accumulation(param_dtype, offload_optimizer):
    dht = DHT(start=True)
    model = nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, dtype=param_dtype))})
    opt = Optimizer(
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        run_id="test_run",
        target_batch_size=4,
        batch_size_per_step=1,
        dht=dht,
        offload_optimizer=offload_optimizer,
        grad_averager_factory=partial(GradientAverager, averaged_grads_dtype=torch.float32),
    )
    try:
        gradients = MICRO_STEP_GRADIENTS[param_dtype]
        for grad in gradients:  # the fourth micro-step reaches target_batch_size: no other peers, local gradients
            model.w.grad = torch.full_like(model.w, grad)
            opt.step()
        assert opt.local_epoch == 1
        # the mean gradient, 513 or 65, is exact in the parameters' dtype; rounded accumulators give 512.5 or 64.5
        assert torch.equal(model.w, torch.full_like(model.w, -sum(gradients) / len(gradients)))
    finally:
        opt.shutdown()
        dht.shutdown()
