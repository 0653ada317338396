"""
Behaviour checks run against a hivemind package in a subprocess by tests/test_upstream.py: once with the patched
hivemind (the installed one with every pull request applied) first on PYTHONPATH, once with the installed hivemind.
Only plain hivemind classes are used (``hivemind.Optimizer``, ``hivemind.optim.grad_averager.GradientAverager``), never this project's package.

Usage: ``python tests/upstream_checks.py RESULTS_FILE [CHECK ...]`` (default: every check in ``CHECKS``); writes a
dict of tensors and counts with ``torch.save``.
"""
import gc
import importlib
import os
import pkgutil
import sys
import traceback
from typing import Optional
from unittest import mock

import hivemind
import torch
from hivemind.compression import Float16Compression
from hivemind.optim import grad_averager
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
    with mock.patch.object(grad_averager.logger, "warning") as warning:
        averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        return dict(
            in_place=[tensor.clone() for tensor in averaged],
            native=[param.grad / len(BATCH_SIZES) for param in native.parameters()],
            in_place_warnings=[call.args[0] for call in warning.call_args_list],
        )


def top_level_ops(function) -> list:
    """names of the operators ``function()`` runs that no other operator called, as the profiler records them; with
    the cyclic collector off after a collection, so that an object it frees meanwhile (hivemind's StepControl.__del__
    reads .item()) does not count as the function's"""
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            function()
    finally:
        gc.enable()
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
    """host reads of each of four no-sync micro-steps' loop (zero_grad, scale(loss).backward(), scaler.step(opt),
    update()) with hivemind.GradScaler in exact mode, the second micro-step overflowing, and the scale after each"""
    reads, scales, epoch, _ = _amp_loop(dht, "amp_reads", layers=2)
    return dict(amp_host_reads=reads, amp_scales=scales, amp_epoch=epoch)


def amp_566(dht) -> dict:
    """the same loop in hivemind#566's configuration (fp16 compression, offloaded optimizer, delayed optimizer step and
    state averaging), on models of 4 and 16 parameter tensors: host reads per micro-step and the top-level operators of
    scaler.step(opt), the no-sync step"""
    found = {}
    for layers in 2, 8:
        found[layers] = _amp_loop(
            dht, f"amp_566_{layers}", layers=layers, grad_compression=Float16Compression(),
            state_averaging_compression=Float16Compression(), offload_optimizer=True, delay_optimizer_step=True,
            delay_state_averaging=True, profile_step=3,
        )
    return dict(amp_566={layers: dict(reads=r, scales=s, epoch=e, ops=o) for layers, (r, s, e, o) in found.items()})


def _amp_loop(dht, run_id: str, layers: int, profile_step: Optional[int] = None, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(layers)))
    opt = hivemind.Optimizer(
        dht=dht, run_id=run_id, params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**9, batch_size_per_step=2, tracker_opts=SINGLE_PEER_TRACKER, **options,
    )
    scaler = hivemind.GradScaler("cpu", init_scale=2.0**10)
    reads, scales, ops = [], [], None
    try:
        for step in range(5):
            gc.collect()  # a collected StepControl reads its state on the host in __del__
            with HostReads() as counted:
                opt.zero_grad()
                generator = torch.Generator().manual_seed(step)
                loss = model(torch.randn(2, 6, generator=generator)).square().mean()
                scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
                if step == profile_step:
                    ops = top_level_ops(lambda: scaler.step(opt))
                else:
                    scaler.step(opt)
                scaler.update()
            if step:  # the first micro-step builds the scaler's state
                reads.append(counted.count)
                scales.append(scaler.get_scale())
        return reads, scales, opt.local_epoch, ops
    finally:
        opt.shutdown()


def imports(dht) -> dict:
    """each module of ``hivemind.optim``: its file, or the error that importing it raised"""
    found = {}
    for module in pkgutil.iter_modules(hivemind.optim.__path__):
        try:
            found[module.name] = importlib.import_module(f"hivemind.optim.{module.name}").__file__
        except Exception as e:
            found[module.name] = f"error: {e!r}"
    return dict(imports=found)


CHECKS = {
    check.__name__: check
    for check in (
        exact_mode, in_place_mode, no_sync_accumulation, no_sync_step, amp_host_reads, amp_566, imports,
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
