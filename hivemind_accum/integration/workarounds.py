"""
Workarounds for hivemind 1.1.12's defects, one per function, each tagged ``hivemind 1.1.12:`` with the defect and
``Remove when:`` with what removes it. The integration classes call them; nothing else here.
"""
import inspect
from typing import List, Optional, Tuple

import torch
from hivemind.averaging.control import StepControl
from hivemind.utils import get_logger

logger = get_logger(__name__)


# hivemind 1.1.12: Optimizer.__init__ computes `client_mode if client_mode is None else dht.client_mode`, the inverse
# of what it documents: a peer whose DHT is in client mode fails at its first epoch, and an explicit client_mode is
# replaced by the DHT's. Remove when (pull request 02-optimizer-client-mode): hivemind's Optimizer computes
# `dht.client_mode if client_mode is None else client_mode` (Optimizer.__init__ and _make_progress_tracker then pass
# client_mode through unchanged).
def client_mode_or_dht(client_mode: Optional[bool], dht) -> bool:
    """``client_mode``, or the DHT's mode where it is None, as hivemind documents"""
    return dht.client_mode if client_mode is None else client_mode


# hivemind 1.1.12: StepControl.cancel() signals the averager's process before it marks the round cancelled, so that
# process may read cancelled() as False and run the all-reduce of a round this peer abandoned. Remove when (pull
# request 05-step-control-cancel-order): hivemind's StepControl.cancel marks the round cancelled first
# (_cancel_signals_first() then finds it and this workaround is already skipped).
def _cancel_signals_first() -> bool:
    """whether hivemind's StepControl.cancel signals the averager's process before it marks the round cancelled (as
    1.1.12's does); True where its source cannot be read (an install without .py files): the subclass is then used,
    and is correct either way"""
    try:
        return inspect.getsource(StepControl.cancel).rstrip().endswith("return super().cancel()")
    except (OSError, TypeError):
        return True


CANCEL_SIGNALS_FIRST = _cancel_signals_first()


class StateFirstStepControl(StepControl):
    """``StepControl`` whose ``cancel()`` marks the round cancelled before it signals the averager's process:
    hivemind's signals first, so that process may read ``cancelled()`` as False, take the cancelled trigger for a
    trigger and run the all-reduce of a round this peer abandoned"""

    def cancel(self) -> bool:
        cancelled = super(StepControl, self).cancel()
        if self._trigger is not None:
            self._trigger.cancel()
        if self._cancel is not None:
            self._cancel.set_result(None)
        return cancelled


def state_first_control(control: StepControl) -> StepControl:
    """``control`` (just scheduled), made a :class:`StateFirstStepControl` where hivemind's cancel signals first"""
    if CANCEL_SIGNALS_FIRST:
        control.__class__ = StateFirstStepControl  # a subclass: no reference cycle, freed as hivemind's is
    return control


# hivemind 1.1.12: a gradient averaging round that was not pre-scheduled gets no deadline, so a round the optimizer
# stopped waiting for goes on looking for a group. Remove when (pull request 08-gradient-round-deadline): hivemind's
# Optimizer schedules such a round with `schedule_step(timeout=averaging_timeout)` itself.
def schedule_with_deadline(grad_averager, timeout: Optional[float]) -> Optional[StepControl]:
    """a gradient averaging round's control, scheduled as ``GradientAverager.step`` would schedule it but with a
    deadline ``timeout`` away, as a pre-scheduled round has; None (and an error logged) if it cannot be"""
    try:
        return grad_averager.schedule_step(timeout=timeout)
    except Exception as e:
        logger.exception(e)
        return None


# hivemind 1.1.12: Optimizer._load_averaged_gradients_into_optimizer_ assigns a clone of the CPU averaged buffer to a
# parameter without .grad, which cannot be the .grad of a CUDA parameter, nor of an fp16/bf16 one with
# averaged_grads_dtype=torch.float32. Remove when: hivemind copies the averaged gradient into a .grad it creates in
# the parameter's dtype and device.
def create_missing_grads(param_groups) -> None:
    """a zero ``.grad`` in its parameter's dtype and device for every parameter without one"""
    for group in param_groups:
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)


# hivemind 1.1.12: an offloaded optimizer binds each parameter's .grad to its averaged buffer, and fails in its
# constructor where their dtypes differ (fp16/bf16 averaged buffers, float32 optimizer parameters). Remove when:
# hivemind gives such parameters a .grad of their own and fills it once per round.
@torch.no_grad()
def bind_offloaded_grads(param_groups, averaged_grads) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """each optimizer parameter's ``.grad`` is its averaged buffer where the dtypes match, or, where they differ, a
    float32 tensor of its own; returns (those tensors, their averaged buffers), to be copied once per round"""
    params = [param for group in param_groups for param in group["params"]]
    copies = ([], [])  # (the optimizer's .grad, the averaged buffers)
    assert len(averaged_grads) == len(params)
    for param, averaged in zip(params, averaged_grads):
        if param.dtype == averaged.dtype:
            param.grad = averaged
        else:
            param.grad = torch.zeros_like(param)
            copies[0].append(param.grad)
            copies[1].append(averaged)
    return copies
