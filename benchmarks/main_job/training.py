"""
Sections 2 to 4 of the main job: two hivemind peers on loopback train the digits CNN in each mode.

The native baseline runs as two processes at once, as loaded as the two peers. How and why: docs/measurement.md.
"""
import multiprocessing as mp
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import hivemind
import torch
import torch.nn.functional as F

from benchmarks.main_job.common import CLIP_NORM, MODES, make_optimizer, redirect_stderr, run_processes
from benchmarks.main_job.digits import build_digits_cnn, evaluate_accuracy, peer_micro_batches
from benchmarks.main_job.probes import (
    LocalGradientCheck, count_averaged_rounds, settle_background_requests, wait_for_swarm,
)


@dataclass(frozen=True)
class TrainConfig:
    """
    One group of training processes (picklable for spawned processes).

    :param runs: ``(section, mode key)`` pairs each process trains one after the other: section ``"training"``
      (hivemind's own loop) or ``"framework"`` (clip, step, ``model.zero_grad()``); ``("native",)`` modes run alone
    :param num_peers: hivemind peers (native walks through every peer's micro-batches)
    :param micro_batch_size: samples per micro-batch (``batch_size_per_step``)
    :param epochs: optimizer steps each run takes (a hivemind run stops once its peers reach this epoch)
    :param micro_steps_per_epoch: micro-steps each peer contributes per epoch; sets ``target_batch_size``
    :param lr: learning rate of the Adam optimizer
    :param matchmaking_time: ``hivemind.Optimizer(matchmaking_time=...)``, seconds
    :param averaging_timeout: ``hivemind.Optimizer(averaging_timeout=...)``, seconds
    :param threads: ``torch.set_num_threads`` of each process
    :param seed: seed of the data split, the shards, the micro-batch order and the initial weights
    :param loss_window: number of last micro-batches (per peer) whose mean training loss is reported
    :param log_dir: folder receiving each process's stderr
    :param nonfinite_epochs: optimizer steps of each ``"nonfinite"`` run (section 4), whose last peer's loss is NaN
    :param verbose: peer 0 prints one line per run
    """

    runs: Tuple[Tuple[str, str], ...]
    num_peers: int
    micro_batch_size: int
    epochs: int
    micro_steps_per_epoch: int
    lr: float
    matchmaking_time: float
    averaging_timeout: float
    threads: int
    seed: int
    loss_window: int
    log_dir: str
    nonfinite_epochs: int = 4
    verbose: bool = False

    @property
    def target_batch_size(self) -> int:
        return self.num_peers * self.micro_steps_per_epoch * self.micro_batch_size

    def epochs_of(self, section: str) -> int:
        """optimizer steps a run of ``section`` takes"""
        return self.nonfinite_epochs if section == "nonfinite" else self.epochs

    def max_steps(self, section: str) -> int:
        """micro-steps after which a hivemind run of ``section`` stops even if its peers did not reach its epochs"""
        return 3 * self.epochs_of(section) * self.micro_steps_per_epoch


def run_label(section: str, key: str) -> str:
    return f"{section}: {MODES[key].label}"


def train_native(config: TrainConfig, results: mp.Queue) -> None:
    """
    Process target: native PyTorch accumulation over every peer's micro-batches, interleaved, ``K`` micro-batches per
    optimizer step (as many samples as the swarm's ``target_batch_size``), ``config.epochs`` optimizer steps:
    ``(loss / K).backward()``, then every ``K``-th micro-batch (framework loop: ``clip_grad_norm_``) ``opt.step()``
    and ``model.zero_grad()``.

    :param config: the run (one ``(section, "native")`` pair)
    :param results: queue receiving one dict (or ``{"error": traceback}``)
    """
    ((section, _),) = config.runs
    redirect_stderr(config.log_dir and os.path.join(config.log_dir, f"{section}_native.log"))
    try:
        torch.set_num_threads(config.threads)
        model = build_digits_cnn(config.seed)
        opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        accumulation_steps = config.target_batch_size // config.micro_batch_size
        steps = config.epochs * config.micro_steps_per_epoch
        streams = [peer_micro_batches(config, peer, steps) for peer in range(config.num_peers)]
        losses, optimizer_steps, started = [], 0, time.perf_counter()
        model.train()
        for batches in zip(*streams):
            for images, labels in batches:
                loss = F.cross_entropy(model(images), labels)
                (loss / accumulation_steps).backward()
                losses.append(loss.item())
                if len(losses) % accumulation_steps == 0:
                    if section == "framework":
                        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                    opt.step()
                    model.zero_grad()
                    optimizer_steps += 1
        results.put(dict(peer=0, runs=[dict(
            section=section, mode="native", train_s=time.perf_counter() - started, micro_steps=len(losses),
            final_loss=statistics.mean(losses[-config.loss_window * config.num_peers :]),
            test_accuracy=evaluate_accuracy(model, config.seed), epochs=optimizer_steps, averaged=None, grad_error=None,
        )]))
    except BaseException:
        results.put(dict(error=traceback.format_exc()))


