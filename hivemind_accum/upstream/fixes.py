"""
Defects of hivemind 1.1.12 that this package works around, and how the generated tree fixes each at its place.

The package cannot change hivemind's code, so it works around a defect from its subclass (an overridden method, a
value kept aside); the generated tree needs no workaround: the series fixes the defect where it is, in its own
commit, and the package's workaround is left out of the merge (``omit``).
"""
import ast
import textwrap
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


class FixError(Exception):
    """a fix does not match the hivemind source or this package's module"""


@dataclass(frozen=True)
class Fix:
    path: str  # the module, relative to the package directory, e.g. "optim/optimizer.py"
    old: str  # hivemind's text, whole lines, found exactly once in the module
    new: str  # what replaces it (may name "{ours}": our statement ``moved``, indented as ``old``)
    subject: str  # the commit's subject
    why: str  # the commit's message: the defect, how it shows, the fix
    omit: Tuple[str, ...] = ()  # our workaround, left out of the merge: "Class.method" or a statement's source
    moved: Optional[str] = None  # the source of a statement of ours that takes ``old``'s place (then omitted too)
    module: str = ""  # our module that works around it ("" for none)


FIXES: Sequence[Fix] = (
    Fix(
        path="optim/optimizer.py",
        module="optimizer",
        old="        client_mode = client_mode if client_mode is None else dht.client_mode\n",
        new="        client_mode = client_mode if client_mode is not None else dht.client_mode\n",
        subject="Optimizer: fall back to the DHT's client mode only when client_mode is not given",
        why=(
            "Optimizer.__init__ computes `client_mode if client_mode is None else dht.client_mode`, the fallback "
            "inverted: without client_mode=, a peer whose DHT is in client mode (behind NAT) keeps "
            "self.client_mode = None, builds averagers in client mode, trains until its first epoch ends and dies in "
            "_update_global_epoch with `ValueError: State sharing priority is unused: averager in client mode cannot "
            "share its state`; an explicit client_mode is replaced by the DHT's. The flag is now copied from the "
            "DHT only when it is not given."
        ),
        omit=(
            "Optimizer._make_progress_tracker",
            "self._client_mode = client_mode",
            "client_mode = dht.client_mode if client_mode is None else client_mode",
        ),
    ),
    Fix(
        path="optim/optimizer.py",
        module="optimizer",
        old="        if self._parent_pid == os.getpid() and self.is_alive():\n",
        new='        if hasattr(self, "state_averager") and self._parent_pid == os.getpid() and self.is_alive():\n',
        subject="Optimizer: do not fail in __del__ after a constructor that raised",
        why=(
            "A constructor that raises (a positional argument, a ValueError from its own checks) leaves an object "
            "without _parent_pid or state_averager, whose __del__ then prints `Exception ignored in: <function "
            "Optimizer.__del__> ... AttributeError` after the real error. __del__ now shuts down only an optimizer "
            "that has a state averager."
        ),
        omit=("Optimizer.__del__",),
    ),
    Fix(
        path="optim/optimizer.py",
        module="optimizer",
        old='        assert not (client_mode and auxiliary), "Client-mode peers cannot serve as auxiliaries"\n',
        new="{ours}",
        moved="if client_mode and auxiliary:",
        subject="Optimizer: raise ValueError, not AssertionError, for client_mode with auxiliary",
        why=(
            "A misconfiguration is reported as a ValueError naming the two arguments instead of an assertion, which "
            "python -O removes."
        ),
    ),
    Fix(
        path="optim/grad_scaler.py",
        old="    def update(self, new_scale: Optional[float] = None) -> bool:\n        with self._lock:\n",
        new=(
            "    def update(self, new_scale: Optional[float] = None) -> bool:\n"
            "        if not self._enabled:\n"
            "            return False  # as torch.amp.GradScaler.update, which does nothing while disabled\n"
            "        with self._lock:\n"
        ),
        subject="GradScaler: make update() a no-op while the scaler is disabled",
        why=(
            "hivemind.GradScaler() without a device targets CUDA and, on a machine without CUDA, warns and disables "
            "itself; scale() and step() then behave as without a scaler, but update() raises `AttributeError: "
            "'GradScaler' object has no attribute '_per_optimizer_states'`, a state that torch's GradScaler creates "
            "only when enabled. torch's own update() returns early when disabled; so does this one now."
        ),
    ),
    Fix(
        path="averaging/control.py",
        module="grad_averager",
        old=(
            "    def cancel(self) -> bool:\n"
            "        if self._trigger is not None:\n"
            "            self._trigger.cancel()\n"
            "        if self._cancel is not None:\n"
            "            self._cancel.set_result(None)\n"
            "        return super().cancel()\n"
        ),
        new=(
            "    def cancel(self) -> bool:\n"
            "        cancelled = super().cancel()  # first: the averager reads cancelled() when the signals below arrive\n"
            "        if self._trigger is not None:\n"
            "            self._trigger.cancel()\n"
            "        if self._cancel is not None:\n"
            "            self._cancel.set_result(None)\n"
            "        return cancelled\n"
        ),
        subject="StepControl: mark a round cancelled before signalling the averager",
        why=(
            "StepControl.cancel() cancels the trigger and sets the cancel future, then marks the step cancelled. The "
            "averager's process wakes on either signal and checks step.cancelled() once before the all-reduce, "
            "which can still read False; a cancelled trigger counts as triggered, so the round the peer abandoned "
            "(Optimizer: 'Skipping pre-scheduled averaging round: there are no other peers') runs its all-reduce "
            "anyway, fails at `InvalidStateError: Can't set_result to a future that is CANCELLED`, and leaves the "
            "group's average in the buffer that already holds the peer's next gradients. The step is now marked "
            "cancelled first."
        ),
        omit=(
            "_StateFirstStepControl",
            "if _CANCEL_SIGNALS_FIRST:",
            "_cancel_signals_first",
            "_CANCEL_SIGNALS_FIRST = _cancel_signals_first()",
            "import inspect",
        ),
    ),
)


