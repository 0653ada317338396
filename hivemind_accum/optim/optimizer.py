"""
:class:`hivemind.Optimizer` that builds this package's gradient averager by default and handles loss scaling without
a host-device synchronization per micro-step.
"""
import contextlib
import inspect
import threading
from typing import Callable, ContextManager, List, Optional, Tuple

import torch
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.optim import optimizer as upstream
from hivemind.optim.grad_averager import GradientAveragerFactory
from hivemind.optim.grad_scaler import GradScaler as HivemindGradScaler
from hivemind.optim.state_averager import ZERO_GRAD_SET_TO_NONE_DEFAULT
from hivemind.utils import get_logger

from hivemind_accum.optim.grad_averager import GradientAverager, is_positive_int
from hivemind_accum.optim.grad_buckets import LOW_PRECISION, check_distinct
from hivemind_accum.optim.progress_tracker import ProgressTracker
from hivemind_accum.optim.round_guard import SkipUnusableSteps, StepDecisions, all_finite
from hivemind_accum.optim.state_averager import TrainingStateAverager
from hivemind_accum.optim.torch_internals import (
    _optimizer_state,
    back_off_loss_scale_,
    check_hivemind_grad_scaler_internals,
    declare_scaling_aware_step,
    foreach_copy_,
    foreach_zero_,
    inv_loss_scale,
    record_found_inf_,
)

logger = get_logger(__name__)


