"""
Backward's cost in place against native accumulation, on a launch-bound model.

The model is 100 x [Linear(32, 32), LayerNorm(32)] (400 tensors), batch 1, one intra-op thread: a backward is about
a thousand small kernels, so host work per tensor shows, as on a host-bound GPU. Both variants live in one process,
one model copy each (same seed). A block runs one window of each in random order; a window is ``--window`` timed
micro-steps (forward untimed; ``loss.backward()`` and, in place, ``accumulate_grads_``, which is the no-sync step's
in-place work) after a reset and two untimed micro-steps (the second is the epoch's hooked backward). Native
accumulates into ``.grad``, zeroed in place at the reset.

Per block: in place's CPU time (``time.thread_time`` of the main thread, where autograd runs on a CPU) over native's.
Printed: the median ratio with a 95 % bootstrap interval, for backward alone and for backward plus the step's
check, and the hooked backward's extra cost once per epoch.

    python -m benchmarks.backward_cost --blocks 40 --out benchmarks/results/backward_cost_cpu.json
"""
import argparse
import copy
import json
import platform
import random
import statistics
import time

import hivemind
import torch

from benchmarks.intervals import bootstrap_interval
from hivemind_accum import GradientAverager


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[layer for _ in range(100) for layer in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))])


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, averager=None):
        self.name, self.model, self.averager = name, model, averager
        self.x = torch.randn(1, 32, generator=torch.Generator().manual_seed(1))

    def reset(self) -> None:
        if self.averager is None:
            self.model.zero_grad(set_to_none=False)
        else:
            self.averager.load_accumulators_into_averager_()
            self.averager.reset_accumulated_grads_()

    def micro_step(self) -> tuple:
        """(CPU seconds of backward, of the step's in-place work)"""
        loss = self.model(self.x).square().mean()
        t0 = time.thread_time()
        loss.backward()
        t1 = time.thread_time()
        if self.averager is not None:
            self.averager.accumulate_grads_(batch_size=1)
        return t1 - t0, time.thread_time() - t1

    def window(self, steps: int) -> dict:
        self.reset()
        lead = [self.micro_step() for _ in range(2)]  # the second is the epoch's hooked backward, in place
        timed = [self.micro_step() for _ in range(steps)]
        return dict(backward=sum(b for b, _ in timed), step=sum(s for _, s in timed),
                    hooked_extra=lead[1][0] - statistics.median(b for b, _ in timed))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--window", type=int, default=30, help="timed micro-steps per window")
    parser.add_argument("--out", default=None, help="write the raw windows and the summary here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True)
    try:
        native_model, in_place_model = make_model(), make_model()
        averager = GradientAverager(in_place_model.parameters(), dht=dht, prefix="backward_cost",
                                    reuse_grad_buffers=True, start=False)
        variants = [Variant("native", copy.deepcopy(native_model)), Variant("in_place", in_place_model, averager)]
        for variant in variants:  # warm-up
            variant.window(5)
        blocks = []
        for _ in range(args.blocks):
            order = random.sample(variants, len(variants))
            blocks.append({variant.name: variant.window(args.window) for variant in order})
    finally:
        dht.shutdown()
    backward = [b["in_place"]["backward"] / b["native"]["backward"] for b in blocks]
    total = [(b["in_place"]["backward"] + b["in_place"]["step"]) / b["native"]["backward"] for b in blocks]
    per_step_us = statistics.median(b["native"]["backward"] for b in blocks) / args.window * 1e6
    step_us = statistics.median(b["in_place"]["step"] for b in blocks) / args.window * 1e6
    hooked_ms = statistics.median(b["in_place"]["hooked_extra"] for b in blocks) * 1e3
    summary = dict(
        torch=torch.__version__, machine=platform.processor() or platform.machine(), blocks=args.blocks,
        window=args.window, native_backward_us=per_step_us, in_place_step_check_us=step_us,
        backward_ratio=bootstrap_interval(backward), backward_and_check_ratio=bootstrap_interval(total),
        hooked_backward_extra_ms_per_epoch=hooked_ms,
    )
    print(f"native backward: {per_step_us:.0f} us of CPU per micro-step (400 tensors, batch 1, 1 thread)")
    for name in ("backward_ratio", "backward_and_check_ratio"):
        median, low, high = summary[name]
        print(f"in place / native, {name[:-6].replace('_', ' ')}: {median:.3f} [{low:.3f}, {high:.3f}] (median of "
              f"{args.blocks} blocks, 95 % bootstrap interval)")
    print(f"in place's check in step(): {step_us:.0f} us per micro-step")
    print(f"the epoch's hooked backward: {hooked_ms:.2f} ms more than an unhooked one, once per epoch")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(dict(summary=summary, blocks=blocks), file, indent=1)


if __name__ == "__main__":
    main()
