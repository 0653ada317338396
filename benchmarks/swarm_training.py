"""
hivemind's own optimizer benchmark setting, run for upstream hivemind and for ``hivemind_accum`` side by side.

A swarm of peers on loopback (one of them in client mode), each its own process with a fixed random micro-batch
size and short random pauses between micro-batches, trains a 2-layer MLP (64-64-10) on scikit-learn's digits with
``hivemind.Optimizer`` in hivemind's benchmark defaults: ``reuse_grad_buffers=True``, ``delay_grad_averaging=True``,
``delay_optimizer_step=True``, ``average_state_every=1``, SGD with ``StepLR``. After the last epoch the main peer's
parameters are scored by their cross-entropy on the whole data set. Each (implementation, seed) pair is a fresh
swarm; implementations alternate within a seed, so machine load affects both alike.

    python -m benchmarks.swarm_training --seeds 5                     # in place, delayed gradient averaging
    python -m benchmarks.swarm_training --seeds 5 --no-delay          # delay_grad_averaging=False
    python -m benchmarks.swarm_training --seeds 3 --exact             # reuse_grad_buffers=False
    python -m benchmarks.swarm_training --seeds 2 --instance          # an optimizer instance: not offloaded, no delay
    python -m benchmarks.swarm_training --seeds 3 --link-mbit 1       # each peer behind a 1 Mbit/s link (root)

With ``--link-mbit`` each peer, and the bootstrap DHT, runs in a network namespace of its own behind a link
rate-limited both ways (``benchmarks/links.py``, docs/measurement.md#swarms).

Writes a JSON with every run (final loss, per-peer round counts: began, averaged, fell back to local gradients,
state downloads; round durations; the micro-steps no optimizer step used, split into dropped by a state download,
unfinished and lost) to ``--output`` and prints the medians.
"""
import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import links

IMPLEMENTATIONS = ("upstream", "hivemind_accum")


@dataclass(frozen=True)
class SwarmConfig:
    seed: int = 0
    implementation: str = "upstream"
    num_peers: int = 4
    num_clients: int = 1
    target_batch_size: int = 96
    reuse_grad_buffers: bool = True
    delay_grad_averaging: bool = True
    optimizer_instance: bool = False  # hivemind.Optimizer(optimizer=SGD(...)): not offloaded, no delayed step
    average_state_every: int = 1
    lr: float = 0.1
    lr_gamma: float = 0.1
    lr_step_size: int = 10
    epochs: int = 30
    batch_size_min: int = 2
    batch_size_max: int = 16
    batch_time_min: float = 0.05
    batch_time_max: float = 0.25
    batch_time_std: float = 0.02
    matchmaking_time: float = 1.0
    averaging_timeout: float = 5.0
    max_refresh_period: float = 1.0
    winddown_time: float = 2.0
    link_mbit: Optional[float] = None  # each peer in a network namespace of its own, its link shaped both ways
    link_latency_ms: float = links.LATENCY_MS


def load_digits_tensors():
    """scikit-learn's bundled digits (1797 x 64, 10 classes), standardized as hivemind's benchmark does MNIST"""
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.as_tensor(digits.data, dtype=torch.float32)
    features = (features - features.mean()) / features.std()
    return features, torch.as_tensor(digits.target, dtype=torch.int64)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


PROBE_SLOTS = 2048  # per peer: micro-steps whose gradient the probe can tell apart


class Probe(nn.Module):
    """
    A parameter that tells which micro-steps an optimizer step used: micro-step ``j`` of peer ``p`` adds
    ``probe[p * PROBE_SLOTS + j]`` to its loss, so its gradient is that one-hot vector; nothing else depends on it.
    The probe's ``.grad`` at each optimizer step then says, per micro-step, with which weight it was used.
    """

    def __init__(self, num_peers: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_peers * PROBE_SLOTS))

    def forward(self, peer: int, micro_step: int) -> torch.Tensor:
        return self.weight[peer * PROBE_SLOTS + min(micro_step, PROBE_SLOTS - 1)]


def record_optimizer_steps(opt, probe_index: int) -> List[torch.Tensor]:
    """the probe's gradient at every optimizer step of ``opt`` (its torch optimizer's ``.grad``, read by a step
    pre-hook in whichever thread steps)"""
    steps = []

    def record(optimizer, args, kwargs):
        steps.append(optimizer.param_groups[0]["params"][probe_index].grad.detach().clone())

    opt.state_averager.optimizer.register_step_pre_hook(record)
    return steps


