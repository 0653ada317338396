"""
What the main job's training runs observe in hivemind's optimizer, and how they wait for it.

:class:`LocalGradientCheck` compares what a peer sends with what its loop produced; the rest count averaged rounds,
wait for the swarm, and settle hivemind's background requests before shutdown.
"""
import math
import time
from typing import Dict, List, Sequence

import hivemind
import torch

from hivemind_accum.torch_compat import foreach_add_, foreach_zero_


def wait_for_swarm(opt: hivemind.Optimizer, num_peers: int, timeout: float) -> None:
    """
    Wait until the optimizer's progress tracker sees ``num_peers`` peers, itself included.

    Until then a peer believes it is alone and would step on its local gradients only.

    :param opt: a running :class:`hivemind.Optimizer`
    :param num_peers: peers to wait for
    :param timeout: seconds
    :raises TimeoutError: if the peers do not find each other in time
    """
    deadline = time.monotonic() + timeout
    while opt.tracker.global_progress.num_peers < num_peers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the progress tracker saw {opt.tracker.global_progress.num_peers} of {num_peers} peers "
                f"after {timeout:.0f} s"
            )
        time.sleep(0.1)


async def _read_pending_requests(dht: hivemind.DHT, node) -> None:
    """a no-op in the DHT's process: it returns once the DHT has read every request sent before it"""


def settle_background_requests(opt: hivemind.Optimizer, dht: hivemind.DHT) -> None:
    """
    Wait until the optimizer's averagers and the DHT have handled every request the last epoch started.

    Each epoch makes every averager announce its state through the DHT. If an averager's process exits before the
    DHT reads that request, hivemind 1.1.12's DHT logs ``[Errno 2] No such file or directory`` (docs/upstream.md,
    "Shutdown noise"). Call this before :meth:`hivemind.Optimizer.shutdown`.

    :param opt: a running optimizer that no longer steps
    :param dht: its DHT
    """
    averagers = [averager for averager in (opt.state_averager, opt.grad_averager) if averager is not None]
    for _ in range(2):  # each round trip: the averager has handled every message sent to it before
        for averager in averagers:
            averager.get_group_bits()
    dht.run_coroutine(_read_pending_requests)


class LocalGradientCheck:
    """
    Check, in every averaging round, that a peer sends the mean of the gradients its loop produced.

    Call :meth:`before_backward` before each ``backward()`` and :meth:`record` right before each ``opt.step()``,
    after any clipping. A micro-batch's gradient is what ``.grad`` gained in between. Each round's
    ``||sent - mean|| / ||mean||`` is appended to :attr:`errors`.

    :param parameters: the model's parameters, in the optimizer's order
    :param averager: the optimizer's gradient averager; its ``step``, ``load_accumulators_into_averager_`` and
      ``reset_accumulated_grads_`` are wrapped on the instance
    """

    def __init__(self, parameters: Sequence[torch.Tensor], averager):
        self.parameters = list(parameters)
        self.sums = [torch.zeros_like(p) for p in self.parameters]
        self.before = [torch.zeros_like(p) for p in self.parameters]
        self.count = 0
        self.errors: List[float] = []
        step, load, reset = averager.step, averager.load_accumulators_into_averager_, averager.reset_accumulated_grads_
        in_step = []

        def checked_step(*args, **kwargs):
            in_step.append(True)
            try:
                return step(*args, **kwargs)
            finally:
                in_step.pop()

        def checked_load():
            load()
            if in_step and self.count:  # a round's load (not a fallback after a failed round)
                with torch.no_grad(), averager.get_tensors() as sent:
                    expected = [total / self.count for total in self.sums]
                    error = sum((s - e).square().sum() for s, e in zip(sent, expected, strict=True))
                    norm = sum(e.square().sum() for e in expected)
                    self.errors.append(math.sqrt(error / norm))

        def checked_reset():
            reset()
            foreach_zero_(self.sums)
            self.count = 0

        averager.step, averager.load_accumulators_into_averager_ = checked_step, checked_load
        averager.reset_accumulated_grads_ = checked_reset

    @torch.no_grad()
    def before_backward(self) -> None:
        for before, param in zip(self.before, self.parameters):
            before.copy_(param.grad) if param.grad is not None else before.zero_()

    @torch.no_grad()
    def record(self) -> None:
        foreach_add_(self.sums, [p.grad for p in self.parameters])
        foreach_add_(self.sums, self.before, alpha=-1.0)
        self.count += 1


def count_averaged_rounds(opt: hivemind.Optimizer, stats: Dict[str, int]) -> None:
    """count, in ``stats["averaged"]``, the rounds whose gradients were averaged with at least one other peer"""
    average = opt._average_gradients_and_load_into_optimizer

    def counting(control):
        average(control)
        try:
            stats["averaged"] += control is not None and len(control.result(timeout=0)) > 1
        except BaseException:
            pass  # the round failed: upstream's code above fell back to local gradients

    opt._average_gradients_and_load_into_optimizer = counting
