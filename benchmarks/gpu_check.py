"""Every GPU path of fpdoctor in one command, within a wall-time budget, on a machine with an NVIDIA GPU.

Parts, each a subprocess with its own time limit (a part that hangs is killed with its whole
process group and marked failed; the rest still run): the tests that skip without a GPU (worked
out from the collected suite by gpu_scripts/gpu_tests.py), the GPU rows of the budget benchmarks,
the commands end to end on the GPU (env, env --probe, health, health under torchrun, trace of an
fp16 GradScaler and a bf16 training script, watch where it exists, run --breadcrumbs on a script
killed by SIGFPE), then the whole suite until the budget is spent. Writes summary.json,
summary.md, parts.log and the crash report to $OUT/gpu-check, else ./out/gpu-check, with what the
machine showed (env facts, health's NVML facts, `nvidia-smi -q`, the kernel log's NVIDIA lines) in
its fixtures/ folder, ready to commit as tests/fixtures/device/NAME/; prints a table. Without a
CUDA GPU it says so in one line and exits 0.

Run: python benchmarks/gpu_check.py [--budget SECONDS] [--out DIR] [--only PART ...] [--list]
(from the repository root; PYTHONPATH=src where fpdoctor is not installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = HERE / "gpu_scripts"
sys.path.insert(0, str(SCRIPTS))
from gpu_tests import tally  # noqa: E402
from kernel_log import NOT_READ as KERNEL_LOG_NOT_READ  # noqa: E402

BUDGET_S = 460.0  # the whole run, under the 8 minutes a lent GPU machine's check may take
RESERVE_S = 10.0  # kept back for the summary
MIN_PART_S = 5.0  # a part left less than this (or than its own cap) is skipped, not started to be killed
KEEP = 200_000  # characters of each part's output kept in parts.log
SIGFPE_STATUS = -signal.SIGFPE  # `fpdoctor run` dies of the signal its command died of


@dataclass
class Outcome:
    """What a part's process did: its exit status (None if killed at its limit), time, output."""

    rc: int | None
    seconds: float
    output: str
    timed_out: bool = False


def run_command(argv: list[str], limit_s: float, env: dict[str, str] | None = None) -> Outcome:
    """Run argv in its own process group; at limit_s, SIGTERM the group, then SIGKILL it 5 s later."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        try:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        except OSError as exc:
            return Outcome(None, time.monotonic() - start, f"could not start {argv[0]}: {exc}")
        timed_out = False
        try:
            proc.wait(timeout=max(limit_s, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        seconds = time.monotonic() - start
        log.seek(0)
        output = log.read()
    if len(output) > KEEP:
        output = f"[... {len(output) - KEEP} characters cut ...]\n" + output[-KEEP:]
    return Outcome(None if timed_out else proc.returncode, seconds, output, timed_out)


@dataclass
class Context:
    """What parts share: where they write, the child environment, the deadline, facts found on the way."""

    work: Path
    env: dict[str, str]
    deadline: float
    python: str = sys.executable
    facts: dict[str, Any] = field(default_factory=dict)

    def fpdoctor(self, *args: str) -> list[str]:
        return [self.python, "-m", "fpdoctor", *args]


@dataclass
class Part:
    """A step of the check: the command (or a reason to skip it) and how its outcome is judged."""

    name: str
    kind: str  # tests, bench, e2e, suite
    limit_s: float
    command: Callable[[Context], list[str] | str]
    judge: Callable[[Context, Outcome], tuple[str, str]] | None = None  # None: a benchmark's own verdict


@dataclass
class Result:
    name: str
    kind: str
    status: str  # pass, fail, skip
    detail: str
    seconds: float = 0.0
    limit_s: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    command: list[str] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""


def part_limit(cap_s: float, deadline: float, now: float) -> float:
    """A part's time limit: its own cap, cut to what is left of the budget before the reserve."""
    return min(cap_s, deadline - RESERVE_S - now)


