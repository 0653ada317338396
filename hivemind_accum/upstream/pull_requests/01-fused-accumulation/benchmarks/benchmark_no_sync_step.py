import argparse
import multiprocessing as mp
import statistics
import time
from functools import partial

import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.optimizer import Optimizer


def measure_micro_step(mode: str, num_layers: int, hidden_dim: int, batch_size: int, num_steps: int, warmup: int):
    """median seconds of one micro-step: backward, then opt.step() unless mode is native"""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*(nn.Linear(hidden_dim, hidden_dim) for _ in range(num_layers)))
    dht = opt = None
    if mode != "native":
        dht = DHT(start=True)
        opt = Optimizer(
            dht=dht,
            run_id="benchmark_no_sync_step",
            params=model.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.1),
            target_batch_size=10**9,  # never reached: every opt.step() is a no-sync step
            batch_size_per_step=batch_size,
            reuse_grad_buffers=mode == "reuse_grad_buffers",
        )
    inputs = torch.randn(batch_size, hidden_dim)
    times = []
    for step in range(warmup + num_steps):
        start = time.perf_counter()
        model(inputs).sum().backward()
        if opt is not None:
            opt.step()
            if mode != "reuse_grad_buffers":
                opt.zero_grad()
        times.append(time.perf_counter() - start)
    if opt is not None:
        opt.shutdown()
        dht.shutdown()
    return statistics.median(times[warmup:])


def _run_in_subprocess(queue, **kwargs):
    queue.put(measure_micro_step(**kwargs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Time one micro-step (backward + no-sync opt.step()) against native PyTorch accumulation"
    )
    parser.add_argument("--num_layers", type=int, default=200, required=False)
    parser.add_argument("--hidden_dim", type=int, default=64, required=False)
    parser.add_argument("--batch_size", type=int, default=4, required=False)
    parser.add_argument("--num_steps", type=int, default=100, required=False)
    parser.add_argument("--warmup", type=int, default=10, required=False)
    args = vars(parser.parse_args())

    num_tensors = 2 * args["num_layers"]
    num_params = args["num_layers"] * (args["hidden_dim"] + 1) * args["hidden_dim"]
    print(f"{num_tensors} parameter tensors, {num_params / 1e6:.2f}M parameters, median of {args['num_steps']} steps")
    print(f"{'mode':<20} {'ms per micro-step':>18} {'x native':>9}")
    native = None
    for mode in "native", "exact", "reuse_grad_buffers":
        queue = mp.get_context("fork").Queue()
        process = mp.get_context("fork").Process(
            target=_run_in_subprocess, args=(queue,), kwargs=dict(mode=mode, **args)
        )
        process.start()
        seconds = queue.get()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()  # a background thread of the optimizer can outlive its shutdown()
        native = seconds if native is None else native
        print(f"{mode:<20} {seconds * 1000:>18.3f} {seconds / native:>9.2f}")
