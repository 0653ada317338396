"""
Keeping inf and NaN out of averaging rounds: one peer whose gradients or parameters are not finite must not poison
every peer it averages with (an all-reduce computes ``sum(weight_i * x_i) / sum(weight_i)``, so a single NaN
element reaches every member of the group, and a weight of 0 does not help: ``0 * NaN`` is NaN).

This module knows nothing about hivemind's classes. It gives one check and one small per-averager record:

- :func:`all_finite`: whether a sequence of tensors holds any inf or NaN, with one read-only reduction per tensor
  (per flat bucket for a ``GradientAverager``'s buffers) and one host read, or from sums taken as the tensors were
  written;
- :class:`RoundGuard`: what one averager does around a round: before it, :meth:`RoundGuard.offer_` checks this peer's
  own values and replaces non-finite ones by zeros, to be sent with weight 0; after it, :meth:`RoundGuard.accept_`
  checks the result and, if it is not finite, restores this peer's own values from a snapshot kept for that purpose.

Who calls what:

- :class:`hivemind_accum.GradientAverager` calls ``offer_`` on the shared buffers it has just loaded, once per round;
  :class:`hivemind_accum.Optimizer` checks the round's averaged gradients with :func:`all_finite` before stepping and,
  if they are not finite, uses the round's own gradients (the averager's failed-round fallback) or skips its step
  (:mod:`hivemind_accum.rounds.step_gate`), deciding from ``RoundGuard.own_finite_in(round)``: a round's own record,
  also when a later round has begun since.
- :class:`hivemind_accum.integration.state_averager.TrainingStateAverager` calls ``offer_``, ``snapshot`` and
  ``accept_`` around each parameter averaging all-reduce, in the averager's background process.
"""
import weakref
from typing import Hashable, List, Optional, Sequence

import torch
from hivemind.utils import get_logger

from hivemind_accum.buffers.buckets import wide_dtype
from hivemind_accum.torch_compat import foreach_copy_, foreach_zero_

logger = get_logger(__name__)


@torch.no_grad()
def all_finite(tensors: Sequence[torch.Tensor], checksums: Optional[torch.Tensor] = None) -> bool:
    """
    Whether every element of every tensor is finite.

    One read-only ``sum`` per floating-point tensor (accumulated in float32 for fp16/bf16), then one host read of all
    the sums: a finite sum proves that every element is finite (inf and NaN propagate through addition). Only a
    tensor whose sum is not finite is checked again element by element (``isfinite().all()``, which allocates a
    boolean mask), so finite values whose sum overflows are not mistaken for inf. Tensors that are not floating point
    (e.g. integer counters among optimizer statistics) are always finite and are skipped.

    :param tensors: tensors of any shape, dtype and device (flat buffers give one reduction each)
    :param checksums: sums already taken over all of ``tensors`` (in any partition, e.g. by
      :meth:`hivemind_accum.buffers.buckets.GradientBuckets.scaled_copy_with_checksums_` as it wrote them): then
      the tensors are read again only if one of these sums is not finite (each then checked element by element)
    :returns: False if any element is inf or NaN
    """
    floats = [tensor for tensor in tensors if tensor.is_floating_point() and tensor.numel() > 0]
    if not floats:
        return True
    if checksums is not None:
        return bool(checksums.isfinite().all()) or all(bool(torch.isfinite(tensor).all()) for tensor in floats)
    sums = [tensor.sum(dtype=wide_dtype(tensor.dtype)) for tensor in floats]
    finite_sums = torch.stack([total.to("cpu", torch.float64) for total in sums]).isfinite().tolist()
    return all(finite or bool(torch.isfinite(tensor).all()) for tensor, finite in zip(floats, finite_sums))


class RoundGuard:
    """
    One averager's defence against non-finite values, round by round.

    :param what: what the averager averages, for log messages (e.g. ``"gradients"``)
    """

    def __init__(self, what: str):
        self.what = what
        self.own_finite = True  # whether this peer's own values were finite when last offered
        # the same, per round, for as long as the round's key (its control) is alive
        self._own_finite_by_round: "weakref.WeakKeyDictionary[Hashable, bool]" = weakref.WeakKeyDictionary()
        self._snapshot: Optional[List[torch.Tensor]] = None

    @torch.no_grad()
    def offer_(self, tensors: Sequence[torch.Tensor], checksums: Optional[torch.Tensor] = None,
               round_key: Optional[Hashable] = None) -> bool:
        """
        Before a round: check this peer's own values, about to be all-reduced; if any is inf or NaN, set all of them
        to zeros (in place) and log a warning. The caller then joins the round with weight 0: the group's average
        is the other members' average, and this peer receives it.

        :param tensors: the averager's buffers, already holding this peer's values for the round
        :param checksums: optional sums of ``tensors`` taken as they were written (see :func:`all_finite`)
        :param round_key: the round the values are offered for (its control handle, or any object that takes a weak
          reference), for :meth:`own_finite_in`; remembered while the key is alive
        :returns: ``own_finite``: True if the values may be offered with their weight, False if they were zeroed
        """
        self.own_finite = all_finite(tensors, checksums)
        if round_key is not None:
            self._own_finite_by_round[round_key] = self.own_finite
        if not self.own_finite:
            foreach_zero_([tensor for tensor in tensors if tensor.numel() > 0])
            logger.warning(
                f"This peer's {self.what} hold inf or NaN: they are replaced by zeros and averaged with weight 0, so "
                f"peers do not receive them"
            )
        return self.own_finite

    def own_finite_in(self, round_key: Optional[Hashable]) -> bool:
        """whether this peer's own values were finite when offered for the round ``round_key`` (:meth:`offer_`),
        however many rounds were offered since; for a round it does not know (None, or never offered), the last
        offer's"""
        if round_key is None:
            return self.own_finite
        return self._own_finite_by_round.get(round_key, self.own_finite)

    @torch.no_grad()
    def snapshot(self, tensors: Sequence[torch.Tensor]) -> None:
        """keep a copy of ``tensors`` (this peer's own values) for :meth:`accept_` or :meth:`restore_`: one fused copy
        into buffers allocated at the first call and reused (``tensors`` must keep their shapes from call to call)"""
        if self._snapshot is None:
            self._snapshot = [torch.empty_like(tensor, device="cpu") for tensor in tensors]
        foreach_copy_(self._snapshot, list(tensors))

    @torch.no_grad()
    def accept_(self, tensors: Sequence[torch.Tensor]) -> bool:
        """
        After a round: if its result in ``tensors`` holds inf or NaN, restore this peer's own values from the last
        :meth:`snapshot` and log a warning.

        :param tensors: the averager's buffers, holding the round's result
        :returns: True if the result was finite and kept
        """
        if all_finite(tensors):
            return True
        self.restore_(tensors)
        logger.warning(f"The averaged {self.what} hold inf or NaN: this peer keeps its own {self.what} instead")
        return False

    @torch.no_grad()
    def restore_(self, tensors: Sequence[torch.Tensor]) -> None:
        """copy the last :meth:`snapshot` back into ``tensors``: one fused copy"""
        foreach_copy_(list(tensors), self._snapshot)