def apply_fix(text: str, fix: Fix, ours: str = "") -> str:
    """hivemind's module with ``fix`` applied; unchanged if hivemind already has the fixed text"""
    if text.count(fix.old) != 1:
        if fix.moved is None and fix.new in text:
            return text  # fixed in this hivemind already
        raise FixError(f"{fix.path}: expected this text exactly once, found it {text.count(fix.old)} times:\n{fix.old}")
    new = fix.new
    if fix.moved is not None:
        indent = fix.old[: len(fix.old) - len(fix.old.lstrip())]
        new = new.replace("{ours}", textwrap.indent(textwrap.dedent(_statement_text(ours, fix.moved)), indent))
    return text.replace(fix.old, new)


def omit_workarounds(ours: str, fixes: Sequence[Fix], name: str) -> str:
    """our module without the methods and statements that the fixes make unnecessary"""
    items = [(item, fix.subject) for fix in fixes for item in fix.omit + ((fix.moved,) if fix.moved else ())]
    return omit_items(ours, items, name)


def omit_items(ours: str, items: Sequence[Tuple[str, str]], name: str) -> str:
    """our module without the named methods, functions, docstrings and statements (``items``: each with the subject
    of the commit that adds it, for the error message)"""
    tree = ast.parse(ours)
    lines = ours.splitlines(keepends=True)
    spans = []
    for item, subject in items:
        node = _find(tree, item)
        if node is None:
            raise FixError(f"{name}: {item!r} (left out for '{subject}') is not in the module")
        spans.append(_span(lines, node))
    kept: List[Tuple[int, int]] = []  # a span inside another one (a statement of a method also left out) goes with it
    for start, end in sorted(spans):
        if kept and start < kept[-1][1]:
            kept[-1] = (kept[-1][0], max(end, kept[-1][1]))
        else:
            kept.append((start, end))
    for start, end in reversed(kept):
        del lines[start:end]
    return "".join(lines)


def _find(tree: ast.Module, item: str) -> Optional[ast.AST]:
    if item.replace(".", "").replace("_", "").isalnum():  # Class.method, Class.method.__doc__, a function or class
        if "." not in item:
            top_level = (ast.FunctionDef, ast.ClassDef)
            return next((n for n in tree.body if isinstance(n, top_level) and n.name == item), None)
        class_name, method, *doc = item.split(".")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                found = next((n for n in node.body if getattr(n, "name", None) == method), None)
                if found is not None and doc == ["__doc__"]:
                    body = found.body
                    is_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                    return body[0] if is_doc and isinstance(body[0].value.value, str) else None
                return found
        return None
    header = item.endswith(":")  # a compound statement, named by its first line
    wanted = ast.unparse(ast.parse(textwrap.dedent(item) + ("\n    pass" if header else "")))
    wanted = wanted.splitlines()[0] if header else wanted
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            text = ast.unparse(node)
            if (text.splitlines()[0] == wanted) if header else (text == wanted):
                found.append(node)
    if len(found) > 1:
        raise FixError(f"{item!r} is in the module {len(found)} times: name it by its text (an Edit) instead")
    return found[0] if found else None


def _span(lines, node) -> Tuple[int, int]:
    """0-based [start, end) lines of a statement, its decorators and the comment lines right above it"""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())]) - 1
    while start > 0 and lines[start - 1].strip().startswith("#"):
        start -= 1
    return start, node.end_lineno


def _statement_text(ours: str, source: str) -> str:
    tree = ast.parse(ours)
    node = _find(tree, source)
    if node is None:
        raise FixError(f"{source!r} is not in the module")
    lines = ours.splitlines(keepends=True)
    start, end = _span(lines, node)
    return "".join(lines[start:end])
