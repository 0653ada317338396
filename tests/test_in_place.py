"""In-place mode (reuse_grad_buffers=True) against native PyTorch accumulation as the oracle."""
import copy
import sys
import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

import hivemind_accum
from hivemind_accum import GradientAverager
from hivemind_accum.rounds.fallback import LocalFallback
from tests.conftest import DEVICES, MixedNet, mixed_batch, shutting_down, swarm


def native_accumulation(model, batches, use_sometimes):
    """sum of the gradients of every micro-batch, as plain ``loss.backward()`` accumulates it (None -> zeros)"""
    model.zero_grad(set_to_none=True)
    for (images, tokens, targets), use in zip(batches, use_sometimes):
        F.mse_loss(model(images, tokens, use), targets).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in model.parameters()]


@pytest.mark.forked
@pytest.mark.parametrize("zero_grad", ["never", "before_backward", "after_step", "mixed"])
def test_in_place_matches_native_accumulation(dht, zero_grad):
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="inplace", reuse_grad_buffers=True, start=False)
    views = list(averager._grad_accumulators())
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    assert model.conv.weight.grad.is_contiguous(memory_format=torch.channels_last)

    rng, generator = random.Random(1), torch.Generator().manual_seed(1)
    for round_ in range(2):
        num_steps = 5 + round_
        batches = [mixed_batch(generator, 4) for _ in range(num_steps)]
        use_sometimes = [rng.random() < 0.5 for _ in range(num_steps)]
        for step, ((images, tokens, targets), use) in enumerate(zip(batches, use_sometimes)):
            if zero_grad == "before_backward" or (zero_grad == "mixed" and step % 2):
                model.zero_grad(set_to_none=True)
            F.mse_loss(model(images, tokens, use), targets).backward()
            averager.accumulate_grads_(batch_size=4)
            if zero_grad == "after_step":
                model.zero_grad(set_to_none=True)
        expected = native_accumulation(reference, batches, use_sometimes)
        for acc, exp in zip(averager._grad_accumulators(), expected, strict=True):
            torch.testing.assert_close(acc, exp)
        averager.load_accumulators_into_averager_()
        assert all(p.grad is v for p, v in zip(model.parameters(), views))  # views re-attached
        with averager.get_tensors() as averaged:
            for avg, exp in zip(averaged, expected, strict=True):
                torch.testing.assert_close(avg, exp / num_steps)
        averager.reset_accumulated_grads_()
        assert all(p.grad is v and v.count_nonzero() == 0 for p, v in zip(model.parameters(), views))


@pytest.mark.forked
def test_in_place_zeroing_a_view_is_refused_and_unequal_batches_warn_once(dht):
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="inplace", reuse_grad_buffers=True, start=False)
    x = torch.ones(1, 3)
    model(x).sum().backward()
    averager.accumulate_grads_(batch_size=1)
    model.zero_grad(set_to_none=False)  # zeroes the running sum in place: an edit, refused at the next micro-step
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"edited in place.*reuse_grad_buffers=False"):
        averager.accumulate_grads_(batch_size=1)
    averager.reset_accumulated_grads_()  # the averager's own reset starts over
    model(2 * x).sum().backward()
    with pytest.warns(UserWarning, match="weighs every micro-step equally") as record:
        averager.accumulate_grads_(batch_size=3)
        model(3 * x).sum().backward()
        averager.accumulate_grads_(batch_size=5)
    assert len(record) == 1
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as (weight, bias):
        torch.testing.assert_close(weight, torch.full((2, 3), 5.0 / 2))  # (2 + 3) / 2 micro-steps
        torch.testing.assert_close(bias, torch.full((2,), 2.0 / 2))


