"""
The main job: what ``hivemind_accum`` changes against upstream hivemind and native PyTorch accumulation, shown on one
machine in four sections, each comparing like with like, then one line per claim.

Five modes are compared, and every row names its mode:

- ``native``: plain PyTorch accumulation (``backward()`` adds into the existing ``.grad``; no hivemind);
- ``upstream, default``: :class:`hivemind.Optimizer` (hivemind 1.1.12), ``reuse_grad_buffers=False``;
- ``upstream, reuse_grad_buffers=True``: the same with upstream's own in-place option;
- ``hivemind_accum, exact``: :class:`hivemind_accum.Optimizer`, ``reuse_grad_buffers=False``;
- ``hivemind_accum, in place``: :class:`hivemind_accum.Optimizer`, ``reuse_grad_buffers=True``.

1. Work per micro-step (``work``): each mode in its own fresh process, one at a time (the same process count, one,
   for every mode, native included), with the allocator settings of :data:`benchmarks.sweep.MALLOC_ENV`, on a small
   transformer encoder (:class:`WorkTransformer`, 13.1 M parameters in 195 tensors, batch 4 x 16 tokens, one torch
   thread). Hivemind modes run one peer with a ``target_batch_size`` it never reaches, so every ``opt.step()`` is a
   no-sync step, in the slowdown report's configuration (fp16 gradient compression, offloaded optimizer, delayed
   optimizer step and state averaging). Columns:

   - ``no-sync step ms``: ``opt.step()`` alone, median of the measured micro-steps (fp32); native has no such call,
     its accumulation happens inside ``backward()``;
   - ``ops/step``: tensor operations launched by one no-sync ``opt.step()`` (fp32): top-level ``aten::`` events in
     ``torch.profiler`` (events without an aten parent, as ``tests/test_cost_guards.py`` counts them: a fused
     ``_foreach_add_`` over P tensors counts once); on a GPU each one is at least one kernel launch;
   - ``host reads fp16``: host reads of device values (``aten::_local_scalar_dense`` events: ``.item()``,
     ``bool(tensor)``) in one whole micro-step (``zero_grad``, forward, backward, ``scaler.step(opt)``,
     ``scaler.update()``) under fp16 autocast with loss scaling: ``torch.amp.GradScaler("cpu")`` for native, upstream
     default and exact, ``hivemind.GradScaler("cpu")`` for the two ``reuse_grad_buffers=True`` modes (each mode's
     required scaler); on a GPU each one is a pipeline stall;
   - ``step ms fp16``: the no-sync ``scaler.step(opt)`` + ``scaler.update()`` in that setting (fp16 micro-steps take
     1 x 4 tokens: CPU fp16 matmuls are slow, and what the no-sync step does depends on the gradients, not the batch);
   - ``accum MB`` (fp32 / fp16): gradient memory held by the accumulators beyond the model's ``.grad``, on the
     gradients' device (upstream: its per-parameter accumulators; exact: its flat buffers, plus any staging buffer
     kept on the CPU, which loss scaling of float32 gradients there does not need); the averager's shared
     CPU buffers, the same in every hivemind mode, are not counted;
   - ``fallback MB``: the host copy of each round's local gradients that ``hivemind_accum`` keeps so that a failed
     averaging round does not lose them (allocated at the first round; upstream has none and loses them);
   - ``micro-step ms`` and ``x native``: the whole fp32 micro-step (``zero_grad`` where the mode uses it, forward,
     backward, ``opt.step()``), median, and its ratio to native's.

2. Training (``training``): a small CNN (:class:`DigitsCNN`, 4.6 M parameters) learns scikit-learn's bundled digits
   (8x8 images, 10 classes, fixed stratified split, no download) for ``--epochs`` optimizer steps of
   ``target_batch_size`` samples, Adam. Every hivemind mode trains with two peers on loopback, each its own process
   with its own :class:`hivemind.DHT` and its own shard of the training set; the same two processes train every mode
   one after the other (a fresh model with the same initial weights and a fresh optimizer per mode; each run stops
   when its peers reach ``--epochs``): upstream default, exact, upstream ``reuse_grad_buffers=True``, in place. Loop:
   ``opt.zero_grad()`` (not with ``reuse_grad_buffers=True``, where upstream forbids it), forward, ``backward()``,
   ``opt.step()``. Native runs in two processes at the same time, as loaded as the two peers (each native process
   does both peers' micro-batches, so the machine does the same work): both walk through every peer's micro-batches,
   ``K`` per optimizer step (as many samples as ``target_batch_size``), the same number of optimizer steps; one runs
   this section's loop, the other the framework loop of section 3. Columns: ``final loss`` (mean training loss over
   each peer's last ``--loss-window`` micro-batches, averaged over peers), ``test acc`` (held-out accuracy after
   training, averaged over peers), ``epochs`` (optimizer steps), ``micro-steps`` (per peer; a hivemind peer keeps
   accumulating until it sees the swarm reach the target through the DHT, so often more than
   ``--micro-steps-per-epoch`` per epoch), ``averaged`` (rounds whose gradients were averaged with the other peer,
   fewest over peers; in the others a peer stepped on its local gradients), ``grad error`` (see 3), ``train s`` (the
   slowest peer's training loop, averaging rounds included, without set-up and the wait for the swarm). With the
   report's delayed optimizer step each epoch's update reaches the model one epoch late, so at equal optimizer steps
   every hivemind mode trails native; compare hivemind modes with each other, native is the reference.

3. A framework-style loop (``framework``) in ``reuse_grad_buffers=True``, as common trainers drive an optimizer that
   they believe steps every call: forward, ``backward()``, ``clip_grad_norm_(model.parameters(), 1.0)``,
   ``opt.step()``, ``model.zero_grad()``: upstream ``reuse_grad_buffers=True`` against in place (the same two peers,
   after section 2) against native (accumulating ``K`` micro-batches, then clip, step and ``model.zero_grad()``).
   ``grad error`` (every hivemind run): in every averaging round, the local gradient a peer hands to the all-reduce
   is compared with the mean of the gradients its loop produced for that round's micro-batches (what ``.grad`` gained
   from ``backward()`` and clipping, recorded right before each ``opt.step()``): ``||sent - mean|| / ||mean||``, the
   worst round over peers; float rounding (about 1e-7) means no micro-batch was lost or counted twice, 1 means the
   sent gradient has nothing to do with the epoch's. Section 1 records what ``opt.zero_grad()`` does in each
   ``reuse_grad_buffers=True`` mode.

4. One peer with NaN gradients (``nonfinite``): the same two peers train section 2's loop for ``--nonfinite-epochs``
   optimizer steps, upstream default and then exact, but the last peer multiplies its loss by NaN at every
   micro-step (an exploding loss, fp16 without a loss scaler, a broken peer), with parameter averaging every epoch
   (hivemind's default). The rows report the healthy peer 0 alone: ``test acc`` and ``final loss`` as in section 2,
   ``finite`` whether every one of its parameters is finite after training (``False``: the NaN peer poisoned it).

Claims (the last lines): each names the modes, the two numbers and whether the claim holds on this run. Time and
count claims hold when the first number is smaller, ``x native`` claims use the README's targets
(``benchmarks/test_local_accumulation.py``), gradient claims allow float rounding (``GRAD_ERROR_TOLERANCE``), and
accuracy claims ``ACCURACY_TOLERANCE``: hivemind's asynchronous epochs (how many micro-batches each peer adds before
it sees the target reached) make repeated runs of one mode differ by up to about that much.

hivemind's own log goes to one file per process in a temporary folder whose path is printed: it holds warnings and,
when a peer's pre-scheduled averaging round finds no partner, an ``[ERROR] Averaging step failed: could not find a
group`` traceback (that peer then steps on its local gradients, counted in ``averaged``), and at shutdown ``Task was
destroyed but it is pending!`` lines: upstream's noise, not failures of this job.

``--models large``: timing only, on synthetic images, through the benchmark sweep (:mod:`benchmarks.sweep`):
ResNet-152 and ConvNeXt-Large built from ``transformers`` configurations (random initialization, no weight download),
native accumulation and upstream, exact and in-place accumulation, each in its own fresh process.

Run from the repository root: ``python benchmarks/benchmark_local_accumulation.py [--models large]``.
"""
import argparse
import collections
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout: import this repository's hivemind_accum

