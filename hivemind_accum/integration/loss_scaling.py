"""
Loss scaling in :class:`hivemind.Optimizer`'s step, without a host read per micro-step: the two grad-scaler protocols.

- ``torch.amp.GradScaler`` and ``hivemind.GradScaler`` in exact mode: each micro-step is unscaled and checked as it
  is accumulated (:meth:`hivemind_accum.GradientAverager.accumulate_grads_` with ``inv_grad_scale``), one that
  overflows is dropped whole, and the scaler's overflow record is set on the device
  (:mod:`hivemind_accum.torch_compat.grad_scaler`);
- ``hivemind.GradScaler`` in place: the accumulated gradients are unscaled and checked once per round.

:class:`LossScaledSteps` is a mixin of :class:`hivemind_accum.Optimizer`, placed before upstream's class.
"""
from typing import Callable, Optional

import torch
from hivemind.optim import optimizer as upstream
from hivemind.optim.grad_scaler import GradScaler as HivemindGradScaler
from hivemind.utils import get_logger

from hivemind_accum.torch_compat import (
    back_off_loss_scale_,
    check_hivemind_grad_scaler_internals,
    declare_scaling_aware_step,
    inv_loss_scale,
    optimizer_state,
    record_found_inf,
)

logger = get_logger(__name__)


