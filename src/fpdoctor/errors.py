"""The errors fpdoctor raises for input it cannot use, under one base a caller can catch.

A `--from` file that is empty or cut off, a compare record that was edited, a report path that is
a directory: each is the user's input, not a fault of fpdoctor, so each says in one line what is
wrong and what to give instead, and the CLI prints that line and exits 2. The base is a
`ValueError` because that is what bad input is in Python; `except ValueError` keeps working.
"""

from __future__ import annotations


class InputError(ValueError):
    """Input fpdoctor cannot use; the message is the one line the user sees, with the fix."""
