"""
The pull requests for hivemind, and the patched hivemind they make.

Each pull request is a folder under ``pull_requests/``: ``description.md`` (its text; a line ``Depends on: NN-slug``
names a prerequisite) and its commits as ``git format-patch`` mails without the author, date and signature lines.
``python -m hivemind_accum.upstream --out DIR`` writes ``DIR/prs/NN-slug/`` (the mails with the contributor as
author, for ``git am`` on hivemind master) and ``DIR/hivemind/``: the installed hivemind with every pull request
applied in order by ``git am``, installable as ``hivemind 1.1.12+accum`` (``pip install DIR``). The pull requests'
tests and benchmarks stay in ``DIR/prs``; the patched tree is hivemind's package only.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Dict, List, Optional

SUPPORTED_VERSION = "1.1.12"  # the hivemind version the pull requests were tested against
LOCAL_VERSION = "accum"  # PEP 440 local version label of the patched package: 1.1.12+accum
PULL_REQUESTS_DIR = Path(__file__).resolve().parent / "pull_requests"
MARKER = ".hivemind_accum_prs"  # marks an output directory this generator wrote (so it may be overwritten)
COMMIT_DATE = "Fri, 4 Dec 2026 00:00:00 +0000"  # fixed, so that the same sources give the same mails
AUTHOR = re.compile(r"\s*(.+?)\s*<([^>]+@[^>]+)>\s*")
AUTHOR_REQUIRED = (
    "the commits need an author: pass --author \"Your Name <you@example.com>\" or set git's user.name and user.email "
    "(the contributor who sends the pull requests; it is written into every patch's From: line)"
)
PACKAGE_ONLY = ["--exclude=tests/*", "--exclude=benchmarks/*"]  # what git am applies to the installed package


class GenerationError(Exception):
    """the installed hivemind, a pull request or the output directory cannot be used; the message says why"""


@dataclass(frozen=True)
class PullRequest:
    folder: Path

    @property
    def slug(self) -> str:
        return self.folder.name

    @property
    def patches(self) -> List[Path]:
        return sorted(self.folder.glob("*.patch"))

    @property
    def description(self) -> str:
        return (self.folder / "description.md").read_text()

    @property
    def depends(self) -> List[str]:
        """the pull requests this one applies after, as its description names them"""
        lines = re.findall(r"(?im)^depends on:(.*)$", self.description)
        return [slug for line in lines for slug in re.findall(r"\d\d-[\w.-]+", line)]

    @property
    def test_files(self) -> List[str]:
        """the test files its commits add or change, e.g. ``["tests/test_grad_scaler.py"]``"""
        paths = {path for patch in self.patches for path in re.findall(r"(?m)^\+\+\+ b/(tests/\S+\.py)$", patch.read_text())}
        return sorted(paths)


def pull_requests() -> List[PullRequest]:
    """every pull request, in the order they apply"""
    return [PullRequest(folder) for folder in sorted(PULL_REQUESTS_DIR.iterdir()) if (folder / "description.md").exists()]


def mail(patch: Path, author: str) -> str:
    """a stored commit as ``git format-patch`` writes it, by ``author``"""
    return f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: {author.strip()}\n" \
           f"Date: {COMMIT_DATE}\n{patch.read_text()}"


def installed_hivemind() -> Path:
    """the directory of the hivemind package that ``import hivemind`` would load (not imported)"""
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.origin is None:
        raise GenerationError(f"hivemind is not installed: pip install hivemind=={SUPPORTED_VERSION}")
    return Path(spec.origin).resolve().parent


def hivemind_version(package_dir: Path) -> str:
    """``__version__`` as written in the package's ``__init__.py``"""
    match = re.search(r"(?m)^__version__\s*=\s*[\"']([^\"']+)[\"']", (package_dir / "__init__.py").read_text())
    if match is None:
        raise GenerationError(f"{package_dir}/__init__.py sets no __version__: is this hivemind?")
    return match.group(1)


def apply_pull_requests(tree: Path, prs: List[PullRequest], author: str, *git_am_options: str) -> None:
    """``git am`` every pull request's mails, in order, in the git repository ``tree``"""
    env = _git_env(author)
    for pr in prs:
        with tempfile.TemporaryDirectory() as mails:
            paths = []
            for patch in pr.patches:
                paths.append(Path(mails) / patch.name)
                paths[-1].write_text(mail(patch, author))
            run = subprocess.run(["git", "am", "-q", *git_am_options, *map(str, paths)], cwd=tree, env=env,
                                 capture_output=True, text=True)
        if run.returncode != 0:
            subprocess.run(["git", "am", "--abort"], cwd=tree, env=env, capture_output=True)
            raise GenerationError(f"pull request {pr.slug} does not apply with git am: {run.stderr.strip()}")


