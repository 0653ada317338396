"""
The pull requests for hivemind (``python -m hivemind_accum.upstream --out DIR`` writes ``DIR/prs``), each checked as
a hivemind maintainer would receive it, on a git tree of the installed hivemind 1.1.12 (whose package equals
hivemind master's): it applies with ``git am`` after the pull requests it names; its tests pass with it and at least
one of them fails without its change; the files it touches are clean under ruff 0.11.2 with hivemind's settings and
under codespell.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hivemind_accum.upstream import installed_hivemind
from hivemind_accum.upstream.stack import PULL_REQUESTS, PULL_REQUESTS_DIR, write_pull_requests

BIN = Path(sys.executable).parent
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
AUTHOR = "Test Contributor <contributor@example.com>"


@pytest.fixture(scope="module")
def hivemind_tree(tmp_path_factory):
    """the generated pull requests, and a git repository whose first commit holds the installed hivemind package"""
    root = tmp_path_factory.mktemp("pull_requests")
    prs = root / "prs"
    write_pull_requests(installed_hivemind(), prs, AUTHOR)
    tree = root / "hivemind"
    shutil.copytree(installed_hivemind(), tree / "hivemind", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(GIT + ["init", "-q", "-b", "master"], cwd=tree, check=True)
    subprocess.run(GIT + ["add", "-A"], cwd=tree, check=True)
    subprocess.run(GIT + ["commit", "-q", "-m", "hivemind"], cwd=tree, check=True)
    return prs, tree


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


def test_generator_needs_an_author(tmp_path):
    """no placeholder identity: without --author or git's user.name and user.email the generator stops, says how to
    set it and writes nothing; with git's identity set, that is the author"""
    (tmp_path / "empty").write_text("")
    env = dict(os.environ, HOME=str(tmp_path), GIT_CONFIG_GLOBAL=str(tmp_path / "empty"), GIT_CONFIG_NOSYSTEM="1")
    command = [sys.executable, "-m", "hivemind_accum.upstream", "--out", str(tmp_path / "out")]
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    assert run.returncode == 2 and '--author "Your Name <you@example.com>"' in run.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "gitconfig").write_text("[user]\n\tname = Ada Lovelace\n\temail = ada@example.org\n")
    run = subprocess.run(command, capture_output=True, text=True, env=dict(env, GIT_CONFIG_GLOBAL=str(tmp_path / "gitconfig")))
    assert run.returncode == 0, run.stderr
    patch = sorted((tmp_path / "out" / "prs").glob("*/*.patch"))[0]
    assert "From: Ada Lovelace <ada@example.org>" in patch.read_text()


@pytest.mark.parametrize("pr", PULL_REQUESTS, ids=lambda pr: pr.slug)
def test_pull_request_applies_and_its_tests_need_its_change(hivemind_tree, pr):
    prs, tree = hivemind_tree
    subprocess.run(GIT + ["checkout", "-q", "-f", "master"], cwd=tree, check=True)
    subprocess.run(GIT + ["clean", "-q", "-fdx"], cwd=tree, check=True)
    subprocess.run(GIT + ["checkout", "-q", "--detach"], cwd=tree, check=True)
    for slug in pr.depends + [pr.slug]:
        applied = subprocess.run(GIT + ["am", "-q", *sorted(map(str, (prs / slug).glob("*.patch")))], cwd=tree,
                                 capture_output=True, text=True)
        assert applied.returncode == 0, f"{slug} does not apply with git am: {applied.stderr}"

    touched = subprocess.run(GIT + ["diff", "--name-only", f"HEAD~{len(pr.commits)}", "HEAD"], cwd=tree, check=True,
                             capture_output=True, text=True).stdout.split()
    config = str(PULL_REQUESTS_DIR / "ruff.toml")
    for command in ["check", "--config", config], ["format", "--check", "--config", config]:
        ruff = subprocess.run([str(BIN / "ruff"), *command, *touched], cwd=tree, capture_output=True, text=True)
        assert ruff.returncode == 0, f"ruff {command[0]}: {ruff.stdout}{ruff.stderr}"
    codespell = subprocess.run([str(BIN / "codespell"), *touched], cwd=tree, capture_output=True, text=True)
    assert codespell.returncode == 0, codespell.stdout

    code, summary = _pytest(tree, pr.test_files)
    assert code == 0 and "passed" in summary, f"{pr.slug}'s tests with its change: {summary}"

    subprocess.run(GIT + ["checkout", "-q", f"HEAD~{len(pr.commits)}", "--", "hivemind"], cwd=tree, check=True)
    code, summary = _pytest(tree, pr.test_files)
    assert code == 1 and "failed" in summary, f"{pr.slug}'s tests without its change: {summary}"
