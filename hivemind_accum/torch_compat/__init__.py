"""
The private torch interfaces this package relies on, in one place, each checked once per process at its first use.

- :mod:`~hivemind_accum.torch_compat.checks`: how a check runs once and what it raises (:class:`TorchInternalsError`,
  naming the torch version and the interface); ``TESTED_TORCH``;
- :mod:`~hivemind_accum.torch_compat.fused_ops`: the fused ``_foreach`` ops, the unscale kernel and the fused add that
  skips itself on overflow, each with its check;
- :mod:`~hivemind_accum.torch_compat.grad_scaler`: ``torch.amp.GradScaler``'s private state and the contract this
  package relies on;
- :mod:`~hivemind_accum.torch_compat.hivemind_grad_scaler`: ``hivemind.GradScaler``'s contract with it, and the
  private state of ``hivemind.GradScaler`` that exact mode's micro-steps use.

A check that passes does not run again in the process. A torch release that is not in ``TESTED_TORCH`` runs, without
a warning, as long as its checks pass (docs/compatibility.md).
"""
from hivemind_accum.torch_compat.checks import TESTED_TORCH, TorchInternalsError
from hivemind_accum.torch_compat.fused_ops import (
    add_unless_found_inf_,
    check_fused_ops,
    check_unscale_op,
    foreach_add_,
    foreach_copy_,
    foreach_mul_,
    foreach_zero_,
    has_add_unless_found_inf,
    non_finite_check_and_unscale_,
)
from hivemind_accum.torch_compat.grad_scaler import (
    back_off_loss_scale_,
    check_grad_scaler_internals,
    check_grad_scaler_once,
    declare_scaling_aware_step,
    inv_loss_scale,
    loss_scale,
    optimizer_state,
    record_found_inf,
)
from hivemind_accum.torch_compat.hivemind_grad_scaler import (
    allow_scale_growth,
    begin_exact_micro_step,
    check_hivemind_grad_scaler_internals,
    end_exact_micro_step,
)


def check_torch_internals() -> None:
    """
    Run now every check this package otherwise runs at first use (each once per process): for a script that wants to
    fail at start-up, or a measurement that should not count the checks' own operations.

    :raises TorchInternalsError: naming the torch version and the first interface that is missing or changed
    """
    check_fused_ops()
    check_unscale_op()
    check_grad_scaler_once()
    check_hivemind_grad_scaler_internals()


__all__ = [
    "TESTED_TORCH", "TorchInternalsError", "add_unless_found_inf_", "allow_scale_growth", "back_off_loss_scale_",
    "begin_exact_micro_step", "check_fused_ops", "end_exact_micro_step",
    "check_grad_scaler_internals", "check_hivemind_grad_scaler_internals", "check_torch_internals",
    "check_unscale_op", "declare_scaling_aware_step", "foreach_add_", "foreach_copy_", "foreach_mul_", "foreach_zero_",
    "has_add_unless_found_inf", "inv_loss_scale", "loss_scale", "non_finite_check_and_unscale_", "optimizer_state",
    "record_found_inf", "check_grad_scaler_once",
]
