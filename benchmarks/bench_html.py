"""The HTML report: page size (budget < 2 MB) and render time, per kind of page.

Reports come from the real capabilities on small CPU models: an env report (no plots), a trace
with headroom of the casebook's fp16 attention block (first bad op and range heatmap), a trace
with headroom of a 100-block MLP (the heatmap capped at its 60 rows closest to a limit), a
sentinel run of 2000 steps (a 2000-point timeline) and the same run's report grown to a diverged
20000-step run with two findings per bad step, and a compare. Each page is rendered `--rounds`
times in one process; the median is printed with the size. The first render of a process also
pays matplotlib's import, measured apart in a fresh interpreter.

Run: python benchmarks/bench_html.py [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fpdoctor
from fpdoctor.casebook import attention
from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.parse import parse_text
from fpdoctor.report.render import render

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 2 * 1024 * 1024


def env_report() -> dict[str, Any]:
    text = (ROOT / "tests/fixtures/env/collect_env/h20_cu121_pytorch133548.txt").read_text()
    return diagnose_env(facts=parse_text(text)).to_dict()


def attention_trace() -> dict[str, Any]:
    block, frames = attention.build()
    with fpdoctor.trace(block, headroom=True) as t:
        block(frames)
    return t.report.to_dict()


def deep_trace() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(100)])
    with fpdoctor.trace(model, headroom=True) as t:
        model(torch.randn(4, 32)).sum().backward()
    return t.report.to_dict()


def sentinel_run(steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = fpdoctor.Sentinel(model, opt)
    g = torch.Generator().manual_seed(1)
    for i in range(1, steps + 1):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)

        def step(x: torch.Tensor = x, y: torch.Tensor = y, i: int = i) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = nn.functional.mse_loss(out, y) * (300.0 if i == steps // 2 else 1.0)
            if i == steps - 10:
                loss = loss + (out / (out - out)).mean()  # 0/0: reproduces on replay
            loss.backward()
            return loss

        guard.step(step)
    return guard.report.to_dict()


def diverged(report: dict[str, Any]) -> dict[str, Any]:
    """The run grown to 20000 steps, non-finite from step 2000 on, two findings per bad step."""
    grown = copy.deepcopy(report)
    timeline = grown["data"]["timeline"]
    timeline["step"] = [s * 10 for s in timeline["step"]]
    timeline["nonfinite"] = list(range(2000, 20001))
    bad = [f for f in grown["findings"] if f["name"] in ("nonfinite-loss", "deterministic-nonfinite")][:2]
    grown["findings"] = [dict(f, where=dict(f["where"], step=s)) for s in range(2000, 20001) for f in bad]
    return grown


def compare_report() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return fpdoctor.compare(model, torch.randn(32, 16), candidate="bf16").report.to_dict()


def cold_import() -> float:
    """Seconds from a fresh interpreter's first plot render, minus the same without plots."""
    code = (
        "import time, fpdoctor.report.plots as p\n"
        "t = time.perf_counter(); p.timeline({'step': [1, 2], 'loss': [1.0, 0.5]})\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="sentinel steps (2000: a 2000-point timeline)")
    args = parser.parse_args()
    sentinel = sentinel_run(args.steps)
    reports = {
        "env (no plots)": env_report(),
        "trace, fp16 attention, headroom": attention_trace(),
        "trace, 100-block MLP, headroom": deep_trace(),
        f"sentinel, {args.steps} steps": sentinel,
        "sentinel, diverged 20000-step run": diverged(sentinel),
        "compare, bf16 MLP": compare_report(),
    }
    render(reports["trace, fp16 attention, headroom"], "html")  # matplotlib's import, paid once
    print(f"{'page':<36} {'size':>10} {'render (median)':>16}")
    for name, report in reports.items():
        times, size = [], 0
        for _ in range(args.rounds):
            start = time.perf_counter()
            page = render(report, "html")
            times.append(time.perf_counter() - start)
            size = len(page.encode())
        flag = "" if size < BUDGET else "  OVER BUDGET"
        print(f"{name:<36} {size / 1024:>8.0f} kB {statistics.median(times):>14.2f} s{flag}")
    print(f"first plot in a fresh process (matplotlib's import included): {cold_import():.2f} s")


if __name__ == "__main__":
    main()
