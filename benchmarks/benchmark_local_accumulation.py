"""
The main job: a real collaborative training run on real data, comparing the cost of local gradient accumulation in
plain PyTorch, in upstream :class:`hivemind.Optimizer` and in :class:`hivemind_accum.Optimizer`.

Default mode (``--models small``): a small CNN learns scikit-learn's bundled digits dataset (8x8 images, 10 classes,
fixed stratified train/test split). Three runs see the same initial weights and the same micro-batches:

- ``native``: one process, plain PyTorch accumulation: ``(loss / K).backward()`` into the existing ``.grad`` for
  K micro-batches, then ``opt.step(); opt.zero_grad()``, where K micro-batches make ``target_batch_size`` samples.
  The process walks through the micro-batches of every peer's shard, interleaved.
- ``upstream`` (:class:`hivemind.Optimizer`) and ``hivemind_accum`` (:class:`hivemind_accum.Optimizer`, identical
  arguments): ``--num-peers`` peers, each in its own process with its own :class:`hivemind.DHT` on loopback (the
  first peer's visible multiaddrs bootstrap the others) and its own shard of the training set. Every peer runs
  ``opt.zero_grad(); loss.backward(); opt.step()`` per micro-batch, concurrently with the others, in the
  configuration of the public performance report where the CPU allows (fp16 gradient compression,
  ``delay_optimizer_step``, ``delay_state_averaging``, ``offload_optimizer``, no local updates; no AMP on CPU).
  ``target_batch_size`` is set so that each peer contributes ``--micro-steps-per-epoch`` micro-batches per epoch.

A peer publishes its progress only after its first micro-step, so after that step every peer waits until its
progress tracker sees all of them (otherwise each would begin alone, stepping on local gradients). After a fixed
number of micro-steps, each peer shuts its optimizer down (which applies any delayed update), then evaluates test
accuracy; the DHTs are shut down once every peer is done.

Large mode (``--models large``): timing only, on synthetic images, through the benchmark sweep
(:mod:`benchmarks.sweep`): ResNet-152 and ConvNeXt-Large built from ``transformers`` configurations (random
initialization, no weight download), native accumulation and upstream, exact and in-place accumulation, each in its
own fresh process with a ``target_batch_size`` it never reaches, so every ``opt.step()`` is a no-sync step.

Measured per run (medians skip the first ``--warmup-steps`` micro-steps of each process):

- micro-step: forward + backward + ``opt.step()`` (with ``opt.zero_grad()`` before it) for hivemind; forward +
  backward (+ the optimizer step every K-th micro-step) for native. ``x native`` divides it by native's.
- no-sync step: ``opt.step()`` alone, over the calls that left ``opt.local_epoch`` unchanged; n/a for native,
  whose accumulation happens inside ``backward()``.
- peak RSS: ``ru_maxrss`` of each training process (hivemind's averager subprocesses and p2p daemon excluded),
  maximum over peers.
- final loss (mean training loss of each peer's last ``--loss-window`` micro-batches, averaged over peers),
  test accuracy (averaged over peers), epochs reached (optimizer steps for native), swarm (the most peers a
  peer's progress tracker saw at once: fewer than ``--num-peers`` means they did not find each other), train
  seconds (the slowest peer's training loop, without the wait for the swarm).

On a small CPU machine the hivemind peers share the cores with each other and with hivemind's background processes,
while native trains alone: in the default mode ``x native`` includes that contention, and the comparison that
isolates accumulation is upstream against hivemind_accum. The JSON report also keeps each process's per-step
timings.

Every implementation runs in fresh processes: allocator state (memory freed by ``zero_grad(set_to_none=True)``
and faulted in again by the next backward) is part of the cost being measured.

Run from the repository root: ``python benchmarks/benchmark_local_accumulation.py [--models large]``.
"""
import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout: import this repository's hivemind_accum

import hivemind  # noqa: E402
import hivemind.compression  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import hivemind_accum  # noqa: E402

