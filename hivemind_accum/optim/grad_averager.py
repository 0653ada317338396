"""
A drop-in replacement for :class:`hivemind.optim.grad_averager.GradientAverager` whose no-sync step costs a
constant number of fused operations (exact mode) or no tensor work at all (in-place mode).

How a gradient travels, in three files:

1. ``loss.backward()`` writes ``param.grad`` (autograd).
2. :meth:`GradientAverager.accumulate_grads_` (this file) adds it into a flat on-device accumulator
   (:mod:`hivemind_accum.optim.grad_buckets`), or, in in-place mode, autograd already did so because ``param.grad``
   *is* a view of that accumulator.
3. :meth:`GradientAverager.load_accumulators_into_averager_` (this file) moves each accumulator, scaled by
   ``1 / micro_steps``, into the averager's shared CPU buffers in one bulk op per bucket; upstream's
   :class:`hivemind.averaging.DecentralizedAverager` all-reduces those buffers with peers.
"""
import inspect
import numbers
import operator
import warnings
from typing import AsyncIterator, ContextManager, Iterable, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.optim import grad_averager as upstream
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from hivemind_accum.optim.grad_buckets import LOW_PRECISION, GradientBuckets
from hivemind_accum.optim.grad_views import GradViews
from hivemind_accum.optim.local_fallback import LocalFallback
from hivemind_accum.optim.round_guard import RoundGuard
from hivemind_accum.optim.schema_mismatch import SchemaMismatchWarning

logger = get_logger(__name__)