class RoundLog:
    """
    What ``hivemind.Optimizer`` did at this peer's epoch boundaries, recorded by wrapping its bound methods:
    rounds begun (with the weight handed to each), rounds whose result was loaded, fallbacks to local gradients (and
    why), state downloads, the time spent in ``_update_global_epoch``, and each round's duration (from its hand-off to
    its result or fallback being loaded).

    The accumulation window: the micro-steps since the last hand-off (``grad_averager.step``) or reset of the
    accumulators. ``dropped`` lists the micro-steps in the window when a state download began: hivemind resets the
    accumulators after the download, and the micro-step that detected it never accumulates. The training loop sets
    ``micro_step`` to the index of the micro-step it is in.
    """

    def __init__(self, opt):
        self.counts = dict(began=0, averaged=0, local_fallback=0, downloads=0)
        self.weights: List[int] = []
        self.fallback_reasons: Dict[str, int] = {}
        self.transition_s = 0.0
        self.round_s: List[float] = []
        self.micro_step = self.window_start = 0
        self.dropped: List[int] = []
        self._wrap(opt, "_load_averaged_gradients_into_optimizer_", lambda *_: self._count("averaged"))
        self._wrap(opt, "_load_local_gradients_into_optimizer", lambda *_: self._count("local_fallback"))
        self._wrap(opt, "load_state_from_peers", lambda *_: (
            self._count("downloads"), self.dropped.extend(range(self.window_start, self.micro_step + 1))))
        self._wrap(opt.grad_averager, "reset_accumulated_grads_", lambda *_: self._new_window())
        average, update, begin = opt._average_gradients_and_load_into_optimizer, opt._update_global_epoch, \
            opt.grad_averager.step
        began_at: Dict[int, float] = {}

        def timed_begin(*args, **kwargs):
            self._count("began")
            self.weights.append(opt.grad_averager.local_samples_accumulated)
            self._new_window()
            control = begin(*args, **kwargs)
            began_at[id(control)] = time.perf_counter()
            return control

        def explained_average(control):
            fallbacks = self.counts["local_fallback"]
            result = average(control)
            if id(control) in began_at:
                self.round_s.append(time.perf_counter() - began_at.pop(id(control)))
            if self.counts["local_fallback"] > fallbacks:
                reason = "no round" if control is None else (
                    type(control.exception()).__name__ if control.done() and control.exception() else "not done")
                self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
            return result

        def timed_update(*args, **kwargs):
            started = time.perf_counter()
            try:
                return update(*args, **kwargs)
            finally:
                self.transition_s += time.perf_counter() - started

        opt._average_gradients_and_load_into_optimizer, opt._update_global_epoch = explained_average, timed_update
        opt.grad_averager.step = timed_begin

    def _new_window(self) -> None:
        self.window_start = self.micro_step + 1

    def _count(self, key: str) -> None:
        self.counts[key] += 1

    @staticmethod
    def _wrap(obj, name: str, before) -> None:
        method = getattr(obj, name)

        def wrapped(*args, **kwargs):
            before()
            return method(*args, **kwargs)

        setattr(obj, name, wrapped)


def split_unused(uses: List[int], dropped: List[int], final_window_start: int) -> Dict[str, int]:
    """
    The micro-steps no optimizer step used (``uses[j] == 0``), by why: dropped by a state download (in ``dropped``),
    unfinished (from ``final_window_start`` on: accumulated after the peer's last hand-off or reset, never handed to a
    round), and lost (every other one). The three add up to the number of zeros in ``uses``.
    """
    dropped, unused = set(dropped), [j for j, used in enumerate(uses) if used == 0]
    download = sum(j in dropped for j in unused)
    unfinished = sum(j not in dropped and j >= final_window_start for j in unused)
    return dict(download=download, unfinished=unfinished, lost=len(unused) - download - unfinished)


def isolate(link: Optional[links.Links], name: str) -> Dict[str, Any]:
    """
    Called first in each forked process: a process group of its own, which ``run_swarm`` kills at the end, so no
    DHT, averager or p2pd process outlives the swarm. In link mode, enter this process's namespace (before hivemind
    starts a thread or its daemon). Returns the DHT's options: in link mode, listen on the namespace's address only.
    """
    os.setpgid(0, 0)
    if link is None:
        return {}
    links.enter_namespace(link.namespace[name])
    return dict(host_maddrs=[f"/ip4/{link.address[name]}/tcp/0"])


def run_bootstrap(link: Optional[links.Links], maddrs, stop) -> None:
    options = isolate(link, "bootstrap")
    import hivemind

    dht = hivemind.DHT(start=True, **options)
    maddrs.put([str(maddr) for maddr in dht.get_visible_maddrs()])
    stop.wait()
    dht.shutdown()


