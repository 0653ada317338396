"""
The main job: hivemind_accum against upstream hivemind 1.1.12 and native PyTorch accumulation, on one screen.

It prints a work table (one micro-step per mode), a training table (two peers on loopback learning scikit-learn's
digits), one line per claim and a reason under each claim that does not hold. Per-run detail goes to the JSON.
What each column means and how it is measured: docs/measurement.md.

Run from the repository root: ``python benchmarks/benchmark_local_accumulation.py [--verbose] [--models large]``.
"""
import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import hivemind
import torch

import hivemind_accum
from benchmarks.main_job.claims import loaded, machine_load, make_claims
from benchmarks.main_job.common import LEGEND, SECTIONS
from benchmarks.main_job.report import (
    WIDTH, claims_section, count_log_errors, describe_logs, load_line, training_section, work_section,
)
from benchmarks.main_job.training import TrainConfig, run_label, run_native, run_peers, summarize_training
from benchmarks.main_job.work import WorkConfig, run_work
from benchmarks.sweep import MALLOC_ENV

LARGE_MODELS = ("resnet152", "convnext-large")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """
    Parse the command line.

    :param argv: command-line arguments (default: ``sys.argv[1:]``)
    """
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--models", choices=("small", "large"), default="small",
                        help="small (default): the work, training, framework and nonfinite sections (see "
                        "--sections); large: time ResNet-152 and ConvNeXt-Large (benchmarks.sweep), one peer")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="small mode: sections to run (default: all)")
    parser.add_argument("--verbose", action="store_true", help="print progress and one line per peer and run")
    parser.add_argument("--work-steps", type=int, default=10, help="work: measured fp32 micro-steps (default: 10)")
    parser.add_argument("--work-warmup", type=int, default=10, help="work: fp32 warm-up micro-steps (default: 10)")
    parser.add_argument("--work-fp16-steps", type=int, default=8, help="work: measured fp16 micro-steps (default: 8)")
    parser.add_argument("--num-peers", type=int, default=2, help="training: hivemind peers (default: 2)")
    parser.add_argument("--micro-batch-size", type=int, default=32,
                        help="training: samples per micro-step (default: 32)")
    parser.add_argument("--epochs", type=int, default=12, help="training: optimizer steps per run (default: 12)")
    parser.add_argument("--micro-steps-per-epoch", type=int, default=6,
                        help="training: micro-steps per peer per epoch; target_batch_size = num_peers * this * "
                        "micro_batch_size (default: 6)")
    parser.add_argument("--nonfinite-epochs", type=int, default=4,
                        help="nonfinite: optimizer steps of each run with a NaN peer (default: 4)")
    parser.add_argument("--lr", type=float, default=1.5e-3, help="training: Adam learning rate (default: 0.0015)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0, help="seconds (default: 1)")
    parser.add_argument("--averaging-timeout", type=float, default=10.0, help="seconds (default: 10)")
    parser.add_argument("--threads", type=int, help="training: torch threads per process (default: CPU cores / peers)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of split, shards, batch order and weights (default: 0)")
    parser.add_argument("--loss-window", type=int, default=20,
                        help="last micro-batches averaged into the final loss (default: 20)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for each group of processes")
    parser.add_argument("--output", type=Path,
                        help="where to write the JSON report (default: local_accumulation[_large].json in the run's "
                        "temporary folder, next to hivemind's log)")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.num_peers)
    for name in ("work_steps", "work_fp16_steps", "num_peers", "micro_batch_size", "epochs", "micro_steps_per_epoch",
                 "threads", "loss_window", "nonfinite_epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.work_warmup < 0:
        parser.error("--work-warmup must be at least 0")
    return args


def progress_printer(verbose: bool) -> Callable[[str], None]:
    """``--verbose``: progress lines on stdout; otherwise one status line on a terminal's stderr, overwritten, or,
    where stderr is not a terminal, the first line of each section (``[work]``, ``[peers]``, ...) on stdout"""
    def wrapped(line: str) -> None:
        print(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False), flush=True)

    if verbose:
        return wrapped
    if sys.stderr.isatty():
        return lambda line: print(f"\r\033[K{line[:WIDTH - 1]}", end="", file=sys.stderr, flush=True)
    sections = set()

    def first_of_each_section(line: str) -> None:
        section = line.split("]")[0] + "]" if line.startswith("[") else None
        if section is not None and section not in sections:
            sections.add(section)
            wrapped(line)

    return first_of_each_section


def run_large(args: argparse.Namespace, run_dir: str) -> None:
    """time ResNet-152 and ConvNeXt-Large with every accumulation implementation (one fresh process each)"""
    from benchmarks.sweep import machine_description, markdown_table, run_sweep, summarize as summarize_sweep

    results = run_sweep(LARGE_MODELS, rounds=1, steps=6, warmup=4, batch_size=4, threads=1, verbose=args.verbose)
    rows = summarize_sweep(results)
    print(f"Measured on: {machine_description(1)}\n\n{markdown_table(rows)}", flush=True)
    output = args.output or Path(run_dir) / "local_accumulation_large.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(dict(mode="large", rows=rows, raw=results), indent=1) + "\n")
    print(f"JSON: {output}")


