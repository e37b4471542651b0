"""`make test`'s second pass collects only the files that `grep -l 'mark\\.serial'` finds (Makefile):
a test marked serial some other way would run in neither pass."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_serial_test_is_in_a_file_the_serial_pass_collects():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "grep -rlE 'mark\\.serial' tests --include='test_*.py'" in makefile
    hidden = []
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text()
        # the marker given by name, or imported as an alias, in a file the grep does not list
        other = re.search(r"(add_marker|applymarker|getattr)\(.*[\"']serial[\"']|import .*\bserial\b", text)
        if other and "mark.serial" not in text:
            hidden.append(str(path.relative_to(TESTS)))
        if "mark.serial" in text and not path.name.startswith("test_"):
            hidden.append(f"{path.relative_to(TESTS)} (not a test_*.py file)")
    assert not hidden, f"serial marks the Makefile's grep does not see: {hidden}"
