"""
:class:`hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` on top of
:class:`hivemind_accum.integration.grad_averager.GradientAverager`'s flat on-device accumulation.

Upstream's PowerSGD class calls ``super().__init__`` and the accumulation methods through ``self``; placing
:class:`~hivemind_accum.integration.grad_averager.GradientAverager` after it in the method resolution order makes every
accumulation call land on the flat buckets while PowerSGD's compression and all-reduce phases run unchanged.
"""
import torch
from hivemind.optim import power_sgd_averager as upstream
from hivemind.utils.asyncio import enter_asynchronously

from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.rounds.finite import all_finite


class PowerSGDGradientAverager(upstream.PowerSGDGradientAverager, GradientAverager):
    """
    PowerSGD gradient averaging (https://arxiv.org/abs/1905.13727, as implemented upstream) with this package's
    accumulation. Accepts exactly upstream's arguments (``parameters, averager_rank, *, dht, prefix,
    reuse_grad_buffers, accumulate_grads_on, client_mode, warn, min_compression_ratio, averaged_grads, **kwargs``);
    see :class:`hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` for PowerSGD's parameters and
    :class:`hivemind_accum.integration.grad_averager.GradientAverager` for the two accumulation modes.

    A failed round does not fall back to the round's local gradients (``keep_local_fallback = False``): PowerSGD adds
    them into its error-feedback buffers when the all-reduce starts, so applying them now would count them twice.
    This peer's inf/NaN gradients go out as zeros with weight 0, and such a round leaves its error feedback as it was
    (:meth:`_aggregate_with_group`); error feedback and ``Q`` left non-finite by a round are reset before the next one
    (:meth:`discard_nonfinite_round_`; docs/guide.md#what-the-guard-does-not-cover).
    """

    keep_local_fallback = False

    def __init__(self, *args, averaged_grads_dtype: torch.dtype = torch.float32, **kwargs):
        """the class's parameters, and ``averaged_grads_dtype``, which accepts only ``torch.float32``: fp16/bf16
        gradients are averaged in float32 (PowerSGD fails on them in their own dtype, hivemind#545)"""
        if averaged_grads_dtype != torch.float32:
            raise ValueError(f"averaged_grads_dtype: PowerSGD averages in torch.float32, got {averaged_grads_dtype!r}")
        self.averaged_grads_dtype = averaged_grads_dtype  # read by _grads_from_parameters before __init__ sets it
        super().__init__(*args, averaged_grads_dtype=averaged_grads_dtype, **kwargs)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """the PowerSGD round (in the averager's background process); in a round joined with weight 0 the
        error-feedback buffers are restored afterwards: this peer sent nothing to compress, but the round subtracts
        the group's result from them, so the next round would send minus that result along with the next gradients"""
        if kwargs.get("weight") != 0:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        async with enter_asynchronously(self.get_tensors()):
            self.round_guard.snapshot(self._ms)
        try:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            async with enter_asynchronously(self.get_tensors()):
                self.round_guard.restore_(self._ms)

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> bool:
        """:meth:`GradientAverager.load_accumulators_into_averager_`, after :meth:`discard_nonfinite_round_`: this
        peer never enters a round with inf/NaN error feedback or ``Q``, whatever became of the previous round"""
        self.discard_nonfinite_round_()
        return super().load_accumulators_into_averager_()

    @torch.no_grad()
    def discard_nonfinite_round_(self) -> None:
        """reset the error-feedback buffers (to zeros) and warm-start ``Q`` matrices (to ``torch.rand``, as
        ``__init__`` initializes them) that a round left non-finite: one check of all of them (one read-only pass, one
        host read), then, only if that fails, one per tensor"""
        with self.get_tensors():  # the background process reads and writes them under this lock
            if all_finite(self._ms + self._qs):
                return
            for m, q in zip(self._ms, self._qs):
                if not all_finite([m, q]):
                    m.zero_()
                    q.copy_(torch.rand(q.shape))
