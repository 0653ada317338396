"""The main job's screen: its two tables, its claims and what hivemind logged, each at most 120 columns."""
import collections
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.main_job.common import LEGEND

WIDTH = 120
WORK_COLUMNS = (
    # (row key, header, format)
    ("label", "mode", "{}"),
    ("no_sync_step_ms", "step ms", "{:.2f}"),
    ("step_ops", "ops", "{}"),
    ("host_reads_fp16", "reads fp16", "{}"),
    ("no_sync_step_fp16_ms", "step ms fp16", "{:.2f}"),
    ("accum_mb_fp32", "accum MB", "{:.1f}"),
    ("accum_mb_fp16", "accum MB fp16", "{:.1f}"),
    ("fallback_mb", "fallback MB", "{:.1f}"),
    ("micro_step_ms", "micro-step ms", "{:.1f}"),
    ("x_native", "x native", "{:.3f}"),
)
TRAINING_COLUMNS = (
    ("section", "loop", "{}"),
    ("label", "mode", "{}"),
    ("peers", "peers", "{}"),
    ("final_loss", "loss", "{:.3f}"),
    ("test_accuracy", "test acc", "{:.3f}"),
    ("epochs", "epochs", "{}"),
    ("micro_steps", "micro-steps", "{}"),
    ("averaged", "averaged", "{}"),
    ("grad_error", "grad error", "{:.1e}"),
    ("train_s", "train s", "{:.1f}"),
    ("finite", "finite", "{}"),
)
# what hivemind 1.1.12 logs as [ERROR] in this job, and why
KNOWN_ERRORS = (
    ("could not find a group", "a round found no partner in time; that peer used its local gradients"),
    # [Errno 2] No such file or directory, or [Errno 104] Connection reset by peer
    ("[hivemind.dht.dht._run:130]", "the DHT read a request after its sender exited (docs/upstream.md)"),
    ("Unable to run All-Reduce", "an all-reduce failed midway (a peer was late); that round stayed local"),
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
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in [header] + cells)


def format_claims(claims: Sequence[Dict[str, Any]]) -> str:
    """one line per claim (``holds``, ``does not hold`` or ``not judged``, then the claim and its numbers: accum's,
    and ``vs`` the upstream mode's where it names one), and a ``why:`` line under each judged claim that does not
    hold (the load that left a claim not judged is printed once, by :func:`claims_section`)"""
    lines = []
    for c in claims:
        judged = c.get("judged", True)
        verdict = "not judged" if not judged else "holds" if c["holds"] else "does not hold"
        numbers = c["a"] if c.get("b") is None else f"{c['a']} vs {c['b']}"
        lines.append(f"{verdict:<13}  {c['text']}: {numbers}")
        if judged and not c["holds"]:
            lines.append(f"{'':13}  why: {c['why']}"[:WIDTH])
    return "\n".join(lines)


def work_section(rows: Sequence[Dict[str, Any]], load: Optional[str] = None) -> str:
    """
    The work table under its title. Its ``x native`` ratios come from one process per mode, whose spread between
    processes is larger than the gaps between modes: a ratio below 1 gets a line saying so, and on a loaded machine
    the ratios are left out.

    :param load: :func:`benchmarks.main_job.claims.loaded` of the work section's samples
    """
    notes = []
    if load:
        rows = [dict(row, x_native=None) for row in rows]
        notes.append(f"x native left out: {load.replace('not judged: ', '')}")
    elif faster := [row for row in rows if row.get("x_native") is not None and row["x_native"] < 1]:
        ratios = ", ".join(f"{row['label']} {row['x_native']:.3f}" for row in faster)
        notes += [f"x native below 1: {ratios}", "  one process per mode: within the noise between processes; "
                  "python -m benchmarks.host_cpu compares modes"]
    return (f"Work per no-sync micro-step, one process per mode in turn ({rows[0]['params'] / 1e6:.1f} M "
            f"parameters in {rows[0]['tensors']} tensors; fp32 unless fp16):\n{format_table(rows, WORK_COLUMNS)}"
            + "".join(f"\n{note}"[:WIDTH + 1] for note in notes))