IMPLEMENTATIONS = ("native", "upstream", "hivemind_accum")
LARGE_MODELS = ("resnet152", "convnext-large")
TABLE_COLUMNS = (
    # (row key, header, format)
    ("implementation", "run", "{}"),
    ("model", "model", "{}"),
    ("params_m", "params M", "{:.2f}"),
    ("peers", "peers", "{}"),
    ("micro_step_ms", "micro-step ms", "{:.2f}"),
    ("x_native", "x native", "{:.3f}"),
    ("nosync_step_ms", "no-sync step ms", "{:.3f}"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("test_accuracy", "test acc", "{:.4f}"),
    ("epochs", "epochs", "{}"),
    ("swarm", "swarm", "{}"),
    ("train_s", "train s", "{:.1f}"),
)


@dataclass(frozen=True)
class RunConfig:
    """
    Everything a training process needs to reproduce its part of one run (picklable for spawned processes).

    :param implementation: one of ``IMPLEMENTATIONS``
    :param num_peers: number of hivemind peers (native always runs one process doing all peers' micro-batches)
    :param micro_batch_size: samples per micro-batch (``batch_size_per_step``)
    :param steps: micro-steps per peer, warm-up included
    :param warmup_steps: leading micro-steps of each process left out of the timing medians
    :param micro_steps_per_epoch: micro-steps each peer contributes per epoch; sets ``target_batch_size``
    :param lr: learning rate of the Adam optimizer
    :param matchmaking_time: ``hivemind.Optimizer(matchmaking_time=...)``, seconds
    :param averaging_timeout: ``hivemind.Optimizer(averaging_timeout=...)``, seconds
    :param reuse_grad_buffers: ``hivemind.Optimizer(reuse_grad_buffers=...)``; if True, ``opt.zero_grad()`` is
      never called, as hivemind requires in that mode
    :param threads: ``torch.set_num_threads`` of each training process
    :param seed: seed of the data split, the shards, the micro-batch order and the initial weights
    :param loss_window: number of last micro-batches whose mean training loss is reported
    :param log_every: print progress every this many micro-steps
    :param label: prefix of the progress lines
    """

    implementation: str
    num_peers: int
    micro_batch_size: int
    steps: int
    warmup_steps: int
    micro_steps_per_epoch: int
    lr: float
    matchmaking_time: float
    averaging_timeout: float
    reuse_grad_buffers: bool
    threads: int
    seed: int
    loss_window: int
    log_every: int
    label: str

    @property
    def target_batch_size(self) -> int:
        return self.num_peers * self.micro_steps_per_epoch * self.micro_batch_size


class DigitsCNN(nn.Module):
    """
    A small convolutional classifier for 1x8x8 images (4.6 M parameters, most of them in the first linear layer),
    sized so that a micro-step takes tens of milliseconds on one CPU thread: an epoch of a few micro-steps then
    lasts long enough for hivemind's progress tracker and matchmaking to keep up, as in a real run.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(128, 256, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build_digits_cnn(seed: int) -> nn.Module:
    """a freshly initialized :class:`DigitsCNN`; the same seed gives the same weights in every process"""
    torch.manual_seed(seed)
    return DigitsCNN()


def load_digits_split(
    seed: int, test_size: float = 0.25
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Load scikit-learn's bundled digits dataset as float images in [0, 1] with a stratified train/test split.

    :param seed: ``random_state`` of the split
    :param test_size: fraction of samples held out for testing
    :returns: train images (N, 1, 8, 8), train labels (N,), test images, test labels
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_size, random_state=seed, stratify=digits.target
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def peer_micro_batches(config: RunConfig, peer_index: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """
    Yield the ``config.steps`` micro-batches (images, labels) of one peer, identical in every process.

    The peer's shard is every ``num_peers``-th training sample of a seeded permutation; each pass over the shard
    visits it in a fresh seeded order, dropping the incomplete last micro-batch.

    :param config: the run; its seed, micro-batch size and step count matter here
    :param peer_index: which peer's micro-batches to yield
    """
    generator = torch.Generator().manual_seed(config.seed * 1000 + peer_index)
    train_images, train_labels, _, _ = load_digits_split(config.seed)
    shard = torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(config.seed))
    shard = shard[peer_index :: config.num_peers]
    batches_per_pass = len(shard) // config.micro_batch_size
    if batches_per_pass == 0:
        raise ValueError(f"micro_batch_size={config.micro_batch_size} exceeds the shard of {len(shard)} samples")
    step = 0
    while True:
        order = shard[torch.randperm(len(shard), generator=generator)]
        for start in range(0, batches_per_pass * config.micro_batch_size, config.micro_batch_size):
            if step == config.steps:
                return
            indices = order[start : start + config.micro_batch_size]
            yield train_images[indices], train_labels[indices]
            step += 1


def evaluate_accuracy(model: nn.Module, seed: int) -> float:
    """
    Fraction of the held-out digits the model classifies correctly.

    :param model: a model taking (N, 1, 8, 8) images
    :param seed: the seed of the train/test split
    """
    _, _, test_images, test_labels = load_digits_split(seed)
    model.eval()
    with torch.no_grad():
        predictions = model(test_images).argmax(dim=1)
    return (predictions == test_labels).float().mean().item()


def peak_rss_mb() -> float:
    """this process's peak resident set size in MiB (``ru_maxrss`` is in KiB on Linux)"""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median_ms(seconds: Sequence[float]) -> Optional[float]:
    return statistics.median(seconds) * 1000 if seconds else None


def _log_progress(config: RunConfig, who: str, total: int, epoch_name: str, epoch: int, losses: List[float]) -> None:
    recent = losses[-config.log_every :]
    print(
        f"[{config.label}] {who}micro-step {len(losses)}/{total}, {epoch_name} {epoch}, "
        f"loss {sum(recent) / len(recent):.4f}",
        flush=True,
    )


def train_native(config: RunConfig, results: mp.Queue) -> None:
    """
    Process target: plain PyTorch accumulation over every peer's micro-batches, interleaved; put a result dict.

    :param config: the run (``implementation="native"``)
    :param results: queue receiving one dict of measurements (or ``{"error": traceback}``)
    """
    try:
        torch.set_num_threads(config.threads)
        model = build_digits_cnn(config.seed)
        opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        accumulation_steps = config.target_batch_size // config.micro_batch_size
        streams = [peer_micro_batches(config, peer) for peer in range(config.num_peers)]
        micro_step_seconds, losses, optimizer_steps = [], [], 0
        train_started = time.perf_counter()
        model.train()
        for batches in zip(*streams):
            for images, labels in batches:
                started = time.perf_counter()
                loss = F.cross_entropy(model(images), labels)
                (loss / accumulation_steps).backward()
                if (len(losses) + 1) % accumulation_steps == 0:
                    opt.step()
                    opt.zero_grad()
                    optimizer_steps += 1
                finished = time.perf_counter()
                losses.append(loss.item())
                if len(losses) > config.warmup_steps:
                    micro_step_seconds.append(finished - started)
                if len(losses) % config.log_every == 0:
                    _log_progress(config, "", config.steps * config.num_peers, "step", optimizer_steps, losses)
        train_seconds = time.perf_counter() - train_started
        results.put(
            dict(
                peer=0,
                params=sum(param.numel() for param in model.parameters()),
                micro_step_ms=_median_ms(micro_step_seconds),
                nosync_step_ms=None,
                peak_rss_mb=peak_rss_mb(),
                final_loss=statistics.mean(losses[-config.loss_window :]),
                test_accuracy=evaluate_accuracy(model, config.seed),
                epochs=optimizer_steps,
                swarm=None,
                train_s=train_seconds,
                micro_step_ms_each=[seconds * 1000 for seconds in micro_step_seconds],
            )
        )
    except BaseException:
        results.put(dict(peer=0, error=traceback.format_exc()))
        raise


def wait_for_swarm(opt: hivemind.Optimizer, num_peers: int, timeout: float) -> None:
    """
    Wait until the optimizer's progress tracker sees ``num_peers`` peers (itself included). Until then a peer
    believes it is alone and would step on its local gradients only.

    :param opt: a running :class:`hivemind.Optimizer`
    :param num_peers: peers to wait for
    :param timeout: seconds
    :raises TimeoutError: if the peers do not find each other in time
    """
    deadline = time.monotonic() + timeout
    while opt.tracker.global_progress.num_peers < num_peers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the progress tracker saw {opt.tracker.global_progress.num_peers} of {num_peers} peers "
                f"after {timeout:.0f} s"
            )
        time.sleep(0.1)


