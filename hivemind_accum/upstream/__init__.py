"""
Generate the upstream pull request from this package: a patched copy of the installed hivemind, the patch series
that turns upstream's tree into it, and the packaging that makes the copy ``pip install``-able.

Nothing of upstream is stored in this repository: every output is derived from the installed hivemind package and
this package's ``optim`` modules (:mod:`hivemind_accum.upstream.merge` merges each module into the upstream module
it mirrors; a module with no upstream counterpart is added with its imports rewritten). Run
``python -m hivemind_accum.upstream --out DIR``.
"""
import ast
import difflib
import importlib.util
import re
import shutil
import textwrap
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hivemind_accum.upstream.changes import CHANGES, edit_hivemind, for_hivemind, peel
from hivemind_accum.upstream.fixes import FIXES, FixError, apply_fix, omit_workarounds
from hivemind_accum.upstream.merge import UPSTREAM_PACKAGE, MergeError, merge_module, rewrite_new_module
from hivemind_accum.upstream.stack import StackError, write_pull_requests

SUPPORTED_VERSION = "1.1.12"  # the hivemind version whose source the merge was tested against
OUR_OPTIM = Path(__file__).resolve().parent.parent / "optim"
MARKER = ".hivemind_accum_series"  # marks an output directory this generator wrote (so it may be overwritten)
LOCAL_VERSION = "accum"  # PEP 440 local version label of the generated package: 1.1.12+accum


STACK_AUTHOR = re.compile(r"\s*(.+?)\s*<([^>]+@[^>]+)>\s*")
AUTHOR_REQUIRED = (
    "the commits need an author: pass --author \"Your Name <you@example.com>\" or set git's user.name and user.email "
    "(the contributor who sends the pull requests; it is written into every patch's From: line)"
)


class GenerationError(Exception):
    """the installed hivemind or the output directory cannot be used; the message says why and what to do"""


@dataclass
class FileChange:
    """one hivemind module as a commit leaves it (``before`` is None for a new module)"""

    path: str  # relative to the package tree's root, e.g. "hivemind/optim/grad_averager.py"
    before: Optional[str]
    after: str


@dataclass
class Patch:
    """one commit of the series: its message and the modules it changes"""

    subject: str
    body: str
    files: List[FileChange]

    @property
    def paths(self) -> List[str]:
        return [change.path for change in self.files]


def installed_hivemind() -> Path:
    """the directory of the hivemind package that ``import hivemind`` would load (not imported)"""
    spec = importlib.util.find_spec(UPSTREAM_PACKAGE)
    if spec is None or spec.origin is None:
        raise GenerationError("hivemind is not installed: pip install hivemind==" + SUPPORTED_VERSION)
    return Path(spec.origin).resolve().parent


