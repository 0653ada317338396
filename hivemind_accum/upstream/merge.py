"""
Merge a ``hivemind_accum.optim`` module into the upstream hivemind module it mirrors.

The merge edits upstream's source text at the places the two syntax trees name, so upstream's formatting and comments
survive and a diff shows only the change. Rules, for a class of ours that subclasses the upstream class of the same
name (``class GradientAverager(upstream.GradientAverager)``):

- a method of ours that upstream lacks is added; one that upstream has replaces upstream's;
- where ours calls upstream's implementation (``super().step(...)``), upstream's method stays under a private name
  (``_base_step``) next to ours, and the call becomes ``self._base_step(...)``; a method of ours whose signature is
  ``(self, *args, **kwargs)`` and that only adds statements around ``super().name(*args, **kwargs)`` is inlined
  instead: upstream's method (signature, docstring, body) with our statements before and after its body;
- a ``__new__`` of ours that only refuses positional arguments (``if args: raise ...``) is left out where upstream's
  ``__init__`` is keyword-only: Python refuses them there;
- class attributes are added or replaced; ``upstream.Class.method`` in the class body becomes the method's merged
  name (``_base_method`` where ours wraps it); the class keeps upstream's docstring, in which each ``:param``
  (``:raises``...) entry our docstring documents replaces upstream's or is added after its predecessor;
- the class keeps upstream's bases, except that a base of ours defined in this module (a new class between
  upstream's class and its bases in the method resolution order) takes the place of the upstream bases it derives
  from; new module-level classes and functions keep our order relative to the merged ones;
- imports of the upstream module itself disappear (``upstream.X`` becomes ``X``), imports of ``hivemind_accum.optim.M``
  become ``hivemind.optim.M``, a name upstream already imports under another name is renamed to upstream's name, and
  new imports are placed in upstream's import sections;
- other module-level functions and assignments are added (or replace upstream's of the same name).

Anything else (a conflicting import, a new base class, a statement kind not listed) raises :class:`MergeError`.
"""
import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

PACKAGE, UPSTREAM_PACKAGE = "hivemind_accum", "hivemind"
BASE_PREFIX = "_base_"  # upstream's implementation of a method that ours wraps keeps this prefix
LINE_LENGTH = 119  # upstream hivemind's formatter limit
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# a docstring field: ":param name:", ":raises ValueError:", ":returns:" (not a role such as ":class:`X`")
_FIELD = re.compile(r"^(\s*):(param|type|raises|returns?|rtype|yields|note|warning)(?:\s+([^:]+?))?:(?!`)")


class MergeError(Exception):
    """this package's module cannot be merged into upstream's by the rules above"""


@dataclass
class _Edit:
    start: int  # 0-based index of the first line replaced (or of the line the text goes before)
    end: int  # 0-based index after the last line replaced; == start for an insertion
    text: str
    seq: int


class _Source:
    """a module's text, lines and syntax tree"""

    def __init__(self, text: str, name: str):
        self.text, self.name = text, name
        self.lines = text.splitlines(keepends=True)
        try:
            self.tree = ast.parse(text, name)
        except SyntaxError as e:
            raise MergeError(f"{name}: {e}") from e

    def span(self, node: ast.AST) -> Tuple[int, int]:
        """0-based [start, end) lines of a statement with its decorators and the comment lines right above it"""
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())]) - 1
        while start > 0 and self.lines[start - 1].strip().startswith("#"):
            start -= 1
        return start, self.end(node)

    def end(self, node: ast.AST) -> int:
        """0-based line after a statement and the comment lines right after it indented deeper than the statement
        (comments at the end of a function's body)"""
        end = node.end_lineno
        while end < len(self.lines) and self.lines[end].strip().startswith("#"):
            if len(self.lines[end]) - len(self.lines[end].lstrip()) <= node.col_offset:
                break
            end += 1
        return end

    def render(self, start: int, end: int, replacements: Sequence[Tuple[ast.AST, str]] = ()) -> str:
        """lines [start, end) with each given node's text replaced"""
        chunk = [line.encode() for line in self.lines[start:end]]
        spans = []
        for node, text in replacements:
            if node.end_lineno <= start or node.lineno > end:
                continue  # outside these lines (e.g. the super() call between the two parts of an inlined method)
            spans.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text))
        for lineno, col, end_lineno, end_col, text in sorted(spans, reverse=True):
            first, last = lineno - 1 - start, end_lineno - 1 - start
            if not (0 <= first <= last < len(chunk)):
                raise MergeError(f"{self.name}:{lineno}: a rewritten expression leaves the merged statement")
            merged = chunk[first][:col] + text.encode() + chunk[last][end_col:]
            chunk[first : last + 1] = [merged]
        text = b"".join(chunk).decode()
        return text if text.endswith("\n") else text + "\n"


@dataclass
class _Import:
    module: Optional[str]  # for ``import a.b``: None
    name: str  # imported name (for ``import a.b``: "a.b")
    bound: str  # the name it binds in the module

    @property
    def key(self) -> Tuple[Optional[str], str]:
        return self.module, self.name


