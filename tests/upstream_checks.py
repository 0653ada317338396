"""
Behaviour checks run against a hivemind package in a subprocess by tests/test_upstream_series.py: once with the
generated (patched) hivemind first on PYTHONPATH, once with the installed upstream hivemind. Only plain hivemind classes
are used (``hivemind.Optimizer``, ``hivemind.optim.grad_averager.GradientAverager``), never this project's package.

Usage: ``python tests/upstream_checks.py RESULTS_FILE [CHECK ...]`` (default: every check in ``CHECKS``); writes a
dict of tensors and counts with ``torch.save``.
"""
import contextlib
import gc
import importlib
import importlib.util
import os
import sys
import traceback
from unittest import mock

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

BATCH_SIZES = (3, 5, 2, 4)  # several micro-steps of different sizes (exact mode weighs them by batch size)
# a single peer whose progress tracker never re-fetches the swarm's progress during the check (see tests/conftest.py)
SINGLE_PEER_TRACKER = dict(min_refresh_period=60, max_refresh_period=120, default_refresh_period=60)


class Net(torch.nn.Module):
    """a random model with float32 and float64 parameters: two accumulator buckets on CPU"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.head = torch.nn.Linear(4, 2).double()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(inputs).double())


def backward(model: Net, step: int, batch_size: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    inputs, targets = torch.randn(batch_size, 6, generator=generator), torch.randn(batch_size, 2, generator=generator)
    (model(inputs).float() - targets).square().mean().backward()


def exact_mode(dht) -> dict:
    """the averaged gradients after several micro-steps (loaded as hivemind.Optimizer loads them for a round)"""
    model = Net()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="exact", start=False)
    for step, batch_size in enumerate(BATCH_SIZES):
        model.zero_grad(set_to_none=True)
        backward(model, step, batch_size)
        averager.accumulate_grads_(batch_size)
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        return dict(exact=[tensor.clone() for tensor in averaged], exact_samples=averager.local_samples_accumulated)


def in_place_mode(dht) -> dict:
    """reuse_grad_buffers=True with a loop that sets .grad to None every micro-step, and native accumulation"""
    model, native = Net(), Net()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="in_place", reuse_grad_buffers=True, start=False)
    for step in range(len(BATCH_SIZES)):
        backward(model, step, 4)
        averager.accumulate_grads_(4)
        for param in model.parameters():
            param.grad = None  # a framework that zeroes gradients after every optimizer call
        backward(native, step, 4)  # native PyTorch accumulation into .grad
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        return dict(
            in_place=[tensor.clone() for tensor in averaged],
            native=[param.grad / len(BATCH_SIZES) for param in native.parameters()],
        )


def scaled_micro_steps(dht) -> dict:
    """exact mode with a loss scale of 2: micro-steps unscaled as they are added and the second one, which overflows,
    dropped; and the same micro-steps without loss scaling, the second one left out (None on a hivemind whose
    accumulate_grads_ takes no inv_grad_scale)"""
    overflowing = 1
    results = {}
    for name, scaled in ("scaled", True), ("scaled_reference", False):
        model = Net()
        averager = GradientAverager(model.parameters(), dht=dht, prefix=name, start=False)
        found = []
        for step, batch_size in enumerate(BATCH_SIZES):
            if step == overflowing and not scaled:
                continue
            model.zero_grad(set_to_none=True)
            backward(model, step, batch_size)
            if scaled:
                for param in model.parameters():
                    param.grad.mul_(2.0)  # as if the loss had been scaled by 2
                if step == overflowing:
                    next(model.parameters()).grad[0, 0] = float("inf")
                try:
                    found.append(averager.accumulate_grads_(batch_size, inv_grad_scale=torch.tensor(0.5)).item())
                except TypeError:
                    return dict(scaled=None)
            else:
                averager.accumulate_grads_(batch_size)
        averager.load_accumulators_into_averager_()
        with averager.get_tensors() as averaged:
            results[name] = [tensor.clone() for tensor in averaged]
        results[f"{name}_samples"] = averager.local_samples_accumulated
        if scaled:
            results["scaled_found_inf"] = found
    return results


def nonfinite_round(dht) -> dict:
    """what a GradientAverager loads for a round after a micro-step whose gradients hold NaN"""
    model = Net()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="nonfinite", start=False)
    for step, batch_size in enumerate(BATCH_SIZES[:2]):
        model.zero_grad(set_to_none=True)
        backward(model, step, batch_size)
        if step == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        averager.accumulate_grads_(batch_size)
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        loaded = [tensor.clone() for tensor in averaged]
    return dict(nonfinite_loaded=loaded, nonfinite_samples=averager.local_samples_accumulated)


def progress_record(dht) -> dict:
    """how many LocalTrainingProgress records a plain hivemind ProgressTracker builds for 100 micro-step reports, and
    the record read after them (the tracker's threads are not started, so nothing else reads it)"""
    from hivemind.optim import progress_tracker

    tracker = progress_tracker.ProgressTracker(dht, prefix="record", target_batch_size=10**9, start=False)
    real = progress_tracker.LocalTrainingProgress
    with mock.patch.object(progress_tracker, "LocalTrainingProgress", wraps=real) as built:
        for samples in range(1, 101):
            tracker.report_local_progress(3, samples)
        builds = built.call_count
    record = tracker.local_progress
    return dict(
        progress_builds=builds, progress_record=(type(record).__name__, record.epoch, record.samples_accumulated)
    )


def top_level_ops(function) -> list:
    """names of the operators ``function()`` runs that no other operator called, as the profiler records them"""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function()
    return [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]


def no_sync_accumulation(dht) -> dict:
    """top-level operators of the exact mode's third micro-step on the two-bucket model"""
    model = Net()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="buckets", start=False)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        backward(model, step, 2)
        if step < 2:
            averager.accumulate_grads_(2)
    return dict(accumulate_ops=top_level_ops(lambda: averager.accumulate_grads_(2)))


