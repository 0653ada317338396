"""The five modes the main job compares, how it builds their optimizers, and how it runs its processes."""
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import hivemind
import torch
from torch import nn

import hivemind_accum
from benchmarks.micro_step_worker import report_configuration

REPO_ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("work", "training", "framework", "nonfinite")
CLIP_NORM = 1.0


@dataclass(frozen=True)
class Mode:
    """
    One accumulation mode.

    :param key: short name used in the JSON report
    :param label: the name printed in every row
    :param optimizer: ``"native"``, ``"upstream"`` (:class:`hivemind.Optimizer`) or ``"hivemind_accum"``
    :param reuse_grad_buffers: ``hivemind.Optimizer(reuse_grad_buffers=...)``
    """

    key: str
    label: str
    optimizer: str
    reuse_grad_buffers: bool

    @property
    def amp_scaler(self) -> Callable[[], torch.amp.GradScaler]:
        """the loss scaler this mode requires on CPU: hivemind.GradScaler with reuse_grad_buffers=True"""
        if self.reuse_grad_buffers:
            return lambda: hivemind.GradScaler("cpu")
        return lambda: torch.amp.GradScaler("cpu")


MODES = {
    mode.key: mode
    for mode in (
        Mode("native", "native", "native", False),
        Mode("upstream", "upstream", "upstream", False),
        Mode("upstream_reuse", "upstream reuse", "upstream", True),
        Mode("exact", "accum exact", "hivemind_accum", False),
        Mode("inplace", "accum in place", "hivemind_accum", True),
    )
}
LEGEND = (
    "upstream: hivemind.Optimizer 1.1.12; accum: hivemind_accum.Optimizer; reuse, in place: reuse_grad_buffers=True\n"
    "x native: a micro-step's time over native's, so below 1 is faster than native\n"
    "Each claim prints accum's number, then 'vs' and the number of the upstream mode it names"
)


def make_optimizer(mode: Mode, dht: hivemind.DHT, run_id: str, model: nn.Module, **kwargs) -> hivemind.Optimizer:
    """
    A hivemind optimizer of ``mode`` in hivemind#566's configuration where the CPU allows.

    :param kwargs: the remaining :class:`hivemind.Optimizer` arguments (optimizer, batch sizes, timeouts)
    """
    optimizer_cls = hivemind.Optimizer if mode.optimizer == "upstream" else hivemind_accum.Optimizer
    return optimizer_cls(
        dht=dht, run_id=run_id, params=model.parameters(), reuse_grad_buffers=mode.reuse_grad_buffers,
        use_local_updates=False, **report_configuration(), **kwargs,
    )


def redirect_stderr(log_path: Optional[str]) -> None:
    """send this process's stderr (hivemind's log, its p2p daemon's output) to ``log_path``"""
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


def run_processes(label: str, targets: Sequence[Tuple[Callable, tuple]], timeout: float) -> List[Dict[str, Any]]:
    """
    Start one spawned process per ``(target, args)``, collect one result dict from each, and join them.

    Each target gets a shared result queue as its last argument.

    :param label: name of this group of processes in messages
    :param timeout: seconds to wait for all results
    :returns: the result dicts, in arrival order
    :raises RuntimeError: if a process reports an error, exits without a result or times out
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(*args, results), name=f"{label}-{i}")
        for i, (target, args) in enumerate(targets)
    ]
    for process in processes:
        process.start()
    collected, deadline = [], time.monotonic() + timeout
    try:
        while len(collected) < len(processes):
            try:
                result = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"[{label}] timed out after {timeout:.0f} s")
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"[{label}] {dead[0].name} exited with code {dead[0].exitcode}")
                continue
            if "error" in result:
                raise RuntimeError(f"[{label}] a process failed:\n{result['error']}")
            collected.append(result)
    finally:
        # after a failure the other peers see a broken barrier and shut their DHTs down themselves; terminating
        # them mid-shutdown would orphan their DHT and p2p daemon processes
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
                process.join()
    return collected
