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

from hivemind_accum.upstream.fixes import CHANGES, FIXES, FixError, apply_fix, omit_workarounds
from hivemind_accum.upstream.merge import UPSTREAM_PACKAGE, MergeError, merge_module, rewrite_new_module

SUPPORTED_VERSION = "1.1.12"  # the hivemind version whose source the merge was tested against
OUR_OPTIM = Path(__file__).resolve().parent.parent / "optim"
UPSTREAM_MD = Path(__file__).resolve().parent.parent.parent / "UPSTREAM.md"
MARKER = ".hivemind_accum_series"  # marks an output directory this generator wrote (so it may be overwritten)
LOCAL_VERSION = "accum"  # PEP 440 local version label of the generated package: 1.1.12+accum


class GenerationError(Exception):
    """the installed hivemind or the output directory cannot be used; the message says why and what to do"""


@dataclass
class ModulePatch:
    """one upstream module changed (``before`` is None for a new module) and the commit that changes it"""

    path: str  # relative to the package tree's root, e.g. "hivemind/optim/grad_averager.py"
    before: Optional[str]
    after: str
    subject: str = ""
    body: str = ""


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


def build_patches(upstream_dir: Path) -> List[ModulePatch]:
    """the series: first one commit per hivemind defect that this package works around (:mod:`.fixes`, fixed at its
    place), then every carried module merged into hivemind's (or added), ordered so that each imports only earlier
    ones or hivemind; each module's commit message comes from UPSTREAM.md's section for it"""
    carried = carried_modules()
    texts: Dict[str, str] = {}  # a module's text so far in the series, by path
    fix_patches: List[ModulePatch] = []
    for fix in FIXES:
        path = f"{UPSTREAM_PACKAGE}/{fix.path}"
        before = texts[path] if path in texts else (upstream_dir / fix.path).read_text()
        ours = (OUR_OPTIM / f"{fix.module}.py").read_text() if fix.module else ""
        try:
            after = apply_fix(before, fix, ours)
        except FixError as e:
            raise GenerationError(f"cannot fix '{fix.subject}': {e}") from e
        if after != before:
            fix_patches.append(ModulePatch(path, before, after, fix.subject, _wrap(fix.why) + "\n"))
        texts[path] = after
    patches: Dict[str, ModulePatch] = {}
    notes: Dict[str, List[str]] = {}
    later: List[ModulePatch] = []  # CHANGES, each a commit after its module's
    for name in carried:
        label = f"hivemind_accum/optim/{name}.py"
        path = f"{UPSTREAM_PACKAGE}/optim/{name}.py"
        upstream_file = upstream_dir / "optim" / f"{name}.py"
        try:
            fixes = [fix for fix in FIXES if fix.module == name]
            ours = omit_workarounds((OUR_OPTIM / f"{name}.py").read_text(), fixes, label)
            changes = [change for change in CHANGES if change.module == name]
            states = [omit_workarounds(ours, changes[i:], label) for i in range(len(changes))] + [ours]
            if upstream_file.exists():
                before = texts[path] if path in texts else upstream_file.read_text()
                notes[name] = []
                module = f"{UPSTREAM_PACKAGE}.optim.{name}"
                merged = [merge_module(before, state, module, carried, label, []) for state in states[:-1]]
                merged.append(merge_module(before, ours, module, carried, label, notes[name]))
            else:
                before, merged = None, [rewrite_new_module(state, carried, label) for state in states]
        except (MergeError, FixError) as e:
            raise GenerationError(f"cannot carry {label} upstream: {e}") from e
        patches[name] = ModulePatch(path, before, merged[0])
        for change, previous, after in zip(changes, merged, merged[1:]):
            later.append(ModulePatch(path, previous, after, change.subject, _wrap(change.why) + "\n"))
    sections = _upstream_md_sections()
    for name, patch in patches.items():
        patch.subject, patch.body = _commit_message(
            patch, (OUR_OPTIM / f"{name}.py").read_text(), sections, notes.get(name, [])
        )
    return fix_patches + [patches[name] for name in _dependency_order(patches)] + later


