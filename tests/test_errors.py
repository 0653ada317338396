"""Bad input gets a clear error naming the parameter; unusual but valid input gets the correct result."""
import copy

import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager

from hivemind_accum import GradientAverager


@pytest.mark.forked
def test_averaged_grads_of_wrong_shape_or_length(dht):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"averaged_grads\[1\]: expected shape \(2,\)"):
        GradientAverager(model.parameters(), dht=dht, prefix="e", averaged_grads=[torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"averaged_grads: expected one tensor per parameter \(2\), got 1"):
        GradientAverager(model.parameters(), dht=dht, prefix="e", averaged_grads=[torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"averaged_grads\[0\]"):
        GradientAverager(model.parameters(), dht=dht, prefix="e", reuse_grad_buffers=True, averaged_grads=[torch.zeros(3, 2), torch.zeros(2)])
    assert all(p.grad is None for p in model.parameters())  # a failed constructor leaves the model untouched


@pytest.mark.forked
def test_parameters_the_accumulators_cannot_hold(dht):
    with pytest.raises(ValueError, match=r"parameters\[0\]: is on the meta device"):
        GradientAverager([torch.nn.Parameter(torch.zeros(3, device="meta"))], dht=dht, prefix="e")
    with pytest.raises(ValueError, match=r"parameters\[1\]: dtype torch.int64 cannot hold gradients"):
        GradientAverager([torch.zeros(2), torch.zeros(2, dtype=torch.long)], dht=dht, prefix="e")
    with pytest.raises(ValueError, match=r"parameters\[0\]: torch.sparse_coo parameters are not supported"):
        GradientAverager([torch.zeros(2, 2).to_sparse()], dht=dht, prefix="e")
    with pytest.raises(ValueError, match="parameters: expected at least one tensor"):
        GradientAverager([], dht=dht, prefix="e")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="accumulate_grads_on: cannot place accumulators on device 'cuda'"):
            GradientAverager([torch.zeros(2)], dht=dht, prefix="e", accumulate_grads_on="cuda")


@pytest.mark.forked
@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True, None])
def test_invalid_batch_size(dht, batch_size):
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="e", start=False)
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"batch_size: expected a positive int"):
        averager.accumulate_grads_(batch_size=batch_size)
    assert averager.local_times_accumulated == 0 and all(a.count_nonzero() == 0 for a in averager._grad_accumulators())


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_sparse_gradients_accumulate_densely(dht, reuse_grad_buffers):
    """nn.Embedding(sparse=True): both modes take sparse gradients (exact mode as upstream does, in-place mode as
    native accumulation into a dense .grad does)"""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    reference = copy.deepcopy(embedding)
    averager = GradientAverager(embedding.parameters(), dht=dht, prefix="e", reuse_grad_buffers=reuse_grad_buffers,
                                start=False)
    upstream = UpstreamGradientAverager(reference.parameters(), dht=dht, prefix="u", start=False)
    for tokens in ([0, 1, 1], [2, 5], [1]):
        for module, avg in ((embedding, averager), (reference, upstream)):
            module.zero_grad(set_to_none=True)
            module(torch.tensor(tokens)).square().sum().backward()
            avg.accumulate_grads_(batch_size=3)  # equal batch sizes: both modes weigh micro-steps alike
    for avg in averager, upstream:
        avg.load_accumulators_into_averager_()
    with averager.get_tensors() as (ours,), upstream.get_tensors() as (ref,):
        torch.testing.assert_close(ours, ref)
        assert ours.count_nonzero() > 0


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_unusual_parameters_frozen_midway_non_contiguous_and_nan(dht, reuse_grad_buffers):
    """non-contiguous parameters (a transposed one and a strided slice), a layer frozen and unfrozen mid-epoch and a
    NaN gradient: exact mode's accumulators match upstream's, in-place mode's native accumulation; the NaN is kept in
    the accumulators, and the load into the averager says so: it sends zeros with weight 0 (issue 13), never the NaN
    nor silently dropped gradients"""
    torch.manual_seed(0)
    transposed = torch.nn.Parameter(torch.randn(4, 3).t())  # strides (1, 3): dense, kept by the views
    strided = torch.nn.Parameter(torch.randn(4, 8)[:, ::2])  # not dense: its views are contiguous
    layer = torch.nn.Linear(4, 2)
    params = [transposed, strided, *layer.parameters()]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def loss(ps, x):
        return torch.nn.functional.linear((x @ ps[0]) @ ps[1], ps[2], ps[3]).square().sum()

    averager = GradientAverager(params, dht=dht, prefix="e", reuse_grad_buffers=reuse_grad_buffers, start=False)
    upstream = UpstreamGradientAverager(reference, dht=dht, prefix="u", start=False)
    native = [torch.zeros_like(p) for p in reference]
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        frozen = step in (1, 2)
        for ps in params, reference:
            ps[2].requires_grad_(not frozen)
            ps[3].requires_grad_(not frozen)
        x = torch.randn(2, 3, generator=generator)
        if not reuse_grad_buffers:
            for p in params:
                p.grad = None
        for p in reference:
            p.grad = None
        loss(params, x).backward()
        loss(reference, x).backward()
        if step == 3:
            for ps in params, reference:
                ps[3].grad[0] = float("nan")  # a NaN gradient in the last micro-step
        native = [n + (torch.zeros_like(n) if p.grad is None else p.grad) for n, p in zip(native, reference)]
        averager.accumulate_grads_(batch_size=2)
        upstream.accumulate_grads_(batch_size=2)
    upstream.load_accumulators_into_averager_()
    ours = [accumulator / 4 for accumulator in averager._grad_accumulators()]  # what the load divides by 4 micro-steps
    with upstream.get_tensors() as ref:
        expected = ref if not reuse_grad_buffers else [n / 4 for n in native]
        for o, e in zip(ours, expected, strict=True):
            torch.testing.assert_close(o, e, equal_nan=True)
    assert ours[3][0].isnan() and not ours[2].isnan().any()
    assert averager._grad_accumulators().__next__().stride() == (1, 3)
    averager.load_accumulators_into_averager_()
    assert not averager.round_guard.own_finite and averager.local_samples_accumulated == 0  # weight 0 in step()
    with averager.get_tensors() as loaded:
        assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in loaded)


@pytest.mark.forked
def test_averaging_after_shutdown_is_a_clear_error_local_accumulation_still_works(dht):
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="e", start=True)
    averager.shutdown()
    model(torch.ones(1, 3)).sum().backward()
    averager.accumulate_grads_(batch_size=1)
    for call in (lambda: averager.step(timeout=1), lambda: averager.schedule_step()):
        with pytest.raises(RuntimeError, match="the averager is not running"):
            call()
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as (weight, bias):
        torch.testing.assert_close(weight, torch.ones(2, 3))
        torch.testing.assert_close(bias, torch.ones(2))
