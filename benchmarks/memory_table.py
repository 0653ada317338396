"""
Memory each accumulation mode holds between micro-steps, counted from the tensors themselves (deterministic).

After two micro-steps of a small model, every tensor reachable from the averager and every ``.grad`` is collected once
per storage and put in one of three groups: ``.grad`` (storages some ``.grad`` uses, which in place are also the
accumulators), ``accumulators`` (the rest the averager owns: accumulators, staging buffers, flags) and ``shared``
(the averager's buffers in shared host memory, which the all-reduce reads). Each group is reported in bytes per
parameter element, so the table holds for any model of the same dtypes. On an accelerator, ``.grad`` and the
accumulators live on the device (unless ``accumulate_grads_on="cpu"``), the shared buffers on the host.

Run ``python -m benchmarks.memory_table`` for the table in docs/guide.md#memory-held-between-micro-steps.
"""
import dataclasses
from typing import Dict, Iterable, Iterator

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager

from hivemind_accum import GradientAverager
from hivemind_accum.buffers import buckets, finite_add

# (label, averager class, constructor arguments, loss-scaled as on an accelerator)
CONFIGURATIONS = (
    ("upstream, reuse_grad_buffers=False", UpstreamGradientAverager, {}, False),
    ("upstream, reuse_grad_buffers=True", UpstreamGradientAverager, dict(reuse_grad_buffers=True), False),
    ("exact", GradientAverager, {}, False),
    ("exact, loss scaling on an accelerator", GradientAverager, {}, True),
    ("exact, accumulate_in_fp32=False", GradientAverager, dict(accumulate_in_fp32=False), False),
    ("exact, averaged_grads_dtype=torch.float32", GradientAverager, dict(averaged_grads_dtype=torch.float32), False),
    ("in place", GradientAverager, dict(reuse_grad_buffers=True), False),
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(obj, depth: int = 10) -> Iterator[torch.Tensor]:
    """tensors held by ``obj``'s attributes, lists, tuples, dicts and dataclasses, ``depth`` containers down"""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth == 0:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth - 1)
    elif dataclasses.is_dataclass(obj) or isinstance(obj, (buckets.GradientBuckets, finite_add.DroppedMicroSteps)):
        yield from _tensors(vars(obj), depth - 1)


def held_bytes(averager, parameters: Iterable[torch.Tensor]) -> Dict[str, int]:
    """bytes of the distinct storages in each group (``.grad``, ``accumulators``, ``shared``), see the module"""
    parameters = list(parameters)
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in parameters
             if p.grad is not None}
    params = {p.untyped_storage().data_ptr() for p in parameters}
    groups = {".grad": sum(grads.values()), "accumulators": 0, "shared": 0}
    seen = set(grads) | params
    for tensor in _tensors(vars(averager)):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        groups["shared" if tensor.is_shared() else "accumulators"] += storage.nbytes()
    return groups


def measure(dht, label: str, averager_cls, kwargs: dict, loss_scaled: bool, dtype: torch.dtype) -> Dict[str, float]:
    """bytes per parameter element in each group after two micro-steps of a 3-layer MLP in ``dtype``"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)).to(dtype)
    averager = averager_cls(model.parameters(), dht=dht, prefix=f"memory_{abs(hash((label, dtype)))}", start=False,
                            **kwargs)
    host_check = finite_add.host_check_is_free
    if loss_scaled:
        finite_add.host_check_is_free = lambda buckets: False  # the accelerator's path, on the CPU
    try:
        for _ in range(2):
            if not kwargs.get("reuse_grad_buffers"):
                model.zero_grad(set_to_none=True)
            model(torch.randn(4, 64, dtype=dtype)).float().square().mean().backward()
            if loss_scaled:
                averager.accumulate_grads_(4, inv_grad_scale=torch.tensor(1.0))
            else:
                averager.accumulate_grads_(4)
        elements = sum(p.numel() for p in model.parameters())
        return {group: nbytes / elements for group, nbytes in held_bytes(averager, model.parameters()).items()}
    finally:
        finite_add.host_check_is_free = host_check


def main():
    dht = hivemind.DHT(start=True)
    try:
        print("bytes per parameter element held between micro-steps (`.grad` / accumulators and staging / shared "
              "host buffers), after `python -m benchmarks.memory_table`:\n")
        print("| mode | " + " | ".join(str(dtype).replace("torch.", "") for dtype in DTYPES) + " |")
        print("|---|" + "---|" * len(DTYPES))
        for label, averager_cls, kwargs, loss_scaled in CONFIGURATIONS:
            cells = []
            for dtype in DTYPES:
                held = measure(dht, label, averager_cls, kwargs, loss_scaled, dtype)
                cells.append(" / ".join(f"{held[group]:.2f}" for group in (".grad", "accumulators", "shared")))
            print(f"| {label} | " + " | ".join(cells) + " |")
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
