"""
Whether every micro-step counts exactly once, for upstream hivemind and ``hivemind_accum``, in the settings where
rounds run late: hivemind's defaults, a short ``averaging_timeout``, and links rate-limited to 1 Mbit/s (network
namespaces and ``tc tbf``: needs root), each with and without ``delay_grad_averaging``. Every setting runs the swarm of
:mod:`benchmarks.swarm_training` for both implementations and each seed, and the table counts, over all peers, how
many optimizer steps used each micro-step, splitting the unused ones into dropped by a state download (hivemind's
rule), unfinished and lost; and the samples the peers hand to a round per epoch (median over runs; the target is 96):
how far past the target the swarm goes before its peers notice it. ``hivemind_accum`` runs as
``hivemind_accum.Optimizer``, its progress tracker included.

    python -m benchmarks.swarm_accounting --seeds 3 --epochs 15     # needs root for the rate-limited settings

Writes every run to ``--output`` (JSON) and prints the table as markdown (docs/measurement.md#swarms).
"""
import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional

from benchmarks.swarm_training import IMPLEMENTATIONS, SwarmConfig, run_swarm

SETTINGS = {  # name -> what differs from SwarmConfig's defaults (delay_grad_averaging is set per row)
    "(a) defaults": {},
    "(b) averaging_timeout=1.5": dict(averaging_timeout=1.5),
    "(c) 1 Mbit/s links": dict(link_mbit=1.0),
}


def tally(runs: List[Dict[str, Any]]) -> Dict[str, int]:
    """over every peer of ``runs``: micro-steps used 0, 1, 2 or more times, and the unused ones by why"""
    peers = [peer for run in runs for peer in run["peers"]]
    counts = {f"used_{k}": sum(peer["used"][k] for peer in peers) for k in range(3)}
    counts["used_more"] = sum(sum(peer["used"][3:]) for peer in peers)
    counts.update({why: sum(peer["unused"][why] for peer in peers) for why in ("download", "unfinished", "lost")})
    counts["incomplete_runs"] = sum(not run["complete"] for run in runs)
    # how far past the target the swarm accumulates before its peers begin a round: how late they notice it
    counts["samples_per_epoch"] = statistics.median(
        sum(sum(peer["weights"]) for peer in run["peers"]) / run["config"]["epochs"] for run in runs)
    return counts


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| setting | delay | implementation | micro-steps used 0 / 1 / 2 times | unused: download / unfinished "
             "/ lost | used twice or more | samples handed to a round per epoch |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        c = row["counts"]
        lines.append(
            f"| {row['setting']} | {'yes' if row['delay'] else 'no'} | {row['implementation']} | "
            f"{c['used_0']} / {c['used_1']} / {c['used_2']} | {c['download']} / {c['unfinished']} / {c['lost']} | "
            f"{c['used_2'] + c['used_more']} | {c['samples_per_epoch']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--output", default="/tmp/swarm_accounting.json")
    args = parser.parse_args(argv)
    rows, started = [], time.perf_counter()
    for setting in args.settings:
        for delay in (True, False):
            base = replace(SwarmConfig(epochs=args.epochs, delay_grad_averaging=delay), **SETTINGS[setting])
            runs = {implementation: [] for implementation in IMPLEMENTATIONS}
            for seed in range(args.seeds):
                for implementation in IMPLEMENTATIONS:  # alternating, so machine load affects both alike
                    runs[implementation].append(run_swarm(replace(base, seed=seed, implementation=implementation)))
            for implementation, mine in runs.items():
                rows.append(dict(setting=setting, delay=delay, implementation=implementation, counts=tally(mine),
                                 runs=mine))
            print(f"[{time.perf_counter() - started:.0f} s] {setting}, delay {delay}: done", flush=True)
            with open(args.output, "w") as file:  # after every setting: a partial table survives an interruption
                json.dump(dict(command=" ".join(["python -m benchmarks.swarm_accounting", *sys.argv[1:]]), rows=rows),
                          file, indent=1)
    print(table(rows))
    print(f"every run: {args.output}")


if __name__ == "__main__":
    main()
