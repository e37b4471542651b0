"""Signal names: one function for a launcher log's signal number and a child's return code."""

from __future__ import annotations

import signal

from fpdoctor.signals import died_of, signal_name


def test_a_signal_number_is_named_as_the_platform_names_it():
    assert signal_name(int(signal.SIGSEGV)) == "SIGSEGV"
    assert signal_name(int(signal.SIGFPE)) == "SIGFPE"


def test_a_number_without_a_name_is_still_said():
    assert signal_name(200) == "signal 200"


def test_a_child_killed_by_a_signal_died_of_it_and_one_that_exited_did_not():
    assert died_of(-int(signal.SIGKILL)) == "SIGKILL"
    assert died_of(-200) == "signal 200"
    assert died_of(0) is None and died_of(1) is None