def run_part(part: Part, ctx: Context) -> Result:
    limit = part_limit(part.limit_s, ctx.deadline, time.monotonic())
    if limit < min(part.limit_s, MIN_PART_S):
        return Result(part.name, part.kind, "skip", "no time left in the budget")
    try:
        command = part.command(ctx)
    except Exception as exc:  # a part that cannot even be set up fails alone
        return Result(part.name, part.kind, "fail", f"could not set up: {type(exc).__name__}: {exc}")
    if isinstance(command, str):
        return Result(part.name, part.kind, "skip", command)
    outcome = run_command(command, limit, ctx.env)
    if outcome.timed_out and part.kind != "suite":
        status, detail = "fail", f"stopped at its time limit ({limit:.0f} s)"
    else:
        try:
            status, detail = (part.judge or _judge_bench)(ctx, outcome)
        except Exception as exc:
            status, detail = "fail", f"could not judge: {type(exc).__name__}: {exc}"
    return Result(
        part.name,
        part.kind,
        status,
        detail,
        seconds=outcome.seconds,
        limit_s=limit,
        rc=outcome.rc,
        timed_out=outcome.timed_out,
        command=command,
        ratios=budget_rows(outcome.output) if part.kind == "bench" else [],
        output=outcome.output,
    )


# --- what a benchmark printed against its budget ---------------------------------------------

_BUDGET = re.compile(r"\(budget\b[^)]*\)")
_NUMBER = re.compile(r"(?<![\w./])[-+]?\d+(?:\.\d+)?(?:%|\s*(?:x|ms|s|MiB|GiB)\b)?")


def budget_rows(output: str) -> list[dict[str, Any]]:
    """Each measured value printed next to "(budget ...)", with the budget, PASS/FAIL and the
    heading it sits under (the last line that starts in the first column)."""
    rows = []
    context = ""
    for line in output.splitlines():
        if line[:1].strip() and "(budget" not in line:
            context = line.strip().rstrip(":")
        for segment in line.split(";"):
            budget = _BUDGET.search(segment)
            if budget is None:
                continue
            before = segment[: budget.start()]
            numbers = list(_NUMBER.finditer(before))
            label = before[: numbers[-1].start()] if numbers else before
            verdict = re.search(r"\b(PASS|FAIL)\b", segment[budget.end() :])
            rows.append(
                {
                    "context": context,
                    "row": re.sub(r"^->\s*|[\s:=]+$", "", " ".join(label.split())),
                    "value": numbers[-1].group().replace(" ", "") if numbers else None,
                    "budget": budget.group()[len("(budget") : -1].strip(" :"),
                    "verdict": verdict.group(1) if verdict else None,
                }
            )
    return rows


# --- the parts -------------------------------------------------------------------------------


def _timeout_args() -> list[str]:
    # a hung test ends at its own limit, not the part's, so the part's other tests still run
    return ["--timeout=120"] if importlib.util.find_spec("pytest_timeout") else []


def _select(ctx: Context) -> list[str]:
    return [
        ctx.python,
        str(SCRIPTS / "gpu_tests.py"),
        "--select",
        str(ctx.work / "selected.json"),
        "--",
        "tests",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
    ]