def source_package(source: Path) -> Path:
    """the hivemind package directory of a hivemind source tree (a git checkout: ``DIR/hivemind``), or ``source``
    itself if it is a package directory"""
    source = Path(source)
    for candidate in source / UPSTREAM_PACKAGE, source:
        if (candidate / "__init__.py").exists() and (candidate / "optim" / "optimizer.py").exists():
            return candidate.resolve()
    raise GenerationError(f"--hivemind-src {source}: neither it nor {source}/hivemind is hivemind's package directory")


def generate(out: Path, upstream_dir: Optional[Path] = None, from_source: bool = False) -> List[ModulePatch]:
    """
    Write the patched package, its patch series and its packaging.

    :param out: output directory, absent, empty or written by this generator before (then replaced); receives
      ``hivemind/`` (the installed package with the patches applied, p2pd binary and protobuf modules included),
      ``patches/NNNN-*.patch`` (``git am`` in a hivemind checkout, or ``patch -p1`` from a directory holding
      ``hivemind/``), ``pyproject.toml`` (``pip install out`` installs the patched hivemind as version
      ``1.1.12+accum``; not written with ``from_source``)
    :param upstream_dir: the hivemind package directory to start from (default: the installed one)
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
    patches = build_patches(upstream_dir)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise GenerationError(f"--out {out}: the directory holds other files; pass a new or empty directory")
    for stale in out / UPSTREAM_PACKAGE, out / "patches":
        if stale.exists():
            shutil.rmtree(stale)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"written by python -m hivemind_accum.upstream from {upstream_dir}\n")
    shutil.copytree(upstream_dir, out / UPSTREAM_PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for patch in patches:
        (out / patch.path).write_text(patch.after)
    (out / "patches").mkdir()
    for number, patch in enumerate(patches, start=1):
        filename = f"{number:04d}-{re.sub(r'[^A-Za-z0-9]+', '-', patch.subject).strip('-')}.patch"
        (out / "patches" / filename).write_text(format_patch(patch, number, len(patches)))
    if not from_source:
        (out / "pyproject.toml").write_text(_pyproject(upstream_dir))
    elif (out / "pyproject.toml").exists():
        (out / "pyproject.toml").unlink()
    return patches


def format_patch(patch: ModulePatch, number: int, total: int) -> str:
    """a ``git format-patch`` mail (``git am`` applies it): subject, message, then a unified diff with a/ and b/
    prefixes"""
    before = [] if patch.before is None else patch.before.splitlines(keepends=True)
    after = patch.after.splitlines(keepends=True)
    old = "/dev/null" if patch.before is None else f"a/{patch.path}"
    diff = "".join(difflib.unified_diff(before, after, old, f"b/{patch.path}", n=3))
    header = f"diff --git a/{patch.path} b/{patch.path}\n" + ("new file mode 100644\n" if patch.before is None else "")
    return (
        f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: hivemind_accum <hivemind_accum@users.noreply.github.com>\n"
        f"Subject: [PATCH {number}/{total}] {patch.subject}\n\n{patch.body}\n---\n{header}{diff}"
    )


def _dependency_order(patches: Dict[str, ModulePatch]) -> List[str]:
    """module names so that each comes after the carried modules it imports (ties alphabetically)"""
    imports = {}
    for name, patch in patches.items():
        tree = ast.parse(patch.after)
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imports[name] = {other for other in patches if other != name and f"{UPSTREAM_PACKAGE}.optim.{other}" in modules}
    order: List[str] = []
    while len(order) < len(patches):
        ready = sorted(name for name in patches if name not in order and imports[name] <= set(order))
        if not ready:
            raise GenerationError(f"carried modules import each other in a cycle: {sorted(set(patches) - set(order))}")
        order.append(ready[0])
    return order


def _upstream_md_sections() -> Dict[str, str]:
    """UPSTREAM.md's ``## `` sections by the ``hivemind/...py`` path their heading names"""
    if not UPSTREAM_MD.exists():
        return {}
    sections, path = {}, None
    for line in UPSTREAM_MD.read_text().splitlines():
        if line.startswith("## "):
            match = re.search(r"`(hivemind/[\w/]+\.py)`", line)
            path = match.group(1) if match else None
            if path:
                sections[path] = ""
        elif path:
            sections[path] += line + "\n"
    return {path: text.strip() for path, text in sections.items()}


