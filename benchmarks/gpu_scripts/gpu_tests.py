"""pytest for gpu_check.py: which tests need a GPU, and every test's outcome as it happens.

Which tests need a GPU is worked out from the collected tests themselves, not from a list, so a
new GPU test is picked up: the `gpu` marker, a skip or skipif whose reason says the test needs
CUDA, a GPU, NVML or an NVIDIA driver, a `pytest.skip("needs ...")` of that kind in the test's
body, or a parameter that is a CUDA device. Tests that skip *because* a GPU is there ("this
machine has a CUDA device") are not chosen.

Outcomes are appended one JSON line per test phase as each ends, so a run stopped at its time
limit still tells what passed and failed before the stop.

Run: python benchmarks/gpu_scripts/gpu_tests.py [--select FILE] [--results FILE] -- PYTEST_ARGS...
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# "needs a CUDA device", "needs NVML and an NVIDIA GPU", "requires cuBLAS": a need, then the thing
NEEDS = re.compile(
    r"\b(?:needs?|requires?)\b[^.;:]*?\b(?:cuda|gpus?|nvml|nvidia|cublas(?:lt)?|nccl|tensor cores?)\b", re.IGNORECASE
)
_SKIP_CALL = re.compile(r"pytest\.skip\(\s*(?:reason\s*=\s*)?[rRbBuUfF]*(['\"])(.*?)\1", re.DOTALL)


def skip_texts(source: str) -> list[str]:
    """The literal reasons of the `pytest.skip(...)` calls in a test's source."""
    return [match.group(2) for match in _SKIP_CALL.finditer(source)]


def needs_gpu(markers: Iterable[str], reasons: Iterable[str], source: str, devices: Iterable[str]) -> bool:
    """Whether a test is one that skips without a GPU (see the module's docstring)."""
    if "gpu" in markers:
        return True
    if any(NEEDS.search(reason) for reason in reasons):
        return True
    if any(NEEDS.search(text) for text in skip_texts(source)):
        return True
    return any(device.startswith("cuda") for device in devices)


def _item_facts(item: Any) -> tuple[list[str], list[str], str, list[str]]:
    markers = [mark.name for mark in item.iter_markers()]
    reasons = []
    for mark in (*item.iter_markers("skipif"), *item.iter_markers("skip")):
        reasons.append(str(mark.kwargs.get("reason", "")))
        reasons += [arg for arg in mark.args if isinstance(arg, str)]
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):  # not a Python function test, or no source
        source = ""
    params = getattr(getattr(item, "callspec", None), "params", {})
    # a torch.device parameter, without importing torch here: tests that have one imported it
    devices = [str(v) for v in params.values() if type(v).__name__ == "device" and type(v).__module__ == "torch"]
    return markers, reasons, source, devices


class Select:
    """Writes {"total": N, "selected": [node ids]} of the collected tests that need a GPU."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        chosen = [item.nodeid for item in items if needs_gpu(*_item_facts(item))]
        self.path.write_text(json.dumps({"total": len(items), "selected": chosen}))


class Record:
    """Appends {"id", "when", "outcome", "seconds"} per test phase that ran, as it ends."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # a setup or teardown that passed says nothing the call does not
        line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": report.duration}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def tally(lines: Iterable[str]) -> dict[str, Any]:
    """Per test, its worst phase: failed over skipped over passed; counts and the ids of the first two."""
    worst: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for line in lines:
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:  # the last line of a run killed mid-write
            continue
        outcome = entry.get("outcome", "failed")
        if rank.get(outcome, 2) >= rank.get(worst.get(entry["id"], "passed"), 0):
            worst[entry["id"]] = outcome if outcome in rank else "failed"
    counts = {name: sum(1 for o in worst.values() if o == name) for name in rank}
    return {
        **counts,
        "failures": sorted(t for t, o in worst.items() if o == "failed"),
        "skips": sorted(t for t, o in worst.items() if o == "skipped"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", type=Path, help="write the tests that need a GPU here (with --collect-only)")
    parser.add_argument("--results", type=Path, help="append each test phase's outcome here")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    import pytest

    sys.path.insert(0, os.getcwd())  # as `python -m pytest` does: the tests package imports from the root
    plugins: list[object] = []
    if args.select:
        plugins.append(Select(args.select))
    if args.results:
        plugins.append(Record(args.results))
    rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return int(pytest.main(rest, plugins=plugins))


if __name__ == "__main__":
    raise SystemExit(main())
