"""Host time of scaler.step(opt) + scaler.update() in a no-sync micro-step of exact mode, and its host reads.
ACCELERATOR_BRANCH=1 takes the branch of an accelerator on the CPU."""

import contextlib
import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hivemind
from hivemind.optim import grad_scaler


class HostReads(TorchDispatchMode):
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    if os.environ.get("ACCELERATOR_BRANCH"):
        grad_scaler._host_read_stalls = lambda device: True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(200)])  # 400 parameter tensors
    dht = hivemind.DHT(start=True)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id="benchmark",
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        target_batch_size=10**9,
        batch_size_per_step=1,
    )
    scaler = hivemind.GradScaler("cpu", init_scale=1.0)
    x, times, reads = torch.randn(1, 64), [], HostReads()
    for step in range(310):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        start = time.perf_counter()
        with reads if step < 10 else contextlib.nullcontext():  # counting slows every op down: not timed
            scaler.step(opt)
            scaler.update()
        times.append(time.perf_counter() - start)
    print(f"median {sorted(times[10:])[150] * 1000:.2f} ms, {reads.count / 10:.0f} host reads per step")
    opt.shutdown()
    dht.shutdown()
