"""
What one no-sync micro-step costs in hivemind#566's configuration (exact mode, fp16 AMP through hivemind.GradScaler),
upstream hivemind 1.1.12 beside hivemind_accum's exact and in-place modes, from deterministic counts on the CPU with
the accelerator's loss-scaling path forced.

- host reads: ``aten::_local_scalar_dense`` in the whole loop of each no-sync micro-step (tests/test_mixed_precision.py's
  ``train`` and ``HostReads``; an overflowing micro-step included), the maximum over the micro-steps;
- aten ops of one no-sync ``scaler.step(opt)`` + ``scaler.update()`` (``benchmarks.micro_step_worker``'s profiled
  ``top_level_ops`` on a 400-tensor MLP); with them the kernel launches on ResNet-152 and ConvNeXt-Large: upstream at
  least one per parameter tensor, exact mode the fused ops' launches (``benchmarks.kernel_launches``, 4 KB kernel
  arguments) plus its other ops;
- gradient bytes read and written per parameter element (float32 ``.grad`` and accumulators), from the ops each step
  runs (docs/measurement.md#on-a-gpu).

Run: ``python -m benchmarks.seed_costs`` (about a minute on 2 CPU cores).
"""
import hivemind

import hivemind_accum
from benchmarks import micro_step_worker
from benchmarks.kernel_launches import multi_tensor_launches
from benchmarks.models import build_model
from hivemind_accum.buffers import finite_add

MODES = ("upstream", "exact", "in place")
# bytes per float32 parameter element read + written by one no-sync step:
# upstream: the scaler's inf check, an in-place unscale by 1 of .grad (4 + 4), then per tensor acc.add_(grad) (4 + 8);
# exact: the fused check and unscale of .grad in place (4 + 4), then the fused add that skips on overflow (4 + 8);
# in place: nothing (autograd accumulated into .grad during backward)
BYTES_PER_ELEMENT = {"upstream": 8 + 12, "exact": 8 + 12, "in place": 0}


def host_reads() -> dict:
    from tests.test_mixed_precision import train

    runs = {"upstream": (hivemind.Optimizer, False), "exact": (hivemind_accum.Optimizer, False),
            "in place": (hivemind_accum.Optimizer, True)}
    return {mode: max(train("hivemind", reuse, overflow=frozenset({2}), optimizer_cls=cls, path="device_check")[3])
            for mode, (cls, reuse) in runs.items()}


def step_ops() -> dict:
    finite_add.host_check_is_free = lambda buckets: False  # the accelerator's path, on the CPU
    impls = {"upstream": "upstream_hivemind", "exact": "exact_hivemind", "in place": "inplace"}
    return {mode: micro_step_worker.run(impl, "mlp-200x8", steps=1, warmup=2, batch_size=4, threads=1,
                                        precision="fp16")["work"]["top_level_ops"] for mode, impl in impls.items()}


def main():
    reads, ops = host_reads(), step_ops()
    print(f"host reads per no-sync micro-step: {reads}")
    print(f"aten ops per no-sync step (400 tensors): {ops}")
    print("| model | params | tensors | mode | host reads | kernel launches | gradient bytes moved |")
    print("|---|---|---|---|---|---|---|")
    for name in ("resnet152", "convnext-large"):
        numels = [p.numel() for p in build_model(name).parameters()]
        fused = multi_tensor_launches(numels, 1) + multi_tensor_launches(numels, 2)
        launches = {"upstream": f"at least {len(numels)}", "exact": f"at most {fused + ops['exact'] - 2}",
                    "in place": f"at most {ops['in place']}"}
        for mode in MODES:
            print(f"| {name} | {sum(numels) / 1e6:.1f} M | {len(numels)} | {mode} | {reads[mode]} | {launches[mode]} "
                  f"| {BYTES_PER_ELEMENT[mode] * sum(numels) / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()
