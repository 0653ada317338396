"""
Section 1 of the main job: what one micro-step costs in each mode, each mode alone in its own fresh process.

How and why it is measured: docs/measurement.md#the-main-job.
"""
import contextlib
import multiprocessing as mp
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import hivemind
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import hivemind_accum
from benchmarks.main_job.common import MODES, Mode, make_optimizer, redirect_stderr, run_processes
from benchmarks.micro_step_worker import count_events


class WorkTransformer(nn.Module):
    """
    A token classifier with many parameter tensors: 13.1 M parameters in 195 tensors.

    Embedding, 16 pre-norm transformer encoder layers (width 256, 4 heads, feed-forward 1024), linear head.
    """

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
    What each work process measures (picklable for spawned processes).

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


def fallback_bytes(mode: Mode, model: nn.Module, opt) -> int:
    """host bytes hivemind_accum holds for the failed-round fallback in this configuration: a copy of the gradients
    (float32 for fp16/bf16 parameters) with ``delay_grad_averaging=True``, none without it (the fallback reads the
    accumulators, see docs/guide.md#failed-rounds)"""
    if mode.optimizer != "hivemind_accum" or not opt.delay_grad_averaging:
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
                step_ops=count_events(step_profile.events())["top_level_ops"] if opt is not None else None,
                host_reads_fp16=count_events(micro_step_profile.events())["host_reads"],
                no_sync_step_fp16_ms=1e3 * statistics.median(step for _, step in fp16) if opt is not None else None,
                accum_mb_fp32=extra_fp32 / 2**20,
                accum_mb_fp16=extra_fp16 / 2**20,
                fallback_mb=fallback_bytes(mode, model, opt) / 2**20,
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

def run_work(config: WorkConfig, log_dir: str, timeout: float, progress) -> List[Dict[str, Any]]:
    """
    Measure every mode, each in its own fresh process, one at a time.

    :param log_dir: folder receiving each process's stderr
    :param timeout: seconds allowed for each process
    :param progress: called with one line of progress per mode
    :returns: one row per mode, in :data:`MODES` order, with ``x_native`` added
    :raises RuntimeError: if a process fails or times out
    """
    rows = []
    for key in MODES:
        started = time.perf_counter()
        log_path = os.path.join(log_dir, f"work_{key}.log")
        (row,) = run_processes(f"work {key}", [(work_worker, (key, config, log_path))], timeout)
        row["label"] = MODES[key].label
        rows.append(row)
        progress(f"[work] {MODES[key].label}: micro-step {row['micro_step_ms']:.1f} ms "
                 f"({time.perf_counter() - started:.0f} s)")
    native = rows[0]["micro_step_ms"]
    for row in rows:
        row["x_native"] = row["micro_step_ms"] / native
    return rows

