"""
:class:`hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` on top of
:class:`hivemind_accum.optim.grad_averager.GradientAverager`'s flat on-device accumulation.

Upstream's PowerSGD class calls ``super().__init__`` and the accumulation methods through ``self``; placing
:class:`~hivemind_accum.optim.grad_averager.GradientAverager` after it in the method resolution order makes every
accumulation call land on the flat buckets while PowerSGD's compression and all-reduce phases run unchanged.
"""
import torch
from hivemind.optim import power_sgd_averager as upstream

from hivemind_accum.optim.grad_averager import GradientAverager
from hivemind_accum.optim.round_guard import all_finite


class PowerSGDGradientAverager(upstream.PowerSGDGradientAverager, GradientAverager):
    """
    PowerSGD gradient averaging (https://arxiv.org/abs/1905.13727, as implemented upstream) with this package's
    accumulation. Accepts exactly upstream's arguments (``parameters, averager_rank, *, dht, prefix,
    reuse_grad_buffers, accumulate_grads_on, client_mode, warn, min_compression_ratio, averaged_grads, **kwargs``);
    see :class:`hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` for PowerSGD's parameters and
    :class:`hivemind_accum.optim.grad_averager.GradientAverager` for the two accumulation modes.

    Unlike :class:`~hivemind_accum.optim.grad_averager.GradientAverager`, a failed round does not fall back to the
    round's local gradients (``keep_local_fallback = False``), as upstream: PowerSGD adds the round's gradients into
    its error-feedback buffers at the start of the all-reduce, so they reach a later round through error feedback, and
    applying them now as well would count them twice.

    Non-finite values: this peer's own gradients are checked as they are loaded, as in
    :class:`~hivemind_accum.optim.grad_averager.GradientAverager`, and sent as zeros with weight 0 if they hold inf or
    NaN, so they never enter this peer's error-feedback buffers nor its ``P`` and ``Q`` contributions. A round whose
    averaged result is not finite (every member had weight 0, or a member does not guard its gradients) has already
    written inf/NaN into the error-feedback buffers and the warm-start ``Q`` matrices, which every later round would
    carry: :meth:`discard_nonfinite_round_` then resets those (error feedback to zeros, ``Q`` to fresh random values as
    at construction), losing the error feedback accumulated so far for those tensors, and the optimizer skips its step.
    A round can also leave them non-finite without reporting a result to this peer (one that fails between PowerSGD's
    two all-reduce phases has already written ``Q = M^T P`` from a 0 / 0 ``P``), and a peer's zeros with weight 0 are
    harmless only if its ``P = M Q`` is finite (``0 * NaN`` is NaN): so every round also begins with this reset
    (:meth:`load_accumulators_into_averager_`, one more read-only pass over ``M`` and ``Q`` per round).
    """

    keep_local_fallback = False

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        """:meth:`GradientAverager.load_accumulators_into_averager_`, after :meth:`discard_nonfinite_round_`: this
        peer never enters a round with inf/NaN error feedback or ``Q``, whatever became of the previous round"""
        self.discard_nonfinite_round_()
        super().load_accumulators_into_averager_()

    @torch.no_grad()
    def discard_nonfinite_round_(self) -> None:
        """reset the error-feedback buffers (to zeros) and warm-start ``Q`` matrices (to ``torch.rand``, as ``__init__``
        initializes them) that a round left non-finite: one check of all of them (one read-only pass, one host read),
        then, only if that fails, one per tensor"""
        with self.get_tensors():  # the background process reads and writes them under this lock
            if all_finite(self._ms + self._qs):
                return
            for m, q in zip(self._ms, self._qs):
                if not all_finite([m, q]):
                    m.zero_()
                    q.copy_(torch.rand(q.shape))
