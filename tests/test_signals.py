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


def _die_in_child(code: str) -> int:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=False).returncode


def test_die_of_ends_the_process_by_the_signal_whatever_handler_or_mask_it_had():
    handled = (
        "import signal; from fpdoctor.signals import die_of\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "die_of(signal.SIGTERM)\n"
        "raise SystemExit(3)\n"
    )
    assert _die_in_child(handled) == -signal.SIGTERM
    segv = "import signal; from fpdoctor.signals import die_of; die_of(signal.SIGSEGV)"
    assert _die_in_child(segv) == -signal.SIGSEGV


def test_die_of_a_signal_that_ends_no_process_is_the_shells_number():
    code = "import signal, sys; from fpdoctor.signals import die_of; sys.exit(die_of(signal.SIGCHLD))"
    assert _die_in_child(code) == 128 + signal.SIGCHLD
