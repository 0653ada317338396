"""``hivemind_accum.optim``: the classes users build, under the path hivemind users know (``hivemind.optim``); they live
in :mod:`hivemind_accum.integration`."""
from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.integration.optimizer import Optimizer
from hivemind_accum.integration.power_sgd_averager import PowerSGDGradientAverager

__all__ = ["GradientAverager", "Optimizer", "PowerSGDGradientAverager"]
