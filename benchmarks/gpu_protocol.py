"""
Does each implementation keep native accumulation's throughput? One model, every implementation in ONE process.

Each implementation is a :class:`benchmarks.micro_step_worker.Loop` (its own model copy, same seed; hivemind's
optimizers share one DHT; a target batch size never reached, so every ``step()`` is a no-sync step). A block runs one
window of each implementation in a random order. A window: ``--lead`` untimed micro-steps, a synchronize, ``--steps``
timed micro-steps, a synchronize. Its time is CUDA-event time on a GPU (wall time on a CPU); the main thread's CPU
(``time.thread_time``) and the other threads' (``time.process_time`` minus it) are recorded beside it.

Per block, each implementation's paired throughput ratio to native (native's time over its own, > 1 is faster). Per
implementation, the median ratio with a 95 % bootstrap interval, and a verdict on ``--target``: "holds" if the lower
bound clears it, "falls short" if the upper bound is below it, else "undecided"; fewer than ``--min-blocks`` blocks
are always "undecided". Upstream's implementations get no verdict (they are what is compared against). The spread of
native's windows is printed beside, so a noisy machine shows as undecided, not as a verdict.

Blocks run until ``--blocks`` or until the next block would end past ``--deadline-s`` (seconds since start); the
JSON and markdown in ``--out-dir`` are rewritten after every block, so a time limit keeps what was measured. Then one
no-sync step per implementation is profiled (host reads, top-level ops, device kernels). On a GPU, clocks,
temperature and power are read before and after.

``--cpu-load K`` starts K busy processes beside the training process (a data loader's or another peer's CPU work);
run the whole under ``taskset -c 0,1`` for the regime of hivemind#566's shared nodes (``benchmarks/gpu_run.sh``).

    python -m benchmarks.gpu_protocol --device cuda --model resnet152 --out-dir OUT
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

from benchmarks.intervals import bootstrap_interval, verdict
from benchmarks.micro_step_worker import PRESETS, Loop, count_work

IMPLEMENTATIONS = ("native", "inplace", "exact", "exact_hivemind", "upstream_hivemind", "upstream_reuse")
UPSTREAM = ("upstream", "upstream_hivemind", "upstream_reuse")  # compared against, no verdict
GPU_QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
# a data loader's kind of work, one core each: small array arithmetic in a loop
CPU_LOAD = "import numpy as np\na = np.random.rand(64, 64)\nwhile True:\n    a = np.tanh(a @ a.T / 64)\n"


def gpu_state(device: str) -> Optional[Dict[str, str]]:
    """``nvidia-smi``'s clocks, temperature, power and throttle reasons of GPU 0 (None on a CPU or without it)"""
    if device != "cuda":
        return None
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return dict(error=repr(e))
    return dict(zip(GPU_QUERY.split(","), (value.strip() for value in line.split(","))))


def window(loop: Loop, lead: int, steps: int) -> Dict[str, float]:
    """one window of ``loop``: seconds per micro-step (device time on a GPU), main- and other-thread CPU per micro-step"""
    cuda = loop.device == "cuda"
    for _ in range(lead):
        loop.micro_step()
    if cuda:
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    main_cpu, all_cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
    if cuda:
        start_event.record()
    for _ in range(steps):
        loop.micro_step()
    if cuda:
        end_event.record()
        torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    main_cpu, all_cpu = time.thread_time() - main_cpu, time.process_time() - all_cpu
    seconds = start_event.elapsed_time(end_event) / 1e3 if cuda else wall
    return dict(time=seconds / steps, wall=wall / steps, main_cpu=main_cpu / steps, other_cpu=(all_cpu - main_cpu) / steps)


def summarize(blocks: List[dict], impls, target: float, min_blocks: int) -> Dict[str, dict]:
    """per implementation: time and CPU medians, the median ratio to native with its interval, and the verdict"""
    summary = {}
    for impl in impls:
        times = [block[impl]["time"] for block in blocks]
        row = dict(time_ms=statistics.median(times) * 1e3,
                   main_cpu_ms=statistics.median(block[impl]["main_cpu"] for block in blocks) * 1e3,
                   other_cpu_ms=statistics.median(block[impl]["other_cpu"] for block in blocks) * 1e3,
                   spread=_spread(times))
        if impl != "native":
            interval = bootstrap_interval([block["native"]["time"] / block[impl]["time"] for block in blocks])
            row.update(ratio=interval, verdict=None if impl in UPSTREAM else
                       verdict(interval, target) if len(blocks) >= min_blocks else "undecided")
        summary[impl] = row
    return summary


def _spread(values) -> float:
    """the interquartile range over the median"""
    if len(values) < 4:
        return float("nan")
    quartiles = statistics.quantiles(values, n=4)
    return (quartiles[2] - quartiles[0]) / statistics.median(values)


