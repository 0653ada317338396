"""
The private torch interfaces this package relies on, in one place, each checked once per process at its first use.

Fused accumulation needs torch's ``_foreach`` ops: :func:`check_fused_ops` runs each on small CPU tensors when the
first accumulators are built or an op is first called, before anything the caller passed is modified. Fused ops that
lack a kernel for sparse tensors on some releases (torch 2.3's ``_foreach_add_`` and ``_foreach_zero_`` have none for
``SparseCPU``) fall back to one op per sparse tensor, the dense tensors still in one fused op.

Loss scaling without a host read per micro-step needs ``torch.amp.GradScaler``'s per-optimizer state (the overflow
record its ``update()`` reads, the stage that says whether the loop already unscaled), its loss scale tensor, the
``_step_supports_amp_scaling`` hand-over and the unscale kernel ``GradScaler.unscale_`` uses; ``hivemind.GradScaler``
calls private methods of ``torch.amp.GradScaler``. None of these is public API: :func:`check_grad_scaler_internals`
runs the whole contract on a scaler of its own at the first loss-scaled step, and each accessor checks the shape of
what it reads.

A check that fails raises :class:`TorchInternalsError` naming the torch version and the interface; one that passes
does not run again in the process. A torch release that is not in ``TESTED_TORCH`` runs, without a warning, as long as
its checks pass (docs/compatibility.md).
"""
import enum
import inspect
import warnings
from typing import Callable, Dict, Optional, Sequence, Set, Tuple

import torch
from torch.amp import grad_scaler as amp_grad_scaler

TESTED_TORCH = ("2.3.1", "2.13.0", "2.14.1")  # the releases CI runs the tests on, oldest to newest


class TorchInternalsError(RuntimeError):
    """a private torch interface this package relies on is missing or changed in the installed torch release"""


_CHECKED: Set[str] = set()  # the interfaces whose check passed in this process


def _check_once(interface: str, check: Callable[[], None]) -> None:
    """run ``check`` (which raises :class:`TorchInternalsError`) unless ``interface`` passed it in this process"""
    if interface not in _CHECKED:
        check()
        _CHECKED.add(interface)


def _changed(what: str, use: str, instead: str = "") -> TorchInternalsError:
    """the error for a private interface that is not as ``use`` (what this package does with it) needs"""
    tested = ", ".join(TESTED_TORCH)
    if torch.__version__.split("+")[0] in TESTED_TORCH:
        advice = "this release passed the check in hivemind_accum's tests, so something in this process changed torch"
    else:
        advice = f"hivemind_accum was tested with torch {tested}, not with this release: install one of those"
    return TorchInternalsError(f"torch {torch.__version__}: {what}. hivemind_accum {use}; {advice}{instead}")


def _check_op(name: str, example: Callable[[Callable], bool], use: str) -> None:
    """``torch.<name>`` exists and ``example(op)``, which runs it on small CPU tensors, gets the expected values"""
    op = getattr(torch, name, None)
    if op is None:
        raise _changed(f"torch.{name} is missing", use)
    try:
        expected = example(op)
    except Exception as e:  # e.g. a changed signature
        raise _changed(f"torch.{name} fails on a small example ({type(e).__name__}: {e})", use) from e
    if not expected:
        raise _changed(f"torch.{name} gives other values than expected on a small example", use)


def _adds(op: Callable) -> bool:
    tensors = [torch.tensor([0.0, 1.0])]
    op(tensors, [torch.tensor([1.0, 2.0])], alpha=2.0)
    return tensors[0].tolist() == [2.0, 5.0]


def _zeroes(op: Callable) -> bool:
    tensors = [torch.tensor([1.0, 2.0])]
    op(tensors)
    return tensors[0].tolist() == [0.0, 0.0]


def _copies(op: Callable) -> bool:
    targets = [torch.zeros(2)]
    op(targets, [torch.tensor([1.0, 2.0])])
    return targets[0].tolist() == [1.0, 2.0]


def _multiplies(op: Callable) -> bool:
    tensors = [torch.tensor([1.0, 2.0])]
    op(tensors, 3.0)
    return tensors[0].tolist() == [3.0, 6.0]


# the fused ops gradient accumulation uses, each with its small example
FUSED_OPS = {
    "_foreach_add_": _adds, "_foreach_zero_": _zeroes, "_foreach_copy_": _copies, "_foreach_mul_": _multiplies,
}


def _check_fused_ops() -> None:
    for name, example in FUSED_OPS.items():
        _check_op(name, example, "accumulates gradients with this fused op")


