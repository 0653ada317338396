"""
In-place mode's ``.grad``: a view of the accumulator, so that autograd accumulates into it.

Autograd adds a micro-step's gradient into an existing ``.grad`` in place, except with ``backward(create_graph=True)``,
where it replaces ``.grad`` by ``.grad + gradient``. A hook that runs before autograd adds sees which of the two will
happen: under ``create_graph`` it detaches the view, so ``.grad`` becomes the micro-step's gradient alone and
:meth:`GradViews.attach_` adds it once. The same hook records which views autograd wrote in place, so that a ``.grad``
replaced after that (``p.grad = f(p.grad)``, a tensor computed from the running sum) is told apart from one replaced
after ``zero_grad`` (the view was not written since) and refused instead of counted twice.
"""
import operator
import weakref
from typing import Sequence, Set

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
          (``p.grad = f(p.grad)``): adding it would count the running sum twice
        """
        if all(map(operator.is_, map(_get_grad, self.parameters), self.views)):
            self._written.clear()
            return  # O(parameters) identity checks in C, about 0.1 us per parameter
        written, self._written = self._written, set()
        detached = [i for i, (param, view) in enumerate(zip(self.parameters, self.views)) if param.grad is not view]
        from_sum = [i for i in detached if i in written and self.parameters[i].grad is not None]
        if from_sum:
            raise ValueError(
                f"parameters[{from_sum[0]}] (shape {tuple(self.parameters[from_sum[0]].shape)}"
                f"{f' and {len(from_sum) - 1} more' if len(from_sum) > 1 else ''}): its .grad was replaced after "
                f"backward() had accumulated into it (p.grad = f(p.grad)?). With reuse_grad_buffers=True .grad is a "
                f"view of the running sum, so the new tensor would count that sum twice. Edit .grad in place "
                f"(p.grad.mul_(c)), or use reuse_grad_buffers=False (exact mode), where .grad is yours"
            )
        sources = [None] * len(self.views)
        for i in detached:
            sources[i] = self.parameters[i].grad
        self.accumulators.add_(sources)
        for i in detached:
            self.parameters[i].grad = self.views[i]

    def reattach_(self) -> None:
        """attach every view again, dropping whatever replaced it (the caller has reset the accumulators)"""
        self._written.clear()
        for param, view in zip(self.parameters, self.views):
            param.grad = view

    def _before_autograd_adds(self, index: int) -> None:
        param = self.parameters[index]
        grad = param.grad
        if grad is None:
            self._written.discard(index)  # autograd makes a fresh .grad: adding it is right whatever came before
        elif grad is self.views[index]:
            if torch.is_grad_enabled():  # backward(create_graph=True): autograd would set .grad = view + gradient
                param.grad = None
                self._written.discard(index)
            else:  # autograd adds into the view in place
                self._written.add(index)


class _BeforeAutogradAdds:
    """a parameter hook (it returns None: the gradient is unchanged) calling its :class:`GradViews`, if still alive"""

    __slots__ = ("owner", "index")

    def __init__(self, owner: "weakref.ref[GradViews]", index: int):
        self.owner, self.index = owner, index

    def __call__(self, grad: torch.Tensor) -> None:
        views = self.owner()
        if views is not None:
            views._before_autograd_adds(self.index)
