"""
Keeping an averaging round's local gradients until the round is settled, so that a failed round falls back to them.

This module knows nothing about hivemind's classes. When a round begins, the averager has loaded its accumulators
(scaled) into the shared buffers that peers all-reduce; the all-reduce then overwrites those buffers. The round's
local gradients are still in the accumulators: :class:`LocalFallback` leaves them there until the round is settled
(its result used, or the fallback loaded), and zeroes them before the next micro-step adds into them. Only if the accumulators are needed for the next
micro-step while the round is still unsettled (as with ``delay_grad_averaging=True``, where the next epoch
accumulates during the round) are the local gradients first copied to host memory, once per such round.
"""
import threading
from typing import List, Optional, Sequence, Union

import torch

from hivemind_accum.optim.grad_buckets import GradientBuckets

Destination = Union[GradientBuckets, Sequence[torch.Tensor]]


class LocalFallback:
    """
    One averager's local gradients of its latest round, kept for a fallback.

    States: ``holding`` (the accumulators still hold a round's local gradients, so they must be released before the
    next accumulation) and ``where`` (where an unsettled round's local gradients are: ``"accumulators"``, ``"host"``
    or None once settled). Every method may be called from any thread (hivemind's optimizer settles a delayed round
    in a background thread).

    :param accumulators: the averager's accumulators, built from ``parameters``
    :param parameters: the averager's parameters (a host copy has their layout, as the averager's shared buffers do)
    :param in_place: whether each ``param.grad`` is a view of ``accumulators``: then, while the accumulators are held,
      a hook on each parameter releases them before a backward pass adds into them
    """

    def __init__(self, accumulators: GradientBuckets, parameters: Sequence[torch.Tensor], in_place: bool):
        self.accumulators = accumulators
        self.parameters = tuple(parameters)
        self._hooked = tuple(param for param in parameters if in_place and param.requires_grad)
        self.holding = False
        self.where: Optional[str] = None
        self._loaded_scale, self._finite = 0.0, True
        self._host: Optional[GradientBuckets] = None  # allocated at the first round released unsettled
        self._hooks: List[torch.utils.hooks.RemovableHandle] = []
        self._lock = threading.RLock()

    @property
    def host_bytes(self) -> int:
        """host memory held for fallbacks (0 until a round had to be copied out of the accumulators)"""
        if self._host is None:
            return 0
        return sum(bucket.flat.numel() * bucket.flat.element_size() for bucket in self._host.buckets)

    def hand_off_(self, scale: float, finite: bool) -> None:
        """
        A round began with ``scale * accumulators`` as this peer's part: keep the accumulators as they are.

        :param scale: the scale the accumulators were loaded with (``1 / micro_steps``)
        :param finite: whether they were finite (if not, the fallback is zeros, as sent to peers)
        """
        with self._lock:
            self._remove_hooks()
            self.holding, self.where = True, "accumulators"
            self._loaded_scale, self._finite = scale, finite
            self._hooks = [param.register_hook(self._before_backward_adds) for param in self._hooked]

    def settle_(self) -> None:
        """the round's result is used: its local gradients are no longer a fallback. The accumulators are left as they
        are until the next micro-step or reset releases them: with an optimizer that is not offloaded, ``.grad`` may
        be their view (in-place mode) and hold the averaged gradients the optimizer is about to step with"""
        with self._lock:
            self.where = None

    def load_into_(self, destination: Destination) -> bool:
        """
        Load the unsettled round's local gradients, as they were loaded for the round, into ``destination``; the round
        is settled then.

        :param destination: the averager's shared buffers (buckets of the same layout, or one tensor per parameter)
        :returns: False (loading nothing) if no round is unsettled
        """
        with self._lock:
            if self.where is None:
                return False
            in_accumulators = self.where == "accumulators"
            source, scale = (self.accumulators, self._loaded_scale) if in_accumulators else (self._host, 1.0)
            source.scaled_copy_to_(destination, scale if self._finite else 0.0)
            self.settle_()
            return True

    def release_(self) -> None:
        """zero the accumulators for the next micro-steps (one ``zero_`` per bucket), first copying an unsettled
        round's local gradients to host memory (one scaled copy per bucket)"""
        with self._lock:
            if self.where == "accumulators":
                if self._host is None:
                    self._host = GradientBuckets(self.parameters, device="cpu", upcast=True)
                self.accumulators.scaled_copy_to_(self._host, self._loaded_scale if self._finite else 0.0)
                self.where = "host"
            self.accumulators.zero_()
            self.holding = False
            if not self._in_backward:  # a hook's own list is not changed while autograd runs it
                self._remove_hooks()

    _in_backward = False

    def _before_backward_adds(self, grad: torch.Tensor) -> None:
        """parameter hook, run before autograd adds a gradient into ``.grad`` (a view of the accumulators)"""
        if self.holding:
            self._in_backward = True
            try:
                self.release_()
            finally:
                self._in_backward = False

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
