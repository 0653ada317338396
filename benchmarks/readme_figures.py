"""
The README's table of no-sync ``opt.step()`` costs, generated from the committed runs: the one source of its figures.

Upstream's and exact mode's steps come from the CPU sweep (``benchmarks/results/sweep_cpu.json``), upstream's
``reuse_grad_buffers=True`` and in-place mode's from the latest sweep of the report's models
(``sweep_cpu_report_models.json``), the transformer's rows from the main job (``local_accumulation.json``), the GPU
rows from the GPU run (``gpu/sweep_cuda.json``, written by ``benchmarks/gpu_run.sh``).
``tests/test_readme_figures.py`` checks that README.md holds this table as generated.

Run ``python -m benchmarks.readme_figures`` to print it.
"""
import json
import os
from typing import Dict, Tuple

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = (("resnet152", "ResNet-152"), ("convnext-large", "ConvNeXt-Large"))
COLUMNS = ("upstream", "exact", "upstream_reuse", "inplace")
SOURCES = {"upstream": "sweep_cpu.json", "exact": "sweep_cpu.json", "upstream_reuse": "sweep_cpu_report_models.json",
           "inplace": "sweep_cpu_report_models.json"}


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as file:
        return json.load(file)


def sweep_steps() -> Dict[Tuple[str, str], dict]:
    """(model, implementation) -> that sweep row, each implementation from the file :data:`SOURCES` names"""
    rows = {}
    for impl, name in SOURCES.items():
        for row in _load(name)["rows"]:
            if row["impl"] == impl:
                rows[row["model"], impl] = row
    return rows


def in_place_steps_ms() -> list:
    """every committed fp32 median of in-place mode's no-sync step, in ms (both sweeps and the main job)"""
    steps = [row["no_sync_step_ms"] for name in set(SOURCES.values()) for row in _load(name)["rows"]
             if row["impl"] == "inplace"]
    return steps + [work["no_sync_step_ms"] for work in _load("local_accumulation.json")["work"]
                    if work["mode"] == "inplace"]


def table_in_place_steps_ms() -> list:
    """the in-place column of :func:`readme_table`, in ms: the two large models' sweep rows and the main job's"""
    rows = sweep_steps()
    return [rows[model, "inplace"]["no_sync_step_ms"] for model, _ in MODELS] + [
        work["no_sync_step_ms"] for work in _load("local_accumulation.json")["work"] if work["mode"] == "inplace"]


def readme_table() -> str:
    """the markdown table, with a header row"""
    lines = ["| setting | upstream | exact | upstream `reuse_grad_buffers=True` | in place |", "|---|---|---|---|---|"]
    rows = sweep_steps()
    for model, title in MODELS:
        first = rows[model, "upstream"]
        cells = [f"{rows[model, impl]['no_sync_step_ms']:.{1 if impl in ('upstream', 'exact') else 2}f}"
                 for impl in COLUMNS]
        lines.append(f"| CPU, {title} ({first['params_m']:.0f} M parameters, {first['tensors']} tensors), fp32, ms | "
                     + " | ".join(cells) + " |")
    work = {entry["mode"]: entry for entry in _load("local_accumulation.json")["work"]}
    title = f"CPU, transformer ({work['exact']['params'] / 1e6:.0f} M parameters, {work['exact']['tensors']} tensors)"
    lines.append(f"| {title}, fp32, ms | " + " | ".join(f"{work[impl]['no_sync_step_ms']:.2f}" for impl in COLUMNS)
                 + " |")
    lines.append(f"| {title}, tensor operations | " + " | ".join(str(work[impl]["step_ops"]) for impl in COLUMNS)
                 + " |")
    lines.extend(gpu_rows())
    return "\n".join(lines)


def gpu_rows() -> list:
    """the GPU run's rows: per model, the no-sync step's host time and the throughput ratio to native accumulation
    (hivemind#566's setting, fp16 AMP); a configuration the run lacks reads 'not measured'"""
    run = _load(os.path.join("gpu", "sweep_cuda.json"))
    rows = {(row["model"], row["impl"]): row for row in run["rows"]}
    device = run["machine"].split(",")[0].removeprefix("NVIDIA ")
    lines = []
    for model, title in MODELS:
        for key, label in ("no_sync_step_ms", "ms"), ("throughput_vs_native", "throughput vs native"):
            cells = [f"{rows[model, impl][key]:.2f}" if (model, impl) in rows else "not measured" for impl in COLUMNS]
            lines.append(f"| {device}, {title}, fp16 AMP, {label} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print(readme_table())
    steps = in_place_steps_ms()
    table = table_in_place_steps_ms()
    print(f"\nin-place no-sync step: {min(table):.2f}-{max(table):.2f} ms in the table, "
          f"{min(steps):.2f}-{max(steps):.2f} ms in every committed fp32 median")
