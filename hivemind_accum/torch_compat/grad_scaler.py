"""
``torch.amp.GradScaler``'s private state and the contract this package relies on (``hivemind.GradScaler``'s is
:mod:`~hivemind_accum.torch_compat.hivemind_grad_scaler`).

Loss scaling without a host read per micro-step needs ``torch.amp.GradScaler``'s per-optimizer state (the overflow
record its ``update()`` reads, the stage that says whether the loop already unscaled), its loss scale and growth
tracker tensors, its backoff factor and the ``_step_supports_amp_scaling`` hand-over.
None of these is public API: :func:`check_grad_scaler_internals` runs the whole contract on a scaler of its own at
the first loss-scaled step, and each accessor checks the shape of what it reads (failures raise
:class:`~hivemind_accum.torch_compat.checks.TorchInternalsError`).
"""
import enum
import warnings
from typing import Dict, Optional, Sequence

import torch
from torch.amp import grad_scaler as amp_grad_scaler

from hivemind_accum.torch_compat.checks import TorchInternalsError, changed, check_once

def declare_scaling_aware_step(optimizer: torch.optim.Optimizer) -> None:
    """
    Make ``torch.amp.GradScaler.step(optimizer)`` hand itself to ``optimizer.step(grad_scaler=...)`` instead of
    unscaling ``.grad`` and reading the overflow flag on the host first (the private ``_step_supports_amp_scaling``
    protocol torch's fused optimizers use; :func:`check_grad_scaler_internals` checks it at the first scaled step).

    :param optimizer: an optimizer whose ``step`` accepts a ``grad_scaler`` keyword argument
    """
    optimizer._step_supports_amp_scaling = True


def _scaler_changed(what: str) -> TorchInternalsError:
    use = "reads this private torch state to unscale gradients and drop overflowing micro-steps without a host read"
    return changed(what, use, instead=", or pass no grad scaler")


def optimizer_state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Dict:
    """the scaler's private record for ``optimizer``, its shape checked"""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _scaler_changed("torch.amp.GradScaler has no _per_optimizer_states (its per-optimizer record)")
    try:
        state = states[id(optimizer)]
    except (KeyError, TypeError) as e:
        raise _scaler_changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)] cannot be read ({type(e).__name__}: {e})"
        )
    missing = [key for key in ("stage", "found_inf_per_device") if not isinstance(state, dict) or key not in state]
    if missing:
        raise _scaler_changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)] has no "
            f"{' or '.join(repr(k) for k in missing)} "
            f"(it holds {sorted(state) if isinstance(state, dict) else type(state).__name__})"
        )
    if not isinstance(state["found_inf_per_device"], dict):
        raise _scaler_changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)]['found_inf_per_device'] is a "
            f"{type(state['found_inf_per_device']).__name__}, not a dict from device to overflow flag"
        )
    return state


def _opt_state_unscaled() -> enum.Enum:
    """``torch.amp.grad_scaler.OptState.UNSCALED``: the stage of an optimizer whose gradients ``unscale_`` unscaled"""
    opt_state = getattr(amp_grad_scaler, "OptState", None)
    unscaled = getattr(opt_state, "UNSCALED", None)
    if not isinstance(unscaled, enum.Enum):
        raise _scaler_changed(
            "torch.amp.grad_scaler.OptState.UNSCALED (the stage torch.amp.GradScaler.unscale_ records) is missing"
        )
    return unscaled


def _loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
        raise _scaler_changed(
            f"torch.amp.GradScaler._scale is "
            f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else scale.shape}, "
            f"not the one-element float tensor holding the loss scale (was scaler.scale(loss) called?)"
        )
    return scale


def _growth_tracker(scaler: torch.amp.GradScaler) -> torch.Tensor:
    tracker = getattr(scaler, "_growth_tracker", None)
    if not isinstance(tracker, torch.Tensor) or tracker.numel() != 1 or tracker.dtype != torch.int32:
        raise _scaler_changed(
            f"torch.amp.GradScaler._growth_tracker is "
            f"{type(tracker).__name__ if not isinstance(tracker, torch.Tensor) else (tracker.shape, tracker.dtype)}, "
            f"not the one-element int32 tensor counting clean steps (was scaler.scale(loss) called?)"
        )
    return tracker


