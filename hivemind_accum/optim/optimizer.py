"""
:class:`hivemind.Optimizer` that builds this package's gradient averager by default.
"""
from typing import Optional

from hivemind.optim import optimizer as upstream
from hivemind.optim.grad_averager import GradientAveragerFactory

from hivemind_accum.optim.grad_averager import GradientAverager


class Optimizer(upstream.Optimizer):
    """
    A subclass of :class:`hivemind.Optimizer` accepting every upstream argument unchanged. The only difference:
    without ``grad_averager_factory``, gradients accumulate in :class:`hivemind_accum.GradientAverager` instead of
    upstream's averager (pass ``grad_averager_factory=partial(hivemind_accum.PowerSGDGradientAverager, averager_rank=r)``
    for PowerSGD). See :class:`hivemind.Optimizer` for all parameters.
    """

    def _make_gradient_averager(self, factory: Optional[GradientAveragerFactory], **kwargs) -> GradientAverager:
        return super()._make_gradient_averager(factory if factory is not None else GradientAverager, **kwargs)