@pytest.mark.forked
def test_in_place_two_peers_average_sample_weighted():
    with swarm(2) as dhts:
        models = [torch.nn.Linear(3, 4) for _ in dhts]
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
        averagers = [
            GradientAverager(model.parameters(), dht=dht, prefix="pair", reuse_grad_buffers=True,
                             target_group_size=2, start=True)
            for model, dht in zip(models, dhts)
        ]
        with shutting_down(*averagers):
            local, weights, averager_micro_steps = [], [], []
            for peer, (model, averager) in enumerate(zip(models, averagers)):
                reference = copy.deepcopy(model)
                generator = torch.Generator().manual_seed(peer)
                batches = [(torch.randn(2 + peer, 3, generator=generator), torch.randn(2 + peer, 4, generator=generator))
                           for _ in range(3 + 2 * peer)]
                for x, y in batches:
                    model.zero_grad()  # a framework that zeroes gradients before every backward
                    F.mse_loss(model(x), y).backward()
                    averager.accumulate_grads_(batch_size=len(x))
                reference.zero_grad()
                for x, y in batches:
                    F.mse_loss(reference(x), y).backward()
                local.append([p.grad / len(batches) for p in reference.parameters()])
                averager_micro_steps.append(len(batches))
                weights.append(averager.local_samples_accumulated)
            assert weights == [2 * 3, 3 * 5]
            controls = [averager.step(wait=False, timeout=30) for averager in averagers]
            assert all(control.result(timeout=60) is not None for control in controls)
            expected = [(weights[0] * g0 + weights[1] * g1) / sum(weights) for g0, g1 in zip(*local)]
            for model, averager in zip(models, averagers):
                with averager.use_averaged_gradients():
                    for param, exp in zip(model.parameters(), expected, strict=True):
                        torch.testing.assert_close(param.grad, exp)
                assert all(p.grad is v for p, v in zip(model.parameters(), averager._grad_accumulators()))
                # the next backward adds into .grad: the round's local mean went to host memory (its failed-round
                # fallback) as the round began, and .grad starts the next epoch at zero
                assert all(v.count_nonzero() == 0 for v in averager._grad_accumulators())
                fallback = [torch.zeros_like(p) for p in model.parameters()]
                assert averager.local_fallback.load_into_(fallback)  # as a failed round would load it
                for got, own in zip(fallback, local[models.index(model)], strict=True):
                    torch.testing.assert_close(got, own)
                averager.notify_used_averaged_gradients()
                averager.reset_accumulated_grads_()  # hivemind.Optimizer's call once the epoch's step is done
                assert all(v.count_nonzero() == 0 for v in averager._grad_accumulators())


@pytest.mark.forked
def test_in_place_gradient_memory_equals_native(dht):
    """in-place mode keeps no gradient memory beyond native accumulation's: every .grad lives inside the buckets,
    whose total size is exactly that of native's .grad tensors (the averager's shared buffers live on the host)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 3))
    model[0].double()
    native = copy.deepcopy(model)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="memory", reuse_grad_buffers=True, start=False)
    images = torch.randn(4, 2, 4, 4)
    for module in model, native:
        module[2](module[1](module[0](images.double())).float()).square().mean().backward()
    averager.accumulate_grads_(batch_size=4)
    bucket_storages = {b.flat.untyped_storage().data_ptr() for b in averager._accumulators.buckets}
    assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} == bucket_storages
    bucket_bytes = sum(b.flat.untyped_storage().nbytes() for b in averager._accumulators.buckets)
    assert bucket_bytes == sum(p.grad.untyped_storage().nbytes() for p in native.parameters())


@pytest.mark.forked
def test_in_place_create_graph_counts_each_micro_step_once(dht):
    """backward(create_graph=True) makes autograd replace .grad by .grad + gradient; in place, each micro-step still
    counts once, as native accumulation does"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="graph", reuse_grad_buffers=True, start=False)
    batches = [torch.randn(5, 3, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    for x in batches:
        model(x).square().mean().backward(create_graph=True)
        averager.accumulate_grads_(batch_size=5)
        reference(x).square().mean().backward()
    for acc, param in zip(averager._grad_accumulators(), reference.parameters(), strict=True):
        torch.testing.assert_close(acc, param.grad)
    assert all(p.grad is v for p, v in zip(model.parameters(), averager._grad_accumulators()))


@pytest.mark.forked
def test_in_place_grad_computed_from_the_running_sum_is_refused(dht):
    """p.grad = f(p.grad) after backward would count the running sum twice: refused, naming the parameter; a .grad
    replaced after zero_grad (its view not written since) is added as usual"""
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="replaced", reuse_grad_buffers=True, start=False)
    x = torch.ones(1, 3)
    model(x).sum().backward()
    averager.accumulate_grads_(batch_size=1)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()  # a fresh .grad: added
    averager.accumulate_grads_(batch_size=1)
    torch.testing.assert_close(model.bias.grad, torch.full((2,), 2.0))
    model(x).sum().backward()
    model.bias.grad = model.bias.grad * 0.5
    with pytest.raises(ValueError, match=r"parameters\[1\] \(shape \(2,\)\).*reuse_grad_buffers=False"):
        averager.accumulate_grads_(batch_size=1)


class _HostCopies(TorchDispatchMode):
    """records (non_blocking, destination pinned) of each copy_ into host memory from another device"""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.copies.append((bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)),
                                args[0].is_pinned()))
        return func(*args, **kwargs)


