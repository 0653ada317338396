"""
Host CPU per micro-step of the whole training process (every thread: ``time.process_time``), native accumulation
against each mode and upstream hivemind's, on a launch-bound model: 100 x [Linear(32, 32), LayerNorm(32)] (400
tensors), batch 1, one intra-op thread, hivemind#566's configuration (fp16 gradient compression, offloaded optimizer,
delayed optimizer step and state averaging), a target batch size never reached (every step is a no-sync step).

Each implementation runs in a process of its own; rounds alternate them. Printed per implementation: the median over
rounds of CPU ms per micro-step, its range, and the ratio of medians to native.

    python -m benchmarks.host_cpu --rounds 3 --out benchmarks/results/host_cpu.json
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

IMPLEMENTATIONS = ("native", "in_place", "exact", "upstream_reuse", "upstream")


def worker(name: str, steps: int, warmup: int) -> float:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression

    import hivemind_accum

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(100) for layer in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))])
    x = torch.randn(1, 32)
    dht = opt = None
    if name != "native":
        dht = hivemind.DHT(start=True)
        cls = hivemind.Optimizer if name.startswith("upstream") else hivemind_accum.Optimizer
        opt = cls(
            dht=dht, run_id="host_cpu", params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            target_batch_size=10**9, batch_size_per_step=1, reuse_grad_buffers=name in ("in_place", "upstream_reuse"),
            offload_optimizer=True, delay_optimizer_step=True, delay_state_averaging=True,
            grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(), verbose=False,
        )

    def micro_step():
        if opt is not None and not opt.grad_averager.reuse_grad_buffers:
            opt.zero_grad()
        model(x).square().mean().backward()
        if opt is not None:
            opt.step()

    try:
        for _ in range(warmup):
            micro_step()
        start = time.process_time()
        for _ in range(steps):
            micro_step()
        return (time.process_time() - start) / steps * 1e3
    finally:
        if opt is not None:
            opt.shutdown()
            dht.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--only", nargs="*", default=IMPLEMENTATIONS, choices=IMPLEMENTATIONS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(worker(args.worker, args.steps, args.warmup))
        return
    runs = {name: [] for name in args.only}
    for _ in range(args.rounds):
        for name in args.only:
            command = [sys.executable, "-m", "benchmarks.host_cpu", "--worker", name, "--steps", str(args.steps),
                       "--warmup", str(args.warmup)]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[name].append(float(output.strip().splitlines()[-1]))
    native = statistics.median(runs["native"]) if "native" in runs else None
    print("| implementation | CPU ms per micro-step, median [range] | ratio to native |")
    print("|---|---|---|")
    for name, values in runs.items():
        median = statistics.median(values)
        ratio = f"{median / native:.2f}" if native else "-"
        print(f"| {name} | {median:.2f} [{min(values):.2f}, {max(values):.2f}] | {ratio} |")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(dict(rounds=args.rounds, steps=args.steps, runs=runs), file, indent=1)


if __name__ == "__main__":
    main()
