"""The self-contained HTML report: one file that opens offline and loads nothing.

Styles are inline, plots are inline SVG (report/plots.py), there is no script to run and no
font or image to fetch; the report's JSON rides along in a data block for machines. The page
leads with the verdict and its fix, then the facts, the views each capability has data for (the
first bad op, the per-module range heatmap, the precision profile, the sentinel's timeline, GEMM
fingerprints across GPUs, the crashed processes), the results table, every finding with its
evidence, and what was not checked.

`page()` renders one report; `book()` renders several (one per `fpdoctor demo` case) into one
document, each in its own section with its own id prefix so that ids stay unique.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fpdoctor.report.model import json_text, severity_rank
from fpdoctor.report.render import _value, headline, is_command, trial_line

FULL_FINDINGS = 10  # per finding name; further ones are listed one line each
LISTED_FINDINGS = 200  # per finding name; the JSON report has the rest
FIRST_BAD_CARDS = 3  # distinct ops (op, module, source line) in the first-bad-op view
CRASH_PANELS = 8  # processes shown with their stacks; a large torchrun job lists the rest in its table
JSON_TWIN_BYTES = 1_000_000  # the embedded JSON is dropped past this, to keep the page under 2 MB
_FIRST_BAD = ("nonfinite-produced", "nonfinite-input", "deterministic-nonfinite")
# The sentinel's replay verdicts sum up the nonfinite-loss/-gradient findings that point to them.
_LEADS = ("deterministic-nonfinite", "transient-fault-suspected")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:1.5em 2em 3em}
h1{font-size:1.5em;margin:.2em 0 .6em}h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #ddd}
h3{font-size:1em;margin:0 0 .3em}section.report{margin-bottom:3em}
table{border-collapse:collapse;margin:.4em 0;background:#fff}
td,th{border:1px solid #d6d6d6;padding:3px 8px;vertical-align:top;text-align:left}
th{background:#f1f1f1;font-weight:600}table.facts th{background:none;color:#555;font-weight:500;white-space:nowrap}
code,pre{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{white-space:pre-wrap;margin:0;background:#f3f3f3;padding:.5em .7em;border-radius:4px}
.banner{border-radius:6px;padding:1em 1.3em;margin:.6em 0 1em;border-left:8px solid}
.banner.error{background:#fdecea;border-color:#c62828}.banner.warning{background:#fff6e0;border-color:#e0a000}
.banner.ok{background:#e9f6ec;border-color:#2e7d32}.banner .verdict{font-weight:700;text-transform:uppercase}
.banner p{margin:.3em 0}.banner pre{background:#fff}
.sev{display:inline-block;min-width:4.5em;font-weight:700;text-transform:uppercase;font-size:.85em}
.sev.error{color:#c62828}.sev.warning{color:#b26a00}.sev.info{color:#1565c0}
.finding{background:#fff;border:1px solid #ddd;border-left:5px solid #999;border-radius:4px;
padding:.6em .9em;margin:.6em 0}
.finding.error{border-left-color:#c62828}.finding.warning{border-left-color:#e0a000}
.finding.info{border-left-color:#1565c0}
.finding table td:first-child{color:#555;white-space:nowrap}
figure{margin:.8em 0;background:#fff;border:1px solid #e3e3e3;border-radius:4px;padding:.6em}
figure svg{max-width:100%;height:auto}figcaption{color:#555;font-size:.9em;margin-top:.3em}
.panel{background:#fff;border:1px solid #e3e3e3;border-radius:4px;padding:.6em .9em;margin:.8em 0}
.note{color:#555}.toc li{margin:.15em 0}small{color:#666}p.message{white-space:pre-wrap}
td.error{color:#c62828;font-weight:600}td.warning{color:#b26a00;font-weight:600}
h2.case{font-size:1.45em;border-bottom:3px solid #999;margin-top:2.5em}
"""


@dataclass(frozen=True)
class Section:
    """One report in a `book`: its heading and the story told above it."""

    heading: str
    story: str
    report: Mapping[str, Any]
    key: str  # id prefix, unique in the document


def page(report: Mapping[str, Any]) -> str:
    """The whole document for one report."""
    title = f"fpdoctor {report['command']}: {headline(report)}"
    body = _report(report, prefix="", heading=None, story=None)
    return _document(title, f"<h1>{_e(title)}</h1>{body}", report)