_NEVER = 2**31 - 1  # a growth interval no growth tracker reaches


def _back_off_loss_scale_(scaler: torch.amp.GradScaler, found_infs: Sequence[torch.Tensor]) -> None:
    if not found_infs:
        return
    scale, tracker = _loss_scale(scaler), _growth_tracker(scaler)
    found_inf = found_infs[0].to(scale.device, non_blocking=True)
    for other in found_infs[1:]:
        found_inf = found_inf + other.to(scale.device, non_blocking=True)
    # an overflow: scale * backoff and tracker 0; none: scale as it was and tracker + 1, which the sub_ undoes
    torch._amp_update_scale_(scale, tracker, found_inf, 1.0, float(scaler.get_backoff_factor()), _NEVER)
    tracker.sub_(1).clamp_(min=0)


def _inv_loss_scale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    scale = _loss_scale(scaler)
    if optimizer_state(scaler, optimizer)["stage"] is _opt_state_unscaled():
        return torch.ones((), dtype=torch.float32, device=scale.device)
    return scale.double().reciprocal().float()


def _record_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor] = None
) -> None:
    state = optimizer_state(scaler, optimizer)
    if found_inf is None:
        if state["found_inf_per_device"]:
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=_loss_scale(scaler).device)
    state["found_inf_per_device"] = {found_inf.device: found_inf}


def check_grad_scaler_once() -> None:
    check_once("torch.amp.GradScaler", check_grad_scaler_internals)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """
    The scaler's current loss scale as its own tensor (no host read; ``get_scale()`` reads it on the host).

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :raises TorchInternalsError: if torch keeps the scale elsewhere or not as a one-element float tensor, or at the
      first call in the process if :func:`check_grad_scaler_internals` fails
    """
    check_grad_scaler_once()
    return _loss_scale(scaler)


def inv_loss_scale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """
    What ``optimizer``'s gradients must be multiplied by to be unscaled, without a host read: ``1 / scale`` as
    ``torch.amp.GradScaler.unscale_`` computes it (in float64, then float32), or 1.0 if the loop already called
    ``scaler.unscale_(optimizer)`` since the last step.

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :param optimizer: the optimizer the scaler steps
    :returns: a one-element float32 tensor on the scale's device
    :raises TorchInternalsError: if the scaler's private state changed shape in this torch release, or at the first
      call in the process if :func:`check_grad_scaler_internals` fails
    """
    check_grad_scaler_once()
    return _inv_loss_scale(scaler, optimizer)


def record_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor] = None
) -> None:
    """
    Set the overflow record the scaler's ``update()`` reads for ``optimizer`` (1.0: back the scale off, 0.0: count a
    step towards growth), as ``unscale_`` would have.

    :param scaler: an enabled ``torch.amp.GradScaler``
    :param optimizer: the optimizer the scaler steps
    :param found_inf: a 0-dim float32 tensor on any device; None records 0.0 on the scale's device, and only if the
      optimizer has no record yet (``update()`` needs one even if a micro-step is discarded)
    :raises TorchInternalsError: if the scaler's private state changed shape in this torch release, or at the first
      call in the process if :func:`check_grad_scaler_internals` fails
    """
    check_grad_scaler_once()
    _record_found_inf(scaler, optimizer, found_inf)


def back_off_loss_scale_(scaler: torch.amp.GradScaler, found_infs: Sequence[torch.Tensor]) -> None:
    """
    What ``update()`` does to the scale after an overflow, on the scale's device without a host read: if any of
    ``found_infs`` is nonzero, the loss scale is multiplied by the backoff factor and the growth tracker reset (with
    ``torch._amp_update_scale_``, as ``update()`` does); otherwise neither changes (the step does not count towards
    growth).

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :param found_infs: 0-dim float32 overflow flags (0.0 or 1.0) on any devices; none changes nothing
    :raises TorchInternalsError: as :func:`inv_loss_scale`, or if the growth tracker is not a one-element int32 tensor
    """
    check_grad_scaler_once()
    _back_off_loss_scale_(scaler, found_infs)


