"""
In-place mode's ``.grad``: a view of the accumulator, so that autograd accumulates into it.

Autograd adds a micro-step's gradient into an existing ``.grad`` in place, except with ``backward(create_graph=True)``,
where it replaces ``.grad`` by ``.grad + gradient``. A hook that runs before autograd adds sees which of the two will
happen: under ``create_graph`` it detaches the view, so ``.grad`` becomes the micro-step's gradient alone and
:meth:`GradViews.attach_` adds it once. The same hook records which views autograd wrote in place, so that a ``.grad``
replaced after that (``p.grad = f(p.grad)``, a tensor computed from the running sum) is told apart from one replaced
after ``zero_grad`` (the view was not written since) and refused instead of counted twice.

An in-place edit of a view between micro-steps (``clip_grad_norm_``, ``p.grad.mul_(c)``) would apply to the running
sum, not to the micro-batch's gradient. The views of a bucket share its flat buffer's version counter, which an
in-place write moves by one per tensor written. The same hook counts autograd's own writes; writes made through
:class:`GradientBuckets` (zeroing, adding) are reported and taken off, so whatever moved a bucket's counter beyond
that, while the bucket held earlier micro-steps' gradients, was an edit: :meth:`GradViews.attach_` refuses it, with
one integer comparison per bucket. The fused unscale kernel of the grad scalers moves no version counter: neither
``hivemind.GradScaler``'s once-per-round unscale nor a plain ``torch.amp.GradScaler.unscale_`` is seen here.
"""
import contextlib
import operator
import weakref
from typing import Iterator, List, Sequence, Set

import torch

from hivemind_accum.optim.grad_buckets import GradientBuckets

_get_grad = operator.attrgetter("grad")