import hivemind  # noqa: E402
import hivemind.compression  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import hivemind_accum  # noqa: E402
from benchmarks.sweep import MALLOC_ENV  # noqa: E402
from hivemind_accum.optim.torch_internals import foreach_add_, foreach_zero_  # noqa: E402

LARGE_MODELS = ("resnet152", "convnext-large")
SECTIONS = ("work", "training", "framework", "nonfinite")
ACCURACY_TOLERANCE = 0.05  # repeated runs of one hivemind mode here differed by up to about this much
GRAD_ERROR_TOLERANCE = 1e-5  # float32 rounding of a sum of a few micro-batches is about 1e-7
IN_PLACE_TARGET, EXACT_TARGET = 1.03, 1.15  # micro-step x native targets (benchmarks/test_local_accumulation.py)
FP16_EXACT_PARITY = 1.10  # exact no-sync step with fp16 loss scaling on CPU vs upstream's (same file: a tie there)
HOST_READ = "aten::_local_scalar_dense"  # what .item(), bool(tensor) and tensor.tolist() of a scalar end in
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
        return (lambda: hivemind.GradScaler("cpu")) if self.reuse_grad_buffers else (lambda: torch.amp.GradScaler("cpu"))


MODES = {
    mode.key: mode
    for mode in (
        Mode("native", "native", "native", False),
        Mode("upstream", "upstream, default", "upstream", False),
        Mode("upstream_reuse", "upstream, reuse_grad_buffers=True", "upstream", True),
        Mode("exact", "hivemind_accum, exact", "hivemind_accum", False),
        Mode("inplace", "hivemind_accum, in place", "hivemind_accum", True),
    )
}


