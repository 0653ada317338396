import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager

# float16 holds 2048 + 1 as 2048, bfloat16 holds 256 + 1 as 256
FP16_STEPS, BF16_STEPS = (2048.0, 1.0, 1.0, 2.0), (256.0, 1.0, 1.0, 2.0)


@pytest.mark.forked
@pytest.mark.parametrize(
    "param_dtype, averaged_grads_dtype, gradients",
    [
        (torch.float16, torch.float32, FP16_STEPS),
        (torch.bfloat16, torch.float32, BF16_STEPS),
        (torch.float32, torch.float16, FP16_STEPS),  # a narrower averaged_grads_dtype does not narrow them
        (torch.float16, torch.bfloat16, BF16_STEPS),
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