def merge_module(
    upstream_text: str, our_text: str, module: str, carried: Iterable[str], name: str = "",
    notes: Optional[List[str]] = None,
) -> str:
    """
    Merge this package's module into upstream's.

    :param upstream_text: upstream's source of the module, e.g. of ``hivemind/optim/grad_averager.py``
    :param our_text: this package's module mirroring it, e.g. ``hivemind_accum/optim/grad_averager.py``
    :param module: upstream's dotted module name, e.g. ``"hivemind.optim.grad_averager"``
    :param carried: names of this package's ``optim`` modules that go upstream (their imports are rewritten)
    :param name: a label for error messages
    :param notes: if given, receives one line per method of upstream's kept under a private name, saying why
    :returns: the merged source
    :raises MergeError: if a rule above does not apply
    """
    merger = _ModuleMerger(_Source(upstream_text, f"{module} (upstream)"), _Source(our_text, name or module), module,
                           set(carried))
    merged = merger.merge()
    if notes is not None:
        notes += merger.notes
    return merged


def rewrite_new_module(our_text: str, carried: Iterable[str], name: str = "") -> str:
    """a module with no upstream counterpart: the same text with its imports of this package's ``optim`` modules
    (and mentions of the package) pointing at upstream's package; raises :class:`MergeError` for any other import of
    this package"""
    source = _Source(our_text, name)
    for node in ast.walk(source.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for imported in _imports(node):
                if _is_ours(imported.module or imported.name):
                    _rewrite_module_name(imported.module or imported.name, set(carried), source.name)
    return _rename_package(source.text)


def _rename_package(text: str) -> str:
    return re.sub(rf"\b{PACKAGE}\b", UPSTREAM_PACKAGE, text)


def _is_ours(module: Optional[str]) -> bool:
    return module is not None and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _rewrite_module_name(module: str, carried: Set[str], where: str) -> str:
    prefix = f"{PACKAGE}.optim."
    if module.startswith(prefix) and module[len(prefix) :] in carried:
        return f"{UPSTREAM_PACKAGE}.optim.{module[len(prefix):]}"
    raise MergeError(
        f"{where}: imports {module}, which does not go upstream; only {PACKAGE}.optim modules are carried over"
    )


def _imports(node: ast.stmt) -> List[_Import]:
    if isinstance(node, ast.Import):
        return [_Import(None, a.name, a.asname or a.name.split(".")[0]) for a in node.names]
    if node.level:
        raise MergeError(f"line {node.lineno}: relative imports are not supported")
    return [_Import(node.module, a.name, a.asname or a.name) for a in node.names]


def _import_section(module: str) -> int:
    top = module.split(".")[0]
    if top == "__future__":
        return 0
    if top in sys.stdlib_module_names:
        return 1
    return 3 if top == UPSTREAM_PACKAGE else 2


def _import_sort_key(module: Optional[str], name: str) -> Tuple[int, int, str]:
    target = module if module is not None else name
    return _import_section(target), int(module is not None), target


def _render_import(module: Optional[str], names: Sequence[Tuple[str, str]]) -> str:
    """an import statement in upstream's style (isort order, black wrapping); ``names``: (name, bound) pairs"""
    implicit = (lambda name: name.split(".")[0]) if module is None else (lambda name: name)
    aliases = [name if bound == implicit(name) else f"{name} as {bound}" for name, bound in names]
    if module is None:
        return "".join(f"import {alias}\n" for alias in aliases)
    # isort's force_sort_within_sections=False, order_by_type=True: CONSTANTS, Classes, functions
    aliases.sort(key=lambda a: (0 if a.isupper() else 1 if a[:1].isupper() else 2, a))
    line = f"from {module} import {', '.join(aliases)}\n"
    if len(line) - 1 <= LINE_LENGTH:
        return line
    return f"from {module} import (\n" + "".join(f"    {alias},\n" for alias in aliases) + ")\n"


def _super_call_name(call: ast.AST) -> Optional[str]:
    """``X`` for a call ``super().X(...)``"""
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
        inner = call.func.value
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super":
            if not inner.args and not inner.keywords:
                return call.func.attr
    return None


def _own_nodes(function: ast.AST) -> Iterable[ast.AST]:
    """nodes of a function's body, not descending into nested functions, lambdas or classes"""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*_FUNCTIONS, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _docstring_node(node: ast.AST) -> Optional[ast.Expr]:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0]
    return None


def _fit_def_line(line: str) -> str:
    """a one-line ``def`` longer than :data:`LINE_LENGTH` with its parameters on a line of their own, as black writes
    it; any other line unchanged"""
    match = re.match(r"^(\s*)(async def|def) (\w+)\((.*)\)(\s*->\s*[^:]+)?:\s*$", line.rstrip("\n"))
    if len(line.rstrip("\n")) <= LINE_LENGTH or match is None:
        return line
    indent, keyword, name, params, returns = match.groups()
    return f"{indent}{keyword} {name}(\n{indent}    {params}\n{indent}){returns or ''}:\n"


def _private_name(method: str) -> str:
    return BASE_PREFIX + method.strip("_")