def make_optimizer(mode: Mode, dht: hivemind.DHT, run_id: str, model: nn.Module, **kwargs) -> hivemind.Optimizer:
    """
    A hivemind optimizer of ``mode`` in the slowdown report's configuration where the CPU allows.

    :param kwargs: the remaining :class:`hivemind.Optimizer` arguments (optimizer, batch sizes, timeouts)
    """
    optimizer_cls = hivemind.Optimizer if mode.optimizer == "upstream" else hivemind_accum.Optimizer
    return optimizer_cls(
        dht=dht, run_id=run_id, params=model.parameters(), reuse_grad_buffers=mode.reuse_grad_buffers,
        grad_compression=hivemind.compression.Float16Compression(), offload_optimizer=True,
        delay_optimizer_step=True, delay_state_averaging=True, use_local_updates=False, verbose=False, **kwargs,
    )


def redirect_stderr(log_path: Optional[str]) -> None:
    """send this process's stderr (hivemind's log, its p2p daemon's output) to ``log_path``"""
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


# ----------------------------------------------------------------------------------------------- section 1: work
class WorkTransformer(nn.Module):
    """a token classifier: embedding, 16 pre-norm transformer encoder layers (d_model 256, 4 heads, feed-forward
    1024), linear head; 13.1 M parameters in 195 tensors"""

    def __init__(self, vocab: int = 1000, width: int = 256, layers: int = 16):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)))


@dataclass(frozen=True)
class WorkConfig:
    """
    :param steps: measured fp32 micro-steps (after ``warmup``)
    :param warmup: fp32 micro-steps before measuring (hivemind processes grow their heap for about 10)
    :param fp16_steps: measured fp16 micro-steps (after 2 warm-up ones)
    :param batch_size: sequences per micro-batch (16 tokens each)
    :param threads: torch intra-op threads
    """

    steps: int
    warmup: int
    fp16_steps: int
    batch_size: int
    threads: int


def accumulator_bytes(mode: Mode, opt: Optional[hivemind.Optimizer], model: nn.Module) -> int:
    """bytes of the accumulators' storage that is not the model's ``.grad`` (on the gradients' device)"""
    if opt is None:
        return 0
    averager = opt.grad_averager
    if isinstance(averager, hivemind_accum.GradientAverager):
        buckets = averager._accumulators.buckets
        tensors = [bucket.flat for bucket in buckets] + [b.staging.flat for b in buckets if b.staging is not None]
    else:
        tensors = list(averager._local_accumulators or ())
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in grads)


def fallback_bytes(mode: Mode, model: nn.Module) -> int:
    """bytes of hivemind_accum's per-round host copy of the local gradients (float32 for fp16/bf16 parameters)"""
    if mode.optimizer != "hivemind_accum":
        return 0
    return sum(p.numel() * max(p.element_size(), 4) for p in model.parameters())


def work_worker(mode_key: str, config: WorkConfig, log_path: str, results: mp.Queue) -> None:
    """
    Process target: measure one mode's micro-step, no-sync step, operations, host reads and memory; put a dict.

    :param mode_key: a key of :data:`MODES`
    :param log_path: file receiving this process's stderr
    :param results: queue receiving one dict of measurements (or ``{"error": traceback}``)
    """
    redirect_stderr(log_path)
    mode, opt, dht = MODES[mode_key], None, None
    try:
        mp.set_start_method("fork", force=True)  # hivemind's averagers are forked, as in an ordinary script
        torch.set_num_threads(config.threads)
        torch.manual_seed(0)
        model = WorkTransformer()
        generator = torch.Generator().manual_seed(1)
        if mode.optimizer != "native":
            dht = hivemind.DHT(start=True)
            opt = make_optimizer(
                mode, dht, f"work_{mode.key}", model, optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                target_batch_size=10**9, batch_size_per_step=config.batch_size, matchmaking_time=5.0,
            )

        def micro_step(scaler=None, step_context=contextlib.nullcontext) -> Tuple[float, float]:
            # CPU fp16 matmuls are slow (about 2 s for a 4 x 16 batch here): fp16 micro-steps take 1 x 4 tokens;
            # what the no-sync step does depends on the gradients' size, not on the batch
            shape = (config.batch_size, 16) if scaler is None else (1, 4)
            tokens = torch.randint(0, 1000, shape, generator=generator)
            targets = torch.randint(0, 1000, shape, generator=generator)
            started = time.perf_counter()
            if opt is not None and not mode.reuse_grad_buffers:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
            (scaler.scale(loss) if scaler is not None else loss).backward()
            step_started = time.perf_counter()
            with step_context():
                if opt is not None and scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                elif opt is not None:
                    opt.step()
            finished = time.perf_counter()
            return finished - started, finished - step_started

        fp32 = [micro_step() for _ in range(config.warmup + config.steps)][config.warmup :]
        step_profile = profile(activities=[ProfilerActivity.CPU])
        micro_step(step_context=lambda: step_profile)
        extra_fp32 = accumulator_bytes(mode, opt, model)
        scaler = mode.amp_scaler()
        fp16 = [micro_step(scaler) for _ in range(2 + config.fp16_steps)][2:]
        with profile(activities=[ProfilerActivity.CPU]) as micro_step_profile:
            micro_step(scaler)
        extra_fp16 = accumulator_bytes(mode, opt, model)
        zero_grad_error = None
        if opt is not None and mode.reuse_grad_buffers:
            try:  # what a framework that calls opt.zero_grad() after every step meets
                opt.zero_grad()
            except Exception as e:
                zero_grad_error = f"{type(e).__name__}: {e}"
        if opt is not None:
            assert opt.local_epoch == 0, "the work section must never reach the target batch size"
        results.put(
            dict(
                mode=mode_key,
                params=sum(p.numel() for p in model.parameters()),
                tensors=len(list(model.parameters())),
                micro_step_ms=1e3 * statistics.median(total for total, _ in fp32),
                no_sync_step_ms=1e3 * statistics.median(step for _, step in fp32) if opt is not None else None,
                step_ops=sum(1 for e in step_profile.events() if e.cpu_parent is None and e.name.startswith("aten::"))
                if opt is not None else None,
                host_reads_fp16=sum(1 for e in micro_step_profile.events() if e.name == HOST_READ),
                no_sync_step_fp16_ms=1e3 * statistics.median(step for _, step in fp16) if opt is not None else None,
                accum_mb_fp32=extra_fp32 / 2**20,
                accum_mb_fp16=extra_fp16 / 2**20,
                fallback_mb=fallback_bytes(mode, model) / 2**20,
                zero_grad_error=zero_grad_error,
                micro_step_ms_each=[1e3 * total for total, _ in fp32],
                no_sync_step_ms_each=[1e3 * step for _, step in fp32],
            )
        )
    except BaseException:
        results.put(dict(mode=mode_key, error=traceback.format_exc()))
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