def training_section(config: Dict[str, Any], rows: Sequence[Dict[str, Any]]) -> str:
    """the training table under its title; ``config`` holds the command-line arguments (the JSON's ``config``)"""
    samples = config["num_peers"] * config["micro_steps_per_epoch"] * config["micro_batch_size"]
    return (f"Training on digits: {config['epochs']} optimizer steps of {samples} samples, {config['num_peers']} "
            f"peers per hivemind mode (nonfinite: {config['nonfinite_epochs']} steps, healthy peer):\n"
            f"{format_table(rows, TRAINING_COLUMNS)}")


def load_line(load: Dict[str, Dict[str, Any]]) -> str:
    """the core count and each sample's 1/5/15-minute load averages (the JSON's ``load``)"""
    first = next(iter(load.values()))
    return (f"Machine load: {first['cores']} cores; 1/5/15-minute load average "
            + "; ".join(f"{when.replace('_', ' ')} {'/'.join(f'{v:.1f}' for v in sample['load_average'])}"
                        for when, sample in load.items()))


def claims_section(claims: Sequence[Dict[str, Any]], load: Optional[str] = None) -> str:
    """
    The claims under a title that counts them by verdict.

    :param load: why the timing claims are not judged (:func:`benchmarks.main_job.claims.loaded`), or None
    """
    judged = [c for c in claims if c.get("judged", True)]
    failing = sum(not c["holds"] for c in judged)
    title = (f"Claims ({len(claims)}: {len(judged) - failing} hold, {failing} "
             f"{'does' if failing == 1 else 'do'} not hold, {len(claims) - len(judged)} not judged):")
    if load and len(judged) < len(claims):
        title += f"\ntiming claims {load}"
    return f"{title}\n{format_claims(claims)}"


def render(report: Dict[str, Any], log_dir: str) -> List[str]:
    """
    The main job's screen, rebuilt from its JSON report, without the lines naming the JSON and the wall time.

    :param report: what the main job wrote (``work``, ``training``, ``config``, ``claims``, ``log``, ``load``)
    :param log_dir: the folder its log lines name
    """
    from benchmarks.main_job.claims import loaded

    parts = [LEGEND]
    load = report.get("load")
    reason = loaded([load["start"], load.get("after_work", load["start"])]) if load else None
    if report["work"]:
        parts.append("\n" + work_section(report["work"], reason))
    if report["training"]:
        parts.append("\n" + training_section(report["config"], report["training"]))
    if load:
        parts.append("\n" + load_line(load))
    parts.append("\n" + claims_section(report["claims"], reason) + "\n")
    parts += describe_logs(log_dir, report["log"])
    return "\n".join(parts).split("\n")


def count_log_errors(log_dir: str) -> Dict[str, Any]:
    """
    Count what hivemind logged in this run, so that its noise is explained, not hidden.

    :param log_dir: folder holding one stderr file per process
    :returns: ``errors`` ({known pattern or unknown line: count}) and ``destroyed`` (asyncio shutdown warnings)
    """
    errors, destroyed = collections.Counter(), 0
    for name in sorted(os.listdir(log_dir)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(log_dir, name), errors="replace") as log:
            for line in log:
                destroyed += line.startswith("Task was destroyed but it is pending!")
                if "[ERROR]" not in line:
                    continue
                known = next((pattern for pattern, _ in KNOWN_ERRORS if pattern in line), None)
                errors[known or line.split("[ERROR]", 1)[1].strip()[:80]] += 1
    return dict(errors=dict(errors), destroyed=destroyed)


def describe_logs(log_dir: str, counts: Dict[str, Any], what: str = "hivemind's log") -> List[str]:
    """
    Say where hivemind's log is and explain each kind of [ERROR] line in it.

    :param counts: :func:`count_log_errors` of ``log_dir``
    :param what: what the folder holds, as the first line names it
    """
    reasons = dict(KNOWN_ERRORS)
    errors = "" if counts["errors"] else ", no [ERROR]"
    lines = [f"{what}: {log_dir} ({counts['destroyed']} x 'Task was destroyed'{errors})"]
    if counts["destroyed"]:
        lines.append("  'Task was destroyed': asyncio tasks hivemind leaves pending when a process exits; harmless")
    for text, count in sorted(counts["errors"].items(), key=lambda item: -item[1]):
        lines.append(f"  {count} x [ERROR] '{text}': {reasons.get(text, 'not explained: please report it')}"[:WIDTH])
    return lines
