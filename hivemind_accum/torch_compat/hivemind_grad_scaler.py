"""
``hivemind.GradScaler``'s contract with ``torch.amp.GradScaler`` and the private state of its own this package uses.

``hivemind.GradScaler`` (1.1.12) calls private methods of ``torch.amp.GradScaler``, checked here once per process.
In exact mode this package drives its micro-steps through its private ``_lock``, ``_optimizer_states_to_reset`` and
``_is_ready_to_update``: the three functions below are the only code that touches them. They are not checked at run
time: this package requires hivemind 1.1.12 exactly, and ``tests/test_mixed_precision.py`` runs them against it.
"""
import inspect
from typing import List, Sequence

import torch

from hivemind_accum.torch_compat.checks import changed, check_once
from hivemind_accum.torch_compat.grad_scaler import back_off_loss_scale_, optimizer_state


def begin_exact_micro_step(scaler, optimizer: torch.optim.Optimizer, own_record: Sequence[torch.Tensor]) -> None:
    """
    Before an exact-mode micro-step with ``hivemind.GradScaler``: have its ``update()`` reset ``optimizer``'s overflow
    record after the micro-step, as after a step of its own.

    :param own_record: the overflow tensors :func:`end_exact_micro_step` last returned for ``optimizer``
    :raises ValueError: if the loop called ``scaler.unscale_(optimizer)`` (between global steps it only checks for
      inf/NaN and leaves the gradients scaled): its record is not ``own_record``
    """
    found_infs = optimizer_state(scaler, optimizer)["found_inf_per_device"].values()
    if any(all(found_inf is not own for own in own_record) for found_inf in found_infs):
        raise ValueError(
            "grad_scaler: hivemind.GradScaler.unscale_(opt) was called before this step, but between global steps "
            "it leaves the gradients multiplied by the loss scale, so whatever read or clipped them saw scaled "
            "values. With reuse_grad_buffers=False use torch.amp.GradScaler, whose unscale_ unscales, or do not "
            "call unscale_: this step unscales the gradients as it accumulates them"
        )
    with scaler._lock:
        scaler._optimizer_states_to_reset.add(id(optimizer))


def end_exact_micro_step(scaler, optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """
    After an exact-mode micro-step with ``hivemind.GradScaler``. Without a global step: back the scale off on the
    device if the micro-step overflowed and leave no overflow record, so that its ``update()``, which reads every
    record on the host, reads none. After a global step the record stays for ``update()``, which may grow the scale.

    :returns: the overflow record left for ``optimizer`` (``own_record`` of the next :func:`begin_exact_micro_step`)
    """
    state = optimizer_state(scaler, optimizer)
    with scaler._lock:
        if not scaler._is_ready_to_update:
            back_off_loss_scale_(scaler, list(state["found_inf_per_device"].values()))
            state["found_inf_per_device"] = {}
    return list(state["found_inf_per_device"].values())


def allow_scale_growth(scaler) -> None:
    """after a global step: ``hivemind.GradScaler.update()`` grows the scale only then"""
    with scaler._lock:
        scaler._is_ready_to_update = True


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
            raise changed(f"torch.amp.GradScaler.{name} is missing", use)
        try:
            inspect.signature(method).bind(None, *positional, **dict.fromkeys(keywords))
        except TypeError:
            call = ", ".join([*positional, *(f"{keyword}=..." for keyword in keywords)])
            raise changed(f"torch.amp.GradScaler.{name}{inspect.signature(method)} does not take ({call})", use)
    states = getattr(torch.amp.GradScaler("cpu"), "_per_optimizer_states", None)
    if not hasattr(states, "__getitem__") or not isinstance(states[0], dict) or "stage" not in states[0]:
        raise changed("torch.amp.GradScaler._per_optimizer_states holds no 'stage' per optimizer", use)


def check_hivemind_grad_scaler_internals() -> None:
    """
    Check, once per process, that ``torch.amp.GradScaler`` has the private methods ``hivemind.GradScaler`` calls
    (``_unscale_grads_``, ``_check_inf_per_device``, ``_found_inf_per_device``, with the parameters it passes) and a
    per-optimizer record with a stage. The in-place mode runs it at its first step with a ``hivemind.GradScaler``.

    :raises TorchInternalsError: naming the torch version and the first of them that is missing or changed
    """
    check_once("hivemind.GradScaler", _check_hivemind_grad_scaler)

