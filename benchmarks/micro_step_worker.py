"""
One benchmark configuration in one fresh process: times every micro-step of a local training loop that never
reaches the swarm's target batch size, so every ``opt.step()`` is a no-sync step.

Run as ``python -m benchmarks.micro_step_worker --impl exact --model linear-100m``; prints one JSON object with
per-micro-step samples in seconds (``micro_step``: zero_grad + forward + backward + step; ``no_sync_step``: the
``opt.step()`` call alone; ``load``: the averaging-time ``load_accumulators_into_averager_``), per-micro-step minor
page faults and system CPU seconds (to tell allocator or kernel trouble from accumulation work), peak RSS in bytes
and the parameter count. Implementations:

- ``native``: plain PyTorch accumulation, ``loss.backward()`` into the existing ``.grad``, no optimizer call;
- ``upstream``: ``hivemind.Optimizer`` (upstream ``GradientAverager``), ``zero_grad()`` before every backward;
- ``exact``: ``hivemind_accum.Optimizer`` (``reuse_grad_buffers=False``), same loop as upstream;
- ``inplace``: ``hivemind_accum.Optimizer(reuse_grad_buffers=True)``, no ``zero_grad`` (autograd accumulates);
- ``native_hivemind`` (a control, not in the sweep's default set): native accumulation in a process that also holds a
  started ``hivemind_accum.Optimizer`` (exact mode, never stepped): what hivemind's presence alone costs a micro-step.

Precisions (``--precision``): ``fp32``; ``bf16``: the forward pass under CPU bf16 autocast; ``fp16``: fp16 autocast
with loss scaling, where native accumulation scales the loss (``torch.amp.GradScaler``, whose ``step`` and ``update``
run once per optimizer step, not in a no-sync micro-step), upstream and exact call ``scaler.step(opt)`` and
``scaler.update()`` with ``torch.amp.GradScaler`` (upstream's recommendation without ``reuse_grad_buffers``) and
inplace does the same with ``hivemind.GradScaler`` (required there). ``micro_step`` includes the scaler calls.

Both hivemind variants use the slowdown report's configuration where the CPU allows: fp16 gradient compression,
offloaded optimizer, delayed optimizer step and state averaging; one peer with a target batch size it never reaches.
"""
import argparse
import json
import resource
import sys
import time

import torch

from benchmarks.models import build_model, make_inputs

IMPLEMENTATIONS = ("native", "upstream", "exact", "inplace")
CONTROLS = ("native_hivemind",)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(
    impl: str, model_name: str, steps: int, warmup: int, batch_size: int, threads: int, precision: str = "fp32"
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(model_name)
    generator = torch.Generator().manual_seed(1)
    opt = dht = None
    if impl != "native":
        import hivemind
        from hivemind.compression import Float16Compression

        import hivemind_accum

        dht = hivemind.DHT(start=True)
        optimizer_cls = hivemind.Optimizer if impl == "upstream" else hivemind_accum.Optimizer
        opt = optimizer_cls(
            dht=dht, run_id=f"bench_{impl}", params=model.parameters(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            target_batch_size=10**9, batch_size_per_step=batch_size, reuse_grad_buffers=impl == "inplace",
            grad_compression=Float16Compression(), offload_optimizer=True, delay_optimizer_step=True,
            delay_state_averaging=True, matchmaking_time=5.0, verbose=False,
        )
    scaler = None
    if precision == "fp16":
        scaler = hivemind.GradScaler("cpu") if impl == "inplace" else torch.amp.GradScaler("cpu")
    autocast_dtype = PRECISIONS[precision]
    micro_steps, no_sync_steps, loads, minor_faults, system_times = [], [], [], [], []
    try:
        for step in range(warmup + steps):
            inputs = make_inputs(model_name, batch_size, generator)
            usage_before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            if impl in ("upstream", "exact"):
                opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = model(inputs).float().square().mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            step_start = time.perf_counter()
            if impl == "native_hivemind":
                pass
            elif opt is not None and scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif opt is not None:
                opt.step()
            end = time.perf_counter()
            if step >= warmup:
                usage = resource.getrusage(resource.RUSAGE_SELF)
                micro_steps.append(end - start)
                no_sync_steps.append(end - step_start)
                minor_faults.append(usage.ru_minflt - usage_before.ru_minflt)
                system_times.append(usage.ru_stime - usage_before.ru_stime)
        if opt is not None:
            assert opt.local_epoch == 0, "the benchmark must never reach the target batch size"
            for _ in range(3):
                start = time.perf_counter()
                opt.grad_averager.load_accumulators_into_averager_()
                loads.append(time.perf_counter() - start)
    finally:
        if opt is not None:
            opt.shutdown()
            dht.shutdown()
    return dict(
        impl=impl, model=model_name, precision=precision, params=sum(p.numel() for p in model.parameters()),
        tensors=len(list(model.parameters())), batch_size=batch_size, threads=threads,
        micro_step=micro_steps, no_sync_step=no_sync_steps if opt is not None else [], load=loads,
        minor_faults=minor_faults, system_time=system_times,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=IMPLEMENTATIONS + CONTROLS, required=True)
    parser.add_argument("--model", default="linear-100m")
    parser.add_argument("--steps", type=int, default=10, help="measured micro-steps")
    parser.add_argument("--warmup", type=int, default=3, help="micro-steps before measuring")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    args = parser.parse_args(argv)
    result = run(args.impl, args.model, args.steps, args.warmup, args.batch_size, args.threads, args.precision)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