def check_fused_ops() -> None:
    """
    Check, once per process, that torch's ``_foreach_add_``, ``_foreach_zero_``, ``_foreach_copy_`` and
    ``_foreach_mul_`` exist and compute what this package uses them for, on small CPU tensors. Gradient buckets call
    it when they are built, and every fused op of this module before it runs.

    :raises TorchInternalsError: naming the torch version and the first op that is missing or computes other values
    """
    _check_once("fused ops", _check_fused_ops)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, in one fused ``_foreach_copy_``"""
    check_fused_ops()
    torch._foreach_copy_(targets, sources)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """``tensors[i].mul_(scalar)`` for every i, in one fused ``_foreach_mul_``"""
    check_fused_ops()
    torch._foreach_mul_(tensors, scalar)


_NO_SPARSE_KERNEL: Set[str] = set()  # fused ops this torch release refused a sparse tensor for (learnt at first use)


def foreach_add_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """
    ``tensors[i] += alpha * others[i]`` for every i, in one fused ``_foreach_add_``. Where that op has no kernel for
    sparse tensors (torch 2.3), the dense ``others`` are still added in one fused op and each sparse one by its own
    ``add_``.

    :param tensors: dense tensors, modified in place
    :param others: one tensor per entry of ``tensors``, of its shape; dense or sparse
    :param alpha: scalar weight applied to every entry of ``others``
    :raises TorchInternalsError: see :func:`check_fused_ops`
    """
    check_fused_ops()
    if "add" not in _NO_SPARSE_KERNEL:
        try:
            return torch._foreach_add_(tensors, others, alpha=alpha)
        except NotImplementedError:  # raised by the dispatcher before any tensor is modified
            if not any(other.is_sparse for other in others):
                raise
            _NO_SPARSE_KERNEL.add("add")
    sparse = [k for k, other in enumerate(others) if other.is_sparse]
    if not sparse:
        return torch._foreach_add_(tensors, others, alpha=alpha)
    dense = [k for k, other in enumerate(others) if not other.is_sparse]
    if dense:
        torch._foreach_add_([tensors[k] for k in dense], [others[k] for k in dense], alpha=alpha)
    for k in sparse:
        tensors[k].add_(others[k], alpha=alpha)


def foreach_zero_(tensors: Sequence[torch.Tensor]) -> None:
    """
    ``tensors[i].zero_()`` for every i, in one fused ``_foreach_zero_`` (dense tensors in one fused op and each sparse
    one by its own ``zero_`` where that op has no kernel for sparse tensors, as in torch 2.3).

    :param tensors: dense or sparse tensors, modified in place
    :raises TorchInternalsError: see :func:`check_fused_ops`
    """
    check_fused_ops()
    if "zero" not in _NO_SPARSE_KERNEL:
        try:
            return torch._foreach_zero_(tensors)
        except NotImplementedError:
            if not any(tensor.is_sparse for tensor in tensors):
                raise
            _NO_SPARSE_KERNEL.add("zero")
    dense = [tensor for tensor in tensors if not tensor.is_sparse]
    if dense:
        torch._foreach_zero_(dense)
    for tensor in tensors:
        if tensor.is_sparse:
            tensor.zero_()


def _unscales(op: Callable) -> bool:
    clean, overflow = torch.tensor([2.0, 4.0]), torch.tensor([2.0, float("inf")])
    found_clean, found_overflow, inv_scale = torch.zeros(()), torch.zeros(()), torch.tensor(0.5)
    op([clean], found_clean, inv_scale)
    op([overflow], found_overflow, inv_scale)
    return clean.tolist() == [1.0, 2.0] and found_clean.item() == 0.0 and found_overflow.item() == 1.0


def _check_unscale_op() -> None:
    _check_once(
        "unscale op",
        lambda: _check_op("_amp_foreach_non_finite_check_and_unscale_", _unscales, "unscales gradients with this op"),
    )


def non_finite_check_and_unscale_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor) -> None:
    """
    ``tensors[i] *= inv_scale`` for every i, and ``found_inf`` set to 1.0 if any element is inf or NaN (left as is
    otherwise): the fused kernel ``torch.amp.GradScaler.unscale_`` uses, checked on small CPU tensors at its first
    call in the process.

    :param tensors: float tensors on one device, modified in place
    :param found_inf: a 0-dim float32 tensor on their device
    :param inv_scale: a 0-dim float32 tensor on their device
    :raises TorchInternalsError: if this torch release has no such op or it computes other values
    """
    _check_unscale_op()
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


# elements of the check's example: more than two vector widths plus a tail, so that vectorized and scalar loops both run
# (torch 2.4-2.13's CPU kernel never stores fp16/bf16 results of its vector loop, pytorch/pytorch#191763)
_ADD_EXAMPLE_SIZE = 67


def _adds_unless_found_inf(op: Callable, device: torch.device, dtype: torch.dtype) -> bool:
    def example():
        return torch.zeros(_ADD_EXAMPLE_SIZE, device=device, dtype=dtype)

    kept, skipped, grads = example(), example(), [example().add_(1)]
    for target, found_inf in ((kept, 0.0), (skipped, 1.0)):
        op([target], grads, [], weight_decay=0.0, momentum=0.0, lr=-2.0, dampening=0.0, nesterov=False,
           maximize=False, is_first_step=False, found_inf=torch.tensor(found_inf, device=device))
    # tolist(), not bool(): a copy, which host-read counters (aten::_local_scalar_dense) do not count as a read per step
    n = _ADD_EXAMPLE_SIZE
    return kept.tolist() == [2.0] * n and skipped.tolist() == [0.0] * n and grads[0].tolist() == [1.0] * n


# (device type, dtype) -> whether add_unless_found_inf_ has a correct kernel there
_ADDS_UNLESS_FOUND_INF: Dict[Tuple[str, torch.dtype], bool] = {}


def has_add_unless_found_inf(device: torch.device, dtype: torch.dtype) -> bool:
    """
    Whether :func:`add_unless_found_inf_` runs correctly on ``device``'s type for ``dtype``: checked once per process,
    device type and dtype on small tensors there (torch's fused SGD kernel has CUDA support from torch 2.1 and CPU
    support from torch 2.4; on the CPU, fp16/bf16 lose results before pytorch/pytorch#191763's fix).

    :param device: the device of the tensors to add
    :param dtype: their dtype
    """
    key = (torch.device(device).type, dtype)
    if key not in _ADDS_UNLESS_FOUND_INF:
        op = getattr(torch, "_fused_sgd_", None)
        try:
            works = op is not None and _adds_unless_found_inf(op, torch.device(device), dtype)
        except (RuntimeError, TypeError):  # no kernel for this device (NotImplementedError), a changed signature
            works = False
        _ADDS_UNLESS_FOUND_INF[key] = works
    return _ADDS_UNLESS_FOUND_INF[key]


def add_unless_found_inf_(
    tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], found_inf: torch.Tensor, alpha: float = 1.0
) -> None:
    """
    ``tensors[i] += alpha * others[i]`` for every i unless ``found_inf`` is 1.0, in one fused pass that reads the flag
    on the device: torch's fused SGD kernel with ``lr=-alpha`` and no momentum or weight decay. The kernel pairs
    elements by memory order, so each pair must share shape and strides.

    :param tensors: dense float tensors on one device, modified in place
    :param others: one per tensor, of its dtype, shape and strides; not modified
    :param found_inf: a 0-dim float32 tensor on their device, 0.0 (add) or 1.0 (add nothing)
    :param alpha: scalar weight; on CUDA the kernel multiplies in double, so sums may differ from ``add_``'s in the
      last bit where ``alpha`` is not a power of two
    :raises TorchInternalsError: if :func:`has_add_unless_found_inf` is False for their device and dtype
    """
    if not has_add_unless_found_inf(found_inf.device, tensors[0].dtype):
        raise _changed(f"torch._fused_sgd_ has no working kernel for {found_inf.device.type}",
                       "adds loss-scaled gradients with this op where it has one")
    torch._fused_sgd_(tensors, others, [], weight_decay=0.0, momentum=0.0, lr=-alpha, dampening=0.0, nesterov=False,
                      maximize=False, is_first_step=False, found_inf=found_inf)


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
    return _changed(what, use, instead=", or pass no grad scaler")


def _optimizer_state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Dict:
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
    torch._amp_update_scale_(scale, tracker, found_inf, 1.0, float(scaler._backoff_factor), _NEVER)
    tracker.sub_(1).clamp_(min=0)


def _inv_loss_scale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    scale = _loss_scale(scaler)
    if _optimizer_state(scaler, optimizer)["stage"] is _opt_state_unscaled():
        return torch.ones((), dtype=torch.float32, device=scale.device)
    return scale.double().reciprocal().float()


def _record_found_inf_(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor] = None
) -> None:
    state = _optimizer_state(scaler, optimizer)
    if found_inf is None:
        if state["found_inf_per_device"]:
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=_loss_scale(scaler).device)
    state["found_inf_per_device"] = {found_inf.device: found_inf}


def _check_grad_scaler() -> None:
    _check_once("torch.amp.GradScaler", check_grad_scaler_internals)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """
    The scaler's current loss scale as its own tensor (no host read; ``get_scale()`` reads it on the host).

    :param scaler: an enabled ``torch.amp.GradScaler`` whose ``scale(loss)`` was called
    :raises TorchInternalsError: if torch keeps the scale elsewhere or not as a one-element float tensor, or at the
      first call in the process if :func:`check_grad_scaler_internals` fails
    """
    _check_grad_scaler()
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
    _check_grad_scaler()
    return _inv_loss_scale(scaler, optimizer)


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
    :raises TorchInternalsError: if the scaler's private state changed shape in this torch release, or at the first
      call in the process if :func:`check_grad_scaler_internals` fails
    """
    _check_grad_scaler()
    _record_found_inf_(scaler, optimizer, found_inf)


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
    _check_grad_scaler()
    _back_off_loss_scale_(scaler, found_infs)


def check_grad_scaler_internals() -> None:
    """
    Run the contract this package relies on against a real, enabled ``torch.amp.GradScaler`` on the CPU (a one-element
    model, a few tiny ops): ``loss_scale`` is the scale, ``inv_loss_scale`` is its inverse until ``unscale_`` and 1.0
    after, the scaler hands itself to a step that declares it handles scaling (:func:`declare_scaling_aware_step`),
    ``update()`` backs the scale off after an overflow recorded by :func:`record_found_inf_` and keeps it after a
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
        _record_found_inf_(scaler, optimizer)
        scaler.unscale_(optimizer)
        if _inv_loss_scale(scaler, optimizer).item() != 1.0:
            raise _scaler_changed(
                "after torch.amp.GradScaler.unscale_(optimizer) the optimizer's stage is not OptState.UNSCALED"
            )
        _record_found_inf_(scaler, optimizer, torch.tensor(float(overflow)))
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


# the private torch.amp.GradScaler methods hivemind.GradScaler calls: name -> (positional, keyword arguments it passes)
HIVEMIND_GRAD_SCALER_CALLS = {
    "_unscale_grads_": (("optimizer", "inv_scale", "found_inf"), ("allow_fp16",)),
    "_check_inf_per_device": (("optimizer",), ()),
    "_found_inf_per_device": (("optimizer",), ()),
}


def _check_hivemind_grad_scaler() -> None:
    use = "loss-scales in place (reuse_grad_buffers=True) with hivemind.GradScaler, which calls it"
    for name, (positional, keywords) in HIVEMIND_GRAD_SCALER_CALLS.items():
        method = getattr(torch.amp.GradScaler, name, None)
        if not callable(method):
            raise _changed(f"torch.amp.GradScaler.{name} is missing", use)
        try:
            inspect.signature(method).bind(None, *positional, **dict.fromkeys(keywords))
        except TypeError:
            call = ", ".join([*positional, *(f"{keyword}=..." for keyword in keywords)])
            raise _changed(f"torch.amp.GradScaler.{name}{inspect.signature(method)} does not take ({call})", use)
    states = getattr(torch.amp.GradScaler("cpu"), "_per_optimizer_states", None)
    if not hasattr(states, "__getitem__") or not isinstance(states[0], dict) or "stage" not in states[0]:
        raise _changed("torch.amp.GradScaler._per_optimizer_states holds no 'stage' per optimizer", use)


def check_hivemind_grad_scaler_internals() -> None:
    """
    Check, once per process, that ``torch.amp.GradScaler`` has the private methods ``hivemind.GradScaler`` calls
    (``_unscale_grads_``, ``_check_inf_per_device``, ``_found_inf_per_device``, with the parameters it passes) and a
    per-optimizer record with a stage. The in-place mode runs it at its first step with a ``hivemind.GradScaler``.

    :raises TorchInternalsError: naming the torch version and the first of them that is missing or changed
    """
    _check_once("hivemind.GradScaler", _check_hivemind_grad_scaler)


def check_torch_internals() -> None:
    """
    Run now every check this module otherwise runs at first use (each once per process): for a script that wants to
    fail at start-up, or a measurement that should not count the checks' own operations.

    :raises TorchInternalsError: naming the torch version and the first interface that is missing or changed
    """
    check_fused_ops()
    _check_unscale_op()
    _check_grad_scaler()
    check_hivemind_grad_scaler_internals()
