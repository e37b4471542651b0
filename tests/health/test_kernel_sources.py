"""Where the live kernel log comes from, and the reasons given when it cannot be read."""

from __future__ import annotations

import os
import stat

import pytest

from fpdoctor.health import kernel_sources as ks


def fake_tool(tmp_path, monkeypatch, name: str, script: str) -> None:
    """Put an executable `name` first on PATH that runs `script` (a shell body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.parametrize(
    ("value", "words"),
    [("1", "kernel.dmesg_restrict=1 and this process lacks CAP_SYSLOG"), ("0", "operation not permitted")],
)
def test_dmesg_denied_reason_reads_dmesg_restrict(tmp_path, value, words):
    path = tmp_path / "dmesg_restrict"
    path.write_text(value + "\n")
    assert words in ks.dmesg_denied_reason(str(path))


def test_dmesg_refused(tmp_path, monkeypatch):
    fake_tool(
        tmp_path, monkeypatch, "dmesg", 'echo "dmesg: read kernel buffer failed: Operation not permitted" >&2\nexit 1\n'
    )
    monkeypatch.setattr(ks, "dmesg_denied_reason", lambda: "not readable: kernel.dmesg_restrict=1 (test)")
    with pytest.raises(ks.NotReadable, match=r"dmesg_restrict=1 \(test\)"):
        ks.read_dmesg()


def test_busybox_dmesg_without_time_format_falls_back(tmp_path, monkeypatch):
    script = (
        'case "$1" in --time-format) echo "dmesg: unrecognized option: time-format" >&2; exit 1;; esac\n'
        'echo "[    1.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.104.05"\n'
    )
    fake_tool(tmp_path, monkeypatch, "dmesg", script)
    assert ks.read_dmesg() == ["[    1.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.104.05"]


def test_empty_journal_is_not_readable(tmp_path, monkeypatch):
    fake_tool(tmp_path, monkeypatch, "journalctl", 'echo "-- No entries --"\necho "No journal files were found." >&2\n')
    with pytest.raises(ks.NotReadable, match=r"no kernel messages for this boot \(No journal files were found.\)"):
        ks.read_journal()


def test_old_journalctl_without_short_iso_precise(tmp_path, monkeypatch):
    script = (
        'for a in "$@"; do [ "$a" = short-iso-precise ] && '
        "{ echo \"Unknown output 'short-iso-precise'\" >&2; exit 1; }; done\n"
        'echo "2025-01-21T04:41:44+0000 node kernel: NVRM: Xid (PCI:0000:3b:00): 13, pid=1, x"\n'
    )
    fake_tool(tmp_path, monkeypatch, "journalctl", script)
    assert ks.read_journal() == ["2025-01-21T04:41:44+0000 node kernel: NVRM: Xid (PCI:0000:3b:00): 13, pid=1, x"]


def test_syslog_file_from_the_last_boot_on(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(
        "Nov  1 10:00:00 node kernel: [    0.000000] Linux version 6.8.0-40-generic\n"
        "Nov  1 11:00:00 node kernel: [ 3600.0] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, old boot\n"
        "Nov  2 09:00:00 node kernel: [    0.000000] Linux version 6.8.0-45-generic\n"
        "Nov  2 09:30:00 node kernel: [ 1800.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=2, this boot\n"
    )
    lines, note = ks.read_syslog_file(str(log))
    assert note is None and len(lines) == 2 and "this boot" in lines[1]
    log.write_text("Nov  2 09:30:00 node kernel: [ 1800.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=2, x\n")
    lines, note = ks.read_syslog_file(str(log))
    assert len(lines) == 1 and "no boot marker" in note


def test_syslog_file_absent(tmp_path):
    with pytest.raises(ks.NotReadable, match=r"^absent$"):
        ks.read_syslog_file(str(tmp_path / "nope.log"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_syslog_file_permission_denied(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("x\n")
    log.chmod(0)
    with pytest.raises(ks.NotReadable, match="permission denied"):
        ks.read_syslog_file(str(log))


def test_read_live_takes_the_first_source_that_works_and_keeps_why_the_others_failed():
    def refused():
        raise ks.NotReadable("not readable: operation not permitted")

    def broken():
        raise OSError("exec format error")

    text = ks.read_live((("dmesg", refused), ("journalctl -k -b", broken), ("kern", lambda: (["a"], "whole file"))))
    assert (text.source, text.lines, text.note) == ("kern", ["a"], "whole file")
    assert text.tried == {
        "dmesg": "not readable: operation not permitted",
        "journalctl -k -b": "not readable: OSError: exec format error",
    }
    none = ks.read_live((("dmesg", refused),))
    assert none.source is None and none.tried == {"dmesg": "not readable: operation not permitted"}


def test_this_machine_gives_a_kernel_log_or_the_reasons():
    text = ks.read_live()
    if text.source is None:
        assert text.tried and all(text.tried.values())
    else:
        assert text.lines
