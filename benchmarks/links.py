"""
Rate-limited links between benchmark processes: each process gets a network namespace of its own, joined to the
others by a bridge in a hub namespace, one veth pair per process. Both ends of every veth shape their egress with
``tc``'s token bucket filter (tbf), so each process's link is limited to the rate in both directions. Only these
namespaces hold the addresses (10.73.0.0/24); the root namespace is not touched. Needs Linux, root and iproute2.

    with Links(["bootstrap", "peer0", "peer1"], mbit=1) as links:
        # in a forked child, before it starts hivemind:
        enter_namespace(links.namespace["peer0"]); host = links.address["peer0"]
"""
import atexit
import ctypes
import os
import shutil
import subprocess
from typing import Dict, List

CLONE_NEWNET = 0x40000000
SUBNET = "10.73.0"
LATENCY_MS = 100.0  # tbf's queue: a packet that would wait longer than this for tokens is dropped
MIN_BURST_BYTES = 4096  # tbf's bucket: at least a few full-size (1514-byte) frames


class LinksUnavailable(RuntimeError):
    pass


def burst_bytes(mbit: float) -> int:
    """tbf's bucket size: 10 ms at the rate, at least MIN_BURST_BYTES"""
    return max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 * 0.01))


def tbf_args(mbit: float, latency_ms: float = LATENCY_MS) -> List[str]:
    return ["tbf", "rate", f"{mbit * 1000:g}kbit", "burst", str(burst_bytes(mbit)), "latency", f"{latency_ms:g}ms"]


def _run(*command: str, hint: str = "") -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinksUnavailable(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.returncode}; {hint}".rstrip("; "))


class Links:
    """the namespaces and links for ``names``, removed on exit from the ``with`` block or of the interpreter"""

    def __init__(self, names: List[str], mbit: float, latency_ms: float = LATENCY_MS):
        assert 0 < len(names) < 250 and mbit > 0
        self.names, self.mbit, self.latency_ms = list(names), mbit, latency_ms
        self.prefix = f"hmlink{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.namespace: Dict[str, str] = {name: f"{self.prefix}-{i}" for i, name in enumerate(self.names)}
        self.address: Dict[str, str] = {name: f"{SUBNET}.{i + 2}" for i, name in enumerate(self.names)}
        self._created: List[str] = []

    def settings(self) -> dict:
        return dict(mbit=self.mbit, burst_bytes=burst_bytes(self.mbit), latency_ms=self.latency_ms,
                    qdisc=" ".join(tbf_args(self.mbit, self.latency_ms)), namespaces=self.namespace)

    def __enter__(self) -> "Links":
        check_available()
        atexit.register(self.remove)
        try:
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "hub", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "hub", "up")
            tbf = tbf_args(self.mbit, self.latency_ms)
            for i, name in enumerate(self.names):
                namespace, hub_end = self.namespace[name], f"to{i}"
                self._add_namespace(namespace)
                _run("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "veth",
                     "netns", namespace)
                _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "hub", "up")
                _run("ip", "-n", namespace, "addr", "add", f"{self.address[name]}/24", "dev", "veth")
                _run("ip", "-n", namespace, "link", "set", "veth", "up")
                _run("tc", "-n", namespace, "qdisc", "add", "dev", "veth", "root", *tbf, hint=TBF_HINT)
                _run("tc", "-n", self.hub, "qdisc", "add", "dev", hub_end, "root", *tbf, hint=TBF_HINT)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def _add_namespace(self, namespace: str) -> None:
        _run("ip", "netns", "add", namespace, hint="Is iproute2's `ip netns` usable here (root, /run writable)?")
        self._created.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def remove(self) -> None:
        """delete every namespace created (their veth ends go with them); safe to call more than once"""
        while self._created:
            subprocess.run(["ip", "netns", "delete", self._created.pop()], capture_output=True)
        atexit.unregister(self.remove)


TBF_HINT = "The kernel needs the tbf qdisc (sch_tbf)."


def check_available() -> None:
    """raise LinksUnavailable naming what is missing: root, `ip`, `tc` (tbf is checked when the first link is made)"""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinksUnavailable(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise LinksUnavailable("network namespaces and tc need root: run as root (e.g. with sudo)")


def enter_namespace(namespace: str) -> None:
    """move the calling thread, and so every process it starts later, into ``ip netns`` namespace ``namespace``"""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)
