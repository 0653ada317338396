"""
One benchmark configuration in one fresh process: times the micro-steps of a local training loop that never
reaches the swarm's target batch size, so every ``opt.step()`` is a no-sync step.

Run as ``python -m benchmarks.micro_step_worker --impl exact --model linear-100m [--device cuda]``; prints one JSON
object (times in seconds, memory in bytes). Implementations:

- ``native``: plain PyTorch accumulation, ``loss.backward()`` into the existing ``.grad``, no optimizer call;
- ``upstream``: ``hivemind.Optimizer`` (upstream ``GradientAverager``, default ``reuse_grad_buffers=False``),
  ``zero_grad()`` before every backward;
- ``upstream_reuse``: ``hivemind.Optimizer(reuse_grad_buffers=True)``, no ``zero_grad`` (autograd accumulates into
  upstream's ``.grad`` buffers);
- ``exact``: ``hivemind_accum.Optimizer`` (``reuse_grad_buffers=False``), same loop as upstream;
- ``inplace``: ``hivemind_accum.Optimizer(reuse_grad_buffers=True)``, no ``zero_grad``;
- ``exact_hivemind`` and ``upstream_hivemind``: ``exact`` and ``upstream`` with ``hivemind.GradScaler`` under fp16:
  hivemind#566's own configuration (docs/measurement.md#on-a-gpu), which ``benchmarks/gpu_run.sh`` measures first;
- ``native_hivemind`` (a control, not in the sweep's default set): native accumulation in a process that also holds a
  started ``hivemind_accum.Optimizer`` (exact mode, never stepped): what hivemind's presence alone costs a micro-step.

Precisions (``--precision``): ``fp32``; ``bf16``: the forward pass under bf16 autocast; ``fp16``: fp16 autocast with
loss scaling, where native accumulation scales the loss (``torch.amp.GradScaler``, whose ``step`` and ``update`` run
once per optimizer step, not in a no-sync micro-step), upstream and exact call ``scaler.step(opt)`` and
``scaler.update()`` with ``torch.amp.GradScaler`` (upstream's recommendation without ``reuse_grad_buffers``), and
upstream_reuse and inplace do the same with ``hivemind.GradScaler`` (required there).

Every hivemind variant uses hivemind#566's configuration: fp16 gradient compression, offloaded optimizer,
delayed optimizer step and state averaging, ``matchmaking_time=5``; one peer whose target batch size is never
reached. ``--preset report`` is the report's whole setting: batch 32 of 224x224 images, fp16 autocast with loss
scaling, ``target_batch_size=32768`` (run it with ``--model resnet152`` or ``--model convnext-large``).

What is measured:

- ``micro_step``: seconds per micro-step (``zero_grad`` where the loop has one, forward, backward, ``step``). On the
  CPU one sample per micro-step. On CUDA one sample per *window* of ``--steps`` consecutive micro-steps: the window
  is timed with one ``torch.cuda.synchronize()`` before and one at its end and none inside (a synchronize per
  micro-step would hide a host stall, the very cost under suspicion), divided by its micro-steps; ``--windows``
  windows. Local throughput is ``batch_size / micro_step``.
- ``no_sync_step``: host seconds of the ``opt.step()`` call (with ``scaler.step`` + ``scaler.update`` under fp16),
  per micro-step, no synchronize (on CUDA: how long the host is held, including any stall waiting for the device).
- ``load``: the averaging-time ``load_accumulators_into_averager_``.
- ``work``: one extra no-sync step profiled with ``torch.profiler``: ``top_level_ops`` (aten operators without an
  aten parent, as ``tests/test_cost_guards.py`` counts them), ``kernels`` (device kernels and memcpy/memset
  activities), ``host_reads`` (``aten::_local_scalar_dense``: every ``.item()``/``bool(tensor)``), ``device_syncs``
  (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls), and ``sync_warnings`` (the
  synchronizing operations ``torch.cuda.set_sync_debug_mode("warn")`` reports during one more no-sync step).
- ``numels``: each parameter's element count, in order (what :mod:`benchmarks.kernel_launches` counts launches from).
- ``peak_device_bytes`` (``torch.cuda.max_memory_allocated``, CUDA only), ``peak_rss_bytes``, per-micro-step minor
  page faults and system CPU seconds (CPU: to tell allocator or kernel trouble from accumulation work).
"""
import argparse
import json
import resource
import sys
import time
import warnings
from typing import Optional

import torch

from benchmarks.models import build_model, make_inputs