def train_peer(config: TrainConfig, peer_index: int, bootstrap: mp.Queue, barrier, results: mp.Queue) -> None:
    """
    Process target: one hivemind peer (its own data shard) training each of ``config.runs`` in turn, each with a fresh
    DHT, model and optimizer, until its optimizer reaches ``config.epochs``; put a result dict. (A DHT outliving its
    optimizer can receive a request from the optimizer's averager process after that process exited, which kills the
    DHT's process: hence a DHT per run.)

    :param config: the runs
    :param peer_index: this peer's index; peer 0 starts each run's first DHT and sends its multiaddrs to the others
    :param bootstrap: queue carrying peer 0's visible multiaddrs (as strings) to every other peer
    :param barrier: a ``num_peers`` barrier: each run starts and ends together, DHTs shut down after every peer is done
    :param results: queue receiving one dict of measurements (or ``{"error": traceback}``)
    """
    redirect_stderr(os.path.join(config.log_dir, f"peer{peer_index}.log"))
    dht = opt = None
    try:
        mp.set_start_method("fork", force=True)  # hivemind's averagers are forked, as in an ordinary script
        torch.set_num_threads(config.threads)
        reports = []
        for section, key in config.runs:
            created = time.perf_counter()
            if peer_index == 0:
                dht = hivemind.DHT(start=True)
                for _ in range(config.num_peers - 1):
                    bootstrap.put([str(maddr) for maddr in dht.get_visible_maddrs()])
            else:
                dht = hivemind.DHT(initial_peers=bootstrap.get(timeout=120), start=True)
            mode, model = MODES[key], build_digits_cnn(config.seed)
            opt = make_optimizer(
                mode, dht, f"main_job_{section}_{key}", model,
                optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
                batch_size_per_step=config.micro_batch_size, target_batch_size=config.target_batch_size,
                matchmaking_time=config.matchmaking_time, averaging_timeout=config.averaging_timeout,
                # request_timeout: hivemind warns unless below matchmaking_time; target_group_size: a round begins
                # as soon as every peer has joined, instead of waiting out matchmaking_time
                averager_opts=dict(request_timeout=config.matchmaking_time / 2, target_group_size=config.num_peers),
                # two peers on loopback: fetch the swarm's progress often, so that a peer sees the epoch's end (and
                # the other peer, at the start) within a micro-step or two instead of hivemind's default 3 s
                tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=1.0, default_refresh_period=0.2),
            )
            stats = dict(averaged=0)
            count_averaged_rounds(opt, stats)
            check = LocalGradientCheck(model.parameters(), opt.grad_averager)
            model.train()
            barrier.wait(timeout=120)  # start each run together
            losses, started, swarm_wait, round_steps, no_sync_steps = [], time.perf_counter(), 0.0, [], []
            setup_seconds = started - created
            poisoned = section == "nonfinite" and peer_index == config.num_peers - 1
            micro_batches = peer_micro_batches(config, peer_index, config.max_steps(section))
            for step, (images, labels) in enumerate(micro_batches, 1):
                if section in ("training", "nonfinite") and not mode.reuse_grad_buffers:
                    opt.zero_grad()
                loss = F.cross_entropy(model(images), labels)
                if poisoned:
                    loss = loss * float("nan")  # every gradient of this peer is NaN
                check.before_backward()
                loss.backward()
                if section == "framework":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                check.record()
                epoch_before, step_started = opt.local_epoch, time.perf_counter()
                opt.step()
                (round_steps if opt.local_epoch != epoch_before else no_sync_steps).append(
                    time.perf_counter() - step_started
                )
                if section == "framework":
                    model.zero_grad()
                losses.append(loss.item())
                if step == 1:  # a peer publishes its progress only once it has accumulated samples: meet here
                    wait_started = time.perf_counter()
                    wait_for_swarm(opt, config.num_peers, timeout=60)
                    barrier.wait(timeout=60)
                    swarm_wait = time.perf_counter() - wait_started
                if opt.local_epoch >= config.epochs_of(section):
                    break
            train_seconds = time.perf_counter() - started - swarm_wait
            epochs = opt.local_epoch
            stopped = time.perf_counter()
            barrier.wait(timeout=config.averaging_timeout + 120)  # every peer has stopped stepping
            settle_background_requests(opt, dht)
            opt.shutdown()  # leaves the swarm and applies any delayed optimizer update to the model
            opt = None
            barrier.wait(timeout=config.averaging_timeout + 120)  # keep the DHTs up until every peer has left
            dht.shutdown()
            dht = None
            shutdown_seconds = time.perf_counter() - stopped
            errors = check.errors
            reports.append(dict(
                section=section, mode=key, peer=peer_index, poisoned=poisoned,
                finite=all(bool(p.isfinite().all()) for p in model.parameters()), train_s=train_seconds,
                setup_s=setup_seconds, swarm_wait_s=swarm_wait,
                shutdown_s=shutdown_seconds, micro_steps=len(losses), epochs=epochs, round_step_s=round_steps,
                no_sync_step_s=no_sync_steps,
                final_loss=statistics.mean(losses[-config.loss_window :]),
                test_accuracy=evaluate_accuracy(model, config.seed), averaged=stats["averaged"],
                grad_error=max(errors) if errors else None, grad_errors=errors,
            ))
            if peer_index == 0 and config.verbose:
                print(f"[{run_label(section, key)}] peer 0: {epochs} epochs in {len(losses)} micro-steps, "
                      f"{train_seconds:.0f} s (set-up {setup_seconds:.0f} s, swarm {swarm_wait:.0f} s, shutdown "
                      f"{shutdown_seconds:.0f} s), final loss {reports[-1]['final_loss']:.3f}", flush=True)
        results.put(dict(peer=peer_index, runs=reports))
    except BaseException:
        barrier.abort()
        results.put(dict(error=traceback.format_exc()))
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