def train_hivemind_peer(config: RunConfig, peer_index: int, bootstrap: mp.Queue, barrier, results: mp.Queue) -> None:
    """
    Process target: one hivemind peer (its own DHT, optimizer and data shard); put a result dict.

    :param config: the run (``implementation`` ``"upstream"`` or ``"hivemind_accum"``)
    :param peer_index: this peer's index; peer 0 starts the first DHT and sends its multiaddrs to the others
    :param bootstrap: queue carrying peer 0's visible multiaddrs (as strings) to every other peer
    :param barrier: a ``num_peers`` barrier: training starts together, DHTs shut down after every peer is done
    :param results: queue receiving one dict of measurements (or ``{"error": traceback}``)
    """
    dht = opt = None
    try:
        # this process was spawned, which made spawn its default; hivemind's averagers are processes holding locks
        # and must be forked, as in any ordinary training script on Linux
        mp.set_start_method("fork", force=True)
        torch.set_num_threads(config.threads)
        if peer_index == 0:
            dht = hivemind.DHT(start=True)
            maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
            for _ in range(config.num_peers - 1):
                bootstrap.put(maddrs)
        else:
            dht = hivemind.DHT(initial_peers=bootstrap.get(timeout=120), start=True)

        model = build_digits_cnn(config.seed)
        optimizer_cls = hivemind.Optimizer if config.implementation == "upstream" else hivemind_accum.Optimizer
        opt = optimizer_cls(
            dht=dht,
            run_id=f"local_accumulation_{config.implementation}",
            params=model.parameters(),
            optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
            batch_size_per_step=config.micro_batch_size,
            target_batch_size=config.target_batch_size,
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            grad_compression=hivemind.compression.Float16Compression(),
            reuse_grad_buffers=config.reuse_grad_buffers,
            offload_optimizer=True,
            delay_optimizer_step=True,
            delay_state_averaging=True,
            use_local_updates=False,
            verbose=False,
            averager_opts=dict(request_timeout=config.matchmaking_time / 2),  # hivemind warns unless below
        )
        barrier.wait(timeout=300)  # start training together

        micro_step_seconds, nosync_step_seconds, losses, swarm, swarm_wait_seconds = [], [], [], 0, 0.0
        train_started = time.perf_counter()
        model.train()
        for step, (images, labels) in enumerate(peer_micro_batches(config, peer_index), start=1):
            started = time.perf_counter()
            if not config.reuse_grad_buffers:
                opt.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            epoch_before = opt.local_epoch
            step_started = time.perf_counter()
            opt.step()
            finished = time.perf_counter()
            losses.append(loss.item())
            swarm = max(swarm, opt.tracker.global_progress.num_peers)
            if step > config.warmup_steps:
                micro_step_seconds.append(finished - started)
                if opt.local_epoch == epoch_before:
                    nosync_step_seconds.append(finished - step_started)
            if step % config.log_every == 0:
                _log_progress(config, f"peer {peer_index}: ", config.steps, "epoch", opt.local_epoch, losses)
            if step == 1:
                # a peer publishes its progress only once it has accumulated samples: meet the others here
                wait_started = time.perf_counter()
                wait_for_swarm(opt, config.num_peers, timeout=60)
                barrier.wait(timeout=60)
                swarm_wait_seconds = time.perf_counter() - wait_started
        train_seconds = time.perf_counter() - train_started - swarm_wait_seconds
        epochs = opt.local_epoch
        opt.shutdown()  # leaves the swarm and applies any delayed optimizer update to the model
        opt = None
        results.put(
            dict(
                peer=peer_index,
                params=sum(param.numel() for param in model.parameters()),
                micro_step_ms=_median_ms(micro_step_seconds),
                nosync_step_ms=_median_ms(nosync_step_seconds),
                peak_rss_mb=peak_rss_mb(),
                final_loss=statistics.mean(losses[-config.loss_window :]),
                test_accuracy=evaluate_accuracy(model, config.seed),
                epochs=epochs,
                swarm=swarm,
                train_s=train_seconds,
                swarm_wait_s=swarm_wait_seconds,
                micro_step_ms_each=[seconds * 1000 for seconds in micro_step_seconds],
                nosync_step_ms_each=[seconds * 1000 for seconds in nosync_step_seconds],
            )
        )
        barrier.wait(timeout=config.averaging_timeout + 120)  # keep this DHT up until every peer has left the swarm
    except BaseException:
        barrier.abort()
        results.put(dict(peer=peer_index, error=traceback.format_exc()))
        raise
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


