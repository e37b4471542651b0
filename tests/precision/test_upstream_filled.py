"""A fix's lines take in the lines between them that ran ops in the same call (upstream._filled): a
variance by hand on line 21, between its mean on line 20 and their cast back on line 22, left out of
the check, read the mean cast back to fp16 and made NaN of a fix that works (trial 162's encoder)."""

from __future__ import annotations

from fpdoctor.precision.compare.upstream import GAP_LINES, _filled


def test_a_gap_of_lines_that_ran_is_filled_and_others_are_not() -> None:
    ran = {("m.py", n) for n in range(18, 30)}
    assert _filled([("m.py", 20), ("m.py", 22), ("m.py", 23)], ran) == [("m.py", n) for n in range(20, 24)]
    # a gap wider than GAP_LINES is two places in the code, not one block
    far = 20 + GAP_LINES + 2
    assert _filled([("m.py", 20), ("m.py", far)], ran) == [("m.py", 20), ("m.py", far)]
    # a line that ran nothing in the call (a comment, another function's body) is not added
    assert _filled([("m.py", 20), ("m.py", 22)], ran - {("m.py", 21)}) == [("m.py", 20), ("m.py", 22)]
    # lines of two files never fill each other
    assert _filled([("a.py", 20), ("b.py", 22)], ran) == [("a.py", 20), ("b.py", 22)]
