"""
README.md's figures come from the committed runs (:mod:`benchmarks.readme_figures`): its table is the generated one,
and the figures its text quotes are those of the runs it names.
"""
import os
import re

from benchmarks.readme_figures import in_place_steps_ms, readme_table, sweep_steps

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme() -> str:
    with open(README) as file:
        return file.read()


def test_readme_table_is_the_generated_one():
    assert readme_table() in readme(), "README.md's table differs: paste `python -m benchmarks.readme_figures`"


def test_readme_in_place_range_spans_every_committed_run():
    low, high = re.search(r"In-place mode removes the step's work: ([0-9.]+)-([0-9.]+) ms", readme()).groups()
    steps = in_place_steps_ms()
    assert (low, high) == (f"{min(steps):.2f}", f"{max(steps):.2f}"), steps


def test_readme_limit_quotes_the_latest_resnet_run():
    rows = sweep_steps()
    ours, upstream = (rows["resnet152", impl]["no_sync_step_ms"] for impl in ("inplace", "upstream_reuse"))
    quoted = f"{ours / upstream:.1f}x on ResNet-152 ({ours:.2f} against {upstream:.2f} ms"
    assert quoted in readme().replace("\n  ", " "), quoted
