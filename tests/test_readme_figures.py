"""
README.md's figures come from the committed runs (:mod:`benchmarks.readme_figures`): its table is the generated one,
and the figures its text quotes are those of the runs it names.
"""
import os
import re

from benchmarks.readme_figures import in_place_steps_ms, readme_table, sweep_steps, table_in_place_steps_ms

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme() -> str:
    with open(README) as file:
        return file.read()


def test_readme_table_is_the_generated_one():
    assert readme_table() in readme(), "README.md's table differs: paste `python -m benchmarks.readme_figures`"


def test_readme_in_place_ranges_are_the_tables_and_every_committed_runs():
    quoted = re.search(r"In-place mode removes the step's work: ([0-9.]+)-([0-9.]+) ms in the table, "
                       r"([0-9.]+)-([0-9.]+) ms in every committed run", readme().replace("\n", " ")).groups()
    table, steps = table_in_place_steps_ms(), in_place_steps_ms()
    assert quoted == tuple(f"{value:.2f}" for value in (min(table), max(table), min(steps), max(steps))), steps


def test_readme_limit_quotes_the_latest_resnet_run():
    rows = sweep_steps()
    ours, upstream = (rows["resnet152", impl]["no_sync_step_ms"] for impl in ("inplace", "upstream_reuse"))
    quoted = f"{ours / upstream:.1f}x on ResNet-152 ({ours:.2f} against {upstream:.2f} ms"
    assert quoted in readme().replace("\n  ", " "), quoted
