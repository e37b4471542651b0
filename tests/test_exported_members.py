"""`fpdoctor.__all__` is the public API: every name in it resolves, `dir()` shows exactly it, and
nothing the package imports for itself (typing helpers, importlib) or keeps private is in it."""

from __future__ import annotations

import types

import fpdoctor

# names whose leading underscore is the convention for a package's metadata
PUBLIC_DUNDERS = {"__version__"}


def test_every_exported_name_is_importable():
    for name in fpdoctor.__all__:
        namespace: dict[str, object] = {}
        exec(f"from fpdoctor import {name}", namespace)
        assert namespace[name] is getattr(fpdoctor, name), name


def test_dir_shows_the_exports_and_nothing_else():
    assert dir(fpdoctor) == sorted(fpdoctor.__all__)


def test_star_import_gives_the_exports():
    namespace: dict[str, object] = {}
    exec("from fpdoctor import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(fpdoctor.__all__)


def test_no_private_or_typing_names_are_exported():
    for name in fpdoctor.__all__:
        assert not name.startswith("_") or name in PUBLIC_DUNDERS, name
        value = getattr(fpdoctor, name)
        if isinstance(value, types.ModuleType):  # a subpackage the README names by attribute
            assert value.__name__ == f"fpdoctor.{name}", name
        elif name not in PUBLIC_DUNDERS:
            assert getattr(value, "__module__", "").startswith("fpdoctor."), (name, value)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & {*fpdoctor.__all__, *dir(fpdoctor)}
