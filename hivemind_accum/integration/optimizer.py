"""
:class:`hivemind.Optimizer` that builds this package's averagers and progress tracker: wiring only. Its step's loss
scaling is :mod:`~hivemind_accum.integration.loss_scaling`'s, its round hooks (which gradients each step uses)
:mod:`~hivemind_accum.integration.round_steps`'s, and its workarounds for hivemind 1.1.12
:mod:`~hivemind_accum.integration.workarounds`'.
"""
import inspect
from typing import Optional

from hivemind.dht import DHT
from hivemind.optim import optimizer as upstream
from hivemind.optim.grad_averager import GradientAveragerFactory
from hivemind.optim.state_averager import ZERO_GRAD_SET_TO_NONE_DEFAULT
from hivemind.utils import get_logger

from hivemind_accum.arguments import check_distinct, is_positive_int, named_params, params_as_lists
from hivemind_accum.integration import workarounds
from hivemind_accum.integration.grad_averager import GradientAverager
from hivemind_accum.integration.loss_scaling import LossScaledSteps
from hivemind_accum.integration.progress_tracker import ProgressTracker
from hivemind_accum.integration.round_steps import RoundSteps
from hivemind_accum.integration.state_averager import TrainingStateAverager
from hivemind_accum.torch_compat import foreach_zero_

logger = get_logger(__name__)


class Optimizer(LossScaledSteps, RoundSteps, upstream.Optimizer):
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
        if batch_size_per_step is not None and not is_positive_int(batch_size_per_step):
            raise ValueError(
                f"batch_size_per_step: expected a positive int (samples per micro-step) or None (then pass "
                f"batch_size= to every step()), got {batch_size_per_step!r}"
            )
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
        self._init_loss_scaling()

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

    def _bind_offloaded_grads(self, grad_averager) -> None:
        """offloaded: each optimizer parameter's ``.grad`` is its averaged buffer where the dtypes match, or, where the
        dtypes differ (fp16/bf16 averaged buffers, float32 optimizer parameters), a float32 tensor of its own that
        :meth:`_load_gradients_into_optimizer_` fills once per round (``workarounds.bind_offloaded_grads``)"""
        with grad_averager.get_tensors() as averaged_grads:
            self._offloaded_grad_copies = workarounds.bind_offloaded_grads(
                self.state_averager.optimizer.param_groups, averaged_grads
            )
