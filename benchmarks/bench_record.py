"""What a cross-machine compare record costs: time beside a plain `compare`, and its size.

The 12-layer encoder of bench_compare.py (dim 256, 8 x 128 tokens), fp16 against fp32. In one
process, alternating after a warm-up, medians: `compare` alone, `compare(save_reference=...)`
(the candidate's samples kept, weight digests, machine facts, the gzip'd JSON written) and
`compare(against=...)` (B's record built in memory, the judgement, the report). The record is
paid from the whole compare budget (<= 3x two plain forwards, bench_compare.py), so its cost is
printed as a ratio of `compare` alone, and apart: the time of the step after the run
(recording.Link.finish), which a shared machine's load disturbs far less than whole runs.
Size: bytes per module call of the written record, against the 96 KiB of arrays a call holds
at most (SAMPLE float64 + float32 values).

Run: python benchmarks/bench_record.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from fpdoctor.precision.record import recording
from models import batch, small_transformer

FINISH: list[float] = []


def _timed_finish(original):  # type: ignore[no-untyped-def]
    def finish(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        original(self, *args, **kwargs)
        FINISH.append(time.perf_counter() - start)

    return finish


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = small_transformer(layers=12, dim=256).eval()
    tokens, _ = batch(length=128)
    encoder, x = model.encoder, model.embed(tokens).detach()
    recording.Link.finish = _timed_finish(recording.Link.finish)  # type: ignore[method-assign]
    steps: dict[str, list[float]] = {"save_reference": [], "against": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.json.gz"
        variants = {
            "compare": lambda: fpdoctor.compare(encoder, x, candidate="fp16"),
            "save_reference": lambda: fpdoctor.compare(encoder, x, candidate="fp16", save_reference=path),
            "against": lambda: fpdoctor.compare(encoder, x, against=path),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():  # warm-up; `against` needs the record
            run()
        for _ in range(args.rounds):
            for name, run in variants.items():
                FINISH.clear()
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
                if name in steps:
                    steps[name].append(FINISH[0])
        record = fpdoctor.CompareRecord.load(path)
        size = path.stat().st_size
        start = time.perf_counter()
        fpdoctor.CompareRecord.load(path)
        load = time.perf_counter() - start
    base = statistics.median(times["compare"])
    print(f"12-layer encoder, dim 256, 8 x 128 tokens, fp16 against fp32, {args.rounds} rounds (medians)")
    for name, values in times.items():
        t = statistics.median(values)
        own = (
            f"   of which the record's own step {statistics.median(steps[name]) * 1e3:.0f} ms" if name in steps else ""
        )
        print(f"  {name:15s} {t * 1e3:7.1f} ms   {t / base:.2f}x compare{own}")
    per_call = size / record.calls
    print(f"  record: {record.calls} module calls, {size / 2**20:.2f} MiB, {per_call / 2**10:.1f} KiB per call")
    print(f"  loading it (every field checked): {load * 1e3:.0f} ms")
    ok = per_call <= 100 * 2**10
    print(f"size {'PASS' if ok else 'FAIL'} (<= 100 KiB per module call)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