class GradientAverager(upstream.GradientAverager):
    """
    Accumulates gradients in persistent flat on-device buffers and aggregates them with peers.

    Same constructor, methods and attributes as :class:`hivemind.optim.grad_averager.GradientAverager`, with two
    accumulation modes (docs/guide.md#two-modes):

    - exact (``reuse_grad_buffers=False``, default): the same accumulators, averaged gradients and averaging weight
      as hivemind 1.1.12; one fused add per (device, dtype) bucket per micro-step; ``.grad`` stays the user's;
    - in place (``reuse_grad_buffers=True``): every ``param.grad`` is a view of the accumulator, so autograd
      accumulates into it and a micro-step does no tensor work; every micro-step counts equally.

    The averaged (all-reduced) buffers have the parameters' dtype, as upstream's, so peers of hivemind 1.1.12 and of
    this package average together; ``averaged_grads_dtype=torch.float32`` averages fp16/bf16 gradients in float32
    instead. Peers average only with peers whose averaged buffers match (the schema hash): a peer that meets one that
    chose differently logs a WARNING naming the argument, once (docs/guide.md#fp16-and-bf16-parameters).

    :param parameters: pytorch parameters for which to aggregate gradients: dense float tensors on any devices and
      dtypes; the accumulators form one flat buffer per (device, dtype) group
    :param dht: a DHT instance connected to the rest of the swarm. See hivemind.DHT docs
    :param prefix: a unique DHT key used for matchmaking, e.g. your experiment name with optional suffixes
    :param reuse_grad_buffers: if True, in-place mode: ``param.grad`` become views of the accumulators
    :param accumulate_in_fp32: exact mode only: if True (default), fp16/bf16 gradients accumulate into float32
      buffers (each micro-step copies and casts them into a persistent float32 staging buffer, then adds with one
      flat op per bucket); if False, they accumulate in the parameters' dtype, halving accumulator memory
    :param accumulate_grads_on: if specified, place the accumulators on this device (e.g. ``"cpu"`` to save device
      memory; each micro-step then copies gradients into a persistent staging buffer there). By default each
      accumulator lives on its parameters' device. Ignored (with a warning) if ``reuse_grad_buffers=True``.
    :param client_mode: if False, this averager will accept incoming requests from other peers; by default, this
      flag is copied from DHTNode inside the ``dht`` instance
    :param warn: if True, warn when the averager did not reset accumulators after use or did not use averaging results
    :param averaged_grads: if provided, the tensors to all-reduce: one per parameter, of the parameter's shape, on
      CPU. By default, one flat shared-memory CPU buffer per bucket, cut into per-parameter views.
    :param averaged_grads_dtype: None (default): the averaged buffers have each parameter's dtype;
      ``torch.float32``: fp16/bf16 gradients are averaged in float32 (twice the host memory and traffic; such a peer
      averages only with peers that set it too). Accumulators are unaffected (see ``accumulate_in_fp32``). Ignored
      if ``averaged_grads`` is given.
    :param kwargs: see DecentralizedAverager keyword arguments for additional parameters
    :raises ValueError: naming the parameter, for an empty or invalid ``parameters`` (naming both positions of a
      tensor listed twice) or a wrong ``averaged_grads``
    """

    keep_local_fallback: bool = True  # see step(); subclasses whose all-reduce keeps state of its own may opt out

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: Optional[torch.device] = None,
        accumulate_in_fp32: bool = True,
        client_mode: bool = None,
        warn: bool = True,
        averaged_grads: Sequence[torch.Tensor] = (),
        averaged_grads_dtype: Optional[torch.dtype] = None,
        **kwargs,
    ):
        if averaged_grads_dtype not in (None, torch.float32):
            raise ValueError(f"averaged_grads_dtype: expected None or torch.float32, got {averaged_grads_dtype!r}")
        if reuse_grad_buffers and accumulate_grads_on is not None:
            logger.warning("Setting 'accumulate_grads_on' has no effect if reuse_grad_buffers=True")
            accumulate_grads_on = None
        client_mode = client_mode if client_mode is not None else dht.client_mode
        self.parameters = tuple(parameters)
        self.reuse_grad_buffers = reuse_grad_buffers
        self.warn = warn
        self.local_samples_accumulated = 0
        self.local_times_accumulated = 0
        self._anchor_batch_size = None
        self._warned_unequal_batches = False
        self._accumulators_used_in_step = False
        self._new_averaged_grads = False

        averaged_grads = tuple(averaged_grads or ())
        if averaged_grads:
            _check_averaged_grads(self.parameters, averaged_grads)
        self.averaged_grads_dtype = averaged_grads_dtype
        self._accumulators = GradientBuckets(
            self.parameters, device=accumulate_grads_on, upcast=accumulate_in_fp32 and not reuse_grad_buffers
        )
        # micro-steps dropped for inf/NaN gradients (accumulate_grads_ with inv_grad_scale), counted on the device
        # without a host sync and subtracted from the host counters when the accumulators are loaded
        # and the batch size of the first micro-step kept (micro-step i weighs b_i / b_first: if the first
        # micro-step is dropped, the accumulators are rescaled once at load time, by _anchor_correction)
        self._drop_counters = torch.zeros(3, device=self._accumulators.buckets[0].flat.device)
        self._dropped_samples, self._dropped_micro_steps, self._first_kept_batch_size = self._drop_counters
        self._first_unset = torch.zeros_like(self._first_kept_batch_size)  # scratch: whether no micro-step was kept
        self._may_have_dropped = False
        self._anchor_correction = 1.0
        self._grad_views = None
        if reuse_grad_buffers:
            self._grad_views = GradViews(self._accumulators, self.parameters, on_rebuild=self._use_accumulators_)
            self._grad_views.attach_(micro_step=False)  # a .grad the model already holds is added in
        self._local_accumulators = self._accumulator_views()  # the name hivemind's other classes read

        if averaged_grads:
            self._averaged_buckets = None
        else:
            self._averaged_buckets = GradientBuckets(
                self.parameters, device="cpu", share_memory=True, upcast=averaged_grads_dtype == torch.float32
            )
            averaged_grads = self._averaged_buckets.views
        self._schema_mismatch = SchemaMismatchWarning(
            self.parameters, averaged_grads, averaged_grads_dtype, custom=self._averaged_buckets is None
        )
        # the latest round's local gradients, kept (in the accumulators, or on the host if micro-steps of the next
        # epoch arrive before the round is settled) until its result is used: a failed round falls back to them
        self.local_fallback = LocalFallback(self._accumulators, self.parameters, in_place=reuse_grad_buffers)
        self._loaded_scale = 0.0
        # checks this peer's gradients once per round, as they are loaded: non-finite ones reach peers as zeros with
        # weight 0 (round_guard.own_finite then tells the optimizer to skip its step)
        self.round_guard = RoundGuard("accumulated gradients")
        DecentralizedAverager.__init__(
            self, averaged_tensors=averaged_grads, dht=dht, prefix=prefix, client_mode=client_mode, **kwargs
        )

    def __del__(self):
        if hasattr(self, "_parent_pid"):  # a constructor that raised before DecentralizedAverager.__init__ ran
            super().__del__()

    averaged_grads_dtype: Optional[torch.dtype] = None  # see __init__; a class default read before it (PowerSGD)

    def _grads_from_parameters(self) -> Iterator[torch.Tensor]:
        """shape and dtype of each averaged gradient (see ``averaged_grads_dtype``) as meta tensors, for subclasses
        that size their own buffers from it (PowerSGD); this never touches ``.grad``"""
        for param in self.parameters:
            upcast = self.averaged_grads_dtype is not None and param.dtype in LOW_PRECISION
            yield torch.empty_like(param, device="meta", dtype=self.averaged_grads_dtype if upcast else None)

    def _run_internal(self):
        """the averager's background process: also watch matchmaking for peers of another schema"""
        self._schema_mismatch.watch_follower_side_()
        super()._run_internal()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """the reply to a group request; one refused for its schema hash is reported once
        (:class:`SchemaMismatchWarning`)"""
        async for response in super().rpc_join_group(request, context):
            if response.code == averaging_pb2.BAD_SCHEMA_HASH:
                self._schema_mismatch.report_(context.remote_id, request.schema_hash)
            yield response

    @torch.no_grad()
    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        """per-parameter views of the accumulators (in in-place mode, the same tensors as ``param.grad``)"""
        yield from self._accumulator_views()

    def _accumulator_views(self) -> Sequence[torch.Tensor]:
        return self._grad_views.aliases if self._grad_views is not None else self._accumulators.views

    def _attach_grads_(self) -> None:
        """in-place mode: add every ``.grad`` that is not its accumulator view into the view, then re-attach the view
        (see :class:`~hivemind_accum.optim.grad_views.GradViews`)"""
        self._grad_views.attach_()

    def _use_accumulators_(self, accumulators: GradientBuckets) -> None:
        """in-place mode: the accumulators were built anew (the parameters changed dtype or device)"""
        self._accumulators = accumulators
        self._local_accumulators = self._accumulator_views()
        self.local_fallback.use_accumulators_(accumulators)

    @torch.no_grad()
    def accumulate_grads_(
        self, batch_size: int, inv_grad_scale: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """
        Add the current micro-step's gradients (``param.grad``) to the local accumulators.

        Exact mode: micro-step ``i`` adds ``(b_i / b_0) * grad``; a ``.grad`` that is None adds nothing. With
        ``inv_grad_scale`` the gradients are unscaled as they are added, and a micro-step holding any inf or NaN is
        dropped whole (it leaves the averaging weight at the next load). Nothing is read on the host on an accelerator.

        In-place mode: autograd already accumulated into the views. A ``.grad`` that was set to None or replaced since
        the previous call is added into its accumulator and the view re-attached, so nothing is lost or counted twice,
        ``backward(create_graph=True)`` included; a ``.grad`` computed from the running sum (``p.grad = p.grad * c``)
        raises instead of counting the sum twice (docs/guide.md#what-the-checks-see).

        :param batch_size: number of samples in this micro-batch, a positive integer
        :param inv_grad_scale: optional 0-dim float32 tensor on any device, ``1 / loss_scale`` of this micro-step's
          gradients (``torch.ones(())`` for gradients already unscaled but not yet checked for inf/NaN)
        :returns: with ``inv_grad_scale``, ``found_inf``: a 0-dim float32 tensor on the accumulators' device, 1.0 if
          this micro-step was dropped (what ``torch.amp.GradScaler.update`` reads to back off); on an accelerator the
          same tensor at every call, overwritten by the next micro-step (clone it to keep it); otherwise None
        :raises ValueError: if ``batch_size`` is not a positive integer, or ``inv_grad_scale`` is given in in-place
          mode (there autograd has already added the gradients to the accumulators); in in-place mode also if a
          ``.grad`` was replaced by a tensor computed from the running sum (the message names the parameter)
        """
        if not is_positive_int(batch_size):
            raise ValueError(
                f"batch_size: expected a positive int (samples in this micro-batch), got {batch_size!r}; "
                f"hivemind.Optimizer passes step(batch_size=...) or else its batch_size_per_step"
            )
        if inv_grad_scale is not None and self.reuse_grad_buffers:
            raise ValueError(
                "inv_grad_scale: with reuse_grad_buffers=True gradients are already in the accumulators and cannot be "
                "unscaled or dropped per micro-step; unscale the accumulated gradients once per round "
                "(hivemind.GradScaler does) or use reuse_grad_buffers=False"
            )
        if self._accumulators_used_in_step and self.warn:  # once per round
            logger.warning(
                "[warn=True] Gradient accumulators were not reset since the last averaging round. Please "
                "call .reset_accumulated_grads_ after every step or use .step(reset_accumulators=True)"
            )
            self._accumulators_used_in_step = False  # warn once per round
        if self.local_fallback.holding:  # the first micro-step after a round began: the accumulators start over
            self.local_fallback.release_()
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size  # micro-step i counts b_i / b_0
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        if self.reuse_grad_buffers:
            if batch_size != self._anchor_batch_size and not self._warned_unequal_batches:
                warnings.warn(
                    f"reuse_grad_buffers=True weighs every micro-step equally (as native PyTorch accumulation does), "
                    f"but batch sizes differ ({self._anchor_batch_size} then {batch_size}); the exact mode "
                    f"(reuse_grad_buffers=False) weighs micro-steps by batch size",
                    stacklevel=2,
                )
                self._warned_unequal_batches = True
            self._attach_grads_()
            return None
        grads, alpha = list(map(_GRAD, self.parameters)), batch_size / self._anchor_batch_size
        if inv_grad_scale is None:
            self._accumulators.add_(grads, alpha=alpha)
            return None
        found_inf = self._accumulators.add_finite_(grads, inv_grad_scale, alpha=alpha)
        self._dropped_samples.add_(found_inf, alpha=batch_size)
        self._dropped_micro_steps.add_(found_inf)
        unset = torch.logical_not(self._first_kept_batch_size, out=self._first_unset)  # in place: allocates nothing
        self._first_kept_batch_size.add_(unset, alpha=batch_size).addcmul_(unset, found_inf, value=-batch_size)
        self._may_have_dropped = True
        return found_inf

    def _settle_dropped_micro_steps(self) -> None:
        """subtract micro-steps dropped for inf/NaN gradients from the host counters: one host sync per round"""
        if not self._may_have_dropped:
            return
        dropped_samples, dropped_micro_steps, first_kept_batch_size = map(round, self._drop_counters.tolist())
        if dropped_micro_steps:
            logger.info(f"Dropped {dropped_micro_steps} micro-step(s), {dropped_samples} samples, with inf/NaN grads")
        self.local_samples_accumulated -= dropped_samples
        self.local_times_accumulated -= dropped_micro_steps
        if first_kept_batch_size:  # kept (not zeroed) so that later micro-steps do not overwrite it
            self._anchor_correction = self._anchor_batch_size / first_kept_batch_size
        self._drop_counters[:2].zero_()
        self._may_have_dropped = False

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
        if _CANCEL_SIGNALS_FIRST:
            control = super().schedule_step(scheduled_time, **kwargs)
            control.__class__ = _StateFirstStepControl  # a subclass: no reference cycle, freed as hivemind's is
            return control
        return super().schedule_step(scheduled_time, **kwargs)

    def _check_running(self, method: str) -> None:
        if not self.is_alive():
            raise RuntimeError(
                f"{type(self).__name__}.{method}: the averager is not running (it was shut down, or built with "
                f"start=False and never started); call run_in_background() first or build a new averager. Local "
                f"accumulation (accumulate_grads_, load_accumulators_into_averager_) works without it"
            )

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        """reset the micro-step counters and the accumulators (one ``zero_`` per bucket). Right after ``step`` loaded
        them for a round, the accumulators are kept until the round is settled instead (see :meth:`step`)"""
        handing_off = self._accumulators_used_in_step and self.keep_local_fallback
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None
        self._warned_unequal_batches = False
        self._drop_counters.zero_()
        self._may_have_dropped = False
        self._anchor_correction = 1.0
        if self.reuse_grad_buffers:
            self._grad_views.reattach_()
        if handing_off:
            self.local_fallback.hand_off_(self._loaded_scale, finite=self.round_guard.own_finite)
        else:
            self.local_fallback.release_()

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        """
        Load locally accumulated gradients, divided by the number of micro-steps, into the averager's shared CPU
        buffers: one bulk copy (and one scale) per bucket. If the last round is not settled (it failed), load that
        round's local gradients again instead (see ``step``). Micro-steps dropped for inf/NaN gradients are
        subtracted from the counters here (see ``accumulate_grads_``).

        The loaded gradients are checked once (``round_guard.offer_``) from sums of each chunk, taken while the copy
        writes it (with ``averaged_grads`` given at construction: one read-only reduction per tensor). If any is inf
        or NaN, the buffers are set to zeros and ``local_samples_accumulated`` to 0, so ``step`` joins the round with
        weight 0; ``round_guard.own_finite`` becomes False, and the optimizer skips this epoch's step.

        :returns: False (loading nothing) where ``local_fallback.for_round(control)`` names a round that keeps its
          local gradients no longer: a fallback loads only its own round's; else None
        """
        with self.get_tensors() as averaged_grads:
            if self.local_fallback.load_into_(self._averaged_target(averaged_grads)):
                logger.info("Averaging round was not used: loaded this round's local gradients again")
                return
        if self.local_fallback.lost:  # never another round's gradients instead
            logger.warning("Averaging round was not used and its local gradients are no longer kept: nothing loaded")
            return False
        if self.local_fallback.holding:  # a round began since the last micro-step: there is nothing new to load
            self.local_fallback.release_()
        if self.reuse_grad_buffers:
            self._grad_views.attach_(micro_step=False, rebuild=True)
        self._settle_dropped_micro_steps()
        times = self.local_times_accumulated
        grad_scale = (self._anchor_correction / times) if times != 0 else 0.0
        self._loaded_scale = grad_scale
        with self.get_tensors() as averaged_grads:
            target, checksums = self._averaged_target(averaged_grads), None
            if target is self._averaged_buckets:  # the check's sums, taken as the copy writes each chunk (in cache)
                checksums = self._accumulators.scaled_copy_with_checksums_(target, grad_scale)
            else:
                self._accumulators.scaled_copy_to_(target, grad_scale)
            guarded = self.flat_averaged_grads(averaged_grads)
            if not self.round_guard.offer_(guarded, checksums, round_key=self.local_fallback.named_round):
                self.local_samples_accumulated = 0  # step() then joins the round with weight 0 (and zeros)

    def notify_used_averaged_gradients(self):
        """Notify averager that the results of a previous averaging round are accounted for"""
        self.local_fallback.settle_()
        super().notify_used_averaged_gradients()

    def flat_averaged_grads(self, averaged_grads: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """the averager's buffers (as given by ``get_tensors()``) as few tensors as possible, for one-pass checks: the
        flat shared buckets when this averager made them, else ``averaged_grads`` itself"""
        if self._averaged_buckets is None:
            return averaged_grads
        return [bucket.flat for bucket in self._averaged_buckets.buckets]

    def discard_nonfinite_round_(self) -> None:
        """called when a round's averaged gradients hold inf or NaN and are not used: nothing to do here, as this
        averager keeps no state across rounds (see :class:`PowerSGDGradientAverager`, which does)"""

    def _averaged_target(self, averaged_grads: Sequence[torch.Tensor]):
        """the averager's buffers as a copy destination: flat buckets when this averager made them and they pair with
        the accumulators (the same grouping), else the list"""
        if self._averaged_buckets is not None and self._accumulators.pairs_with(self._averaged_buckets):
            return self._averaged_buckets
        return averaged_grads


def _cancel_signals_first() -> bool:
    """whether hivemind's StepControl.cancel signals the averager's process before it marks the round cancelled (as
    1.1.12's does); True where its source cannot be read (an install without .py files): the subclass is then used,
    and is correct either way"""
    try:
        return inspect.getsource(StepControl.cancel).rstrip().endswith("return super().cancel()")
    except (OSError, TypeError):
        return True


_CANCEL_SIGNALS_FIRST = _cancel_signals_first()


class _StateFirstStepControl(StepControl):
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


_GRAD = operator.attrgetter("grad")


def is_positive_int(value) -> bool:
    """whether ``value`` is an int (of any integral type, but not a bool) greater than zero"""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value > 0


def _check_averaged_grads(parameters: Sequence[torch.Tensor], averaged_grads: Sequence[torch.Tensor]) -> None:
    if len(averaged_grads) != len(parameters):
        raise ValueError(
            f"averaged_grads: expected one tensor per parameter ({len(parameters)}), got {len(averaged_grads)}"
        )
    for i, (param, grad) in enumerate(zip(parameters, averaged_grads)):
        if not isinstance(grad, torch.Tensor) or grad.shape != param.shape:
            got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(
                f"averaged_grads[{i}]: expected shape {tuple(param.shape)} (as parameters[{i}]), got {got}"
            )
        if grad.device.type != "cpu":
            raise ValueError(f"averaged_grads[{i}]: must be on CPU to be shared with the averager, got {grad.device}")
