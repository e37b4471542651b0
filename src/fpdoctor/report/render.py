"""Renderers: a report dict in, text out. They format; they never compute or collect.

All formats render the *redacted* dict from `Report.to_dict()`, so a secret cannot reach any
of them. Capabilities that want a facts table put rows in ``data["summary"]`` (label, value),
a results table in ``data["table"]`` ({"title", "columns", "rows"} of strings) and unchecked
sources in ``data["not_checked"]``; renderers show each when present.
"""

from __future__ import annotations

import html
import io
import re
from collections.abc import Mapping
from typing import Any

from fpdoctor.report.model import UNFINISHED, Severity, Trial, json_text, severity_rank

FORMATS = ("text", "json", "markdown", "html")

_SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold cyan"}
_VERDICT_STYLE = {"error": "bold white on red", "warning": "bold black on yellow", "ok": "bold white on green"}


# A clean text report leads with its verdict and a few facts; the whole table when asked (-v).
NOTE_MIN = 12  # the results table's last column (its notes), cut to this where the names need the room
LABEL_WIDTH = 40  # the summary's label column at most, in characters
CLEAN_ROWS = 8


def ordinal(n: int) -> str:
    """'1st', '2nd', '11th', '23rd': how a finding words a count."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def headline(report: Mapping[str, Any]) -> str:
    """What a report leads with in every format: its verdict, except that a report that saw nothing
    wrong because it could not look, or did not look to the end, says so ("not checked",
    "incomplete", "in progress": never a bare ok), and a run cut short with findings says both
    ("error, incomplete")."""
    verdict = str(report["verdict"])
    status = report.get("data", {}).get("status")
    worst = max((severity_rank(f["severity"]) for f in report["findings"]), default=0)
    if status in ("not checked", *UNFINISHED) and worst < Severity.WARNING.rank:
        return str(status)
    if status in UNFINISHED:
        return f"{verdict}, {status}"
    return verdict


def render(report: dict[str, Any], fmt: str, *, color: bool = False, width: int = 100, verbose: bool = False) -> str:
    if fmt == "json":
        return json_text(report) + "\n"
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    if fmt == "text":
        return render_text(report, color=color, width=width, verbose=verbose)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _value(value: Any) -> str:
    """A value as a person reads it: numbers to 4 significant digits, lists joined, records as
    `key value` pairs - never a JSON blob (the JSON format is there for machines)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_nested(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value):
            return "; ".join(f"({_value(v)})" for v in value)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return "[" + ", ".join(_value(v) for v in value) + "]"  # a shape or a list of numbers
        return ", ".join(_value(v) for v in value)
    return str(value)


def _nested(value: Any) -> str:
    """A record inside a record is bracketed, so its keys do not run into its parent's."""
    return f"({_value(value)})" if isinstance(value, dict) else _value(value)


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    return [f"{key}: {_value(value)}" for key, value in evidence.items()]


# A fix whose every line is a command or a shell comment is shown as code; prose is shown as prose.
_COMMAND = re.compile(
    r"^\s*(#|\$ |[A-Z_][A-Z0-9_]*=|(python3?|pip3?|uv|conda|mamba|export|unset|fpdoctor|torchrun|accelerate|"
    r"nvidia-smi|dmesg|journalctl|sudo|apt(-get)?|yum|dnf|ldconfig|cd|ls|git|docker|module|source|nsys|"
    r"compute-sanitizer|ulimit|echo|cat|env)\b|[./~]\S*/)"
)


def trial_line(finding: Mapping[str, Any]) -> str:
    """ "checked on ...: X; metric a -> b" or "not tried: why", from a finding's JSON; empty for a
    finding without a fix or a report written before fixes carried their trial."""
    trial = finding.get("fix_trial")
    if not finding.get("fix") or not isinstance(trial, Mapping):
        return ""
    return Trial.from_dict(trial).text()


def is_command(fix: str) -> bool:
    lines = [line for line in fix.splitlines() if line.strip()]
    return bool(lines) and all(_COMMAND.match(line) for line in lines)


def _md_text(value: Any) -> str:
    """Text pasted into GitHub markdown: `<wheel nvidia-cublas-cu12>` must not be eaten as a tag."""
    return html.escape(str(value), quote=False)


