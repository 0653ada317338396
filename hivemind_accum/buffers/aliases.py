"""
In-place mode's ``.grad``: per-parameter aliases of the accumulators, so that autograd accumulates into them, with no
Python call in backward.

Each ``param.grad`` is an alias of its slice of a flat accumulator (``Tensor.set_`` on the bucket's storage). Autograd
adds each micro-step's gradient into it in place, as native accumulation adds into ``.grad``. Unlike a view, an alias
has a version counter of its own, which autograd's add and any in-place edit move by one. :meth:`GradAliases.attach_`
runs at every ``step()`` and reads, on the host, what happened since the previous call:

- identity: a ``.grad`` that is not its alias was set to None (``zero_grad``) and maybe refilled by backward, or
  replaced. A fresh gradient is added into the alias; the alias is attached again.
- version counters: a ``.grad`` replaced after its alias was written (``p.grad = f(p.grad)``, or ``zero_grad`` after
  backward) is refused. Adding it would count the running sum twice, or keep a micro-batch the caller dropped.
- ``backward(create_graph=True)`` makes autograd replace ``.grad`` by ``alias + gradient`` out of place: right after a
  reset the alias holds zeros, so that is the fresh gradient; the epoch's hooked backward sees ``create_graph`` and the
  hooks then stay (below).
- storage: an alias moved out of its accumulator (``model.half()``, ``model.to(device)``, ``p.grad.data = ...``) holds
  the running sum. At the next step that adds into the accumulators, load or reset, the accumulators are built anew
  from the parameters as they are and the sums copied in.

An in-place edit of the running sum (``clip_grad_norm_``, ``p.grad.mul_(c)``) cannot be told from autograd's own add
without a hook in backward: two backward passes, and one backward pass followed by ``clip_grad_norm_``, leave the same
state. So hooks are registered for one backward pass per epoch, the first that adds into a running sum (after the
first step following a reset). They count autograd's adds; the next ``step()`` removes them and refuses any write
beyond. Once a hook sees ``create_graph=True``, the hooks stay, so that ``.grad`` is each micro-step's own gradient.
"""
import contextlib
import operator
import weakref
from typing import Callable, Iterator, List, Optional, Sequence, Set

import torch

from hivemind_accum.buffers.buckets import GradientBuckets

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")


