"""``python -m hivemind_accum.upstream --out DIR``: write the patched hivemind, its patch series and packaging"""
import argparse
import subprocess
import sys
from pathlib import Path

from hivemind_accum.upstream import (
    AUTHOR_REQUIRED,
    STACK_AUTHOR,
    SUPPORTED_VERSION,
    GenerationError,
    generate,
    hivemind_version,
    installed_hivemind,
    source_package,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hivemind_accum.upstream",
        description=f"Generate from the installed hivemind {SUPPORTED_VERSION}: DIR/hivemind (the patched package), "
        f"DIR/patches (the pull request as a patch series, patch -p1 from a directory holding hivemind/) and "
        f"DIR/pyproject.toml (pip install DIR)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (new, empty or generated before)")
    parser.add_argument(
        "--hivemind-src", type=Path, metavar="SRC",
        help="generate against this hivemind source tree (a git checkout, e.g. of master, any version) instead of the "
        "installed package; then git am DIR/patches/*.patch in that checkout applies the series (no pyproject.toml "
        "is written: the checkout has its own packaging)",
    )
    parser.add_argument(
        "--author", metavar='"NAME <EMAIL>"',
        help="the author of the pull requests' and the series' commits (the contributor who sends them); default: "
        "git's user.name and user.email, as git commit takes them",
    )
    args = parser.parse_args(argv)
    args.author = args.author or git_identity()
    if not args.author or STACK_AUTHOR.fullmatch(args.author) is None:
        print(f"error: {AUTHOR_REQUIRED}", file=sys.stderr)
        return 2
    try:
        upstream_dir = source_package(args.hivemind_src) if args.hivemind_src else installed_hivemind()
        patches = generate(args.out, upstream_dir, from_source=args.hivemind_src is not None, author=args.author)
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"patched hivemind {hivemind_version(upstream_dir)} from {upstream_dir}:")
    for number, patch in enumerate(patches, start=1):
        print(f"  {number:2d} {patch.subject} ({', '.join(patch.paths)})")
    packaging = "" if args.hivemind_src else f", {args.out}/pyproject.toml"
    print(f"wrote {args.out}/hivemind, {args.out}/patches ({len(patches)} patches){packaging}")
    prs = sorted(path.name for path in (args.out / "prs").iterdir())
    print(f"wrote {args.out}/prs: {len(prs)} pull requests for hivemind ({', '.join(prs)})")
    if args.hivemind_src:
        print(f"apply with: git -C {args.hivemind_src} am {args.out.resolve()}/patches/*.patch")
    else:
        print(f"install with: pip install {args.out}")
    return 0


def git_identity() -> str:
    """``"Name <email>"`` from git's configuration (user.name, user.email), or "" where either is unset"""
    values = []
    for key in ("user.name", "user.email"):
        run = subprocess.run(["git", "config", "--get", key], capture_output=True, text=True, cwd=Path.home())
        values.append(run.stdout.strip() if run.returncode == 0 else "")
    return f"{values[0]} <{values[1]}>" if all(values) else ""


if __name__ == "__main__":
    sys.exit(main())