def book(title: str, sections: Sequence[Section]) -> str:
    """One document with a section per report and a table of contents."""
    toc = "".join(
        f'<li><a href="#{_e(s.key)}report">{_e(s.heading)}</a>: <span class="sev {_e(s.report["verdict"])}">'
        f"{_e(s.report['verdict'])}</span></li>"
        for s in sections
    )
    body = "".join(_report(s.report, prefix=s.key, heading=s.heading, story=s.story) for s in sections)
    return _document(title, f'<h1>{_e(title)}</h1><ol class="toc" id="contents">{toc}</ol>{body}',
                     [s.report for s in sections])  # fmt: skip


def _e(value: Any) -> str:
    return html.escape(str(value))


def _document(title: str, body: str, twin: Any) -> str:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body><main>{body}"
        f"{_json_twin(twin)}</main></body></html>\n"
    )


def _json_twin(value: Any) -> str:
    """The report's JSON, for a machine reading the page; `<` escaped so that no text in it can
    end the block or open a tag."""
    text = json_text(value, indent=None).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    if len(text) > JSON_TWIN_BYTES:
        return (
            f'<p class="note" id="json-twin">The JSON report ({len(text) // 1000} kB) is not embedded in this '
            "page; write it with --format json.</p>"
        )
    return f'<script type="application/json" id="json-twin">{text}</script>'


def _report(report: Mapping[str, Any], *, prefix: str, heading: str | None, story: str | None) -> str:
    data = report.get("data") or {}
    parts = [f'<section class="report" id="{_e(prefix)}report">']
    if heading:
        parts.append(f'<h2 class="case">{_e(heading)}</h2>')
    if story:
        parts.append(f'<p class="note">{_e(story)}</p>')
    parts.append(_banner(report, prefix))
    parts.append(_facts(data, prefix))
    for view in _VIEWS:
        parts.append(_view(view, report, prefix))
    parts.append(_results(data, prefix))
    parts.append(_findings(report["findings"], prefix))
    parts.append(_not_checked(data, prefix))
    parts.append(
        f"<p><small>fpdoctor {_e(report.get('version', ''))}, report schema {_e(report.get('schema', ''))}, "
        f"command {_e(report['command'])}</small></p></section>"
    )
    return "".join(parts)


