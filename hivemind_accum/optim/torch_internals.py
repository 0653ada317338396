"""
The private torch interfaces this package relies on, in one place, each checked where it is read.

Fused accumulation needs torch's ``_foreach`` ops. Fused ops that lack a kernel for sparse tensors on some releases
(torch 2.3's ``_foreach_add_`` and ``_foreach_zero_`` have none for ``SparseCPU``) fall back to one op per sparse
tensor, the dense tensors still in one fused op.

Loss scaling without a host read per micro-step needs ``torch.amp.GradScaler``'s per-optimizer state (the overflow
record its ``update()`` reads, the stage that says whether the loop already unscaled), its loss scale tensor and the
unscale kernel ``GradScaler.unscale_`` uses. None of these is public API, so a torch release may change them: a state
whose shape changed raises :class:`TorchInternalsError` naming the torch version and what changed, instead of a
``KeyError`` in the middle of a step, and :func:`check_grad_scaler_internals` exercises the whole contract on a real
scaler.
"""
import enum
import warnings
from typing import Callable, Dict, Optional, Sequence, Set

import torch
from torch.amp import grad_scaler as amp_grad_scaler

TESTED_TORCH = ("2.3.1", "2.13.0", "2.14.1")  # the releases CI runs the tests on, oldest to newest (setup.py's range)


class TorchInternalsError(RuntimeError):
    """a private torch interface this package relies on is missing or changed shape in the installed torch release"""


def _changed(what: str) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__}: {what}. hivemind_accum reads this private torch state to unscale gradients and "
        f"drop overflowing micro-steps without a host read; it was tested with torch {', '.join(TESTED_TORCH)}: "
        f"install one of those, or pass no grad scaler"
    )


def _fused_op(name: str) -> Callable:
    op = getattr(torch, name, None)
    if op is None:
        raise TorchInternalsError(
            f"torch {torch.__version__} has no torch.{name}, the fused op hivemind_accum accumulates gradients with; "
            f"it was tested with torch {', '.join(TESTED_TORCH)}"
        )
    return op


_foreach_add = _fused_op("_foreach_add_")
_foreach_zero = _fused_op("_foreach_zero_")
foreach_copy_ = _fused_op("_foreach_copy_")  # foreach_copy_(targets, sources): targets[i].copy_(sources[i]), one op
foreach_mul_ = _fused_op("_foreach_mul_")  # foreach_mul_(tensors, scalar): tensors[i].mul_(scalar), one op
# non_finite_check_and_unscale_(tensors, found_inf, inv_scale): tensors[i] *= inv_scale, found_inf = 1.0 if any element
# is inf or NaN (the kernel torch.amp.GradScaler.unscale_ uses; found_inf and inv_scale are 0-dim float32 tensors)
non_finite_check_and_unscale_ = _fused_op("_amp_foreach_non_finite_check_and_unscale_")

_NO_SPARSE_KERNEL: Set[str] = set()  # fused ops this torch release refused a sparse tensor for (learnt at first use)


def foreach_add_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """
    ``tensors[i] += alpha * others[i]`` for every i, in one fused ``_foreach_add_``. Where that op has no kernel for
    sparse tensors (torch 2.3), the dense ``others`` are still added in one fused op and each sparse one by its own
    ``add_``.

    :param tensors: dense tensors, modified in place
    :param others: one tensor per entry of ``tensors``, of its shape; dense or sparse
    :param alpha: scalar weight applied to every entry of ``others``
    """
    if "add" not in _NO_SPARSE_KERNEL:
        try:
            return _foreach_add(tensors, others, alpha=alpha)
        except NotImplementedError:  # raised by the dispatcher before any tensor is modified
            if not any(other.is_sparse for other in others):
                raise
            _NO_SPARSE_KERNEL.add("add")
    sparse = [k for k, other in enumerate(others) if other.is_sparse]
    if not sparse:
        return _foreach_add(tensors, others, alpha=alpha)
    dense = [k for k, other in enumerate(others) if not other.is_sparse]
    if dense:
        _foreach_add([tensors[k] for k in dense], [others[k] for k in dense], alpha=alpha)
    for k in sparse:
        tensors[k].add_(others[k], alpha=alpha)


def foreach_zero_(tensors: Sequence[torch.Tensor]) -> None:
    """
    ``tensors[i].zero_()`` for every i, in one fused ``_foreach_zero_`` (dense tensors in one fused op and each sparse
    one by its own ``zero_`` where that op has no kernel for sparse tensors, as in torch 2.3).

    :param tensors: dense or sparse tensors, modified in place
    """
    if "zero" not in _NO_SPARSE_KERNEL:
        try:
            return _foreach_zero(tensors)
        except NotImplementedError:
            if not any(tensor.is_sparse for tensor in tensors):
                raise
            _NO_SPARSE_KERNEL.add("zero")
    dense = [tensor for tensor in tensors if not tensor.is_sparse]
    if dense:
        _foreach_zero(dense)
    for tensor in tensors:
        if tensor.is_sparse:
            tensor.zero_()


def declare_scaling_aware_step(optimizer: torch.optim.Optimizer) -> None:
    """
    Make ``torch.amp.GradScaler.step(optimizer)`` hand itself to ``optimizer.step(grad_scaler=...)`` instead of
    unscaling ``.grad`` and reading the overflow flag on the host first (the private ``_step_supports_amp_scaling``
    protocol torch's fused optimizers use).

    :param optimizer: an optimizer whose ``step`` accepts a ``grad_scaler`` keyword argument
    """
    optimizer._step_supports_amp_scaling = True