def run_processes(label: str, targets: Sequence[Tuple[Callable, tuple]], timeout: float) -> List[Dict[str, Any]]:
    """
    Start one spawned process per ``(target, args)`` (each target gets a shared result queue as its last argument),
    collect one result dict from each, and join them.

    :param label: name of this group of processes in messages
    :param timeout: seconds to wait for all results
    :returns: the result dicts, in arrival order
    :raises RuntimeError: if a process reports an error, exits without a result or times out
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(*args, results), name=f"{label}-{i}") for i, (target, args) in enumerate(targets)
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


def run_work(args: argparse.Namespace, log_dir: str) -> List[Dict[str, Any]]:
    """section 1: each mode in its own fresh process, one at a time; returns one row per mode"""
    config = WorkConfig(
        steps=args.work_steps, warmup=args.work_warmup, fp16_steps=args.work_fp16_steps, batch_size=4, threads=1
    )
    rows = []
    for key in MODES:
        started = time.perf_counter()
        log_path = os.path.join(log_dir, f"work_{key}.log")
        (row,) = run_processes(f"work {key}", [(work_worker, (key, config, log_path))], args.timeout)
        row["label"] = MODES[key].label
        rows.append(row)
        print(f"[work] {MODES[key].label}: micro-step {row['micro_step_ms']:.1f} ms ({time.perf_counter() - started:.0f} s)",
              flush=True)
    native = rows[0]["micro_step_ms"]
    for row in rows:
        row["x_native"] = row["micro_step_ms"] / native
    return rows


# ------------------------------------------------------------------------------------ sections 2 and 3: training
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


def peer_micro_batches(
    config: "TrainConfig", peer_index: int, steps: int
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """
    Yield ``steps`` micro-batches (images, labels) of one peer, identical in every process.

    The peer's shard is every ``num_peers``-th training sample of a seeded permutation; each pass over the shard
    visits it in a fresh seeded order, dropping the incomplete last micro-batch.

    :param config: the run; its seed, number of peers and micro-batch size matter here
    :param peer_index: which peer's micro-batches to yield
    :param steps: how many
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
            if step == steps:
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


class LocalGradientCheck:
    """
    Compares, in every averaging round, the local gradient a peer hands to the all-reduce with the mean of the
    gradients its loop produced for the round's micro-batches: call :meth:`before_backward` before each
    ``backward()`` and :meth:`record` right before each ``opt.step()`` (after any clipping); the micro-batch's gradient
    is what ``.grad`` gained in between (in a loop that never zeroes ``.grad`` it holds a running sum).

    :param parameters: the model's parameters, in the optimizer's order
    :param averager: the optimizer's gradient averager; its ``step``, ``load_accumulators_into_averager_`` and
      ``reset_accumulated_grads_`` are wrapped on the instance
    """

    def __init__(self, parameters: Sequence[torch.Tensor], averager):
        self.parameters = list(parameters)
        self.sums = [torch.zeros_like(p) for p in self.parameters]
        self.before = [torch.zeros_like(p) for p in self.parameters]
        self.count = 0
        self.errors: List[float] = []
        step, load, reset = averager.step, averager.load_accumulators_into_averager_, averager.reset_accumulated_grads_
        in_step = []

        def checked_step(*args, **kwargs):
            in_step.append(True)
            try:
                return step(*args, **kwargs)
            finally:
                in_step.pop()

        def checked_load():
            load()
            if in_step and self.count:  # a round's load (not a fallback after a failed round)
                with torch.no_grad(), averager.get_tensors() as sent:
                    expected = [total / self.count for total in self.sums]
                    error = sum((s - e).square().sum() for s, e in zip(sent, expected, strict=True))
                    norm = sum(e.square().sum() for e in expected)
                    self.errors.append(math.sqrt(error / norm))

        def checked_reset():
            reset()
            foreach_zero_(self.sums)
            self.count = 0

        averager.step, averager.load_accumulators_into_averager_ = checked_step, checked_load
        averager.reset_accumulated_grads_ = checked_reset

    @torch.no_grad()
    def before_backward(self) -> None:
        for before, param in zip(self.before, self.parameters):
            before.copy_(param.grad) if param.grad is not None else before.zero_()

    @torch.no_grad()
    def record(self) -> None:
        foreach_add_(self.sums, [p.grad for p in self.parameters])
        foreach_add_(self.sums, self.before, alpha=-1.0)
        self.count += 1


