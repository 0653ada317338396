"""
Which gradients each optimizer step of :class:`hivemind.Optimizer` uses: the round's average if it is finite, else the
round's own local gradients (the failed-round fallback, :mod:`hivemind_accum.rounds.fallback`), else no step
(:mod:`hivemind_accum.rounds.step_gate`); with delayed averaging, the host copy of a round's local gradients;
offloaded, the ``.grad`` tensors they are loaded into. One concern: what the optimizer step finds in ``.grad``.

:class:`RoundSteps` is a mixin of :class:`hivemind_accum.Optimizer`, placed before upstream's class.
"""
import contextlib
import threading
from typing import ContextManager, Optional

import torch
from hivemind.averaging.control import StepControl
from hivemind.optim import optimizer as upstream
from hivemind.utils import get_logger

from hivemind_accum.integration import workarounds
from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.rounds.finite import all_finite
from hivemind_accum.rounds.step_gate import SkipUnusableSteps, StepDecisions
from hivemind_accum.torch_compat import foreach_copy_

logger = get_logger(__name__)


class RoundSteps(upstream.Optimizer):
    """:class:`hivemind.Optimizer`'s round hooks with this package's fallback and step gate"""

    def _init_round_steps(self) -> None:
        """called in ``__init__``, once upstream's built the averagers"""
        self._step_decisions = StepDecisions()  # each round's decision for its optimizer step: _round_usable
        self._host_copy_step = threading.local()  # see _step_with_host_copy
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
        :class:`~hivemind_accum.rounds.step_gate.SkipUnusableSteps`)"""
        logger.log(self.status_loglevel, "Proceeding with local gradients")
        if self._step_with_host_copy():
            self._step_decisions.decide(self._round_own_finite())
            self.grad_averager.notify_used_averaged_gradients()
        elif self.grad_averager.load_accumulators_into_averager_() is False:  # upstream's returns None
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
            workarounds.create_missing_grads(self.state_averager.optimizer.param_groups)
        elif getattr(self, "_offloaded_grad_copies", ([], []))[0]:  # see _bind_offloaded_grads
            with torch.no_grad(), self.grad_averager.get_tensors():
                foreach_copy_(*self._offloaded_grad_copies)
        super()._load_averaged_gradients_into_optimizer_()

    def _bind_offloaded_grads(self, grad_averager) -> None:
        """offloaded: each optimizer parameter's ``.grad`` is its averaged buffer where the dtypes match, or, where the
        dtypes differ (fp16/bf16 averaged buffers, float32 optimizer parameters), a float32 tensor of its own that
        :meth:`_load_gradients_into_optimizer_` fills once per round (``workarounds.bind_offloaded_grads``)"""
        with grad_averager.get_tensors() as averaged_grads:
            self._offloaded_grad_copies = workarounds.bind_offloaded_grads(
                self.state_averager.optimizer.param_groups, averaged_grads
            )

    def _step_with_host_copy(self) -> bool:
        """delayed averaging (offloaded): if the round's local gradients were copied to host memory (the next epoch
        accumulated during the round), the optimizer step, next in this thread, uses that copy as ``.grad``, and the
        averager's buffers, which may hold a later round's part by now, are left alone; returns whether it will"""
        fallback = getattr(self.grad_averager, "local_fallback", None)
        if not self.delay_grad_averaging or fallback is None or not self.grad_averager.keep_local_fallback:
            return False
        params = [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]
        if not fallback.host_copy_fits(params):
            return False
        host = fallback.take_host_copy()
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
        self.grad_averager.local_fallback.give_back(host)

    def _round_own_finite(self) -> bool:
        """whether this peer's own gradients of the round this thread settles were finite: that round's record, also
        after later rounds began (``RoundGuard.own_finite_in``)"""
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
        self.state_averager.hold_back()

    def _compute_schema_hash(self) -> int:
        """parameter shapes and, offloaded, ``.grad`` identities, read while no optimizer step runs: a skipped step
        takes the ``.grad`` tensors away for its duration, maybe in the state averager's thread"""
        with self.state_averager.lock_optimizer:
            return super()._compute_schema_hash()

    def _guards_gradients(self) -> bool:
        """whether the gradient averager is a :class:`GradientAverager` (a ``grad_averager_factory`` may build
        another kind)"""
        return isinstance(self.grad_averager, GradientAverager)
