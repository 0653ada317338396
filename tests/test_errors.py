"""Bad input gets a clear error naming the parameter; unusual but valid input gets the correct result."""
import copy
import gc
import inspect
import pydoc
import sys
import threading
import warnings

import hivemind
import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager

import hivemind_accum
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
        if step == 3:  # a NaN gradient in the last micro-step, through autograd (an edit of a view is refused)
            for ps in params, reference:
                (ps[3] * torch.tensor([float("nan"), 0.0])).sum().backward()
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


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_averager_rejects_a_tensor_listed_twice(dht, reuse_grad_buffers):
    """in place, GradientAverager([w, w]) would give both positions one .grad view and accumulate it twice (3.33 and
    2.0 instead of 1 and 1 after three micro-steps of gradient 1); both modes refuse it and leave the model untouched"""
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    for params, first, second in ([w, w], 0, 1), ([w, b, w], 0, 2), ([b, w, b], 0, 2):
        with pytest.raises(ValueError, match=rf"parameters\[{first}\] and parameters\[{second}\] are the same tensor"):
            GradientAverager(params, dht=dht, prefix="e", reuse_grad_buffers=reuse_grad_buffers, start=False)
    assert w.grad is None and b.grad is None
    averager = GradientAverager([w, b], dht=dht, prefix="e", reuse_grad_buffers=reuse_grad_buffers, start=False)
    assert len(averager.parameters) == 2  # distinct tensors of equal values are fine


def progress_trackers():
    """upstream's progress tracker threads: hivemind.Optimizer starts one first thing"""
    return [thread for thread in threading.enumerate() if thread.name.startswith("ProgressTracker")]


DUPLICATES = dict(
    flat=(lambda w, b: dict(params=iter([w, b, w])), r"params\[0\] and params\[2\]"),
    groups=(
        lambda w, b: dict(params=[{"params": [w]}, {"params": [b, w], "lr": 0.5}]),
        r'params\[0\]\["params"\]\[0\] and params\[1\]\["params"\]\[1\]',
    ),
    torch_optimizer=(  # within one group torch only warns
        lambda w, b: dict(optimizer=torch.optim.SGD([w, b, w], lr=0.1), offload_optimizer=False),
        r'optimizer.param_groups\[0\]\["params"\]\[0\] and optimizer.param_groups\[0\]\["params"\]\[2\]',
    ),
)


@pytest.mark.forked
@pytest.mark.parametrize("case", DUPLICATES)
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_optimizer_rejects_a_parameter_listed_twice(dht, case, reuse_grad_buffers):
    """ours names both positions before anything starts; upstream raises `AssertionError: Found duplicate parameters in
    param_groups` after its progress tracker has started. (A torch optimizer built with a parameter in two groups never
    gets here: torch.optim raises its own error; within one group it only warns.)"""
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    make_kwargs, positions = DUPLICATES[case]

    def kwargs():  # fresh one-pass iterators for every constructor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "optimizer contains a parameter group with duplicate"
            return {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1), **make_kwargs(w, b)}

    with pytest.raises(ValueError, match=positions + " are the same tensor: pass each parameter once"):
        hivemind_accum.Optimizer(
            dht=dht, run_id="dup", target_batch_size=4, batch_size_per_step=1, reuse_grad_buffers=reuse_grad_buffers,
            **kwargs(),
        )
    assert not progress_trackers() and w.grad is None
    with pytest.raises(AssertionError, match="Found duplicate parameters"):  # upstream, as said above
        hivemind.Optimizer(dht=dht, run_id="dup_upstream", target_batch_size=4, batch_size_per_step=1, **kwargs())
    assert progress_trackers()  # upstream's tracker thread was left running
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        torch.optim.SGD([{"params": [w]}, {"params": [b, w]}], lr=0.1)


def test_optimizer_lists_upstreams_arguments():
    signature = inspect.signature(hivemind_accum.Optimizer)
    assert signature == inspect.signature(hivemind.Optimizer)
    assert list(signature.parameters)[:4] == ["dht", "run_id", "target_batch_size", "batch_size_per_step"]
    assert len(signature.parameters) > 30
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    assert "target_batch_size: 'int'" in pydoc.render_doc(hivemind_accum.Optimizer, renderer=pydoc.plaintext)


@pytest.mark.forked
def test_optimizer_rejects_positional_arguments_without_a_second_error(dht, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    model = torch.nn.Linear(3, 2)
    kwargs = dict(dht=dht, run_id="pos", target_batch_size=4, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        hivemind.Optimizer(model.parameters(), **kwargs)
    gc.collect()
    assert [type(u.exc_value) for u in unraisable] == [AttributeError]  # upstream: "... no attribute '_parent_pid'"
    unraisable.clear()
    with pytest.raises(TypeError, match=r"Optimizer takes keyword arguments only, as hivemind.Optimizer does \(got 1"):
        hivemind_accum.Optimizer(model.parameters(), **kwargs)
    gc.collect()
    assert unraisable == []


def test_optimizer_names_the_required_arguments_for_positional_ones():
    """the constructor's own message, not Python's "missing 2 required keyword-only arguments: 'dht' and
    'optimizer'" (dht was passed, by position)"""
    with pytest.raises(TypeError) as error:
        hivemind_accum.Optimizer(object(), "run", 100)
    assert str(error.value).startswith(
        "Optimizer takes keyword arguments only, as hivemind.Optimizer does (got 3 positional): pass each argument "
        "by name; dht=, run_id=, target_batch_size=, optimizer= are required, e.g. Optimizer(dht=dht, run_id=..., "
    )


@pytest.mark.forked
@pytest.mark.parametrize("batch_size_per_step", [0, -4, 2.5, True, "4"])
def test_optimizer_rejects_invalid_batch_size_per_step_at_construction(dht, batch_size_per_step):
    with pytest.raises(ValueError, match=r"batch_size_per_step: expected a positive int \(samples per micro-step\) or"):
        hivemind_accum.Optimizer(
            dht=dht, run_id="bs", target_batch_size=4, batch_size_per_step=batch_size_per_step,
            params=torch.nn.Linear(3, 2).parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
    assert not progress_trackers()  # raised before upstream's __init__ started anything


@pytest.mark.forked
def test_patched_hivemind_names_batch_size_per_step_not_batch_size(dht):
    hivemind_accum.patch_hivemind()
    try:
        model = torch.nn.Linear(3, 2)
        opt = hivemind.Optimizer(
            dht=dht, run_id="bs_patched", target_batch_size=4, batch_size_per_step=0, params=model.parameters(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1), verbose=False,
        )
        try:
            model(torch.randn(1, 3)).sum().backward()
            with pytest.raises(ValueError, match=r"^batch_size_per_step: expected a positive int .*got 0"):
                opt.step()
            opt.step(batch_size=1)  # an explicit batch size is still taken
            assert opt.grad_averager.local_samples_accumulated == 1
        finally:
            opt.shutdown()
    finally:
        hivemind_accum.unpatch_hivemind()
