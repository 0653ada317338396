"""
A WARNING, once per averager, when a peer of another schema is met.

Peers average only if their averaged tensors have the same shapes and dtypes (hivemind's schema hash); otherwise
matchmaking refuses the group request with ``BAD_SCHEMA_HASH`` and hivemind logs it at DEBUG level only, so a swarm
that mixes ``averaged_grads_dtype`` choices never averages, silently. Both sides of a refused request are seen here:
the peer asked to lead (from the request, whose schema hash it compares with the other ``averaged_grads_dtype``'s)
and the peer that asked (from hivemind's DEBUG message, read by a logging filter in the averager's process).
"""
import logging
import re
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.averager import compute_schema_hash
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from hivemind_accum.buffers.buckets import LOW_PRECISION, wide_dtype

logger = get_logger(__name__)

MATCHMAKING_LOGGER = "hivemind.averaging.matchmaking"
_REJECTED = re.compile(r"requested (\S+) to be my leader, but got rejected with BAD_SCHEMA_HASH")


class SchemaMismatchLogger:
    """
    Logs the WARNING, once per averager (not a :class:`Warning`: it goes to the log, as hivemind's messages do).

    :param parameters: the averager's parameters
    :param averaged_grads: the tensors it all-reduces
    :param averaged_grads_dtype: its ``averaged_grads_dtype`` (None or ``torch.float32``)
    :param custom: whether ``averaged_grads`` were given by the user (then no other choice is computed)
    """

    def __init__(
        self,
        parameters: Sequence[torch.Tensor],
        averaged_grads: Sequence[torch.Tensor],
        averaged_grads_dtype: Optional[torch.dtype],
        custom: bool = False,
    ):
        low = sorted({str(param.dtype).replace("torch.", "") for param in parameters if param.dtype in LOW_PRECISION})
        self.low_precision = "/".join(low)
        self.mine = averaged_grads_dtype
        self.other_hash = None
        if low and not custom:  # the schema hash the other choice gives: zero-stride tensors, nothing allocated
            upcast_other = averaged_grads_dtype is None
            self.other_hash = compute_schema_hash([
                torch.empty_strided(
                    grad.shape, (0,) * grad.dim(), dtype=wide_dtype(param.dtype) if upcast_other else param.dtype
                )
                for param, grad in zip(parameters, averaged_grads)
            ])
        self.warned = False

    def _choice(self, dtype: Optional[torch.dtype]) -> str:
        if dtype is None:
            return f"in {self.low_precision} (averaged_grads_dtype=None, the default)"
        return "in float32 (averaged_grads_dtype=torch.float32)"

    def report(self, peer, their_hash: Optional[bytes] = None) -> None:
        """log the WARNING for ``peer`` unless this averager did already"""
        if self.warned:
            return
        self.warned = True
        if their_hash is not None and their_hash == self.other_hash:
            other = None if self.mine is not None else torch.float32
            logger.warning(
                f"Gradient averaging: peer {peer} averages {self.low_precision} gradients {self._choice(other)}, this "
                f"peer {self._choice(self.mine)}: they never average together (BAD_SCHEMA_HASH). Give every peer the "
                f"same averaged_grads_dtype of hivemind_accum.GradientAverager"
            )
            return
        mine = f"; this peer averages {self.low_precision} gradients {self._choice(self.mine)}"
        mine = mine if self.low_precision else ""
        logger.warning(
            f"Gradient averaging: peer {peer} has averaged tensors of other shapes, dtypes or compression: they never "
            f"average together (BAD_SCHEMA_HASH){mine}. With fp16/bf16 parameters every peer needs the same "
            f"averaged_grads_dtype of hivemind_accum.GradientAverager (None, the default, keeps the parameters' dtype)"
        )

    def watch_follower_side(self) -> None:
        """in the averager's process: read hivemind's DEBUG message for a request refused with ``BAD_SCHEMA_HASH``
        (records below the level that was in effect are dropped here, so nothing else is logged than before)"""
        matchmaking = logging.getLogger(MATCHMAKING_LOGGER)
        matchmaking.addFilter(_RefusedRequests(self, threshold=matchmaking.getEffectiveLevel()))
        if matchmaking.getEffectiveLevel() > logging.DEBUG:
            matchmaking.setLevel(logging.DEBUG)


class _RefusedRequests(logging.Filter):
    def __init__(self, warning: SchemaMismatchLogger, threshold: int):
        super().__init__()
        self.warning, self.threshold = warning, threshold

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG and not self.warning.warned:
            refused = _REJECTED.search(record.getMessage())
            if refused is not None:
                self.warning.report(refused.group(1))
        return record.levelno >= self.threshold


class ReportsSchemaMismatch(DecentralizedAverager):
    """the hooks of an averager that logs a :class:`SchemaMismatchLogger` (its ``_schema_mismatch``) from both sides of
    a request refused with ``BAD_SCHEMA_HASH``"""

    _schema_mismatch: SchemaMismatchLogger

    def _run_internal(self):
        """the averager's background process: also watch matchmaking for peers of another schema"""
        self._schema_mismatch.watch_follower_side()
        super()._run_internal()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """the reply to a group request; one refused for its schema hash is reported once
        (:class:`SchemaMismatchLogger`)"""
        async for response in super().rpc_join_group(request, context):
            if response.code == averaging_pb2.BAD_SCHEMA_HASH:
                self._schema_mismatch.report(context.remote_id, request.schema_hash)
            yield response
