"""
The parts of two fixed costs, measured in one process (docs/measurement.md), in CPU time of the calling thread
(``time.thread_time``, less disturbed than wall time by other processes on a shared machine), one torch thread:

- ``load``: ways to load 100 M float32 elements (760 tensors' worth) into a shared buffer scaled by ``1 / K`` and
  decide whether they are finite: upstream's per-tensor ``copy_`` and ``mul_``; one ``torch.mul(out=)``; that plus a
  separate ``sum`` (the check before the chunked load); a copy then ``_amp_foreach_non_finite_check_and_unscale_``
  over the whole buffer; and chunk by chunk (mul then sum, or copy then the amp kernel) for several chunk sizes.
- ``no-sync``: the calls of one no-sync ``step()`` of ``hivemind.Optimizer`` / ``hivemind_accum.Optimizer`` on
  ``mlp-200x16`` (400 tensors), each timed alone, and reading ``.grad`` of its 400 parameters.

Run: ``python -m benchmarks.floor_parts load`` (about 1 minute), ``python -m benchmarks.floor_parts no-sync --impl
inplace`` (and ``upstream_reuse``, ``exact``, ``upstream``).
"""
import argparse
import operator
import statistics
import time
import timeit

import torch

from hivemind_accum.torch_compat import non_finite_check_and_unscale_


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1e3 * statistics.median(times)


def load_variants(elements: int = 100_000_000, tensors: int = 760, repeats: int = 9) -> None:
    src = torch.randn(elements)
    dst = torch.zeros(elements).share_memory_()
    sizes = [elements // tensors] * tensors
    sizes[-1] += elements - sum(sizes)
    src_views, dst_views = src.split(sizes), dst.split(sizes)
    scale, found_inf, inv_scale = 1 / 3, torch.zeros(()), torch.tensor(1 / 3)

    def upstream():
        for a, b in zip(src_views, dst_views):
            b.copy_(a).mul_(scale)

    def chunked_sum(chunk):
        sums = torch.empty(-(-elements // chunk))
        pairs = list(zip(src.split(chunk), dst.split(chunk), sums.unbind()))

        def run():
            for a, b, slot in pairs:
                torch.mul(a, scale, out=b)
                torch.sum(b, dim=0, out=slot)
            return bool(sums.isfinite().all())

        return run

    def chunked_amp(chunk):
        pairs = list(zip(src.split(chunk), dst.split(chunk)))

        def run():
            found_inf.zero_()
            for a, b in pairs:
                b.copy_(a)
                non_finite_check_and_unscale_([b], found_inf, inv_scale)
            return found_inf.item() == 0

        return run

    def whole_amp():
        dst.copy_(src)
        non_finite_check_and_unscale_([dst], found_inf, inv_scale)
        return found_inf.item() == 0

    variants = {
        "upstream: copy_ + mul_ per tensor": upstream,
        "mul(out=) per bucket, no check": lambda: torch.mul(src, scale, out=dst),
        "mul(out=) + separate sum": lambda: (torch.mul(src, scale, out=dst), bool(dst.sum().isfinite())),
        "copy + amp check-and-unscale": whole_amp,
    }
    for chunk in (1 << 16, 1 << 17, 1 << 18, 1 << 20):
        variants[f"chunks of {chunk >> 10} K: mul(out=) + sum"] = chunked_sum(chunk)
        variants[f"chunks of {chunk >> 10} K: copy + amp"] = chunked_amp(chunk)
    results = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved, so that drift of the machine spreads over all of them
        for name, fn in variants.items():
            results[name].append(_median_ms(fn, 1))
    reference = statistics.median(results["upstream: copy_ + mul_ per tensor"])
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:40s} {median:7.1f} ms  {median / reference:.2f}x upstream", flush=True)


def no_sync_parts(impl: str, repeats: int = 9, number: int = 200) -> None:
    import hivemind
    from hivemind.compression import Float16Compression

    import hivemind_accum
    from benchmarks.models import build_model

    model = build_model("mlp-200x16")
    dht = hivemind.DHT(start=True)
    optimizer_cls = hivemind.Optimizer if impl.startswith("upstream") else hivemind_accum.Optimizer
    opt = optimizer_cls(
        dht=dht, run_id="parts", params=model.parameters(), target_batch_size=10**9, batch_size_per_step=4,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        reuse_grad_buffers=impl in ("upstream_reuse", "inplace"), grad_compression=Float16Compression(),
        offload_optimizer=True, delay_optimizer_step=True, delay_state_averaging=True, matchmaking_time=5.0,
        verbose=False,
    )
    try:
        model(torch.randn(4, 16)).square().mean().backward()
        params = tuple(model.parameters())
        grads, get_grad = tuple(param.grad for param in params), operator.attrgetter("grad")
        parts = {
            "step()": opt.step,
            "state_averager.step(apply_delayed_updates=True)": lambda: opt.state_averager.step(
                apply_delayed_updates=True),
            "grad_averager.accumulate_grads_": lambda: opt.grad_averager.accumulate_grads_(4),
            "tracker.report_local_progress": lambda: opt.tracker.report_local_progress(
                opt.local_epoch, opt.grad_averager.local_samples_accumulated),
            "_maybe_schedule_gradient_averaging": opt._maybe_schedule_gradient_averaging,
            "_maybe_schedule_state_averaging": opt._maybe_schedule_state_averaging,
            "400 x (param.grad is view)": lambda: all(map(operator.is_, map(get_grad, params), grads)),
        }
        for _ in range(20):
            opt.step()
        for name, fn in parts.items():
            seconds = min(timeit.repeat(fn, number=number, repeat=repeats, timer=time.thread_time)) / number
            print(f"{impl:15s} {name:50s} {1e6 * seconds:7.1f} us", flush=True)
        # as in a training loop: each call right after a forward and backward pass, which leave the parameters'
        # tensor objects out of the cache (median of ``number`` calls)
        for name in ("step()", "400 x (param.grad is view)"):
            times = []
            for _ in range(number):
                model(torch.randn(4, 16)).square().mean().backward()
                start = time.thread_time()
                parts[name]()
                times.append(time.thread_time() - start)
            print(f"{impl:15s} {name + ' after backward':50s} {1e6 * statistics.median(times):7.1f} us", flush=True)
    finally:
        opt.shutdown()
        dht.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["load", "no-sync"])
    parser.add_argument("--impl", default="inplace", choices=["upstream", "upstream_reuse", "exact", "inplace"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "load":
        load_variants()
    else:
        no_sync_parts(args.impl)


if __name__ == "__main__":
    main()
