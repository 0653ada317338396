import contextlib
import faulthandler
import gc
import os
import pickle
import random
import time
from typing import Any, Callable, Iterator, List, Optional

# set before torch is imported: torch.cuda.is_available() then asks NVML, which does not poison fork where the driver
# has NVML (elsewhere it falls back to cudaGetDeviceCount, which does: see NEEDS_CUDA)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import hivemind  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from hivemind.utils.mpfuture import MPFuture  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Skip conditions on CUDA, evaluated when a test sets up (for a @pytest.mark.forked test: in its own process), never
# at import. A CUDA call in the pytest process, torch.cuda.is_available() included, poisons fork: every later forked
# CUDA test then fails with "Cannot re-initialize CUDA in forked subprocess" (tests/test_cuda_at_import.py). Use them
# on forked tests only, in modules that import torch (the condition is evaluated in the test module's namespace).
NEEDS_CUDA = pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


class DispatchedOps(TorchDispatchMode):
    """records the aten operators dispatched while it is active, not those they call: ``ops`` (names such as
    ``"aten._foreach_add_.List"``). Unlike the profiler's parent links, which go by microsecond timestamps on torch 2.3,
    it never takes a nested op for a top-level one"""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """collects garbage first, then keeps the cyclic collector off inside: what a measured step reads on the host is
    its own, not that of an object the collector frees during it (hivemind's StepControl.__del__ reads its shared
    state with ``.item()``)"""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def seeded_random_state():
    """
    Every test starts from the same random state: torch's (CPU and CUDA), Python's ``random`` and numpy's, seeded
    with 0, in the process that runs the test (for a forked test: its child). Peers forked from it inherit torch's
    and numpy's state, so what they draw is the same at every run. Python's ``random`` is reseeded from the OS in
    every forked child (``os.register_at_fork``): a peer that needs reproducible draws from it uses its own
    ``random.Random(seed)``.
    """
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """poll ``condition`` every 0.05 s until it holds; raise ``TimeoutError`` naming ``what`` after ``timeout`` s"""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def send_by_value(channel, message: Any) -> None:
    """
    Send ``message`` from a peer process to the test through a ``multiprocessing`` queue or pipe connection, pickled
    by the standard pickler, so that its tensors travel as bytes. Sent as they are, torch's multiprocessing pickler
    passes each tensor as a shared-memory file (hivemind sets torch's ``file_system`` sharing strategy) that is
    removed when the sending process exits, which a peer may do before the test reads the message ("RuntimeError: No
    such file or directory" in the test). Read it with :func:`receive_by_value`.
    """
    data = pickle.dumps(message)
    channel.send_bytes(data) if hasattr(channel, "send_bytes") else channel.put(data)


def receive_by_value(channel, timeout: Optional[float] = None) -> Any:
    """
    Read a message sent with :func:`send_by_value`.

    :param channel: the queue or the pipe connection's reading end
    :param timeout: seconds to wait on a queue (a connection: poll it first)
    :raises queue.Empty: if a queue stays empty for ``timeout`` seconds
    """
    return pickle.loads(channel.recv_bytes() if hasattr(channel, "recv_bytes") else channel.get(timeout=timeout))


class MixedNet(nn.Module):
    """
    A small model with several layer kinds and two dtypes (two accumulator buckets on CPU): a sparse-gradient
    embedding, a channels_last convolution with batch norm, linear layers with layer norm, a float64 branch,
    a head that receives gradients only on some micro-steps and a frozen layer that never does.
    """

    def __init__(self, sparse_embedding: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(10, 6, sparse=sparse_embedding)
        self.conv = nn.Conv2d(2, 4, 3, padding=1).to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4 + 6, 5)
        self.norm = nn.LayerNorm(5)
        self.sometimes = nn.Linear(5, 5)
        self.double_branch = nn.Linear(5, 5).double()
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        features = self.bn(self.conv(images.contiguous(memory_format=torch.channels_last))).relu().flatten(1)
        hidden = self.norm(self.fc(torch.cat([features, self.embedding(tokens).mean(1)], dim=1)))
        if use_sometimes:
            hidden = hidden + self.sometimes(hidden).tanh()
        hidden = hidden + self.double_branch(hidden.double()).float()
        return self.frozen(hidden)


def mixed_batch(generator: torch.Generator, batch_size: int):
    images = torch.randn(batch_size, 2, 4, 4, generator=generator)
    tokens = torch.randint(0, 10, (batch_size, 3), generator=generator)
    targets = torch.randn(batch_size, 5, generator=generator)
    return images, tokens, targets


@contextlib.contextmanager
def swarm(num_peers: int, **dht_kwargs) -> Iterator[List[hivemind.DHT]]:
    """start ``num_peers`` DHT nodes on loopback (the first one is the initial peer), shut all of them down after"""
    dhts = [hivemind.DHT(start=True, **dht_kwargs)]
    try:
        for _ in range(num_peers - 1):
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True, **dht_kwargs))
        yield dhts
    finally:
        for dht in dhts:
            dht.shutdown()


@contextlib.contextmanager
def shutting_down(*averagers):
    try:
        yield averagers
    finally:
        for averager in averagers:
            if averager.is_alive():
                averager.shutdown()


PYTEST_PID = os.getpid()  # the pytest process; a forked test runs in a child of it


@pytest.fixture(autouse=True)
def forked_test_time_limit(request):
    """
    A forked test that runs within 10 s of its time limit (``@pytest.mark.timeout(s)``, else pytest.ini's ``timeout``)
    prints every thread's stack and exits, so pytest reports it as crashed and goes on. pytest-timeout's alarm rings in
    the pytest process instead, which is waiting for the child: it stops the whole run with an INTERNALERROR.
    """
    if os.getpid() == PYTEST_PID:
        yield
        return
    marker = request.node.get_closest_marker("timeout")
    try:
        limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout"))
    except (ValueError, TypeError):  # pytest-timeout left out (-p no:timeout): no ini option
        limit = 300.0
    faulthandler.dump_traceback_later(max(limit - 10, 1.0), exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def fresh_mpfuture_locks():
    """
    Each test starts with fresh process-shared locks in hivemind's MPFuture (``MPFuture.reset_backend()``, in the
    process that runs the test). They are created at import and inherited by every process forked later; a peer
    process stopped while it held one (``DHT.shutdown`` terminates a DHT that outlives its grace period) leaves it held,
    and every later DHT then hangs at start, in ``set_result`` of its ready future.
    """
    MPFuture.reset_backend()
    yield


@pytest.fixture
def dht():
    with swarm(1) as (node,):
        yield node


# a single peer's progress tracker that never re-fetches the swarm's progress from the DHT during a short test: a
# fetch can return this peer's own record from before its latest report and roll the global sample count back, which
# moves epoch boundaries by a few micro-steps on a loaded machine; alone, the local reports are the whole truth
SINGLE_PEER_TRACKER = dict(min_refresh_period=60, max_refresh_period=120, default_refresh_period=60)
