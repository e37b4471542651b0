"""No package reaches into another's private names.

A leading underscore says "this module's own, free to change": `from fpdoctor.numerics.trace.tracer import
_is_user_file` in precision, or `fingerprint._child_command = ...` in the casebook, ties one package
to another's insides where no reader of the owner looks. Within a package that is the package's
business; across packages it must go through a public name. The layers themselves (who may import
whom, no cycles between packages) are import-linter's contracts in pyproject.toml (`lint-imports`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "fpdoctor"

# Private names still taken across packages, each to be replaced by a public seam: none left.
ALLOWED: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Packages split into capability packages: each of those is a package of its own here.
SPLIT = {"numerics", "precision"}


def _package(module: str) -> str:
    """fpdoctor.numerics.trace.tracer -> numerics.trace; fpdoctor.files -> files; fpdoctor -> ''."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trespasses(full: str, own: str) -> bool:
    """Whether `full` (fpdoctor.numerics.trace._OWN_DIR) holds a private part owned by a package
    other than `own`. A private part belongs to what contains it: `fpdoctor._version` to all of
    fpdoctor, `fpdoctor.integrations._watch` to integrations."""
    parts = full.split(".")
    return any(_private(part) and i > 1 and _package(".".join(parts[:i])) != own for i, part in enumerate(parts))


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _foreign_private_names(path: Path) -> Iterator[tuple[str, str, int]]:
    """(importer, the private name in full, line) for each private name `path` takes from another package."""
    importer = _module(path)
    own = _package(importer)
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, str] = {}  # local name -> the fpdoctor module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, importer, path.name == "__init__.py")
            if source.split(".")[0] != "fpdoctor":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if (ROOT / Path(*full.split(".")[1:])).with_suffix(".py").exists() or (
                    ROOT / Path(*full.split(".")[1:]) / "__init__.py"
                ).exists():
                    modules[alias.asname or alias.name] = full
                if _trespasses(full, own):
                    yield importer, full, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "fpdoctor":
                    continue
                if alias.asname:
                    modules[alias.asname] = alias.name
                if _trespasses(alias.name, own):
                    yield importer, alias.name, node.lineno
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _trespasses(f"{modules[node.value.id]}.{node.attr}", own)
        ):
            yield importer, f"{modules[node.value.id]}.{node.attr}", node.lineno


def _taken() -> list[tuple[str, str, int]]:
    return [hit for path in sorted(ROOT.rglob("*.py")) for hit in _foreign_private_names(path)]


def test_no_private_name_is_taken_from_another_package():
    taken = [f"{importer}:{line} takes {name}" for importer, name, line in _taken() if (importer, name) not in ALLOWED]
    assert taken == [], "use (or add) a public name instead:\n" + "\n".join(taken)


def test_every_allowed_exception_is_still_taken():
    """An entry whose use is gone is removed, so the list only ever shrinks."""
    still = {(importer, name) for importer, name, _ in _taken()}
    assert ALLOWED - still == set()


def test_no_command_takes_another_commands_private_names():
    """A command's module (cli/<command>.py) is its own: what two commands share lives in a module
    of its own (cli/output.py, cli/ranks.py, cli/trace_outcome.py), never in one of them."""
    taken = []
    for path in sorted((ROOT / "cli").glob("*.py")):
        importer = _module(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("fpdoctor.cli.") and module != importer:
                taken += [f"{importer}:{node.lineno} takes {module}.{a.name}" for a in node.names if _private(a.name)]
    assert taken == [], "move what two commands share into a module of its own:\n" + "\n".join(taken)
