"""
Cost of the per-round finiteness check (:func:`hivemind_accum.rounds.finite.all_finite`) on host buffers of the
averager's layout, next to the averaging-time load it follows (one scaled copy per flat bucket into the shared
buffers) for scale.

Each check is one read-only ``sum`` per flat buffer and one host read; a gradient round runs it once on this peer's
loaded gradients and once on the averaged result (the optimizer skips the second when it falls back to local
gradients). Nothing runs per micro-step.

Run: ``python -m benchmarks.finiteness_pass`` (about 30 s on 2 CPU cores); ``--help`` for options.
"""
import argparse
import json
import platform
import statistics
import time

import torch

from hivemind_accum.rounds.finite import all_finite


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: pages faulted in, kernels chosen
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=100_000_000, help="float32 elements in all buckets together")
    parser.add_argument("--buckets", type=int, default=1, help="flat buckets the elements are split into")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--repeats", type=int, default=9, help="measured runs per number (median reported)")
    parser.add_argument("--output", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)

    sizes = [args.elements // args.buckets] * args.buckets
    sizes[-1] += args.elements - sum(sizes)
    source = [torch.randn(size) for size in sizes]
    target = [torch.empty(size).share_memory_() for size in sizes]
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        check_ms = median_ms(lambda: all_finite(target), args.repeats)
        load_ms = median_ms(lambda: [torch.mul(src, 0.5, out=dst) for src, dst in zip(source, target)], args.repeats)
        results.append(dict(threads=threads, check_ms=round(check_ms, 1), load_ms=round(load_ms, 1)))
        print(
            f"{args.elements / 1e6:g} M float32 in {args.buckets} bucket(s), {threads} thread(s): finiteness check "
            f"{check_ms:.1f} ms, averaging-time load {load_ms:.1f} ms (medians of {args.repeats})",
            flush=True,
        )
    if args.output:
        machine = dict(machine=platform.machine(), cpus=torch.get_num_threads(), torch=torch.__version__)
        with open(args.output, "w") as f:
            json.dump(dict(elements=args.elements, buckets=args.buckets, results=results, **machine), f, indent=1)


if __name__ == "__main__":
    main()