class LossScaledSteps(upstream.Optimizer):
    """:class:`hivemind.Optimizer`'s step with this package's loss scaling (see :meth:`step`)"""

    def _init_loss_scaling(self) -> None:
        """called at the end of ``__init__``"""
        self._micro_step_scaler = None
        self._own_found_inf_record = []  # the overflow tensors step() last recorded in the grad scaler
        if self.use_gradient_averaging and not self.auxiliary:
            # torch.amp.GradScaler.step then hands itself to step() instead of unscaling and reading the overflow
            # flag on the host before every micro-step in the exact mode as in the in-place one
            declare_scaling_aware_step(self)

    def step(
        self,
        closure: Optional[Callable[[], torch.Tensor]] = None,
        batch_size: Optional[int] = None,
        grad_scaler: Optional[torch.amp.GradScaler] = None,
    ):
        """
        Update training progress after accumulating another local batch size. Depending on the configuration, this
        will report progress to peers, run global or local optimizer step, average parameters or schedule background
        tasks. Loss scaling never synchronizes with an accelerator in the no-sync step (docs/guide.md):

        - exact mode, ``torch.amp.GradScaler`` or ``hivemind.GradScaler``: each micro-step is unscaled and checked as it
          is accumulated; one that overflows is dropped whole, its samples leave this peer's progress, and the scale
          backs off on the device: in ``update()`` (``torch.amp.GradScaler``) or in this step (``hivemind.GradScaler``,
          whose ``update()`` reads every overflow record on the host; it grows only after a global step, as in place);
        - in-place mode, ``hivemind.GradScaler``: the accumulated gradients are unscaled and checked once per round;
          an overflow drops the round's local gradients (weight 0, no optimizer step), as native accumulation does.

        :param closure: A closure that reevaluates the model and returns the loss
        :param batch_size: optional override for batch_size_per_step from init
        :param grad_scaler: ``torch.amp.GradScaler`` or ``hivemind.GradScaler`` with ``reuse_grad_buffers=False``,
          ``hivemind.GradScaler`` with ``reuse_grad_buffers=True``; a disabled scaler counts as none
        :raises ValueError: for any other grad scaler: a ``torch.amp.GradScaler`` in in-place mode (its ``unscale_``
          would unscale the accumulated gradients again every micro-step), or one that is no ``torch.amp.GradScaler``;
          and in exact mode if the loop called ``hivemind.GradScaler.unscale_(opt)`` (it leaves the gradients scaled
          between global steps, so whatever read or clipped them saw scaled values)
        :raises TorchInternalsError: at the first step with a grad scaler, if a private torch interface that loss
          scaling relies on changed in this torch release (the message names it; docs/compatibility.md)
        """
        if grad_scaler is not None and not grad_scaler.is_enabled():
            grad_scaler = None
        if grad_scaler is None or not self.use_gradient_averaging or self.auxiliary:
            return super().step(closure, batch_size, grad_scaler)
        if self.grad_averager.reuse_grad_buffers:
            if not isinstance(grad_scaler, HivemindGradScaler):
                raise ValueError(
                    f"grad_scaler: reuse_grad_buffers=True needs hivemind.GradScaler "
                    f"(got {_qualified_name(grad_scaler)}): "
                    f"a plain scaler's unscale_ would unscale the accumulated gradients again on every micro-step; "
                    f"or use reuse_grad_buffers=False, which accepts torch.amp.GradScaler"
                )
            check_hivemind_grad_scaler_internals()  # before the scaler unscales or checks anything
            return super().step(closure, batch_size, grad_scaler)
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            raise ValueError(
                f"grad_scaler: reuse_grad_buffers=False needs torch.amp.GradScaler or hivemind.GradScaler "
                f"(got {_qualified_name(grad_scaler)})"
            )
        if isinstance(grad_scaler, HivemindGradScaler):
            self._begin_hivemind_scaler_micro_step(grad_scaler)
        record_found_inf(grad_scaler, self)  # update() needs a record even if this micro-step is discarded
        self._micro_step_scaler = grad_scaler
        try:
            # the accumulators hold unscaled, finite gradients: the global step runs as without loss scaling
            return super().step(closure, batch_size, grad_scaler=None)
        finally:
            self._micro_step_scaler = None
            if isinstance(grad_scaler, HivemindGradScaler):
                self._end_hivemind_scaler_micro_step(grad_scaler)

    def _begin_hivemind_scaler_micro_step(self, scaler: HivemindGradScaler) -> None:
        """exact mode, ``hivemind.GradScaler``: refuse a loop that called its ``unscale_`` (which, between global steps,
        only checks for inf/NaN and leaves the gradients scaled); have its ``update()`` reset this optimizer's overflow
        record after the micro-step, as after a step of its own"""
        found_infs = optimizer_state(scaler, self)["found_inf_per_device"].values()
        if any(all(found_inf is not own for own in self._own_found_inf_record) for found_inf in found_infs):
            raise ValueError(
                "grad_scaler: hivemind.GradScaler.unscale_(opt) was called before this step, but between global steps "
                "it leaves the gradients multiplied by the loss scale, so whatever read or clipped them saw scaled "
                "values. With reuse_grad_buffers=False use torch.amp.GradScaler, whose unscale_ unscales, or do not "
                "call unscale_: this step unscales the gradients as it accumulates them"
            )
        with scaler._lock:
            scaler._optimizer_states_to_reset.add(id(self))

    def _end_hivemind_scaler_micro_step(self, scaler: HivemindGradScaler) -> None:
        """exact mode, ``hivemind.GradScaler``: after a step without a global step, back the scale off on the device if
        the micro-step overflowed and leave no overflow record, so that its ``update()``, which reads every record on
        the host, reads none; after a global step the record stays for ``update()``, which may grow the scale"""
        state = optimizer_state(scaler, self)
        with scaler._lock:
            if not scaler._is_ready_to_update:
                back_off_loss_scale_(scaler, list(state["found_inf_per_device"].values()))
                state["found_inf_per_device"] = {}
        self._own_found_inf_record = list(state["found_inf_per_device"].values())  # see _begin_hivemind_scaler_...

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler: Optional[HivemindGradScaler]) -> bool:
        """accumulate this micro-step's gradients without reading anything on the host on an accelerator (on the CPU:
        one read, see :meth:`step`)"""
        scaler = self._micro_step_scaler
        if scaler is not None:  # exact mode: unscale, check and maybe drop (on an accelerator, on the device)
            # 1 / scale, or 1.0 if the loop called torch.amp.GradScaler.unscale_(opt)
            found_inf = self.grad_averager.accumulate_grads_(batch_size, inv_grad_scale=inv_loss_scale(scaler, self))
            record_found_inf(scaler, self, found_inf)
        else:  # in-place mode with a grad scaler: checked once per round, in _begin_averaging_gradients
            self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        return True

    def _update_global_epoch(self, grad_scaler: Optional[HivemindGradScaler]) -> None:
        """exact mode with a grad scaler: before the epoch ends, subtract the micro-steps dropped for overflow from the
        reported progress (one host read per epoch); if the swarm is then short of its target, the epoch goes on"""
        if self._micro_step_scaler is not None and self.grad_averager._dropped.may_have_dropped:
            self.grad_averager._settle_dropped_micro_steps()
            self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
            if not self.tracker.ready_to_update_epoch:
                return
        super()._update_global_epoch(grad_scaler)
        if isinstance(self._micro_step_scaler, HivemindGradScaler):
            with self._micro_step_scaler._lock:  # its update() grows the scale only after a global step
                self._micro_step_scaler._is_ready_to_update = True

    def _begin_averaging_gradients(self, grad_scaler: Optional[HivemindGradScaler]) -> bool:
        """in-place mode with a grad scaler: unscale the accumulated gradients and, if they overflowed, drop them
        before they reach peers (one host sync per round); then as without a grad scaler"""
        if grad_scaler is not None:
            with grad_scaler.running_global_step():
                if not grad_scaler.unscale_(self):  # not an assert: python -O would skip the unscale itself
                    raise RuntimeError("hivemind.GradScaler did not unscale the accumulated gradients at a global step")
            if not grad_scaler.are_grads_finite(self, use_cached=True):
                logger.warning(
                    "Accumulated gradients overflowed (inf/NaN): dropping this round's local gradients, this peer "
                    "averages with weight 0 and skips the optimizer step; the loss scale will back off"
                )
                self.grad_averager.reset_accumulated_grads_()
        return super()._begin_averaging_gradients(None)


def _qualified_name(obj) -> str:
    """``obj``'s class with its module, e.g. ``hivemind.optim.grad_scaler.GradScaler``"""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
