"""
The step gate: whether the optimizer step of a round may use the round's gradients, and a no-op step where it may not.

This module knows nothing about hivemind's classes:

- :class:`SkipUnusableSteps`: step hooks that make a torch optimizer's step a no-op while a round is not usable;
- :class:`StepDecisions`: each round's decision for its step, carried from the thread that loads the round to the
  job that steps, so that a late step reads its own round's decision and no other.

:class:`hivemind_accum.Optimizer` decides, round by round, from :mod:`hivemind_accum.rounds.finite`'s records
(:mod:`hivemind_accum.integration.round_steps`).
"""
import threading
from concurrent.futures import Executor, Future
from typing import Callable, List, Optional, Tuple

import torch


class SkipUnusableSteps:
    """
    Step hooks on a torch optimizer (``register_step_pre_hook`` / ``register_step_post_hook``) that turn a step into a
    no-op while ``usable()`` is False: for the step's duration every parameter's ``.grad`` is None, which torch
    optimizers skip (no update, no momentum, no weight decay); the post-hook puts the same ``.grad`` tensors back, so
    buffers bound as ``.grad`` (hivemind's offloaded optimizer) stay bound. The hooks run in whichever thread steps.

    :param optimizer: a torch optimizer whose parameters skip a step by having no ``.grad``
    :param usable: called at each step (pre-hook): False to skip it
    :param on_skip: called when a step is skipped, before it runs
    """

    def __init__(self, optimizer: torch.optim.Optimizer, usable: Callable[[], bool], on_skip: Callable[[], None]):
        self.usable, self.on_skip = usable, on_skip
        self._taken: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        optimizer.register_step_pre_hook(self._pre_step)
        optimizer.register_step_post_hook(self._post_step)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self.usable():
            return
        self.on_skip()
        self._taken = [(param, param.grad) for group in optimizer.param_groups for param in group["params"]]
        for param, _ in self._taken:
            param.grad = None

    def _post_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for param, grad in self._taken:
            param.grad = grad
        self._taken = []


class StepDecisions:
    """
    Whether each round's optimizer step may use the round's gradients, handed from where the round is loaded to the
    step that uses it. A decision belongs to the thread that made it. A job submitted through :meth:`carried_by`'s
    executor takes the submitting thread's decision along into the thread that runs it; a decision made inside the
    job (a delayed round's load) replaces it. The step reads its own thread's decision. So a late step reads its own
    round's decision, never one made for a later round, and a decision that no step read ends with its job.
    """

    def __init__(self):
        self._thread = threading.local()

    def decide(self, usable: bool) -> None:
        """record, in this thread, whether the step of the round just loaded may use its gradients"""
        self._thread.usable = usable

    def take(self) -> Optional[bool]:
        """this thread's decision, which is cleared; None if there is none"""
        usable, self._thread.usable = getattr(self._thread, "usable", None), None
        return usable

    def carried_by(self, executor: Executor) -> Executor:
        """``executor``, whose ``submit`` hands the submitting thread's decision to the job"""
        return _CarryingExecutor(executor, self)

    def _run_with(self, usable: Optional[bool], fn: Callable, args, kwargs):
        self._thread.usable = usable
        try:
            return fn(*args, **kwargs)
        finally:
            self._thread.usable = None


class _CarryingExecutor(Executor):
    def __init__(self, executor: Executor, decisions: StepDecisions):
        self._executor, self._decisions = executor, decisions

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        return self._executor.submit(self._decisions._run_with, self._decisions.take(), fn, args, kwargs)

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        self._executor.shutdown(wait, **kwargs)
