"""
The pull requests for hivemind (``python -m hivemind_accum.upstream --out DIR`` writes ``DIR/prs``), each checked as
a hivemind maintainer would receive it, on a git tree of the installed hivemind 1.1.12 (whose package equals
hivemind master's): it applies with ``git am`` after the pull requests it names; its tests pass with it and at least
one of them fails without its change; the files it touches are clean under ruff 0.11.2 with hivemind's settings and
under codespell.
"""
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hivemind_accum.upstream import PULL_REQUESTS_DIR, apply_pull_requests, git_tree, installed_hivemind, pull_requests

BIN = Path(sys.executable).parent
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
AUTHOR = "Test Contributor <contributor@example.com>"
PULL_REQUESTS = pull_requests()


@pytest.fixture(scope="module")
def hivemind_tree(tmp_path_factory):
    """a git repository whose first commit, on branch master, holds the installed hivemind package"""
    tree = tmp_path_factory.mktemp("pull_requests") / "hivemind"
    git_tree(installed_hivemind(), tree, AUTHOR)
    subprocess.run(GIT + ["branch", "-M", "master"], cwd=tree, check=True)
    return tree


def _pytest(tree: Path, files):
    """run the tests in their own pytest process group; afterwards kill whatever they left running, as hivemind's
    tests/conftest.py does at the end of a test run (a test that fails on master may leave an Optimizer's peers)"""
    env = dict(os.environ, PYTHONPATH=str(tree), HIVEMIND_MEMORY_SHARING_STRATEGY="file_descriptor")
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "120", *files],
            cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            code = process.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        out.seek(0)
        lines = out.read().strip().splitlines()
    return code, lines[-1] if lines else ""


def test_every_pull_request_has_a_test_and_a_description():
    assert len(PULL_REQUESTS) >= 3
    assert "hivemind#566" in (PULL_REQUESTS_DIR / PULL_REQUESTS[0].slug / "description.md").read_text()
    assert PULL_REQUESTS[0].depends == []
    for pr in PULL_REQUESTS:
        assert pr.test_files, pr.slug
        assert (pr.folder / "description.md").read_text().startswith("# "), pr.slug


@pytest.mark.parametrize("pr", PULL_REQUESTS, ids=lambda pr: pr.slug)
def test_pull_request_applies_and_its_tests_need_its_change(hivemind_tree, pr):
    tree = hivemind_tree
    subprocess.run(GIT + ["checkout", "-q", "-f", "master"], cwd=tree, check=True)
    subprocess.run(GIT + ["clean", "-q", "-fdx"], cwd=tree, check=True)
    subprocess.run(GIT + ["checkout", "-q", "--detach"], cwd=tree, check=True)
    by_slug = {other.slug: other for other in PULL_REQUESTS}
    apply_pull_requests(tree, [by_slug[slug] for slug in pr.depends] + [pr], AUTHOR)

    touched = subprocess.run(GIT + ["diff", "--name-only", f"HEAD~{len(pr.patches)}", "HEAD"], cwd=tree, check=True,
                             capture_output=True, text=True).stdout.split()
    config = str(PULL_REQUESTS_DIR / "ruff.toml")
    for command in ["check", "--config", config], ["format", "--check", "--config", config]:
        ruff = subprocess.run([str(BIN / "ruff"), *command, *touched], cwd=tree, capture_output=True, text=True)
        assert ruff.returncode == 0, f"ruff {command[0]}: {ruff.stdout}{ruff.stderr}"
    codespell = subprocess.run([str(BIN / "codespell"), *touched], cwd=tree, capture_output=True, text=True)
    assert codespell.returncode == 0, codespell.stdout

    code, summary = _pytest(tree, pr.test_files)
    assert code == 0 and "passed" in summary, f"{pr.slug}'s tests with its change: {summary}"

    subprocess.run(GIT + ["checkout", "-q", f"HEAD~{len(pr.patches)}", "--", "hivemind"], cwd=tree, check=True)
    code, summary = _pytest(tree, pr.test_files)
    assert code == 1 and "failed" in summary, f"{pr.slug}'s tests without its change: {summary}"


@pytest.mark.timeout(1200)
def test_every_pull_requests_tests_pass_with_all_applied(hivemind_tree):
    """the stack as a maintainer who merged it all would run it: each pull request's tests on the tree with every
    pull request applied"""
    tree = hivemind_tree
    subprocess.run(GIT + ["checkout", "-q", "-f", "master"], cwd=tree, check=True)
    subprocess.run(GIT + ["clean", "-q", "-fdx"], cwd=tree, check=True)
    subprocess.run(GIT + ["checkout", "-q", "--detach"], cwd=tree, check=True)
    apply_pull_requests(tree, PULL_REQUESTS, AUTHOR)
    files = sorted({path for pr in PULL_REQUESTS for path in pr.test_files})
    code, summary = _pytest(tree, files)
    assert code == 0 and "passed" in summary and "failed" not in summary, summary
