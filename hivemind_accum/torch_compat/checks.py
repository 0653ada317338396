"""
How each private torch interface is checked: once per process, at its first use, and a failed check raises
:class:`TorchInternalsError` naming the torch version and the interface (docs/compatibility.md).
"""
from typing import Callable, Set

import torch

TESTED_TORCH = ("2.3.1", "2.13.0", "2.14.1")  # the releases CI runs the tests on, oldest to newest


class TorchInternalsError(RuntimeError):
    """a private torch interface this package relies on is missing or changed in the installed torch release"""


_CHECKED: Set[str] = set()  # the interfaces whose check passed in this process


def check_once(interface: str, check: Callable[[], None]) -> None:
    """run ``check`` (which raises :class:`TorchInternalsError`) unless ``interface`` passed it in this process"""
    if interface not in _CHECKED:
        check()
        _CHECKED.add(interface)


def changed(what: str, use: str, instead: str = "") -> TorchInternalsError:
    """the error for a private interface that is not as ``use`` (what this package does with it) needs"""
    tested = ", ".join(TESTED_TORCH)
    if torch.__version__.split("+")[0] in TESTED_TORCH:
        advice = "this release passed the check in hivemind_accum's tests, so something in this process changed torch"
    else:
        advice = f"hivemind_accum was tested with torch {tested}, not with this release: install one of those"
    return TorchInternalsError(f"torch {torch.__version__}: {what}. hivemind_accum {use}; {advice}{instead}")


def check_op(name: str, example: Callable[[Callable], bool], use: str) -> None:
    """``torch.<name>`` exists and ``example(op)``, which runs it on small CPU tensors, gets the expected values"""
    op = getattr(torch, name, None)
    if op is None:
        raise changed(f"torch.{name} is missing", use)
    try:
        expected = example(op)
    except Exception as e:  # e.g. a changed signature
        raise changed(f"torch.{name} fails on a small example ({type(e).__name__}: {e})", use) from e
    if not expected:
        raise changed(f"torch.{name} gives other values than expected on a small example", use)