def _targets(node: ast.stmt) -> List[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _assigned_names(node: ast.stmt) -> List[str]:
    names = []
    for target in _targets(node):
        if not isinstance(target, ast.Name):
            raise MergeError(f"line {node.lineno}: only assignments to plain names can be merged")
        names.append(target.id)
    return names


class _ModuleMerger:
    def __init__(self, upstream: _Source, ours: _Source, module: str, carried: Set[str]):
        self.up, self.ours, self.module, self.carried = upstream, ours, module, carried
        self.edits: List[_Edit] = []
        self.self_aliases: Set[str] = set()  # names under which ours imports the upstream module itself
        self.name_map: Dict[str, str] = {}  # a name of ours -> upstream's name for the same object
        self.notes: List[str] = []  # why a method of upstream's is kept under a private name

    def add(self, start: int, end: int, text: str) -> None:
        self.edits.append(_Edit(start, end, text, len(self.edits)))

    def merge(self) -> str:
        self._merge_imports()
        up_top = {n.name: n for n in self.up.tree.body if isinstance(n, (ast.ClassDef, *_FUNCTIONS))}
        up_assigns = {
            name: n for n in self.up.tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for name in _assigned_names(n)
        }
        preamble_end = self._preamble_end()
        self.new_classes = {n.name: n for n in self.ours.tree.body if isinstance(n, ast.ClassDef) and n.name not in up_top}
        body = self.ours.tree.body
        for i, node in enumerate(body):
            if isinstance(node, (ast.Import, ast.ImportFrom)) or node is _docstring_node(self.ours.tree):
                continue
            if isinstance(node, ast.ClassDef):
                upstream_base = self._upstream_base(node, up_top)
                if upstream_base is not None:
                    _ClassMerger(self, *upstream_base, node).merge()
                else:
                    self._add_or_replace(node, up_top.get(node.name), self._next_counterpart(body[i + 1 :], up_top))
            elif isinstance(node, _FUNCTIONS):
                self._add_or_replace(node, up_top.get(node.name), self._next_counterpart(body[i + 1 :], up_top))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names = _assigned_names(node)
                existing = [up_assigns[name] for name in names if name in up_assigns]
                text = self.code(node)
                if existing and ast.dump(existing[0]) == ast.dump(ast.parse(text).body[0]):
                    continue  # e.g. logger = get_logger(__name__)
                if existing:
                    self.add(*self.up.span(existing[0]), text)
                else:
                    self.add(preamble_end, preamble_end, text)
            else:
                raise MergeError(
                    f"{self.ours.name}:{node.lineno}: a module-level {type(node).__name__} cannot be merged; "
                    f"module-level code must be imports, classes, functions or assignments"
                )
        self._add_imports()
        return self._apply()

    def code(self, node: ast.AST, extra: Sequence[Tuple[ast.AST, str]] = (), span=None) -> str:
        """our statement's text with upstream-module references and renamed imports rewritten (``extra``
        replacements win over those inside them)"""
        start, end = span if span is not None else self.ours.span(node)
        inside = {id(sub) for outer, _ in extra for sub in ast.walk(outer) if sub is not outer}
        return _rename_package(self.ours.render(start, end, [*self._rewrites(node, inside), *extra]))

    def _rewrites(self, node: ast.AST, skip: Set[int] = frozenset()) -> List[Tuple[ast.AST, str]]:
        rewrites = []
        for sub in ast.walk(node):
            if id(sub) in skip:
                continue
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in self.self_aliases:
                rewrites.append((sub, sub.attr))  # upstream.GradientAverager -> GradientAverager
            elif isinstance(sub, ast.Name) and sub.id in self.name_map:
                rewrites.append((sub, self.name_map[sub.id]))
            elif isinstance(sub, ast.Name) and sub.id in self.self_aliases:
                raise MergeError(f"{self.ours.name}:{sub.lineno}: the upstream module itself is used as a value")
        return rewrites

    def _add_or_replace(self, node: ast.stmt, existing: Optional[ast.stmt], before: Optional[ast.stmt]) -> None:
        """replace upstream's statement of the same name, or add ours before ``before`` (else at the end)"""
        if existing is not None:
            self.add(*self.up.span(existing), self.code(node))
        elif before is not None:
            start = self.up.span(before)[0]
            self.add(start, start, self.code(node) + "\n\n")
        else:
            self.add(len(self.up.lines), len(self.up.lines), "\n\n" + self.code(node))

    def _next_counterpart(self, following: Sequence[ast.stmt], up_top: Dict[str, ast.AST]) -> Optional[ast.stmt]:
        """upstream's class or function matching the first of ``following`` that upstream has (keeps our order, so a
        new base class lands before the class it is a base of)"""
        for node in following:
            if isinstance(node, (ast.ClassDef, *_FUNCTIONS)) and node.name in up_top:
                return up_top[node.name]
        return None

    def _upstream_base(self, node: ast.ClassDef, up_top: Dict[str, ast.AST]):
        """upstream's class that ours subclasses (``upstream.X``) and the merged class's bases: ours besides upstream's
        class, each either one of upstream's bases or a new class of this module (which then stands in for the
        upstream bases it derives from, keeping the method resolution order), then upstream's remaining bases"""
        upstream_bases = [
            b.attr for b in node.bases
            if isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) and b.value.id in self.self_aliases
        ]
        if not upstream_bases:
            return None
        if len(upstream_bases) > 1 or upstream_bases[0] != node.name or not isinstance(up_top.get(node.name), ast.ClassDef):
            raise MergeError(
                f"{self.ours.name}:{node.lineno}: class {node.name} must subclass upstream's class of the same name"
            )
        upstream_class = up_top[node.name]
        upstream_base_names = [ast.unparse(b) for b in upstream_class.bases]
        added, covered = [], set()
        for base in node.bases:
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in self.self_aliases:
                continue
            name = self.name_map.get(ast.unparse(base), ast.unparse(base))
            if name in self.new_classes:
                added.append(name)
                covered |= {self.name_map.get(ast.unparse(b), ast.unparse(b)) for b in self.new_classes[name].bases}
            elif name not in upstream_base_names:
                raise MergeError(
                    f"{self.ours.name}:{node.lineno}: class {node.name} adds base {name}, which upstream's class does "
                    f"not have ({', '.join(upstream_base_names)}) and this module does not define; change the bases "
                    f"upstream by hand"
                )
        if node.keywords or node.decorator_list:
            raise MergeError(f"{self.ours.name}:{node.lineno}: class keywords or decorators cannot be merged")
        bases = added + [name for name in upstream_base_names if name not in covered and name not in added]
        return upstream_class, (bases if added else None)

    def _merge_imports(self) -> None:
        up_imports = [(node, _imports(node)) for node in self.up.tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        bound = {imp.bound: imp.key for _, imports in up_imports for imp in imports}
        by_key = {imp.key: imp.bound for _, imports in up_imports for imp in imports}
        package, _, leaf = self.module.rpartition(".")
        new: Dict[Optional[str], List[Tuple[str, str]]] = {}
        for node in self.ours.tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for imp in _imports(node):
                if imp.module is None and _is_ours(imp.name):
                    raise MergeError(f"{self.ours.name}:{node.lineno}: use 'from ... import ...' for {imp.name}")
                if _is_ours(imp.module):
                    imp.module = _rewrite_module_name(imp.module, self.carried, self.ours.name)
                if (imp.module, imp.name) == (package, leaf) or (imp.module is None and imp.name == self.module):
                    self.self_aliases.add(imp.bound)  # from hivemind.optim import grad_averager as upstream
                elif imp.module == self.module:
                    self.name_map[imp.bound] = imp.name  # a name of the merged module itself
                elif imp.key in by_key:
                    if by_key[imp.key] != imp.bound:
                        self.name_map[imp.bound] = by_key[imp.key]  # GradScaler as HivemindGradScaler -> GradScaler
                elif imp.bound in bound:
                    raise MergeError(
                        f"{self.ours.name}:{node.lineno}: imports {imp.bound} from {imp.module or imp.name}, but "
                        f"upstream's module binds {imp.bound} to {'.'.join(filter(None, bound[imp.bound]))}"
                    )
                else:
                    new.setdefault(imp.module, []).append((imp.name, imp.bound))
        self._new_imports, self._up_imports = new, up_imports

    def _add_imports(self) -> None:
        """our new imports, in upstream's import sections, each only if the merged code uses the name it binds"""
        up_imports = self._up_imports
        used_names = {n.id for n in ast.walk(ast.parse(self._apply())) if isinstance(n, ast.Name)}
        new = {}
        for module, names in self._new_imports.items():
            used = [(name, bound) for name, bound in names if bound.split(".")[0] in used_names]
            if used:
                new[module] = used
        from_nodes = {n.module: (n, imports) for n, imports in up_imports if isinstance(n, ast.ImportFrom)}
        for module, names in new.items():
            if module is not None and module in from_nodes:  # extend upstream's own statement
                node, imports = from_nodes[module]
                merged = [(imp.name, imp.bound) for imp in imports] + names
                self.add(*self.up.span(node), _render_import(module, merged))
                continue
            if module is None:  # one ``import x`` statement per module
                for name, bound_name in names:
                    self._insert_import(up_imports, _import_sort_key(None, name), _render_import(None, [(name, bound_name)]))
            else:
                self._insert_import(up_imports, _import_sort_key(module, ""), _render_import(module, names))

    def _insert_import(self, up_imports, key, statement: str) -> None:
        keys = [(node, _import_sort_key(getattr(node, "module", None), node.names[0].name)) for node, _ in up_imports]
        same_section = [(node, k) for node, k in keys if k[0] == key[0]]
        for node, k in same_section:
            if k > key:
                return self.add(self.up.span(node)[0], self.up.span(node)[0], statement)
        if same_section:
            end = same_section[-1][0].end_lineno
            return self.add(end, end, statement)
        earlier = [node for node, k in keys if k[0] < key[0]]
        if earlier:
            end = earlier[-1].end_lineno
            return self.add(end, end, "\n" + statement)
        start = self.up.span(keys[0][0])[0] if keys else 0
        self.add(start, start, statement + "\n")

    def _preamble_end(self) -> int:
        """the line after upstream's last module-level statement before its first class or function"""
        end = 0
        for node in self.up.tree.body:
            if isinstance(node, (ast.ClassDef, *_FUNCTIONS)):
                break
            end = node.end_lineno
        return end

    def _apply(self) -> str:
        lines = list(self.up.lines)
        edits = sorted(self.edits, key=lambda e: (e.start, e.end != e.start, e.seq))
        for before, after in zip(edits, edits[1:]):
            if before.end > after.start:
                raise MergeError(f"{self.up.name}: two changes overlap at line {after.start + 1}")
        for edit in reversed(edits):
            lines[edit.start : edit.end] = [edit.text]
        text = "".join(lines)
        try:
            ast.parse(text)
        except SyntaxError as e:
            raise MergeError(f"{self.module}: the merged module does not parse ({e})") from e
        return text


@dataclass
class _Inline:
    """how one of our methods goes into upstream's method ``target`` instead of wrapping it"""

    target: str  # upstream's method whose body receives our statements
    before: List[ast.stmt]  # our statements before the call
    after: List[ast.stmt]  # our statements after it (a final ``return`` of the call's result left out)
    wrapper: Optional[ast.With] = None  # ``with ...:`` of ours around the call: upstream's body goes inside it
    replaced: Sequence[ast.stmt] = ()  # upstream's leading ``if p is not None:`` blocks, for a p ours passes as None
    renames: Optional[Dict[str, str]] = None  # our names for the result -> upstream's returned names
    final_return: Optional[ast.Return] = None  # upstream's final return (our after-statements go before it)


def _signature_params(function: ast.FunctionDef):
    """positional parameter names (without self), keyword-only names, defaults by name, *args and **kwargs names"""
    args = function.args
    named = [a.arg for a in args.posonlyargs + args.args]
    defaults = dict(zip(named[len(named) - len(args.defaults) :], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    return (
        named[1:], [a.arg for a in args.kwonlyargs], defaults,
        args.vararg.arg if args.vararg else None, args.kwarg.arg if args.kwarg else None,
    )


def _refuses_positional_arguments(method: ast.FunctionDef) -> bool:
    """``def __new__(cls, *args, **kwargs)`` whose body (after a docstring) is ``if args: ... raise ...`` and
    ``return super().__new__(cls)``"""
    args, body = method.args, method.body[1:] if _docstring_node(method) else list(method.body)
    if method.name != "__new__" or args.posonlyargs or len(args.args) != 1 or args.vararg is None or len(body) != 2:
        return False
    guard, new = body
    return (
        isinstance(guard, ast.If) and isinstance(guard.test, ast.Name) and guard.test.id == args.vararg.arg
        and not guard.orelse and isinstance(guard.body[-1], ast.Raise)
        and isinstance(new, ast.Return) and _super_call_name(new.value) == "__new__"
    )


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _is_not_none_test(stmt: ast.stmt, name: str) -> bool:
    """``if name is not None:`` without an else"""
    test = getattr(stmt, "test", None)
    return (
        isinstance(stmt, ast.If) and not stmt.orelse and isinstance(test, ast.Compare) and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot) and isinstance(test.left, ast.Name) and test.left.id == name
        and _is_none(test.comparators[0])
    )


def _rebinds(body: Sequence[ast.stmt], name: str, value: ast.expr) -> bool:
    """whether ``body`` (upstream's method) itself sets ``name = value`` at its top level, before reading ``name``:
    then passing ``value`` for ``name`` changes nothing (e.g. a default that upstream's method resolves the same way)"""
    for stmt in body:
        if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == [name]:
            return ast.unparse(stmt.value) == ast.unparse(value)
        if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(stmt)):
            return False
    return False


def _plan_inline(ours: ast.FunctionDef, upstream: ast.FunctionDef, target: str):
    """(plan, None) if our method can go into upstream's ``target`` (its signature, docstring and body, with our
    statements around that body), else (None, why not)"""
    if {ast.dump(d) for d in ours.decorator_list} - {ast.dump(d) for d in upstream.decorator_list}:
        return None, "it adds a decorator"
    body = ours.body[1:] if _docstring_node(ours) else list(ours.body)
    wrapper = None
    if len(body) == 1 and isinstance(body[0], ast.With):
        wrapper, body = body[0], body[0].body
    calls = [n for n in _own_nodes(ours) if _super_call_name(n) == target]
    if len(calls) != 1:
        return None, f"it calls it {len(calls)} times, with different arguments or in different branches"
    positions = [
        i for i, stmt in enumerate(body)
        if isinstance(stmt, (ast.Expr, ast.Return, ast.Assign)) and stmt.value is calls[0]
    ]
    if not positions:
        return None, "it calls it inside a condition or an expression"
    i = positions[0]
    call_stmt, before, after = body[i], body[:i], body[i + 1 :]
    if wrapper is not None and (before or after or isinstance(body[i], ast.Assign)):
        return None, "it runs statements inside its with-block besides the call"
    call = calls[0]
    up_body = upstream.body[1:] if _docstring_node(upstream) else list(upstream.body)
    up_pos, up_kw, up_defaults, up_star, up_double = _signature_params(upstream)
    our_pos, our_kw, our_defaults, our_star, our_double = _signature_params(ours)
    for name in our_pos + our_kw:
        if name not in up_pos + up_kw or (name in our_kw) != (name in up_kw):
            return None, f"its parameter {name} differs from the base signature"
        if name in our_pos and our_pos.index(name) != up_pos.index(name):
            return None, f"its parameter {name} is at another position"
        if name in our_defaults and ast.dump(our_defaults[name]) != ast.dump(up_defaults.get(name, ast.Pass())):
            return None, f"its parameter {name} has another default"
    passed, none_params = set(), []
    for j, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name) and arg.value.id == our_star:
            passed |= set(up_pos[j:]) | {up_star}
        elif j >= len(up_pos):
            return None, "it passes more positional arguments than the base takes"
        elif isinstance(arg, ast.Name) and arg.id == up_pos[j] and arg.id in our_pos + our_kw:
            passed.add(arg.id)
        elif _is_none(arg):
            none_params.append(up_pos[j])
            passed.add(up_pos[j])
        elif _rebinds(up_body, up_pos[j], arg):
            passed.add(up_pos[j])
        else:
            return None, f"it passes a changed {up_pos[j]}"
    for keyword in call.keywords:
        if keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id == our_double:
            passed |= (set(up_pos) | set(up_kw) | {up_double}) - passed
        elif keyword.arg is None or keyword.arg not in up_pos + up_kw:
            return None, "it passes keyword arguments the base does not take"
        elif isinstance(keyword.value, ast.Name) and keyword.value.id == keyword.arg in our_pos + our_kw:
            passed.add(keyword.arg)
        elif _is_none(keyword.value):
            none_params.append(keyword.arg)
            passed.add(keyword.arg)
        elif _rebinds(up_body, keyword.arg, keyword.value):
            passed.add(keyword.arg)
        else:
            return None, f"it passes a changed {keyword.arg}"
    missing = (set(up_pos) | set(up_kw) | {up_star, up_double}) - {None} - passed
    if missing or set(our_pos + our_kw) - passed:
        return None, "it does not pass every argument through"
    used = {n.id for stmt in before + after for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    if {our_star, our_double} & used - {None}:
        return None, "its statements read *args or **kwargs"
    if any(_super_call_name(n) == target for stmt in before + after for n in ast.walk(stmt)):
        return None, "it calls it again"
    own = list(_own_nodes(upstream))
    if any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)) for n in own):
        return None, "the base is a generator or awaits"
    returns = [n for n in own if isinstance(n, ast.Return)]
    replaced = []
    for name in none_params:
        leading = []
        for stmt in up_body:
            if not _is_not_none_test(stmt, name):
                break
            leading.append(stmt)
        rest = [stmt for stmt in up_body if stmt not in leading]
        uses = [n for stmt in rest for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == name]
        if not leading or uses:
            return None, f"it passes {name}=None to a base that uses {name} beyond a leading `if {name} is not None:`"
        replaced += leading
    if wrapper is not None and replaced:
        return None, "it both wraps the base in a with-block and replaces its first statements"
    plan = _Inline(target, before, after, wrapper, replaced)
    if isinstance(call_stmt, ast.Assign):  # result = super().x(...); checks; return result
        targets = call_stmt.targets[0] if len(call_stmt.targets) == 1 else None
        names = [t.id for t in getattr(targets, "elts", [targets]) if isinstance(t, ast.Name)]
        final = after[-1] if after else None
        up_final = up_body[-1] if up_body else None
        if (
            not names or final is None or not isinstance(final, ast.Return) or final.value is None
            or ast.unparse(final.value) != ast.unparse(targets) or len(returns) != 1 or returns[0] is not up_final
            or up_final.value is None
        ):
            return None, "it uses the base's result other than by checking it before returning it"
        returned = [t.id for t in getattr(up_final.value, "elts", [up_final.value]) if isinstance(t, ast.Name)]
        if len(returned) != len(names) or len(getattr(up_final.value, "elts", [up_final.value])) != len(names):
            return None, "the base's final return is not a tuple of names like ours"
        plan.after, plan.renames, plan.final_return = after[:-1], dict(zip(names, returned)), up_final
        return plan, None
    if after and returns:
        return None, "it runs statements after the base, which returns early"
    if isinstance(call_stmt, ast.Expr) and any(r.value is not None and not _is_none(r.value) for r in returns):
        return None, "it drops the base's return value"
    return plan, None


