"""
A drop-in replacement for :class:`hivemind.optim.grad_averager.GradientAverager` whose no-sync step costs a
constant number of fused operations (exact mode) or no tensor work at all (in-place mode).

This module wires the package's parts into hivemind's class: the buffers (:mod:`hivemind_accum.buffers`), the
failed-round fallback and the finite check (:mod:`hivemind_accum.rounds`). Its round methods are
:mod:`~hivemind_accum.integration.round_keeping`'s, its matchmaking hooks
:mod:`~hivemind_accum.integration.schema_mismatch`'s. A gradient's data, in three files per mode (every call on its
way: docs/guide.md#a-gradients-path):

1. ``loss.backward()`` writes ``param.grad`` (autograd).
2. :meth:`GradientAverager.accumulate_grads_` (this file) adds it into a flat accumulator
   (:mod:`hivemind_accum.buffers.buckets`; loss-scaled: :mod:`hivemind_accum.buffers.finite_add`), or, in in-place
   mode, autograd already did so because ``param.grad`` *is* an alias of that accumulator.
3. :meth:`GradientAverager.load_accumulators_into_averager_` (this file) moves each accumulator, scaled by the
   batch-size correction over the number of micro-steps, into the averager's shared CPU buffers chunk by chunk,
   summing each chunk as it writes it
   (:meth:`~hivemind_accum.buffers.buckets.GradientBuckets.scaled_copy_with_checksums_`); upstream's
   :class:`hivemind.averaging.DecentralizedAverager` all-reduces those buffers with peers.
"""
import warnings
from typing import Iterable, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.dht import DHT
from hivemind.optim import grad_averager as upstream
from hivemind.utils import get_logger

from hivemind_accum.arguments import check_averaged_grads, check_micro_step
from hivemind_accum.buffers.buckets import GradientBuckets, wide_dtype
from hivemind_accum.buffers.finite_add import DroppedMicroSteps
from hivemind_accum.buffers.aliases import GradAliases
from hivemind_accum.integration.round_keeping import KeepsRoundsForFallback
from hivemind_accum.integration.schema_mismatch import ReportsSchemaMismatch, SchemaMismatchLogger
from hivemind_accum.rounds.fallback import LocalFallback
from hivemind_accum.rounds.finite import RoundGuard

logger = get_logger(__name__)