@pytest.mark.forked
@pytest.mark.parametrize("device", DEVICES)
def test_in_place_round_is_copied_out_as_it_begins_without_blocking_on_cuda(dht, device, monkeypatch):
    """in place, the next backward adds into .grad: a round's local gradients are copied to host memory as the round
    begins (from CUDA into pinned memory with non_blocking=True, waited for when read), outside any backward pass,
    and .grad starts the next epoch at zero; the fallback then loads the round's gradients, also after that backward"""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(device)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="copy_out", reuse_grad_buffers=True, start=False)
    for _ in range(2):
        model(torch.randn(2, 4, device=device)).square().mean().backward()
        averager.accumulate_grads_(2)
    expected = [acc.detach().cpu() / 2 for acc in averager._grad_accumulators()]
    averager.load_accumulators_into_averager_()
    seen = []
    copy_out = LocalFallback._copy_out_

    def recording_copy_out(self, host, scale):
        with _HostCopies() as copies:
            copy_out(self, host, scale)
        seen.append(copies.copies)

    monkeypatch.setattr(LocalFallback, "_copy_out_", recording_copy_out)
    averager._accumulators_used_in_step = True  # as GradientAverager.step leaves it once a round began
    averager.reset_accumulated_grads_()
    buckets = len(averager._accumulators.buckets)
    assert seen == [[(True, True)] * buckets if device == "cuda" else []], seen  # the CPU: torch.mul(out=)
    assert all(p.grad.count_nonzero() == 0 for p in model.parameters())
    model(torch.randn(2, 4, device=device)).square().mean().backward()  # the next epoch's first micro-step
    assert len(seen) == 1
    loaded = [torch.zeros_like(e) for e in expected]
    assert averager.local_fallback.load_into_(loaded)
    for got, want in zip(loaded, expected, strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want)


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("zero_grad_after_step", [False, True])
@pytest.mark.parametrize("whose_zero_grad", ["optimizer", "model"])
def test_zero_grad_drops_a_micro_batch_or_refuses(dht, reuse_grad_buffers, zero_grad_after_step, whose_zero_grad):
    """zero_grad() between backward() and step() drops that micro-batch in exact mode (the oracle), and in place
    when .grad was None before backward() (zero_grad after every step). In place with the view attached, backward()
    has added the micro-batch into the running sum already: refused, naming the parameter, instead of leaving a
    gradient the caller dropped in the sum; by opt.zero_grad() itself, or, after model.zero_grad(), by the next
    step(). Zeroing before backward() or after step() keeps the sum"""
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hivemind_accum.Optimizer(
        params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=1.0), run_id="zero_grad", dht=dht,
        target_batch_size=2, batch_size_per_step=1, reuse_grad_buffers=reuse_grad_buffers,
    )
    ones = torch.ones(1, 1)
    zero_grad = opt.zero_grad if whose_zero_grad == "optimizer" else model.zero_grad

    def micro_step():
        if not zero_grad_after_step:
            zero_grad()
        model(ones).sum().backward()
        opt.step()
        if zero_grad_after_step:
            zero_grad()

    try:
        micro_step(), micro_step()
        assert opt.local_epoch == 1 and model.weight.item() == -1.0
        model(ones * 100).sum().backward()
        if reuse_grad_buffers and not zero_grad_after_step:
            with pytest.raises(ValueError, match=r"parameters\[0\] \(shape \(1, 1\)\): .*zero_grad\(\) after backward"):
                zero_grad()
                micro_step()  # model.zero_grad() cannot refuse: the next step() does
            return
        zero_grad()  # drops the micro-batch of 100s
        micro_step(), micro_step()
        assert opt.local_epoch == 2 and model.weight.item() == -2.0
    finally:
        opt.shutdown()


