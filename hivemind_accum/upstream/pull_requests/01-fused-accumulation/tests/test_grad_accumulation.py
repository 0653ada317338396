from unittest import mock

import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager


@pytest.mark.forked
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float32,) * 30, (torch.float32, torch.float16) * 15])
def test_accumulate_grads_is_one_foreach_add_per_dtype(dtypes):
    dht = DHT(start=True)
    model = nn.ParameterList([nn.Parameter(torch.zeros(5, dtype=dtype)) for dtype in dtypes])
    averager = GradientAverager(model.parameters(), dht=dht, prefix="test", reuse_grad_buffers=False, start=False)
    dht.shutdown()  # the averager is not started: accumulate_grads_ runs in this process alone

    batch_sizes = [4, 2, 8]
    reference = [torch.zeros_like(param) for param in model.parameters()]
    for step, batch_size in enumerate(batch_sizes):
        for i, param in enumerate(model.parameters()):
            param.grad = torch.full_like(param, (step + 1) * (i + 1) / 7)
            # each micro-batch is weighted by its size relative to the first one's
            reference[i].add_(param.grad, alpha=batch_size / batch_sizes[0])
        with mock.patch.object(torch, "_foreach_add_", wraps=torch._foreach_add_) as foreach_add:
            averager.accumulate_grads_(batch_size=batch_size)
        assert foreach_add.call_count == len(set(dtypes))

    assert averager.local_samples_accumulated == sum(batch_sizes) and averager.local_times_accumulated == 3
    for accumulator, expected in zip(averager._grad_accumulators(), reference):
        assert accumulator.dtype == expected.dtype and torch.equal(accumulator, expected)

    averager.reset_accumulated_grads_()
    assert all(not accumulator.any() for accumulator in averager._grad_accumulators())


@pytest.mark.forked
def test_accumulate_sparse_grads():
    dht = DHT(start=True)
    embedding = nn.Embedding(4, 3, sparse=True)
    averager = GradientAverager(embedding.parameters(), dht=dht, prefix="test", reuse_grad_buffers=False, start=False)
    dht.shutdown()

    for batch_size in 2, 4:
        embedding.zero_grad(set_to_none=True)
        embedding(torch.tensor([1, 1, 3])).sum().backward()
        assert embedding.weight.grad.is_sparse
        averager.accumulate_grads_(batch_size=batch_size)

    expected = torch.tensor([0.0, 2.0, 0.0, 1.0])[:, None].expand(4, 3) * (1 + 4 / 2)
    assert torch.equal(next(averager._grad_accumulators()), expected)
