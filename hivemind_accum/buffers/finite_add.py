"""
The finite-only add of loss-scaled gradients (:meth:`GradientBuckets.add_finite_`) and the counters of the micro-steps
it drops.

``add_finite_`` adds a micro-step's gradients, unscaled, only if all of them are finite. Two paths, split by where
the data lives: with everything on the CPU the decision is read on the host (a read stalls nothing there); otherwise
it stays on the device, and nothing is read on the host (:class:`DroppedMicroSteps` counts what was dropped there, for
one host read per round).
"""
from __future__ import annotations

import math
import operator
from itertools import repeat
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from hivemind_accum.torch_compat import add_unless_found_inf_, has_add_unless_found_inf, non_finite_check_and_unscale_

if TYPE_CHECKING:
    from hivemind_accum.buffers.buckets import GradientBucket, GradientBuckets


class DroppedMicroSteps:
    """
    Micro-steps dropped for inf/NaN gradients (:meth:`GradientBuckets.add_finite_`): each micro-step's flag is copied
    into a slot of a device buffer (one copy, no host read) and its batch size kept on the host; one host read per
    round tells which were dropped, their samples summed exactly on the host. Also the batch size of the first
    micro-step kept (micro-step i weighs ``b_i / b_first``: if the first micro-step is dropped, the accumulators are
    rescaled once at load time).

    :param device: where the flags live (the accumulators' first bucket's device)
    """

    def __init__(self, device: torch.device):
        self._device = device
        self._flags = torch.zeros(0)  # found_inf of each micro-step since the last reset (at the first, 8 slots)
        self._batch_sizes: List[int] = []  # of each micro-step since the last reset
        self._collected = 0  # micro-steps whose flags collect_ read already
        self._first_kept_batch_size = 0
        self.may_have_dropped = False

    def count_(self, found_inf: torch.Tensor, batch_size: int) -> None:
        """count a micro-step of ``batch_size`` samples, dropped if ``found_inf`` is 1.0: one copy; allocates only at
        the first call and where an epoch's micro-steps pass every earlier epoch's and 8, 16, 32, ..."""
        slot = len(self._batch_sizes)
        if slot == len(self._flags):
            grown = torch.zeros(max(8, 2 * slot), device=self._device)
            grown[:slot].copy_(self._flags)
            self._flags = grown
        self._flags[slot].copy_(found_inf)
        self._batch_sizes.append(batch_size)
        self.may_have_dropped = True

    def collect_(self) -> Tuple[int, int, int]:
        """(dropped samples, dropped micro-steps, first kept batch size or 0) of the micro-steps since the last
        collect, in one host read; the first kept batch size stays until :meth:`reset_`"""
        sizes = self._batch_sizes[self._collected:]
        flags = self._flags[self._collected:len(self._batch_sizes)].tolist()
        self._collected = len(self._batch_sizes)
        self.may_have_dropped = False
        dropped = [size for size, flag in zip(sizes, flags) if flag]
        if not self._first_kept_batch_size:
            self._first_kept_batch_size = next((size for size, flag in zip(sizes, flags) if not flag), 0)
        return sum(dropped), len(dropped), self._first_kept_batch_size

    def reset_(self) -> None:
        """forget every micro-step (the accumulators were reset)"""
        self._batch_sizes.clear()
        self._collected = self._first_kept_batch_size = 0
        self.may_have_dropped = False


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """move a flag or scale across devices: without blocking towards an accelerator (stream-ordered), blocking
    towards the CPU, whose kernels would otherwise read the destination before the copy lands"""
    return tensor.to(device, non_blocking=torch.device(device).type != "cpu")


def host_check_is_free(buckets: GradientBuckets) -> bool:
    """True if every buffer and every source of ``buckets`` lives on the CPU: reading a flag there stalls nothing"""
    return all(bucket.flat.device.type == bucket.source_device.type == "cpu" for bucket in buckets.buckets)