def python_calls_in_backward(model, x) -> int:
    """Python frames entered during ``model(x).sum().backward()`` (the forward runs outside the count)"""
    loss = model(x).sum()
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.forked
@pytest.mark.parametrize("tensors", [40, 400])
def test_in_place_backward_makes_no_python_call_per_parameter(dht, tensors):
    """in place, a backward makes the Python calls native accumulation makes, whatever the parameter count; only one
    backward per epoch (the second micro-step's) runs hooks, which see in-place edits of the running sum"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(tensors // 2)])
    native = copy.deepcopy(model)
    x = torch.randn(1, 4)
    python_calls_in_backward(native, x)  # native accumulation, from the second backward on: .grad exists
    native_calls = python_calls_in_backward(native, x)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="calls", reuse_grad_buffers=True, start=False)
    for epoch in range(2):
        extra = []
        hooked = []
        for _ in range(5):
            hooked.append(sum(p._backward_hooks is not None for p in model.parameters()))
            extra.append(python_calls_in_backward(model, x) - native_calls)
            averager.accumulate_grads_(batch_size=1)
        assert extra[0] <= 4 and all(calls <= 4 for calls in extra[2:]), extra
        # no hook dict left either: an empty one still makes autograd take the GIL for each parameter, silently
        assert hooked == [0, tensors, 0, 0, 0], hooked
        assert extra[1] >= tensors, extra  # the hooked backward: one call per parameter
        averager.load_accumulators_into_averager_()
        averager.reset_accumulated_grads_()


def gan_micro_steps(generator, discriminator, step_=None):
    """four GAN-style micro-steps (the discriminator frozen for the generator's backward), then a gradient assigned
    with weight decay and a graph to the parameter (outside torch.no_grad); ``step_`` ends each micro-step"""
    torch.manual_seed(1)
    for _ in range(4):
        z, real = torch.randn(4, 2), torch.randn(4, 3)
        discriminator.requires_grad_(True)
        (discriminator(real).mean() - discriminator(generator(z).detach()).mean()).backward()
        discriminator.requires_grad_(False)
        (-discriminator(generator(z)).mean()).backward()
        discriminator.requires_grad_(True)
        step_ and step_()
    grads = torch.autograd.grad(generator(torch.randn(4, 2)).square().mean(), list(generator.parameters()))
    for param, grad in zip(generator.parameters(), grads):
        if step_:
            param.grad = grad + 0.01 * param
        else:
            with torch.no_grad():
                param.grad += grad + 0.01 * param
    step_ and step_()


@pytest.mark.forked
def test_in_place_toggling_requires_grad_and_assigned_grads_match_native(dht):
    """a parameter trainable again after the epoch's hooks were registered is no edit; a .grad assigned with a graph
    of its own (p.grad = g + wd * p) is a fresh gradient, added like any other"""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append((torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)))
    (generator, discriminator), (native_g, native_d) = models
    params = [*generator.parameters(), *discriminator.parameters()]
    averager = GradientAverager(params, dht=dht, prefix="gan", reuse_grad_buffers=True, start=False)
    gan_micro_steps(generator, discriminator, lambda: averager.accumulate_grads_(batch_size=4))
    gan_micro_steps(native_g, native_d)
    for acc, param in zip(averager._grad_accumulators(), [*native_g.parameters(), *native_d.parameters()]):
        torch.testing.assert_close(acc, param.grad)