def train_all(args: argparse.Namespace, log_dir: str, progress: Callable[[str], None], seconds: dict) -> List[dict]:
    """sections 2 to 4: native in two processes at once, then the peers through every hivemind run; wall seconds of
    each group of processes go to ``seconds``"""
    common = dict(
        num_peers=args.num_peers, micro_batch_size=args.micro_batch_size, epochs=args.epochs,
        micro_steps_per_epoch=args.micro_steps_per_epoch, lr=args.lr, matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout, threads=args.threads, seed=args.seed, loss_window=args.loss_window,
        log_dir=log_dir, nonfinite_epochs=args.nonfinite_epochs, verbose=args.verbose,
    )
    sections = [section for section in ("training", "framework", "nonfinite") if section in args.sections]
    results = []
    if {"training", "framework"} & set(sections):  # nonfinite compares hivemind modes only
        progress("[native] the training and framework loops at the same time, one process each")
        started = time.perf_counter()
        results += [result for result in run_native(common, args.timeout) if result["runs"][0]["section"] in sections]
        seconds["native"] = time.perf_counter() - started
    runs = []
    if "training" in sections:
        runs += [("training", key) for key in ("upstream", "exact", "upstream_reuse", "inplace")]
    if "framework" in sections:
        runs += [("framework", key) for key in ("upstream_reuse", "inplace")]
    if "nonfinite" in sections:
        runs += [("nonfinite", key) for key in ("upstream", "exact")]
    if runs:
        config = TrainConfig(runs=tuple(runs), **common)
        progress(f"[peers] {args.num_peers} peers, target_batch_size={config.target_batch_size}, {len(runs)} runs in "
                 f"turn: {'; '.join(run_label(*run) for run in runs)}")
        started = time.perf_counter()
        results += run_peers(config, args.timeout * len(runs))
        seconds["peers"] = time.perf_counter() - started
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    """
    Run the requested sections, print their tables and the claims, write the JSON.

    :param argv: command-line arguments (default: ``sys.argv[1:]``); see ``--help``
    """
    args = parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="hivemind_accum_main_job_")
    if args.models == "large":
        return run_large(args, run_dir)
    os.environ.update(MALLOC_ENV)  # every process started from here on: the sweep's allocator settings
    started, progress = time.perf_counter(), progress_printer(args.verbose)
    print(LEGEND, flush=True)
    work_rows, seconds, load = [], {}, dict(start=machine_load())
    if "work" in args.sections:
        config = WorkConfig(steps=args.work_steps, warmup=args.work_warmup, fp16_steps=args.work_fp16_steps,
                            batch_size=4, threads=1)
        work_rows = run_work(config, run_dir, args.timeout, progress)
        load["after_work"] = machine_load()
        seconds["work"] = time.perf_counter() - started
        progress("")
        print("\n" + work_section(work_rows, loaded([load["start"], load["after_work"]])), flush=True)
    training_rows = summarize_training(train_all(args, run_dir, progress, seconds))
    progress("")
    if training_rows:
        print("\n" + training_section(vars(args), training_rows), flush=True)
    if args.verbose:
        for row in training_rows:
            for peer in row["per_peer"]:
                print(f"  {run_label(row['section'], row['mode'])} peer {peer.get('peer', 0)}: {peer['epochs']} epochs, "
                      f"{peer['micro_steps']} micro-steps, {peer['train_s']:.1f} s")
    load["end"] = machine_load()
    work_load = loaded([load["start"], load.get("after_work", load["start"])])
    print("\n" + load_line(load), flush=True)
    claims = make_claims(
        {row["mode"]: row for row in work_rows}, {(row["section"], row["mode"]): row for row in training_rows},
        load=work_load,
    )
    print(f"\n{claims_section(claims, work_load)}\n")
    log_counts = count_log_errors(run_dir)
    output = args.output or Path(run_dir) / "local_accumulation.json"
    what = "hivemind's log and this run's JSON" if args.output is None else "hivemind's log"
    print("\n".join(describe_logs(run_dir, log_counts, what)))
    wall_seconds = time.perf_counter() - started
    report = dict(
        mode=args.models,
        config={key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        versions=dict(
            torch=torch.__version__, hivemind=hivemind.__version__, hivemind_accum=hivemind_accum.__version__
        ),
        wall_s=wall_seconds, section_s=seconds, load=load, work=work_rows, training=training_rows, claims=claims,
        log=log_counts,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    parts = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    if args.output is not None:
        print(f"JSON with per-run detail: {output}")
    print(f"total wall time {wall_seconds:.0f} s ({parts}); docs/measurement.md explains every number", flush=True)
