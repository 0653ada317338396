"""
Sweep model sizes and accumulation implementations, each configuration in its own fresh process; write JSON, a
markdown table and hivemind#566's two figures.

Processes alternate between implementations round by round; every number is a median over all measured micro-steps
of all rounds. Every worker runs with the allocator settings :data:`MALLOC_ENV`. Why, and how each number is
measured: docs/measurement.md. The JSON and markdown are rewritten after every worker; a worker that fails or runs past
``--worker-timeout`` is recorded there and skipped (the exit status is then 1). ``--merge`` adds to saved results.

A model name may carry a precision, ``<model>:<precision>`` with precision ``fp32`` (default), ``bf16`` or ``fp16``
(see :mod:`benchmarks.micro_step_worker`); ratios are then to native accumulation in the same precision.

Run: ``python -m benchmarks.sweep`` (all sizes; about 10 minutes on 2 CPU cores), ``--help`` for options. On a GPU,
``--device cuda --preset report`` runs hivemind#566's setting; ``benchmarks/gpu_run.sh`` is the prepared command
(docs/measurement.md#on-a-gpu).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.micro_step_worker import IMPLEMENTATIONS, PRESETS, REPORT_IMPLEMENTATIONS, WORK_KEYS

DEFAULT_MODELS = ("linear-10m", "resnet152", "linear-100m", "convnext-large")
REPORT_MODELS = ("resnet152", "convnext-large")
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MALLOC_ENV = dict(MALLOC_MMAP_THRESHOLD_=str(2**30), MALLOC_TRIM_THRESHOLD_=str(2**32))


def run_configuration(
    impl: str, model: str, steps: int, warmup: int, batch_size: int, threads: int, device: str = "cpu",
    preset: Optional[str] = None, windows: int = 1, timeout: float = 1800,
) -> dict:
    """
    Run one configuration in a fresh ``python -m benchmarks.micro_step_worker`` process.

    :param model: a model name, optionally with ``:<precision>`` (``linear-10m:bf16``)
    :param device: ``cpu`` or ``cuda``: where the model, inputs, autocast and scaler live
    :param preset: a worker preset (``report``) that overrides batch size, image size and precision
    :param windows: CUDA only: timed windows of ``steps`` micro-steps (one sample each)
    :param timeout: seconds the worker may run; then it is killed
    :returns: the worker's JSON result (times in seconds, memory in bytes)
    :raises RuntimeError: with the worker's stderr tail if it fails or runs past ``timeout``
    """
    model, _, precision = model.partition(":")
    command = [
        sys.executable, "-m", "benchmarks.micro_step_worker", "--impl", impl, "--model", model,
        "--precision", precision or "fp32", "--steps", str(steps), "--windows", str(windows),
        "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", str(threads), "--device", device,
    ] + (["--preset", preset] if preset else [])
    env = dict(os.environ, **MALLOC_ENV)
    try:
        proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise RuntimeError(f"{' '.join(command)} ran past {timeout:.0f} s:\n{stderr[-3000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_sweep(
    models: Sequence[str] = DEFAULT_MODELS,
    impls: Sequence[str] = IMPLEMENTATIONS,
    rounds: int = 2,
    steps: int = 6,
    warmup: int = 10,
    batch_size: int = 4,
    threads: int = 1,
    verbose: bool = True,
    device: str = "cpu",
    preset: Optional[str] = None,
    windows: int = 1,
    failures: Optional[List[dict]] = None,
    on_result: Optional[Callable[[Dict[str, Dict[str, List[dict]]]], None]] = None,
    worker_timeout: float = 1800,
    results: Optional[Dict[str, Dict[str, List[dict]]]] = None,
) -> Dict[str, Dict[str, List[dict]]]:
    """
    Run every (model, implementation) configuration ``rounds`` times, each in a fresh process, alternating.

    :param failures: if given, a worker that fails is recorded there (model, impl, round, error) and the sweep goes
      on; if None, the first failure is raised
    :param on_result: called with the results so far after every worker, failed ones included (to save them)
    :param worker_timeout: seconds each worker may run (see :func:`run_configuration`)
    :param results: earlier results to add to (updated in place), e.g. another sweep's on the same machine
    :returns: ``results[model][impl]`` = list of worker results, one per round (per fresh process)
    :raises RuntimeError: if a worker fails and ``failures`` is None
    """
    results = {} if results is None else results
    for model in models:
        by_impl = results.setdefault(model, {})
        for impl in impls:
            by_impl.setdefault(impl, [])
        for round_ in range(rounds):
            for impl in impls if round_ % 2 == 0 else reversed(impls):
                try:
                    result = run_configuration(impl, model, steps, warmup, batch_size, threads, device, preset,
                                               windows, timeout=worker_timeout)
                except RuntimeError as e:
                    if failures is None:
                        raise
                    failures.append(dict(model=model, impl=impl, round=round_ + 1, error=str(e)))
                    print(f"[sweep] {model} round {round_ + 1}/{rounds} {impl:>14} on {device}: FAILED, skipped:\n{e}",
                          file=sys.stderr, flush=True)
                else:
                    by_impl[impl].append(result)
                    if verbose:
                        print(
                            f"[sweep] {model} round {round_ + 1}/{rounds} {impl:>14} on {device}: micro-step "
                            f"{1e3 * statistics.median(result['micro_step']):.1f} ms",
                            file=sys.stderr, flush=True,
                        )
                if on_result is not None:
                    on_result(results)
    return results


def pooled(runs: List[dict], key: str) -> List[float]:
    """all samples of ``key`` over every process of one configuration"""
    return [sample for run in runs for sample in run[key]]


def summarize(results: Dict[str, Dict[str, List[dict]]]) -> List[dict]:
    """one row per (model, implementation) with samples: medians in milliseconds, ratios to native (None without
    native samples), throughput in samples/s, peak RSS and device memory in MiB, and the profiled work of one no-sync
    step (see the worker)"""
    rows = []
    for model, by_impl in results.items():
        native = statistics.median(pooled(by_impl["native"], "micro_step")) if by_impl.get("native") else None
        native_device = by_impl["native"][0].get("peak_device_bytes") if by_impl.get("native") else None
        for impl, runs in by_impl.items():
            if not runs:  # every worker of it failed, or it has not run yet
                continue
            micro = statistics.median(pooled(runs, "micro_step"))
            no_sync, load = pooled(runs, "no_sync_step"), pooled(runs, "load")
            peak_device = max((run.get("peak_device_bytes") or 0) for run in runs) or None
            work = {key: max((run["work"].get(key) for run in runs if run["work"].get(key) is not None), default=None)
                    for key in WORK_KEYS}
            rows.append(dict(
                model=model, impl=impl, device=runs[0].get("device", "cpu"), params_m=runs[0]["params"] / 1e6,
                tensors=runs[0]["tensors"], batch_size=runs[0]["batch_size"], micro_step_ms=1e3 * micro,
                throughput=runs[0]["batch_size"] / micro,
                ratio_to_native=micro / native if native else None,
                throughput_vs_native=native / micro if native else None,
                no_sync_step_ms=1e3 * statistics.median(no_sync) if no_sync else None,
                load_ms=1e3 * statistics.median(load) if load else None,
                peak_rss_mib=max(run["peak_rss_bytes"] for run in runs) / 2**20,
                peak_device_mib=peak_device / 2**20 if peak_device else None,
                peak_device_vs_native=peak_device / native_device if peak_device and native_device else None,
                processes=len(runs), samples=len(pooled(runs, "micro_step")), **work,
            ))
    return rows


def markdown_table(rows: List[dict]) -> str:
    """the CPU table (micro-step times), or, if any row was measured on CUDA, the GPU table (throughput, host syncs,
    kernel launches, device memory)"""
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    if any(row.get("device") == "cuda" for row in rows):
        lines = [
            "| model (M params, tensors) | implementation | samples/s | throughput vs native | no-sync `step()` host ms "
            "| host syncs per no-sync step | kernels per no-sync step | peak device MiB (vs native) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            syncs = "n/a" if row["impl"] == "native" else f"{row['sync_warnings']} ({row['host_reads']} reads)"
            lines.append(
                f"| {row['model']} ({row['params_m']:.1f} M, {row['tensors']}) | {row['impl']} | {row['throughput']:.0f} "
                f"| {fmt(row['throughput_vs_native'], '.3f')} | {fmt(row['no_sync_step_ms'], '.2f')} | {syncs} "
                f"| {'n/a' if row['impl'] == 'native' else row['kernels']} "
                f"| {fmt(row['peak_device_mib'], '.0f')} ({fmt(row['peak_device_vs_native'], '.3f')}x) |"
            )
        return "\n".join(lines)
    lines = [
        "| model (M params, tensors) | implementation | micro-step ms | ratio to native | no-sync `step()` ms "
        "| averaging-time load ms | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} ({row['params_m']:.1f} M, {row['tensors']}) | {row['impl']} | {row['micro_step_ms']:.1f} "
            f"| {fmt(row['ratio_to_native'], '.3f')} | {fmt(row['no_sync_step_ms'], '.2f')} "
            f"| {fmt(row['load_ms'], '.1f')} | {row['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: List[dict], output_dir: str, title_suffix: str) -> List[str]:
    """the report's two figures: no-sync step time against parameter count, local throughput relative to native"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = dict(zip(REPORT_IMPLEMENTATIONS, ("tab:gray", "tab:red", "tab:orange", "tab:blue",
                                                "tab:green", "tab:purple", "tab:brown")))
    order = [impl for impl in REPORT_IMPLEMENTATIONS if any(r["impl"] == impl for r in rows)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for impl in (impl for impl in order if impl != "native"):
        points = sorted((r["params_m"], r["no_sync_step_ms"]) for r in rows if r["impl"] == impl and r["no_sync_step_ms"])
        if points:
            ax.plot(*zip(*points), marker="o", label=impl, color=colors[impl])
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("no-sync opt.step() time, ms (median, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"No-sync step time vs model size ({title_suffix})")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(os.path.join(output_dir, "no_sync_step_vs_params.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    models = list(dict.fromkeys(r["model"] for r in rows))
    impls = order
    fig, ax = plt.subplots(figsize=(8.4, 4.2))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        values = [next((r["throughput_vs_native"] or 0 for r in rows if r["model"] == m and r["impl"] == impl), 0)
                  for m in models]
        bars = ax.bar([i + k * width for i in range(len(models))], [100 * v for v in values], width, label=impl,
                      color=colors[impl])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("local throughput, % of native PyTorch accumulation")
    ax.set_title(f"Local throughput relative to native ({title_suffix})")
    ax.axhline(100, color="gray", lw=0.8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside the axes: it covers no bar
    ax.set_ylim(0, max(110, 10 * (1 + max(100 * (r["throughput_vs_native"] or 0) for r in rows) // 10)))
    paths.append(os.path.join(output_dir, "throughput_vs_native.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def machine_description(threads: int, device: str = "cpu", device_name: Optional[str] = None) -> str:
    """one line naming the machine, torch, threads, Python and allocator settings, for the results' header

    :param device_name: the GPU's name as a worker read it (this process never touches CUDA)
    """
    gpu = f"{device_name or 'a GPU'}, CUDA {torch.version.cuda}, " if device == "cuda" else ""
    return (
        f"{gpu}{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {threads} intra-op "
        f"thread(s), Python {platform.python_version()}, glibc malloc {' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}"
    )


def save_results(path: str, results: Dict[str, Dict[str, List[dict]]], failures: List[dict], threads: int,
                 device: str, args: dict) -> str:
    """
    Write ``path`` + ``.json`` (machine, args, summary rows, raw results, failures) and ``.md`` (the table, then
    one line per failed worker).

    :returns: the markdown text
    """
    rows = summarize(results)
    device_name = next((run.get("device_name") for by_impl in results.values() for runs in by_impl.values()
                        for run in runs if run.get("device_name")), None)
    machine = machine_description(threads, device, device_name)
    with open(f"{path}.json", "w") as f:
        json.dump(dict(machine=machine, args=args, rows=rows, raw=results, failures=failures), f, indent=1)
    lines = [f"Measured on: {machine}", "", markdown_table(rows)]
    if failures:
        lines += ["", "Failed workers (recorded, skipped):"]
        lines += [f"- {f['model']} {f['impl']} round {f['round']}: {f['error'].strip().splitlines()[-1]}"
                  for f in failures]
    text = "\n".join(lines) + "\n"
    with open(f"{path}.md", "w") as f:
        f.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help=f"linear-<N>m, resnet152, convnext-large (default: "
                        f"{' '.join(DEFAULT_MODELS)}; with --preset report: {' '.join(REPORT_MODELS)})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: %(default)s")
    parser.add_argument("--preset", choices=PRESETS, help="report: hivemind#566's setting (batch 32 of 224x224 "
                        "images, fp16 AMP with loss scaling, target 32768) with upstream reuse_grad_buffers=True too")
    parser.add_argument("--impls", nargs="+", choices=REPORT_IMPLEMENTATIONS,
                        help="implementations (default: native upstream exact inplace; with --preset, all five)")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per implementation, alternating (default: 2)")
    parser.add_argument("--steps", type=int, help="measured micro-steps per process on CPU (default: 6), per window on "
                        "CUDA (default: 30)")
    parser.add_argument("--windows", type=int, default=2, help="CUDA: timed windows per process (default: 2)")
    parser.add_argument("--warmup", type=int, default=10, help="micro-steps before measuring (default: 10)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch (default: 4; the preset: 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default: 1)")
    parser.add_argument("--worker-timeout", type=float, default=1800,
                        help="seconds one worker may run before it is killed and recorded as failed (default: 1800)")
    parser.add_argument("--output-dir", default=RESULTS_DIR, help="where to write <name>.{json,md} and the plots")
    parser.add_argument("--name", help="file name of the results (default: sweep_<device>)")
    parser.add_argument("--merge", action="store_true",
                        help="add to the results already in <name>.json (another sweep's on the same machine)")
    parser.add_argument("--no-plot", action="store_true", help="write no figures")
    args = parser.parse_args(argv)
    models = args.models or list(REPORT_MODELS if args.preset else DEFAULT_MODELS)
    impls = args.impls or list(REPORT_IMPLEMENTATIONS if args.preset else IMPLEMENTATIONS)
    steps = args.steps or (30 if args.device == "cuda" else 6)
    name = args.name or f"sweep_{args.device}"
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, name)
    results, failures = {}, []
    if args.merge and os.path.exists(f"{path}.json"):
        with open(f"{path}.json") as f:
            saved = json.load(f)
        results, failures = saved["raw"], saved.get("failures", [])
    failed_before = len(failures)

    def save(results_so_far):  # after every worker: a run cut short keeps what it measured
        return save_results(path, results_so_far, failures, args.threads, args.device, vars(args))

    run_sweep(models, impls, args.rounds, steps, args.warmup, args.batch_size, args.threads, device=args.device,
              preset=args.preset, windows=args.windows if args.device == "cuda" else 1, failures=failures,
              on_result=save, worker_timeout=args.worker_timeout, results=results)
    text = save(results)
    rows = summarize(results)
    label = "GPU" if args.device == "cuda" else "CPU"
    for figure in [] if args.no_plot or not rows else plot(rows, args.output_dir,
                                                           f"{label}{', report setting' if args.preset else ''}"):
        print(f"wrote {figure}", file=sys.stderr)
    print(text)
    if len(failures) > failed_before:
        sys.exit(f"{len(failures) - failed_before} worker(s) failed (recorded in {name}.json and {name}.md)")


if __name__ == "__main__":
    main()
