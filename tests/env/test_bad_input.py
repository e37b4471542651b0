"""Malformed input gives exit 2 and one line on stderr, never a traceback (ARCHITECTURE.md, contract 1)."""

from __future__ import annotations

import pytest

from tests.conftest import run_fpdoctor


def _bad_inputs(tmp_path):
    binary = tmp_path / "core.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    truncated = tmp_path / "facts.json"
    truncated.write_text('{"schema": "fpdoctor.facts/1", "torch": {"version": "2.3')
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("lorem ipsum dolor\nsit amet 12345\n%%%%\n" * 20)
    not_facts = tmp_path / "other.json"
    not_facts.write_text('{"hello": "world"}')
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("é" * 500).encode("latin-1"))
    return {
        "binary": (binary, "binary file"),
        "empty": (empty, "is empty"),
        "truncated": (truncated, "truncated JSON"),
        "garbage": (garbage, "found neither collect_env fields"),
        "not-facts": (not_facts, "not fpdoctor facts"),
        "not-utf8": (latin1, "not UTF-8"),
        "directory": (tmp_path, "is a directory"),
        "missing": (tmp_path / "nope.txt", "no such file"),
    }


@pytest.mark.parametrize(
    "kind", ["binary", "empty", "truncated", "garbage", "not-facts", "not-utf8", "directory", "missing"]
)
def test_bad_input_in_process(kind, tmp_path, cli):
    path, words = _bad_inputs(tmp_path)[kind]
    result = cli("env", "--from", str(path))
    assert result.code == 2
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("fpdoctor: error: ")


def test_bad_input_end_to_end_has_no_traceback(tmp_path):
    path, _ = _bad_inputs(tmp_path)["truncated"]
    result = run_fpdoctor("env", "--from", str(path))
    assert result.code == 2 and "Traceback" not in result.err and len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["env", "--format", "yaml"],
        ["env", "--no-such-flag"],
        ["explain", "ENV999"],
        ["demo", "no-such-case"],
        ["frobnicate"],
        ["env", "--probe-timeout", "0"],
    ],
)
def test_bad_usage(args, cli):
    result = cli(*args)
    assert result.code == 2
    assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err


def test_output_into_a_missing_directory(tmp_path, cli):
    report = tmp_path / "r.txt"
    report.write_text("PyTorch version: 2.5.1+cu124\nCUDA used to build PyTorch: 12.4\n")
    result = cli("env", "--from", str(report), "-o", str(tmp_path / "no" / "dir" / "out.json"))
    assert result.code == 2 and "does not exist" in result.err