def add_finite_with_host_check(
    buckets: GradientBuckets, sources: Sequence[Optional[torch.Tensor]], inv_scale: torch.Tensor, alpha: float
) -> torch.Tensor:
    """:meth:`GradientBuckets.add_finite_` for CPU data: one read-only pass (a sum per source: inf or NaN anywhere
    makes it non-finite), one host read, then (if finite) one :meth:`GradientBuckets.add_` with the unscale folded into
    ``alpha``. On a CPU a read-only pass costs what a read-write unscale does, so this path costs one pass where the
    device path takes four. Finite gradients whose sum exceeds float32's range (3.4e38) count as overflowed too"""
    inv_scale = inv_scale.to("cpu", torch.float32)
    sums = [(grad.coalesce().values() if grad.is_sparse else grad).sum(dtype=torch.float32)
            for grad in sources if grad is not None]
    if sums:  # the decision and the unscale factor in one host read: the factor, or NaN if any source is not finite
        inv_scale = torch.where(torch.stack(sums).isfinite().all(), inv_scale, float("nan"))
    factor = inv_scale.item()
    finite = math.isfinite(factor)  # an infinite 1 / loss scale drops the micro-step too, as on the device path
    if finite:
        buckets.add_(sources, alpha=alpha * factor)
    return torch.tensor(0.0 if finite else 1.0, device=buckets.buckets[0].flat.device)


def add_finite_on_device(
    buckets: GradientBuckets, sources: Sequence[Optional[torch.Tensor]], inv_scale: torch.Tensor, alpha: float
) -> torch.Tensor:
    """:meth:`GradientBuckets.add_finite_` without a host synchronization: check and unscale on the device, then add
    unless an overflow was found. A bucket whose sources match its buffer (device, dtype, strides) takes two passes:
    the sources are unscaled in place, then added by a fused kernel that skips the add on the device's flag. Any
    other bucket stages its sources in a persistent buffer first (copy, unscale, mask, add). From the second call on
    it allocates nothing"""
    for bucket in buckets.buckets:
        if bucket.found_inf is None:
            bucket.found_inf = torch.zeros((), dtype=torch.float32, device=bucket.flat.device)
        bucket.found_inf.zero_()
    found_inf = buckets.buckets[0].found_inf
    unscaled = []
    for bucket in buckets.buckets:
        grads = [sources[i] for i in bucket.indices]
        direct = _present_if_unscalable_in_place(bucket, grads)
        if direct is not None:  # the sources themselves, unscaled in place as torch.amp.GradScaler.unscale_ does
            targets, grads = direct
            if not grads:  # no gradient in this bucket: nothing to add
                continue
        else:  # kept: nothing allocated per micro-step
            targets, grads = None, [bucket.stage_(grads)]
        non_finite_check_and_unscale_(grads, bucket.found_inf, _to_device(inv_scale, bucket.flat.device))
        if bucket.found_inf is not found_inf:
            found_inf.add_(_to_device(bucket.found_inf, found_inf.device))
        unscaled.append((bucket, targets, grads))
    if len(buckets.buckets) > 1:
        found_inf.clamp_(max=1.0)
    for bucket, targets, grads in unscaled:  # a micro-step counts only if all of it is finite
        bucket_inf = _to_device(found_inf, bucket.flat.device)
        if targets is not None:
            add_unless_found_inf_(targets, grads, bucket_inf, alpha=alpha)
            continue
        if bucket.drop_mask is None:
            bucket.drop_mask = torch.zeros((), dtype=torch.bool, device=bucket.flat.device)
        torch.logical_or(bucket_inf, bucket_inf, out=bucket.drop_mask)  # found_inf != 0, allocating nothing
        bucket.flat.add_(grads[0].masked_fill_(bucket.drop_mask, 0), alpha=alpha)
    return found_inf


def _present_if_unscalable_in_place(
    bucket: GradientBucket, grads: Sequence[Optional[torch.Tensor]]
) -> Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]]:
    """the bucket's views and the gradients present, if those gradients can be unscaled in place and added by
    :func:`add_unless_found_inf_`: buffer and gradients share device and dtype, the fused kernel runs there, and each
    gradient has its view's strides (the kernel pairs elements by memory order); else None"""
    if bucket.needs_staging:
        return None
    if not has_add_unless_found_inf(bucket.flat.device, bucket.flat.dtype):
        return None
    if bucket.strides is None:
        bucket.strides = [view.stride() for view in bucket.views]
    views = bucket.views
    if any(map(operator.is_, grads, repeat(None))):
        present = [k for k, grad in enumerate(grads) if grad is not None]
        views, grads = [views[k] for k in present], [grads[k] for k in present]
        strides = [bucket.strides[k] for k in present]
    else:
        strides = bucket.strides
    try:
        if list(map(torch.Tensor.stride, grads)) != strides:
            return None
    except RuntimeError:  # a sparse gradient has no strides
        return None
    return views, list(grads)