def no_sync_step(dht) -> dict:
    """top-level operators of a plain hivemind.Optimizer's third no-sync step (exact mode, float32 model: one
    bucket; upstream's optimizer offloads parameters in float32, so the two-dtype model does not fit it)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = hivemind.Optimizer(
        dht=dht, run_id="no_sync", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**9, batch_size_per_step=2, tracker_opts=SINGLE_PEER_TRACKER,
    )
    try:
        for step in range(3):
            opt.zero_grad()
            generator = torch.Generator().manual_seed(step)
            model(torch.randn(2, 6, generator=generator)).square().mean().backward()
            if step < 2:
                opt.step()
        return dict(no_sync_ops=top_level_ops(opt.step), no_sync_epoch=opt.local_epoch)
    finally:
        opt.shutdown()


class HostReads(TorchDispatchMode):
    """counts ``aten::_local_scalar_dense`` (``.item()`` and the like: a host read) dispatched in this thread"""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def amp_host_reads(dht) -> dict:
    """host reads of each of three no-sync micro-steps' loop (zero_grad, scale(loss).backward(), scaler.step(opt),
    update()) with hivemind.GradScaler in exact mode, the second micro-step overflowing, and the scale after each; the
    loss-scaling path an accelerator takes, forced on the CPU where the tree has one"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = hivemind.Optimizer(
        dht=dht, run_id="amp_reads", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**9, batch_size_per_step=2, tracker_opts=SINGLE_PEER_TRACKER,
    )
    scaler = hivemind.GradScaler("cpu", init_scale=2.0**10)
    buckets = sys.modules.get("hivemind.optim.grad_buckets")
    forced = (mock.patch.object(buckets, "_host_check_is_free", lambda _: False)
              if hasattr(buckets, "_host_check_is_free") else contextlib.nullcontext())
    reads, scales = [], []
    try:
        with forced:
            for step in range(4):
                gc.collect()  # a collected StepControl reads its state on the host in __del__
                with HostReads() as counted:
                    opt.zero_grad()
                    generator = torch.Generator().manual_seed(step)
                    loss = model(torch.randn(2, 6, generator=generator)).square().mean()
                    scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
                    scaler.step(opt)
                    scaler.update()
                if step:  # the first micro-step runs the first use's checks of torch's private interfaces
                    reads.append(counted.count)
                    scales.append(scaler.get_scale())
        return dict(amp_host_reads=reads, amp_scales=scales, amp_epoch=opt.local_epoch)
    finally:
        opt.shutdown()


def failed_round(dht) -> dict:
    """what hivemind.Optimizer would step with after a round that began and then failed: alone in the swarm, with a
    target group of two, the round's matchmaking always fails"""
    model = Net()
    averager = GradientAverager(
        model.parameters(), dht=dht, prefix="lonely", target_group_size=2, min_matchmaking_time=0.5,
        request_timeout=0.2, start=True,
    )
    try:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            backward(model, step, 2)
            averager.accumulate_grads_(2)
        expected = [acc.clone() / 2 for acc in averager._grad_accumulators()]  # the round's local gradients
        control = averager.step(wait=False, timeout=2.0)
        try:
            control.result(timeout=30)
            failed = False
        except Exception:
            failed = True
        averager.load_accumulators_into_averager_()  # hivemind.Optimizer's "Proceeding with local gradients"
        with averager.get_tensors() as averaged:
            return dict(round_failed=failed, fallback=[t.clone() for t in averaged], local=expected)
    finally:
        averager.shutdown()


def _optimizer(dht, batch_size_per_step=2, **kwargs) -> hivemind.Optimizer:
    model = torch.nn.Linear(3, 1)
    return hivemind.Optimizer(
        dht=dht, run_id="checks", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**9, batch_size_per_step=batch_size_per_step, tracker_opts=SINGLE_PEER_TRACKER, **kwargs,
    )


