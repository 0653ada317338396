from hivemind_accum.optim.grad_averager import GradientAverager
from hivemind_accum.optim.optimizer import Optimizer
from hivemind_accum.optim.power_sgd_averager import PowerSGDGradientAverager

__all__ = ["GradientAverager", "Optimizer", "PowerSGDGradientAverager"]