def render_text(report: dict[str, Any], *, color: bool = False, width: int = 100, verbose: bool = False) -> str:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        color_system="standard" if color else None,
        force_terminal=color,
        highlight=False,
        soft_wrap=False,
    )
    verdict = report["verdict"]
    head = Text()
    # a report that saw nothing wrong because it could not look says so, never a bare OK
    lead = headline(report)
    head.append(f" {lead.upper()} ", style=_VERDICT_STYLE[verdict if lead == verdict else "warning"])
    head.append(f"  fpdoctor {report['command']}  ", style="bold")
    counts = _counts(report["findings"])
    head.append(", ".join(f"{n} {sev}" for sev, n in counts.items() if n) or "no findings")
    console.print(head)

    summary = report["data"].get("summary")
    hidden = 0
    if summary and not report["findings"] and not verbose and len(summary) > CLEAN_ROWS:
        summary, hidden = summary[:CLEAN_ROWS], len(summary) - CLEAN_ROWS
    if summary:
        table = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 0))
        # a long label (a decisions line names its source) wraps in its own column: left at its length, it
        # took the width the values need and folded each of them every few words
        table.add_column(style="dim", max_width=LABEL_WIDTH)
        table.add_column(overflow="fold")
        for label, value in summary:
            table.add_row(escape(str(label)), escape(str(value)))
        console.print()
        console.print(table)
        if hidden:
            console.print(
                Text(
                    f"({hidden} more fact{'s' if hidden > 1 else ''}: -v shows them, --format json keeps them all)",
                    style="dim",
                )
            )

    results = report["data"].get("table")
    if results:
        table = Table(title=escape(results["title"]), title_justify="left", box=None, pad_edge=False)
        widths = [max(len(str(c)) for c in [column, *(row[k] for row in results["rows"])]) for k, column in
                  enumerate(results["columns"])]  # fmt: skip
        # the first column names things (module paths): whole where the figures and a note cut to a few
        # characters leave room for it (a path folded in two reads as two modules), folded only past that
        last = len(widths) - 1
        rest = sum(widths[1:-1]) + min(widths[-1], NOTE_MIN) if last > 1 else sum(widths[1:])
        first = max(1, min(widths[0], width - rest - 2 * len(widths)))
        for k, column in enumerate(results["columns"]):
            table.add_column(
                escape(column),
                justify="left" if k == 0 else "right",
                overflow="fold" if k == 0 else "ellipsis",
                no_wrap=k > 0,
                min_width=first if k == 0 else None,
                # the notes take what the names and figures leave
                max_width=max(NOTE_MIN, width - first - sum(widths[1:-1]) - 2 * len(widths))
                if k == last and last > 1
                else None,
            )
        for row in results["rows"]:
            table.add_row(*(escape(str(cell)) for cell in row))
        console.print()
        console.print(table)

    for finding in report["findings"]:
        console.print()
        line = Text()
        line.append(f"{finding['severity'].upper():7} ", style=_SEVERITY_STYLE[finding["severity"]])
        line.append(f"{finding['code']} {finding['name']}", style="bold")
        line.append(f"  {finding['title']}")
        console.print(line)
        if finding["message"]:
            console.print(Text(finding["message"]), style=None)
        for ev in _evidence_lines(finding["evidence"]):
            console.print(Text("  evidence  ", style="dim") + Text(ev))
        if finding["fix"]:
            console.print(Text("  fix", style="bold green"))
            for fix_line in finding["fix"].splitlines():
                # Never wrap a command: it must survive copy and paste.
                console.print(Text("    " + fix_line), soft_wrap=True)
            trial = trial_line(finding)
            if trial:
                console.print(Text("  ") + Text(trial, style="green" if trial.startswith("checked") else "yellow"))
        if finding["references"]:
            console.print(Text("  see  ", style="dim") + Text(", ".join(finding["references"][:3])))

    not_checked = report["data"].get("not_checked")
    if not_checked:
        console.print()
        console.print(Text("Not checked", style="bold"))
        for source, why in not_checked.items():
            console.print(Text(f"  {source}: ", style="dim") + Text(str(why)))
    # rich pads table cells to the console width; trailing blanks only get in the way of diffs.
    return "\n".join(line.rstrip() for line in buf.getvalue().split("\n"))


def _counts(findings: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in findings:
        counts[f["severity"]] += 1
    return counts


def _md_cell(value: Any) -> str:
    return _md_text(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    """GitHub-flavoured markdown, meant to be pasted into an issue as is."""
    out = [f"### fpdoctor {report['command']}: **{headline(report)}**", ""]
    out.append(f"<sub>fpdoctor {report['version']}, report schema `{report['schema']}`</sub>")
    out.append("")
    summary = report["data"].get("summary")
    if summary:
        out += ["| fact | value |", "|---|---|"]
        out += [f"| {_md_cell(k)} | {_md_cell(v)} |" for k, v in summary]
        out.append("")
    results = report["data"].get("table")
    if results:
        out += [f"**{_md_cell(results['title'])}**", ""]
        out.append("| " + " | ".join(_md_cell(c) for c in results["columns"]) + " |")
        out.append("|" + "---|" * len(results["columns"]))
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in results["rows"]]
        out.append("")
    if report["findings"]:
        out += ["| severity | code | name | title |", "|---|---|---|---|"]
        for f in report["findings"]:
            out.append(f"| {f['severity']} | `{f['code']}` | `{f['name']}` | {_md_cell(f['title'])} |")
        out.append("")
        for f in report["findings"]:
            out.append(f"<details><summary><code>{f['code']}</code> {html.escape(f['name'])}</summary>")
            out.append("")
            out.append(_md_text(f["message"]))
            out.append("")
            for ev in _evidence_lines(f["evidence"]):
                out.append(f"- {_md_text(ev)}")
            if f["fix"]:
                fix = ["```sh", f["fix"], "```"] if is_command(f["fix"]) else [_md_text(f["fix"])]
                out += ["", "**Fix**", "", *fix]
                trial = trial_line(f)
                if trial:
                    out += ["", f"*{_md_text(trial)}*"]
            if f["references"]:
                out += ["", "References: " + ", ".join(_md_text(r) for r in f["references"])]
            out += ["", "</details>", ""]
    else:
        out += ["No findings.", ""]
    not_checked = report["data"].get("not_checked")
    if not_checked:
        out += ["Not checked:", ""]
        out += [f"- {_md_text(k)}: {_md_cell(v)}" for k, v in not_checked.items()]
        out.append("")
    return "\n".join(out)


def render_html(report: dict[str, Any]) -> str:
    """One self-contained page: inline styles and SVG plots, nothing loaded from the network."""
    from fpdoctor.report import html as html_page

    return html_page.page(report)
