import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


def benchmark_micro_step(mode: str, num_layers: int, hidden_dim: int, batch_size: int, num_steps: int, warmup: int):
    """median seconds of one micro-step (backward, then opt.step() unless mode is native) and of its opt.step()"""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(hidden_dim, hidden_dim) for _ in range(num_layers)))
    inputs = torch.randn(batch_size, hidden_dim)
    dht = opt = None
    if mode != "native":
        dht = DHT(start=True)
        opt = Optimizer(
            dht=dht,
            run_id=f"benchmark_no_sync_step_{mode}",
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.1),
            target_batch_size=10**9,  # never reached: every opt.step() is a no-sync step
            batch_size_per_step=batch_size,
            reuse_grad_buffers=mode == "reuse_grad_buffers",
        )
    micro_step_times, step_times = [], []
    for _ in range(warmup + num_steps):
        start = time.perf_counter()
        model(inputs).sum().backward()
        step_start = time.perf_counter()
        if opt is not None:
            opt.step()
            if mode == "exact":
                opt.zero_grad()
        end = time.perf_counter()
        micro_step_times.append(end - start)
        step_times.append(end - step_start)
    if opt is not None:
        opt.shutdown()
        dht.shutdown()
    return statistics.median(micro_step_times[warmup:]), statistics.median(step_times[warmup:])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Time one no-sync micro-step against native PyTorch accumulation")
    parser.add_argument("--num_layers", type=int, default=200, required=False)
    parser.add_argument("--hidden_dim", type=int, default=64, required=False)
    parser.add_argument("--batch_size", type=int, default=4, required=False)
    parser.add_argument("--num_steps", type=int, default=200, required=False)
    parser.add_argument("--warmup", type=int, default=10, required=False)
    args = vars(parser.parse_args())
    torch.set_num_threads(1)

    num_params = args["num_layers"] * (args["hidden_dim"] + 1) * args["hidden_dim"]
    num_tensors = 2 * args["num_layers"]
    print(f"{num_tensors} parameter tensors, {num_params / 1e6:.2f}M parameters, median of {args['num_steps']} steps")
    print(f"{'mode':<20} {'micro-step, ms':>15} {'x native':>9} {'opt.step(), ms':>15}")
    native = None
    for mode in "native", "exact", "reuse_grad_buffers":
        micro_step, step = benchmark_micro_step(mode, **args)
        native = native or micro_step
        print(f"{mode:<20} {micro_step * 1000:>15.3f} {micro_step / native:>9.2f} {step * 1000:>15.3f}")
