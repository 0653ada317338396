"""
:class:`hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` on top of
:class:`hivemind_accum.optim.grad_averager.GradientAverager`'s flat on-device accumulation.

Upstream's PowerSGD class calls ``super().__init__`` and the accumulation methods through ``self``; placing
:class:`~hivemind_accum.optim.grad_averager.GradientAverager` after it in the method resolution order makes every
accumulation call land on the flat buckets while PowerSGD's compression and all-reduce phases run unchanged.
"""
from hivemind.optim import power_sgd_averager as upstream

from hivemind_accum.optim.grad_averager import GradientAverager


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
    """

    keep_local_fallback = False