class GradAliases:
    """
    Keeps every ``param.grad`` an alias of ``accumulators`` and adds whatever replaced an alias into it.

    :param accumulators: the averager's accumulators, built from ``parameters`` in their dtypes
    :param parameters: the averager's parameters
    :param on_rebuild: called with the new accumulators when they are built anew (the parameters' dtype or device
      changed, or a ``.grad``'s storage left them)
    """

    def __init__(self, accumulators: GradientBuckets, parameters: Sequence[torch.Tensor],
                 on_rebuild: Optional[Callable[[GradientBuckets], None]] = None):
        self.parameters = tuple(parameters)
        self._on_rebuild = on_rebuild
        self._use(accumulators)
        self._hooks: List[torch.utils.hooks.RemovableHandle] = []
        self._hook_writes: List[int] = []  # per parameter: autograd's adds into its alias seen by the hooks
        self._holds: List[bool] = []  # per parameter: whether its alias held a sum when the hooks were registered
        self._arm_next = True  # register the hooks at the next micro-step's attach_ (the first of an epoch)
        self._create_graph = False  # a hook saw backward(create_graph=True): keep the hooks
        self._edited: List[int] = []  # parameters whose running sum the hooks saw edited, until the reset

    def _use(self, accumulators: GradientBuckets) -> None:
        self.accumulators = accumulators
        self.aliases = tuple(map(_alias, accumulators.views))
        self._pointers = list(map(torch.Tensor.data_ptr, self.aliases))
        self._dtypes, self._devices = list(map(_DTYPE, self.aliases)), list(map(_DEVICE, self.aliases))
        self._versions = list(map(_VERSION, self.aliases))  # at the last attach_, plus the package's own writes
        self._reset_versions = list(self._versions)
        self._added: Set[int] = set()  # parameters whose alias a fresh gradient was added into since the reset

    def attach_(self, micro_step: bool = True, rebuild: bool = False) -> None:
        """
        Add every ``.grad`` that is not its alias into the alias, then attach the alias again. While all aliases are
        attached this compares identities and reads version counters, no tensor work.

        :param micro_step: whether a micro-step ends here (the first after a reset registers the hooks)
        :param rebuild: also build the accumulators anew if an alias or a parameter moved (a load does)
        :raises ValueError: naming the parameter, if its ``.grad`` was replaced after its alias was written
          (``p.grad = f(p.grad)``: adding it would count the running sum twice), or set to None after backward()
          added into its alias (that micro-batch cannot be dropped); if the hooks registered for this backward saw an
          in-place edit of a running sum (``clip_grad_norm_``, ``mul_``)
        """
        versions = list(map(_VERSION, self.aliases))
        if self._hooks and micro_step:
            self._check_edits(versions)
        self._refuse_edits()
        if all(map(operator.is_, map(_GRAD, self.parameters), self.aliases)):
            if rebuild and self._moved():
                self._rebuild()
                versions = list(map(_VERSION, self.aliases))
            self._versions = versions
        else:
            self._attach_detached_(list(map(_GRAD, self.parameters)), versions)
        if micro_step and self._arm_next:
            self._arm()

    def _attach_detached_(self, grads: List[Optional[torch.Tensor]], versions: List[int]) -> None:
        detached = [i for i, (grad, alias) in enumerate(zip(grads, self.aliases)) if grad is not alias]
        written = {i for i in detached if versions[i] != self._versions[i]}
        if any(grads[i] is not None and grads[i].requires_grad for i in detached):
            self._arm_next = True  # backward(create_graph=True)? the hooks see the next backward and stay if so
        dropped = [i for i in detached if i in written and grads[i] is None]
        if dropped:
            raise ValueError(self._dropped_message(dropped))
        from_sum = [i for i in detached if i in written and grads[i] is not None]
        if from_sum:
            raise ValueError(
                f"{_names(self.parameters, from_sum)}: its .grad was replaced after backward() had added into it: by "
                f"p.grad = f(p.grad), or by zero_grad() after backward() and before step(). With "
                f"reuse_grad_buffers=True .grad is an alias of the running sum: a tensor computed from it would count "
                f"that sum twice, and zero_grad() cannot drop a micro-batch already added. Call step() before "
                f"zero_grad(), or use reuse_grad_buffers=False (exact mode), where .grad is yours to edit"
            )
        if self._moved():
            self._rebuild()
        with torch.no_grad():
            sources = [None] * len(self.aliases)
            fresh = [i for i in detached if grads[i] is not None]
            for i in fresh:
                sources[i] = grads[i]
            if fresh:
                self.accumulators.add_(sources)
        self._added.update(fresh)
        for i in detached:
            self.parameters[i].grad = self.aliases[i]
        self._versions = list(map(_VERSION, self.aliases))

    def reattach(self) -> None:
        """attach every alias again, dropping whatever replaced it (the caller resets the accumulators next); build
        the accumulators anew first if an alias or a parameter moved"""
        self._disarm()
        if self._moved():
            self._rebuild()
        for param, alias in zip(self.parameters, self.aliases):
            param.grad = alias
        self._versions = list(map(_VERSION, self.aliases))
        self._reset_versions = list(self._versions)
        self._added.clear()
        self._edited = []
        self._arm_next = True

    def check_no_unstepped_grads(self) -> None:
        """
        Before ``zero_grad(set_to_none=True)``: setting ``.grad`` to None drops a micro-batch's gradient only if it is
        not yet in the running sum.

        :raises ValueError: naming the parameter, if backward() added into its alias since the last micro-step
        """
        written = [i for i, (grad, alias, old) in enumerate(zip(map(_GRAD, self.parameters), self.aliases,
                                                                 self._versions))
                   if grad is alias and alias._version != old]
        if written:
            raise ValueError(self._dropped_message(written))

    @contextlib.contextmanager
    def own_write(self, zeroes: bool = False) -> Iterator[None]:
        """
        Within, writes to the attached ``.grad`` are the package's own, not edits (the optimizer's own reset).

        :param zeroes: whether the write zeroes the accumulators: they then hold no earlier micro-step
        """
        before = list(map(_VERSION, self.aliases))
        try:
            yield
        finally:
            for i, (old, new) in enumerate(zip(before, map(_VERSION, self.aliases))):
                self._versions[i] += new - old
                if zeroes:  # the alias holds no earlier micro-step from here
                    self._reset_versions[i] = new
            if zeroes:
                self._added.clear()
                self._holds = [False] * len(self._holds)

    def _moved(self) -> bool:
        """whether an alias left its accumulator or a parameter changed dtype or device"""
        return (list(map(torch.Tensor.data_ptr, self.aliases)) != self._pointers
                or list(map(_DTYPE, self.parameters)) != self._dtypes
                or list(map(_DEVICE, self.parameters)) != self._devices)

    def _rebuild(self) -> None:
        """accumulators built anew from the parameters as they are now, holding what each alias holds (cast and moved
        as the parameters were)"""
        old = self.aliases
        accumulators = GradientBuckets(self.parameters)
        with torch.no_grad():
            for view, alias in zip(accumulators.views, old):
                view.copy_(alias)
        holding = {i for i, (alias, reset) in enumerate(zip(old, self._reset_versions)) if alias._version != reset}
        attached = [param.grad is alias for param, alias in zip(self.parameters, old)]
        added = self._added | holding
        self._use(accumulators)
        self._added = added
        for param, alias, was_attached in zip(self.parameters, self.aliases, attached):
            if was_attached:
                param.grad = alias
        self._versions = list(map(_VERSION, self.aliases))
        self._reset_versions = list(self._versions)
        if self._on_rebuild is not None:
            self._on_rebuild(accumulators)

    # ---- the hooks of one backward pass per epoch: in-place edits of the running sum ----

    def _arm(self) -> None:
        self._arm_next = False
        if self._hooks:
            return
        self._hook_writes = [0] * len(self.parameters)
        self._holds = [alias._version != reset or i in self._added
                       for i, (alias, reset) in enumerate(zip(self.aliases, self._reset_versions))]
        owner = weakref.ref(self)  # the hooks outlive an averager that is shut down: they then do nothing
        self._hooked = [param.requires_grad for param in self.parameters]
        self._hooks = [param.register_hook(_BeforeAutogradAdds(owner, i))
                       for i, param in enumerate(self.parameters) if param.requires_grad]

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._hooks:
            for param in self.parameters:  # an empty hook dict still makes autograd take the GIL for this tensor
                if param._backward_hooks is not None and not param._backward_hooks:
                    param._backward_hooks = None
        self._hooks = []

    def _check_edits(self, versions: List[int]) -> None:
        """after the hooked backward: refuse an alias holding a sum written beyond autograd's adds; the hooks go,
        unless they saw create_graph"""
        self._edited.extend(
            i for i, (new, old, writes, holds, hooked) in enumerate(zip(versions, self._versions, self._hook_writes,
                                                                        self._holds, self._hooked))
            if hooked and holds and new - old > writes and self.parameters[i].grad is self.aliases[i]
        )
        if not self._create_graph:
            self._disarm()
        self._hook_writes = [0] * len(self.parameters)

    def _refuse_edits(self) -> None:
        """raise while an edit of a running sum seen by the hooks stays in the accumulators (until the reset)"""
        edited = self._edited
        if edited:
            raise ValueError(
                f"the .grad of {_names(self.parameters, edited)} was edited in place between micro-steps (a write "
                f"beyond backward()'s own, e.g. torch.nn.utils.clip_grad_norm_, p.grad.mul_(c) or "
                f"model.zero_grad(set_to_none=False)). With reuse_grad_buffers=True each .grad is an alias of the "
                f"running sum of this epoch's micro-steps, so the edit changed that sum, not this micro-batch's "
                f"gradient. Use reuse_grad_buffers=False (exact mode), where .grad is yours to edit"
            )

    def _before_autograd_adds(self, index: int) -> None:
        param = self.parameters[index]
        if param.grad is not self.aliases[index]:
            return  # autograd makes a fresh .grad (or adds into a replacement): seen at the next attach_
        if torch.is_grad_enabled():  # backward(create_graph=True): .grad becomes this micro-step's gradient alone
            self._create_graph = True
            param.grad = None
        else:
            self._hook_writes[index] += 1

    def _dropped_message(self, indices: Sequence[int]) -> str:
        return (
            f"{_names(self.parameters, indices)}: zero_grad() after backward() and before step(). With "
            f"reuse_grad_buffers=True backward() adds each micro-batch's gradient into the running sum of the epoch "
            f"at once, so zero_grad() cannot drop it. Call step() before zero_grad(), or use "
            f"reuse_grad_buffers=False (exact mode) to drop micro-batches"
        )


def _alias(view: torch.Tensor) -> torch.Tensor:
    """a tensor on ``view``'s memory with a version counter of its own (a view shares its base's)"""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    with torch.no_grad():
        return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _names(parameters: Sequence[torch.Tensor], indices: Sequence[int]) -> str:
    indices = sorted(indices)
    first = indices[0]
    shown = ", ".join(f"parameters[{i}]" for i in indices[:3])
    more = f" and {len(indices) - 3} more" if len(indices) > 3 else ""
    if len(indices) == 1:
        return f"parameters[{first}] (shape {tuple(parameters[first].shape)})"
    return f"{shown}{more}"


class _BeforeAutogradAdds:
    """a parameter hook (it returns None: the gradient is unchanged) calling its :class:`GradAliases`, if still alive"""

    __slots__ = ("owner", "index")

    def __init__(self, owner: "weakref.ref[GradAliases]", index: int):
        self.owner, self.index = owner, index

    def __call__(self, grad: torch.Tensor) -> None:
        aliases = self.owner()
        if aliases is not None:
            aliases._before_autograd_adds(self.index)