IMPLEMENTATIONS = ("native", "upstream", "exact", "inplace")
REPORT_IMPLEMENTATIONS = ("native", "upstream", "upstream_reuse", "exact", "inplace", "exact_hivemind", "upstream_hivemind")
CONTROLS = ("native_hivemind",)
IN_PLACE_LOOPS = ("upstream_reuse", "inplace")  # no zero_grad: autograd accumulates into .grad; hivemind.GradScaler
HIVEMIND_SCALER = IN_PLACE_LOOPS + ("exact_hivemind", "upstream_hivemind")  # under fp16
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICES = ("cpu", "cuda")
# hivemind#566's setting: batch 32 of 224x224 images, fp16 AMP, target 32768 samples
PRESETS = {"report": dict(batch_size=32, image_size=224, precision="fp16", target_batch_size=32768)}
WORK_KEYS = ("top_level_ops", "kernels", "host_reads", "device_syncs", "sync_warnings")
SYNC_RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
HOST_READ = "aten::_local_scalar_dense"  # what .item(), bool(tensor) and tensor.tolist() of a scalar end in


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def report_configuration() -> dict:
    """
    hivemind#566's :class:`hivemind.Optimizer` arguments that a CPU allows.

    :returns: fp16 gradient compression, offloaded optimizer, delayed optimizer step and state averaging, quiet
    """
    from hivemind.compression import Float16Compression

    return dict(
        grad_compression=Float16Compression(), offload_optimizer=True, delay_optimizer_step=True,
        delay_state_averaging=True, verbose=False,
    )


def count_events(events) -> dict:
    """
    Count the work in a :mod:`torch.profiler` trace.

    :param events: ``profile.events()``
    :returns: ``top_level_ops`` (aten operators without a parent, as ``tests/test_cost_guards.py`` counts them),
      ``kernels`` (device activities), ``host_reads`` (``.item()``, ``bool(tensor)``) and ``device_syncs``
    """
    return dict(
        top_level_ops=sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::")),
        kernels=sum(1 for e in events if e.device_type != torch.autograd.DeviceType.CPU),
        host_reads=sum(1 for e in events if e.name == HOST_READ),
        device_syncs=sum(1 for e in events if e.name in SYNC_RUNTIME_CALLS),
    )


class Loop:
    """
    One implementation's training loop, ready to run micro-steps: its model (seeded), inputs, optimizer and scaler.

    :param impl: one of :data:`REPORT_IMPLEMENTATIONS` or :data:`CONTROLS`
    :param dht: a started DHT to share (one per process in :mod:`benchmarks.gpu_protocol`); else the loop starts its own
    """

    def __init__(
        self, impl: str, model_name: str, batch_size: int, precision: str = "fp32", device: str = "cpu",
        image_size: int = 32, target_batch_size: int = 10**9, dht=None,
    ):
        self.impl, self.model_name, self.batch_size, self.device, self.image_size = impl, model_name, batch_size, device, image_size
        torch.manual_seed(0)
        self.model = build_model(model_name).to(device)
        self.generator = torch.Generator(device=device).manual_seed(1)
        self.opt = self.own_dht = None
        if impl != "native":
            import hivemind

            import hivemind_accum

            if dht is None:
                dht = self.own_dht = hivemind.DHT(start=True)
            optimizer_cls = hivemind.Optimizer if impl.startswith("upstream") else hivemind_accum.Optimizer
            self.opt = optimizer_cls(
                dht=dht, run_id=f"bench_{impl}", params=self.model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
                target_batch_size=target_batch_size, batch_size_per_step=batch_size,
                reuse_grad_buffers=impl in IN_PLACE_LOOPS, matchmaking_time=5.0, **report_configuration(),
            )
        self.scaler = None
        if precision == "fp16" and impl in HIVEMIND_SCALER:
            import hivemind

            self.scaler = hivemind.GradScaler(device)
        elif precision == "fp16":
            self.scaler = torch.amp.GradScaler(device)
        self.autocast_dtype = PRECISIONS[precision]

    def micro_step(self, timings: Optional[list] = None, during_step=None) -> None:
        """one micro-step; ``timings`` gets the host seconds of the step call, ``during_step`` wraps it"""
        impl, opt, scaler = self.impl, self.opt, self.scaler
        inputs = make_inputs(self.model_name, self.batch_size, self.generator, image_size=self.image_size, device=self.device)
        if impl in ("upstream", "exact", "upstream_hivemind", "exact_hivemind"):
            opt.zero_grad()
        with torch.autocast(self.device, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None):
            loss = self.model(inputs).float().square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        step_start = time.perf_counter()
        with during_step() if during_step is not None else _nothing():
            if impl in ("native", "native_hivemind"):
                pass
            elif scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if timings is not None:
            timings.append(time.perf_counter() - step_start)

    def shutdown(self) -> None:
        if self.opt is not None:
            self.opt.shutdown()
        if self.own_dht is not None:
            self.own_dht.shutdown()


