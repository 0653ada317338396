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
import numbers
import operator
import warnings
from typing import Iterable, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.dht import DHT
from hivemind.optim import grad_averager as upstream
from hivemind.utils import get_logger

from hivemind_accum.optim.grad_buckets import GradientBuckets

logger = get_logger(__name__)
_get_grad = operator.attrgetter("grad")


class GradientAverager(upstream.GradientAverager):
    """
    Accumulates gradients in persistent flat on-device buffers and aggregates them with peers.

    Same constructor, methods and attributes as :class:`hivemind.optim.grad_averager.GradientAverager` (which it
    subclasses), with two accumulation modes:

    - exact (``reuse_grad_buffers=False``, default): the accumulators, averaged gradients and averaging weight are
      the ones upstream computes (micro-step ``i`` of batch size ``b_i`` adds ``(b_i / b_0) * grad``; averaging
      divides by the number of micro-steps ``K``). The user may read, clip or zero ``.grad`` freely between
      ``backward()`` and ``accumulate_grads_``. Each micro-step costs one fused ``_foreach_add_`` per
      (device, dtype) bucket, with no allocation and no host synchronization.
    - in place (``reuse_grad_buffers=True``): every ``param.grad`` is a view of the accumulator, so autograd
      accumulates in place, as in native PyTorch accumulation; see ``accumulate_grads_`` for what happens when a
      ``.grad`` is set to None or replaced. Every micro-step counts equally (the sum over micro-steps divided by
      ``K``), as native accumulation of a mean loss does; if batch sizes differ, a warning says so once.

    :param parameters: pytorch parameters for which to aggregate gradients: dense float tensors on any devices and
      dtypes; the accumulators form one flat buffer per (device, dtype) group
    :param dht: a DHT instance connected to the rest of the swarm. See hivemind.DHT docs
    :param prefix: a unique DHT key used for matchmaking, e.g. your experiment name with optional suffixes
    :param reuse_grad_buffers: if True, in-place mode: ``param.grad`` become views of the accumulators
    :param accumulate_grads_on: if specified, place the accumulators on this device (e.g. ``"cpu"`` to save device
      memory; each micro-step then copies gradients into a persistent staging buffer there). By default each
      accumulator lives on its parameters' device. Ignored (with a warning) if ``reuse_grad_buffers=True``.
    :param client_mode: if False, this averager will accept incoming requests from other peers; by default, this
      flag is copied from DHTNode inside the ``dht`` instance
    :param warn: if True, warn when the averager did not reset accumulators after use or did not use averaging results
    :param averaged_grads: if provided, the tensors to all-reduce: one per parameter, of the parameter's shape, on
      CPU. By default, one flat shared-memory CPU buffer per bucket, cut into per-parameter views.
    :param kwargs: see DecentralizedAverager keyword arguments for additional parameters
    :raises ValueError: naming the parameter, for an empty or invalid ``parameters`` or a wrong ``averaged_grads``
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
        client_mode: bool = None,
        warn: bool = True,
        averaged_grads: Sequence[torch.Tensor] = (),
        **kwargs,
    ):
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
        self._accumulators = GradientBuckets(self.parameters, device=accumulate_grads_on)
        self._local_accumulators = self._accumulators.views  # upstream's name, read by hivemind's own code
        if reuse_grad_buffers:
            self._attach_grads_()

        if averaged_grads:
            self._averaged_buckets = None
        else:
            self._averaged_buckets = GradientBuckets(self.parameters, device="cpu", share_memory=True)
            averaged_grads = self._averaged_buckets.views
        # this round's local gradients (as loaded into the averager), kept on the host until the round's result is
        # used: if the all-reduce fails after the accumulators were reset, the optimizer falls back to these;
        # allocated at the first round
        self._local_fallback: Optional[GradientBuckets] = None
        self._fallback_pending = False
        DecentralizedAverager.__init__(
            self, averaged_tensors=averaged_grads, dht=dht, prefix=prefix, client_mode=client_mode, **kwargs
        )

    def __del__(self):
        if hasattr(self, "_parent_pid"):  # a constructor that raised before DecentralizedAverager.__init__ ran
            super().__del__()

    @torch.no_grad()
    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        """per-parameter views of the accumulators (in in-place mode, the same tensors as ``param.grad``)"""
        yield from self._accumulators.views

    def _attach_grads_(self) -> None:
        """in-place mode: add every ``.grad`` that is not its accumulator view into the view, then re-attach the view;
        while all views are attached this only compares object identities, no tensor work"""
        views = self._accumulators.views
        if all(map(operator.is_, map(_get_grad, self.parameters), views)):
            return  # O(parameters) identity checks in C, about 0.1 us per parameter
        detached = [i for i, (param, view) in enumerate(zip(self.parameters, views)) if param.grad is not view]
        sources = [None] * len(views)
        for i in detached:
            sources[i] = self.parameters[i].grad
        self._accumulators.add_(sources)
        for i in detached:
            self.parameters[i].grad = views[i]

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int):
        """
        Add the current micro-step's gradients (``param.grad``) to the local accumulators.

        Exact mode: one fused ``_foreach_add_`` per bucket, weighted by ``batch_size / first_batch_size`` as upstream;
        parameters whose ``.grad`` is None contribute nothing.

        In-place mode: autograd has already accumulated into the views, so while every ``.grad`` is still its view
        this does no tensor work. A ``.grad`` that was set to None since the previous call (e.g. by
        ``zero_grad(set_to_none=True)``, before or after ``backward()``) holds only the gradients computed since
        then: it is added into the accumulator and the view is re-attached, so nothing is lost or counted twice.
        The same holds for a ``.grad`` replaced by a tensor of new gradients, but not for one computed from the old
        ``.grad`` (``p.grad = p.grad * c``, out-of-place clipping or casting): that tensor already contains the
        accumulated sum, which would then count twice; edit ``.grad`` in place or use the exact mode. Zeroing a view
        in place (``zero_grad(set_to_none=False)``) discards the accumulated sum, as it would in native PyTorch.

        :param batch_size: number of samples in this micro-batch, a positive integer
        :raises ValueError: if ``batch_size`` is not a positive integer
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int (samples in this micro-batch), got {batch_size!r}")
        if self._accumulators_used_in_step and self.warn:  # same warning as upstream's, once per round
            logger.warning(
                "[warn=True] Gradient accumulators were not reset since the last averaging round. Please "
                "call .reset_accumulated_grads_ after every step or use .step(reset_accumulators=True)"
            )
            self._accumulators_used_in_step = False  # warn once per round
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size  # upstream's weighting: micro-step i counts b_i / b_0
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
        else:
            self._accumulators.add_([param.grad for param in self.parameters], alpha=batch_size / self._anchor_batch_size)

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
        difference: before the accumulators are reset, this round's local gradients are kept on the host. If the
        round then fails (the all-reduce raises or times out), the next ``load_accumulators_into_averager_`` (which
        ``hivemind.Optimizer`` calls to "proceed with local gradients") restores them instead of loading the
        already-reset accumulators, so the epoch's local work is not lost. Extra cost: one host copy per round.
        """
        self._check_running("step")
        self._fallback_pending = False
        return super().step(
            weight=weight, reset_accumulators=reset_accumulators, control=control, timeout=timeout, wait=wait, **kwargs
        )

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs) -> StepControl:
        """as upstream's ``schedule_step``; raises a clear ``RuntimeError`` if the averager is not running"""
        self._check_running("schedule_step")
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
        """reset the accumulators (one ``zero_`` per bucket) and the micro-step counters"""
        if self._accumulators_used_in_step and self.keep_local_fallback:
            self._save_local_fallback()  # called by step(): the round's local gradients are in the averager
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None
        self._warned_unequal_batches = False
        if self.reuse_grad_buffers:
            for param, view in zip(self.parameters, self._accumulators.views):
                param.grad = view
        self._accumulators.zero_()

    def _save_local_fallback(self) -> None:
        if self._local_fallback is None:
            self._local_fallback = GradientBuckets(self.parameters, device="cpu")
        with self.get_tensors() as averaged_grads:  # once per round: one fused copy, whatever the buffers' layout
            torch._foreach_copy_(list(self._local_fallback.views), list(averaged_grads))
        self._fallback_pending = True

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        """
        Load locally accumulated gradients, divided by the number of micro-steps, into the averager's shared CPU
        buffers: one bulk copy (and one scale) per bucket. If the last ``step`` reset the accumulators and its
        result was not used yet (the round failed), load that round's local gradients instead.
        """
        if self._fallback_pending:
            logger.info("Averaging round was not used: loading this round's local gradients, kept since step()")
            self._fallback_pending = False
            with self.get_tensors() as averaged_grads:
                self._local_fallback.scaled_copy_to_(self._averaged_target(averaged_grads), 1.0)
            return
        if self.reuse_grad_buffers:
            self._attach_grads_()
        grad_scale = (1.0 / self.local_times_accumulated) if self.local_times_accumulated != 0 else 0.0
        with self.get_tensors() as averaged_grads:
            self._accumulators.scaled_copy_to_(self._averaged_target(averaged_grads), grad_scale)

    def notify_used_averaged_gradients(self):
        """Notify averager that the results of a previous averaging round are accounted for"""
        self._fallback_pending = False
        super().notify_used_averaged_gradients()

    def _averaged_target(self, averaged_grads: Sequence[torch.Tensor]):
        """the averager's buffers as a copy destination: flat buckets when this averager made them, else the list"""
        return self._averaged_buckets if self._averaged_buckets is not None else averaged_grads


def _check_averaged_grads(parameters: Sequence[torch.Tensor], averaged_grads: Sequence[torch.Tensor]) -> None:
    if len(averaged_grads) != len(parameters):
        raise ValueError(
            f"averaged_grads: expected one tensor per parameter ({len(parameters)}), got {len(averaged_grads)}"
        )
    for i, (param, grad) in enumerate(zip(parameters, averaged_grads)):
        if not isinstance(grad, torch.Tensor) or grad.shape != param.shape:
            got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(f"averaged_grads[{i}]: expected shape {tuple(param.shape)} (as parameters[{i}]), got {got}")
        if grad.device.type != "cpu":
            raise ValueError(f"averaged_grads[{i}]: must be on CPU to be shared with the averager, got {grad.device}")