class GradientAverager(ReportsSchemaMismatch, KeepsRoundsForFallback, upstream.GradientAverager):
    """
    Accumulates gradients in persistent flat on-device buffers and aggregates them with peers.

    Same constructor, methods and attributes as :class:`hivemind.optim.grad_averager.GradientAverager`, with two
    accumulation modes (docs/guide.md#two-modes):

    - exact (``reuse_grad_buffers=False``, default): the same accumulators, averaged gradients and averaging weight
      as hivemind 1.1.12; one fused add per (device, dtype) bucket per micro-step; ``.grad`` stays the user's;
    - in place (``reuse_grad_buffers=True``): every ``param.grad`` is an alias of the accumulator, so autograd
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
            check_averaged_grads(self.parameters, averaged_grads)
        self.averaged_grads_dtype = averaged_grads_dtype
        self._accumulators = GradientBuckets(
            self.parameters, device=accumulate_grads_on, upcast=accumulate_in_fp32 and not reuse_grad_buffers
        )
        # micro-steps dropped for inf/NaN gradients (accumulate_grads_ with inv_grad_scale), subtracted from the host
        # counters when the accumulators are loaded; a dropped first micro-step rescales them, by _anchor_correction
        self._dropped = DroppedMicroSteps(self._accumulators.buckets[0].flat.device)
        self._anchor_correction = 1.0
        self.grad_aliases: Optional[GradAliases] = None  # in-place mode: the .grad aliases and their checks
        if reuse_grad_buffers:
            self.grad_aliases = GradAliases(self._accumulators, self.parameters, on_rebuild=self._use_accumulators)
            self.grad_aliases.attach_(micro_step=False)  # a .grad the model already holds is added in
        self._local_accumulators = self._accumulator_views()  # upstream's name, for code written against it

        if averaged_grads:
            self._averaged_buckets = None
        else:
            self._averaged_buckets = GradientBuckets(
                self.parameters, device="cpu", share_memory=True, upcast=averaged_grads_dtype == torch.float32
            )
            averaged_grads = self._averaged_buckets.views
        self._schema_mismatch = SchemaMismatchLogger(  # read by ReportsSchemaMismatch's hooks
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
            upcast = self.averaged_grads_dtype is not None
            yield torch.empty_like(param, device="meta", dtype=wide_dtype(param.dtype) if upcast else None)

    @torch.no_grad()
    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        """per-parameter views of the accumulators (in in-place mode, the same tensors as ``param.grad``)"""
        yield from self._accumulator_views()

    def _accumulator_views(self) -> Sequence[torch.Tensor]:
        return self.grad_aliases.aliases if self.grad_aliases is not None else self._accumulators.views

    def _attach_grads_(self) -> None:
        """in-place mode: add every ``.grad`` that is not its accumulator alias into the alias, then re-attach the alias
        (see :class:`~hivemind_accum.buffers.aliases.GradAliases`)"""
        self.grad_aliases.attach_()

    def _use_accumulators(self, accumulators: GradientBuckets) -> None:
        """in-place mode: the accumulators were built anew (the parameters changed dtype or device)"""
        self._accumulators = accumulators
        self._local_accumulators = self._accumulator_views()
        self.local_fallback.use_accumulators(accumulators)

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
        the previous call is added into its accumulator and the alias re-attached, so nothing is lost or counted twice,
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
        check_micro_step(batch_size, inv_grad_scale, self.reuse_grad_buffers)
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
        grads, alpha = [param.grad for param in self.parameters], batch_size / self._anchor_batch_size
        if inv_grad_scale is None:
            self._accumulators.add_(grads, alpha=alpha)
            return None
        found_inf = self._accumulators.add_finite_(grads, inv_grad_scale, alpha=alpha)
        self._dropped.count_(found_inf, batch_size)
        return found_inf

    def settle_dropped_micro_steps(self) -> bool:
        """subtract micro-steps dropped for inf/NaN gradients from the host counters: one host read, and only if
        ``accumulate_grads_`` was given ``inv_grad_scale`` since the last settle; returns whether it read"""
        if not self._dropped.may_have_dropped:
            return False
        dropped_samples, dropped_micro_steps, first_kept_batch_size = self._dropped.collect_()
        if dropped_micro_steps:
            logger.info(f"Dropped {dropped_micro_steps} micro-step(s), {dropped_samples} samples, with inf/NaN grads")
        self.local_samples_accumulated -= dropped_samples
        self.local_times_accumulated -= dropped_micro_steps
        if first_kept_batch_size:  # micro-step i was weighed b_i / b_0, b_0 maybe dropped: rescale at load
            self._anchor_correction = self._anchor_batch_size / first_kept_batch_size
        return True

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        """reset the micro-step counters and the accumulators (one ``zero_`` per bucket). Right after ``step`` loaded
        them for a round, the accumulators are kept until the round is settled instead (see :meth:`step`)"""
        handing_off = self._accumulators_used_in_step and self.keep_local_fallback
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None
        self._warned_unequal_batches = False
        self._dropped.reset_()
        self._anchor_correction = 1.0
        if self.reuse_grad_buffers:
            self.grad_aliases.reattach()
        if handing_off:
            self.local_fallback.hand_off_(self._loaded_scale, finite=self.round_guard.own_finite)
        else:
            self.local_fallback.release_()

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> bool:
        """
        Load locally accumulated gradients, divided by the number of micro-steps, into the averager's shared CPU
        buffers: one bulk copy (and one scale) per bucket. If the last round is not settled (it failed), load that
        round's local gradients again instead (see ``step``). Micro-steps dropped for inf/NaN gradients are
        subtracted from the counters here (see ``accumulate_grads_``).

        The loaded gradients are checked once (``round_guard.offer_``) from sums of each chunk, taken while the copy
        writes it (with ``averaged_grads`` given at construction: one read-only reduction per tensor). If any is inf
        or NaN, the buffers are set to zeros and ``local_samples_accumulated`` to 0, so ``step`` joins the round with
        weight 0; ``round_guard.own_finite`` becomes False, and the optimizer skips this epoch's step.

        :returns: whether it loaded anything: False where ``local_fallback.for_round(control)`` names a round that
          keeps its local gradients no longer (a fallback loads only its own round's)
        """
        with self.get_tensors() as averaged_grads:
            if self.local_fallback.load_into_(self._averaged_target(averaged_grads)):
                logger.info("Averaging round was not used: loaded this round's local gradients again")
                return True
        if self.local_fallback.lost:  # never another round's gradients instead
            logger.warning("Averaging round was not used and its local gradients are no longer kept: nothing loaded")
            return False
        if self.local_fallback.holding:  # a round began since the last micro-step: there is nothing new to load
            self.local_fallback.release_()
        if self.reuse_grad_buffers:
            self.grad_aliases.attach_(micro_step=False, rebuild=True)
        self.settle_dropped_micro_steps()
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
                self.local_samples_accumulated = 0  # upstream's step() takes it as the weight: 0 (and zeros)
        return True

    def flat_averaged_grads(self, averaged_grads: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """the averager's buffers (as given by ``get_tensors()``) as few tensors as possible, for one-pass checks: the
        flat shared buckets when this averager made them, else ``averaged_grads`` itself"""
        if self._averaged_buckets is None:
            return averaged_grads
        return [bucket.flat for bucket in self._averaged_buckets.buckets]

    def _averaged_target(self, averaged_grads: Sequence[torch.Tensor]):
        """the averager's buffers as a copy destination: flat buckets when this averager made them and they pair with
        the accumulators (the same grouping), else the list"""
        if self._averaged_buckets is not None and self._accumulators.pairs_with(self._averaged_buckets):
            return self._averaged_buckets
        return averaged_grads