def run_peer(config: SwarmConfig, index: int, initial_peers, results, link: Optional[links.Links] = None) -> None:
    options = isolate(link, f"peer{index}")
    import hivemind

    import hivemind_accum

    # hivemind_accum.Optimizer (every change of the package, its progress tracker included) or upstream's
    optimizer_cls = hivemind_accum.Optimizer if config.implementation == "hivemind_accum" else hivemind.Optimizer
    torch.set_num_threads(1)
    rng = random.Random(config.seed * 1000 + index)
    batch_size = rng.randint(config.batch_size_min, config.batch_size_max)
    batch_time = rng.uniform(config.batch_time_min, config.batch_time_max)
    client_mode = index >= config.num_peers - config.num_clients
    features, targets = load_digits_tensors()
    model = make_model(config.seed)
    probe = Probe(config.num_peers)
    generator = torch.Generator().manual_seed(config.seed * 1000 + index)
    dht = hivemind.DHT(initial_peers=initial_peers, client_mode=client_mode, start=True, **options)
    params = [*model.parameters(), probe.weight]
    scheduler = partial(torch.optim.lr_scheduler.StepLR, gamma=config.lr_gamma, step_size=config.lr_step_size)
    if config.optimizer_instance:  # hivemind's most common setup; it admits no offload and no delayed step
        sgd = torch.optim.SGD(params, lr=config.lr)
        optimizer = dict(optimizer=sgd, scheduler=scheduler(sgd), delay_grad_averaging=False, delay_optimizer_step=False)
    else:
        optimizer = dict(params=params, optimizer=partial(torch.optim.SGD, lr=config.lr), scheduler=scheduler,
                         delay_grad_averaging=config.delay_grad_averaging, delay_optimizer_step=True)
    opt = optimizer_cls(
        dht=dht, run_id=f"swarm_{config.implementation}_{config.seed}", target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size, tracker_opts=dict(max_refresh_period=config.max_refresh_period),
        matchmaking_time=config.matchmaking_time, averaging_timeout=config.averaging_timeout,
        reuse_grad_buffers=config.reuse_grad_buffers, average_state_every=config.average_state_every,
        client_mode=client_mode, **optimizer,
    )
    log = RoundLog(opt)
    probe_steps = record_optimizer_steps(opt, probe_index=len(list(model.parameters())))
    micro_steps, started = 0, time.perf_counter()
    prev_time = time.perf_counter()
    while opt.local_epoch < config.epochs:
        log.micro_step = micro_steps
        time.sleep(max(0.0, prev_time + rng.gauss(batch_time, config.batch_time_std) - time.perf_counter()))
        batch = torch.randint(0, len(features), (batch_size,), generator=generator)
        (F.cross_entropy(model(features[batch]), targets[batch]) + probe(index, micro_steps)).backward()
        opt.step()
        if not config.reuse_grad_buffers:
            opt.zero_grad()
        micro_steps += 1
        prev_time = time.perf_counter()
    seconds, final_window_start = time.perf_counter() - started, log.window_start
    time.sleep(config.winddown_time)
    opt.state_averager.step(wait_for_delayed_updates=True)
    with torch.no_grad():
        loss = F.cross_entropy(model(features), targets).item()
        finite = all(bool(param.isfinite().all()) for param in model.parameters())
    own = torch.stack(probe_steps)[:, index * PROBE_SLOTS: index * PROBE_SLOTS + min(micro_steps, PROBE_SLOTS)]
    uses = (own != 0).sum(0)  # per micro-step: in how many optimizer steps of this peer it was used
    report = dict(
        used=[int((uses == k).sum()) for k in range(4)], optimizer_steps=len(probe_steps),
        unused=split_unused(uses.tolist(), log.dropped, final_window_start), dropped_by_download=log.dropped,
        final_window_start=final_window_start, round_s=log.round_s,
        index=index, batch_size=batch_size, client_mode=client_mode, micro_steps=micro_steps, seconds=seconds,
        epoch=opt.local_epoch, loss=loss, finite=finite, weights=log.weights, transition_s=log.transition_s, fallback_reasons=log.fallback_reasons,
        **log.counts,
    )
    results.put(pickle.dumps(report))
    opt.shutdown()
    dht.shutdown()