def run_implementation(config: RunConfig, timeout: float) -> List[Dict[str, Any]]:
    """
    Run one implementation in fresh spawned processes and collect each process's measurements.

    :param config: the run
    :param timeout: seconds to wait for all results before terminating the processes
    :returns: one result dict per training process, ordered by peer index
    :raises RuntimeError: if a process fails, exits without a result or times out
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    if config.implementation == "native":
        processes = [context.Process(target=train_native, args=(config, results), name=config.label)]
    else:
        bootstrap, barrier = context.Queue(), context.Barrier(config.num_peers)
        processes = [
            context.Process(
                target=train_hivemind_peer,
                args=(config, peer, bootstrap, barrier, results),
                name=f"{config.label}-{peer}",
            )
            for peer in range(config.num_peers)
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
                    raise RuntimeError(f"[{config.label}] timed out after {timeout:.0f} s")
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"[{config.label}] {dead[0].name} exited with code {dead[0].exitcode}")
                continue
            if "error" in result:
                raise RuntimeError(f"[{config.label}] peer {result['peer']} failed:\n{result['error']}")
            collected.append(result)
    finally:
        # after a failure the other peers see a broken barrier and shut their DHTs down themselves; terminating
        # them mid-shutdown would orphan their DHT and p2p daemon processes
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
                process.join()
    return sorted(collected, key=lambda result: result["peer"])


def summarize(config: RunConfig, results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """
    Reduce per-process results to one table row: timings as the median over peers, peak RSS as the maximum,
    loss and accuracy as the mean, epochs and swarm size as the maximum, train time as the slowest peer's.

    :param config: the run
    :param results: one dict per training process, as put by ``train_native`` / ``train_hivemind_peer``
    """

    def reduce(key, how):
        values = [result[key] for result in results if result[key] is not None]
        return how(values) if values else None

    return dict(
        implementation=config.implementation,
        model="digits_cnn",
        params_m=results[0]["params"] / 1e6,
        peers=len(results) if config.implementation != "native" else 1,
        micro_step_ms=reduce("micro_step_ms", statistics.median),
        x_native=None,
        nosync_step_ms=reduce("nosync_step_ms", statistics.median),
        peak_rss_mb=reduce("peak_rss_mb", max),
        final_loss=reduce("final_loss", statistics.mean),
        test_accuracy=reduce("test_accuracy", statistics.mean),
        epochs=reduce("epochs", max),
        swarm=reduce("swarm", max),
        train_s=reduce("train_s", max),
        per_peer=results,
    )


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """
    Plain-text table of result rows, one column per ``TABLE_COLUMNS`` entry; missing values print as ``n/a``.

    :param rows: dicts as returned by ``summarize``
    """
    header = [title for _, title, _ in TABLE_COLUMNS]
    cells = [
        [fmt.format(row[key]) if row[key] is not None else "n/a" for key, _, fmt in TABLE_COLUMNS] for row in rows
    ]
    widths = [max(len(line[i]) for line in [header] + cells) for i in range(len(header))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in [header] + cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """
    Parse the command line.

    :param argv: command-line arguments (default: ``sys.argv[1:]``)
    """
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument(
        "--models",
        choices=("small", "large"),
        default="small",
        help="small (default): train a CNN on digits with several peers; "
        "large: time ResNet-152 and ConvNeXt-Large on synthetic images (benchmarks.sweep), one peer",
    )
    parser.add_argument(
        "--implementations",
        nargs="+",
        choices=IMPLEMENTATIONS,
        default=list(IMPLEMENTATIONS),
        help="small mode: runs to do, always in the order native, upstream, hivemind_accum (default: all)",
    )
    parser.add_argument("--num-peers", type=int, default=2, help="hivemind peers (default: 2)")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="samples per micro-step (default: 32)")
    parser.add_argument("--steps", type=int, default=160, help="micro-steps per peer, warm-up included (default: 160)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="leading micro-steps (first-touch page faults, allocator growth) left out of the medians (default: 2)",
    )
    parser.add_argument(
        "--micro-steps-per-epoch",
        type=int,
        default=8,
        help="micro-steps per peer per epoch: target_batch_size = num_peers * this * micro_batch_size (default: 8)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 0.001)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0, help="seconds (default: 1)")
    parser.add_argument("--averaging-timeout", type=float, default=10.0, help="seconds (default: 10)")
    parser.add_argument(
        "--reuse-grad-buffers",
        action="store_true",
        help="pass reuse_grad_buffers=True to both hivemind optimizers; opt.zero_grad() is then never called",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads per training process (default: CPU cores / peers, at least 1)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of split, shards, batch order and weights (default: 0)"
    )
    parser.add_argument(
        "--loss-window", type=int, default=20, help="last micro-batches averaged into the final loss (default: 20)"
    )
    parser.add_argument("--log-every", type=int, default=40, help="progress line every this many micro-steps")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed for each implementation's run (default: 600)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="where to write the JSON report (default: benchmarks/results/local_accumulation[_large].json)",
    )
    args = parser.parse_args(argv)
    if args.output is None:
        suffix = "" if args.models == "small" else "_large"
        args.output = REPO_ROOT / "benchmarks" / "results" / f"local_accumulation{suffix}.json"
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.num_peers)
    for name in ("num_peers", "micro_batch_size", "steps", "micro_steps_per_epoch", "threads", "loss_window", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be at least 0 and below --steps")
    return args


def run_large(args: argparse.Namespace) -> None:
    """time ResNet-152 and ConvNeXt-Large with every accumulation implementation (one fresh process each)"""
    from benchmarks.sweep import machine_description, markdown_table, run_sweep, summarize as summarize_sweep

    results = run_sweep(LARGE_MODELS, rounds=1, steps=6, warmup=4, batch_size=4, threads=1)
    rows = summarize_sweep(results)
    print(f"\nMeasured on: {machine_description(1)}\n\n{markdown_table(rows)}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(mode="large", rows=rows, raw=results), indent=1) + "\n")
    print(f"wrote {args.output}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """
    Run every requested implementation, print the table, write the JSON.

    :param argv: command-line arguments (default: ``sys.argv[1:]``); see ``--help``
    """
    args = parse_args(argv)
    if args.models == "large":
        return run_large(args)
    script_started = time.perf_counter()
    rows, native_ms = [], None
    for implementation in [name for name in IMPLEMENTATIONS if name in args.implementations]:
        config = RunConfig(
            implementation=implementation,
            num_peers=args.num_peers,
            micro_batch_size=args.micro_batch_size,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            micro_steps_per_epoch=args.micro_steps_per_epoch,
            lr=args.lr,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            reuse_grad_buffers=args.reuse_grad_buffers,
            threads=args.threads,
            seed=args.seed,
            loss_window=args.loss_window,
            log_every=args.log_every,
            label=implementation,
        )
        print(f"[{config.label}] starting (target_batch_size={config.target_batch_size})", flush=True)
        row = summarize(config, run_implementation(config, timeout=args.timeout))
        if implementation == "native":
            native_ms = row["micro_step_ms"]
        if native_ms and row["micro_step_ms"] is not None:
            row["x_native"] = row["micro_step_ms"] / native_ms
        rows.append(row)
        print(f"[{config.label}] done in {row['train_s']:.1f} s of training", flush=True)

    wall_seconds = time.perf_counter() - script_started
    print()
    print(format_table(rows))
    print(f"\ntotal wall time {wall_seconds:.1f} s", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        mode=args.models,
        config={key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        versions=dict(
            torch=torch.__version__, hivemind=hivemind.__version__, hivemind_accum=hivemind_accum.__version__
        ),
        wall_s=wall_seconds,
        rows=rows,
    )
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
