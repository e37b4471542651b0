"""One report writer for the CLI's -o and the framework callbacks' report_path."""

from __future__ import annotations

import argparse
import json

import pytest

from fpdoctor.errors import InputError
from fpdoctor.report.model import Report
from fpdoctor.report.write import format_for, rank_path, write, write_text


@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("r.json", "json"),
        ("out/R.HTML", "html"),
        ("r.htm", "html"),
        ("r.md", "markdown"),
        ("r.markdown", "markdown"),
        ("r.txt", "text"),
        ("report", "text"),
    ],
)
def test_the_extension_names_the_format(path, fmt):
    assert format_for(path) == fmt


def test_each_rank_writes_beside_the_others():
    assert rank_path("out/report.json", 1) == "out/report.rank1.json"
    assert rank_path("report", 3) == "report.rank3"


def test_a_report_is_written_in_the_format_its_name_asks_for(tmp_path):
    report = Report(command="env", data={"summary": [("driver", "550.54")]})
    write(report.to_dict(), str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["command"] == "env"
    write(report.to_dict(), str(tmp_path / "r.md"))
    assert (tmp_path / "r.md").read_text().startswith("#")


def test_a_path_that_cannot_hold_the_report_is_refused_in_one_line(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        write_text(str(tmp_path), "x")
    with pytest.raises(InputError, match="does not exist"):
        write_text(str(tmp_path / "no" / "r.txt"), "x")


@pytest.mark.parametrize("name", ["r.txt", "r.md", "r.json", "r.html"])
def test_the_cli_and_a_callback_write_the_same_file(tmp_path, name):
    pytest.importorskip("torch")
    from fpdoctor.cli.output import emit, resolve_output
    from fpdoctor.integrations import _report

    # a clean report with more facts than a terminal's summary shows: a file holds them all
    rows = [(f"fact {i}", str(i)) for i in range(12)]
    report = Report(command="sentinel", data={"summary": rows})
    args = argparse.Namespace(format=None, output=str(tmp_path / "cli" / name))
    (tmp_path / "cli").mkdir()
    resolve_output(args)
    emit(report.to_dict(), args)
    (tmp_path / "callback").mkdir()
    _report.write(report, str(tmp_path / "callback" / name))
    assert (tmp_path / "callback" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()
    assert "fact 11" in (tmp_path / "callback" / name).read_text()