def count_averaged_rounds(opt: hivemind.Optimizer, stats: Dict[str, int]) -> None:
    """count, in ``stats["averaged"]``, the rounds whose gradients were averaged with at least one other peer"""
    average = opt._average_gradients_and_load_into_optimizer

    def counting(control):
        average(control)
        try:
            stats["averaged"] += control is not None and len(control.result(timeout=0)) > 1
        except BaseException:
            pass  # the round failed: upstream's code above fell back to local gradients

    opt._average_gradients_and_load_into_optimizer = counting


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
                averager_opts=dict(request_timeout=config.matchmaking_time / 2),  # hivemind warns unless below
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
            opt.shutdown()  # leaves the swarm and applies any delayed optimizer update to the model
            opt = None
            barrier.wait(timeout=config.averaging_timeout + 120)  # keep the DHTs up until every peer has left
            dht.shutdown()
            dht = None
            shutdown_seconds = time.perf_counter() - stopped
            errors = check.errors
            reports.append(dict(
                section=section, mode=key, peer=peer_index, poisoned=poisoned,
                finite=all(bool(p.isfinite().all()) for p in model.parameters()), train_s=train_seconds, setup_s=setup_seconds, swarm_wait_s=swarm_wait,
                shutdown_s=shutdown_seconds, micro_steps=len(losses), epochs=epochs, round_step_s=round_steps,
                no_sync_step_s=no_sync_steps,
                final_loss=statistics.mean(losses[-config.loss_window :]),
                test_accuracy=evaluate_accuracy(model, config.seed), averaged=stats["averaged"],
                grad_error=max(errors) if errors else None, grad_errors=errors,
            ))
            if peer_index == 0:
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


def run_peers(config: TrainConfig, timeout: float) -> List[Dict[str, Any]]:
    """run ``config.num_peers`` peer processes through ``config.runs``; return their result dicts"""
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


# ------------------------------------------------------------------------------------------------ report
WORK_COLUMNS = (
    # (row key, header, format)
    ("label", "mode", "{}"),
    ("no_sync_step_ms", "no-sync step ms", "{:.2f}"),
    ("step_ops", "ops/step", "{}"),
    ("host_reads_fp16", "host reads fp16", "{}"),
    ("no_sync_step_fp16_ms", "step ms fp16", "{:.2f}"),
    ("accum_mb_fp32", "accum MB fp32", "{:.1f}"),
    ("accum_mb_fp16", "accum MB fp16", "{:.1f}"),
    ("fallback_mb", "fallback MB", "{:.1f}"),
    ("micro_step_ms", "micro-step ms", "{:.1f}"),
    ("x_native", "x native", "{:.3f}"),
)
TRAINING_COLUMNS = (
    ("section", "loop", "{}"),
    ("label", "mode", "{}"),
    ("peers", "peers", "{}"),
    ("final_loss", "final loss", "{:.3f}"),
    ("test_accuracy", "test acc", "{:.3f}"),
    ("epochs", "epochs", "{}"),
    ("micro_steps", "micro-steps", "{}"),
    ("averaged", "averaged", "{}"),
    ("grad_error", "grad error", "{:.1e}"),
    ("train_s", "train s", "{:.1f}"),
    ("finite", "finite", "{}"),
)