def client_mode(dht) -> dict:
    """``client_mode=True`` given explicitly to an optimizer whose DHT is a full peer: kept, or replaced by the DHT's"""
    opt = _optimizer(dht, client_mode=True)
    try:
        return dict(explicit_client_mode=opt.client_mode, averager_client_mode=opt.grad_averager.client_mode)
    finally:
        opt.shutdown()


def failed_constructor(dht) -> dict:
    """what a constructor that raises leaves behind: errors printed by __del__ (``sys.unraisablehook``)"""
    unraisable = []

    def hook(info) -> None:  # only the optimizer's own: other checks' garbage may be collected here too
        if "Optimizer" in getattr(info.object, "__qualname__", ""):
            unraisable.append(repr(info.exc_value))

    gc.collect()
    previous, sys.unraisablehook = sys.unraisablehook, hook
    try:
        try:
            hivemind.Optimizer(dht)
        except TypeError:
            pass
        gc.collect()
    finally:
        sys.unraisablehook = previous
    return dict(unraisable_after_failed_constructor=unraisable)


def client_mode_with_auxiliary(dht) -> dict:
    """the error for ``client_mode=True, auxiliary=True`` (None: the optimizer was built)"""
    try:
        opt = _optimizer(dht, client_mode=True, auxiliary=True, batch_size_per_step=None)
    except Exception as e:
        return dict(client_mode_with_auxiliary=type(e).__name__)
    opt.shutdown()
    return dict(client_mode_with_auxiliary=None)


def constructor_checks(dht) -> dict:
    """the errors for ``batch_size_per_step=0`` and for a parameter listed twice (None: the optimizer was built)"""
    param = torch.nn.Parameter(torch.zeros(2))
    found = {}
    for name, kwargs in ("zero_batch_size", dict(batch_size_per_step=0, params=[param])), (
        "duplicate_parameter", dict(batch_size_per_step=2, params=[param, param])
    ):
        try:
            opt = hivemind.Optimizer(
                dht=dht, run_id=f"checks_{name}", optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                target_batch_size=10**9, tracker_opts=SINGLE_PEER_TRACKER, **kwargs,
            )
        except Exception as e:
            found[name] = type(e).__name__
            continue
        opt.shutdown()
        found[name] = None
    return dict(constructor_checks=found)


def disabled_grad_scaler(dht) -> dict:
    """what ``update()`` of a disabled ``hivemind.GradScaler`` returns, or the error it raises"""
    scaler = hivemind.GradScaler(enabled=False)
    try:
        return dict(disabled_scaler_update=scaler.update())
    except AttributeError as e:
        return dict(disabled_scaler_update=repr(e))


def cancel_order(dht) -> dict:
    """whether a cancelled StepControl reads as cancelled when the averager's process receives each cancel signal"""
    from hivemind.averaging.control import StepControl
    from hivemind.utils import MPFuture, get_dht_time

    control = StepControl(scheduled_time=get_dht_time(), deadline=float("inf"), allow_retries=False, weight=1.0,
                          data_for_gather=b"")
    trigger, cancel = MPFuture(), MPFuture()
    control.attach(trigger, cancel)
    seen = []
    for future, name in ((trigger, "cancel"), (cancel, "set_result")):
        original = getattr(future, name)
        setattr(future, name, lambda *args, original=original: (seen.append(control.cancelled()), original(*args))[1])
    control.cancel()
    return dict(cancelled_when_signalled=seen)


def imports(dht) -> dict:
    """each module of ``hivemind.optim`` that the series adds or changes, if present: its file, or the error that
    importing it raised (a series' first patches add modules that nothing imports yet)"""
    names = (
        "torch_internals", "grad_buckets", "local_fallback", "round_guard", "progress_tracker", "grad_averager",
        "power_sgd_averager", "state_averager", "optimizer",
    )
    found = {}
    for name in names:
        if importlib.util.find_spec(f"hivemind.optim.{name}") is None:
            continue
        try:
            found[name] = importlib.import_module(f"hivemind.optim.{name}").__file__
        except Exception as e:
            found[name] = f"error: {e!r}"
    return dict(imports=found)


CHECKS = {
    check.__name__: check
    for check in (
        exact_mode, in_place_mode, no_sync_accumulation, no_sync_step, failed_round, client_mode, failed_constructor,
        client_mode_with_auxiliary, disabled_grad_scaler, constructor_checks, scaled_micro_steps, nonfinite_round,
        progress_record, cancel_order, amp_host_reads, imports,
    )
}


def main(path: str, names=()) -> None:
    dht = hivemind.DHT(start=True)
    try:
        results = dict(hivemind_file=hivemind.__file__)
        for name in names or CHECKS:
            results.update(CHECKS[name](dht))
        results["imported_hivemind_accum"] = any(name.startswith("hivemind_accum") for name in sys.modules)
        torch.save(results, path)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # a background thread of a half-built optimizer must not keep the process alive
    os._exit(0)
