"""The fix contract, held like the import contracts (SPEC 3.2): a warning or an error that prints a fix
says whether that fix was tried (what was changed, on which input, the metric before -> after) or why it
could not be. Every `Report` a test makes in-process, and every JSON report a CLI run prints, is read
when the test ends; one finding without it fails the test, whichever front end made it.
`tests/conftest.py` imports the two fixtures below, so they hold on every test of the suite."""

from __future__ import annotations

import json

import pytest

# JSON reports printed by `run_fpdoctor` (tests/conftest.py) in the running test
PRINTED: list[str] = []


def unproven_fixes(findings: list[dict]) -> list[str]:
    """The findings (as JSON) that print a fix at warning or error level with neither its measured
    effect nor why it could not be tried (SPEC 3.2)."""
    return [
        f"{f['code']} {f['name']}: {f['title']}"
        for f in findings
        if f.get("fix") and f.get("severity") in ("warning", "error") and not f.get("fix_trial")
    ]


@pytest.fixture(autouse=True, scope="session")
def _reports_recorded():
    """Every `Report` made in this process from here on, until a test's end reads it (below)."""
    from fpdoctor.report.model import Report

    init = Report.__init__

    def recording(self: Report, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        _MADE.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Report, "__init__", recording)
        yield


_MADE: list = []  # Reports made since the last test ended (module fixtures' count for the first test after)


@pytest.fixture(autouse=True)
def _every_printed_fix_says_if_tried(request: pytest.FixtureRequest, _reports_recorded: None):
    """The fix contract, held like the import contracts: every `Report` made in this process during a
    test (and its module fixtures), and every JSON report `run_fpdoctor` printed, is read when the test
    ends; a warning or error whose fix carries neither its trial nor why it was not tried fails the
    test, whichever front end made it. A test about such findings themselves (rendering a report
    written before fixes said so) is marked `@pytest.mark.unproven_fixes`."""
    yield
    made, printed = list(_MADE), list(PRINTED)
    _MADE.clear()
    PRINTED.clear()
    if request.node.get_closest_marker("unproven_fixes") is not None:
        return
    found = unproven_fixes([f.to_dict() for r in made for f in r.findings])
    for text in printed:
        try:
            report = json.loads(text)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("findings"), list):
            found += unproven_fixes(report["findings"])
    if found:
        pytest.fail("a fix printed with neither its trial nor why it was not tried:\n  " + "\n  ".join(found))
