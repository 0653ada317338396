"""DHT stores and CPU time per no-sync micro-step of hivemind.Optimizer (400 parameter tensors, alone in the swarm)"""

import threading

import psutil
import torch

import hivemind

torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(200)])  # 400 parameter tensors
dht = hivemind.DHT(start=True)
opt = hivemind.Optimizer(
    dht=dht,
    run_id="wakeups",
    params=model.parameters(),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    target_batch_size=10**9,
    batch_size_per_step=1,
    reuse_grad_buffers=True,
    verbose=False,
)
stores, store = [], dht.store
dht.store = lambda *args, **kwargs: stores.append(args) or store(*args, **kwargs)
main_id, this = threading.get_native_id(), psutil.Process()


def cpu_seconds():  # the training loop's thread, this process's other threads (ended ones too), child processes
    main = sum(t.user_time + t.system_time for t in this.threads() if t.id == main_id)
    children = sum(sum(child.cpu_times()[:2]) for child in this.children(recursive=True))
    return main, sum(this.cpu_times()[:2]) - main, children


for step in range(1100):
    if step == 100:  # 1000 micro-steps after 100 of warm-up
        stores.clear()
        start = cpu_seconds()
    model(torch.randn(1, 32)).sum().backward()
    opt.step()
main, threads, children = (end - begin for end, begin in zip(cpu_seconds(), start))  # seconds per 1000 steps
print(
    f"{len(stores) / 1000:.3f} DHT stores per micro-step; CPU ms per micro-step: training loop {main:.2f}, "
    f"other threads {threads:.2f}, child processes {children:.2f}"
)
opt.shutdown()
dht.shutdown()
