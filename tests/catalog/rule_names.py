"""Find, by reading the source, every catalogue name or code the code passes to the catalogue.

A finding refers to its catalogue entry by a string (`catalog.make("ecc-uncorrectable", ...)`), so
a misspelt name is a runtime `UnknownRuleError` on a path that may have no test. This walker starts
from `catalog.get`, the one lookup every name goes through, and follows each argument back to its
literals:

- a literal is a use (`"gpu-lost"`), and so are both arms of `a if c else b` and of `a or b`;
- a local variable, a module constant or a closure's variable is followed to its assignments;
- a call of a function of the project is followed to that function's `return`s;
- a parameter makes its function a lookup helper in turn (`make(name, ...)` calls `get(name)`),
  and the walk goes on at every call of that helper, with the parameter's default when a call
  leaves it out.

Whatever cannot be followed (an attribute, a subscript, an f-string) is reported as unresolved, so
a new way of naming a rule is either followed here or named in the test as coming from outside.
Names compared with a finding's name (`f.name == "loss-spike"`, `error.finding != "cuda-error"`)
are uses too: a misspelt comparison never matches and silently changes a verdict.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT_MODULE = "fpdoctor.catalog"
ROOT_FUNCTION = "get"

# Attributes and variables that hold a finding's name, compared with literals in the code.
NAME_HOLDERS = {"name", "finding"}

# Dataclass fields that hold a catalogue name for later: their values are uses too (module, class, field).
NAME_FIELDS = {("fpdoctor.meanings", "ErrorText", "finding")}

_Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Use:
    """One literal name or code the code hands to the catalogue, and where."""

    path: str
    line: int
    value: str


@dataclass(frozen=True)
class Unresolved:
    """A name argument the walk could not follow back to literals."""

    path: str
    line: int
    source: str  # the expression, as written


@dataclass(frozen=True)
class Helper:
    """A function whose parameter `param` (at `index` among the call's positional arguments) is a
    catalogue name: `get` itself, and every function that passes its parameter on to one."""

    module: str
    function: str
    param: str
    index: int
    default: ast.expr | None
    is_method: bool


@dataclass
class _Module:
    name: str
    path: str
    tree: ast.Module
    functions: dict[str, list[_Function]] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    methods: set[str] = field(default_factory=set)  # names of functions defined in a class
    module_aliases: dict[str, str] = field(default_factory=dict)  # local name -> module
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    calls: list[ast.Call] = field(default_factory=list)
    compares: list[ast.Compare] = field(default_factory=list)


@dataclass
class Walk:
    uses: list[Use] = field(default_factory=list)
    unresolved: list[Unresolved] = field(default_factory=list)
    helpers: dict[tuple[str, str], Helper] = field(default_factory=dict)


@cache  # the walk reads nothing but the parsed module: one parse serves every test
def _index(name: str, path: str, source: str, packages: frozenset[str]) -> _Module:
    tree = ast.parse(source, filename=path)
    mod = _Module(name=name, path=path, tree=tree)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            mod.parents[child] = node
        if isinstance(node, ast.Call):
            mod.calls.append(node)
        elif isinstance(node, ast.Compare):
            mod.compares.append(node)
        if isinstance(node, _Function):
            mod.functions.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.ClassDef):
            mod.classes[node.name] = node
            mod.methods.update(n.name for n in node.body if isinstance(n, _Function))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    mod.module_aliases[a.asname] = a.name
                else:
                    mod.module_aliases[a.name] = a.name  # `import fpdoctor.catalog` binds the dotted path
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                local = a.asname or a.name
                full = f"{node.module}.{a.name}"
                if full in packages:
                    mod.module_aliases[local] = full
                else:
                    mod.imported[local] = (node.module, a.name)
    return mod


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


class _Walker:
    def __init__(self, modules: dict[str, _Module]) -> None:
        self.modules = modules
        self.walk = Walk()
        self._seen_returns: set[tuple[str, int]] = set()
        self._following: set[tuple[str, int, str]] = set()

    # -- what a call calls

    def callee(self, mod: _Module, call: ast.Call) -> tuple[str, str] | None:
        """(module, function) of a call of a project function, as far as names tell."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in mod.imported:
                return mod.imported[func.id]
            if func.id in mod.functions or func.id in mod.classes:
                return mod.name, func.id
            return None
        if isinstance(func, ast.Attribute):
            owner = _dotted(func.value)
            if owner is not None:
                module = mod.module_aliases.get(owner) or (owner if owner in self.modules else None)
                if module is not None:
                    return module, func.attr
            return "", func.attr  # a method call: matched by the method's name
        return None

    def _is_call_of(self, mod: _Module, call: ast.Call, helper: Helper) -> bool:
        target = self.callee(mod, call)
        if target is None:
            return False
        module, name = target
        if name != helper.function:
            return False
        return module == helper.module or (module == "" and helper.is_method)

    # -- the walk

    def run(self) -> Walk:
        root = self._helper(ROOT_MODULE, ROOT_FUNCTION)
        assert root is not None, f"{ROOT_MODULE}.{ROOT_FUNCTION} not found"
        todo = [root, *(self._field(*declared) for declared in sorted(NAME_FIELDS))]
        for helper in todo:
            self.walk.helpers[(helper.module, helper.function)] = helper
        while todo:
            helper = todo.pop()
            for mod in self.modules.values():
                for node in mod.calls:
                    if self._is_call_of(mod, node, helper):
                        arg = self._argument(node, helper)
                        if arg is None:
                            continue
                        for new in self.resolve(mod, arg, self._scope(mod, node)):
                            if (new.module, new.function) not in self.walk.helpers:
                                self.walk.helpers[(new.module, new.function)] = new
                                todo.append(new)
        for mod in self.modules.values():
            self._comparisons(mod)
        return self.walk

    def _helper(self, module: str, function: str, param_name: str | None = None) -> Helper | None:
        mod = self.modules.get(module)
        if mod is None or function not in mod.functions:
            return None
        fn = mod.functions[function][0]
        params = [*fn.args.posonlyargs, *fn.args.args]
        is_method = function in mod.methods
        defaults = [None] * (len(params) - len(fn.args.defaults)) + list(fn.args.defaults)
        for i, p in enumerate(params):
            if param_name is None or p.arg == param_name:
                index = i - 1 if is_method and params[0].arg in ("self", "cls") else i
                return Helper(module, function, p.arg, index, defaults[i], is_method)
        for p, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
            if p.arg == param_name:
                return Helper(module, function, p.arg, -1, d, is_method)
        return None

    def _field(self, module: str, cls: str, name: str) -> Helper:
        """A dataclass field as a helper's parameter: its constructor's argument is the name."""
        node = self.modules[module].classes[cls]
        fields = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        for i, f in enumerate(fields):
            if isinstance(f.target, ast.Name) and f.target.id == name:
                return Helper(module, cls, name, i, f.value, is_method=False)
        raise LookupError(f"{module}.{cls} has no field {name}")

    @staticmethod
    def _argument(call: ast.Call, helper: Helper) -> ast.expr | None:
        for kw in call.keywords:
            if kw.arg == helper.param:
                return kw.value
        if 0 <= helper.index < len(call.args):
            return call.args[helper.index]
        if any(isinstance(a, ast.Starred) for a in call.args) or any(kw.arg is None for kw in call.keywords):
            return call  # *args or **kwargs: unresolved, the caller's text is reported
        return helper.default  # left out: the default is the name

    def _scope(self, mod: _Module, node: ast.AST) -> list[_Function]:
        """The functions around `node`, innermost first."""
        out = []
        while node in mod.parents:
            node = mod.parents[node]
            if isinstance(node, _Function):
                out.append(node)
        return out

    def _unresolved(self, mod: _Module, node: ast.AST) -> None:
        at = node.iter if isinstance(node, ast.comprehension) else node
        self.walk.unresolved.append(Unresolved(mod.path, getattr(at, "lineno", 0), ast.unparse(node).strip()))

    def resolve(self, mod: _Module, node: ast.AST, scope: list[_Function]) -> Iterator[Helper]:
        """Record the literals `node` can be; yield the helpers its parameters make."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.walk.uses.append(Use(mod.path, node.lineno, node.value))
        elif isinstance(node, ast.IfExp):
            yield from self.resolve(mod, node.body, scope)
            yield from self.resolve(mod, node.orelse, scope)
        elif isinstance(node, ast.BoolOp | ast.Tuple | ast.List | ast.Set):
            for value in node.values if isinstance(node, ast.BoolOp) else node.elts:
                yield from self.resolve(mod, value, scope)
        elif isinstance(node, ast.Name):
            key = (mod.name, scope[0].lineno if scope else 0, node.id)
            if key not in self._following:  # `x = x or "a"` follows x once
                self._following.add(key)
                yield from self._name(mod, node, scope)
                self._following.discard(key)
        elif isinstance(node, ast.Call) and (target := self.callee(mod, node)) and target[0]:
            yield from self._returns(node, *target)
        else:
            self._unresolved(mod, node)

    def _name(self, mod: _Module, node: ast.Name, scope: list[_Function]) -> Iterator[Helper]:
        for i, fn in enumerate(scope):
            params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            if any(p.arg == node.id for p in params):
                helper = self._helper(mod.name, fn.name, node.id)
                if helper is None:
                    self._unresolved(mod, node)
                else:
                    yield helper
                return
            values = list(_assigned(fn.body, node.id))
            if values:
                for value in values:
                    yield from self.resolve(mod, value, scope[i:])
                return
        values = list(_assigned(mod.tree.body, node.id))
        if not values:
            self._unresolved(mod, node)
        for value in values:
            yield from self.resolve(mod, value, [])

    def _returns(self, call: ast.Call, module: str, function: str) -> Iterator[Helper]:
        mod = self.modules.get(module)
        if mod is None or function not in mod.functions:
            self.walk.unresolved.append(Unresolved(module, call.lineno, ast.unparse(call)))
            return
        for fn in mod.functions[function]:
            if (mod.path, fn.lineno) in self._seen_returns:
                continue
            self._seen_returns.add((mod.path, fn.lineno))
            for ret in _own(fn.body, ast.Return):
                if ret.value is None:
                    self._unresolved(mod, ret)
                else:
                    yield from self.resolve(mod, ret.value, [fn, *self._scope(mod, fn)])

    def _comparisons(self, mod: _Module) -> None:
        for node in mod.compares:
            sides = [node.left, *node.comparators]
            if not any(_holds_a_name(s) for s in sides):
                continue
            for side in sides:
                items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for item in items:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str) and "-" in item.value:
                        self.walk.uses.append(Use(mod.path, item.lineno, item.value))


def _holds_a_name(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in NAME_HOLDERS) or (
        isinstance(node, ast.Name) and node.id in NAME_HOLDERS
    )


def _own(body: list[ast.stmt], kind: type) -> Iterator[ast.AST]:
    """Nodes of `kind` in `body`, not inside a nested function or class."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, kind):
            yield node
        if not isinstance(node, _Function | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def _assigned(body: list[ast.stmt], name: str) -> Iterator[ast.AST]:
    """What `name` is set to in `body`: each value, or the statement itself where it cannot be
    followed (unpacking, a `with` target)."""
    for node in _own(body, ast.AST):
        if isinstance(node, ast.Assign) and any(name in _target_names(t) for t in node.targets):
            simple = any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            yield node.value if simple else node
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr | ast.AugAssign):
            if isinstance(node.target, ast.Name) and node.target.id == name and node.value is not None:
                yield node.value
        elif isinstance(node, ast.For | ast.comprehension) and name in _target_names(node.target):
            # a loop variable is each item of what it loops over
            yield node.iter if isinstance(node.target, ast.Name) else node
        elif isinstance(node, ast.With) and any(
            i.optional_vars is not None and name in _target_names(i.optional_vars) for i in node.items
        ):
            yield node


def _target_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def walk_sources(sources: dict[str, tuple[str, str]]) -> Walk:
    """Walk modules given as {module name: (path, source)}."""
    packages = frozenset(name for name, (path, _) in sources.items() if path.endswith("__init__.py"))
    modules = {name: _index(name, path, text, packages) for name, (path, text) in sources.items()}
    return _Walker(modules).run()


def package_sources(src: Path, package: str = "fpdoctor") -> dict[str, tuple[str, str]]:
    """{module name: (path under `src`, source)} for every module of `package`."""
    sources = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = (path.relative_to(src).as_posix(), path.read_text(encoding="utf-8"))
    return sources
