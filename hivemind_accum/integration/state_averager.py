"""
:class:`hivemind.optim.state_averager.TrainingStateAverager` that keeps inf and NaN out of parameter (state) averaging.

Upstream all-reduces parameters, chosen optimizer statistics and extra tensors as they are: one peer whose parameters
became NaN makes every member of its group NaN at the next state averaging round, and a peer's download of the
state (``load_state_from_peers``) copies whatever it receives. This subclass changes three hooks, each around
upstream's own code:

- ``_run_allreduce_inplace_`` (in the averager's background process, once per round): keeps a copy of this peer's
  tensors, offers non-finite ones as zeros with weight 0 and, if the round's result is not finite, restores the copy
  (see :class:`hivemind_accum.rounds.finite.RoundGuard`); a peer asked to hold back (:meth:`hold_back`) also
  joins with weight 0 and takes the others' average;
- ``get_current_state``: refuses to share a state that is not finite (the downloading peer then tries the next one);
- ``load_state_from_peers`` (through :class:`_FiniteStateDownloads`, placed between upstream's class and
  :class:`hivemind.averaging.DecentralizedAverager` in the method resolution order): discards a downloaded state
  that is not finite.
"""
import ctypes
import multiprocessing as mp
from typing import Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim import state_averager as upstream
from hivemind.utils import get_logger

from hivemind_accum.rounds.finite import RoundGuard, all_finite

logger = get_logger(__name__)


class _FiniteStateDownloads(DecentralizedAverager):
    """``load_state_from_peers`` of :class:`DecentralizedAverager` that discards a state holding inf or NaN"""

    def load_state_from_peers(self, wait: bool = True, timeout=None):
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if wait and loaded is not None and not all_finite(loaded[1]):
            logger.warning("The state downloaded from a peer holds inf or NaN: keeping this peer's own state")
            return None
        return loaded


class TrainingStateAverager(upstream.TrainingStateAverager, _FiniteStateDownloads):
    """
    :class:`hivemind.optim.state_averager.TrainingStateAverager` (same arguments) whose averaging rounds never take or
    offer inf or NaN:

    - a peer whose parameters or optimizer statistics hold inf/NaN joins the all-reduce with zeros and weight 0;
    - a non-finite averaged result is not taken: the peer keeps its own tensors;
    - after :meth:`hold_back` the next round is joined with weight 0;
    - a non-finite state is neither shared with a downloading peer nor taken from one (docs/guide.md#non-finite-peers).
    """

    def __init__(self, **kwargs):
        self.round_guard = RoundGuard("parameters and optimizer statistics")
        self._hold_back = mp.RawValue(ctypes.c_bool, False)  # set by the training process, read by the averager's
        super().__init__(**kwargs)

    def hold_back(self) -> None:
        """join the next averaging round with weight 0 (and take the others' average), e.g. after skipping an
        optimizer step that the others took; cleared once a round completes (not by a round that fails)"""
        self._hold_back.value = True

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info, group_id=None, **kwargs):
        """the all-reduce of :class:`DecentralizedAverager`, guarded (runs in the averager's background process,
        the tensors locked)"""
        guard = self.round_guard
        guard.snapshot(tensors)  # before offer_ may zero them: a peer whose values are not finite keeps them so
        if not guard.offer_(tensors) or self._hold_back.value:
            kwargs["weight"] = 0.0
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        except BaseException:
            if not guard.own_finite:
                guard.restore_(tensors)  # zeros that no round replaced must not pass for this peer's state
            raise
        guard.accept_(tensors)
        self._hold_back.value = False  # held back for one completed round (if every member held back, the result is
        # 0 / 0 and each keeps its own values: holding back again would repeat that forever)

    def get_current_state(self):
        """upstream's state for a downloading peer; raises if it holds inf or NaN, so that peer tries the next one"""
        metadata, tensors, infos = super().get_current_state()
        if not all_finite(tensors):
            raise RuntimeError("Not sharing this peer's state: its parameters or optimizer statistics hold inf or NaN")
        return metadata, tensors, infos