def check_grad_scaler_internals() -> None:
    """
    Run the contract this package relies on against a real, enabled ``torch.amp.GradScaler`` on the CPU (a one-element
    model, a few tiny ops): ``loss_scale`` is the scale, ``inv_loss_scale`` is its inverse until ``unscale_`` and 1.0
    after, the scaler hands itself to a step that declares it handles scaling (:func:`declare_scaling_aware_step`),
    ``update()`` backs the scale off after an overflow recorded by :func:`record_found_inf` and keeps it after a
    clean record, and :func:`back_off_loss_scale_` backs it off as ``update()`` does. The accessors run it at their
    first call in a process.

    :raises TorchInternalsError: naming the torch version and the first part of the contract that does not hold
    """
    try:
        _run_grad_scaler_contract()
    except TorchInternalsError:
        raise
    except Exception as e:  # torch's own GradScaler code failed on its changed internals
        raise _scaler_changed(f"a torch.amp.GradScaler on the CPU fails ({type(e).__name__}: {e})") from e


def _run_grad_scaler_contract() -> None:
    init_scale, backoff = 2.0**10, 0.5

    class ScalingAwareSGD(torch.optim.SGD):
        def step(self, closure=None, grad_scaler=None):
            self.handed = grad_scaler

    param = torch.nn.Parameter(torch.ones(1))
    optimizer = ScalingAwareSGD([param], lr=0.0)
    declare_scaling_aware_step(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff, growth_interval=1000)
    for overflow, expected_scale in ((False, init_scale), (True, init_scale * backoff)):
        scaler.scale(param.sum()).backward()
        if _loss_scale(scaler).item() != scaler.get_scale():
            raise _scaler_changed(
                f"torch.amp.GradScaler._scale holds {_loss_scale(scaler).item()}, get_scale() says "
                f"{scaler.get_scale()}"
            )
        if _inv_loss_scale(scaler, optimizer).item() != 1 / scaler.get_scale():
            raise _scaler_changed("the inverse of torch.amp.GradScaler._scale is not 1 / get_scale() before unscale_")
        _record_found_inf(scaler, optimizer)
        scaler.unscale_(optimizer)
        if _inv_loss_scale(scaler, optimizer).item() != 1.0:
            raise _scaler_changed(
                "after torch.amp.GradScaler.unscale_(optimizer) the optimizer's stage is not OptState.UNSCALED"
            )
        _record_found_inf(scaler, optimizer, torch.tensor(float(overflow)))
        optimizer.handed = None
        with warnings.catch_warnings():  # torch 2.x announces that it may stop handing itself over (FutureWarning)
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(optimizer)
        if optimizer.handed is not scaler:
            raise _scaler_changed(
                "torch.amp.GradScaler.step does not hand itself to optimizer.step(grad_scaler=...) for an optimizer "
                "with _step_supports_amp_scaling = True"
            )
        scaler.update()
        if scaler.get_scale() != expected_scale:
            raise _scaler_changed(
                f"torch.amp.GradScaler.update() left the scale at {scaler.get_scale()} after a recorded "
                f"{'overflow' if overflow else 'clean step'} (expected {expected_scale}): it no longer reads "
                f"_per_optimizer_states[id(optimizer)]['found_inf_per_device']"
            )
        param.grad = None
    tracker = _growth_tracker(scaler).fill_(5)
    for overflow, expected in ((False, (init_scale * backoff, 5)), (True, (init_scale * backoff**2, 0))):
        _back_off_loss_scale_(scaler, [torch.tensor(float(overflow))])
        if (scaler.get_scale(), int(tracker)) != expected:
            raise _scaler_changed(
                f"torch._amp_update_scale_ left (scale, growth tracker) at {(scaler.get_scale(), int(tracker))} after "
                f"{'an overflow' if overflow else 'a clean step'} (expected {expected})"
            )
