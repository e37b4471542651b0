"""Every catalogue name or code the code hands to the catalogue is in it (read from the source,
so a path no behaviour test takes is checked too); see tests/catalog/rule_names.py for the walk."""

from __future__ import annotations

import textwrap

from fpdoctor import catalog
from tests.catalog.rule_names import Walk, package_sources, walk_sources
from tests.conftest import ROOT

SRC = ROOT / "src"

# Names that come from outside the code, as (path, expression): `fpdoctor explain CODE|NAME`.
FROM_OUTSIDE = {("fpdoctor/cli/explain.py", "args.code")}


def _unknown(walk: Walk) -> list[str]:
    out = []
    for use in walk.uses:
        try:
            catalog.get(use.value)
        except catalog.UnknownRuleError:
            out.append(f"{use.path}:{use.line}: {use.value!r}")
    return out


def test_every_name_handed_to_the_catalogue_is_in_it():
    walk = walk_sources(package_sources(SRC))
    assert _unknown(walk) == []
    unresolved = {(u.path, u.source) for u in walk.unresolved}
    assert unresolved == FROM_OUTSIDE, "pass catalogue names as literals (or name the source here)"
    # the walk finds the lookups it follows: get, make (it calls get) and the crash texts' field
    assert {h.function for h in walk.helpers.values()} >= {"get", "make", "ErrorText", "_e"}
    assert len({(u.path, u.line) for u in walk.uses}) > 100


def test_a_misspelt_name_fails_the_walk_whichever_way_it_is_passed():
    planted = textwrap.dedent(
        """
        from fpdoctor import catalog
        from fpdoctor.catalog import make as build
        from fpdoctor.meanings import ErrorText

        THROTTLED = "gpu-throttle"

        def _named(name, message):
            return catalog.make(name, message=message)

        def _which(hot):
            return "gpu-throttled" if hot else "gpu-los"

        def checks(f, hot):
            yield catalog.make("ecc-uncorectable", message="")
            yield build("xid-eror", message="")
            yield catalog.make(THROTTLED, message="")
            yield _named("row-remap-pendng", "")
            yield catalog.make(_which(hot), message="")
            yield catalog.get("HWR999")
            for name in ("gpu-lost", "rank-outlyer"):
                yield catalog.make(name, message="")
            if f.name == "loss-spik":
                yield ErrorText("k", None, "cuda-eror", None)
        """
    )
    sources = package_sources(SRC)
    sources["fpdoctor.planted"] = ("fpdoctor/planted.py", planted)
    found = sorted(line.split(": ", 1)[1] for line in _unknown(walk_sources(sources)) if "planted" in line)
    assert found == sorted(
        repr(n)
        for n in (
            "gpu-throttle",
            "gpu-los",
            "ecc-uncorectable",
            "xid-eror",
            "row-remap-pendng",
            "HWR999",
            "rank-outlyer",
            "loss-spik",
            "cuda-eror",
        )
    )


def test_a_name_the_walk_cannot_follow_is_reported():
    sources = package_sources(SRC)
    sources["fpdoctor.planted"] = (
        "fpdoctor/planted.py",
        "from fpdoctor import catalog\n\ndef f(names):\n    return catalog.make(names[0], message='')\n",
    )
    unresolved = {(u.path, u.source) for u in walk_sources(sources).unresolved}
    assert ("fpdoctor/planted.py", "names[0]") in unresolved