def _commit_message(patch: ModulePatch, our_source: str, sections: Dict[str, str], notes: Sequence[str] = ()):
    """subject and body: the module docstring's first paragraph says why, UPSTREAM.md's section says what changes"""
    docstring = ast.get_docstring(ast.parse(our_source)) or ""
    why = re.sub(r"\bhivemind_accum\b", UPSTREAM_PACKAGE, docstring.split("\n\n")[0])
    name = Path(patch.path).stem
    subject = SUBJECTS.get(name, f"{'Add' if patch.before is None else 'Change'} {patch.path}")
    what = sections.get(patch.path)
    if what is None:
        what = f"(UPSTREAM.md has no section for {patch.path}; see the module's docstring.)"
    paragraphs = [_wrap(why)] if why else []
    paragraphs += [_markdown_to_text(what)]
    if notes:
        paragraphs.append(_wrap(
            "Where a changed method still needs the previous implementation as a function (rather than running its "
            "body with new statements before or after it), that implementation is kept under a private name:"
        ))
        paragraphs.append("\n".join(_wrap(f"- {_helper_note(note)}", indent="  ") for note in notes))
    return subject, "\n\n".join(paragraphs) + "\n"


# each module's commit subject (a module not listed: "Add <path>" or "Change <path>")
SUBJECTS = {
    "grad_buckets": "Add optim/grad_buckets.py: flat per-(device, dtype) gradient buffers with fused operations",
    "round_guard": "Add optim/round_guard.py: keep inf and NaN out of averaging rounds",
    "torch_internals": "Add optim/torch_internals.py: the private torch interfaces in one place, checked where read",
    "local_fallback": "Add optim/local_fallback.py: keep a round's local gradients until the round is settled",
    "grad_averager": (
        "GradientAverager: flat-buffer accumulation in both modes, loss-scaled micro-steps, failed-round fallback"
    ),
    "power_sgd_averager": "PowerSGDGradientAverager: flat-buffer accumulation, reset non-finite error feedback",
    "state_averager": "TrainingStateAverager: never offer or take non-finite parameters or statistics",
    "progress_tracker": "ProgressTracker: build the progress record when it is read, not at every micro-step",
    "optimizer": "Optimizer: sync-free loss scaling, skip non-finite rounds, check arguments, zero_grad in place",
}

# why a method of hivemind's is kept as a private helper, where the merge's own reason is too terse
KEPT_HELPERS = {
    "ProgressTracker._base_report_local_progress": (
        "the previous report_local_progress, still called for arguments that are not plain non-negative ints, so "
        "that building the LocalTrainingProgress at once raises the model's ValidationError for them as before"
    ),
    "Optimizer._base_step": (
        "the new step passes a torch.amp.GradScaler to the micro-step accumulation for the duration of one call only "
        "(set before the previous step runs with grad_scaler=None, cleared in a finally clause), and runs the "
        "previous step unchanged without a scaler, in in-place mode and on auxiliary peers"
    ),
}


def _helper_note(note: str) -> str:
    helper = note.split(":", 1)[0]
    if helper in KEPT_HELPERS:
        return f"{note.split(': ', 2)[0]}: {note.split(': ', 2)[1]}: {KEPT_HELPERS[helper]}"
    return note


def _markdown_to_text(markdown: str) -> str:
    """UPSTREAM.md prose for a commit message: paragraphs wrapped at 72 columns, each table row a bullet"""
    paragraphs, rows = [], []
    for block in re.split(r"\n\s*\n", markdown):
        lines = block.strip().splitlines()
        if lines and all(line.startswith("|") for line in lines):
            cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
            header, body = cells[0], [c for c in cells[1:] if not set("".join(c)) <= set("-: ")]
            for row in body:
                details = [f"{h}: {c}" for h, c in zip(header[1:], row[1:]) if c]
                rows.append(_wrap(f"- {row[0]}: " + "; ".join(details), indent="  "))
            paragraphs.append("\n".join(rows))
            rows = []
        elif lines:
            paragraphs.append(_wrap(" ".join(line.strip() for line in lines)))
    return "\n\n".join(paragraphs)


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