class Optimizer(upstream.Optimizer):
    """
    A subclass of :class:`hivemind.Optimizer` accepting every upstream argument unchanged. Differences:

    - without ``grad_averager_factory``, gradients accumulate in :class:`hivemind_accum.GradientAverager` instead of
      upstream's averager (pass ``grad_averager_factory=partial(hivemind_accum.PowerSGDGradientAverager,
      averager_rank=r)`` for PowerSGD);
    - ``zero_grad`` is allowed with ``reuse_grad_buffers=True`` (see :meth:`zero_grad`);
    - loss scaling (``scaler.step(opt)`` or ``opt.step(grad_scaler=scaler)``) costs no host-device synchronization
      in the no-sync step and drops only an overflowing micro-step in the exact mode (see :meth:`step`);
    - ``client_mode`` defaults to the DHT's mode, as upstream documents (upstream 1.1.12 inverts that fallback: a peer
      whose DHT is in client mode fails at its first epoch, and a ``client_mode`` given explicitly is replaced by the
      DHT's);
    - bad arguments get a ``TypeError`` or ``ValueError`` before anything starts (see :meth:`__init__`);
    - a peer never steps with, nor sends to peers, gradients or parameters that hold inf or NaN (see
      :meth:`_load_averaged_gradients_into_optimizer_` and :class:`hivemind_accum.optim.state_averager.
      TrainingStateAverager`, the state averager it builds).

    See :class:`hivemind.Optimizer` for all parameters.
    """

    def __new__(cls, *args, **kwargs):
        """refuses positional arguments with a message naming the required ones (Python's own error for a
        keyword-only constructor would say that the required keyword arguments are missing)"""
        if args:
            signature = inspect.signature(upstream.Optimizer.__init__)
            required = [name for name, p in signature.parameters.items() if p.default is p.empty][1:]  # not self
            raise TypeError(
                f"{cls.__name__} takes keyword arguments only, as hivemind.Optimizer does (got {len(args)} "
                f"positional): pass each argument by name; {', '.join(f'{name}=' for name in required)} are "
                f"required, e.g. {cls.__name__}(dht=dht, run_id=..., target_batch_size=..., batch_size_per_step=..., "
                f"params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params))"
            )
        return super().__new__(cls)

    def __init__(
        self,
        *,
        dht: DHT,
        optimizer,
        params=None,
        batch_size_per_step: Optional[int] = None,
        client_mode: Optional[bool] = None,
        auxiliary: bool = False,
        **kwargs,
    ):
        """
        Keyword arguments only, as the class documents them (``help`` and ``inspect.signature`` list them);
        ``client_mode=None`` means the DHT's mode. Checked before any process or thread starts:

        :raises TypeError: for positional arguments
        :raises ValueError: if ``batch_size_per_step`` is not a positive int or None, if ``client_mode`` and
          ``auxiliary`` are both true, or if a parameter is listed twice in ``params`` (or, without ``params``, in the
          optimizer's ``param_groups``): the message names both positions
        """
        if batch_size_per_step is not None and not is_positive_int(batch_size_per_step):
            raise ValueError(
                f"batch_size_per_step: expected a positive int (samples per micro-step) or None (then pass "
                f"batch_size= to every step()), got {batch_size_per_step!r}"
            )
        client_mode = dht.client_mode if client_mode is None else client_mode
        if client_mode and auxiliary:
            raise ValueError("client_mode, auxiliary: a client-mode peer cannot serve as an auxiliary peer")
        if params is not None:
            params, named = _params_as_lists(params)
        else:
            named = _named_params(getattr(optimizer, "param_groups", ()), "optimizer.param_groups")
        check_distinct(named)
        # upstream 1.1.12 computes `client_mode if client_mode is None else dht.client_mode`: kept here and restored in
        # _make_progress_tracker, the first thing upstream's __init__ builds from self.client_mode
        self._client_mode = client_mode
        super().__init__(
            dht=dht, optimizer=optimizer, params=params, batch_size_per_step=batch_size_per_step,
            client_mode=client_mode, auxiliary=auxiliary, **kwargs,
        )
        self._micro_step_scaler = None
        self._step_decisions = StepDecisions()  # each round's decision for its optimizer step: _round_usable
        self._host_copy_step = threading.local()  # see _step_with_host_copy
        self._own_found_inf_record = []  # the overflow tensors step() last recorded in the grad scaler
        if self.use_gradient_averaging and self._guards_gradients():
            # a round whose gradients are not usable (inf/NaN, see _load_averaged_gradients_into_optimizer_) makes the
            # optimizer step, run by the state averager (maybe in its thread), a no-op
            self._skip_unusable_steps = SkipUnusableSteps(
                self.state_averager.optimizer, usable=self._round_usable, on_skip=self._on_skipped_step,
            )
            # a job of the state averager steps with the decision of the round loaded before it was submitted, or of
            # the round it loads itself (delayed averaging), however late it runs
            self.state_averager.step_executor = self._step_decisions.carried_by(self.state_averager.step_executor)
            self.state_averager.optimizer.register_step_pre_hook(self._swap_in_host_copy)  # after the skip's hooks
            self.state_averager.optimizer.register_step_post_hook(self._swap_out_host_copy)
        if self.use_gradient_averaging and not self.auxiliary:
            # torch.amp.GradScaler.step then hands itself to step() instead of unscaling and reading the overflow
            # flag on the host before every micro-step in the exact mode as in the in-place one
            declare_scaling_aware_step(self)

    # help() and inspect.signature list upstream's arguments (inspect reads a class's own __new__ first)
    __new__.__signature__ = __init__.__signature__ = inspect.signature(upstream.Optimizer.__init__)

    def __del__(self):
        if hasattr(self, "state_averager"):  # a constructor that raised early has nothing to shut down
            super().__del__()

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        """upstream's construction (the same arguments) of this package's :class:`ProgressTracker`, whose
        per-micro-step report builds no pydantic model"""
        self.client_mode = self._client_mode  # see __init__
        return ProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

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
        record_found_inf_(grad_scaler, self)  # update() needs a record even if this micro-step is discarded
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
        found_infs = _optimizer_state(scaler, self)["found_inf_per_device"].values()
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
        state = _optimizer_state(scaler, self)
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
            record_found_inf_(scaler, self, found_inf)
        else:  # in-place mode with a grad scaler: checked once per round, in _begin_averaging_gradients
            self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        return True

    def _update_global_epoch(self, grad_scaler: Optional[HivemindGradScaler]) -> None:
        """exact mode with a grad scaler: before the epoch ends, subtract the micro-steps dropped for overflow from the
        reported progress (one host read per epoch); if the swarm is then short of its target, the epoch goes on"""
        if self._micro_step_scaler is not None and self.grad_averager._may_have_dropped:
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
        before they reach peers (one host sync per round); then as upstream"""
        if grad_scaler is not None:
            with grad_scaler.running_global_step():
                assert grad_scaler.unscale_(self)
            if not grad_scaler.are_grads_finite(self, use_cached=True):
                logger.warning(
                    "Accumulated gradients overflowed (inf/NaN): dropping this round's local gradients, this peer "
                    "averages with weight 0 and skips the optimizer step; the loss scale will back off"
                )
                self.grad_averager.reset_accumulated_grads_()
        if self.scheduled_grads is None and self.tracker.global_progress.num_peers > 1:
            self.scheduled_grads = self._schedule_round()  # the round's local gradients are kept under its control
        return super()._begin_averaging_gradients(None)

    def _load_averaged_gradients_into_optimizer_(self):
        """
        Called with a round's averaged gradients in the averager's buffers. With a :class:`GradientAverager` (see
        :meth:`_guards_gradients`) they are checked first (one read-only reduction per bucket) and used only if
        finite; otherwise the round counts as failed: the optimizer steps with this peer's own gradients of the round
        (kept since the round began, as for any failed round), or, if the averager keeps none (PowerSGD), skips its
        step. If this peer's own
        gradients of the round held inf or NaN (they were sent as zeros with weight 0, see
        :meth:`GradientAverager.load_accumulators_into_averager_`), it skips its step whatever the result.
        """
        if not self._guards_gradients():
            return self._load_gradients_into_optimizer_()
        usable = self._round_own_finite()
        if usable:
            with self.grad_averager.get_tensors() as averaged_grads:
                finite = all_finite(self.grad_averager.flat_averaged_grads(averaged_grads))
            if not finite and self.grad_averager.keep_local_fallback:
                logger.warning(
                    f"The averaged gradients of epoch {self.local_epoch}'s round hold inf or NaN: falling back to "
                    f"this peer's own gradients of that round"
                )
                return self._load_local_gradients_into_optimizer()
            if not finite:
                logger.warning(
                    f"The averaged gradients of epoch {self.local_epoch}'s round hold inf or NaN and this averager "
                    f"keeps no local gradients to fall back to: this peer skips its optimizer step"
                )
                usable = False
        self._step_decisions.decide(usable)
        if not usable:
            self.grad_averager.discard_nonfinite_round_()  # PowerSGD: its residuals may hold the round's inf/NaN
            return self.grad_averager.notify_used_averaged_gradients()  # the optimizer step will be skipped
        self._load_gradients_into_optimizer_()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Optional[StepControl]):
        """Run gradient averaging; on success, feed averaged gradients into optimizer; else, use local gradients of
        the round ``maybe_step_control`` began, even after later rounds began"""
        with self._bound_to_round(maybe_step_control):
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def _schedule_round(self) -> Optional[StepControl]:
        """a gradient averaging round's control, scheduled as ``GradientAverager.step`` would schedule it but with a
        deadline ``averaging_timeout`` away, as a pre-scheduled round has (without one, a round the optimizer stopped
        waiting for would go on looking for a group); None (and an error logged) if it cannot be"""
        try:
            return self.grad_averager.schedule_step(timeout=self.averaging_timeout)
        except Exception as e:
            logger.exception(e)
            return None

    def _bound_to_round(self, control: Optional[StepControl]) -> ContextManager:
        """a context within which this thread's fallback and settling concern the round ``control`` began"""
        if control is None or not getattr(self.grad_averager, "keep_local_fallback", False):
            return contextlib.nullcontext()
        return self.grad_averager.local_fallback.for_round(control)

    def _load_local_gradients_into_optimizer(self):
        """Fall back to this peer's own gradients of the round: load them into the averager's buffers (averaged over
        micro-steps, and on the host where the optimizer is offloaded), then into the optimizer. A
        :class:`GradientAverager` checked them as it loaded them: if they held inf or NaN, or if they are kept no
        longer (two later rounds began), the optimizer step is skipped (see
        :class:`~hivemind_accum.optim.round_guard.SkipUnusableSteps`)"""
        logger.log(self.status_loglevel, "Proceeding with local gradients")
        if self._step_with_host_copy():
            self._step_decisions.decide(self._round_own_finite())
            self.grad_averager.notify_used_averaged_gradients()
        elif self.grad_averager.load_accumulators_into_averager_() is False:
            self._step_decisions.decide(False)
            self.grad_averager.notify_used_averaged_gradients()
        elif self._guards_gradients() and not self._round_own_finite():
            self._step_decisions.decide(False)
            self.grad_averager.notify_used_averaged_gradients()  # the optimizer step will be skipped
        else:
            self._step_decisions.decide(True)
            self._load_gradients_into_optimizer_()  # checked already

    def _load_gradients_into_optimizer_(self):
        """upstream's ``_load_averaged_gradients_into_optimizer_``, after creating any missing ``.grad`` in the
        parameter's dtype and device (not offloaded), so that upstream copies the averaged gradient into it (upstream
        would assign a clone of the CPU buffer, which cannot be the ``.grad`` of a CUDA parameter, nor of an fp16/bf16
        one with ``averaged_grads_dtype=torch.float32``); offloaded, after filling the optimizer's own float32
        ``.grad`` from fp16/bf16 averaged buffers"""
        if not self.offload_optimizer:
            for group in self.state_averager.optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
        elif getattr(self, "_offloaded_grad_copies", ([], []))[0]:  # see _bind_offloaded_grads_
            with torch.no_grad(), self.grad_averager.get_tensors():
                foreach_copy_(*self._offloaded_grad_copies)
        super()._load_averaged_gradients_into_optimizer_()

    def _step_with_host_copy(self) -> bool:
        """delayed averaging (offloaded): if the round's local gradients were copied to host memory (the next epoch
        accumulated during the round), the optimizer step, next in this thread, uses that copy as ``.grad``, and the
        averager's buffers, which may hold a later round's part by now, are left alone; returns whether it will"""
        fallback = getattr(self.grad_averager, "local_fallback", None)
        if not self.delay_grad_averaging or fallback is None or not self.grad_averager.keep_local_fallback:
            return False
        params = [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]
        host_layout = [(param.shape, torch.float32 if param.dtype in LOW_PRECISION else param.dtype, "cpu")
                       for param in fallback.parameters]  # GradientBuckets(device="cpu", upcast=True)
        if host_layout != [(param.shape, param.dtype, param.device.type) for param in params]:
            return False
        host = fallback.take_host_copy_()
        if host is None:
            return False
        self._host_copy_step.host = host
        return True

    def _swap_in_host_copy(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """step pre-hook: a step of :meth:`_step_with_host_copy` runs with the host copy as ``.grad`` (a skipped step,
        whose ``.grad`` are None, is left as it is)"""
        host, self._host_copy_step.host = getattr(self._host_copy_step, "host", None), None
        if host is None:
            return
        params = [param for group in optimizer.param_groups for param in group["params"]]
        self._host_copy_step.swapped = host, [(param, param.grad) for param in params if param.grad is not None]
        for param, grad in zip(params, host.views):
            if param.grad is not None:
                param.grad = grad

    def _swap_out_host_copy(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """step post-hook: the ``.grad`` tensors are put back and the host copy given back"""
        swapped, self._host_copy_step.swapped = getattr(self._host_copy_step, "swapped", None), None
        if swapped is None:
            return
        host, grads = swapped
        for param, grad in grads:
            param.grad = grad
        self.grad_averager.local_fallback.give_back_(host)

    def _round_own_finite(self) -> bool:
        """whether this peer's own gradients of the round this thread settles were finite: that round's record, also
        after later rounds began (``round_guard.own_finite_in``)"""
        return self.grad_averager.round_guard.own_finite_in(self.grad_averager.local_fallback.named_round)

    def _round_usable(self) -> bool:
        """whether the optimizer step about to run may use its round's gradients, as that round's load decided: not
        if its fallback found them kept no longer, nor if they or the round's result held inf or NaN. A step whose
        round no load of ours decided (hivemind loaded the accumulators itself) uses them if the latest were finite.
        Each decision reaches its own round's step only (``StepDecisions``), also when the step runs late"""
        usable = self._step_decisions.take()
        return self.grad_averager.round_guard.own_finite if usable is None else usable

    def _on_skipped_step(self) -> None:
        """the optimizer step of an unusable round is about to be skipped: the next state averaging round (which the
        state averager runs after this step) is joined with weight 0, so the others are not pulled back to this peer's
        older parameters"""
        logger.log(self.status_loglevel, f"Skipping the optimizer step of epoch {self.local_epoch} (inf or NaN)")
        self.state_averager.hold_back_()

    def _compute_schema_hash(self) -> int:
        """parameter shapes and, offloaded, ``.grad`` identities, read while no optimizer step runs: a skipped step
        takes the ``.grad`` tensors away for its duration, maybe in the state averager's thread"""
        with self.state_averager.lock_optimizer:
            return super()._compute_schema_hash()

    def _guards_gradients(self) -> bool:
        """whether the gradient averager is a :class:`GradientAverager` (a ``grad_averager_factory`` may build
        another kind)"""
        return isinstance(self.grad_averager, GradientAverager)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """upstream's construction (the same arguments) of this package's :class:`TrainingStateAverager`, whose rounds
        never take or offer inf/NaN"""
        return TrainingStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def zero_grad(self, set_to_none: bool = ZERO_GRAD_SET_TO_NONE_DEFAULT):
        """
        Reset the model's gradients, also with ``reuse_grad_buffers=True``: with ``set_to_none=True`` (the default
        with torch 2) the gradients already accumulated stay in the averager and the next micro-step's gradients are
        added to them; ``set_to_none=False`` zeroes ``.grad`` in place, which in in-place mode discards this epoch's
        accumulated gradients, as it would in native PyTorch accumulation.

        :param set_to_none: set each ``.grad`` to None instead of filling it with zeros
        :raises ValueError: in in-place mode with ``set_to_none=True``, naming the parameter, after a ``backward()``
          not yet followed by ``step()``: its gradient is in the running sum already, so it cannot be dropped
        """
        params = [param for group in self.param_groups for param in group["params"]]
        views = getattr(self.grad_averager, "_grad_views", None) if self.use_gradient_averaging else None
        if set_to_none:
            if views is not None:
                views.check_no_unstepped_grads()
            for param in params:
                param.grad = None
            return
        grads = [param.grad for param in params if param.grad is not None]
        if views is None:
            foreach_zero_(grads)
        else:
            with views.own_write(zeroes=True):  # the accumulators' reset, not an edit of the running sum
                foreach_zero_(grads)

    def _make_gradient_averager(self, factory: Optional[GradientAveragerFactory], **kwargs) -> GradientAverager:
        """the gradient averager, built by ``factory`` (by default :class:`GradientAverager`); offloaded, the
        optimizer's ``.grad`` are then bound to its averaged buffers (:meth:`_bind_offloaded_grads_`)"""
        assert hasattr(self, "state_averager"), "must initialize state averager first"
        factory = factory if factory is not None else GradientAverager
        grad_averager = factory(
            dht=self.dht,
            prefix=f"{self.run_id}_grad_averager",
            parameters=self.state_averager.main_parameters,
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )
        if self.offload_optimizer:
            self._bind_offloaded_grads_(grad_averager)
        return grad_averager

    @torch.no_grad()
    def _bind_offloaded_grads_(self, grad_averager) -> None:
        """offloaded: each optimizer parameter's ``.grad`` is its averaged buffer where the dtypes match, or, where the
        dtypes differ (fp16/bf16 averaged buffers, float32 optimizer parameters), a float32 tensor of its own that
        :meth:`_load_gradients_into_optimizer_` fills once per round"""
        params = [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]
        self._offloaded_grad_copies = ([], [])  # (the optimizer's .grad, the averaged buffers)
        with grad_averager.get_tensors() as averaged_grads:
            assert len(averaged_grads) == len(params)
            for param, averaged in zip(params, averaged_grads):
                if param.dtype == averaged.dtype:
                    param.grad = averaged
                else:
                    param.grad = torch.zeros_like(param)
                    self._offloaded_grad_copies[0].append(param.grad)
                    self._offloaded_grad_copies[1].append(averaged)


def _qualified_name(obj) -> str:
    """``obj``'s class with its module, e.g. ``hivemind.optim.grad_scaler.GradScaler``"""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _named_params(groups, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    """(position, tensor) for every parameter of a sequence of param groups, positions written from ``prefix``"""
    return [
        (f'{prefix}[{i}]["params"][{j}]', param)
        for i, group in enumerate(groups)
        if isinstance(group, dict)
        for j, param in enumerate(group.get("params", ()))
    ]


def _params_as_lists(params):
    """``params`` (tensors or param groups, each possibly a one-pass iterator) as lists, and its named parameters"""
    params = list(params)
    if all(isinstance(param, torch.Tensor) for param in params):
        return params, [(f"params[{i}]", param) for i, param in enumerate(params)]
    params = [
        dict(group, params=[group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"]))
        if isinstance(group, dict) and "params" in group
        else group
        for group in params
    ]
    return params, _named_params(params, "params")