def format_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str, str]]) -> str:
    """
    Plain-text table, one column per ``(key, header, format)``; missing values print as ``n/a``.

    :param rows: dicts holding every column's key
    :param columns: e.g. :data:`WORK_COLUMNS`
    """
    header = [title for _, title, _ in columns]
    cells = [[fmt.format(row[key]) if row.get(key) is not None else "n/a" for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header] + cells) for i in range(len(header))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in [header] + cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def make_claims(work: Dict[str, Dict[str, Any]], training: Dict[Tuple[str, str], Dict[str, Any]]) -> List[Dict]:
    """
    One dict per claim: ``text`` (what was compared, modes named), the two numbers ``a`` and ``b`` as printed and
    ``holds``. Claims whose rows are missing (a section skipped) are left out.

    :param work: work rows by mode key
    :param training: training rows by (section, mode key)
    """
    claims = []

    def claim(text: str, a: float, b: float, fmt: str, holds: bool) -> None:
        claims.append(dict(text=text, a=fmt.format(a), b=fmt.format(b), holds=bool(holds)))

    if work:
        w = {key: row for key, row in work.items()}
        ms, ops, reads = "{:.2f} ms", "{:d}", "{:d}"
        claim("exact no-sync step (fp32) cheaper than upstream default", w["exact"]["no_sync_step_ms"],
              w["upstream"]["no_sync_step_ms"], ms, w["exact"]["no_sync_step_ms"] < w["upstream"]["no_sync_step_ms"])
        claim("exact tensor operations per no-sync step fewer than upstream default", w["exact"]["step_ops"],
              w["upstream"]["step_ops"], ops, w["exact"]["step_ops"] < w["upstream"]["step_ops"])
        claim("in place no-sync step (fp32) cheaper than upstream default", w["inplace"]["no_sync_step_ms"],
              w["upstream"]["no_sync_step_ms"], ms, w["inplace"]["no_sync_step_ms"] < w["upstream"]["no_sync_step_ms"])
        claim("in place no-sync step (fp32) cheaper than upstream reuse_grad_buffers=True",
              w["inplace"]["no_sync_step_ms"], w["upstream_reuse"]["no_sync_step_ms"], ms,
              w["inplace"]["no_sync_step_ms"] < w["upstream_reuse"]["no_sync_step_ms"])
        claim("in place tensor operations per no-sync step no more than upstream reuse_grad_buffers=True",
              w["inplace"]["step_ops"], w["upstream_reuse"]["step_ops"], ops,
              w["inplace"]["step_ops"] <= w["upstream_reuse"]["step_ops"])
        claim("exact host reads per micro-step with fp16 loss scaling no more than upstream default (on CPU, where a "
              "read stalls nothing, exact mode reads once by design; on an accelerator it reads none)",
              w["exact"]["host_reads_fp16"], w["upstream"]["host_reads_fp16"], reads,
              w["exact"]["host_reads_fp16"] <= w["upstream"]["host_reads_fp16"])
        claim("in place host reads per micro-step with fp16 loss scaling fewer than upstream reuse_grad_buffers=True",
              w["inplace"]["host_reads_fp16"], w["upstream_reuse"]["host_reads_fp16"], reads,
              w["inplace"]["host_reads_fp16"] < w["upstream_reuse"]["host_reads_fp16"])
        claim(f"exact no-sync step with fp16 loss scaling within {FP16_EXACT_PARITY}x upstream default's (on CPU both "
              f"make two passes over the gradients, each as costly)", w["exact"]["no_sync_step_fp16_ms"],
              w["upstream"]["no_sync_step_fp16_ms"], ms,
              w["exact"]["no_sync_step_fp16_ms"] <= FP16_EXACT_PARITY * w["upstream"]["no_sync_step_fp16_ms"])
        claim("in place no-sync step with fp16 loss scaling cheaper than upstream reuse_grad_buffers=True",
              w["inplace"]["no_sync_step_fp16_ms"], w["upstream_reuse"]["no_sync_step_fp16_ms"], ms,
              w["inplace"]["no_sync_step_fp16_ms"] < w["upstream_reuse"]["no_sync_step_fp16_ms"])
        mb = "{:.1f} MB"
        for precision in ("fp32", "fp16"):
            key = f"accum_mb_{precision}"
            claim(f"exact accumulator memory ({precision}) no more than upstream default", w["exact"][key],
                  w["upstream"][key], mb, w["exact"][key] <= w["upstream"][key])
        claim("in place accumulator memory less than upstream default (fp32)", w["inplace"]["accum_mb_fp32"],
              w["upstream"]["accum_mb_fp32"], mb, w["inplace"]["accum_mb_fp32"] < w["upstream"]["accum_mb_fp32"])
        claim("hivemind_accum (exact, in place) host memory no more than upstream (failed-round fallback copy)",
              w["exact"]["fallback_mb"], w["upstream"]["fallback_mb"], mb,
              w["exact"]["fallback_mb"] <= w["upstream"]["fallback_mb"])
        x = "{:.3f}x"
        claim(f"in place micro-step within {IN_PLACE_TARGET}x native", w["inplace"]["x_native"], IN_PLACE_TARGET, x,
              w["inplace"]["x_native"] <= IN_PLACE_TARGET)
        claim(f"exact micro-step within {EXACT_TARGET}x native", w["exact"]["x_native"], EXACT_TARGET, x,
              w["exact"]["x_native"] <= EXACT_TARGET)
        claim("exact micro-step no slower than upstream default (x native)", w["exact"]["x_native"],
              w["upstream"]["x_native"], x, w["exact"]["x_native"] <= w["upstream"]["x_native"])
        claim("in place micro-step no slower than upstream reuse_grad_buffers=True (x native)",
              w["inplace"]["x_native"], w["upstream_reuse"]["x_native"], x,
              w["inplace"]["x_native"] <= w["upstream_reuse"]["x_native"])
        upstream_error, ours_error = w["upstream_reuse"]["zero_grad_error"], w["inplace"]["zero_grad_error"]
        claims.append(dict(
            text="opt.zero_grad() with reuse_grad_buffers=True: in place allowed, upstream raises",
            a="allowed" if ours_error is None else ours_error[:60], b=(upstream_error or "allowed")[:60],
            holds=ours_error is None and upstream_error is not None,
        ))

    def exact_gradients(section: str, ours: str, theirs: str) -> None:
        if (section, ours) in training and (section, theirs) in training:
            a, b = training[(section, ours)]["grad_error"], training[(section, theirs)]["grad_error"]
            claim(f"{section} loop: {MODES[ours].label} hands the all-reduce the mean of its micro-batch gradients "
                  f"(grad error <= {GRAD_ERROR_TOLERANCE:g}; {MODES[theirs].label} for comparison)", a, b, "{:.1e}",
                  a <= GRAD_ERROR_TOLERANCE)

    def learns_as_well(section: str, ours: str, theirs: str) -> None:
        if (section, ours) in training and (section, theirs) in training:
            a, b = training[(section, ours)]["test_accuracy"], training[(section, theirs)]["test_accuracy"]
            claim(f"{section} loop: {MODES[ours].label} test accuracy at least {MODES[theirs].label}'s "
                  f"- {ACCURACY_TOLERANCE}", a, b, "{:.3f}", a >= b - ACCURACY_TOLERANCE)

    exact_gradients("training", "exact", "upstream")
    exact_gradients("training", "inplace", "upstream_reuse")
    learns_as_well("training", "exact", "upstream")
    learns_as_well("training", "inplace", "upstream_reuse")
    exact_gradients("framework", "inplace", "upstream_reuse")
    learns_as_well("framework", "inplace", "upstream_reuse")
    if ("nonfinite", "exact") in training and ("nonfinite", "upstream") in training:
        ours, theirs = training[("nonfinite", "exact")], training[("nonfinite", "upstream")]
        claims.append(dict(
            text=f"one NaN peer: the healthy peer's parameters stay finite with {MODES['exact'].label} "
                 f"({MODES['upstream'].label} for comparison)",
            a=str(ours["finite"]), b=str(theirs["finite"]), holds=ours["finite"],
        ))
        claim(f"one NaN peer: the healthy peer's test accuracy with {MODES['exact'].label} above "
              f"{MODES['upstream'].label}'s", ours["test_accuracy"], theirs["test_accuracy"], "{:.3f}",
              ours["test_accuracy"] > theirs["test_accuracy"])
    return claims


