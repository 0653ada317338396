"""
The averager's side of the failed-round fallback: a round's local gradients are kept under the round's control
(:class:`~hivemind_accum.rounds.fallback.LocalFallback`, the averager's ``local_fallback``) from the moment the round
begins until its result or its fallback is used.

:class:`KeepsRoundsForFallback` is a mixin of :class:`hivemind_accum.GradientAverager`, placed before upstream's class.
"""
from typing import ContextManager, Optional

from hivemind.averaging.control import StepControl
from hivemind.optim import grad_averager as upstream

from hivemind_accum.integration import workarounds
from hivemind_accum.rounds.fallback import LocalFallback


class KeepsRoundsForFallback(upstream.GradientAverager):
    """:class:`hivemind.optim.grad_averager.GradientAverager`'s round methods, keeping each round's local gradients
    in ``local_fallback`` (built by the subclass's ``__init__``)"""

    local_fallback: LocalFallback
    keep_local_fallback: bool = True  # see step(); subclasses whose all-reduce keeps state of its own may opt out

    def step(
        self,
        weight: Optional[float] = None,
        reset_accumulators: bool = True,
        control: Optional[StepControl] = None,
        timeout: Optional[float] = None,
        wait: bool = True,
        **kwargs,
    ):
        """
        Average accumulated gradients with peers, as upstream's ``GradientAverager.step`` (same parameters), with one
        difference: this round's local gradients are kept until the round is settled. If the round fails (the
        all-reduce raises or times out), the next ``load_accumulators_into_averager_`` (which ``hivemind.Optimizer``
        calls to "proceed with local gradients") loads them again, so the epoch's local work is not lost. They stay in
        the accumulators (in place: in ``.grad``) until the round is settled (its result used or the fallback loaded);
        a micro-step or ``reset_accumulated_grads_`` that comes earlier copies them to host memory first. Given a
        ``control``, they are kept under it (``local_fallback.for_round(control)`` names the round), also while later
        rounds begin: at most two rounds are kept, a third drops the oldest.

        If this peer's gradients hold inf or NaN, they are replaced by zeros and, with ``weight=None`` (the default, as
        ``hivemind.Optimizer`` calls it), the round's weight is 0: see ``load_accumulators_into_averager_``. An
        explicit ``weight`` is used as given.
        """
        with self._beginning_round(control):
            return super().step(
                weight=weight, reset_accumulators=reset_accumulators, control=control, timeout=timeout, wait=wait,
                **kwargs,
            )

    def _beginning_round(self, control: Optional[StepControl]) -> ContextManager:
        """a context in which the round ``control`` begins: its local gradients are kept under ``control``; raises a
        clear ``RuntimeError`` if the averager is not running"""
        self._check_running("step")
        return self.local_fallback.for_round(control, beginning=True)

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs) -> StepControl:
        """as upstream's ``schedule_step``; raises a clear ``RuntimeError`` if the averager is not running"""
        self._check_running("schedule_step")
        return workarounds.state_first_control(super().schedule_step(scheduled_time, **kwargs))

    def _check_running(self, method: str) -> None:
        if not self.is_alive():
            raise RuntimeError(
                f"{type(self).__name__}.{method}: the averager is not running (it was shut down, or built with "
                f"start=False and never started); call run_in_background() first or build a new averager. Local "
                f"accumulation (accumulate_grads_, load_accumulators_into_averager_) works without it"
            )

    def notify_used_averaged_gradients(self):
        """Notify averager that the results of a previous averaging round are accounted for"""
        self.local_fallback.settle()
        super().notify_used_averaged_gradients()

    def discard_nonfinite_round_(self) -> None:
        """called when a round's averaged gradients hold inf or NaN and are not used: nothing to do here, as this
        averager keeps no state across rounds (see :class:`PowerSGDGradientAverager`, which does)"""
