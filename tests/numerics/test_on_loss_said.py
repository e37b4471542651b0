"""What a loss check changed, said once: the lines of one file raised to fp32 as one set (a SimCLR loss
by hand: "line 48 in fp32; lines 48 and 50 in fp32; line 51 in fp32" read as three changes)."""

from __future__ import annotations

from fpdoctor.numerics.engine.on_loss import said_once


def test_the_lines_of_one_file_raised_to_fp32_are_one_set_where_the_first_was_said() -> None:
    said = [
        "the constant 1e-12 at train.py:17 replaced by 6.1e-05",
        "line 48 of train.py in fp32",
        "lines 48 and 50 of train.py in fp32",
        "line 3 of loss.py in fp32",
        "line 51 of train.py in fp32",
        "line 48 of train.py in fp32",
    ]
    assert said_once(said) == (
        "the constant 1e-12 at train.py:17 replaced by 6.1e-05; lines 48, 50 and 51 of train.py in fp32; "
        "line 3 of loss.py in fp32"
    )
    assert said_once(["lines 3, 5 and 9 of a.py in fp32"]) == "lines 3, 5 and 9 of a.py in fp32"