def _lead(findings: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The finding the banner leads with: the first of the worst severity, a replay verdict first."""
    if not findings:
        return None
    worst = max(severity_rank(f["severity"]) for f in findings)
    top = [f for f in findings if severity_rank(f["severity"]) == worst]
    return next((f for f in top if f["name"] in _LEADS), top[0])


def _fix(finding: Mapping[str, Any]) -> str:
    """The fix, then whether it was tried (checked with its figures, or why not)."""
    fix = finding.get("fix") or ""
    if not fix:
        return ""
    trial = trial_line(finding)
    tried = f'<p class="trial"><i>{_e(trial)}</i></p>' if trial else ""
    return "<p><b>Fix</b></p>" + (f"<pre>{_e(fix)}</pre>" if is_command(fix) else f"<p>{_e(fix)}</p>") + tried


def _banner(report: Mapping[str, Any], p: str) -> str:
    findings = report["findings"]
    verdict = report["verdict"]
    lead = _lead(findings)
    counts = {s: sum(1 for f in findings if f["severity"] == s) for s in ("error", "warning", "info")}
    tally = ", ".join(f"{n} {s}" + ("s" if n > 1 and s != "info" else "") for s, n in counts.items() if n)
    out = [f'<div class="banner {_e(verdict)}" id="{p}verdict">']
    out.append(f'<p><span class="verdict">{_e(headline(report))}</span> &middot; '
               f'fpdoctor {_e(report["command"])} &middot; '
               f"{_e(tally or 'no findings')}</p>")  # fmt: skip
    if lead is not None:
        out.append(
            f'<p><b><a href="#{p}finding-{findings.index(lead)}"><code>{_e(lead["code"])}</code></a> '
            f'{_e(lead["title"])}</b></p><p class="message">{_e(lead["message"])}</p>'
        )
        if (confidence := lead.get("evidence", {}).get("confidence")) is not None:
            out.append(f"<p><b>Confidence:</b> {_e(_value(confidence))}</p>")
        out.append(_fix(lead))
        others: dict[str, int] = {}
        for f in findings:
            if f is not lead:
                others[f["name"]] = others.get(f["name"], 0) + 1
        if others:
            also = ", ".join(f"{_e(n)}" + (f" &times;{k}" if k > 1 else "") for n, k in others.items())
            out.append(f"<p><small>Also: {also}.</small></p>")
    else:
        out.append("<p>No problem found in what was checked; the facts and what was not checked follow.</p>")
    out.append("</div>")
    return "".join(out)


def _facts(data: Mapping[str, Any], p: str) -> str:
    summary = data.get("summary")
    if not summary:
        return ""
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_fact(v)}</td></tr>" for k, v in summary)
    return f'<h2 id="{p}facts">Facts</h2><table class="facts">{rows}</table>'


def _fact(value: Any) -> str:
    text = str(value)
    return f"<pre>{_e(text.strip())}</pre>" if "\n" in text else _e(text)  # code, a stack or a log keeps its lines


def _results(data: Mapping[str, Any], p: str) -> str:
    results = data.get("table")
    if not isinstance(results, Mapping) or not results.get("columns"):
        return ""
    cells = ["<tr>" + "".join(f"<th>{_e(c)}</th>" for c in results["columns"]) + "</tr>"]
    cells += ["<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in results.get("rows", [])]
    return f'<h2 id="{p}results">{_e(results.get("title", "Results"))}</h2><table>{"".join(cells)}</table>'


def _cell(value: Any) -> str:
    text = str(value)
    state = text.lower()  # a verdict or state column (health's GPUs, torchrun's ranks) reads at a glance
    return f'<td class="{state}">{_e(text)}</td>' if state in ("error", "warning") else f"<td>{_e(text)}</td>"


def _evidence_table(finding: Mapping[str, Any]) -> str:
    rows = [(f"where: {k}", v) for k, v in (finding.get("where") or {}).items() if v is not None]
    rows += list((finding.get("evidence") or {}).items())
    if not rows:
        return ""
    return "<table>" + "".join(f"<tr><td>{_e(k)}</td><td>{_fact(_value(v))}</td></tr>" for k, v in rows) + "</table>"


def _finding(f: Mapping[str, Any], index: int, p: str) -> str:
    refs = "".join(f'<li><a href="{_e(r)}">{_e(r)}</a></li>' for r in f.get("references") or [])
    return (
        f'<article class="finding {_e(f["severity"])}" id="{p}finding-{index}">'
        f'<h3><span class="sev {_e(f["severity"])}">{_e(f["severity"])}</span> <code>{_e(f["code"])}</code> '
        f'{_e(f["name"])}: {_e(f["title"])}</h3><p class="message">{_e(f["message"])}</p>{_evidence_table(f)}'
        + _fix(f)
        + (f"<p><b>References</b></p><ul>{refs}</ul>" if refs else "")
        + "</article>"
    )


def _findings(findings: Sequence[Mapping[str, Any]], p: str) -> str:
    """Every finding with its evidence; a name that repeats (one per bad step in a long run) shows
    its first ones in full and lists the rest one line each."""
    if not findings:
        return f'<h2 id="{p}findings">Findings</h2><p>No findings.</p>'
    seen: dict[str, int] = {}
    full: list[str] = []
    listed: dict[str, list[str]] = {}
    left_out: dict[str, int] = {}
    for index, f in enumerate(findings):
        n = seen[f["name"]] = seen.get(f["name"], 0) + 1
        if n <= FULL_FINDINGS:
            full.append(_finding(f, index, p))
        elif n <= FULL_FINDINGS + LISTED_FINDINGS:
            where = ", ".join(f"{k} {_value(v)}" for k, v in (f.get("where") or {}).items() if v is not None)
            listed.setdefault(f["name"], []).append(
                f'<tr id="{p}finding-{index}"><td><code>{_e(f["code"])}</code></td><td>{_e(where)}</td>'
                f"<td>{_e(f['message'])}</td></tr>"
            )
        else:
            left_out[f["name"]] = left_out.get(f["name"], 0) + 1
    out = [f'<h2 id="{p}findings">Findings</h2>', *full]
    for name, rows in listed.items():
        more = f" ({left_out[name]} more in the JSON report)" if name in left_out else ""
        out.append(
            f"<details><summary>{len(rows)} more {_e(name)}{_e(more)}</summary>"
            f"<table><tr><th>code</th><th>where</th><th>message</th></tr>{''.join(rows)}</table></details>"
        )
    return "".join(out)


def _not_checked(data: Mapping[str, Any], p: str) -> str:
    not_checked = data.get("not_checked")
    if not not_checked:
        return ""
    items = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in not_checked.items())
    return f'<h2 id="{p}not-checked">Not checked</h2><ul>{items}</ul>'


# ---- views: each returns (title, body html, caption) or None when its data is absent -------------------------


def _first_bad_op(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    from fpdoctor.report import plots

    cards, seen = [], set()
    for index, f in enumerate(report["findings"]):
        where, ev = f.get("where") or {}, f.get("evidence") or {}
        if f["name"] not in _FIRST_BAD or not where.get("op"):
            continue
        same = (where.get("op"), where.get("module"), ev.get("location"))
        if same in seen:
            continue
        seen.add(same)
        facts = [
            ("op", where.get("op")),
            ("module", where.get("module") or "outside any module"),
            ("phase", where.get("phase")),
            ("source", ev.get("location")),
            (
                "produced",
                f"{_value(ev.get('count'))} {ev.get('kind')} of {_value(ev.get('numel'))} values"
                if ev.get("count") is not None
                else None,
            ),
            ("dtype", ev.get("dtype")),
            ("shape", ev.get("shape")),
            *((k, where.get(k)) for k in ("rank", "step", "iteration", "call", "input") if where.get(k) is not None),
        ]
        rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_value(v))}</td></tr>" for k, v in facts if v is not None)
        inputs = _inputs_table(ev.get("inputs"))
        chart = plots.input_ranges(ev, key=f"{p}input-ranges-{index}") or ""
        reaches = "".join(f"<li>{_e(r)}</li>" for r in ev.get("reaches") or [])
        cards.append(
            f'<div class="panel"><h3><a href="#{p}finding-{index}"><code>{_e(f["code"])}</code></a> '
            f'{_e(f["title"])}</h3><table class="facts">{rows}</table>{inputs}'
            + (
                f"<figure>{chart}<figcaption>Each input's largest magnitude against its dtype's max.</figcaption>"
                "</figure>"
                if chart
                else ""
            )
            + (f"<p><b>Reaches</b></p><ul>{reaches}</ul>" if reaches else "")
            + "</div>"
        )
        if len(cards) == FIRST_BAD_CARDS:
            break
    if not cards:
        return None
    return "First bad op", "".join(cards), ""


def _inputs_table(inputs: Any) -> str:
    if not isinstance(inputs, list) or not inputs:
        return ""
    rows = []
    for i in inputs:
        if not isinstance(i, Mapping):
            continue
        rows.append(
            "<tr>"
            + "".join(f"<td>{_e(_value(i.get(k)))}</td>" for k in ("from", "dtype", "shape", "min", "max", "nonfinite"))
            + "</tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in ("input from", "dtype", "shape", "min", "max", "non-finite"))
    return f"<p><b>Inputs</b></p><table><tr>{head}</tr>{''.join(rows)}</table>"


def _range_view(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    from fpdoctor.report import plots

    rows = (report.get("data") or {}).get("headroom")
    svg = plots.range_heatmap(rows, key=f"{p}range") if isinstance(rows, list) and rows else None
    if svg is None:
        return None
    return (
        "Value ranges against the fp16, bf16 and fp8 limits",
        svg,
        "Per module output, in model order. Left: the largest magnitude as a share of each format's largest "
        "finite value (from 50%, one doubling from overflow, it is a risk). Right: the share of non-zero values "
        "below each format's flush-to-zero threshold (1% and above is named as underflow risk); fp8 columns "
        "assume tensorwise scaling "
        "that maps the largest magnitude to the format's max.",
    )


def _profile_view(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    from fpdoctor.report import plots

    data = report.get("data") or {}
    rows = plots.profile_rows(data)
    plan = data.get("plan")
    kept = plan.get("keep_fp32") or [] if isinstance(plan, Mapping) else []
    ratio = plots.number(data.get("divergence_ratio"))
    svg = plots.precision_profile(rows, divergence_ratio=ratio, kept=kept, key=f"{p}profile") if rows else None
    if svg is None:
        return None
    return (
        "Precision profile",
        svg,
        "Error against an fp64 reference per module, as SQNR in dB. Propagated: the module as the model runs, "
        "errors from earlier modules included. Isolated: the module alone, fed the reference's inputs; for a "
        "module with submodules, its worst own op (computed in its forward, outside its submodules). Noise "
        "floor: what rounding that output alone costs. A module whose isolated error falls past the "
        "divergence line is one to keep in higher precision"
        + ("; [fp32] marks the plan's exceptions." if kept else "."),
    )


def _timeline_view(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    from fpdoctor.report import plots

    timeline = (report.get("data") or {}).get("timeline")
    svg = plots.timeline(timeline, key=f"{p}timeline") if isinstance(timeline, Mapping) else None
    if svg is None:
        return None
    return (
        "Training timeline",
        svg,
        "Loss per step (log scale when every loss is positive); below, the steps whose loss or gradients were "
        "non-finite, the steps AMP's GradScaler skipped, and the loss spikes.",
    )


def _fingerprint_view(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    from fpdoctor.report import plots

    fingerprints = (report.get("data") or {}).get("fingerprints")
    rows = fingerprints.get("rows") if isinstance(fingerprints, Mapping) else None
    svg = plots.fingerprint_matrix(rows, key=f"{p}fingerprints") if isinstance(rows, list) else None
    if svg is None:
        return None
    return (
        "GEMM fingerprints across devices",
        svg,
        "The same seeded matrix products on every device, digested bit for bit. Devices of one fingerprint "
        "group (same GPU model, SM count, cuBLAS, driver and torch) must agree exactly; a red row or column is "
        "the device that does not. A red label is a device the findings name.",
    )


_FAILED = ("signal", "terminated", "killed", "exception")


def _crash_view(report: Mapping[str, Any], p: str) -> tuple[str, str, str] | None:
    """`fpdoctor run`: each process that failed, with its Python stack, the ops it had in
    flight, its native stack and the tail of the cuBLAS log, as far as the report holds them."""
    processes = (report.get("data") or {}).get("processes")
    if not isinstance(processes, list):
        return None
    # as `fpdoctor run` counts failures: killed by a signal, an uncaught exception, or a non-zero exit
    failed = [q for q in processes if isinstance(q, Mapping) and (q.get("ended") in _FAILED or q.get("exit_code"))]
    panels = []
    for q in failed[:CRASH_PANELS]:
        who = f"pid {q.get('pid')}" + (f", rank {q['rank']}" if q.get("rank") is not None else "")
        who += f" on {q['host']}" if q.get("host") else ""
        end = q.get("signal") or (f"exit code {q['exit_code']}" if q.get("exit_code") is not None else q.get("ended"))
        parts = [f'<div class="panel"><h3>{_e(who)}: {_e(end)}</h3>']
        if q.get("argv"):
            parts.append(f"<p><code>{_e(' '.join(str(a) for a in q['argv']))}</code></p>")
        for thread in q.get("threads") or []:
            if isinstance(thread, Mapping) and thread.get("current"):
                parts.append(_lines("Python stack, most recent call first", _frames(thread.get("frames"))))
        for exc in q.get("exceptions") or []:
            if isinstance(exc, Mapping):
                text = exc.get("traceback") or f"{exc.get('type')}: {exc.get('message')}"
                parts.append(_lines("Uncaught exception", [str(text).rstrip()]))
        parts.append(_lines("Last ops (breadcrumbs)", [str(o) for o in q.get("ops") or []]))
        for thread in (q.get("native") or [])[:1]:
            if isinstance(thread, Mapping):
                parts.append(_lines("Native stack", _frames(thread.get("frames"))))
        parts.append(_lines("cuBLAS log, last lines", [str(x) for x in (q.get("library_log") or [])[-10:]]))
        panels.append("".join(parts) + "</div>")
    if not panels:
        return None
    more = len(failed) - len(panels)
    tail = f'<p class="note">{more} more failed process(es) in the JSON report.</p>' if more > 0 else ""
    return "Crash", "".join(panels) + tail, ""


def _frames(frames: Any) -> list[str]:
    out = []
    for frame in frames or []:
        if isinstance(frame, Mapping) and frame.get("file") is not None:
            out.append(f"{frame['file']}:{frame.get('line', '?')} in {frame.get('function', '?')}")
        else:
            out.append(_value(frame))
    return out


def _lines(title: str, lines: list[str]) -> str:
    return f"<p><b>{_e(title)}</b></p><pre>{_e(chr(10).join(lines))}</pre>" if lines else ""


_VIEWS: tuple[tuple[str, Callable[[Mapping[str, Any], str], tuple[str, str, str] | None]], ...] = (
    ("first-bad-op", _first_bad_op),
    ("range-heatmap", _range_view),
    ("precision-profile", _profile_view),
    ("timeline", _timeline_view),
    ("fingerprints", _fingerprint_view),
    ("crash", _crash_view),
)


def _view(view: tuple[str, Callable[..., tuple[str, str, str] | None]], report: Mapping[str, Any], p: str) -> str:
    name, draw = view
    try:
        drawn = draw(report, p)
    except Exception as error:  # a plot that cannot be drawn must not cost the user the report
        why = f"{type(error).__name__}: {error}"
        return f'<p class="note" id="{p}{name}">The {name} view could not be drawn: {_e(why)}</p>'
    if drawn is None:
        return ""
    title, body, caption = drawn
    if body.startswith("<svg"):
        body = f"<figure>{body}<figcaption>{_e(caption)}</figcaption></figure>"
    return f'<h2 id="{p}{name}">{_e(title)}</h2>{body}'
