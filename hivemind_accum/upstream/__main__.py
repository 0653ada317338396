"""``python -m hivemind_accum.upstream --out DIR``: write the patched hivemind, its patch series and packaging"""
import argparse
import sys
from pathlib import Path

from hivemind_accum.upstream import SUPPORTED_VERSION, GenerationError, generate, installed_hivemind


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hivemind_accum.upstream",
        description=f"Generate from the installed hivemind {SUPPORTED_VERSION}: DIR/hivemind (the patched package), "
        f"DIR/patches (the pull request as a patch series, patch -p1 from a directory holding hivemind/) and "
        f"DIR/pyproject.toml (pip install DIR)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (new, empty or generated before)")
    args = parser.parse_args(argv)
    try:
        upstream_dir = installed_hivemind()
        patches = generate(args.out, upstream_dir)
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"patched hivemind {SUPPORTED_VERSION} from {upstream_dir}:")
    for patch in patches:
        print(f"  {patch.path}: {'added' if patch.before is None else 'changed'}")
    print(f"wrote {args.out}/hivemind, {args.out}/patches ({len(patches)} patches), {args.out}/pyproject.toml")
    print(f"install with: pip install {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
