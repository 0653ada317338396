"""
The averaging-time load's finiteness check, taken as the copy writes each chunk (no separate pass over the shared
buffers): same values and the same decision as upstream's load followed by a separate check, counted with
``torch.profiler`` (no timing).
"""
import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager
from torch.profiler import profile

from hivemind_accum import GradientAverager
from hivemind_accum.buffers import buckets as grad_buckets
from hivemind_accum.buffers.buckets import GradientBuckets
from hivemind_accum.rounds.finite import all_finite


def params_of(sizes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(size, dtype=dtype)) for size in sizes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_checksums_are_the_sums_of_the_chunks_written(monkeypatch, dtype):
    monkeypatch.setattr(grad_buckets, "CHECK_CHUNK", 7)
    params = params_of([(3, 5), (11,), (2, 2)], dtype) + params_of([(4,)], torch.float32)
    source = GradientBuckets(params)
    destination = GradientBuckets(params, device="cpu", share_memory=True, upcast=True)
    generator = torch.Generator().manual_seed(0)
    for view in source.views:
        view.copy_(torch.randn(view.shape, generator=generator))
    sums = source.scaled_copy_with_checksums_(destination, 0.25)
    expected = []
    for src, dst in zip(source.buckets, destination.buckets):
        assert torch.equal(dst.flat, src.flat.to(dst.flat.dtype) * 0.25)
        expected += [chunk.sum(dtype=torch.float32) for chunk in dst.flat.split(7)]
    # float32: one bucket of 34 elements (5 chunks of 7); otherwise 30 elements (5 chunks) and a float32 bucket of 4
    assert sums.dtype == torch.float32 and len(sums) == len(expected) == (5 if dtype == torch.float32 else 6)
    torch.testing.assert_close(sums, torch.stack(expected))
    with pytest.raises(ValueError, match="destination"):
        source.scaled_copy_with_checksums_(list(destination.views), 1.0)


def test_all_finite_from_checksums():
    big = torch.full((4,), 3e38)
    assert all_finite([big], checksums=big.sum().reshape(1))  # an overflowing sum: checked element by element
    assert not all_finite([torch.tensor([1.0, float("nan")])], checksums=torch.tensor([float("nan")]))
    assert all_finite([torch.ones(3)], checksums=torch.tensor([3.0]))


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), 3e38])
def test_load_matches_upstream_and_the_separate_check(monkeypatch, dht, reuse_grad_buffers, bad):
    """exact mode against upstream's load; in place against native accumulation's sum / K; a non-finite element in
    one chunk zeros everything (weight 0), a finite one whose chunk sum overflows does not"""
    monkeypatch.setattr(grad_buckets, "CHECK_CHUNK", 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 3))
    params = list(model.parameters())
    ours = GradientAverager(params, dht=dht, prefix="ours", reuse_grad_buffers=reuse_grad_buffers, start=False)
    reference = [torch.zeros_like(param) for param in params]
    upstream_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    upstream = UpstreamGradientAverager(upstream_params, dht=dht, prefix="ref", start=False)
    for step in range(3):
        grads = [torch.randn_like(param) for param in params]
        if bad is not None and step == 1:
            grads[0][5, 7:11] = bad  # elements 87-90 of the flat bucket, in its second chunk of 64
        for param, upstream_param, grad, total in zip(params, upstream_params, grads, reference):
            if reuse_grad_buffers:
                (param * grad).sum().backward()  # autograd accumulates grad into the view
            else:
                param.grad = grad.clone()
            upstream_param.grad = grad.clone()
            total.add_(grad)
        ours.accumulate_grads_(4)
        upstream.accumulate_grads_(4)
    ours.load_accumulators_into_averager_()
    upstream.load_accumulators_into_averager_()
    with ours.get_tensors() as loaded, upstream.get_tensors() as expected:
        finite = all_finite(expected)
        assert ours.round_guard.own_finite == finite == (bad is None or bad == 3e38)
        assert (ours.local_samples_accumulated == 12) == finite
        for mine, theirs, total in zip(loaded, expected, reference):
            if not finite:
                assert torch.equal(mine, torch.zeros_like(mine))
            elif reuse_grad_buffers:
                torch.testing.assert_close(mine, total / 3)
            else:
                assert torch.equal(mine, theirs)


@pytest.mark.forked
def test_load_reads_each_chunk_while_writing_it(dht):
    """the check sums chunks of at most CHECK_CHUNK elements (each right after it is written), never a whole bucket:
    one mul and one sum per chunk, and a single host read for the decision"""
    params = params_of([(300_000,), (200_000,), (10,)])
    averager = GradientAverager(params, dht=dht, prefix="count", start=False)
    for param in params:
        param.grad = torch.ones_like(param)
    averager.accumulate_grads_(1)
    with profile(record_shapes=True) as prof:
        averager.load_accumulators_into_averager_()
    top = [event for event in prof.events() if event.cpu_parent is None and event.name.startswith("aten::")]
    chunks = -(-500_010 // grad_buckets.CHECK_CHUNK)
    sums = [event for event in top if event.name == "aten::sum"]
    muls = [event for event in top if event.name == "aten::mul"]
    assert len(sums) == len(muls) == chunks == 2
    assert all(event.input_shapes[0][0] <= grad_buckets.CHECK_CHUNK for event in sums + muls)
    assert sum(1 for event in prof.events() if event.name == "aten::_local_scalar_dense") == 1
    assert averager.round_guard.own_finite