def kill_group(process) -> None:
    """kill a forked process and every process it started (its group, see ``isolate``)"""
    if process.is_alive():
        process.kill()
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def run_swarm(config: SwarmConfig, timeout: float = 300.0) -> Dict[str, Any]:
    names = ["bootstrap", *(f"peer{index}" for index in range(config.num_peers))]
    link = None if config.link_mbit is None else links.Links(names, config.link_mbit, config.link_latency_ms)
    ctx = mp.get_context("fork")
    results, maddrs, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    bootstrap = ctx.Process(target=run_bootstrap, args=(link, maddrs, stop))
    peers = []
    reports = []
    with link or contextlib.nullcontext():
        try:
            bootstrap.start()
            initial_peers = maddrs.get(timeout=60)
            peers = [ctx.Process(target=run_peer, args=(config, index, initial_peers, results, link))
                     for index in range(config.num_peers)]
            for peer in peers:
                peer.start()
            deadline = time.monotonic() + timeout
            while len(reports) < len(peers) and time.monotonic() < deadline:
                try:
                    reports.append(pickle.loads(results.get(timeout=5)))
                except Exception:
                    if not any(peer.is_alive() for peer in peers):
                        break
            for peer in peers:
                peer.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            stop.set()
            bootstrap.join(timeout=10)
            for process in [*peers, bootstrap]:
                kill_group(process)
    reports.sort(key=lambda report: report["index"])
    main = next((report for report in reports if report["index"] == 0), None)
    return dict(
        config=asdict(config), link=link and link.settings(), peers=reports, complete=len(reports) == config.num_peers,
        exit_codes=[peer.exitcode for peer in peers], loss=main["loss"] if main else None,
    )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="swarms per implementation (seeds 0..N-1)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-delay", action="store_true", help="delay_grad_averaging=False")
    parser.add_argument("--exact", action="store_true", help="reuse_grad_buffers=False")
    parser.add_argument("--instance", action="store_true",
                        help="an optimizer instance (not offloaded, no delayed step or averaging)")
    parser.add_argument("--epochs", type=int, default=SwarmConfig.epochs)
    parser.add_argument("--averaging-timeout", type=float, default=SwarmConfig.averaging_timeout,
                        help="hivemind.Optimizer's averaging_timeout, seconds")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="each peer in a network namespace of its own, its link limited to this rate both ways "
                             "(tc tbf; needs root and iproute2)")
    parser.add_argument("--output", default=None, help="JSON path (default: a file in the temporary directory)")
    return parser.parse_args(argv)


def summarize(runs: List[Dict[str, Any]], implementations) -> str:
    """one line per implementation: median final loss, then what the swarm's rounds and optimizer steps did"""
    lines = ["implementation   median loss  losses by seed                  micro-steps used 0/1/2 times  "
             "unused: download/unfinished/lost  rounds began  local fallbacks  state downloads  median round s"]
    for implementation in implementations:
        mine = [run for run in runs if run["config"]["implementation"] == implementation and run["loss"] is not None]
        if not mine:
            continue
        peers = [peer for run in mine for peer in run["peers"]]
        used = "/".join(str(sum(peer["used"][k] for peer in peers)) for k in range(3))
        unused = "/".join(str(sum(peer["unused"][why] for peer in peers)) for why in ("download", "unfinished", "lost"))
        round_s = [seconds for peer in peers for seconds in peer["round_s"]]
        round_s = f"{statistics.median(round_s):14.2f}" if round_s else f"{'-':>14s}"
        losses = ", ".join(f"{run['loss']:.3f}" for run in mine)
        lines.append(
            f"{implementation:16s} {statistics.median(run['loss'] for run in mine):11.3f}  {losses:30s}  {used:28s}  "
            f"{unused:32s}  "
            f"{sum(peer['began'] for peer in peers):12d}  {sum(peer['local_fallback'] for peer in peers):15d}  "
            f"{sum(peer['downloads'] for peer in peers):15d}  {round_s}"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    base = SwarmConfig(epochs=args.epochs, delay_grad_averaging=not args.no_delay, reuse_grad_buffers=not args.exact,
                       optimizer_instance=args.instance, link_mbit=args.link_mbit,
                       averaging_timeout=args.averaging_timeout)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for implementation in args.implementations:
            started = time.perf_counter()
            try:
                run = run_swarm(replace(base, seed=seed, implementation=implementation))
            except links.LinksUnavailable as error:
                sys.exit(f"--link-mbit: {error}")
            run["wall_s"] = time.perf_counter() - started
            runs.append(run)
            loss = f"{run['loss']:.3f}" if run["loss"] is not None else "none (the main peer did not report)"
            print(f"seed {seed} {implementation:15s} loss {loss}, {run['wall_s']:.0f} s, every peer exited 0: "
                  f"{run['complete'] and run['exit_codes'] == [0] * base.num_peers}", flush=True)
    output = args.output or os.path.join(os.environ.get("TMPDIR", "/tmp"), "swarm_training.json")
    with open(output, "w") as file:
        json.dump(dict(command=" ".join(["python -m benchmarks.swarm_training", *(argv or sys.argv[1:])]), runs=runs),
                  file, indent=1)
    print(summarize(runs, args.implementations))
    print(f"every run: {output}")


if __name__ == "__main__":
    main()