class _ClassMerger:
    def __init__(self, merger: _ModuleMerger, up_class: ast.ClassDef, bases: Optional[List[str]], our_class: ast.ClassDef):
        self.m, self.up_class, self.our_class, self.bases = merger, up_class, our_class, bases
        for cls in up_class, our_class:
            if cls.col_offset != 0:
                raise MergeError(f"class {cls.name}: only module-level classes can be merged")
        self.up_methods = {n.name: n for n in up_class.body if isinstance(n, _FUNCTIONS)}
        self.our_methods = {n.name: n for n in our_class.body if isinstance(n, _FUNCTIONS)}
        callers: Dict[str, List[str]] = {}
        for method in self.our_methods.values():
            for sub in _own_nodes(method):
                name = _super_call_name(sub)
                if name is not None:
                    callers.setdefault(name, []).append(method.name)
        self.plans: Dict[str, _Inline] = {}  # our method -> how it goes into upstream's method
        self.renamed: Dict[str, str] = {}  # upstream's method -> its new name
        self.reasons: Dict[str, str] = {}  # upstream's method kept as _base_<name> -> why
        for name in sorted(set(callers) & set(self.up_methods) & set(self.our_methods)):
            caller = callers[name][0] if len(set(callers[name])) == 1 else None
            if caller is None or (caller != name and caller in self.up_methods):
                plan, why = None, "several methods call it"
            else:
                plan, why = _plan_inline(self.our_methods[caller], self.up_methods[name], name)
            if plan is not None:
                self.plans[caller] = plan
                if caller != name:  # upstream's body goes on under our new method's name
                    self.renamed[name] = caller
            else:
                self.renamed[name] = _private_name(name)
                self.reasons[name] = why
                merger.notes.append(
                    f"{up_class.name}.{_private_name(name)}: the previous {up_class.name}.{name}, which the new "
                    f"{name} calls: {why}"
                )
        self.inlined = {plan.target for plan in self.plans.values()}
        self.dropped = set()  # our methods left out: upstream's code does what they do
        if "__new__" in self.our_methods and _refuses_positional_arguments(self.our_methods["__new__"]):
            init = self.up_methods.get("__init__")
            if init is None or init.args.posonlyargs or len(init.args.args) != 1 or init.args.vararg is not None:
                raise MergeError(
                    f"class {up_class.name}: our __new__ refuses positional arguments, but upstream's __init__ is not "
                    f"keyword-only"
                )
            self.dropped.add("__new__")  # Python itself refuses them for upstream's keyword-only __init__
        for name, private in self.renamed.items():
            if name in self.reasons and (private in self.up_methods or private in self.our_methods):
                raise MergeError(f"class {up_class.name}: {private} (upstream's implementation) is already a method")

    def merge(self) -> None:
        if self.bases is not None:  # class Name(<bases>): on one line, as black writes a short header
            if not self.up_class.bases or self.up_class.bases[-1].end_lineno != self.up_class.lineno:
                raise MergeError(f"class {self.up_class.name}: upstream's class header must fit on one line")
            line = self.m.up.lines[self.up_class.lineno - 1].encode()
            first, last = self.up_class.bases[0], self.up_class.bases[-1]
            header = line[: first.col_offset] + ", ".join(self.bases).encode() + line[last.end_col_offset :]
            self.m.add(self.up_class.lineno - 1, self.up_class.lineno, header.decode())
        up_docstring = _docstring_node(self.up_class)
        anchor = up_docstring.end_lineno if up_docstring else self.m.up.span(self.up_class.body[0])[0]
        previous_was_attribute = False
        for node in self.our_class.body:
            if node is _docstring_node(self.our_class):
                self._merge_docstring(up_docstring, node)
            elif isinstance(node, _FUNCTIONS) and node.name in self.dropped:
                continue
            elif isinstance(node, _FUNCTIONS):
                anchor = self._merge_method(node, anchor)
                previous_was_attribute = False
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and all(isinstance(t, ast.Name) for t in _targets(node)):
                anchor = self._merge_attribute(node, anchor, blank_line=not previous_was_attribute)
                previous_was_attribute = True
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # e.g. __init__.__signature__ = ...
                if self._signature_of_inlined(node):
                    continue  # the inlined method has upstream's signature itself; a dropped one is gone
                self.m.add(anchor, anchor, self.m.code(node, self._class_references(node, in_body=True)))
                previous_was_attribute = True
            elif not isinstance(node, ast.Pass):
                raise MergeError(f"{self.m.ours.name}:{node.lineno}: a {type(node).__name__} in class {self.our_class.name}")

    def _signature_of_inlined(self, node: ast.stmt) -> bool:
        """``method.__signature__ = ...`` for methods of ours that went into upstream's method of the same name or
        were left out"""
        return all(
            isinstance(t, ast.Attribute) and t.attr == "__signature__" and isinstance(t.value, ast.Name)
            and (t.value.id in self.dropped or t.value.id in self.plans and self.plans[t.value.id].target == t.value.id)
            for t in _targets(node)
        )

    def _class_references(self, node: ast.AST, in_body: bool) -> List[Tuple[ast.AST, str]]:
        """``upstream.Class.method`` of the merged class: the method as now named (``_base_x`` where ours wraps it),
        a bare name in the class body, ``Class.name`` in a method"""
        references = []
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
                and isinstance(sub.value.value, ast.Name) and sub.value.value.id in self.m.self_aliases
                and sub.value.attr == self.up_class.name
            ):
                name = self.renamed.get(sub.attr, sub.attr)
                references.append((sub, name if in_body else f"{self.up_class.name}.{name}"))
        return references

    def _method_code(self, node: ast.AST, span=None, renames: Optional[Dict[str, str]] = None) -> str:
        extra = self._class_references(node, in_body=False)
        for sub in _own_nodes(node):
            name = _super_call_name(sub)
            if name in self.inlined:
                continue  # the call that an inlined method's statements surround (not rendered)
            if name in self.renamed:
                extra.append((sub.func, f"self.{self.renamed[name]}"))
            elif name in self.up_methods:  # upstream's method that ours keeps
                raise MergeError(
                    f"{self.m.ours.name}:{sub.lineno}: super().{name}() calls upstream's method that this class does "
                    f"not override; call self.{name}() instead"
                )
        if renames:
            extra += [(n, renames[n.id]) for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in renames]
        return self.m.code(node, extra, span)

    def _merge_method(self, node: ast.FunctionDef, anchor: int) -> int:
        plan = self.plans.get(node.name)
        if plan is not None:
            return self._merge_inlined(node, plan)
        existing = self.up_methods.get(node.name)
        if existing is None:
            self.m.add(anchor, anchor, "\n" + self._method_code(node))
            return anchor
        start, end = self.m.up.span(existing)
        if node.name in self.renamed:  # upstream's method goes on under another name, ours takes its place
            self.m.add(start, start, self._method_code(node) + "\n")
            def_line = self.m.up.lines[existing.lineno - 1]
            renamed_line = re.sub(rf"\bdef {re.escape(node.name)}\(", f"def {self.renamed[node.name]}(", def_line, count=1)
            self.m.add(existing.lineno - 1, existing.lineno, _fit_def_line(renamed_line))
        elif not _same_code(self._method_code(node), "".join(self.m.up.lines[start:end])):
            self.m.add(start, end, self._method_code(node))
        return end

    def _merge_inlined(self, node: ast.FunctionDef, plan: _Inline) -> int:
        """upstream's method ``plan.target`` with our statements around its body (and our docstring's fields)"""
        up = self.up_methods[plan.target]
        _, end = self.m.up.span(up)
        up_doc, our_doc = _docstring_node(up), _docstring_node(node)
        body_start = up_doc.end_lineno if up_doc else self.m.up.span(up.body[0])[0]
        if our_doc is not None and up_doc is not None:
            self._merge_docstring(up_doc, our_doc)
        elif our_doc is not None:
            self.m.add(body_start, body_start, self._method_code(node, self.m.ours.span(our_doc)))
        if plan.before:
            text = self._method_code(node, (self.m.ours.span(plan.before[0])[0], self.m.ours.end(plan.before[-1])))
            if plan.replaced:
                self.m.add(self.m.up.span(plan.replaced[0])[0], self.m.up.end(plan.replaced[-1]), text)
            else:
                self.m.add(body_start, body_start, text)
        if plan.wrapper is not None:
            source = self.m.ours.text
            items = [
                ast.get_source_segment(source, item.context_expr)
                + (f" as {ast.get_source_segment(source, item.optional_vars)}" if item.optional_vars else "")
                for item in plan.wrapper.items
            ]
            indent = " " * up.body[-1].col_offset
            lines = ["    " + line if line.strip() else line for line in self.m.up.lines[body_start:end]]
            if any(len(line.rstrip("\n")) > LINE_LENGTH for line in lines):
                raise MergeError(f"{self.up_class.name}.{plan.target}: its body no longer fits in a with-block")
            self.m.add(body_start, end, f"{indent}with {', '.join(items)}:\n" + "".join(lines))
        if plan.after:
            last = self.m.ours.end(node) if plan.final_return is None else self.m.ours.end(plan.after[-1])
            text = self._method_code(node, (self.m.ours.span(plan.after[0])[0], last), plan.renames)
            at = self.m.up.span(plan.final_return)[0] if plan.final_return is not None else end
            self.m.add(at, at, text)
        return end

    def _merge_attribute(self, node: ast.stmt, anchor: int, blank_line: bool) -> int:
        names = set(_assigned_names(node))
        for existing in self.up_class.body:
            if isinstance(existing, (ast.Assign, ast.AnnAssign)) and names & set(_assigned_names(existing)):
                self.m.add(*self.m.up.span(existing), self.m.code(node))
                return existing.end_lineno
        self.m.add(anchor, anchor, ("\n" if blank_line else "") + self.m.code(node))
        return anchor

    def _merge_docstring(self, up_docstring: Optional[ast.Expr], our_docstring: ast.Expr) -> None:
        """upstream's docstring (of the class, or of an inlined method) with the ``:param``/``:raises`` entries ours
        documents replaced or added"""
        ours = _field_chunks(self.m.code(our_docstring).splitlines(keepends=True))
        our_fields = [(chunk[0], chunk[1]) for chunk in ours if chunk[0] is not None]
        if not our_fields:
            return
        if up_docstring is None:
            raise MergeError(f"class {self.up_class.name}: upstream has no docstring to add parameters to")
        start, end = up_docstring.lineno - 1, up_docstring.end_lineno
        chunks = _field_chunks(self.m.up.lines[start:end])
        ours_by_key = dict(our_fields)
        merged = [(key, ours_by_key.get(key, lines)) for key, lines in chunks]
        present = {key for key, _ in merged if key is not None}
        for i, (key, lines) in enumerate(our_fields):
            if key in present:
                continue
            # after its predecessor of the same kind in our docstring; else first (a parameter) or last (a :raises)
            kind = key.split()[0]
            predecessors = [k for k, _ in our_fields[:i] if k in present and k.split()[0] == kind]
            fields = [j for j, (k, _) in enumerate(merged) if k is not None]
            if predecessors:
                position = 1 + max(j for j, (k, _) in enumerate(merged) if k == predecessors[-1])
            elif fields:
                position = fields[0] if kind == "param" else fields[-1] + 1
            else:
                position = len(merged) - 1  # before the closing quotes
            merged.insert(position, (key, lines))
            present.add(key)
        self.m.add(start, end, "".join(line for _, lines in merged for line in lines))


def _same_code(ours: str, upstream: str) -> bool:
    """whether two method sources are the same code, docstrings aside (ours then changes nothing upstream)"""
    trees = []
    for text in ours, upstream:
        function = ast.parse(textwrap.dedent(text)).body[-1]
        if _docstring_node(function) is not None:
            function.body = function.body[1:]
        trees.append(ast.dump(function))
    return trees[0] == trees[1]


def _field_chunks(lines: Sequence[str]) -> List[Tuple[Optional[str], List[str]]]:
    """a docstring's lines cut into ``(key, lines)`` chunks: a field (``:param name:``, key ``"param name"``) with
    its more-indented continuation lines, or ``(None, [line])`` for any other line"""
    chunks: List[Tuple[Optional[str], List[str]]] = []
    indent = None
    for line in lines:
        match = _FIELD.match(line)
        if match:
            kind, arg = match.group(2), match.group(3)
            chunks.append((f"{kind} {arg}" if arg else kind, [line]))
            indent = len(match.group(1))
        elif indent is not None and line.strip() and len(line) - len(line.lstrip()) > indent:
            chunks[-1][1].append(line)
        else:
            chunks.append((None, [line]))
            indent = None
    return chunks