def _judge_select(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    path = ctx.work / "selected.json"
    if not path.exists():
        return "fail", f"collection failed (exit {outcome.rc})"
    chosen = json.loads(path.read_text())
    ctx.facts["gpu_tests"], ctx.facts["suite_size"] = chosen["selected"], chosen["total"]
    if outcome.rc != 0 or not chosen["selected"]:
        return "fail", f"exit {outcome.rc}, {len(chosen['selected'])} GPU test(s) of {chosen['total']} collected"
    return "pass", f"{len(chosen['selected'])} of {chosen['total']} collected tests need a GPU"


def _gpu_tests(ctx: Context) -> list[str] | str:
    ids = ctx.facts.get("gpu_tests")
    if not ids:
        return "no GPU tests were selected"
    return [
        ctx.python,
        str(SCRIPTS / "gpu_tests.py"),
        "--results",
        str(ctx.work / "gpu-tests.jsonl"),
        "--",
        *ids,
        "-q",
        "-p",
        "no:cacheprovider",
        *_timeout_args(),
    ]


def tests_verdict(counts: dict[str, Any], finished: bool, of: int | None = None) -> tuple[str, str]:
    """pass when nothing failed; the detail counts, names the first failures and GPU-time skips."""
    ran = counts["passed"] + counts["failed"] + counts["skipped"]
    detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if not finished:
        detail += f"; stopped at the budget after {ran}" + (f" of {of}" if of else "") + " tests"
    if counts["failures"]:
        detail += "; failed: " + ", ".join(counts["failures"][:3]) + (" ..." if len(counts["failures"]) > 3 else "")
    if counts["skips"] and finished and of is None:  # a GPU test that skips on a GPU is worth a look
        detail += "; skipped: " + ", ".join(counts["skips"][:3])
    return ("fail" if counts["failed"] or (finished and ran == 0) else "pass"), detail


def _judge_tests(name: str, of_key: str | None) -> Callable[[Context, Outcome], tuple[str, str]]:
    def judge(ctx: Context, outcome: Outcome) -> tuple[str, str]:
        path = ctx.work / name
        counts = tally(path.read_text().splitlines() if path.exists() else [])
        status, detail = tests_verdict(counts, not outcome.timed_out, ctx.facts.get(of_key) if of_key else None)
        if not outcome.timed_out and outcome.rc not in (0, 5) and not counts["failed"]:
            return "fail", f"pytest exit {outcome.rc}; {detail}"  # an error outside any test (collection, plugin)
        return status, detail

    return judge


def _suite(ctx: Context) -> list[str] | str:
    return [
        ctx.python,
        str(SCRIPTS / "gpu_tests.py"),
        "--results",
        str(ctx.work / "suite.jsonl"),
        "--",
        "tests",
        "-q",
        "-p",
        "no:cacheprovider",
        *_timeout_args(),
    ]


def _bench(script: str, *args: str) -> Callable[[Context], list[str]]:
    return _cmd("PYTHON", str(HERE / script), *args)


def _judge_bench(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    rows = budget_rows(outcome.output)
    failed = [r for r in rows if r["verdict"] == "FAIL"]
    judged = [r for r in rows if r["verdict"]]
    detail = f"{len(judged) - len(failed)} of {len(judged)} budget rows pass"
    if failed:
        detail += "; over: " + ", ".join(f"{r['row'] or r['context']} {r['value']} ({r['budget']})" for r in failed)
    if outcome.rc != 0 and not failed:
        detail = f"exit {outcome.rc}; " + detail
    return ("pass" if outcome.rc == 0 else "fail"), detail


def _report(ctx: Context, name: str) -> dict[str, Any]:
    return dict(json.loads((ctx.work / name).read_text()))


def _codes(report: dict[str, Any]) -> str:
    codes = sorted({f"{f['code']} {f['name']}" for f in report.get("findings", [])})
    return f"verdict {report.get('verdict')}" + (f"; findings: {', '.join(codes)}" if codes else "")


def _judge_env(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    report = _report(ctx, "env.json")
    gpus = [g.get("name") for g in report["data"]["facts"].get("gpus") or []]
    ok = outcome.rc in (0, 1) and bool(gpus)  # exit 1: an error-level finding about this machine, a result
    return ("pass" if ok else "fail"), f"exit {outcome.rc}, GPUs {gpus}; {_codes(report)}"


def _judge_probe(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    report = _report(ctx, "env-probe.json")
    probes = report["data"]["facts"].get("probes") or []
    states = {p.get("name"): p.get("status") for p in probes}
    ok = outcome.rc in (0, 1) and bool(probes) and all(s == "ok" for s in states.values())
    return ("pass" if ok else "fail"), f"exit {outcome.rc}, probes {states}; {_codes(report)}"


def _judge_clean(report_name: str) -> Callable[[Context, Outcome], tuple[str, str]]:
    """A command on a healthy GPU and a clean script: exit 0 and no error-level finding."""

    def judge(ctx: Context, outcome: Outcome) -> tuple[str, str]:
        report = _report(ctx, report_name)
        ok = outcome.rc == 0 and report.get("verdict") != "error"
        return ("pass" if ok else "fail"), f"exit {outcome.rc}; {_codes(report)}"

    return judge


def _judge_sigfpe(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    report = _report(ctx, "run-sigfpe.json")
    signals = [f for f in report.get("findings", []) if (f.get("evidence") or {}).get("signal") == "SIGFPE"]
    last_op = str((signals[0].get("evidence") or {}).get("last_op")) if signals else None
    ok = outcome.rc == SIGFPE_STATUS and bool(signals) and "cuda" in str(last_op)
    detail = f"exit {outcome.rc} (expected {SIGFPE_STATUS}); last op recorded: {last_op}; {_codes(report)}"
    return ("pass" if ok else "fail"), detail


def _watch(dtype: str) -> Callable[[Context], list[str] | str]:
    def command(ctx: Context) -> list[str] | str:
        if "watch" not in ctx.facts:
            ctx.facts["watch"] = run_command(ctx.fpdoctor("watch", "--help"), 30, ctx.env).rc == 0
        if not ctx.facts["watch"]:
            return "`fpdoctor watch` is not built here (`watch --help` fails)"
        return ctx.fpdoctor(
            "watch",
            "--report",
            str(ctx.work / f"watch-{dtype}.json"),
            "--",
            ctx.python,
            str(SCRIPTS / "train_amp.py"),
            "--dtype",
            dtype,
        )

    return command


def _nvidia_smi(ctx: Context) -> list[str] | str:
    smi = shutil.which("nvidia-smi")
    return [smi, "-q"] if smi else "no nvidia-smi on PATH"


def _judge_smi(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    if outcome.rc == 0:  # a failed nvidia-smi's message is no `nvidia-smi -q` to keep as a fixture
        (ctx.work / "nvidia-smi-q.txt").write_text(outcome.output)
    return ("pass" if outcome.rc == 0 else "fail"), f"exit {outcome.rc}, {len(outcome.output.splitlines())} lines"


def _judge_kernel_log(ctx: Context, outcome: Outcome) -> tuple[str, str]:
    said = outcome.output.strip().splitlines()[-1:] or [""]
    if outcome.rc == KERNEL_LOG_NOT_READ:  # a container without the kernel log: health says so too
        return "skip", said[0]
    return ("pass" if outcome.rc == 0 else "fail"), f"exit {outcome.rc}; {said[0]}"


def _cmd(*args: str) -> Callable[[Context], list[str]]:
    """A command line; "@NAME" is the file NAME in the run's work folder, "PYTHON" this interpreter."""

    def command(ctx: Context) -> list[str]:
        return [ctx.python if a == "PYTHON" else str(ctx.work / a[1:]) if a.startswith("@") else a for a in args]

    return command


def parts() -> list[Part]:
    fpdoctor = ("PYTHON", "-m", "fpdoctor")
    train = str(SCRIPTS / "train_amp.py")
    torchrun = ("PYTHON", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "fpdoctor")
    return [
        Part("nvidia-smi -q", "e2e", 30, _nvidia_smi, _judge_smi),
        Part("kernel log", "e2e", 60, _cmd("PYTHON", str(SCRIPTS / "kernel_log.py"), "@kernel.log"), _judge_kernel_log),
        Part("select GPU tests", "tests", 90, _select, _judge_select),
        Part("GPU tests", "tests", 180, _gpu_tests, _judge_tests("gpu-tests.jsonl", None)),
        Part("fpdoctor env", "e2e", 90, _cmd(*fpdoctor, "env", "-o", "@env.json", "--save-facts", "@env-facts.json"),
             _judge_env),
        Part("fpdoctor env --probe", "e2e", 90, _cmd(*fpdoctor, "env", "--probe", "-o", "@env-probe.json"),
             _judge_probe),
        Part("fpdoctor health", "e2e", 60, _cmd(*fpdoctor, "health", "-q", "-o", "@health.json"),
             _judge_clean("health.json")),
        Part("health --duration 5 (torchrun)", "e2e", 90,
             _cmd(*torchrun, "health", "--duration", "5", "-q", "-o", "@health-torchrun.json"),
             _judge_clean("health-torchrun.json")),
        Part("trace fp16 GradScaler", "e2e", 90,
             _cmd(*fpdoctor, "trace", "-q", "-o", "@trace-fp16.json", train, "--dtype", "fp16"),
             _judge_clean("trace-fp16.json")),
        Part("trace bf16", "e2e", 90,
             _cmd(*fpdoctor, "trace", "-q", "-o", "@trace-bf16.json", train, "--dtype", "bf16"),
             _judge_clean("trace-bf16.json")),
        Part("watch fp16 GradScaler", "e2e", 90, _watch("fp16"), _judge_clean("watch-fp16.json")),
        Part("watch bf16", "e2e", 90, _watch("bf16"), _judge_clean("watch-bf16.json")),
        Part("run --breadcrumbs SIGFPE", "e2e", 90,
             _cmd(*fpdoctor, "run", "--breadcrumbs", "-o", "@run-sigfpe.json", "PYTHON", str(SCRIPTS / "sigfpe.py")),
             _judge_sigfpe),
        Part("bench_sentinel (CUDA)", "bench", 120, _bench("bench_sentinel.py", "--device", "cuda", "--rounds", "5")),
        Part("bench_watch (CUDA)", "bench", 120, _bench("bench_watch.py", "--device", "cuda", "--blocks", "5")),
        Part("bench_numerics (CUDA)", "bench", 150,
             _bench("bench_numerics.py", "--only", "cuda", "--rounds", "3", "--steps", "4")),
        Part("bench_fingerprint (CUDA)", "bench", 90,
             _bench("bench_fingerprint.py", "--device", "cuda", "--durations", "0", "3", "--rounds", "3")),
        Part("bench_compare (CUDA)", "bench", 150, _bench("bench_compare.py", "--device", "cuda", "--rounds", "3")),
        Part("bench_health", "bench", 60, _bench("bench_health.py", "--rounds", "3")),
        Part("bench_env", "bench", 90, _bench("bench_env.py", "--rounds", "3")),
        Part("whole suite", "suite", 3600, _suite, _judge_tests("suite.jsonl", "suite_size")),
    ]  # fmt: skip


# --- the machine, the summary ----------------------------------------------------------------

MACHINE = r"""
import json, platform, sys
from importlib import metadata
out = {"python": platform.python_version()}
try:
    import torch
except Exception as exc:
    out["error"] = f"torch does not import: {type(exc).__name__}: {exc}"
else:
    out.update(torch=torch.__version__, cuda_runtime=torch.version.cuda, cuda=torch.cuda.is_available())
    if out["cuda"]:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["cudnn"] = torch.backends.cudnn.version()
        out["arch_list"] = torch.cuda.get_arch_list()
try:
    import pynvml
    pynvml.nvmlInit()
    out["driver"] = pynvml.nvmlSystemGetDriverVersion()
except Exception:
    pass
for name in ("fpdoctor", "lightning", "transformers", "pytest", "nvidia-ml-py"):
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
try:
    import fpdoctor
    out["fpdoctor"] = fpdoctor.__version__
except Exception:
    pass
print(json.dumps(out))
"""


def machine_facts(env: dict[str, str]) -> dict[str, Any]:
    outcome = run_command([sys.executable, "-c", MACHINE], 120, env)
    lines = outcome.output.strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        return {"error": f"the machine probe failed (exit {outcome.rc}): {outcome.output.strip()[-300:]}"}


def no_gpu_line(machine: dict[str, Any]) -> str | None:
    """The one line for a machine the check cannot use, or None when it has a CUDA GPU."""
    if machine.get("cuda"):
        return None
    if "error" in machine:
        return f"gpu-check: {machine['error']}; nothing to check"
    return f"gpu-check: no CUDA GPU here (torch {machine.get('torch')}, CUDA available: no); nothing to check"


def build_summary(machine: dict[str, Any], results: list[Result], wall_s: float, budget_s: float) -> dict[str, Any]:
    counts = {status: sum(1 for r in results if r.status == status) for status in ("pass", "fail", "skip")}
    return {
        "schema": "fpdoctor-gpu-check/1",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine,
        "wall_s": round(wall_s, 1),
        "budget_s": budget_s,
        "counts": counts,
        "parts": [
            {
                "name": r.name,
                "kind": r.kind,
                "status": r.status,
                "detail": r.detail,
                "seconds": round(r.seconds, 1),
                "limit_s": round(r.limit_s, 1),
                "rc": r.rc,
                "timed_out": r.timed_out,
                "command": r.command,
                "ratios": r.ratios,
            }
            for r in results
        ],
    }


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(summary: dict[str, Any], results: list[Result]) -> str:
    m = summary["machine"]
    c = summary["counts"]
    lines = [
        f"# fpdoctor gpu-check, {summary['date']}",
        "",
        f"{', '.join(m.get('gpus') or ['no GPU'])} (sm {m.get('capability')}), driver {m.get('driver')}, "
        f"torch {m.get('torch')} (CUDA {m.get('cuda_runtime')}, cuDNN {m.get('cudnn')}), Python {m.get('python')}, "
        f"fpdoctor {m.get('fpdoctor')}.",
        "",
        f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped in {summary['wall_s']} s "
        f"(budget {summary['budget_s']:.0f} s).",
        "",
        "| part | status | seconds | detail |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {_cell(p['name'])} | {p['status']} | {p['seconds']} | {_cell(p['detail'])} |" for p in summary["parts"]
    ]
    rows = [(p["name"], r) for p in summary["parts"] for r in p["ratios"]]
    if rows:
        lines += [
            "",
            "## Budgets",
            "",
            "| benchmark | row | measured | budget | verdict |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, r in rows:
            row = f"{r['context']}: {r['row']}" if r["row"] else r["context"]
            lines.append(
                f"| {_cell(name)} | {_cell(row)} | {r['value']} | {_cell(r['budget'])} | {r['verdict'] or '-'} |"
            )
    failed = [r for r in results if r.status == "fail"]
    if failed:
        lines += ["", "## Output of the failed parts (last 40 lines; parts.log has all)"]
        for r in failed:
            tail = "\n".join(r.output.rstrip().splitlines()[-40:])
            lines += ["", f"### {r.name}", "", "```", tail, "```"]
    return "\n".join(lines) + "\n"


def table(summary: dict[str, Any]) -> str:
    out = [f"{'part':<32} {'status':<6} {'seconds':>7}  detail"]
    for p in summary["parts"]:
        detail = p["detail"] if len(p["detail"]) <= 90 else p["detail"][:87] + "..."
        out.append(f"{p['name']:<32} {p['status']:<6} {p['seconds']:>7.1f}  {detail}")
    c = summary["counts"]
    out.append(f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped in {summary['wall_s']} s")
    return "\n".join(out)


# What comes back besides summary.json, summary.md and parts.log; the device tool returns at most
# 8 files, at most 2 folders below $OUT. FIXTURES go to fixtures/, in the formats `fpdoctor env
# --from` and `fpdoctor health --from` read: tests/fixtures/device/NAME/ holds such a folder and
# tests/test_device_fixtures.py runs the collectors' parsers on each one committed there.
ARTIFACTS = ("run-sigfpe.json",)
FIXTURES = ("env-facts.json", "health.json", "nvidia-smi-q.txt", "kernel.log")


def write_outputs(out: Path, work: Path, summary: dict[str, Any], results: list[Result]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary, results))
    with (out / "parts.log").open("w", encoding="utf-8") as log:
        for r in results:
            log.write(f"===== {r.name}: {r.status} ({r.seconds:.1f} s) $ {' '.join(r.command)}\n{r.output}\n")
    for name in ARTIFACTS:
        if (work / name).exists():
            shutil.copyfile(work / name, out / name)
    recorded = [name for name in FIXTURES if (work / name).exists()]
    if recorded:
        (out / "fixtures").mkdir(exist_ok=True)
    for name in recorded:
        shutil.copyfile(work / name, out / "fixtures" / name)


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu-check" if os.environ.get("OUT") else ROOT / "out" / "gpu-check"


def child_env() -> dict[str, str]:
    """Children find this checkout's fpdoctor (an absolute path: they may change directory)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help="seconds for the whole run (default %(default)s)"
    )
    parser.add_argument("--out", type=Path, help="where the summary goes (default $OUT/gpu-check, else out/gpu-check)")
    parser.add_argument("--only", nargs="+", metavar="PART", help="run only the parts whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the parts and their time limits, run nothing")
    args = parser.parse_args(argv)
    chosen = [p for p in parts() if not args.only or any(o.lower() in p.name.lower() for o in args.only)]
    if args.list:
        for p in chosen:
            print(f"{p.name:<32} {p.kind:<6} limit {p.limit_s:.0f} s")
        return 0
    start = time.monotonic()
    env = child_env()
    machine = machine_facts(env)
    line = no_gpu_line(machine)
    if line is not None:
        print(line)
        return 0 if "error" not in machine else 1
    os.chdir(ROOT)  # the parts name paths from the repository root (tests/, benchmarks/)
    ctx = Context(work=Path(tempfile.mkdtemp(prefix="gpu-check-")), env=env, deadline=start + args.budget)
    print(f"gpu-check on {', '.join(machine['gpus'])}, torch {machine['torch']}, budget {args.budget:.0f} s")
    results = []
    for part in chosen:
        result = run_part(part, ctx)
        results.append(result)
        print(f"  {result.status:<4} {part.name:<32} {result.seconds:6.1f} s  {result.detail[:120]}", flush=True)
    summary = build_summary(machine, results, time.monotonic() - start, args.budget)
    out = args.out or default_out()
    write_outputs(out, ctx.work, summary, results)
    shutil.rmtree(ctx.work, ignore_errors=True)
    print(table(summary))
    print(f"summary: {out / 'summary.md'}")
    return 1 if summary["counts"]["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