def hivemind_version(package_dir: Path) -> str:
    """``__version__`` as written in the package's ``__init__.py``"""
    tree = ast.parse((package_dir / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise GenerationError(f"{package_dir}/__init__.py sets no __version__: is this hivemind?")


def carried_modules() -> List[str]:
    """this package's ``optim`` modules that go upstream, e.g. ``["grad_averager", "grad_buckets", ...]``"""
    return sorted(p.stem for p in OUR_OPTIM.glob("*.py") if p.name != "__init__.py")


def build_patches(upstream_dir: Path) -> List[Patch]:
    """the series: first one commit per hivemind defect that this package works around (:mod:`.fixes`, fixed at its
    place), then one commit per change (:mod:`.changes`), each bringing its part of every carried module into
    hivemind's (merged) or adding it (a new module)"""
    carried = carried_modules()
    texts: Dict[str, str] = {}  # a module's text after the defect fixes, by path
    patches: List[Patch] = []
    for fix in FIXES:
        path = f"{UPSTREAM_PACKAGE}/{fix.path}"
        before = texts[path] if path in texts else (upstream_dir / fix.path).read_text()
        ours = (OUR_OPTIM / f"{fix.module}.py").read_text() if fix.module else ""
        try:
            after = apply_fix(before, fix, ours)
        except FixError as e:
            raise GenerationError(f"cannot fix '{fix.subject}': {e}") from e
        if after != before:
            patches.append(Patch(fix.subject, _wrap(fix.why) + "\n", [FileChange(path, before, after)]))
        texts[path] = after
    entering = _entering(carried)
    ours: Dict[str, str] = {}
    for name in carried:
        label = f"hivemind_accum/optim/{name}.py"
        try:
            ours[name] = omit_workarounds(
                (OUR_OPTIM / f"{name}.py").read_text(), [fix for fix in FIXES if fix.module == name], label
            )
        except FixError as e:
            raise GenerationError(f"cannot carry {label} upstream: {e}") from e
    current: Dict[str, Optional[str]] = {}  # a module's text so far in the series, by path
    notes_seen: Dict[str, List[str]] = {name: [] for name in carried}
    for number, change in enumerate(CHANGES):
        files, notes = [], []
        for name in (name for name in carried if entering[name] <= number):
            label = f"hivemind_accum/optim/{name}.py"
            path = f"{UPSTREAM_PACKAGE}/optim/{name}.py"
            upstream_file = upstream_dir / "optim" / f"{name}.py"
            try:
                state = for_hivemind(peel(ours[name], name, CHANGES[number + 1:], label))
                if upstream_file.exists():
                    original = texts[path] if path in texts else upstream_file.read_text()
                    base = edit_hivemind(original, name, CHANGES[: number + 1], label)
                    module_notes: List[str] = []
                    after = merge_module(base, state, f"{UPSTREAM_PACKAGE}.optim.{name}", carried, label, module_notes)
                    notes += [note for note in module_notes if note not in notes_seen[name]]
                    notes_seen[name] = module_notes
                    before = current.get(path, original)
                else:
                    after, before = rewrite_new_module(state, carried, label), current.get(path)
            except (MergeError, FixError) as e:
                raise GenerationError(f"cannot carry {label} upstream ('{change.subject}'): {e}") from e
            if after != before:
                files.append(FileChange(path, before, after))
            current[path] = after
        if not files:
            raise GenerationError(f"the change '{change.subject}' changes no module: check its items in changes.py")
        patches.append(Patch(change.subject, _change_message(change.why, notes), files))
    return patches


def _entering(carried: Sequence[str]) -> Dict[str, int]:
    """the change each carried module enters the series with, by module; every module enters exactly once"""
    entering: Dict[str, int] = {}
    for number, change in enumerate(CHANGES):
        for name in change.enters:
            if name in entering or name not in carried:
                raise GenerationError(f"changes.py: '{change.subject}' brings in {name!r}, which is "
                                      f"{'brought in earlier' if name in entering else 'not a carried module'}")
            entering[name] = number
        for name in change.omit:
            if name not in carried:
                raise GenerationError(f"changes.py: '{change.subject}' names {name!r}, which is not a carried module")
    missing = [name for name in carried if name not in entering]
    if missing:
        raise GenerationError(f"changes.py: no change brings in {missing}: add each to the enters of its first change")
    return entering


def source_package(source: Path) -> Path:
    """the hivemind package directory of a hivemind source tree (a git checkout: ``DIR/hivemind``), or ``source``
    itself if it is a package directory"""
    source = Path(source)
    for candidate in source / UPSTREAM_PACKAGE, source:
        if (candidate / "__init__.py").exists() and (candidate / "optim" / "optimizer.py").exists():
            return candidate.resolve()
    raise GenerationError(f"--hivemind-src {source}: neither it nor {source}/hivemind is hivemind's package directory")


def generate(
    out: Path, upstream_dir: Optional[Path] = None, from_source: bool = False, author: Optional[str] = None
) -> List[Patch]:
    """
    Write the patched package, its patch series and its packaging.

    :param out: output directory, absent, empty or written by this generator before (then replaced); receives
      ``hivemind/`` (the installed package with the patches applied, p2pd binary and protobuf modules included),
      ``patches/NNNN-*.patch`` (``git am`` in a hivemind checkout, or ``patch -p1`` from a directory holding
      ``hivemind/``), ``pyproject.toml`` (``pip install out`` installs the patched hivemind as version
      ``1.1.12+accum``; not written with ``from_source``), ``prs/NN-slug/`` (the pull requests for hivemind, each a
      ``git format-patch`` series and its ``description.md``: :mod:`hivemind_accum.upstream.stack`)
    :param upstream_dir: the hivemind package directory to start from (default: the installed one)
    :param author: "Name <email>", the author of the pull requests' and the series' commits: the contributor who
      sends them (required; ``--author`` on the command line)
    :param from_source: ``upstream_dir`` is the package directory of a hivemind source tree (e.g. a checkout of
      hivemind's master), of any version: the series is generated against its modules
    :returns: the patches, in series order
    :raises GenerationError: for an installed hivemind other than 1.1.12, an already patched hivemind, a module that
      cannot be merged, a defect fix that does not match, or an output directory holding other files
    """
    upstream_dir = Path(upstream_dir or installed_hivemind())
    version = hivemind_version(upstream_dir)
    if version != SUPPORTED_VERSION and not from_source:
        raise GenerationError(
            f"hivemind {version} is installed at {upstream_dir}, but the patch series is generated from hivemind "
            f"{SUPPORTED_VERSION}'s source only (the version it was tested with); install hivemind=={SUPPORTED_VERSION} "
            f"(pip install hivemind=={SUPPORTED_VERSION}) and run again, or pass a hivemind checkout with "
            f"--hivemind-src"
        )
    if (upstream_dir / "optim" / "grad_buckets.py").exists():
        raise GenerationError(
            f"{upstream_dir} is already a patched hivemind (it has optim/grad_buckets.py); generate from a pristine "
            f"hivemind {SUPPORTED_VERSION} (check that PYTHONPATH does not put a generated tree first)"
        )
    if not author or STACK_AUTHOR.fullmatch(author) is None:
        raise GenerationError(AUTHOR_REQUIRED)
    patches = build_patches(upstream_dir)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise GenerationError(f"--out {out}: the directory holds other files; pass a new or empty directory")
    for stale in out / UPSTREAM_PACKAGE, out / "patches", out / "prs":
        if stale.exists():
            shutil.rmtree(stale)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"written by python -m hivemind_accum.upstream from {upstream_dir}\n")
    shutil.copytree(upstream_dir, out / UPSTREAM_PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for patch in patches:
        for change in patch.files:
            (out / change.path).write_text(change.after)
    (out / "patches").mkdir()
    for number, patch in enumerate(patches, start=1):
        filename = f"{number:04d}-{re.sub(r'[^A-Za-z0-9]+', '-', patch.subject).strip('-')}.patch"
        (out / "patches" / filename).write_text(format_patch(patch, number, len(patches), author))
    try:
        write_pull_requests(upstream_dir, out / "prs", author)
    except StackError as e:
        raise GenerationError(f"cannot write the pull requests: {e}") from e
    if not from_source:
        (out / "pyproject.toml").write_text(_pyproject(upstream_dir))
    elif (out / "pyproject.toml").exists():
        (out / "pyproject.toml").unlink()
    return patches


def format_patch(patch: Patch, number: int, total: int, author: str) -> str:
    """a ``git format-patch`` mail (``git am`` applies it): subject, message, then a unified diff with a/ and b/
    prefixes for each module the commit changes"""
    diffs = []
    for change in patch.files:
        before = [] if change.before is None else change.before.splitlines(keepends=True)
        after = change.after.splitlines(keepends=True)
        old = "/dev/null" if change.before is None else f"a/{change.path}"
        header = f"diff --git a/{change.path} b/{change.path}\n" + (
            "new file mode 100644\n" if change.before is None else ""
        )
        diffs.append(header + "".join(difflib.unified_diff(before, after, old, f"b/{change.path}", n=3)))
    return (
        f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: {author.strip()}\n"
        f"Subject: [PATCH {number}/{total}] {patch.subject}\n\n{patch.body}\n---\n{''.join(diffs)}"
    )


def _change_message(why: str, notes: Sequence[str] = ()) -> str:
    """a change's commit message: its paragraphs and bullets wrapped at 72 columns, then why any helper kept
    hivemind's previous implementation under a private name"""
    paragraphs = []
    for block in re.split(r"\n\s*\n", why.strip()):
        items = re.split(r"\n(?=- )", block.strip())
        if items[0].startswith("- "):
            paragraphs.append("\n".join(_wrap(item, indent="  ") for item in items))
        else:
            paragraphs.append(_wrap(block))
    if notes:
        paragraphs.append(_wrap(
            "Where a changed method still needs the previous implementation as a function (rather than running its "
            "body with new statements before or after it), that implementation is kept under a private name:"
        ))
        paragraphs.append("\n".join(_wrap(f"- {_helper_note(note)}", indent="  ") for note in notes))
    return "\n\n".join(paragraphs) + "\n"


# why a method of hivemind's is kept as a private helper, where the merge's own reason is too terse
KEPT_HELPERS = {
    "ProgressTracker._base_report_local_progress": (
        "the previous report_local_progress. The new one still calls it for arguments that are not plain "
        "non-negative ints, so that they raise LocalTrainingProgress's ValidationError as before."
    ),
    "PowerSGDGradientAverager._base_init": (
        "the previous __init__. The new one takes averaged_grads_dtype, which it accepts only as torch.float32 "
        "(PowerSGD fails on fp16/bf16 gradients in their own dtype, hivemind#545), sets it before the previous "
        "__init__ sizes its buffers from _grads_from_parameters, and passes it on to GradientAverager."
    ),
    "PowerSGDGradientAverager._base_aggregate_with_group": (
        "the previous _aggregate_with_group, the PowerSGD round. The new one runs it unchanged, and in a round "
        "joined with weight 0 copies the error-feedback buffers before it and back after it: the round subtracts "
        "the group's result from them, though this peer sent nothing to compress."
    ),
    "Optimizer._base_step": (
        "the previous step. The new one hands a torch.amp.GradScaler to the micro-step accumulation for one call "
        "only (set before it calls the previous step with grad_scaler=None, cleared in a finally clause), and calls "
        "the previous step unchanged without a scaler, in in-place mode and on auxiliary peers."
    ),
}


def _helper_note(note: str) -> str:
    helper = note.split(":", 1)[0]
    return f"{helper}: {KEPT_HELPERS[helper]}" if helper in KEPT_HELPERS else note


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(" ".join(text.split()), width=72, subsequent_indent=indent, break_on_hyphens=False)


def _pyproject(upstream_dir: Path) -> str:
    """packaging for the patched tree: upstream's name, dependencies and console scripts (read from the installed
    distribution's metadata), every file of the package as package data (p2pd, *.proto, config.yml)"""
    dist_info = next(upstream_dir.parent.glob(f"{UPSTREAM_PACKAGE}-{SUPPORTED_VERSION}.dist-info"), None)
    requires, scripts, summary = [], {}, "Decentralized deep learning in PyTorch"
    if dist_info is not None:
        metadata = Parser().parsestr((dist_info / "METADATA").read_text())
        summary = metadata.get("Summary", summary)
        requires = [r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r]
        entry_points = dist_info / "entry_points.txt"
        if entry_points.exists():
            section = None
            for line in entry_points.read_text().splitlines():
                if line.startswith("["):
                    section = line.strip("[]")
                elif section == "console_scripts" and "=" in line:
                    script, target = (part.strip() for part in line.split("=", 1))
                    scripts[script] = target
    quoted = lambda values: "".join(f'    "{v}",\n' for v in values)  # noqa: E731
    return (
        f"# generated by python -m hivemind_accum.upstream from hivemind {SUPPORTED_VERSION}: upstream's package with\n"
        f"# the patches in patches/ applied\n"
        f'[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{UPSTREAM_PACKAGE}"\nversion = "{SUPPORTED_VERSION}+{LOCAL_VERSION}"\n'
        f'description = "{summary} (with hivemind_accum\'s gradient accumulation)"\nrequires-python = ">=3.9"\n'
        f"dependencies = [\n{quoted(requires)}]\n\n"
        + ("[project.scripts]\n" + "".join(f'{k} = "{v}"\n' for k, v in scripts.items()) + "\n" if scripts else "")
        + f'[tool.setuptools.packages.find]\ninclude = ["{UPSTREAM_PACKAGE}", "{UPSTREAM_PACKAGE}.*"]\n'
        f"namespaces = true\n\n"
        f'[tool.setuptools.package-data]\n"*" = ["*"]\n'
    )
