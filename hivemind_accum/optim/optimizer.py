"""
:class:`hivemind.Optimizer` that builds this package's gradient averager by default.
"""
from typing import Optional

import torch

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

    def zero_grad(self, set_to_none: bool = True):
        """
        Reset the model's gradients. Unlike upstream, this is allowed with ``reuse_grad_buffers=True``: with
        ``set_to_none=True`` (the default) the gradients already accumulated stay in the averager and the next
        micro-step's gradients are added to them; ``set_to_none=False`` zeroes ``.grad`` in place, which in in-place
        mode discards this epoch's accumulated gradients, as it would in native PyTorch accumulation.

        :param set_to_none: set each ``.grad`` to None instead of filling it with zeros
        """
        params = [param for group in self.param_groups for param in group["params"]]
        if set_to_none:
            for param in params:
                param.grad = None
        else:
            torch._foreach_zero_([param.grad for param in params if param.grad is not None])

    def _make_gradient_averager(self, factory: Optional[GradientAveragerFactory], **kwargs) -> GradientAverager:
        return super()._make_gradient_averager(factory if factory is not None else GradientAverager, **kwargs)
