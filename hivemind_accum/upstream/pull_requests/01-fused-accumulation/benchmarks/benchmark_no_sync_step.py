import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


def benchmark_no_sync_step(
    mode: str, num_layers: int, hidden_dim: int, batch_size: int, num_steps: int, warmup: int, device: str
):
    """median milliseconds of backward(), of the no-sync opt.step() and of the accumulate_grads_ inside it"""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(hidden_dim, hidden_dim) for _ in range(num_layers))).to(device)
    inputs = torch.randn(batch_size, hidden_dim, device=device)
    dht = opt = None
    accumulate_times = []
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
        accumulate_grads_ = opt.grad_averager.accumulate_grads_

        def timed_accumulate_grads_(*args, **kwargs):
            start = time.perf_counter()
            accumulate_grads_(*args, **kwargs)
            synchronize(device)
            accumulate_times.append(time.perf_counter() - start)

        opt.grad_averager.accumulate_grads_ = timed_accumulate_grads_

    backward_times, step_times = [], []
    for _ in range(warmup + num_steps):
        synchronize(device)
        start = time.perf_counter()
        model(inputs).sum().backward()
        synchronize(device)
        step_start = time.perf_counter()
        if opt is not None:
            opt.step()
            if mode == "exact":
                opt.zero_grad()
            synchronize(device)
        backward_times.append(step_start - start)
        step_times.append(time.perf_counter() - step_start)
    if opt is not None:
        opt.shutdown()
        dht.shutdown()
    medians = [
        statistics.median(times[warmup:]) * 1000 if times else None
        for times in (backward_times, step_times, accumulate_times)
    ]
    return medians if opt is not None else medians[:1] + [None, None]


def synchronize(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Time the no-sync opt.step() (a micro-step before target_batch_size is reached) against native "
        "PyTorch accumulation, whose micro-step is backward() alone"
    )
    parser.add_argument("--num_layers", type=int, default=200, required=False)
    parser.add_argument("--hidden_dim", type=int, default=64, required=False)
    parser.add_argument("--batch_size", type=int, default=4, required=False)
    parser.add_argument("--num_steps", type=int, default=200, required=False)
    parser.add_argument("--warmup", type=int, default=10, required=False)
    parser.add_argument("--device", type=str, default="cpu", required=False)
    args = vars(parser.parse_args())
    torch.set_num_threads(1)

    num_tensors = 2 * args["num_layers"]
    num_params = args["num_layers"] * (args["hidden_dim"] + 1) * args["hidden_dim"]
    print(
        f"{num_tensors} parameter tensors, {num_params / 1e6:.2f}M parameters on {args['device']}, "
        f"median of {args['num_steps']} steps, ms"
    )
    print(f"{'mode':<20} {'backward()':>11} {'opt.step()':>11} {'accumulate_grads_':>18}")
    for mode in "native", "exact", "reuse_grad_buffers":
        backward, step, accumulate = benchmark_no_sync_step(mode, **args)
        cells = [
            f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"
            for value, width in ((backward, 11), (step, 11), (accumulate, 18))
        ]
        print(f"{mode:<20} {' '.join(cells)}")
    print("opt.step() includes opt.zero_grad() in exact mode")
