"""
:class:`hivemind.Optimizer` that builds this package's averagers and progress tracker, and its step: a micro-step's
gradients go to :meth:`GradientAverager.accumulate_grads_`, unscaled there with a grad scaler and without a host read
(the two grad-scaler protocols: docs/guide.md). Its round hooks (which gradients each optimizer step uses) are
:mod:`~hivemind_accum.integration.round_steps`', its workarounds for hivemind 1.1.12
:mod:`~hivemind_accum.integration.workarounds`'.
"""
import inspect
from typing import Callable, Optional

import torch
from hivemind.dht import DHT
from hivemind.optim import optimizer as upstream
from hivemind.optim.grad_averager import GradientAveragerFactory
from hivemind.optim.grad_scaler import GradScaler as HivemindGradScaler
from hivemind.optim.state_averager import ZERO_GRAD_SET_TO_NONE_DEFAULT
from hivemind.utils import get_logger

from hivemind_accum.arguments import check_batch_size_per_step, check_distinct, named_params, params_as_lists
from hivemind_accum.integration import workarounds
from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.integration.progress_tracker import ProgressTracker
from hivemind_accum.integration.round_steps import RoundSteps
from hivemind_accum.integration.state_averager import TrainingStateAverager
from hivemind_accum.torch_compat import (
    allow_scale_growth,
    begin_exact_micro_step,
    check_hivemind_grad_scaler_internals,
    declare_scaling_aware_step,
    end_exact_micro_step,
    foreach_zero_,
    inv_loss_scale,
    record_found_inf,
)

logger = get_logger(__name__)


class Optimizer(RoundSteps, upstream.Optimizer):
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
      :meth:`_load_averaged_gradients_into_optimizer_` and :class:`hivemind_accum.integration.state_averager.
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
        check_batch_size_per_step(batch_size_per_step)
        client_mode = workarounds.client_mode_or_dht(client_mode, dht)
        if client_mode and auxiliary:
            raise ValueError("client_mode, auxiliary: a client-mode peer cannot serve as an auxiliary peer")
        if params is not None:
            params, named = params_as_lists(params)
        else:
            named = named_params(getattr(optimizer, "param_groups", ()), "optimizer.param_groups")
        check_distinct(named)
        # kept here and restored in _make_progress_tracker, the first thing upstream's __init__ builds from
        # self.client_mode (workarounds.client_mode_or_dht)
        self._client_mode = client_mode
        super().__init__(
            dht=dht, optimizer=optimizer, params=params, batch_size_per_step=batch_size_per_step,
            client_mode=client_mode, auxiliary=auxiliary, **kwargs,
        )
        self._init_round_steps()
        self._micro_step_scaler = None  # the grad scaler of the exact-mode step now running, see step()
        self._own_found_inf_record = []  # the overflow tensors hivemind.GradScaler last left (end_exact_micro_step)
        if self.use_gradient_averaging and not self.auxiliary:
            # torch.amp.GradScaler.step then hands itself to step() instead of unscaling and reading the overflow
            # flag on the host before every micro-step
            declare_scaling_aware_step(self)

    # help() and inspect.signature list upstream's arguments (inspect reads a class's own __new__ first)
    __new__.__signature__ = __init__.__signature__ = inspect.signature(upstream.Optimizer.__init__)

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
            begin_exact_micro_step(grad_scaler, self, self._own_found_inf_record)
        record_found_inf(grad_scaler, self)  # update() needs a record even if this micro-step is discarded
        # upstream's step hands its hooks only a hivemind.GradScaler; this one reaches them through this attribute
        self._micro_step_scaler = grad_scaler
        try:
            # the accumulators hold unscaled, finite gradients: the global step runs as without loss scaling
            return super().step(closure, batch_size, grad_scaler=None)
        finally:
            self._micro_step_scaler = None
            if isinstance(grad_scaler, HivemindGradScaler):
                self._own_found_inf_record = end_exact_micro_step(grad_scaler, self)

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler: Optional[HivemindGradScaler]) -> bool:
        """accumulate this micro-step's gradients without reading anything on the host on an accelerator (on the CPU:
        one read, see :meth:`step`)"""
        scaler = self._micro_step_scaler
        if scaler is not None:  # exact mode: unscale, check and maybe drop (on an accelerator, on the device)
            # 1 / scale, or 1.0 if the loop called torch.amp.GradScaler.unscale_(opt)
            found_inf = self.grad_averager.accumulate_grads_(batch_size, inv_grad_scale=inv_loss_scale(scaler, self))
            record_found_inf(scaler, self, found_inf)
        else:  # no grad scaler, or in place with hivemind.GradScaler (checked once per round, at its beginning)
            self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        return True

    def _update_global_epoch(self, grad_scaler: Optional[HivemindGradScaler]) -> None:
        """exact mode with a grad scaler: before the epoch ends, subtract the micro-steps dropped for overflow from the
        reported progress (one host read per epoch); if the swarm is then short of its target, the epoch goes on"""
        if self._micro_step_scaler is not None and self.grad_averager.settle_dropped_micro_steps():
            self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
            if not self.tracker.ready_to_update_epoch:
                return
        super()._update_global_epoch(grad_scaler)
        if isinstance(self._micro_step_scaler, HivemindGradScaler):
            allow_scale_growth(self._micro_step_scaler)

    def _begin_averaging_gradients(self, grad_scaler: Optional[HivemindGradScaler]) -> bool:
        """in-place mode with a grad scaler: unscale the accumulated gradients and, if they overflowed, drop them
        before they reach peers (one host sync per round); then the round's control is scheduled, with a deadline, if
        none was (its local gradients are kept under it: round_steps.py); then as upstream without a grad scaler"""
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
        if self.scheduled_grads is None and self.tracker.global_progress.num_peers > 1:
            self.scheduled_grads = workarounds.schedule_with_deadline(self.grad_averager, self.averaging_timeout)
        return super()._begin_averaging_gradients(None)

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
        aliases = getattr(self.grad_averager, "grad_aliases", None) if self.use_gradient_averaging else None
        if set_to_none:
            if aliases is not None:
                aliases.check_no_unstepped_grads()
            for param in params:
                param.grad = None
            return
        grads = [param.grad for param in params if param.grad is not None]
        if aliases is None:
            foreach_zero_(grads)
        else:
            with aliases.own_write(zeroes=True):  # the accumulators' reset, not an edit of the running sum
                foreach_zero_(grads)

    def _make_gradient_averager(self, factory: Optional[GradientAveragerFactory], **kwargs) -> GradientAverager:
        """the gradient averager, built by ``factory`` (by default :class:`GradientAverager`); offloaded, the
        optimizer's ``.grad`` are then bound to its averaged buffers (:meth:`_bind_offloaded_grads`)"""
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
            self._bind_offloaded_grads(grad_averager)
        return grad_averager


def _qualified_name(obj) -> str:
    """``obj``'s class with its module, e.g. ``hivemind.optim.grad_scaler.GradScaler``"""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