def run_native(common: Dict[str, Any], timeout: float) -> List[Dict[str, Any]]:
    """
    Run native accumulation's training loop and framework loop at the same time, one process each.

    :param common: every :class:`TrainConfig` field but ``runs``
    :param timeout: seconds allowed for both
    :returns: their result dicts
    """
    targets = [
        (train_native, (TrainConfig(runs=((section, "native"),), **common),)) for section in ("training", "framework")
    ]
    return run_processes("native", targets, timeout)


def run_peers(config: TrainConfig, timeout: float) -> List[Dict[str, Any]]:
    """
    Run ``config.num_peers`` peer processes through ``config.runs``.

    :param timeout: seconds allowed for all runs
    :returns: one result dict per peer
    :raises RuntimeError: if a peer fails or the runs time out
    """
    context = mp.get_context("spawn")
    bootstrap, barrier = context.Queue(), context.Barrier(config.num_peers)
    targets = [(train_peer, (config, peer, bootstrap, barrier)) for peer in range(config.num_peers)]
    return run_processes("peers", targets, timeout)


def summarize_training(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """one row per (section, mode): loss and accuracy averaged over peers, epochs and micro-steps the most, rounds
    averaged the fewest, gradient error the worst"""
    runs = [run for result in results for run in result["runs"]]
    rows = []
    for section in ("training", "framework", "nonfinite"):
        for key in MODES:
            # section 4 reports the healthy peers only: the NaN peer's own loss and model are NaN by construction
            per_peer = [run for run in runs if run["section"] == section and run["mode"] == key
                        and not run.get("poisoned")]
            if not per_peer:
                continue

            def reduce(name, how):
                values = [value[name] for value in per_peer if value[name] is not None]
                return how(values) if values else None

            rows.append(dict(
                section=section, mode=key, label=MODES[key].label, peers=len(per_peer) if key != "native" else 1,
                final_loss=reduce("final_loss", statistics.mean), test_accuracy=reduce("test_accuracy", statistics.mean),
                epochs=reduce("epochs", max), micro_steps=reduce("micro_steps", max), averaged=reduce("averaged", min),
                grad_error=reduce("grad_error", max) if section != "nonfinite" else None, train_s=reduce("train_s", max),
                finite=all(run.get("finite", True) for run in per_peer), per_peer=per_peer,
            ))
    return rows