class GradViews:
    """
    Keeps every ``param.grad`` a view of ``accumulators`` and adds whatever replaced a view into it.

    :param accumulators: the averager's accumulators, built from ``parameters`` in their dtypes
    :param parameters: the averager's parameters; each one that requires grad gets a hook run before autograd adds
      into its ``.grad``
    """

    def __init__(self, accumulators: GradientBuckets, parameters: Sequence[torch.Tensor]):
        self.accumulators = accumulators
        self.parameters = tuple(parameters)
        self.views = accumulators.views
        self._written: Set[int] = set()  # parameters whose view autograd added into since the last attach_
        self._dropped: Set[int] = set()  # of those, parameters whose .grad was set to None before the next attach_
        self._buckets = accumulators.buckets
        self._bucket_of = [0] * len(self.parameters)
        for k, bucket in enumerate(self._buckets):
            for i in bucket.indices:
                self._bucket_of[i] = k
        # per bucket: its version counter when last accounted for, autograd's in-place writes since (counted by the
        # hook), whether it holds gradients of earlier micro-steps, and whether an edit was seen before a reported write
        self._baseline: List[int] = [bucket.flat._version for bucket in self._buckets]
        self._autograd_writes: List[int] = [0] * len(self._buckets)
        self._holds_sum: List[bool] = [False] * len(self._buckets)
        self._edited: List[int] = [0] * len(self._buckets)
        accumulators.write_observer = self.own_write
        owner = weakref.ref(self)  # the hooks outlive an averager that is shut down: they then do nothing
        self._hooks = [
            param.register_hook(_BeforeAutogradAdds(owner, index))
            for index, param in enumerate(self.parameters)
            if param.requires_grad
        ]

    def attach_(self) -> None:
        """
        Add every ``.grad`` that is not its view into the view, then attach the view again. While all views are
        attached this only compares object identities, no tensor work.

        :raises ValueError: naming the parameter, if its ``.grad`` was replaced after autograd had added into its view
          (``p.grad = f(p.grad)``): adding it would count the running sum twice; naming the parameter, if its
          ``.grad`` was set to None (``zero_grad``) after autograd had added into its view: that micro-batch cannot be
          dropped; naming the bucket, if a view holding earlier micro-steps' gradients was edited in place since the
          last call (``clip_grad_norm_``, ``mul_``)
        """
        self._check_edits()
        if all(map(operator.is_, map(_get_grad, self.parameters), self.views)):
            self._written.clear()
            self._account_()
            return  # O(parameters) identity checks in C, about 0.1 us per parameter
        written, self._written = self._written, set()
        detached = [i for i, (param, view) in enumerate(zip(self.parameters, self.views)) if param.grad is not view]
        dropped, self._dropped = self._dropped, set()
        dropped.update(i for i in detached if i in written and self.parameters[i].grad is None)
        if dropped:
            raise ValueError(self._dropped_message(dropped))
        from_sum = [i for i in detached if i in written and self.parameters[i].grad is not None]
        if from_sum:
            raise ValueError(
                f"parameters[{from_sum[0]}] (shape {tuple(self.parameters[from_sum[0]].shape)}"
                f"{f' and {len(from_sum) - 1} more' if len(from_sum) > 1 else ''}): its .grad was replaced after "
                f"backward() had accumulated into it (p.grad = f(p.grad)?). With reuse_grad_buffers=True .grad is a "
                f"view of the running sum, so the new tensor would count that sum twice. Use "
                f"reuse_grad_buffers=False (exact mode), where .grad is yours to edit"
            )
        sources = [None] * len(self.views)
        for i in detached:
            sources[i] = self.parameters[i].grad
        self.accumulators.add_(sources)
        for i in detached:
            self.parameters[i].grad = self.views[i]
        self._account_(added=[bucket for bucket in range(len(self._buckets))
                              if any(sources[i] is not None for i in self._buckets[bucket].indices)])

    def reattach_(self) -> None:
        """attach every view again, dropping whatever replaced it (the caller has reset the accumulators); writes to
        the views until now are accounted for"""
        self._written.clear()
        self._dropped.clear()
        for param, view in zip(self.parameters, self.views):
            param.grad = view
        self._edited = [0] * len(self._buckets)
        self._account_()

    def check_no_unstepped_grads(self) -> None:
        """
        Before ``zero_grad(set_to_none=True)``: setting ``.grad`` to None drops a micro-batch's gradient only if it is
        not yet in the running sum.

        :raises ValueError: naming the parameter, if backward() added into its view since the last micro-step: that
          gradient is part of the running sum now, and dropping it is impossible
        """
        if self._written:
            raise ValueError(self._dropped_message(self._written))

    def _dropped_message(self, indices: Set[int]) -> str:
        first = min(indices)
        return (
            f"parameters[{first}] (shape {tuple(self.parameters[first].shape)}"
            f"{f' and {len(indices) - 1} more' if len(indices) > 1 else ''}): zero_grad() after backward() and "
            f"before step(). With reuse_grad_buffers=True backward() adds each micro-batch's gradient into the "
            f"running sum of the epoch at once, so zero_grad() cannot drop it. Call step() before zero_grad(), or use "
            f"reuse_grad_buffers=False (exact mode) to drop micro-batches"
        )

    @contextlib.contextmanager
    def own_write(self, zeroes: bool = False) -> Iterator[None]:
        """
        Within, writes to the views are the package's own, not edits (a reset, an unscale once per round).

        :param zeroes: whether the write zeroes the accumulators: they then hold no earlier micro-step
        """
        before = [bucket.flat._version for bucket in self._buckets]
        for k, version in enumerate(before):  # an edit made before this write is not lost with it
            extra = version - self._baseline[k] - self._autograd_writes[k]
            if extra > 0:
                self._edited[k] += extra if self._holds_sum[k] else 0
                self._baseline[k] += extra
        try:
            yield
        finally:
            for k, bucket in enumerate(self._buckets):
                self._baseline[k] += bucket.flat._version - before[k]
                if zeroes:
                    self._holds_sum[k] = False

    def _check_edits(self) -> None:
        """raise if a bucket holding earlier micro-steps' gradients was written beyond autograd's and our own writes"""
        for k, bucket in enumerate(self._buckets):
            extra = bucket.flat._version - self._baseline[k] - self._autograd_writes[k]
            if self._edited[k] or (extra > 0 and self._holds_sum[k]):
                raise ValueError(self._edit_message(k, max(extra, 0) + self._edited[k]))

    def _account_(self, added: Sequence[int] = ()) -> None:
        """take every write to the views until now as accounted for; a bucket written holds gradients from now on"""
        for k, bucket in enumerate(self._buckets):
            version = bucket.flat._version
            if version != self._baseline[k] or k in added:
                self._holds_sum[k] = True
            self._baseline[k], self._autograd_writes[k] = version, 0

    def _edit_message(self, k: int, edits: int) -> str:
        bucket = self._buckets[k]
        names = ", ".join(f"parameters[{i}]" for i in bucket.indices[:3])
        more = f" and {len(bucket.indices) - 3} more" if len(bucket.indices) > 3 else ""
        return (
            f"the .grad of {names}{more} ({bucket.source_dtype} on {bucket.source_device}) was edited in place "
            f"between micro-steps ({edits} in-place write(s) beyond backward()'s own, e.g. "
            f"torch.nn.utils.clip_grad_norm_, p.grad.mul_(c) or model.zero_grad(set_to_none=False)). With reuse_grad_buffers=True each .grad is a view of the running sum of "
            f"this epoch's micro-steps, so the edit changed that sum, not this micro-batch's gradient. Use "
            f"reuse_grad_buffers=False (exact mode), where .grad is yours to edit"
        )

    def _before_autograd_adds(self, index: int) -> None:
        param = self.parameters[index]
        grad = param.grad
        if grad is None:  # autograd makes a fresh .grad, added at the next attach_
            if index in self._written:  # set to None after backward() added into the view: a dropped micro-batch
                self._dropped.add(index)
            self._written.discard(index)
        elif grad is self.views[index]:
            if torch.is_grad_enabled():  # backward(create_graph=True): autograd would set .grad = view + gradient
                param.grad = None
                self._written.discard(index)
            else:  # autograd adds into the view in place: one write on the bucket's version counter
                self._written.add(index)
                self._autograd_writes[self._bucket_of[index]] += 1


class _BeforeAutogradAdds:
    """a parameter hook (it returns None: the gradient is unchanged) calling its :class:`GradViews`, if still alive"""

    __slots__ = ("owner", "index")

    def __init__(self, owner: "weakref.ref[GradViews]", index: int):
        self.owner, self.index = owner, index

    def __call__(self, grad: torch.Tensor) -> None:
        views = self.owner()
        if views is not None:
            views._before_autograd_adds(self.index)