def format_claims(claims: Sequence[Dict[str, Any]]) -> str:
    return "\n".join(
        f"{c['text']}: {c['a']} vs {c['b']}: {'holds' if c['holds'] else 'does not hold'}" for c in claims
    )


def describe_logs(log_dir: str) -> str:
    """what hivemind logged (stderr of every process started), counted, so its noise is explained, not hidden"""
    no_group, destroyed, errors = 0, 0, collections.Counter()
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as log:
            for line in log:
                if "[ERROR]" in line and "could not find a group" in line:
                    no_group += 1
                elif "[ERROR]" in line:
                    errors[line.split("[ERROR]", 1)[1].strip()[:100]] += 1
                destroyed += line.startswith("Task was destroyed but it is pending!")
    others = "; ".join(f"{count} x '{text}'" for text, count in errors.most_common())
    return (
        f"hivemind's own log is in {log_dir}: {no_group} x '[ERROR] Averaging step failed: could not find a group' "
        f"(a pre-scheduled round found no partner in time; that peer stepped on its local gradients, see 'averaged'), "
        f"{destroyed} x 'Task was destroyed but it is pending!' (asyncio tasks left when a hivemind process shuts "
        f"down){'; other [ERROR] lines: ' + others if others else ''}"
    )


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
        help="small (default): the work, training and framework sections (see --sections); "
        "large: time ResNet-152 and ConvNeXt-Large on synthetic images (benchmarks.sweep), one peer",
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="small mode: sections to run (default: all)")
    parser.add_argument("--work-steps", type=int, default=10, help="work: measured fp32 micro-steps (default: 10)")
    parser.add_argument("--work-warmup", type=int, default=10, help="work: fp32 warm-up micro-steps (default: 10)")
    parser.add_argument("--work-fp16-steps", type=int, default=8, help="work: measured fp16 micro-steps (default: 8)")
    parser.add_argument("--num-peers", type=int, default=2, help="training: hivemind peers (default: 2)")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="training: samples per micro-step (default: 32)")
    parser.add_argument("--epochs", type=int, default=12, help="training: optimizer steps per run (default: 12)")
    parser.add_argument(
        "--micro-steps-per-epoch",
        type=int,
        default=6,
        help="training: micro-steps per peer per epoch; target_batch_size = num_peers * this * micro_batch_size "
        "(default: 6)",
    )
    parser.add_argument("--nonfinite-epochs", type=int, default=4,
                        help="nonfinite: optimizer steps of each run with a NaN peer (default: 4)")
    parser.add_argument("--lr", type=float, default=1.5e-3, help="training: Adam learning rate (default: 0.0015)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0, help="seconds (default: 1)")
    parser.add_argument("--averaging-timeout", type=float, default=10.0, help="seconds (default: 10)")
    parser.add_argument("--threads", type=int, help="training: torch threads per process (default: CPU cores / peers)")
    parser.add_argument("--seed", type=int, default=0, help="seed of split, shards, batch order and weights (default: 0)")
    parser.add_argument(
        "--loss-window", type=int, default=20, help="last micro-batches averaged into the final loss (default: 20)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for each group of processes")
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
    for name in ("work_steps", "work_fp16_steps", "num_peers", "micro_batch_size", "epochs", "micro_steps_per_epoch",
                 "threads", "loss_window", "nonfinite_epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.work_warmup < 0:
        parser.error("--work-warmup must be at least 0")
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
    Run the requested sections, print their tables and the claims, write the JSON.

    :param argv: command-line arguments (default: ``sys.argv[1:]``); see ``--help``
    """
    args = parse_args(argv)
    if args.models == "large":
        return run_large(args)
    os.environ.update(MALLOC_ENV)  # every process started from here on: the sweep's allocator settings
    started = time.perf_counter()
    log_dir = tempfile.mkdtemp(prefix="hivemind_accum_main_job_")
    print(f"hivemind's own log (warnings, tracebacks of rounds that found no group, shutdown noise) goes to {log_dir}",
          flush=True)
    work_rows, training_results = [], []
    if "work" in args.sections:
        work_rows = run_work(args, log_dir)
        print(f"\nWork per micro-step (one process per mode, one at a time; {work_rows[0]['params'] / 1e6:.1f} M "
              f"parameters in {work_rows[0]['tensors']} tensors):\n{format_table(work_rows, WORK_COLUMNS)}\n", flush=True)
    common = dict(
        num_peers=args.num_peers, micro_batch_size=args.micro_batch_size, epochs=args.epochs,
        micro_steps_per_epoch=args.micro_steps_per_epoch, lr=args.lr, matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout, threads=args.threads, seed=args.seed, loss_window=args.loss_window,
        log_dir=log_dir, nonfinite_epochs=args.nonfinite_epochs,
    )
    sections = [section for section in ("training", "framework", "nonfinite") if section in args.sections]
    if sections:
        if {"training", "framework"} & set(sections):  # nonfinite compares hivemind modes only
            group_started = time.perf_counter()
            print(f"[native] the training and framework loops at the same time, one process each, {args.epochs} "
                  f"optimizer steps of {TrainConfig(runs=(), **common).target_batch_size} samples", flush=True)
            targets = [(train_native, (TrainConfig(runs=((section, "native"),), **common),))
                       for section in ("training", "framework")]
            training_results += [
                result for result in run_processes("native", targets, args.timeout) if result["runs"][0]["section"] in sections
            ]
            print(f"[native] done in {time.perf_counter() - group_started:.0f} s", flush=True)
        runs = []
        if "training" in sections:
            runs += [("training", key) for key in ("upstream", "exact", "upstream_reuse", "inplace")]
        if "framework" in sections:
            runs += [("framework", key) for key in ("upstream_reuse", "inplace")]
        if "nonfinite" in sections:
            runs += [("nonfinite", key) for key in ("upstream", "exact")]
        config = TrainConfig(runs=tuple(runs), **common)
        group_started = time.perf_counter()
        print(f"[peers] {args.num_peers} peers, target_batch_size={config.target_batch_size}, one run after the other: "
              f"{'; '.join(run_label(*run) for run in runs)}", flush=True)
        training_results += run_peers(config, args.timeout * len(runs))
        print(f"[peers] done in {time.perf_counter() - group_started:.0f} s", flush=True)
    training_rows = summarize_training(training_results)
    if training_rows:
        print(f"\nTraining on scikit-learn digits, {args.epochs} optimizer steps of "
              f"{args.num_peers * args.micro_steps_per_epoch * args.micro_batch_size} samples ({args.num_peers} peers per "
              f"hivemind mode; native: two processes at once, each over every peer's micro-batches):\n"
              f"{format_table(training_rows, TRAINING_COLUMNS)}\n", flush=True)
    claims = make_claims(
        {row["mode"]: row for row in work_rows}, {(row["section"], row["mode"]): row for row in training_rows}
    )
    wall_seconds = time.perf_counter() - started
    print(f"Claims (this run):\n{format_claims(claims)}\n", flush=True)
    print(describe_logs(log_dir), flush=True)
    print(f"total wall time {wall_seconds:.0f} s", flush=True)
    report = dict(
        mode=args.models,
        config={key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        versions=dict(torch=torch.__version__, hivemind=hivemind.__version__, hivemind_accum=hivemind_accum.__version__),
        wall_s=wall_seconds,
        work=work_rows,
        training=training_rows,
        claims=claims,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
