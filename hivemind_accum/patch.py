"""
Make code that builds :class:`hivemind.Optimizer` itself (a training framework, say) use this package's accumulation
without code changes.
"""
import functools
import threading

from hivemind.optim import optimizer as upstream_optimizer
from hivemind.optim.grad_scaler import GradScaler as HivemindGradScaler

from hivemind_accum.arguments import check_batch_size_per_step
from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.integration.optimizer import Optimizer

_UPSTREAM = dict(
    GradientAverager=upstream_optimizer.GradientAverager,
    zero_grad=upstream_optimizer.Optimizer.zero_grad,
    step=upstream_optimizer.Optimizer.step,
    scaler_step=HivemindGradScaler.step,
)
_lock = threading.Lock()


def _refuse_scaled_exact_step(optimizer, grad_scaler) -> None:
    """raise before a micro-step of a plain ``hivemind.Optimizer`` in exact mode with an enabled ``hivemind.GradScaler``,
    which would step with gradients still multiplied by the loss scale"""
    if (
        isinstance(grad_scaler, HivemindGradScaler)
        and grad_scaler.is_enabled()
        and isinstance(optimizer, upstream_optimizer.Optimizer)
        and not isinstance(optimizer, Optimizer)
        and optimizer.use_gradient_averaging
        and not optimizer.auxiliary
        and not optimizer.grad_averager.reuse_grad_buffers
    ):
        raise ValueError(
            "grad_scaler: hivemind.GradScaler with reuse_grad_buffers=False: hivemind 1.1.12's Optimizer would step with "
            "gradients still multiplied by the loss scale. Build hivemind_accum.Optimizer instead, which unscales "
            "them, or use reuse_grad_buffers=True, or torch.amp.GradScaler with scaler.step(opt)"
        )


@functools.wraps(_UPSTREAM["step"])
def _step(self, closure=None, batch_size=None, grad_scaler=None):
    _refuse_scaled_exact_step(self, grad_scaler)
    if batch_size is None:  # hivemind.Optimizer does not check it at construction
        check_batch_size_per_step(self.batch_size_per_step)
    return _UPSTREAM["step"](self, closure, batch_size, grad_scaler)


@functools.wraps(_UPSTREAM["scaler_step"])
def _scaler_step(self, optimizer, *args, **kwargs):
    _refuse_scaled_exact_step(optimizer, self)
    return _UPSTREAM["scaler_step"](self, optimizer, *args, **kwargs)


def patch_hivemind() -> None:
    """
    Patch upstream hivemind in this process so that every ``hivemind.Optimizer`` built afterwards without a
    ``grad_averager_factory`` accumulates gradients in :class:`hivemind_accum.GradientAverager` (both accumulation
    modes, the fallback to local gradients after a failed round), and accepts ``zero_grad()`` with
    ``reuse_grad_buffers=True``. Optimizers built before the call keep their averager. A micro-step with
    ``hivemind.GradScaler`` and ``reuse_grad_buffers=False``, which hivemind 1.1.12 takes with gradients still
    multiplied by the loss scale, raises instead. Idempotent; undo with :func:`unpatch_hivemind`.

    Patched names: ``hivemind.optim.optimizer.GradientAverager`` (the default averager factory),
    ``hivemind.Optimizer.zero_grad``, ``hivemind.Optimizer.step`` and ``hivemind.GradScaler.step``.
    """
    with _lock:
        upstream_optimizer.GradientAverager = GradientAverager
        upstream_optimizer.Optimizer.zero_grad = Optimizer.zero_grad
        upstream_optimizer.Optimizer.step = _step
        HivemindGradScaler.step = _scaler_step


def unpatch_hivemind() -> None:
    """restore what :func:`patch_hivemind` patched (no effect if not patched)"""
    with _lock:
        upstream_optimizer.GradientAverager = _UPSTREAM["GradientAverager"]
        upstream_optimizer.Optimizer.zero_grad = _UPSTREAM["zero_grad"]
        upstream_optimizer.Optimizer.step = _UPSTREAM["step"]
        HivemindGradScaler.step = _UPSTREAM["scaler_step"]


def is_patched() -> bool:
    """whether :func:`patch_hivemind` is in effect"""
    return upstream_optimizer.GradientAverager is GradientAverager
