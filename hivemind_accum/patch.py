"""
Make code that builds :class:`hivemind.Optimizer` itself (a training framework, say) use this package's accumulation
without code changes.
"""
import threading

from hivemind.optim import optimizer as upstream_optimizer

from hivemind_accum.optim.grad_averager import GradientAverager
from hivemind_accum.optim.optimizer import Optimizer

_UPSTREAM = dict(GradientAverager=upstream_optimizer.GradientAverager, zero_grad=upstream_optimizer.Optimizer.zero_grad)
_lock = threading.Lock()


def patch_hivemind() -> None:
    """
    Patch upstream hivemind in this process so that every ``hivemind.Optimizer`` built afterwards without a
    ``grad_averager_factory`` accumulates gradients in :class:`hivemind_accum.GradientAverager` (both accumulation
    modes, the fallback to local gradients after a failed round), and accepts ``zero_grad()`` with
    ``reuse_grad_buffers=True``. Optimizers built before the call keep their averager. Idempotent; undo with
    :func:`unpatch_hivemind`.

    Patched names: ``hivemind.optim.optimizer.GradientAverager`` (the default averager factory) and
    ``hivemind.Optimizer.zero_grad``.
    """
    with _lock:
        upstream_optimizer.GradientAverager = GradientAverager
        upstream_optimizer.Optimizer.zero_grad = Optimizer.zero_grad


def unpatch_hivemind() -> None:
    """restore upstream hivemind's default gradient averager and ``zero_grad`` (no effect if not patched)"""
    with _lock:
        upstream_optimizer.GradientAverager = _UPSTREAM["GradientAverager"]
        upstream_optimizer.Optimizer.zero_grad = _UPSTREAM["zero_grad"]


def is_patched() -> bool:
    """whether :func:`patch_hivemind` is in effect"""
    return upstream_optimizer.GradientAverager is GradientAverager