def markdown(result: dict) -> str:
    config = result["config"]
    lines = [f"{config['model']} on {result['device_name']}, {len(result['blocks'])} blocks of {config['steps']} "
             f"micro-steps per window, target {config['target']} of native (CPU load {config['cpu_load']}, "
             f"cores {config['cores']})", "",
             "| implementation | ms per micro-step | spread (IQR/median) | main-thread CPU ms | other-thread CPU ms "
             "| throughput / native [95 % interval] | verdict |", "|---|---|---|---|---|---|---|"]
    for impl, row in result["summary"].items():
        ratio = "1" if impl == "native" else "{:.3f} [{:.3f}, {:.3f}]".format(*row["ratio"])
        lines.append(f"| {impl} | {row['time_ms']:.2f} | {row['spread']:.3f} | {row['main_cpu_ms']:.2f} | "
                     f"{row['other_cpu_ms']:.2f} | {ratio} | {row.get('verdict') or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument("--blocks", type=int, default=200, help="at most this many blocks")
    parser.add_argument("--min-blocks", type=int, default=30, help="fewer blocks give no verdict")
    parser.add_argument("--deadline-s", type=float, default=150, help="no block may end later (seconds since start)")
    parser.add_argument("--steps", type=int, default=6, help="timed micro-steps per window")
    parser.add_argument("--lead", type=int, default=1, help="untimed micro-steps before a window")
    parser.add_argument("--warmup", type=int, default=3, help="micro-steps of each implementation before the blocks")
    parser.add_argument("--target", type=float, default=0.99, help="throughput ratio to native a verdict judges")
    parser.add_argument("--threads", type=int, default=8, help="torch intra-op threads")
    parser.add_argument("--cpu-load", type=int, default=0, help="busy processes beside this one")
    parser.add_argument("--name", default=None, help="file names in --out-dir (default protocol_<model>)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=0, help="of the block orders")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if "native" not in args.impls:
        parser.error("--impls: native is what the ratios are to")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name or f"protocol_{args.model}")
    load = [subprocess.Popen([sys.executable, "-c", CPU_LOAD], env=dict(os.environ, OMP_NUM_THREADS="1"))
            for _ in range(args.cpu_load)]
    torch.set_num_threads(args.threads)
    import hivemind

    dht, loops = hivemind.DHT(start=True), {}
    config = dict(vars(args), cores=sorted(os.sched_getaffinity(0)), **PRESETS["report"])
    result = dict(config=config, python=platform.python_version(), torch=torch.__version__,
                  hivemind=hivemind.__version__, device_name=torch.cuda.get_device_name() if args.device == "cuda"
                  else platform.processor() or platform.machine(), gpu_before=gpu_state(args.device), blocks=[])
    try:
        preset = PRESETS["report"]
        for impl in args.impls:
            loops[impl] = Loop(impl, args.model, preset["batch_size"], preset["precision"], args.device,
                               preset["image_size"], preset["target_batch_size"], dht=dht)
            for _ in range(args.warmup):
                loops[impl].micro_step()
        result["setup_s"] = time.perf_counter() - started
        rng = random.Random(args.seed)
        while len(result["blocks"]) < args.blocks:
            block_start = time.perf_counter()
            order = rng.sample(args.impls, len(args.impls))
            block = {impl: window(loops[impl], args.lead, args.steps) for impl in order}
            result["blocks"].append(dict(block, order=order))
            result["summary"] = summarize(result["blocks"], args.impls, args.target, args.min_blocks)
            _write(stem, result)
            now = time.perf_counter()
            if now + (now - block_start) > started + args.deadline_s:
                break
        result["gpu_after"] = gpu_state(args.device)
        result["work"] = {}
        for impl in args.impls:
            if impl != "native" and time.perf_counter() - started < args.deadline_s + 10:
                try:
                    result["work"][impl] = count_work(loops[impl].micro_step, args.device)
                except Exception as e:  # noqa: BLE001: a failure to count must not lose the timings
                    result["work"][impl] = dict(error=repr(e))
        for impl, loop in loops.items():
            assert loop.opt is None or loop.opt.local_epoch == 0, f"{impl} reached the target batch size"
        _write(stem, result)
    finally:
        for loop in loops.values():
            loop.shutdown()
        dht.shutdown()
        for process in load:
            process.kill()
    print(markdown(result))
    print(f"native's windows: spread {result['summary']['native']['spread']:.3f} (IQR/median); GPU before "
          f"{result['gpu_before']}, after {result.get('gpu_after')}")
    print("work per no-sync step:", json.dumps(result["work"]))
    print(f"{len(result['blocks'])} blocks in {time.perf_counter() - started:.0f} s (setup {result['setup_s']:.0f} s); "
          f"{stem}.json")
    return 0


def _write(stem: str, result: dict) -> None:
    with open(stem + ".json.tmp", "w") as file:
        json.dump(result, file, indent=1)
    os.replace(stem + ".json.tmp", stem + ".json")
    with open(stem + ".md", "w") as file:
        file.write(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
