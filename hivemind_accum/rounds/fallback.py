"""
Keeping an averaging round's local gradients until the round is settled, so that a failed round falls back to them.

This module knows nothing about hivemind's classes. When a round begins, the averager has loaded its accumulators
(scaled) into the shared buffers that peers all-reduce; the all-reduce then overwrites those buffers. The round's
local gradients are still in the accumulators: :class:`LocalFallback` leaves them there until the round is settled
(its result used, or the fallback loaded), and zeroes them before the next micro-step adds into them. Only if the accumulators are needed for the next
micro-step while the round is still unsettled (as with ``delay_grad_averaging=True``, where the next epoch
accumulates during the round) are the local gradients first copied to host memory, once per such round; from CUDA
into pinned memory without blocking. In in-place mode the next backward pass adds straight into the accumulators,
so a round's local gradients are copied out as soon as the round begins.

Each round is kept under its own key, so a round's fallback that comes after the next round began (it waited for the
averager's lock) loads that round's gradients, not the next one's; at most two rounds are kept (docs/guide.md).
"""
import contextlib
import threading
from typing import Dict, Hashable, Iterator, List, Optional, Sequence, Union

import torch

from hivemind_accum.buffers.buckets import GradientBuckets, wide_dtype

Destination = Union[GradientBuckets, Sequence[torch.Tensor]]