def run(
    impl: str, model_name: str, steps: int, warmup: int, batch_size: int, threads: int, precision: str = "fp32",
    device: str = "cpu", windows: int = 1, image_size: int = 32, target_batch_size: int = 10**9,
) -> dict:
    """
    Measure one configuration in this process: warm up, time the micro-steps, profile one no-sync step, time the load.

    :param impl: one of :data:`REPORT_IMPLEMENTATIONS` or :data:`CONTROLS`
    :param model_name: a :func:`benchmarks.models.build_model` name
    :param steps: measured micro-steps: one sample each on the CPU, one window on CUDA
    :param windows: CUDA only: timed windows of ``steps`` micro-steps
    :param target_batch_size: the swarm's target, never reached (asserted)
    :returns: the measurements, as the module docstring describes them
    """
    torch.set_num_threads(threads)
    loop = Loop(impl, model_name, batch_size, precision, device, image_size, target_batch_size)
    model, opt, micro_step = loop.model, loop.opt, loop.micro_step

    micro_steps, no_sync_steps, loads, minor_faults, system_times = [], [], [], [], []
    try:
        for _ in range(warmup):
            micro_step()
        if device == "cuda":
            for _ in range(windows):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    micro_step(no_sync_steps)
                torch.cuda.synchronize()  # the only synchronize of the window, at its end
                micro_steps.append((time.perf_counter() - start) / steps)
        else:
            for _ in range(steps):
                usage_before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                micro_step(no_sync_steps)
                micro_steps.append(time.perf_counter() - start)
                usage = resource.getrusage(resource.RUSAGE_SELF)
                minor_faults.append(usage.ru_minflt - usage_before.ru_minflt)
                system_times.append(usage.ru_stime - usage_before.ru_stime)
        try:  # a failure to count must not lose the timings above
            work = count_work(micro_step, device)
        except Exception as e:  # noqa: BLE001
            print(f"count_work failed: {e!r}", file=sys.stderr)
            work = dict.fromkeys(WORK_KEYS) | dict(error=repr(e))
        if opt is not None:
            assert opt.local_epoch == 0, "the benchmark must never reach the target batch size"
            for _ in range(3):
                _synchronize(device)
                start = time.perf_counter()
                opt.grad_averager.load_accumulators_into_averager_()
                _synchronize(device)
                loads.append(time.perf_counter() - start)
    finally:
        loop.shutdown()
    return dict(
        impl=impl, model=model_name, precision=precision, device=device, params=sum(p.numel() for p in model.parameters()),
        tensors=len(list(model.parameters())), numels=[p.numel() for p in model.parameters()], batch_size=batch_size, image_size=image_size, threads=threads,
        micro_step=micro_steps, no_sync_step=no_sync_steps if opt is not None else [], load=loads,
        minor_faults=minor_faults, system_time=system_times, work=work,
        peak_device_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        device_name=torch.cuda.get_device_name() if device == "cuda" else None,
    )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def count_work(micro_step, device: str) -> dict:
    """
    Count what one no-sync step does: profile the ``step`` call of one more micro-step, then, on CUDA, count the
    synchronizing calls ``torch.cuda.set_sync_debug_mode("warn")`` reports during another.

    :param micro_step: the worker's micro-step, taking ``during_step`` (a context manager factory around ``step``)
    :returns: :func:`count_events` of the profile, plus ``sync_warnings`` (``None`` on the CPU)
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    holder = {}

    def profiled():
        holder["prof"] = profile(activities=activities)
        return holder["prof"]

    micro_step(during_step=profiled)
    _synchronize(device)
    events = holder["prof"].events()
    work = dict(count_events(events), sync_warnings=None)
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            micro_step(during_step=_sync_debug_warn)
        work["sync_warnings"] = sum(1 for w in caught if "synchronizing" in str(w.message))
    return work


class _sync_debug_warn:
    """``torch.cuda.set_sync_debug_mode("warn")`` inside the block: every synchronizing CUDA call warns"""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=REPORT_IMPLEMENTATIONS + CONTROLS, required=True)
    parser.add_argument("--model", default="linear-100m")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--preset", choices=PRESETS, help="hivemind#566's setting (overrides batch size, "
                        "image size, precision and target batch size)")
    parser.add_argument("--steps", type=int, default=10, help="measured micro-steps (per window on CUDA)")
    parser.add_argument("--windows", type=int, default=1, help="CUDA: timed windows of --steps micro-steps")
    parser.add_argument("--warmup", type=int, default=3, help="micro-steps before measuring")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=32, help="side of the images for resnet152/convnext-large")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    config = dict(batch_size=args.batch_size, image_size=args.image_size, precision=args.precision,
                  target_batch_size=10**9)
    config.update(PRESETS.get(args.preset, {}))
    result = run(args.impl, args.model, args.steps, args.warmup, threads=args.threads, device=args.device,
                 windows=args.windows, **config)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
