"""The self-contained HTML report: page structure per command, the views drawn from real reports,
what the page never loads, its size on long runs, and a real headless browser opening it."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.casebook import attention
from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.parse import parse_text
from fpdoctor.report import html as html_page
from fpdoctor.report import plots
from fpdoctor.report.model import json_text
from fpdoctor.report.render import render
from tests.conftest import ENV_FIXTURES, ROOT

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
MB2 = 2 * 1024 * 1024


class Outline(HTMLParser):
    """What a page is made of: ids in order, elements by tag, nesting errors, the JSON twin."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: list[str] = []
        self.tags: dict[str, int] = {}
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.resources: list[str] = []  # src/href that would make the browser fetch something
        self.twin = ""
        self._in_twin = False
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"unclosed: {self.stack}")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._element(tag, dict(attrs))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._element(tag, dict(attrs))  # <path .../> inside the SVG

    def _element(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if attrs.get("id"):
            self.ids.append(str(attrs["id"]))
        for name in ("src", "href", "xlink:href", "data"):
            value = attrs.get(name) or ""
            if value and not value.startswith("#") and not (tag == "a" and name == "href"):
                self.resources.append(f"<{tag} {name}={value}>")
        if tag == "script":
            self._in_twin = attrs.get("type") == "application/json"
            if not self._in_twin:
                self.resources.append("<script> that runs")

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        self._in_twin = False

    def handle_data(self, data: str) -> None:
        if self._in_twin:
            self.twin += data


def outline(text: str) -> Outline:
    page = Outline(text)
    assert not page.errors, page.errors[:5]
    assert len(page.ids) == len(set(page.ids)), sorted({i for i in page.ids if page.ids.count(i) > 1})[:5]
    assert not page.resources, page.resources[:5]
    assert "@font-face" not in text and "url(http" not in text
    return page


def views(page: Outline, prefix: str = "") -> set[str]:
    names = ("first-bad-op", "range-heatmap", "precision-profile", "timeline", "fingerprints", "crash", "results",
             "not-checked")  # fmt: skip
    return {n for n in names if prefix + n in page.ids}


# ---- reports from the real capabilities ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_report() -> dict:
    block, frames = attention.build()
    with fpdoctor.trace(block, headroom=True) as t:
        block(frames)
    assert t.report is not None
    return t.report.to_dict()


@pytest.fixture(scope="module")
def sentinel_report() -> dict:
    """40 steps: a one-off NaN gradient (transient), a loss spike, and a 0/0 that reproduces."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = fpdoctor.Sentinel(model, opt)
    g = torch.Generator().manual_seed(1)
    faults = {"transient": 1}
    for i in range(1, 41):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

        def step(x=x, y=y, i=i):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = nn.functional.mse_loss(out, y) * (300.0 if i == 30 else 1.0)
            if i == 36:
                loss = loss + (out / (out - out)).mean()  # 0/0 on every replay
            loss.backward()
            if i == 12 and faults["transient"]:
                faults["transient"] = 0
                model[0].weight.grad[0, 0] = float("nan")
            return loss

        guard.step(step)
    report = guard.report.to_dict()
    names = {f["name"] for f in report["findings"]}
    assert {"transient-fault-suspected", "loss-spike", "deterministic-nonfinite"} <= names, names
    return report


class Overflowing(nn.Module):
    """Its middle layer's output passes fp16's max: non-finite in fp16, a divergent module."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.big, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.big(self.inp(x)))


@pytest.fixture(scope="module")
def compare_report() -> dict:
    torch.manual_seed(0)
    result = fpdoctor.compare(Overflowing(), torch.randn(8, 16), candidate="fp16")
    assert result.first_divergent == "big"
    return result.report.to_dict()


@pytest.fixture(scope="module")
def env_report() -> dict:
    text = (ENV_FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt").read_text()
    return diagnose_env(facts=parse_text(text)).to_dict()


@pytest.fixture(scope="module")
def pages(trace_report, sentinel_report, compare_report) -> dict[str, str]:
    """Each page rendered once for the tests that only read it (a page with plots takes a second)."""
    return {
        "trace": render(trace_report, "html"),
        "sentinel": render(sentinel_report, "html"),
        "compare": render(compare_report, "html"),
    }


def run_report() -> dict:
    """A `fpdoctor run` report's shape: a process that died of SIGFPE, with its stack and op ring."""
    process = {
        "pid": 4242,
        "rank": 3,
        "host": "node7",
        "argv": ["python", "train.py"],
        "ended": "signal",
        "signal": "SIGFPE",
        "exit_code": -8,
        "threads": [
            {
                "thread": "0x1",
                "current": True,
                "frames": [
                    {"file": "torch/nn/modules/linear.py", "line": 125, "function": "forward"},
                    {"file": "train.py", "line": 40, "function": "<module>"},
                ],
            },
        ],
        "ops": ["aten.addmm.default (fc1) bf16[2,1024]x[1024,18432]  <- in flight"],
        "library_log": ["[cublasLt][1][Api][cublasLtMatmul] A=0x7f..."],
    }
    finding = {
        "code": "CRS001",
        "name": "fatal-signal",
        "severity": "error",
        "title": "rank 3 died of SIGFPE",
        "message": "rank 3 died of SIGFPE in forward.\nPython stack:\n    torch/nn/modules/linear.py:125 in forward",
        "where": {"host": "node7", "pid": 4242, "rank": 3},
        "evidence": {"signal": "SIGFPE", "returncode": -8},
        "fix": "fpdoctor env",
        "references": [],
    }
    exited = {"pid": 4243, "ended": "exited", "exit_code": 0, "threads": []}
    table = {"title": "processes", "columns": ["process", "ended", "where"], "rows": [["rank 3", "error", "x"]]}
    return {
        "schema": "fpdoctor.report/1",
        "command": "run",
        "version": "0",
        "verdict": "error",
        "findings": [finding],
        "data": {"summary": [["exit status", "136"]], "processes": [process, exited], "table": table},
    }


# ---- page structure ------------------------------------------------------------------------------------------


def test_trace_page_has_the_first_bad_op_and_the_range_heatmap(pages):
    text = pages["trace"]
    page = outline(text)
    assert views(page) == {"first-bad-op", "range-heatmap"}
    assert page.ids[:3] == ["report", "verdict", "facts"] and "findings" in page.ids
    assert page.tags["svg"] == 3  # the bmm's and the softmax's inputs against fp16's max, and the heatmap
    panel = text[text.index('id="first-bad-op"') : text.index('id="range-heatmap"')]
    assert "aten.bmm.default" in panel and "attention.py:32" in panel and "244.6" in panel  # op, source, input max
    assert "fp16 max 65504" in panel  # the limit drawn beside the inputs
    heatmap = text[text.index('id="range-heatmap"') : text.index('id="findings"')]
    for label in ("attn.q", "fp16 max", "bf16 max", "e4m3 max", "e5m2 max", "fp16 flush", "e4m3 flush*"):
        assert label in heatmap
    assert "finding-0" in page.ids and 'href="#finding-0"' in text  # the banner links to its finding


def test_sentinel_page_has_the_timeline_and_the_replayed_op(pages):
    text = pages["sentinel"]
    page = outline(text)
    assert views(page) == {"first-bad-op", "timeline"}
    timeline = text[text.index('id="timeline"') : text.index('id="findings"')]
    assert "non-finite (2)" in timeline and "loss spike (1)" in timeline and "AMP skipped (0)" in timeline
    assert "gradient norm" in timeline  # the norm panel, from the steps the sentinel took it on
    panel = text[text.index('id="first-bad-op"') : text.index('id="timeline"')]
    assert "aten.div.Tensor" in panel
    banner = text[text.index('id="verdict"') : text.index('id="facts"')]
    # the first replay verdict leads, not the non-finite-gradient finding that points to it
    assert "did not reproduce when replayed" in banner and "Step 12" in banner


def test_compare_page_has_the_precision_profile(pages):
    text = pages["compare"]
    page = outline(text)
    assert views(page) == {"precision-profile", "results"}
    profile = text[text.index('id="precision-profile"') : text.index('id="results"')]
    for label in ("noise floor", "propagated", "isolated", "diverges", "non-finite", "divergence line (16x"):
        assert label in profile


def test_env_page_draws_nothing_it_has_no_data_for(env_report):
    text = render(env_report, "html")
    page = outline(text)
    assert views(page) <= {"not-checked"} and "svg" not in page.tags and "figure" not in page.tags
    assert {"verdict", "facts", "findings"} <= set(page.ids)


def test_run_page_shows_the_crashed_process():
    text = render(run_report(), "html")
    page = outline(text)
    assert views(page) == {"crash", "results"}
    crash = text[text.index('id="crash"') : text.index('id="results"')]
    assert "pid 4242, rank 3 on node7: SIGFPE" in crash and "train.py:40 in &lt;module&gt;" in crash
    assert "&lt;- in flight" in crash and "cublasLtMatmul" in crash
    assert "pid 4243" not in crash  # exited cleanly: not a crash
    assert '<td class="error">error</td>' in text  # a state cell reads at a glance
    assert '<p class="message">' in text  # the stack in the message keeps its lines (pre-wrap)


def test_health_page_shows_which_gpu_computes_differently():
    def row(rank: int, digest: str, verdict: str) -> dict:
        group = "NVIDIA H200 · 132 SMs · cuBLAS 12.8 · driver 570.1 · torch 2.11"
        digests = {"bf16": digest, "fp32": "aa"}
        return {"rank": rank, "host": "node1", "device": f"cuda:{rank}", "index": rank, "name": "NVIDIA H200",
                "group": group, "digests": digests, "self_consistent": True, "verdict": verdict}  # fmt: skip

    rows = [row(0, "x", "ok"), row(1, "x", "ok"), row(2, "y", "outlier"), row(3, "x", "ok")]
    report = dict(run_report(), command="health", findings=[], verdict="ok", data={"fingerprints": {"rows": rows}})
    text = render(report, "html")
    page = outline(text)
    assert "fingerprints" in page.ids and page.tags["svg"] == 1
    matrix = text[text.index('id="fingerprints"') : text.index('id="findings"')]
    # 16 cells: the outlier's row and column differ (6 red), the rest agree (10 green)
    assert matrix.count("fill: #e57373") == 6 and matrix.count("fill: #81c784") == 10
    assert "rank 2: 2 NVIDIA H200" in matrix
    alone = dict(report, data={"fingerprints": {"rows": rows[:1]}})  # nothing to compare it with
    assert "fingerprints" not in outline(render(alone, "html")).ids


def test_demo_is_one_page_with_a_section_per_case(cli, tmp_path):
    out = tmp_path / "demo.html"
    result = cli("demo", "h20-sigfpe", "fp8-outlier-channels", "-o", str(out))
    assert result.code == 0, result.err
    text = out.read_text()
    assert text.count("<!doctype html>") == 1 and text.count("</html>") == 1
    page = outline(text)
    assert {"contents", "h20-sigfpe-report", "fp8-outlier-channels-report"} <= set(page.ids)
    assert {"h20-sigfpe-verdict", "fp8-outlier-channels-precision-profile"} <= set(page.ids)
    assert [d["command"] for d in json.loads(page.twin)] == ["env", "compare"]


# ---- what every page keeps to ----------------------------------------------------------------------------


def test_json_twin_is_the_report(trace_report, pages):
    page = outline(pages["trace"])
    assert json.loads(page.twin) == json.loads(json_text(trace_report))


@pytest.mark.parametrize("which", ["trace", "sentinel", "compare"])
def test_a_report_read_back_from_json_draws_the_same_page(which, request, pages):
    again = json.loads(json_text(request.getfixturevalue(f"{which}_report")))  # non-finite numbers now "nan"/"inf"
    # the same page, byte for byte: views, plots (their ids too) and the JSON twin alike
    assert render(again, "html") == pages[which]


def test_user_text_is_escaped_in_the_page_its_plots_and_its_json(trace_report):
    report = copy.deepcopy(trace_report)
    evil = "<script>alert(1)</script>"
    report["data"]["headroom"][0]["module"] = evil
    report["findings"][0]["title"] = evil
    report["findings"][0]["evidence"]["inputs"][0]["from"] = evil
    report["data"]["summary"].append([evil, evil])
    text = render(report, "html")
    outline(text)
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)" in text
    assert "\\u003cscript\\u003e" in text  # in the JSON twin


def test_a_view_whose_plot_fails_is_named_and_the_page_still_renders(sentinel_report, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("bad axis")

    monkeypatch.setattr(plots, "timeline", broken)
    text = render(sentinel_report, "html")
    page = outline(text)
    assert "The timeline view could not be drawn: ValueError: bad axis" in text
    assert {"verdict", "first-bad-op", "findings"} <= set(page.ids)


def test_the_profile_reads_the_table_and_skips_what_it_cannot_read(compare_report):
    from_table = copy.deepcopy(compare_report)
    del from_table["data"]["modules"]  # only the rendered table: its dB columns are parsed
    assert "precision-profile" in views(outline(render(from_table, "html")))
    renamed = copy.deepcopy(from_table)
    renamed["data"]["table"]["columns"] = ["module", "prop", "iso", "noise", "ratio", "NaN/Inf"]
    text = render(renamed, "html")
    assert "precision-profile" not in views(outline(text)) and "could not be drawn" not in text
    empty = copy.deepcopy(renamed)
    empty["data"].pop("table")
    assert "results" not in views(outline(render(empty, "html")))


def test_a_finding_repeated_on_every_step_is_listed_once_a_line(sentinel_report):
    report = copy.deepcopy(sentinel_report)
    one = next(f for f in report["findings"] if f["name"] == "nonfinite-loss")
    report["findings"] = [dict(one, where=dict(one["where"], step=s)) for s in range(300)]
    text = render(report, "html")
    page = outline(text)
    assert text.count('<article class="finding') == html_page.FULL_FINDINGS
    assert page.tags["details"] == 1 and f"({300 - html_page.FULL_FINDINGS - html_page.LISTED_FINDINGS} more" in text
    assert "finding-209" in page.ids and "finding-210" not in page.ids


def test_svg_text_is_text_and_names_no_font_file(pages):
    text = pages["trace"]
    svgs = re.findall(r"<svg.*?</svg>", text, flags=re.S)
    assert svgs and all("<text" in s and "font-family" in s and "sans-serif" in s for s in svgs)
    assert all("<image" not in s and "http" not in s.split(">", 1)[1] for s in svgs)  # no raster, no URL


def test_import_and_the_other_renderers_never_load_matplotlib():
    code = (
        "import sys, fpdoctor\n"
        "from fpdoctor.report.render import render\n"
        "from fpdoctor.report.model import Report\n"
        "r = Report(command='env', data={'summary': [('a', 'b')]}).to_dict()\n"
        "for fmt in ('text', 'json', 'markdown', 'html'):\n"
        "    render(r, fmt)\n"
        "print('matplotlib' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr  # a page without plots needs neither


# ---- size on long runs ---------------------------------------------------------------------------------------


def test_a_long_diverged_run_stays_under_2_mb(sentinel_report):
    """2000 timeline points, every step of a 20000-step run non-finite after step 2000, each with its
    two findings: the page stays under 2 MB (lanes are drawn at screen resolution, repeats listed)."""
    report = copy.deepcopy(sentinel_report)
    loss = [1.0 / (1 + 0.01 * s) for s in range(1, 2001)]
    loss[1500:] = [float("nan")] * 500
    report["data"]["timeline"] = {
        "step": list(range(1, 20001, 10)),
        "loss": loss,
        "nonfinite": list(range(2000, 20001)),
        "amp_skipped": list(range(1, 2000, 3)),
        "spikes": [1490, 1495],
    }
    by_name = {f["name"]: f for f in report["findings"]}
    bad = [by_name["nonfinite-loss"], by_name["deterministic-nonfinite"]]
    report["findings"] = [dict(f, where=dict(f["where"], step=s)) for s in range(2000, 20001) for f in bad]
    text = render(report, "html")
    page = outline(text)
    assert "timeline" in views(page) and len(text.encode()) < MB2, len(text.encode())
    assert "AMP skipped (667)" in text and "non-finite (18001)" in text


def test_a_deep_model_with_headroom_stays_under_2_mb():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(100)])  # 301 modules
    with fpdoctor.trace(model, headroom=True) as t:
        model(torch.randn(4, 32)).sum().backward()
    report = t.report.to_dict()
    assert len(report["data"]["headroom"]) > plots.MAX_ROWS
    text = render(report, "html")
    page = outline(text)
    assert "range-heatmap" in views(page) and len(text.encode()) < MB2
    rows = len(report["data"]["headroom"])
    assert f"the {plots.MAX_ROWS} of {rows} modules closest to a limit" in text


# ---- a real browser ------------------------------------------------------------------------------------------


def _chromium() -> str | None:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _browser(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # were the page to ask for anything, it would fail here
        f"--user-data-dir={tmp / 'profile'}",
    ]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("which", ["trace", "sentinel", "compare"])
def test_a_headless_browser_renders_the_page(which, pages, tmp_path):
    page = tmp_path / f"{which}.html"
    page.write_text(pages[which], encoding="utf-8")
    shot = tmp_path / "shot.png"
    done = _browser(f"--screenshot={shot}", "--window-size=1200,2000", page.as_uri(), tmp=tmp_path)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a page was painted, not a blank
    dom = _browser("--dump-dom", page.as_uri(), tmp=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = outline(dom.stdout.split("\n", 1)[1] if dom.stdout.startswith("<!") else dom.stdout)
    assert loaded.tags.get("svg") == Outline(page.read_text()).tags.get("svg")  # every plot is in the DOM
    assert not loaded.resources


def test_the_html_golden_is_checked_in_and_parses():
    golden = ROOT / "tests" / "report" / "golden" / "h20_env.html"
    page = outline(golden.read_text())
    assert {"report", "verdict", "facts", "findings", "json-twin"} <= set(page.ids)


def test_at_a_phone_width_the_page_paints_at_that_width_without_console_messages(pages, tmp_path):
    page = tmp_path / "trace.html"
    page.write_text(pages["trace"], encoding="utf-8")
    # a phone lays the page out at its own width (not 980 px shrunk) only when the page asks it to
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in pages["trace"]
    shot = tmp_path / "phone.png"
    done = _browser(
        "--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=390,844", page.as_uri(), tmp=tmp_path
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    data = shot.read_bytes()
    assert int.from_bytes(data[16:20], "big") == 390 and len(data) > 10_000  # IHDR width: painted at 390 px
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]  # the page's console, one per line
    assert not console, console[:5]