def _optimizer_state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Dict:
    """the scaler's private record for ``optimizer``, its shape checked"""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _changed("torch.amp.GradScaler has no _per_optimizer_states (its per-optimizer record)")
    try:
        state = states[id(optimizer)]
    except (KeyError, TypeError) as e:
        raise _changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)] cannot be read ({type(e).__name__}: {e})"
        )
    missing = [key for key in ("stage", "found_inf_per_device") if not isinstance(state, dict) or key not in state]
    if missing:
        raise _changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)] has no "
            f"{' or '.join(repr(k) for k in missing)} "
            f"(it holds {sorted(state) if isinstance(state, dict) else type(state).__name__})"
        )
    if not isinstance(state["found_inf_per_device"], dict):
        raise _changed(
            f"torch.amp.GradScaler._per_optimizer_states[id(optimizer)]['found_inf_per_device'] is a "
            f"{type(state['found_inf_per_device']).__name__}, not a dict from device to overflow flag"
        )
    return state


def _opt_state_unscaled() -> enum.Enum:
    """``torch.amp.grad_scaler.OptState.UNSCALED``: the stage of an optimizer whose gradients ``unscale_`` unscaled"""
    opt_state = getattr(amp_grad_scaler, "OptState", None)
    unscaled = getattr(opt_state, "UNSCALED", None)
    if not isinstance(unscaled, enum.Enum):
        raise _changed(
            "torch.amp.grad_scaler.OptState.UNSCALED (the stage torch.amp.GradScaler.unscale_ records) is missing"
        )
    return unscaled


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """
    The scaler's current loss scale as its own tensor (no host read; ``get_scale()`` reads it on the host).

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :raises TorchInternalsError: if torch keeps the scale elsewhere or not as a one-element float tensor
    """
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
        raise _changed(
            f"torch.amp.GradScaler._scale is "
            f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else scale.shape}, "
            f"not the one-element float tensor holding the loss scale (was scaler.scale(loss) called?)"
        )
    return scale


def inv_loss_scale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """
    What ``optimizer``'s gradients must be multiplied by to be unscaled, without a host read: ``1 / scale`` as
    ``torch.amp.GradScaler.unscale_`` computes it (in float64, then float32), or 1.0 if the loop already called
    ``scaler.unscale_(optimizer)`` since the last step.

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :param optimizer: the optimizer the scaler steps
    :returns: a one-element float32 tensor on the scale's device
    :raises TorchInternalsError: if the scaler's private state changed shape in this torch release
    """
    scale = loss_scale(scaler)
    if _optimizer_state(scaler, optimizer)["stage"] is _opt_state_unscaled():
        return torch.ones((), dtype=torch.float32, device=scale.device)
    return scale.double().reciprocal().float()


def record_found_inf_(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor] = None
) -> None:
    """
    Set the overflow record the scaler's ``update()`` reads for ``optimizer`` (1.0: back the scale off, 0.0: count a
    step towards growth), as ``unscale_`` would have.

    :param scaler: an enabled ``torch.amp.GradScaler``
    :param optimizer: the optimizer the scaler steps
    :param found_inf: a 0-dim float32 tensor on any device; None records 0.0 on the scale's device, and only if the
      optimizer has no record yet (``update()`` needs one even if a micro-step is discarded)
    :raises TorchInternalsError: if the scaler's private state changed shape in this torch release
    """
    state = _optimizer_state(scaler, optimizer)
    if found_inf is None:
        if state["found_inf_per_device"]:
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=loss_scale(scaler).device)
    state["found_inf_per_device"] = {found_inf.device: found_inf}


def check_grad_scaler_internals() -> None:
    """
    Run the contract this package relies on against a real, enabled ``torch.amp.GradScaler`` on the CPU (a one-element
    model, a few tiny ops): ``loss_scale`` is the scale, ``inv_loss_scale`` is its inverse until ``unscale_`` and 1.0
    after, the scaler hands itself to a step that declares it handles scaling (:func:`declare_scaling_aware_step`),
    and ``update()`` backs the scale off after an overflow recorded by :func:`record_found_inf_` and keeps it after a
    clean record.

    :raises TorchInternalsError: naming the torch version and the first part of the contract that does not hold
    """
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
        if loss_scale(scaler).item() != scaler.get_scale():
            raise _changed(
                f"torch.amp.GradScaler._scale holds {loss_scale(scaler).item()}, get_scale() says {scaler.get_scale()}"
            )
        if inv_loss_scale(scaler, optimizer).item() != 1 / scaler.get_scale():
            raise _changed("the inverse of torch.amp.GradScaler._scale is not 1 / get_scale() before unscale_")
        record_found_inf_(scaler, optimizer)
        scaler.unscale_(optimizer)
        if inv_loss_scale(scaler, optimizer).item() != 1.0:
            raise _changed(
                "after torch.amp.GradScaler.unscale_(optimizer) the optimizer's stage is not OptState.UNSCALED"
            )
        record_found_inf_(scaler, optimizer, torch.tensor(float(overflow)))
        optimizer.handed = None
        with warnings.catch_warnings():  # torch 2.x announces that it may stop handing itself over (FutureWarning)
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(optimizer)
        if optimizer.handed is not scaler:
            raise _changed(
                "torch.amp.GradScaler.step does not hand itself to optimizer.step(grad_scaler=...) for an optimizer "
                "with _step_supports_amp_scaling = True"
            )
        scaler.update()
        if scaler.get_scale() != expected_scale:
            raise _changed(
                f"torch.amp.GradScaler.update() left the scale at {scaler.get_scale()} after a recorded "
                f"{'overflow' if overflow else 'clean step'} (expected {expected_scale}): it no longer reads "
                f"_per_optimizer_states[id(optimizer)]['found_inf_per_device']"
            )
        param.grad = None