class LocalFallback:
    """
    One averager's local gradients of its latest rounds, each kept for that round's fallback.

    A round is named by a key of the caller's (e.g. the round's control handle). ``holding``: the accumulators still
    hold the latest round's local gradients, so they must be released before the next accumulation. Calls concern
    the round named by :meth:`for_round` in the calling thread, else the latest round. Every method may be called from
    any thread (hivemind's optimizer settles a delayed round in a background thread).

    :param accumulators: the averager's accumulators, built from ``parameters``
    :param parameters: the averager's parameters (a host copy has their layout, as the averager's shared buffers do)
    :param in_place: whether each ``param.grad`` is an alias of ``accumulators``: then a round's local gradients are
      copied out and the accumulators zeroed as soon as the round begins, as the next backward pass adds into them
    """

    max_rounds = 2  # rounds kept at once: beginning a third one drops the oldest

    def __init__(self, accumulators: GradientBuckets, parameters: Sequence[torch.Tensor], in_place: bool):
        self.accumulators = accumulators
        self.parameters = tuple(parameters)
        self._in_place = in_place
        self.holding = False
        # key -> where the round's gradients are (None: the accumulators, else a host buffer) and their scale, in
        # the order the rounds began
        self._kept: Dict[Hashable, List] = {}
        self._latest: Optional[Hashable] = None
        self._hosts: List[GradientBuckets] = []  # allocated at the first round released unsettled, reused
        self._lent: List[GradientBuckets] = []  # host copies taken by take_host_copy, not reused until given back
        self._lock = threading.RLock()
        self._thread = threading.local()
        # CUDA accumulators are copied out into pinned host memory without blocking (see _copy_out_)
        self._pinned = _on_cuda(accumulators)  # host copies are pinned
        self._copied: Dict[int, tuple] = {}  # id(host) -> (event recorded after the copy into it, its scale)

    @property
    def host_bytes(self) -> int:
        """host memory held for fallbacks (0 until a round had to be copied out of the accumulators)"""
        return sum(bucket.flat.numel() * bucket.flat.element_size() for host in self._hosts for bucket in host.buckets)

    @property
    def kept_rounds(self) -> int:
        """how many rounds' local gradients are kept"""
        return len(self._kept)

    @contextlib.contextmanager
    def for_round(self, key: Hashable, beginning: bool = False) -> Iterator[None]:
        """
        Within, calls from this thread concern the round ``key``.

        :param key: the round's key
        :param beginning: True while the round begins: :meth:`hand_off_` keeps it under ``key`` and :meth:`load_into_`
          loads nothing; False: :meth:`load_into_` and :meth:`settle` load or settle that round's gradients only
        """
        outer = getattr(self._thread, "round", None)
        self._thread.round = key, beginning
        try:
            yield
        finally:
            self._thread.round = outer

    @property
    def named_round(self) -> Optional[Hashable]:
        """the round :meth:`for_round` names in this thread; None if it names none"""
        named = getattr(self._thread, "round", None)
        return named[0] if named is not None else None

    def _round(self) -> Optional[Hashable]:
        named = getattr(self._thread, "round", None)
        return named[0] if named is not None else self._latest

    @property
    def lost(self) -> bool:
        """whether :meth:`for_round` names a round that is not beginning, in this thread, whose gradients are kept no
        longer"""
        named = getattr(self._thread, "round", None)
        return named is not None and not named[1] and named[0] not in self._kept

    def hand_off_(self, scale: float, finite: bool) -> None:
        """
        A round began with ``scale * accumulators`` as this peer's part: keep the accumulators as they are.

        :param scale: the scale the accumulators were loaded with (``1 / micro_steps``)
        :param finite: whether they were finite (if not, the fallback is zeros, as sent to peers)
        """
        with self._lock:
            while len(self._kept) >= self.max_rounds:
                del self._kept[next(iter(self._kept))]
            named = getattr(self._thread, "round", None)
            self._latest = key = named[0] if named is not None and named[0] is not None else object()
            self._kept[key] = [None, scale if finite else 0.0]
            self.holding = True
            if self._in_place:
                self.release_()

    def settle(self) -> None:
        """the round's result is used: its local gradients are no longer a fallback. The accumulators are left as they
        are until the next micro-step or reset releases them: with an optimizer that is not offloaded, ``.grad`` may
        be their alias (in-place mode) and hold the averaged gradients the optimizer is about to step with"""
        with self._lock:
            self._kept.pop(self._round(), None)

    def load_into_(self, destination: Destination) -> bool:
        """
        Load the round's local gradients, as they were loaded for the round, into ``destination``; the round is
        settled then.

        :param destination: the averager's shared buffers (buckets of the same layout, or one tensor per parameter)
        :returns: False (loading nothing) if the round is settled or its gradients are kept no longer
        """
        with self._lock:
            kept = self._kept.get(self._round())
            if kept is None:
                return False
            host, scale = kept
            (self.accumulators if host is None else self._host_ready(host)).scaled_copy_to_(destination, scale)
            self.settle()
            return True

    def host_copy_fits(self, params: Sequence[torch.Tensor]) -> bool:
        """whether a host copy (on the CPU, fp16/bf16 as float32) has the shape, dtype and device of each of
        ``params``, in order"""
        layout = [(param.shape, wide_dtype(param.dtype), "cpu") for param in self.parameters]
        return layout == [(param.shape, param.dtype, param.device.type) for param in params]

    def take_host_copy(self) -> Optional[GradientBuckets]:
        """
        The round's local gradients, as they were loaded for the round, if they were copied to host memory (a later
        micro-step needed the accumulators); the round is settled then.

        :returns: the host copy, not reused until :meth:`give_back`; None (taking nothing) if there is none
        """
        with self._lock:
            key = self._round()
            kept = self._kept.get(key)
            if kept is None or kept[0] is None:
                return None
            del self._kept[key]
            self._lent.append(kept[0])
            return self._host_ready(kept[0])

    def give_back(self, host: GradientBuckets) -> None:
        """a host copy from :meth:`take_host_copy` is no longer read"""
        with self._lock:
            self._lent = [lent for lent in self._lent if lent is not host]

    def release_(self) -> None:
        """zero the accumulators for the next micro-steps (one ``zero_`` per bucket), first copying an unsettled
        round's local gradients to host memory (one scaled copy per bucket)"""
        with self._lock:
            kept = self._kept.get(self._latest)
            if kept is not None and kept[0] is None:
                kept[0] = self._free_host()
                self._copy_out_(kept[0], kept[1])
                kept[1] = 1.0
            self.accumulators.zero_()
            self.holding = False

    def use_accumulators(self, accumulators: GradientBuckets) -> None:
        """the averager's accumulators were built anew (in place: the parameters changed dtype or device); host
        copies of the old layout are dropped"""
        with self._lock:
            self.accumulators = accumulators
            self._pinned = _on_cuda(accumulators)
            used = [kept[0] for kept in self._kept.values()] + self._lent
            self._hosts = [host for host in self._hosts if any(host is other for other in used)]

    def _copy_out_(self, host: GradientBuckets, scale: float) -> None:
        """``host = scale * accumulators``: one blocking scaled copy per bucket; from CUDA accumulators into pinned
        ``host`` one copy per bucket with ``non_blocking=True`` instead (the caller's ``zero_`` follows it in stream
        order), scaled by :meth:`_host_ready` once it has landed"""
        if not self._pinned:
            self.accumulators.scaled_copy_to_(host, scale)
            return
        for src, dst in zip(self.accumulators.buckets, host.buckets):
            dst.flat.copy_(src.flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[id(host)] = copied, scale

    def _host_ready(self, host: GradientBuckets) -> GradientBuckets:
        """``host`` once a copy of :meth:`_copy_out_` into it has landed, scaled (on the host, as a blocking copy is)"""
        pending = self._copied.pop(id(host), None)
        if pending is not None:
            copied, scale = pending
            copied.synchronize()
            for bucket in host.buckets:
                bucket.flat.mul_(scale)
        return host

    def _free_host(self) -> GradientBuckets:
        """a host buffer that holds no kept round, allocated if there is none (pinned for CUDA accumulators)"""
        used = [kept[0] for kept in self._kept.values()] + self._lent
        for host in self._hosts:
            if all(host is not other for other in used):
                return host
        self._hosts.append(GradientBuckets(self.parameters, device="cpu", upcast=True, pin_memory=self._pinned))
        return self._hosts[-1]


def _on_cuda(accumulators: GradientBuckets) -> bool:
    return all(bucket.flat.device.type == "cuda" for bucket in accumulators.buckets)
