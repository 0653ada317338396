"""``python -m hivemind_accum.upstream --out DIR``: write the pull requests for hivemind and the patched hivemind"""
import argparse
import subprocess
import sys
from pathlib import Path

from hivemind_accum.upstream import SUPPORTED_VERSION, GenerationError, generate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hivemind_accum.upstream",
        description=f"Write DIR/prs (the pull requests for hivemind, for git am on master), DIR/hivemind (the "
        f"installed hivemind {SUPPORTED_VERSION} with every pull request applied) and DIR/pyproject.toml "
        f"(pip install DIR)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (new, empty or written before)")
    parser.add_argument(
        "--author", metavar='"NAME <EMAIL>"',
        help="the author of the pull requests' commits (the contributor who sends them); default: git's user.name "
        "and user.email, as git commit takes them",
    )
    args = parser.parse_args(argv)
    try:
        prs = generate(args.out, args.author or git_identity())
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for pr in prs:
        after = f" (after {', '.join(pr.depends)})" if pr.depends else ""
        print(f"  {pr.slug}{after}")
    print(f"wrote {args.out}/prs ({len(prs)} pull requests for hivemind) and {args.out}/hivemind (all applied)")
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