def git_tree(package_dir: Path, tree: Path, author: str) -> None:
    """a git repository at ``tree`` whose one commit holds ``package_dir`` as ``hivemind/``"""
    shutil.copytree(package_dir, tree / "hivemind", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = _git_env(author)
    for command in ["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"hivemind {hivemind_version(package_dir)}"]:
        subprocess.run(["git", *command], cwd=tree, env=env, check=True, capture_output=True)


def generate(out: Path, author: str, package_dir: Optional[Path] = None) -> List[PullRequest]:
    """
    Write ``out/prs/`` (every pull request, by ``author``), ``out/hivemind/`` (``package_dir``, default the installed
    hivemind, with every pull request applied by ``git am``; tests and benchmarks left out) and
    ``out/pyproject.toml``. ``out`` is new, empty or written by this function before.

    :raises GenerationError: for a hivemind other than 1.1.12, no author, a pull request that does not apply, or an
      output directory holding other files
    """
    package_dir = Path(package_dir or installed_hivemind())
    version = hivemind_version(package_dir)
    if version != SUPPORTED_VERSION:
        raise GenerationError(
            f"hivemind {version} is installed at {package_dir}, but the pull requests were tested against hivemind "
            f"{SUPPORTED_VERSION} only; install it (pip install hivemind=={SUPPORTED_VERSION}) and run again"
        )
    if not author or AUTHOR.fullmatch(author) is None:
        raise GenerationError(AUTHOR_REQUIRED)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise GenerationError(f"--out {out}: the directory holds other files; pass a new or empty directory")
    prs = pull_requests()
    with tempfile.TemporaryDirectory() as scratch:
        git_tree(package_dir, Path(scratch), author)
        apply_pull_requests(Path(scratch), prs, author, *PACKAGE_ONLY)
        for stale in out / "hivemind", out / "prs":
            if stale.exists():
                shutil.rmtree(stale)
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(f"written by python -m hivemind_accum.upstream from {package_dir}\n")
        shutil.copytree(Path(scratch) / "hivemind", out / "hivemind")
    for pr in prs:
        (out / "prs" / pr.slug).mkdir(parents=True)
        (out / "prs" / pr.slug / "description.md").write_text(pr.description)
        for patch in pr.patches:
            (out / "prs" / pr.slug / patch.name).write_text(mail(patch, author))
    (out / "pyproject.toml").write_text(_pyproject(package_dir))
    return prs


def _git_env(author: str) -> Dict[str, str]:
    name, email = AUTHOR.fullmatch(author).groups()
    return dict(
        PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=tempfile.gettempdir(), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null",
        GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email,
        GIT_AUTHOR_DATE=COMMIT_DATE, GIT_COMMITTER_DATE=COMMIT_DATE,
    )


def _pyproject(package_dir: Path) -> str:
    """packaging for the patched tree: upstream's name, dependencies and console scripts (read from the installed
    distribution's metadata), every file of the package as package data (p2pd, *.proto, config.yml)"""
    dist_info = next(package_dir.parent.glob(f"hivemind-{SUPPORTED_VERSION}.dist-info"), None)
    requires, scripts, summary = [], {}, "Decentralized deep learning in PyTorch"
    if dist_info is not None:
        metadata = Parser().parsestr((dist_info / "METADATA").read_text())
        summary = metadata.get("Summary", summary)
        requires = [r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r]
        entry_points = dist_info / "entry_points.txt"
        section = None
        for line in entry_points.read_text().splitlines() if entry_points.exists() else []:
            if line.startswith("["):
                section = line.strip("[]")
            elif section == "console_scripts" and "=" in line:
                script, target = (part.strip() for part in line.split("=", 1))
                scripts[script] = target
    quoted = "".join(f'    "{value}",\n' for value in requires)
    return (
        f"# written by python -m hivemind_accum.upstream: hivemind {SUPPORTED_VERSION} with the pull requests in prs/\n"
        f'[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "hivemind"\nversion = "{SUPPORTED_VERSION}+{LOCAL_VERSION}"\n'
        f'description = "{summary} (with hivemind_accum\'s pull requests)"\nrequires-python = ">=3.9"\n'
        f"dependencies = [\n{quoted}]\n\n"
        + ("[project.scripts]\n" + "".join(f'{k} = "{v}"\n' for k, v in scripts.items()) + "\n" if scripts else "")
        + '[tool.setuptools.packages.find]\ninclude = ["hivemind", "hivemind.*"]\nnamespaces = true\n\n'
        '[tool.setuptools.package-data]\n"*" = ["*"]\n'
    )
